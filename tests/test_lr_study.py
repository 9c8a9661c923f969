"""The LR-intervention experiment: its metrics, and its quick mode end to end (a real CLI run)."""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "lr_intervention.py"

spec = importlib.util.spec_from_file_location("lr_intervention", SCRIPT)
lri = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lri)

TINY = [
    "model.d_model=16", "model.num_heads=2", "model.max_seq_len=16", "data.seq_len=16", "data.batch_size=4",
    "data.eval_batches=1", "data.corpus_bytes=65536", "launch.replicas=3", "train.steps=50", "optim.warmup_steps=5",
    "study.seeds=0,1", "study.schedules=d2x_fp32_for1k_1reps,d1x_bf16_for4k_2reps",
    "study.eval_every=5", "study.window_margin=3", "study.smooth=4",
]


def test_metric_helpers_on_known_curves():
    np.testing.assert_allclose(lri.smooth([1, 3, 5, 7], 2), [1, 2, 4, 6])
    # steps are 1-based counts: a failure over steps [2, 4) affects the states after steps 3 and 4
    assert lri.in_windows(np.arange(1, 9), [(2, 4)], margin=2).tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    dev = lri.deviation([1, 2, 3], [1.0, 2.5, 3.0], [0, 4], [0.0, 4.0])
    np.testing.assert_allclose(dev, [0.0, 0.5, 0.0])
    mx, rms = lri.fluctuation(np.array([0.3, -0.4, 5.0]), np.array([True, True, False]))
    assert mx == pytest.approx(0.4) and rms == pytest.approx(math.sqrt((0.09 + 0.16) / 2))
    assert lri.fluctuation(np.array([1.0]), np.array([False])) == (0.0, 0.0)
    # jitter: only consecutive steps inside the windows count (3 -> 5 is a gap)
    assert lri.jitter([1, 2, 3, 5], [0.0, 1.0, 1.0, 3.0], [True] * 4) == pytest.approx(math.sqrt(0.5))
    assert lri.jitter([1, 2], [0.0, 1.0], [True, False]) == 0.0


def test_summary_and_conclusion_follow_the_numbers():
    def run(s, m, seed, rms):
        return {"schedule": s, "intervention": m, "seed": seed,
                "metrics": {k: (rms if k == "rms_dev" else 0.01) for k in lri.METRICS}}

    runs = [run("a", "none", 0, 0.30), run("a", "none", 1, 0.32), run("a", "sqrt", 0, 0.10), run("a", "sqrt", 1, 0.12),
            run("a", "linear", 0, 0.05), run("a", "linear", 1, 0.07)]
    rows = lri.summarize(runs)
    by = {(r["schedule"], r["intervention"]): r for r in rows}
    assert by[("a", "none")]["rms_dev"] == pytest.approx(0.31)
    assert by[("a", "none")]["rms_dev_std"] == pytest.approx(np.std([0.30, 0.32], ddof=1))
    c = lri.conclude(rows, baseline_spread=0.02)
    assert c["sqrt_flatter_than_none"] == 1 and c["sqrt_flatter_than_linear"] == 0
    assert c["per_schedule"]["a"]["flattest"] == "linear" and not c["agrees_with_paper"]
    assert "DISAGREES" in c["text"]


def test_bad_study_override_is_explained():
    with pytest.raises(ValueError, match="no field 'sedes' in StudyConfig"):
        lri.load_study("lr_study_quick", ["study.sedes=1"])
    with pytest.raises(ValueError, match="precision must be one of"):
        lri.load_study("lr_study_quick", ["study.schedules=d2x_fp9_for1k_1reps"])


def test_quick_mode_end_to_end_writes_a_complete_json(tmp_path):
    out = tmp_path / "lr.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), *TINY],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["quick"] is True and res["num_replicas"] == 3
    summary = res["summary"]
    assert {(r["schedule"], r["intervention"]) for r in summary} == {("baseline", "none")} | {
        (s, m) for s in ("d2x_fp32_for1k_1reps", "d1x_bf16_for4k_2reps") for m in ("none", "linear", "sqrt")}
    for row in summary:
        for k in ("max_dev", "rms_dev", "jitter", "final_gap"):
            assert math.isfinite(row[k]) and math.isfinite(row[f"{k}_std"]), (row, k)
        assert row["runs"] == (4 if row["schedule"] == "baseline" else 2)  # baseline: 2 dtypes x 2 seeds
    base = next(r for r in summary if r["schedule"] == "baseline")
    # the baseline against itself
    assert base["max_dev"] == base["rms_dev"] == base["jitter"] == base["final_gap"] == 0.0
    failing = [r for r in summary if r["schedule"] != "baseline"]
    assert all(r["max_dev"] > 0 for r in failing)  # failures do move the curves
    # every run trained exactly the baseline's data: 50 steps x 3 replicas batches (plus < 3 overshoot)
    for run in res["runs"]:
        assert 150 <= run["batches"][-1] < 153 and run["extra_steps"] >= 1
        assert all(math.isfinite(x) for x in run["train_loss"]) and all(math.isfinite(e[2]) for e in run["evals"])
        assert min(run["num_contributing"]) == 3 - int(run["schedule"].split("_")[3][0])
    # each precision is compared with a baseline of its own dtype (bf16 runs as bfloat16 here)
    assert sorted((b["dtype"], b["seed"]) for b in res["baselines"]) == [
        ("bfloat16", 0), ("bfloat16", 1), ("float32", 0), ("float32", 1)]
    assert {(r["precision"], r["dtype"]) for r in res["runs"]} == {("fp32", "float32"), ("bf16", "bfloat16")}
    assert "sqrt had a lower RMS deviation" in res["conclusion"]["text"]
    assert "sqrt had a lower RMS deviation" in proc.stdout
    for p in res["plots"]:
        assert pathlib.Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {pathlib.Path(p).name for p in res["plots"]} == {"lr_full.png", "lr_zoom.png"}


@pytest.mark.slow  # the real quick study (~2 min): FTHSDP_RUN_SLOW=1 (tests/conftest.py)
def test_the_quick_study_itself(tmp_path):
    """Acceptance: the shipped quick study runs here and states its conclusion from its numbers."""
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert len(res["summary"]) == 1 + 3 * 3 and res["num_replicas"] == 8
    assert all(math.isfinite(r[k]) for r in res["summary"] for k in lri.METRICS)
    assert res["elapsed_s"] > 0
    assert ("Flattening: AGREES" in proc.stdout) or ("Flattening: DISAGREES" in proc.stdout)
