"""The relay (fthsdp/control/relay.py): many processes' sessions on one stream to the lighthouse.

Pure: the seq renumbering and the relay's configuration. A real relay process and a
real lighthouse: clients behind a relay get the same quorums as direct ones while
the lighthouse reads batches; a client that leaves the relay has its open request
withdrawn; an authenticated lighthouse checks every message a relay carries (the
relay holds no secret and cannot forge one); bad batches and bad messages get
clear errors and a batch of garbage costs the lighthouse a bounded amount; a
killed relay sends its clients to the lighthouse directly, they come back to it
restarted on its port, and leave it again SIGSTOPped (a SIGSTOPped leader behind
a relay is declared dead by its silence: tests/test_lighthouse_session.py). The
emulation runs the whole control loop through relays with kills, a lighthouse
restart, a relay killed and restarted and one stopped; `fthsdp run` restarts a
killed relay.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from fthsdp.control import relay, session
from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import JobNotFound, LighthouseClient
from fthsdp.control.session_client import (RelayPath, Routed, SessionError, SessionRoute, SyncSession,
                                           connect_refused, relay_gone)
from fthsdp.logs import read_metrics
from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as load_stubs
from raising_thread import RaisingThread

pb2, _ = load_stubs()
DETECT = 0.5
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def test_a_client_leaves_its_relay_after_failures_that_last_and_returns_later():
    p = RelayPath("relay:1")
    assert p.via_relay and not p.try_relay(0.0)
    # a burst of fast failures is not proof (a connect storm refuses a few streams)
    assert not p.failed(10.0, "x") and not p.failed(10.01, "x") and not p.failed(10.02, "x")
    assert p.failed(10.0 + p.GRACE_S, "still failing") and not p.via_relay  # still failing after the grace: leave
    assert (p.left_why, p.leaves) == ("still failing", 1)
    assert not p.failed(10.5, "x")  # on the lighthouse directly, a failure is not the relay's
    assert not p.try_relay(10.0 + p.RETRY_S - 0.1)  # not yet
    assert p.try_relay(10.3 + p.RETRY_S) and p.via_relay and p.returning
    assert p.owns(False, True) and p.owns(True, False) and not p.owns(False, False)  # the probe's outcome counts
    # a failed return goes back at once, and waits twice as long before the next
    assert p.failed(16.0, "refused") and not p.via_relay and p.retry_at == 16.0 + 2 * p.RETRY_S
    assert p.try_relay(16.0 + 2 * p.RETRY_S)
    assert p.ok() and not p.returning and p.returns == 1 and p.retry_s == p.RETRY_S  # a reply: back for good
    assert not p.ok()
    assert not p.failed(40.0, "x") and not p.failed(40.0 + p.GRACE_S, "x")  # two failures are not enough
    p.ok()  # a reply in between starts the count again
    assert not p.failed(40.0 + 2 * p.GRACE_S, "x")
    for k in range(10):  # returns that keep failing back off to at most MAX_RETRY_S
        p.via_relay, p.returning = True, True
        p.failed(100.0 * k, "x")
    assert p.retry_s == p.MAX_RETRY_S
    none = RelayPath("")
    assert not none.via_relay and not none.try_relay(1e9) and not none.failed(0.0, "x")
    # silence: only a relay that answered nothing for silence_s is left (a busy relay is slow too)
    q = RelayPath("relay:1", silence_s=2.0)
    assert not q.failed(1.0, "no reply", silent=True) and not q.failed(2.9, "no reply", silent=True)
    q.ok()  # a reply: the silence starts again
    assert not q.failed(3.0, "no reply", silent=True) and not q.failed(4.5, "no reply", silent=True)
    assert q.failed(5.0, "no reply", silent=True) and not q.via_relay
    with pytest.raises(ValueError, match="silence_s"):
        RelayPath("relay:1", silence_s=0.0)


def test_a_client_returns_at_once_to_a_relay_left_by_broken_streams_once_it_accepts_connections_again():
    p = RelayPath("relay:1")
    assert not p.watching and not p.channel_state(True, 0.0)  # on the relay: its channel is no news
    for t in (10.0, 10.1, 10.0 + p.GRACE_S):
        p.failed(t, "refused")
    assert not p.via_relay and p.watching and p.retry_at == 10.0 + p.GRACE_S + p.RETRY_S
    assert not p.channel_state(True, 10.4)  # up since the leave: its streams broke for another reason
    assert not p.channel_state(False, 10.5) and p.seen_down  # down (killed) ...
    assert p.channel_state(True, 10.7) and p.retry_at == 10.7 and not p.watching  # ... and back: return now
    assert not p.channel_state(False, 10.8) and not p.channel_state(True, 10.9)  # once per leave
    assert p.try_relay(10.8) and p.returning
    # the probe is refused (it died again): left again, watched again, back off as before
    assert p.failed(11.0, "refused") and p.watching and p.retry_at == 11.0 + 2 * p.RETRY_S
    assert not p.channel_state(False, 11.1) and p.channel_state(True, 11.2) and p.try_relay(11.2)
    assert p.ok() and p.returns == 1
    # left on a refused connection (nothing listened), its channel connected again before the first
    # look (the relay was restarted meanwhile: CI saw it): return now, not after the retry wait
    for t in (20.0, 20.1, 20.0 + p.GRACE_S):
        p.failed(t, "failed to connect to all addresses", refused=True)
    assert not p.via_relay and p.seen_down and p.channel_state(True, 20.5) and p.try_relay(20.5)
    # a refused silence is still a silence: not watched
    r = RelayPath("relay:1", silence_s=1.0)
    r.failed(1.0, "no reply", silent=True, refused=True)
    assert r.failed(2.0, "no reply", silent=True, refused=True) and not r.watching and not r.seen_down
    # a relay left by its silence (a stopped one keeps its connections) waits out the retry
    q = RelayPath("relay:1", silence_s=1.0)
    q.failed(1.0, "no reply", silent=True)
    assert q.failed(2.0, "no reply", silent=True) and not q.watching
    assert not q.channel_state(False, 2.1) and not q.channel_state(True, 2.2) and not q.try_relay(2.3)
    assert q.try_relay(2.0 + q.RETRY_S)


def test_a_client_moved_to_another_relay_probes_it_at_once_or_when_the_old_one_fails():
    p = RelayPath("old:1")
    assert not p.move("old:1", 1.0) and p.moves == 0  # the same relay: nothing to do
    assert p.move("new:1", 1.0) and p.relay == "new:1" and p.moves == 1
    assert p.via_relay and not p.try_relay(1.0)  # still answered through the old one: it stays there
    for t in (2.0, 2.1, 2.5):  # the old one fails: left, and the return goes to the new one
        p.failed(t, "refused")
    assert not p.via_relay and p.try_relay(2.5 + p.RETRY_S)
    q = RelayPath("old:1")
    for t in (0.0, 0.1, 0.5):
        q.failed(t, "refused")
    assert q.try_relay(q.retry_at) and q.failed(10.0, "a failed return doubles the wait")
    assert q.retry_s == 2 * q.RETRY_S and q.watching
    # away from the old relay, a move is a return due now, with the backoff started over
    assert q.move("new:1", 11.0) and q.try_relay(11.0) and q.retry_s == q.RETRY_S and not q.watching
    # moved while still on the old relay (silent: a process squats its port), it fails later: the
    # new relay is tried at once, not after the retry wait (it never failed)
    m = RelayPath("old:1", silence_s=1.0)
    assert m.move("new:1", 1.0) and m.via_relay and m.moved_from == "old:1"
    m.failed(1.5, "no reply", silent=True)
    assert m.failed(2.5, "no reply", silent=True) and m.left_relay == "old:1" and m.try_relay(2.5)
    # the new one refuses its probe: its own failed return, waited out doubled as any
    assert m.failed(2.9, "refused") and m.left_relay == "new:1" and m.retry_at == 2.9 + 2 * m.RETRY_S
    none = RelayPath("")  # a client given a relay for the first time
    assert none.move("new:1", 5.0) and none.try_relay(5.0)
    with pytest.raises(ValueError, match="not empty"):
        none.move("", 6.0)


def test_a_failure_counts_for_the_relay_only_when_it_may_be_the_relays():
    assert relay_gone(SessionError(grpc.StatusCode.UNAVAILABLE, "ended", broken=True))  # a broken stream
    assert relay_gone(SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply", unanswered=True))  # silence
    assert not relay_gone(SessionError(grpc.StatusCode.UNAVAILABLE, "the relay cannot reach the lighthouse"))
    assert not relay_gone(SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, "no quorum in time"))  # a reply
    assert not relay_gone(ValueError("x"))
    # a broken stream whose channel could not connect (gRPC's words): the relay was down at the leave
    down = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.3:41491: Failed to connect to "
            "remote host: Connection refused")
    assert connect_refused(SessionError(grpc.StatusCode.UNAVAILABLE, down, broken=True))
    assert not connect_refused(SessionError(grpc.StatusCode.UNAVAILABLE, "Socket closed", broken=True))
    assert not connect_refused(SessionError(grpc.StatusCode.UNAVAILABLE, down))  # a reply: the relay's upstream


class _FakeSession:
    """A session's bookkeeping only (SessionRoute does no I/O)."""

    def __init__(self, name: str, relayed: bool) -> None:
        self.name, self.relayed, self.probe, self.idle = name, relayed, False, False

    def __repr__(self) -> str:
        return self.name


