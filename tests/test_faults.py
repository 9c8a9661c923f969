"""Fault plans (pure) and the run report over synthetic run files."""

import json
import pathlib

import pytest

from fthsdp.launch import report
from fthsdp.launch.faults import Fault, parse_fault, plan, random_kills


def test_parse_and_plan():
    assert parse_fault("1@40", "kill") == Fault(step=40, replica=1, kind="kill")
    assert parse_fault("0@3", "stop", 2.0).stop_s == 2.0
    faults = plan(("2@9",), ("0@5",), replicas=3)
    assert [(f.kind, f.replica, f.step) for f in faults] == [("stop", 0, 5), ("kill", 2, 9)]


@pytest.mark.parametrize("spec,msg", [("1", "expected REPLICA@STEP"), ("a@b", "expected REPLICA@STEP"),
                                      ("-1@3", "must be >= 0"), ("5@3", "replicas 0..2")])
def test_bad_fault_specs(spec, msg):
    with pytest.raises(ValueError, match=msg):
        plan((spec,), (), replicas=3)


def test_a_relay_kill_names_its_relay_and_the_first_by_default():
    faults = plan((), (), replicas=3, relay=("7", "2@9"), relays=3)
    assert [(f.kind, f.relay_index, f.step, f.label()) for f in faults] == [
        ("relay", 0, 7, "relay 0@7"), ("relay", 2, 9, "relay 2@9")]
    # a plan saved before relays had an index (replica JOB) names the first, and reads back the same
    old = Fault.from_json({"step": 5, "replica": -1, "kind": "relay"})
    assert old.relay_index == 0 and Fault.from_json(faults[1].to_json()) == faults[1]
    with pytest.raises(ValueError, match=r"starts relays 0\.\.1 \(launch.relays=2\): name one of those"):
        plan((), (), replicas=3, relay=("2@9",), relays=2)
    with pytest.raises(ValueError, match=r"starts no relay \(launch.relays=0\)"):
        plan((), (), replicas=3, relay=("9",), relays=0)
    for spec, msg in (("x", "expected STEP or INDEX@STEP"), ("1@", "expected STEP or INDEX@STEP"),
                      ("-1@4", "must be >= 0"), ("-3", "must be >= 0")):
        with pytest.raises(ValueError, match=msg):
            plan((), (), replicas=3, relay=(spec,))


