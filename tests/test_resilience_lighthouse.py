"""A restartable lighthouse (issue 10, item 2) and a normal exit that is not a death (item 3).

The lighthouse keeps nothing the replicas cannot give back: a lighthouse
killed mid-run and restarted on the same address with empty memory rebuilds
each job from what the replicas report (their last quorum id and members,
their step). The end-to-end test runs a real job (3 replica processes, FTAR
over loopback) against a lighthouse process started by the test with
`fthsdp lighthouse --bind`, SIGKILLs it mid-run and restarts it on the same
port: the job must finish with identical final states, every batch trained
exactly once, quorum ids that never go backwards and no replica caught up.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fthsdp.data.ledger import check_exactly_once
from fthsdp.launch import report
from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import JobFinished, LighthouseClient, LighthouseUnavailable

from test_fault_tolerance import TINY

REPO = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def addrs(rid: int) -> list[str]:
    return [f"127.0.0.1:{21000 + rid}"]


def ask_all(clients, step, timeout_s=20.0):
    with ThreadPoolExecutor(len(clients)) as ex:
        futs = [ex.submit(c.get_quorum, step, ftar_addresses=addrs(int(c.replica_id)), num_replicas=len(clients),
                          timeout_s=timeout_s) for c in clients]
        return [f.result() for f in futs]


# -- the server and client, in process ------------------------------------------------------------------


def test_restarted_lighthouse_continues_quorum_ids_and_waits_for_reported_members():
    port = free_port()
    cfg = LighthouseConfig(bind=f"127.0.0.1:{port}", join_timeout_s=0.2, detect_s=0.6)
    clients = [LighthouseClient(f"127.0.0.1:{port}", "job", i, outage_s=30.0) for i in range(3)]
    first = LighthouseThread(cfg)
    first.start()
    try:
        for c in clients:
            c.start_heartbeats()
        time.sleep(0.2)
        assert {q.quorum_id for q in ask_all(clients, 0)} == {1}
        # a commit failure moves the job to quorum 2 (so "1" would be a reuse after a restart)
        with ThreadPoolExecutor(3) as ex:
            qs = list(ex.map(lambda c: c.get_quorum(1, ftar_addresses=addrs(int(c.replica_id)), commit_failed=True,
                                                    num_replicas=3, timeout_s=20), clients))
        assert {q.quorum_id for q in qs} == {2}
        first.stop()  # the lighthouse goes away; the replicas ask for step 2 meanwhile
        with ThreadPoolExecutor(3) as ex:
            futs = [ex.submit(c.get_quorum, 2, ftar_addresses=addrs(int(c.replica_id)), num_replicas=3,
                              timeout_s=20) for c in clients[:2]]
            time.sleep(1.0)
            assert not any(f.done() for f in futs)  # riding out the outage, not failing
            second = LighthouseThread(cfg)  # same address, empty memory
            second.start()
            try:
                time.sleep(1.0)
                # replica 2 (a member of quorum 2, heartbeating again) is waited for, not left out
                assert not any(f.done() for f in futs)
                [st] = clients[0].status()
                assert "member(s) of quorum 2" in st.last_reason, st.last_reason
                q2 = clients[2].get_quorum(2, ftar_addresses=addrs(2), num_replicas=3, timeout_s=20)
                qs = [f.result() for f in futs] + [q2]
            finally:
                second.stop()
        assert {q.quorum_id for q in qs} == {3}, [q.reason for q in qs]
        assert qs[0].member_ids == ("0", "1", "2") and qs[0].behind == ()
        assert "lighthouse restarted: replicas last saw quorum 2" in qs[0].reason
        assert all(c.outages for c in clients[:2])
    finally:
        for c in clients:
            c.close()
        first.stop()


def test_a_beat_reporting_a_higher_quorum_id_moves_no_id_once_this_lighthouse_decided_the_jobs():
    """Rule 5's floor is what a restarted lighthouse learns of ids decided before it. A heartbeat
    reporting an id above the newest this lighthouse decided (any replica id holding the job's key
    can send one) made every later decision take a new id, every FTAR ring rebuilt each step; it is
    not followed once the lighthouse decided the job's quorums (a request's report still is)."""
    import grpc

    from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as load_stubs

    pb2, pb2_grpc = load_stubs()
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.2, detect_s=1.0)) as lh:
        a, b = (LighthouseClient(lh.address, "job", i) for i in range(2))
        try:
            assert {q.quorum_id for q in ask_all([a, b], 0)} == {1}
            with grpc.insecure_channel(lh.address) as ch:
                pb2_grpc.LighthouseStub(ch).Heartbeat(pb2.HeartbeatRequest(
                    protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="job", replica_id="9", step=1,
                    last_quorum_id=7), timeout=5)
            qs = ask_all([a, b], 1)
            assert {q.quorum_id for q in qs} == {1}, [q.reason for q in qs]
        finally:
            a.close()
            b.close()


def test_members_answered_before_a_lighthouse_sigkill_hear_that_the_others_ask_the_restarted_one():
    """The lighthouse answered replica 0's request for step 1 and died before writing 1's and 2's
    (quorum 1 kept: the same members). Replica 0 is in step 1's all-reduce; 1 and 2 ask the
    restarted lighthouse, which waits for 0 (a member of the newest quorum reported). Replica 0's
    heartbeats say where it is (its phase report), and their replies name the replicas asking at
    or before its step: it aborts that all-reduce at once instead of at its deadline, and asks.
    A member in an earlier step's all-reduce, or computing, is told of nobody."""
    from fthsdp.observe.phase import Phase, PhaseTracker

    port = free_port()
    cfg = LighthouseConfig(bind=f"127.0.0.1:{port}", join_timeout_s=0.2, detect_s=0.6)
    clients = [LighthouseClient(f"127.0.0.1:{port}", "job", i, outage_s=30.0) for i in range(3)]
    where = PhaseTracker()
    clients[0].phase_source = lambda: where.report("0")
    heard: list[tuple[tuple[str, ...], int, int]] = []
    first = LighthouseThread(cfg)
    first.start()
    second = LighthouseThread(cfg)
    try:
        clients[0].start_heartbeats(on_asking=lambda asking, qid, step: heard.append((asking, qid, step)))
        for c in clients[1:]:
            c.start_heartbeats()
        time.sleep(0.2)
        assert {q.quorum_id for q in ask_all(clients, 0)} == {1}
        with ThreadPoolExecutor(2) as ex:
            # A live lighthouse: 1 and 2 finished step 0 and ask for step 1 while 0 is still in
            # step 0's all-reduce: nobody named (they ask at a later step).
            where.set(Phase.ALLREDUCE, step=0, quorum_id=1, members=("0", "1", "2"))
            futs = [ex.submit(c.get_quorum, 1, ftar_addresses=addrs(int(c.replica_id)), num_replicas=3,
                              timeout_s=20) for c in clients[1:]]
            time.sleep(0.3)
            assert clients[0].heartbeat().asking == () and heard == []
            q0 = clients[0].get_quorum(1, ftar_addresses=addrs(0), num_replicas=3, timeout_s=20)
            assert {q0.quorum_id} | {f.result().quorum_id for f in futs} == {1}
        # Replica 0 was answered for step 1; the lighthouse dies before 1 and 2 read theirs.
        where.set(Phase.ALLREDUCE, step=1)
        first.stop()
        second.start()  # same address, empty memory
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(c.get_quorum, 1, ftar_addresses=addrs(int(c.replica_id)), num_replicas=3,
                              timeout_s=20) for c in clients[1:]]
            deadline = time.monotonic() + 10
            while not heard and time.monotonic() < deadline:
                time.sleep(0.02)
            assert heard, "replica 0's heartbeats never named the replicas asking the restarted lighthouse"
            asking, qid, step = heard[0]
            assert set(asking) == {"1", "2"} and (qid, step) == (1, 1), heard[0]
            # the restarted lighthouse waits for 0 (heard from, not asking: it holds quorum 1)
            for _ in range(100):
                [st] = clients[1].status()
                if "member(s) of quorum 1 not asking yet" in st.last_reason:
                    break
                time.sleep(0.02)
            assert "member(s) of quorum 1 not asking yet [0]" in st.last_reason, st.last_reason
            where.set(Phase.COMPUTING)  # not in an all-reduce: told of nobody
            assert clients[0].heartbeat().asking == ()
            where.set(Phase.ALLREDUCE, step=0)  # an earlier step's all-reduce: 1 and 2 ask at step 1
            assert clients[0].heartbeat().asking == ()
            # 0 aborts its all-reduce and asks (its commit failed): one quorum of all three.
            where.set(Phase.WAITING_FOR_QUORUM, step=1)
            q0 = clients[0].get_quorum(1, ftar_addresses=addrs(0), commit_failed=True, num_replicas=3, timeout_s=20)
            qs = [q0] + [f.result() for f in futs]
        assert {q.quorum_id for q in qs} == {2} and qs[0].member_ids == ("0", "1", "2"), [q.reason for q in qs]
    finally:
        for c in clients:
            c.close()
        first.stop()
        second.stop()


