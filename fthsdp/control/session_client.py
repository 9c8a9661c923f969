"""The client end of the session stream (:mod:`fthsdp.control.session`), for threads.

:class:`SyncSession` carries one process's ``GetQuorum`` and ``Heartbeat``
requests on one long-lived stream: callers (the heartbeat thread, the step
that asks for a quorum) hand it a request's bytes and wait, each with its own
deadline, for the reply of the same ``seq``, which a reader thread matches.
Errors come back as :class:`SessionError`, a ``grpc.RpcError`` with the code
and details the unary call would have ended with, so a caller handles both
transports alike. A stream that breaks (the lighthouse died or restarted)
fails every open request with ``UNAVAILABLE`` and is opened again by the next
request. A lighthouse that does not offer sessions answers ``UNIMPLEMENTED``:
:class:`SessionUnsupported`, after which the caller uses unary calls.

A session may go through a relay (:mod:`fthsdp.control.relay`). A relay that
cannot reach the lighthouse answers ``UNAVAILABLE`` itself; a relay that is
gone breaks the stream and a stopped one answers nothing (:func:`relay_gone`),
and after a few such failures in a row the client speaks to the lighthouse
directly, and tries its relay again later (:class:`RelayPath`): a relay bounds
the lighthouse's fan-in, never its clients' availability.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from fthsdp.control import session
from fthsdp.proto import lighthouse as _load_stubs

pb2, _ = _load_stubs()

__all__ = ["SessionError", "SessionUnsupported", "SyncSession", "parse_reply", "beat_covered", "relay_gone",
           "connect_refused", "stop_stream", "RelayPath", "SessionRoute", "Routed", "CLOSED"]


CLOSED = "its client closed this session stream"  # why a request on a session closed under it failed


class SessionError(grpc.RpcError):
    """A session request ended with a non-OK status (as a unary call's ``grpc.RpcError``)."""

    def __init__(self, code: grpc.StatusCode, details: str, broken: bool = False, unanswered: bool = False) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details
        self.broken = broken  # the stream itself ended (not a reply's status)
        self.unanswered = unanswered  # nothing came back before the request's deadline (not a reply's status)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def debug_error_string(self) -> str:
        return f"session stream: {self._code.name}: {self._details}"


class SessionUnsupported(SessionError):
    """The lighthouse offers no session stream (an older one): use unary calls."""


def beat_covered(session, process_index: int, registers: bool, since_asked_s: float, interval_s: float,
                 relay_return_due: bool = False) -> bool:
    """Whether a heartbeat due now may be skipped: a replica's leader (process 0) on a confirmed
    ``session`` (a reply came back on it), registering nothing, that sent a quorum request less
    than ``interval_s`` ago, which the lighthouse counts as this beat (fewer messages while steps
    are fast; a stopped leader is still judged by the time of its last request or beat). Never
    when it is time to try its relay again (``relay_return_due``): the heartbeat is the return's
    probe (:class:`RelayPath`). The one rule of the threaded client and the emulation's asyncio
    client."""
    return (session is not None and session.confirmed and process_index == 0 and not registers
            and since_asked_s < interval_s and not relay_return_due)


def parse_reply(raw: bytes):
    """A ``SessionReply`` from the wire; a reply that cannot be read is a protocol error."""
    try:
        return pb2.SessionReply.FromString(raw)
    except Exception as e:  # noqa: BLE001 - whatever the bytes were
        raise SessionError(grpc.StatusCode.INTERNAL, f"unreadable session reply from the lighthouse: {e}") from None


def stream_error(e: BaseException) -> SessionError:
    """What a broken stream means for its open requests."""
    code = e.code() if isinstance(e, grpc.RpcError) and hasattr(e, "code") else grpc.StatusCode.UNAVAILABLE
    details = (e.details() if isinstance(e, grpc.RpcError) and hasattr(e, "details") else "") or str(e)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return SessionUnsupported(code, f"the lighthouse offers no session stream: {details}")
    if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK):
        code = grpc.StatusCode.UNAVAILABLE  # the stream ended under its requests: as if unreachable
    return SessionError(code, f"session stream ended: {details}", broken=True)


def stop_stream(call, tasks) -> None:
    """Cancel an asyncio stream ``call`` and the tasks that read and write it, except the one
    running this (it is the one that found the stream ended, and returns by itself)."""
    import asyncio

    call.cancel()
    me = asyncio.current_task()
    for t in tasks:
        if t is not me:
            t.cancel()