def test_a_session_route_leaves_for_the_lighthouse_probes_its_relay_and_closes_what_it_dropped():
    gone = SessionError(grpc.StatusCode.UNAVAILABLE, "ended", broken=True)
    path = RelayPath("relay:1", retry_s=1.0)
    relayed = _FakeSession("relayed", True)
    route = SessionRoute(path, relayed)
    direct = _FakeSession("direct", False)
    assert route.pick("GetQuorum", 0.0, lambda: pytest.fail("no probe yet")) == (relayed, ())
    # a refusal through the relay is a reply: the path works, nothing switches
    assert route.failed(relayed, SessionError(grpc.StatusCode.UNAVAILABLE, "no lighthouse"), 0.0,
                        lambda: direct) == Routed()
    assert route.failed(relayed, gone, 0.0, lambda: direct) == Routed()  # one break: an outage
    assert route.failed(relayed, gone, 0.1, lambda: direct) == Routed()
    r = route.failed(relayed, gone, 0.1 + path.GRACE_S, lambda: direct)
    assert r == Routed(close=(relayed,), again=True, left=True) and route.session is direct
    # another request on the stream it left: sent again directly, nothing to close twice
    assert route.failed(relayed, gone, 0.5, lambda: pytest.fail("a second direct session")) == Routed(again=True)
    # a quorum request never probes; the heartbeat due to return does, on a new stream
    t = 0.1 + path.GRACE_S + 1.0
    assert route.pick("GetQuorum", t, lambda: pytest.fail("no probe for a quorum request")) == (direct, ())
    probe = _FakeSession("probe", True)
    s, close = route.pick("Heartbeat", t, lambda: probe)
    assert s is probe and probe.probe and close == () and route.session is direct
    assert route.answered(probe) == Routed(close=(), back=True)  # back: the direct one is retired
    assert route.session is probe and not probe.probe and route.retired is direct
    assert route.pick("Heartbeat", t + 1, lambda: pytest.fail("already back"))[1] == ()  # retired, not idle
    direct.idle = True
    assert route.pick("Heartbeat", t + 1, lambda: pytest.fail("already back")) == (probe, (direct,))
    assert route.retired is None and route.sessions() == (probe,)
    # a failed probe goes back to the lighthouse at once
    for when in (t + 2, t + 2.1, t + 2.1 + path.GRACE_S):
        r = route.failed(probe, gone, when, lambda: _FakeSession("direct2", False))
    assert r.left and r.again and not route.session.relayed
    p2, _ = route.pick("Heartbeat", t + 2.1 + path.GRACE_S + 2 * 1.0, lambda: _FakeSession("probe2", True))
    assert p2.probe
    r = route.failed(p2, SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, "silent", unanswered=True), 50.0,
                     lambda: pytest.fail("the direct session stays"))
    assert r == Routed(close=(p2,), again=True, left=True) and route.session.name == "direct2"
    d2 = route.session
    assert route.unsupported(d2) == (d2,) and route.session is None and route.sessions() == ()  # unary from now


