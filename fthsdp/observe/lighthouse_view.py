"""A lighthouse seen from outside: its Status RPC as plain data, plus history.

One Status answer is a snapshot: the current quorum, each replica's step,
heartbeat age and whether it is dead. What an operator asks ("when did
replica 1 die, how long until the lighthouse noticed, when was it back, how
did membership change") needs the snapshots over time. :class:`History` keeps
that from successive polls, in memory and bounded; it is a pure object (views
in, events out) so it is unit-tested without a server.

The poller talks to the lighthouse only through its public Status call, so
the dashboard and the lighthouse metrics work against any running lighthouse
without touching its code.
"""

from __future__ import annotations

import collections
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from fthsdp.digits import ascii_int
from fthsdp.observe.root_cause import RootCauseStatus

if TYPE_CHECKING:
    from fthsdp.control.lighthouse_client import StatusReply

# Replica states as the dashboard and metrics name them.
DEAD = "dead"  # the lighthouse declared it dead (heartbeat silence > detect_s)
HEALTHY = "healthy"  # member of the current quorum, at its max step: contributes gradients
BEHIND = "behind"  # member of the current quorum below its max step: fetches state, sends zeros
WAITING = "waiting"  # alive, asking for a quorum that does not include it yet
OUTSIDE = "outside"  # alive, not in the current quorum, not asking (starting, compiling, done)
STATES = (HEALTHY, BEHIND, WAITING, OUTSIDE, DEAD)
# How a replica was lost (Failure.kind): declared dead, or dropped from the quorum while alive.
LEFT_QUORUM = "left quorum"
# Gone from the lighthouse's view while the job runs: its process left (a fault it classified ends
# with a Leave, and the lighthouse forgets it) or a restarted lighthouse never heard it again.
LEFT_JOB = "left job"
FAILURE_KINDS = (DEAD, LEFT_QUORUM, LEFT_JOB)


class LighthouseUnreachable(ConnectionError):
    """The lighthouse's Status call failed, or its answer could not be read; the message says
    where and why."""


@dataclass(frozen=True)
class ReplicaView:
    replica_id: str
    step: int
    heartbeat_age_s: float  # < 0: never heard
    dead: bool
    waiting: bool
    # Where its process 0 serves /metrics ("" = not advertised); see metrics_addresses.
    metrics_address: str = ""
    # Its last phase report (root-cause analysis): "computing", "allreduce", ... ("" = none),
    # seconds in it, and in the all-reduce the replica whose data it waits for.
    phase: str = ""
    phase_s: float = 0.0
    waiting_on: str = ""
    # Every process's /metrics address (index = process; ReplicaStatus.metrics_addresses).
    metrics_addresses: tuple[str, ...] = ()
    # Silent-data-corruption check: its last fingerprint (hex, "" = none) and why its
    # state is condemned ("" = it is not).
    fingerprint: str = ""
    condemned: str = ""


@dataclass(frozen=True)
class SdcView:
    """A fingerprint mismatch the lighthouse found (fthsdp/control/sdc.py)."""

    step: int
    culprits: tuple[str, ...]
    fatal: bool  # no majority: the job was stopped
    reason: str


@dataclass(frozen=True)
class QuorumView:
    quorum_id: int
    members: tuple[str, ...]
    healthy: tuple[str, ...]
    behind: tuple[str, ...]
    max_step: int
    reason: str


@dataclass(frozen=True)
class JobView:
    job_id: str
    replicas: tuple[ReplicaView, ...]
    quorum: QuorumView | None
    last_reason: str
    num_configured: int
    local_world_size: int
    root_cause: RootCauseStatus | None = None  # the verdict now
    last_stall: RootCauseStatus | None = None  # the last verdict that named a culprit
    sdc_events: tuple[SdcView, ...] = ()  # fingerprint mismatches, oldest first
    finished_step: int | None = None  # the job finished at this step (None: it has not)

    def state_of(self, r: ReplicaView) -> str:
        """One word for a replica, from the lighthouse's point of view."""
        if r.dead:
            return DEAD
        q = self.quorum
        if q is not None and r.replica_id in q.members:
            return BEHIND if r.replica_id in q.behind else HEALTHY
        return WAITING if r.waiting else OUTSIDE


