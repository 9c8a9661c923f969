"""`fthsdp ray --address` on an existing multi-node local cluster, and `--kill-node`.

The cluster is built as a user builds one on this machine: `ray start --head`
(no CPUs: the driver and the lighthouse only) and `ray start --address` for two
worker nodes of two CPUs each, so the three replicas are spread 2 + 1 over them.
`--kill-node 1@STEP` SIGKILLs the raylet of replica 1's node: every replica on
it dies with it. When a third worker node joins once the node is gone, the
replacements are placed on a node other than the dead one, rejoin from the
survivor(s), and the job finishes with identical states; when none joins,
the one the surviving node has no room for is left out and the job goes on
with fewer replicas, saying so. The cluster's processes (found by its temp dir, and their children)
are SIGKILLed at the end.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from fthsdp.logs import read_metrics

from test_ray import PACED, ray_processes

pytest.importorskip("ray")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RAY = str(pathlib.Path(sys.executable).with_name("ray"))
STEPS = 240


def _env(token: str) -> dict:
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
            # the cluster notices a lost node within ~3 s instead of ~15 s
            "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
            "RAY_health_check_timeout_ms": "1000"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_cluster(temp_dir: str) -> None:
    """SIGKILL of every process of this cluster (its command line names our temp dir) and their children."""
    pids = {int(line.split()[0]) for line in ray_processes(temp_dir)} - {os.getpid()}
    kids = set()
    for pid in pids:
        r = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
        kids |= {int(x) for x in r.stdout.split()}
    for pid in (pids | kids) - {os.getpid()}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def cluster():
    temp_dir = tempfile.mkdtemp(prefix="fr-")
    env = _env(secrets.token_hex(16))
    # Every node on loopback: a one-machine cluster must not listen on (or send to)
    # the machine's network address.
    common = ["--object-store-memory", str(80 * 1024 * 1024), "--disable-usage-stats",
              "--node-ip-address", "127.0.0.1"]
    try:
        subprocess.run([RAY, "start", "--head", "--port", str(_free_port()), "--num-cpus", "0", "--temp-dir",
                        temp_dir, "--include-dashboard", "false", *common], env=env, check=True,
                       capture_output=True, timeout=120)
        address = pathlib.Path(temp_dir, "ray_current_cluster").read_text().strip()

        def add_node(cpus: int) -> None:
            subprocess.run([RAY, "start", "--address", address, "--num-cpus", str(cpus), *common], env=env,
                           check=True, capture_output=True, timeout=120)

        add_node(2)
        add_node(2)
        yield {"address": address, "env": env, "add_node": add_node, "temp_dir": temp_dir}
    finally:
        deadline = time.monotonic() + 30
        while ray_processes(temp_dir) and time.monotonic() < deadline:
            _kill_cluster(temp_dir)
            time.sleep(0.5)
        left = ray_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"the test cluster's processes survived SIGKILL: {left}"


def _ended(job: subprocess.Popen, tmp_path: pathlib.Path) -> str:
    """The job's log once it ended on its own, asserted a success."""
    rc = job.wait(420)
    log = (tmp_path / "run.stderr").read_text()
    assert rc == 0, log[-4000:]
    return log


def _stop(job: subprocess.Popen, stderr) -> None:
    if job.poll() is None:
        job.kill()
        job.wait(30)
    stderr.close()


