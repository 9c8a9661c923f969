"""The lighthouse: a gRPC (asyncio) quorum service for many jobs at once.

Each replica asks it for the quorum of its next step (`GetQuorum`, blocking
until the pure decision in :mod:`fthsdp.control.quorum` says yes, or the call's
deadline passes) and heartbeats about every 100 ms. A replica silent for the
detection window is declared dead and listed in every heartbeat reply of its
job, so survivors abort their in-flight all-reduce at once instead of waiting
for its deadline. Jobs are keyed by job id and fully independent.

Run it with ``fthsdp lighthouse --bind 127.0.0.1:0`` or
``python -m fthsdp.control.lighthouse``; it prints ``lighthouse listening on HOST:PORT``.

**Restartable, no standby.** The lighthouse keeps no state that the replicas
cannot give back: every quorum request and heartbeat carries the replica's
step and the last quorum it was a member of (id and members). A lighthouse
restarted on the same address with empty memory therefore rebuilds each job
as its replicas come back (they retry with backoff through the outage, see
:mod:`fthsdp.control.lighthouse_client`): the incumbents it must wait for are the
reported quorum's members, new quorum ids continue above every reported id
(never backwards), and healthy/behind follows from the reported steps, so no
replica trains a step twice or loses one. A hot standby would add a second
source of truth to keep consistent (and a leader election) for what a
restart rebuilds in one round of requests; the outage costs the job only the
restart time, bounded by ``ft.lighthouse_outage_s``. One case a restart cannot
rebuild: a lighthouse killed between writing one member's answer and the
others' leaves the answered members in the step's all-reduce and the rest
asking the restarted lighthouse, which waits for the answered ones (they hold
the newest quorum reported). A heartbeat whose phase report says its process is
in an all-reduce is therefore answered with the replicas asking for a quorum
at or before that step (``asking_replica_ids``): a member of that all-reduce's
quorum among them is not in it, so the process aborts it and asks too (found
by the emulation: a 6 s stall at 64 replicas, the all-reduce's deadline).

**Replicas of several processes.** Every process heartbeats under (replica,
process index, process count) and registers its own FTAR endpoints and state
server (with its heartbeats, until the reply says they are held; the leader's
with its quorum request too). A replica is live only while *all* its
processes are: its last-heard time is the oldest of its processes', so one
process silent past the detection window makes the whole replica dead, with
no help from the replica itself. A replica's request is a candidate only once
every process registered and is live; the decision itself stays over replicas
(:mod:`fthsdp.control.quorum`). The leader (process 0) asks; each answer is
the asker's view (:func:`fthsdp.control.quorum.process_view`), and the other
processes fetch theirs with ``GetView`` once their leader hands them the
quorum id. Views are serialized once per (quorum, shard range) for healthy
askers, so a round stays O(replicas x processes).
**Who is stalling the job.** Heartbeats carry each process's phase report
(:mod:`fthsdp.observe.phase`). Per job, the lighthouse runs the pure
root-cause analysis (:mod:`fthsdp.observe.root_cause`) when a quorum shrinks
(over the old members, before the survivors are answered) and otherwise at
most every ``rca_interval_s`` (and never more often than 20x its own cost),
not per heartbeat: storing a report is one dict assignment. It logs each
change of verdict once and reports the verdict, and the last one that named a
culprit, in ``Status``.

A replica that stops on purpose says goodbye (``Leave``): it is forgotten at
once, never "declared dead", and when it finished the job the lighthouse
remembers the last step, so a replica restarted after the end is told the job
finished instead of being left to train alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import sys
import time
from dataclasses import dataclass, field

import grpc

from fthsdp.addresses import split_host_port
from fthsdp.control import admission, auth, guard, quorum as qm, pacing, session, wire
from fthsdp.control.guard import Refused
from fthsdp.control.server_thread import ServerThread
from fthsdp.control.channel_args import NO_REUSEPORT
from fthsdp.observe import root_cause as rc
from fthsdp.observe.load_metrics import LoadCollector, LoadSnapshot
from fthsdp.observe.verdict_metrics import RootCauseMetrics
from fthsdp.control import sdc
from fthsdp.proto import ENDPOINTS_NOT_HELD, LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as _load_stubs

pb2, pb2_grpc = _load_stubs()
log = logging.getLogger("fthsdp.control.lighthouse")
MAX_ACCUSED = 16  # accused replica ids per quorum request (one per ring neighbour is all an honest one sends)

__all__ = ["LighthouseConfig", "Lighthouse", "LighthouseThread", "quorum_to_proto", "cli"]


@dataclass(frozen=True)
class LighthouseConfig:
    """Server settings; the decision parameters apply to every job."""

    bind: str = "127.0.0.1:0"
    min_replicas: int = 1
    join_timeout_s: float = 1.0
    # Failure-detection window (heartbeat silence -> dead). 0.8 s so that, with
    # 100 ms heartbeats and a 20 ms tick, survivors learn of a death < 1 s after it.
    detect_s: float = 0.8
    num_replicas: int = 0  # default configured replicas per job (0 = replicas seen)
    tick_s: float = 0.02  # re-evaluation period: time alone can complete a quorum
    forget_after_s: float = 600.0  # drop a job silent this long (no replica heard, none waiting)
    # Calls gRPC may hold before this server's event loop takes them (see _server_options).
    max_pending_rpcs: int = 65536
    # Root-cause analysis period per job (also run at once when a quorum shrinks).
    rca_interval_s: float = 0.5
    # The lighthouse secret (fthsdp.control.auth): every call must carry a credential
    # derived from it. None = authentication off, allowed on a loopback bind only
    # (in-process tests; `fthsdp lighthouse --insecure`), with a warning.
    secret: bytes | None = field(default=None, repr=False)
    tls_cert_file: str = ""  # PEM certificate chain and key: serve TLS instead of plain TCP
    tls_key_file: str = ""
    limits: guard.Limits = field(default_factory=guard.Limits)
    # Per-connection, per-host and per-job budgets (fthsdp/control/admission.py): a flood of one
    # client is held back on its own connections instead of slowing every job. None: no budgets.
    fairness: admission.FairnessLimits | None = field(default_factory=admission.FairnessLimits)
    # HOST:PORT where the lighthouse serves its own Prometheus metrics (the root-cause
    # verdicts, fthsdp/observe/verdict_metrics.py); "" = none. Unauthenticated like every
    # /metrics endpoint: it names jobs and replicas, so loopback unless decided otherwise.
    metrics_bind: str = ""
    # Heartbeats a second this lighthouse asks of all its processes together once there are many
    # (fthsdp/control/pacing.py): N beating processes are asked to beat every N / beats_per_s s at
    # most, and the silence window widens to match. 0 = never pace.
    beats_per_s: float = pacing.DEFAULT_BEATS_PER_S

    def __post_init__(self) -> None:
        qm.QuorumConfig(self.min_replicas, self.join_timeout_s, self.detect_s, self.num_replicas)
        pacing.BeatPacer(self.beats_per_s, self.detect_s)  # its checks
        if not (0 < self.tick_s <= 1.0):
            raise ValueError(f"tick_s must be in (0, 1], got {self.tick_s}")
        if not (0 < self.rca_interval_s <= 60):
            raise ValueError(f"rca_interval_s must be in (0, 60] seconds, got {self.rca_interval_s}")
        if not self.forget_after_s > self.detect_s:
            raise ValueError(f"forget_after_s ({self.forget_after_s}) must exceed detect_s ({self.detect_s})")
        if not (isinstance(self.max_pending_rpcs, int) and 1 <= self.max_pending_rpcs <= 1 << 24):
            raise ValueError(f"max_pending_rpcs must be an integer in [1, {1 << 24}] (about two per replica "
                             f"of every job served), got {self.max_pending_rpcs!r}")
        try:
            host, _ = split_host_port(self.bind)
        except ValueError as e:
            raise ValueError(f"bind must be HOST:PORT (e.g. 127.0.0.1:0 for any free port): {e}") from None
        if self.secret is None and not is_loopback(host):
            raise ValueError(f"the lighthouse at {self.bind} would serve without authentication beyond loopback: "
                             "give it a secret (--secret-file, $FTHSDP_LIGHTHOUSE_SECRET_FILE)")
        if self.metrics_bind:
            from fthsdp.observe.metrics import parse_bind

            try:
                parse_bind(self.metrics_bind)
            except ValueError as e:
                raise ValueError(f"metrics_bind: {e}") from None
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("TLS needs both a certificate file and its key file (--tls-cert, --tls-key)")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Field numbers of what view_reply appends by hand (fthsdp.control.wire), from the schema.
_RESPONSE_QUORUM = pb2.QuorumResponse.DESCRIPTOR.fields_by_name["quorum"].number
_QUORUM_NEIGHBOURHOOD = pb2.Quorum.DESCRIPTOR.fields_by_name["neighbourhood"].number
_HEARTBEAT_ASKING = pb2.HeartbeatResponse.DESCRIPTOR.fields_by_name["asking_replica_ids"].number
_QUORUM_NEIGHBOURHOOD_FROM = pb2.Quorum.DESCRIPTOR.fields_by_name["neighbourhood_from"].number
_HEARTBEAT_BEAT_INTERVAL = pb2.HeartbeatResponse.DESCRIPTOR.fields_by_name["beat_interval_ms"].number
# How often the lighthouse recounts its beating processes to set their pace (pacing.BeatPacer).
_PACE_RECOUNT_S = 0.25
_ORPHAN_SWEEP_S = 2.0  # how often groups of replicas whose leader was never heard are looked for


def quorum_to_proto(q: qm.Quorum) -> pb2.Quorum:
    """``q`` on the wire: a full quorum (Status) or a process's view (quorum answers)."""
    if q.ring_neighbours:  # (view_reply appends a neighbourhood to bytes instead)
        p = quorum_to_proto(dataclasses.replace(q, rings=(), ring_neighbours=False))
        p.neighbourhood.extend(pb2.MemberEndpoints(first_shard=q.first_shard, addresses=[r[pos] for r in q.rings])
                               for pos in range(3))
        return p
    return pb2.Quorum(
        quorum_id=q.quorum_id,
        members=[
            pb2.Member(
                replica_id=m.replica_id,
                step=m.step,
                ftar_addresses=list(m.ftar_addresses),
                state_server_address=m.state_server_address,
                local_world_size=m.local_world_size,
                num_processes=m.num_processes,
                rejoining=m.rejoining,
            )
            for m in q.members
        ],
        max_step=q.max_step,
        healthy=list(q.healthy),
        behind=list(q.behind),
        recovery=[pb2.Recovery(replica_id=b, source_replica_ids=list(q.recovery[b])) for b in q.behind
                  if b in q.recovery],
        num_healthy=q.num_healthy,
        num_configured=q.num_configured,
        reason=q.reason,
        rings=[pb2.ShardRing(shard=q.first_shard + j, addresses=list(r)) for j, r in enumerate(q.rings)],
        sources=[pb2.ShardSource(shard=x.shard, replica_id=x.replica_id, state_server_address=x.state_server_address)
                 for x in q.sources],
    )


def verdict_to_proto(v: rc.Verdict, at: float, step: int, now: float) -> pb2.RootCause:
    return pb2.RootCause(kind=v.kind, culprit=v.culprit, peer=v.peer, evidence=v.evidence,
                         confidence=v.confidence, wait_chain=list(v.chain), step=step, age_s=max(0.0, now - at),
                         process=v.process)


_PHASE_NAMES = {n: n.removeprefix("PHASE_").lower().replace("_", "-") for n in pb2.Phase.keys()}


def _process_report(r: str, age_s: float, p, process: int, asking: bool, dead: bool,
                    silent: tuple[int, ...]) -> rc.ProcessReport:
    """One process's report (``p``: its last PhaseReport, None = none yet) as plain data."""
    if p is None:
        return rc.ProcessReport(r, age_s, asking=asking, declared_dead=dead, silent_processes=silent, process=process)
    phase = _PHASE_NAMES.get(pb2.Phase.Name(p.phase), "") if p.phase in pb2.Phase.values() else ""
    return rc.ProcessReport(
        r, age_s, "" if phase == "unknown" else phase, p.step, p.in_phase_s, p.waiting_on, p.waiting_s,
        p.ring_step, p.ring_steps, p.compute_s,
        tuple(rc.StreamRate(s.to_replica, s.bytes_per_s, s.busy_fraction, process) for s in p.streams),
        asking=asking, declared_dead=dead, silent_processes=silent, process=process)


def rca_snapshot(phases: dict, last_seen: dict[str, float], now: float, asking, dead, members, detect_s: float,
                 step: int, groups: dict | None = None, frozen_after_s: float = 0.0,
                 process_phases: dict | None = None) -> rc.JobSnapshot:
    """The root-cause analysis's plain input from the lighthouse's state of one job.

    ``phases``: each replica's leader's last phase report; ``process_phases``: the
    followers' (replica -> process -> report), merged into their replica's
    (root_cause.merge_processes)."""
    reports = []
    groups = groups or {}
    process_phases = process_phases or {}
    for r, seen in last_seen.items():
        silent: tuple[int, ...] = ()
        g = groups.get(r)
        if g is not None:  # the longest silent first
            silent = tuple(sorted(g.silent(now, frozen_after_s), key=lambda q: (g.seen.get(q, g.since), q)))
        lead = _process_report(r, now - seen, phases.get(r), 0, r in asking, r in dead, silent)
        followers = process_phases.get(r)
        if followers and g is not None:
            procs = [lead] + [_process_report(r, now - seen, p, q, r in asking, r in dead, silent)
                              for q, p in sorted(followers.items()) if 0 < q < g.num_processes]
            lead = rc.merge_processes(procs)
        reports.append(lead)
    return rc.JobSnapshot(tuple(reports), tuple(members), detect_s, step)