@dataclass(frozen=True)
class LighthouseView:
    time: float  # wall clock of the answer (time.time())
    jobs: tuple[JobView, ...]
    detect_s: float
    min_replicas: int
    metrics_address: str = ""  # where the lighthouse serves its own /metrics ("" = it does not)
    beat_interval_s: float = 0.0  # the slowest it asks processes to beat (0: their own; pacing widens detect_s)

    def job(self, job_id: str) -> JobView | None:
        return next((j for j in self.jobs if j.job_id == job_id), None)


def view_from_status(reply: "StatusReply", now: float) -> LighthouseView:
    """A lighthouse's Status, as the client reads it (:class:`StatusReply`), in the dashboard's
    terms: ids instead of members, a phase as its word, a fingerprint as hex."""

    def quorum(q) -> QuorumView | None:
        return None if q is None else QuorumView(q.quorum_id, q.member_ids, q.healthy, q.behind, q.max_step, q.reason)

    def replica(r) -> ReplicaView:
        word = r.phase.phase.name.lower().replace("_", "-") if r.phase is not None else ""
        return ReplicaView(r.replica_id, r.step, r.last_heartbeat_age_s, r.dead, r.waiting,
                           r.metrics_addresses[0] if r.metrics_addresses else "",
                           "" if word == "unknown" else word, r.phase.in_phase_s if r.phase is not None else 0.0,
                           r.phase.waiting_on if r.phase is not None else "", r.metrics_addresses,
                           f"{r.fingerprint:016x}@{r.fingerprint_step}" if r.fingerprint is not None else "",
                           r.condemned)

    jobs = tuple(
        JobView(j.job_id, tuple(replica(r) for r in j.replicas), quorum(j.quorum), j.last_reason, j.num_configured,
                j.local_world_size, j.root_cause, j.last_stall,
                tuple(SdcView(e.step, tuple(e.culprits), e.fatal, e.reason) for e in j.sdc_events), j.finished_step)
        for j in reply.jobs
    )
    return LighthouseView(now, jobs, reply.detect_s, reply.min_replicas, reply.metrics_address,
                          reply.beat_interval_s)


def view_from_proto(resp: Any, now: float) -> LighthouseView:
    """A ``StatusResponse`` as the dashboard's plain data (read once, by the client's
    :func:`~fthsdp.control.lighthouse_client.status_from_proto`)."""
    from fthsdp.control.lighthouse_client import status_from_proto

    return view_from_status(status_from_proto(resp), now)


class StatusPoller:
    """Calls a lighthouse's Status RPC (every job) with a deadline on each call."""

    def __init__(self, address: str, rpc_timeout_s: float = 2.0, status_key: bytes | None = None) -> None:
        """``status_key``: the lighthouse's read-only key (fthsdp.control.auth), needed unless
        the lighthouse runs with --insecure."""
        import grpc

        from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse

        host, sep, port = address.rpartition(":")
        if not sep or not host or ascii_int(port, max_digits=5) is None:
            raise ValueError(f"lighthouse address {address!r} is not HOST:PORT (e.g. 127.0.0.1:29510)")
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self._grpc = grpc
        self._pb2, _ = lighthouse()
        self._version = LIGHTHOUSE_PROTOCOL_VERSION
        self._channel = grpc.insecure_channel(address)
        self._status = self._channel.unary_unary("/fthsdp.v1.Lighthouse/Status", request_serializer=None,
                                                 response_deserializer=self._pb2.StatusResponse.FromString)
        self._key = status_key

    def poll(self) -> LighthouseView:
        from fthsdp.control import auth

        body = self._pb2.StatusRequest(protocol_version=self._version).SerializeToString()
        if self._key:
            body = auth.signed_request(self._key, "Status", "", "", body, kind="status")
        try:
            resp = self._status(body, timeout=self.rpc_timeout_s)
        except self._grpc.RpcError as e:
            raise LighthouseUnreachable(
                f"lighthouse {self.address}: Status failed ({e.code().name}: {e.details()}); "
                "is `fthsdp lighthouse` running there?") from e
        from fthsdp.control.lighthouse_client import LighthouseError

        try:
            return view_from_proto(resp, time.time())
        except LighthouseError as e:  # an answer it cannot read (a mismatched or lying lighthouse)
            raise LighthouseUnreachable(f"lighthouse {self.address}: its Status answer cannot be read: {e}") from e

    def close(self) -> None:
        self._channel.close()


