"""The quorum as the jitted step sees it: a small pytree of arrays.

Membership enters the step only through these arrays, never as static
arguments or Python constants, so a membership change never recompiles the
step (invariant 4 in the README: no recompilation).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

# Status codes of a cross-replica all-reduce (FTAR's status output).
STATUS_OK = 0
STATUS_RECOVERABLE = 1
# Only on the GPU, where the handler has returned before the ring runs: a fatal
# error found later (bad quorum inputs, unknown communicator, protocol
# violation) is written to the device as 2 (the step does not commit) and the
# next all-reduce call raises it as an ffi::Error (JaxRuntimeError).
STATUS_FATAL = 2

# The step carries a quorum id as an int32 scalar, so only its low 31 bits: enough to tell the
# communicator's quorum from a stale one (two quorums 2**31 decisions apart are never both live),
# and a lighthouse's ids past 2**31 - 1 (a long job, or a restarted lighthouse following a high
# reported id) cannot overflow the array. ffi/control_thread.cc compares the same bits.
STEP_QUORUM_ID_MASK = 0x7FFFFFFF


class QuorumInputs(NamedTuple):
    """Per-step quorum arrays (all int32 scalars).

    contribute:        1 if this replica trains on its batch, 0 if it is behind
                       (sends a zero gradient and consumes no batch).
    num_contributing:  replicas that contribute gradients (healthy) this step.
    num_members:       replicas in the all-reduce ring (healthy + behind).
    num_configured:    replicas the job is configured with (total).
    lr_mode:           fthsdp.step.intervention.Intervention value (none/linear/sqrt).
    rank:              this replica's position in the ring, 0..num_members-1.
    quorum_id:         the lighthouse's quorum id, its low 31 bits (STEP_QUORUM_ID_MASK: an int32
                       holds no more, and ids run to 2**53); FTAR refuses a stale one.
    comm:              communicator handle: a small integer id into the native
                       registry of FTAR communicators (never a pointer).

    On a GPU these arrays live on the device. FTAR's CUDA handler never reads
    them on a host thread: the stream itself copies them into host-pinned
    memory ahead of the gradient, where the control plane picks them up, so
    the quorum stays a runtime value there too (no recompilation, no sync).
    """

    contribute: jax.Array
    num_contributing: jax.Array
    num_members: jax.Array
    num_configured: jax.Array
    lr_mode: jax.Array
    rank: jax.Array
    quorum_id: jax.Array
    comm: jax.Array


def make_quorum_inputs(
    *,
    contribute: bool = True,
    num_contributing: int = 1,
    num_members: int | None = None,
    num_configured: int = 1,
    lr_mode: int = 0,
    rank: int = 0,
    quorum_id: int = 0,
    comm: int = -1,
) -> QuorumInputs:
    """Host-side constructor (numpy int32 scalars: cheap to pass every step)."""
    if num_members is None:
        num_members = num_contributing
    if not 0 <= num_contributing <= num_members or num_configured < 1:
        raise ValueError(
            f"inconsistent quorum: {num_contributing} contributing, {num_members} members, "
            f"{num_configured} configured"
        )
    # This replica's own part must agree with the count: one contributing while counted out never
    # commits (its sum has no divisor), one counted in while sending zeros scales every replica's
    # mean by (n-1)/n without a word.
    if contribute and num_contributing == 0:
        raise ValueError("inconsistent quorum: this replica contributes but 0 replicas are counted contributing")
    if not contribute and num_contributing == num_members:
        raise ValueError(f"inconsistent quorum: this replica contributes nothing but all {num_members} members "
                         "are counted contributing")
    if not 0 <= rank < max(num_members, 1):
        raise ValueError(f"rank {rank} outside ring of {num_members} members")
    i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
    return QuorumInputs(
        contribute=i32(1 if contribute else 0),
        num_contributing=i32(num_contributing),
        num_members=i32(num_members),
        num_configured=i32(num_configured),
        lr_mode=i32(lr_mode),
        rank=i32(rank),
        quorum_id=i32(quorum_id & STEP_QUORUM_ID_MASK),
        comm=i32(comm),
    )


class AllReduceFn(Protocol):
    """Cross-replica all-reduce with FTAR's signature.

    Called inside the jitted step with the (possibly FSDP-sharded) gradient
    pytree. Returns the element-wise SUM over the ring members and a status
    array of shape (num_local_devices,), int32, one entry per local shard
    (STATUS_OK, STATUS_RECOVERABLE; STATUS_FATAL on GPU), sharded over the replica's mesh so that
    the commit vote `all(status == OK)` is a collective inside the step.
    Fatal errors raise (ffi::Error -> JaxRuntimeError).
    """

    def __call__(self, grads, quorum: QuorumInputs, mesh: jax.sharding.Mesh): ...


def local_allreduce(grads, quorum: QuorumInputs, mesh: jax.sharding.Mesh):
    """The all-reduce of a job with a single replica: the identity, always OK."""
    del quorum
    status = jnp.zeros((mesh.devices.size,), jnp.int32)
    status = jax.lax.with_sharding_constraint(
        status, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))
    )
    return grads, status
