"""The lighthouse over real gRPC on loopback: in-process server thread and a real subprocess."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import (
    InvalidLighthouseRequest,
    JobNotFound,
    LighthouseClient,
    LighthouseError,
    LighthouseUnavailable,
    QuorumTimeout,
)
from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as load_stubs

pb2, pb2_grpc = load_stubs()

DETECT = 0.5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def lighthouse():
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.3, detect_s=DETECT)) as lh:
        yield lh


def addrs(rid: int, lws: int = 1) -> list[str]:
    return [f"127.0.0.1:{20000 + 10 * rid + k}" for k in range(lws)]


def make_clients(address: str, job: str, n: int, heartbeat: bool = True, **kw) -> list[LighthouseClient]:
    clients = [LighthouseClient(address, job, i) for i in range(n)]
    if heartbeat:
        for c in clients:
            c.start_heartbeats(**kw)
        time.sleep(0.15)  # every replica heard from before anyone asks
    return clients


def quorum_all(clients, steps, **kw):
    """Each client asks concurrently (as separate replicas do); returns their answers."""
    with ThreadPoolExecutor(len(clients)) as ex:
        futs = [
            ex.submit(c.get_quorum, s, ftar_addresses=addrs(int(c.replica_id), kw.get("lws", 1)),
                      state_server_address=f"127.0.0.1:{30000 + int(c.replica_id)}",
                      commit_failed=kw.get("failed", False), timeout_s=kw.get("timeout_s", 10.0))
            for c, s in zip(clients, steps)
        ]
        return [f.result() for f in futs]


def close_all(clients):
    for c in clients:
        c.close()


def test_three_replicas_form_one_quorum(lighthouse):
    clients = make_clients(lighthouse.address, "job", 3)
    try:
        qs = quorum_all(clients, [0, 0, 0])
        # identical answer for every member but its rings: each its own and its neighbours' endpoints
        assert all(dataclasses.replace(q, rings=()) == dataclasses.replace(qs[0], rings=()) for q in qs)
        q = qs[0]
        assert q.member_ids == ("0", "1", "2") and q.quorum_id == 1
        assert q.healthy == ("0", "1", "2") and q.behind == () and q.num_configured == 3
        for i, qi in enumerate(qs):  # in a ring of three, the neighbourhood is every member
            assert qi.ring_neighbours and qi.ring_addresses(str(i)) == [addrs(0), addrs(1), addrs(2)]
        assert q.member("2").state_server_address == "127.0.0.1:30002"
        [st] = clients[0].status()
        assert st.quorum.quorum_id == q.quorum_id and st.quorum.member_ids == q.member_ids
        assert st.quorum.member("1").ftar_addresses == tuple(addrs(1))  # Status: every endpoint
        assert [r.replica_id for r in st.replicas] == ["0", "1", "2"]
        assert not any(r.dead for r in st.replicas)
        assert all(0 <= r.last_heartbeat_age_s < DETECT for r in st.replicas)
    finally:
        close_all(clients)


def test_a_replica_id_of_non_ascii_digits_is_ordered_and_declared_dead_like_any_other(lighthouse):
    """"²" is a digit to str.isdigit() but not to int(): ordering the ring by it raised in the
    quorum decision, in failure detection (no replica of the job was declared dead again) and in
    Status (every caller). It is ordered as a name now: the job forms its quorum, Status reads,
    and the id is declared dead when it goes silent."""
    a, b = LighthouseClient(lighthouse.address, "odd", "0"), LighthouseClient(lighthouse.address, "odd", "²")
    try:
        for c in (a, b):
            c.start_heartbeats()
        time.sleep(0.15)
        with ThreadPoolExecutor(2) as ex:
            qs = list(ex.map(lambda c: c.get_quorum(0, ftar_addresses=["127.0.0.1:20001"], timeout_s=10.0), (a, b)))
        assert qs[0].member_ids == qs[1].member_ids == ("0", "²")
        b.close()  # silent from now on
        deadline = time.monotonic() + 10
        while not any(r.replica_id == "²" and r.dead for j in a.status() for r in j.replicas):
            assert time.monotonic() < deadline, "the silent replica was never declared dead"
            time.sleep(0.05)
    finally:
        a.close()
        b.close()


def test_silent_replica_declared_dead_and_reported_to_survivors(lighthouse):
    seen: dict[str, tuple[float, tuple[str, ...], int]] = {}
    lock = threading.Lock()

    def on_dead_for(rid):
        def cb(dead, quorum_id):
            with lock:
                seen.setdefault(rid, (time.monotonic(), dead, quorum_id))
        return cb

    clients = [LighthouseClient(lighthouse.address, "job", i) for i in range(3)]
    for c in clients:
        c.start_heartbeats(on_dead=on_dead_for(c.replica_id))
    time.sleep(0.15)
    try:
        q = quorum_all(clients, [0, 0, 0])[0]
        assert not seen  # nobody is dead while all heartbeat
        clients[2].stop_heartbeats()
        silent_since = time.monotonic()
        deadline = silent_since + DETECT + 1.0
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(seen) == {"0", "1"}, seen
        for rid, (t, dead, qid) in seen.items():
            assert dead == ("2",) and qid == q.quorum_id
            # detection within the window plus a heartbeat period and scheduling slack
            assert t - silent_since < DETECT + 0.35, (rid, t - silent_since)
            assert t - silent_since > DETECT - 0.15
        reply = clients[0].heartbeat()
        assert reply.dead_replica_ids == ("2",) and reply.dead_members == ("2",)
        [st] = clients[0].status()
        assert {r.replica_id: r.dead for r in st.replicas} == {"0": False, "1": False, "2": True}
        # The survivors form a new quorum at once (the dead replica is not waited for).
        t0 = time.monotonic()
        q2 = quorum_all(clients[:2], [1, 1], failed=True)[0]
        assert time.monotonic() - t0 < 0.25
        assert q2.member_ids == ("0", "1") and q2.quorum_id == q.quorum_id + 1
        assert clients[0].heartbeat().dead_members == ()  # the new quorum has no dead member
        clients[2].start_heartbeats()  # it comes back: no longer dead
        time.sleep(0.15)
        assert clients[0].heartbeat().dead_replica_ids == ()
    finally:
        close_all(clients)


def test_two_jobs_do_not_interfere(lighthouse):
    a = make_clients(lighthouse.address, "job-a", 2)
    b = make_clients(lighthouse.address, "job-b", 3)
    try:
        with ThreadPoolExecutor(2) as ex:
            fa = ex.submit(quorum_all, a, [7, 7])
            fb = ex.submit(quorum_all, b, [0, 0, 0])
            qa, qb = fa.result()[0], fb.result()[0]
        assert qa.member_ids == ("0", "1") and qa.max_step == 7 and qa.num_configured == 2
        assert qb.member_ids == ("0", "1", "2") and qb.max_step == 0 and qb.num_configured == 3
        assert qa.quorum_id == qb.quorum_id == 1  # ids are per job
        b[2].stop_heartbeats()  # a death in job b ...
        time.sleep(DETECT + 0.2)
        assert b[0].heartbeat().dead_replica_ids == ("2",)
        assert a[0].heartbeat().dead_replica_ids == ()  # ... is invisible to job a
        # job a keeps stepping on its own quorum, same id, no waiting for job b
        assert quorum_all(a, [8, 8])[0].quorum_id == 1
        jobs = {j.job_id: j for j in a[0].status(job_id="")}
        assert set(jobs) == {"job-a", "job-b"}
        assert [r.dead for r in jobs["job-b"].replicas] == [False, False, True]
    finally:
        close_all(a + b)


def test_behind_replica_gets_load_balanced_sources(lighthouse):
    clients = make_clients(lighthouse.address, "job", 4)
    try:
        qs = quorum_all(clients, [12, 12, 12, 3], lws=2)
        q = qs[3]
        assert q.max_step == 12 and q.healthy == ("0", "1", "2") and q.behind == ("3",)
        assert q.num_healthy == 3
        srcs = q.sources_for("3")
        assert len(srcs) == 2 and len(set(srcs)) == 2 and set(srcs) <= {"0", "1", "2"}
    finally:
        close_all(clients)


def test_quorum_id_stable_across_steps_and_changes_with_membership_or_commit_failure(lighthouse):
    clients = make_clients(lighthouse.address, "job", 3)
    two = clients[:2]
    try:
        clients[2].stop_heartbeats()  # replica 2 starts later
        time.sleep(DETECT + 0.1)
        ids = [quorum_all(two, [s, s])[0].quorum_id for s in range(3)]
        assert ids == [1, 1, 1]
        clients[2].start_heartbeats()
        clients[2].heartbeat(0)  # live at the lighthouse before the others ask (else they decide without it)
        q = quorum_all(clients, [3, 3, 0])[0]
        assert q.quorum_id == 2 and q.member_ids == ("0", "1", "2") and q.behind == ("2",)
        assert quorum_all(clients, [4, 4, 4])[0].quorum_id == 2
        q = quorum_all(clients, [4, 4, 4], failed=True)[0]
        assert q.quorum_id == 3 and "commit failed" in q.reason
        assert quorum_all(clients, [5, 5, 5])[0].quorum_id == 3
    finally:
        close_all(clients)


def test_deadline_gives_the_lighthouse_reason():
    with LighthouseThread(LighthouseConfig(min_replicas=2, detect_s=DETECT)) as lh:
        with LighthouseClient(lh.address, "job", 0) as c:
            t0 = time.monotonic()
            with pytest.raises(QuorumTimeout, match="min_replicas=2"):
                c.get_quorum(0, ftar_addresses=addrs(0), timeout_s=0.6)
            assert 0.4 < time.monotonic() - t0 < 1.5
            [st] = c.status()
            assert st.quorum is None and not any(r.waiting for r in st.replicas)


def raw_request(**over):
    fields = dict(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="job", replica_id="0", step=0,
                  ftar_addresses=addrs(0), local_world_size=1)
    fields.update(over)
    return pb2.QuorumRequest(**fields)


@pytest.mark.parametrize(
    "over,match",
    [
        ({"job_id": ""}, "job_id is empty"),
        ({"replica_id": ""}, "replica_id is empty"),
        ({"step": -1}, "step is -1"),
        ({"protocol_version": 7}, f"version 7, this lighthouse speaks {LIGHTHOUSE_PROTOCOL_VERSION}"),
        ({"protocol_version": 1}, "version 1, this lighthouse speaks"),  # a pre-(replica, process) client
        ({"process_index": 1, "num_processes": 2, "local_world_size": 2}, "only a replica's leader"),
        ({"num_processes": 2, "local_world_size": 3}, "not a multiple of num_processes 2"),
        ({"num_processes": 2, "local_world_size": 4}, "ftar_addresses has 1 entries but local_world_size is 4 over 2"),
        ({"protocol_version": 0}, "protocol_version is missing"),
        ({"local_world_size": 0, "ftar_addresses": []}, "local_world_size is 0"),
        ({"local_world_size": 2}, "ftar_addresses has 1 entries but local_world_size is 2"),
        ({"ftar_addresses": [""]}, "empty address"),
        ({"num_replicas": -3}, "num_replicas is -3"),
    ],
)
def test_invalid_quorum_request_is_invalid_argument(lighthouse, over, match):
    with grpc.insecure_channel(lighthouse.address) as ch:
        stub = pb2_grpc.LighthouseStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            stub.GetQuorum(raw_request(**over), timeout=5)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert match in ei.value.details()


def test_a_request_whose_answer_was_lost_is_answered_again_from_the_quorum_it_was_decided_into():
    """A request decided into the newest quorum and sent again (its answer lost on the way: a
    relay died holding it, a stream broke) gets that quorum at once; the others wait in its
    all-reduce for this member. A new request of the same replica, or one without an id, waits
    for the next round as before."""
    def ask(stub, rid, request_id, timeout=5.0):
        req = raw_request(replica_id=str(rid), ftar_addresses=addrs(rid), num_replicas=2, request_id=request_id)
        return stub.GetQuorum(req, timeout=timeout)

    with LighthouseThread(LighthouseConfig(min_replicas=2, detect_s=5.0)) as lighthouse, \
            grpc.insecure_channel(lighthouse.address) as ch:
        stub = pb2_grpc.LighthouseStub(ch)
        with ThreadPoolExecutor(2) as ex:
            first = list(ex.map(lambda r: ask(stub, r, 100 + r), range(2)))
        qid = first[0].quorum.quorum_id
        assert {a.quorum.quorum_id for a in first} == {qid}
        again = ask(stub, 1, 101, timeout=2.0)  # replica 0 does not ask again: nothing else could answer it
        assert again.quorum.quorum_id == qid and [m.replica_id for m in again.quorum.members] == ["0", "1"]
        assert lighthouse.server.stats["answers_resent"] == 1
        for request_id in (102, 0):  # a new request (or one with no id) is the next round's
            with pytest.raises(grpc.RpcError) as ei:
                ask(stub, 1, request_id, timeout=1.0)
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert lighthouse.server.stats["answers_resent"] == 1


def test_invalid_heartbeat_and_status_versions(lighthouse):
    with grpc.insecure_channel(lighthouse.address) as ch:
        stub = pb2_grpc.LighthouseStub(ch)
        for call, msg in [
            (stub.Heartbeat, pb2.HeartbeatRequest(protocol_version=1, job_id="", replica_id="0")),
            (stub.Heartbeat, pb2.HeartbeatRequest(protocol_version=1, job_id="j", replica_id="0", step=-2)),
            (stub.Status, pb2.StatusRequest(protocol_version=9)),
        ]:
            with pytest.raises(grpc.RpcError) as ei:
                call(msg, timeout=5)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()


def test_conflicting_job_settings_are_rejected_with_the_fix(lighthouse):
    clients = make_clients(lighthouse.address, "job", 3)
    clients[0].state_signature = 0xF16  # replica 2 states none (0): never compared
    try:
        with ThreadPoolExecutor(1) as ex:  # replica 0 waits (2 shards, 3 replicas) for the others
            fut = ex.submit(clients[0].get_quorum, 0, ftar_addresses=addrs(0, 2), num_replicas=3, timeout_s=5)
            time.sleep(0.1)
            with pytest.raises(InvalidLighthouseRequest, match="4 of replica '1'.*conflicts with 2 of live replica '0'"):
                clients[1].get_quorum(0, ftar_addresses=addrs(1, 4), num_replicas=3, timeout_s=5)
            with pytest.raises(InvalidLighthouseRequest, match="num_replicas 5 .*conflicts with 3"):
                clients[1].get_quorum(0, ftar_addresses=addrs(1, 2), num_replicas=5, timeout_s=5)
            # a state made unlike replica 0's (fthsdp/step/signature.py): refused, naming both
            clients[1].state_signature = 0xB16
            with pytest.raises(InvalidLighthouseRequest, match="state of replica '1'.*signature 0000000000000b16.*"
                               "not made like that of live replica '0' \\(0000000000000f16\\).*"
                               "model, optimizer or data settings"):
                clients[1].get_quorum(0, ftar_addresses=addrs(1, 2), num_replicas=3, timeout_s=5)
            clients[1].state_signature = 0xF16
            # Fixed requests complete the quorum that replica 0 has been waiting for.
            qs = quorum_all(clients[1:], [0, 0], lws=2)
            assert dataclasses.replace(fut.result(), rings=()) == dataclasses.replace(qs[0], rings=())
            assert qs[0].num_members == 3 and qs[0].num_configured == 3 and qs[0].quorum_id == 1
    finally:
        close_all(clients)


def test_a_quorum_request_ended_by_its_replicas_leave_says_so(lighthouse):
    """A replica that leaves while its quorum request waits: the request was refused as
    "superseded by a newer quorum request", which sent a reader looking for a second request."""
    clients = make_clients(lighthouse.address, "job", 2)
    try:
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(clients[0].get_quorum, 0, ftar_addresses=addrs(0, 1), num_replicas=2, timeout_s=10)
            time.sleep(0.3)  # waiting for replica 1
            clients[0].leave(0, finished=False)
            with pytest.raises(LighthouseError, match="replica '0' of job 'job' left \\(Leave\\): this quorum "
                                                      "request of it is void"):
                fut.result(15)
    finally:
        close_all(clients)


def test_a_second_lighthouse_or_relay_on_a_port_in_use_is_refused():
    """gRPC binds with SO_REUSEPORT by default: a second lighthouse on a port in use bound it too
    and the kernel split the replicas' connections between two lighthouses, each deciding its own
    quorums (a split brain). The second one must fail to start, saying the port is in use; a
    lighthouse restarted on the port of one that stopped binds it."""
    from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
    from fthsdp.control.relay import RelayConfig, RelayThread

    with LighthouseThread(LighthouseConfig(bind="127.0.0.1:0")) as first:
        port = first.address.rpartition(":")[2]
        with pytest.raises(OSError, match="is the port in use"):
            with LighthouseThread(LighthouseConfig(bind=f"127.0.0.1:{port}")):
                pass
        relay = RelayThread(RelayConfig(lighthouse=first.address, bind="127.0.0.1:0"))
        relay.start()
        try:
            with pytest.raises(OSError):
                RelayThread(RelayConfig(lighthouse=first.address, bind=relay.address)).start()
        finally:
            relay.stop()
    with LighthouseThread(LighthouseConfig(bind=f"127.0.0.1:{port}")) as again:  # the first one stopped
        assert again.address.endswith(f":{port}")


def test_unreachable_lighthouse_is_a_clear_error():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with LighthouseClient(f"127.0.0.1:{port}", "job", 0) as c:
        with pytest.raises(LighthouseUnavailable, match="is `fthsdp lighthouse` running"):
            c.get_quorum(0, ftar_addresses=addrs(0), timeout_s=2)


REPLICA = textwrap.dedent(
    """
    import sys, time
    from fthsdp.control.lighthouse_client import LighthouseClient
    c = LighthouseClient(sys.argv[1], "job", sys.argv[2])
    c.start_heartbeats()
    q = c.get_quorum(0, ftar_addresses=["127.0.0.1:1"], timeout_s=20)
    print("quorum", q.quorum_id, ",".join(q.member_ids), flush=True)
    time.sleep(60)
    """
)


@pytest.mark.multiprocess
def test_subprocess_lighthouse_detects_a_killed_replica(tmp_path):
    port_file = tmp_path / "port"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    lh = subprocess.Popen(
        [sys.executable, "-m", "fthsdp.control.lighthouse", "--bind", "127.0.0.1:0", "--insecure", "--detect", str(DETECT),
         "--join-timeout", "5", "--replicas", "2", "--port-file", str(port_file)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    replica = None
    try:
        line = lh.stdout.readline()
        assert line.startswith("lighthouse listening on 127.0.0.1:"), line
        address = line.split()[-1]
        assert port_file.read_text().strip() == address.rsplit(":", 1)[1]
        replica = subprocess.Popen([sys.executable, "-c", REPLICA, address, "1"], cwd=REPO, env=env,
                                   stdout=subprocess.PIPE, text=True)
        dead_at: list[float] = []
        with LighthouseClient(address, "job", 0) as me:
            me.start_heartbeats(on_dead=lambda dead, qid: dead_at.append(time.monotonic()) if dead == ("1",) else None)
            # --replicas 2: the first quorum waits (up to 5 s) for the replica still starting up
            q = me.get_quorum(0, ftar_addresses=["127.0.0.1:2"], timeout_s=20)
            assert q.member_ids == ("0", "1")
            assert replica.stdout.readline().split() == ["quorum", str(q.quorum_id), "0,1"]
            os.kill(replica.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            replica.wait(5)
            while not dead_at and time.monotonic() < killed_at + DETECT + 2:
                time.sleep(0.01)
            assert dead_at, "the killed replica was never reported dead"
            detection = dead_at[0] - killed_at
            assert detection < DETECT + 0.4, detection
            q2 = me.get_quorum(1, ftar_addresses=["127.0.0.1:2"], commit_failed=True, timeout_s=5)
            assert q2.member_ids == ("0",) and q2.quorum_id == q.quorum_id + 1
        lh.send_signal(signal.SIGTERM)
        assert lh.wait(10) == 0
        assert "declared dead" in lh.stderr.read()
    finally:
        for p in (replica, lh):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(5)


def test_cli_reports_a_port_in_use():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "fthsdp.control.lighthouse", "--bind", f"127.0.0.1:{port}", "--insecure"],
                           cwd=REPO, capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert f"lighthouse cannot bind 127.0.0.1:{port}" in p.stderr and "in use" in p.stderr


def test_cli_rejects_bad_flags():
    from fthsdp.control.lighthouse import cli

    with pytest.raises(SystemExit) as ei:
        cli(["--bind", "localhost"])
    assert ei.value.code == 2
    with pytest.raises(SystemExit):
        cli(["--min-replicas", "0"])


@pytest.mark.multiprocess
def test_quorum_scale_experiment_runs(tmp_path):
    out = tmp_path / "qs.json"
    p = subprocess.run(
        [sys.executable, "experiments/quorum_scale.py", "--replicas", "3", "12", "--processes", "1", "3",
         "--rounds", "2", "--procs", "2", "--no-plot", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    import json

    res = json.loads(out.read_text())["results"]
    assert [(r["replicas"], r["processes"]) for r in res] == [(3, 1), (12, 1), (3, 3), (12, 3)]
    for r in res:
        assert r["rounds_ok"] == 2 and r["failed_requests"] == 0, r
        assert 0 < r["after_last_s"] <= r["quorum_s"] <= r["round_s"] < 20
    one, three = res[1], res[3]  # 12 replicas of 1 and of 3 processes
    assert three["view_bytes"] > 0 and three["answer_bytes"] < 1.3 * one["answer_bytes"]  # O(R x own shards)


def test_silent_job_is_forgotten():
    with LighthouseThread(LighthouseConfig(detect_s=0.2, forget_after_s=0.4)) as lh:
        with LighthouseClient(lh.address, "gone", 0) as c, LighthouseClient(lh.address, "alive", 0) as d:
            c.heartbeat()
            d.start_heartbeats()
            time.sleep(0.3)
            assert {j.job_id for j in d.status(job_id="")} == {"gone", "alive"}
            time.sleep(0.3)
            assert {j.job_id for j in d.status(job_id="")} == {"alive"}
            with pytest.raises(JobNotFound, match="no job 'gone'"):
                c.status()


def test_status_command_shows_quorum_reason_and_replicas(lighthouse, capsys):
    from fthsdp.cli import main as fthsdp_main

    clients = make_clients(lighthouse.address, "statusjob", 2)
    try:
        quorum_all(clients, [3, 3])
        assert fthsdp_main(["status", "--lighthouse", lighthouse.address]) == 0
        out = capsys.readouterr().out
        assert "job 'statusjob'" in out and "members ['0', '1'] at step 3" in out
        assert "last decision: quorum" in out
        assert "failure detection: " in out and "asked to beat" not in out  # 2 processes: not paced
        assert out.count("training") + out.count("waiting for quorum") == 2
        # every job's status carries the lighthouse's own load: 2 replicas asked and beat here
        load = next(line for line in out.splitlines() if line.startswith("lighthouse since it started"))
        assert "1 job(s)" in load and "% of a core" in load and "ms each" in load and "refused: none" in load, load
        jobs, got = (r := clients[0].status_reply("")).jobs, r.load
        assert [j.job_id for j in jobs] == ["statusjob"] and got.jobs == 1 and got.evaluations >= 1
        assert got.cpu_s > 0 and got.uptime_s > 0
        assert got.detect_s == r.detect_s > 0 and got.beat_interval_s == r.beat_interval_s == 0  # the reply's own
        assert clients[0].status_reply().load is None  # one job's status: not the lighthouse's load
        assert fthsdp_main(["status", "--lighthouse", lighthouse.address, "--job", "statusjob"]) == 0
        assert "lighthouse since" not in capsys.readouterr().out
    finally:
        for c in clients:
            c.close()
    assert fthsdp_main(["status", "--lighthouse", "127.0.0.1:9", "--job", "x"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_the_load_line_gives_rates_between_two_readings_and_restarts_from_a_new_lighthouse():
    from fthsdp.control.lighthouse_client import format_load
    from fthsdp.observe.load_metrics import LoadSnapshot

    def load(uptime, cpu, msgs, evals, eval_s, refused, relayed=0, batches=0):
        return LoadSnapshot(uptime_s=uptime, cpu_s=cpu, jobs=2, sessions_opened=4, session_messages=msgs,
                            evaluations=evals, evaluation_s=eval_s, held_total=3, held_now=0,
                            connection_budget_calls_per_s=500.0, refused_by_code=refused, sessions_open=3,
                            relayed_messages=relayed, relay_batches=batches, relay_streams_open=1 if batches else 0)

    a = load(100.0, 20.0, 10_000, 200, 0.4, {"INVALID_ARGUMENT": 2})
    b = load(110.0, 25.0, 12_000, 300, 0.6, {"INVALID_ARGUMENT": 2, "UNAUTHENTICATED": 5})
    assert format_load(a) == ("lighthouse since it started 1m40s ago: 2 job(s); CPU 20% of a core; 100 session "
                              "messages/s (3 sessions open, 4 opened); 2.0 quorum decisions/s, 2.00 ms each; 3 call(s) held "
                              "by a budget (0 now, budget 500 calls/s a connection); refused: 2 INVALID_ARGUMENT")
    assert format_load(b, a) == ("lighthouse over the last 10.0s: 2 job(s); CPU 50% of a core; 200 session "
                                 "messages/s (3 sessions open, 4 opened); 10.0 quorum decisions/s, 2.00 ms each; 0 call(s) "
                                 "held by a budget (0 now, budget 500 calls/s a connection); refused: 5 "
                                 "UNAUTHENTICATED")
    # a restarted lighthouse (less uptime than the last reading): its counters began again
    assert format_load(load(5.0, 1.0, 50, 0, 0.0, {}), b).startswith("lighthouse since it started 0m05s ago")
    # ... or more uptime, from a restart longer ago than the last reading: a counter went back
    later = load(200.0, 30.0, 9_000, 400, 0.8, {"INVALID_ARGUMENT": 2, "UNAUTHENTICATED": 5})
    assert format_load(later, b).startswith("lighthouse since it started 3m20s ago")
    fewer_refused = load(200.0, 30.0, 20_000, 400, 0.8, {"INVALID_ARGUMENT": 1})
    assert format_load(fewer_refused, b).startswith("lighthouse since it started")
    assert "-" not in format_load(later, b)  # no negative rate
    # behind relays: the share of the messages that came through them (a drop: processes left their relays)
    c, d = load(100.0, 20.0, 10_000, 200, 0.4, {}, 6_000, 1_000), load(110.0, 25.0, 12_000, 300, 0.6, {}, 6_500, 1_100)
    assert "200 session messages/s (3 sessions open, 4 opened; 50/s of them through 1 relay stream(s) in 10 " \
           "batches/s)" in format_load(d, c)
    # the heartbeats, once it has counted processes beating it (pacing: what its pace is set for)
    import dataclasses

    e, f = (dataclasses.replace(x, heartbeats=h, beating_processes=2048) for x, h in ((a, 40_000), (b, 60_000)))
    assert "; 2000 heartbeats/s from 2048 process(es);" in format_load(f, e)