def test_renumbered_sets_the_seq_and_keeps_every_other_byte():
    raw = session.envelope(7, "GetQuorum", b"\x0a\x03abc" * 50, timeout_s=2.5)
    for seq in (1, 127, 128, 300, 2**40):
        got = relay.renumbered(raw, seq)
        assert got.startswith(raw)  # the body (which the credential signs) is untouched
        msg = pb2.SessionRequest.FromString(got)
        assert (msg.seq, msg.method, msg.body, msg.timeout_s) == (seq, "GetQuorum", b"\x0a\x03abc" * 50, 2.5)
    rep = session.reply(9, b"body", grpc.StatusCode.ABORTED, "why")
    back = pb2.SessionReply.FromString(relay.renumbered(rep, 3))
    assert (back.seq, back.code, back.details, back.body) == (3, grpc.StatusCode.ABORTED.value[0], "why", b"body")
    with pytest.raises(ValueError, match="numbered from 1"):
        relay.renumbered(raw, 0)


def test_batches_are_bounded_in_messages_and_bytes():
    import collections

    q = collections.deque([b"x" * 400_000, b"y" * 400_000, b"z" * 400_000, b"w" * 10])
    assert [len(m) for m in session.take_batch(q)] == [400_000, 400_000]  # a third would pass 1 MiB
    assert [len(m) for m in session.take_batch(q)] == [400_000, 10]
    q = collections.deque([b"big" * 1_000_000, b"a"])
    assert len(session.take_batch(q)) == 1 and list(q) == [b"a"]  # a message over the bound goes alone
    q = collections.deque([b"m"] * 10)
    assert len(session.take_batch(q, max_messages=4)) == 4 and len(q) == 6