def test_a_manager_in_a_doomed_all_reduce_aborts_it_when_a_member_asks_the_restarted_lighthouse():
    """The whole chain with real parts: a restarted lighthouse, replica 0's heartbeat thread
    reporting its phase, Manager.on_asking, and a real FTAR ring whose all-reduce replica 0 is
    in while replica 1 (never answered) asks the restarted lighthouse instead of joining it: the
    all-reduce returns RECOVERABLE with the reason, long before its 30 s deadline. The same news
    about another step's all-reduce, or naming no member, aborts nothing."""
    import functools
    import types

    import numpy as np

    from fthsdp.collective import ftar
    from fthsdp.observe.phase import Phase, PhaseTracker
    from fthsdp.replica.manager import Manager

    port = free_port()
    cfg = LighthouseConfig(bind=f"127.0.0.1:{port}", join_timeout_s=0.2, detect_s=0.6)
    comms = [ftar.Communicator(1, timeout_s=30) for _ in range(2)]
    clients = [LighthouseClient(f"127.0.0.1:{port}", "job", i, outage_s=30.0) for i in range(2)]
    first, second = LighthouseThread(cfg), LighthouseThread(cfg)
    try:
        first.start()
        for c in clients:
            c.start_heartbeats()
        time.sleep(0.2)
        (q, _) = ask_all(clients, 0)
        with ThreadPoolExecutor(2) as ex:  # both configure the ring of quorum 1 (it connects)
            oks = list(ex.map(lambda i: comms[i].configure("job", q.quorum_id, i, [x.address for x in comms],
                                                           timeout_s=20), range(2)))
        assert all(oks), [o.reason for o in oks]
        mgr = types.SimpleNamespace(quorum=q, _configured_qid=q.quorum_id, _aborted_qid=None, _lock=threading.Lock(),
                                    replica_id="0", phases=PhaseTracker(), detections=[], comm=comms[0])
        mgr._abort_ours = functools.partial(Manager._abort_ours, mgr)
        on_asking = functools.partial(Manager.on_asking, mgr)
        on_asking(("1",), q.quorum_id, 1)  # not in an all-reduce: nothing to abort
        mgr.phases.set(Phase.ALLREDUCE, step=1, quorum_id=q.quorum_id, members=q.member_ids)
        on_asking(("1",), q.quorum_id, 0)  # news about another step's all-reduce
        on_asking(("7",), q.quorum_id, 1)  # nobody of the quorum
        assert mgr._aborted_qid is None and mgr.detections == []
        clients[0].stop_heartbeats()
        clients[0].phase_source = lambda: mgr.phases.report("0")
        clients[0].start_heartbeats(on_asking=on_asking)
        result: list = []
        x = np.ones(1024, np.float32)
        reducer = threading.Thread(target=lambda: result.append(
            comms[0].allreduce_host(x, quorum_id=q.quorum_id, rank=0, n=2)))
        reducer.start()  # replica 0 was answered for step 1; the lighthouse dies before replica 1 reads its answer
        first.stop()
        second.start()
        with ThreadPoolExecutor(1) as ex:
            asked = ex.submit(clients[1].get_quorum, 1, ftar_addresses=addrs(1), num_replicas=2, timeout_s=30)
            reducer.join(25)
            assert result, "replica 0's all-reduce was not aborted"
            status, reason = result[0]
            assert status != 0 and "ask for a new quorum at step <= 1" in reason, (status, reason)
            assert mgr._aborted_qid == q.quorum_id and mgr.detections[0]["asking"] == ["1"]
            # the step is retried: replica 0 asks too (its commit failed), and both are answered
            q0 = clients[0].get_quorum(1, ftar_addresses=addrs(0), commit_failed=True, num_replicas=2, timeout_s=30)
            assert q0.member_ids == ("0", "1") and asked.result().quorum_id == q0.quorum_id > q.quorum_id
    finally:
        for c in clients:
            c.close()
        for c in comms:
            c.close()
        first.stop()
        second.stop()