def test_random_kills_are_seeded_and_sane():
    a = random_kills(4, replicas=3, steps=100, seed=7)
    assert a == random_kills(4, replicas=3, steps=100, seed=7)
    assert a != random_kills(4, replicas=3, steps=100, seed=8)
    assert len({f.step for f in a}) == 4 and all(5 <= f.step < 95 and 0 <= f.replica < 3 for f in a)
    with pytest.raises(ValueError, match="at least 2 replicas"):
        random_kills(1, replicas=1, steps=100, seed=0)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_finds_detection_and_stall(tmp_path):
    # replica 0 and 1 train 10 steps of 0.1 s; replica 2 is killed at t=100.45 during step 4;
    # the survivors' step 4 takes 1.2 s, and they learn of the death at t=101.0.
    t = 100.0
    rows = {"0": [], "1": [], "2": []}
    for rid in rows:
        clock = t
        for s in range(10):
            if rid == "2" and s >= 4:
                break
            dur = 1.2 if s == 4 else 0.1
            members = ["0", "1", "2"] if s < 5 else ["0", "1"]
            rows[rid].append({"kind": "step", "replica": rid, "step": s, "quorum_id": 1 if s < 5 else 2,
                              "members": members, "healthy": True, "attempts": 2 if s == 4 else 1,
                              "loss": 5.0 - s * 0.1, "start": clock, "end": clock + dur, "position": s})
            clock += dur
    rows["0"].append({"kind": "detection", "replica": "0", "time": 101.0, "dead": ["2"], "quorum_id": 1})
    for rid in ("0", "1"):
        rows[rid].append({"kind": "done", "replica": rid, "step": 10, "hash": "abc"})
    for rid, rs in rows.items():
        _write(tmp_path / f"metrics-{rid}.jsonl", rs)
    _write(tmp_path / "events.jsonl", [{"time": 100.45, "kind": "kill", "replica": 2, "step": 4}])
    s = report.write_summary(tmp_path)
    (f,) = s["failures"]
    assert f["detection_s"] == pytest.approx(0.55)
    assert f["stall_s"]["0"] == pytest.approx(1.1) and f["straddling_step"]["1"] == 4
    assert [q["members"] for q in s["quorum_changes"]] == [["0", "1", "2"], ["0", "1"]]
    assert s["identical_final_state"] is True
    assert s["replicas"]["0"]["retried_steps"] == 1
    assert any("detected in 0.55s" in line for line in report.describe(s))
    png = report.plot_timeline(tmp_path, num_configured=3)
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("with_quorum_at", [True, False])
def test_report_times_a_kill_between_steps_by_the_answer_not_the_step_start(tmp_path, with_quorum_at):
    # Replica 2 is killed at t=100.39, between steps: no all-reduce is in flight, so no abort
    # names it; the survivors' step 4 starts at 100.40, asks, and gets the quorum without
    # replica 2 at 101.20 (the detection window). The step's start is not the detection.
    rows = {"0": [], "1": [], "2": []}
    for rid in rows:
        clock = 100.0
        for s in range(6):
            if rid == "2" and s >= 4:
                break
            dur = 0.9 if s == 4 else 0.1
            rec = {"kind": "step", "replica": rid, "step": s, "quorum_id": 1 if s < 4 else 2,
                   "members": ["0", "1", "2"] if s < 4 else ["0", "1"], "healthy": True, "attempts": 1,
                   "loss": 1.0, "start": clock, "end": clock + dur, "position": s}
            if with_quorum_at:
                rec["quorum_at"] = clock + (0.8 if s == 4 else 0.01)
            rows[rid].append(rec)
            clock += dur
    for rid, rs in rows.items():
        _write(tmp_path / f"metrics-{rid}.jsonl", rs)
    _write(tmp_path / "events.jsonl", [{"time": 100.39, "kind": "kill", "replica": 2, "step": 4}])
    (f,) = report.summarize(tmp_path)["failures"]
    # Files written before quorum_at existed: the step's start, as before.
    assert f["detection_s"] == pytest.approx(0.81 if with_quorum_at else 0.01)


def test_report_flags_divergent_replicas(tmp_path):
    _write(tmp_path / "metrics-0.jsonl", [{"kind": "done", "replica": "0", "step": 5, "hash": "a"}])
    _write(tmp_path / "metrics-1.jsonl", [{"kind": "done", "replica": "1", "step": 5, "hash": "b"}])
    s = report.summarize(tmp_path)
    assert s["identical_final_state"] is False
    assert "NO" in report.describe(s)[-1]


# -- the launcher's pure decisions (issue 10) ---------------------------------------

from fthsdp.launch import rundir, supervise  # noqa: E402
from fthsdp.launch.faults import JOB, choose_sources, due  # noqa: E402


def test_command_line_fault_flags_replace_the_configs_plan():
    # --random-kills N means N: the config's kill 1@40 is not added on top
    s = choose_sources(None, None, 3, None, None, cfg_kills=("1@40",), cfg_stops=(), cfg_random=0)
    assert s.origin == "command line" and s.kills == () and s.random_count == 3
    assert len(plan(s.kills, s.stops, 3, random_count=s.random_count, steps=100, seed=1)) == 3
    s = choose_sources(None, None, None, None, None, cfg_kills=("1@40",), cfg_stops=("0@9",), cfg_random=2)
    assert s.origin == "config" and s.kills == ("1@40",) and s.random_count == 2
    s = choose_sources(None, None, None, (12,), None, cfg_kills=("1@40",), cfg_stops=(), cfg_random=0)
    assert s.kills == () and s.lighthouse == (12,)


def test_faults_fire_on_the_live_process_progress_only():
    kill = Fault(step=6, replica=1, kind="kill")
    # a restarted replica whose new process has not committed: no progress, even if
    # its killed predecessor's status said step 9
    assert due(kill, {0: 9, 1: None}, healthy={0}) == "wait"
    assert due(kill, {0: 9, 1: 5}, healthy={0, 1}) == "wait"
    assert due(kill, {0: 9, 1: 6}, healthy={0, 1}) == "fire"
    lh = Fault(step=4, replica=JOB, kind="lighthouse")
    assert due(lh, {0: None, 1: None}, set()) == "wait" and due(lh, {0: 4, 1: None}, {0}) == "fire"