def test_relay_config_says_what_is_wrong():
    with pytest.raises(ValueError, match="relay lighthouse"):
        relay.RelayConfig(lighthouse="nohost")
    with pytest.raises(ValueError, match="relay lighthouse"):
        relay.RelayConfig(lighthouse="127.0.0.1:0")  # the lighthouse's port cannot be "any"
    with pytest.raises(ValueError, match="both a certificate"):
        relay.RelayConfig(lighthouse="127.0.0.1:1", tls_cert_file="c.pem")
    with pytest.raises(ValueError, match="max_batch"):
        relay.RelayConfig(lighthouse="127.0.0.1:1", max_batch=0)
    r = subprocess.run([sys.executable, "-m", "fthsdp.control.relay", "--lighthouse", "x"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "relay lighthouse 'x'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "fthsdp.cli", "ray", "--config", "base", "--kill-relay", "5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--kill-relay: the launcher starts no relay (launch.relays=0)" in r.stderr
    r = subprocess.run([sys.executable, "-m", "fthsdp.cli", "run", "--config", "base", "--kill-relay", "5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--kill-relay: the launcher starts no relay (launch.relays=0)" in r.stderr


@contextlib.contextmanager
def relay_process(lighthouse: str, bind: str = "127.0.0.1:0", *flags: str):
    """A real relay process in front of ``lighthouse``; yields (address, Popen)."""
    p = subprocess.Popen([sys.executable, "-m", "fthsdp.control.relay", "--lighthouse", lighthouse,
                          "--bind", bind, "--log-level", "WARNING", *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("relay listening on "), f"relay did not start: {line!r} {p.stderr.read()[:2000]}"
        yield line.split()[-1], p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait(10)
        p.stdout.close()
        p.stderr.close()


@pytest.fixture
def lighthouse():
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.3, detect_s=DETECT, tick_s=0.02)) as lh:
        yield lh


def _client(address: str, rid, **kw) -> LighthouseClient:
    return LighthouseClient(address, "job", rid, rpc_timeout_s=5.0, heartbeat_timeout_s=0.5, **kw)


def _ask(clients, step: int, n: int):
    with ThreadPoolExecutor(len(clients)) as ex:
        return list(ex.map(lambda r: clients[r].get_quorum(step, ftar_addresses=[f"127.0.0.1:{9000 + r}"],
                                                           num_replicas=n, timeout_s=10), range(len(clients))))


def test_clients_behind_a_relay_get_the_same_quorums_as_direct_ones(lighthouse):
    with relay_process(lighthouse.address) as (addr, _):
        clients = [_client(lighthouse.address, r, relay=addr if r < 3 else "") for r in range(4)]
        try:
            for step in range(3):
                qs = _ask(clients, step, 4)
                assert len({q.quorum_id for q in qs}) == 1 and qs[0].member_ids == ("0", "1", "2", "3")
                assert all(q.max_step == step for q in qs)
            hb = clients[0].heartbeat(3)
            assert hb.quorum_id == qs[0].quorum_id and hb.dead_members == ()
            assert all(c.relay == addr for c in clients[:3])  # still behind it
            load = lighthouse.server.load_snapshot()  # what /metrics and `fthsdp status` show
            assert (load.sessions_open, load.relay_streams_open) == (1, 1)
        finally:
            for c in clients:
                c.close()
    st = lighthouse.server.stats
    assert st["sessions_opened"] == 2  # one direct client's stream and the relay's one
    assert st["session_messages"] == 4 * 3 + 1 and st["relayed_messages"] == 3 * 3 + 1
    # the relay's 9 quorum requests and its beat came in batches (how many depends on timing)
    assert 1 <= st["relay_batches"] <= 3 * 3 + 1
    load = lighthouse.server.load_snapshot()
    assert load.relay_batches == st["relay_batches"] and load.session_messages == 13
    assert load.relayed_messages == 10


def test_a_client_that_leaves_the_relay_has_its_open_request_withdrawn():
    with LighthouseThread(LighthouseConfig(min_replicas=2, join_timeout_s=0.3, detect_s=DETECT)) as lh, \
            relay_process(lh.address) as (addr, _):
        watcher = _client(lh.address, "watcher", session=False)
        s = SyncSession(grpc.insecure_channel(addr))
        try:
            body = pb2.QuorumRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="job", replica_id="1",
                                     step=0, ftar_addresses=["127.0.0.1:9001"], local_world_size=1, num_replicas=2)
            t = RaisingThread(SessionError, s.request, "GetQuorum", body.SerializeToString(), 30.0)
            t.start()

            def waiting() -> bool:
                try:
                    jobs = watcher.status()
                except JobNotFound:  # nothing reached the lighthouse yet
                    return False
                return any(r.replica_id == "1" and r.waiting for j in jobs for r in j.replicas)

            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not waiting():
                time.sleep(0.02)
            assert waiting(), "the request through the relay never reached the lighthouse"
            s.close()  # the client's stream to the relay ends ...
            t.check(5)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and waiting():
                time.sleep(0.02)
            assert not waiting(), "the lighthouse still holds the request of a client that left the relay"
        finally:
            watcher.close()


def test_a_withdrawal_in_a_relay_batch_the_budget_refuses_is_still_honoured():
    """A relay sends a withdrawal once. In a batch that the relay stream's budget refuses, its
    messages are refused but its withdrawals still count: otherwise the request of a client that
    left stays open at the lighthouse until its own deadline (60 s by default), counting its replica
    as live and keeping its id from the client's restarted process."""
    from queue import SimpleQueue

    from fthsdp.control import admission

    tight = admission.FairnessLimits(relay_batches_per_s=0.01, relay_burst=1, new_connection_tokens=1)
    with LighthouseThread(LighthouseConfig(min_replicas=2, join_timeout_s=0.3, detect_s=DETECT,
                                           fairness=tight)) as lh:
        watcher = _client(lh.address, "watcher", session=False)
        out: SimpleQueue = SimpleQueue()
        channel = grpc.insecure_channel(lh.address, options=[("grpc.use_local_subchannel_pool", 1)])
        call = channel.stream_stream(session.RELAY_METHOD, request_serializer=None, response_deserializer=None)(
            iter(out.get, None), timeout=30)

        def waiting() -> bool:
            try:
                return any(r.replica_id == "1" and r.waiting for j in watcher.status() for r in j.replicas)
            except JobNotFound:
                return False

        try:
            body = pb2.QuorumRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="job", replica_id="1",
                                     step=0, ftar_addresses=["127.0.0.1:9001"], local_world_size=1, num_replicas=2)
            out.put(session.batch([session.envelope(5, "GetQuorum", body.SerializeToString(), 30.0)]))
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not waiting():
                time.sleep(0.02)
            assert waiting(), "the relayed quorum request never reached the lighthouse"
            # the client left: the next batch withdraws seq 5, and the stream's budget refuses it
            out.put(session.batch([session.envelope(6, "Heartbeat", _hb("2"))], withdrawn=[5]))
            refusal = [pb2.SessionReply.FromString(r) for r in pb2.RelayBatch.FromString(next(call)).messages]
            assert [(r.seq, r.code) for r in refusal] == [(6, EXHAUSTED)], refusal
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and waiting():
                time.sleep(0.02)
            assert not waiting(), "the refused batch's withdrawal was lost: replica 1's request is still open"
        finally:
            out.put(None)
            call.cancel()
            channel.close()
            watcher.close()


def test_the_relay_holds_back_a_client_the_lighthouse_keeps_refusing_for_what_it_sends():
    h = relay.RefusalHold()
    unauth, invalid = grpc.StatusCode.UNAUTHENTICATED.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # refusals for other reasons (a budget, an id held by a live process, no quorum yet) do not count
    for code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED,
                 grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
        for _ in range(10):
            h.reply(1.0, code.value[0], "x")
    assert not h.holds(1.0) and h.refusals == 0
    h.reply(1.0, unauth, "wrong job secret")
    h.reply(1.0, invalid, "not a valid HeartbeatRequest")
    assert not h.holds(1.0)  # two: not yet
    h.reply(1.0, unauth, "wrong job secret")
    assert h.holds(1.0) and h.holds(5.9) and not h.holds(6.0)  # held, then one let through after 1 / PER_S
    code, details = h.answer()
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("wrong job secret [repeated by the relay")
    assert "refused 3 in a row" in details
    h.reply(6.1, unauth, "wrong job secret")  # the one let through: refused again, held again
    assert h.holds(6.2) and h.holds(10.9) and not h.holds(11.2)
    h.reply(11.3, unauth, "x")  # and once more
    assert h.holds(11.4)
    h.reply(11.5, 0, "")  # accepted (fixed): the hold lifts at once, the count starts again
    assert not h.holds(11.5) and h.refusals == 0
    h.reply(11.6, unauth, "x")
    assert not h.holds(11.6)


def test_a_client_with_a_wrong_secret_behind_a_relay_does_not_cost_the_others_their_beats():
    """One process with a wrong job secret beats through the relay as fast as it gets answers. The
    lighthouse charges each refusal to the relay's one stream (~1,000 of its 5,000 batches/s): 40 of
    them would put the stream 8 s in debt, and every batch of the block, the other processes' beats
    among them, would be held back (up to 1 s each: longer than a detection window) or refused. The
    relay holds the bad client back after 3, answering it with the lighthouse's own refusal, so the
    stream's budget (full after a quiet moment) is never short: nothing is held."""
    from fthsdp.control import auth

    secret, wrong = auth.new_secret(), auth.new_secret()

    def beat(key: bytes, rid: str) -> bytes:
        return auth.signed_request(auth.derive(auth.job_key(key, "job"), "lighthouse"), "Heartbeat", "job", rid,
                                   _hb(rid), "job")

    with LighthouseThread(LighthouseConfig(join_timeout_s=0.3, detect_s=DETECT, secret=secret)) as lh, \
            relay_process(lh.address) as (addr, _):
        bad, good = SyncSession(grpc.insecure_channel(addr)), SyncSession(grpc.insecure_channel(addr))
        try:
            good.request("Heartbeat", beat(secret, "1"), 5.0)
            time.sleep(2.5)  # the relay stream's budget fills to its burst (a new stream starts nearly empty)
            held = lh.server.load_snapshot().held_total
            seen = []
            for _ in range(40):
                with pytest.raises(SessionError) as e:
                    bad.request("Heartbeat", beat(wrong, "7"), 5.0)
                seen.append((e.value.code(), "repeated by the relay" in str(e.value)))
            assert seen[:3] == [(grpc.StatusCode.UNAUTHENTICATED, False)] * 3, seen
            assert seen[3:] == [(grpc.StatusCode.UNAUTHENTICATED, True)] * 37, seen
            for _ in range(10):  # not refused (a budget's refusal would raise RESOURCE_EXHAUSTED) ...
                good.request("Heartbeat", beat(secret, "1"), 5.0)
            assert lh.server.load_snapshot().held_total == held  # ... nor held back
        finally:
            bad.close()
            good.close()


def test_an_authenticated_lighthouse_checks_every_message_a_relay_carries():
    from fthsdp.control import auth

    secret = auth.new_secret()
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.3, detect_s=DETECT, secret=secret)) as lh, \
            relay_process(lh.address) as (addr, _):
        from test_lighthouse_session import check_credentials

        check_credentials(lh.address, secret, relay=addr)
        good = _client(lh.address, 0, key=auth.job_key(secret, "job"), relay=addr)
        try:
            # A relay cannot alter what it carries: a signed body changed on the way fails its check.
            signed = auth.signed_request(auth.derive(auth.job_key(secret, "job"), "lighthouse"), "Heartbeat", "job",
                                         "3", pb2.HeartbeatRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION,
                                                                   job_id="job", replica_id="3").SerializeToString(),
                                         "job")
            forged = signed.replace(b"\x1a\x013", b"\x1a\x014", 1)  # replica_id "3" -> "4"
            assert forged != signed
            got = _raw(addr, session.METHOD, [session.envelope(5, "Heartbeat", signed),
                                               session.envelope(6, "Heartbeat", forged)], 2)
            by_seq = {r.seq: r for r in got}
            assert by_seq[5].code == 0
            assert by_seq[6].code == grpc.StatusCode.UNAUTHENTICATED.value[0], by_seq[6].details
            assert good.heartbeat(1).quorum_id == 0  # and the relay goes on for the others
            assert good.relay == addr
        finally:
            good.close()