def test_a_heartbeat_abort_decided_for_one_quorum_never_lands_on_the_next_ones_ring():
    """FTAR applies configures and aborts in order, to whatever ring is current: an abort decided
    for quorum Q from a late heartbeat reply (naming a replica dead in Q that is back in Q+1),
    queued while the Manager configures Q+1, failed Q+1's first all-reduce. The decision and its
    queueing are one step under the Manager's lock, and no abort is decided while a configure is
    under way."""
    import functools
    import types

    from fthsdp.replica.manager import Manager

    def quorum(qid, members):
        return types.SimpleNamespace(quorum_id=qid, member_ids=members, rank_of=members.index,
                                     ring_addresses=lambda me: [[f"127.0.0.1:{7000 + int(m)}"] for m in members])

    # replica 1 was declared dead in quorum 1, restarted, and is a member of quorum 2 again
    q1, q2 = quorum(1, ("0", "1", "2")), quorum(2, ("0", "1", "2"))
    log: list = []

    class Comm:  # the order FTAR would see its commands in
        def abort(self, reason):
            assert mgr._lock.locked(), "an abort queued outside the Manager's lock"
            log.append(("abort", reason))

        def configure(self, job, qid, rank, members, **kw):
            mgr.on_dead(("1",), 1)  # a late reply about quorum 1 arrives mid-configure
            log.append(("configure", qid))

    mgr = types.SimpleNamespace(quorum=q1, _configured_qid=1, _aborted_qid=None, _lock=threading.Lock(),
                                replica_id="0", detections=[], comm=Comm(), job_id="job", _op_deadline=0.0,
                                cfg=types.SimpleNamespace(timeouts=types.SimpleNamespace(allreduce_timeout_s=5.0)))
    mgr._abort_ours = functools.partial(Manager._abort_ours, mgr)
    mgr._deadline = lambda q: 5.0
    mgr.on_dead = functools.partial(Manager.on_dead, mgr)
    mgr.on_dead(("1",), 1)  # in quorum 1's all-reduce: aborted, once
    mgr.on_dead(("1",), 1)
    assert log == [("abort", "lighthouse declared replica(s) 1 dead")]
    mgr._aborted_qid = None  # as when quorum 1's all-reduce failed on its own (EOF), never aborted
    mgr.quorum = q2
    Manager._configure(mgr, q2)
    assert log[1:] == [("configure", 2)] and mgr._configured_qid == 2  # the stale abort never queued


