"""Replicas of several processes through `fthsdp run` (issue 11): real processes, real SIGKILLs.

Each replica is P=2 processes x 1 device forming one JAX runtime (FSDP over the
two processes); process 0 leads (asks the lighthouse, publishes quorums), the
follower replays. Checked from the run's artifacts: every process of every
replica holds bitwise the same state after every committed step, every batch
exactly once, one compilation per process, and a killed process (a follower
or the leader) takes its replica out whole while the others keep training
within the all-reduce deadline.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from fthsdp.launch import report
from fthsdp.logs import read_metrics
from test_fault_tolerance import DEADLINE_S, TINY
from test_launcher import exactly_once, fthsdp_run

pytestmark = pytest.mark.multiprocess


def _steps(path: pathlib.Path) -> dict[int, str]:
    return {d["step"]: d["hash"] for d in read_metrics(path) if d.get("kind") == "step" and "hash" in d}


def _done(path: pathlib.Path) -> dict:
    return next((d for d in read_metrics(path) if d.get("kind") == "done"), {})


def _run(tmp_path, replicas: int, steps: int, *extra: str):
    out = tmp_path / "run"
    p = fthsdp_run(out, "--config", "base", "--replicas", str(replicas), "--processes-per-replica", "2",
                   "--devices-per-replica", "1", *extra, *TINY, f"train.steps={steps}", "train.min_step_s=0.05")
    return out, p


def _check_processes_agree(out: pathlib.Path, survivors: list[int]) -> None:
    """Every process of a surviving replica: same hash as its leader at every step, compiled once."""
    for r in survivors:
        lead, follow = _steps(out / f"metrics-{r}.jsonl"), _steps(out / "followers" / f"{r}.1" / f"metrics-{r}.jsonl")
        assert lead and lead == follow, f"replica {r}: its processes diverged"
        for path in (out / f"metrics-{r}.jsonl", out / "followers" / f"{r}.1" / f"metrics-{r}.jsonl"):
            assert _done(path).get("compilations") == {"compute_grads": 1, "apply_grads": 1}, path


def test_two_replicas_of_two_processes_train_identically(tmp_path):
    out, p = _run(tmp_path, 2, 15)
    assert p.returncode == 0, p.stderr[-3000:]
    run = report.load_run(out)
    from test_fault_tolerance import assert_identical_after_every_commit

    assert assert_identical_after_every_commit(run) == 15
    _check_processes_agree(out, [0, 1])
    exactly_once(out, run)
    # each process connected only its own shard's ring: 2 endpoints per replica, one per process
    logs = {r: (out / f"replica-{r}.0.log").read_text() for r in (0, 1)}
    assert all("ftar endpoints [" in t for t in logs.values())


@pytest.mark.parametrize("who", ["1.1", pytest.param("1.0", marks=pytest.mark.slow)])
def test_a_killed_process_takes_its_replica_out_whole_and_it_rejoins_as_a_group(tmp_path, who):
    """SIGKILL of one process (a follower; the leader in the slow variant) of replica 1: the
    rest of its group is killed, the others go on within the deadline, the group is restarted
    and rejoins from its peers; at the end all three hold the same state, nothing trained twice."""
    steps = 150
    out, p = _run(tmp_path, 3, steps, "--kill", f"{who}@8", "train.min_step_s=0.3")
    assert p.returncode == 0, p.stderr[-3000:]
    run = report.load_run(out)
    events = read_metrics(out / "events.jsonl")
    kinds = [(e["kind"], e.get("replica")) for e in events]
    assert ("kill", 1) in kinds and ("restart", 1) in kinds, kinds
    from test_fault_tolerance import assert_identical_after_every_commit

    assert {r for r, d in run.done.items() if d.get("step") == steps} == {"0", "1", "2"}, run.done
    assert assert_identical_after_every_commit(run) >= steps - 10
    exactly_once(out, run)
    members = [tuple(r["members"]) for r in run.steps["0"]]
    assert ("0", "2") in members and members[-1] == ("0", "1", "2"), sorted(set(members))
    for r in ("0", "2"):  # the survivors never waited past the all-reduce deadline
        for rec in run.steps[r][1:]:
            assert rec["end"] - rec["start"] < 2 * DEADLINE_S, (r, rec["step"], rec["end"] - rec["start"])
    for r in (0, 1, 2):  # every process of every replica: the same state as its leader
        lead, follow = _steps(out / f"metrics-{r}.jsonl"), _steps(out / "followers" / f"{r}.1" / f"metrics-{r}.jsonl")
        common = set(lead) & set(follow)
        assert len(common) >= 8 and max(common) > 10, (r, sorted(common))  # before the kill and after the rejoin
        assert all(lead[s] == follow[s] for s in common), r
    assert _done(out / "followers" / "1.1" / "metrics-1.jsonl").get("compilations") == \
        {"compute_grads": 1, "apply_grads": 1}


def test_a_frozen_follower_gets_its_replica_declared_dead(tmp_path):
    """SIGSTOP of a non-leader process: its leader stops hearing it within the detection
    window and takes the replica out (replica-fatal); the others go on within the deadline."""
    out, p = _run(tmp_path, 3, 30, "--stop", "1.1@8", "--stop-seconds", "10", "--no-restart")
    run = report.load_run(out)
    status = json.loads((out / "status-1.json").read_text())
    assert "process 1 of replica 1 silent" in status.get("fault", ""), status
    assert {r for r, d in run.done.items() if d.get("step") == 30} == {"0", "2"}, run.done.keys()
    from test_fault_tolerance import assert_identical_after_every_commit

    assert assert_identical_after_every_commit(run) >= 25
    for r in ("0", "2"):
        assert run.steps[r][-1]["members"] == ["0", "2"]
        for rec in run.steps[r][1:]:
            assert rec["end"] - rec["start"] < 2 * DEADLINE_S, (r, rec["step"], rec["end"] - rec["start"])
