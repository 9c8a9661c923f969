"""The lineage fence (rule 6 of fthsdp.control.quorum) against a real lighthouse over gRPC,
with real clients: across a lighthouse restart (the restarted one rebuilds the lineage
from the replicas' reports) and in the job's last step (no request follows the fork, so
the lighthouse judges the leavers instead).

The split brain is made with heartbeats stopped and started (what SIGSTOP does to a
replica, as far as the lighthouse can tell): replica 2 silent, 0 and 1 form quorum 2 at
step 1; then 0 and 1 silent, 2 alone re-decides step 1 in quorum 3. The real-process
version of the same sequence is tests/test_lineage_fork.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import InvalidLighthouseRequest, JobFinished, LighthouseClient
from fthsdp.control.quorum import Lineage

from test_resilience_lighthouse import addrs, free_port

DETECT_S = 0.5


def ask_all(clients: list[LighthouseClient], step: int, commit_failed: bool = False) -> list:
    """Every client asks for the quorum of ``step`` at once (a job of 3 replicas)."""
    with ThreadPoolExecutor(len(clients)) as ex:
        futs = [ex.submit(c.get_quorum, step, ftar_addresses=addrs(int(c.replica_id)), num_replicas=3,
                          commit_failed=commit_failed, timeout_s=10) for c in clients]
        return [f.result() for f in futs]


def fork(clients: list[LighthouseClient]) -> None:
    """Quorum 1 at step 0; 0 and 1 commit step 1 in quorum 2; replica 2 re-decides step 1 in quorum 3."""
    c0, c1, c2 = clients
    for c in clients:
        c.start_heartbeats()
    time.sleep(0.2)
    assert {q.quorum_id for q in ask_all(clients, 0)} == {1}
    c2.stop_heartbeats()  # replica 2 goes silent in step 1
    time.sleep(DETECT_S + 0.3)
    q2 = ask_all([c0, c1], 1, commit_failed=True)
    assert {q.quorum_id for q in q2} == {2} and q2[0].member_ids == ("0", "1")
    c0.stop_heartbeats()  # 0 and 1 commit step 1 and go silent in step 2
    c1.stop_heartbeats()
    c2.start_heartbeats()
    time.sleep(DETECT_S + 0.3)
    q3 = c2.get_quorum(1, ftar_addresses=addrs(2), commit_failed=True, num_replicas=3, timeout_s=10)
    assert q3.quorum_id == 3 and q3.member_ids == ("2",) and q3.max_step == 1, q3.reason


def test_a_restarted_lighthouse_rebuilds_the_lineage_from_the_replicas():
    port = free_port()
    cfg = LighthouseConfig(bind=f"127.0.0.1:{port}", join_timeout_s=0.2, detect_s=DETECT_S)
    clients = [LighthouseClient(f"127.0.0.1:{port}", "job", i, outage_s=30.0) for i in range(3)]
    first = LighthouseThread(cfg)
    first.start()
    second = None
    try:
        fork(clients)
        assert [c.lineage.entries for c in clients] == [((1, 0), (2, 1)), ((1, 0), (2, 1)), ((1, 0), (3, 1))]
        first.stop()  # the lighthouse restarts with empty memory while 2 trains step 2
        second = LighthouseThread(cfg)
        second.start()
        for c in clients[:2]:
            c.start_heartbeats()  # 0 and 1 wake up: they committed step 2 in quorum 2, 2 in quorum 3
        time.sleep(0.2)
        qs = ask_all(clients, 3)
        # Before the lineage was rebuilt all three were "healthy at step 3" holding two models.
        assert {q.quorum_id for q in qs} == {4}, [q.reason for q in qs]
        q = qs[0]
        assert q.healthy == ("2",) and q.behind == ("0", "1") and q.sources_for("0") == ("2",), q.reason
        assert "lighthouse restarted" in q.reason and "quorum 3 re-decided step 1" in q.reason, q.reason
        # Once caught up in quorum 4 they are members of the lineage again: the next round is plain.
        qs = ask_all(clients, 4)
        assert qs[0].healthy == ("0", "1", "2") and "fenced" not in qs[0].reason
    finally:
        for c in clients:
            c.close()
        first.stop()
        if second is not None:
            second.stop()


def test_a_fork_in_the_last_step_ends_with_the_verdict_not_two_final_states():
    """The job has 2 steps: 0 and 1 committed steps 1 and 2 in quorum 2 (its last), replica
    2 re-decided step 1 in quorum 3 and trains on. No request of 0 and 1 follows, so no quorum can fence them:
    their Leave is judged instead. They are told their state forked (and from which step),
    and their `finished` does not end the job while the lineage's holder still trains."""
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.2, detect_s=DETECT_S)) as lh:
        clients = [LighthouseClient(lh.address, "job", i) for i in range(3)]
        c0, c1, c2 = clients
        try:
            fork(clients)
            assert c0.leave(3, finished=True) and c1.leave(3, finished=True)
            assert c0.forked is not None and c0.forked[0] == 1, c0.forked
            assert "quorum 3 re-decided step 1 after its last quorum 2" in c0.forked[1]
            # The job did not end: the lineage's holder gets its quorum for step 1's successor
            # (before the fix, 0's `finished` ended the job and 2 was answered JobFinished).
            q = c2.get_quorum(2, ftar_addresses=addrs(2), num_replicas=3, timeout_s=10)
            assert q.member_ids == ("2",) and q.max_step == 2, q.reason
            # The lineage's holder finishes: its Leave ends the job, and it is not forked.
            assert c2.leave(3, finished=True) and c2.forked is None
            with LighthouseClient(lh.address, "job", 1, rejoin=True) as late:
                with pytest.raises(JobFinished, match="already finished at step 3"):
                    late.get_quorum(0, ftar_addresses=addrs(1), timeout_s=10)
        finally:
            for c in clients:
                c.close()