class RelayPath:
    """Which way a client's session goes, through its relay or to the lighthouse directly, and
    when it switches. Pure (times in); the two clients (threads: lighthouse_client, asyncio: the
    emulation's) do the switching.

    **Leave** after :data:`BREAKS` broken streams in a row through the relay, spread over at
    least :data:`GRACE_S`, with no reply in between. One break is not proof of a dead relay: when
    the first break was enough, 461 of 512 emulated leaders left two live relays at start-up
    (which failure broke their streams was not pinned down), and a channel that failed to connect
    fails the next streams at once, so a count alone is reached in milliseconds; a dead relay
    keeps failing. The grace is short beside the failure-detection window, because while a
    client is cut off from its relay its heartbeats do not arrive either.

    Or after :data:`SILENCE_S` of requests that nothing answered within their deadline, with no
    reply in between: a SIGSTOPped relay (a hung host) keeps its connections and answers
    nothing. Silence is weaker proof than a break, because a busy relay is slow too: when the
    third unanswered request was enough, 377 of 512 emulated leaders left two live relays in the
    first round at 512 x 196 (every answer 1.4 MB, the beats' answers queued behind them), and
    the limit was 10 s. With a new quorum's rings sent as each leader's ring neighbourhood (a
    first answer of ~30 KB) no round queues the beats that long: no process left a live relay at
    512 x 196 behind 2 relays from a cold start with a 2.5 s limit, nor with 3 s on a host whose
    second core a busy loop took (README, "The relay tier", Failures). A stopped relay's clients
    are declared dead by the lighthouse before they leave it, and rejoin once they speak to it
    directly: the block is out for about SILENCE_S and a beat's deadline (3.6 s measured; 10.7 s
    with 10 s), not until the relay resumes. (HTTP/2 keepalive pings did not tell the two apart
    here: a client pinging every second did not end its stream to a stopped relay within 8 s.)

    **Return** :data:`RETRY_S` after leaving (the launcher restarts a dead relay on its port; a
    stopped one may be resumed): the next heartbeat goes through the relay on a new stream, a
    *probe* with half the beat's deadline, and the session moves to that stream once it is
    answered; a quorum request never waits on a relay not known to answer. A failed probe goes
    back to the lighthouse at once (the beat is sent there in the time left) and doubles the wait
    (at most :data:`MAX_RETRY_S`). So a relay's failure takes its clients' fan-in away only while
    it lasts, at the price of one probe per try.

    Or **return at once** when a relay left by its broken streams is seen to accept connections
    again (:meth:`channel_state`: the client watches its channel meanwhile): the launcher restarts
    a killed relay on its port within a second, often a little after the grace, and a client that
    left it then waited out RETRY_S away from it (seen in ``fthsdp run``: a replica left a relay
    restarted 0.31 s after its kill, 0.08 s after it listened again, and was still away when it was
    killed itself 0.6 s later). Only a channel seen down since the leave and then connected
    counts, once per leave: a relay whose connections stay up while its streams break, or a
    stopped one (its connections stay up), says nothing new by them, and waits RETRY_S."""

    BREAKS = 3
    GRACE_S = 0.3
    SILENCE_S = 3.0
    RETRY_S = 5.0
    MAX_RETRY_S = 60.0

    def __init__(self, relay: str, retry_s: float | None = None, silence_s: float | None = None) -> None:
        retry_s = self.RETRY_S if retry_s is None else retry_s
        silence_s = self.SILENCE_S if silence_s is None else silence_s
        if not 0 < retry_s <= self.MAX_RETRY_S:
            raise ValueError(f"retry_s {retry_s}: must be in (0, {self.MAX_RETRY_S}] seconds")
        if not silence_s > 0:
            raise ValueError(f"silence_s {silence_s}: must be > 0 seconds")
        self.silence_s = silence_s
        self.quiet_since: float | None = None  # the first unanswered request since the last reply
        self.relay = relay  # this client's relay ("": none, always the lighthouse directly)
        self.via_relay = bool(relay)
        self.returning = False  # back on the relay, no reply through it yet
        self.breaks = 0
        self.since: float | None = None
        self.first_retry_s = retry_s  # the wait before the first return after leaving (RETRY_S but in tests)
        self.retry_s = retry_s
        self.retry_at = math.inf
        self.left_why = ""  # why it last left the relay
        self.left_relay = ""  # the relay it last left (the one it was moved from, after a move)
        self.moved_from = ""  # moved while still on this relay (move): once it fails, the new one is tried at once
        self.watching = False  # left by broken streams: its channel connecting again means it is back
        self.seen_down = False  # its channel was seen not connected since the client left
        self.leaves = 0
        self.returns = 0
        self.reconnects = 0  # returns made at once because the relay's channel connected again
        self.moves = 0  # times the client was given another relay (move)

    def ok(self) -> bool:
        """A reply came on the current path; True: it was the first through the relay after a return."""
        self.breaks, self.since, self.quiet_since = 0, None, None
        if not self.returning:
            return False
        self.returning, self.retry_s = False, self.first_retry_s
        self.returns += 1
        return True

    def failed(self, now: float, why: str, silent: bool = False, refused: bool = False) -> bool:
        """A request through the relay failed as a gone relay makes it fail (a broken stream) or,
        ``silent``, nothing answered it in time (:func:`relay_gone`); True: leave the relay now.
        ``refused``: the failure said nothing accepted a connection at the relay's address
        (:func:`connect_refused`): its channel is known down at the leave, so a restarted relay
        whose channel is already connected again at the first look is returned to at once."""
        if not self.via_relay:
            return False
        if silent:
            self.quiet_since = now if self.quiet_since is None else self.quiet_since
            leave = now - self.quiet_since >= self.silence_s
        else:
            self.breaks += 1
            self.since = now if self.since is None else self.since
            leave = self.breaks >= self.BREAKS and now - self.since >= self.GRACE_S
        if not (self.returning or leave):
            return False
        if self.returning:
            self.retry_s = min(2 * self.retry_s, self.MAX_RETRY_S)
        self.via_relay = self.returning = False
        self.watching, self.seen_down = not silent, refused and not silent
        self.breaks, self.since, self.quiet_since = 0, None, None
        self.retry_at = now + self.retry_s
        self.left_relay = self.moved_from or self.relay
        if self.moved_from:  # the failed relay is the old one: the new one was never tried
            self.retry_at, self.watching, self.seen_down, self.moved_from = now, False, False, ""
        self.left_why = why
        self.leaves += 1
        return True

    def channel_state(self, ready: bool, now: float) -> bool:
        """What the relay's channel is (``ready``: connected) while the client is away from it. A
        relay left by its broken streams whose channel is seen down and then connected again
        was restarted on its address: the return is due now, not after the retry wait. True:
        it just became due (once per leave)."""
        if self.via_relay or not self.watching:
            return False
        if not ready:
            self.seen_down = True
            return False
        if not self.seen_down:
            return False  # up all along since the leave: its streams broke for another reason
        self.watching = self.seen_down = False
        self.retry_at = min(self.retry_at, now)
        self.reconnects += 1
        return True

    def move(self, relay: str, now: float) -> bool:
        """The client's relay is now ``relay``: its launcher placed it elsewhere (the old one's node
        was lost) or gave it one. Away from the old relay, the next heartbeat probes the new one at
        once, as a return; still on the old one (it answers), the client stays there until it
        fails, and then tries the new one at once, not after the retry wait (the new one never
        failed: ``fthsdp run`` saw a client on a silent old address wait it out to the job's end).
        The backoff of failed returns starts over: they were the old relay's. False: it is the
        relay the client has already."""
        if not relay:
            raise ValueError("a relay to move to is HOST:PORT, not empty")
        if relay == self.relay:
            return False
        if self.via_relay and not self.moved_from:
            self.moved_from = self.relay
        self.relay = relay
        self.watching = self.seen_down = False  # the old relay's channel says nothing of the new one
        self.retry_s = self.first_retry_s
        if not self.via_relay:
            self.retry_at = now
        self.moves += 1
        return True

    def owns(self, current: bool, probe: bool) -> bool:
        """Whether a session's outcome counts for the path: the current session's, or the
        outstanding probe's (``probe``: a return's stream); a stream left meanwhile counts for
        nothing. The one rule of both clients."""
        return current or (probe and self.returning)

    def return_due(self, now: float) -> bool:
        """Whether it is time to try the relay again (the next heartbeat does)."""
        return not self.via_relay and bool(self.relay) and now >= self.retry_at

    def try_relay(self, now: float) -> bool:
        """Whether the request about to go out returns to the relay (left long enough ago)."""
        if not self.return_due(now):
            return False
        self.via_relay = self.returning = True
        self.watching = self.seen_down = False
        return True


