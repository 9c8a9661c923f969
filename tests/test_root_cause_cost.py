"""The quick form of experiments/root_cause_cost.py runs end to end and writes
complete JSON: heartbeat size and latency with phase reports off and on (a real
lighthouse process), and the analysis over plain data up to 1,024 replicas,
whose verdicts name the right culprit."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess


def test_root_cause_cost_quick(tmp_path):
    out = tmp_path / "rca.json"
    r = subprocess.run([sys.executable, "experiments/root_cause_cost.py", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    size = res["heartbeat_size"]
    assert 0 < size["off_bytes"] < size["on_bytes"] < 400
    lat = res["heartbeat_latency"]
    assert lat["on"]["n"] == lat["off"]["n"] > 0 and lat["median_ratio_on_off"] > 0
    assert set(res["analysis"]) == {"64", "256", "1024"}
    for n, row in res["analysis"].items():
        assert row["healthy"]["kind"] == "none" and row["quorum_round"]["kind"] == "none"
        assert (row["frozen_chain"]["kind"], row["frozen_chain"]["culprit"]) == ("frozen", str(int(n) // 2))
    assert out.with_suffix(".png").stat().st_size > 10_000