# -- history -------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One poll of one job: the quorum and every replica's state."""

    time: float
    quorum_id: int
    members: tuple[str, ...]
    states: dict[str, str]  # replica -> one of STATES


@dataclass
class Failure:
    """A replica lost to the job: declared dead, or dropped from the quorum alive."""

    job: str
    replica: str
    kind: str  # one of FAILURE_KINDS
    time: float  # when a poll first showed it
    quorum_id: int  # the quorum it was lost from
    silence_s: float | None = None  # heartbeat silence when first seen dead (detection time, to one poll)
    back_time: float | None = None  # when it was a quorum member again
    back_after_s: float | None = None
    # The survivors' stall: from the job's last step before the loss to its
    # first step seen once the loss was (to within a poll; the replicas'
    # fthsdp_stall_seconds has it exactly). None until the job stepped again.
    stall_s: float | None = None
    lost_at: float | None = None  # estimated time of the loss: last heard (dead), else when seen
    progress_before: float | None = None  # the last poll that saw the job step before lost_at
    # A dead replica seen alive again (restarted) that has not rejoined a quorum yet: if it dies
    # again, that is a new failure (a crash loop is counted at every death, not once).
    revived: bool = False
    ended: bool = False  # closed by a new failure of the same replica (it died again before rejoining)


@dataclass
class JobHistory:
    samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=2000))
    failures: collections.deque = field(default_factory=lambda: collections.deque(maxlen=100))
    decisions: int = 0  # quorum changes seen
    steps: dict[str, collections.deque] = field(default_factory=dict)  # replica -> (time, step, state) of recent polls
    last_reason: str = ""
    max_step: int = -1  # the job's highest live replica step seen
    members: tuple = ()  # the members of the last decided quorum seen (a restarted lighthouse has none yet)
    last_quorum_id: int = 0
    advances: collections.deque = field(default_factory=lambda: collections.deque(maxlen=512))  # polls it grew


