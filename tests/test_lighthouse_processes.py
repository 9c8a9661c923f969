"""The lighthouse protocol for replicas of several processes (issue 11, items 2 and 4/5).

Pure: a process's view of a quorum carries the members and only its own shards'
rings and recovery sources. Real lighthouse (gRPC, real clients): every process
heartbeats under (replica, process) and registers its own endpoints; a replica
asks only once all its processes registered; a follower gets its own view by the
quorum id its leader got; one silent process makes its whole replica dead
although its leader keeps heartbeating.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from fthsdp.control import quorum as qm
from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import (InvalidLighthouseRequest, LighthouseClient, LighthouseError, Registration,
                                           ReplicaIdHeld)
from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as load_stubs

pb2, pb2_grpc = load_stubs()
DETECT = 0.5


def ftar(r: int, p: int, d: int) -> list[str]:
    """Process p of replica r: endpoints of its d shards (global shards p*d .. p*d+d-1)."""
    return [f"127.0.0.{r + 2}:{20000 + 100 * p + k}" for k in range(d)]


def server(r: int, p: int) -> str:
    return f"127.0.0.{r + 2}:{30000 + p}"


def full_member(r: int, step: int, procs: int, d: int) -> qm.Member:
    return qm.Member(str(r), step, tuple(a for p in range(procs) for a in ftar(r, p, d)), server(r, 0), procs * d,
                     procs, tuple(server(r, p) for p in range(procs)))


def test_a_process_view_carries_only_its_own_shards_rings_and_sources():
    # 3 replicas x 2 processes x 2 shards; replica 2 behind, healthy 0 and 1.
    members = tuple(full_member(r, 5 if r < 2 else 0, 2, 2) for r in range(3))
    recovery = qm.assign_sources([("2", 4)], ("0", "1"))
    q = qm.Quorum(9, members, 5, ("0", "1"), ("2",), recovery, 2, 3, "test")
    v = qm.process_view(q, "0", 2, 2)  # healthy replica 0, process 1: shards 2 and 3
    assert v.rings == (tuple(ftar(r, 1, 2)[0] for r in range(3)), tuple(ftar(r, 1, 2)[1] for r in range(3)))
    assert v.first_shard == 2 and v.sources == () and v.recovery == {}
    assert all(m.ftar_addresses == () for m in v.members)  # no member's endpoint list
    assert v.ring_addresses() == [ftar(r, 1, 2) for r in range(3)]  # per member: this process's two rings
    b = qm.process_view(q, "2", 2, 2)  # behind replica 2, process 1
    assert [(s.shard, s.replica_id) for s in b.sources] == [(2, recovery["2"][2]), (3, recovery["2"][3])]
    # each shard comes from the state server of the source's process that holds that shard (process 1)
    assert [s.state_server_address for s in b.sources] == [server(int(s.replica_id), 1) for s in b.sources]
    assert b.sources_for("2") == (recovery["2"][2], recovery["2"][3])
    assert q.member("1").server_for(3) == server(1, 1) and q.member("1").server_for(1) == server(1, 0)
    with pytest.raises(ValueError, match="outside"):
        qm.process_view(q, "0", 4, 2)


def test_a_views_size_grows_with_the_askers_shards_not_with_every_endpoint():
    def size(procs: int) -> int:
        from fthsdp.control.lighthouse import quorum_to_proto

        members = tuple(full_member(r, 1, procs, 2) for r in range(16))
        q = qm.Quorum(3, members, 1, tuple(m.replica_id for m in members), (), {}, 16, 16, "x")
        return len(quorum_to_proto(qm.process_view(q, "0", 0, 2)).SerializeToString()), \
            len(quorum_to_proto(q).SerializeToString())

    (v1, full1), (v8, full8) = size(1), size(8)
    assert full8 > 4 * full1  # every endpoint: grows with the replica's processes
    assert v8 < 1.2 * v1  # a process's view: the same size whatever the replica's process count


@pytest.fixture
def lighthouse():
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.3, detect_s=DETECT, tick_s=0.02)) as lh:
        yield lh


def clients(address: str, job: str, replicas: int, procs: int, d: int,
            ring_form: str = "neighbours") -> dict[tuple[int, int], LighthouseClient]:
    out = {}
    for r in range(replicas):
        for p in range(procs):
            c = LighthouseClient(address, job, r, heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5,
                                 process_index=p, num_processes=procs, ring_form=ring_form)
            c.register(ftar(r, p, d), server(r, p), procs * d)
            out[(r, p)] = c
    return out


def beat_until_registered(cs: dict, timeout_s: float = 5.0) -> None:
    """Every process heartbeats, until the lighthouse holds every one's registration."""
    for c in cs.values():
        c.start_heartbeats()
    deadline = time.monotonic() + timeout_s
    while not all(c.registration.held for c in cs.values()):
        assert time.monotonic() < deadline, "a process never registered"
        time.sleep(0.02)


