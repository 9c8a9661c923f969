"""Silent data corruption end to end (issue 16, item 4): real replica processes, a real
lighthouse, one bit of one replica's parameters flipped mid-run by the test hook
(ft.test_flip_bit). Three replicas: the lighthouse finds the replica at the next commit,
takes it out of the healthy set, it rejoins from the majority's state, and every replica
ends identical, every batch trained exactly once. Two replicas: no majority, so the job
stops with a clear error naming the step and both fingerprints."""

import collections
import json
import pathlib
import re
import subprocess
import sys

import pytest

from fthsdp.data.ledger import check_exactly_once
from fthsdp.launch import report
from fthsdp.launch.faults import plan
from fthsdp.launch.local import LocalJob

from test_fault_tolerance import TINY

pytestmark = pytest.mark.multiprocess

FLIP_STEP = 6  # replica 1's parameters get a flipped bit right after it commits this step


def job(tmp_path: pathlib.Path, replicas: int, steps: int) -> LocalJob:
    overrides = TINY + [f"launch.replicas={replicas}", "launch.devices_per_replica=2", f"train.steps={steps}",
                        f"ft.test_flip_bit=1@{FLIP_STEP}", "train.min_step_s=0.05"]
    return LocalJob(config="base", overrides=overrides, out_dir=tmp_path, replicas=replicas, steps=steps,
                    faults=plan((), (), replicas), restart=False, detect_s=0.8, join_timeout_s=0.5,
                    deadline_s=240, progress=False)


def hashes_by_step(run: report.RunFiles) -> dict[int, dict[str, str]]:
    by_step: dict[int, dict[str, str]] = collections.defaultdict(dict)
    for rid, recs in run.steps.items():
        for r in recs:
            by_step[r["step"]][rid] = (r["hash"], r["fingerprint"])
    return by_step


def test_flipped_bit_is_found_at_the_next_commit_and_the_replica_rejoins(tmp_path):
    steps = 16
    s = job(tmp_path, 3, steps).run()
    run = report.load_run(tmp_path)
    assert s["failed_replicas"] == [] and sorted(run.done) == ["0", "1", "2"]
    by_step = hashes_by_step(run)
    # the hook fired once, on replica 1, after its commit of FLIP_STEP ...
    flips = [r for r in (tmp_path / "metrics-1.jsonl").read_text().splitlines() if '"test_flip_bit"' in r]
    assert len(flips) == 1 and f'"step": {FLIP_STEP}' in flips[0]
    # ... the states were identical until then, and after the next commit replica 1's differs
    for step in range(FLIP_STEP + 1):
        assert len(set(by_step[step].values())) == 1, (step, by_step[step])
    bad = by_step[FLIP_STEP + 1]
    assert bad["0"] == bad["2"] and bad["1"][0] != bad["0"][0] and bad["1"][1] != bad["0"][1]
    # the lighthouse found it there (the state after FLIP_STEP + 2 committed steps) and named replica 1
    lh = (tmp_path / "lighthouse.log").read_text()
    found = re.findall(r"silent data corruption after step (\d+): replica\(s\) (\S+) disagree", lh)
    assert found == [(str(FLIP_STEP + 2), "1")], lh[-3000:]
    # replica 1 was listed behind at the very next step and caught up from the majority ...
    rec1 = {r["step"]: r for r in run.steps["1"]}
    assert not rec1[FLIP_STEP + 2]["healthy"] and any("caught up" in e for e in rec1[FLIP_STEP + 2]["events"])
    assert all(rec1[st]["healthy"] for st in range(steps) if st != FLIP_STEP + 2)
    # ... and from then on every replica holds the same bytes, to the end
    for step in range(FLIP_STEP + 2, steps):
        assert len(set(by_step[step].values())) == 1, (step, by_step[step])
    assert s["identical_final_state"], s["final_hashes"]
    # exactly once: replica 1's catch-up step consumed no batch
    (positions,) = {tuple(d["positions"]) for d in run.done.values()}
    assert positions == (steps, steps - 1, steps)
    rep = check_exactly_once(sorted((tmp_path / "ledger").glob("*.jsonl")), dict(enumerate(positions)))
    assert rep.ok, rep.summary()


