"""Synchronous lighthouse client, as one replica's Manager uses it.

``get_quorum`` blocks until the lighthouse decides the next step's quorum
(deadline-bounded, with the lighthouse's reason on timeout). A daemon thread
heartbeats about every 100 ms and calls ``on_dead(dead_members, quorum_id)``
whenever the lighthouse reports members of the current quorum dead, so the
Manager can abort its in-flight FTAR at once; the FTAR deadline stays the
backstop. Every RPC carries a deadline.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from fthsdp import quorum as qm
from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as _load_stubs

pb2, pb2_grpc = _load_stubs()
log = logging.getLogger("fthsdp.lighthouse_client")

__all__ = [
    "LighthouseClient",
    "HeartbeatReply",
    "ReplicaStatus",
    "JobStatus",
    "LighthouseError",
    "QuorumTimeout",
    "InvalidLighthouseRequest",
    "LighthouseUnavailable",
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
    """The lighthouse cannot be reached."""


@dataclass(frozen=True)
class HeartbeatReply:
    dead_replica_ids: tuple[str, ...]
    quorum_id: int
    dead_members: tuple[str, ...]  # dead members of the lighthouse's current quorum


@dataclass(frozen=True)
class ReplicaStatus:
    replica_id: str
    step: int
    last_heartbeat_age_s: float
    dead: bool
    waiting: bool


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    replicas: tuple[ReplicaStatus, ...]
    quorum: qm.Quorum | None
    last_reason: str
    local_world_size: int
    num_configured: int


def format_status(jobs: Sequence[JobStatus]) -> str:
    """A person's view of the lighthouse: per job, the quorum and why, and every replica."""
    if not jobs:
        return "no jobs"
    lines = []
    for j in jobs:
        q = j.quorum
        head = f"job {j.job_id!r}: {j.num_configured or '?'} configured"
        if q is not None:
            head += (f", quorum {q.quorum_id} members {list(q.member_ids)} at step {q.max_step} "
                     f"(healthy {list(q.healthy)}, behind {list(q.behind)})")
        lines.append(head)
        lines.append(f"  last decision: {j.last_reason or '-'}")
        for r in j.replicas:
            state = "DEAD" if r.dead else ("waiting for quorum" if r.waiting else "training")
            lines.append(f"  replica {r.replica_id:>4}: step {r.step:>6}  heard {r.last_heartbeat_age_s:6.2f}s ago  {state}")
    return "\n".join(lines)


def status_cli(argv: list[str]) -> int:
    """``fthsdp status --lighthouse HOST:PORT [--job ID] [--watch S]``."""
    import argparse

    p = argparse.ArgumentParser(prog="fthsdp status", description="Show a lighthouse's jobs, quorums and replicas.")
    p.add_argument("--lighthouse", required=True, help="HOST:PORT of `fthsdp lighthouse`")
    p.add_argument("--job", default="", help="one job (default: every job)")
    p.add_argument("--watch", type=float, default=0.0, help="refresh every S seconds until interrupted")
    args = p.parse_args(argv)
    client = LighthouseClient(args.lighthouse, "fthsdp-status", "status", rpc_timeout_s=5.0)
    try:
        while True:
            try:
                print(format_status(client.status(args.job)), flush=True)
            except LighthouseError as e:
                print(f"fthsdp status: {e}", file=sys.stderr)
                return 1
            if args.watch <= 0:
                return 0
            time.sleep(args.watch)
            print()
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def quorum_from_proto(p: pb2.Quorum) -> qm.Quorum:
    return qm.Quorum(
        quorum_id=p.quorum_id,
        members=tuple(
            qm.Member(m.replica_id, m.step, tuple(m.ftar_addresses), m.state_server_address, m.local_world_size)
            for m in p.members
        ),
        max_step=p.max_step,
        healthy=tuple(p.healthy),
        behind=tuple(p.behind),
        recovery={r.replica_id: tuple(r.source_replica_ids) for r in p.recovery},
        num_healthy=p.num_healthy,
        num_configured=p.num_configured,
        reason=p.reason,
    )