@pytest.mark.parametrize("new_node", [True, False], ids=["replaced_on_a_new_node", "no_room_goes_on_fewer"])
def test_kill_node(tmp_path, cluster, new_node):
    """new_node: a node joins after the loss (the replacements go there), and a relay runs beside
    each replica (launch.relays=3, launch.relay_placement=replicas): replica 1's, on the lost node,
    is placed again with its replacement; else there is no room for them and the job goes on with
    the survivors, saying so."""
    out = tmp_path / "run"
    # without room, the placement deadline (ft.startup_timeout_s) must end well before the job does
    steps, timeout = (STEPS, 60) if new_node else (2 * STEPS, 20)
    relays = ["launch.relays=3", "launch.relay_placement=replicas"] if new_node else []
    cmd = [sys.executable, "-m", "fthsdp.cli", "ray", "--no-progress", "--address", cluster["address"],
           "--out-dir", str(out), "--config", "base", "--replicas", "3", "--devices-per-replica", "1",
           "--kill-node", "1@20", *PACED, f"train.steps={steps}", f"ft.startup_timeout_s={timeout}", *relays]
    stderr = open(tmp_path / "run.stderr", "w")
    job = subprocess.Popen(cmd, stdout=stderr, stderr=subprocess.STDOUT, env=cluster["env"])
    try:
        # once the node is gone, a fresh node joins: room for the replacements
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and job.poll() is None:
            evs = read_metrics(out / "events.jsonl") if (out / "events.jsonl").exists() else []
            if any(e["kind"] == "kill" and e.get("how") == "node" for e in evs):
                if new_node:
                    cluster["add_node"](2)
                break
            time.sleep(0.5)
        log = _ended(job, tmp_path)
    finally:
        _stop(job, stderr)

    events = read_metrics(out / "events.jsonl")
    (kill,) = [e for e in events if e["kind"] == "kill"]
    assert kill["how"] == "node" and kill["replica"] == 1 and "raylet" in kill["raylet"]
    dead_node = kill["node"]
    placed: dict[int, list[dict]] = {}
    for e in events:
        if e["kind"] == "placed":
            placed.setdefault(e["replica"], []).append(e)
    lost = {r for r, ps in placed.items() if ps[0]["node"] == dead_node}
    assert 1 in lost and len(lost) <= 2  # two CPUs a node: replica 1 and at most one other
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_final_state"], summary["final_hashes"]
    if not new_node:
        # the surviving node (2 CPUs) has room for len(lost) - 1 of them: those are placed there
        # and rejoin; the one left over is left out and the others finish the job without it
        unplaced = {e["replica"] for e in events if e["kind"] == "unplaced"}
        assert len(unplaced) == 1 and unplaced <= lost, (unplaced, lost)
        assert set(summary["unplaced_replicas"]) == {str(r) for r in unplaced}
        for r in lost - unplaced:
            assert len(placed[r]) == 2 and placed[r][1]["node"] != dead_node, placed[r]
        assert set(summary["final_hashes"]) == {str(r) for r in set(placed) - unplaced}
        assert set(summary["final_steps"].values()) == {steps}
        assert "cannot be placed" in log and "the job goes on with" in log
        return
    for r in lost:
        # the group was placed again, on a live node, and the replica rejoined
        assert len(placed[r]) == 2 and placed[r][1]["node"] != dead_node, placed[r]
    # Each relay started on the node of the replica (relay i: replica i) whose placement started it;
    # one on the lost node (replica 1's, and the other lost replica's if any) was not restarted there
    # but placed again with its replica's replacement.
    starts: dict[int, list[dict]] = {}
    for e in events:
        if e["kind"] == "relay":
            starts.setdefault(e["index"], []).append(e)
    assert sorted(starts) == [0, 1, 2] and all(ss[0]["with_replica"] == i for i, ss in starts.items()), starts
    node_at = {(e["replica"], k): e["node"] for r in placed for k, e in enumerate(placed[r])}
    for i, ss in starts.items():
        for k, s in enumerate(ss):
            assert s["node"] == node_at[(s["with_replica"], k)], (s, placed)
    lost_relays = [e for e in events if e["kind"] == "relay_lost"]
    for i, ss in starts.items():
        if ss[0]["node"] == dead_node:
            assert [e["index"] for e in lost_relays].count(i) == 1 and len(ss) == 2, (i, ss, lost_relays)
            assert ss[1]["node"] != dead_node and ss[1]["with_replica"] in lost, ss
            assert "its node is gone" in next(e for e in lost_relays if e["index"] == i)["reason"]
        else:
            assert len(ss) == 1 and i not in [e["index"] for e in lost_relays], (i, ss, lost_relays)
    assert 1 in [e["index"] for e in lost_relays] and "died with its node" in log
    carried = {e["index"]: e for e in events if e["kind"] == "relay_stopped"}  # the last of each relay
    assert sorted(carried) == [0, 1, 2] and all(c["clients"] >= 1 and c["replies_down"] >= 50
                                                for c in carried.values()), carried
    assert {e["index"] for e in lost_relays} == {i for i in starts if i in lost}
    for r in set(placed) - lost:
        assert len(placed[r]) == 1
    assert set(summary["final_hashes"]) == {"0", "1", "2"}
    assert set(summary["final_steps"].values()) == {steps}
    assert "final state identical on every finishing replica (3): yes" in log


