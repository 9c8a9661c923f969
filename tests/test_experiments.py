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
    # One shape: the quick form's two-process shape (3x1p2) is the killed group of
    # tests/test_multiprocess_replica.py, whose survivors' stall is bounded there.
    run("failure_stall.py", "--quick", "--configs", "3x2", "--out", str(out))
    res = json.loads(out.read_text())
    for key in ("detection_s", "rebuild_s", "allreduce_s", "median_step_s", "stall_s"):
        assert isinstance(res[key], float) and res[key] >= (-1 if key == "stall_s" else 0), key
    assert len(res["runs"]) == 1 and all(r["identical_final_state"] for r in res["runs"])
    assert set(res["shapes"]) == {"3x2 P1"}
    assert 0 < res["detection_s"] < 3.0
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_recovery_rejoin_quick(tmp_path):
    out = tmp_path / "rec.json"
    run("recovery.py", "--quick", "--skip-transfer", "--out", str(out))
    res = json.loads(out.read_text())
    assert isinstance(res["rejoin_stall_fraction"], float)
    assert 0 < res["restart_to_commit_s"] < 120
    (r,) = res["rejoin_runs"]
    assert r["identical_final_state"] and r["catch_up_fetch_s"] > 0


def test_auth_cost_small(tmp_path):
    """experiments/auth_cost.py's three parts at their smallest: the schema, and that the budgets
    held the stranger's flood back (fewer of its calls answered than without them, the same run)."""
    out = tmp_path / "ac.json"
    run("auth_cost.py", "--quick", "--replicas", "4", "--rounds", "2", "--heartbeat-blocks", "2",
        "--flood-pairs", "2", "--out", str(out))
    res = json.loads(out.read_text())
    assert res["heartbeat"]["paired_p50_on_over_off"]["n"] == 2
    assert res["heartbeat"]["paired_p50_metadata_only_over_off"]["n"] == 2  # the old transport's cost alone
    (q,) = res["quorum"]
    assert q["rounds_ok"] == 2 and q["request_p50_s"]["paired_on_over_off"]["verdict"] in (
        "met", "not met", "undecided")
    assert res["credential_cpu_us"]["sign_us"] > 0 and res["credential_cpu_us"]["check_us"] > 0
    samples = 0
    for name in ("budgets", "no_budgets"):
        for mode in ("stranger", "insider"):
            r = res["flood"][name][mode]
            samples += r["heartbeat"]["samples"]["alone"] + r["heartbeat"]["samples"]["flooded"]
            assert isinstance(r["within_2x"], bool)
    assert samples > 0  # (a 0.6 s block of a loaded machine may see none of its calls answered within it)
    with_budgets = sum(res["flood"]["budgets"]["stranger"]["flood_codes"].values())
    without = sum(res["flood"]["no_budgets"]["stranger"]["flood_codes"].values())
    assert with_budgets < without, (with_budgets, without)
    assert set(res["flood"]["budgets"]["stranger"]["flood_codes"]) <= {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED",
                                                                     "INVALID_ARGUMENT"}


@pytest.mark.parametrize("ring", [1, 2])
def test_fingerprint_cost_quick(tmp_path, ring):
    """experiments/fingerprint_cost.py at its smallest: the schema and the verdict's form (the
    figure itself comes from the full run on a quiet machine, not from CI). With ``--ring 2`` the
    step all-reduces over a real FTAR ring with a second process, and every timed step must
    commit (the script stops on the first that does not)."""
    out = tmp_path / "fp.json"
    run("fingerprint_cost.py", "--quick", "--ring", str(ring), "--out", str(out))
    res = json.loads(out.read_text())
    assert res["ring"] == ring and ("FTAR" in res["allreduce"]) == (ring > 1)
    assert res["groups"] == 3 and len(res["ratios"]["in_step"]["cpu"]) == 3
    for key in ("in_step_overhead_cpu", "in_step_overhead_wall", "every_k_overhead_cpu", "in_step_update_part_cpu",
                "in_step_update_part_wall", "in_step_gradient_part_cpu", "every_k_update_part_cpu"):
        d = res[key]
        assert d["n"] == 3 and d["ci95"][0] <= d["median"] <= d["ci95"][1], key
        assert d["verdict"] in ("met", "not met", "undecided")
    assert res["target_met"] == res["in_step_update_part_cpu"]["verdict"]
    assert res["target_met_whole_step"] == res["in_step_overhead_cpu"]["verdict"]
    # Each group's whole-step overhead is its update part plus its gradient part.
    for clock in ("cpu", "wall"):
        for whole, upd, grad in zip(res["ratios"]["in_step"][clock], res["update_part_shares"]["in_step"][clock],
                                    res["gradient_part_shares"]["in_step"][clock]):
            assert abs((whole - 1) - (upd + grad)) < 1e-9
    # a share of a step (the figure itself: README)
    assert 0 < res["work_fraction_of_step_cpu"]["median"] < 1 and res["state_bytes"] > 5e6


