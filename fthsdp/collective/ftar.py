"""FTAR's Python face: the communicator and the jittable all-reduce.

A `Communicator` owns one native ring endpoint per local shard (the C++
control thread drives them all). `allreduce` implements the AllReduceFn
contract of `fthsdp.step.quorum_inputs`: inside the jitted step it buckets the
gradient pytree into one flat buffer per dtype for every local shard, calls
the `fthsdp_ftar` custom call once per shard under `shard_map` (shard i of
this replica forms a ring with shard i of every other replica), and
unbuckets. Membership and the communicator handle enter as int32 arrays, so
reconfiguring never recompiles (invariant 4 in the README: no recompilation).

Outcomes: status 0 (OK) or 1 (RECOVERABLE: a peer died, a timeout, a stale
quorum, an abort, a neighbour broke the protocol) per local shard; fatal
errors (bad arguments) raise JaxRuntimeError.

Authentication: a communicator given the job's FTAR key (`FtarOptions.key`,
derived from the job secret) only accepts ring neighbours that prove they hold
it (a mutual HMAC-SHA256 challenge-response over the job, quorum id, rank,
stream and both sides' nonces, ffi/transport/wire.h), and tags every chunk
header with a MAC under a per-connection key. Chunk *payloads* are not
MACed (that would cost far more than the 2% bandwidth budget): a member of the
job holding the key can still send wrong numbers, and an on-path attacker
able to rewrite TCP segments could alter payload bytes, but nobody without
the key can take a ring slot or inject a chunk header. A malformed or
unauthenticated chunk makes the all-reduce return RECOVERABLE naming the
neighbour (its rank and address); `Communicator.take_violations` hands the
violations to the Manager, which reports the offender to the lighthouse.
Without a key (an explicitly insecure job) the ring behaves as before and a
warning is logged.

The same custom call runs on CPU and GPU devices (fthsdp.collective.native registers
both). On a GPU the handler only enqueues work on XLA's stream: the stream
stages the gradient through host-pinned memory block by block, the C++
control thread runs the ring over it (the same ring and schedule as on CPU),
a reduce worker kernel on the GPU sums each received chunk (one addition per
element in the CPU's order, so results are bitwise identical to the CPU
FTAR) and the control thread releases the stream block by block; a fatal error found after the handler returned is written as
status 2 (STATUS_FATAL) and raised by the next call (ffi/staging_abi.h).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from fthsdp.collective import native
from fthsdp.addresses import LOOPBACK, advertised, check_host, is_wildcard
from fthsdp.step.quorum_inputs import STATUS_FATAL, STATUS_OK, STATUS_RECOVERABLE, QuorumInputs
from fthsdp.timeouts import Timeouts

__all__ = ["FtarOptions", "ConfigureResult", "PeerViolation", "key_from_secret", "Communicator", "allreduce", "STATUS_OK",
           "STATUS_RECOVERABLE", "STATUS_FATAL", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
TARGET = "fthsdp_ftar"
KEY_MIN_BYTES = 16
log = logging.getLogger("fthsdp.collective.ftar")
_warned_insecure = False


# Test hooks (off unless set): the native library corrupts the N-th chunk header this process
# sends when CORRUPT_CHUNK_ENV=N; CORRUPT_REPLICA_ENV=R keeps that for replica R's processes only
# (a launcher hands every replica the same environment).
CORRUPT_CHUNK_ENV = "FTHSDP_FTAR_TEST_CORRUPT_CHUNK"
CORRUPT_REPLICA_ENV = "FTHSDP_FTAR_TEST_CORRUPT_REPLICA"


def scope_test_hooks(replica_id: str, environ=None) -> bool:
    """Before this process's first communicator: drop the chunk-corruption test hook unless it
    targets ``replica_id``. Returns whether the hook stays armed (it is off by default)."""
    import os

    env = os.environ if environ is None else environ
    target = env.get(CORRUPT_REPLICA_ENV)
    if target is not None and target != str(replica_id):
        env.pop(CORRUPT_CHUNK_ENV, None)
    armed = bool(env.get(CORRUPT_CHUNK_ENV))
    if armed:
        log.warning("test hook %s=%s is set: this process corrupts one chunk header it sends",
                    CORRUPT_CHUNK_ENV, env[CORRUPT_CHUNK_ENV])
    return armed


def key_from_secret(secret: bytes | str) -> bytes:
    """The FTAR key of a job's secret: ``fthsdp.control.auth.derive(secret, "ftar")``, so the key
    FTAR holds and proves on the wire is not the secret itself and is useless to the job's other
    planes (a leaked FTAR key does not sign lighthouse calls or fetch state)."""
    from fthsdp.control import auth

    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < KEY_MIN_BYTES:
        raise ValueError(f"a job secret of {len(raw)} bytes is too short for FTAR's key (at least "
                         f"{KEY_MIN_BYTES}); pass key=b'' only for an explicitly insecure ring")
    return auth.derive(raw, "ftar")


@dataclasses.dataclass(frozen=True)
class FtarOptions:
    """Transport knobs of one communicator (fixed for its lifetime).

    streams: TCP connections per ring neighbour; chunks are striped over them.
    chunk_bytes / chunks: chunk size S and chunks in flight C of the pipeline;
        S*C bytes of receive staging are allocated (and touched) up front.
    timeout_s: deadline of one all-reduce call; past it the call returns
        RECOVERABLE instead of hanging (invariant 3 in the README: no hang).
    listen_host: the interface the ring endpoints bind (an IPv4 or IPv6
        literal or a name; 0.0.0.0 / :: = every interface).
    advertise_host: the host peers connect to, published in `addresses`
        (empty: the bound host; required when binding every interface).
    key: the job's FTAR key (>= 16 bytes, from the job secret; never printed);
        empty: an explicitly insecure ring (no handshake proof, no chunk tags).
    """

    streams: int = 2
    chunk_bytes: int = 1 << 20
    chunks: int = 4
    timeout_s: float = 60.0
    listen_host: str = LOOPBACK
    socket_buffer_bytes: int = 0
    advertise_host: str = ""
    key: bytes = dataclasses.field(default=b"", repr=False)

    def __post_init__(self):
        if not isinstance(self.key, (bytes, bytearray)):
            raise TypeError(f"key must be bytes (the job's FTAR key), got {type(self.key).__name__}")
        if self.key and len(self.key) < KEY_MIN_BYTES:
            raise ValueError(f"key must have at least {KEY_MIN_BYTES} bytes (derive it from the job secret with "
                             f"key_from_secret), got {len(self.key)}")
        if not 1 <= self.streams <= 64:
            raise ValueError(f"streams must be in [1, 64], got {self.streams}")
        if not 1 <= self.chunks <= 256:
            raise ValueError(f"chunks must be in [1, 256], got {self.chunks}")
        if not 64 <= self.chunk_bytes <= 1 << 30:
            raise ValueError(f"chunk_bytes must be in [64, 2**30], got {self.chunk_bytes}")
        if not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= Timeouts.MAX_S):
            raise ValueError(f"timeout_s must be a finite number of seconds in (0, a week], got {self.timeout_s}")
        check_host(self.listen_host)
        if self.advertise_host:
            check_host(self.advertise_host)
        elif is_wildcard(self.listen_host):
            raise ValueError(f"listen_host {self.listen_host!r} binds every interface: set advertise_host to "
                             "the address peers reach this host on")


@dataclasses.dataclass(frozen=True)
class PeerViolation:
    """A ring neighbour broke the protocol (a malformed or unauthenticated chunk).

    rank is the offender's rank in quorum `quorum_id` (the Manager maps it to
    a replica id); address its ring address; reason the full message."""

    shard: int
    quorum_id: int
    rank: int
    address: str
    reason: str


@dataclasses.dataclass(frozen=True)
class ConfigureResult:
    """Whether the ring of a configure() is connected; `reason` says why not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class Communicator:
    """A handle on the native FTAR communicator of this replica (one ring per local shard).

    Pass `handle` into the step as `QuorumInputs.comm`; publish `addresses`
    (one host:port per local shard) to the other replicas; call `configure`
    with every quorum change and `abort` when a peer is declared dead.
    """

    def __init__(self, num_shards: int = 1, options: FtarOptions | None = None, **kwargs: Any):
        if options is None:
            options = FtarOptions(**kwargs)
        elif kwargs:
            raise TypeError("pass either options= or keyword options, not both")
        self.options = options
        self.num_shards = int(num_shards)
        self._mod = native.module()
        if not options.key:
            global _warned_insecure
            if not _warned_insecure:
                _warned_insecure = True
                log.warning("FTAR runs without a job secret: ring handshakes and chunk headers are not "
                            "authenticated, anyone who can reach the ring ports can join or feed the "
                            "all-reduce (give the job a secret to close this)")
        self.handle: int = self._mod.ftar_create(
            self.num_shards, options.listen_host, options.streams, options.chunk_bytes,
            options.chunks, float(options.timeout_s), options.socket_buffer_bytes, bytes(options.key))

    @property
    def authenticated(self) -> bool:
        """Whether this ring requires neighbours to prove the job's key."""
        return bool(self.options.key)

    @property
    def addresses(self) -> list[str]:
        """This replica's advertised address per local shard (what peers connect to)."""
        return [advertised(a, self.options.advertise_host) for a in self._mod.ftar_addresses(self.handle)]

    @property
    def address(self) -> str:
        """All shard addresses joined by ',' (a member's entry in `configure`)."""
        return ",".join(self.addresses)

    def configure(self, job_id: str, quorum_id: int, rank: int,
                  members: Sequence[str | Sequence[str]], timeout_s: float = 30.0,
                  wait: bool = True, op_timeout_s: float = 0.0) -> ConfigureResult:
        """Tear down the old ring and connect this quorum's neighbours.

        members: every member's addresses in ring order (a list of per-shard
        addresses, or one ','-joined string). With wait=True, blocks until the
        ring is connected or `timeout_s` passed; a failure is not raised: the
        next all-reduce reports RECOVERABLE with the same reason. op_timeout_s:
        each all-reduce's deadline in this ring (0: the options' timeout_s).
        """
        joined = [m if isinstance(m, str) else ",".join(m) for m in members]
        self._mod.ftar_configure(self.handle, str(job_id), int(quorum_id), int(rank), joined,
                                 float(timeout_s), float(op_timeout_s))
        if not wait:
            return ConfigureResult(True, "connecting")
        ok, reason = self._mod.ftar_wait_configured(self.handle, min(float(timeout_s) + 1.0, Timeouts.MAX_S))
        return ConfigureResult(bool(ok), reason)

    def set_op_timeout(self, seconds: float) -> None:
        """The deadline of this ring's all-reduces from now on (0: the options' timeout_s), for a
        quorum that keeps its ring (same id) but not its deadline: its behind member caught up."""
        self._mod.ftar_set_op_timeout(self.handle, float(seconds))

    def wait_configured(self, timeout_s: float) -> ConfigureResult:
        ok, reason = self._mod.ftar_wait_configured(self.handle, float(timeout_s))
        return ConfigureResult(bool(ok), reason)

    def abort(self, reason: str = "aborted") -> None:
        """In-flight all-reduces return RECOVERABLE promptly; reconfigure to go on."""
        self._mod.ftar_abort(self.handle, reason)

    def stats(self) -> list[dict]:
        """Per-shard counters: state, ops, bytes, refused handshakes, violations, last error."""
        return list(self._mod.ftar_stats(self.handle))

    def progress(self) -> list[dict]:
        """Per local shard: where its ring is in the current all-reduce (ring step, chunks
        still queued to send, seconds since data last came from the left neighbour, bytes
        and busy seconds per stream). Lock-free in C++: safe to call while the ring is stuck."""
        return list(self._mod.ftar_progress(self.handle))

    def take_violations(self) -> list[PeerViolation]:
        """Protocol violations by ring neighbours since the last call (each op that
        returned RECOVERABLE for one left one here)."""
        return [PeerViolation(**d) for d in self._mod.ftar_take_violations(self.handle)]

    def allreduce_host(self, array: np.ndarray, *, quorum_id: int, rank: int, n: int,
                       shard: int = 0) -> tuple[int, str]:
        """In-place sum of a host array over the ring, outside XLA (tests, benchmarks)."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or not array.flags.writeable:
            raise ValueError("allreduce_host sums in place: give a writeable, C-contiguous numpy array "
                             "(np.ascontiguousarray(x) and copy the result back; a view such as x[:, ::2] or "
                             "x.T would be summed as a copy and the array left unchanged)")
        return self._mod.ftar_allreduce_host(self.handle, shard, quorum_id, rank, n, array)

    def close(self) -> None:
        if self.handle is not None:
            self._mod.ftar_destroy(self.handle)
            self.handle = None

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shard_index(mesh: Mesh) -> jax.Array:
    """Linear index of this device in the mesh (the same on every replica)."""
    idx = jnp.int32(0)
    for name in mesh.axis_names:
        idx = idx * mesh.shape[name] + jax.lax.axis_index(name).astype(jnp.int32)
    return idx


def _ftar_call(comm, shard, quorum_id, rank, n, buckets):
    outs = [jax.ShapeDtypeStruct((1,), jnp.int32)] + [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buckets]
    call = jax.ffi.ffi_call(TARGET, outs, has_side_effect=True,
                            input_output_aliases={5 + i: 1 + i for i in range(len(buckets))})
    res = call(comm, shard, quorum_id, rank, n, *buckets)
    return res[0], list(res[1:])


def _default_specs(leaves, mesh: Mesh):
    from fthsdp.step.sharding import fsdp_spec

    return [fsdp_spec(tuple(x.shape), mesh.devices.size) if len(mesh.axis_names) == 1 else P()
            for x in leaves]


def allreduce(grads, quorum: QuorumInputs, mesh: Mesh, specs=None):
    """Sum `grads` over the ring members (AllReduceFn). Returns (sums, status[num_local_devices]).

    specs: PartitionSpec per leaf (a pytree like `grads`) describing how the
    gradients are sharded over `mesh`; default: fthsdp.step.sharding's FSDP layout
    on a 1-D mesh, replicated on other meshes (pass specs there, or XLA
    gathers the gradients first). Each local shard is all-reduced in its own
    ring (shard i with shard i of every replica), so the local device
    programs never wait on each other, whatever order XLA runs them in.
    """
    native.ensure_registered()
    leaves, treedef = jax.tree.flatten(grads)
    for x in leaves:
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"ftar.allreduce: gradient of dtype {x.dtype} (shape {x.shape}); "
                            "supported: float32, bfloat16, float16")
    spec_leaves = _default_specs(leaves, mesh) if specs is None else treedef.flatten_up_to(specs)
    axes = tuple(mesh.axis_names)
    status_spec = P(axes if len(axes) > 1 else axes[0])
    q = [jnp.asarray(v, jnp.int32).reshape(()) for v in
         (quorum.comm, quorum.quorum_id, quorum.rank, quorum.num_members)]

    def body(comm, quorum_id, rank, n, *local):
        order: list[jnp.dtype] = []
        for x in local:
            if jnp.dtype(x.dtype) not in order:
                order.append(jnp.dtype(x.dtype))
        buckets = [jnp.concatenate([x.reshape(-1) for x in local if jnp.dtype(x.dtype) == dt])
                   for dt in order]
        # This process's endpoint of the shard: a replica of P processes lays its mesh out
        # process-major (fthsdp.step.sharding.replica_mesh), so global shard g is local
        # endpoint g mod (shards per process); with one process, g itself.
        shard = (_shard_index(mesh) % (mesh.devices.size // jax.process_count())).reshape(())
        status, sums = _ftar_call(comm, shard, quorum_id, rank, n, buckets)
        out, offsets = [], {dt: 0 for dt in order}
        for x in local:
            dt = jnp.dtype(x.dtype)
            flat = sums[order.index(dt)]
            out.append(jax.lax.dynamic_slice_in_dim(flat, offsets[dt], x.size).reshape(x.shape)
                       if x.size else jnp.zeros(x.shape, x.dtype))
            offsets[dt] += x.size
        return (status, *out)

    if not leaves:
        status = jnp.zeros((mesh.devices.size,), jnp.int32)
        return grads, status
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), P(), *spec_leaves),
                           out_specs=(status_spec, *spec_leaves), check_vma=False)
    status, *summed = mapped(*q, *leaves)
    return jax.tree.unflatten(treedef, summed), status
