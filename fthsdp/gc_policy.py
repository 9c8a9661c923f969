"""CPython's garbage collector tuned for the processes whose pauses are someone's latency.

**Why.** CPython runs a young collection whenever the tracked objects allocated
and not yet freed pass 700, and promotes the survivors; enough young
collections trigger a middle one, enough middle ones a full one, which walks
every object alive. A lighthouse round allocates thousands of short-lived
tracked objects at once (a future, a pending entry, callbacks and handles per
quorum request), so it collected dozens of times per round and promoted
objects that were freed moments later, feeding the long collections. Measured
with ``experiments/scale.py`` at 512 replicas x 196 ranks over 40 rounds: the
lighthouse paused 566 ms in 774 collections (the longest 45 ms) and the
emulator 1.5 s (the longest 72 ms): quorum latency p50 86 ms but p99 168 ms.
With a young threshold of 20,000 the lighthouse collected 4 times (18 ms in
all): what a round allocates is freed by reference counting before 20,000 pile
up, nothing is promoted, and the long collections stop (p50 78, p99 96-102 ms
in the same runs).

**What is kept.** The collector still runs: cyclic garbage is found at most
20,000 allocations later (a few MB at worst). :func:`gc.freeze` moves what is
alive when the process settles (modules, the gRPC and protobuf runtimes, the
emulation's ranks) out of every later collection's walk.

Used by the lighthouse's command (``fthsdp lighthouse``: the process is the
lighthouse's own), by a replica process around its step loop (once jax and the
compiled step are built: with the defaults a training replica of ``make run``
paused 136 ms in one full collection, its heartbeat thread with it; under this
policy no collection after start-up took over 5 ms), and by the emulation while
it runs (one process standing for hundreds of hosts, whose pauses would
otherwise stall all of them at once). A library object never changes its host
process's collector.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["YOUNG_THRESHOLD", "low_pause_gc"]

YOUNG_THRESHOLD = 20_000  # tracked objects allocated and not freed before a young collection (CPython: 700)


@contextlib.contextmanager
def low_pause_gc(young: int = YOUNG_THRESHOLD) -> Iterator[None]:
    """Inside: everything alive now frozen, young collections every ``young`` net
    allocations; on exit the process's own thresholds again, and the whole heap
    unfrozen. A freeze made before entering is undone with it: a freeze cannot be undone
    in part, and the frozen count cannot say whether anyone else froze (CPython 3.12
    moves immortal objects into the frozen set in every full collection: a fresh
    interpreter counts a few hundred frozen objects without any freeze)."""
    if young < 1:
        raise ValueError(f"young threshold must be >= 1 allocation, got {young}")
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(young, *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()
