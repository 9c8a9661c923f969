"""Silent-data-corruption verdicts: compare the replicas' state fingerprints, step by step.

After every commit each replica reports a fingerprint of the state it holds
(:mod:`fthsdp.step.fingerprint`; 64 bits computed on its devices) with its
quorum requests and heartbeats. Invariant 1 says every replica that committed
step N holds the same bytes, so their fingerprints of "the state after N
committed steps" must be equal. When they are not, some replica computed
garbage (a flipped bit in memory, a faulty ALU) and nothing else in the job
would notice.

This module is the lighthouse's judgement, pure (plain data in and out, no
clock, no I/O), so every rule is unit-tested without a server:

* :func:`judge` -- one step: the fingerprints reported so far and the
  *voters* (the replicas expected to hold that step: the members of the
  quorum that ran it, minus those declared dead since; where that quorum is
  known, only its members' reports are judged). A fingerprint held
  by a strict majority of the voters wins; every reporter that disagrees
  with it is a *culprit*. If the disagreement cannot be settled yet (voters
  still to report could still make a majority) the verdict is *pending*; if
  it never can (two replicas that differ, a tie, three different values) it
  is *no majority*: the lighthouse cannot tell who is right and stops the
  job rather than guess.
* :class:`SdcTracker` -- one job's last few steps of reports, who is
  *condemned* (its state must be replaced by the majority's: the next quorum
  lists it behind, so it fetches the state from its healthy peers while
  contributing zero gradients, the ordinary rejoin path), and the events.
  A condemned replica is cleared once it reports, at a later step, the
  fingerprint the others hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fthsdp.control.quorum import ring_key

__all__ = ["FlipSpec", "parse_flip", "AGREE", "PENDING", "MISMATCH", "NO_MAJORITY", "Verdict", "judge", "SdcTracker", "fmt_fingerprint"]

AGREE = "agree"
PENDING = "pending"  # a disagreement that the voters yet to report may still settle
MISMATCH = "mismatch"  # a strict majority holds one fingerprint; the culprits differ from it
NO_MAJORITY = "no_majority"  # a disagreement nobody can settle: the job must stop


def fmt_fingerprint(fp: int | None) -> str:
    return "-" if fp is None else f"{fp:016x}"


def _ids(ids: Iterable[str]) -> list[str]:
    return sorted(ids, key=ring_key)


@dataclass(frozen=True)
class Verdict:
    kind: str
    step: int  # committed steps of the state the fingerprints are of
    reports: tuple[tuple[str, int], ...]  # (replica, fingerprint), ring order
    culprits: tuple[str, ...] = ()  # MISMATCH: the replicas that disagree with the majority
    majority: int | None = None  # MISMATCH: the majority's fingerprint
    reason: str = ""

    @property
    def fatal(self) -> bool:
        return self.kind == NO_MAJORITY


def judge(step: int, reports: Mapping[str, int], voters: Iterable[str] = ()) -> Verdict:
    """The verdict on the fingerprints of the state after ``step`` committed steps.

    ``reports``: replica -> fingerprint, as reported so far. ``voters``: the replicas
    expected to report this step (alive members of the quorum that committed it); every
    reporter counts as a voter too. A strict majority of the voters is needed to convict.
    """
    rep = tuple((r, int(reports[r])) for r in _ids(reports))
    shown = ", ".join(f"{r}:{fmt_fingerprint(f)}" for r, f in rep)
    if len({f for _, f in rep}) <= 1:
        return Verdict(AGREE, step, rep, reason=f"step {step}: {len(rep)} replica(s) agree ({shown or 'none'})")
    electorate = set(voters) | set(reports)
    need = len(electorate) // 2 + 1
    best, count = max(Counter(f for _, f in rep).items(), key=lambda kv: (kv[1], -kv[0]))
    if count >= need:
        culprits = tuple(r for r, f in rep if f != best)
        return Verdict(MISMATCH, step, rep, culprits, best, reason=(
            f"silent data corruption after step {step}: replica(s) {', '.join(culprits)} disagree with the majority "
            f"({count} of {len(electorate)} hold {fmt_fingerprint(best)}; reports {shown}): "
            f"taken out of the quorum's healthy set, they rejoin from the majority's state"))
    missing = _ids(electorate - set(reports))
    if count + len(missing) >= need:
        return Verdict(PENDING, step, rep, reason=(
            f"fingerprints after step {step} disagree ({shown}); waiting for {', '.join(missing)} to report "
            f"before judging ({need} of {len(electorate)} needed for a majority)"))
    return Verdict(NO_MAJORITY, step, rep, reason=(
        f"silent data corruption after step {step}: the replicas hold different states ({shown}) and no "
        f"fingerprint is held by a majority ({need} of {len(electorate)} needed), so the lighthouse cannot tell "
        "which replica is right and stopped the job rather than guess. Check the hardware of these replicas "
        "and resume the job from its last persistent checkpoint (fthsdp run --resume)"))


@dataclass
class SdcTracker:
    """One job's fingerprints of its last ``keep`` steps and what was concluded from them.

    The lighthouse calls :meth:`record` for every report (quorum request or
    heartbeat), :meth:`set_voters` for every quorum it decides, and
    :meth:`update` before deciding a quorum; it passes :attr:`condemned` to the
    quorum decision, holds the quorum while :meth:`pending` names a requester's
    step, and stops the job once :attr:`fatal` is set.
    """

    keep: int = 8
    max_events: int = 32
    reports: dict[int, dict[str, int]] = field(default_factory=dict)
    voters: dict[int, frozenset[str]] = field(default_factory=dict)
    condemned: dict[str, Verdict] = field(default_factory=dict)
    events: list[Verdict] = field(default_factory=list)  # MISMATCH and NO_MAJORITY verdicts, oldest first
    fatal: Verdict | None = None
    verdicts: dict[int, Verdict] = field(default_factory=dict)  # the latest verdict per step
    latest: dict[str, tuple[int, int]] = field(default_factory=dict)  # replica -> (step, fingerprint)
    _dirty: set[int] = field(default_factory=set)

    def record(self, replica: str, step: int, fp: int) -> None:
        """A replica's fingerprint of its state after ``step`` committed steps."""
        if step < 0:
            raise ValueError(f"fingerprint step must be >= 0, got {step}")
        newest = max(self.reports, default=step)
        if step <= newest - self.keep:
            return  # too old to matter: the steps it could be compared with are forgotten
        prev = self.latest.get(replica)
        if prev is None or step >= prev[0]:
            self.latest[replica] = (step, int(fp))
        at = self.reports.setdefault(step, {})
        if at.get(replica) != fp:
            at[replica] = int(fp)
            self._dirty.add(step)
        for old in [s for s in self.reports if s <= max(self.reports) - self.keep]:
            del self.reports[old]
            self.voters.pop(old, None)
            self.verdicts.pop(old, None)
            self._dirty.discard(old)

    def set_voters(self, step: int, members: Iterable[str]) -> None:
        """The replicas that will hold ``step`` committed steps (a quorum that runs step ``step - 1``)."""
        self.voters[step] = frozenset(members)
        self._dirty.add(step)

    def forget_after(self, step: int) -> None:
        """A quorum was decided at ``step``: states of later steps reported so far belong to a
        lineage the job no longer continues (rule 6 of fthsdp.control.quorum: that quorum
        re-decided a step they had committed), not to this one. Their reports, voters and
        verdicts are dropped, and the condemnations they made lifted: comparing a fork with
        the lineage is no evidence of corruption (the fork's holders are fenced instead)."""
        if max(self.reports, default=step) <= step and max(self.voters, default=step) <= step:
            return  # the common case: nothing reported or expected past this step
        for table in (self.reports, self.voters, self.verdicts):
            for s in [s for s in table if s > step]:
                del table[s]
        self._dirty = {s for s in self._dirty if s <= step}
        for r in [r for r, v in self.condemned.items() if v.step > step]:
            del self.condemned[r]

    def forget(self, replica: str) -> None:
        """A replica left on purpose: it is no longer condemned (a restarted one rejoins from its peers)."""
        self.condemned.pop(replica, None)
        self.latest.pop(replica, None)

    def update(self, alive: Iterable[str]) -> list[Verdict]:
        """Judge the steps with new reports (and every pending one: a voter may have died).
        Returns the new MISMATCH / NO_MAJORITY verdicts (each once); condemns and clears."""
        alive = set(alive)
        steps = self._dirty | {s for s, v in self.verdicts.items() if v.kind == PENDING}
        self._dirty = set()
        new: list[Verdict] = []
        for step in sorted(steps):
            reports = self.reports.get(step)
            eligible = self.voters.get(step)
            if reports and eligible is not None:
                # Only the members of the quorum that ran the step vote on it: a replica id that was
                # never one (registered with the job's key, heartbeating a made-up fingerprint) no
                # longer ties or outvotes the members and stops or steers the job. A member since
                # declared dead keeps its report (what its state was), not its seat among the awaited.
                reports = {r: f for r, f in reports.items() if r in eligible}
            if not reports:
                continue
            voters = (eligible or frozenset()) & alive
            v = judge(step, reports, voters)
            old = self.verdicts.get(step)
            self.verdicts[step] = v
            if v.kind == MISMATCH:
                for c in v.culprits:
                    # not if it has since reported a later state (it may have rejoined already)
                    if self.latest.get(c, (step, 0))[0] <= step and (
                            c not in self.condemned or self.condemned[c].step < step):
                        self.condemned[c] = v
            if v.kind in (MISMATCH, NO_MAJORITY) and (old is None or (old.kind, old.culprits) != (v.kind, v.culprits)):
                new.append(v)
                self.events.append(v)
                del self.events[:-self.max_events]
            if v.kind == NO_MAJORITY and self.fatal is None:
                self.fatal = v
            # A condemned replica that now holds what the others hold, at a later step, is clean again.
            if v.kind in (AGREE, MISMATCH) and len(reports) > 1:
                good = v.majority if v.kind == MISMATCH else next(iter(reports.values()))
                for r, f in reports.items():
                    c = self.condemned.get(r)
                    if c is not None and c.step < step and f == good:
                        del self.condemned[r]
        return new

    @property
    def needs_update(self) -> bool:
        """New reports or voters since the last :meth:`update`."""
        return bool(self._dirty)

    @property
    def any_pending(self) -> bool:
        return any(v.kind == PENDING for v in self.verdicts.values())

    def pending(self, step: int) -> Verdict | None:
        """The pending verdict of ``step``, if its fingerprints disagree and it cannot be settled yet."""
        v = self.verdicts.get(step)
        return v if v is not None and v.kind == PENDING else None

    def reset(self) -> None:
        """A new run of the job (``fresh_start``): forget everything, the fatal verdict included."""
        self.reports.clear()
        self.voters.clear()
        self.condemned.clear()
        self.events.clear()
        self.verdicts.clear()
        self.latest.clear()
        self._dirty.clear()
        self.fatal = None