def test_two_replicas_that_disagree_stop_the_job_with_a_clear_error(tmp_path):
    steps = 14
    args = [sys.executable, "-m", "fthsdp.cli", "run", "--config", "base", "--replicas", "2",
            "--devices-per-replica", "2", "--out-dir", str(tmp_path), "--no-progress", *TINY,
            f"train.steps={steps}", f"ft.test_flip_bit=1@{FLIP_STEP}", "train.min_step_s=0.05"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    # job-fatal: the launcher does not fall back to the checkpoint (max_job_restarts is left at its default)
    assert p.returncode == 4, out[-3000:]
    assert "exited job-fatal (exit code 78): a restart would fail the same way" in out, out[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["job_restarts"] == []
    run = report.load_run(tmp_path)
    assert run.done == {}
    fps = {rid: next(r["fingerprint"] for r in recs if r["step"] == FLIP_STEP + 1) for rid, recs in run.steps.items()}
    assert fps["0"] != fps["1"]
    for rid in ("0", "1"):
        status = json.loads((tmp_path / f"status-{rid}.json").read_text())
        assert status["exit_code"] == 78 and status["state"] == "failed (job-fatal)"
        msg = status["fault"]
        assert f"silent data corruption after step {FLIP_STEP + 2}" in msg, msg
        assert f"0:{fps['0']}" in msg and f"1:{fps['1']}" in msg, msg
        # nobody trained past the step where the mismatch was found
        assert max(r["step"] for r in run.steps[rid]) == FLIP_STEP + 1
    # the launcher's output carries the whole reason
    assert f"silent data corruption after step {FLIP_STEP + 2}" in out and "rather than guess" in out, out[-3000:]


@pytest.mark.slow
def test_multi_process_replicas_find_and_repair_a_flipped_bit(tmp_path):
    """3 replicas x 2 processes x 1 device (each replica's state sharded over two processes): the
    fingerprint is one in-graph reduction over both processes' shards, the same on both; the
    flipped replica is found at the next commit and rejoins as a group; all end identical."""
    from test_launcher import fthsdp_run

    steps = 14
    out = tmp_path / "run"
    p = fthsdp_run(out, "--config", "base", "--replicas", "3", "--processes-per-replica", "2",
                   "--devices-per-replica", "1", *TINY, f"train.steps={steps}", "train.min_step_s=0.05",
                   f"ft.test_flip_bit=1@{FLIP_STEP}")
    assert p.returncode == 0, p.stderr[-3000:]
    run = report.load_run(out)
    lh = (out / "lighthouse.log").read_text()
    found = re.findall(r"silent data corruption after step (\d+): replica\(s\) (\S+) disagree", lh)
    assert found == [(str(FLIP_STEP + 2), "1")], lh[-3000:]
    by_step = hashes_by_step(run)
    assert by_step[FLIP_STEP + 1]["1"] != by_step[FLIP_STEP + 1]["0"] == by_step[FLIP_STEP + 1]["2"]
    for step in range(FLIP_STEP + 2, steps):
        assert len(set(by_step[step].values())) == 1, (step, by_step[step])
    # each follower computed the same fingerprint as its leader at every step
    from fthsdp.logs import read_metrics

    for r in ("0", "1", "2"):
        lead = {d["step"]: d["fingerprint"] for d in read_metrics(out / f"metrics-{r}.jsonl") if d.get("kind") == "step"}
        follow = {d["step"]: d["fingerprint"] for d in read_metrics(out / "followers" / f"{r}.1" / f"metrics-{r}.jsonl")
                  if d.get("kind") == "step"}
        assert lead and lead == follow, r