def test_between_tries_across_an_outage_the_client_waits_for_its_channel_not_a_backoff():
    """LighthouseClient._pause over real sockets: with nothing listening it waits its delay out
    ("down"); once a lighthouse serves on the port it returns as the channel connects
    ("connected"), long before its delay; a channel already up after a pause that found it
    down is tried at once ("connected"); and a channel up all along (the calls fail for
    another reason) gets the whole delay ("up"), so a lighthouse that answers UNAVAILABLE
    is not hammered."""
    port = free_port()
    cfg = LighthouseConfig(bind=f"127.0.0.1:{port}", join_timeout_s=0.2, detect_s=0.6)
    lh = LighthouseThread(cfg)
    with LighthouseClient(f"127.0.0.1:{port}", "job", 0, outage_s=30.0) as c:
        try:
            with pytest.raises(LighthouseUnavailable):  # the channel tries, and finds nothing
                c.heartbeat()
            t0 = time.monotonic()
            assert c._pause(0.3, "") == "down" and time.monotonic() - t0 >= 0.29
            threading.Timer(0.3, lh.start).start()
            t0 = time.monotonic()
            assert c._pause(10.0, "down") == "connected"
            assert time.monotonic() - t0 < 5.0  # the channel's reconnect backoff (0.25 s), not the delay
            c.heartbeat()
            t0 = time.monotonic()
            assert c._pause(2.0, "down") == "connected" and time.monotonic() - t0 < 1.0
            t0 = time.monotonic()
            assert c._pause(0.4, "") == "up" and time.monotonic() - t0 >= 0.39
        finally:
            lh.stop()


