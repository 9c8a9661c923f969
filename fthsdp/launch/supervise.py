"""The launcher's decisions about its replicas, as plain functions over plain data.

Which replicas are healthy (their live process has committed a step and is
neither stopped nor dead), which could still make progress, and when the job
has lost its live state and must fall back to the persistent checkpoint.
Kept apart from the process loop so each rule is unit-tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaView:
    rid: int
    state: str  # starting / running / killed / stopped / done / failed (the launcher's view)
    live_step: int | None  # the step its live process reported; None before its first commit
    mode: str = "start"  # start (a job's start or resume: begins with the others) / rejoin (alone, from peers)
    progressed: bool = False  # its live process committed at least once (also true while it is stopped)


def healthy(views: list[ReplicaView]) -> set[int]:
    """Replicas holding the live state right now: running and committed in this process."""
    return {v.rid for v in views if v.state == "running" and v.live_step is not None}


def can_progress(v: ReplicaView) -> bool:
    """Whether this replica could still carry the job: it holds the state (even
    while stopped: it resumes behind and catches up), or it is a job start
    (initial, resumed) that will train from the checkpoint with the others.
    A replica restarted to rejoin cannot: it needs a healthy peer to fetch from."""
    if v.state == "running":
        return v.live_step is not None or v.mode == "start"
    if v.state == "stopped":
        return v.progressed
    return False


def job_done(views: list[ReplicaView]) -> bool:
    return any(v.state == "done" for v in views)


def needs_fallback(views: list[ReplicaView]) -> bool:
    """True when nobody holds the live state any more and nobody can regain it
    from a peer: every replica is dead, failed, or restarting to rejoin without
    having rejoined. Then only the persistent checkpoint can save the job."""
    return bool(views) and not job_done(views) and not any(can_progress(v) for v in views)


def restart_allowed(views: list[ReplicaView], rid: int) -> bool:
    """A killed replica is restarted to rejoin only while someone else can carry
    the job; never into a finished job (it would find no peers)."""
    return not job_done(views) and any(can_progress(v) for v in views if v.rid != rid)
