"""The `fthsdp` console script, as a user runs it."""

import json
import subprocess
import sys


def run(*args, cwd=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "fthsdp.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def test_train_lowers_the_loss_and_writes_artifacts(tmp_path):
    out = tmp_path / "run"
    r = run("train", "--config", "configs/base.py", "train.steps=60", "train.eval_every=30",
            f"train.out_dir={out}", "launch.devices_per_replica=2")
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["loader_position"] == 60
    assert summary["last_loss"] < summary["first_loss"] - 2.0
    assert (out / "loss.png").stat().st_size > 5000
    assert "held-out loss" in r.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 6


def test_bad_override_fails_with_a_clear_message():
    r = run("train", "optim.lr=fast")
    assert r.returncode == 2
    assert "optim.lr: expected float, got 'fast'" in r.stderr


def test_unknown_command_and_help():
    r = run("frobnicate")
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr
    r = run("--help")
    assert r.returncode == 0 and "train" in r.stdout