# -- the test hook's spec (jax-free: the config checks parse it) --------------------------------


class FlipSpec:
    """``REPLICA@STEP[:BIT]`` (``ft.test_flip_bit``): after replica REPLICA commits step STEP
    (the step index of its metrics), flip bit BIT (default 16, a mantissa bit of float32:
    the value changes by under 1%, so training goes on but the bytes differ) of the first
    element of its first parameter. A test hook, off by default."""

    def __init__(self, replica: int, step: int, bit: int = 16) -> None:
        if replica < 0 or step < 0 or not 0 <= bit < 32:
            raise ValueError(f"flip spec {replica}@{step}:{bit}: need REPLICA >= 0, STEP >= 0, 0 <= BIT < 32")
        self.replica, self.step, self.bit = replica, step, bit

    def __repr__(self) -> str:
        return f"{self.replica}@{self.step}:{self.bit}"


def parse_flip(text: str) -> FlipSpec | None:
    """``""`` -> None (off); ``"R@S"`` or ``"R@S:BIT"`` -> FlipSpec; anything else -> ValueError."""
    text = text.strip()
    if not text:
        return None
    where, _, bit = text.partition(":")
    r, sep, s = where.partition("@")
    if not sep or not r.strip().isdigit() or not s.strip().isdigit() or (bit and not bit.strip().isdigit()):
        raise ValueError(f"ft.test_flip_bit={text!r}: expected REPLICA@STEP or REPLICA@STEP:BIT (e.g. 1@20:16)")
    return FlipSpec(int(r), int(s), int(bit) if bit else 16)