def relay_gone(e: BaseException) -> bool:
    """Whether ``e``, from a session through a relay, means the relay itself may be gone or
    stopped: its stream broke or is unreachable, or nothing came back in time
    (:class:`RelayPath` says when the client speaks to the lighthouse directly instead). An
    ``UNAVAILABLE`` *reply* (the relay cannot reach the lighthouse) is an outage to ride out
    as without a relay, and any other reply shows the path works."""
    if not isinstance(e, SessionError) or isinstance(e, SessionUnsupported):
        return False
    return e.unanswered or (e.broken and e.code() == grpc.StatusCode.UNAVAILABLE)


def connect_refused(e: BaseException) -> bool:
    """Whether ``e``, a broken session stream, says its channel could not connect (nothing
    accepted a connection at the address: the relay process is gone, or not listening yet), as
    gRPC words it in the status details. Seen at a leave, the channel was down then: the relay
    listening again later is a restart, even when its channel connected before the client
    looked (:meth:`RelayPath.channel_state`)."""
    if not isinstance(e, SessionError) or not e.broken or e.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    text = e.details().lower()
    return "failed to connect" in text or "connection refused" in text


@dataclass(frozen=True)
class Routed:
    """What an outcome did to a :class:`SessionRoute`: ``close`` the sessions it dropped (the
    caller closes them: the threaded client at once, the asyncio one with ``await``); ``again``:
    send the failed request on ``route.session`` now (it is direct); ``left`` / ``back``: the
    process just left its relay or came back to it (the caller logs it)."""

    close: tuple = ()
    again: bool = False
    left: bool = False
    back: bool = False