class History:
    """Membership and failures over time, built from successive views.

    ``update(view)`` returns the failures that this view revealed (for logs and
    counters); ``job_json(job_id)`` is what the dashboard shows. A failure is
    recorded once per loss: a replica first seen dead, or a member of the
    previous quorum missing from the new one while alive. It is closed (back)
    when the replica is a quorum member again.
    """

    STEP_WINDOW = 20  # polls used for a replica's step-time estimate
    # A job the lighthouse no longer lists is kept this long (its failures stay on the page; the
    # lighthouse itself forgets a silent job after 10 minutes), and at most MAX_JOBS such jobs are
    # kept: a dashboard that runs for months does not keep every job it ever saw.
    FORGET_AFTER_S = 3600.0
    MAX_JOBS = 256

    def __init__(self) -> None:
        self.jobs: dict[str, JobHistory] = {}
        self._prev: dict[str, Sample] = {}
        self._last_listed: dict[str, float] = {}  # job -> the time of the last view that listed it
        self.forgotten: list[str] = []  # the jobs the last update() forgot (their series go too)
        # The failures the last update() found dead that were open as "left quorum" (not new:
        # counted when they left, but their detection time is known only now).
        self.upgraded: list[Failure] = []

    def _forget_old_jobs(self, now: float, listed: set[str]) -> None:
        # Only jobs the lighthouse no longer lists: a listed one forgotten each poll lost its history
        # (its failures went unseen) and its counters restarted.
        by_age = sorted((j for j in self._last_listed if j not in listed), key=self._last_listed.__getitem__)
        gone = [j for j in by_age if now - self._last_listed[j] > self.FORGET_AFTER_S]
        gone += [j for j in by_age if j not in gone][:max(0, len(by_age) - len(gone) - self.MAX_JOBS)]
        for j in gone:
            self.jobs.pop(j, None)
            self._prev.pop(j, None)
            del self._last_listed[j]
        self.forgotten = gone

    def update(self, view: LighthouseView) -> list[Failure]:
        found: list[Failure] = []
        upgraded: list[Failure] = []
        for job in view.jobs:
            self._last_listed[job.job_id] = view.time
        self._forget_old_jobs(view.time, {job.job_id for job in view.jobs})
        for job in view.jobs:
            h = self.jobs.setdefault(job.job_id, JobHistory())
            q = job.quorum
            s = Sample(view.time, q.quorum_id if q else 0, q.members if q else (),
                       {r.replica_id: job.state_of(r) for r in job.replicas})
            prev = self._prev.get(job.job_id)
            if prev is not None and s.quorum_id != prev.quorum_id and s.quorum_id:
                h.decisions += 1
            elif prev is None and s.quorum_id:
                h.decisions += 1
            h.last_reason = job.last_reason or (q.reason if q else "")
            new: list[Failure] = []
            open_ = {f.replica: f for f in h.failures if f.back_time is None and not f.ended}
            for r in job.replicas:
                was = prev.states.get(r.replica_id) if prev else None
                silence = r.heartbeat_age_s if r.heartbeat_age_s >= 0 else None
                if prev is None:
                    pass  # the first poll seeds the history: what was lost before it is not a new failure
                elif r.dead and was != DEAD:
                    f = open_.get(r.replica_id)
                    if f is not None and f.kind == "dead" and f.revived:  # restarted, died again before rejoining
                        f.ended = True
                        f = open_[r.replica_id] = None
                    if f is not None and f.kind != "dead":  # it left the quorum first, then was declared dead
                        f.kind, f.silence_s = "dead", silence
                        upgraded.append(f)
                    elif f is None:
                        new.append(Failure(job.job_id, r.replica_id, "dead", view.time,
                                           prev.quorum_id if prev else s.quorum_id, silence_s=silence))
                elif (not r.dead and r.replica_id in prev.members and s.quorum_id and s.quorum_id != prev.quorum_id
                      and r.replica_id not in s.members and r.replica_id not in open_):
                    # (a lighthouse restarted lists replicas before its first quorum: no quorum yet is
                    # nobody's loss, or every member of the job would count as lost at each restart)
                    new.append(Failure(job.job_id, r.replica_id, LEFT_QUORUM, view.time, prev.quorum_id))
                f = open_.get(r.replica_id)
                if f is not None and f.kind == "dead" and not r.dead:
                    f.revived = True
                if f is not None and not r.dead and r.replica_id in s.members and s.quorum_id > f.quorum_id:
                    f.back_time = view.time
                    f.back_after_s = view.time - f.time
                dq = h.steps.setdefault(r.replica_id, collections.deque(maxlen=self.STEP_WINDOW))
                if dq and r.step < dq[-1][1]:
                    dq.clear()  # restarted from an earlier step
                dq.append((view.time, r.step, s.states[r.replica_id]))
            for gone in set(h.steps) - set(s.states):  # a replica the lighthouse forgot
                del h.steps[gone]
            if prev is not None and job.finished_step is None and s.quorum_id:
                # Only against a decided quorum: a restarted lighthouse lists its replicas as they come
                # back, before its first quorum, and the members not back yet have not left.
                listed = {r.replica_id for r in job.replicas}
                new.extend(Failure(job.job_id, rid, LEFT_JOB, view.time, h.last_quorum_id) for rid in h.members
                           if rid not in listed and not open_.get(rid))
            if s.quorum_id:
                h.members, h.last_quorum_id = s.members, s.quorum_id
            top = max((r.step for r in job.replicas if not r.dead), default=-1)
            stepped = top > h.max_step
            if stepped:
                h.max_step = top
                h.advances.append(view.time)
            for f in new:
                f.lost_at = view.time - f.silence_s if f.silence_s is not None else view.time
                f.progress_before = max((t for t in h.advances if t <= f.lost_at), default=None)
            if stepped:  # the job stepped: that ends the stall of every loss seen so far
                for f in (*h.failures, *new):
                    if f.stall_s is None and f.progress_before is not None:
                        f.stall_s = view.time - f.progress_before
            h.failures.extend(new)
            found.extend(new)
            h.samples.append(s)
            self._prev[job.job_id] = s
        self.upgraded = upgraded
        return found

    def step_seconds(self, job_id: str, replica: str) -> float | None:
        """Seconds per step over the recent polls in which the replica trained
        (healthy at both ends): a catch-up jumps many steps at once and is not a
        step time. None until it trained a step under observation."""
        dq = self.jobs.get(job_id, JobHistory()).steps.get(replica)
        if not dq:
            return None
        dt = dsteps = 0.0
        for (t0, s0, st0), (t1, s1, st1) in zip(list(dq), list(dq)[1:]):
            if st0 == st1 == HEALTHY and s1 >= s0:
                dt, dsteps = dt + (t1 - t0), dsteps + (s1 - s0)
        return dt / dsteps if dsteps > 0 else None

    def job_json(self, job: JobView, max_samples: int = 600) -> dict:
        """Everything the dashboard shows of one job, as JSON-ready data."""
        h = self.jobs.get(job.job_id, JobHistory())
        q = job.quorum
        return {
            "job_id": job.job_id,
            "num_configured": job.num_configured,
            "local_world_size": job.local_world_size,
            "finished_step": job.finished_step,  # None while it trains
            "quorum": None if q is None else {
                "quorum_id": q.quorum_id, "members": list(q.members), "healthy": list(q.healthy),
                "behind": list(q.behind), "max_step": q.max_step, "reason": q.reason},
            "last_reason": h.last_reason or job.last_reason,
            "decisions": h.decisions,
            "replicas": [
                {"replica_id": r.replica_id, "step": r.step, "state": job.state_of(r),
                 "heartbeat_age_s": r.heartbeat_age_s, "step_s": self.step_seconds(job.job_id, r.replica_id),
                 "phase": r.phase, "phase_s": r.phase_s, "waiting_on": r.waiting_on,
                 "fingerprint": r.fingerprint, "condemned": r.condemned}
                for r in job.replicas
            ],
            "root_cause": None if job.root_cause is None else asdict(job.root_cause),
            "last_stall": None if job.last_stall is None else asdict(job.last_stall),
            "sdc_events": [asdict(e) for e in job.sdc_events],
            "timeline": [
                {"t": s.time, "quorum_id": s.quorum_id, "members": list(s.members), "states": s.states}
                for s in changes(h.samples)[-max_samples:]
            ],
            "failures": [asdict(f) for f in reversed(h.failures)],
        }


def changes(samples) -> list[Sample]:
    """The samples where the quorum or a replica's state changed, plus the last
    one: the same timeline, drawn from a fraction of the data."""
    out: list[Sample] = []
    for s in samples:
        if not out or (s.quorum_id, s.members, s.states) != (out[-1].quorum_id, out[-1].members, out[-1].states):
            out.append(s)
    samples = list(samples)
    if samples and out[-1] is not samples[-1]:
        out.append(samples[-1])
    return out
