"""The session stream (fthsdp/control/session.py): heartbeats and quorum requests as messages.

Pure: the envelope's checks. Real lighthouse, real gRPC: clients on sessions get
the same quorums as unary ones (and the lighthouse counts their messages); a
quorum request's deadline and a stream that ends are handled as for a unary
call; a client falls back to unary calls when the server offers no sessions;
bad messages on a stream get a clear error and the lighthouse goes on. Real
processes: a replica leader SIGKILLed or SIGSTOPped while on its session is
declared dead within the detection window, as with unary calls (a stopped
process keeps its connection: liveness comes from heartbeat messages).
"""

from __future__ import annotations

import contextlib
import math
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

from fthsdp.control import session
from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import CredentialRefused, LighthouseClient, QuorumTimeout
from fthsdp.control.session_client import SessionError, SyncSession
from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as load_stubs
from raising_thread import RaisingThread

pb2, pb2_grpc = load_stubs()
DETECT = 0.5


def test_envelope_checks_say_what_is_wrong():
    ok = pb2.SessionRequest(seq=1, method="Heartbeat", body=b"")
    assert session.envelope_problem(ok) is None
    assert "seq is 0" in session.envelope_problem(pb2.SessionRequest(seq=0, method="Heartbeat"))
    assert "not carried on a session" in session.envelope_problem(pb2.SessionRequest(seq=1, method="Leave"))
    for bad in (-1.0, math.nan, math.inf, 1e9):
        err = session.envelope_problem(pb2.SessionRequest(seq=1, method="GetQuorum", timeout_s=bad))
        assert err is not None and "timeout_s" in err
    raw = session.reply(7, code=grpc.StatusCode.ABORTED, details="why")
    rep = pb2.SessionReply.FromString(raw)
    assert (rep.seq, session.status_code(rep.code), rep.details) == (7, grpc.StatusCode.ABORTED, "why")
    assert session.status_code(999) is grpc.StatusCode.UNKNOWN


@pytest.fixture
def lighthouse():
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.3, detect_s=DETECT, tick_s=0.02)) as lh:
        yield lh


def _client(address: str, rid: int, **kw) -> LighthouseClient:
    return LighthouseClient(address, "job", rid, rpc_timeout_s=5.0, heartbeat_timeout_s=0.5, **kw)


def test_sessions_and_unary_calls_get_the_same_quorums(lighthouse):
    clients = [_client(lighthouse.address, r, session=r < 2) for r in range(3)]  # 0, 1 sessions; 2 unary
    try:
        for step in range(3):
            with ThreadPoolExecutor(3) as ex:
                qs = list(ex.map(lambda r: clients[r].get_quorum(step, ftar_addresses=[f"127.0.0.1:{9000 + r}"],
                                                                 num_replicas=3, timeout_s=10), range(3)))
            assert len({q.quorum_id for q in qs}) == 1 and qs[0].member_ids == ("0", "1", "2")
            assert all(q.max_step == step for q in qs)
        hb = clients[0].heartbeat(3)
        assert hb.quorum_id == qs[0].quorum_id and hb.dead_members == ()
    finally:
        for c in clients:
            c.close()
    st = lighthouse.server.stats
    assert st["sessions_opened"] == 2
    assert st["session_messages"] == 2 * 3 + 1  # 3 quorum requests each, one heartbeat


def test_a_session_request_times_out_with_the_reason_and_a_closed_stream_withdraws_it():
    with LighthouseThread(LighthouseConfig(min_replicas=2, join_timeout_s=0.3, detect_s=DETECT)) as lh:
        _timeout_and_withdraw(lh)


