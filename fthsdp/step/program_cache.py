"""Compiled step programs kept on disk for the processes JAX's own cache leaves out.

JAX's persistent compilation cache is written by process 0 of a multi-process
runtime only ("Not writing persistent cache entry since process_id != 0"), and
on the CPU its key holds a topology fingerprint that differs from process to
process. So a follower process of a multi-process replica never finds an
entry: it compiles every program at every start (2-3.5 s each for the small
test model on a 2-core host, 6.5 s for ``apply_grads`` while the leader
compiled beside it), and its leader waits in the first collective meanwhile.
Every restart of such a replica paid that before its first commit.

:class:`PersistentJit` wraps a ``jax.jit`` function. On process 0, in a
one-process runtime, on a non-CPU backend, or with no compilation cache
configured, it *is* that function (each call goes straight to it). Otherwise,
on the first call with a given signature (the arguments' tree, shapes,
dtypes and shardings) it lowers the call, and looks the program up under
:func:`program_key`: a hash of the lowered program's text, this process's
index and count, the devices the program runs on, the XLA flags and the
versions. A hit is loaded with ``jax.experimental.serialize_executable``; a
miss is compiled and stored. (A 1-replica x 2-process job of the tiny test
model: the follower's warm-up took 13.8 s with nothing stored, 1.9 s after.) Later calls with that
signature call the compiled program directly: the program checks its
arguments itself before it runs, so a call costs what calling a compiled
program costs, and one that the program refuses (another tree, shape, dtype
or sharding) is dispatched again. As with any compiled program, arguments that
differ from the first call's only in a weak type reuse its program.

GPUs are left to JAX: on GPU its key drops the device assignment so that it
is the same on every process (its source says so), which would let followers
read what process 0 wrote. That is not checked here; this cache stays off
there.

Entries are files ``<cache dir>/fthsdp-process-programs/<function>-<key>``
(``<cache dir>`` is JAX's, ``jax_compilation_cache_dir``): a magic line,
the payload's SHA-256, then the payload. One that fails its check (a torn or
edited file) is removed and the program compiled again, with a warning; a
store that fails (a full disk) costs only the next start's compile. Like
JAX's own cache, an entry is a serialized executable that loading runs:
the cache folder must be writable by this user only. Nothing evicts
entries (JAX's cache keeps everything by default too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pathlib
import re
from typing import Any, Callable

import jax
import numpy as np

from fthsdp.atomic_file import write_atomic

log = logging.getLogger(__name__)

__all__ = ["PersistentJit", "persistent_jit", "counts_of", "program_key", "pack_entry", "unpack_entry",
           "ProgramCounts", "SUBDIR", "MAGIC"]

SUBDIR = "fthsdp-process-programs"
MAGIC = b"fthsdp-program-v1\n"


def pack_entry(payload: bytes) -> bytes:
    """An entry file's bytes: the magic line, the payload's SHA-256, the payload."""
    return MAGIC + hashlib.sha256(payload).digest() + payload


def unpack_entry(raw: bytes) -> bytes:
    """The payload of an entry file; ``ValueError`` saying what is wrong when it is not one."""
    if not raw.startswith(MAGIC):
        raise ValueError("not a program entry of this version (its first line is not "
                         f"{MAGIC.strip().decode()!r})")
    digest, payload = raw[len(MAGIC):len(MAGIC) + 32], raw[len(MAGIC) + 32:]
    if len(digest) < 32 or hashlib.sha256(payload).digest() != digest:
        raise ValueError("its SHA-256 does not match its contents (a torn write or an edited file)")
    return payload


def program_key(program_text: str, *, process_index: int, process_count: int, device_ids: tuple,
                xla_flags: str, versions: tuple) -> str:
    """The file name of one process's compiled program: everything the executable depends on
    that the lowered text does not say (which process, which devices, flags, versions)."""
    h = hashlib.sha256()
    for part in (program_text, f"process {process_index}/{process_count}", repr(device_ids), xla_flags,
                 repr(versions)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclasses.dataclass
class ProgramCounts:
    """What a wrapper did with its programs: loaded from disk, or compiled (and stored)."""

    loaded: int = 0
    compiled: int = 0

    def __add__(self, other: "ProgramCounts") -> "ProgramCounts":
        return ProgramCounts(self.loaded + other.loaded, self.compiled + other.compiled)


def _program_devices(args: tuple, lowered: Any) -> list:
    """The devices a lowered call runs on, in the order its program numbers them: the mesh of a
    named sharding among its arguments' and results' (all of a program's shardings share one
    device set), else their one device, else the default device, as ``jax.jit`` picks."""
    shardings = [x.sharding for x in jax.tree.leaves(args) if isinstance(x, jax.Array)]
    shardings += [o.sharding for o in jax.tree.leaves(lowered.out_info) if getattr(o, "sharding", None) is not None]
    best: list = []
    for s in shardings:
        mesh = getattr(s, "mesh", None)
        devices = list(mesh.devices.flat) if mesh is not None and hasattr(mesh, "devices") else \
            sorted(s.device_set, key=lambda d: d.id)
        if len(devices) > len(best):
            best = devices
    return best or [jax.devices()[0]]


def _signature(args: tuple) -> tuple:
    """What selects a program: the arguments' tree, and each leaf's abstract value (shape, dtype,
    weak type) and sharding."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((x.aval, x.sharding) if isinstance(x, jax.Array) else
                       (type(x), np.shape(x), np.result_type(x)) for x in leaves)