def _parent(pid: int) -> int:
    return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def test_a_relay_lost_with_its_node_is_placed_again_and_its_survivors_move_to_it(tmp_path, cluster):
    """launch.relays=1, launch.relay_placement=replicas: the one relay runs on the node of the first
    replica placed. That node is lost as a machine is (its raylet SIGKILLed from outside the job,
    not a fault the launcher planned) and a fresh node joins: the relay is placed again with the
    first replacement, and the replicas that survived on the other node, which spoke to the
    lighthouse directly meanwhile, are told its new address and move to it."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fthsdp.cli", "ray", "--no-progress", "--address", cluster["address"],
           "--out-dir", str(out), "--config", "base", "--replicas", "3", "--devices-per-replica", "1", *PACED,
           f"train.steps={STEPS}", "ft.startup_timeout_s=60", "launch.relays=1", "launch.relay_placement=replicas"]
    stderr = open(tmp_path / "run.stderr", "w")
    job = subprocess.Popen(cmd, stdout=stderr, stderr=subprocess.STDOUT, env=cluster["env"])
    try:
        deadline = time.monotonic() + 300
        relay, placed = None, {}
        while time.monotonic() < deadline and job.poll() is None:  # every replica placed, and training
            evs = read_metrics(out / "events.jsonl") if (out / "events.jsonl").exists() else []
            relay = next((e for e in evs if e["kind"] == "relay"), None)
            placed = {e["replica"]: e for e in evs if e["kind"] == "placed"}
            steps = [read_metrics(p)[-1].get("step", 0) for p in out.glob("metrics-*.jsonl") if p.stat().st_size]
            if relay is not None and len(placed) == 3 and len(steps) == 3 and min(steps) >= 20:
                break
            time.sleep(0.5)
        assert relay is not None and len(placed) == 3, f"the job did not start: {relay} {placed}"
        lost = {r for r, e in placed.items() if e["node"] == relay["node"]}
        survivors = set(placed) - lost
        assert relay["with_replica"] in lost and survivors, placed  # 2 CPUs a node: one survivor at least
        raylet = _parent(placed[relay["with_replica"]]["pid"])
        assert "raylet" in pathlib.Path(f"/proc/{raylet}/cmdline").read_text()
        os.kill(raylet, signal.SIGKILL)
        cluster["add_node"](2)
        _ended(job, tmp_path)
    finally:
        _stop(job, stderr)
    events = read_metrics(out / "events.jsonl")
    (gone,) = [e for e in events if e["kind"] == "relay_lost"]
    assert gone["index"] == 0 and gone["node"] == relay["node"] and "its node is gone" in gone["reason"]
    starts = [e for e in events if e["kind"] == "relay"]
    assert len(starts) == 2 and starts[1]["node"] != relay["node"] and starts[1]["with_replica"] in lost, starts
    (moved,) = [e for e in events if e["kind"] == "relay_moved"]
    assert moved["address"] == starts[1]["address"] and set(moved["replicas"]) == survivors, moved
    for r in survivors:  # each moved to the new relay (its client's log line)
        assert f"its relay is now {moved['address']}" in (out / f"replica-{r}.log").read_text()
    # the new relay carried the survivors and the replacements: every replica's process
    (carried,) = [e for e in events if e["kind"] == "relay_stopped"]
    assert carried["clients"] >= 3 and carried["replies_down"] >= 50, carried
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_final_state"] and set(summary["final_steps"].values()) == {STEPS}, summary