def test_random_kill_never_takes_the_last_healthy_replica_but_a_named_kill_may():
    rnd = Fault(step=5, replica=0, kind="kill", explicit=False)
    named = Fault(step=5, replica=0, kind="kill")
    # replica 1 is restarting (running, no progress yet): it is not healthy
    assert due(rnd, {0: 7, 1: None}, healthy={0}) == "wait"
    assert due(rnd, {0: 7, 1: 7}, healthy={0, 1}) == "fire"
    assert due(named, {0: 7, 1: None}, healthy={0}) == "fire"
    assert all(not f.explicit for f in random_kills(3, replicas=3, steps=50, seed=1))


def V(rid, state, step=None, mode="start", progressed=None, last=None):
    return supervise.ReplicaView(rid, state, step, mode, step is not None if progressed is None else progressed,
                                 step if last is None else last)


def test_fallback_only_when_nobody_holds_or_can_regain_the_state():
    starting = [V(0, "running"), V(1, "running")]  # a job's start: nobody committed yet, but they will
    assert not supervise.needs_fallback(starting)
    all_dead = [V(0, "killed"), V(1, "failed")]
    assert supervise.needs_fallback(all_dead)
    rejoining_alone = [V(0, "running", mode="rejoin"), V(1, "killed")]
    assert supervise.needs_fallback(rejoining_alone)
    assert not supervise.needs_fallback([V(0, "running", 12), V(1, "killed")])
    assert not supervise.needs_fallback([V(0, "stopped", progressed=True, last=12), V(1, "killed", last=12)])
    assert supervise.needs_fallback([V(0, "stopped", progressed=False, mode="rejoin"), V(1, "killed")])
    finished = [V(0, "done"), V(1, "killed")]
    assert not supervise.needs_fallback(finished) and not supervise.restart_allowed(finished, 1)
    assert supervise.healthy([V(0, "running", 3), V(1, "running", mode="rejoin"), V(2, "stopped", 3)]) == {0}


def test_a_job_fatal_exit_is_not_worth_a_restart():
    from fthsdp.errors import EXIT_JOB_FATAL, EXIT_REPLICA_FATAL

    def F(rid, rc):
        return supervise.ReplicaView(rid, "failed", None, returncode=rc)

    assert supervise.job_fatal([F(0, EXIT_JOB_FATAL), F(1, EXIT_JOB_FATAL)]) == [0, 1]
    assert supervise.job_fatal([F(0, 1), V(1, "killed")]) == []  # an unclassified error: the fallback may help
    assert supervise.job_fatal([F(0, EXIT_REPLICA_FATAL), V(1, "running", 3)]) == []
    # a replica that is running again is judged by its live process, not its last exit
    again = supervise.ReplicaView(0, "running", 4, returncode=EXIT_JOB_FATAL)
    assert supervise.job_fatal([again]) == []


def test_resume_shape_check_names_the_difference_and_keeps_overrides():
    from fthsdp import config as config_lib

    saved = rundir.effective(config_lib.load("base", ["train.steps=200", "launch.devices_per_replica=1"]))
    now = rundir.effective(config_lib.load("base", ["train.steps=120", "launch.devices_per_replica=2",
                                                    "ft.detect_s=0.9", "train.min_step_s=0.1"]))
    diffs = rundir.shape_differences(saved, now)
    assert diffs == ["launch.devices_per_replica: 1 in the run, 2 now", "train.steps: 200 in the run, 120 now"]
    # how the run is driven may change: faults, restarts, the fallback bound
    driven = rundir.effective(config_lib.load("base", ["train.steps=200", "launch.devices_per_replica=1",
                                                       "launch.kill=0@5", "launch.max_job_restarts=0"]))
    assert rundir.shape_differences(saved, driven) == []
    merged = rundir.merge_overrides(["train.steps=200", "optim.lr=0.001"], ["train.steps=300"])
    assert merged == ["optim.lr=0.001", "train.steps=300"]
    hint = rundir.resume_hint(pathlib.Path("runs/x y"), "ft_local", ["optim.lr=0.001"])
    assert hint == "fthsdp run --resume --out-dir 'runs/x y' --config ft_local optim.lr=0.001"