def _timeout_and_withdraw(lighthouse) -> None:
    a = _client(lighthouse.address, 0)
    try:
        with pytest.raises(QuorumTimeout, match="no quorum for job 'job'"):
            a.get_quorum(0, ftar_addresses=["127.0.0.1:9000"], num_replicas=2, timeout_s=0.6)
        # a request left open when its stream ends is withdrawn, as a cancelled call's is
        s = SyncSession(grpc.insecure_channel(lighthouse.address))
        body = pb2.QuorumRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="job", replica_id="1", step=0,
                                 ftar_addresses=["127.0.0.1:9001"], local_world_size=1, num_replicas=2)
        t = RaisingThread(SessionError, s.request, "GetQuorum", body.SerializeToString(), 30.0)
        t.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(r.waiting for j in a.status() for r in j.replicas):
            time.sleep(0.02)
        assert any(r.replica_id == "1" and r.waiting for r in a.status()[0].replicas)
        s.close()
        t.check(5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(r.waiting for r in a.status()[0].replicas):
            time.sleep(0.02)
        assert not any(r.waiting for r in a.status()[0].replicas)
    finally:
        a.close()


def test_a_reply_that_lands_as_the_wait_times_out_is_returned_not_dropped(lighthouse, monkeypatch):
    """The reader thread takes a reply's waiter and sets its event; a request whose wait ended at
    that moment returns the reply instead of DEADLINE_EXCEEDED (a quorum's answer thrown away is
    asked for again, and a relay that answered would count as silent). The race is made certain:
    the waiter's first wait returns "timed out" only once the reply has been delivered."""
    from fthsdp.control import session_client

    class LateEvent(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            self.late = True

        def wait(self, timeout=None) -> bool:
            if self.late:  # the caller's deadline strikes just as the reader delivers
                self.late = False
                assert super().wait(10.0), "no reply at all"
                return False
            return super().wait(timeout)

    real_init = session_client._Waiter.__init__

    def late_waiter(self) -> None:
        real_init(self)
        self.event = LateEvent()

    monkeypatch.setattr(session_client._Waiter, "__init__", late_waiter)
    s = SyncSession(grpc.insecure_channel(lighthouse.address))
    try:
        hb = pb2.HeartbeatRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="job", replica_id="0")
        body = s.request("Heartbeat", hb.SerializeToString(), 5.0)
        pb2.HeartbeatResponse.FromString(body)  # the reply itself, not an error
    finally:
        s.close()


def test_a_client_falls_back_to_unary_calls_without_sessions():
    """A real gRPC server offering only the unary Heartbeat (an older lighthouse)."""
    seen = []

    def heartbeat(raw: bytes, context) -> bytes:
        seen.append(pb2.HeartbeatRequest.FromString(raw).replica_id)
        return pb2.HeartbeatResponse(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, quorum_id=42).SerializeToString()

    server = grpc.server(ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("fthsdp.v1.Lighthouse", {
        "Heartbeat": grpc.unary_unary_rpc_method_handler(heartbeat)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        c = _client(f"127.0.0.1:{port}", 5)
        try:
            assert c.heartbeat(1).quorum_id == 42 and c.heartbeat(2).quorum_id == 42
            assert c._route.session is None and seen == ["5", "5"]  # told UNIMPLEMENTED once, unary since
        finally:
            c.close()
    finally:
        server.stop(0)


def _raw_stream(address: str, messages: list[bytes], expect: int, timeout_s: float = 10.0) -> list:
    """Send ``messages`` on one session stream and read ``expect`` replies."""
    channel = grpc.insecure_channel(address)
    try:
        call = channel.stream_stream(session.METHOD, request_serializer=None, response_deserializer=None)(
            iter(messages), timeout=timeout_s)
        out = []
        for raw in call:
            out.append(pb2.SessionReply.FromString(raw))
            if len(out) == expect:
                call.cancel()
                break
        return out
    finally:
        channel.close()


def test_bad_messages_on_a_session_get_clear_errors_and_the_lighthouse_goes_on(lighthouse):
    hb = pb2.HeartbeatRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="job", replica_id="0").SerializeToString()
    bad = [
        b"\xff\xff\xff",                                           # not a SessionRequest
        session.envelope(0, "Heartbeat", hb),                      # seq 0
        session.envelope(2, "Leave", hb),                          # not a session method
        session.envelope(3, "Heartbeat", b"\x0a\xff"),             # a body that is not a HeartbeatRequest
        session.envelope(4, "GetQuorum", hb, timeout_s=-1.0),      # a negative deadline
        session.envelope(5, "Heartbeat", pb2.HeartbeatRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION,
                                                              job_id="job", replica_id="a b").SerializeToString()),
        session.envelope(6, "Heartbeat", hb),                      # a good one among them
        session.envelope(7, "GetQuorum", pb2.QuorumRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="job",
                                                           replica_id="0", local_world_size=1).SerializeToString()),
    ]
    got = _raw_stream(lighthouse.address, bad, len(bad))
    replies = {r.seq: r for r in got}
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    zero = [r for r in got if r.seq == 0]  # the unreadable one and the one numbered 0
    assert all(r.code == invalid for r in zero)
    assert sorted(r.details.split(":")[0] for r in zero) == ["a session message is not a valid SessionRequest "
                                                             "protobuf message", "seq is 0"]
    assert replies[2].code == invalid and "not carried on a session" in replies[2].details
    assert replies[3].code == invalid and "not a valid HeartbeatRequest" in replies[3].details
    assert replies[4].code == invalid and "timeout_s" in replies[4].details
    assert replies[5].code == invalid and "space or control character" in replies[5].details
    assert replies[6].code == 0  # no authentication on this lighthouse: the heartbeat is answered
    assert replies[7].code == invalid and "ftar_addresses" in replies[7].details
    # the lighthouse still serves sessions and unary calls
    ok = _raw_stream(lighthouse.address, [session.envelope(1, "Heartbeat", hb)], 1)
    assert ok[0].code == 0 and pb2.HeartbeatResponse.FromString(ok[0].body).protocol_version == LIGHTHOUSE_PROTOCOL_VERSION
    c = _client(lighthouse.address, 0, session=False)
    try:
        c.heartbeat(0)
    finally:
        c.close()


def test_an_authenticated_lighthouse_checks_every_session_message():
    from fthsdp.control import auth

    secret = auth.new_secret()
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.3, detect_s=DETECT, secret=secret)) as lh:
        check_credentials(lh.address, secret)
        assert lh.server.stats["sessions_opened"] == 3


