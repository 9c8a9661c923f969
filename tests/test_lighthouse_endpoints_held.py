"""Quorum requests that leave their endpoints out (QuorumRequest.endpoints_held).

Real lighthouse, real gRPC, real clients: after one answered request a leader
stops resending its shards' endpoints, and the quorum still carries them; a
lighthouse restarted on the same address, which holds nothing, refuses the
lean request with ENDPOINTS_NOT_HELD and the client sends them again, on
unary calls and on sessions alike; malformed uses of the field get clear
errors. And the garbage-collector policy the lighthouse's process runs under.
"""

from __future__ import annotations

import gc
import socket
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from fthsdp import gc_policy
from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import HeldEndpoints, LighthouseClient, endpoints_not_held
from fthsdp.proto import ENDPOINTS_NOT_HELD, LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as load_stubs

pb2, pb2_grpc = load_stubs()
SHARDS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _endpoints(i: int) -> tuple[list[str], str]:
    return [f"127.0.0.{i + 2}:{21000 + 10 * i + k}" for k in range(SHARDS)], f"127.0.0.{i + 2}:{31000 + i}"


def _round(clients: list[LighthouseClient], step: int):
    def ask(i: int):
        ftar, server = _endpoints(i)
        return clients[i].get_quorum(step, ftar_addresses=ftar, state_server_address=server, timeout_s=20.0)

    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(ask, range(len(clients))))


def _check_members(q, n: int, viewer: str) -> None:
    """Every member's endpoints as it sent them first, whether or not it sent them again:
    per member in ring order, its endpoints of each shard (``viewer``'s neighbour view; n <= 3,
    so its neighbourhood is every member)."""
    assert sorted(q.member_ids) == [str(i) for i in range(n)]
    order = [int(r) for r in q.member_ids]
    assert [m.state_server_address for m in q.members] == [_endpoints(i)[1] for i in order]
    assert len(q.rings) == SHARDS
    assert q.ring_addresses(viewer) == [list(_endpoints(i)[0]) for i in order]


@pytest.mark.parametrize("sessions", [True, False], ids=["session", "unary"])
def test_endpoints_go_once_and_again_after_a_lighthouse_restart(sessions):
    n, port = 2, _free_port()
    cfg = LighthouseConfig(bind=f"127.0.0.1:{port}", min_replicas=n, join_timeout_s=5.0, detect_s=5.0)
    clients = [LighthouseClient(f"127.0.0.1:{port}", "held", str(i), rpc_timeout_s=10.0, session=sessions,
                                outage_s=20.0) for i in range(n)]
    try:
        with LighthouseThread(cfg) as lh:
            for step in range(3):
                qs = _round(clients, step)
                assert len({q.quorum_id for q in qs}) == 1
                for i, q in enumerate(qs):
                    _check_members(q, n, str(i))
            stats = dict(lh.server.stats)
        # the first request of each client carried the endpoints, the next two did not
        assert stats["requests_endpoints_held"] == 2 * n
        assert stats["endpoints_not_held"] == 0
        with LighthouseThread(cfg) as lh2:  # same address, empty memory
            qs = _round(clients, 3)
            for i, q in enumerate(qs):
                _check_members(q, n, str(i))
            qs = _round(clients, 4)
            stats2 = dict(lh2.server.stats)
        # each client's lean request was refused once, resent whole, and lean again after
        assert stats2["endpoints_not_held"] == n
        assert stats2["requests_endpoints_held"] == n
    finally:
        for c in clients:
            c.close()


