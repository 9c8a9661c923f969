"""A replica of several processes (issue 11): one JAX runtime per replica, FSDP over its
global mesh, the leader's decision channel.

Real processes: two processes forming one replica's runtime (gloo CPU collectives,
coordinator on an emulated host address) take two FSDP steps on arrays that are
not fully addressable and must reach bitwise the state a one-process replica with
the same devices reaches (state_hash gathers across processes); the leader's
decisions and the followers' addresses cross the runtime's key-value store; a
follower waiting for a dead leader fails within its deadline.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from fthsdp.replica.group import ENV, GroupSpec

WORKER = pathlib.Path(__file__).parent / "group_workers" / "one_step.py"


def test_group_spec_from_flags_and_env():
    env = {ENV["replica_id"]: "4", ENV["process_index"]: "1", ENV["num_processes"]: "2",
           ENV["coordinator"]: "[::1]:4000"}
    s = GroupSpec.from_env(env)
    assert (s.replica_id, s.process_index, s.num_processes, s.coordinator, s.is_leader, s.label) == \
        (4, 1, 2, "[::1]:4000", False, "4.1")
    assert GroupSpec.from_env(env, process_index=0).is_leader  # a flag wins over the environment
    assert GroupSpec.from_env({}, replica_id=2).label == "2"  # one process: the replica's id, as before
    for kwargs, env2, msg in [({}, {}, "no replica id"),
                              ({"replica_id": 0, "num_processes": 2}, {}, "needs its coordinator"),
                              ({"replica_id": 0, "process_index": 2, "num_processes": 2, "coordinator": "h:1"}, {},
                               "outside 0..1"),
                              ({}, {ENV["replica_id"]: "x"}, "must be an integer"),
                              ({"replica_id": 0, "num_processes": 2, "coordinator": "::1:5"}, {}, "brackets")]:
        with pytest.raises(ValueError, match=msg):
            GroupSpec.from_env(env2, **kwargs)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _run(tmp: pathlib.Path, nproc: int, devices: int, *extra: str, cache: pathlib.Path | None = None) -> list[dict]:
    coord = f"127.0.0.2:{_free_port('127.0.0.2')}" if nproc > 1 else ""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **({"FTHSDP_COMPILATION_CACHE": str(cache)} if cache else {})}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp / f"p{i}.json"), str(i), str(nproc), coord,
                               str(devices), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, start_new_session=True) for i in range(nproc)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    return [json.loads((tmp / f"p{i}.json").read_text()) if (tmp / f"p{i}.json").exists() else
            {"missing": outs[i][-3000:] if i < len(outs) else ""} for i in range(nproc)]


@pytest.mark.multiprocess
def test_two_processes_form_one_replica_bitwise_equal_to_one_process(tmp_path):
    (tmp_path / "one").mkdir()
    (ref,) = _run(tmp_path / "one", 1, 2)
    cache = tmp_path / "cache"  # empty: both processes compile; JAX's cache keeps only the leader's programs
    group = _run(tmp_path, 2, 1, cache=cache)
    assert all("missing" not in g for g in group), group
    assert group[0]["own_programs"] == {"loaded": 0, "compiled": 0}  # process 0: JAX's cache serves it
    assert group[1]["own_programs"] == {"loaded": 0, "compiled": 3}  # init, compute_grads, apply_grads
    # Started again, the follower loads its programs instead of compiling them, with the same results.
    (tmp_path / "again").mkdir()
    again = _run(tmp_path / "again", 2, 1, cache=cache)
    assert again[1].get("own_programs") == {"loaded": 3, "compiled": 0}, again
    for g in again:
        assert (g["hash0"], g["hash2"], g["loss"], g["compilations"]) == (ref["hash0"], ref["hash2"], ref["loss"],
                                                                           [1, 1])
    assert ref["mesh_devices"] == 2 and ref["fully_addressable"]
    for g in group:
        assert g["processes"] == 2 and g["mesh_devices"] == 2 and not g["fully_addressable"]
        # the same state, bitwise, after init and after two FSDP steps across processes
        assert (g["hash0"], g["hash2"], g["loss"]) == (ref["hash0"], ref["hash2"], ref["loss"])
        assert g["committed"] and g["compilations"] == [1, 1]
        assert g["quorum"] == {"quorum_id": 7, "members": ["0", "3"]}  # the leader's decision, replayed
    assert group[0]["gathered"] == [["ftar-of-0"], ["ftar-of-1"]] and group[1]["gathered"] is None
    # per-shard recovery: each process's own shards are about half the state, and put back onto its
    # devices they rebuild the same state bitwise (the one-process replica's parts are the whole state)
    assert ref["local_bytes"] == ref["state_bytes"] and ref["rebuilt_hash"] == ref["hash2"]
    for g in group:
        assert g["like_matches"] and g["rebuilt_hash"] == ref["hash2"]
        assert 0.45 < g["local_bytes"] / g["state_bytes"] < 0.6, (g["local_bytes"], g["state_bytes"])
    assert "the leader is dead or hung" in group[1]["timeout"] and 0.9 <= group[1]["timeout_s"] < 10


@pytest.mark.multiprocess
def test_a_follower_whose_leader_died_fails_within_its_deadline(tmp_path):
    t0 = time.monotonic()
    _, follower = _run(tmp_path, 2, 1, "kill_leader")
    took = time.monotonic() - t0
    if "missing" in follower:
        # the runtime noticed first and aborted the follower (its coordinator vanished): a unit failure too
        assert "JAX distributed service detected fatal errors" in follower["missing"], follower["missing"]
    else:
        assert follower["error"] and "no 'quorum' decision" in follower["error"], follower
        assert follower["waited_s"] < 10, follower
    assert took < 120, f"the follower outlived its dead leader by {took:.0f}s"


@pytest.mark.multiprocess
def test_per_shard_recovery_between_two_replicas_of_two_processes(tmp_path):
    """Replica 1's process p fetches only its own shards, and only from process p of replica 0,
    over real peer servers: about half of the state per process, and the whole state rebuilt
    bitwise on replica 1 (its own initial state was different)."""
    worker = pathlib.Path(__file__).parent / "group_workers" / "peer_shards.py"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    coords = {r: f"127.0.0.{2 + r}:{_free_port(f'127.0.0.{2 + r}')}" for r in (0, 1)}
    procs = {}
    for r in (0, 1):
        (tmp_path / "shared").mkdir(exist_ok=True)
        for i in (0, 1):
            procs[(r, i)] = subprocess.Popen(
                [sys.executable, str(worker), str(tmp_path / f"r{r}p{i}.json"), str(r), str(i), coords[r],
                 str(tmp_path / "shared")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                start_new_session=True)
    outs = {}
    try:
        for k, p in procs.items():
            outs[k] = p.communicate(timeout=300)[0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)
    res = {}
    for r in (0, 1):
        for i in (0, 1):
            path = tmp_path / f"r{r}p{i}.json"
            assert path.exists(), outs.get((r, i), "")[-3000:]
            res[(r, i)] = json.loads(path.read_text())
    assert res[(0, 0)]["hash"] != res[(1, 0)]["hash"]  # replica 1 started elsewhere
    for i in (0, 1):
        got, served = res[(1, i)], res[(0, i)]
        assert got["fetched_hash"] == res[(0, 0)]["hash"]  # the whole state, bitwise, from the two halves
        assert got["source"] == served["url"]  # process i fetched from process i of replica 0
        assert 0.45 < got["fetched_bytes"] / got["state_bytes"] < 0.6, got
        assert served["served"]["bytes_served"] >= 0.45 * got["state_bytes"], served
        assert served["served"]["bytes_served"] < 0.6 * got["state_bytes"], served


def _kv_pair():
    """The key-value store a replica's processes share (jax.distributed's own coordination
    service, real gRPC on loopback), with one client per process: (service, [leader, follower])."""
    import threading

    from jax._src.lib import _jax as xe

    addr = f"127.0.0.1:{_free_port('127.0.0.1')}"
    service = xe.get_distributed_runtime_service(addr, 2)
    clients = [xe.get_distributed_runtime_client(addr, i, init_timeout=20) for i in range(2)]
    threads = [threading.Thread(target=c.connect) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return service, clients


def _kv_shutdown(service, clients) -> None:
    """Ends :func:`_kv_pair`'s store: each client's shutdown waits for the others (a barrier), so
    they go from threads, then the service."""
    import threading

    for c in clients:
        threading.Thread(target=c.shutdown, daemon=True).start()
    time.sleep(0.2)
    service.shutdown()


def test_followers_learn_the_leaders_forked_verdict_at_leave():
    """The lighthouse judges a leaving replica's final state forked (its last quorum's steps were
    re-decided by a quorum it was not in): the leader's client records it, and each follower of
    the replica must end the same way (its ledger's commits rolled back, no "done" record). The
    verdict reaches the follower through the leader's decision channel; a follower whose leader
    never says goodbye claims nothing."""
    import threading

    from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
    from fthsdp.control.lighthouse_client import LighthouseClient
    from fthsdp.replica.group import DecisionChannel, FollowerQuorumSource, LeaderQuorumSource
    from test_lineage_lighthouse import DETECT_S, fork

    service, (kv0, kv1) = _kv_pair()
    spec = dict(replica_id=0, num_processes=2, coordinator="127.0.0.1:1")
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.2, detect_s=DETECT_S)) as lh:
        clients = [LighthouseClient(lh.address, "job", i) for i in range(3)]
        own = LighthouseClient(lh.address, "job", 0, process_index=1, num_processes=2)  # the follower's own client
        try:
            fork(clients)  # replica 0's last quorum (2) committed step 1; quorum 3 re-decided it
            leader = LeaderQuorumSource(clients[0], DecisionChannel(GroupSpec(process_index=0, **spec), client=kv0))
            follower = FollowerQuorumSource(DecisionChannel(GroupSpec(process_index=1, **spec), client=kv1), 10.0, own)
            got = {}
            t = threading.Thread(target=lambda: got.setdefault("left", follower.leave(3, finished=True)))
            t.start()  # the follower reaches its end first and waits for its leader's goodbye
            assert leader.leave(3, finished=True)
            t.join(15)
            assert leader.forked is not None and leader.forked[0] == 1, leader.forked
            assert got["left"] is True and follower.forked == leader.forked, (follower.forked, leader.forked)
            assert "re-decided step 1" in follower.forked[1]
            # The lineage's holder is not forked, and its leave ends the job as before.
            assert clients[2].leave(3, finished=True) and clients[2].forked is None
            # A follower whose leader died before its goodbye: no verdict, nothing claimed forked.
            lone = FollowerQuorumSource(DecisionChannel(GroupSpec(process_index=1, **spec), namespace="other",
                                                        client=kv1), 0.3, own)
            assert lone.leave(3) is False and lone.forked is None
        finally:
            for c in [*clients, own]:
                c.close()
            _kv_shutdown(service, (kv0, kv1))


def test_a_followers_accusation_reaches_the_lighthouse_through_its_leader():
    """A follower process caught a ring neighbour (replica 2) breaking FTAR's protocol on its own
    shard's ring. Only the leader asks the lighthouse, so the follower leaves its accusation in
    the replica's mailbox (jax.distributed's key-value store, real gRPC on loopback) and the
    leader sends it with its next quorum request: the lighthouse leaves replica 2 out. Before,
    a follower's accusations were dropped, and a faulty neighbour on a follower's ring failed
    every attempt of every replica on it until they ran out of retries."""
    from concurrent.futures import ThreadPoolExecutor

    from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
    from fthsdp.replica.group import DecisionChannel, FollowerQuorumSource, LeaderQuorumSource
    from test_lighthouse_processes import beat_until_registered, clients, ftar, server

    service, (kv0, kv1) = _kv_pair()
    spec = dict(replica_id=0, num_processes=2, coordinator="127.0.0.1:1")
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.3, detect_s=1.0, tick_s=0.02)) as lh:
        cs = clients(lh.address, "job", 3, 2, 1)  # 3 replicas x 2 processes x 1 device
        try:
            beat_until_registered(cs)
            leader = LeaderQuorumSource(cs[(0, 0)], DecisionChannel(GroupSpec(process_index=0, **spec), client=kv0))
            follower_channel = DecisionChannel(GroupSpec(process_index=1, **spec), client=kv1)
            follower = FollowerQuorumSource(follower_channel, 20.0, cs[(0, 1)])
            sources = {0: leader, 1: cs[(1, 0)], 2: cs[(2, 0)]}

            def ask(r, step, **kw):
                return sources[r].get_quorum(step, ftar_addresses=ftar(r, 0, 1), state_server_address=server(r, 0),
                                             num_replicas=3, timeout_s=20, **kw)

            with ThreadPoolExecutor(4) as ex:
                others = [ex.submit(ask, r, 0) for r in (1, 2)]
                followed = ex.submit(follower.get_quorum, 0)
                q = ask(0, 0)
                assert q.member_ids == ("0", "1", "2") and followed.result(20).quorum_id == q.quorum_id
                [f.result(20) for f in others]
                # the step failed; the follower's ring saw replica 2 break the protocol
                accused = ex.submit(ask, 2, 0, commit_failed=True)
                time.sleep(0.1)
                other = ex.submit(ask, 1, 0, commit_failed=True)
                followed = ex.submit(follower.get_quorum, 0, accused=["2"])
                deadline = time.monotonic() + 10
                while not kv0.key_value_dir_get(follower_channel.mailbox("accused")):
                    assert time.monotonic() < deadline, "the follower's accusation never reached the mailbox"
                    time.sleep(0.01)
                q0 = ask(0, 0, commit_failed=True)  # the leader accuses nobody itself
                assert q0.member_ids == other.result(20).member_ids == ("0", "1"), q0
                assert "excluded [2]" in q0.reason and followed.result(20).quorum_id == q0.quorum_id
                assert not accused.done()  # left out of this quorum
                assert not kv0.key_value_dir_get(follower_channel.mailbox("accused"))  # taken once
                assert leader.channel.collect("accused") == []
                # the survivors commit step 0; the accused rejoins at step 1
                other = ex.submit(ask, 1, 1)
                followed = ex.submit(follower.get_quorum, 1)
                q1 = ask(0, 1)
                assert accused.result(20).member_ids == q1.member_ids == ("0", "1", "2")
                other.result(20)
                followed.result(20)
        finally:
            for c in cs.values():
                c.close()
            _kv_shutdown(service, (kv0, kv1))


def test_a_passing_view_error_costs_the_follower_one_step_not_its_replica():
    """A follower's GetView that fails with a passing error (a deadline, a budget's
    RESOURCE_EXHAUSTED) took the step without its view (the replica's commit vote fails and its
    leader asks again) instead of failing the replica as a unit, which the leader's own quorum
    request would have retried; a lighthouse unreachable past its allowance still ends it."""
    import grpc

    from fthsdp.control import quorum as qm
    from fthsdp.control.lighthouse_client import CredentialRefused, LighthouseError, LighthouseUnavailable
    from fthsdp.replica.group import DecisionChannel, FollowerQuorumSource, ViewUnavailable, quorum_to_json

    class Client:  # the follower's own lighthouse client, as far as get_quorum uses it
        replica_id, process_index = "0", 1
        error: Exception

        def set_step(self, step):
            pass

        def get_view(self, quorum_id):
            raise self.error

    service, (kv0, kv1) = _kv_pair()
    spec = dict(replica_id=0, num_processes=2, coordinator="127.0.0.1:1")
    try:
        leader = DecisionChannel(GroupSpec(process_index=0, **spec), client=kv0)
        client = Client()
        follower = FollowerQuorumSource(DecisionChannel(GroupSpec(process_index=1, **spec), client=kv1), 20.0, client)
        member = qm.Member("0", 3, ("127.0.0.1:7000",), "http://127.0.0.1:7100", 1)
        for qid, error in ((5, LighthouseError("GetView: RESOURCE_EXHAUSTED: held by a budget",
                                               grpc.StatusCode.RESOURCE_EXHAUSTED)),
                           (6, LighthouseError("GetView: DEADLINE_EXCEEDED", grpc.StatusCode.DEADLINE_EXCEEDED))):
            client.error = error
            leader.share("quorum", quorum_to_json(qm.Quorum(qid, (member,), 3, ("0",), ())), 0)
            q = follower.get_quorum(3)
            assert q.quorum_id == qid and q.rings == () and "no view of quorum" in follower.missing_view
        client.error = LighthouseUnavailable("cannot reach the lighthouse for 61s", grpc.StatusCode.UNAVAILABLE)
        leader.share("quorum", quorum_to_json(qm.Quorum(7, (member,), 3, ("0",), ())), 0)
        with pytest.raises(ViewUnavailable, match="replica fails as a unit"):
            follower.get_quorum(3)
        # the job's own verdicts stand for the replica: a refused credential is job-fatal (78), not a
        # replica restart into the same refusal
        client.error = CredentialRefused("GetView refused: the credential does not verify",
                                         grpc.StatusCode.UNAUTHENTICATED)
        leader.share("quorum", quorum_to_json(qm.Quorum(8, (member,), 3, ("0",), ())), 0)
        with pytest.raises(CredentialRefused):
            follower.get_quorum(3)
    finally:
        _kv_shutdown(service, (kv0, kv1))


def test_a_follower_leaving_on_its_own_fault_does_not_wait_for_its_leader():
    """On a fault, a follower waited up to its whole decision timeout (five minutes) for its
    leader's leave verdict, which a leader waiting for it in a collective never publishes; the
    replica stayed out of the job meanwhile. It now stops beating and goes at once."""
    from fthsdp.replica.group import DecisionChannel, FollowerQuorumSource

    service, (kv0, kv1) = _kv_pair()
    stopped = []
    client = type("Client", (), {"stop_heartbeats": lambda self: stopped.append(True)})()
    try:
        spec = dict(replica_id=0, num_processes=2, coordinator="127.0.0.1:1")
        follower = FollowerQuorumSource(DecisionChannel(GroupSpec(process_index=1, **spec), client=kv1), 300.0, client)
        t0 = time.monotonic()
        follower.abandon(7)
        assert stopped == [True] and time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        follower.timeout_s = 1.0
        assert follower.leave(7) is False and time.monotonic() - t0 >= 0.9  # leave() waits for the verdict
    finally:
        _kv_shutdown(service, (kv0, kv1))


def test_a_followers_step0_verdict_is_its_leaders():
    """A replica restarted to rejoin, at step 0: whether to train, wait or give up is taken on the
    leader's clock for every process (each on its own could cross the grace on different attempts
    and the group exit with mixed codes), through the replica's real key-value store."""
    import threading

    from fthsdp.replica.group import DecisionChannel, FollowerQuorumSource, LeaderQuorumSource, ViewUnavailable

    service, (kv0, kv1) = _kv_pair()
    spec = dict(replica_id=0, num_processes=2, coordinator="127.0.0.1:1")
    try:
        leader = LeaderQuorumSource(None, DecisionChannel(GroupSpec(process_index=0, **spec), client=kv0))
        follower = FollowerQuorumSource(DecisionChannel(GroupSpec(process_index=1, **spec), client=kv1), 10.0, None)
        for qid, (mine, leaders) in enumerate((("wait", "wait"), ("wait", "give up"), ("give up", "train"))):
            got = {}
            t = threading.Thread(target=lambda: got.setdefault("v", follower.step0_verdict(mine, "own clock", 0, qid)))
            t.start()  # the follower asks first and waits for its leader's verdict
            assert leader.step0_verdict(leaders, "the leader's clock", 0, qid) == (leaders, "the leader's clock")
            t.join(15)
            assert got["v"] == (leaders, "the leader's clock"), got
        leader.step0_verdict("wait", "x", 0, 7)  # a verdict on another quorum than the follower's
        with pytest.raises(ViewUnavailable, match="on step 0 of quorum 7, this process's on step 0 of quorum 8"):
            follower.step0_verdict("wait", "x", 0, 8)
        kv0.key_value_set("fthsdp/r0/step0/4", '"train"')  # a leader's malformed verdict: the replica fails
        with pytest.raises(ViewUnavailable, match="not \\[verdict, why, step, quorum id\\]"):
            follower.step0_verdict("wait", "x", 0, 9)
    finally:
        _kv_shutdown(service, (kv0, kv1))