def check_credentials(address: str, secret: bytes, **kw) -> None:
    """A client with the job's key, one with another lighthouse's and one with none, each on its
    session (``kw``: e.g. through a relay): only the first is answered, the others hear why."""
    from fthsdp.control import auth

    good = _client(address, 0, key=auth.job_key(secret, "job"), **kw)
    stranger = _client(address, 1, key=auth.job_key(auth.new_secret(), "job"), **kw)
    anonymous = _client(address, 2, **kw)
    try:
        assert good.heartbeat(0).quorum_id == 0
        with pytest.raises(CredentialRefused, match="does not verify"):
            stranger.heartbeat(0)
        with pytest.raises(CredentialRefused, match="carries no credential"):
            anonymous.heartbeat(0)
        assert good._route.session is not None
    finally:
        for c in (good, stranger, anonymous):
            c.close()


LEADER = textwrap.dedent("""
    import sys, time
    from fthsdp.control.lighthouse_client import LighthouseClient
    address, rid, session, relay = sys.argv[1], sys.argv[2], sys.argv[3] != "0", sys.argv[4]
    c = LighthouseClient(address, "job", rid, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.3, session=session,
                         relay=relay)
    c.start_heartbeats()
    step = 0
    while True:
        q = c.get_quorum(step, ftar_addresses=["127.0.0.1:%d" % (9000 + int(rid))], num_replicas=3, timeout_s=30)
        print("quorum", q.quorum_id, step, c.relay == relay, flush=True)
        step += 1
        time.sleep(0.05)
""")


@pytest.mark.parametrize("sig,transport", [(signal.SIGKILL, "session"), (signal.SIGSTOP, "session"),
                                           (signal.SIGSTOP, "unary"), (signal.SIGSTOP, "relay")])