def _wire(message) -> bytes:
    """Response serializer: a reply built once for many calls arrives as bytes already."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def _server_options(config: LighthouseConfig) -> list[tuple[str, int]]:
    """gRPC server arguments that keep a burst of requests from being dropped.

    The asyncio server takes calls from gRPC's core one at a time, one per turn
    of its event loop; calls that arrive faster wait in the core's pending
    queue. Past ``grpc.server.max_pending_requests`` (default 1,000) the core
    refuses new calls at random, and always past the hard limit (3,000): it
    cancels them before any handler runs, without a log line, and the client
    sees a bare ``CANCELLED``. One round of 2,048 replicas asking at once is
    such a burst: that was the flat lighthouse's lost requests at >= 2,048
    replicas. Both limits are set to ``max_pending_rpcs`` (a replica has at
    most a quorum call and a heartbeat in flight), so the queue is bounded
    and, below the bound, nothing is refused. The core also cancels a call
    left untaken for ``grpc.server_max_unrequested_time_in_server`` (30 s by
    default), which an overloaded lighthouse reaches at 8,192 replicas; the
    caller's own deadline is the bound that matters, so that one is an hour.
    """
    n = config.max_pending_rpcs
    return [("grpc.server.max_pending_requests", n), ("grpc.server.max_pending_requests_hard_limit", n),
            ("grpc.server_max_unrequested_time_in_server", 3600), NO_REUSEPORT]


class _Superseded(Exception):
    """A pending quorum request ended by its replica's newer request, or (``left``) by its Leave."""

    def __init__(self, left: bool = False) -> None:
        super().__init__("left" if left else "superseded")
        self.left = left


def answer_wait_s(remaining_s: float) -> float:
    """How long a quorum request with ``remaining_s`` left of its deadline is waited on: a
    little less, so that the caller gets the lighthouse's reason rather than a bare
    DEADLINE_EXCEEDED from its own timer."""
    return max(0.0, remaining_s - min(0.1, 0.1 * remaining_s))


def _finished_reply(done: "_Finished") -> bytes:
    return pb2.QuorumResponse(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_finished=True,
                              finished_step=done.step, finished_positions=done.positions,
                              finished_last_steps=done.last_steps).SerializeToString()


def _data_state_problem(positions, last_steps) -> str:
    """What is wrong with a Leave's data state ('' if nothing): one position (>= 0) and one
    last step (>= -1, none yet) per replica."""
    if len(positions) != len(last_steps):
        return (f"data_positions has {len(positions)} entries and data_last_steps {len(last_steps)}: "
                "one of each per replica of the job")
    if any(p < 0 for p in positions) or any(t < -1 for t in last_steps):
        return "data_positions must be >= 0 and data_last_steps >= -1 (no step yet)"
    return ""


class _SdcStop(Exception):
    """The job was stopped by a fingerprint mismatch without a majority (the message says which)."""


@dataclass(frozen=True)
class _Finished:
    """The answer to a request of a job that already finished: its last step, and the finished
    model's data state (LeaveRequest.data_positions; empty when the finisher sent none)."""

    step: int
    positions: tuple[int, ...] = ()
    last_steps: tuple[int, ...] = ()


@dataclass
class _Pending:
    request: qm.QuorumRequest
    future: asyncio.Future
    request_id: int = 0  # QuorumRequest.request_id


@dataclass
class _Group:
    """The processes of one replica of several: when each was last heard and what it registered.

    A process not heard yet counts as heard when the group was first heard
    (``since``): it has one detection window to show up, like everyone."""

    num_processes: int
    since: float
    seen: dict[int, float] = field(default_factory=dict)
    ftar: dict[int, tuple[str, ...]] = field(default_factory=dict)
    server: dict[int, str] = field(default_factory=dict)

    def last_seen(self, leader_at: float | None = None) -> float:
        """The oldest of its processes' last-heard times (``leader_at`` overrides process 0's)."""
        t = math.inf
        for p in range(self.num_processes):
            v = leader_at if (p == 0 and leader_at is not None) else self.seen.get(p, self.since)
            t = min(t, v)
        return t

    def silent(self, now: float, window: float) -> list[int]:
        return [p for p in range(self.num_processes) if now - self.seen.get(p, self.since) > window]

    def register(self, process: int, ftar: tuple[str, ...], server: str) -> str | None:
        """Keep ``process``'s own shards' endpoints, or say why not. Every process of a replica
        holds as many shards as its leader: a follower registering another count made the
        replica's endpoint list the wrong length, and cutting any view of a quorum holding it
        raised (every member's GetView failed). The leader's count rules: a follower's that
        differs is refused, and a follower registered before its leader with another count is
        dropped (it registers again, and is refused then, with the reason)."""
        if process == 0:
            for p in [p for p, a in self.ftar.items() if p != 0 and len(a) != len(ftar)]:
                del self.ftar[p]
                self.server.pop(p, None)
        elif 0 in self.ftar and len(ftar) != len(self.ftar[0]):
            return (f"registers {len(ftar)} FTAR endpoint(s) but its leader (process 0) registered "
                    f"{len(self.ftar[0])}: every process of a replica holds the same number of shards (start every "
                    f"process with the same devices per process and --processes-per-replica)")
        self.ftar[process], self.server[process] = ftar, server
        return None

    def last_heard(self) -> float:
        """When any of its processes was last heard (``since`` when none was)."""
        return max(self.seen.values(), default=self.since)

    def endpoints(self, now: float, window: float) -> tuple[tuple[str, ...], tuple[str, ...]] | str:
        """Every shard's endpoint and each process's state server, or why not yet."""
        missing = [p for p in range(self.num_processes) if p not in self.ftar]
        if missing:
            return f"process(es) {missing} have not registered their addresses yet"
        stale = [p for p in self.silent(now, window) if p != 0]
        if stale:
            return f"process(es) {stale} silent > {window:g}s"
        return (tuple(a for p in range(self.num_processes) for a in self.ftar[p]),
                tuple(self.server[p] for p in range(self.num_processes)))

    def shift(self, lag_s: float, before: float) -> None:
        """Times older than ``before`` (a lighthouse stall's start) moved ``lag_s`` later."""
        if self.since < before:
            self.since += lag_s
        shift_heard(self.seen, lag_s, before)


def shift_heard(heard: dict, lag_s: float, before: float) -> None:
    """The one rule for a lighthouse stall of ``lag_s`` that ended at ``before + lag_s``: what was
    heard before it started moves ``lag_s`` later (the stall was not the senders' silence); what
    was heard after is left, or a death right after the stall would be detected that much later."""
    for k, t in heard.items():
        if t < before:
            heard[k] = t + lag_s


@dataclass
class _Setting:
    """A per-replica setting every live replica of a job must agree on.

    Indexed by value, so checking a request is O(1) while the job agrees
    (the usual case) instead of a scan of all its replicas.
    """

    by_replica: dict[str, int] = field(default_factory=dict)
    by_value: dict[int, set[str]] = field(default_factory=dict)

    def set(self, rid: str, value: int | None) -> None:
        old = self.by_replica.get(rid)
        if old == value:
            return
        if old is not None:
            self.by_value[old].discard(rid)
            if not self.by_value[old]:
                del self.by_value[old]
        if value is None:
            self.by_replica.pop(rid, None)
        else:
            self.by_replica[rid] = value
            self.by_value.setdefault(value, set()).add(rid)

    def conflict(self, rid: str, value: int, is_live) -> tuple[str, int] | None:
        """A live replica other than ``rid`` holding a different value, if any."""
        for v, rids in self.by_value.items():
            if v != value:
                for r in sorted(rids, key=qm.ring_key):
                    if r != rid and is_live(r):
                        return r, v
        return None

    def live_values(self, is_live) -> list[int]:
        return [v for v, rids in self.by_value.items() if any(is_live(r) for r in rids)]


