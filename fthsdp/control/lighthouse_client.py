"""Synchronous lighthouse client, as one replica's Manager uses it.

``get_quorum`` blocks until the lighthouse decides the next step's quorum
(deadline-bounded, with the lighthouse's reason on timeout). A daemon thread
heartbeats about every 100 ms and calls ``on_dead(dead_members, quorum_id)``
whenever the lighthouse reports members of the current quorum dead, so the
Manager can abort its in-flight FTAR at once; the FTAR deadline stays the
backstop. Every RPC carries a deadline.

**Riding out a lighthouse outage.** A lighthouse that dies (and is restarted
on the same address) must not take the job with it: ``get_quorum`` retries an
unreachable lighthouse with capped exponential backoff for up to
``outage_s`` (``ft.lighthouse_outage_s``) before it gives up, and the
heartbeat thread keeps trying every interval. The caller's step is untouched
meanwhile (its gradients stay in hand). Every request reports the last quorum
this replica was a member of, from which a restarted lighthouse rebuilds the
job (see :mod:`fthsdp.control.lighthouse`). ``leave`` says goodbye at a normal exit.

**A process of a replica of several.** Constructed with ``process_index`` and
``num_processes``, the client heartbeats as that process and, once given its
own shards' endpoints (:meth:`LighthouseClient.register`), sends them with its
heartbeats until the lighthouse says it holds them. Only the leader (process
0) calls ``get_quorum``; the others call :meth:`LighthouseClient.get_view`
with the quorum id their leader hands them. Either way the answer is this
process's view: ``Quorum.rings`` (its shards' rings) and ``Quorum.sources``.

**Credentials.** Given the job's secret (``key``), every call is signed
(:mod:`fthsdp.control.auth`: an HMAC over the method, ids, the exact request
bytes, a timestamp and a nonce, appended to the request as its ``credential``
field), and carries this process's
*incarnation*, a random token that binds its (replica id, process) to this
process (see :func:`fthsdp.control.guard.incarnation_problem`).
``status_key`` signs Status calls only. ``tls_ca_file`` connects over TLS,
trusting that certificate.
"""

from __future__ import annotations

import dataclasses

import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from fthsdp.addresses import split_host_port
from fthsdp.control import auth, quorum as qm
from fthsdp.control.channel_args import RECONNECT_ARGS
from fthsdp.control.pacing import paced_interval, reported_ms
from fthsdp.control.session import SESSION_METHODS
from fthsdp.control.session_client import (RelayPath, Routed, SessionError, SessionRoute, SessionUnsupported,
                                           SyncSession, beat_covered)
from fthsdp.observe.load_metrics import LoadSnapshot
from fthsdp.observe.phase import Phase, PhaseSnapshot, StreamReport
from fthsdp.observe.root_cause import RootCauseStatus
from fthsdp.errors import JobFatalError
from fthsdp.proto import ENDPOINTS_NOT_HELD, LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as _load_stubs

pb2, pb2_grpc = _load_stubs()
log = logging.getLogger("fthsdp.control.lighthouse_client")

__all__ = [
    "LighthouseClient",
    "HeartbeatReply",
    "Registration",
    "ReplicaStatus",
    "JobStatus",
    "load_from_status",
    "status_from_proto",
    "format_load",
    "LighthouseError",
    "QuorumTimeout",
    "InvalidLighthouseRequest",
    "LighthouseUnavailable",
    "JobFinished",
    "SilentDataCorruption",
    "quorum_from_proto",
]


class LighthouseError(RuntimeError):
    """A lighthouse call failed; ``code`` is the gRPC status code."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class QuorumTimeout(LighthouseError, TimeoutError):
    """No answer within the deadline (the message carries the lighthouse's reason)."""


class InvalidLighthouseRequest(LighthouseError, ValueError):
    """The lighthouse rejected the request as malformed (the message says what to fix)."""


class JobNotFound(LighthouseError, LookupError):
    """The lighthouse has no such job yet (no replica of it has been heard from)."""


class LighthouseUnavailable(LighthouseError, ConnectionError):
    """The lighthouse cannot be reached (``outage_s``: for how long it was retried)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, outage_s: float = 0.0) -> None:
        super().__init__(message, code)
        self.outage_s = outage_s


class NotAuthorized(LighthouseError, PermissionError):
    """The lighthouse refused the credential (UNAUTHENTICATED / PERMISSION_DENIED); the message says why."""


class CredentialRefused(NotAuthorized):
    """The lighthouse refused the credential itself (auth.PERMANENT_REFUSALS: another secret, none,
    a client that signs otherwise): asking again cannot change that, unlike a replay or clock
    refusal or a replica id held by another process."""


class ReplicaIdHeld(NotAuthorized):
    """Another live process holds this replica id (guard.incarnation_problem): get_quorum retries
    until it is declared dead, then raises this."""


class JobFinished(LighthouseError):
    """The job this replica asks to train in already finished (at ``step``): nothing is left to do.

    ``data``: the finished model's data state (``{"positions": [...], "last_step": [...]}``,
    one entry per replica) as the replica that ended the job left it, or None when the
    lighthouse holds none. A replica arriving after the end records from it a batch it
    trained but had not written into its ledger."""

    def __init__(self, message: str, step: int, data: dict | None = None) -> None:
        super().__init__(message, None)
        self.step = step
        self.data = data


class SilentDataCorruption(LighthouseError, JobFatalError):
    """The lighthouse stopped the job: the replicas' fingerprints of one step disagree with
    no majority to tell which is right (the message names the step and every fingerprint)."""


_SERVICE = "/fthsdp.v1.Lighthouse/"
_CHANNEL_OPTIONS = [
    # A connection of its own: the lighthouse budgets calls per connection (fthsdp/control/admission.py),
    # so clients of one process (tests, tools) must not pool theirs into one.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),  # a quorum answer of the largest job admitted
    *RECONNECT_ARGS,  # reconnect within 0.1 s of a restart; a busy server gets time to connect
]


_REPLY_TYPES = {"GetQuorum": pb2.QuorumResponse, "Heartbeat": pb2.HeartbeatResponse}


def older_lighthouse_advice(signed: bool, code: grpc.StatusCode | None, details: str) -> str | None:
    """What to say instead when a lighthouse older than this client refused a signed call.

    This client signs in the request's credential field (field 130, fthsdp.control.auth); a
    lighthouse from before that field reads the credential from gRPC metadata, skips the field
    as unknown and answers that the call "carries no credential", which sends an operator
    hunting for a secret the replicas do have. A current lighthouse names the field in that
    refusal, so a refusal of a signed call that does not is an older lighthouse's: None when
    the refusal is anything else."""
    if (signed and code == grpc.StatusCode.UNAUTHENTICATED and "carries no credential" in details
            and f"field {auth.CREDENTIAL_FIELD}" not in details):
        return (f"the lighthouse is older than this client: it looks for the credential in gRPC metadata and does "
                f"not know the request's credential field ({auth.CREDENTIAL_FIELD}) that this client signs in, so it "
                "found none (the secret is not the problem): upgrade fthsdp on the lighthouse to this client's "
                f"version, or run the replicas with the lighthouse's version (it answered: {details})")
    return None


def new_request_id() -> int:
    """A quorum request's id (QuorumRequest.request_id): random, never 0 (0 = none)."""
    return int.from_bytes(os.urandom(8), "little") or 1


def backoff_delays(first_s: float = 0.05, cap_s: float = 0.5, factor: float = 2.0):
    """Retry delays: exponential from ``first_s``, capped at ``cap_s`` (a restart
    is noticed within ``cap_s``; an outage costs the lighthouse a few RPCs per second per replica)."""
    d = first_s
    while True:
        yield d
        d = min(cap_s, d * factor)


@dataclass
class Registration:
    """One process's own shards' endpoints, and whether the lighthouse holds them.

    A process of a replica of several registers its FTAR endpoints, its state
    server and the replica's shard count by sending them with its heartbeats
    until a reply says the lighthouse holds them (``addresses_registered``); a
    reply saying it does not (a restarted lighthouse, which remembers nothing)
    makes them go out again. One rule for both clients that heartbeat: the
    synchronous :class:`LighthouseClient` (its heartbeat thread) and the
    emulation's asyncio client (:mod:`fthsdp.sim.aio_client`).

    ``endpoints`` is replaced whole (one tuple) so that a heartbeat thread reading
    it never sees half of a new registration; :meth:`heard` counts a reply only
    for the registration that request carried.
    """

    endpoints: tuple[tuple[str, ...], str, int] | None = None  # (ftar addresses, state server, shards per replica)
    held: bool = False  # the lighthouse said it holds ``endpoints``

    def give(self, ftar_addresses: Sequence[str], state_server_address: str, local_world_size: int) -> None:
        """New endpoints: sent with the next heartbeats until held."""
        self.endpoints = (tuple(ftar_addresses), state_server_address, int(local_world_size))
        self.held = False

    def fill(self, req: pb2.HeartbeatRequest) -> tuple[tuple[str, ...], str, int] | None:
        """Add the endpoints to heartbeat ``req`` unless the lighthouse holds them; returns
        the registration the request speaks for (pass it to :meth:`heard`)."""
        ep = self.endpoints
        if ep is not None and not self.held:
            req.ftar_addresses.extend(ep[0])
            req.state_server_address, req.local_world_size = ep[1], ep[2]
        return ep

    def heard(self, sent: tuple[tuple[str, ...], str, int] | None, addresses_registered: bool) -> None:
        """A heartbeat reply: held stops the sending, not held starts it again."""
        if sent is not None and sent is self.endpoints:
            self.held = addresses_registered


