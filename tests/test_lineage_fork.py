"""A split brain made with real processes and real signals (`fthsdp run`, SIGSTOP/SIGCONT):
two quorums both commit the same steps, and the lineage fence (rule 6 of
fthsdp.control.quorum) sends the forked replicas back to a lower step.

Replica 2 is stopped in step 5: 0 and 1 abort, form quorum 2 without it and commit
steps 5 and 6. Then 0 and 1 are stopped and 2 wakes up: 0 and 1 are silent past the
detection window, so 2 alone is a majority of the live, forms a quorum at step 5 and
trains steps 5, 6, ... again with other batches. When 0 and 1 wake up they finish
their step in quorum 2 and ask at step 7 or 8, below or above 2: either way they are
fenced (behind), fetch 2's state, roll their discarded commits back in their ledgers
and train those batches again. The job must end with one model and every batch
trained exactly once."""

from __future__ import annotations

import collections
import json

import pytest

from fthsdp.data.ledger import Rollback, read_ledger
from fthsdp.launch import report

from test_launcher import exactly_once, fthsdp_run, job_args

pytestmark = pytest.mark.multiprocess


def test_a_forked_replica_goes_back_to_the_lineage_with_an_exactly_once_ledger(tmp_path):
    out = tmp_path / "run"
    p = fthsdp_run(out, *job_args(3, 24, "--stop", "2@5", "--stop", "0@7", "--stop", "1@7", "--stop-seconds", "5",
                                  "train.min_step_s=0.15", "ft.checkpoint_every=2"), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    run = report.load_run(out)
    from fthsdp.logs import read_metrics

    rollbacks = {rid: [r for r in read_metrics(out / f"metrics-{rid}.jsonl") if r.get("kind") == "rollback"]
                 for rid in ("0", "1", "2")}
    # The fork happened: replica 2 re-trained step 5 in a quorum of its own after 0 and 1 had
    # committed it (and 6) in theirs.
    committed_by = collections.defaultdict(set)
    for rid, recs in run.steps.items():
        for r in recs:
            if r["healthy"]:
                committed_by[(r["step"], r["quorum_id"])].add(rid)
    fork = {q for (s, q), who in committed_by.items() if s == 5}
    assert len(fork) == 2, f"step 5 was not committed by two quorums: {dict(committed_by)}"
    # 0 and 1 were fenced: they rolled back exactly their commits from step 5 on (ledger steps
    # 6..), and fetched replica 2's state; 2 rolled back nothing.
    for rid in ("0", "1"):
        (rb,) = rollbacks[rid]
        assert rb["first"] == 6 and rb["last"] >= 7 and rb["step"] >= 7, rb
        (led,) = [r for r in read_ledger(out / "ledger" / f"replica_{rid}.jsonl").records if isinstance(r, Rollback)]
        assert (led.first, led.last, led.step) == (rb["first"], rb["last"], rb["step"])
        fetches = [r for r in read_metrics(out / f"metrics-{rid}.jsonl") if r.get("kind") == "fetch"]
        assert any(f["step"] == rb["step"] for f in fetches), fetches
    assert rollbacks["2"] == []
    log0 = (out / "replica-0.log").read_text()
    assert "fenced, behind" in log0 and "re-decided step 5" in log0, log0[-3000:]
    # One model: along the lineage every replica that committed a step holds the same bytes,
    # and the final states are bitwise identical.
    assert {rid: len(rbs) for rid, rbs in run.rollbacks.items()} == {"0": 1, "1": 1}
    for step, hashes in report.hashes_after_commits(run).items():
        assert len(set(hashes.values())) == 1, f"replicas diverged after step {step}: {hashes}"
    assert len({d["hash"] for d in run.done.values()}) == 1 and len(run.done) == 3, run.done
    # Every batch exactly once in the surviving lineage: without the rollbacks 0's and 1's
    # batches of steps 5 and 6 would count twice.
    exactly_once(out, run)
    assert "replica 0 was fenced (its state forked from the job's lineage): its commits of steps 5.." in p.stderr
    # No persistent checkpoint holds the forked state: replica 0 (the lowest of quorum 2)
    # saved its steps 6 and 8 there, over replica 2's if 2 had saved them first; it deletes
    # what it wrote when it rolls back, so a restart cannot bring the discarded commits back.
    forked_qid = next(q for q in fork if committed_by[(5, q)] == {"0", "1"})
    for d in (out / "checkpoints").iterdir():
        meta = json.loads((d / "meta" / "metadata").read_text()) if (d / "meta" / "metadata").exists() else {}
        assert not (meta.get("quorum_id") == forked_qid and meta.get("step", 0) > 5), (d.name, meta)


def test_a_fork_in_the_last_steps_ends_with_one_final_state(tmp_path):
    """The same fork, in a job of 8 steps: replica 2 re-decides step 5 and trains to the end
    while 0 and 1 are stopped in step 6. When they wake up, no quorum may follow to fence
    them (2 finished, or is finishing). Whatever the race, the job must end with one final
    state: 0 and 1 either catch up from 2 (fenced) or are told at their Leave that their
    state forked (the lighthouse judges the leavers against its lineage), roll back their
    discarded commits and claim no final state; every batch is in the final model once."""
    from fthsdp.logs import read_metrics

    out = tmp_path / "run"
    p = fthsdp_run(out, *job_args(3, 8, "--stop", "2@5", "--stop", "0@6", "--stop", "1@6", "--stop-seconds", "5",
                                  "train.min_step_s=0.15"), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    run = report.load_run(out)
    quorums_of_5 = {r["quorum_id"] for recs in run.steps.values() for r in recs if r["step"] == 5 and r["healthy"]}
    assert len(quorums_of_5) == 2, "step 5 was not committed by two quorums"
    assert len({d["hash"] for d in run.done.values()}) == 1 and "2" in run.done, run.done
    for rid in ("0", "1"):
        recs = read_metrics(out / f"metrics-{rid}.jsonl")
        ends = [r for r in recs if r.get("kind") in ("done", "forked", "job_finished")]
        assert ends, f"replica {rid} ended without saying how"
        if rid not in run.done:  # not repaired: the lighthouse's verdict, and the discarded commits rolled back
            (forked,) = [r for r in recs if r.get("kind") == "forked"]
            assert forked["forked_step"] == 5 and "re-decided step 5" in forked["reason"], forked
            assert f"replica {rid}: final state discarded: replica {rid} at step" in p.stderr
            assert any(isinstance(r, Rollback) and r.first == 6
                       for r in read_ledger(out / "ledger" / f"replica_{rid}.jsonl").records)
    exactly_once(out, run)


@pytest.mark.slow  # beside tests/test_lineage_lighthouse.py's restart test (real lighthouse, gRPC clients)
def test_a_fork_is_fenced_by_a_lighthouse_restarted_after_it(tmp_path):
    """The fork of the first test, then the lighthouse SIGKILLed and restarted on the same
    port (empty memory) before the forked replicas wake up: the restarted lighthouse rebuilds
    the lineage from the replicas' reports and fences them all the same. Replicas started
    directly against the test's own lighthouse; every signal sent on what the status files
    show, so the order of events does not depend on the machine's speed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from fthsdp.data.ledger import check_exactly_once

    from test_fault_tolerance import TINY
    from test_resilience_lighthouse import REPO, free_port, start_lighthouse, step_of

    port, steps = free_port(), 24
    lh_log = tmp_path / "lighthouse.log"
    lh = start_lighthouse(port, lh_log)
    env = dict(os.environ, PYTHONUNBUFFERED="1", FTHSDP_PEER_TOKEN="lineage-restart-test")
    procs = []

    def wait(what, cond, limit=120.0):
        deadline = time.monotonic() + limit
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            assert all(p.poll() is None for p in procs), f"a replica exited while waiting for {what}"
            time.sleep(0.02)

    def signal_replica(rid, sig):
        os.killpg(procs[rid].pid, sig)

    try:
        for rid in range(3):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fthsdp.replica.process", "--config", "base", "--replica-id", str(rid),
                 "--lighthouse", f"127.0.0.1:{port}", "--job", "lineage-restart", "--out-dir", str(tmp_path),
                 *TINY, "launch.replicas=3", "launch.devices_per_replica=1", f"train.steps={steps}",
                 "train.min_step_s=0.1", "ft.checkpoint_every=1000", "ft.lighthouse_outage_s=60"],
                cwd=REPO, env=env, stdout=open(tmp_path / f"replica-{rid}.out", "w"), stderr=subprocess.STDOUT,
                start_new_session=True))
        wait("step 5", lambda: min(step_of(tmp_path, r) for r in range(3)) >= 5)
        signal_replica(2, signal.SIGSTOP)
        wait("0 and 1 at step 8 without 2", lambda: min(step_of(tmp_path, r) for r in (0, 1)) >= 8)
        signal_replica(0, signal.SIGSTOP)
        signal_replica(1, signal.SIGSTOP)
        signal_replica(2, signal.SIGCONT)
        wait("2 retraining alone to step 11", lambda: step_of(tmp_path, 2) >= 11)
        os.killpg(lh.pid, signal.SIGKILL)
        lh.wait(10)
        lh = start_lighthouse(port, lh_log)  # same port, empty memory: no lineage
        wait("2 going on with the restarted lighthouse", lambda: step_of(tmp_path, 2) >= 13)
        signal_replica(0, signal.SIGCONT)
        signal_replica(1, signal.SIGCONT)
        rcs = [p.wait(240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        os.killpg(lh.pid, signal.SIGTERM)
        lh.wait(10)
    logs = {r: (tmp_path / f"replica-{r}.out").read_text() for r in range(3)}
    assert rcs == [0, 0, 0], {r: logs[r][-3000:] for r in range(3)}
    text = lh_log.read_text()
    assert "lighthouse restarted" in text and "merged" in text, text[-3000:]
    assert "fenced, behind: [0, 1]" in text and "re-decided step 5" in text, text[-3000:]
    run = report.load_run(tmp_path)
    assert {rid: [(rb["first"], rb["kind"]) for rb in rbs] for rid, rbs in run.rollbacks.items()} == {
        "0": [(6, "rollback")], "1": [(6, "rollback")]}
    for step, hashes in report.hashes_after_commits(run).items():
        assert len(set(hashes.values())) == 1, f"replicas diverged after step {step}: {hashes}"
    assert len(run.done) == 3 and len({d["hash"] for d in run.done.values()}) == 1, run.done
    (positions,) = {tuple(d["positions"]) for d in run.done.values()}
    rep = check_exactly_once(sorted((tmp_path / "ledger").glob("*.jsonl")), dict(enumerate(positions)))
    assert rep.ok, rep.summary()