def test_tls_on_both_hops_of_a_relay(tmp_path):
    """A TLS lighthouse, a relay serving TLS and checking the lighthouse's certificate: a client
    trusting the CA gets its quorum through the relay; a plain client gets nowhere."""
    from fthsdp.control import auth
    from test_security_lighthouse import _self_signed

    cert, key = _self_signed(tmp_path)
    secret = auth.new_secret()
    cfg = LighthouseConfig(secret=secret, tls_cert_file=str(cert), tls_key_file=str(key), join_timeout_s=0.1)
    with LighthouseThread(cfg) as lh, relay_process(lh.address, "127.0.0.1:0", "--tls-cert", str(cert), "--tls-key",
                                                    str(key), "--lighthouse-tls-ca", str(cert)) as (addr, _):
        with _client(lh.address, "0", key=auth.job_key(secret, "job"), tls_ca_file=str(cert), relay=addr) as c:
            assert c.get_quorum(0, ftar_addresses=["127.0.0.1:7000"], timeout_s=10).member_ids == ("0",)
            assert c.relay == addr and lh.server.stats["relay_batches"] >= 1
        with pytest.raises(grpc.RpcError):  # plain TCP to the relay's TLS port
            _raw(addr, session.METHOD, [session.envelope(1, "Heartbeat", _hb())], 1, timeout_s=3)


def _raw(address: str, method: str, messages: list[bytes], expect: int, timeout_s: float = 10.0) -> list:
    """Send ``messages`` on one stream of ``method`` and read ``expect`` replies (each batch's
    replies unpacked when ``method`` is the relay method), on a connection of its own (each has its
    own budget at the lighthouse)."""
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)(
            iter(messages), timeout=timeout_s)
        out = []
        for raw in call:
            inner = pb2.RelayBatch.FromString(raw).messages if method == session.RELAY_METHOD else [raw]
            out.extend(pb2.SessionReply.FromString(r) for r in inner)
            if len(out) >= expect:
                call.cancel()
                break
        return out
    finally:
        channel.close()


def _hb(rid: str = "0") -> bytes:
    return pb2.HeartbeatRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="job",
                                replica_id=rid).SerializeToString()


def test_bad_batches_get_clear_errors_and_a_batch_of_garbage_is_cut_short(lighthouse):
    got = _raw(lighthouse.address, session.RELAY_METHOD, [b"\xff\xff\xff", session.batch([])], 2)
    assert [r.seq for r in got] == [0, 0] and all(r.code == INVALID for r in got)
    assert "not a valid RelayBatch" in got[0].details and "empty" in got[1].details
    # 20 malformed messages: the first 8 are refused one by one, the rest unread; the good ones
    # before them are answered.
    garbage = [session.envelope(1, "Heartbeat", _hb()), session.envelope(2, "Heartbeat", _hb("1"))]
    garbage += [session.envelope(10 + i, "Heartbeat", b"\x0a\xff") for i in range(20)]
    got = {r.seq: r for r in _raw(lighthouse.address, session.RELAY_METHOD, [session.batch(garbage)], 22)}
    assert got[1].code == 0 and got[2].code == 0
    refused = [got[10 + i] for i in range(20)]
    assert all(r.code == INVALID and "not a valid HeartbeatRequest" in r.details for r in refused[:8])
    assert all(r.code == EXHAUSTED and "was not read" in r.details for r in refused[8:])
    # the lighthouse goes on: a fresh relay stream is served
    ok = _raw(lighthouse.address, session.RELAY_METHOD, [session.batch([session.envelope(1, "Heartbeat", _hb())])], 1)
    assert ok[0].code == 0


