"""The effective-training-time model (fthsdp.sim.ett) and experiments/ett.py.

The model must reproduce the FT-HSDP paper's 44% (synchronous) and 80%
(FT-HSDP) at 100K GPUs from the paper's own inputs, its closed form must agree
with its simulation, its accounting must add up, and the experiment's figures
must follow from the JSON it reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import pytest

from fthsdp.sim import ett as E

REPO = pathlib.Path(__file__).resolve().parents[1]
G = E.PAPER_GPUS
F = E.PAPER_FAILURES
WEEKS8 = 8 * E.WEEK_S


# --- the paper's figures from the paper's inputs ----------------------------------------------------------

def test_paper_inputs_are_the_papers():
    assert F.interval_s(G) == pytest.approx(18 * 60)
    assert E.PAPER_SYNC.restart_s(G) == pytest.approx(600, abs=10)  # "up to 10 minutes"
    assert E.PAPER_SYNC.comm_init_at(16_384) == pytest.approx(17.0)  # NCCL init 17 s at 16K ...
    assert E.PAPER_SYNC.comm_init_at(98_304) == pytest.approx(200.0)  # ... ~200 s at 98K
    p = E.paper_ft_hsdp()
    assert (p.replicas, p.repair_s, p.retry_s) == (12, 600.0, E.PAPER_STEP_S)
    assert p.stall_s == pytest.approx(180, abs=10)  # "a total stall of about three minutes"


def test_sync_reproduces_44_percent():
    assert E.sync_closed_form(G, F, E.PAPER_SYNC) == pytest.approx(E.PAPER_SYNC_ETT, abs=0.02)
    sim = E.simulate_sync(G, F, E.PAPER_SYNC, horizon_s=26 * E.WEEK_S, seed=0)
    assert sim.ett == pytest.approx(E.PAPER_SYNC_ETT, abs=0.025)
    assert sim.failures > 10_000  # half a year of a failure every 18 minutes


def test_ft_hsdp_reproduces_80_percent():
    p = E.paper_ft_hsdp()
    assert E.paper_arithmetic(G, F, p) == pytest.approx(E.PAPER_FT_HSDP_ETT, abs=0.01)
    assert E.replica_closed_form(G, F, p) == pytest.approx(E.PAPER_FT_HSDP_ETT, abs=0.025)
    sim = E.simulate_replicas(G, F, p, horizon_s=26 * E.WEEK_S, seed=0)
    assert sim.ett == pytest.approx(E.PAPER_FT_HSDP_ETT, abs=0.03)


def test_paper_arithmetic_by_hand():
    # (8 + 7 * 11/12) / 18 with a 3 min stall and a 10 min repair in 12 replicas
    p = dataclasses.replace(E.paper_ft_hsdp(), detection_s=60.0, ring_rebuild_s=0.0, retry_s=20.0,
                            first_step_s=100.0)
    assert p.stall_s == 180.0
    assert E.paper_arithmetic(G, F, p) == pytest.approx((8 + 7 * 11 / 12) / 18)


def test_optimistic_sync_overlap_is_exp():
    s = dataclasses.replace(E.PAPER_SYNC, overlap="restart")
    lam_r = F.rate(G) * s.restart_s(G)
    assert E.sync_closed_form(G, F, s) == pytest.approx(math.exp(-lam_r))
    assert E.simulate_sync(G, F, s, horizon_s=WEEKS8, seed=3).ett == pytest.approx(math.exp(-lam_r), abs=0.02)
    assert E.sync_closed_form(G, F, s) > E.sync_closed_form(G, F, E.PAPER_SYNC) + 0.1


# --- properties -------------------------------------------------------------------------------------------

SYSTEMS = {
    "sync": E.PAPER_SYNC,
    "sync_restart": dataclasses.replace(E.PAPER_SYNC, overlap="restart"),
    "sync_ckpt": dataclasses.replace(E.PAPER_SYNC, checkpoint_interval_s=900.0),
    "paper": E.paper_ft_hsdp(),
    "fthsdp": E.fthsdp_at_scale(E.MeasuredStalls(), E.ScaleParams()),
}


@pytest.mark.parametrize("name", sorted(SYSTEMS))
@pytest.mark.parametrize("gpus", [8_192, 32_768, 100_000])
def test_closed_form_agrees_with_simulation(name, gpus):
    rec = SYSTEMS[name]
    sim = E.simulate(gpus, F, rec, horizon_s=WEEKS8, seed=1)
    assert sim.ett == pytest.approx(E.closed_form(gpus, F, rec), abs=0.02), sim.events


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_monotone_in_failure_rate(name):
    rec = SYSTEMS[name]
    mtbfs = [F.gpu_mtbf_s * f for f in (0.5, 1, 2, 4, 16)]
    closed = [E.closed_form(G, E.FailureModel(m), rec) for m in mtbfs]
    assert all(a < b for a, b in zip(closed, closed[1:])), closed
    # one seed couples the schedules (the same unit-rate arrivals, scaled): more failures, less ETT
    sims = [E.simulate(G, E.FailureModel(m), rec, horizon_s=2 * E.WEEK_S, seed=5).ett for m in mtbfs[::2]]
    assert all(a < b for a, b in zip(sims, sims[1:])), sims


def test_monotone_in_each_stall_component():
    base = E.paper_ft_hsdp()
    ref = E.replica_closed_form(G, F, base)
    for name in ("detection_s", "ring_rebuild_s", "retry_s", "other_fail_s", "first_step_s"):
        worse = dataclasses.replace(base, **{name: getattr(base, name) + 30.0})
        assert E.replica_closed_form(G, F, worse) < ref, name
    assert E.replica_closed_form(G, F, dataclasses.replace(base, repair_s=900.0)) < ref
    assert E.replica_closed_form(G, F, dataclasses.replace(base, replicas=24)) > ref
    sync_ref = E.sync_closed_form(G, F, E.PAPER_SYNC)
    for name in ("detection_s", "allocation_s", "loading_s", "first_step_s"):
        worse = dataclasses.replace(E.PAPER_SYNC, **{name: getattr(E.PAPER_SYNC, name) + 30.0})
        assert E.sync_closed_form(G, F, worse) < sync_ref, name
    assert E.sync_closed_form(G, F, dataclasses.replace(E.PAPER_SYNC, checkpoint_interval_s=600.0)) < sync_ref


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_simulation_accounting_adds_up(name):
    sim = E.simulate(G, F, SYSTEMS[name], horizon_s=WEEKS8, seed=2)
    assert sim.accounting_error_s() < 1e-6 * sim.horizon_s
    assert all(v >= 0 for v in sim.lost_s.values())
    assert sim.ett == pytest.approx(sim.effective_s / sim.horizon_s)
    assert sum(sim.events.values()) == sim.failures  # every failure handled exactly one way
    if name.startswith("sync"):
        assert sim.lost_s["fail"] == sim.lost_s["rejoin"] == sim.lost_s["reduced"] == 0
        assert sim.events["during_restart"] > 0  # overlaps really happen at 100K
    else:
        assert sim.lost_s["fail"] > 0 and sim.lost_s["reduced"] > 0


def test_sweep_by_hand():
    # 4 replicas over 200 s: replica out for [0, 100), everybody stalled [0, 10) and [95, 100)
    eff, lost = E._sweep(200.0, 4, [(0.0, 100.0)], [(0.0, 10.0, "fail"), (95.0, 100.0, "rejoin")])
    assert lost["fail"] == 10.0 and lost["rejoin"] == 5.0
    assert lost["reduced"] == pytest.approx(85.0 / 4)
    assert eff == pytest.approx(85.0 * 3 / 4 + 100.0)
    # overlapping stalls are charged once, to the first kind in priority order
    eff, lost = E._sweep(100.0, 2, [], [(0.0, 20.0, "rejoin"), (10.0, 30.0, "restart")])
    assert (lost["restart"], lost["rejoin"], eff) == (20.0, 10.0, 70.0)


def test_overlapping_failures_in_a_small_job():
    # 2 replicas, failures every ~5 min, a 10 min repair: replicas fail while under repair, both go down
    # (a synchronous restart of everything), failures hit the restart; the accounting still adds up.
    rec = dataclasses.replace(E.paper_ft_hsdp(), replicas=2,
                              fallback=dataclasses.replace(E.PAPER_SYNC, checkpoint_interval_s=1800.0))
    f = E.FailureModel.from_job_interval(G, 300.0)
    sim = E.simulate_replicas(G, f, rec, horizon_s=E.WEEK_S, seed=4)
    for kind in ("total_outage", "replica_under_repair", "during_total_restart"):
        assert sim.events.get(kind, 0) > 0, sim.events
    assert sim.lost_s["restart"] > 0 and sim.lost_s["lost_work"] > 0
    assert sim.accounting_error_s() < 1e-6 * sim.horizon_s
    assert sim.ett < E.replica_closed_form(G, f, rec)  # total outages cost more than the closed form counts


def test_no_failures_no_loss():
    sim = E.simulate(1, E.FailureModel(1e15), E.paper_ft_hsdp(), horizon_s=E.WEEK_S, seed=0)
    assert sim.failures == 0 and sim.ett == 1.0


def test_lost_work_per_failure():
    assert E.lost_work_per_failure(1e-9, 600.0) == pytest.approx(300.0, rel=1e-3)  # rare failures: C/2
    assert E.lost_work_per_failure(1e-3, 1e7) == pytest.approx(1e3)  # no checkpoints: everything since the resume
    assert E.lost_work_per_failure(1e-3, 0.0) == 0.0
    import numpy as np
    t = np.random.default_rng(0).exponential(1000.0, 200_000)
    assert E.lost_work_per_failure(1e-3, 900.0) == pytest.approx(float(np.mean(t % 900.0)), rel=0.01)


def test_bad_inputs_are_refused_with_a_reason():
    with pytest.raises(E.ETTError, match="repair_s"):
        E.replica_closed_form(G, F, dataclasses.replace(E.paper_ft_hsdp(), repair_s=60.0))
    with pytest.raises(E.ETTError, match="replicas"):
        E.replica_closed_form(G, F, dataclasses.replace(E.paper_ft_hsdp(), replicas=1))
    with pytest.raises(E.ETTError, match="overlap"):
        E.sync_closed_form(G, F, dataclasses.replace(E.PAPER_SYNC, overlap="sometimes"))
    with pytest.raises(E.ETTError, match="detection_s"):
        E.sync_closed_form(G, F, dataclasses.replace(E.PAPER_SYNC, detection_s=-1.0))
    with pytest.raises(E.ETTError, match="gpu_mtbf_s"):
        E.FailureModel(0.0)
    with pytest.raises(E.ETTError, match="horizon"):
        E.simulate(G, F, E.PAPER_SYNC, horizon_s=0.0)


def test_fthsdp_at_scale_follows_its_inputs():
    m, s = E.MeasuredStalls(), E.ScaleParams()
    rec = E.fthsdp_at_scale(m, s, step_s=20.0, replicas=12)
    assert rec.detection_s == m.detection_s
    assert rec.ring_rebuild_s == pytest.approx(m.ring_rebuild_s + s.quorum_latency_s)
    assert rec.retry_s == pytest.approx(s.retry_s(12)) and rec.retry_s > m.allreduce_s
    assert rec.other_fail_s == pytest.approx(m.survivors_stall_s - 0.50 - 0.0008 - 0.0096)
    assert s.fetch_s() < 20.0 and rec.rejoin_s == pytest.approx(m.rejoin_stall_fraction * 20.0)
    assert rec.repair_s == pytest.approx(m.detection_s + s.allocation_s + s.process_start_s + s.compile_s
                                         + s.fetch_s() + 20.0)
    # a fetch slower than the catch-up step makes the survivors wait for the rest
    slow = dataclasses.replace(s, fetch_bytes_per_s_per_host=1e9)
    assert E.fthsdp_at_scale(m, slow).rejoin_s == pytest.approx(m.rejoin_stall_fraction * 20.0
                                                                + slow.fetch_s() - 20.0)
    # a measured restart slower than the model's is kept
    big = dataclasses.replace(m, restart_to_commit_s=5000.0)
    assert E.fthsdp_at_scale(big, s).repair_s == pytest.approx(big.detection_s + 5000.0)


def test_fthsdp_meets_93_percent_at_100k():
    rec = E.fthsdp_at_scale(E.MeasuredStalls(), E.ScaleParams())
    assert E.replica_closed_form(G, F, rec) >= 0.93
    shares = E.lost_shares(G, F, rec)
    assert max(shares, key=shares.get) == "replica_out"  # the repair in the background, not a stall
    assert 1 - E.replica_closed_form(G, F, rec) == pytest.approx(sum(shares.values()), abs=0.002)


# --- experiments/ett.py ----------------------------------------------------------------------------------

def run_ett(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "experiments" / "ett.py"), "--quick", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


def write_inputs(tmp_path, detection_s=0.3, restart_to_commit_s=2.0):
    fs = tmp_path / "fs.json"
    rc = tmp_path / "rc.json"
    # the schemas experiments/failure_stall.py and experiments/recovery.py write (top-level medians)
    fs.write_text(json.dumps({"detection_s": detection_s, "rebuild_s": 0.002, "allreduce_s": 0.02,
                              "median_step_s": 0.05, "stall_s": detection_s + 0.1, "runs": [],
                              "targets": {}, "targets_met": {}}))
    rc.write_text(json.dumps({"rejoin_stall_fraction": 0.05, "restart_to_commit_s": restart_to_commit_s,
                              "fetch_gbps": 1.0, "rejoin_runs": [], "targets": {}, "targets_met": {}}))
    return fs, rc


def test_experiment_figures_follow_from_inputs(tmp_path):
    fs, rc = write_inputs(tmp_path)
    out = tmp_path / "out" / "ett.json"
    p = run_ett(tmp_path, "--failure-stall", str(fs), "--recovery", str(rc), "--out", str(out))
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert pathlib.Path(d["plot"]).exists() and d["plot"].endswith(".png")
    rows = d["projection"]
    assert len(rows) >= 4 and all(set(r) == {"gpus", "sync", "paper", "fthsdp"} for r in rows)
    assert [r["gpus"] for r in rows] == sorted(r["gpus"] for r in rows) and rows[0]["gpus"] <= 1024
    assert any(r["gpus"] == 100_000 for r in rows) and rows[-1]["gpus"] >= 200_000
    assert all(0 <= r[k] <= 1 for r in rows + d["projection_sim"] for k in ("sync", "paper", "fthsdp"))
    assert [r["gpus"] for r in d["projection_sim"]] == [r["gpus"] for r in rows]
    opt = d["projection_sync_optimistic"]
    assert [r["gpus"] for r in opt] == [r["gpus"] for r in rows]
    assert all(o["sync"] >= r["sync"] for o, r in zip(opt, rows))
    # every measured figure came from the files written above
    m = d["inputs"]["measured"]
    assert m["detection_s"] == {"value": 0.3, "source": f"{fs}:detection_s"}
    assert m["survivors_stall_s"]["value"] == pytest.approx(0.4)
    assert m["restart_to_commit_s"] == {"value": 2.0, "source": f"{rc}:restart_to_commit_s"}
    # ... and the projection follows from them through the model
    measured = E.MeasuredStalls(detection_s=0.3, ring_rebuild_s=0.002, allreduce_s=0.02, survivors_stall_s=0.4,
                                rejoin_stall_fraction=0.05, restart_to_commit_s=2.0)
    rec = E.fthsdp_at_scale(measured, E.ScaleParams(), step_s=20.0, replicas=12)
    at = {r["gpus"]: r for r in rows}
    for g in at:
        assert at[g]["fthsdp"] == pytest.approx(E.replica_closed_form(g, F, rec), rel=1e-9)
        assert at[g]["sync"] == pytest.approx(E.sync_closed_form(g, F, E.PAPER_SYNC), rel=1e-9)
    assert d["inputs"]["fthsdp_at_scale"]["rejoin_s"] == pytest.approx(0.05 * 20.0)
    assert d["reproduction"]["sync"]["within_3_points"] and d["reproduction"]["ft_hsdp"]["within_3_points"]
    t = d["target"]
    assert t["met"] == (min(t["fthsdp_closed_form"], t["fthsdp_simulation"]) >= 0.93)
    assert t["dominant"] in d["at_reference"]["fthsdp"]["lost_shares_first_order"]
    assert at[100_000]["sync"] < at[100_000]["paper"] < at[100_000]["fthsdp"]
    # every failure found only by heartbeat silence, paced at this size: 12,500 processes of 8 GPUs against
    # the default budget beat once a second (the cap), an 8 s window
    (paced,) = [s for s in d["sensitivity"] if s["name"] == "fthsdp, found by paced heartbeats alone"]
    slow = E.fthsdp_at_scale(dataclasses.replace(measured, detection_s=8.0), E.ScaleParams(), step_s=20.0, replicas=12)
    assert paced["detection_s"] == 8.0 and "12,500 processes" in paced["what"], paced
    assert paced["fthsdp"] == pytest.approx(E.replica_closed_form(G, F, slow), rel=1e-9)
    assert paced["fthsdp"] < t["fthsdp_closed_form"]

    # a 60 s detection (the paper's timeout) in the measured input lowers fthsdp by about rate x 59.7 s
    fs2, _ = write_inputs(tmp_path, detection_s=60.0)
    out2 = tmp_path / "out2.json"
    p = run_ett(tmp_path, "--failure-stall", str(fs2), "--recovery", str(rc), "--out", str(out2))
    assert p.returncode == 0, p.stderr
    d2 = json.loads(out2.read_text())
    drop = d["target"]["fthsdp_closed_form"] - d2["target"]["fthsdp_closed_form"]
    assert drop == pytest.approx(F.rate(G) * 59.7, rel=0.15)


def test_experiment_missing_and_bad_inputs(tmp_path):
    out = tmp_path / "ett.json"
    p = run_ett(tmp_path, "--failure-stall", str(tmp_path / "nope.json"), "--recovery",
                str(tmp_path / "nope2.json"), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "experiments/failure_stall.py" in p.stdout and "experiments/recovery.py" in p.stdout
    d = json.loads(out.read_text())
    assert all(v["source"].startswith("default") for v in d["inputs"]["measured"].values())
    assert d["inputs"]["measured"]["detection_s"]["value"] == 0.50
    assert d["inputs"]["measured"]["restart_to_commit_s"]["value"] == 3.3
    assert len(d["notes"]) == 2

    # a survivors' stall measured slightly negative (noise around no stall) counts as 0, and says so
    fs, rc = write_inputs(tmp_path, detection_s=0.3)
    doc = json.loads(fs.read_text())
    fs.write_text(json.dumps({**doc, "stall_s": -0.02}))
    p = run_ett(tmp_path, "--failure-stall", str(fs), "--recovery", str(rc), "--out", str(out))
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert d["inputs"]["measured"]["survivors_stall_s"] == {"value": 0.0, "source": f"{fs}:stall_s",
                                                            "measured": -0.02}
    assert any("stall_s=-0.02" in n for n in d["notes"])

    bad = tmp_path / "bad.json"
    bad.write_text('{"detection_s": "fast"}')
    p = run_ett(tmp_path, "--failure-stall", str(bad), "--recovery", str(tmp_path / "nope2.json"),
                "--out", str(out))
    assert p.returncode == 2 and "detection_s='fast'" in p.stderr and "failure_stall.py" in p.stderr
    p = run_ett(tmp_path, "--set", "compile_s=soon", "--out", str(out))
    assert p.returncode == 2 and "compile_s=soon" in p.stderr
