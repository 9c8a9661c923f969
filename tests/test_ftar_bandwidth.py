"""The bandwidth study's --quick form: it runs, writes the documented JSON and
a plot, and records a peer that is not installed as skipped instead of crashing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess


def test_quick_benchmark_writes_rows_and_skips_missing_peers(tmp_path, repo_root=None):
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "bw.json"
    r = subprocess.run(
        [sys.executable, str(root / "experiments" / "ftar_bandwidth.py"), "--quick", "--out", str(out),
         "--procs", "2", "--sizes-mib", "8", "--iters", "2", "--warmup", "1", "--loopback-runs", "1",
         "--systems", "ftar_1stream,ftar_1stream_auth,gloo", "--paired-auth", "4", "--paired-restarts", "1", "--paired-block", "2", "--peer-python", str(tmp_path / "no-such-python")],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["loopback_gbps"] > 0
    rows = res["rows"]
    assert [(x["system"], x["n"], x["bytes"]) for x in rows] == [("ftar_1stream", 2, 8 << 20),
                                                                   ("ftar_1stream_auth", 2, 8 << 20)]
    for row in rows:
        for key in ("algbw_gbps", "busbw_gbps", "busbw_gbps_best"):
            assert row[key] > 0
        assert row["busbw_gbps_best"] >= row["busbw_gbps"]
    (cost,) = res["auth_cost"].values()  # authenticated beside unauthenticated, same run
    assert cost["ratio"] == pytest.approx(rows[1]["busbw_gbps"] / rows[0]["busbw_gbps"])
    assert res["chunk_tag_s"] > 0 and cost["mac_bound_fraction"] > 0
    paired = res["auth_paired"]["MiB=8"]  # the same comparison side by side in one process, in blocks
    assert paired["ops_per_arm"] == 4 and paired["blocks_per_arm"] == 2
    assert [len(paired["times_s"][k]) for k in ("plain", "auth", "plain_b")] == [2, 2, 2]
    assert paired["auth_bw_ratio"]["n"] == paired["aa_control_bw_ratio"]["n"] == 2
    assert paired["auth_bw_ratio"]["median"] > 0 and 0 < paired["mac_bound_fraction"] < 1
    # 8 MiB in 1 MiB chunks between two ranks: each sends 8 and receives 8, all tagged and checked
    assert paired["mac_in_situ"]["macs_per_op"] == 32 and 0 < paired["mac_in_situ"]["fraction_of_op"] < 1
    assert [s["system"] for s in res["skipped"]] == ["gloo"] and "not found" in res["skipped"][0]["reason"]
    assert out.with_suffix(".png").stat().st_size > 1000