def test_a_relay_answers_garbage_from_its_clients_and_goes_on(lighthouse):
    with relay_process(lighthouse.address) as (addr, p):
        got = _raw(addr, session.METHOD, [b"\xff\xff\xff", session.envelope(0, "Heartbeat", _hb()),
                                          session.envelope(3, "Leave", _hb()),
                                          session.envelope(4, "Heartbeat", _hb())], 4)
        by = {r.seq: r for r in got if r.seq}
        zero = sorted(r.details.split(":")[0] for r in got if r.seq == 0)
        assert zero == ["a session message is not a valid SessionRequest protobuf message", "seq is 0"]
        assert by[3].code == INVALID and "not carried on a session" in by[3].details  # the lighthouse's check
        assert by[4].code == 0
        # a message too large for the lighthouse breaks its own client's stream, not the relay's one
        with pytest.raises(grpc.RpcError) as e:
            _raw(addr, session.METHOD, [session.envelope(5, "Heartbeat", b"\x0a" + b"x" * 5_000_000)], 1)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _raw(addr, session.METHOD, [session.envelope(6, "Heartbeat", _hb())], 1)[0].code == 0
        # a client that opens a relay stream on the relay finds no such service: relays do not nest
        with pytest.raises(grpc.RpcError) as e:
            _raw(addr, session.RELAY_METHOD, [session.batch([session.envelope(1, "Heartbeat", _hb())])], 1)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert p.poll() is None


def _beat_for(clients, seconds: float, step: int) -> None:
    """Heartbeats of ``clients`` for ``seconds`` (they stay alive at a lighthouse of a short window)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for c in clients:
            c.heartbeat(step)
        time.sleep(0.1)


@contextlib.contextmanager
def _beating(clients, step: int):
    """Heartbeats of every client every 0.1 s in the background, as a job's heartbeat thread sends
    them: a quorum request alone keeps its replica alive for one detection window, and under load
    the other replica's request can come later than that (CI saw a replica ignored as silent)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            for c in clients:
                with contextlib.suppress(Exception):
                    c.heartbeat(step)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def test_clients_leave_a_killed_relay_come_back_to_it_restarted_and_leave_it_stopped(lighthouse, monkeypatch):
    monkeypatch.setattr(RelayPath, "RETRY_S", 1.0)  # 5 s in a job
    monkeypatch.setattr(RelayPath, "SILENCE_S", 0.9)  # 3 s in a job
    with relay_process(lighthouse.address) as (addr, p):
        # outage_s: a client rides out the first broken streams as an outage (RelayPath.BREAKS)
        clients = [_client(lighthouse.address, r, relay=addr, outage_s=10.0) for r in range(2)]
        for c in clients:  # from a killed relay only its channel connecting again brings them back soon
            c._route.path.first_retry_s = c._route.path.retry_s = 30.0
        try:
            assert len({q.quorum_id for q in _ask(clients, 0, 2)}) == 1
            p.kill()
            p.wait(10)
            # one broken stream is an outage, not yet a dead relay (a connect storm can refuse one)
            with pytest.raises(Exception, match="session stream ended"):
                clients[0].heartbeat(1)
            assert clients[0].relay == addr
            # a relay that stays away is left: the step's requests ride it out and go on directly
            qs = _ask(clients, 1, 2)
            assert len({q.quorum_id for q in qs}) == 1 and qs[0].max_step == 1
            assert [c.relay for c in clients] == ["", ""]
            assert clients[0].heartbeat(2).dead_members == ()
            with relay_process(lighthouse.address, addr) as (again, p2):  # restarted on its port
                assert again == addr
                batches = lighthouse.server.stats["relay_batches"]
                up = time.monotonic()  # back within a reconnect backoff and a beat, not the 30 s retry wait
                while [c.relay for c in clients] != [addr, addr] and time.monotonic() - up < 5.0:
                    _beat_for(clients, 0.1, 2)
                assert [c.relay for c in clients] == [addr, addr], "clients did not return to the restarted relay"
                for c in clients:  # the stopped relay below is left by silence: back after the retry wait
                    c._route.path.first_retry_s = c._route.path.retry_s = RelayPath.RETRY_S
                with _beating(clients, 2):
                    qs = _ask(clients, 2, 2)
                assert len({q.quorum_id for q in qs}) == 1 and qs[0].max_step == 2
                assert [c.relay for c in clients] == [addr, addr]  # back on it
                assert lighthouse.server.stats["relay_batches"] > batches
                # A stopped relay keeps its connections and answers nothing: heartbeats find it silent.
                p2.send_signal(signal.SIGSTOP)
                t0 = time.monotonic()

                def leave(c: LighthouseClient) -> None:  # both at once: neither is silent meanwhile
                    for _ in range(6):
                        with contextlib.suppress(Exception):
                            c.heartbeat(3)
                        if not c.relay:
                            break

                with ThreadPoolExecutor(len(clients)) as ex:
                    list(ex.map(leave, clients))
                assert [c.relay for c in clients] == ["", ""], "a client stayed behind a stopped relay"
                assert time.monotonic() - t0 < 6 * 0.5 + 1
                with _beating(clients, 3):
                    qs = _ask(clients, 3, 2)  # the job goes on without the relay
                assert len({q.quorum_id for q in qs}) == 1 and qs[0].max_step == 3
                p2.send_signal(signal.SIGCONT)
                _beat_for(clients, RelayPath.RETRY_S + 0.2, 4)
                with _beating(clients, 4):
                    qs = _ask(clients, 4, 2)
                assert len({q.quorum_id for q in qs}) == 1 and qs[0].max_step == 4
                assert [c.relay for c in clients] == [addr, addr]
                assert clients[0].heartbeat(5).dead_members == ()
        finally:
            for c in clients:
                c.close()