class SessionRoute:
    """The sessions of one process and which one a request goes on: the current one, a probe
    through the relay when :class:`RelayPath` says to return, and a ``retired`` one left while
    a request still waited on it (closed once idle). The switching rules of both clients (the
    threaded one of :mod:`fthsdp.control.lighthouse_client` and the emulation's asyncio one);
    no I/O here: a session is made by the callable given and closed by the caller (:class:`Routed`).
    Not thread-safe: the threaded client holds its lock around each call."""

    def __init__(self, path: RelayPath, session) -> None:
        self.path = path
        self.session = session  # None: unary calls (no session, or the lighthouse offers none)
        self.retired = None

    def pick(self, method: str, now: float, probe: Callable[[], object]) -> tuple[object, tuple]:
        """(the session ``method``'s request goes on, sessions to close). A heartbeat due to
        return to the relay goes on a new stream through it, ``probe()``: a quorum request never
        waits on a relay not known to answer."""
        close = ()
        if self.retired is not None and self.retired.idle:
            close, self.retired = (self.retired,), None
        if method == "Heartbeat" and self.session is not None and self.path.try_relay(now):
            s = probe()
            s.probe = True
            return s, close
        return self.session, close

    def answered(self, s) -> Routed:
        """A reply came on ``s``: through the relay it counts for it (a probe's: it is back)."""
        if not s.relayed or not self.path.owns(s is self.session, s.probe) or not self.path.ok():
            return Routed()
        s.probe = False
        close = (self.retired,) if self.retired is not None else ()
        self.retired, self.session = self.session, s  # the direct one: closed once idle
        return Routed(close=close, back=True)

    def failed(self, s, e: SessionError, now: float, direct: Callable[[], object]) -> Routed:
        """A request on ``s`` failed with ``e``. ``again``: it goes again on the (direct) session
        now current, because the relay is gone or silent (now, or another request found so first)."""
        if not s.relayed:
            return Routed()
        if not relay_gone(e) and not isinstance(e, SessionUnsupported):
            return self.answered(s)  # a reply, if a refusal: the path works (a probe's: it is back)
        left, close = False, ()
        if self.path.owns(s is self.session, s.probe):
            if not self.path.failed(now, e.details(), e.unanswered, connect_refused(e)):
                return Routed()
            left, close = True, (s,)  # its channel stays open: the client returns to it later
            if s is self.session:
                back, self.retired = self.retired, None
                self.session = back if back is not None else direct()
        return Routed(close=close, again=self.session is not None and not self.session.relayed, left=left)

    def unsupported(self, s) -> tuple:
        """The lighthouse offers no session (``s`` was told so): unary calls from now; closes ``s``."""
        self.session = None
        return (s,)

    def sessions(self) -> tuple:
        """Every session it holds (to close them all)."""
        return tuple(x for x in (self.session, self.retired) if x is not None)