@dataclass
class _Job:
    job_id: str
    # replica -> process index -> the process holding it (guard.incarnation_problem)
    incarnations: dict[str, dict[int, str]] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)  # heartbeat or request
    heartbeating: set[str] = field(default_factory=set)  # ever sent a Heartbeat
    last_heartbeat: dict[str, float] = field(default_factory=dict)  # time of its last Heartbeat
    steps: dict[str, int] = field(default_factory=dict)
    local_world_size: _Setting = field(default_factory=_Setting)
    stated_replicas: _Setting = field(default_factory=_Setting)  # num_replicas when stated
    # Processes per replica: every replica of a job has the same P x D shape (a rejoining
    # process fetches its local shards from the matching process of a healthy replica).
    processes: _Setting = field(default_factory=_Setting)
    # What each replica's training state is made of (fthsdp/step/signature.py), when stated.
    state_signature: _Setting = field(default_factory=_Setting)
    pending: dict[str, _Pending] = field(default_factory=dict)
    quorum: qm.Quorum | None = None
    # member -> the request_id of its request that `quorum` answered (Lighthouse.accept_quorum_request:
    # a send of it again, whose answer was lost, is answered from `quorum` at once)
    answered_ids: dict[str, int] = field(default_factory=dict)
    last_reason: str = "no quorum request yet"
    dead: set[str] = field(default_factory=set)
    # Live replicas as of the last tick (+ newcomers since): a request is
    # evaluated at once only when it could complete a quorum (every live
    # replica asking); otherwise the next tick does it. This keeps a burst of
    # N requests at O(N) work instead of O(N^2) (experiments/quorum_scale.py).
    live_hint: int = 0
    eval_scheduled: bool = False
    # The last quorum in wire form, built once and shared by all its members'
    # answers (building it per answer made a round O(N^2)).
    proto_cache: tuple[qm.Quorum, pb2.Quorum] | None = None
    hb_cache: tuple[tuple, bytes] | None = None
    dead_version: int = 0  # bumped whenever `dead` changes (keys hb_cache)
    # Requests ever made pending (with len(pending), it keys asking_cache: a change of the
    # pending set either adds one or removes one without adding), and the last
    # HeartbeatResponse.asking_replica_ids built, as ((added, pending, step), field bytes).
    pending_added: int = 0
    asking_cache: tuple[tuple[int, int, int], bytes] | None = None
    # Evaluation pacing (see Lighthouse._tick_loop).
    last_eval_at: float = 0.0
    last_eval_cost_s: float = 0.0
    # The highest quorum id any replica reported having seen (requests and
    # heartbeats): what a restarted lighthouse continues the ids above.
    qid_floor: int = 0
    reported_qids: dict[str, int] = field(default_factory=dict)  # replica -> last quorum id its heartbeats report
    # The job's last step once a replica left having finished it (None: running), and the
    # finished model's data state as that replica left it (what `finished()` answers).
    finished_step: int | None = None
    finished_data: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    last_activity: float = 0.0  # any RPC of this job (a job whose replicas all left is kept a while)
    # Replicas of several processes (replica id -> its processes); one-process replicas have none.
    # Changed only through set_group / drop_group, which keep follower_processes.
    groups: dict[str, _Group] = field(default_factory=dict)
    # Processes of the groups beyond their leaders that were heard: the job's admission budget
    # counts them on every request (summing over the groups there made a round O(replicas^2)).
    # Heard, not declared: a follower's heartbeat stating num_processes=4096 under fresh ids
    # added thousands of calls a second to its job's budget each.
    follower_processes: int = 0
    # The last few decided quorums by id (GetView answers a follower about its leader's quorum).
    decided: dict[int, qm.Quorum] = field(default_factory=dict)
    # Each leader's last FTAR endpoints, as one tuple object reused while a request repeats
    # them: the decision compares every member's endpoints with the last quorum's, and fresh
    # strings cost it ~10 ms at 16 x 6,250 (the same object compares at once).
    # replica -> its leader's FTAR endpoints and state server, as last sent (a request with
    # endpoints_held stands for these)
    endpoints: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    # Serialized views of the current quorum, per (shard range, behind replica or None).
    view_cache: dict[tuple, bytes] = field(default_factory=dict)
    view_cache_of: qm.Quorum | None = None
    view_members: dict[str, qm.Member] = field(default_factory=dict)
    # (first shard, shards, member rank) -> that member's MemberEndpoints of those shards, encoded
    # as a Quorum.neighbourhood field (view_cache_of's; built once, appended to three answers)
    view_endpoints: dict[tuple[int, int, int], bytes] = field(default_factory=dict)
    held_members_of: qm.Quorum | None = None  # the earlier quorum ring deltas are built against
    held_members: dict[str, qm.Member] = field(default_factory=dict)
    # Root-cause analysis: each process's last phase report, the verdict now
    # and the last one that named a culprit, as (verdict, monotonic time, step).
    phases: dict[str, pb2.PhaseReport] = field(default_factory=dict)
    # The followers' (process index > 0 of a replica of several): replica -> process -> report.
    process_phases: dict[str, dict[int, pb2.PhaseReport]] = field(default_factory=dict)
    verdict: tuple[rc.Verdict, float, int] | None = None
    last_stall: tuple[rc.Verdict, float, int] | None = None
    last_rca_at: float = 0.0
    last_rca_cost_s: float = 0.0
    # Silent-data-corruption check: the replicas' state fingerprints per step, verdicts,
    # condemned replicas (fthsdp/control/sdc.py), and where each replica serves /metrics.
    sdc: sdc.SdcTracker = field(default_factory=sdc.SdcTracker)
    metrics_addresses: dict[str, dict[int, str]] = field(default_factory=dict)  # replica -> process -> addr
    # Replicas left out of the next quorum (admitted accusations of breaking FTAR's protocol,
    # fthsdp.control.quorum.admit_accusation) and each accuser's last admitted accusation.
    excluded: set[str] = field(default_factory=set)
    accused_at: dict[str, int] = field(default_factory=dict)
    # Which quorum last decided each step: a requester whose state forked from it is
    # fenced (behind) by the decision (rule 6 of fthsdp.control.quorum).
    lineage: qm.Lineage = field(default_factory=qm.Lineage)
    # The first quorum id this lighthouse decided for the job (0: none yet). Entries the
    # replicas report below it are from before a lighthouse restart: merged into the
    # lineage (each replica's last quorum id at its report kept: a repeated one is not read).
    lineage_from: int = 0
    lineage_reports: dict[str, int] = field(default_factory=dict)  # replica -> its last quorum id when it reported

    def finished(self) -> _Finished:
        """The answer to whoever asks after the job finished."""
        return _Finished(self.finished_step, *self.finished_data)

    def set_group(self, rid: str, g: "_Group") -> None:
        self.drop_group(rid)
        self.groups[rid] = g
        self.follower_processes += sum(1 for p in g.seen if p > 0)

    def heard_process(self, g: "_Group", process: int, now: float) -> None:
        """``g``'s ``process`` was heard (counted once for the job's budget, if a follower)."""
        if process > 0 and process not in g.seen:
            self.follower_processes += 1
        g.seen[process] = now

    def drop_group(self, rid: str) -> None:
        g = self.groups.pop(rid, None)
        if g is not None:
            self.follower_processes -= sum(1 for p in g.seen if p > 0)

    def quorum_proto(self, q: qm.Quorum) -> pb2.Quorum:
        if self.proto_cache is None or self.proto_cache[0] is not q:
            self.proto_cache = (q, quorum_to_proto(q))
        return self.proto_cache[1]

    def remember(self, q: qm.Quorum) -> None:
        """Keep the last few decided quorums (a follower's GetView names its leader's)."""
        self.decided[q.quorum_id] = q
        while len(self.decided) > 8:
            del self.decided[min(self.decided)]

    def view_reply(self, q: qm.Quorum, rid: str, process: int, stats: dict, holds_view: bool = False,
                   compact_ok: bool = False, held: qm.Quorum | None = None, neighbours: bool = False) -> bytes:
        """The serialized QuorumResponse for process ``process`` of member ``rid``: its view
        (:func:`fthsdp.control.quorum.process_view`). Built once per decision and shard range
        for healthy askers (the same bytes for every replica's process p: building it per
        call made a round O(N^2): at 8,192 members, 9 ms per call), per asker when behind.
        ``holds_view``: the asker holds this quorum id's view already; a healthy asker then
        gets it without the rings (``rings_omitted``): O(members) instead of O(members x
        shards), 10 KB instead of 1.45 MB per leader at 512 replicas x 196 shards.
        ``compact_ok``: the asker accepts ``members_omitted``; when it holds the view and
        every member is healthy (the steady state) the answer is then O(1), about 100
        bytes, instead of O(members): 400 KB per answer, 3.3 GB per round at 8,192 flat
        replicas, which gRPC copied and the clients received. ``held``: the earlier quorum
        whose view the asker holds (its last, when it accepts ring deltas): the rings then go
        as a delta against that view (``rings_from``), O(changed members x shards), when the
        asker's shards are the same in both. ``neighbours``: the asker takes its rings as its
        ring neighbourhood, its own and its two neighbours' endpoints (``Quorum.neighbourhood``,
        :func:`fthsdp.control.quorum.ring_neighbourhood`): the part every asker shares is built
        once as above, and the asker's neighbourhood is appended to it (protobuf merges the two
        ``quorum`` fields into one; :mod:`fthsdp.control.wire`): three members' endpoints, each
        encoded once per decision, so an asker costs a few byte joins, not O(members x shards).
        With ``held`` (the asker's last quorum) and the same neighbourhood there
        (:func:`fthsdp.control.quorum.same_neighbourhood`), only that quorum's id is appended
        (``neighbourhood_from``)."""
        if self.view_cache_of is not q:
            self.view_cache, self.view_cache_of = {}, q
            self.view_members = {x.replica_id: x for x in q.members}
            self.view_endpoints = {}
        m = self.view_members[rid]
        per = max(1, m.local_world_size // max(1, m.num_processes))
        first = process * per
        behind = rid if rid in q.recovery else None
        lean = holds_view and behind is None
        compact = lean and compact_ok and not q.behind
        neighbours = neighbours and not lean
        if held is not None and (lean or held.quorum_id == q.quorum_id or not self._same_shards(held, rid, m)):
            held = None
        # a neighbour view needs no delta; the held view may let it leave the neighbourhood out
        held_near, held = (held, None) if neighbours else (None, held)
        key = (first, per, behind, lean, compact, held.quorum_id if held is not None else 0, neighbours)
        raw = self.view_cache.get(key)
        if raw is None:
            if compact:
                proto = pb2.Quorum(quorum_id=q.quorum_id, max_step=q.max_step, num_healthy=q.num_healthy,
                                   num_configured=q.num_configured, reason=q.reason, rings_omitted=True,
                                   members_omitted=True)
            else:
                # A lean view is cut with no shards at all: building its rings only to drop
                # them cost 28 ms per decision at 16 x 6,250 (behind is None: no sources either).
                view = qm.process_view(q, rid, first, 0 if lean else per, rings=not neighbours)
                changed = qm.ring_changes(held, q, first, per) if held is not None else ()
                proto = quorum_to_proto(qm.delta_view(view, changed) if held is not None else view)
                proto.rings_omitted = lean
                if held is not None:
                    proto.rings_from = held.quorum_id
                    proto.ring_members.extend(changed)
            raw = pb2.QuorumResponse(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, quorum=proto,
                                     endpoints_omittable=True).SerializeToString()
            if key[2] is None:
                self.view_cache[key] = raw
            stats["replies_serialized"] += 1
        if neighbours and held_near is not None and qm.same_neighbourhood(q, held_near, rid, first, per):
            kept = wire.varint_field(_QUORUM_NEIGHBOURHOOD_FROM, held_near.quorum_id)
            raw += wire.field_bytes(_RESPONSE_QUORUM, kept)
            stats["replies_neighbourhood_kept"] += 1
        elif neighbours:
            near = b"".join(self._member_endpoints(q, first, per, r)
                            for r in qm.ring_neighbourhood(len(q.members), q.rank_of(rid)))
            raw += wire.field_bytes(_RESPONSE_QUORUM, near)
            stats["replies_ring_neighbours"] += 1
        stats["replies_sent"] += 1
        stats["replies_rings_omitted"] += lean
        stats["replies_members_omitted"] += compact
        stats["replies_ring_delta"] += held is not None
        return raw

    def _member_endpoints(self, q: qm.Quorum, first: int, per: int, rank: int) -> bytes:
        """Member ``rank``'s endpoints of shards ``first`` .. ``+per-1`` as a ``Quorum.neighbourhood``
        field (one of :func:`fthsdp.control.quorum.ring_neighbourhood`'s), encoded once per decision."""
        key = (first, per, rank)
        raw = self.view_endpoints.get(key)
        if raw is None:
            m = q.members[rank]
            qm.check_shards(m, first, per)
            body = pb2.MemberEndpoints(first_shard=first, addresses=m.ftar_addresses[first:first + per])
            raw = self.view_endpoints[key] = wire.field_bytes(_QUORUM_NEIGHBOURHOOD, body.SerializeToString())
        return raw

    def _same_shards(self, held: qm.Quorum, rid: str, m: qm.Member) -> bool:
        """Whether ``rid`` held the same shards in quorum ``held`` as ``m`` says it holds now (its
        view of ``held`` has the rings a delta is built against)."""
        if self.held_members_of is not held:
            self.held_members_of, self.held_members = held, {x.replica_id: x for x in held.members}
        was = self.held_members.get(rid)
        return was is not None and (was.local_world_size, was.num_processes) == (m.local_world_size, m.num_processes)

    def heartbeat_reply(self, registered: bool = True) -> bytes:
        """The serialized HeartbeatResponse: the same for every replica until the dead
        set or the quorum changes (building it per heartbeat was O(members))."""
        key = (self.quorum, self.dead_version, registered)
        if self.hb_cache is None or self.hb_cache[0] != key:
            dead = sorted(self.dead, key=qm.ring_key)
            members = set(self.quorum.member_ids) if self.quorum is not None else set()
            resp = pb2.HeartbeatResponse(
                protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, dead_replica_ids=dead,
                quorum_id=self.quorum.quorum_id if self.quorum is not None else 0,
                dead_members=[r for r in dead if r in members], addresses_registered=registered)
            self.hb_cache = (key, resp.SerializeToString())
        return self.hb_cache[1]

    def asking_field(self, step: int) -> bytes:
        """``HeartbeatResponse.asking_replica_ids`` for a process in the all-reduce of ``step``:
        the replicas with a quorum request pending at a step <= ``step``, as fields appended to
        the shared reply (empty when none). Built once per pending set and step: every member
        of a running all-reduce beats while the next round's requests arrive (their steps are
        later, so the list is empty but was still a scan of every pending request)."""
        key = (self.pending_added, len(self.pending), step)
        if self.asking_cache is None or self.asking_cache[0] != key:
            raw = b"".join(wire.field_bytes(_HEARTBEAT_ASKING, rid.encode())
                           for rid, p in self.pending.items() if p.request.step <= step)
            self.asking_cache = (key, raw)
        return self.asking_cache[1]


def _reads_lineage(job: "_Job", rid: str, last_quorum_id: int) -> bool:
    """Whether a quorum request's lineage entries may be news to ``job``: it was not decided
    by this lighthouse from its quorum 1 (``lineage_from != 1``: it restarted, or has decided
    nothing yet), and the replica's last quorum id changed since it last reported (its
    entries change only when it is answered a new quorum id, which becomes its last one).
    Two int compares, without touching the request's entries: the common case, a lighthouse
    that decided the job's quorum 1 itself, never reads them."""
    return job.lineage_from != 1 and job.lineage_reports.get(rid) != last_quorum_id


def _asking(job: _Job, request: pb2.HeartbeatRequest) -> bytes:
    """What a heartbeat's reply adds for a process in an all-reduce: the replicas asking for a
    quorum at or before its step (``HeartbeatResponse.asking_replica_ids``); nothing otherwise."""
    if job.pending and request.HasField("phase") and request.phase.phase == pb2.PHASE_ALLREDUCE:
        return job.asking_field(request.phase.step)
    return b""


def _version_error(v: int) -> str | None:
    if v == LIGHTHOUSE_PROTOCOL_VERSION:
        return None
    if v == 0:
        return (
            f"protocol_version is missing: this lighthouse speaks version {LIGHTHOUSE_PROTOCOL_VERSION}; "
            "use fthsdp's LighthouseClient or set protocol_version"
        )
    return (
        f"client speaks lighthouse protocol version {v}, this lighthouse speaks "
        f"{LIGHTHOUSE_PROTOCOL_VERSION}: run the same fthsdp version on replicas and lighthouse"
    )


def _endpoints_error(who: str, num_processes: int, process_index: int, local_world_size: int,
                    ftar_addresses, required: bool, held: bool = False) -> str | None:
    """What is wrong with a process's (replica, process) identity and its own shards' endpoints.
    ``held``: the endpoints are the ones this lighthouse holds for the replica, checked when they
    came (their count is still checked against this request's shape; the scan for an empty one,
    ~1.5 us at 196 shards, is not repeated on every request)."""
    n = num_processes or 1
    if n < 1:
        return f"num_processes is {num_processes} ({who}): it must be the replica's process count, >= 1 (0 = 1)"
    if not 0 <= process_index < n:
        return f"process_index {process_index} is outside 0..{n - 1} ({who}, num_processes {n})"
    if not required and not ftar_addresses:
        return None
    if local_world_size < 1:
        return f"local_world_size is {local_world_size} ({who}): it must be the number of devices (shards) per replica, >= 1"
    if local_world_size % n:
        return (f"local_world_size {local_world_size} is not a multiple of num_processes {n} ({who}): every "
                "process of a replica holds the same number of shards")
    if len(ftar_addresses) != local_world_size // n:
        return (
            f"ftar_addresses has {len(ftar_addresses)} entries but local_world_size is {local_world_size} over "
            f"{n} process(es) ({who}): send one FTAR endpoint (host:port) per shard of this process"
        )
    if not held and "" in ftar_addresses:  # one C-level scan (a tuple: the leader's are converted once per request)
        return f"ftar_addresses contains an empty address ({who}): every shard needs host:port"
    return None


class Lighthouse(pb2_grpc.LighthouseServicer):
    """The server. Use :meth:`start`/:meth:`stop` inside a running asyncio loop."""

    def __init__(self, config: LighthouseConfig | None = None) -> None:
        self.config = config or LighthouseConfig()
        self._jobs: dict[str, _Job] = {}
        self._server: grpc.aio.Server | None = None
        self._tick_task: asyncio.Task | None = None
        self.port: int = 0
        # Where the time goes (tests and experiments read these counters).
        self.stats = {"decisions": 0, "evaluations": 0, "evaluation_s": 0.0, "replies_serialized": 0,
                      "replies_sent": 0, "replies_rings_omitted": 0, "replies_members_omitted": 0, "replies_ring_delta": 0,
                      "replies_ring_neighbours": 0, "replies_neighbourhood_kept": 0,
                      "stalls": 0, "rca_runs": 0, "rca_s": 0.0,
                      "sdc_mismatches": 0, "refused": 0, "forgotten_dead": 0,
                      "sessions_opened": 0, "session_messages": 0, "relay_batches": 0,
                      "sessions_open": 0, "relay_streams_open": 0, "relayed_messages": 0, "requests_endpoints_held": 0,
                      "endpoints_not_held": 0, "answers_resent": 0, "heartbeats": 0}
        self._auth = guard.CallAuthenticator(self.config.secret, limits=self.config.limits)
        # The verdicts as Prometheus series, served on config.metrics_bind (start()).
        self.rca_metrics = RootCauseMetrics()
        self.metrics_server = None
        self._new_ids = guard.NewIdRate(self.config.limits.new_ids_per_s, self.config.limits.new_ids_burst)
        self._admission = admission.Admission(self.config.fairness) if self.config.fairness is not None else None
        # Limits and credentials are checked in front of every handler (fthsdp.control.guard),
        # one gate for both transports; it also counts the refusals (load_snapshot).
        self._gate = guard.CallGate(self._auth, self.config.limits, self._admission, self._job_size)
        self._started = time.monotonic()  # the load's uptime
        self.rca_metrics.registry.register(LoadCollector(self.load_snapshot))
        # The processes' beat pace and the silence window that goes with it (recounted each
        # _PACE_RECOUNT_S by the tick): every liveness judgement reads self.detect_s.
        self._pacer = pacing.BeatPacer(self.config.beats_per_s, self.config.detect_s, started_at=self._started)
        self._pace_bytes = b""  # HeartbeatResponse.beat_interval_ms, appended to every beat's reply
        self._paced_at = -math.inf
        self._orphans_swept_at = -math.inf
        self._beating = 0  # the processes beating it at the last count (load_snapshot reads it)

    # -- lifecycle ---------------------------------------------------------

    def load_snapshot(self) -> LoadSnapshot:
        """What the budgets and checks held back and refused, and the quorum decision's cost, now
        (read by the metrics exporter's thread at each scrape: dict copies, no lock needed)."""
        st, adm = dict(self.stats), self._admission
        return LoadSnapshot(held_total=adm.stats["held"] if adm else 0, held_now=adm.held_total if adm else 0,
                            refused_by_code=dict(self._gate.refused),
                            connection_budget_calls_per_s=adm.limits.connection_calls_per_s if adm else 0.0,
                            sessions_opened=st["sessions_opened"], session_messages=st["session_messages"],
                            relay_batches=st["relay_batches"], sessions_open=st["sessions_open"],
                            relay_streams_open=st["relay_streams_open"], relayed_messages=st["relayed_messages"],
                            evaluations=st["evaluations"], evaluation_s=st["evaluation_s"], jobs=len(self._jobs),
                            heartbeats=st["heartbeats"], beating_processes=self._beating, detect_s=self.detect_s,
                            beat_interval_s=self._pacer.interval_s,
                            uptime_s=time.monotonic() - self._started, cpu_s=time.process_time())

    @property
    def address(self) -> str:
        host = self.config.bind.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Bind and serve; returns the bound port (useful with port 0)."""
        c = self.config
        self._server = grpc.aio.server(options=[*_server_options(c),
                                                 ("grpc.max_receive_message_length", c.limits.max_request_bytes)])
        # _wire is every response serializer (a reply built once arrives as bytes).
        # The session stream (fthsdp.control.session): the same calls as messages of one stream per process.
        self._server.add_generic_rpc_handlers((guard.generic_handler(pb2, self, self._gate, _wire),
                                               session.generic_handler(self, self._gate)))
        if c.secret is None:
            log.warning("lighthouse on %s serves WITHOUT authentication (loopback only): anyone on this machine "
                        "can join, steer or read its jobs", c.bind)
        try:
            if c.tls_cert_file:
                with open(c.tls_key_file, "rb") as k, open(c.tls_cert_file, "rb") as crt:
                    creds = grpc.ssl_server_credentials([(k.read(), crt.read())])
                self.port = self._server.add_secure_port(c.bind, creds)
            else:
                self.port = self._server.add_insecure_port(c.bind)
        except RuntimeError as e:
            raise OSError(f"lighthouse cannot bind {self.config.bind}: {e} (is the port in use?)") from e
        if self.port == 0:
            raise OSError(f"lighthouse cannot bind {self.config.bind} (is the port in use?)")
        # Its replay memory starts empty: calls signed before now are refused (retried afresh), but
        # for a second's grace, so that a client whose clock is a little behind is not refused for
        # that long after every restart (a replay captured in that second goes through).
        self._auth.replays.started(time.time() - auth.START_GRACE_S)
        await self._server.start()
        if c.metrics_bind:
            from fthsdp.observe.metrics import serve as serve_metrics

            try:
                self.metrics_server = serve_metrics(self.rca_metrics.registry, c.metrics_bind)
            except OSError as e:
                await self._server.stop(0)
                self._server = None
                raise OSError(f"lighthouse cannot serve its metrics on {c.metrics_bind}: {e} (is the port in use?)") from e
            log.info("lighthouse metrics on http://%s/metrics", self.metrics_server.address)
            if not is_loopback(self.metrics_server.host):
                log.warning("lighthouse metrics on %s are served without authentication beyond loopback: anyone "
                            "who reaches it reads the job and replica names and the verdicts", c.metrics_bind)
        self._tick_task = asyncio.get_running_loop().create_task(self._tick_loop())
        log.info("lighthouse serving on %s (%s)", self.address, self.config)
        return self.port

    async def stop(self, grace_s: float = 0.2) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
            try:
                await self._tick_task
            except asyncio.CancelledError:
                pass
            self._tick_task = None
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()

    # -- state ---------------------------------------------------------------

    def _job_size(self, job_id: str) -> int:
        """Processes registered by job ``job_id`` (its budget in fthsdp.control.admission follows it)."""
        job = self._jobs.get(job_id)
        if job is None:
            return 0
        return len(job.last_seen) + job.follower_processes

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job(job_id)
            log.info("new job %r", job_id)
        job.last_activity = time.monotonic()
        return job

    def _liveness(self, job: _Job, now: float) -> dict[str, float]:
        """Last-heard times; a waiting requester that does not heartbeat counts as heard now.

        Its open call is its sign of life (a killed process's call is cancelled
        by the kernel closing its socket). That covers a restarted replica too:
        it asks before it starts heartbeating (so it is never a "live newcomer
        not asking" that the others wait for), and its id's last heartbeat, from
        the killed process, predates its request by more than the detection
        window. Replicas that heartbeat while they ask are judged by their
        heartbeats alone, so a stopped process is detected.
        """
        silent_waiters = [r for r, p in job.pending.items() if self._asks_without_beats(job, r, p)]
        if not silent_waiters:
            return job.last_seen
        view = dict(job.last_seen)
        for r in silent_waiters:
            g = job.groups.get(r)  # its open call speaks for its leader only, not for silent followers
            view[r] = now if g is None else g.last_seen(leader_at=now)
        return view

    def _asks_without_beats(self, job: _Job, rid: str, pending: "_Pending") -> bool:
        """Whether ``rid``'s open request is its sign of life (:meth:`_liveness`): it never
        heartbeat, or its id's last heartbeat (a killed process's) predates the request by more
        than the detection window (a restarted replica asks before it beats)."""
        return (rid not in job.heartbeating
                or job.last_heartbeat.get(rid, -math.inf) < pending.request.arrived_at - self.detect_s)

    def _decision_config(self, job: _Job) -> qm.QuorumConfig:
        stated = next(iter(job.stated_replicas.by_value), 0)
        c = self.config
        return qm.QuorumConfig(c.min_replicas, c.join_timeout_s, self.detect_s, stated or c.num_replicas)

    def _evaluate(self, job: _Job) -> None:
        job.eval_scheduled = False
        if not job.pending:
            return
        now = time.monotonic()
        if job.finished_step is not None:  # nothing left to train: say so to whoever still asks
            for rid, p in list(job.pending.items()):
                del job.pending[rid]
                if not p.future.done():
                    p.future.set_result(job.finished())
            return
        requests, waiting_note = self._candidate_requests(job, now)
        if self._sdc_hold(job, now, requests):
            return
        t0 = time.perf_counter()
        quorum, reason = qm.decide_quorum(
            requests, self._liveness(job, now), job.quorum, self._decision_config(job), now,
            quorum_id_floor=job.qid_floor, reported_quorum_ids=job.reported_qids,
            condemned=job.sdc.condemned, excluded=job.excluded, lineage=job.lineage,
        )
        job.last_eval_at, job.last_eval_cost_s = now, time.perf_counter() - t0
        self.stats["evaluations"] += 1
        self.stats["evaluation_s"] += job.last_eval_cost_s
        job.last_reason = reason + waiting_note
        if quorum is None:
            return
        if job.quorum is None or quorum.quorum_id != job.quorum.quorum_id:
            log.info("job %r: %s", job.job_id, reason)
        if job.quorum is not None and set(job.quorum.member_ids) - set(quorum.member_ids):
            # The quorum shrinks: who was lost, judged over the old members while
            # the survivors' requests are still open (they wait on the lost ones).
            try:
                self._root_cause(job, now, job.quorum.member_ids)
            except Exception:  # an analysis bug must never keep a quorum from its members
                log.exception("job %r: root-cause analysis failed", job.job_id)
        if "fenced, behind" in reason:
            log.warning("job %r: %s", job.job_id, reason)
        job.quorum = quorum
        job.lineage = job.lineage.after_quorum(quorum)
        if job.lineage_from == 0:
            job.lineage_from = quorum.quorum_id
        job.remember(quorum)
        job.excluded.clear()  # an exclusion lasts for exactly one quorum
        self.stats["decisions"] += 1
        job.sdc.forget_after(quorum.max_step)  # reports of later steps are of a forked lineage (rule 6)
        job.sdc.set_voters(quorum.max_step + 1, quorum.member_ids)  # who will hold the state it commits
        job.answered_ids = {}
        for rid in quorum.member_ids:
            p = job.pending.pop(rid)
            job.answered_ids[rid] = p.request_id
            # Its call was open until this answer: heard now. Judging it by its request's
            # arrival instead declared members dead when answering a large quorum took
            # longer than the detection window (the emulation found this at 4,096 replicas:
            # a lone late requester then formed a quorum of one, split brain).
            g = job.groups.get(rid)
            if g is None:
                job.last_seen[rid] = now
            else:
                g.seen[0] = now
                job.last_seen[rid] = g.last_seen()
            if not p.future.done():
                p.future.set_result(quorum)

    def _sdc_hold(self, job: _Job, now: float, requests: dict) -> bool:
        """Judge the job's fingerprints before a quorum decision (fthsdp/control/sdc.py).
        True when no quorum may be decided now: the job was stopped (every pending request
        is answered with the error), or the requesters' states disagree and a voter that
        could settle it has not reported yet."""
        if not job.sdc.needs_update and job.sdc.fatal is None and not job.sdc.any_pending:
            return False  # nothing new to judge (the common case: one dict check per evaluation)
        alive = (set(job.last_seen) - job.dead) | set(requests)
        for v in job.sdc.update(alive):
            log.error("job %r: %s", job.job_id, v.reason)
            self.stats["sdc_mismatches"] += 1
        if job.sdc.fatal is not None:
            for rid, p in list(job.pending.items()):
                del job.pending[rid]
                if not p.future.done():
                    p.future.set_exception(_SdcStop(job.sdc.fatal.reason))
            job.last_reason = f"job stopped: {job.sdc.fatal.reason}"
            return True
        for step in sorted({r.step for r in requests.values()}):
            v = job.sdc.pending(step)
            if v is not None:
                job.last_reason = v.reason
                return True
        return False

    def _candidate_requests(self, job: _Job, now: float) -> tuple[dict[str, qm.QuorumRequest], str]:
        """The pending requests the decision may use: a replica of several processes asks
        only once every process registered its addresses and is live (its request is then
        completed with all of them); until then it is live but not asking."""
        out: dict[str, qm.QuorumRequest] = {}
        notes = []
        for r, p in job.pending.items():
            if p.future.done():  # its caller was answered or gave up: it cannot be told of a quorum
                continue
            g = job.groups.get(r)
            if g is None:
                out[r] = p.request
                continue
            ep = g.endpoints(now, self.detect_s)
            if isinstance(ep, str):
                notes.append(f"replica {r}: {ep}")
                continue
            if len(ep[0]) != p.request.local_world_size:
                # Its processes' endpoints must add up to the shards its leader asked with: a member
                # with fewer failed every other member's view of the quorum (a ValueError in its
                # handler, the answer lost) and more would stand in other members' rings.
                notes.append(f"replica {r}: its {g.num_processes} process(es) registered {len(ep[0])} FTAR "
                             f"endpoint(s) in all, its request has local_world_size={p.request.local_world_size} "
                             "(start every process of it with the same --devices-per-replica)")
                continue
            out[r] = dataclasses.replace(p.request, ftar_addresses=ep[0], state_server_addresses=ep[1],
                                         state_server_address=ep[1][0], num_processes=g.num_processes)
        note = ("; not asking until all its processes registered: " + "; ".join(notes[:4])
                + (" ..." if len(notes) > 4 else "")) if notes else ""
        return out, note

    def _group(self, job: _Job, rid: str, num_processes: int, now: float) -> _Group:
        g = job.groups.get(rid)
        if g is None or g.num_processes != num_processes:
            g = _Group(num_processes, now)
            job.set_group(rid, g)
        return g

    def _root_cause(self, job: _Job, now: float, members: tuple[str, ...] | None = None) -> rc.Verdict:
        """Runs the analysis over the job's last reports; logs and keeps the verdict."""
        t0 = time.perf_counter()
        view = self._liveness(job, now)
        if members is None:
            members = job.quorum.member_ids if job.quorum is not None else ()
        frozen_after_s = self.detect_s / 2
        snap = rca_snapshot(job.phases, view, now, job.pending, job.dead, members, self.detect_s,
                            max(job.steps.values(), default=0), job.groups, frozen_after_s, job.process_phases)
        verdict = rc.analyse(snap, rc.Thresholds(frozen_after_s=frozen_after_s))
        job.last_rca_at, job.last_rca_cost_s = now, time.perf_counter() - t0
        self.stats["rca_runs"] += 1
        self.stats["rca_s"] += job.last_rca_cost_s
        old = job.verdict[0] if job.verdict is not None else None
        self.rca_metrics.observe(job.job_id, verdict)
        if old is None or old.key != verdict.key:
            job.verdict = (verdict, now, snap.step)
            if verdict.kind == rc.NONE:
                if old is not None:
                    log.info("job %r: root cause: %s", job.job_id, verdict.describe())
            else:
                log.warning("job %r: root cause: %s", job.job_id, verdict.describe())
        elif verdict.evidence != old.evidence:  # same culprit, fresher evidence: keep its first time
            job.verdict = (verdict, job.verdict[1], job.verdict[2])
        if verdict.kind not in (rc.NONE, rc.UNKNOWN):
            job.last_stall = job.verdict
        return verdict

    def _root_cause_logged(self, job: _Job, now: float) -> None:
        """The analysis, its errors logged (an analysis bug must never stop quorums): at its
        interval, and at once when the dead set changes. A replica
        of several processes is declared dead while the lighthouse still knows which of its
        processes went silent; its leader then leaves (replica-fatal) and that is gone. At
        the interval (0.5 s) the verdict named the process only when a run happened to fall
        between half the detection window and the death (a 0.4 s gap), or before the leave."""
        try:
            self._root_cause(job, now)
        except Exception:  # an analysis bug must never stop quorums
            job.last_rca_at = now
            log.exception("job %r: root-cause analysis failed", job.job_id)

    def _accuse(self, job: _Job, accuser: str, quorum_id: int, accused) -> None:
        """Admit or ignore (with the reason, logged) each accusation of a quorum request."""
        for target in accused:
            ok, why = qm.admit_accusation(qm.Accusation(accuser, str(target), quorum_id), job.quorum,
                                          job.excluded, job.accused_at)
            if ok:
                job.excluded.add(str(target))
                job.accused_at[accuser] = quorum_id
                log.warning("job %r: %s", job.job_id, why)
            else:
                log.warning("job %r: accusation of %r by %s ignored: %s", job.job_id, str(target)[:64], accuser, why)

    def _heard(self, job: _Job, rid: str, now: float, process: int = 0, num_processes: int = 1) -> None:
        """``rid``'s process ``process`` was heard. A replica of several processes is as
        fresh as its stalest process; a follower alone never makes its replica known (its
        leader's first request or heartbeat does) nor brings a dead one back."""
        if num_processes > 1:
            g = self._group(job, rid, num_processes, now)
            job.heard_process(g, process, now)
            t = g.last_seen()
            if process != 0:
                if rid in job.last_seen and rid not in job.dead:
                    job.last_seen[rid] = t
                return
            if rid in job.dead and now - t > self.detect_s:
                job.last_seen[rid] = t  # its leader is back, a follower is not (yet): still dead
                return
        else:
            if process == 0:
                job.drop_group(rid)
            t = now
        if rid not in job.last_seen or rid in job.dead:
            job.live_hint += 1
            if rid in job.dead:
                job.dead.discard(rid)
                job.dead_version += 1
                log.info("job %r: replica %s is back", job.job_id, rid)
        job.last_seen[rid] = t

    def _expected(self, job: _Job) -> int:
        """Requests that could complete a quorum now (every live replica asking)."""
        if job.quorum is not None:
            expected = job.live_hint - len(job.quorum.left_out)
        else:  # before the first quorum, a stated replica count is the better guess
            expected = max(job.live_hint, next(iter(job.stated_replicas.by_value), 0))
        return max(expected, self.config.min_replicas)

    def _tick_should_evaluate(self, job: _Job, now: float, dead_changed: bool) -> bool:
        """Whether this tick re-decides ``job``: when the dead set changed or every
        expected request is in; otherwise (only time can change the answer: a join
        timeout, a restart grace) at most every 10x the last decision's cost, so
        that with thousands of replicas asking the tick does not spend the
        lighthouse's CPU re-deciding the same "not yet" every 20 ms."""
        if dead_changed or len(job.pending) >= self._expected(job):
            return True
        return now - job.last_eval_at >= max(self.config.tick_s, 10 * job.last_eval_cost_s)

    def _schedule_evaluation(self, job: _Job) -> None:
        # Coalesce: many requests arriving together cost one evaluation.
        if not job.eval_scheduled:
            job.eval_scheduled = True
            asyncio.get_running_loop().call_soon(self._evaluate, job)

    def _update_dead(self, job: _Job, now: float) -> list[str]:
        """Recompute the job's dead set (each tick). While nobody is dead and even the
        stalest last-heard time is within the window, nobody can be (the liveness view
        only raises times): one C-level min, not the O(replicas) Python pass that cost the
        flat lighthouse ~1 ms a tick at 4,096 replicas."""
        if not job.dead and (not job.last_seen or now - min(job.last_seen.values()) <= self.detect_s):
            job.live_hint = len(job.last_seen)
            return []
        view = self._liveness(job, now)
        dead = qm.dead_replicas(view, now, self.detect_s)
        job.live_hint = len(view) - len(dead)
        for r in set(dead) - job.dead:
            g = job.groups.get(r)
            log.warning(
                "job %r: replica %s declared dead (silent %.3fs > %gs)%s",
                job.job_id, r, now - view[r], self.detect_s,
                f": process(es) {g.silent(now, self.detect_s)} of {g.num_processes} silent" if g else "",
            )
        for r in job.dead - set(dead):
            log.info("job %r: replica %s is back", job.job_id, r)
        if len(dead) > self.config.limits.max_dead_listed:
            dead = self._forget_oldest_dead(job, dead)
        if job.dead != set(dead):
            job.dead = set(dead)
            job.dead_version += 1
        return dead

    def _forget_oldest_dead(self, job: _Job, dead: list[str]) -> list[str]:
        """Bound the dead list (and so every heartbeat reply): forget the replicas dead the
        longest, as if they had left. A forgotten replica that comes back is a newcomer."""
        by_age = sorted(dead, key=lambda r: job.last_seen.get(r, -math.inf))
        drop = set(by_age[:len(dead) - self.config.limits.max_dead_listed])
        for r in drop:
            self._forget(job, r)
        self.stats["forgotten_dead"] += len(drop)
        log.warning("job %r: %d dead replicas forgotten (at most %d are listed dead)", job.job_id, len(drop),
                    self.config.limits.max_dead_listed)
        return [r for r in dead if r not in drop]

    def _absorb_stall(self, lag_s: float, now: float) -> None:
        """The lighthouse itself did not run for ``lag_s`` until ``now`` (a GC pause, an
        overloaded host, SIGSTOP): heartbeats it could not read are not the replicas' silence.
        Without this, a stall longer than the detection window declared every
        replica dead at once and let the first requester form a quorum alone. Only what was
        heard before the stall moves: a beat read after it (before this tick) is not pushed
        into the future, which would detect a death right after the stall that much later."""
        self.stats["stalls"] += 1
        log.warning("lighthouse stalled %.2fs (> detection window / 4): not counting it as replicas' silence", lag_s)
        before = now - lag_s
        for job in self._jobs.values():
            shift_heard(job.last_seen, lag_s, before)
            for g in job.groups.values():
                g.shift(lag_s, before)

    def _drop_orphan_groups(self, now: float) -> None:
        """Forget the process groups of replicas whose leader was never heard (followers started
        alone, or a secret's holder beating as followers under fresh ids) once all their processes
        were silent a detection window: they count in their job's size (its budget) until then.
        O(jobs + multi-process replicas), every ``_ORPHAN_SWEEP_S``."""
        for job in self._jobs.values():
            for rid in [r for r, g in job.groups.items() if r not in job.last_seen and r not in job.pending
                        and now - g.last_heard() > self.detect_s]:
                job.drop_group(rid)
                for held in (job.incarnations, job.metrics_addresses, job.process_phases):
                    held.pop(rid, None)
                log.info("job %r: processes of replica %s dropped: its leader was never heard and they are "
                         "silent", job.job_id, rid)

    @property
    def detect_s(self) -> float:
        """The silence that declares a process dead now: ``config.detect_s``, or wider while the
        beats are paced (:class:`fthsdp.control.pacing.BeatPacer`)."""
        return self._pacer.window()

    def beating_processes(self) -> int:
        """The processes that beat this lighthouse now (every live replica's, followers
        included): what its pace is set for. O(jobs + multi-process replicas)."""
        n = 0
        for job in self._jobs.values():
            n += len(job.last_seen) - len(job.dead)
            # followers of live replicas only: a dead replica's group is kept until it is forgotten
            # (counting it slowed every process's beats and widened detection for every job)
            n += sum(g.num_processes - 1 for rid, g in job.groups.items()
                     if rid in job.last_seen and rid not in job.dead)
        return max(n, 0)

    def _pace(self, now: float) -> None:
        """Recount the beating processes and set their pace and the silence window (pacing)."""
        self._paced_at = now
        was_window, was, was_paced = self.detect_s, self._pacer.interval_s, self._pacer.paced
        n = self._beating = self.beating_processes()
        p = self._pacer.update(n, now)
        ms = int(round(p * 1000.0))
        self._pace_bytes = wire.varint_field(_HEARTBEAT_BEAT_INTERVAL, ms) if ms > 0 else b""
        if self.detect_s != was_window and (self._pacer.paced or was_paced):
            if self.detect_s > was_window:
                over = (f"; at one beat every {pacing.MAX_PACED_INTERVAL_S:g} s (the slowest it asks for) they "
                        f"still send {n / pacing.MAX_PACED_INTERVAL_S:.0f} beats/s, past the budget"
                        if n / self.config.beats_per_s > pacing.MAX_PACED_INTERVAL_S else "")
                kept = (f" (kept from what its processes report: a lighthouse before it paced them; its own "
                        f"count asks for {self._pacer.counted_s:.3g} s)" if p > self._pacer.counted_s else "")
                log.warning("%d processes beat this lighthouse (budget %g beats/s): each is asked to beat every "
                            "%.3g s at most%s, and failure detection now takes %.3g s instead of %.3g s%s (raise "
                            "--beats-per-s on a host with the CPU for it)", n, self.config.beats_per_s, p, kept,
                            self.detect_s, self.config.detect_s, over)
            else:
                log.info("%d processes beat this lighthouse: pace %.3g s (was %.3g s), failure detection %.3g s",
                         n, p, was, self.detect_s)

    async def _tick_loop(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.config.tick_s)
            now = time.monotonic()
            lag, last = now - last - self.config.tick_s, now
            if lag > self.config.detect_s / 4:
                self._absorb_stall(lag, now)
            if now - self._paced_at >= _PACE_RECOUNT_S:
                self._pace(now)
            if now - self._orphans_swept_at >= _ORPHAN_SWEEP_S:
                self._orphans_swept_at = now
                self._drop_orphan_groups(now)
            for job in list(self._jobs.values()):
                if not job.pending and now - job.last_activity > self.config.forget_after_s and all(
                        now - t > self.config.forget_after_s for t in job.last_seen.values()):
                    log.info("job %r: silent for %gs, forgotten", job.job_id, self.config.forget_after_s)
                    del self._jobs[job.job_id]
                    self.rca_metrics.forget(job.job_id)
                    continue
                try:
                    version = job.dead_version
                    self._update_dead(job, now)
                    if job.dead_version != version and job.quorum is not None and job.finished_step is None:
                        self._root_cause_logged(job, now)
                    if job.pending and self._tick_should_evaluate(job, now, job.dead_version != version):
                        self._evaluate(job)
                except Exception:  # never let one job's bug stop the others
                    log.exception("job %r: evaluation failed", job.job_id)
                if (job.quorum is not None and job.finished_step is None and now - job.last_rca_at
                        >= max(self.config.rca_interval_s, 20 * job.last_rca_cost_s)):
                    self._root_cause_logged(job, now)

    # -- RPCs ----------------------------------------------------------------

    def _check_quorum_request(self, req: pb2.QuorumRequest, now: float, ftar: tuple[str, ...] = ()) -> str | None:
        # Lengths, characters, addresses and ranges were checked in front (fthsdp.control.guard).
        err = _version_error(req.protocol_version)
        if err:
            return err
        who = f"replica {req.replica_id!r} of job {req.job_id!r}"
        if req.process_index != 0:
            return (f"process {req.process_index} of {who} asked for a quorum: only a replica's leader "
                    "(process 0) asks; the other processes get its quorum id from it and call GetView")
        err = _endpoints_error(who, req.num_processes, req.process_index, req.local_world_size,
                               ftar or tuple(req.ftar_addresses), required=True, held=req.endpoints_held)
        if err:
            return err
        if req.num_replicas < 0:
            return f"num_replicas is {req.num_replicas} ({who}): it must be >= 0 (0 = not stated)"
        if len(req.accused_replica_ids) > MAX_ACCUSED:
            return (f"accused_replica_ids has {len(req.accused_replica_ids)} entries ({who}): at most "
                    f"{MAX_ACCUSED} (the members that broke FTAR's protocol against this replica)")
        job = self._jobs.get(req.job_id)
        if (job is None or _reads_lineage(job, req.replica_id, req.last_quorum_id)) and req.lineage:
            try:
                qm.parse_lineage_report(req.lineage, req.last_quorum_id)
            except ValueError as e:
                return f"{e} ({who}): send the newest entries of the replica's own lineage (quorum.lineage_report)"
        if job is None:
            return None
        def is_live(r: str) -> bool:
            return r in job.pending or now - job.last_seen.get(r, -math.inf) <= self.detect_s

        # Settings every live replica of a job must share: (kept values, this request's (None: not
        # stated), why a different one is refused). Each message is built only for a refusal.
        shared = (
            (job.local_world_size, req.local_world_size, lambda v, r, w: (
                f"local_world_size {v} of {who} conflicts with {w} of live replica {r!r}: every replica of a job "
                "must shard the same way (same devices per replica)")),
            (job.processes, req.num_processes or 1, lambda v, r, w: (
                f"num_processes {v} of {who} conflicts with {w} of live replica {r!r}: every replica of a job must "
                "have the same processes x devices shape (--processes-per-replica)")),
            (job.stated_replicas, req.num_replicas or None, lambda v, r, w: (
                f"num_replicas {v} of {who} conflicts with {w} stated by live replica {r!r}: every replica of a "
                "job must be launched with the same replica count")),
            (job.state_signature, req.state_signature or None, lambda v, r, w: (
                f"the training state of {who} (signature {v:016x}) is not made like that of live replica {r!r} "
                f"({w:016x}): its parameter or optimizer shapes or dtypes differ, or its model, optimizer or data "
                "settings, train.steps, train.seed, ft.intervention or ft.fingerprint*, or its jax, jaxlib or "
                "fthsdp version or kind of device (fthsdp/step/signature.py), so the replicas would average "
                "unlike values; launch every replica of a job alike")),
        )
        for kept, value, why in shared:
            if value is not None:
                c = kept.conflict(req.replica_id, value, is_live)
                if c is not None:
                    return why(value, *c)
        return None

    def _admit(self, request, peer: str, now: float, relayed: bool = False) -> guard.Refusal | None:
        """The checks that need job state: jobs per lighthouse, replicas per job, new ids
        per client host, and the (replica, process)'s incarnation (guard.incarnation_problem).
        A new id costs its connection extra (admission.py), except on a relay's connection,
        which registers every process behind it: the relay's host is still bounded by the
        new-ids rate, and each id's job by its replica limit and its budget."""
        lim = self.config.limits
        job = self._jobs.get(request.job_id)
        if job is None and len(self._jobs) >= lim.max_jobs:
            return guard.Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"this lighthouse serves {len(self._jobs)} jobs, its limit: job {request.job_id!r} is refused; "
                "run it on another lighthouse, or wait for a finished job to be forgotten (--forget-after)"))
        rid = request.replica_id
        proc = getattr(request, "process_index", 0)  # Leave: the replica's leader
        if job is None or rid not in job.last_seen:
            if job is not None and len(job.last_seen) >= lim.max_replicas_per_job:
                return guard.Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                    f"job {request.job_id!r} already has {len(job.last_seen)} replicas, this lighthouse's limit: "
                    f"replica {rid!r} is refused (raise --max-replicas-per-job if the job is really that large)"))
            if (job is not None and proc > 0 and rid not in job.groups
                    and len(job.groups) >= lim.max_replicas_per_job):
                # a follower whose leader was never heard opens a group of its own: at most as many
                # groups as replicas (orphans are dropped a detection window after their last beat)
                return guard.Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                    f"job {request.job_id!r} already holds {len(job.groups)} replicas of several processes, this "
                    f"lighthouse's limit: process {proc} of replica {rid!r}, whose leader (process 0) "
                    f"was never heard, is refused (start its leader; raise --max-replicas-per-job if the job is "
                    f"really that large)"))
            if not self._new_ids.take(guard.peer_host(peer), now):
                return guard.Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                    f"too many new replica ids from {peer} (limit {lim.new_ids_per_s:g}/s after a burst "
                    f"of {lim.new_ids_burst}): replica {rid!r} of job {request.job_id!r} is refused; retry later"))
            if self._admission is not None and not relayed:  # registering an id costs more than a call
                self._admission.new_id(peer, now)
        if job is not None:
            holder = job.incarnations.get(rid, {}).get(proc)
            if proc > 0:
                # A follower's holder is live by its own beats: its replica's new leader, asking
                # already, must not keep the restarted group's follower out (refused until the
                # leader's quorum wait ran out, the replica dead for want of that follower).
                g = job.groups.get(rid)
                live = g is not None and now - g.seen.get(proc, -math.inf) <= self.detect_s
            else:
                # A leader is live by its own beats (a replica's by its stalest process's), and by an
                # open request only as _liveness counts one: a request left pending on the connection
                # of a host that died kept a new process out for the request's whole deadline instead
                # of one detection window.
                g = job.groups.get(rid)
                heard = g.seen.get(0, -math.inf) if g is not None else job.last_seen.get(rid, -math.inf)
                pending = job.pending.get(rid)
                live = now - heard <= self.detect_s or (pending is not None
                                                        and self._asks_without_beats(job, rid, pending))
            err = guard.incarnation_problem(rid, request.job_id, holder, request.incarnation, live)
            if err:
                return guard.Refusal(grpc.StatusCode.PERMISSION_DENIED, err)
        return None

    async def _abort(self, context, e: Refused) -> None:
        """End a unary call with refusal ``e``, counted like every other transport's refusals."""
        self._gate.count(e.code)
        await context.abort(e.code, e.reason)

    async def _refuse_unless_admitted(self, request, context, now: float) -> None:
        try:
            self._admitted(request, context.peer() or "", now)
        except Refused as e:
            await self._abort(context, e)

    def _admitted(self, request, peer: str, now: float, relayed: bool = False) -> None:
        """:meth:`_admit`, counted and raised as :class:`Refused` when it refuses."""
        refusal = self._admit(request, peer, now, relayed)
        if refusal is not None:
            self.stats["refused"] += 1
            raise Refused(refusal.code, refusal.reason)

    @staticmethod
    def _bind(job: _Job, request) -> None:
        rid, proc = request.replica_id, getattr(request, "process_index", 0)
        held = job.incarnations.setdefault(rid, {})
        if request.incarnation and held.get(proc) != request.incarnation:
            if proc in held:
                log.warning("job %r: replica id %s (process %d) taken over by a new process (its holder left or "
                            "was dead)", job.job_id, rid, proc)
            held[proc] = request.incarnation

    async def GetQuorum(self, request: pb2.QuorumRequest, context: grpc.aio.ServicerContext) -> bytes:
        """The unary call: :meth:`accept_quorum_request`, then wait for the decision (the
        session stream, fthsdp.control.session, waits for it its own way)."""
        try:
            got = self.accept_quorum_request(request, context.peer() or "", time.monotonic())
        except Refused as e:
            await self._abort(context, e)
        if isinstance(got, bytes):
            return got
        job, entry = got
        remaining = context.time_remaining()
        # Answer a little before the caller's deadline so it gets our reason,
        # not a bare DEADLINE_EXCEEDED from its own timer.
        wait = None if remaining is None else answer_wait_s(remaining)
        try:
            result = await asyncio.wait_for(entry.future, wait)
        except TimeoutError:
            # Withdrawn before the abort's await: a decision in between took the timed-out request
            # into a quorum that nobody told it of, and the others waited for it in the all-reduce.
            self.withdraw(job, entry)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self.no_quorum_reason(job))
        except (_SdcStop, _Superseded) as e:
            self.withdraw(job, entry)
            err = self.quorum_error(request, e)
            await context.abort(err.code, err.reason)
        finally:
            self.withdraw(job, entry)
        return self.quorum_answer(job, request, result)

    def accept_quorum_request(self, request: pb2.QuorumRequest, peer: str, now: float,
                              relayed: bool = False) -> bytes | tuple[_Job, _Pending]:
        """Everything a quorum request does before it waits, whatever carried it (a unary
        call, a session message): the checks that need job state, the bookkeeping, and
        its pending entry, whose future the decision completes (a quorum, a
        :class:`_Finished`, or an exception: :meth:`quorum_error`). Returns the answer at
        once (bytes) when there is nothing to wait for; raises :class:`Refused`. ``relayed``:
        it came through a relay (:meth:`_admit`)."""
        if request.endpoints_held:
            ftar, server = self._held_endpoints(request)
        else:  # converted from the message once per request
            ftar, server = tuple(request.ftar_addresses), request.state_server_address
        err = self._check_quorum_request(request, now, ftar)
        if err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, err)
        self._admitted(request, peer, now, relayed)
        job = self._job(request.job_id)
        self._bind(job, request)
        rid = request.replica_id
        if request.fresh_start and job.finished_step is not None:
            log.info("job %r: a new run starts (replica %s); forgetting that the last run finished at step %d",
                     job.job_id, rid, job.finished_step)
            job.finished_step, job.finished_data = None, ((), ())
            job.sdc.reset()
        elif request.fresh_start and job.sdc.fatal is not None:
            log.info("job %r: a new run starts (replica %s); forgetting the fingerprint mismatch that stopped it",
                     job.job_id, rid)
            job.sdc.reset()
        if job.sdc.fatal is not None:
            raise Refused(grpc.StatusCode.DATA_LOSS, job.sdc.fatal.reason)
        if job.finished_step is not None:
            log.info("job %r: replica %s asks at step %d but the job finished at step %d",
                     job.job_id, rid, request.step, job.finished_step)
            return _finished_reply(job.finished())
        if request.last_quorum_id > job.qid_floor:
            job.qid_floor = request.last_quorum_id
        nproc = request.num_processes or 1
        held = job.endpoints.get(rid)
        if held is not None and held[0] == ftar and held[1] == server:
            ftar = held[0]
        else:
            job.endpoints[rid] = (ftar, server)
        if nproc > 1:
            self._group(job, rid, nproc, now).register(0, ftar, server)
        self._heard(job, rid, now, 0, nproc)
        if rid in job.heartbeating:
            # A leader that heartbeats may skip a beat right after asking (its heartbeat thread
            # does, lighthouse_client): its request is as good a sign of life as a heartbeat sent
            # now, and it is judged by these times alone (a stopped leader is still detected one
            # detection window after its last request or beat).
            job.last_heartbeat[rid] = now
        if (request.request_id and job.quorum is not None and rid not in job.pending
                and job.answered_ids.get(rid) == request.request_id):
            # Decided into the newest quorum already, and sent again: its answer was lost on the
            # way (a relay died, a stream broke after the decision). Waiting for the next round
            # instead left the other members in this quorum's all-reduce until its deadline
            # (10 s in the emulation at 10,240 ranks, when a relay died holding the answers).
            self.stats["answers_resent"] += 1
            log.info("job %r: replica %s asked again for quorum %d (its answer was lost); answered again",
                     job.job_id, rid, job.quorum.quorum_id)
            return self.quorum_answer(job, request, job.quorum)
        if request.accused_replica_ids:
            self._accuse(job, rid, request.last_quorum_id, request.accused_replica_ids)
        if _reads_lineage(job, rid, request.last_quorum_id):
            job.lineage_reports[rid] = request.last_quorum_id
            if request.lineage and (job.lineage_from == 0 or request.lineage[0] < job.lineage_from):
                self._merge_lineage(job, rid, request.lineage)
        job.steps[rid] = request.step
        _record_fingerprint(job, rid, request)
        job.local_world_size.set(rid, request.local_world_size)
        job.stated_replicas.set(rid, request.num_replicas or None)
        job.processes.set(rid, nproc)
        job.state_signature.set(rid, request.state_signature or None)
        old = job.pending.pop(rid, None)
        if old is not None and not old.future.done():
            old.future.set_exception(_Superseded())
        future = asyncio.get_running_loop().create_future()
        entry = _Pending(
            qm.QuorumRequest(
                replica_id=rid,
                step=request.step,
                arrived_at=now,
                ftar_addresses=ftar,
                state_server_address=server,
                local_world_size=request.local_world_size,
                commit_failed=request.commit_failed,
                last_quorum_id=request.last_quorum_id,
                # Read only by a lighthouse that does not remember the job's quorum
                # (restarted, or a new job): copying every member's id out of every
                # request made a round O(N^2) in Python objects (8,192 x 8,192 at 8K).
                last_members=tuple(request.last_members) if job.quorum is None else (),
                num_processes=nproc,
                rejoin=request.rejoin,
            ),
            future,
            request.request_id,
        )
        job.pending[rid] = entry
        job.pending_added += 1
        if len(job.pending) >= self._expected(job):
            # The last request a decision waits for decides at once: scheduled behind the
            # loop's other ready callbacks (the next reads, heartbeats) it waited ~8 ms at
            # 512 replicas. Its own answer is pushed by its future's callback, as any other.
            try:
                self._evaluate(job)
            except Exception:  # a decision's bug must not leave this request pending for ever
                log.exception("job %r: the quorum decision failed on replica %r's request", job.job_id, rid)
                self.withdraw(job, entry)
                raise
        return job, entry

    def _held_endpoints(self, request: pb2.QuorumRequest) -> tuple[tuple[str, ...], str]:
        """The endpoints a request with ``endpoints_held`` stands for: the ones its replica's
        leader last sent. Why the field exists: at 512 replicas x 196 shards, reading and
        checking 196 addresses of every request was a fifth of the lighthouse's CPU per
        round, for addresses that had not changed since the replica started.
        Raises :class:`Refused` (FAILED_PRECONDITION, ``ENDPOINTS_NOT_HELD``) when this
        lighthouse holds none for the replica: the client then sends them again."""
        job = self._jobs.get(request.job_id)
        held = job.endpoints.get(request.replica_id) if job is not None else None
        if held is None:
            self.stats["endpoints_not_held"] += 1
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, (
                f"{ENDPOINTS_NOT_HELD} (replica {request.replica_id!r} of job {request.job_id!r}: it restarted "
                "or forgot the replica): send ftar_addresses and state_server_address with the request"))
        self.stats["requests_endpoints_held"] += 1
        return held

    @staticmethod
    def withdraw(job: _Job, entry: _Pending) -> None:
        """``entry`` is no longer waited for (answered, timed out, or its caller gone)."""
        rid = entry.request.replica_id
        if job.pending.get(rid) is entry:
            del job.pending[rid]

    @staticmethod
    def no_quorum_reason(job: _Job) -> str:
        return f"no quorum for job {job.job_id!r} within the call's deadline; last decision: {job.last_reason}"

    @staticmethod
    def quorum_error(request: pb2.QuorumRequest, e: BaseException) -> guard.Refusal:
        """How a pending request that ended in ``e`` is refused."""
        if isinstance(e, _SdcStop):
            return guard.Refusal(grpc.StatusCode.DATA_LOSS, str(e))
        if isinstance(e, _Superseded) and e.left:
            return guard.Refusal(grpc.StatusCode.ABORTED, f"replica {request.replica_id!r} of job {request.job_id!r} "
                                                          "left (Leave): this quorum request of it is void")
        if isinstance(e, _Superseded):
            return guard.Refusal(grpc.StatusCode.ABORTED, f"superseded by a newer quorum request from replica "
                                                          f"{request.replica_id!r} of job {request.job_id!r}")
        return guard.Refusal(grpc.StatusCode.INTERNAL, f"the lighthouse failed to answer: {type(e).__name__}: {e}")

    def quorum_answer(self, job: _Job, request: pb2.QuorumRequest, result) -> bytes:
        """The serialized answer to ``request`` once its entry's future holds ``result``."""
        if isinstance(result, _Finished):
            return _finished_reply(result)
        held = job.decided.get(request.last_quorum_id) \
            if request.accepts_ring_delta or request.accepts_ring_neighbours else None
        return job.view_reply(result, request.replica_id, 0, self.stats,
                              holds_view=request.last_quorum_id == result.quorum_id,
                              compact_ok=request.accepts_members_omitted, held=held,
                              neighbours=request.accepts_ring_neighbours)

    async def Heartbeat(self, request: pb2.HeartbeatRequest, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return self.accept_heartbeat(request, context.peer() or "", time.monotonic())
        except Refused as e:
            await self._abort(context, e)

    def accept_heartbeat(self, request: pb2.HeartbeatRequest, peer: str, now: float, relayed: bool = False) -> bytes:
        """A heartbeat, whatever carried it (a unary call, a session message, a relay's batch):
        the serialized reply, or :class:`Refused`."""
        err = _version_error(request.protocol_version)
        who = f"process {request.process_index} of replica {request.replica_id!r} of job {request.job_id!r}"
        err = err or _endpoints_error(who, request.num_processes, request.process_index, request.local_world_size,
                                      request.ftar_addresses, required=False)
        if err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, err)
        self._admitted(request, peer, now, relayed)
        self.stats["heartbeats"] += 1
        job = self._job(request.job_id)
        self._bind(job, request)
        rid = request.replica_id
        nproc, proc = request.num_processes or 1, request.process_index
        registered = True
        if nproc > 1:
            held = job.groups.get(rid)
            if (proc != 0 and held is not None and held.num_processes != nproc
                    and now - held.seen.get(0, -math.inf) <= self.detect_s):  # nor reshapes its live leader's group
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, (
                    f"{who} says its replica has {nproc} processes but its leader (process 0) registered "
                    f"{held.num_processes}: start every process of a replica with the same --processes-per-replica"))
            if (proc != 0 and held is None and rid in job.heartbeating
                    and now - job.last_heartbeat.get(rid, -math.inf) <= self.detect_s):
                # Its live leader beats as a replica of one process: a group opened here held that
                # replica out of every quorum ("not asking until all its processes registered").
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, (
                    f"{who} says its replica has {nproc} processes but its live leader (process 0) runs as a "
                    "replica of one process: start every process of a replica with the same "
                    "--processes-per-replica"))
            g = self._group(job, rid, nproc, now)
            if request.ftar_addresses:
                err = g.register(proc, tuple(request.ftar_addresses), request.state_server_address)
                if err:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{who} {err}")
            registered = proc in g.ftar
        self._heard(job, rid, now, proc, nproc)
        if request.beat_interval_ms and self._pacer.inherit(request.beat_interval_ms / 1000.0, now):
            self._pace(now)  # paced by the lighthouse before this one: keep that pace (BeatPacer.inherit)
        if request.metrics_address:
            job.metrics_addresses.setdefault(rid, {})[proc] = request.metrics_address
        if proc != 0:  # a follower: its liveness, addresses and phase; its leader speaks for the replica
            if request.HasField("phase") and nproc > 1:
                job.process_phases.setdefault(rid, {})[proc] = request.phase  # analysed with its leader's
            return job.heartbeat_reply(registered) + _asking(job, request) + self._pace_bytes
        job.heartbeating.add(rid)
        job.last_heartbeat[rid] = now
        job.reported_qids[rid] = request.last_quorum_id
        job.steps[rid] = request.step
        if request.HasField("phase"):
            job.phases[rid] = request.phase  # kept as sent: analysed only every rca_interval_s
        if request.last_quorum_id > job.qid_floor and job.quorum is None:
            # What a restarted lighthouse learns of ids decided before it (rule 5). Once it decided
            # the job's quorums itself, a beat's higher id is no such news (a replica that was
            # answered by another lighthouse says so in its request, which still counts): followed,
            # it made every decision take a new id, rebuilding every ring each step.
            job.qid_floor = request.last_quorum_id
        _record_fingerprint(job, rid, request)  # judged at the next evaluation
        # The dead set is recomputed each tick (tick_s adds to detection time;
        # per-heartbeat recomputation would cost O(replicas) per heartbeat), and
        # the reply is serialized once per (quorum, dead set), not per heartbeat.
        return job.heartbeat_reply(registered) + _asking(job, request) + self._pace_bytes

    async def GetView(self, request: pb2.ViewRequest, context: grpc.aio.ServicerContext) -> pb2.QuorumResponse:
        err = _version_error(request.protocol_version)
        if err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        job = self._jobs.get(request.job_id)
        q = job.decided.get(request.quorum_id) if job is not None else None
        rid = request.replica_id
        if q is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"quorum {request.quorum_id} of job {request.job_id!r} is not held by this lighthouse (it keeps the "
                f"last 8; a restarted one none): replica {rid!r} must ask for a new quorum")
        m = next((x for x in q.members if x.replica_id == rid), None)
        if m is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"replica {rid!r} is not a member of quorum {q.quorum_id} of job {request.job_id!r}")
        if not 0 <= request.process_index < m.num_processes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"process_index {request.process_index} is outside 0..{m.num_processes - 1} "
                                f"(replica {rid!r} has {m.num_processes} process(es) in quorum {q.quorum_id})")
        held = job.decided.get(request.held_quorum_id) \
            if request.accepts_ring_delta or request.accepts_ring_neighbours else None
        try:
            return job.view_reply(q, rid, request.process_index, self.stats, held=held,
                                  neighbours=request.accepts_ring_neighbours)
        except ValueError as e:  # a view that cannot be built (shards outside a member's): say why
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the view of quorum {q.quorum_id} for process {request.process_index} of replica "
                                f"{rid!r} cannot be built: {e}")

    async def Leave(self, request: pb2.LeaveRequest, context: grpc.aio.ServicerContext) -> pb2.LeaveResponse:
        err = _version_error(request.protocol_version)
        if err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        await self._refuse_unless_admitted(request, context, time.monotonic())
        bad = _data_state_problem(request.data_positions, request.data_last_steps)
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Leave of replica {request.replica_id!r}: {bad}")
        job = self._job(request.job_id)
        rid = request.replica_id
        known = rid in job.last_seen
        self._forget(job, rid)
        old = job.pending.pop(rid, None)
        if old is not None and not old.future.done():
            old.future.set_exception(_Superseded(left=True))
        job.live_hint = max(0, job.live_hint - (1 if known else 0))
        forked = qm.forked_at(job.lineage, request.last_quorum_id, request.step)
        if forked is not None:
            # Its last steps were re-decided by a quorum it was not in, and no request of it
            # followed to fence it (the job's last step): its state is not the job's, and its
            # `finished` must not end the job while the lineage's holders may still train.
            why = qm.fork_reason(rid, request.step, request.last_quorum_id, forked)
            log.warning("job %r: %s", job.job_id, why)
            if job.pending:
                self._schedule_evaluation(job)
            return pb2.LeaveResponse(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, forked=why,
                                     forked_step=forked[1])
        finished = request.finished
        doubt = self._finish_doubt(job, rid, request.step) if finished else ""
        if doubt:
            # A replica's word alone ended the job for every replica at any step it named: the
            # others were answered job-finished and exited 0 mid-run. It leaves, the job goes on.
            log.warning("job %r: replica %s says it finished the job at step %d, but %s: taken as a replica that "
                        "stopped, not as the job's end", job.job_id, rid, request.step, doubt)
            finished = False
        if finished:
            if request.data_positions and (job.finished_step is None or request.step >= job.finished_step):
                job.finished_data = (tuple(request.data_positions), tuple(request.data_last_steps))
            job.finished_step = max(job.finished_step or 0, request.step)
        log.info("job %r: replica %s left at step %d (%s)", job.job_id, rid, request.step,
                 "finished the job" if finished else "stopped")
        if job.pending:  # someone may have been waiting for it
            self._schedule_evaluation(job)
        return pb2.LeaveResponse(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION)

    @staticmethod
    def _finish_doubt(job: _Job, rid: str, step: int) -> str:
        """Why a Leave saying "finished at ``step``" cannot be the job's end ("" if it can): a
        finisher ran the last step in the job's newest quorum, so it is one of its members and
        leaves at its max step + 1. (A lighthouse that decided no quorum yet, restarted, takes
        its word as before.)"""
        q = job.quorum
        if q is None:
            return ""
        if rid not in q.member_ids:
            return f"it is not a member of the job's newest quorum {q.quorum_id} ({', '.join(q.member_ids)})"
        if step != q.max_step + 1:
            return (f"the job's newest quorum {q.quorum_id} ran step {q.max_step}, so a finisher leaves at step "
                    f"{q.max_step + 1}")
        return ""

    @staticmethod
    def _merge_lineage(job: _Job, rid: str, values) -> None:
        """A replica's lineage entries from before this lighthouse decided the job's first
        quorum (it restarted): merged into the job's lineage (rule 6 of fthsdp.control.quorum).
        Checked already (``_check_quorum_request``)."""
        pairs = qm.parse_lineage_report(values)
        old = [p for p in pairs if job.lineage_from == 0 or p[0] < job.lineage_from]
        merged = job.lineage.merged(old)
        if merged.entries != job.lineage.entries:  # (an entry may be new yet dominated by one held)
            log.info("job %r: lineage entries (quorum, step) %s reported by replica %s (from before this "
                     "lighthouse's first quorum) merged: %s", job.job_id, old, rid, list(merged.entries[-8:]))
        # Ids below a cut report's oldest entry: with `old` not empty that entry is older than
        # this lighthouse's first quorum, so every id forgotten was decided before it restarted.
        cut = qm.unreported_through(pairs) if old else 0
        if cut > merged.dropped_through:
            log.info("job %r: replica %s reported its newest %d lineage entries, from quorum %d: quorums <= %d "
                     "are forgotten (a replica whose last quorum is that old is fenced)", job.job_id, rid,
                     len(pairs), pairs[0][0], cut)
            merged = merged.forgotten_through(cut)
        job.lineage = merged

    @staticmethod
    def _forget(job: _Job, rid: str) -> None:
        """Everything the job holds of replica ``rid`` but its pending request (Leave; the oldest
        dead beyond the limit). Its id is free again: Leave releases every process's claim."""
        job.incarnations.pop(rid, None)
        for d in (job.last_seen, job.steps, job.phases, job.process_phases):
            d.pop(rid, None)
        job.heartbeating.discard(rid)
        job.last_heartbeat.pop(rid, None)
        job.reported_qids.pop(rid, None)
        job.metrics_addresses.pop(rid, None)
        job.endpoints.pop(rid, None)
        job.sdc.forget(rid)
        if rid in job.dead:
            job.dead.discard(rid)
            job.dead_version += 1
        job.local_world_size.set(rid, None)
        job.stated_replicas.set(rid, None)
        job.processes.set(rid, None)
        job.state_signature.set(rid, None)
        job.drop_group(rid)

    async def Status(self, request: pb2.StatusRequest, context: grpc.aio.ServicerContext) -> pb2.StatusResponse:
        err = _version_error(request.protocol_version)
        if err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        if request.job_id and request.job_id not in self._jobs:
            # Never the list of job ids: a caller allowed to read one job must not learn the others.
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no job {request.job_id!r} on this lighthouse (no replica of it has been heard from yet)",
            )
        now = time.monotonic()
        lim = self.config.limits
        names = [request.job_id] if request.job_id else sorted(self._jobs)
        jobs = [self._jobs[k] for k in names[:lim.max_status_jobs]]
        out = []
        for job in jobs:
            view = self._liveness(job, now)
            dead = set(qm.dead_replicas(view, now, self.detect_s))
            replicas = [
                pb2.ReplicaStatus(
                    replica_id=r,
                    step=job.steps.get(r, 0),
                    last_heartbeat_age_s=now - view[r],
                    dead=r in dead,
                    waiting=r in job.pending,
                    num_processes=job.groups[r].num_processes if r in job.groups else 1,
                    silent_processes=job.groups[r].silent(now, self.detect_s) if r in job.groups else [],
                    phase=job.phases.get(r),
                    metrics_addresses=_by_process(job.metrics_addresses.get(r, {})),
                    condemned=job.sdc.condemned[r].reason if r in job.sdc.condemned else "",
                    **self._fingerprint_status(job, r),
                )
                for r in sorted(view, key=qm.ring_key)[:lim.max_status_replicas]
            ]
            lws = set(job.local_world_size.live_values(lambda r: r not in dead))
            js = pb2.JobStatus(
                job_id=job.job_id,
                replicas=replicas,
                has_quorum=job.quorum is not None,
                last_reason=job.last_reason,
                local_world_size=lws.pop() if len(lws) == 1 else 0,
                num_configured=self._decision_config(job).num_configured or len(view),
                finished_step=-1 if job.finished_step is None else job.finished_step,
                sdc_events=[_sdc_event(v) for v in job.sdc.events],
                sdc_fatal=job.sdc.fatal.reason if job.sdc.fatal is not None else "",
                replicas_omitted=max(0, len(view) - lim.max_status_replicas),
            )
            if job.quorum is not None:
                js.quorum.CopyFrom(job.quorum_proto(job.quorum))
            if job.verdict is not None:
                js.root_cause.CopyFrom(verdict_to_proto(*job.verdict, now))
            if job.last_stall is not None:
                js.last_stall.CopyFrom(verdict_to_proto(*job.last_stall, now))
            out.append(js)
        c = self.config
        return pb2.StatusResponse(
            protocol_version=LIGHTHOUSE_PROTOCOL_VERSION,
            jobs=out,
            min_replicas=c.min_replicas,
            join_timeout_s=c.join_timeout_s,
            detect_s=self.detect_s,  # the silence window now: wider than configured while beats are paced
            beat_interval_s=self._pacer.interval_s,
            jobs_omitted=max(0, len(names) - lim.max_status_jobs),
            metrics_address=self.metrics_server.address if self.metrics_server is not None else "",
            # about every job: only for a Status of every job (the status key), never for one job's secret
            load=None if request.job_id else self._load_proto(),
        )

    def _load_proto(self) -> "pb2.LighthouseLoad":
        """:meth:`load_snapshot` as a Status carries it: the detection in force travels at the
        reply's top level (``StatusResponse.detect_s``, ``beat_interval_s``), not twice."""
        fields = dataclasses.asdict(self.load_snapshot())
        del fields["detect_s"], fields["beat_interval_s"]
        return pb2.LighthouseLoad(**fields)

    @staticmethod
    def _fingerprint_status(job: _Job, rid: str) -> dict:
        latest = job.sdc.latest.get(rid)
        return {} if latest is None else {"fingerprint_step": latest[0], "fingerprint": latest[1]}