@dataclass
class HeldEndpoints:
    """Whether a leader's quorum requests may leave its endpoints out (``endpoints_held``).

    A leader sends its shards' FTAR endpoints and its state server with every quorum
    request; at 196 shards per process that is 196 addresses the lighthouse read and
    checked again each step, a fifth of its CPU per round at 512 replicas. Once a
    lighthouse has answered a request that carried them with ``endpoints_omittable``,
    it keeps them, and the next requests with the same endpoints set ``endpoints_held``
    instead. A lighthouse that no longer holds them (restarted) refuses with
    ``ENDPOINTS_NOT_HELD``; :meth:`lost` then makes the request go out whole again. An
    older lighthouse never says ``endpoints_omittable``, so it always gets them. One rule
    for the synchronous :class:`LighthouseClient` and the emulation's asyncio client.
    """

    held: tuple[tuple[str, ...], str] | None = None  # (ftar addresses, state server) the lighthouse keeps

    def fill(self, req: pb2.QuorumRequest, ftar_addresses: Sequence[str], state_server_address: str
             ) -> tuple[tuple[str, ...], str]:
        """Put the endpoints into ``req``, or ``endpoints_held`` when the lighthouse keeps these
        very ones; returns what the request speaks for (pass it to :meth:`heard`)."""
        ep = (tuple(ftar_addresses), state_server_address)
        if ep == self.held:
            req.endpoints_held = True
        else:
            req.ftar_addresses.extend(ep[0])
            req.state_server_address = ep[1]
        return ep

    def heard(self, sent: tuple[tuple[str, ...], str], endpoints_omittable: bool) -> None:
        """An answer to a request that spoke for ``sent``."""
        self.held = sent if endpoints_omittable else None

    def lost(self) -> None:
        """The lighthouse said it does not hold them: send them with the next request."""
        self.held = None


def endpoints_not_held(code, details: str | None) -> bool:
    """Whether a refusal is the lighthouse's ``ENDPOINTS_NOT_HELD`` (send the endpoints again)."""
    return code == grpc.StatusCode.FAILED_PRECONDITION and (details or "").startswith(ENDPOINTS_NOT_HELD)


@dataclass(frozen=True)
class HeartbeatReply:
    dead_replica_ids: tuple[str, ...]
    quorum_id: int
    dead_members: tuple[str, ...]  # dead members of the lighthouse's current quorum
    # Replicas asking for a quorum at or before the step of the all-reduce this beat reported
    # itself in, and that all-reduce as (quorum id, step); empty / None unless it reported one.
    asking: tuple[str, ...] = ()
    allreduce: tuple[int, int] | None = None
    # The lighthouse's pace: beat no more often than this (0.0 = at your own interval; pacing.py).
    beat_interval_s: float = 0.0


def heartbeat_reply(resp: pb2.HeartbeatResponse, allreduce: tuple[int, int] | None) -> HeartbeatReply:
    """A HeartbeatResponse as plain data; ``allreduce``: the (quorum id, step) of the all-reduce
    the beat reported (its phase), which the reply's ``asking`` list is about."""
    asking = tuple(resp.asking_replica_ids)
    return HeartbeatReply(tuple(resp.dead_replica_ids), resp.quorum_id, tuple(resp.dead_members), asking,
                          allreduce if asking else None, resp.beat_interval_ms / 1000.0)


@dataclass(frozen=True)
class ReplicaStatus:
    replica_id: str
    step: int
    last_heartbeat_age_s: float
    dead: bool
    waiting: bool
    num_processes: int = 1
    silent_processes: tuple[int, ...] = ()  # processes silent past the detection window
    phase: PhaseSnapshot | None = None  # its last phase report (None: none)
    metrics_addresses: tuple[str, ...] = ()  # its processes' /metrics, index = process
    fingerprint: int | None = None  # of its state after fingerprint_step committed steps
    fingerprint_step: int = 0
    condemned: str = ""  # why its state is condemned (a fingerprint mismatch), "" if not


def phase_to_proto(s: PhaseSnapshot) -> "pb2.PhaseReport":
    return pb2.PhaseReport(
        phase=pb2.Phase.Value("PHASE_" + s.phase.name), step=s.step, in_phase_s=s.in_phase_s,
        quorum_id=s.quorum_id, ring_step=s.ring_step, ring_steps=s.ring_steps, waiting_on=s.waiting_on,
        waiting_s=s.waiting_s, bytes_moved=s.bytes_moved, compute_s=s.compute_s,
        last_step_s=s.last_step_s,
        streams=[pb2.StreamRate(to_replica=x.to_replica, bytes_per_s=x.bytes_per_s, bytes=x.bytes,
                                busy_fraction=x.busy_fraction)
                 for x in s.streams])


_PHASE_BY_NUMBER = {pb2.Phase.Value("PHASE_" + p.name): p for p in Phase}


def phase_from_proto(p: "pb2.PhaseReport") -> PhaseSnapshot | None:
    """None for an unknown phase (a newer sender): shown as no report rather than guessed."""
    phase = _PHASE_BY_NUMBER.get(p.phase)
    if phase is None:
        return None
    return PhaseSnapshot(phase, p.step, p.in_phase_s, p.quorum_id, p.ring_step, p.ring_steps, p.waiting_on,
                         p.waiting_s, p.bytes_moved,
                         tuple(StreamReport(x.to_replica, x.bytes_per_s, x.bytes, x.busy_fraction)
                               for x in p.streams),
                         p.compute_s, p.last_step_s)


def root_cause_from_proto(r: "pb2.RootCause") -> RootCauseStatus:
    return RootCauseStatus(r.kind, r.culprit, r.peer, r.evidence, r.confidence, tuple(r.wait_chain), r.step, r.age_s,
                           r.process)


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    replicas: tuple[ReplicaStatus, ...]
    quorum: qm.Quorum | None
    last_reason: str
    local_world_size: int
    num_configured: int
    root_cause: RootCauseStatus | None = None  # the verdict now (None: not analysed yet)
    last_stall: RootCauseStatus | None = None  # the last verdict that named a culprit
    sdc_events: tuple = ()  # pb2.SdcEvent: fingerprint mismatches, oldest first
    sdc_fatal: str = ""
    finished_step: int | None = None  # the job finished at this step (a replica left having reached it)


@dataclass(frozen=True)
class StatusReply:
    """A lighthouse's Status: its jobs, its own load (a Status of every job only, which needs its
    status key; else None), and how fast it detects a death now. The one reading of a
    ``StatusResponse`` (:func:`status_from_proto`): ``fthsdp status`` prints it, the dashboard and
    the lighthouse's exporter view it (fthsdp/observe/lighthouse_view.py)."""

    jobs: list[JobStatus]
    load: LoadSnapshot | None
    detect_s: float  # the silence that declares a process dead: wider than configured while paced
    beat_interval_s: float  # the slowest it asks its processes to beat (0 = their own interval)
    min_replicas: int = 0
    metrics_address: str = ""  # where the lighthouse serves its own /metrics ("" = it does not)


def status_from_proto(resp: "pb2.StatusResponse") -> StatusReply:
    """A ``StatusResponse`` as plain data (a field an older lighthouse does not send reads as its
    default)."""
    jobs = [
        JobStatus(
            job_id=j.job_id,
            replicas=tuple(
                ReplicaStatus(r.replica_id, r.step, r.last_heartbeat_age_s, r.dead, r.waiting,
                              r.num_processes or 1, tuple(r.silent_processes),
                              phase_from_proto(r.phase) if r.HasField("phase") else None,
                              metrics_addresses=tuple(r.metrics_addresses),
                              fingerprint=r.fingerprint if r.HasField("fingerprint") else None,
                              fingerprint_step=r.fingerprint_step,
                              condemned=r.condemned)
                for r in j.replicas
            ),
            quorum=quorum_from_proto(j.quorum) if j.has_quorum else None,
            last_reason=j.last_reason,
            local_world_size=j.local_world_size,
            num_configured=j.num_configured,
            root_cause=root_cause_from_proto(j.root_cause) if j.HasField("root_cause") else None,
            last_stall=root_cause_from_proto(j.last_stall) if j.HasField("last_stall") else None,
            sdc_events=tuple(j.sdc_events),
            sdc_fatal=j.sdc_fatal,
            finished_step=j.finished_step if j.finished_step >= 0 else None,
        )
        for j in resp.jobs
    ]
    return StatusReply(jobs, load_from_status(resp), resp.detect_s, resp.beat_interval_s, resp.min_replicas,
                       resp.metrics_address)