def ask(cs: dict, replicas: int, d: int, step: int = 0, timeout_s: float = 10.0) -> list[qm.Quorum]:
    with ThreadPoolExecutor(replicas) as ex:
        futs = [ex.submit(cs[(r, 0)].get_quorum, step, ftar_addresses=ftar(r, 0, d), state_server_address=server(r, 0),
                          num_replicas=replicas, timeout_s=timeout_s) for r in range(replicas)]
        return [f.result() for f in futs]


def test_registration_goes_out_until_held_and_again_when_forgotten():
    """The one registration rule both heartbeating clients use (the synchronous client and
    the emulation's asyncio one): endpoints ride the heartbeats until a reply says held, go
    out again when a reply says not held (a restarted lighthouse), and a reply to a request
    that carried an older registration does not mark a newer one held."""
    reg = Registration()
    req = pb2.HeartbeatRequest()
    assert reg.fill(req) is None and not req.ftar_addresses  # nothing given: nothing sent
    reg.give(["127.0.0.1:7000", "127.0.0.1:7001"], "http://127.0.0.1:7100", 4)
    req = pb2.HeartbeatRequest()
    sent = reg.fill(req)
    assert list(req.ftar_addresses) == ["127.0.0.1:7000", "127.0.0.1:7001"] and req.local_world_size == 4
    reg.heard(sent, True)
    req = pb2.HeartbeatRequest()
    assert reg.fill(req) == sent and not req.ftar_addresses and not req.state_server_address  # held: not sent
    reg.heard(sent, False)  # a restarted lighthouse forgot them
    req = pb2.HeartbeatRequest()
    sent = reg.fill(req)
    assert len(req.ftar_addresses) == 2
    reg.give(["127.0.0.1:7002"], "http://127.0.0.1:7101", 2)  # new endpoints while that beat was in flight
    reg.heard(sent, True)
    assert not reg.held  # the reply spoke for the old registration


def test_every_process_registers_and_gets_its_own_view(lighthouse):
    cs = clients(lighthouse.address, "mp", 2, 2, 2)
    try:
        beat_until_registered(cs)  # every heartbeat carried its addresses once
        q0, q1 = ask(cs, 2, 2)
        assert q0.quorum_id == q1.quorum_id and q0.member_ids == ("0", "1")
        # the leaders: shards 0, 1 (in a ring of two, a neighbour view holds every member)
        assert q0.ring_neighbours and q0.ring_addresses("0") == [ftar(0, 0, 2), ftar(1, 0, 2)]
        v = cs[(1, 1)].get_view(q0.quorum_id)  # replica 1's follower, by its leader's quorum id
        assert v.first_shard == 2 and v.ring_addresses("1") == [ftar(0, 1, 2), ftar(1, 1, 2)]
        assert v.member_ids == q0.member_ids and v.max_step == q0.max_step
        [st] = cs[(0, 0)].status()
        assert [(r.replica_id, r.num_processes, r.dead) for r in st.replicas] == [("0", 2, False), ("1", 2, False)]
        assert st.quorum.member("1").ftar_addresses == tuple(ftar(1, 0, 2) + ftar(1, 1, 2))  # Status: all
        with pytest.raises(LighthouseError) as ei:
            cs[(1, 1)].get_view(q0.quorum_id + 5)
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and "not held" in str(ei.value)
        with grpc.insecure_channel(lighthouse.address) as ch:
            with pytest.raises(grpc.RpcError) as e2:
                pb2_grpc.LighthouseStub(ch).GetView(pb2.ViewRequest(
                    protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="mp", replica_id="1", process_index=2,
                    quorum_id=q0.quorum_id), timeout=5)
            assert e2.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside 0..1" in e2.value.details()
            with pytest.raises(grpc.RpcError) as e3:  # a process saying it is process 3 of 2
                pb2_grpc.LighthouseStub(ch).Heartbeat(pb2.HeartbeatRequest(
                    protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="mp", replica_id="1", process_index=3,
                    num_processes=2), timeout=5)
            assert e3.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside 0..1" in e3.value.details()
    finally:
        for c in cs.values():
            c.close()


