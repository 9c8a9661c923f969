"""Lazy host snapshots of a replica's committed state (DataStates-LLM style).

After a commit, the state's arrays are immutable until the next update
replaces them (JAX never writes into an array in place unless its buffer is
donated). So the copy to host memory can run while the next step's forward
and backward run: `begin(step, state)` starts every device->host transfer and
returns; a background thread lands the bytes in one coalesced, pre-faulted
host buffer and checksums each piece once, as it lands. `wait()` blocks only
if that copy is still pending.

Two buffers (slots) are reused across steps: the latest snapshot is never the
one being overwritten, the previous one stays servable until its slot is
reused, and a slot with a peer still reading from it (a lease) is not reused
until that read ends. `begin` runs on the training thread, which must never
wait for a peer: when the slot to reuse is still leased, that step's snapshot
is skipped (logged once per run of skips) and the previous one stays served; a
fetch of the newer step is told it is stale and asks another peer or again.
The leased slot takes no new lease from then on, so it is free as soon as the
pieces in flight are sent (ft.peer_send_s bounds each).

A snapshot is the replica's state at a step *as of its latest `begin`*: a
later `begin` of step s (the state was replaced at the same step number by a
lineage fence, a fetch or a resume, or rewound to an earlier step) makes every
snapshot of step s or later unservable at once, before the new copy lands, so
no new lease ever reads bytes the replica no longer holds.

Layout: every leaf of the state (in `jax.tree_util` order) is stored whole, in
C order, at a 64-byte aligned offset; each leaf is cut into pieces of at most
`piece_bytes` (piece k of a leaf covers bytes [k*P, min((k+1)*P, nbytes)) of
that leaf). FSDP-sharded arrays are assembled from their addressable shards,
so a replica's snapshot is its whole state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import mmap
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

log = logging.getLogger("fthsdp.checkpoint.snapshot")

FORMAT = "fthsdp.snapshot"
FORMAT_VERSION = 1
CHECKSUM_ALGO = "crc32"
LEAF_ALIGN = 64
DEFAULT_PIECE_BYTES = 8 << 20


class SnapshotError(RuntimeError):
    """A snapshot could not be taken, or a manifest is not one we can read."""


class StaleStepError(LookupError):
    """The requested step is not the snapshot being served."""

    def __init__(self, requested: int, served: int | None):
        self.requested = requested
        self.served = served
        what = ("no snapshot yet (none taken, or the last one was superseded by a new snapshot of its step, "
                "not landed yet)" if served is None else f"step {served} is served")
        super().__init__(f"step {requested} is not available: {what}")


def checksum(data) -> int:
    """The piece checksum (zlib CRC-32; releases the GIL on large buffers)."""
    return zlib.crc32(data) & 0xFFFFFFFF


@dataclass(frozen=True)
class LeafSpec:
    path: str  # jax.tree_util.keystr of the leaf's key path
    shape: tuple[int, ...]
    dtype: str
    offset: int  # into the coalesced buffer
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """What a snapshot holds and where: enough to fetch and verify it."""

    step: int
    leaves: tuple[LeafSpec, ...]
    piece_bytes: int
    checksums: tuple[tuple[int, ...], ...]  # per leaf, per piece
    total_bytes: int
    format: str = FORMAT
    version: int = FORMAT_VERSION
    checksum_algo: str = CHECKSUM_ALGO

    def num_pieces(self, leaf: int) -> int:
        return num_pieces(self.leaves[leaf].nbytes, self.piece_bytes)

    def piece_range(self, leaf: int, piece: int) -> tuple[int, int]:
        """Byte range [start, end) of a piece, relative to its leaf."""
        n = self.leaves[leaf].nbytes
        start = piece * self.piece_bytes
        if not 0 <= piece < self.num_pieces(leaf):
            raise IndexError(f"leaf {leaf} has {self.num_pieces(leaf)} pieces, asked for piece {piece}")
        return start, min(start + self.piece_bytes, n)

    def pieces(self) -> Iterator[tuple[int, int]]:
        """Every (leaf, piece), in layout order."""
        for i in range(len(self.leaves)):
            for k in range(self.num_pieces(i)):
                yield i, k

    def same_layout(self, other: "Manifest") -> bool:
        return (self.leaves, self.piece_bytes, self.total_bytes) == (other.leaves, other.piece_bytes, other.total_bytes)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        return json.dumps(d, separators=(",", ":"))

    @staticmethod
    def from_json(text: str | bytes) -> "Manifest":
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: a body nested too deep
            raise SnapshotError(f"snapshot manifest is not valid JSON ({e}); is the peer an fthsdp peer "
                                "server?") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise SnapshotError(f"not a snapshot manifest: format is {got!r}, expected {FORMAT!r}")
        if d.get("version") != FORMAT_VERSION:
            raise SnapshotError(
                f"snapshot manifest version {d.get('version')!r} is not supported (this build reads version "
                f"{FORMAT_VERSION}); run the same fthsdp version on every replica"
            )
        if d.get("checksum_algo") != CHECKSUM_ALGO:
            raise SnapshotError(f"unsupported checksum {d.get('checksum_algo')!r}, expected {CHECKSUM_ALGO!r}")
        try:
            leaves = tuple(
                LeafSpec(str(x["path"]), tuple(int(s) for s in x["shape"]), str(x["dtype"]), int(x["offset"]),
                         int(x["nbytes"]))
                for x in d["leaves"]
            )
            m = Manifest(
                step=int(d["step"]),
                leaves=leaves,
                piece_bytes=int(d["piece_bytes"]),
                checksums=tuple(tuple(int(c) for c in cs) for cs in d["checksums"]),
                total_bytes=int(d["total_bytes"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: a number like 1e400
            raise SnapshotError(f"snapshot manifest is malformed: {type(e).__name__}: {e}") from None
        m.validate()
        return m

    def validate(self) -> None:
        """A manifest that describes a buffer it could have come from: each leaf's bytes are its
        shape times its dtype's size, the leaves lie in order without overlapping (a piece written
        over bytes already verified would install what was not), inside a buffer no larger than
        their aligned sum. A peer that lies about any of it is refused before anything is allocated."""
        if self.piece_bytes <= 0:
            raise SnapshotError(f"manifest piece_bytes must be > 0, got {self.piece_bytes}")
        if len(self.checksums) != len(self.leaves):
            raise SnapshotError(f"manifest has {len(self.leaves)} leaves but {len(self.checksums)} checksum lists")
        end = 0
        for i, (leaf, cs) in enumerate(zip(self.leaves, self.checksums)):
            try:
                dtype = _np_dtype(leaf.dtype)
                if dtype.hasobject:  # Python objects are not bytes to fetch
                    raise TypeError(leaf.dtype)
                itemsize = dtype.itemsize
            except (TypeError, ValueError, AttributeError):
                raise SnapshotError(f"manifest leaf {i} ({leaf.path[:200]}) has dtype {leaf.dtype[:64]!r}, which "
                                    "is not a numpy array type of plain bytes") from None
            if any(d < 0 for d in leaf.shape) or leaf.nbytes != math.prod(leaf.shape) * itemsize:
                raise SnapshotError(f"manifest leaf {i} ({leaf.path[:200]}) says {leaf.nbytes} bytes for shape "
                                    f"{leaf.shape} of {leaf.dtype}: the peer's manifest is inconsistent")
            if leaf.offset < end or leaf.offset + leaf.nbytes > self.total_bytes:
                raise SnapshotError(f"manifest leaf {i} ({leaf.path[:200]}) at bytes [{leaf.offset}, "
                                    f"{leaf.offset + leaf.nbytes}) overlaps the leaf before it or lies outside the "
                                    f"{self.total_bytes}-byte buffer")
            end = leaf.offset + leaf.nbytes
            if len(cs) != self.num_pieces(i):
                raise SnapshotError(f"manifest leaf {i} ({leaf.path[:200]}) has {len(cs)} checksums for "
                                    f"{self.num_pieces(i)} pieces")
        if self.total_bytes != end:
            raise SnapshotError(f"manifest says a {self.total_bytes}-byte buffer for leaves that end at byte {end}")


def num_pieces(nbytes: int, piece_bytes: int) -> int:
    return max(1, -(-nbytes // piece_bytes))  # an empty leaf still has one (empty) piece


def _np_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16, float8_*: registered by jax's dependency

        return np.dtype(getattr(ml_dtypes, name))


def flatten(tree) -> tuple[list[str], list[Any], Any]:
    """(paths, leaves, treedef) in jax.tree_util order."""
    import jax

    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in with_path]
    return paths, [x for _, x in with_path], treedef


def plan_layout(paths: Sequence[str], leaves: Sequence[Any]) -> tuple[tuple[LeafSpec, ...], int]:
    """Offsets of every leaf in the coalesced buffer."""
    specs = []
    offset = 0
    for path, x in zip(paths, leaves):
        shape = tuple(int(s) for s in np.shape(x))
        dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        offset = -(-offset // LEAF_ALIGN) * LEAF_ALIGN
        specs.append(LeafSpec(path, shape, dtype.name, offset, nbytes))
        offset += nbytes
    return tuple(specs), offset


class HostBuffer:
    """A page-aligned host buffer whose pages are faulted in up front.

    First-touch page faults run at ~1 GB/s against ~25 GB/s for warm memory,
    so the buffer is populated when it is made (MAP_POPULATE, else a fill),
    never during a copy."""

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        size = max(self.nbytes, 1)
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
        populate = getattr(mmap, "MAP_POPULATE", 0)
        self._mmap = mmap.mmap(-1, size, flags=flags | populate)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8, count=size)[: self.nbytes]
        if not populate:
            self.array.fill(0)
        elif hasattr(self._mmap, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self._mmap.madvise(mmap.MADV_HUGEPAGE)

    def leaf_view(self, spec: LeafSpec) -> np.ndarray:
        flat = self.array[spec.offset : spec.offset + spec.nbytes]
        return flat.view(_np_dtype(spec.dtype)).reshape(spec.shape)


@dataclass
class Snapshot:
    """A complete snapshot: its manifest and the host bytes it describes."""

    manifest: Manifest
    buffer: HostBuffer

    @property
    def step(self) -> int:
        return self.manifest.step

    def piece(self, leaf: int, piece: int) -> memoryview:
        start, end = self.manifest.piece_range(leaf, piece)
        off = self.manifest.leaves[leaf].offset
        return memoryview(self.buffer.array[off + start : off + end])

    def leaf(self, i: int) -> np.ndarray:
        return self.buffer.leaf_view(self.manifest.leaves[i])

    def verify(self) -> None:
        """Recomputes every checksum (for tests and paranoia)."""
        for i, k in self.manifest.pieces():
            if checksum(self.piece(i, k)) != self.manifest.checksums[i][k]:
                raise SnapshotError(f"snapshot step {self.step}: leaf {self.manifest.leaves[i].path} piece {k} changed")


def _leaf_copies(x) -> list[tuple[Any, Any]]:
    """(index into the global array, source) for every shard we must copy."""
    shards = getattr(x, "addressable_shards", None)
    if shards is None:
        return [((), x)]
    if not x.is_fully_addressable:
        raise SnapshotError(
            f"array of shape {x.shape} is not fully addressable by this process; a snapshot holds a replica's whole "
            "state, so each replica must live in one process (its mesh over local devices)"
        )
    return [(s.index, s.data) for s in shards if s.replica_id == 0]


def _on_cpu(x) -> bool:
    """CPU arrays already live in host memory: there is no transfer to start."""
    try:
        return all(d.platform == "cpu" for d in x.sharding.device_set)
    except AttributeError:
        return True


class _Slot:
    def __init__(self):
        self.buffer: HostBuffer | None = None
        self.layout: tuple[LeafSpec, ...] | None = None
        self.leases = 0
        self.snap: Snapshot | None = None  # the complete snapshot this slot holds, None while (re)written


class Snapshotter:
    """Double-buffered lazy snapshots of one replica's committed state.

    Typical use by the Manager: after committing step s, `begin(s, state)`;
    run step s+1's forward and backward; call `wait()` before anything that
    could invalidate the arrays (donation), else simply before the next
    `begin`. Peers read the latest complete snapshot through `lease(step)`.
    To replace the snapshot of a step already taken (the state was replaced
    at that step number), call `begin(step, new_state)` again.
    """

    def __init__(self, piece_bytes: int = DEFAULT_PIECE_BYTES, slots: int = 2, lease_timeout_s: float = 60.0,
                 nice: int = 10):
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be > 0, got {piece_bytes}")
        if slots < 2:
            raise ValueError(f"slots must be >= 2 (one served while the next is copied), got {slots}")
        self.piece_bytes = int(piece_bytes)
        self.lease_timeout_s = lease_timeout_s
        self._slots = [_Slot() for _ in range(slots)]
        self._cond = threading.Condition()
        self._served: tuple[_Slot, Snapshot] | None = None
        self._pending: Future | None = None
        self.nice = nice
        self.worker_tid: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fthsdp-snapshot",
                                        initializer=self._lower_priority)
        self.last_copy_s = 0.0  # background time of the last copy (copy + checksums)
        self._layout_key = None
        self._layout: tuple[tuple[LeafSpec, ...], int] = ((), 0)
        # One begin at a time: two racing begins could claim the same free slot, and the copy
        # submitted last (whichever step it was) overwrote the other under its readers. Each begin
        # waits for the copy before it under this lock, so copies land in begin order.
        self._begin_lock = threading.Lock()
        self.skipped = 0  # snapshots skipped in a row because a peer still read the slot to reuse

    def _lower_priority(self) -> None:
        """The copy has a whole step to land: let the training threads go first (Linux: per-thread nice)."""
        self.worker_tid = threading.get_native_id()
        if self.nice:
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, self.worker_tid, os.getpriority(os.PRIO_PROCESS, 0) + self.nice)

    # -- taking snapshots -------------------------------------------------

    def begin(self, step: int, state) -> bool:
        """Starts copying `state` (committed at `step`) to host; returns at once: whether it started.

        Never waits for a peer: if the slot to reuse is still leased, this
        step's snapshot is skipped (False; the previous one stays served, a
        fetch of this step is told it is stale) rather than making the
        training thread miss its collective deadlines. Blocks only while the
        previous copy (our own, off-thread) is still landing. That copy's
        failure is logged, not raised: it was that step's, and raising it here
        lost this step's snapshot too. A begin of a step already snapshotted
        replaces that snapshot (see the module docstring)."""
        with self._begin_lock:
            try:
                self.wait()
            except SnapshotError as e:
                log.warning("the snapshot before step %d's was not taken: %s", step, e)
            paths, leaves, _ = flatten(state)
            key = (tuple(paths), tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves))
            if key != self._layout_key:  # the layout only changes if the state's structure does
                self._layout = plan_layout(paths, leaves)
                self._layout_key = key
            layout, total = self._layout
            for x in leaves:
                if getattr(x, "is_fully_addressable", True) is False:
                    raise SnapshotError(
                        f"array of shape {x.shape} is not fully addressable by this process; a snapshot holds a "
                        "replica's whole state, so each replica must live in one process (its mesh over local "
                        "devices)"
                    )
            with self._cond:
                self._supersede(int(step))
                slot = self._claim_slot(int(step))
            if slot is None:
                return False
            if slot.layout != layout or slot.buffer is None:
                slot.buffer = HostBuffer(total)
                slot.layout = layout
            # Starting transfers (~40 us per array) and enumerating shards (~15 us) is done by the copy
            # thread, off the training thread.
            self._pending = self._pool.submit(self._land, int(step), slot, layout, total, leaves)
            return True

    def wait(self, timeout: float | None = None) -> Snapshot | None:
        """Blocks until the pending copy (if any) has landed; returns the served snapshot."""
        fut = self._pending
        if fut is not None:
            try:
                fut.result(timeout=timeout)
            except TimeoutError:
                raise
            except Exception as e:
                if self._pending is fut:  # not a newer begin's copy, which must still be waited for
                    self._pending = None
                raise SnapshotError(f"snapshot copy failed: {type(e).__name__}: {e}") from e
            if self._pending is fut:
                self._pending = None
        return self.latest()

    @property
    def pending(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def take(self, step: int, state) -> Snapshot:
        """begin + wait: a synchronous snapshot of `step` (tests, servers of fixed state; never a
        training thread). It may wait for a peer: up to lease_timeout_s for the slot to reuse."""
        deadline = time.monotonic() + self.lease_timeout_s
        while not self.begin(step, state):
            with self._cond:
                if not self._cond.wait_for(self._slot_free, timeout=max(0.0, deadline - time.monotonic())):
                    raise SnapshotError(
                        f"every spare snapshot slot is still being read by a peer after {self.lease_timeout_s}s; "
                        "a stuck peer connection holds it (raise lease_timeout_s or add slots)"
                    )
        snap = self.wait()
        assert snap is not None and snap.step == step
        return snap

    def _supersede(self, step: int) -> None:
        """Under _cond: a begin of `step` means the replica's state at `step` is the one being copied
        now, so any snapshot of `step` or later holds bytes it no longer has (a fork replaced by the
        lineage's state, a rewind): no new lease may read them. Leases already held finish on
        them (their fetcher checks those bytes against the manifest it got with them)."""
        for s in self._slots:
            if s.snap is not None and s.snap.step >= step:
                s.snap = None
        if self._served is not None and self._served[1].step >= step:
            self._served = None

    def _spares(self) -> list[_Slot]:
        served = self._served[0] if self._served else None
        return [s for s in self._slots if s is not served]

    def _slot_free(self) -> bool:
        return any(s.leases == 0 for s in self._spares())

    def _claim_slot(self, step: int) -> _Slot | None:
        """Under _cond: a spare slot no peer is reading, now unservable (it is about to be
        overwritten); None if every spare is read, and the snapshot of `step` is skipped.

        Skipping, not waiting (the training thread must not wait for a peer) nor allocating a
        further slot: a slot is a whole replica state of host memory, populated at ~1 GB/s on the
        allocating thread, and a bound on spares only moves the stall to the next stuck peer.
        What a skip costs is only freshness: peers are served the previous step until a slot is
        free, and a fetch of the newer step is told it is stale and asks another peer."""
        spares = self._spares()
        free = [s for s in spares if s.leases == 0]
        if free:
            # Empty slots first, then the oldest step: the newer snapshots stay servable longest.
            slot = min(free, key=lambda s: (s.snap is not None, -1 if s.snap is None else s.snap.step))
            slot.snap = None
            if self.skipped:
                log.info("snapshots resume at step %d: peers have let go of the slot it reuses (%d snapshot(s) "
                         "skipped while they read it)", step, self.skipped)
                self.skipped = 0
            return slot
        # Every spare slot is being read. The least-read one takes no new lease from now on (its
        # older step is about to be overwritten: a fetch of it is told it is stale and asks for the
        # new one), so only the pieces in flight hold it: a fetcher whose streams overlap their
        # leases must not hold it forever.
        min(spares, key=lambda s: s.leases).snap = None
        served = f"step {self._served[1].step} stays served" if self._served else "no snapshot is served"
        if not self.skipped:
            log.warning("snapshot of step %d skipped: a peer is still reading the slot it would reuse (a slow or "
                        "stopped fetcher; each piece's send is bounded by ft.peer_send_s); %s and training goes "
                        "on; snapshots resume once that read ends (no warning per step until then)", step, served)
        else:
            log.debug("snapshot of step %d skipped: the slot to reuse is still being read", step)
        self.skipped += 1
        return None

    def _land(self, step: int, slot: _Slot, layout, total: int, leaves) -> None:
        t0 = time.perf_counter()
        buf = slot.buffer
        assert buf is not None
        for x in leaves:  # start every device->host transfer before waiting on any (a no-op on CPU)
            start = getattr(x, "copy_to_host_async", None)
            if start is not None and not _on_cpu(x):
                start()
        sums = []
        for spec, x in zip(layout, leaves):
            dest = buf.leaf_view(spec)
            for index, src in _leaf_copies(x):
                host = np.asarray(src)
                if index == () and dest.shape == ():
                    dest[...] = host
                else:
                    dest[index] = host
            flat = buf.array[spec.offset : spec.offset + spec.nbytes]
            sums.append(
                tuple(
                    checksum(flat[k * self.piece_bytes : (k + 1) * self.piece_bytes])
                    for k in range(num_pieces(spec.nbytes, self.piece_bytes))
                )
            )
        manifest = Manifest(step, layout, self.piece_bytes, tuple(sums), total)
        snap = Snapshot(manifest, buf)
        with self._cond:
            slot.snap = snap
            self._served = (slot, snap)
            self._cond.notify_all()
        self.last_copy_s = time.perf_counter() - t0

    # -- serving ------------------------------------------------------------

    def latest(self) -> Snapshot | None:
        with self._cond:
            return self._served[1] if self._served else None

    def served_step(self) -> int | None:
        snap = self.latest()
        return None if snap is None else snap.step

    @contextlib.contextmanager
    def lease(self, step: int | None = None) -> Iterator[Snapshot]:
        """Holds a snapshot so it is not overwritten while read: the latest, or that of `step`.

        The previous step's snapshot stays servable until its slot is reused
        by the next-but-one `begin`, so a fetch of step s that outlasts one
        training step still completes. A snapshot superseded by a later
        `begin` of its step (or an earlier one) is never served."""
        with self._cond:
            served = self._served[1].step if self._served else None
            if step is None:
                if self._served is None:
                    raise StaleStepError(-1, None)
                slot, snap = self._served
            else:
                # At most one slot holds a servable snapshot of a step: a begin of it clears the others.
                held = [s for s in self._slots if s.snap is not None and s.snap.step == step]
                if not held:
                    raise StaleStepError(step, served)
                slot = held[0]
                snap = slot.snap
                assert snap is not None
            slot.leases += 1
        try:
            yield snap
        finally:
            with self._cond:
                slot.leases -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.wait()
        self._pool.shutdown(wait=True)


def restore_tree(manifest: Manifest, buffer: HostBuffer, like=None, shardings=None):
    """The state pytree held by `buffer`.

    Without `like`: a flat {path: ndarray} dict. With `like` (any pytree of the
    same structure: arrays, ShapeDtypeStructs): that structure, checked leaf by
    leaf. With `shardings` (a pytree of shardings matching `like`, or taken
    from ShapeDtypeStruct.sharding in `like`): jax arrays placed on them.
    Numpy leaves are views into `buffer` (no copy)."""
    host = [buffer.leaf_view(s) for s in manifest.leaves]
    if like is None:
        return {s.path: h for s, h in zip(manifest.leaves, host)}
    paths, leaves, treedef = flatten(like)
    check_matches(manifest, paths, leaves)
    import jax

    if shardings is not None:
        flat = jax.tree_util.tree_leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
        if len(flat) != len(host):
            raise ValueError(f"shardings has {len(flat)} leaves but the state has {len(host)}")
    else:  # jax.Array / ShapeDtypeStruct leaves carry their sharding; numpy leaves stay on host
        flat = [None if isinstance(x, np.ndarray) else getattr(x, "sharding", None) for x in leaves]
    host = [h if s is None else place(h, s) for h, s in zip(host, flat)]
    return jax.tree_util.tree_unflatten(treedef, host)


def place(host: np.ndarray, sharding):
    """One host array onto a sharding, each device taking only its shard."""
    import jax

    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def check_matches(manifest: Manifest, paths: Sequence[str], leaves: Sequence[Any]) -> None:
    if len(paths) != len(manifest.leaves):
        raise SnapshotError(
            f"the target pytree has {len(paths)} leaves but the snapshot of step {manifest.step} has "
            f"{len(manifest.leaves)}; the peers run a different model or optimizer"
        )
    for i, (p, x, spec) in enumerate(zip(paths, leaves, manifest.leaves)):
        shape = tuple(int(s) for s in np.shape(x))
        dtype = np.dtype(x.dtype).name if hasattr(x, "dtype") else np.asarray(x).dtype.name
        if (p, shape, dtype) != (spec.path, spec.shape, spec.dtype):
            raise SnapshotError(
                f"leaf {i} differs from the snapshot: target {p} {shape} {dtype}, snapshot {spec.path} "
                f"{spec.shape} {spec.dtype}"
            )
    planned, total = plan_layout(paths, leaves)
    if (planned, total) != (manifest.leaves, manifest.total_bytes):  # where each leaf's bytes lie, too
        raise SnapshotError(f"the snapshot of step {manifest.step} lays its leaves out in a "
                            f"{manifest.total_bytes}-byte buffer where this build puts them in {total} bytes: the "
                            "peer's manifest is inconsistent (a different fthsdp version, or a broken peer)")