def format_detection(reply: StatusReply) -> str:
    """A person's line about failure detection, and why it is slower when the beats are paced."""
    line = f"failure detection: {reply.detect_s:.3g} s of silence"
    if reply.beat_interval_s > 0:
        line += (f"; processes asked to beat every {reply.beat_interval_s:.3g} s at most (the lighthouse's beat "
                 f"budget, `fthsdp lighthouse --beats-per-s`: more processes than it carries at their own "
                 f"interval widen detection; raise it on a host with the CPU for it)")
    return line


def load_from_status(resp: "pb2.StatusResponse") -> LoadSnapshot | None:
    """The lighthouse's load as a Status of every job carries it (``LighthouseLoad``, its fields
    named as the snapshot's), with the failure detection in force from the reply's top level;
    None when the reply has no load (a Status of one job)."""
    if not resp.HasField("load"):
        return None
    top = {"detect_s": resp.detect_s, "beat_interval_s": resp.beat_interval_s}
    p = resp.load
    return LoadSnapshot(**{f.name: getattr(p, f.name) for f in dataclasses.fields(LoadSnapshot)
                           if f.name not in top and f.name != "refused_by_code"},
                        refused_by_code=dict(p.refused_by_code), **top)


def format_load(load: LoadSnapshot, before: LoadSnapshot | None = None) -> str:
    """A person's line about the lighthouse's load: since it started, or, given the reading
    ``before`` of the same lighthouse (``fthsdp status --watch``), between the two."""
    if before is not None and load.uptime_s > before.uptime_s and not _counters_went_back(load, before):
        span, since = load.uptime_s - before.uptime_s, f"over the last {load.uptime_s - before.uptime_s:.1f}s"
    else:  # the first reading, or a restarted lighthouse (its counters began again)
        before, span, since = None, load.uptime_s, f"since it started {_duration(load.uptime_s)} ago"

    def delta(name: str) -> float:
        return getattr(load, name) - (getattr(before, name) if before is not None else 0)

    def rate(n: float) -> float:
        return n / span if span > 0 else 0.0

    evals, held = delta("evaluations"), delta("held_total")
    refused = {k: v - (before.refused_by_code.get(k, 0) if before is not None else 0)
               for k, v in sorted(load.refused_by_code.items())}
    budget = (f"budget {load.connection_budget_calls_per_s:g} calls/s a connection"
              if load.connection_budget_calls_per_s else "no budgets")
    parts = [
        f"CPU {100 * rate(delta('cpu_s')):.0f}% of a core",
        f"{rate(delta('session_messages')):.0f} session messages/s ({load.sessions_open} sessions open, "
        f"{load.sessions_opened} opened"
        + (f"; {rate(delta('relayed_messages')):.0f}/s of them through {load.relay_streams_open} relay stream(s) "
           f"in {rate(delta('relay_batches')):.0f} batches/s" if load.relay_batches else "") + ")",
        (f"{rate(evals):.1f} quorum decisions/s, {1e3 * delta('evaluation_s') / evals:.2f} ms each"
         if evals else "no quorum decision"),
        *([f"{rate(delta('heartbeats')):.0f} heartbeats/s from {load.beating_processes} process(es)"]
          if load.beating_processes else []),
        f"{held} call(s) held by a budget ({load.held_now} now, {budget})",
        "refused: " + (", ".join(f"{v} {k}" for k, v in refused.items() if v) or "none"),
    ]
    return f"lighthouse {since}: {load.jobs} job(s); " + "; ".join(parts)


_LOAD_COUNTERS = ("held_total", "sessions_opened", "session_messages", "relay_batches", "relayed_messages",
                  "evaluations", "evaluation_s", "heartbeats", "cpu_s")


def _counters_went_back(load: LoadSnapshot, before: LoadSnapshot) -> bool:
    """A counter smaller than at the reading before: the lighthouse restarted between the two,
    though its uptime grew past the old one (a watch slower than the restart); the rates since
    then would be negative."""
    return (any(getattr(load, n) < getattr(before, n) for n in _LOAD_COUNTERS)
            or any(load.refused_by_code.get(k, 0) < v for k, v in before.refused_by_code.items()))


def _duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"  # a lighthouse's answer: never trusted to be a number int() takes
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _phase_text(p: PhaseSnapshot | None) -> str:
    if p is None:
        return ""
    text = f"  {p.phase.value} {p.in_phase_s:.2f}s"
    if p.waiting_on:
        text += f" (ring step {p.ring_step + 1}/{p.ring_steps}, waiting on {p.waiting_on} {p.waiting_s:.2f}s)"
    return text


def format_status(jobs: Sequence[JobStatus]) -> str:
    """A person's view of the lighthouse: per job, the quorum and why, and every replica."""
    if not jobs:
        return "no jobs"
    lines = []
    for j in jobs:
        q = j.quorum
        head = f"job {j.job_id!r}: {j.num_configured or '?'} configured"
        if j.finished_step is not None:
            head += f", finished at step {j.finished_step}"
        if q is not None:
            head += (f", quorum {q.quorum_id} members {list(q.member_ids)} at step {q.max_step} "
                     f"(healthy {list(q.healthy)}, behind {list(q.behind)})")
        lines.append(head)
        lines.append(f"  last decision: {j.last_reason or '-'}")
        if j.root_cause is not None:
            lines.append(f"  root cause: {j.root_cause.describe()}")
        if j.last_stall is not None and (j.root_cause is None or j.root_cause.kind == "none"):
            lines.append(f"  last stall ({j.last_stall.age_s:.0f}s ago): {j.last_stall.describe()}")
        for r in j.replicas:
            state = "DEAD" if r.dead else ("waiting for quorum" if r.waiting else "training")
            if r.condemned:
                state += "  CONDEMNED (fingerprint mismatch: rejoining from the majority)"
            fp = f"  fingerprint {r.fingerprint:016x}@{r.fingerprint_step}" if r.fingerprint is not None else ""
            lines.append(f"  replica {r.replica_id:>4}: step {r.step:>6}  heard {r.last_heartbeat_age_s:6.2f}s ago  "
                         f"{state}{fp}{_phase_text(r.phase)}")
        for e in j.sdc_events[-5:]:
            lines.append(f"  {'SDC (job stopped)' if e.fatal else 'SDC'}: {e.reason}")
        if j.sdc_fatal:
            lines.append(f"  job stopped: {j.sdc_fatal}")
    return "\n".join(lines)


