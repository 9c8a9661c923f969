"""experiments/ftar_gpu.py --quick runs on any host: on one without a GPU it
measures the CPU FTAR and loopback rows, records the GPU systems under
`skipped` with the reason, and still writes the JSON and the plot."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16",
        "data.seq_len=16", "data.batch_size=8", "data.corpus_bytes=65536"]

pytestmark = pytest.mark.multiprocess


def test_quick_run_writes_rows_targets_and_plot(tmp_path):
    out = tmp_path / "ftar_gpu.json"
    r = subprocess.run([sys.executable, str(REPO / "experiments" / "ftar_gpu.py"), "--quick", "--out", str(out),
                        "--iters", "2", "--warmup", "1", "--step-iters", "3", "--step-platform", "cpu",
                        "--step-overrides", *TINY], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file()
    systems = {row["system"] for row in res["rows"]}
    assert "ftar_cpu" in systems
    for row in res["rows"]:
        assert row["busbw_gbps"] > 0 and row["n"] == 2 and row["bytes"] == 64 << 20
    assert res["loopback_gbps"]["2"] > 0
    # every GPU system either measured or skipped with a reason
    for system in ("ftar_gpu", "gloo_cuda"):
        assert system in systems or res["skipped"].get(system), system
    assert {s["mode"] for s in res["step"]} == {"local", "ftar"}
    assert all(s["median_s"] > 0 for s in res["step"])
    assert "step_ftar_vs_identity" in res["targets"]
    # the table is printed, and again from the JSON
    assert "ftar_cpu" in r.stdout and "targets:" in r.stdout
    t = subprocess.run([sys.executable, str(REPO / "experiments" / "ftar_gpu.py"), "--table", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert t.returncode == 0 and "step_ftar_vs_identity" in t.stdout and "loopback" in t.stdout, t.stderr
