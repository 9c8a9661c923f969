"""Every timeout of a fault-tolerant job, in one place, with their ordering checked.

The control plane's timeouts only work together: a heartbeat must be sent
several times within the detection window, or a live replica is declared dead;
the detection window must be shorter than the all-reduce deadline, or a frozen
peer is found by the deadline (slow) instead of by the lighthouse (fast); the
all-reduce deadline must be shorter than the quorum wait, or a replica gives up
on the quorum while its peers are still inside an all-reduce that will time
out. Scattering these numbers over modules let inconsistent settings through
silently; :class:`Timeouts` is their one owner. Every module that waits reads
its deadline from here, and :meth:`Timeouts.check` refuses a set whose order
would break the protocol, naming the fields and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


class TimeoutsError(ValueError):
    """A timeout is out of range or the set is not ordered as the protocol needs."""


@dataclass(frozen=True)
class Timeouts:
    """The job's timeouts in seconds. Field names match ``FTConfig`` (``ft.<name>``)."""

    heartbeat_interval_s: float = 0.1  # a replica heartbeats this often
    detect_s: float = 0.8  # heartbeat silence that declares a replica dead
    join_timeout_s: float = 0.5  # how long a quorum waits for a *newcomer* that is live but not asking
    allreduce_timeout_s: float = 10.0  # FTAR's deadline: the backstop when detection misses a fault
    # Added to that deadline in a quorum with a behind member, which fetches the state before it
    # joins the all-reduce: a fetch longer than the deadline failed every attempt of the healthy
    # members (each one refetched) until they gave up and the job fell back to its checkpoint.
    catch_up_timeout_s: float = 30.0
    quorum_timeout_s: float = 120.0  # how long one get_quorum call waits for a decision
    startup_timeout_s: float = 120.0  # a fresh job waits this long for every replica to be live
    lighthouse_outage_s: float = 60.0  # replicas ride out a lighthouse outage this long, then give up
    # The peer state server (fthsdp/checkpoint/peer_server.py): what one connection may cost it.
    peer_header_s: float = 5.0  # a request head must arrive whole within this (slowloris is cut)
    peer_idle_s: float = 30.0  # a keep-alive connection with no request in flight is closed after this
    peer_send_s: float = 60.0  # one response (a piece) must be written out within this (slow readers are cut)

    # The minimum number of heartbeats that must fit in the detection window:
    # one late heartbeat (a GC pause, a busy core) must not look like a death.
    MIN_HEARTBEATS_PER_WINDOW = 3
    # No timeout may exceed a week: the native control thread turns seconds into
    # an int64 count of nanoseconds, and a value like 1e300 would overflow it.
    MAX_S = 7 * 24 * 3600.0

    def check(self) -> "Timeouts":
        """Returns self, or raises :class:`TimeoutsError` naming the offending ``ft.`` fields."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    and 0 < v <= self.MAX_S):
                raise TimeoutsError(f"ft.{f.name}={v!r}: must be a finite number of seconds > 0 and "
                                    f"<= {self.MAX_S:g} (a week)")
        order = [
            ("heartbeat_interval_s", "detect_s", "a replica must heartbeat several times per detection window"),
            ("detect_s", "allreduce_timeout_s",
             "failure detection must be faster than the all-reduce deadline (the deadline is the backstop)"),
            ("allreduce_timeout_s", "quorum_timeout_s",
             "a replica must not give up on a quorum while its peers can still be inside an all-reduce"),
            ("join_timeout_s", "quorum_timeout_s", "the join limit must end before the quorum wait does"),
            ("peer_header_s", "peer_idle_s",
             "a half-sent request head must not hold a peer-server connection longer than an idle one"),
        ]
        for lo, hi, why in order:
            if not getattr(self, lo) < getattr(self, hi):
                raise TimeoutsError(
                    f"ft.{lo}={getattr(self, lo):g} must be < ft.{hi}={getattr(self, hi):g}: {why}")
        if not self.catch_up_allreduce_s < self.quorum_timeout_s:
            raise TimeoutsError(
                f"ft.allreduce_timeout_s + ft.catch_up_timeout_s = {self.catch_up_allreduce_s:g} must be < "
                f"ft.quorum_timeout_s={self.quorum_timeout_s:g}: a replica must not give up on a quorum while its "
                "peers can still be in a catch-up's all-reduce")
        need = self.MIN_HEARTBEATS_PER_WINDOW * self.heartbeat_interval_s
        if self.detect_s < need:
            raise TimeoutsError(
                f"ft.detect_s={self.detect_s:g} must be >= {self.MIN_HEARTBEATS_PER_WINDOW} x "
                f"ft.heartbeat_interval_s={self.heartbeat_interval_s:g} (= {need:g}): one late heartbeat "
                "must not declare a live replica dead")
        from fthsdp.control.auth import CLOCK_WINDOW_S

        if not self.peer_header_s < CLOCK_WINDOW_S:
            raise TimeoutsError(
                f"ft.peer_header_s={self.peer_header_s:g} must be < {CLOCK_WINDOW_S:g} s (the credential clock "
                "window, fthsdp.control.auth.CLOCK_WINDOW_S): a request signed just before its head was sent "
                "must still be fresh when the head is complete")
        if self.lighthouse_outage_s < self.detect_s:
            raise TimeoutsError(
                f"ft.lighthouse_outage_s={self.lighthouse_outage_s:g} must be >= ft.detect_s={self.detect_s:g}: "
                "replicas must outlast at least one detection window of lighthouse silence")
        return self

    @classmethod
    def from_ft(cls, ft) -> "Timeouts":
        """The timeouts of an ``FTConfig`` (any object with the same field names)."""
        return cls(**{f.name: getattr(ft, f.name) for f in dataclasses.fields(cls)})

    @property
    def catch_up_allreduce_s(self) -> float:
        """The all-reduce deadline of a quorum with a behind member (it fetches the state first)."""
        return self.allreduce_timeout_s + self.catch_up_timeout_s

    @property
    def heartbeat_rpc_s(self) -> float:
        """Deadline of one heartbeat RPC: a lost one is retried at the next interval,
        and a few lost in a row must still fit in the detection window."""
        return max(0.05, min(0.5, self.detect_s / 2))

    @property
    def follower_startup_silence_s(self) -> float:
        """How long a replica's leader lets a follower's beat stand still before the replica
        trains (fthsdp.replica.group.FollowerSilence): importing and compiling beside the rest
        of a job on a busy host, a follower missed its beats for just over the detection window,
        and taking the replica out then restarted the whole job. Ten detection windows, within
        the start-up limit; from the first step on, the detection window applies."""
        return self._ten_windows()

    @property
    def alone_rejoin_s(self) -> float:
        """How long a replica restarted to rejoin, whose quorum at step 0 holds only replicas
        restarted to rejoin (itself alone, or others: Member.rejoining), keeps asking for a quorum
        holding the job's state before it gives up (job-fatal; see fsm.rejoin_at_step_0). A
        healthy replica cut off from the lighthouse for a moment (its relay stopped: it leaves
        it after 3 s of silence) is declared dead within the detection window and is back once
        heard: in a chaos soak the rejoiners, alone for that moment, exited job-fatal and the
        job ended, or met and redid it from step 0. Ten detection windows, within the start-up
        limit, and never less than that moment itself: a relay's silence limit (RelayPath.SILENCE_S),
        the beat that finds it, and a detection window to be heard again (a short ft.detect_s or
        ft.startup_timeout_s would otherwise give up before the healthy replica is back)."""
        from fthsdp.control.session_client import RelayPath

        return max(self._ten_windows(), RelayPath.SILENCE_S + self.heartbeat_rpc_s + self.detect_s)

    def _ten_windows(self) -> float:
        return min(self.startup_timeout_s, 10 * self.detect_s)


# The lighthouse holds a call over its connection's or job's budget (fthsdp/control/admission.py)
# at most this long, and never more than half the call's own remaining deadline: a legitimate
# call is held for milliseconds at most; a flood's calls wait here, idle, instead of being
# answered and sent again at once. Shorter than a heartbeat's RPC deadline would be useless
# (the half-deadline rule already covers it); longer only keeps a flood's calls parked longer.
LIGHTHOUSE_MAX_HOLD_S = 1.0