def status_cli(argv: list[str]) -> int:
    """``fthsdp status --lighthouse HOST:PORT [--job ID] [--watch S]``, or ``--prometheus-rules`` or
    ``--grafana-dashboard`` (no lighthouse needed)."""
    import argparse

    p = argparse.ArgumentParser(prog="fthsdp status", description="Show a lighthouse's jobs, quorums and replicas.")
    p.add_argument("--lighthouse", default=None, help="HOST:PORT of `fthsdp lighthouse` (required but with "
                                                          "--prometheus-rules or --grafana-dashboard)")
    p.add_argument("--job", default="", help="one job (default: every job)")
    p.add_argument("--watch", type=float, default=0.0, help="refresh every S seconds until interrupted")
    p.add_argument("--prometheus-targets", action="store_true",
                   help="print a Prometheus file_sd target list (JSON) of every live replica process's /metrics "
                        "(labels job, replica, process) instead of the status")
    p.add_argument("--prometheus-rules", action="store_true",
                   help="print fthsdp's Prometheus alerting rules (a rule_files entry: lighthouse down, a job "
                        "degraded or stalled, failures, silent data corruption, stragglers, the lighthouse's "
                        "load) and exit")
    p.add_argument("--grafana-dashboard", action="store_true",
                   help="print a Grafana dashboard (JSON, to import) of fthsdp's Prometheus series: quorum, "
                        "failures and stalls, the data plane, the lighthouse's load; and exit")
    p.add_argument("--status-key-file", default=None,
                   help="the lighthouse's read-only status key (`fthsdp lighthouse --print-status-key`; "
                        "`fthsdp run` writes status.key in its run directory): read every job")
    p.add_argument("--secret-file", default=None, help="the lighthouse secret (the status key is derived from it)")
    p.add_argument("--job-secret-file", default=None,
                   help=f"a job's secret (default ${auth.SECRET_FILE_ENV} / ${auth.SECRET_ENV}): read that --job only")
    p.add_argument("--tls-ca", default="", help="PEM certificate to trust: connect over TLS")
    args = p.parse_args(argv)
    if args.prometheus_rules:
        from fthsdp.observe.metrics import alerts_file

        print(alerts_file().read_text(), end="")
        return 0
    if args.grafana_dashboard:
        from fthsdp.observe.grafana import dashboard_json

        print(dashboard_json(), end="")
        return 0
    if not args.lighthouse:
        p.error("--lighthouse HOST:PORT is required (the address `fthsdp lighthouse` serves; `fthsdp run` writes "
                "it to lighthouse.port in its run directory)")
    try:
        status_key = auth.load_secret(args.status_key_file) if args.status_key_file else None
        if status_key is None and args.secret_file:
            status_key = auth.status_key(auth.load_secret(args.secret_file))
        job_key = None if status_key is not None else auth.load_secret(args.job_secret_file)
    except auth.SecretError as e:
        p.error(str(e))
    if job_key is not None and not args.job:
        p.error("a job's secret reads that job only: name it with --job")
    if args.prometheus_targets:
        return _print_targets(args.lighthouse, args.job, status_key)
    client = LighthouseClient(args.lighthouse, "fthsdp-status", "status", rpc_timeout_s=5.0,
                              key=job_key, status_key=status_key, tls_ca_file=args.tls_ca)
    before: LoadSnapshot | None = None
    try:
        while True:
            try:
                reply = client.status_reply(args.job)
            except LighthouseError as e:
                print(f"fthsdp status: {e}", file=sys.stderr)
                return 1
            if reply.load is not None:  # a Status of every job (the status key): the lighthouse's own load
                print(format_load(reply.load, before), flush=True)
                before = reply.load
            print(format_detection(reply), flush=True)
            print(format_status(reply.jobs), flush=True)
            if args.watch <= 0:
                return 0
            time.sleep(args.watch)
            print()
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def _print_targets(address: str, job: str, status_key: bytes | None = None) -> int:
    """``fthsdp status --prometheus-targets``: the file_sd JSON of what the lighthouse knows."""
    import json

    from fthsdp.observe.lighthouse_view import LighthouseUnreachable, StatusPoller
    from fthsdp.observe.metrics import status_targets

    try:
        poller = StatusPoller(address, rpc_timeout_s=5.0, status_key=status_key)
    except ValueError as e:
        print(f"fthsdp status: {e}", file=sys.stderr)
        return 2
    try:
        view = poller.poll()
    except LighthouseUnreachable as e:
        print(f"fthsdp status: {e}", file=sys.stderr)
        return 1
    finally:
        poller.close()
    if job:
        if view.job(job) is None:
            print(f"fthsdp status: no job {job!r} on lighthouse {address}; known jobs: "
                  f"{[j.job_id for j in view.jobs]}", file=sys.stderr)
            return 1
        view = dataclasses.replace(view, jobs=(view.job(job),))
    print(json.dumps(status_targets(view, lighthouse_host=address.rpartition(":")[0].strip("[]")), indent=1),
          flush=True)
    return 0


def require_view(held: qm.Quorum | None, quorum_id: int, what: str) -> None:
    """``held`` must be this process's view of quorum ``quorum_id`` (with its rings) for an
    answer that leaves out what it holds; anything else is a protocol error, raised as such."""
    if held is None or held.quorum_id != quorum_id or not held.rings:
        raise LighthouseError(f"{what} but this process holds "
                              f"{'no view' if held is None else f'the view of quorum {held.quorum_id}'}: "
                              "mismatched lighthouse and client versions?")


# How a client takes a new quorum's rings (its request's flags, ring_request_flags): its ring
# neighbours' endpoints only (this version's default; a lighthouse that predates them sends a
# delta or whole rings), a delta against the view it holds, or whole (as the oldest clients).
RING_FORMS = ("neighbours", "delta", "whole")


def ring_request_flags(form: str) -> dict[str, bool]:
    """The QuorumRequest / ViewRequest fields that ask for rings in ``form`` (RING_FORMS)."""
    if form not in RING_FORMS:
        raise ValueError(f"ring form {form!r} unknown: one of {RING_FORMS}")
    return {"accepts_ring_neighbours": form == "neighbours", "accepts_ring_delta": form != "whole"}


def keep_rings(q: qm.Quorum, held: qm.Quorum | None) -> qm.Quorum:
    """``q`` (an answer whose rings the lighthouse left out: ``rings_omitted``) with the
    rings of ``held``, this process's view of the same quorum id. The lighthouse omits
    them only when the request reported that id as its last quorum, so ``held`` is it;
    anything else is a protocol error, raised as such."""
    require_view(held, q.quorum_id, f"the lighthouse left out the rings of quorum {q.quorum_id}")
    return dataclasses.replace(q, rings=held.rings, first_shard=held.first_shard, ring_neighbours=held.ring_neighbours)


def keep_ring_delta(q: qm.Quorum, rings_from: int, changed: Sequence[str], held: qm.Quorum | None) -> qm.Quorum:
    """``q`` (an answer whose rings are a delta against quorum ``rings_from``: only the
    ``changed`` members' endpoints) with whole rings, the others' endpoints from ``held``,
    this process's view of ``rings_from``. The lighthouse sends a delta only against the
    quorum the request reported as its last, so ``held`` is it; anything else is a protocol
    error, raised as such."""
    require_view(held, rings_from,
                 f"the lighthouse sent the rings of quorum {q.quorum_id} as a delta against quorum {rings_from}")
    try:
        return qm.rings_with_delta(q, tuple(changed), held)
    except ValueError as e:
        raise LighthouseError(f"the rings of quorum {q.quorum_id} as a delta against quorum {rings_from} do not fit "
                              f"this process's view of it: {e} (mismatched lighthouse and client versions?)") from None


def keep_neighbourhood(q: qm.Quorum, viewer: str, neighbourhood_from: int, held: qm.Quorum | None) -> qm.Quorum:
    """``q`` (an answer that left its ring neighbourhood out as unchanged since quorum
    ``neighbourhood_from``) with its rings from ``held``, this process's view of that quorum
    (:func:`fthsdp.control.quorum.kept_neighbourhood`). The lighthouse leaves it out only
    against the quorum the request reported as its last, so ``held`` is it; anything else is a
    protocol error, raised as such."""
    require_view(held, neighbourhood_from, f"the lighthouse left out the ring neighbourhood of quorum {q.quorum_id} "
                                           f"as unchanged since quorum {neighbourhood_from}")
    try:
        return qm.kept_neighbourhood(q, viewer, held)
    except ValueError as e:
        raise LighthouseError(f"the ring neighbourhood of quorum {q.quorum_id}, kept from quorum {neighbourhood_from}, "
                              f"does not fit this process's view of it: {e} (mismatched lighthouse and client "
                              "versions?)") from None


def keep_members(q: qm.Quorum, held: qm.Quorum | None) -> qm.Quorum:
    """``q`` (a compact answer: ``members_omitted``) completed from ``held``, this
    process's view of the same quorum id: the same members, all at ``q.max_step`` and
    healthy, with ``held``'s rings. The lighthouse sends it only when every member is
    healthy and the request reported that id as its last quorum; anything else is a
    protocol error, raised as such."""
    require_view(held, q.quorum_id, f"the lighthouse left out the members of quorum {q.quorum_id}")
    if q.num_healthy != len(held.members):
        raise LighthouseError(f"the lighthouse left out the members of quorum {q.quorum_id} with {q.num_healthy} "
                              f"healthy of the {len(held.members)} this process holds: a compact answer lists all "
                              "members healthy (mismatched lighthouse and client versions?)")
    members = tuple(m if m.step == q.max_step else dataclasses.replace(m, step=q.max_step) for m in held.members)
    return dataclasses.replace(q, members=members, healthy=held.member_ids, behind=(), recovery={},
                               rings=held.rings, first_shard=held.first_shard, sources=(),
                               ring_neighbours=held.ring_neighbours)


