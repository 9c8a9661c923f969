"""Who is stalling the job: root-cause analysis over plain data (issue 16).

Each replica process reports where it is with its heartbeats (a phase, and in
FTAR the replica whose data it waits for: fthsdp/observe/phase.py). From the
last report of every process, its heartbeat age, the quorum and the detection
window, :func:`analyse` builds the wait-for graph and names its root:

* an edge ``a -> b`` means a cannot progress until b does: a is in the
  all-reduce waiting for data from its left neighbour b, or a asks for a
  quorum that waits for member b, which is not asking;
* a process whose heartbeats went silent has no outgoing edges (its report
  is stale): everyone who waits on it, transitively, is stalled by it.

The verdict's kinds, first match wins:

* ``dead``: the root has been silent past the detection window;
* ``frozen``: the root has been silent for a while (``frozen_after_s``) but
  not yet the window, and others wait on it (SIGSTOP, a hung host);
* ``slow``: the root is alive and busy (computing, fetching, checkpointing,
  compiling) much longer than the others' compute time, or, with no wait
  chain at the moment, its last forward+backward took much longer than the
  others' median;
* ``slow_link``: an FTAR stream carries far less per busy second than the
  others and is busy a good share of the time, so it is the ring's bottleneck
  rather than one unlucky chunk (the sender is named, the receiver is
  ``peer``);
* ``none``: nothing is wrong.

Ties (several roots) are broken by how many processes wait on each, then by
the longest silence, then by ring order; the evidence names the others and
the confidence drops. Cycles (every rank waiting on its left neighbour, the
normal state of a slow ring) have no root; a slow link or a slow compute then
explains them, else the verdict is ``unknown``.

This module is pure: no clocks, no sockets, no logging. The lighthouse runs it
(fthsdp/control/lighthouse.py); the unit tests drive it with plain data.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

NONE, DEAD, FROZEN, SLOW, SLOW_LINK, UNKNOWN = "none", "dead", "frozen", "slow", "slow_link", "unknown"
KINDS = (NONE, DEAD, FROZEN, SLOW, SLOW_LINK, UNKNOWN)

# Phase names (fthsdp/observe/phase.py's Phase values).
ALLREDUCE = "allreduce"
WAITING_FOR_QUORUM = "waiting-for-quorum"
BUSY_PHASES = ("computing", "fetching", "checkpointing", "compiling", "starting")


@dataclass(frozen=True)
class StreamRate:
    """A process's outgoing FTAR streams to ``to``: bytes per busy second, recently, and
    the share of that time its senders were busy."""

    to: str
    bytes_per_s: float
    busy_fraction: float = 1.0


@dataclass(frozen=True)
class ProcessReport:
    """One process as the lighthouse last heard it."""

    replica: str
    heartbeat_age_s: float
    phase: str = ""  # "" = no report
    step: int = 0
    in_phase_s: float = 0.0
    waiting_on: str = ""  # in the all-reduce: the replica whose data it waits for
    waiting_s: float = 0.0
    ring_step: int = 0
    ring_steps: int = 0
    last_compute_s: float = -1.0  # < 0: none yet
    streams: tuple[StreamRate, ...] = ()
    asking: bool = False  # a quorum request of it is open at the lighthouse
    declared_dead: bool = False


@dataclass(frozen=True)
class Thresholds:
    """When a silence, a compute or a stream counts as the problem.

    frozen_after_s: heartbeat silence that makes a waited-on process frozen
        (the lighthouse passes detect_s / 2: well above one heartbeat interval).
    slow_factor / slow_min_s: busy this many times the others' median compute
        time, and at least this long, is slow.
    link_factor / link_min_busy: a stream carrying this many times less than
        the median of the others, and busy at least this share of the time,
        is a slow link.
    wait_min_s: a wait shorter than this is a ring or a quorum in progress,
        not an edge of the wait-for graph (else every healthy ring, each rank
        waiting on its left neighbour for a few milliseconds, is a cycle).
    """

    frozen_after_s: float = 0.4
    slow_factor: float = 3.0
    slow_min_s: float = 0.2
    link_factor: float = 4.0
    link_min_busy: float = 0.1
    wait_min_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("frozen_after_s", "slow_factor", "slow_min_s", "link_factor", "link_min_busy", "wait_min_s"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"root-cause threshold {name}={v!r} must be > 0")
        if self.slow_factor <= 1 or self.link_factor <= 1:
            raise ValueError("root-cause slow_factor and link_factor must be > 1 (they are ratios to the median)")


@dataclass(frozen=True)
class JobSnapshot:
    """Everything one analysis needs, as plain data."""

    reports: tuple[ProcessReport, ...]
    members: tuple[str, ...]  # the current quorum, ring order (() = none)
    detect_s: float
    step: int = 0


@dataclass(frozen=True)
class Verdict:
    kind: str
    culprit: str = ""
    peer: str = ""
    evidence: str = ""
    confidence: float = 0.0
    chain: tuple[str, ...] = ()  # a waiter -> ... -> culprit

    @property
    def key(self) -> tuple[str, str, str]:
        """What "the verdict changed" means (log once per change)."""
        return self.kind, self.culprit, self.peer

    def describe(self) -> str:
        if self.kind == NONE:
            return f"no stall: {self.evidence}"
        who = f"{self.culprit} -> {self.peer}" if self.kind == SLOW_LINK else f"replica {self.culprit}"
        return f"{self.kind.upper()} {who} (confidence {self.confidence:.2f}): {self.evidence}"


@dataclass
class _Graph:
    edges: dict[str, tuple[str, ...]] = field(default_factory=dict)
    why: dict[tuple[str, str], str] = field(default_factory=dict)


def _fmt(s: float) -> str:
    return f"{s:.2f}s" if s < 10 else f"{s:.0f}s"


def _rate(bps: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} B/s"


def wait_for_graph(snap: JobSnapshot, silent: set[str], wait_min_s: float = 0.0) -> _Graph:
    """Edges a -> b: a waits on b. Silent processes have none (their reports are stale)."""
    g = _Graph()
    known = {r.replica for r in snap.reports}
    asking = {r.replica for r in snap.reports if r.asking}
    for r in snap.reports:
        if r.replica in silent:
            continue
        out: list[str] = []
        if (r.phase == ALLREDUCE and r.waiting_on and r.waiting_on != r.replica and r.waiting_on in known
                and r.waiting_s >= wait_min_s):
            out.append(r.waiting_on)
            step = f" at ring step {r.ring_step + 1}/{r.ring_steps}" if r.ring_steps else ""
            g.why[(r.replica, r.waiting_on)] = (
                f"{r.replica} waits in FTAR{step} for data from {r.waiting_on} ({_fmt(r.waiting_s)})")
        elif r.replica in snap.members and (
                (r.phase == WAITING_FOR_QUORUM and r.in_phase_s >= wait_min_s) or (r.asking and not r.phase)):
            for m in snap.members:
                if m != r.replica and m not in asking and m in known:
                    out.append(m)
                    g.why[(r.replica, m)] = f"{r.replica} asks for a quorum that waits for member {m}"
        if out:
            g.edges[r.replica] = tuple(out)
    return g


def _roots(g: _Graph) -> tuple[dict[str, set[str]], set[str]]:
    """Sinks reachable from each waiter: {sink: waiters that reach it} and the waiters
    caught in a cycle that reaches no sink."""
    reach: dict[str, set[str]] = {}
    cyclic: set[str] = set()
    for start in g.edges:
        seen = {start}
        stack = [start]
        sinks = set()
        while stack:
            a = stack.pop()
            nxt = g.edges.get(a, ())
            if not nxt:
                sinks.add(a)
            for b in nxt:
                if b not in seen:
                    seen.add(b)
                    stack.append(b)
        if not sinks:
            cyclic.add(start)
        for s in sinks:
            reach.setdefault(s, set()).add(start)
    return reach, cyclic


def _chain(g: _Graph, start: str, goal: str) -> tuple[str, ...]:
    """A shortest path start -> ... -> goal (breadth first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for a in frontier:
            for b in g.edges.get(a, ()):
                if b in seen:
                    continue
                seen.add(b)
                prev[b] = a
                if b == goal:
                    path = [b]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return tuple(reversed(path))
                nxt.append(b)
        frontier = nxt
    return (start,)


def _order_key(members: tuple[str, ...]):
    pos = {m: i for i, m in enumerate(members)}

    def key(r: str):
        return (pos.get(r, len(pos)), int(r) if r.isdigit() else 0, r)

    return key


def _median_compute(reports, exclude: str) -> float | None:
    xs = [r.last_compute_s for r in reports if r.replica != exclude and r.last_compute_s >= 0]
    return statistics.median(xs) if xs else None


def _slow_link(snap: JobSnapshot, th: Thresholds) -> Verdict | None:
    links = [(r.replica, s.to, s.bytes_per_s, s.busy_fraction) for r in snap.reports for s in r.streams
             if s.bytes_per_s > 0 and (not snap.members or r.replica in snap.members)]
    if len(links) < 2:
        return None
    worst = min(links, key=lambda x: (x[2], _order_key(snap.members)(x[0])))
    others = [x[2] for x in links if x is not worst]
    median = statistics.median(others)
    if worst[2] * th.link_factor > median or worst[3] < th.link_min_busy:
        return None
    ratio = median / worst[2]
    return Verdict(
        SLOW_LINK, worst[0], worst[1],
        f"FTAR stream {worst[0]} -> {worst[1]} carries {_rate(worst[2])} while busy, and is busy "
        f"{worst[3]:.0%} of the time; the other {len(others)} stream(s) carry {_rate(median)} (median), "
        f"{ratio:.0f}x more",
        confidence=min(1.0, 0.5 + ratio / (4 * th.link_factor)))


def analyse(snap: JobSnapshot, th: Thresholds | None = None) -> Verdict:
    """The verdict for one job: the root of its wait-for graph, its kind and the evidence."""
    th = th or Thresholds()
    by_id = {r.replica: r for r in snap.reports}
    key = _order_key(snap.members)
    silent = {r.replica for r in snap.reports
              if r.declared_dead or r.heartbeat_age_s >= min(th.frozen_after_s, snap.detect_s)}
    g = wait_for_graph(snap, silent, th.wait_min_s)
    reach, cyclic = _roots(g)

    # Roots that stall someone: silent ones first, then busy ones.
    def silence(r: str) -> float:
        rep = by_id[r]
        return float("inf") if rep.declared_dead else rep.heartbeat_age_s

    silent_roots = sorted((s for s in reach if s in silent), key=lambda s: (-len(reach[s]), -silence(s), key(s)))
    if silent_roots:
        root = silent_roots[0]
        rep = by_id[root]
        waiters = sorted(reach[root], key=key)
        first = min(waiters, key=lambda w: (len(_chain(g, w, root)), key(w)))
        chain = _chain(g, first, root)
        dead = rep.declared_dead or rep.heartbeat_age_s >= snap.detect_s
        heard = ("declared dead by the lighthouse" if rep.declared_dead and rep.heartbeat_age_s < 0
                 else f"no heartbeat for {_fmt(rep.heartbeat_age_s)}")
        window = f"(detection window {_fmt(snap.detect_s)})"
        last = f"; its last report: {rep.phase or 'none'} at step {rep.step}" if rep.phase else ""
        evidence = [f"replica {root}: {heard} {window}{last}",
                    f"{len(waiters)} process(es) wait on it ({', '.join(waiters)})",
                    g.why.get((chain[-2], chain[-1]), "") if len(chain) > 1 else ""]
        confidence = 1.0 if dead else 0.9
        others = silent_roots[1:]
        if others:
            evidence.append(f"also silent and waited on: {', '.join(others)}")
            if len(reach[others[0]]) == len(reach[root]):
                confidence = 0.5
        return Verdict(DEAD if dead else FROZEN, root, "", "; ".join(e for e in evidence if e), confidence, chain)

    # A silent quorum member nobody is shown waiting on yet (e.g. every survivor
    # still computing): still the likeliest culprit once they reach the ring.
    silent_members = sorted((s for s in silent if s in snap.members), key=lambda s: (-silence(s), key(s)))

    busy_roots = []
    for s, waiters in reach.items():
        rep = by_id[s]
        if rep.phase in BUSY_PHASES:
            med = _median_compute(snap.reports, s)
            base = med if med is not None else 0.0
            if rep.in_phase_s >= max(th.slow_min_s, th.slow_factor * base):
                busy_roots.append((s, waiters, med))
    link = _slow_link(snap, th)
    if busy_roots and not silent_members:
        busy_roots.sort(key=lambda x: (-len(x[1]), -by_id[x[0]].in_phase_s, key(x[0])))
        root, waiters, med = busy_roots[0]
        rep = by_id[root]
        first = min(waiters, key=lambda w: (len(_chain(g, w, root)), key(w)))
        chain = _chain(g, first, root)
        base = f"the others' median compute is {_fmt(med)}" if med is not None else "no compute time of the others yet"
        evidence = [f"replica {root} has been {rep.phase} for {_fmt(rep.in_phase_s)} at step {rep.step} ({base})",
                    f"{len(waiters)} process(es) wait on it ({', '.join(sorted(waiters, key=key))})",
                    g.why.get((chain[-2], chain[-1]), "") if len(chain) > 1 else ""]
        confidence = 0.9 if med is not None else 0.6
        if len(busy_roots) > 1:
            evidence.append(f"also busy and waited on: {', '.join(b[0] for b in busy_roots[1:])}")
            confidence = min(confidence, 0.5)
        return Verdict(SLOW, root, "", "; ".join(e for e in evidence if e), confidence, chain)

    if silent_members:
        root = silent_members[0]
        rep = by_id[root]
        dead = rep.declared_dead or rep.heartbeat_age_s >= snap.detect_s
        return Verdict(DEAD if dead else FROZEN, root, "",
                       f"quorum member {root}: no heartbeat for {_fmt(rep.heartbeat_age_s)} (detection window "
                       f"{_fmt(snap.detect_s)}); nobody reports waiting on it yet",
                       0.8 if dead else 0.6, (root,))

    if link is not None:
        return link

    # No root now: compare the last forward+backward of every member.
    computed = [r for r in snap.reports if r.last_compute_s >= 0 and (not snap.members or r.replica in snap.members)]
    if len(computed) >= 2:
        worst = min(computed, key=lambda r: (-r.last_compute_s, key(r.replica)))
        med = _median_compute(computed, worst.replica)
        if med is not None and worst.last_compute_s >= max(th.slow_min_s, th.slow_factor * med):
            ratio = worst.last_compute_s / med if med > 0 else float("inf")
            return Verdict(SLOW, worst.replica, "",
                           f"replica {worst.replica}'s last forward+backward took {_fmt(worst.last_compute_s)}, "
                           f"{ratio:.1f}x the others' median {_fmt(med)}: every all-reduce waits for it",
                           0.8, (worst.replica,))

    if cyclic:
        ring = sorted(cyclic, key=key)
        return Verdict(UNKNOWN, "", "",
                       f"{', '.join(ring)} wait on each other in a cycle with no silent, slow or throttled "
                       "member to blame (a ring in progress, or a fault this analysis cannot see)", 0.2)
    n = len(snap.members) or len(snap.reports)
    return Verdict(NONE, "", "", f"{n} process(es) reporting, none silent, slow or waiting on another", 1.0)
