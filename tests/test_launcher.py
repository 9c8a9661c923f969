"""`fthsdp run` as a user runs it (a subprocess, real signals), one test per
launcher defect of issue 10: faults keyed to the live process, random kills
that mean N and spare the last healthy replica, the report's survivors, a
resume that keeps the run's overrides and shape and replays nothing, one
launch log per attempt, the whole-job fallback to the checkpoint, and a
lighthouse SIGKILLed mid-run."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from fthsdp.data.ledger import check_exactly_once
from fthsdp.launch import report
from fthsdp.logs import read_metrics

from test_fault_tolerance import TINY, assert_compiled_once, assert_identical_after_every_commit

pytestmark = pytest.mark.multiprocess

PACED = TINY + ["ft.checkpoint_every=10", "train.min_step_s=0.1"]


def fthsdp_run(out: pathlib.Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`fthsdp run --out-dir OUT ARGS` in a subprocess; its output kept next to the run."""
    cmd = [sys.executable, "-m", "fthsdp.cli", "run", "--no-progress", "--out-dir", str(out), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.stderr", "a") as f:
        f.write(p.stderr)
    return p


def job_args(replicas: int, steps: int, *extra: str) -> list[str]:
    """Flags first, then the tiny paced job, then `extra`'s overrides (x=y), which win."""
    flags = [a for a in extra if "=" not in a]
    return ["--config", "base", "--replicas", str(replicas), "--devices-per-replica", "1", *flags, *PACED,
            f"train.steps={steps}", *[a for a in extra if "=" in a]]


def events(out: pathlib.Path, attempt: str | None = None) -> list[dict]:
    path = out / "events.jsonl" if attempt is None else out / "attempts" / attempt / "events.jsonl"
    return read_metrics(path)


def summary(out: pathlib.Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def exactly_once(out: pathlib.Path, run: report.RunFiles) -> tuple[int, ...]:
    (positions,) = {tuple(d["positions"]) for d in run.done.values()}
    rep = check_exactly_once(sorted((out / "ledger").glob("*.jsonl")), dict(enumerate(positions)))
    assert rep.ok, rep.summary()
    return positions


def test_faults_follow_the_live_process_and_survivors_are_the_healthy(tmp_path):
    out = tmp_path / "run"
    # replica 1 is killed at step 6, restarted, and killed again once its *new*
    # process is past step 6 (not on the dead one's stale status); replica 2 is
    # killed while replica 1 is still restarting: only replica 0 survives that one.
    p = fthsdp_run(out, *job_args(3, 100, "--kill", "1@6", "--kill", "1@6", "--kill", "2@8",
                                  "launch.restart_delay_s=1.5"))
    assert p.returncode == 0, p.stderr[-3000:]
    ev = events(out)
    kills = [e for e in ev if e["kind"] == "kill"]
    assert [(e["replica"]) for e in kills] == [1, 2, 1]
    run = report.load_run(out)
    first_pid = run.steps["1"][0]["pid"]
    second_kill = kills[2]
    restarted = [r for r in run.steps["1"] if r["pid"] != first_pid and r["end"] <= second_kill["time"]]
    assert restarted, "the second kill fired before the restarted process committed a step"
    assert second_kill["step"] >= 6
    # the kill of replica 2 happened while replica 1 was restarting: one survivor
    assert kills[1]["healthy"] == [0]
    s = summary(out)
    f2 = next(f for f in s["failures"] if f["replica"] == "2")
    assert set(f2["stall_s"]) == {"0"}
    assert all(f["detection_s"] is None or f["detection_s"] > 0 for f in s["failures"])
    assert s["identical_final_state"] and s["job_restarts"] == []
    exactly_once(out, run)


def test_random_kills_mean_n_and_spare_the_last_healthy_replica(tmp_path):
    out = tmp_path / "run"
    # seed 2 puts the two kills of a 2-replica job 2 steps apart (r0@8, r1@10): the
    # second must wait until the first victim has rejoined (it is "running" from its
    # spawn, but not healthy); the config's own kill (0@20) is not added on top.
    p = fthsdp_run(out, *job_args(2, 60, "--random-kills", "2", "--seed", "2", "launch.kill=0@20",
                                  "launch.restart_delay_s=0.2", "train.min_step_s=0.25"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "faults (from command line) ['kill r0@8', 'kill r1@10']" in p.stderr
    kills = [e for e in events(out) if e["kind"] == "kill"]
    s = summary(out)
    # exactly the two planned; under heavy load the second may not be due before the end
    assert len(kills) + len(s["faults_not_fired"]) == 2 and kills[0]["replica"] == 0, (kills, s["faults_not_fired"])
    assert all(k["healthy"] for k in kills), kills  # someone healthy was always left
    assert s["job_restarts"] == [] and s["identical_final_state"] and s["failed_replicas"] == []
    exactly_once(out, report.load_run(out))


def test_resume_keeps_overrides_refuses_other_shapes_and_replays_no_fault(tmp_path):
    out = tmp_path / "run"
    p = fthsdp_run(out, *job_args(2, 30, "--kill", "1@4", "--kill-all", "14", "optim.lr=0.002"))
    assert p.returncode == 0, p.stderr[-3000:]
    hint = next(line for line in p.stderr.splitlines() if "resume with:" in line).split("resume with: ")[1]
    assert "optim.lr=0.002" in hint and "train.steps=30" in hint
    # a different shape is refused, naming the difference
    for extra, field in ((["train.steps=20"], "train.steps: 30 in the run, 20 now"),
                         (["--devices-per-replica", "2"], "launch.devices_per_replica: 1 in the run, 2 now")):
        bad = fthsdp_run(out, "--resume", *extra, timeout=60)
        assert bad.returncode == 2 and field in bad.stderr, bad.stderr[-2000:]
    p = fthsdp_run(out, "--resume")
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads((out / "run.json").read_text())
    assert "optim.lr=0.002" in doc["overrides"] and "train.steps=30" in doc["overrides"]
    assert [a["kind"] for a in doc["attempts"]] == ["fresh", "resume"]
    # the faults of the first attempt fired once and are not replayed
    assert not [e for e in events(out) if e["kind"] in ("kill", "kill_all")]
    assert sorted(f["kind"] for f in doc["fired"]) == ["kill", "kill_all"]
    # one launch log per attempt, and launch.log points at the latest
    log0 = (out / "attempts/0/launch.log").read_text()
    assert "kill_all" in log0 and "attempt 0" in log0
    assert (out / "launch.log").resolve() == (out / "attempts/1/launch.log").resolve()
    assert "attempt 1 (resume)" in (out / "launch.log").read_text()
    run = report.load_run(out)
    assert all(d["step"] == 30 for d in run.done.values()) and len(run.done) == 2
    positions = exactly_once(out, run)
    assert positions[0] == 30 and positions[1] < 30  # replica 1 missed the steps it was down


def test_a_batch_committed_but_not_logged_is_recorded_when_the_job_resumes(tmp_path):
    """Replica 1 is killed between its commit of step 9 and that commit's ledger line (the test
    hook ft.test_die_before_ledger; a kill can land there). The checkpoint of step 10, written
    by replica 0 at the same commit, holds replica 1's batch 9; its restart is delayed past the
    whole job's kill at step 13, so the job resumes from that checkpoint with batch 9 in the
    model and not in replica 1's ledger. The resumed replica records it (the checkpoint now
    keeps the step each replica last contributed to): every batch exactly once. Before, the
    exactly-once check found batch 9 never trained (the chaos soak did, once)."""
    out = tmp_path / "run"
    p = fthsdp_run(out, *job_args(2, 16, "--kill-all", "13", "ft.test_die_before_ledger=1@9",
                                  "launch.restart_delay_s=60"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "test_die_before_ledger-1").exists()  # the hook fired
    p = fthsdp_run(out, "--resume")
    assert p.returncode == 0, p.stderr[-3000:]
    run = report.load_run(out)
    assert all(d["step"] == 16 for d in run.done.values()) and len(run.done) == 2
    positions = exactly_once(out, run)
    assert positions == (16, 16)
    assert "ledger: batch 9 was committed at step 10 before we recorded it" in (out / "replica-1.log").read_text()


def test_a_batch_committed_but_not_logged_is_recorded_by_a_replica_back_after_the_end(tmp_path):
    """Replica 1 is killed between its commit of step 15 and that commit's ledger line, and its
    restart checks in after replica 0 has finished the job: it never rejoins, so no fetched state
    tells it that step 15 holds its batch 14. The finisher's Leave left the model's data state
    on the lighthouse, whose job-finished answer hands it over: the late replica records batch
    14, and every batch is in the ledgers exactly once. Before, the exactly-once check found
    that batch never trained (the chaos soak did, once: batch 58 of replica 0)."""
    out = tmp_path / "run"
    # (restarted at once: replica 0 finishes its last two steps while the restart starts up; a
    # restart due after replica 0 ended would not be made into a finished job)
    p = fthsdp_run(out, *job_args(2, 16, "ft.test_die_before_ledger=1@14", "launch.restart_delay_s=0"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "test_die_before_ledger-1").exists()  # the hook fired
    log1 = (out / "replica-1.log").read_text()
    assert "already finished at step 16" in log1, log1[-3000:]
    assert "ledger: batch 14 was committed at step 15 before we recorded it" in log1
    run = report.load_run(out)
    assert sorted(run.done) == ["0"]
    assert exactly_once(out, run) == (16, 15)


def test_a_finished_replica_exiting_before_it_is_reaped_is_not_a_lost_job(tmp_path):
    """The launcher reaps exited processes, then decides on restarts and the whole-job fallback
    from its views of them. A finisher that exits between the two still held the job's last
    state: its status file says so. Its view read as a running replica that never committed, so
    with the other replica restarting to rejoin, "no healthy replica is left" restarted the whole
    finished job from its checkpoint (seen in CI, in the test above)."""
    from fthsdp.launch import supervise
    from fthsdp.launch.local import LocalJob, ReplicaProc

    job = LocalJob(config="base", overrides=[], out_dir=tmp_path, replicas=2, steps=16, faults=[], progress=False)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    rejoiner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        while done.poll() is None:  # exited; the launcher has not reaped it yet
            time.sleep(0.01)
        (tmp_path / "status-0.json").write_text(json.dumps({"pid": done.pid, "step": 16, "state": "done",
                                                            "final": True}))
        r0, r1 = (job.procs.setdefault(rid, ReplicaProc(rid)) for rid in (0, 1))
        r0.proc, r0.state, r0.progressed, r0.last_step = done, "running", True, 16
        r1.proc, r1.state, r1.mode, r1.last_step = rejoiner, "running", "rejoin", 15
        views = job.views()
        assert views[0].live_step == 16
        assert not supervise.needs_fallback(views)
        job.maybe_fall_back()
        assert job.job_restarts == [] and not job.gave_up
        job.reap()
        assert r0.state == "done" and supervise.job_done(job.views())
        # a process that died (not finished) holds nothing, before it is reaped too
        r0.proc, r0.state, r0.returncode = subprocess.Popen([sys.executable, "-c", "raise SystemExit(70)"]), \
            "running", None
        r0.proc.wait()
        (tmp_path / "status-0.json").write_text(json.dumps({"pid": r0.proc.pid, "step": 16}))
        assert job.views()[0].live_step is None
    finally:
        rejoiner.kill()
        rejoiner.wait()
        job.shutdown()


def test_two_jobs_share_an_authenticated_lighthouse_by_name(tmp_path):
    """An external lighthouse serves jobs by name, each with the secret printed for that name
    (`fthsdp lighthouse --print-job-secret JOB`). fthsdp run named every job "fthsdp", so the
    README's own commands failed (the secret of "myjob" does not verify for "fthsdp"), and two
    jobs on one lighthouse would have been one job. A refused credential is job-fatal at once
    (it was retried as transient, and the job restarted from its checkpoint until its restarts ran
    out)."""
    from fthsdp.control import auth
    from test_resilience_lighthouse import lighthouse_process

    lh_key, port_file = tmp_path / "lh.key", tmp_path / "lh.port"
    auth.write_secret(str(lh_key), auth.new_secret())
    keys = {}
    for job in ("alpha", "beta"):
        keys[job] = tmp_path / f"{job}.key"
        auth.write_secret(str(keys[job]), auth.job_key(auth.load_secret(str(lh_key)), job))
    lh, port = lighthouse_process(["--secret-file", str(lh_key), "--bind", "127.0.0.1:0", "--replicas", "1"],
                                  port_file)
    try:
        address = f"127.0.0.1:{port}"
        runs = {job: subprocess.Popen([sys.executable, "-m", "fthsdp.cli", "run", "--no-progress", "--out-dir",
                                       str(tmp_path / job), *job_args(1, 6, "--lighthouse", address, "--job", job,
                                                                      "--secret-file", str(keys[job]))],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for job in keys}
        for job, p in runs.items():
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, (job, err[-3000:])
            assert report.load_run(tmp_path / job).done["0"]["step"] == 6
        # the secret of one name given to a job of another: refused once, job-fatal, no restarts
        p = fthsdp_run(tmp_path / "wrong", *job_args(1, 6, "--lighthouse", address, "--secret-file",
                                                     str(keys["alpha"])))
        assert p.returncode == 4 and "exited job-fatal" in p.stderr, p.stderr[-3000:]
        assert summary(tmp_path / "wrong")["job_restarts"] == []
        out = (tmp_path / "wrong" / "replica-0.out").read_text()
        assert "credential does not verify" in out and "--print-job-secret JOB" in out and "--job JOB" in out
    finally:
        lh.kill()
        lh.wait(30)
    bad = fthsdp_run(tmp_path / "bad-name", *job_args(1, 6, "--job", "my job"))
    assert bad.returncode != 0 and "launch.job_id" in bad.stderr and "1 to 64" in bad.stderr


def test_no_healthy_replica_left_falls_back_to_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    # both replicas die at step 15 (the restart of the first is delayed past the
    # second's death): nobody holds the live state, the launcher restarts the job
    # from the checkpoint of step 10 by itself and it finishes.
    p = fthsdp_run(out, *job_args(2, 40, "--kill", "0@15", "--kill", "1@15", "launch.restart_delay_s=5"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "no healthy replica is left" in p.stderr and "restarting the whole job from the checkpoint of step 10" \
        in p.stderr
    s = summary(out)
    assert [j["checkpoint"] for j in s["job_restarts"]] == [10]
    assert s["identical_final_state"] and s["failed_replicas"] == []
    run = report.load_run(out)
    assert sorted(run.done) == ["0", "1"] and all(d["step"] == 40 for d in run.done.values())
    assert min(r["step"] for recs in run.steps.values() for r in recs) == 10
    assert exactly_once(out, run) == (40, 40)
    assert_identical_after_every_commit(run)
    assert_compiled_once(run)


def test_fallback_is_bounded(tmp_path):
    out = tmp_path / "run"
    p = fthsdp_run(out, *job_args(2, 40, "--kill", "0@12", "--kill", "1@12", "launch.restart_delay_s=5",
                                  "launch.max_job_restarts=0"))
    assert p.returncode == 4, p.stderr[-3000:]
    assert "launch.max_job_restarts=0" in p.stderr and "fthsdp run --resume --out-dir" in p.stderr


def test_lighthouse_killed_mid_run_is_restarted_and_the_job_finishes(tmp_path):
    out = tmp_path / "run"
    p = fthsdp_run(out, *job_args(2, 40, "--kill-lighthouse", "12", "ft.lighthouse_outage_s=30"))
    assert p.returncode == 0, p.stderr[-3000:]
    # its warm spare (launch.lighthouse_standby, on by default) took the port over
    assert "lighthouse died (signal 9); its standby took over in" in p.stderr
    s = summary(out)
    assert len(s["lighthouse_restarts"]) == 1 and s["lighthouse_restarts"][0]["standby"] is True
    # the replicas rode out the outage: no fallback to the checkpoint was needed
    assert s["job_restarts"] == [], "the replicas did not survive the lighthouse outage"
    run = report.load_run(out)
    assert s["identical_final_state"] and all(d["step"] == 40 for d in run.done.values())
    assert exactly_once(out, run) == (40, 40)


def test_lighthouse_that_cannot_be_restarted_stops_the_job_with_a_resume_hint(tmp_path):
    import socket

    from fthsdp.launch.local import LocalJob

    job = LocalJob(config="base", overrides=["optim.lr=0.001"], out_dir=tmp_path, replicas=2, steps=10, faults=[],
                   progress=False)
    try:
        job.start_lighthouse()
        port = job.lighthouse_port
        job.lighthouse.kill()
        job.lighthouse.wait(10)
        # its address is taken by someone else now: a restart on it cannot bind
        squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        try:
            assert job.supervise_lighthouse() is False
        finally:
            squatter.close()
        assert "died (signal 9) and could not be restarted" in job.gave_up
        assert f"fthsdp run --resume --out-dir {tmp_path} --config base optim.lr=0.001" in job.gave_up
        assert job.finished()
    finally:
        job.shutdown()


def test_a_job_runs_without_a_time_limit_unless_launch_deadline_s_sets_one(tmp_path):
    """launch.deadline_s (0 by default: a training job runs as long as it needs; the launcher once
    stopped every job at 15 minutes). Set, an unfinished job is stopped at it, its summary written,
    and the launcher says how to resume it (exit 4, as for every job it gives up on)."""
    from fthsdp.config import LaunchConfig
    from fthsdp.launch.local import LocalJob

    assert LaunchConfig().deadline_s == 0.0
    assert LocalJob(config="base", overrides=[], out_dir=tmp_path, replicas=1, steps=1, faults=[]).deadline_s == 0.0
    out = tmp_path / "run"
    p = fthsdp_run(out, *job_args(1, 100_000, "launch.deadline_s=2"), timeout=120)
    assert p.returncode == 4, p.stderr[-3000:]
    assert "the job did not finish within launch.deadline_s = 2 s" in p.stderr
    assert f"fthsdp run --resume --out-dir {out}" in p.stderr
    assert "did not finish within" in summary(out)["gave_up"]


@pytest.mark.parametrize("how", ["replica-fatal", "SIGSEGV"])
def test_a_replica_that_keeps_failing_before_its_first_commit_is_not_restarted_forever(tmp_path, how):
    """A replica-fatal exit asks for a restart; one that comes back before any commit, start after
    start (a deterministic start-up fault), was restarted every second until the job's deadline.
    Now each restart waits twice as long, and after MAX_FAILED_STARTS the replica is failed with
    its log's last lines and the resume command. Real processes exiting 70 stand in for it, or
    dying of SIGSEGV (a crash in XLA or the FFI at every start, which was restarted for ever)."""
    from fthsdp.errors import EXIT_REPLICA_FATAL
    from fthsdp.launch.local import MAX_FAILED_STARTS, LocalJob, ReplicaProc

    code = (f"import sys; sys.exit({EXIT_REPLICA_FATAL})" if how == "replica-fatal" else
            "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    rc = EXIT_REPLICA_FATAL if how == "replica-fatal" else -signal.SIGSEGV

    job = LocalJob(config="base", overrides=[], out_dir=tmp_path, replicas=2, steps=10, faults=[], progress=False,
                   restart=True)
    log_path = tmp_path / "replica-1.out"
    log_path.write_text("Traceback ...\nRuntimeError: the same start-up fault\n")
    rp = job.procs[1] = ReplicaProc(1, log_path=log_path)
    waits = []
    try:
        for attempt in range(1, MAX_FAILED_STARTS + 1):
            rp.proc = subprocess.Popen([sys.executable, "-c", code])
            rp.proc.wait(30)
            rp.state = "running"
            t0 = time.time()
            job.reap()
            if attempt < MAX_FAILED_STARTS:
                assert rp.state == "killed" and rp.failed_starts == attempt, (rp.state, rp.failed_starts)
                waits.append(rp.restart_at - t0)
        assert rp.state == "failed" and rp.returncode == rc
        assert waits[1] > 1.8 * waits[0] > 0, waits  # each restart waits longer
        rp.failed_starts = 0
        rp.progressed = True  # a replica that committed before it failed is restarted as always
        rp.proc = subprocess.Popen([sys.executable, "-c", code])
        rp.proc.wait(30)
        rp.state = "running"
        job.reap()
        assert rp.state == "killed" and rp.failed_starts == 0
    finally:
        job.shutdown()


def test_a_fault_never_fires_at_a_replica_that_finished_and_a_kill_that_hangs_does_not_crash_the_launcher(tmp_path):
    """A kill due at the last step found the replica finished (exit 0) but not yet reaped, and
    overwrote "done" with "killed": the finished job was restarted from its checkpoint. And a
    process that does not end after SIGKILL (uninterruptible sleep) raised TimeoutExpired out of
    the launcher's loop."""
    from fthsdp.launch.faults import Fault
    from fthsdp.launch.local import LocalJob, ReplicaProc, _wait_killed

    job = LocalJob(config="base", overrides=[], out_dir=tmp_path, replicas=2, steps=10, faults=[], progress=False,
                   restart=True)
    try:
        for rid in (0, 1):
            rp = job.procs[rid] = ReplicaProc(rid, state="running")
            rp.proc = subprocess.Popen([sys.executable, "-c", "pass"])
            rp.proc.wait(30)
            (tmp_path / f"status-{rid}.json").write_text(json.dumps({"pid": rp.proc.pid, "step": 10, "final": True}))
        job.pending = [Fault(10, 1, "kill")]
        job.apply_faults()
        assert job.pending and job.procs[1].state == "running" and not job.fired  # not fired at the finisher
        job.reap()
        assert [job.procs[r].state for r in (0, 1)] == ["done", "done"]
    finally:
        job.shutdown()

    class Stuck:  # a process in uninterruptible sleep: SIGKILL is pending, wait() times out
        pid = 4242

        def wait(self, timeout=None):
            raise subprocess.TimeoutExpired("replica", timeout)

    assert _wait_killed(Stuck(), 0.01, "replica 1") is False


def test_a_followers_job_fatal_exit_after_its_leaders_restart_exit_stands_for_the_group(tmp_path):
    """The leader notices its follower's silence and exits 70 (restart me); the follower, on its
    way out with a job-fatal verdict (78), was SIGKILLed by the launcher first and the group was
    restarted into the same failure. Now the rest of a group whose ended processes ask for a
    restart get a moment to end on their own, and the group ends as its worst process did."""
    from fthsdp.errors import EXIT_JOB_FATAL, EXIT_REPLICA_FATAL
    from fthsdp.launch.local import LocalJob, ReplicaProc

    job = LocalJob(config="base", overrides=[], out_dir=tmp_path, replicas=2, steps=10, faults=[], progress=False,
                   restart=True, detect_s=0.5)
    rp = job.procs[1] = ReplicaProc(1, log_path=tmp_path / "replica-1.out", state="running")
    rp.log_path.write_text("")
    try:
        rp.proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({EXIT_REPLICA_FATAL})"])
        rp.followers = [subprocess.Popen([sys.executable, "-c",
                                          f"import sys, time; time.sleep(1.0); sys.exit({EXIT_JOB_FATAL})"])]
        rp.proc.wait(30)
        deadline = time.time() + 20
        while rp.state == "running" and time.time() < deadline:
            job.reap()
            time.sleep(0.05)
        assert rp.followers[0].returncode == EXIT_JOB_FATAL  # it ended on its own, not by the launcher's kill
        assert (rp.state, rp.returncode) == ("failed", EXIT_JOB_FATAL)
    finally:
        job.shutdown()


def test_a_second_launcher_on_a_run_directory_in_use_is_refused(tmp_path):
    """A fresh run clears its directory's checkpoints and ledgers: a second launcher there (another
    terminal, a forgotten run) would delete a live run's. The first holds the directory; the second
    is refused with who holds it, and the directory is free once the holder ends."""
    from fthsdp.launch import rundir

    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").mkdir()
    held = rundir.hold(out)
    try:
        p = fthsdp_run(out, *job_args(1, 5), timeout=120)
        assert p.returncode == 2 and "is in use by another launcher (pid " in p.stderr, p.stderr[-2000:]
        assert (out / "checkpoints").is_dir()  # nothing of the holder's was touched
        with pytest.raises(rundir.RunDirBusy, match="give this run another --out-dir"):
            rundir.hold(out)
    finally:
        held.close()
    rundir.hold(out).close()  # free again


def test_launchers_lighthouse_gets_the_configured_connection_budget(tmp_path):
    """launch.lighthouse_connection_calls_per_s reaches the lighthouse `fthsdp run` starts: a
    client calling faster than a small budget is held back, and the lighthouse's log names that
    budget (the Ray launcher's actor takes the same value: test_ray_lighthouse_actor_...)."""
    import time

    from fthsdp.control import auth
    from fthsdp.control.lighthouse_client import LighthouseClient
    from fthsdp.launch.local import LocalJob

    job = LocalJob(config="base", overrides=[], out_dir=tmp_path, replicas=2, steps=10, faults=[], progress=False,
                   lighthouse_calls_per_s=25.0)
    try:
        job.start_lighthouse()
        with LighthouseClient(job.lighthouse_addr, "x", "x", status_key=auth.status_key(job.lighthouse_secret)) as c:
            t0 = time.monotonic()
            for _ in range(60):  # a new connection starts with 20 tokens: ~40 calls wait for 25/s
                c.status(job_id="")
            took = time.monotonic() - t0
        log_text = (tmp_path / "lighthouse.log").read_text()
        assert "held back" in log_text and "25 calls/s" in log_text, log_text[-2000:]
        assert took > 1.0, took  # ~1.6 s at 25 calls/s; the default budget (burst 200) would not hold any
    finally:
        job.shutdown()


def test_ray_lighthouse_actor_takes_the_connection_budget():
    """The Ray launcher's lighthouse actor (run here as a plain object, without Ray) builds its
    lighthouse with the budget the driver hands it, and the default without one."""
    from fthsdp.control.admission import FairnessLimits
    from fthsdp.launch.ray_actors import LighthouseActor

    for given, want in (({}, FairnessLimits().connection_calls_per_s), ({"connection_calls_per_s": 750.0}, 750.0)):
        a = LighthouseActor("127.0.0.1", 0, 1.0, 0.5, 2, None, ("", ""), **given)
        try:
            assert a.thread.config.fairness.connection_calls_per_s == want
            assert a.address().startswith("127.0.0.1:")
            facts = a.facts()  # what the driver records in its "lighthouse" event
            assert facts["connection_calls_per_s"] == want and facts["metrics_address"].startswith("127.0.0.1:")
        finally:
            a.stop()


def test_both_launchers_lighthouses_get_the_configured_beat_budget(tmp_path):
    """launch.lighthouse_beats_per_s reaches the lighthouse `fthsdp run` starts (its serving line
    names its config) and the Ray launcher's lighthouse actor (run here without Ray), whose facts
    the driver records; 0 (never pace) too."""
    from fthsdp.control.pacing import DEFAULT_BEATS_PER_S
    from fthsdp.launch.local import LocalJob
    from fthsdp.launch.ray_actors import LighthouseActor

    job = LocalJob(config="base", overrides=[], out_dir=tmp_path, replicas=2, steps=10, faults=[], progress=False,
                   lighthouse_beats_per_s=0.0)
    try:
        job.start_lighthouse()
        log_text = (tmp_path / "lighthouse.log").read_text()
        assert "beats_per_s=0.0" in log_text, log_text[-2000:]
    finally:
        job.shutdown()
    for given, want in (({}, DEFAULT_BEATS_PER_S), ({"beats_per_s": 123.0}, 123.0)):
        a = LighthouseActor("127.0.0.1", 0, 1.0, 0.5, 2, None, ("", ""), **given)
        try:
            assert a.thread.config.beats_per_s == want and a.facts()["beats_per_s"] == want
        finally:
            a.stop()


def test_ray_relay_actor_serves_in_front_of_a_lighthouse():
    """The Ray launcher's relay actor (run here as a plain object, without Ray): a client's
    session through it reaches the lighthouse, and its stats say what it carried."""
    from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
    from fthsdp.control.lighthouse_client import LighthouseClient
    from fthsdp.launch.ray_actors import RelayActor

    with LighthouseThread(LighthouseConfig(join_timeout_s=0.2)) as lh:
        a = RelayActor("127.0.0.1", 0, lh.address)
        try:
            with LighthouseClient(lh.address, "job", "0", relay=a.address()) as c:
                q = c.get_quorum(0, ftar_addresses=["127.0.0.1:9000"], num_replicas=1, timeout_s=10)
                assert q.member_ids == ("0",) and c.relay == a.address()
            assert a.stats()["messages_up"] >= 1 and lh.server.stats["relay_batches"] >= 1
        finally:
            a.stop()


def test_status_line_says_done_for_a_replica_that_exited_cleanly(tmp_path):
    """A replica whose process exited 0 has no live status file any more; the
    status line must say it is done, not that it is starting."""
    import subprocess
    import sys

    from fthsdp.launch.local import LocalJob, ReplicaProc

    job = LocalJob(config="base", overrides=[], out_dir=tmp_path, replicas=2, steps=10, faults=[], progress=False,
                   restart=True)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(30)
    job.procs = {0: ReplicaProc(rid=0, proc=done, state="done"), 1: ReplicaProc(rid=1, proc=None, state="starting")}
    line = job.status_line()
    assert "r0: done" in line and "r1: starting" in line, line