def test_a_followers_view_of_a_new_quorum_comes_as_a_ring_delta_against_the_one_it_holds(lighthouse):
    """Replica 2 (2 processes x 2 shards) joins replicas 0 and 1: the followers of 0 and 1 hold
    their views of the first quorum and get the second's rings as a delta (replica 2's endpoints
    of their shards only), which they rebuild into the whole view; replica 2's follower, holding
    none, gets it whole. A follower that says it holds a quorum it is not a member of gets the
    view whole too; a negative held id is refused with the reason."""
    cs = clients(lighthouse.address, "mpd", 3, 2, 2, ring_form="delta")
    try:
        beat_until_registered(cs)
        with ThreadPoolExecutor(2) as ex:
            first = list(ex.map(lambda r: cs[(r, 0)].get_quorum(0, ftar_addresses=ftar(r, 0, 2),
                                                                  state_server_address=server(r, 0),
                                                                  num_replicas=3, timeout_s=10), (0, 1)))
        assert {q.quorum_id for q in first} == {1} and first[0].member_ids == ("0", "1")
        for r in (0, 1):
            assert cs[(r, 1)].get_view(1).ring_addresses() == [ftar(0, 1, 2), ftar(1, 1, 2)]
        with ThreadPoolExecutor(3) as ex:  # the newcomer first: the last quorum's members are waited for
            def asks(r: int):
                return cs[(r, 0)].get_quorum(1, ftar_addresses=ftar(r, 0, 2), state_server_address=server(r, 0),
                                             num_replicas=3, timeout_s=10)

            late = ex.submit(asks, 2)
            time.sleep(0.3)
            f0, f1 = ex.submit(asks, 0), ex.submit(asks, 1)
            second = [f0.result(), f1.result(), late.result()]
        qid = second[0].quorum_id
        assert qid > 1 and second[0].member_ids == ("0", "1", "2"), second[0].reason
        before = lighthouse.server.stats["replies_ring_delta"]
        views = {r: cs[(r, 1)].get_view(qid) for r in range(3)}
        assert lighthouse.server.stats["replies_ring_delta"] - before == 2  # 0's and 1's followers; 2 holds none
        for v in views.values():
            assert v.first_shard == 2 and v.ring_addresses() == [ftar(r, 1, 2) for r in range(3)]
        with grpc.insecure_channel(lighthouse.address) as ch:
            stub = pb2_grpc.LighthouseStub(ch)
            resp = stub.GetView(pb2.ViewRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="mpd",
                                                replica_id="2", process_index=1, quorum_id=qid, held_quorum_id=1,
                                                accepts_ring_delta=True), timeout=5)
            assert resp.quorum.rings_from == 0 and len(resp.quorum.rings[0].addresses) == 3  # 2 was not in 1
            with pytest.raises(grpc.RpcError) as e:
                stub.GetView(pb2.ViewRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="mpd",
                                             replica_id="1", process_index=1, quorum_id=qid, held_quorum_id=-3,
                                             accepts_ring_delta=True), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "held_quorum_id is -3" in e.value.details()
    finally:
        for c in cs.values():
            c.close()


