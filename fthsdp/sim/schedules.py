"""Failure schedules in the paper's grammar, scaled down to runs this machine can do.

The FT-HSDP paper (section 6.2) names each accuracy experiment
`freq_fp_len_con_lr`, for example `d2x_fp8_for4k_1reps_lr_none`:

    freq  `d<F>x`          F failures per period of n steps; the paper sets
                           n = 11k steps when a failure lasts 4k steps or more,
                           and n = 5k steps otherwise
    fp    `fp8|fp16|bf16|fp32`  training precision
    len   `for<L>[k]`      each failure lasts L steps (`k` = thousands, `for1.5k` ok)
    con   `<C>reps`        C replicas are killed at once in each failure
    lr    `lr_<mode>`      learning-rate intervention: none, linear, sqrt, or `x`
                           (or omitted) for "every mode" (the study sweeps them)

Scaling rule (`ScaleRule`): a paper run has millions of steps; ours has a few
hundred. Time is scaled linearly so that `periods` paper periods of n steps
exactly fill the failure phase [start_frac, end_frac) of our `total_steps`;
every failure keeps its fraction of the period (length L * P/n, at least one
step), and the F failures of a period sit centred in F equal slots, so they
never overlap. The paper starts killing at 200B of 500B tokens (start_frac 0.4);
we stop killing at end_frac so that the tail shows whether the run returns to
the baseline. Which C replicas die in a failure is drawn from the seed. The
precision maps to the model's activation dtype (`activation_dtype`): fp8 has no
matmul in XLA here and XLA:CPU has no float16 dot, so fp8 always and fp16 on
CPU run at bfloat16, the nearest lower precision available; the name keeps
what was asked, the results record the dtype that ran.

Everything here is a pure function of its arguments: the same schedule, rule
and seed give the same membership mask on every machine.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from fthsdp.step.intervention import Intervention

PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
LONG_FAILURE_STEPS = 4000  # the paper's rule: failures this long use an 11k-step period
LONG_PERIOD, SHORT_PERIOD = 11_000, 5_000

GRAMMAR = "d<F>x_<fp8|fp16|bf16|fp32>_for<L>[k]_<C>reps[_lr_<none|linear|sqrt|x>]"
EXAMPLE = "d2x_fp16_for4k_3reps_lr_sqrt"


class ScheduleError(ValueError):
    """A failure schedule that cannot be parsed or does not fit the run."""


@dataclass(frozen=True)
class FailureSchedule:
    """One parsed `freq_fp_len_con_lr` setting, in the paper's units (steps)."""

    failures: int  # per period
    precision: str  # fp8 | fp16 | bf16 | fp32
    length: int  # steps per failure (paper steps)
    concurrent: int  # replicas killed at once
    intervention: str | None  # none | linear | sqrt, or None for "sweep all"

    @property
    def period(self) -> int:
        """The paper's n: 11k steps for failures of 4k steps or more, 5k otherwise."""
        return LONG_PERIOD if self.length >= LONG_FAILURE_STEPS else SHORT_PERIOD

    @property
    def name(self) -> str:
        """Canonical spelling (round-trips through `parse`)."""
        n = f"{self.length // 1000}k" if self.length % 1000 == 0 else (
            f"{self.length / 1000:g}k" if self.length >= 1000 and (self.length * 10) % 1000 == 0 else str(self.length))
        lr = f"_lr_{self.intervention}" if self.intervention else ""
        return f"d{self.failures}x_{self.precision}_for{n}_{self.concurrent}reps{lr}"

    @property
    def base_name(self) -> str:
        """The name without the intervention (the key a study groups runs by)."""
        return self.with_intervention(None).name

    @property
    def dtype(self) -> str:
        return PRECISION_DTYPE[self.precision]

    def activation_dtype(self, platform: str = "cpu") -> str:
        """The dtype this precision runs at on `platform` (see the module docstring)."""
        return "bfloat16" if platform == "cpu" and self.precision == "fp16" else self.dtype

    def with_intervention(self, mode: "str | Intervention | None") -> "FailureSchedule":
        from dataclasses import replace

        return replace(self, intervention=None if mode is None else Intervention.parse(mode).name.lower())


def _bad(text: str, token: str, what: str) -> ScheduleError:
    return ScheduleError(
        f"failure schedule {text!r}: {what} (got {token!r}); the grammar is {GRAMMAR}, e.g. {EXAMPLE!r}"
    )