def test_clients_follow_their_relay_file_to_a_relay_placed_elsewhere(lighthouse, tmp_path, caplog):
    """A launcher that places a block's relay elsewhere (its node was lost) writes the new address
    into each of the block's processes' relay files: a client still answered through the old relay
    moves at its next beat, and one that left a dead relay returns through the new one at once,
    not after its retry wait (30 s here)."""
    with relay_process(lighthouse.address) as (a, pa), relay_process(lighthouse.address) as (b, _):
        files = [tmp_path / f"relay-{r}" for r in range(2)]
        clients = [_client(lighthouse.address, r, relay=a, relay_file=str(files[r]), outage_s=10.0,
                           heartbeat_interval_s=0.05) for r in range(2)]
        for c in clients:
            c._route.path.first_retry_s = c._route.path.retry_s = 30.0

        def until(cond, what: str, seconds: float = 5.0) -> None:
            end = time.monotonic() + seconds
            while not cond() and time.monotonic() < end:
                time.sleep(0.02)
            assert cond(), what

        try:
            assert len({q.quorum_id for q in _ask(clients, 0, 2)}) == 1
            for c in clients:
                c.start_heartbeats()
            assert [c.relay for c in clients] == [a, a]
            files[0].write_text(b + "\n")  # client 0's relay moved while the old one still answers
            until(lambda: clients[0].relay == b, "client 0 did not move to the relay its file names")
            assert clients[1].relay == a and clients[0]._route.path.moves == 1
            pa.kill()  # the old relay dies: client 1 leaves it and speaks to the lighthouse directly
            pa.wait(10)
            until(lambda: clients[1].relay == "", "client 1 did not leave the dead relay")
            t0 = time.monotonic()
            files[1].write_text(b)
            until(lambda: clients[1].relay == b, "client 1 did not return through its new relay")
            assert time.monotonic() - t0 < 5.0  # its retry wait was 30 s
            qs = _ask(clients, 1, 2)
            assert len({q.quorum_id for q in qs}) == 1 and qs[0].max_step == 1
            with caplog.at_level("WARNING", logger="fthsdp.control.lighthouse_client"):
                files[0].write_text("not an address")
                until(lambda: "relay file" in caplog.text, "a malformed relay file was not reported")
            assert "the relay is unchanged" in caplog.text and clients[0].relay == b
            assert all(c.heartbeat_failures == 0 for c in clients)
        finally:
            for c in clients:
                c.close()


def test_10k_ranks_through_relays_with_kills_a_hang_a_lighthouse_restart_and_failed_relays():
    """The emulation's whole control loop at 10,240 ranks behind 4 real relay processes, one of
    them SIGKILLed and restarted, one SIGSTOPped for 2.5 s, and the invariants the real tests
    check (consistent decisions, no wait past its deadline, every batch once)."""
    import re

    from fthsdp.sim.emulation import EmulationConfig, Fault, run_emulation
    from fthsdp.sim.mock_plane import ModelShape

    faults = (Fault("kill", step=3, replica=2, seconds=0.5), Fault("lighthouse", step=6, seconds=0.5),
              Fault("relay", step=9, replica=1, seconds=0.5), Fault("kill", step=11, replica=10, seconds=0.5),
              Fault("hang", step=13, replica=20, seconds=1.6), Fault("relay_stop", step=12, replica=3, seconds=2.5))
    cfg = EmulationConfig(replicas=32, ranks_per_replica=320, steps=60, relays=4, faults=faults,
                          model=ModelShape(params=10**9, step_s=0.05), run_timeout_s=120.0, relay_retry_s=1.0,
                          relay_silence_s=1.0)
    assert cfg.ranks == 10_240
    rep = run_emulation(cfg)
    assert rep.violations() == []
    assert rep.final_steps == {str(i): 60 for i in range(32)}
    ev = "\n".join(rep.events)
    assert "replica 2: caught up" in ev and "replica 10: caught up" in ev and rep.lighthouse_starts == 2
    assert "lighthouse declared ['20'] dead" in ev and "replica 20: caught up" in ev
    assert "fault: relay 1 SIGKILLed at step 9, restarted after 0.5s" in ev
    assert "fault: relay 3 SIGSTOPped at step 12 for 2.5s" in ev
    # relay 1 carried replicas 8-15 and relay 3 replicas 24-31: their processes left them for the
    # lighthouse (the stopped one's after 1 s of heartbeats nothing answered) and came back to them
    m = re.search(r"(\d+) process\(es\) left a failed relay for the lighthouse \(most often: [^)]*\); "
                  r"(\d+) are back on it \((\d+) returned as soon as it accepted connections again\), "
                  r"(\d+) still speak to the lighthouse directly", ev)
    assert m, ev
    left, back, reconnected, direct = map(int, m.groups())
    assert left >= 8 and left == back + direct and back >= left // 2, ev
    assert reconnected >= 1, ev  # relay 1's, restarted (relay 3's was stopped: its connections stayed up)
    assert all(s.get("messages_up", 0) > 0 for s in rep.relay_stats)  # the restarted relay 1 too
    assert all(len(c.batches) == len(c.healthy) for c in rep.commits.values())


def test_replicas_of_several_processes_through_relays():
    """Every process of a 3-process replica has its own session through its replica's relay (the
    leader's quorum requests, each process's heartbeats and registrations); the followers' views
    are unary calls to the lighthouse."""
    from fthsdp.sim.emulation import EmulationConfig, Fault, run_emulation
    from fthsdp.sim.mock_plane import ModelShape

    cfg = EmulationConfig(replicas=4, ranks_per_replica=6, steps=9, processes_per_replica=3, relays=2,
                          model=ModelShape(params=10**6, step_s=0.02), faults=(Fault("kill", step=3, replica=1,
                                                                                      seconds=0.5),),
                          run_timeout_s=60.0)
    rep = run_emulation(cfg)
    assert rep.violations() == [] and rep.final_steps == {str(i): 9 for i in range(4)}
    assert rep.views_fetched >= 2 * 4
    # 4 replicas x 3 processes, and replica 1's 3 again after its restart
    assert sum(s["clients"] for s in rep.relay_stats) == 15, rep.relay_stats
    assert all(s["upstream_breaks"] == 0 and s["replies_down"] > 0 for s in rep.relay_stats)


