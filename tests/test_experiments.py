"""The quick forms of the fault-tolerance studies run end to end and write
complete JSON (CI runs these; the full studies are run by hand)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess


def run(script, *args, timeout=400):
    r = subprocess.run([sys.executable, f"experiments/{script}", *args], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def test_failure_stall_quick(tmp_path):
    out = tmp_path / "fs.json"
    run("failure_stall.py", "--quick", "--out", str(out))
    res = json.loads(out.read_text())
    for key in ("detection_s", "rebuild_s", "allreduce_s", "median_step_s", "stall_s"):
        assert isinstance(res[key], float) and res[key] >= (-1 if key == "stall_s" else 0), key
    # a one-process shape and a two-process shape (issue 11), side by side
    assert len(res["runs"]) == 2 and all(r["identical_final_state"] for r in res["runs"])
    assert set(res["shapes"]) == {"3x2 P1", "3x1 P2"}
    assert 0 < res["detection_s"] < 3.0 and 0 < res["shapes"]["3x1 P2"]["detection_s"] < 3.0
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_recovery_rejoin_quick(tmp_path):
    out = tmp_path / "rec.json"
    run("recovery.py", "--quick", "--skip-transfer", "--out", str(out))
    res = json.loads(out.read_text())
    assert isinstance(res["rejoin_stall_fraction"], float)
    assert 0 < res["restart_to_commit_s"] < 120
    (r,) = res["rejoin_runs"]
    assert r["identical_final_state"] and r["catch_up_fetch_s"] > 0