def quorum_from_proto(p: pb2.Quorum) -> qm.Quorum:
    """A quorum answer (a process's view) or a Status quorum (every endpoint) from the wire.
    A view with a ring neighbourhood (``Quorum.neighbourhood``) has as its rings, per shard, the
    (left, own, right) endpoints; a neighbourhood that is not three equal runs of endpoints is a
    protocol error, raised as :class:`LighthouseError`."""
    near = p.neighbourhood
    if near and (len(near) != 3 or len({len(e.addresses) for e in near}) != 1 or len({e.first_shard for e in near}) != 1
                 or not near[0].addresses or p.rings):
        raise LighthouseError(
            f"quorum {p.quorum_id}'s ring neighbourhood is not three equal runs of endpoints of the same shards "
            f"({[(e.first_shard, len(e.addresses)) for e in near][:4]}, {len(p.rings)} whole rings beside it): "
            "mismatched lighthouse and client versions?")
    return qm.Quorum(
        quorum_id=p.quorum_id,
        members=tuple(
            qm.Member(m.replica_id, m.step, tuple(m.ftar_addresses), m.state_server_address, m.local_world_size,
                      m.num_processes or 1, rejoining=m.rejoining)
            for m in p.members
        ),
        max_step=p.max_step,
        healthy=tuple(p.healthy),
        behind=tuple(p.behind),
        recovery={r.replica_id: tuple(r.source_replica_ids) for r in p.recovery},
        num_healthy=p.num_healthy,
        num_configured=p.num_configured,
        reason=p.reason,
        rings=tuple(zip(*(tuple(e.addresses) for e in near))) if near else tuple(tuple(r.addresses) for r in p.rings),
        first_shard=near[0].first_shard if near else p.rings[0].shard if p.rings else 0,
        sources=tuple(qm.ShardSource(x.shard, x.replica_id, x.state_server_address) for x in p.sources),
        ring_neighbours=bool(near),
    )


OnDead = Callable[[tuple[str, ...], int], None]
# on_asking(asking replicas, quorum id, step) of the all-reduce the heartbeat reported
OnAsking = Callable[[tuple[str, ...], int, int], None]


