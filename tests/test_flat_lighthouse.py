"""The flat lighthouse's steady-state answer (members_omitted): a replica that holds the
quorum id's view gets ~100 bytes instead of every member, and completes it itself; any
change (a new quorum id, a member behind, a client that did not ask for it) gets the
answer in full. Real gRPC on loopback, real clients."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses

import pytest

from fthsdp.control import quorum as qm
from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import LighthouseClient, LighthouseError, keep_members

N = 4


def _round(clients, steps, failed=()):
    with cf.ThreadPoolExecutor(len(clients)) as ex:
        return list(ex.map(lambda i: clients[i].get_quorum(
            steps[i], ftar_addresses=[f"127.0.0.1:{20000 + i}"], state_server_address=f"127.0.0.1:{30000 + i}",
            num_replicas=N, commit_failed=i in failed, timeout_s=30.0), range(len(clients))))


def test_steady_answers_leave_out_the_members_and_any_change_sends_them():
    with LighthouseThread(LighthouseConfig(join_timeout_s=20.0, detect_s=20.0)) as lh:
        clients = [LighthouseClient(lh.address, "compact", str(i)) for i in range(N)]
        stats = lh.server.stats
        try:
            first = _round(clients, [0] * N)
            c0 = stats["replies_members_omitted"]
            second = _round(clients, [1] * N)
            c1 = stats["replies_members_omitted"]
            # Replica 3 failed its commit: a new quorum id, 3 behind: full answers.
            third = _round(clients, [2, 2, 2, 1], failed={3})
            c2 = stats["replies_members_omitted"]
            # Same quorum id, but 3 is still behind (it fetched, then its all-reduce failed: no
            # commit_failed here, as after a lost answer): full answers while anyone is behind.
            fourth = _round(clients, [3, 3, 3, 2])
            c3 = stats["replies_members_omitted"]
            fifth = _round(clients, [4] * N)
            c4 = stats["replies_members_omitted"]
        finally:
            for c in clients:
                c.close()
    assert (c0, c1, c2, c3, c4) == (0, N, N, N, 2 * N)
    for a, b in zip(first, second):  # the completed compact answer is the full answer of step 1
        assert b.quorum_id == a.quorum_id == 1 and b.max_step == 1 and b.healthy == a.healthy
        assert b.rings == a.rings and b.behind == () and b.recovery == {}
        assert [m.replica_id for m in b.members] == [m.replica_id for m in a.members]
        assert all(m.step == 1 for m in b.members)
        assert [m.state_server_address for m in b.members] == [m.state_server_address for m in a.members]
    assert third[0].quorum_id == 2 and third[0].behind == ("3",) and third[3].sources_for("3")
    assert fourth[0].quorum_id == 2 and fourth[0].behind == ("3",)
    assert fifth[0].quorum_id == 2 and fifth[0].healthy == ("0", "1", "2", "3") and fifth[0].max_step == 4


def test_a_client_that_does_not_ask_for_it_gets_the_members():
    """An older client (no accepts_members_omitted) is answered as before (rings omitted only)."""
    from fthsdp.control.lighthouse import pb2
    from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION

    with LighthouseThread(LighthouseConfig(join_timeout_s=20.0, detect_s=20.0)) as lh:
        import grpc

        from fthsdp.proto import lighthouse as load_stubs

        _, pb2_grpc = load_stubs()
        with grpc.insecure_channel(lh.address) as ch:
            stub = pb2_grpc.LighthouseStub(ch)

            def ask(step: int, last: int) -> pb2.Quorum:
                return stub.GetQuorum(pb2.QuorumRequest(
                    protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="old", replica_id="0", step=step,
                    ftar_addresses=["127.0.0.1:20000"], state_server_address="127.0.0.1:30000", local_world_size=1,
                    last_quorum_id=last), timeout=10).quorum

            q1 = ask(0, 0)
            q2 = ask(1, q1.quorum_id)
    assert q2.rings_omitted and not q2.members_omitted and [m.replica_id for m in q2.members] == ["0"]


def test_keep_members_refuses_an_answer_it_cannot_complete():
    members = tuple(qm.Member(str(i), 5, (), f"127.0.0.1:{30000 + i}") for i in range(3))
    held = qm.Quorum(quorum_id=7, members=members, max_step=5, healthy=("0", "1", "2"), behind=(),
                     rings=(tuple(f"127.0.0.1:{20000 + i}" for i in range(3)),))
    compact = qm.Quorum(quorum_id=7, members=(), max_step=6, healthy=(), behind=(), num_healthy=3)
    got = keep_members(compact, held)
    assert got.member_ids == held.member_ids and got.healthy == held.member_ids and got.rings == held.rings
    assert all(m.step == 6 for m in got.members)
    with pytest.raises(LighthouseError, match="holds the view of quorum 7"):
        keep_members(dataclasses.replace(compact, quorum_id=8), held)
    with pytest.raises(LighthouseError, match="no view"):
        keep_members(compact, None)
    with pytest.raises(LighthouseError, match="2 healthy of the 3"):
        keep_members(dataclasses.replace(compact, num_healthy=2), held)