def test_replicas_of_different_process_counts_are_refused(lighthouse):
    a = LighthouseClient(lighthouse.address, "shape", 0, process_index=0, num_processes=2)
    b = LighthouseClient(lighthouse.address, "shape", 1, process_index=0, num_processes=1)
    try:
        a.heartbeat()
        with ThreadPoolExecutor(1) as ex:
            f = ex.submit(a.get_quorum, 0, ftar_addresses=ftar(0, 0, 2), num_replicas=2, timeout_s=2)
            time.sleep(0.2)
            with pytest.raises(LighthouseError, match="num_processes 1 .* conflicts with 2 of live replica '0'"):
                b.get_quorum(0, ftar_addresses=ftar(1, 0, 4), num_replicas=2, timeout_s=2)
            with pytest.raises(LighthouseError):
                f.result()  # replica 0 alone: its follower never registered, no quorum
    finally:
        a.close()
        b.close()


def test_a_followers_endpoint_count_is_its_leaders():
    """A follower registering another number of shards than its leader made the replica's endpoint
    list the wrong length, and cutting any member's view of a quorum holding it raised. The
    leader's count rules; a follower registered before its leader with another count is dropped."""
    from fthsdp.control.lighthouse import _Group

    g = _Group(2, since=0.0)
    assert g.register(1, ("a:1", "a:2"), "s1") is None  # before its leader: kept for now
    assert g.register(0, ("b:1",), "s0") is None  # the leader holds one shard: the follower's two go
    assert 1 not in g.ftar and 1 not in g.server
    err = g.register(1, ("a:1", "a:2"), "s1")
    assert err is not None and "registers 2 FTAR endpoint(s) but its leader (process 0) registered 1" in err
    assert g.register(1, ("a:1",), "s1") is None and g.endpoints(0.0, 1.0) == (("b:1", "a:1"), ("s0", "s1"))


def test_a_follower_of_another_shape_than_its_live_leader_is_refused(lighthouse):
    cs = clients(lighthouse.address, "shape2", 1, 2, 1)
    wrong: list[LighthouseClient] = []
    try:
        beat_until_registered(cs)
        cs[(0, 1)].stop_heartbeats()  # the follower dies; one of another shape comes in its place
        time.sleep(DETECT + 0.3)  # its old process is silent: the id is free to take over
        for procs, d, match in ((2, 2, "registers 2 FTAR endpoint.* its leader .*registered 1"),
                                (3, 1, "says its replica has 3 processes but its leader .* registered 2")):
            c = LighthouseClient(lighthouse.address, "shape2", 0, process_index=1, num_processes=procs)
            wrong.append(c)
            c.register(ftar(0, 1, d), server(0, 1), procs * d)
            with pytest.raises(LighthouseError, match=match):
                c._beat()
        assert lighthouse.server._jobs["shape2"].groups["0"].num_processes == 2  # the leader's group is whole
    finally:
        for c in [*cs.values(), *wrong]:
            c.close()


def test_followers_whose_leader_never_comes_are_bounded_and_forgotten():
    """A follower whose leader was never heard opens a process group: at most as many as the job
    may have replicas, and dropped once silent (they count in the job's size, its budget)."""
    from fthsdp.control.guard import Limits

    cfg = LighthouseConfig(join_timeout_s=0.3, detect_s=DETECT, tick_s=0.02, limits=Limits(max_replicas_per_job=2))
    orphans: list[LighthouseClient] = []
    with LighthouseThread(cfg) as lh:
        try:
            for r in range(3):
                orphans.append(LighthouseClient(lh.address, "orphans", 10 + r, process_index=1, num_processes=2))
            orphans[0]._beat()
            orphans[1]._beat()
            with pytest.raises(LighthouseError, match="already holds 2 replicas of several processes"):
                orphans[2]._beat()
            job = lh.server._jobs["orphans"]
            assert set(job.groups) == {"10", "11"} and lh.server._job_size("orphans") == 2
            deadline = time.monotonic() + DETECT + 5
            while job.groups:  # silent a detection window: dropped at the next sweep (every 2 s)
                assert time.monotonic() < deadline, sorted(job.groups)
                time.sleep(0.05)
            assert lh.server._job_size("orphans") == 0
            orphans[2]._beat()  # room again
        finally:
            for c in orphans:
                c.close()


