"""`fthsdp ray`: the fault-tolerant job on a real local Ray cluster, faults through Ray.

The end-to-end test runs `fthsdp ray` as a user does (a subprocess that
starts a fresh local cluster with `ray.init()`): three replicas of one device,
one replica's actor `ray.kill`ed mid-run and another's worker process
SIGKILLed. The pure parts (placement, the lighthouse's address, the fault
flags) are tested without a cluster.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from fthsdp.data.ledger import check_exactly_once
from fthsdp.launch import report
from fthsdp.launch.ray import cluster_cpus_needed, parse_ray_kills, placement_for
from fthsdp.launch.ray_actors import node_host
from fthsdp.logs import read_metrics

from test_fault_tolerance import TINY

ray = pytest.importorskip("ray")

PACED = TINY + ["ft.checkpoint_every=10", "train.min_step_s=0.1"]
STEPS = 200  # long enough (>= 17 s paced) for a replacement to start and rejoin on a loaded machine


# -- pure parts -----------------------------------------------------------------------------


def test_placement_is_one_bundle_per_process_sized_by_devices():
    # devices per process (launch.devices_per_replica), one bundle per process
    assert placement_for(1, 1, cluster_gpus=0).bundles == [{"CPU": 1.0}]
    assert placement_for(2, 2, cluster_gpus=0).bundles == [{"CPU": 2.0}, {"CPU": 2.0}]
    assert placement_for(4, 2, cluster_gpus=8).bundles == [{"CPU": 1.0, "GPU": 4.0}] * 2
    assert placement_for(2, 1, cluster_gpus=1).bundles == [{"CPU": 2.0}]  # too few GPUs for one process
    with pytest.raises(ValueError, match="got 2 x 0"):
        placement_for(0, 2, cluster_gpus=0)
    assert cluster_cpus_needed(3, 1) == 5  # the bundles and room for two replacements
    assert cluster_cpus_needed(2, 1, processes=2) == 8


def test_lighthouse_listens_on_loopback_on_one_machine_else_on_the_driver_node():
    one = [{"NodeID": "a", "Alive": True, "NodeManagerHostname": "h", "NodeManagerAddress": "10.0.0.1"},
           {"NodeID": "b", "Alive": True, "NodeManagerHostname": "h", "NodeManagerAddress": "10.0.0.1"}]
    assert node_host(one, "a") == "127.0.0.1"
    two = [one[0], {"NodeID": "b", "Alive": True, "NodeManagerHostname": "g", "NodeManagerAddress": "10.0.0.2"}]
    assert node_host(two, "a") == "10.0.0.1"
    dead = [one[0], {**two[1], "Alive": False}]
    assert node_host(dead, "a") == "127.0.0.1"


def test_an_actor_refuses_a_checkpoint_directory_it_does_not_share_with_the_driver(tmp_path, monkeypatch):
    """The default checkpoint directory is a path on the driver's machine: on another node it was
    created empty, and the job's checkpoints scattered across nodes. An actor must see the file
    the driver wrote there before it links it; the launcher reads its refusal as job-fatal."""
    import shutil

    from fthsdp.launch.ray_actors import NOT_SHARED, ReplicaActor

    monkeypatch.setenv("FTHSDP_COMPILATION_CACHE", str(tmp_path / "xla"))
    actor = ReplicaActor(0, {}, {}, None, f"{tmp_path.name}-")
    try:
        shared, elsewhere = tmp_path / "shared", tmp_path / "node-local"
        shared.mkdir()
        (shared / ".fthsdp-driver-x").write_text("")
        with pytest.raises(RuntimeError, match=f"{NOT_SHARED}: .*--checkpoint-dir a path every node mounts"):
            actor.link_checkpoints(str(elsewhere), ".fthsdp-driver-x", wait_s=0.3)
        assert not (actor.dir / "checkpoints").exists()
        actor.link_checkpoints(str(shared), ".fthsdp-driver-x")
        assert (actor.dir / "checkpoints").resolve() == shared.resolve()
    finally:
        shutil.rmtree(actor.dir, ignore_errors=True)


def test_ray_fault_flags_parse_and_refuse_bad_input():
    (f,) = parse_ray_kills(["1@40"], "kill_node", 3)
    assert (f.replica, f.step, f.kind) == (1, 40, "kill_node")
    with pytest.raises(ValueError, match="--kill-worker 'x': expected REPLICA@STEP"):
        parse_ray_kills(["x"], "kill_worker", 3)
    with pytest.raises(ValueError, match="replicas 0..2"):
        parse_ray_kills(["3@5"], "kill_node", 3)


def test_cli_refuses_a_bad_fault_flag_before_starting_ray():
    p = subprocess.run([sys.executable, "-m", "fthsdp.cli", "ray", "--config", "base", "--replicas", "3",
                        "--kill-node", "9@5"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "replicas 0..2" in p.stderr, p.stderr
    # a process the replica does not have: refused here, not raised out of the job at its step
    p = subprocess.run([sys.executable, "-m", "fthsdp.cli", "ray", "--config", "base", "--replicas", "2",
                        "--kill", "1.1@40"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "a replica has processes 0..0" in p.stderr, p.stderr


def test_a_checkpoint_dir_holding_an_earlier_runs_checkpoints_is_refused(tmp_path):
    """fthsdp ray cannot resume: a fallback would restore the earlier run's state as this job's."""
    from fthsdp.launch.ray import check_checkpoint_dir

    check_checkpoint_dir(str(tmp_path / "missing"))
    (tmp_path / "ckpt" / "100").mkdir(parents=True)
    (tmp_path / "ckpt" / ".fthsdp-owner").write_text("{}")
    with pytest.raises(ValueError, match=r"holds checkpoints of an earlier run \(steps \[100\]\)"):
        check_checkpoint_dir(str(tmp_path / "ckpt"))


# -- a real local cluster ---------------------------------------------------------------------


def ray_processes(marker: str) -> list[str]:
    """Processes of this machine whose command line names `marker` (our cluster's temp dir)."""
    ps = subprocess.run(["ps", "-eww", "-o", "pid,stat,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in ps if marker in line and "ps -eww" not in line and line.split()[1][:1] != "Z"]


def fthsdp_ray(out: pathlib.Path, temp_dir: str, *args: str, timeout: float = 480) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fthsdp.cli", "ray", "--no-progress", "--out-dir", str(out), *args]
    if "--address" not in args:
        cmd[4:4] = ["--temp-dir", temp_dir]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    (out.parent / f"{out.name}.stderr").write_text(p.stderr)
    return p


@pytest.fixture
def short_tmp():
    """Ray's sockets live under its temp dir: the path must stay short (AF_UNIX limit)."""
    d = tempfile.mkdtemp(prefix="fr-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.multiprocess
def test_ray_kill_and_worker_sigkill_replicas_are_replaced_and_rejoin(tmp_path, short_tmp):
    out = tmp_path / "run"
    p = fthsdp_ray(out, short_tmp, "--config", "base", "--replicas", "3", "--devices-per-replica", "1",
                   "--kill", "1@15", "--kill-worker", "2@30", "--kill-relay", "45", *PACED, f"train.steps={STEPS}",
                   "launch.lighthouse_connection_calls_per_s=333", "launch.relays=2",
                   "launch.relay_placement=replicas")
    assert p.returncode == 0, p.stderr[-4000:]

    # The driver left nothing behind: no process of its cluster, no work directory.
    deadline = time.monotonic() + 30
    while ray_processes(short_tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    # (workers rename themselves "ray::..."; they exit with their raylet, which names our temp dir.
    # Other clusters on the machine, e.g. a parallel CI run, are not ours to count.)
    assert ray_processes(short_tmp) == [], ray_processes(short_tmp)
    assert not list(pathlib.Path(tempfile.gettempdir()).glob("fthsdp-ray-*-r*"))

    events = read_metrics(out / "events.jsonl")
    kills = {e["replica"]: e for e in events if e["kind"] == "kill"}
    assert kills[1]["how"] == "ray-kill" and kills[2]["how"] == "sigkill"
    # the lighthouse actor runs with the configured budget and serves its /metrics
    (lh,) = [e for e in events if e["kind"] == "lighthouse"]
    assert lh["connection_calls_per_s"] == 333.0 and lh["metrics_address"], lh
    # launch.relay_placement=replicas: each relay actor was started when the first replica of its
    # block (0-1, 2) was placed, on that replica's node; every replica process's session went
    # through its block's relay; relay 0, killed, was restarted on its address and replicas 0 and 1
    # went on through it (its own count: the replacement's processes too)
    relays = {e["index"]: k for k, e in enumerate(events) if e["kind"] == "relay"}
    assert sorted(relays) == [0, 1] and events[relays[1]]["with_replica"] == 2
    assert events[relays[0]]["with_replica"] in (0, 1)
    for k in relays.values():  # started while that replica's group was placed, before its actors ran
        relay = events[k]
        first = next(j for j, e in enumerate(events) if e["kind"] == "placed" and e["replica"] == relay["with_replica"])
        assert k < first and not any(e["kind"] == "placed" for e in events[k:first]), events[k:first + 1]
        assert events[first]["node"] == relay["node"] and relay["address"].startswith("127.0.0.1:"), relay
    (restart,) = [e for e in events if e["kind"] == "relay_restart"]
    assert restart["index"] == 0
    carried = {e["index"]: e for e in events if e["kind"] == "relay_stopped"}
    assert carried[0]["clients"] >= 2 and carried[1]["clients"] >= 2, carried  # replica 2 and its replacement
    assert all(c["messages_up"] >= 100 and c["replies_down"] >= 100 for c in carried.values()), carried
    placed = {}
    for e in events:
        if e["kind"] == "placed":
            placed.setdefault(e["replica"], []).append(e["pid"])
    # each killed replica's group was placed again: a new actor process
    assert len(placed[1]) == 2 and len(placed[2]) == 2 and len(placed[0]) == 1, placed
    assert placed[1][0] != placed[1][1] and placed[2][0] != placed[2][1]
    assert kills[1]["pid"] == placed[1][0] and kills[2]["pid"] == placed[2][0]
    assert {e["replica"] for e in events if e["kind"] == "restart"} == {1, 2}

    # The report is fthsdp run's, from the records collected through Ray.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_final_state"], summary["final_hashes"]
    assert set(summary["final_hashes"]) == {"0", "1", "2"}
    assert set(summary["final_steps"].values()) == {STEPS}
    assert [f["replica"] for f in summary["failures"]] == ["1", "2"]
    assert (out / "timeline.png").stat().st_size > 10_000

    run = report.load_run(out)
    for rid in ("1", "2"):
        recs = run.steps[rid]
        after = [r for r in recs if r["start"] > kills[int(rid)]["time"]]
        # the replacement rejoined through peer fetch: its first record catches up, then it trains
        assert after and not after[0]["healthy"], after[:1]
        assert after[-1]["healthy"] and after[-1]["step"] == STEPS - 1
        assert {r["pid"] for r in after} == {placed[int(rid)][1]}
    (positions,) = {tuple(d["positions"]) for d in run.done.values()}
    rep = check_exactly_once(sorted((out / "ledger").glob("*.jsonl")), dict(enumerate(positions)))
    assert rep.ok, rep.summary()
    assert sum(positions) == rep.counted
    # the same closing lines as fthsdp run's
    assert "final state identical on every finishing replica (3): yes" in p.stderr
    assert "kill of replica 1 (at step 15): detected in" in p.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_lighthouse_actor_killed_is_restarted_on_its_address(tmp_path, short_tmp):
    out = tmp_path / "run"
    p = fthsdp_ray(out, short_tmp, "--config", "base", "--replicas", "2", "--devices-per-replica", "1",
                   "--kill-lighthouse", "20", *PACED, "train.steps=80")
    assert p.returncode == 0, p.stderr[-4000:]
    events = read_metrics(out / "events.jsonl")
    starts = [e for e in events if e["kind"] == "lighthouse"]
    # a new actor (another process) on the same address: the warm spare, created before the kill
    # and bound at it (launch.lighthouse_standby); the replicas reconnected and finished together
    assert len(starts) == 2 and starts[0]["address"] == starts[1]["address"]
    assert starts[0]["actor_pid"] != starts[1]["actor_pid"]
    assert [s["standby"] for s in starts] == [False, True], starts
    assert [e["kind"] for e in events].count("lighthouse_restart") == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_final_state"] and set(summary["final_steps"].values()) == {80}
    assert len(summary["lighthouse_restarts"]) == 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ray_replace_experiment_quick(tmp_path):
    out = tmp_path / "rr.json"
    p = subprocess.run([sys.executable, str(pathlib.Path(__file__).parents[1] / "experiments" / "ray_replace.py"),
                        "--quick", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(out.read_text())
    for k in ("local", "ray"):
        assert r[k]["identical_final_state"] and r[k]["first_commit_caught_up"]
        assert r[k]["replace_s"] > r[k]["restart_s"] > 0  # death -> restart -> first commit, in that order
        assert r[k]["stall_s"] is not None
    assert r["ray"]["placed_s"] > r["ray"]["restart_s"]
    assert set(r["targets"]) == {"stall_within_s", "stall_met", "replace_ratio_at_most", "replace_met"}
    assert out.with_suffix(".png").stat().st_size > 5_000


@pytest.mark.slow
@pytest.mark.multiprocess
def test_multi_process_replica_is_one_actor_per_process_and_replaced_as_a_group(tmp_path, short_tmp):
    """2 replicas x 2 processes x 1 device: one placement group of two bundles per replica, one actor
    per process; ray.kill of replica 1's follower takes the whole group down, and it is placed
    again (two new actors) and rejoins."""
    out = tmp_path / "run"
    p = fthsdp_ray(out, short_tmp, "--config", "base", "--replicas", "2", "--processes-per-replica", "2",
                   "--devices-per-replica", "1", "--kill", "1.1@15", *PACED, "train.steps=150")
    assert p.returncode == 0, p.stderr[-4000:]
    assert "placement [{'CPU': 1.0}, {'CPU': 1.0}]" in p.stderr
    events = read_metrics(out / "events.jsonl")
    (kill,) = [e for e in events if e["kind"] == "kill"]
    groups = [(e["time"], [q["pid"] for q in e["processes"]]) for e in events
              if e["kind"] == "placed" and e["replica"] == 1]
    # (a loaded machine may also lose a group at start-up; it is restarted like any death)
    before = [pids for t, pids in groups if t < kill["time"]][-1]
    after = [pids for t, pids in groups if t > kill["time"]]
    assert kill["process"] == 1 and kill["pid"] == before[1]  # the follower's actor
    assert len(before) == 2 and after and len(after[0]) == 2
    assert not set(before) & set(after[0])  # the whole group was replaced: two new actors
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_final_state"] and set(summary["final_steps"].values()) == {150}
    run = report.load_run(out)
    recs = [r for r in run.steps["1"] if r["start"] > kill["time"]]
    assert recs and not recs[0]["healthy"] and recs[-1]["step"] == 149  # it rejoined from its peer
    assert ray_processes(short_tmp) == []
