"""The launcher's decisions about its replicas, as plain functions over plain data.

Which replicas are healthy (their live process has committed the job's latest
step, give or take the one being committed, and is neither stopped nor dead),
which could still make progress, and when the job has lost its live state and
must fall back to the persistent checkpoint.

The job's *frontier* is the latest step any process of this attempt committed.
A replica whose last commit is older (it was stopped and woke up behind, say)
holds an old state: it can catch up from a replica at the frontier, but if
none is left, training on from its state would train the lost steps' batches
a second time. Only the checkpoint can save the job then.
Kept apart from the process loop so each rule is unit-tested without processes.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from fthsdp.errors import EXIT_JOB_FATAL, EXIT_REPLICA_FATAL


@dataclass(frozen=True)
class ReplicaView:
    rid: int
    state: str  # starting / running / killed / stopped / done / failed (the launcher's view)
    live_step: int | None  # the step its live process reported; None before its first commit
    mode: str = "start"  # start (a job's start or resume: begins with the others) / rejoin (alone, from peers)
    progressed: bool = False  # its live process committed at least once (also true while it is stopped)
    last_step: int | None = None  # the last step its live process reported (kept while it is stopped)
    returncode: int | None = None  # how its last process ended, once it has


def at_frontier(v: ReplicaView, frontier: int | None) -> bool:
    """Its last commit is the job's latest step (or the one before, being committed now)."""
    return v.last_step is not None and (frontier is None or v.last_step >= frontier - 1)


def frontier(views: list[ReplicaView]) -> int | None:
    steps = [v.last_step for v in views if v.last_step is not None]
    return max(steps) if steps else None


def healthy(views: list[ReplicaView], front: int | None = None) -> set[int]:
    """Replicas holding the live state right now: running, committed in this
    process, at the frontier (default: the views' own frontier)."""
    front = frontier(views) if front is None else front
    return {v.rid for v in views if v.state == "running" and v.live_step is not None and at_frontier(v, front)}


def can_progress(v: ReplicaView, front: int | None = None) -> bool:
    """Whether this replica could still carry the job: it holds the latest state
    (even while stopped: it wakes up and goes on), or it is a job start (initial,
    resumed) that has not committed yet and will train from the checkpoint with
    the others. A replica restarted to rejoin cannot: it needs a healthy peer to
    fetch from; nor can one whose state is older than the frontier."""
    if v.state == "running":
        if v.live_step is None:
            return v.mode == "start" and front is None
        return at_frontier(v, front)
    if v.state == "stopped":
        return v.progressed and at_frontier(v, front)
    return False


def job_done(views: list[ReplicaView]) -> bool:
    return any(v.state == "done" for v in views)


def needs_fallback(views: list[ReplicaView]) -> bool:
    """True when nobody holds the live state any more and nobody can regain it
    from a peer: every replica is dead, failed, or restarting to rejoin without
    having rejoined. Then only the persistent checkpoint can save the job."""
    front = frontier(views)
    return bool(views) and not job_done(views) and not any(can_progress(v, front) for v in views)


def job_fatal(views: list[ReplicaView]) -> list[int]:
    """Replicas that failed with their own job-fatal verdict (EXIT_JOB_FATAL: a bad
    config, a version mismatch, replicas disagreeing on their state with no
    majority to trust). Falling back to the checkpoint would only fail again
    (or, for corrupt state, guess), so the launcher stops instead."""
    return [v.rid for v in views if v.state == "failed" and v.returncode == EXIT_JOB_FATAL]


def restart_allowed(views: list[ReplicaView], rid: int) -> bool:
    """A killed replica is restarted to rejoin only while someone else can carry
    the job; never into a finished job (it would find no peers)."""
    front = frontier(views)
    return not job_done(views) and any(can_progress(v, front) for v in views if v.rid != rid)


def after_exit(returncode: int) -> str:
    """What a replica's exit means: "done" (0), "restart" (a signal we did not
    send, e.g. a dead machine or the OOM killer, or the replica's own verdict
    EXIT_REPLICA_FATAL: restart me), or "failed" (job-fatal or an unclassified
    error: a restart would fail the same way)."""
    if returncode == 0:
        return "done"
    if (returncode < 0 and returncode != -signal.SIGTERM) or returncode == EXIT_REPLICA_FATAL:
        return "restart"
    return "failed"


def group_returncode(codes: list[int]) -> int:
    """The exit that stands for a replica of several processes when some ended with ``codes``
    (non-zero) and the launcher stopped the rest (the replica fails as a unit). A verdict that
    forbids a restart (job-fatal, an unclassified error) wins over one that asks for it: with the
    leader's own end standing for the group, a follower's job-fatal exit read as a kill (the
    launcher's SIGKILL of the leader) and the group was restarted into the same failure, again
    and again."""
    final = [c for c in codes if after_exit(c) == "failed"]
    if final:
        return EXIT_JOB_FATAL if EXIT_JOB_FATAL in final else final[0]
    return codes[0] if codes else 0