def _by_process(addresses: dict[int, str]) -> list[str]:
    """Addresses by process index ("" where a process advertised none)."""
    return [addresses.get(p, "") for p in range(max(addresses, default=-1) + 1)]


def _record_fingerprint(job: _Job, rid: str, request) -> None:
    """Record the fingerprint a quorum request or heartbeat carries, unless the state it is of
    forked from the job's lineage (such a replica is fenced and fetches the lineage's state, not
    judged). The state is the one the quorum ``fingerprint_quorum_id`` committed: a fenced replica
    sends the fingerprint of its forked state until it commits again, by then a member of a quorum
    of the lineage. (Judged by ``last_quorum_id`` alone, that stale fingerprint stopped a job as
    silent data corruption; older clients state no quorum and are judged so still.)"""
    if not request.HasField("fingerprint"):
        return
    if qm.forked_at(job.lineage, request.fingerprint_quorum_id or request.last_quorum_id, request.fingerprint_step):
        return
    job.sdc.record(rid, request.fingerprint_step, request.fingerprint)


def _sdc_event(v: sdc.Verdict) -> pb2.SdcEvent:
    return pb2.SdcEvent(step=v.step, culprits=list(v.culprits), majority_fingerprint=v.majority or 0,
                        reports=[pb2.FingerprintReport(replica_id=r, fingerprint=f) for r, f in v.reports],
                        reason=v.reason, fatal=v.fatal)