def test_outage_longer_than_the_limit_is_a_clear_error():
    port = free_port()
    with LighthouseClient(f"127.0.0.1:{port}", "job", 0, outage_s=0.8) as c:
        t0 = time.monotonic()
        with pytest.raises(LighthouseUnavailable, match="unreachable for .*ft.lighthouse_outage_s=0.8") as ei:
            c.get_quorum(0, ftar_addresses=addrs(0), timeout_s=5)
        assert 0.7 < time.monotonic() - t0 < 5
        assert ei.value.outage_s >= 0.8


def test_leave_is_not_a_death_and_a_finished_job_answers_rejoiners(caplog):
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.2, detect_s=0.4)) as lh:
        a, b = (LighthouseClient(lh.address, "job", i) for i in range(2))
        try:
            for c in (a, b):
                c.start_heartbeats()
            time.sleep(0.2)
            ask_all([a, b], 9)
            with LighthouseClient(lh.address, "job", 5) as bad, caplog.at_level("WARNING"):
                # a data state that is not one entry of each per replica is refused, and ends nothing
                assert not bad.leave(3, finished=True, data={"positions": [1, 2], "last_step": [0]})
            assert "data_positions has 2 entries and data_last_steps 1" in caplog.text
            with caplog.at_level("INFO", logger="fthsdp.control.lighthouse"):
                # the finisher leaves its model's data state; a leaver without one does not erase it
                assert a.leave(10, finished=True, data={"positions": [10, 9], "last_step": [9, 8]})
                assert b.leave(10, finished=True)
                time.sleep(0.8)  # two detection windows: nobody may be declared dead
            assert "declared dead" not in caplog.text
            assert "replica 0 left at step 10 (finished the job)" in caplog.text
            [st] = a.status()
            assert st.replicas == () or not any(r.dead for r in st.replicas)
            # A replica restarted after the end is told so, at once.
            with LighthouseClient(lh.address, "job", 1, rejoin=True) as late:
                with pytest.raises(JobFinished, match="already finished at step 10") as ei:
                    late.get_quorum(0, ftar_addresses=addrs(1), timeout_s=10)
                assert ei.value.step == 10
                assert ei.value.data == {"positions": [10, 9], "last_step": [9, 8]}
            # A new run of the same job id (a fresh start) is not refused.
            with LighthouseClient(lh.address, "job", 0) as fresh:
                q = fresh.get_quorum(0, ftar_addresses=addrs(0), timeout_s=10)
                assert q.member_ids == ("0",)
        finally:
            a.close()
            b.close()


def test_a_leave_that_cannot_be_the_jobs_end_does_not_finish_it(caplog):
    """A Leave saying "finished" ended the job for everyone at whatever step it named: a replica
    id that was never in the quorum, or a member naming a step its quorum did not run, had every
    other replica answered job-finished mid-run. They leave; the job goes on until a member of
    its newest quorum leaves at that quorum's step + 1."""
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.2, detect_s=0.8)) as lh:
        a, b = (LighthouseClient(lh.address, "job", i) for i in range(2))
        try:
            ask_all([a, b], 4)
            with caplog.at_level("WARNING", logger="fthsdp.control.lighthouse"):
                with LighthouseClient(lh.address, "job", 7) as stranger:
                    assert stranger.leave(5, finished=True)
                assert a.leave(2**40, finished=True)
            assert "replica 7 says it finished the job at step 5, but it is not a member" in caplog.text
            assert (f"replica 0 says it finished the job at step {2**40}, but the job's newest quorum 1 ran step 4, "
                    "so a finisher leaves at step 5") in caplog.text
            assert b.status()[0].finished_step is None
            assert b.leave(5, finished=True)  # the real end
            [st] = b.status()
            assert st.finished_step == 5
        finally:
            a.close()
            b.close()


# -- a real job, its lighthouse SIGKILLed mid-run and restarted ----------------------------------------


