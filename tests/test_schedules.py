"""Failure schedules: the paper's grammar, clear errors, and the stated scaling rule."""

import numpy as np
import pytest

from fthsdp.sim import schedules
from fthsdp.sim.schedules import FailureSchedule, ScaleRule, ScheduleError, parse, scale


def test_parses_the_papers_example_and_round_trips():
    s = parse("d2x_fp8_for4k_1reps_lr_none")
    assert s == FailureSchedule(failures=2, precision="fp8", length=4000, concurrent=1, intervention="none")
    assert s.period == 11_000  # the paper: n = 11k for 4k-step failures
    assert s.name == "d2x_fp8_for4k_1reps_lr_none"
    assert parse(s.name) == s
    t = parse("D2X_FP16_for1.5k_3reps_lr_SQRT")
    assert (t.length, t.concurrent, t.intervention, t.period) == (1500, 3, "sqrt", 5_000)
    assert parse(t.name) == t
    assert parse("d1x_fp32_for250_2reps").intervention is None
    assert parse("d1x_fp32_for250_2reps_lr_x").intervention is None
    assert parse("d2x_fp16_for4k_3reps_lr_sqrt").base_name == "d2x_fp16_for4k_3reps"
    assert parse("d2x_fp16_for4k_3reps").with_intervention("linear").name == "d2x_fp16_for4k_3reps_lr_linear"
    assert s.dtype == "bfloat16" and t.dtype == "float16"


@pytest.mark.parametrize("text,needle", [
    ("", "non-empty"),
    ("d2x_fp16_for4k", "has 3 '_'-separated parts"),
    ("2x_fp16_for4k_3reps", "d<F>x"),
    ("d0x_fp16_for4k_3reps", "d<F>x"),
    ("d2x_fp4_for4k_3reps", "precision must be one of fp32, bf16, fp16, fp8"),
    ("d2x_fp16_4k_3reps", "for<L>"),
    ("d2x_fp16_for0.5_3reps", "whole number of steps"),
    ("d2x_fp16_for4k_threereps", "<C>reps"),
    ("d2x_fp16_for4k_0reps", "<C>reps"),
    ("d2x_fp16_for4k_3reps_rate_sqrt", "fifth part must be 'lr'"),
    ("d2x_fp16_for4k_3reps_lr_cubic", "none, linear, sqrt or x"),
    ("d3x_fp16_for4k_1reps", "do not fit in the paper's period of 11000"),
])
def test_malformed_schedules_say_what_is_wrong(text, needle):
    with pytest.raises(ScheduleError, match=".*") as e:
        parse(text)
    assert needle in str(e.value)
    if text:
        assert "d2x_fp16_for4k_3reps_lr_sqrt" in str(e.value) or "overlap" in str(e.value)


def test_scaling_rule_places_failures_inside_the_phase_without_overlap():
    rule = ScaleRule(total_steps=200, num_replicas=4, start_frac=0.4, end_frac=0.85, periods=1)
    sc = scale("d2x_fp32_for4k_3reps", rule, seed=0)
    lo, hi = rule.phase
    assert (lo, hi) == (80, 170)
    # 4k of 11k steps of a 90-step period -> round(32.7) = 33 steps
    assert [f.end - f.start for f in sc.failures] == [33, 33]
    assert all(lo <= f.start < f.end <= hi for f in sc.failures)
    assert sc.failures[0].end <= sc.failures[1].start
    for f in sc.failures:
        assert len(f.replicas) == 3 and len(set(f.replicas)) == 3
        assert not sc.alive[f.start:f.end, list(f.replicas)].any()
        others = [r for r in range(4) if r not in f.replicas]
        assert sc.alive[f.start:f.end, others].all()
    down = ~sc.alive
    assert down.sum() == 2 * 33 * 3
    assert sc.alive[:lo].all() and sc.alive[hi:].all()
    assert "x8.18e-03" in rule.describe(sc.schedule)


def test_scaling_is_a_pure_function_of_schedule_rule_and_seed():
    rule = ScaleRule(300, 6, periods=2)
    a = scale("d2x_fp16_for1k_2reps", rule, seed=3)
    b = scale(parse("d2x_fp16_for1k_2reps"), rule, seed=3)
    c = scale("d2x_fp16_for1k_2reps", rule, seed=4)
    assert np.array_equal(a.alive, b.alive) and a.failures == b.failures
    assert len(a.failures) == 4  # 2 per period x 2 periods
    assert [f.start for f in a.failures] == [f.start for f in c.failures]  # timing from the rule
    assert any(f.replicas != g.replicas for f, g in zip(a.failures, c.failures))  # victims from the seed


def test_short_failures_keep_at_least_one_step():
    sc = scale("d1x_fp32_for1_1reps", ScaleRule(100, 2), seed=0)
    assert [f.end - f.start for f in sc.failures] == [1]


def test_schedule_that_would_kill_everyone_or_bad_rule_is_refused():
    with pytest.raises(ScheduleError, match="kills 3 replicas at once but the run has only 3"):
        scale("d2x_fp16_for4k_3reps", ScaleRule(200, 3))
    with pytest.raises(ScheduleError, match="at least 2 replicas"):
        scale("d2x_fp16_for4k_1reps", ScaleRule(200, 1))
    with pytest.raises(ScheduleError, match="start_frac < end_frac"):
        scale("d2x_fp16_for4k_1reps", ScaleRule(200, 4, start_frac=0.9, end_frac=0.5))
    with pytest.raises(ScheduleError, match="too short"):
        scale("d2x_fp16_for4k_1reps", ScaleRule(4, 4, periods=3))


def test_study_config_validates_its_lists():
    schedules.StudyConfig().validate()
    with pytest.raises(ScheduleError, match="precision"):
        schedules.StudyConfig(schedules=("d2x_fp9_for1k_1reps",)).validate()
    with pytest.raises(ValueError, match="unknown LR intervention"):
        schedules.StudyConfig(interventions=("cubic",)).validate()


def test_precision_runs_at_a_dtype_this_platform_has():
    assert parse("d1x_fp32_for1k_1reps").activation_dtype("cpu") == "float32"
    assert parse("d1x_bf16_for1k_1reps").activation_dtype("cpu") == "bfloat16"
    assert parse("d1x_fp16_for1k_1reps").activation_dtype("cpu") == "bfloat16"  # no f16 dot on XLA:CPU
    assert parse("d1x_fp16_for1k_1reps").activation_dtype("gpu") == "float16"
    assert parse("d1x_fp8_for1k_1reps").activation_dtype("gpu") == "bfloat16"


def test_mask_from_scripted_outages():
    alive = schedules.mask_from_outages(10, 3, [(1, 2, 5), (2, 4, 6)])
    assert alive.shape == (10, 3)
    assert alive[:, 1].tolist() == [True, True, False, False, False, True, True, True, True, True]
    assert (~alive).sum() == 3 + 2
    with pytest.raises(ScheduleError, match="replicas 0..2"):
        schedules.mask_from_outages(10, 3, [(3, 2, 5)])
    with pytest.raises(ScheduleError, match="need 0 < start < end"):
        schedules.mask_from_outages(10, 3, [(0, 0, 5)])
    with pytest.raises(ScheduleError, match="no replica is up at step 3"):
        schedules.mask_from_outages(10, 2, [(0, 3, 5), (1, 2, 4)])