OnDead = Callable[[tuple[str, ...], int], None]


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
    ) -> None:
        if not job_id:
            raise ValueError("job_id is empty: pass the job's name (shared by all its replicas)")
        if replica_id == "" or replica_id is None:
            raise ValueError("replica_id is empty: pass this replica's id, unique within the job")
        if heartbeat_interval_s <= 0 or heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_interval_s and heartbeat_timeout_s must be > 0")
        self.address = address
        self.job_id = job_id
        self.replica_id = str(replica_id)
        self.rpc_timeout_s = rpc_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = pb2_grpc.LighthouseStub(self._channel)
        self._step = 0
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._on_dead: OnDead | None = None
        self.last_heartbeat: HeartbeatReply | None = None
        self.heartbeat_failures = 0  # consecutive
        self.last_heartbeat_error: LighthouseError | None = None

    # -- errors --------------------------------------------------------------

    def _error(self, what: str, e: grpc.RpcError, timeout_s: float) -> LighthouseError:
        code = e.code() if hasattr(e, "code") else None
        details = (e.details() if hasattr(e, "details") else None) or str(e)
        where = f"lighthouse {self.address} (job {self.job_id!r}, replica {self.replica_id!r})"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return QuorumTimeout(f"{what}: no answer from {where} within {timeout_s:g}s: {details}", code)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidLighthouseRequest(f"{what} rejected by {where}: {details}", code)
        if code == grpc.StatusCode.NOT_FOUND:
            return JobNotFound(f"{what} at {where}: {details}", code)
        if code == grpc.StatusCode.UNAVAILABLE:
            return LighthouseUnavailable(
                f"{what}: cannot reach {where}: {details}; is `fthsdp lighthouse` running at that address?", code
            )
        return LighthouseError(f"{what} failed at {where}: {code}: {details}", code)

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
    ) -> qm.Quorum:
        """Block until the quorum of ``step`` (this replica's next step) is decided.

        Raises QuorumTimeout (with the lighthouse's last decision reason) if
        none is decided within ``timeout_s``.
        """
        self._step = step
        req = pb2.QuorumRequest(
            protocol_version=LIGHTHOUSE_PROTOCOL_VERSION,
            job_id=self.job_id,
            replica_id=self.replica_id,
            step=step,
            ftar_addresses=list(ftar_addresses),
            state_server_address=state_server_address,
            local_world_size=len(ftar_addresses) if local_world_size is None else local_world_size,
            commit_failed=commit_failed,
            num_replicas=num_replicas,
        )
        try:
            resp = self._stub.GetQuorum(req, timeout=timeout_s)
        except grpc.RpcError as e:
            raise self._error(f"get_quorum(step={step})", e, timeout_s) from None
        return quorum_from_proto(resp.quorum)

    def heartbeat(self, step: int | None = None) -> HeartbeatReply:
        """One heartbeat now (the background thread calls this)."""
        if step is not None:
            self._step = step
        req = pb2.HeartbeatRequest(
            protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id=self.job_id, replica_id=self.replica_id, step=self._step
        )
        try:
            resp = self._stub.Heartbeat(req, timeout=self.heartbeat_timeout_s)
        except grpc.RpcError as e:
            raise self._error("heartbeat", e, self.heartbeat_timeout_s) from None
        reply = HeartbeatReply(tuple(resp.dead_replica_ids), resp.quorum_id, tuple(resp.dead_members))
        self.last_heartbeat = reply
        return reply

    def status(self, job_id: str | None = None) -> list[JobStatus]:
        """Introspection: every job (``job_id=""``) or one (default: this client's job)."""
        jid = self.job_id if job_id is None else job_id
        try:
            resp = self._stub.Status(
                pb2.StatusRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id=jid), timeout=self.rpc_timeout_s
            )
        except grpc.RpcError as e:
            raise self._error("status", e, self.rpc_timeout_s) from None
        return [
            JobStatus(
                job_id=j.job_id,
                replicas=tuple(
                    ReplicaStatus(r.replica_id, r.step, r.last_heartbeat_age_s, r.dead, r.waiting) for r in j.replicas
                ),
                quorum=quorum_from_proto(j.quorum) if j.has_quorum else None,
                last_reason=j.last_reason,
                local_world_size=j.local_world_size,
                num_configured=j.num_configured,
            )
            for j in resp.jobs
        ]

    # -- heartbeat thread ----------------------------------------------------

    def set_step(self, step: int) -> None:
        """The step reported by the next heartbeats (get_quorum sets it too)."""
        self._step = step

    def start_heartbeats(self, on_dead: OnDead | None = None) -> None:
        """Start the daemon heartbeat thread.

        ``on_dead(dead_members, quorum_id)`` is called from that thread on every
        reply that lists dead members of the lighthouse's current quorum
        (repeatedly, ~10 Hz, until a new quorum forms): keep it cheap and
        idempotent (e.g. abort FTAR if ``quorum_id`` is the one in flight).
        """
        if self._hb_thread is not None:
            raise RuntimeError("heartbeats already running")
        self._on_dead = on_dead
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

    def _heartbeat_loop(self) -> None:
        next_at = time.monotonic()
        while not self._hb_stop.is_set():
            try:
                reply = self.heartbeat()
                if self.heartbeat_failures:
                    log.info("heartbeats to %s resumed after %d failures", self.address, self.heartbeat_failures)
                self.heartbeat_failures = 0
                if reply.dead_members and self._on_dead is not None:
                    try:
                        self._on_dead(reply.dead_members, reply.quorum_id)
                    except Exception:
                        log.exception("on_dead callback raised")
            except LighthouseError as e:
                self.heartbeat_failures += 1
                self.last_heartbeat_error = e
                if self.heartbeat_failures in (1, 10) or self.heartbeat_failures % 100 == 0:
                    log.warning("heartbeat failure %d: %s", self.heartbeat_failures, e)
            next_at += self.heartbeat_interval_s
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (slow RPC): do not burst to catch up
                next_at, delay = time.monotonic(), 0.0
            self._hb_stop.wait(delay)

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        self.stop_heartbeats()
        self._channel.close()

    def __enter__(self) -> LighthouseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