def lighthouse_error(what: str, where: str, code: grpc.StatusCode | None, details: str, timeout_s: float = 0.0,
                     signed: bool = False) -> LighthouseError:
    """The error a failed lighthouse call raises, by its status. Its class decides what the replica
    does (fthsdp.errors.classify): a malformed request, a job stopped for silent data corruption or
    a refused credential is job-fatal, a deadline replica-fatal, the rest passing. One function for
    this client and the emulation's (fthsdp.sim.aio_client), so the two cannot drift apart.
    ``signed``: the call carried a credential (an older lighthouse that misread it is named)."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        within = f" within {timeout_s:g}s" if timeout_s else ""
        return QuorumTimeout(f"{what}: no answer from {where}{within}: {details}", code)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidLighthouseRequest(f"{what} rejected by {where}: {details}", code)
    if code == grpc.StatusCode.NOT_FOUND:
        return JobNotFound(f"{what} at {where}: {details}", code)
    if code == grpc.StatusCode.DATA_LOSS:
        return SilentDataCorruption(f"{what}: {where} stopped the job: {details}", code)
    if code == grpc.StatusCode.PERMISSION_DENIED and "held by another live process" in details:
        return ReplicaIdHeld(f"{what} refused by {where}: {details}", code)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        older = older_lighthouse_advice(signed, code, details)
        kind = CredentialRefused if any(m in details for m in auth.PERMANENT_REFUSALS) else NotAuthorized
        return kind(f"{what} refused by {where}: {older or details}", code)
    if code == grpc.StatusCode.UNAVAILABLE:
        return LighthouseUnavailable(
            f"{what}: cannot reach {where}: {details}; is `fthsdp lighthouse` running at that address?", code
        )
    return LighthouseError(f"{what} failed at {where}: {code}: {details}", code)


def _parse_reply(method: str, data: bytes):
    """A session reply's body as its message; one that does not parse is a failed call (INTERNAL, as
    gRPC reports a unary reply it cannot deserialize), not a protobuf DecodeError out of the client."""
    try:
        return _REPLY_TYPES[method].FromString(data)
    except Exception as e:  # noqa: BLE001 - any garbage from the network
        raise SessionError(grpc.StatusCode.INTERNAL, (
            f"the reply to {method} is not a valid {_REPLY_TYPES[method].__name__} protobuf message "
            f"({type(e).__name__}: {str(e)[:200]}): a relay or lighthouse of another protocol, or a faulty one")) from e


class LighthouseClient:
    """One replica's connection to the lighthouse (thread-safe)."""

    def __init__(
        self,
        address: str,
        job_id: str,
        replica_id: str | int,
        *,
        rpc_timeout_s: float = 5.0,
        heartbeat_interval_s: float = 0.1,
        heartbeat_timeout_s: float = 0.5,
        outage_s: float = 0.0,
        rejoin: bool = False,
        process_index: int = 0,
        num_processes: int = 1,
        key: bytes | None = None,
        status_key: bytes | None = None,
        tls_ca_file: str = "",
        session: bool = True,
        relay: str = "",
        relay_file: str = "",
        ring_form: str = "neighbours",
    ) -> None:
        """``outage_s``: how long ``get_quorum`` retries an unreachable lighthouse
        (0 = fail at once). ``rejoin``: this process was restarted to rejoin a
        running job (a finished job then answers :class:`JobFinished`).
        ``process_index``/``num_processes``: which process of its replica this is.
        ``key``: the job's secret (None: unsigned calls, for a lighthouse run with
        ``--insecure``); ``status_key``: the read-only key, for Status only;
        ``tls_ca_file``: a PEM certificate to trust, connecting over TLS. ``session``: send
        heartbeats and quorum requests as messages of one long-lived stream
        (:mod:`fthsdp.control.session`; unary calls when the lighthouse offers none).
        ``relay``: HOST:PORT of a relay (:mod:`fthsdp.control.relay`) to carry that stream (over
        TLS too when ``tls_ca_file`` is given); the lighthouse directly once the relay is gone.
        ``relay_file``: a file where a launcher writes this process's relay when it places it
        elsewhere (its node was lost): read when it changes, once a heartbeat (:meth:`move_relay`).
        ``ring_form``: how a new quorum's rings are asked for (:data:`RING_FORMS`; the default,
        this process's ring neighbours' endpoints only, is the smallest answer; the others are
        what older clients ask for, kept for tests and comparisons)."""
        ring_request_flags(ring_form)  # refuses an unknown form here, not at the first request
        if num_processes < 1 or not 0 <= process_index < num_processes:
            raise ValueError(f"process_index {process_index} must be in 0..num_processes-1 (num_processes "
                             f"{num_processes} >= 1)")
        if not job_id:
            raise ValueError("job_id is empty: pass the job's name (shared by all its replicas)")
        if replica_id == "" or replica_id is None:
            raise ValueError("replica_id is empty: pass this replica's id, unique within the job")
        if heartbeat_interval_s <= 0 or heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_interval_s and heartbeat_timeout_s must be > 0")
        if not outage_s >= 0:
            raise ValueError(f"outage_s must be >= 0 seconds, got {outage_s}")
        self.address = address
        self.ring_form = ring_form
        self.job_id = job_id
        self.replica_id = str(replica_id)
        self.rpc_timeout_s = rpc_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.paced_s = 0.0  # the lighthouse's pace (HeartbeatResponse.beat_interval_ms; 0 = none)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.outage_s = outage_s
        self.rejoin = rejoin
        self.process_index = process_index
        self.num_processes = num_processes
        # This process's own shards' endpoints, sent with heartbeats while the lighthouse
        # does not hold them (see register).
        self.registration = Registration()
        self._call_key = auth.derive(key, "lighthouse") if key is not None else None
        self._status_key = status_key
        self.incarnation = os.urandom(16).hex()  # this process's claim on its (replica id, process)
        creds = None
        if tls_ca_file:
            with open(tls_ca_file, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())

        def channel(to: str) -> grpc.Channel:
            return grpc.secure_channel(to, creds, options=_CHANNEL_OPTIONS) if creds is not None else \
                grpc.insecure_channel(to, options=_CHANNEL_OPTIONS)

        self._channel = channel(address)
        self._channel_to = channel
        path = RelayPath(relay if session else "")  # through the relay, or directly, and when
        self._relay_channel = channel(relay) if path.relay else None
        self._left_channels: list[grpc.Channel] = []  # relays moved from: closed with the client
        self._relay_file = relay_file if session else ""
        self._relay_file_seen: tuple | None = None  # its (inode, mtime, size) when last read
        # Requests go as bytes: the credential signs exactly the bytes before it.
        self._rpc = {
            name: self._channel.unary_unary(_SERVICE + name, request_serializer=None,
                                            response_deserializer=getattr(pb2, reply).FromString)
            for name, reply in (("GetQuorum", "QuorumResponse"), ("Heartbeat", "HeartbeatResponse"),
                                ("GetView", "QuorumResponse"), ("Leave", "LeaveResponse"),
                                ("Status", "StatusResponse"))
        }
        # Heartbeats and quorum requests as messages of one stream (None: unary calls), and which
        # stream a request goes on. The lock: the heartbeat thread and the step may both switch.
        self._route = SessionRoute(path, None if not session else SyncSession(self._relay_channel, relayed=True)
                                   if self._relay_channel else SyncSession(self._channel))
        self._lock_relay = threading.Lock()
        self._relay_watch: Callable | None = None  # the subscription to the relay channel's state (_watch_relay)
        self._asked_at = -math.inf  # when get_quorum last sent a request (monotonic)
        self._step = 0
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._on_dead: OnDead | None = None
        self._on_asking: OnAsking | None = None
        self.last_heartbeat: HeartbeatReply | None = None
        self.heartbeat_failures = 0  # consecutive
        self.last_heartbeat_error: LighthouseError | None = None
        # The last quorum this replica was a member of: reported with every
        # request so a restarted lighthouse can rebuild the job.
        self.last_quorum: qm.Quorum | None = None
        # Which quorum first decided which step, over the quorums this replica was
        # answered (its newest entries go with every request: a restarted lighthouse
        # rebuilds the job's lineage fence from them, rule 6 of fthsdp.control.quorum).
        self.lineage = qm.Lineage(limit=qm.LINEAGE_REPORTED)
        self._held_endpoints = HeldEndpoints()  # may the quorum requests leave the endpoints out
        # Set by leave() when the lighthouse found this replica's final state forked from
        # the job's lineage: (the step the lineage re-decided, why).
        self.forked: tuple[int, str] | None = None
        self.outages: list[tuple[float, float]] = []  # (start, seconds) of each outage get_quorum rode out
        # Where this process is, sent with every heartbeat (root-cause analysis);
        # None: heartbeats carry no phase report.
        self.phase_source: Callable[[], PhaseSnapshot] | None = None
        # Reported with every quorum request and heartbeat: the latest fingerprint of the
        # committed state (step, value, the quorum that committed it) and where this process
        # serves /metrics.
        self.fingerprint: tuple[int, int, int] | None = None
        self.metrics_address = ""
        # What this replica's training state is made of (fthsdp/step/signature.py), stated with
        # every quorum request: the lighthouse refuses one unlike a live replica's (0: not stated).
        self.state_signature = 0

    def report_fingerprint(self, step: int, fingerprint: int, quorum_id: int) -> None:
        """The fingerprint of the state after ``step`` committed steps, the last of them
        committed in quorum ``quorum_id`` (sent with the next quorum request and heartbeats;
        the lighthouse compares the replicas' if that quorum is in the job's lineage)."""
        self.fingerprint = (int(step), int(fingerprint), int(quorum_id))

    def advertise_metrics(self, address: str) -> None:
        """Where this process serves /metrics ("host:port"), sent with its heartbeats
        (``fthsdp status --prometheus-targets`` lists it)."""
        self.metrics_address = address

    def _fingerprint_fields(self) -> dict:
        fp = self.fingerprint
        return {} if fp is None else {"fingerprint_step": fp[0], "fingerprint": fp[1], "fingerprint_quorum_id": fp[2]}

    def _call(self, method: str, req, timeout: float):
        """One RPC with this client's credential (none without a key)."""
        body = req.SerializeToString()
        if method == "Status" and self._status_key is not None:
            key, kind = self._status_key, "status"
        else:
            key, kind = self._call_key, "job"
        if key is not None:
            body = auth.signed_request(key, method, req.job_id, getattr(req, "replica_id", ""), body, kind)
        s = self._session_now(method) if method in SESSION_METHODS else None
        if s is not None:
            start = time.monotonic()
            try:
                # a return to the relay (RelayPath) leaves half the heartbeat's time for the lighthouse
                out = _parse_reply(method, s.request(method, body, timeout / 2 if s.probe else timeout))
                self._relay_answered(s)
                return out
            except SessionError as e:
                if isinstance(e, SessionUnsupported) and not s.probe:
                    log.info("%s: %s; using unary calls", f"relay {self._route.path.relay}" if s.relayed else
                             f"lighthouse {self.address}", e.details())
                    with self._lock_relay:
                        dropped = self._route.unsupported(s)
                    self._closing(dropped)
                else:
                    with self._lock_relay:
                        routed = self._route.failed(s, e, time.monotonic(), lambda: SyncSession(self._channel))
                        again = self._route.session
                    self._routed(routed, e.details())
                    if not routed.again:
                        raise  # e.g. UNAVAILABLE from a live relay: an outage to ride out, through the relay again
                    left = max(0.001, timeout - (time.monotonic() - start))
                    return _parse_reply(method, again.request(method, body, left))
        return self._rpc[method](body, timeout=timeout)

    @property
    def relay(self) -> str:
        """The relay this process's session goes through ("": the lighthouse directly)."""
        p = self._route.path
        return p.relay if p.via_relay else ""

    def _session_now(self, method: str) -> SyncSession | None:
        """The session a request goes on (:meth:`SessionRoute.pick`: a heartbeat due to return
        to the relay goes on a probe through it)."""
        with self._lock_relay:
            s, close = self._route.pick(method, time.monotonic(), lambda: SyncSession(self._relay_channel, relayed=True))
        self._closing(close)
        return s

    def _relay_answered(self, s: SyncSession) -> None:
        """A reply came on ``s``: through the relay, it counts for it (a probe's: it is back)."""
        if s.relayed:
            with self._lock_relay:
                routed = self._route.answered(s)
            self._routed(routed)

    def _routed(self, r: Routed, why: str = "") -> None:
        """Log a switch of path and close the sessions it dropped."""
        p = self._route.path
        if r.back:
            log.info("process %d of replica %r is back on relay %s", self.process_index, self.replica_id, p.relay)
        if r.left:
            then = (f"tries its new relay {p.relay} at once" if p.left_relay != p.relay else
                    f"tries the relay again in {p.retry_s:.0f} s" +
                    (" or once it accepts connections again" if p.watching else ""))
            log.warning("relay %s failed (%s): process %d of replica %r speaks to lighthouse %s directly, and %s",
                        p.left_relay, why, self.process_index, self.replica_id, self.address, then)
            if p.watching:
                self._watch_relay()
        self._closing(r.close)

    def move_relay(self, relay: str) -> bool:
        """Speak through relay ``relay`` (HOST:PORT) from now on: its launcher placed this process's
        relay elsewhere (the old one's node was lost), or gave it one. The next heartbeat probes it
        (:meth:`RelayPath.move`); a session still answered through the old relay stays on it until it
        fails. False: nothing changed (the same relay, or no session stream to carry). Raises
        ValueError for a malformed address."""
        split_host_port(relay)
        with self._lock_relay:
            if self._route.session is None:
                return False
            old, watch = self._relay_channel, self._relay_watch
            if not self._route.path.move(relay, time.monotonic()):
                return False
            self._relay_channel, self._relay_watch = self._channel_to(relay), None
            if old is not None:
                self._left_channels.append(old)  # a session on it may still be answered
        if old is not None and watch is not None:
            old.unsubscribe(watch)
        log.info("process %d of replica %r: its relay is now %s", self.process_index, self.replica_id, relay)
        return True

    def _follow_relay_file(self) -> None:
        """Reads ``relay_file`` when it changed (one stat a beat) and moves to the relay it names."""
        try:
            st = os.stat(self._relay_file)
        except FileNotFoundError:
            return
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen == self._relay_file_seen:
            return
        self._relay_file_seen = seen
        try:
            with open(self._relay_file) as f:
                relay = f.read().strip()
            self.move_relay(relay)
        except (OSError, ValueError) as e:
            log.warning("relay file %s: %s (it should hold the relay's HOST:PORT); the relay is unchanged",
                        self._relay_file, e)

    def _watch_relay(self) -> None:
        """Away from a relay left by its broken streams: follow its channel's state (a
        subscription that also starts a connection attempt, which gRPC repeats every reconnect
        backoff while it fails), so the next heartbeat returns to it as soon as it accepts
        connections again (:meth:`RelayPath.channel_state`). One subscription at a time, each
        leave a new one (its first state is the channel's now); dropped once it no longer
        matters (back on the relay, or left again for a reason its channel cannot tell)."""

        def heard(state: grpc.ChannelConnectivity) -> None:
            with self._lock_relay:
                p = self._route.path
                if self._relay_watch is heard and p.channel_state(state is grpc.ChannelConnectivity.READY,
                                                                  time.monotonic()):
                    log.info("relay %s accepts connections again: process %d of replica %r returns to it",
                             p.relay, self.process_index, self.replica_id)
                done = not p.watching or self._relay_watch is not heard
                if done and self._relay_watch is heard:
                    self._relay_watch = None
            if done:
                ch.unsubscribe(heard)

        with self._lock_relay:
            ch = self._relay_channel  # the relay's channel now (a move replaces it)
            old, self._relay_watch = self._relay_watch, heard
        if old is not None:
            ch.unsubscribe(old)
        ch.subscribe(heard, try_to_connect=True)

    @staticmethod
    def _closing(sessions) -> None:
        for x in sessions:
            x.close()  # a relayed one's channel stays open until close(): the client returns to it later

    # -- errors --------------------------------------------------------------

    def _error(self, what: str, e: grpc.RpcError, timeout_s: float) -> LighthouseError:
        code = e.code() if hasattr(e, "code") else None
        details = (e.details() if hasattr(e, "details") else None) or str(e)
        where = f"lighthouse {self.address} (job {self.job_id!r}, replica {self.replica_id!r})"
        signed = self._call_key is not None or self._status_key is not None
        return lighthouse_error(what, where, code, details, timeout_s, signed)

    # -- calls ---------------------------------------------------------------

    def get_quorum(
        self,
        step: int,
        *,
        ftar_addresses: Sequence[str],
        state_server_address: str = "",
        local_world_size: int | None = None,
        commit_failed: bool = False,
        num_replicas: int = 0,
        timeout_s: float = 60.0,
        accused: Sequence[str] = (),
    ) -> qm.Quorum:
        """Block until the quorum of ``step`` (this replica's next step) is decided.

        Raises QuorumTimeout (with the lighthouse's last decision reason) if
        none is decided within ``timeout_s``; :class:`JobFinished` if the job
        already finished; :class:`LighthouseUnavailable` once the lighthouse
        was unreachable for longer than ``outage_s`` (it is retried with
        backoff until then, e.g. while it restarts). ``accused``: members of
        the last quorum that broke FTAR's protocol against this replica (the
        lighthouse may leave them out of the next quorum).
        """
        self._step = step
        self._asked_at = time.monotonic()
        last = self.last_quorum
        req = pb2.QuorumRequest(
            protocol_version=LIGHTHOUSE_PROTOCOL_VERSION,
            job_id=self.job_id,
            replica_id=self.replica_id,
            step=step,
            local_world_size=(len(ftar_addresses) * self.num_processes if local_world_size is None
                              else local_world_size),
            commit_failed=commit_failed,
            num_replicas=num_replicas,
            last_quorum_id=last.quorum_id if last is not None else 0,
            last_members=list(last.member_ids) if last is not None and qm.sends_last_members(last, self.replica_id)
            else [],
            rejoin=self.rejoin,
            fresh_start=last is None and not self.rejoin,
            process_index=self.process_index,
            num_processes=self.num_processes,
            **self._fingerprint_fields(),
            state_signature=self.state_signature,
            accused_replica_ids=list(accused),
            incarnation=self.incarnation,
            accepts_members_omitted=True,
            **ring_request_flags(self.ring_form),
            lineage=qm.lineage_report(self.lineage),
            # the same on every send of this request below: a lighthouse that decided it answers a
            # send again at once (its answer was lost on the way)
            request_id=new_request_id(),
        )
        whole = pb2.QuorumRequest()
        whole.CopyFrom(req)
        sent = self._held_endpoints.fill(req, ftar_addresses, state_server_address)
        down_since: float | None = None
        delays = backoff_delays()
        paused = ""
        held_until = time.monotonic() + timeout_s
        while True:
            try:
                resp = self._call("GetQuorum", req, timeout_s)
                break
            except grpc.RpcError as e:
                if req.endpoints_held and endpoints_not_held(getattr(e, "code", lambda: None)(),
                                                             getattr(e, "details", lambda: "")()):
                    log.info("lighthouse %s does not hold this replica's endpoints (it restarted); sending them",
                             self.address)
                    self._held_endpoints.lost()
                    req = whole
                    self._held_endpoints.fill(req, ftar_addresses, state_server_address)
                    continue
                err = self._error(f"get_quorum(step={step})", e, timeout_s)
            if isinstance(err, ReplicaIdHeld) and time.monotonic() < held_until:
                # A restart that came back before its old process was declared dead: wait that out.
                log.info("%s; retrying", err)
                time.sleep(0.2)
                continue
            if not isinstance(err, LighthouseUnavailable):
                raise err from None
            now = time.monotonic()
            if down_since is None:
                down_since = now
                if self.outage_s > 0:
                    log.warning("lighthouse %s unreachable at step %d; retrying for up to %gs "
                                "(ft.lighthouse_outage_s): %s", self.address, step, self.outage_s, err)
            if now - down_since >= self.outage_s:
                raise LighthouseUnavailable(
                    f"{err} (unreachable for {now - down_since:.1f}s; ft.lighthouse_outage_s={self.outage_s:g}). "
                    "Restart the lighthouse on the same address within that limit, or resume the job from its "
                    "persistent checkpoint (fthsdp run --resume)", err.code, outage_s=now - down_since) from None
            paused = self._pause(min(next(delays), max(0.0, down_since + self.outage_s - now)), paused)
            if paused == "connected":
                delays = backoff_delays()  # connected again: the next tries start short
        if down_since is not None:
            took = time.monotonic() - down_since
            self.outages.append((time.time() - took, took))
            log.warning("lighthouse %s reachable again after %.2fs; step %d goes on", self.address, took, step)
        self._held_endpoints.heard(sent, resp.endpoints_omittable)
        if resp.job_finished:
            data = {"positions": list(resp.finished_positions), "last_step": list(resp.finished_last_steps)} \
                if resp.finished_positions else None
            raise JobFinished(
                f"job {self.job_id!r} already finished at step {resp.finished_step} (lighthouse {self.address}); "
                f"replica {self.replica_id!r} at step {step} has nothing left to train", resp.finished_step, data)
        q = quorum_from_proto(resp.quorum)
        if resp.quorum.members_omitted:
            q = keep_members(q, self.last_quorum)
        elif resp.quorum.rings_omitted:
            q = keep_rings(q, self.last_quorum)
        elif resp.quorum.rings_from:
            q = keep_ring_delta(q, resp.quorum.rings_from, resp.quorum.ring_members, self.last_quorum)
        elif resp.quorum.neighbourhood_from:
            q = keep_neighbourhood(q, self.replica_id, resp.quorum.neighbourhood_from, self.last_quorum)
        if self.replica_id in q.member_ids:
            self.lineage = self.lineage.answered_quorum(q)
            self.last_quorum = q
        return q

    def _pause(self, delay_s: float, last: str) -> str:
        """Between two tries across an outage: ``delay_s``, or less once the lighthouse's channel
        connects again. Returns ``"connected"`` (the channel came up during this pause, or since
        the last one, ``last``, found it down: try at once, and the caller's backoff starts
        over), ``"down"`` (still down after ``delay_s``) or ``"up"`` (it was up: the calls fail
        for another reason, or go through a relay, whose channel is up while the lighthouse is
        not; the whole delay was slept). Sleeping the backoff through found a restarted
        lighthouse up to a backoff (0.5 s) late, and a call racing the channel's reconnection
        failed to connect and slept another."""
        if self._route.path.via_relay:
            time.sleep(delay_s)
            return "up"
        deadline = time.monotonic() + delay_s
        states: queue.SimpleQueue = queue.SimpleQueue()
        heard = states.put
        self._channel.subscribe(heard, try_to_connect=False)  # its state now, then each change
        try:
            first = True
            while (left := deadline - time.monotonic()) > 0:
                try:
                    state = states.get(timeout=left)
                except queue.Empty:
                    break
                if state is grpc.ChannelConnectivity.READY:
                    if first and last != "down":
                        time.sleep(max(0.0, deadline - time.monotonic()))
                        return "up"
                    return "connected"
                first = False
            return "down"
        finally:
            self._channel.unsubscribe(heard)

    def register(self, ftar_addresses: Sequence[str], state_server_address: str, local_world_size: int) -> None:
        """This process's own shards' endpoints: sent with the heartbeats until the
        lighthouse holds them (a replica of several processes; the leader's go with
        its quorum requests too)."""
        self.registration.give(ftar_addresses, state_server_address, local_world_size)

    def get_view(self, quorum_id: int, *, timeout_s: float | None = None) -> qm.Quorum:
        """This process's view of quorum ``quorum_id`` (which its leader got): its shards'
        rings and recovery sources. Raises LighthouseError (FAILED_PRECONDITION) when the
        lighthouse no longer holds that quorum; retries an unreachable lighthouse like
        ``get_quorum`` for up to ``outage_s``."""
        t = self.rpc_timeout_s if timeout_s is None else timeout_s
        held = self.last_quorum
        req = pb2.ViewRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id=self.job_id,
                              replica_id=self.replica_id, process_index=self.process_index, quorum_id=quorum_id,
                              held_quorum_id=held.quorum_id if held is not None else 0,
                              **ring_request_flags(self.ring_form))
        down_since: float | None = None
        delays = backoff_delays()
        paused = ""
        while True:
            try:
                resp = self._call("GetView", req, t)
                break
            except grpc.RpcError as e:
                err = self._error(f"get_view(quorum {quorum_id}, process {self.process_index})", e, t)
            if not isinstance(err, LighthouseUnavailable):
                raise err from None
            now = time.monotonic()
            down_since = now if down_since is None else down_since
            if now - down_since >= self.outage_s:
                raise err
            paused = self._pause(min(next(delays), max(0.0, down_since + self.outage_s - now)), paused)
            if paused == "connected":
                delays = backoff_delays()  # connected again: the next tries start short
        q = quorum_from_proto(resp.quorum)
        if resp.quorum.rings_from:
            q = keep_ring_delta(q, resp.quorum.rings_from, resp.quorum.ring_members, held)
        elif resp.quorum.neighbourhood_from:
            q = keep_neighbourhood(q, self.replica_id, resp.quorum.neighbourhood_from, held)
        self.last_quorum = q
        return q

    def leave(self, step: int, *, finished: bool, timeout_s: float | None = None, data: dict | None = None) -> bool:
        """Say goodbye (stop heartbeats first): the lighthouse forgets this replica at
        once instead of declaring it dead, and with ``finished`` remembers that the
        job finished at ``step``. Best effort: returns False if the lighthouse could
        not be told (it then detects the silence as usual).

        When the lighthouse finds this replica's state forked from the job's lineage (a
        later quorum re-decided a step it had committed: its last steps, which no request
        of it followed), :attr:`forked` is set to ``(the step re-decided, why)``: its
        commits after that step are not in the job's model.

        ``data`` (with ``finished``): the model's data state (``positions``, ``last_step``: one
        entry per replica), which the lighthouse hands to replicas asking after the end."""
        self.stop_heartbeats()
        last = self.last_quorum
        req = pb2.LeaveRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id=self.job_id,
                               replica_id=self.replica_id, step=step, finished=finished,
                               incarnation=self.incarnation, last_quorum_id=last.quorum_id if last else 0,
                               data_positions=[int(v) for v in data["positions"]] if data else [],
                               data_last_steps=[int(v) for v in data["last_step"]] if data else [])
        t = self.rpc_timeout_s if timeout_s is None else timeout_s
        try:
            resp = self._call("Leave", req, t)
            if resp.forked:
                self.forked = (resp.forked_step, resp.forked)
            return True
        except grpc.RpcError as e:
            log.warning("%s", self._error("leave", e, t))
            return False

    def heartbeat(self, step: int | None = None) -> HeartbeatReply:
        """One heartbeat now, and its reply."""
        if step is not None:
            self._step = step
        req, sent = self._heartbeat_request()
        try:
            resp = self._call("Heartbeat", req, self.heartbeat_timeout_s)
        except grpc.RpcError as e:
            raise self._error("heartbeat", e, self.heartbeat_timeout_s) from None
        return self._heard_beat(sent, resp, req)

    def _beat(self) -> HeartbeatReply | None:
        """The heartbeat thread's beat, and its reply; None when its last quorum request
        counts as this beat (:func:`fthsdp.control.session_client.beat_covered`)."""
        now = time.monotonic()
        if beat_covered(self._route.session, self.process_index, self.registration.endpoints is not None,
                        now - self._asked_at, self.beat_interval_s, self._route.path.return_due(now)):
            return None
        return self.heartbeat()

    def _heard_beat(self, sent, resp, req) -> HeartbeatReply:
        # Sent and held: stop sending them; not held (a restarted lighthouse): send again.
        self.registration.heard(sent, resp.addresses_registered)
        reply = heartbeat_reply(resp, (req.phase.quorum_id, req.phase.step))
        self.paced_s = reply.beat_interval_s
        self.last_heartbeat = reply
        return reply

    def _dead_news(self, reply: HeartbeatReply) -> None:
        """The heartbeat thread's news for the step loop: dead members of the lighthouse's quorum,
        and replicas asking for a quorum while this process is in an all-reduce they may belong to."""
        if reply.dead_members and self._on_dead is not None:
            try:
                self._on_dead(reply.dead_members, reply.quorum_id)
            except Exception:
                log.exception("on_dead callback raised")
        if reply.asking and reply.allreduce is not None and self._on_asking is not None:
            try:
                self._on_asking(reply.asking, *reply.allreduce)
            except Exception:
                log.exception("on_asking callback raised")

    def _heartbeat_request(self):
        """This process's HeartbeatRequest now, and the registration it carries."""
        last = self.last_quorum
        req = pb2.HeartbeatRequest(
            protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id=self.job_id, replica_id=self.replica_id,
            step=self._step, last_quorum_id=last.quorum_id if last is not None else 0,
            process_index=self.process_index, num_processes=self.num_processes,
            metrics_address=self.metrics_address, **self._fingerprint_fields(), incarnation=self.incarnation,
            beat_interval_ms=reported_ms(self.heartbeat_interval_s, self.paced_s),
        )
        sent = self.registration.fill(req)
        if self.phase_source is not None:
            try:
                req.phase.CopyFrom(phase_to_proto(self.phase_source()))
            except Exception as e:  # noqa: BLE001 - a failed report must not silence the heartbeat
                log.debug("phase report failed: %s", e)
        return req, sent

    def status(self, job_id: str | None = None) -> list[JobStatus]:
        """Introspection: every job (``job_id=""``) or one (default: this client's job)."""
        return self.status_reply(job_id).jobs

    def status_reply(self, job_id: str | None = None) -> StatusReply:
        """:meth:`status`, the lighthouse's own load when it says (a Status of every job), and its
        failure detection now."""
        jid = self.job_id if job_id is None else job_id
        try:
            resp = self._call("Status", pb2.StatusRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id=jid),
                              self.rpc_timeout_s)
        except grpc.RpcError as e:
            raise self._error("status", e, self.rpc_timeout_s) from None
        return status_from_proto(resp)

    # -- heartbeat thread ----------------------------------------------------

    def set_step(self, step: int) -> None:
        """The step reported by the next heartbeats (get_quorum sets it too)."""
        self._step = step

    def start_heartbeats(self, on_dead: OnDead | None = None, on_asking: OnAsking | None = None) -> None:
        """Start the daemon heartbeat thread.

        ``on_dead(dead_members, quorum_id)`` is called from that thread on every
        reply that lists dead members of the lighthouse's current quorum
        (repeatedly, ~10 Hz, until a new quorum forms): keep it cheap and
        idempotent (e.g. abort FTAR if ``quorum_id`` is the one in flight).
        ``on_asking(asking, quorum_id, step)`` likewise, on every reply to a beat whose
        phase report said this process is in the all-reduce of ``step`` on quorum
        ``quorum_id`` (``phase_source``) that lists replicas asking for a quorum at or
        before that step: those of them in that quorum are not in its all-reduce.
        """
        if self._hb_thread is not None:
            raise RuntimeError("heartbeats already running")
        self._on_dead, self._on_asking = on_dead, on_asking
        self._hb_stop.clear()
        self._hb_thread = threading.Thread(
            target=self._heartbeat_loop, name=f"fthsdp-heartbeat-{self.replica_id}", daemon=True
        )
        self._hb_thread.start()

    def stop_heartbeats(self, timeout_s: float = 2.0) -> None:
        t = self._hb_thread
        if t is None:
            return
        self._hb_stop.set()
        t.join(timeout_s)
        if t.is_alive():
            raise TimeoutError(f"heartbeat thread did not stop within {timeout_s}s")
        self._hb_thread = None

    @property
    def heartbeating(self) -> bool:
        return self._hb_thread is not None

    @property
    def beat_interval_s(self) -> float:
        """How often the heartbeat thread beats: ``heartbeat_interval_s``, or the lighthouse's
        slower pace while it asks for one (fthsdp.control.pacing)."""
        return paced_interval(self.heartbeat_interval_s, self.paced_s)

    def _heartbeat_loop(self) -> None:
        next_at = time.monotonic()
        while not self._hb_stop.is_set():
            try:
                if self._relay_file:
                    self._follow_relay_file()
                reply = self._beat()
                if reply is not None:
                    if self.heartbeat_failures:
                        log.info("heartbeats to %s resumed after %d failures", self.address,
                                 self.heartbeat_failures)
                    self.heartbeat_failures = 0
                    self._dead_news(reply)
            except Exception as e:  # noqa: BLE001 - the thread must outlive any error: its silence is a death
                if not isinstance(e, LighthouseError):
                    e = LighthouseError(f"heartbeat: unexpected {type(e).__name__}: {e}")
                self.heartbeat_failures += 1
                self.last_heartbeat_error = e
                if self.heartbeat_failures in (1, 10) or self.heartbeat_failures % 100 == 0:
                    log.warning("heartbeat failure %d: %s", self.heartbeat_failures, e)
            next_at += self.beat_interval_s
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (slow RPC): do not burst to catch up
                next_at, delay = time.monotonic(), 0.0
            self._hb_stop.wait(delay)

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        self.stop_heartbeats()
        with self._lock_relay:
            sessions = self._route.sessions()
        self._closing(sessions)
        for ch in [self._relay_channel, *self._left_channels]:
            if ch is not None:
                ch.close()
        self._channel.close()

    def __enter__(self) -> LighthouseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
