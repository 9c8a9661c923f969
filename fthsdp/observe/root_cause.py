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
  chain at the moment, its recent forward+backward time (a median of the
  last few) is much longer than the others';
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

**Replicas of several processes.** Every process reports its own phase (the
leader's and each follower's heartbeats): the process that waits longest in
FTAR gives its replica's edge (a follower's ring can stall while its leader's
is done), else the one busy longest; its replica's compute time is its slowest
process's. The verdict names the culprit as (replica, process): the silent
process of a silent replica (a frozen follower under a live leader), the busy
or waiting process of a busy one, the sending process of a slow link. ``-1``
where no single process is meant (``none``, ``unknown``).

This module is pure: no clocks, no sockets, no logging. The lighthouse runs it
(fthsdp/control/lighthouse.py); the unit tests drive it with plain data.
"""

from __future__ import annotations

import bisect
import functools
import statistics
from dataclasses import dataclass, field

from fthsdp.control.quorum import ring_key

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
    process: int = 0  # which process of the sending replica owns the stream


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
    compute_s: float = -1.0  # recent forward+backward seconds (a median of the last few); < 0: none yet
    streams: tuple[StreamRate, ...] = ()
    asking: bool = False  # a quorum request of it is open at the lighthouse
    declared_dead: bool = False
    # A replica of several processes is as fresh as its stalest process: which went silent
    # (the longest silent first).
    silent_processes: tuple[int, ...] = ()
    process: int = 0  # whose phase report this is (see merge_processes)


# Another process is preferred to a lower-numbered one only when it has waited (or been
# busy) this much longer: the processes of a replica step together, their reports arrive
# at different moments, and a verdict must not flap between them on that jitter alone.
PROCESS_MARGIN_S = 0.5


def _longest(reports: list[ProcessReport], seconds) -> ProcessReport:
    best = None
    for r in sorted(reports, key=lambda r: r.process):
        if best is None or seconds(r) > seconds(best) + PROCESS_MARGIN_S:
            best = r
    assert best is not None
    return best


def _representative(reports: list[ProcessReport], wait_min_s: float) -> ProcessReport:
    waiting = [r for r in reports if r.phase == ALLREDUCE and r.waiting_on and r.waiting_s >= wait_min_s]
    if waiting:
        return _longest(waiting, lambda r: r.waiting_s)
    busy = [r for r in reports if r.phase in BUSY_PHASES]
    if busy:
        return _longest(busy, lambda r: r.in_phase_s)
    return min(reports, key=lambda r: r.process)


def merge_processes(reports: list[ProcessReport], wait_min_s: float = 0.1) -> ProcessReport:
    """One replica's report from its processes' (each with its ``process`` set; the
    replica-level fields -- heartbeat age, asking, declared dead, silent processes --
    taken from the leader's, process 0, or the first). The graph has one node per replica
    and one outgoing edge per node, so the process that explains the most is kept: the
    one waiting longest in FTAR, else the one busy longest (by more than PROCESS_MARGIN_S,
    else the lowest-numbered: no flapping), else the leader; compute time
    is the slowest process's, and every process's streams are kept (tagged)."""
    if not reports:
        raise ValueError("merge_processes: no reports")
    if len(reports) == 1:
        return reports[0]
    base = min(reports, key=lambda r: r.process)
    pick = _representative(reports, wait_min_s)
    computes = [r.compute_s for r in reports if r.compute_s >= 0]
    streams = tuple(s if s.process == r.process else StreamRate(s.to, s.bytes_per_s, s.busy_fraction, r.process)
                    for r in sorted(reports, key=lambda r: r.process) for s in r.streams)
    return ProcessReport(
        base.replica, base.heartbeat_age_s, pick.phase, pick.step, pick.in_phase_s, pick.waiting_on, pick.waiting_s,
        pick.ring_step, pick.ring_steps, max(computes) if computes else -1.0, streams, asking=base.asking,
        declared_dead=base.declared_dead, silent_processes=base.silent_processes, process=pick.process)


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

    @functools.cached_property
    def member_set(self) -> frozenset[str]:
        return frozenset(self.members)


@dataclass(frozen=True)
class Verdict:
    kind: str
    culprit: str = ""
    peer: str = ""
    evidence: str = ""
    confidence: float = 0.0
    chain: tuple[str, ...] = ()  # a waiter -> ... -> culprit
    process: int = -1  # which process of the culprit replica (-1: no culprit)

    @property
    def key(self) -> tuple[str, str, str, int]:
        """What "the verdict changed" means (log once per change)."""
        return self.kind, self.culprit, self.peer, self.process

    def describe(self) -> str:
        if self.kind == NONE:
            return f"no stall: {self.evidence}"
        proc = f" process {self.process}" if self.process > 0 else ""
        who = f"{self.culprit}{proc} -> {self.peer}" if self.kind == SLOW_LINK else f"replica {self.culprit}{proc}"
        return f"{self.kind.upper()} {who} (confidence {self.confidence:.2f}): {self.evidence}"


@dataclass(frozen=True)
class RootCauseStatus:
    """A lighthouse's root-cause verdict as its Status reports it (RootCause in the proto): the
    :class:`Verdict`, the step it is about and its age. What `fthsdp status`, the dashboard and
    its JSON show (one type for all three)."""

    kind: str
    culprit: str
    peer: str
    evidence: str
    confidence: float
    wait_chain: tuple[str, ...]
    step: int
    age_s: float
    process: int = -1  # which process of the culprit replica (-1: none named)

    def describe(self) -> str:
        if self.kind == "none":
            return f"no stall ({self.evidence})"
        proc = f" process {self.process}" if self.process > 0 else ""
        who = (f"link {self.culprit}{proc} -> {self.peer}" if self.kind == "slow_link"
               else f"replica {self.culprit}{proc}")
        return f"{self.kind.upper()} {who} (confidence {self.confidence:.2f}, step {self.step}): {self.evidence}"


@dataclass
class _Graph:
    edges: dict[str, tuple[str, ...]] = field(default_factory=dict)
    why: dict[tuple[str, str], str] = field(default_factory=dict)  # FTAR edges' evidence


def _fmt(s: float) -> str:
    return f"{s:.2f}s" if s < 10 else f"{s:.0f}s"


def _rate(bps: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} B/s"


# A virtual node: a quorum request waits on every member that is not asking.
# Waiters point at it once and it points at those members, so a round where
# half the members ask and half do not costs O(members) edges, not O(members^2).
QUORUM = "\x00quorum"


def wait_for_graph(snap: JobSnapshot, silent: set[str], wait_min_s: float = 0.0) -> _Graph:
    """Edges a -> b: a waits on b. Silent processes have none (their reports are stale)."""
    g = _Graph()
    known = {r.replica for r in snap.reports if r.replica != QUORUM}
    asking = {r.replica for r in snap.reports if r.asking}
    quorum_waiters = False
    for r in snap.reports:
        if r.replica in silent or r.replica not in known:  # (a replica id that is the virtual node's name)
            continue
        if (r.phase == ALLREDUCE and r.waiting_on and r.waiting_on != r.replica and r.waiting_on in known
                and r.waiting_s >= wait_min_s):
            g.edges[r.replica] = (r.waiting_on,)
            step = f" at ring step {r.ring_step + 1}/{r.ring_steps}" if r.ring_steps else ""
            g.why[(r.replica, r.waiting_on)] = (
                f"{r.replica} waits in FTAR{step} for data from {r.waiting_on} ({_fmt(r.waiting_s)})")
        elif r.replica in snap.member_set and (
                (r.phase == WAITING_FOR_QUORUM and r.in_phase_s >= wait_min_s) or (r.asking and not r.phase)):
            g.edges[r.replica] = (QUORUM,)
            quorum_waiters = True
    if quorum_waiters:
        g.edges[QUORUM] = tuple(m for m in snap.members if m not in asking and m in known)
    return g


@dataclass
class _Reach:
    """Who waits on one root: by distance, with the next hop toward the root. Every node
    but the virtual quorum node has one outgoing edge, so the reverse walks of different
    roots are disjoint except through the quorum node, whose walk is done once and
    shared (``via``): a quorum round with K members not asking costs O(members), not O(K x members)."""

    hops: dict[str, tuple[int, str]]  # waiter -> (distance, next node toward the root)
    via: _Reach | None = None  # the quorum node's waiters, when this root is one the quorum waits for

    @property
    def count(self) -> int:
        own = len(self.hops) - (1 if QUORUM in self.hops else 0)
        return own + (self.via.count if self.via is not None else 0)

    @property
    def waiters(self) -> list[str]:
        own = [w for w in self.hops if w != QUORUM]
        return own + (self.via.waiters if self.via is not None else [])

    def _farthest(self, key) -> tuple[int, str] | None:
        own = [(d, w) for w, (d, _) in self.hops.items() if w != QUORUM]
        best = min(own, key=lambda x: (-x[0], key(x[1]))) if own else None
        if self.via is not None and QUORUM in self.hops:
            far = self.via._farthest(key)
            if far is not None:
                cand = (far[0] + self.hops[QUORUM][0], far[1])
                if best is None or (-cand[0], key(cand[1])) < (-best[0], key(best[1])):
                    best = cand
        return best

    def _next(self, node: str) -> str:
        """The next node toward the root: through this root's own walk, else the quorum's."""
        if node in self.hops:
            return self.hops[node][1]
        return self.via._next(node)  # type: ignore[union-attr]

    def chain(self, root: str, key) -> tuple[str, ...]:
        """The longest wait chain into the root (farthest waiter first), without the quorum node."""
        far = self._farthest(key)
        if far is None:
            return (root,)
        path = [far[1]]
        while path[-1] != root:
            path.append(self._next(path[-1]))
        return tuple(x for x in path if x != QUORUM)


def _walk(rev: dict[str, list[str]], start: str, stop: str | None) -> dict[str, tuple[int, str]]:
    """Reverse breadth-first walk from ``start``; ``stop`` is entered but not walked past."""
    hops: dict[str, tuple[int, str]] = {}
    frontier = [start]
    d = 0
    while frontier:
        d += 1
        nxt = []
        for b in frontier:
            if b == stop:
                continue
            for a in rev.get(b, ()):
                if a != start and a not in hops:
                    hops[a] = (d, b)
                    nxt.append(a)
        frontier = nxt
    return hops


def _roots(g: _Graph) -> tuple[dict[str, _Reach], set[str]]:
    """For every sink that someone waits on, who waits on it, and the waiters caught in a
    cycle that reaches no sink."""
    rev: dict[str, list[str]] = {}
    for a, outs in g.edges.items():
        for b in outs:
            rev.setdefault(b, []).append(a)
    quorum = _Reach(_walk(rev, QUORUM, None)) if QUORUM in rev else None
    reach: dict[str, _Reach] = {}
    # Quorum waiters are never a cycle: with every member asking, they wait on the decision itself.
    reached: set[str] = set(quorum.hops) if quorum is not None else set()
    for s in (b for b in rev if not g.edges.get(b) and b != QUORUM):
        hops = _walk(rev, s, QUORUM)
        reach[s] = _Reach(hops, quorum if QUORUM in hops else None)
        reached.update(hops)
    cyclic = {a for a in g.edges if a not in reached and a != QUORUM}
    return reach, cyclic


def _why(g: _Graph, chain: tuple[str, ...], root: str) -> str:
    if len(chain) < 2:
        return ""
    last = chain[-2]
    if (last, root) in g.why:
        return g.why[(last, root)]
    return f"{last} asks for a quorum that waits for member {root}"


def _order_key(members: tuple[str, ...]):
    pos = {m: i for i, m in enumerate(members)}

    def key(r: str):
        return (pos.get(r, len(pos)), ring_key(r))

    return key


def _median_without(xs: list[float], v: float) -> float | None:
    """The median of sorted ``xs`` without one occurrence of ``v`` (v < 0: none to
    remove), in O(log n): the analysis asks it once per candidate root."""
    i = bisect.bisect_left(xs, v) if v >= 0 else len(xs)
    drop = v >= 0 and i < len(xs) and xs[i] == v
    n = len(xs) - (1 if drop else 0)
    if n <= 0:
        return None

    def at(k: int) -> float:
        return xs[k + 1] if drop and k >= i else xs[k]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def _names(ids: list[str], most: int = 8) -> str:
    return ", ".join(ids[:most]) + (f" and {len(ids) - most} more" if len(ids) > most else "")


def _slow_link(snap: JobSnapshot, th: Thresholds) -> Verdict | None:
    links = [(r.replica, s.to, s.bytes_per_s, s.busy_fraction, s.process) for r in snap.reports for s in r.streams
             if s.bytes_per_s > 0 and (not snap.members or r.replica in snap.member_set)]
    if len(links) < 2:
        return None
    key = _order_key(snap.members)
    worst = min(links, key=lambda x: (x[2], key(x[0])))
    others = [x[2] for x in links if x is not worst]
    median = statistics.median(others)
    if worst[2] * th.link_factor > median or worst[3] < th.link_min_busy:
        return None
    ratio = median / worst[2]
    sender = f"{worst[0]} (process {worst[4]})" if worst[4] > 0 else worst[0]
    return Verdict(
        SLOW_LINK, worst[0], worst[1],
        f"FTAR stream {sender} -> {worst[1]} carries {_rate(worst[2])} while busy, and is busy "
        f"{worst[3]:.0%} of the time; the other {len(others)} stream(s) carry {_rate(median)} (median), "
        f"{ratio:.0f}x more",
        confidence=min(1.0, 0.5 + ratio / (4 * th.link_factor)), process=worst[4])


def _silent_process(rep: ProcessReport) -> int:
    """The process of a silent replica to name: its longest-silent process, else its own."""
    return rep.silent_processes[0] if rep.silent_processes else rep.process


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

    silent_roots = sorted((s for s in reach if s in silent), key=lambda s: (-reach[s].count, -silence(s), key(s)))
    if silent_roots:
        root = silent_roots[0]
        rep = by_id[root]
        waiters = sorted(reach[root].waiters, key=key)
        chain = reach[root].chain(root, key)
        dead = rep.declared_dead or rep.heartbeat_age_s >= snap.detect_s
        heard = ("declared dead by the lighthouse" if rep.declared_dead and rep.heartbeat_age_s < 0
                 else f"no heartbeat for {_fmt(rep.heartbeat_age_s)}")
        if rep.silent_processes:
            heard += " from its process(es) " + ", ".join(map(str, rep.silent_processes))
        window = f"(detection window {_fmt(snap.detect_s)})"
        last = f"; its last report: {rep.phase or 'none'} at step {rep.step}" if rep.phase else ""
        evidence = [f"replica {root}: {heard} {window}{last}",
                    f"{len(waiters)} process(es) wait on it ({_names(waiters)})", _why(g, chain, root)]
        confidence = 1.0 if dead else 0.9
        others = silent_roots[1:]
        if others:
            evidence.append(f"also silent and waited on: {_names(others)}")
            if reach[others[0]].count == len(waiters):
                confidence = 0.5
        return Verdict(DEAD if dead else FROZEN, root, "", "; ".join(e for e in evidence if e), confidence, chain,
                       _silent_process(rep))

    # A silent quorum member nobody is shown waiting on yet (e.g. every survivor
    # still computing): still the likeliest culprit once they reach the ring.
    silent_members = sorted((s for s in silent if s in snap.member_set), key=lambda s: (-silence(s), key(s)))

    computes = sorted(r.compute_s for r in snap.reports if r.compute_s >= 0)
    busy_roots = []
    for s, r in reach.items():
        rep = by_id[s]
        if rep.phase in BUSY_PHASES:
            med = _median_without(computes, rep.compute_s)
            base = med if med is not None else 0.0
            if rep.in_phase_s >= max(th.slow_min_s, th.slow_factor * base):
                busy_roots.append((s, r, med))
    link = _slow_link(snap, th)
    if busy_roots and not silent_members:
        busy_roots.sort(key=lambda x: (-x[1].count, -by_id[x[0]].in_phase_s, key(x[0])))
        root, r, med = busy_roots[0]
        rep = by_id[root]
        waiters = sorted(r.waiters, key=key)
        chain = r.chain(root, key)
        base = f"the others' median compute is {_fmt(med)}" if med is not None else "no compute time of the others yet"
        busy = f"replica {root} process {rep.process}" if rep.process > 0 else f"replica {root}"
        evidence = [f"{busy} has been {rep.phase} for {_fmt(rep.in_phase_s)} at step {rep.step} ({base})",
                    f"{len(waiters)} process(es) wait on it ({_names(waiters)})", _why(g, chain, root)]
        confidence = 0.9 if med is not None else 0.6
        if len(busy_roots) > 1:
            evidence.append(f"also busy and waited on: {_names([b[0] for b in busy_roots[1:]])}")
            confidence = min(confidence, 0.5)
        return Verdict(SLOW, root, "", "; ".join(e for e in evidence if e), confidence, chain, rep.process)

    if silent_members:
        root = silent_members[0]
        rep = by_id[root]
        dead = rep.declared_dead or rep.heartbeat_age_s >= snap.detect_s
        return Verdict(DEAD if dead else FROZEN, root, "",
                       f"quorum member {root}: no heartbeat for {_fmt(rep.heartbeat_age_s)} (detection window "
                       f"{_fmt(snap.detect_s)}); nobody reports waiting on it yet",
                       0.8 if dead else 0.6, (root,), _silent_process(rep))

    if link is not None:
        return link

    # No root now: compare the recent forward+backward time of every member.
    computed = [r for r in snap.reports
                if r.compute_s >= 0 and (not snap.members or r.replica in snap.member_set)]
    if len(computed) >= 2:
        worst = min(computed, key=lambda r: (-r.compute_s, key(r.replica)))
        med = _median_without(sorted(r.compute_s for r in computed), worst.compute_s)
        if med is not None and worst.compute_s >= max(th.slow_min_s, th.slow_factor * med):
            ratio = worst.compute_s / med if med > 0 else float("inf")
            return Verdict(SLOW, worst.replica, "",
                           f"replica {worst.replica}'s forward+backward takes {_fmt(worst.compute_s)}, "
                           f"{ratio:.1f}x the others' median {_fmt(med)}: every all-reduce waits for it",
                           0.8, (worst.replica,), worst.process)

    if cyclic:
        ring = sorted(cyclic, key=key)
        return Verdict(UNKNOWN, "", "",
                       f"{_names(ring)} wait on each other in a cycle with no silent, slow or throttled "
                       "member to blame (a ring in progress, or a fault this analysis cannot see)", 0.2)
    n = len(snap.members) or len(snap.reports)
    if QUORUM in g.edges and not g.edges[QUORUM]:
        waiting = sorted((a for a, outs in g.edges.items() if outs == (QUORUM,)), key=key)
        return Verdict(NONE, "", "", f"{_names(waiting)} ask for a quorum and every known member is asking: they "
                                     "wait for the lighthouse's decision (a newcomer's join timeout, or fewer "
                                     "replicas than the job's minimum), not on one another", 1.0)
    return Verdict(NONE, "", "", f"{n} process(es) reporting, none silent, slow or waiting on another", 1.0)