def test_a_replica_asks_only_once_all_its_processes_registered(lighthouse):
    cs = clients(lighthouse.address, "reg", 2, 2, 1)
    try:
        for key, c in cs.items():
            if key != (1, 1):  # replica 1's follower is not up yet
                c.start_heartbeats()
        time.sleep(0.2)
        with ThreadPoolExecutor(2) as ex:
            f0 = ex.submit(cs[(0, 0)].get_quorum, 0, ftar_addresses=ftar(0, 0, 1), state_server_address=server(0, 0),
                           num_replicas=2, timeout_s=10)
            f1 = ex.submit(cs[(1, 0)].get_quorum, 0, ftar_addresses=ftar(1, 0, 1), state_server_address=server(1, 0),
                           num_replicas=2, timeout_s=10)
            time.sleep(0.1)
            [st] = cs[(0, 0)].status()
            assert "not asking until all its processes registered" in st.last_reason, st.last_reason
            cs[(1, 1)].start_heartbeats()  # it registers: replica 1 now asks
            f0.result()  # replica 0 is answered too
            q1 = f1.result()
        # replica 0 may have formed a quorum alone (the follower missed the join timeout); in any case
        # replica 1 is a member only with its follower's endpoints
        if "1" in q1.member_ids:
            assert q1.ring_addresses("1")[q1.rank_of("1")] == ftar(1, 0, 1)
            assert cs[(1, 1)].get_view(q1.quorum_id).ring_addresses("1")[q1.rank_of("1")] == ftar(1, 1, 1)
    finally:
        for c in cs.values():
            c.close()


def test_one_silent_process_makes_its_whole_replica_dead(lighthouse):
    cs = clients(lighthouse.address, "silent", 3, 2, 1)
    seen: list[tuple[tuple[str, ...], int]] = []
    lock = threading.Lock()

    def on_dead(dead, qid):
        with lock:
            seen.append((dead, qid))

    try:
        for key, c in cs.items():
            c.start_heartbeats(on_dead if key == (0, 0) else None)
        time.sleep(0.2)
        qs = ask(cs, 3, 1)
        assert qs[0].member_ids == ("0", "1", "2")
        cs[(1, 1)].stop_heartbeats()  # replica 1's follower freezes; its leader keeps heartbeating
        t0 = time.monotonic()
        while True:
            [st] = cs[(0, 0)].status()
            r1 = next(r for r in st.replicas if r.replica_id == "1")
            if r1.dead:
                break
            assert time.monotonic() - t0 < 3 * DETECT, "the replica of a silent process was not declared dead"
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert list(r1.silent_processes) == [1] and DETECT * 0.8 <= took < 2 * DETECT, (r1, took)
        assert cs[(1, 0)].heartbeating  # its leader is fine, yet the replica is dead
        deadline = time.monotonic() + 5
        while True:  # the survivors hear it as a dead member of their quorum
            with lock:
                if any("1" in dead and qid == qs[0].quorum_id for dead, qid in seen):
                    break
            assert time.monotonic() < deadline, seen
            time.sleep(0.02)
        # the next quorum forms without replica 1 although its leader asks too
        with ThreadPoolExecutor(3) as ex:
            futs = {r: ex.submit(cs[(r, 0)].get_quorum, 1, ftar_addresses=ftar(r, 0, 1),
                                 state_server_address=server(r, 0), num_replicas=3, timeout_s=3) for r in (0, 2)}
            q = futs[0].result()
        assert q.member_ids == ("0", "2"), q
    finally:
        for c in cs.values():
            c.close()