def test_run_dir_keeps_one_launch_log_per_attempt(tmp_path):
    rd = rundir.RunDir(tmp_path)
    rd.save({"config": "base", "overrides": []})
    n0, log0 = rd.begin_attempt("fresh")
    log0.write_text("attempt 0\n")
    (tmp_path / "metrics-0.jsonl").write_text("{}\n")
    n1, log1 = rd.begin_attempt("fallback", "fallback-1")
    assert (n0, n1) == (0, 1)
    assert (tmp_path / "attempts/0/metrics-0.jsonl").exists() and not (tmp_path / "metrics-0.jsonl").exists()
    assert (tmp_path / "launch.log").resolve() == log1.resolve() and log0.read_text() == "attempt 0\n"
    assert [a["kind"] for a in rd.load()["attempts"]] == ["fresh", "fallback"]


def test_report_counts_only_replicas_healthy_at_the_fault_as_survivors(tmp_path):
    # replica 1 was restarting when replica 2 was killed: its first (catch-up) step is no "stall"
    rows = {"0": [], "1": []}
    for s in range(6):
        rows["0"].append({"kind": "step", "replica": "0", "step": s, "quorum_id": 1, "members": ["0"],
                          "healthy": True, "attempts": 1, "loss": 1.0, "start": 100.0 + s, "end": 100.9 + s})
    rows["1"].append({"kind": "step", "replica": "1", "step": 4, "quorum_id": 2, "members": ["0", "1"],
                      "healthy": False, "attempts": 1, "loss": None, "start": 104.0, "end": 104.9})
    for rid, rs in rows.items():
        _write(tmp_path / f"metrics-{rid}.jsonl", rs)
    _write(tmp_path / "events.jsonl", [{"time": 103.5, "kind": "kill", "replica": 2, "step": 3, "healthy": [0]}])
    (f,) = report.summarize(tmp_path)["failures"]
    assert set(f["stall_s"]) == {"0"}


def test_a_replica_behind_the_frontier_does_not_hold_the_live_state():
    # replica 0 was stopped at step 25 and woke up behind; replica 2, the last one
    # at step 33, died: training on from 25 would train steps 26..33's batches twice
    woke_behind = [V(0, "running", 25), V(1, "killed", last=33), V(2, "killed", last=33)]
    assert supervise.frontier(woke_behind) == 33
    assert supervise.healthy(woke_behind) == set() and supervise.needs_fallback(woke_behind)
    assert not supervise.restart_allowed(woke_behind, 1)
    # while someone is at the frontier, the one behind catches up from it: no fallback
    catching_up = [V(0, "running", 25), V(1, "running", 33), V(2, "killed", last=33)]
    assert supervise.healthy(catching_up) == {1} and not supervise.needs_fallback(catching_up)
    # one step apart is the same step being committed, not "behind"
    assert supervise.healthy([V(0, "running", 32), V(1, "running", 33)]) == {0, 1}
    # a random kill of the only replica at the frontier waits
    assert due(Fault(step=30, replica=1, kind="kill", explicit=False), {0: 25, 1: 33},
               supervise.healthy(catching_up)) == "wait"


def test_what_a_replica_exit_means():
    import signal

    from fthsdp.errors import EXIT_JOB_FATAL, EXIT_REPLICA_FATAL

    assert supervise.after_exit(0) == "done"
    assert supervise.after_exit(-signal.SIGKILL) == "restart"  # a dead machine, the OOM killer
    assert supervise.after_exit(EXIT_REPLICA_FATAL) == "restart"  # the replica asks for it
    assert supervise.after_exit(EXIT_JOB_FATAL) == "failed" and supervise.after_exit(1) == "failed"
    # a replica of several processes, the rest stopped by the launcher: the worst verdict stands
    assert supervise.group_returncode([EXIT_JOB_FATAL]) == EXIT_JOB_FATAL  # a follower's job-fatal exit
    assert supervise.group_returncode([-signal.SIGKILL, EXIT_JOB_FATAL]) == EXIT_JOB_FATAL
    assert supervise.group_returncode([1, EXIT_JOB_FATAL]) == EXIT_JOB_FATAL
    assert supervise.group_returncode([EXIT_REPLICA_FATAL, 1]) == 1  # an unclassified error: no restart
    assert supervise.group_returncode([-signal.SIGKILL]) == -signal.SIGKILL  # a dead machine: restarted
    assert supervise.group_returncode([EXIT_REPLICA_FATAL]) == EXIT_REPLICA_FATAL