def _process_cache_dir() -> pathlib.Path | None:
    """Where this process keeps its programs, or None when JAX's own cache serves it."""
    if jax.process_count() == 1 or jax.process_index() == 0 or jax.default_backend() != "cpu":
        return None
    base = jax.config.jax_compilation_cache_dir
    return pathlib.Path(base) / SUBDIR if base else None


def _compile(lowered: Any) -> tuple[Any, bool]:
    """``lowered.compile()``, and whether JAX's persistent cache served it. A program loaded from
    there must not be serialized again: on the CPU the copy loses its kernels (its first call
    fails with "Function ... not found"). A follower never gets one (its key is its own and
    only process 0 writes), but a cache forced on with ``cache_dir`` beside JAX's can."""
    hits: list[str] = []

    def listener(event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_listener(listener)
    try:
        compiled = lowered.compile()
    finally:
        jax.monitoring.unregister_event_listener(listener)
    return compiled, bool(hits)


def _versions() -> tuple:
    import jaxlib

    return (jax.__version__, getattr(jaxlib, "__version__", "?"), jax.devices()[0].client.platform_version)


class PersistentJit:
    """A ``jax.jit`` function whose programs outlive the process where JAX's cache does not
    keep them (module docstring). Attributes other than the call (``lower``, ``trace``...)
    are the jitted function's."""

    def __init__(self, jitted: Callable, name: str, cache_dir: str | os.PathLike | None = None):
        """``cache_dir``: keep the programs there in any process (default: decided at the first
        call, when the distributed runtime has started)."""
        self._jit = jitted
        self.name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        self.counts = ProgramCounts()
        # False: not decided yet; None: JAX's cache serves this process; a path: this cache does
        self._dir: pathlib.Path | None | bool = pathlib.Path(cache_dir) if cache_dir is not None else False
        self._programs: dict[tuple, Callable] = {}
        self._last: tuple[tuple, Callable] | None = None  # the signature called last, and its program

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._jit, attr)

    def _cache_size(self) -> int:
        """Programs compiled or loaded: the jitted function's count where JAX's cache serves."""
        return self._jit._cache_size() if not self._dir else len(self._programs)

    def __call__(self, *args):
        if self._dir is False:
            self._dir = _process_cache_dir()
        if not self._dir:
            return self._jit(*args)
        if self._last is not None:
            # The common case costs nothing here: the compiled program checks its arguments'
            # tree, shapes, dtypes and shardings itself, before it runs, and says which differ.
            sig, program = self._last
            try:
                return program(*args)
            except (TypeError, ValueError):
                if _signature(args) == sig:
                    raise  # not another signature: the call's own error
        sig = _signature(args)
        program = self._programs.get(sig)
        if program is None:
            program = self._programs[sig] = self._load_or_compile(args)
        self._last = (sig, program)
        return program(*args)

    def _load_or_compile(self, args: tuple) -> Callable:
        from jax.experimental import serialize_executable as se

        lowered = self._jit.lower(*args)
        devices = _program_devices(args, lowered)
        key = program_key(lowered.as_text(), process_index=jax.process_index(),
                          process_count=jax.process_count(), device_ids=tuple(int(d.id) for d in devices),
                          xla_flags=os.environ.get("XLA_FLAGS", ""), versions=_versions())
        path = self._dir / f"{self.name}-{key[:48]}"
        if path.exists():
            try:
                payload = unpack_entry(path.read_bytes())
                program = se.deserialize_and_load(payload, lowered.in_tree, lowered.out_tree,
                                                   execution_devices=devices)
                self.counts.loaded += 1
                return program
            except Exception as e:  # noqa: BLE001 - any failure to load means: compile it again
                log.warning("program cache: %s is unusable (%s: %s); removing it and compiling %s again",
                            path, type(e).__name__, e, self.name)
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        compiled, from_jax_cache = _compile(lowered)
        self.counts.compiled += 1
        if from_jax_cache:  # (only where this cache is forced on beside JAX's: see _compile)
            log.info("program cache: %s came from JAX's cache and is not stored again", self.name)
            return compiled
        try:
            payload, _, _ = se.serialize(compiled)
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(path, pack_entry(payload))
        except (ValueError, NotImplementedError) as e:  # a program JAX cannot serialize stays in memory
            log.info("program cache: %s is not stored (%s)", self.name, e)
        except OSError as e:
            log.warning("program cache: could not store %s in %s (%s); the next start compiles it again",
                        self.name, path.parent, e)
        return compiled


def persistent_jit(fn: Callable, name: str | None = None, cache_dir: str | os.PathLike | None = None,
                   **jit_kwargs) -> PersistentJit:
    """``jax.jit(fn, **jit_kwargs)``, with its programs kept on disk where JAX's cache does not."""
    return PersistentJit(jax.jit(fn, **jit_kwargs), name or getattr(fn, "__name__", "program"), cache_dir)


def counts_of(*fns: Any) -> ProgramCounts:
    """The summed counts of the :class:`PersistentJit` among ``fns`` (others count nothing)."""
    total = ProgramCounts()
    for f in fns:
        if isinstance(f, PersistentJit):
            total = total + f.counts
    return total