def test_a_followers_neighbour_view_holds_its_shards_of_its_ring_neighbourhood(lighthouse):
    """Four replicas x 2 processes x 2 shards: a follower's view of the leaders' quorum holds,
    for its own shards 2 and 3, only its replica's and the two neighbour replicas' endpoints."""
    cs = clients(lighthouse.address, "mpn", 4, 2, 2)
    try:
        beat_until_registered(cs)
        qs = ask(cs, 4, 2)
        qid = qs[0].quorum_id
        assert qs[0].member_ids == ("0", "1", "2", "3")
        for r in range(4):
            v = cs[(r, 1)].get_view(qid)
            near = {(r - 1) % 4, r, (r + 1) % 4}
            assert v.ring_neighbours and v.first_shard == 2
            assert v.ring_addresses(str(r)) == [ftar(m, 1, 2) if m in near else ["", ""] for m in range(4)]
    finally:
        for c in cs.values():
            c.close()


def test_a_dead_replicas_followers_no_longer_count_as_beating(lighthouse):
    """The lighthouse paces beats for the processes that beat it; a dead replica's group stays
    until the replica is forgotten, and its followers were still counted: every process was paced
    (and detection widened) for processes long dead."""
    cs = clients(lighthouse.address, "count", 2, 2, 1)
    try:
        beat_until_registered(cs)
        assert lighthouse.server.beating_processes() == 4
        for p in (0, 1):
            cs[(1, p)].close()  # replica 1 dies, both its processes
        deadline = time.monotonic() + 10
        while not any(r.replica_id == "1" and r.dead for j in cs[(0, 0)].status() for r in j.replicas):
            assert time.monotonic() < deadline, "replica 1 was never declared dead"
            time.sleep(0.05)
        # replica 0's two processes, once the lighthouse's next tick has recorded the death
        while lighthouse.server.beating_processes() != 2:
            assert time.monotonic() < deadline + 5, lighthouse.server.beating_processes()
            time.sleep(0.05)
    finally:
        for c in cs.values():
            c.close()


def test_a_restarted_groups_follower_takes_over_while_its_new_leader_asks(lighthouse):
    """A replica of two processes dies whole (no Leave) and restarts: its new leader asks for a
    quorum first, then its new follower beats. The follower's old process is judged by its own
    beats, so the new one takes the id over at once; before, the replica's pending request (its
    own new leader's) counted the old follower live, every beat of the new one was refused
    (PERMISSION_DENIED) and the replica stayed out until the leader's quorum wait ran out. A
    second process claiming a live follower's id is still refused."""
    cs = clients(lighthouse.address, "t", 2, 2, 1)
    new: list[LighthouseClient] = []

    def ask(c, r, step):
        return c.get_quorum(step, ftar_addresses=ftar(r, 0, 1), state_server_address=server(r, 0), num_replicas=2,
                            timeout_s=8)

    try:
        beat_until_registered(cs)
        assert [q.member_ids for q in ask_all_of(cs, 0, ask)] == [("0", "1")] * 2
        stranger = LighthouseClient(lighthouse.address, "t", 0, process_index=1, num_processes=2)
        new.append(stranger)
        with pytest.raises(ReplicaIdHeld, match="held by another live process"):  # replica 0's follower beats
            stranger._beat()
        for p in (0, 1):
            cs[(1, p)].stop_heartbeats()  # replica 1 dies whole, without a Leave
        deadline = time.monotonic() + 10
        while not any(r.replica_id == "1" and r.dead for j in cs[(0, 0)].status() for r in j.replicas):
            assert time.monotonic() < deadline, "replica 1 was never declared dead"
            time.sleep(0.05)
        for p in (0, 1):
            c = LighthouseClient(lighthouse.address, "t", 1, heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5,
                                 process_index=p, num_processes=2, rejoin=True)
            c.register(ftar(1, p, 1), server(1, p), 2)
            new.append(c)
        leader, follower = new[1], new[2]
        with ThreadPoolExecutor(2) as ex:
            rejoining = ex.submit(ask, leader, 1, 1)
            time.sleep(0.3)  # the new leader's request is pending
            follower._beat()  # accepted: its old process is silent
            follower.start_heartbeats()
            q = ask(cs[(0, 0)], 0, 1)
            assert q.member_ids == rejoining.result(10).member_ids == ("0", "1"), q
        assert follower.heartbeat_failures == 0
    finally:
        for c in [*cs.values(), *new]:
            c.close()