def parse(text: str) -> FailureSchedule:
    """Parses `freq_fp_len_con_lr`; every malformed part gets its own error."""
    if not isinstance(text, str) or not text.strip():
        raise ScheduleError(f"failure schedule must be a non-empty string like {EXAMPLE!r}, got {text!r}")
    raw = text
    tokens = text.strip().lower().split("_")
    if len(tokens) not in (4, 6):
        raise ScheduleError(
            f"failure schedule {raw!r} has {len(tokens)} '_'-separated parts; expected 4 (no lr) or 6: "
            f"{GRAMMAR}, e.g. {EXAMPLE!r}"
        )
    freq, fp, length, con = tokens[:4]
    m = re.fullmatch(r"d(\d+)x", freq)
    if not m or int(m.group(1)) < 1:
        raise _bad(raw, freq, "the first part must be d<F>x with F >= 1 failures per period")
    failures = int(m.group(1))
    if fp not in PRECISION_DTYPE:
        raise _bad(raw, fp, f"the precision must be one of {', '.join(PRECISION_DTYPE)}")
    m = re.fullmatch(r"for(\d+(?:\.\d+)?)(k?)", length)
    if not m:
        raise _bad(raw, length, "the failure length must be for<L> or for<L>k (steps, k = thousands)")
    steps = float(m.group(1)) * (1000 if m.group(2) else 1)
    if steps < 1 or steps != int(steps):
        raise _bad(raw, length, "the failure length must be a whole number of steps >= 1")
    m = re.fullmatch(r"(\d+)reps?", con)
    if not m or int(m.group(1)) < 1:
        raise _bad(raw, con, "the fourth part must be <C>reps with C >= 1 replicas killed at once")
    concurrent = int(m.group(1))
    mode = None
    if len(tokens) == 6:
        if tokens[4] != "lr":
            raise _bad(raw, tokens[4], "the fifth part must be 'lr' (as in ..._lr_sqrt)")
        if tokens[5] != "x":
            try:
                mode = Intervention.parse(tokens[5]).name.lower()
            except ValueError:
                raise _bad(raw, tokens[5], "the intervention must be none, linear, sqrt or x (all)") from None
    sched = FailureSchedule(failures, fp, int(steps), concurrent, mode)
    if failures * sched.length > sched.period:
        raise ScheduleError(
            f"failure schedule {raw!r}: {failures} failures of {sched.length} steps do not fit in the "
            f"paper's period of {sched.period} steps (they would overlap); use fewer or shorter failures"
        )
    return sched


@dataclass(frozen=True)
class ScaleRule:
    """How a paper schedule maps onto a run of `total_steps` steps of `num_replicas` replicas."""

    total_steps: int
    num_replicas: int
    start_frac: float = 0.4  # the paper starts killing at 200B of 500B tokens
    end_frac: float = 0.85  # no failure starts or lasts past here: the tail shows recovery
    periods: int = 1  # paper periods that fill the failure phase

    def validate(self) -> "ScaleRule":
        if self.num_replicas < 2:
            raise ScheduleError(f"a failure study needs at least 2 replicas, got num_replicas={self.num_replicas}")
        if not 0.0 <= self.start_frac < self.end_frac <= 1.0:
            raise ScheduleError(
                f"need 0 <= start_frac < end_frac <= 1, got start_frac={self.start_frac}, end_frac={self.end_frac}"
            )
        if self.periods < 1:
            raise ScheduleError(f"periods must be >= 1, got {self.periods}")
        if self.phase[1] - self.phase[0] < self.periods:
            raise ScheduleError(
                f"the failure phase of {self.phase[1] - self.phase[0]} steps (total_steps={self.total_steps}, "
                f"fractions {self.start_frac}..{self.end_frac}) is too short for {self.periods} period(s); "
                "train longer or widen the phase"
            )
        return self

    @property
    def phase(self) -> tuple[int, int]:
        return int(round(self.start_frac * self.total_steps)), int(round(self.end_frac * self.total_steps))

    def describe(self, sched: FailureSchedule) -> str:
        lo, hi = self.phase
        p = (hi - lo) / self.periods
        return (f"{sched.name}: {self.periods} paper period(s) of {sched.period} steps -> {p:g} of our steps each "
                f"(x{p / sched.period:.2e}) in steps [{lo}, {hi}) of {self.total_steps}; "
                f"{sched.failures} failure(s) per period of {scaled_length(sched, self)} step(s) "
                f"(paper {sched.length}), {sched.concurrent} of {self.num_replicas} replicas each")


@dataclass(frozen=True)
class Failure:
    """One failure in our steps: `replicas` are absent for steps [start, end)."""

    start: int
    end: int
    replicas: tuple[int, ...]


@dataclass(frozen=True)
class ScaledSchedule:
    schedule: FailureSchedule
    rule: ScaleRule
    seed: int
    failures: tuple[Failure, ...]
    alive: np.ndarray = field(repr=False)  # (total_steps, num_replicas) bool: who is up at each step

    @property
    def windows(self) -> list[tuple[int, int]]:
        return [(f.start, f.end) for f in self.failures]


def scaled_length(sched: FailureSchedule, rule: ScaleRule) -> int:
    lo, hi = rule.phase
    period = (hi - lo) / rule.periods
    slot = period / sched.failures
    # At most one step short of the slot: consecutive windows (centred in adjacent slots) then
    # leave a step between them where nobody new is down, so that a replica coming back always
    # has a healthy peer to catch up from (windows back to back could leave none: no_healthy_steps).
    room = int(math.floor(slot))
    return max(1, min(room - 1 if room >= 2 else room, int(round(sched.length * period / sched.period))))