class LighthouseThread(ServerThread):
    """A lighthouse on its own event loop in a daemon thread (tests, notebooks, launchers).

    ``with LighthouseThread(config) as lh: lh.address`` — the address is valid
    once the context is entered; leaving it stops the server.
    """

    def __init__(self, config: LighthouseConfig | None = None, *, start_timeout_s: float = 10.0) -> None:
        self.config = config or LighthouseConfig()
        super().__init__(lambda: Lighthouse(self.config), "fthsdp-lighthouse", start_timeout_s)
        self.server: Lighthouse | None = None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fthsdp lighthouse",
        description="Quorum and failure-detection service for fault-tolerant training jobs (many jobs per lighthouse).",
    )
    d = LighthouseConfig()
    p.add_argument("--bind", default=d.bind, help="HOST:PORT to listen on; port 0 = any free port (default %(default)s)")
    p.add_argument("--min-replicas", type=int, default=d.min_replicas, help="fewest replicas a quorum may have (default %(default)s)")
    p.add_argument("--join-timeout", type=float, default=d.join_timeout_s,
                   help="seconds to wait for live replicas not yet asking before forming the quorum without them (default %(default)s)")
    p.add_argument("--detect", type=float, default=d.detect_s,
                   help="failure-detection window: a replica silent this long is dead (default %(default)s s)")
    p.add_argument("--beats-per-s", type=float, default=d.beats_per_s,
                   help="heartbeats a second asked of all processes together: past beats-per-s x their interval "
                        "processes, each is asked to beat less often and failure detection widens to match "
                        "(0 = never; default %(default)g)")
    p.add_argument("--replicas", type=int, default=d.num_replicas,
                   help="configured replicas per job when requests do not state it (0 = replicas seen; default %(default)s)")
    p.add_argument("--tick", type=float, default=d.tick_s, help="re-evaluation period in seconds (default %(default)s)")
    p.add_argument("--forget-after", type=float, default=d.forget_after_s,
                   help="forget a job none of whose replicas was heard for this long (default %(default)s s)")
    p.add_argument("--max-pending-rpcs", type=int, default=d.max_pending_rpcs,
                   help="calls gRPC may queue before the server takes them; more are refused (default %(default)s)")
    p.add_argument("--rca-interval", type=float, default=d.rca_interval_s,
                   help="root-cause analysis period per job, seconds (also run when a quorum shrinks; default %(default)s)")
    p.add_argument("--metrics-bind", default=d.metrics_bind, metavar="HOST:PORT",
                   help="serve the lighthouse's Prometheus metrics (root-cause verdicts) here; port 0 = any free "
                        "port, listed by `fthsdp status --prometheus-targets` (default: none)")
    p.add_argument("--port-file", default=None, help="write the bound port to this file (atomically) once listening")
    p.add_argument("--secret-file", default=None,
                   help="the lighthouse secret (64 hex digits, e.g. `openssl rand -hex 32`); default "
                        f"${auth.LIGHTHOUSE_SECRET_FILE_ENV}, else ${auth.LIGHTHOUSE_SECRET_ENV} (hex). Never on a "
                        "command line. Each job's secret is derived from it (--print-job-secret)")
    p.add_argument("--insecure", action="store_true",
                   help="serve without authentication (loopback binds only; anyone on this machine can then "
                        "join, steer or read its jobs)")
    p.add_argument("--tls-cert", default="", help="PEM certificate chain: serve TLS (with --tls-key)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--print-job-secret", default=None, metavar="JOB",
                   help="print job JOB's secret (hex) derived from the lighthouse secret, for `fthsdp run "
                        "--lighthouse ... --secret-file`, and exit")
    p.add_argument("--print-status-key", action="store_true",
                   help="print the read-only status key (hex) for `fthsdp status --status-key-file`, and exit")
    lim = guard.Limits()
    p.add_argument("--max-replicas-per-job", type=int, default=lim.max_replicas_per_job,
                   help="refuse replicas beyond this many per job (default %(default)s)")
    p.add_argument("--max-jobs", type=int, default=lim.max_jobs, help="refuse jobs beyond this many (default %(default)s)")
    fair = admission.FairnessLimits()
    p.add_argument("--connection-calls-per-s", type=float, default=fair.connection_calls_per_s,
                   help="calls per second one client connection may make before the rest are held back "
                        "(a replica process makes ~10-50; default %(default)s)")
    p.add_argument("--no-fairness", action="store_true",
                   help="no per-connection, per-host or per-job budgets: one client's flood then slows every job "
                        "(for measuring what the budgets buy; experiments/auth_cost.py)")
    p.add_argument("--standby", action="store_true",
                   help="start, then wait for a line `serve` on stdin before binding --bind: a launcher's warm "
                        "spare, which takes a dead lighthouse's port without Python's start-up; exits when "
                        "stdin closes first")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