class _Waiter:
    __slots__ = ("event", "reply", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply = None
        self.error: SessionError | None = None


class SyncSession:
    """One stream of ``channel`` to the lighthouse's session service (thread-safe)."""

    def __init__(self, channel: grpc.Channel, relayed: bool = False) -> None:
        self.relayed = relayed  # the channel is a relay's (the client's bookkeeping: RelayPath)
        self.probe = False  # a return to the relay, not yet answered (the client's bookkeeping)
        self._open = channel.stream_stream(session.METHOD, request_serializer=None, response_deserializer=None)
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._outgoing: queue.SimpleQueue | None = None
        self._call = None
        self._waiters: dict[int, _Waiter] = {}
        self._closed = False
        self.confirmed = False  # a reply came back on the current stream (it is up, sessions are offered)

    def request(self, method: str, body: bytes, timeout_s: float) -> bytes:
        """Send request ``body`` of ``method`` and wait at most ``timeout_s`` for its reply's body.
        Raises :class:`SessionError` (the status the unary call would have had; ``DEADLINE_EXCEEDED``
        when nothing came back in time, ``UNAVAILABLE`` when the stream broke)."""
        session.check_deadline(method, timeout_s)
        w = _Waiter()
        with self._lock:
            if self._closed:
                raise SessionError(grpc.StatusCode.CANCELLED, "the session is closed")
            if self._call is None:
                self._start()
            seq = next(self._seq)
            self._waiters[seq] = w
            self._outgoing.put(session.envelope(seq, method, body, timeout_s))
        if not w.event.wait(timeout_s):
            with self._lock:
                still_waiting = self._waiters.pop(seq, None) is not None
            # Not there: the reader took it as the wait ended, and sets its reply (or the stream's
            # error) at once; a reply that made it is not thrown away (a quorum's answer would be
            # asked for again, and a relay that answered counted as silent).
            if still_waiting or not w.event.wait(1.0):
                raise SessionError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"no reply to {method} on the session stream within {timeout_s:g}s",
                                   unanswered=True)
        if w.error is not None:
            raise w.error
        rep = w.reply
        if rep.code != 0:
            raise SessionError(session.status_code(rep.code), rep.details)
        return rep.body

    def _start(self) -> None:
        """Open a stream (under the lock): a generator feeds it from a queue; a thread reads it."""
        out: queue.SimpleQueue = queue.SimpleQueue()

        def requests():
            while True:
                item = out.get()
                if item is None:
                    return
                yield item

        call = self._open(requests())
        self._outgoing, self._call, self.confirmed = out, call, False
        threading.Thread(target=self._read, args=(call, out), name="fthsdp-lighthouse-session",
                         daemon=True).start()

    def _read(self, call, out: queue.SimpleQueue) -> None:
        error: SessionError
        try:
            for raw in call:
                rep = parse_reply(raw)
                with self._lock:
                    w = self._waiters.pop(rep.seq, None)
                    if self._call is call:
                        self.confirmed = True
                if w is not None:
                    w.reply = rep
                    w.event.set()
            error = stream_error(RuntimeError("the lighthouse closed it"))
        except grpc.RpcError as e:
            error = stream_error(e)
        except SessionError as e:
            error = e
            call.cancel()
        with self._lock:
            if self._call is call:
                self._call, self._outgoing, self.confirmed = None, None, False
                waiters, self._waiters = self._waiters, {}
            else:
                waiters = {}
        out.put(None)  # ends the request generator
        for w in waiters.values():
            w.error = error
            w.event.set()

    @property
    def idle(self) -> bool:
        """Nothing is waiting for a reply on it (it can be closed without failing a request)."""
        with self._lock:
            return not self._waiters

    def close(self) -> None:
        """End the stream; a request still waiting on it fails at once as after a break (its caller
        sends it again elsewhere: the client left this stream), not at its deadline."""
        with self._lock:
            self._closed = True
            call, out = self._call, self._outgoing
            self._call = self._outgoing = None
            waiters, self._waiters = self._waiters, {}
        if out is not None:
            out.put(None)
        if call is not None:
            call.cancel()
        for w in waiters.values():
            w.error = SessionError(grpc.StatusCode.UNAVAILABLE, CLOSED, broken=True)
            w.event.set()