def lighthouse_process(args: list[str], port_file: pathlib.Path, log: pathlib.Path | None = None
                       ) -> tuple[subprocess.Popen, int]:
    """`fthsdp lighthouse ARGS` in its own session, and the port it serves on once it does."""
    port_file.unlink(missing_ok=True)
    out = open(log, "a") if log is not None else subprocess.DEVNULL
    p = subprocess.Popen([sys.executable, "-m", "fthsdp.cli", "lighthouse", *args, "--port-file", str(port_file)],
                         cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert p.poll() is None, log.read_text() if log is not None else "the lighthouse exited"
        assert time.monotonic() < deadline, "the lighthouse did not start"
        time.sleep(0.05)
    return p, int(port_file.read_text())


def start_lighthouse(port: int, log: pathlib.Path) -> subprocess.Popen:
    return lighthouse_process(["--bind", f"127.0.0.1:{port}", "--insecure", "--detect", "0.8", "--join-timeout",
                               "0.5"], log.with_suffix(".port"), log)[0]


def step_of(out: pathlib.Path, rid: int) -> int:
    try:
        return json.loads((out / f"status-{rid}.json").read_text()).get("step", 0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


@pytest.mark.multiprocess
def test_job_survives_a_lighthouse_sigkill_and_restart(tmp_path):
    replicas, steps, kill_at, outage_s = 3, 60, 15, 3.0
    port = free_port()
    lh_log = tmp_path / "lighthouse.log"
    lh = start_lighthouse(port, lh_log)
    env = dict(os.environ, PYTHONUNBUFFERED="1", FTHSDP_PEER_TOKEN="lighthouse-restart-test")
    env.setdefault("FTHSDP_COMPILATION_CACHE", str(pathlib.Path.home() / ".cache" / "fthsdp" / "xla"))
    procs = []
    try:
        for rid in range(replicas):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fthsdp.replica.process", "--config", "base", "--replica-id", str(rid),
                 "--lighthouse", f"127.0.0.1:{port}", "--job", "lh-restart", "--out-dir", str(tmp_path),
                 *TINY, f"launch.replicas={replicas}", "launch.devices_per_replica=1", f"train.steps={steps}",
                 "train.min_step_s=0.1", "ft.checkpoint_every=1000", "ft.lighthouse_outage_s=60"],
                cwd=REPO, env=env, stdout=open(tmp_path / f"replica-{rid}.out", "w"), stderr=subprocess.STDOUT,
                start_new_session=True))
        deadline = time.monotonic() + 240
        while max(step_of(tmp_path, r) for r in range(replicas)) < kill_at:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.02)
        os.killpg(lh.pid, signal.SIGKILL)
        lh.wait(10)
        killed_at, killed_step = time.time(), max(step_of(tmp_path, r) for r in range(replicas))
        time.sleep(outage_s)  # every replica is now waiting for the lighthouse
        during = [step_of(tmp_path, r) for r in range(replicas)]
        assert all(p.poll() is None for p in procs), "a replica died with the lighthouse"
        lh = start_lighthouse(port, lh_log)  # same port, empty memory
        restarted_at = time.time()
        rcs = [p.wait(240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        os.killpg(lh.pid, signal.SIGTERM)
        lh.wait(10)
    logs = {r: (tmp_path / f"replica-{r}.out").read_text() for r in range(replicas)}
    assert rcs == [0] * replicas, {r: logs[r][-3000:] for r in range(replicas)}
    assert max(during) <= killed_step + 1  # nobody trained on without a quorum
    run = report.load_run(tmp_path)
    hashes = {d["hash"] for d in run.done.values()}
    assert len(run.done) == replicas and len(hashes) == 1, run.done
    for rid, recs in run.steps.items():
        assert [r["step"] for r in recs] == list(range(steps)), rid  # no step twice, none lost
        assert all(r["healthy"] for r in recs), rid  # nobody was made to catch up
        qids = [r["quorum_id"] for r in recs]
        assert qids == sorted(qids), (rid, qids)  # quorum ids never go backwards
        after = [r for r in recs if r["start"] >= restarted_at]
        assert after and after[0]["quorum_id"] > max(r["quorum_id"] for r in recs if r["end"] <= killed_at)
        # Each replica noticed the outage and its end: its quorum request rode it out ("reachable
        # again"), or, when the lighthouse died just after answering this replica's request (not
        # yet the others'), it spent the outage in that step's all-reduce and its heartbeats did
        # ("resumed"; their replies then name the others asking the restarted lighthouse and it
        # aborts that all-reduce, or its deadline passes first when the outage outlasts it; the
        # step is retried).
        log_text = logs[int(rid)]
        assert "reachable again after" in log_text or (
            "heartbeats to" in log_text and "resumed after" in log_text
            and "retrying on a new quorum" in log_text), log_text[-3000:]
    (positions,) = {tuple(d["positions"]) for d in run.done.values()}
    assert positions == (steps,) * replicas
    rep = check_exactly_once(sorted((tmp_path / "ledger").glob("*.jsonl")), dict(enumerate(positions)))
    assert rep.ok, rep.summary()
    text = lh_log.read_text()
    assert "lighthouse restarted: replicas last saw quorum" in text
    assert "declared dead" not in text  # the normal exits at the end were goodbyes
    assert text.count("(finished the job)") == replicas


def test_startup_barrier_rides_out_a_lighthouse_that_is_down_then_comes_back():
    """The start-up barrier of a job's (re)start waits through a lighthouse outage
    (found by the chaos soak: a lighthouse killed during a fallback's start-up wait
    killed the replicas with LighthouseUnavailable)."""
    import types

    from fthsdp.config import Config
    from fthsdp.replica.manager import Manager

    port = free_port()
    address = f"127.0.0.1:{port}"
    cfg = LighthouseConfig(bind=address, join_timeout_s=0.2, detect_s=0.6)
    waiter = LighthouseClient(address, "job", 0, outage_s=30.0)
    peer = LighthouseClient(address, "job", 1, heartbeat_interval_s=0.05, outage_s=30.0)
    lh = LighthouseThread(cfg)
    try:
        with ThreadPoolExecutor(1) as ex:
            # nothing listens yet: the barrier must keep waiting, not raise
            fut = ex.submit(Manager.wait_for_peers, types.SimpleNamespace(cfg=Config()), waiter.status, 1, 60.0)
            time.sleep(1.5)
            assert not fut.done(), f"the barrier gave up while the lighthouse was down: {fut.exception()}"
            lh.start()
            peer.start_heartbeats()
            assert fut.result(timeout=30) >= 1
    finally:
        peer.close()
        waiter.close()
        lh.stop()


def test_startup_barrier_gives_up_after_the_outage_limit():
    import dataclasses
    import types

    from fthsdp.errors import JobFatalError

    from fthsdp.config import Config
    from fthsdp.replica.manager import Manager

    base = Config()
    cfg = dataclasses.replace(base, ft=dataclasses.replace(base.ft, lighthouse_outage_s=1.0))
    waiter = LighthouseClient(f"127.0.0.1:{free_port()}", "job", 0, outage_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(JobFatalError, match="lighthouse stayed unreachable") as ei:
            Manager.wait_for_peers(types.SimpleNamespace(cfg=cfg), waiter.status, 1, 60.0)
        assert isinstance(ei.value.__cause__, LighthouseUnavailable)
        assert time.monotonic() - t0 < 30
    finally:
        waiter.close()

    # a hung lighthouse (each Status past its deadline: QuorumTimeout) is the same: job-fatal, not
    # this replica's own fault (which restarted every replica to rejoin a job that never started)
    from fthsdp.control.lighthouse_client import QuorumTimeout
    from fthsdp.errors import FaultClass, classify

    def hung():
        raise QuorumTimeout("Status: no answer within 5s")

    with pytest.raises(JobFatalError) as ei:
        Manager.wait_for_peers(types.SimpleNamespace(cfg=cfg), hung, 1, 60.0)
    assert classify(ei.value).kind is FaultClass.JOB_FATAL


def test_startup_barrier_rides_out_a_slow_status_answer():
    """A Status past its deadline (QuorumTimeout, a TimeoutError) is ridden out like an
    unreachable lighthouse, not raised at once out of the barrier."""
    import dataclasses
    import types

    from fthsdp.config import Config
    from fthsdp.control.lighthouse_client import JobStatus, QuorumTimeout, ReplicaStatus
    from fthsdp.replica.manager import Manager

    base = Config()
    cfg = dataclasses.replace(base, ft=dataclasses.replace(base.ft, lighthouse_outage_s=5.0))
    calls = []

    def status():
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise QuorumTimeout("Status: no answer within 5s")
        live = (ReplicaStatus("0", 0, 0.1, False, False), ReplicaStatus("1", 0, 0.1, False, False))
        return [JobStatus("job", live, None, "", 1, 2)]

    assert Manager.wait_for_peers(types.SimpleNamespace(cfg=cfg), status, 2, 60.0) == 2
    assert len(calls) == 3


@pytest.mark.multiprocess
@pytest.mark.parametrize("roles", [("rejoin",), ("rejoin", "rejoin"), ("rejoin", "first start")],
                         ids=["alone", "two-rejoiners", "with-a-first-start"])
def test_a_restarted_replica_at_step_0_asks_again_for_a_while_before_it_gives_up_or_trains(tmp_path, roles):
    """A replica restarted to rejoin (--rejoin) that is healthy at step 0 does not exit job-fatal
    (nor train the job from its start) at once: a live replica may be cut off from the lighthouse
    for a moment (a chaos soak lost its job so: both rejoiners gave up while the one healthy
    replica's relay was stopped; in a rerun they met and redid the job from step 0, a fork). In a
    quorum of only replicas restarted to rejoin (alone, or two of them: Member.rejoining) it asks
    again for Timeouts.alone_rejoin_s (ten detection windows), then exits 78 with the reason; with
    a replica at its first start (the job's first step never committed) it trains at once."""
    from fthsdp.errors import EXIT_JOB_FATAL

    port = free_port()
    lh = start_lighthouse(port, tmp_path / "lighthouse.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", FTHSDP_PEER_TOKEN="alone-rejoin-test")
    procs = []
    # rejoiners only: one replica of the job is away (cut off); with a first start, none is (it waits for all)
    replicas = len(roles) if "first start" in roles else len(roles) + 1
    first_id = replicas - len(roles)  # replica ids are 0 .. replicas - 1: the away one is 0
    watcher = LighthouseClient(f"127.0.0.1:{port}", "alone", 99)

    def start(i: int, role: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "fthsdp.replica.process", "--config", "base", "--replica-id", str(first_id + i),
             *(["--rejoin"] if role == "rejoin" else []), "--lighthouse", f"127.0.0.1:{port}", "--job", "alone",
             "--out-dir", str(tmp_path / f"r{i}"), *TINY, f"launch.replicas={replicas}",
             "launch.devices_per_replica=1", "train.steps=6", "ft.detect_s=0.4"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def live_at_lighthouse() -> set[str]:
        try:
            return {r.replica_id for j in watcher.status() for r in j.replicas if not r.dead}
        except LookupError:  # the job does not exist until a replica heartbeats
            return set()

    try:
        if "first start" in roles:
            # the first start checks in (it heartbeats and waits at the start-up barrier) before the
            # rejoiner asks: otherwise a slower compile leaves the rejoiner alone at its first quorum
            # (a wait this test does not mean to check)
            procs.append(start(1, "first start"))
            deadline = time.monotonic() + 120
            while "1" not in live_at_lighthouse():
                assert procs[0].poll() is None and time.monotonic() < deadline, "the first start never checked in"
                time.sleep(0.1)
            procs.insert(0, start(0, "rejoin"))
        else:
            procs.extend(start(i, role) for i, role in enumerate(roles))
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        watcher.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
        os.killpg(lh.pid, signal.SIGTERM)
        lh.wait(10)
    rejoiner = outs[0]

    def at(line: str) -> float:
        h, m, s = line.split()[0].split(":")
        return 3600 * int(h) + 60 * int(m) + float(s)

    waits = [ln for ln in rejoiner.splitlines() if "asking again for up to 4.0 s" in ln]
    if "first start" in roles:  # trusted at once (a wait cost the other its attempts): both trained 6 steps
        assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
        assert not waits and "['1'] at their first start (the job's first step never committed); training from " \
            "the start" in rejoiner, rejoiner[-3000:]
        return
    for p, out in zip(procs, outs):
        assert p.returncode == EXIT_JOB_FATAL, out[-3000:]
        assert "no replica holding the job's state has been running for 4.0 s" in out, out[-3000:]
        assert ("it is alone" if len(roles) == 1 else "holds only replicas restarted to rejoin (['1', '2'])") in out
    gave_up = [ln for ln in rejoiner.splitlines() if "no replica holding the job's state has been running" in ln]
    assert waits and gave_up, rejoiner[-3000:]
    assert at(gave_up[0]) - at(waits[0]) >= 3.9, (waits[0], gave_up[0])  # 10 x ft.detect_s, not at once