def no_healthy_steps(alive: np.ndarray) -> list[int]:
    """The steps of a membership mask at which no replica is healthy (up at that step and the one
    before): whoever is up there is coming back and has nobody to catch up from."""
    healthy = alive.copy()
    healthy[1:] &= alive[:-1]
    return [int(t) for t in np.flatnonzero(~healthy.any(axis=1))]


def scale(sched: FailureSchedule | str, rule: ScaleRule, seed: int = 0) -> ScaledSchedule:
    """Applies the scaling rule (module docstring): failures in our steps and the membership mask."""
    if isinstance(sched, str):
        sched = parse(sched)
    rule.validate()
    if sched.concurrent >= rule.num_replicas:
        raise ScheduleError(
            f"{sched.name} kills {sched.concurrent} replicas at once but the run has only {rule.num_replicas}: "
            "at least one must survive; use more replicas or a smaller <C>reps"
        )
    lo, hi = rule.phase
    period = (hi - lo) / rule.periods
    slot = period / sched.failures
    length = scaled_length(sched, rule)
    rng = np.random.default_rng(np.random.PCG64([seed, 0x5CED]))
    alive = np.ones((rule.total_steps, rule.num_replicas), dtype=bool)
    failures = []
    for p in range(rule.periods):
        for j in range(sched.failures):
            slot_start = lo + p * period + j * slot
            start = int(math.floor(slot_start + (slot - length) / 2))
            end = start + length
            victims = tuple(sorted(int(r) for r in rng.choice(rule.num_replicas, sched.concurrent, replace=False)))
            alive[start:end, list(victims)] = False
            failures.append(Failure(start, end, victims))
    stranded = no_healthy_steps(alive)
    if stranded:  # a slot too short to leave a step between windows (one step long)
        raise ScheduleError(f"{sched.name} scaled to {rule.total_steps} steps leaves no healthy replica at step "
                            f"{stranded[0]} (failure windows back to back): use more steps or fewer failures")
    return ScaledSchedule(sched, rule, seed, tuple(failures), alive)


def mask_from_outages(total_steps: int, num_replicas: int, outages) -> np.ndarray:
    """A membership mask from explicit outages `(replica, first_absent_step, first_back_step)`.

    For cross-checks against a multi-process run with scripted kills: the
    replica is absent for steps [first_absent_step, first_back_step) and is
    behind (catching up) at first_back_step.
    """
    alive = no_failures(total_steps, num_replicas)
    for replica, lo, hi in outages:
        if not 0 <= replica < num_replicas:
            raise ScheduleError(f"outage of replica {replica}: the run has replicas 0..{num_replicas - 1}")
        if not 0 < lo < hi:
            raise ScheduleError(f"outage of replica {replica} over steps [{lo}, {hi}): need 0 < start < end "
                                "(everyone starts from the same init at step 0)")
        alive[lo:hi, replica] = False
    dead = np.flatnonzero(~alive.any(axis=1))
    if dead.size:
        raise ScheduleError(f"no replica is up at step {int(dead[0])}: at least one must survive every step")
    stranded = no_healthy_steps(alive)
    if stranded:
        raise ScheduleError(f"no replica is healthy at step {stranded[0]} (up then and the step before): the ones "
                            "coming back have nobody to catch up from")
    return alive


def no_failures(total_steps: int, num_replicas: int) -> np.ndarray:
    """The baseline's mask: everyone up at every step."""
    return np.ones((total_steps, num_replicas), dtype=bool)


@dataclass(frozen=True)
class StudyConfig:
    """What an LR-intervention study sweeps (composed with a `Config` in configs/lr_study.py)."""

    schedules: tuple[str, ...] = ("d2x_fp32_for1k_1reps", "d2x_fp32_for1k_3reps", "d2x_fp32_for4k_3reps")
    interventions: tuple[str, ...] = ("none", "linear", "sqrt")
    seeds: tuple[int, ...] = (0, 1, 2)
    num_replicas: int = 0  # 0: the Config's launch.replicas
    start_frac: float = 0.4
    end_frac: float = 0.85
    periods: int = 1
    eval_every: int = 5  # held-out loss every this many steps (and at the end)
    smooth: int = 8  # trailing window (steps) of the smoothed training loss
    window_margin: int = 10  # steps after a failure that still count as its window
    honor_precision: bool = False  # True: run fp16/bf16/fp8 schedules at PRECISION_DTYPE

    def validate(self) -> "StudyConfig":
        if not self.schedules:
            raise ScheduleError("the study lists no schedules")
        for s in self.schedules:
            parse(s)
        for m in self.interventions:
            Intervention.parse(m)
        if not self.seeds:
            raise ScheduleError("the study lists no seeds")
        if self.num_replicas < 0:
            raise ScheduleError(f"num_replicas must be >= 0 (0: use launch.replicas), got {self.num_replicas}")
        if self.eval_every < 1 or self.smooth < 1 or self.window_margin < 0:
            raise ScheduleError("eval_every and smooth must be >= 1 and window_margin >= 0")
        return self

    def rule(self, total_steps: int, num_replicas: int) -> ScaleRule:
        n = self.num_replicas or num_replicas
        return ScaleRule(total_steps, n, self.start_frac, self.end_frac, self.periods).validate()
