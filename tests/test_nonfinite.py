"""Non-finite gradients end to end: real replica processes and a real lighthouse, a learning
rate so large that the first update sends the parameters past float32's range, so that every
later step's averaged gradients hold NaNs. With optim.nonfinite=skip each such step commits
with its update skipped, on both replicas alike, and optim.nonfinite_limit skips in a row end
the job with exit 78 and a message saying what to do (no restart into the same divergence)."""

import json
import subprocess
import sys

import pytest

from fthsdp.launch import report

from test_fault_tolerance import TINY

pytestmark = pytest.mark.multiprocess

LIMIT = 3


def test_a_diverged_run_skips_its_non_finite_updates_then_stops_with_what_to_do(tmp_path):
    args = [sys.executable, "-m", "fthsdp.cli", "run", "--config", "base", "--replicas", "2",
            "--devices-per-replica", "2", "--out-dir", str(tmp_path), "--no-progress", *TINY,
            "train.steps=20", "optim.lr=1e30", "optim.warmup_steps=0", "optim.decay=constant",
            f"optim.nonfinite_limit={LIMIT}"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 4, out[-3000:]  # job-fatal: not restarted, no fallback to a checkpoint
    assert "exited job-fatal (exit code 78)" in out, out[-3000:]
    run = report.load_run(tmp_path)
    assert run.done == {}
    for rid in ("0", "1"):
        recs = run.steps[rid]
        # step 0 trained (finite gradients, the update sent the parameters to ~1e30); steps 1..3
        # committed with the update skipped, each spending its own batch once
        assert [r["step"] for r in recs] == list(range(LIMIT + 1))
        assert [r["skipped"] for r in recs] == [False] + [True] * LIMIT
        assert [r["position"] for r in recs] == list(range(LIMIT + 1))
        assert all(r["attempts"] == 1 for r in recs)
        assert "hold a NaN or an infinity: the update was skipped" in recs[1]["events"][-1]
        status = json.loads((tmp_path / f"status-{rid}.json").read_text())
        assert status["exit_code"] == 78 and status["state"] == "failed (job-fatal)"
        assert f"steps 1..{LIMIT}: the averaged gradients held a NaN or an infinity {LIMIT} times in a row" \
            in status["fault"], status["fault"]
    # the replicas skipped alike: the same state after every step (that a skip keeps the parameters
    # and the optimizer state bit for bit is tests/test_step.py's)
    for step in range(LIMIT + 1):
        assert run.steps["0"][step]["fingerprint"] == run.steps["1"][step]["fingerprint"], step
    assert "lower optim.lr" in (tmp_path / "replica-0.out").read_text()


def test_fthsdp_train_stops_a_diverged_run_the_same_way(tmp_path):
    """The one-replica trainer (`fthsdp train`) counted skipped updates as commits and trained on
    to the end; it stops at optim.nonfinite_limit skips in a row, exit 78, saying what to do."""
    args = [sys.executable, "-m", "fthsdp.cli", "train", "--config", "base", "--no-progress", *TINY,
            "launch.devices_per_replica=2", "train.steps=20", f"train.out_dir={tmp_path}", "optim.lr=1e30",
            "optim.warmup_steps=0", "optim.decay=constant", f"optim.nonfinite_limit={LIMIT}"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert p.returncode == 78, (p.stdout + p.stderr)[-3000:]
    assert f"fthsdp train: steps 1..{LIMIT}: the averaged gradients held a NaN or an infinity {LIMIT} times" \
        in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert p.stderr.count("the update was skipped") == LIMIT
