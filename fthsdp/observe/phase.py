"""Where a replica process is, for root-cause analysis of stalls (issue 16).

The Manager and the replica process call :meth:`PhaseTracker.set` at phase
boundaries (waiting for a quorum, computing, in the all-reduce, fetching,
checkpointing, compiling, idle). That is one tuple assignment: atomic under
the GIL, no lock on the step's hot path. The heartbeat thread calls
:meth:`PhaseTracker.report` about every 100 ms; in the all-reduce it also
reads FTAR's progress counters (lock-free in C++, so it works while the ring
is stuck) and turns ring ranks into replica ids with the quorum: which
replica's data this process waits for, and how fast its outgoing streams
carried data recently. The lighthouse builds the job's wait-for graph from
these (fthsdp/observe/root_cause.py).
"""

from __future__ import annotations

import collections
import enum
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence


class Phase(str, enum.Enum):
    STARTING = "starting"
    COMPILING = "compiling"
    COMPUTING = "computing"
    ALLREDUCE = "allreduce"
    FETCHING = "fetching"
    CHECKPOINTING = "checkpointing"
    WAITING_FOR_QUORUM = "waiting-for-quorum"
    IDLE = "idle"


@dataclass(frozen=True)
class StreamReport:
    to_replica: str
    bytes_per_s: float  # per busy second of its senders
    bytes: int
    busy_fraction: float = 0.0  # of the window's wall time, averaged over the streams


@dataclass(frozen=True)
class PhaseSnapshot:
    """One report, as plain data (the lighthouse client turns it into a PhaseReport)."""

    phase: Phase
    step: int
    in_phase_s: float
    quorum_id: int = 0
    ring_step: int = 0
    ring_steps: int = 0
    waiting_on: str = ""
    waiting_s: float = 0.0
    bytes_moved: int = 0
    streams: tuple[StreamReport, ...] = ()
    compute_s: float = -1.0
    last_step_s: float = -1.0


# progress() of fthsdp.collective.ftar.Communicator: one dict per local shard.
ProgressFn = Callable[[], Sequence[dict]]


class PhaseTracker:
    """The phase of one process, cheap to set, read by the heartbeat thread.

    Stream rates are measured over windows of MIN_WINDOW_S..MAX_WINDOW_S of
    wall time (restarted with each new ring), long enough to average out one
    chunk's scheduling noise on a loaded host, short enough to follow a link
    that turns slow.
    """

    MIN_WINDOW_S = 1.0
    MAX_WINDOW_S = 5.0
    COMPUTES_KEPT = 5

    def __init__(self, progress: ProgressFn | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._progress = progress
        # (phase, step, since, quorum_id, members): replaced whole, never mutated
        self._state: tuple[Phase, int, float, int, tuple[str, ...]] = (Phase.STARTING, 0, clock(), 0, ())
        self._computes: collections.deque[float] = collections.deque(maxlen=self.COMPUTES_KEPT)
        self.compute_s = -1.0  # the median of the last COMPUTES_KEPT forward+backward times
        self.last_step_s = -1.0
        self._rate_lock = threading.Lock()  # report() only: the heartbeat thread and tests
        # Rate windows of the outgoing streams: (quorum id, members, bytes, busy s, wall time) at the
        # window's start; the last finished window's report stands in while the current one is young.
        self._rate_base: tuple[int, tuple[str, ...], int, float, float] | None = None
        self._rates_done: tuple[StreamReport, ...] = ()
        self._rates: tuple[StreamReport, ...] = ()

    def set(self, phase: Phase, step: int | None = None, quorum_id: int | None = None,
            members: Sequence[str] | None = None) -> None:
        """Enter ``phase`` (hot path: one tuple assignment)."""
        old = self._state
        self._state = (phase, old[1] if step is None else int(step), self._clock(),
                       old[3] if quorum_id is None else int(quorum_id),
                       old[4] if members is None else tuple(members))

    def computed(self, seconds: float) -> None:
        """One forward+backward took ``seconds`` (the step loop calls it once per step)."""
        self._computes.append(seconds)
        self.compute_s = statistics.median(self._computes)

    @property
    def phase(self) -> Phase:
        return self._state[0]

    def in_allreduce(self, step: int) -> bool:
        """Whether the process is in the all-reduce of ``step`` now (one read of the state)."""
        phase, at = self._state[:2]
        return phase is Phase.ALLREDUCE and at == step

    def report(self, replica_id: str) -> PhaseSnapshot:
        phase, step, since, qid, members = self._state
        now = self._clock()
        ring = {}
        if self._progress is not None and replica_id in members:
            ring = self._ring(replica_id, qid, members, phase == Phase.ALLREDUCE)
        return PhaseSnapshot(phase, step, max(0.0, now - since), qid, compute_s=self.compute_s,
                             last_step_s=self.last_step_s, streams=self._rates, **ring)

    def _ring(self, replica_id: str, qid: int, members: tuple[str, ...], in_allreduce: bool) -> dict:
        try:
            shards = list(self._progress())
        except Exception:  # noqa: BLE001 - a closed communicator: report the phase alone
            return {}
        if not shards:
            return {}
        n = len(members)
        me = members.index(replica_id)
        right = members[(me + 1) % n]
        sent = sum(sum(p["bytes_sent"]) for p in shards)
        busy = sum(sum(p["send_busy_s"]) for p in shards)
        streams = sum(len(p["send_busy_s"]) for p in shards) or 1
        now = self._clock()
        with self._rate_lock:
            base = self._rate_base
            if base is None or base[0] != qid or base[1] != members:  # a new ring: new windows
                self._rate_base, self._rates_done, self._rates = (qid, members, sent, busy, now), (), ()
            else:
                wall = now - base[4]
                current = ()
                if busy > base[3] and sent > base[2] and wall > 0:
                    current = (StreamReport(right, (sent - base[2]) / (busy - base[3]), sent - base[2],
                                            min(1.0, (busy - base[3]) / (wall * streams))),)
                self._rates = current if wall >= self.MIN_WINDOW_S or not self._rates_done else self._rates_done
                if wall >= self.MAX_WINDOW_S:
                    self._rates_done = current
                    self._rate_base = (qid, members, sent, busy, now)
        if not in_allreduce:
            return {}
        active = [p for p in shards if p["in_op"]]
        if not active:
            return {}
        p = max(active, key=lambda p: p["since_recv_s"])  # the shard that waits longest
        left = members[(p["rank"] - 1) % p["n"]] if p["n"] == n and p["rank"] >= 0 else ""
        return {"ring_step": int(p["ring_step"]), "ring_steps": int(p["ring_steps"]), "waiting_on": left,
                "waiting_s": float(p["since_recv_s"]), "bytes_moved": int(sum(p["bytes_received"]))}