def test_fingerprint_parts_quick(tmp_path):
    """experiments/fingerprint_parts.py at its smallest: every diagnostic variant runs, the jax
    reference form gives the native kernel's value in the step, a device's own words (no psum)
    do not, and the bare psum is timed."""
    out = tmp_path / "parts.json"
    run("fingerprint_parts.py", "--quick", "--out", str(out))
    res = json.loads(out.read_text())
    assert set(res["overhead_cpu"]) == {"in_step", "no_psum", "psum_only", "reference"}
    assert set(res["update_part_cpu"]) == set(res["overhead_cpu"])
    for d in (*res["overhead_cpu"].values(), *res["update_part_cpu"].values(), res["psum_minus_no_psum_cpu"]):
        assert d["n"] == 3 and d["ci95"][0] <= d["median"] <= d["ci95"][1]
    assert res["check"]["reference_equals_in_step"] is True
    assert res["check"]["no_psum_fp_device0"] != res["check"]["in_step_fp"]
    assert res["bare_psum"]["calls"] == 100 and res["bare_psum"]["wall_s"] > 0


def test_relay_failover_quick(tmp_path):
    """A relay killed and restarted, and one stopped for 3 s, at 8 replicas x 64 ranks behind 2
    relays: every invariant holds, and the replicas not behind the stopped relay do not wait for
    it (they go on without its block, declared dead, which rejoins once it is continued)."""
    out = tmp_path / "rf.json"
    run("relay_failover.py", "--quick", "--out", str(out))
    runs = {x["scenario"]: x for x in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"none", "killed", "stopped"}
    for x in runs.values():
        assert x["violations"] == [] and len(x["final_steps"]) == 1 and x["median_round_s"] > 0
    stopped = runs["stopped"]
    assert stopped["block_out_s"] >= stopped["stop_s"] - 0.5  # its block waited for the relay ...
    # ... the others did not: they wait out the detection window, not the stop (1.57 s of a 3 s
    # stop once on a loaded CI host, when the bound was half the stop)
    assert stopped["stall_s"] < stopped["stop_s"] - 1.0
    assert set(stopped["replicas_caught_up"]) == {"0", "1", "2", "3"}
    assert runs["none"]["replicas_caught_up"] == [] and runs["none"]["processes_left_relay"] == 0
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_lighthouse_restart_stall_quick(tmp_path):
    """A lighthouse SIGKILL between steps and one while it is writing a step's answers, at 64
    replicas, each against this tree's lighthouse and against the committed one run from its
    extract (the ``--baseline`` plumbing: EmulationConfig.lighthouse_from): every invariant
    holds, and the members answered before the SIGKILL abort their all-reduce on hearing the
    others ask (none waits out its 6 s deadline); and the threaded client rides out restarts."""
    out = tmp_path / "lrs.json"
    run("lighthouse_restart_stall.py", "--quick", "--baseline", "HEAD", "--out", str(out))
    res = json.loads(out.read_text())
    runs = {(x["side"], x["where"]): x for x in res["runs"]}
    assert set(runs) == {(s, w) for s in ("now", "baseline") for w in ("between", "answering")}
    for x in runs.values():
        assert x["violations"] == [] and x["final_steps"] == [10] and x["lighthouse_starts"] == 2
        assert x["failed_at_deadline"] == 0 and x["max_allreduce_wait_s"] < x["allreduce_deadline_s"] / 2
    for side in ("now", "baseline"):
        # whoever was in the all-reduce when the lighthouse died aborted it on hearing who asks (at
        # 64 replicas the lighthouse has sometimes written every answer before the SIGKILL lands:
        # then nobody is; tests/test_emulation.py makes the split certain at 256)
        answering = runs[(side, "answering")]
        assert answering["aborted_on_asking"] == answering["in_allreduce_at_kill"]
        assert runs[(side, "between")]["in_allreduce_at_kill"] == 0
    assert res["summary"]["answering"]["ratio_baseline_over_now"] > 0
    # the threaded client rode out 3 restarts a side, answered once the restarted lighthouse served
    for side in ("now", "baseline"):
        c = res["threaded_client"][side]
        assert len(c["after_serving_s"]) == 3 and 0 <= c["median_s"] <= c["max_s"] < 5
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_relay_return_quick(tmp_path):
    """A real relay SIGKILLed and restarted on its address twice, 2 threaded clients behind it,
    this tree against its own extract (the ``--baseline`` plumbing: before_after.call_with):
    the clients leave the dead relay and are back on the restarted one well before the 5 s
    retry wait (they watch its channel)."""
    out = tmp_path / "rr.json"
    run("relay_return.py", "--quick", "--baseline", "HEAD", "--out", str(out))
    res = json.loads(out.read_text())
    assert set(res["sides"]) == {"now", "baseline"}
    for s in res["sides"].values():
        assert s["client_trials"] == 4 and s["left"] == 4 and s["not_back"] == 0, s
        assert 0 <= s["median_back_after_serving_s"] <= s["max_back_after_serving_s"] < 2.5, s
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.multiprocess
def test_heartbeat_pacing_quick(tmp_path):
    """256 emulated replicas beating every 0.1 s against a real lighthouse, unpaced and with a
    budget of 500 beats/s (so that pacing engages at this size): the paced lighthouse says it
    paced them (0.512 s) and widened its window, every round formed with all 256, nobody was
    declared dead, and the JSON and plot hold both arms."""
    out = tmp_path / "hp.json"
    run("heartbeat_pacing.py", "--quick", "--budgets", "500", "--out", str(out), timeout=600)
    res = json.loads(out.read_text())
    assert sorted(r["arm"] for r in res["rows"]) == ["paced 500/s", "unpaced"]
    paced = next(r for r in res["rows"] if r["arm"] == "paced 500/s")
    assert paced["complete_rounds"] == paced["rounds"] == 3 and paced["declared_dead"] == 0, paced
    assert any("asked to beat every 0.512 s" in x for x in paced["pacing_log"]), paced["pacing_log"]
    (s,) = res["summary"]
    assert s["replicas"] == 256 and set(s) >= {"unpaced", "paced 500/s"}
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.multiprocess
def test_paced_restart_quick(tmp_path):
    """128 emulated replicas of 2 processes paced to 0.512 s (a budget of 500 beats/s) and their
    lighthouse SIGKILLed and restarted: both starts paced them to 0.512 s (the restarted one from
    its first recount or from what their beats said, whichever came first; tests/test_pacing.py
    pins the second), nobody was declared dead, every invariant held."""
    out = tmp_path / "pr.json"
    run("paced_restart.py", "--quick", "--out", str(out), timeout=600)
    (r,) = json.loads(out.read_text())["runs"]
    assert r["side"] == "now" and r["declared_dead"] == 0 and r["violations"] == [] and r["final_steps"] == [6], r
    assert sum("every 0.512 s" in x for x in r["pacing_log"]) >= 2, r["pacing_log"]  # one line a start
    assert r["complete_rounds"] >= r["rounds"] - 1, r  # the restart's: requests in flight at the kill fail


