"""The replay cache is kept per key: one job's key (or the status key) cannot refuse another job's calls.

A review reproduced it end to end: one cache shared by every key of a lighthouse let a
holder of any one job's key flood it with correctly signed calls stamped ~29 s ahead;
past the cache's capacity it forgot the earliest-stamped nonces first, the honest calls
stamped now, and refused every call stamped before them, so every job's heartbeats and
quorum requests were refused and its replicas declared dead. Here each key has its own
nonces, floor and capacity (fthsdp.control.auth.KeyedReplayCache), within a total bound
that cuts the keys holding the most, and a call may be stamped at most MAX_FUTURE_S ahead.

The pure cache is tested as a function; the attack against a real lighthouse over real
gRPC (LighthouseThread, signed raw calls from many connections, LighthouseClient replicas).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from fthsdp.control import auth, guard
from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread, pb2
from fthsdp.control.lighthouse_client import LighthouseClient
from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION

V = LIGHTHOUSE_PROTOCOL_VERSION
SECRET = bytes(range(32))
T = 10_000.0  # the unit tests' clock


# -- pure: the cache ------------------------------------------------------------------------

def test_one_keys_flood_lifts_its_own_floor_only_and_nonces_are_compared_within_a_key():
    r = auth.KeyedReplayCache(capacity=100, total_capacity=1000)
    for i in range(300):  # three times its capacity, stamped ahead
        r.check_and_add("evil", b"e%d" % i, T + 4 + i * 1e-3, T)
    assert len(r.cache("evil")) == 100 and r.cache("evil").floor > T + 4
    assert r.check_and_add("evil", b"fresh", T, T) == auth.TOO_OLD  # its own fresh call retries ...
    assert r.check_and_add("victim", b"v0", T, T) is None  # ... another key's does not
    assert r.check_and_add("victim", b"e299", T + 4.299, T) is None  # a nonce another key used: not a replay
    assert "replayed" in r.check_and_add("victim", b"v0", T, T + 1)  # its own: one
    assert r.check_and_add("evil", b"fresh", T + 5, T + 5) is None  # the flood's key recovers within MAX_FUTURE_S


def test_the_total_bound_cuts_the_keys_holding_the_most_and_spares_the_rest():
    r = auth.KeyedReplayCache(capacity=400, total_capacity=640)
    for i in range(50):
        assert r.check_and_add("victim", b"v%d" % i, T - 1 + i * 1e-3, T) is None
    for i in range(400):  # two keys, each within its own capacity, together past the total
        for key in ("a", "b"):
            assert r.check_and_add(key, b"%s%d" % (key.encode(), i), T + 4 + i * 1e-3, T) is None, (key, i)
    assert len(r) <= 640 and len(r.cache("a")) < 400
    assert len(r.cache("victim")) == 50 and r.cache("victim").floor == -float("inf")  # untouched
    assert abs(len(r.cache("a")) - len(r.cache("b"))) <= 1  # cut to one level
    assert r.check_and_add("victim", b"late", T - 0.5, T) is None  # stamped before the floods' floors: taken
    assert r.check_and_add("a", b"again", T, T) == auth.TOO_OLD  # the cut keys' own early calls retry
    with pytest.raises(ValueError, match="exceeds total_capacity"):
        auth.KeyedReplayCache(capacity=10, total_capacity=5)


def test_keys_are_bounded_a_silent_key_is_forgotten_and_a_restart_covers_every_key():
    r = auth.KeyedReplayCache(max_keys=2)
    assert r.check_and_add("a", b"n", T, T) is None and r.check_and_add("b", b"n", T, T) is None
    assert r.check_and_add("c", b"n", T, T) == auth.TOO_MANY_KEYS  # both still hold calls in the window
    assert auth.TOO_MANY_KEYS in auth.ReplayCache.RETRYABLE
    later = T + auth.CLOCK_WINDOW_S + 1
    assert r.check_and_add("c", b"n", later, later) is None and r.keys() == 1  # "a" and "b" fell silent
    r.started(later + 1)  # every key, held or new, refuses what was signed before the start
    assert r.check_and_add("c", b"m", later + 0.5, later + 1.2) == auth.BEFORE_START
    assert r.check_and_add("e", b"m", later + 0.5, later + 1.2) == auth.BEFORE_START
    assert r.check_and_add("e", b"m", later + 1.1, later + 1.2) is None


def test_the_clock_window_is_30_s_behind_and_5_s_ahead():
    r = auth.KeyedReplayCache()
    assert r.check_and_add("j", b"a", T - 29.5, T) is None  # a client 29.5 s behind (or a call held up)
    assert r.check_and_add("j", b"b", T + 4.9, T) is None  # a client 4.9 s ahead
    why = r.check_and_add("j", b"c", T + 29, T)
    assert "more than 5 s ahead" in why and "NTP" in why and "+29.0 s" in why
    why = r.check_and_add("new", b"c", T + 29, T)  # refused before a key is held for it
    assert "more than 5 s ahead" in why and r.cache("new") is None
    assert "more than 30 s behind" in r.check_and_add("j", b"d", T - 31, T)


# -- a real lighthouse ------------------------------------------------------------------------

def call_key(job: str) -> bytes:
    return auth.derive(auth.job_key(SECRET, job), "lighthouse")


def heartbeat(job: str, replica: str = "0", incarnation: str = "flood") -> pb2.HeartbeatRequest:
    return pb2.HeartbeatRequest(protocol_version=V, job_id=job, replica_id=replica, step=1, incarnation=incarnation)


def send(address: str, calls: list[bytes | Callable[[], bytes]], method: str = "Heartbeat") -> list[grpc.StatusCode]:
    """The calls (or what signs each as it is sent), one after another on one connection of their own."""
    codes = []
    with grpc.insecure_channel(address) as ch:
        fn = ch.unary_unary(f"/fthsdp.v1.Lighthouse/{method}", request_serializer=None, response_deserializer=None)
        for data in calls:
            try:
                fn(data if isinstance(data, bytes) else data(), timeout=10)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
    return codes


def refusal(address: str, data: bytes, method: str = "Heartbeat") -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch:
        fn = ch.unary_unary(f"/fthsdp.v1.Lighthouse/{method}", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as ei:
            fn(data, timeout=10)
    return ei.value


def with_nonce(key: bytes, req: pb2.HeartbeatRequest, timestamp: float, nonce: bytes) -> bytes:
    """A heartbeat signed with a nonce of the caller's choosing (as a flooder who saw another job's may)."""
    body = req.SerializeToString()
    cred = auth.sign(key, "Heartbeat", req.job_id, req.replica_id, body, timestamp, nonce=nonce)
    return body + pb2.HeartbeatRequest(credential=cred.encode()).SerializeToString()


def test_a_flood_signed_with_one_jobs_key_refuses_no_other_jobs_calls():
    """Two flooding jobs send correctly signed heartbeats stamped 4.5 s ahead (inside the clock
    window), each more than its key's replay capacity and together more than the total, from
    many connections. The floods' own fresh calls are then asked to retry (their floors are
    ahead of the clock); the victim job's two replicas, beating all along, are answered at once,
    form a quorum and none is declared dead. A nonce a flooder used is no replay for the victim,
    and a call stamped 29 s ahead is refused with the clock's reason."""
    per_key, total, flood = 100, 150, 130
    limits = guard.Limits(replay_nonces_per_key=per_key, replay_nonces_total=total)
    cfg = LighthouseConfig(secret=SECRET, join_timeout_s=0.2, detect_s=0.5, limits=limits)
    with LighthouseThread(cfg) as lh:
        victim_key = auth.job_key(SECRET, "victim")
        replicas = [LighthouseClient(lh.address, "victim", str(i), key=victim_key) for i in range(2)]
        try:
            for c in replicas:
                c.start_heartbeats()
            time.sleep(0.3)

            def ahead(job: str) -> Callable[[], bytes]:  # signed as it is sent, 4.5 s ahead
                return lambda: auth.signed_request(call_key(job), "Heartbeat", job, "0",
                                                   heartbeat(job).SerializeToString(), now=time.time() + 4.5)

            per_conn = 13
            floods = {job: [[ahead(job)] * per_conn for _ in range(0, flood, per_conn)] for job in ("evil", "evil2")}
            with ThreadPoolExecutor(8) as ex:
                codes = {job: [code for got in ex.map(lambda calls: send(lh.address, calls), conns) for code in got]
                         for job, conns in floods.items()}
            # Taken, or (a flood's call stamped below its own key's floor, once cut) asked to retry.
            assert all(c in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED) for got in codes.values()
                       for c in got), codes
            accepted = [got.count(grpc.StatusCode.OK) for got in codes.values()]
            assert max(accepted) > per_key and sum(accepted) > total, accepted  # past both bounds
            # The floods lifted their keys' floors past the clock: their own fresh calls are asked to retry ...
            for job_id in floods:
                e = refusal(lh.address, auth.signed_request(call_key(job_id), "Heartbeat", job_id, "0",
                                                            heartbeat(job_id).SerializeToString()))
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry it" in e.details(), e.details()
            # ... and no other key's: the victim beats, asks for and gets a quorum of both replicas, none dead.
            for c in replicas:
                c.heartbeat(2)
            with ThreadPoolExecutor(2) as ex:
                quorums = list(ex.map(lambda c: c.get_quorum(
                    2, ftar_addresses=[f"127.0.0.1:{21000 + int(c.replica_id)}"], num_replicas=2, timeout_s=10),
                    replicas))
            assert all(len(q.members) == 2 for q in quorums), quorums
            (job,) = replicas[0].status()
            assert not any(r.dead for r in job.replicas), job.replicas
            # A nonce a flooder used (say, one it saw the victim's client about to use) is the flooder's.
            taken_at, taken = time.time() + 4.5, b"n" * 16
            for key, job_id in ((call_key("evil"), "evil"), (call_key("victim"), "victim")):
                got = send(lh.address, [with_nonce(key, heartbeat(job_id, "9", "x"), taken_at, taken)])
                assert got == [grpc.StatusCode.OK], (job_id, got)
            # A call stamped past the 5 s the clock may run ahead: refused, saying so.
            e = refusal(lh.address, auth.signed_request(call_key("victim"), "Heartbeat", "victim", "0",
                                                        heartbeat("victim").SerializeToString(),
                                                        now=time.time() + 29))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e.details()
            assert "more than 5 s ahead" in e.details() and "NTP" in e.details()
            # The status key is a key of its own too: a reader of every job is answered.
            with LighthouseClient(lh.address, "x", "x", status_key=auth.status_key(SECRET)) as reader:
                assert {j.job_id for j in reader.status("")} >= {"victim", "evil", "evil2"}
        finally:
            for c in replicas:
                c.close()