def test_a_malformed_lineage_report_is_refused_with_the_reason():
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.2, detect_s=DETECT_S)) as lh:
        with LighthouseClient(lh.address, "job", 0) as c:
            c.lineage = Lineage(entries=((3, 5), (2, 7)))  # not rising: no replica's lineage looks like this
            with pytest.raises(InvalidLighthouseRequest, match="rise in quorum id and step"):
                c.get_quorum(0, ftar_addresses=addrs(0), num_replicas=1, timeout_s=5)
            c.lineage = Lineage()
            assert c.get_quorum(0, ftar_addresses=addrs(0), num_replicas=1, timeout_s=5).quorum_id == 1


def test_a_cut_report_makes_the_restarted_lighthouse_forget_the_older_quorums():
    """The lighthouse's merge of reports (the pure rule: tests/test_quorum_lineage.py): a full
    report's older ids are forgotten, a shorter one is whole, and ids this lighthouse decided
    itself are never forgotten."""
    from fthsdp.control.lighthouse import Lighthouse, _Job
    from fthsdp.control.quorum import forked_at, lineage_report

    holder = Lineage()
    for q, s in ((1, 0), (3, 1), (4, 3), (5, 5), (6, 7), (7, 9)):
        holder = holder.after(q, s)
    job = _Job("job")
    Lighthouse._merge_lineage(job, "0", lineage_report(Lineage().after(1, 0).after(2, 1)))
    assert job.lineage.entries == ((1, 0), (2, 1)) and job.lineage.dropped_through == 0
    Lighthouse._merge_lineage(job, "2", lineage_report(holder))
    assert job.lineage.dropped_through == 3 and forked_at(job.lineage, 2, 3) == (0, 0)
    # After its first quorum (8) the lighthouse reads only entries older than it; a later full
    # report of a replica forgets no more than what precedes that report's old part.
    job.lineage, job.lineage_from = job.lineage.after(8, 11), 8
    Lighthouse._merge_lineage(job, "2", [6, 7, 7, 9, 8, 11, 9, 13])
    assert job.lineage.dropped_through == 5 and job.lineage.entries[-1] == (8, 11)
    assert forked_at(job.lineage, 7, 10) is None


def test_a_fenced_replicas_fingerprint_of_its_forked_state_is_not_judged_against_the_lineage():
    """0 and 1 hold the fingerprint of their forked state (3 committed steps, the last two in
    quorum 2) until they commit again, and send it with every beat. Fenced into quorum 4, they
    beat as its members (last_quorum_id 4): judged by that id, their fingerprint was compared
    with 2's of the same step and the lighthouse stopped the job as silent data corruption
    (the fresh-clone CI found it in tests/test_lineage_fork.py). The quorum that committed the
    fingerprinted state is what is judged now; 2's fingerprint, of the lineage, still counts."""
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.2, detect_s=DETECT_S)) as lh:
        clients = [LighthouseClient(lh.address, "job", i, heartbeat_interval_s=0.05) for i in range(3)]
        c0, c1, c2 = clients
        try:
            fork(clients)
            for c in (c0, c1):
                c.report_fingerprint(3, 0xBAD, 2)  # of their state after steps 1 and 2 in quorum 2
            c2.report_fingerprint(3, 0x600D, 3)  # of the lineage's: steps 1 and 2 in quorum 3
            c0.start_heartbeats()
            c1.start_heartbeats()
            time.sleep(0.2)
            qs = ask_all(clients, 3)
            assert {q.quorum_id for q in qs} == {4} and qs[0].behind == ("0", "1"), qs[0].reason
            assert all(c.last_heartbeat is not None for c in clients)
            time.sleep(0.3)  # several beats of 0 and 1 as members of quorum 4, with the old fingerprint
            qs = ask_all(clients, 4)  # before the fix: SilentDataCorruption (DATA_LOSS), the job stopped
            assert {q.quorum_id for q in qs} == {4}, [q.reason for q in qs]
            job = c2.status()[0]
            assert job.sdc_fatal == "" and job.sdc_events == ()
            fps = {r.replica_id: (r.fingerprint, r.fingerprint_step) for r in job.replicas}
            assert fps == {"0": (None, 0), "1": (None, 0), "2": (0x600D, 3)}, fps
        finally:
            for c in clients:
                c.close()
