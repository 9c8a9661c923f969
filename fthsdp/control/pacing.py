"""Heartbeat pacing: the lighthouse sets how often processes beat once there are many.

**Why.** Every process of every replica heartbeats the lighthouse (default every
0.1 s), and the lighthouse is one Python event loop that spends some tens of
microseconds on each message (README, "The budgets' words cost a quarter of a
message"): 10 beats/s x 4,096 processes is ~41,000 messages a second, more than
its core can read, so its quorum rounds starve and late beats start to look
like deaths (the scale study's flat rows cannot heartbeat at all for that
reason). Nothing in a process's own configuration can know how many others
beat the same lighthouse, so the lighthouse decides: with a budget of
``beats_per_s`` beats a second, N beating processes are asked to beat no more
often than every ``N / beats_per_s`` seconds (``HeartbeatResponse.beat_interval_ms``;
a process beats at the slower of that and its own interval).

**The cost, said out loud.** Slower beats mean slower failure detection: the
lighthouse widens its silence window to ``PACED_BEATS_PER_WINDOW`` paced
intervals when that is longer than its configured window, and logs when it
does. Below ``beats_per_s x interval`` processes (500 at the defaults)
nothing changes.

**Changing the pace safely.** A process told an interval keeps it until its next
beat's reply, so after the pace falls the lighthouse keeps the wider window for
``PACED_BEATS_PER_WINDOW`` of the slowest interval it announced (every process
has beaten at the new pace by then); when the pace rises the window widens at
once, before any process has slowed down.

**A restarted lighthouse.** It knows none of its processes at first and counts them as they
come back, so its first count is low, and a pace set from it would tell processes paced by
the lighthouse before it to beat as fast as their own interval: a storm of beats at the
moment it is busiest. Each heartbeat therefore says the interval its process beats at
(``HeartbeatRequest.beat_interval_ms``, 0 when its own), and for its first
:data:`INHERIT_S` seconds a lighthouse keeps at least the slowest pace so reported
(:meth:`BeatPacer.inherit`), with the window that goes with it; after that its own count
rules. Reports are honoured only then so that processes repeating a pace back to the
lighthouse that set it cannot hold it after the processes that needed it are gone. (A
lighthouse restarted with a larger budget therefore takes its own, faster pace only after
those seconds; a report can slow the pace and detection, for every job on the lighthouse, to
at most the 1 s cap and its 8 s window, and only until 8 such intervals after those seconds.)

:class:`BeatPacer` is plain data and a clock passed in (unit-tested without a
server); :func:`paced_interval` is the client's side of the rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["BeatPacer", "paced_interval", "reported_ms", "PACED_BEATS_PER_WINDOW", "MAX_PACED_INTERVAL_S",
           "DEFAULT_BEATS_PER_S", "INHERIT_S"]

# Beats that fit in a paced silence window: as many as in the default configuration (ft.detect_s
# 0.8 s / ft.heartbeat_interval_s 0.1 s). With 4 (the Timeouts' minimum of 3, plus one), 2,048
# emulated processes paced to 0.2 s (a budget of 10,000/s) saw 21,960 beats taken for deaths in
# 5 rounds; with 8, 309 (experiments/heartbeat_pacing.py): under load beats come late in
# bunches, and a window of few beats is the one they miss.
PACED_BEATS_PER_WINDOW = 8
# No process is asked to beat less often than this, so that the paced window (8 s) stays under
# the all-reduce's default deadline (ft.allreduce_timeout_s, 10 s, the backstop detection must
# beat). Past budget x 1 s processes (5,000 at the default budget) the beats exceed the budget;
# the lighthouse says so.
MAX_PACED_INTERVAL_S = 1.0
# The default budget: ~0.2 of a core at the ~38 us a beat costs the lighthouse on this project's
# hosts, leaving the rest to the quorum rounds (512 replica leaders beating every 0.1 s, the
# scale study's widest shape, are not slowed). Measured with the emulator on the same 2 cores
# (experiments/heartbeat_pacing.py): 2,048 processes at 10,000 beats/s still saw late beats
# taken for deaths; at 2,000 none.
DEFAULT_BEATS_PER_S = 5_000.0
# How long a lighthouse keeps the pace its processes say they beat at (BeatPacer.inherit): long
# enough for every process to find it again after a restart (a restart at 512 x 196 took
# 0.9-1.3 s to reach every rank, README "At scale"), and each has then beaten at least once
# at the slowest pace (1 s).
INHERIT_S = 10.0


def paced_interval(own_s: float, announced_s: float) -> float:
    """The interval a process beats at: its own, or the lighthouse's announced one when slower,
    at most :data:`MAX_PACED_INTERVAL_S` (a lighthouse cannot silence a process for longer; a
    bad announcement, NaN or negative, is ignored)."""
    if not (isinstance(announced_s, float | int) and math.isfinite(announced_s)) or announced_s <= own_s:
        return own_s
    return max(own_s, min(float(announced_s), MAX_PACED_INTERVAL_S))


def reported_ms(own_s: float, announced_s: float) -> int:
    """What a heartbeat says of its process's pace (``HeartbeatRequest.beat_interval_ms``): the
    interval it beats at in whole milliseconds when a lighthouse paced it slower than its own,
    else 0 (:meth:`BeatPacer.inherit` reads it)."""
    s = paced_interval(own_s, announced_s)
    return int(round(s * 1000.0)) if s > own_s else 0


def _whole_ms(s: float) -> float:
    """``s`` rounded down to whole milliseconds, as a reply (``beat_interval_ms``) carries it."""
    return math.floor(s * 1000.0) / 1000.0


@dataclass
class BeatPacer:
    """The lighthouse's pace (the interval it announces) and its silence window.

    ``update(processes, now)`` each time the lighthouse recounts its beating processes;
    ``interval_s`` is what it announces (0.0: nothing, each beats at its own interval) and
    ``window()`` the silence that declares a process dead."""

    beats_per_s: float  # the budget; 0 = never pace
    detect_s: float  # the configured silence window
    started_at: float = 0.0  # when the lighthouse started (the clock of ``now``): inherit() until INHERIT_S after
    interval_s: float = 0.0
    counted_s: float = 0.0  # the pace its own count asks for (interval_s is more while it inherits)
    _inherited_s: float = 0.0  # the slowest pace processes brought from an earlier lighthouse
    _slowest_s: float = 0.0  # the slowest interval announced that a process may still be beating at
    _slowest_until: float = field(default=-math.inf)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.beats_per_s) and self.beats_per_s >= 0):
            raise ValueError(f"beats_per_s must be a finite number >= 0 (0 = no pacing), got {self.beats_per_s!r}")
        if not (math.isfinite(self.detect_s) and self.detect_s > 0):
            raise ValueError(f"detect_s must be a finite number of seconds > 0, got {self.detect_s!r}")

    def update(self, processes: int, now: float) -> float:
        """Recount: ``processes`` beat this lighthouse now. Returns the interval announced."""
        p = 0.0
        if self.beats_per_s > 0 and processes > 0:
            p = _whole_ms(min(processes / self.beats_per_s, MAX_PACED_INTERVAL_S))
        self.counted_s = p
        if self._inheriting(now):
            p = max(p, self._inherited_s)  # the count is still growing: keep the pace they brought
        self.interval_s = p
        if p >= self._slowest_s or now >= self._slowest_until:
            self._slowest_s = p
            self._slowest_until = now + PACED_BEATS_PER_WINDOW * p
        return p

    def inherit(self, interval_s: float, now: float) -> bool:
        """A process says it beats every ``interval_s`` (an earlier lighthouse paced it). In the
        first :data:`INHERIT_S` seconds the pace announced does not fall below the slowest such
        report (at most :data:`MAX_PACED_INTERVAL_S`; a budget of 0 inherits nothing). Returns
        True when that raised the pace: :meth:`update` it now, before more replies go out."""
        if not (self.beats_per_s > 0 and self._inheriting(now) and math.isfinite(interval_s)):
            return False
        s = _whole_ms(min(interval_s, MAX_PACED_INTERVAL_S))
        if s <= self._inherited_s:
            return False
        self._inherited_s = s
        return s > self.interval_s

    def _inheriting(self, now: float) -> bool:
        return now - self.started_at < INHERIT_S

    def window(self) -> float:
        """The silence that declares a process dead now: the configured window, or
        :data:`PACED_BEATS_PER_WINDOW` of the slowest interval still in use, whichever is longer."""
        return max(self.detect_s, PACED_BEATS_PER_WINDOW * self._slowest_s)

    @property
    def paced(self) -> bool:
        """Whether the window is wider than configured (detection is slower)."""
        return self.window() > self.detect_s