@pytest.mark.multiprocess
def test_lighthouse_standby_quick(tmp_path):
    """`fthsdp run` with its lighthouse SIGKILLed once, with the launcher's warm spare and
    without: the spare took over in one arm and a cold start in the other, each death's
    restart, outage and stall were read, and both jobs ended identical without a fallback."""
    out = tmp_path / "ls.json"
    run("lighthouse_standby.py", "--quick", "--out", str(out), timeout=600)
    res = json.loads(out.read_text())
    assert sorted(r["arm"] for r in res["runs"]) == ["cold", "standby"]
    for r in res["runs"]:
        (d,) = r["deaths"]
        assert d["standby"] is (r["arm"] == "standby") and d["restart_s"] > 0 and d["stall_s"] is not None
        assert r["identical_final_state"] and r["job_restarts"] == []
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_ring_forms_quick(tmp_path):
    """64 x 32 with a replica killed and restarted, a failed commit and the lighthouse restarted,
    leaders taking rings whole, as a delta and as their ring neighbours only: the same job each
    way (every invariant, every step); the delta's answers on each change of quorum id are
    several times smaller than whole rings, and the neighbours' several times smaller in the
    first round and after the restart too (where a delta has nothing to be against) and smaller
    than the delta's on a change."""
    out = tmp_path / "rf.json"
    run("ring_forms.py", "--quick", "--out", str(out))
    res = json.loads(out.read_text())
    runs = {x["arm"]: x for x in res["runs"]}
    assert set(runs) == {"whole", "delta", "neighbours"}
    for x in runs.values():
        assert x["violations"] == [] and x["final_steps"] == [12] and len(x["changes"]) == 2, x
    assert res["ratios"]["whole_over_delta"]["change_answer_bytes_median"] > 3
    assert res["ratios"]["whole_over_delta"]["first_answer_bytes"] == 1.0
    assert res["ratios"]["whole_over_neighbours"]["first_answer_bytes"] > 3
    assert res["ratios"]["whole_over_neighbours"]["change_answer_bytes_median"] > 3
    # on a change, only the leaders beside the gap get a neighbourhood: fewer bytes than a delta
    assert res["ratios"]["delta_over_neighbours"]["change_answer_bytes_median"] > 1
    # a restarted lighthouse holds no earlier view: whole rings again for a delta, not for neighbours
    assert all(x["lighthouse_starts"] == 2 and x["restart_round"] for x in runs.values())
    assert res["ratios"]["whole_over_delta"]["restart_answer_bytes"] == 1.0
    assert res["ratios"]["whole_over_neighbours"]["restart_answer_bytes"] > 3
    # the restart's own round, timed from the restarted lighthouse serving (not the outage's 1 s)
    assert all(0 < x["restart_round"]["latency_from_lighthouse_back_s"] < 30 for x in runs.values())
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_before_after_quick(tmp_path):
    """A hierarchical row at this tree's HEAD (extracted with git archive, imported from the
    extract: its rows say so) and one of the working tree, side by side: both complete every
    round, and the ratios are computed from the two."""
    out = tmp_path / "ba.json"
    run("before_after.py", "--baseline", "HEAD", "--shape", "16x8", "--rounds", "3", "--pairs", "1",
        "--out", str(out))
    res = json.loads(out.read_text())
    rows = {r["side"]: r for r in res["rows"]}
    assert set(rows) == {"baseline", "now"}
    assert rows["baseline"]["fthsdp_from"] == "baseline extract" and rows["now"]["fthsdp_from"] == "working tree"
    for r in rows.values():
        assert r["complete_rounds"] == r["rounds"] == 3 and r["violations"] == [], r
    assert res["shape"] == {"replicas": 16, "ranks_per_replica": 8, "flat": False}
    assert res["ratio_of_medians_baseline_over_now"]["p50_s"] == pytest.approx(
        rows["baseline"]["p50_s"] / rows["now"]["p50_s"])


def test_lighthouse_message_cost_quick(tmp_path):
    """The lighthouse's own cost per session message, with and without its budgets, this tree and
    its HEAD's extract: every arm runs the code it names and completes its rounds (each answer an
    OK quorum). No ratio is asserted: one quick run per arm on a shared host is too noisy for it."""
    out = tmp_path / "mc.json"
    run("lighthouse_message_cost.py", "--quick", "--baseline", "HEAD", "--out", str(out))
    res = json.loads(out.read_text())
    assert {r["arm"] for r in res["runs"]} == {"now", "now-no-budgets", "baseline", "baseline-no-budgets"}
    for r in res["runs"]:
        assert "error" not in r and r["messages_per_round"] == 128 and r["quorum_id"] >= 1, r
        assert r["fthsdp_from"] == ("baseline extract" if r["arm"].startswith("baseline") else "working tree")
    assert all(v > 0 for v in res["median_us_per_message"].values())
    assert all(v > 0 for v in res["median_registration_cpu_s"].values())
    assert set(res["registration_ratio_to_now"]) == {"now-no-budgets", "baseline", "baseline-no-budgets"}