async def _serve(config: LighthouseConfig, port_file: str | None) -> None:
    from fthsdp.launch.lifetime import serve_until_terminated

    server = Lighthouse(config)
    await server.start()
    await serve_until_terminated(server.port, port_file, f"lighthouse listening on {server.address}")
    log.info("lighthouse stopping")
    await server.stop()


def cli(argv: list[str]) -> int:
    """``fthsdp lighthouse ...``: serve until SIGTERM/SIGINT; returns the exit code."""
    from fthsdp.launch.lifetime import die_with_launcher

    die_with_launcher()  # started by `fthsdp run`: never outlive it
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        secret = auth.load_secret(args.secret_file, file_env=auth.LIGHTHOUSE_SECRET_FILE_ENV,
                                  env=auth.LIGHTHOUSE_SECRET_ENV)
    except auth.SecretError as e:
        parser.error(str(e))
    if args.print_job_secret is not None or args.print_status_key:
        if secret is None:
            parser.error("--print-job-secret / --print-status-key need the lighthouse secret (--secret-file)")
        key = auth.status_key(secret) if args.print_status_key else auth.job_key(secret, args.print_job_secret)
        print(key.hex())
        return 0
    if secret is None and not args.insecure:
        parser.error("no lighthouse secret: give --secret-file (or $FTHSDP_LIGHTHOUSE_SECRET_FILE), or serve "
                     "without authentication with --insecure (loopback binds only)")
    if secret is not None and args.insecure:
        parser.error("--insecure and a secret together: choose one")
    try:
        config = LighthouseConfig(
            bind=args.bind,
            min_replicas=args.min_replicas,
            join_timeout_s=args.join_timeout,
            detect_s=args.detect,
            beats_per_s=args.beats_per_s,
            num_replicas=args.replicas,
            tick_s=args.tick,
            forget_after_s=args.forget_after,
            max_pending_rpcs=args.max_pending_rpcs,
            secret=secret,
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
            limits=guard.Limits(max_replicas_per_job=args.max_replicas_per_job, max_jobs=args.max_jobs),
            fairness=None if args.no_fairness else admission.FairnessLimits(
                connection_calls_per_s=args.connection_calls_per_s),
            rca_interval_s=args.rca_interval,
            metrics_bind=args.metrics_bind,
        )
    except ValueError as e:
        parser.error(str(e))
    from fthsdp import logs

    logs.setup("fthsdp.control.lighthouse", level=getattr(logging, args.log_level))  # text or JSON ($FTHSDP_LOG_FORMAT)
    if args.standby:
        from fthsdp.launch.lifetime import wait_to_serve  # (and what serving imports: imported while it waits)

        if not wait_to_serve(sys.stdin, "fthsdp lighthouse"):
            return 0
        log.info("standby lighthouse: told to serve on %s", config.bind)
    try:
        asyncio.run(_serve(config, args.port_file))
    except OSError as e:
        print(f"fthsdp lighthouse: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # `python -m fthsdp.control.lighthouse` runs this file as __main__, a second copy of the
    # module beside the fthsdp.control.lighthouse that the other modules import: serve
    # from that one, so that every class is the one they know.
    from fthsdp.control import lighthouse as _canonical

    sys.exit(_canonical.cli(sys.argv[1:]))