def test_lean_requests_the_lighthouse_cannot_honour_get_clear_errors():
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.2, detect_s=2.0)) as lh:
        with grpc.insecure_channel(lh.address) as ch:
            stub = pb2_grpc.LighthouseStub(ch)
            base = dict(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="lean", replica_id="0", step=0,
                        local_world_size=1)
            # never sent its endpoints to this lighthouse: told to send them
            with pytest.raises(grpc.RpcError) as e:
                stub.GetQuorum(pb2.QuorumRequest(**base, endpoints_held=True), timeout=5)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert e.value.details().startswith(ENDPOINTS_NOT_HELD) and "send ftar_addresses" in e.value.details()
            assert endpoints_not_held(e.value.code(), e.value.details())
            # both at once: which one is meant?
            with pytest.raises(grpc.RpcError) as e:
                stub.GetQuorum(pb2.QuorumRequest(**base, endpoints_held=True, ftar_addresses=["127.0.0.1:1"]),
                               timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "endpoints_held is set but the request also carries" in e.value.details()
            # a whole request is answered and says the endpoints may be left out next time
            resp = stub.GetQuorum(pb2.QuorumRequest(**base, ftar_addresses=["127.0.0.1:4000"],
                                                    state_server_address="127.0.0.1:5000"), timeout=5)
            assert resp.endpoints_omittable and [m.replica_id for m in resp.quorum.members] == ["0"]
            resp = stub.GetQuorum(pb2.QuorumRequest(**{**base, "step": 1}, last_quorum_id=resp.quorum.quorum_id,
                                                    endpoints_held=True), timeout=5)
            assert resp.quorum.quorum_id >= 1
        assert lh.server.stats["requests_endpoints_held"] == 1


def test_held_endpoints_rule():
    h = HeldEndpoints()
    req = pb2.QuorumRequest()
    sent = h.fill(req, ["a:1", "b:2"], "c:3")
    assert list(req.ftar_addresses) == ["a:1", "b:2"] and not req.endpoints_held
    h.heard(sent, True)
    req = pb2.QuorumRequest()
    h.fill(req, ("a:1", "b:2"), "c:3")
    assert req.endpoints_held and not req.ftar_addresses and not req.state_server_address
    req = pb2.QuorumRequest()  # an endpoint changed: whole again
    h.fill(req, ("a:1", "b:9"), "c:3")
    assert not req.endpoints_held and list(req.ftar_addresses) == ["a:1", "b:9"]
    h.heard(sent, False)  # an older lighthouse never says omittable
    req = pb2.QuorumRequest()
    h.fill(req, ("a:1", "b:2"), "c:3")
    assert not req.endpoints_held
    h.heard(sent, True)
    h.lost()
    req = pb2.QuorumRequest()
    h.fill(req, ("a:1", "b:2"), "c:3")
    assert not req.endpoints_held
    assert not endpoints_not_held(grpc.StatusCode.FAILED_PRECONDITION, "something else")


def test_low_pause_gc_sets_and_restores_the_collector():
    gc.unfreeze()  # whatever an earlier test froze: back under the collector
    before = gc.get_threshold()
    junk = [[i] for i in range(1000)]
    with gc_policy.low_pause_gc(12345):
        assert gc.get_threshold()[0] == 12345 and gc.get_threshold()[1:] == before[1:]
        assert gc.get_freeze_count() >= len(junk)
        gc.collect()  # (CPython 3.12 adds the immortal objects a full collection meets to the frozen count)
    # Unfrozen on exit: not even the objects a full collection put among the frozen stay there.
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    gc.freeze()  # frozen by someone else first: unfrozen too (a freeze cannot be undone in part)
    with gc_policy.low_pause_gc():
        pass
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
    with pytest.raises(ValueError, match="young threshold"):
        with gc_policy.low_pause_gc(0):
            pass


def test_a_lighthouse_run_as_a_program_answers_refusals_on_sessions_with_their_codes(tmp_path):
    """`python -m fthsdp.control.lighthouse` (what `fthsdp run` starts) once ran a second copy
    of its module, whose refusals the session handler did not recognise: each came back as
    INTERNAL with no sequence number and the refused request waited for its deadline (the
    emulation found it when a restarted lighthouse refused lean requests)."""
    import os
    import subprocess
    import sys
    import time

    from fthsdp.control.lighthouse_client import InvalidLighthouseRequest

    lh = subprocess.Popen([sys.executable, "-m", "fthsdp.control.lighthouse", "--bind", "127.0.0.1:0", "--insecure",
                           "--join-timeout", "0.2"], env=dict(os.environ, PYTHONUNBUFFERED="1"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = lh.stdout.readline()
        assert line.startswith("lighthouse listening on"), line
        address = line.split()[-1]
        # A follower (process 1 of 2) asking for a quorum is refused INVALID_ARGUMENT by the
        # lighthouse's own checks, on its session.
        with LighthouseClient(address, "prog", "0", process_index=1, num_processes=2, rpc_timeout_s=5.0) as c:
            t0 = time.monotonic()
            with pytest.raises(InvalidLighthouseRequest, match="only a replica's leader"):
                c.get_quorum(0, ftar_addresses=["127.0.0.1:2"], local_world_size=2, timeout_s=30.0)
            assert time.monotonic() - t0 < 10.0  # answered, not left to its 30 s deadline
            assert c._route.session is not None  # it went over the session, not a unary fallback
        # A lean request this lighthouse cannot honour: FAILED_PRECONDITION, then resent whole.
        with LighthouseClient(address, "prog", "1", rpc_timeout_s=5.0) as c:
            c._held_endpoints.heard((("127.0.0.1:3",), ""), True)  # as if an earlier lighthouse held them
            q = c.get_quorum(0, ftar_addresses=["127.0.0.1:3"], timeout_s=30.0)
            assert q.member_ids == ("1",) and q.ring_addresses("1") == [["127.0.0.1:3"]]
    finally:
        lh.terminate()
        lh.wait(10)
    assert "a message failed" not in lh.stderr.read()