def test_a_killed_or_stopped_leader_on_a_session_is_declared_dead_in_the_detection_window(lighthouse, sig, transport,
                                                                                        tmp_path):
    script = tmp_path / "leader.py"
    script.write_text(LEADER)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    flag = "0" if transport == "unary" else "1"
    with contextlib.ExitStack() as stack:
        relay = ""
        if transport == "relay":  # the leaders' sessions through a relay: a stopped one's stream stays open
            from test_relay import relay_process

            relay = stack.enter_context(relay_process(lighthouse.address))[0]
        _declared_dead_in_the_window(lighthouse, sig, transport, [
            subprocess.Popen([sys.executable, str(script), lighthouse.address, str(r), flag, relay], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in range(3)])


def _declared_dead_in_the_window(lighthouse, sig, transport: str, procs: list) -> None:
    watcher = _client(lighthouse.address, "watcher")
    try:
        for p in procs:  # every leader formed at least two quorums on its session (through its relay)
            for _ in range(2):
                line = p.stdout.readline()
                assert line.startswith("quorum") and line.split()[-1] == "True", "a leader did not get its quorums"
        assert (lighthouse.server.stats["sessions_opened"] >= 3) == (transport == "session")
        assert (lighthouse.server.stats["relay_batches"] > 0) == (transport == "relay")
        t0 = time.monotonic()
        procs[2].send_signal(sig)
        dead_at = None
        while time.monotonic() - t0 < 5 * DETECT:
            (job,) = [j for j in watcher.status() if j.job_id == "job"]
            if any(r.replica_id == "2" and r.dead for r in job.replicas):
                dead_at = time.monotonic() - t0
                break
            time.sleep(0.02)
        assert dead_at is not None, f"{sig.name}: replica 2 was never declared dead"
        # the window plus a tick and the poll (a stopped process keeps its stream open: its
        # silence alone declares it dead)
        assert dead_at < DETECT + 0.5, f"{sig.name}: declared dead after {dead_at:.2f}s"
        # the survivors go on without it
        for p in procs[:2]:
            assert p.stdout.readline().startswith("quorum")
    finally:
        watcher.close()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait(10)
            p.stdout.close()


def test_a_quorum_request_counts_as_its_leaders_heartbeat():
    """Judged by the time of its last request or beat: silent 0.3 s after a heartbeat, then
    asking, a leader is not dead 0.35 s after asking (0.65 s after its beat, past the window),
    and is dead a window after its request."""
    with LighthouseThread(LighthouseConfig(min_replicas=2, join_timeout_s=0.3, detect_s=DETECT)) as lh:
        a, watcher = _client(lh.address, 0), _client(lh.address, "w")
        try:
            a.heartbeat(0)
            time.sleep(0.3)
            t1 = time.monotonic()
            asking = RaisingThread(QuorumTimeout, a.get_quorum, 0, ftar_addresses=["127.0.0.1:9000"], timeout_s=1.5)
            asking.start()
            time.sleep(0.35)

            def dead() -> bool:
                return any(r.replica_id == "0" and r.dead for r in watcher.status()[0].replicas)

            assert not dead()
            while not dead() and time.monotonic() - t1 < 3 * DETECT:
                time.sleep(0.02)
            assert DETECT <= time.monotonic() - t1 < DETECT + 0.4
            asking.check(5)
        finally:
            a.close()
            watcher.close()


def test_the_heartbeat_thread_skips_beats_while_its_leader_asks_more_often(lighthouse):
    c = _client(lighthouse.address, 0)
    try:
        c.get_quorum(0, ftar_addresses=["127.0.0.1:9000"], num_replicas=1, timeout_s=5)
        c.start_heartbeats()
        before = lighthouse.server.stats["session_messages"]
        asked, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 1.0:  # a request every ~40 ms, a beat due every 100 ms
            c.get_quorum(asked + 1, ftar_addresses=["127.0.0.1:9000"], num_replicas=1, timeout_s=5)
            asked += 1
            time.sleep(0.03)
        beats = lighthouse.server.stats["session_messages"] - before - asked
        assert asked >= 10 and 0 <= beats <= 3, (asked, beats)
        time.sleep(0.35)  # stepping stops: the beats resume
        beats_idle = lighthouse.server.stats["session_messages"] - before - asked - beats
        assert beats_idle >= 2
    finally:
        c.close()


@pytest.mark.parametrize("timeout_s", [math.inf, math.nan, 0.0, -1.0, 8 * 24 * 3600.0])
def test_a_session_request_without_a_usable_deadline_is_refused_before_it_is_sent(timeout_s):
    s = SyncSession(grpc.insecure_channel("127.0.0.1:9"))  # never connected: refused before sending
    try:
        with pytest.raises(ValueError, match="timeout_s is .*finite number of seconds"):
            s.request("Heartbeat", b"", timeout_s)
    finally:
        s.close()
    # the emulation's asyncio client, the same rule
    import asyncio

    from fthsdp.sim.aio_client import AioSession

    async def ask():
        channel = grpc.aio.insecure_channel("127.0.0.1:9")
        try:
            with pytest.raises(ValueError, match="timeout_s is .*finite number of seconds"):
                await AioSession(channel).request("Heartbeat", b"", timeout_s)
        finally:
            await channel.close()

    asyncio.run(ask())


def test_a_session_reply_that_does_not_parse_is_a_failed_call_not_a_decode_error():
    """A reply body that is not protobuf (a relay of another protocol, a faulty one) raised a bare
    DecodeError out of the client, which no caller classifies; it is a SessionError (INTERNAL),
    which the route handles as a failed path, as gRPC reports a unary reply it cannot read."""
    from fthsdp.control.lighthouse_client import _parse_reply

    with pytest.raises(SessionError) as ei:
        _parse_reply("GetQuorum", b"\xff\xff\xff")
    assert ei.value.code() == grpc.StatusCode.INTERNAL and "not a valid QuorumResponse" in ei.value.details()
    assert _parse_reply("Heartbeat", b"").ByteSize() == 0  # an empty message parses