def ask_all_of(cs: dict, step: int, ask) -> list[qm.Quorum]:
    """Every replica's leader (process 0) asks at once."""
    leaders = sorted(r for r, p in cs if p == 0)
    with ThreadPoolExecutor(len(leaders)) as ex:
        return list(ex.map(lambda r: ask(cs[(r, 0)], r, step), leaders))


def test_a_replica_whose_processes_hold_fewer_shards_than_its_request_does_not_enter_the_quorum(lighthouse):
    """Replica 2's leader asks with local_world_size=4 while its two processes registered one FTAR
    endpoint each. Taken into the quorum, it broke every other process's view of it (a ValueError
    in the GetView handler: UNKNOWN, the follower without its view). It is not asking until its
    endpoints add up (the reason in the decision), and replicas 0 and 1 train on with whole views."""
    cs = clients(lighthouse.address, "liar", 2, 2, 2)
    stop = threading.Event()
    with grpc.insecure_channel(lighthouse.address) as ch:
        stub = pb2_grpc.LighthouseStub(ch)

        def beat_liar() -> None:  # after its leader's request: the beats register one endpoint per process
            while not stop.is_set():
                for p in range(2):
                    stub.Heartbeat(pb2.HeartbeatRequest(
                        protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="liar", replica_id="2", process_index=p,
                        num_processes=2, incarnation=f"2-{p}", ftar_addresses=ftar(2, p, 1),
                        state_server_address=server(2, p), local_world_size=2), timeout=5)
                stop.wait(0.05)

        beater = threading.Thread(target=beat_liar, daemon=True)
        try:
            beat_until_registered(cs)
            liar = stub.GetQuorum.future(pb2.QuorumRequest(
                protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="liar", replica_id="2", step=0,
                ftar_addresses=ftar(2, 0, 2), state_server_address=server(2, 0), local_world_size=4, num_processes=2,
                num_replicas=3, incarnation="2-0"), timeout=3)
            time.sleep(0.05)
            beater.start()
            time.sleep(0.1)
            with ThreadPoolExecutor(2) as ex:
                futs = [ex.submit(cs[(r, 0)].get_quorum, 0, ftar_addresses=ftar(r, 0, 2),
                                  state_server_address=server(r, 0), num_replicas=3, timeout_s=10) for r in range(2)]
                q, _ = [f.result() for f in futs]
            assert q.member_ids == ("0", "1"), q.reason
            v = cs[(1, 1)].get_view(q.quorum_id)
            assert v.first_shard == 2 and v.ring_addresses("1") == [ftar(0, 1, 2), ftar(1, 1, 2)]
            with pytest.raises(grpc.RpcError) as ei:
                liar.result()
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert ("replica 2: its 2 process(es) registered 2 FTAR endpoint(s) in all, its request has "
                    "local_world_size=4") in ei.value.details(), ei.value.details()
        finally:
            stop.set()
            if beater.is_alive():
                beater.join(5)
            for c in cs.values():
                c.close()


def test_a_follower_of_a_live_single_process_replica_is_refused(lighthouse):
    """A process saying it is process 1 of 2 of a replica whose live leader beats as a replica of
    one process opened a process group for it, and that replica was then held out of every quorum
    until "all its processes registered". It is refused; once the leader is silent past the
    detection window (a replica restarted with other settings), a group may form."""
    leader = LighthouseClient(lighthouse.address, "single", 0)
    stranger = LighthouseClient(lighthouse.address, "single", 0, process_index=1, num_processes=2)
    try:
        leader._beat()
        stranger.register(ftar(0, 1, 1), server(0, 1), 2)
        with pytest.raises(InvalidLighthouseRequest, match="its live leader .* runs as a replica of one process"):
            stranger._beat()
        assert "0" not in lighthouse.server._jobs["single"].groups
        time.sleep(DETECT + 0.2)  # the leader is silent past the window
        stranger._beat()
        assert lighthouse.server._jobs["single"].groups["0"].num_processes == 2
    finally:
        leader.close()
        stranger.close()