@pytest.mark.multiprocess
def test_fthsdp_run_with_relays_trains_through_kills_of_a_relay_a_replica_and_the_lighthouse(tmp_path):
    """`fthsdp run` with launch.relays=2 (one replica behind each), each relay on the emulated host of
    its replica (launch.hosts, launch.relay_placement=replicas): every replica process's heartbeats
    and quorum requests go through its relay (its log counts them); relay 1 is SIGKILLed
    (``--kill-relay 1@5``) and the launcher restarts it on its address (within ~0.3 s: its replica
    rides the gap out as an outage, or leaves it and returns once it accepts connections again;
    CI saw both), the replica behind it, SIGKILLed at step 12, rejoins through it, the lighthouse
    is SIGKILLed and restarted (cold: no standby) behind both, and the job ends exactly once and
    bitwise identical."""
    import ast

    from fthsdp.launch import report
    from test_launcher import exactly_once, fthsdp_run, job_args, summary

    out = tmp_path / "run"
    p = fthsdp_run(out, *job_args(2, 50, "--kill", "1@12", "--kill-relay", "1@5", "--kill-lighthouse", "35",
                                  "launch.relays=2", "launch.lighthouse_standby=false",
                                  "launch.hosts=127.0.0.2,127.0.0.3", "launch.relay_placement=replicas",
                                  "ft.lighthouse_outage_s=30", "launch.restart_delay_s=0.5", "train.min_step_s=0.2"))
    assert p.returncode == 0, p.stderr[-3000:]
    s = summary(out)
    assert len(s["lighthouse_restarts"]) == 1 and s["job_restarts"] == []
    assert s["lighthouse_restarts"][0]["standby"] is False and "lighthouse died (signal 9); restarted in" in p.stderr
    assert [r["index"] for r in s["relay_restarts"]] == [1] and "signal 9" in s["relay_restarts"][0]["died"]
    assert "relay 1 died (signal 9); restarted on its address in" in p.stderr
    run = report.load_run(out)
    assert s["identical_final_state"] and all(d["step"] == 50 for d in run.done.values())
    positions = exactly_once(out, run)
    assert positions[0] == 50 and 12 < positions[1] < 50, positions  # replica 1 rejoined and trained again
    assert relay.relay_of(("a", "b"), 1, 2) == "b"  # replica 1 is behind relay 1
    relays = {e["index"]: e["address"] for e in read_metrics(out / "events.jsonl") if e["kind"] == "relay"}
    assert relays[0].startswith("127.0.0.2:") and relays[1].startswith("127.0.0.3:"), relays  # on their replicas' hosts
    log_text = (out / "relay-1.log").read_text()
    stats = ast.literal_eval(log_text.rpartition("relay stopping (")[2].partition(")")[0])
    # the restarted relay's own count: replica 1's process behind it again, and its second one after
    # its kill, >= 40 quorum requests between them, and their beats
    assert stats["clients"] >= 2 and stats["messages_up"] >= 40 and stats["replies_down"] >= 40, stats
    assert stats["upstream_breaks"] >= 1  # the lighthouse's death, ridden out behind the relay
    other = (out / "relay-0.log").read_text()  # relay 0 was never killed: one life, replica 0 behind it
    assert other.count("relay stopping (") == 1 and "relay 0 died" not in p.stderr


@pytest.mark.multiprocess
def test_fthsdp_run_moves_a_relay_whose_port_was_taken_and_its_replicas_follow_it(tmp_path):
    """`fthsdp run` with one relay: the relay is SIGKILLed from outside the job and its port taken
    at once by another process, so the launcher cannot restart it on its address; it starts it on
    another port of its host and rewrites the relay file of its block (relay-0.address,
    ft.lighthouse_relay_file): both replicas' processes, still on the old address (the squatter
    accepts connections and answers nothing), leave it after its silence and try the new relay at
    once (RelayPath.move), are carried by it, and the job ends exactly once and bitwise identical.
    (Before, the relay stayed dead and its replicas spoke to the lighthouse for the rest of the job;
    and a client moved while on a silent relay waited the 5 s retry out before trying the new one.)"""
    import ast
    import os
    import socket

    from fthsdp.addresses import split_host_port
    from fthsdp.launch import report
    from test_launcher import exactly_once, job_args, summary

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fthsdp.cli", "run", "--no-progress", "--out-dir", str(out),
           *job_args(2, 40, "launch.relays=1", "train.min_step_s=0.2")]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    taken = socket.socket()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # a few steps in
            m = out / "metrics-1.jsonl"
            if m.exists() and len(read_metrics(m)) >= 5:
                break
            time.sleep(0.1)
        old = (out / "relay-0.address").read_text().strip()
        pid = int(subprocess.run(["pgrep", "-f", f"fthsdp.control.relay .*{out / 'relay-0.port'}"],
                                 capture_output=True, text=True).stdout.split()[0])
        os.kill(pid, signal.SIGKILL)
        host, port = split_host_port(old)
        for _ in range(200):  # its port, as soon as the kernel frees it (no SO_REUSEPORT: gRPC cannot share it)
            try:
                taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                taken.bind((host, port))
                break
            except OSError:
                time.sleep(0.005)
        taken.listen()
        _, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
        taken.close()
    assert job.returncode == 0, err[-3000:]
    s = summary(out)
    (restart,) = s["relay_restarts"]
    new = (out / "relay-0.address").read_text().strip()
    assert restart["moved_from"] == old and new != old and new.startswith(host + ":"), (restart, new)
    assert f"its address {old} could not be taken again" in err
    moved = [e for e in read_metrics(out / "events.jsonl") if e["kind"] == "relay_moved"]
    assert [(e["moved_from"], e["address"]) for e in moved] == [(old, new)]
    for rid in (0, 1):  # each process moved to the new relay and was carried by it
        text = (out / f"replica-{rid}.log").read_text()
        assert f"its relay is now {new}" in text and f"is back on relay {new}" in text, text[-3000:]
    stats = ast.literal_eval((out / "relay-0.log").read_text().rpartition("relay stopping (")[2].partition(")")[0])
    assert stats["clients"] >= 2 and stats["messages_up"] >= 20, stats
    run = report.load_run(out)
    assert s["identical_final_state"] and all(d["step"] == 40 for d in run.done.values())
    # the squatter's port is silent (it never accepts): the block was cut off ~3 s (the silence rule)
    # and may have been declared dead and rejoined behind meanwhile; every batch still trained once
    assert all(0 < p <= 40 for p in exactly_once(out, run))
