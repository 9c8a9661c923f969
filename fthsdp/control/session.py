"""The session stream: a process's heartbeats and quorum requests on one long-lived stream.

**Why.** The lighthouse is one Python event loop. A unary gRPC call costs it
a new call object, several callbacks into gRPC's Cython layer and asyncio
turns around the handler; measured at 512 replica leaders x 196 ranks, the
lighthouse spent ~0.39 s of CPU per round on 512 quorum calls and 512
heartbeats, and the last leader's request waited ~210 ms behind the others
(experiments/scale.py, its breakdown). A message on an open bidirectional
stream costs one read and one write: a bare grpc.aio server answered a round
of 512 clients in 25-38 ms over streams against 64-84 ms over unary calls.
So each process may open one session (``LighthouseSession.Open``) and send
its ``GetQuorum`` and ``Heartbeat`` requests on it as messages; each decision
is pushed once to every waiting session.

**Nothing else changes.** Every message is checked exactly as the unary call
would be, in the same order (the connection's budget, the body's shape, the
credential over the same method and bytes, the job's budget; then the
lighthouse's own checks), and answered with the code and reason the unary
call would have ended with (:class:`~fthsdp.proto` ``SessionReply``). A
request over its connection's budget holds the stream (it is not read on
until the budget allows), which is the same back-pressure. Liveness still
comes from heartbeat messages only: a SIGSTOPped process keeps its TCP
connection and its stream open, and is declared dead by its silence as
before; a killed one's stream ends, which withdraws its open quorum request
as a cancelled call does. A message that cannot be read gets a clear error
(``INVALID_ARGUMENT``, with ``seq`` 0 when even its envelope is unreadable) and
the session goes on; nothing a client sends on it can stop the lighthouse.

**Relays.** ``OpenRelay`` is the same service for a relay
(:mod:`fthsdp.control.relay`) that carries many processes' sessions: its messages
arrive in :class:`RelayBatch` es and its replies leave in them (one write for
whatever queued), each message is checked exactly as above, the stream's budget
is charged once per batch (a refused message costs it what it costs any
connection, and a batch with :data:`MAX_REFUSED_PER_BATCH` refusals is not read
further), and ``withdrawn`` seqs are withdrawn after the batch's messages, as if
their processes' own streams had ended.

The envelope checks are pure functions (:func:`envelope_problem`,
:func:`envelope`, :func:`reply`); :func:`generic_handler` is the transport.
A lighthouse without this service answers ``UNIMPLEMENTED``, and clients
fall back to unary calls (:mod:`fthsdp.control.session_client`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time

import grpc

from fthsdp.control import guard
from fthsdp.proto import lighthouse as _load_stubs
from fthsdp.timeouts import LIGHTHOUSE_MAX_HOLD_S

pb2, _ = _load_stubs()
log = logging.getLogger("fthsdp.control.lighthouse")

__all__ = ["SERVICE", "METHOD", "RELAY_METHOD", "SESSION_METHODS", "MAX_OPEN", "MAX_OPEN_RELAYED", "MAX_BATCH",
           "MAX_BATCH_BYTES", "MAX_TIMEOUT_S", "UNREADABLE", "Stream", "check_deadline", "envelope", "reply",
           "envelope_problem", "batch", "take_batch",
           "batch_problem", "generic_handler",
           "status_code"]

SERVICE = "fthsdp.v1.LighthouseSession"
METHOD = f"/{SERVICE}/Open"
RELAY_METHOD = f"/{SERVICE}/OpenRelay"  # many processes' sessions on one stream (fthsdp.control.relay)
# The calls a session carries (the others, rare, stay unary: Leave, GetView, Status).
SESSION_METHODS = {"GetQuorum": "QuorumRequest", "Heartbeat": "HeartbeatRequest"}
MAX_OPEN = 64  # requests one session may have unanswered; more are refused (a process has at most two)
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a message's deadline beyond a week is a bug (Timeouts.MAX_S)
MAX_OUTBOX = 256  # replies waiting for the client to read them before the session stops reading
# A relay's stream carries many processes: one open quorum request each (a few more while they retry).
MAX_OPEN_RELAYED = 65_536
MAX_BATCH = 4096  # messages in one RelayBatch; a relay sends what queued while its last write went out
# Bytes in one RelayBatch (a message larger than this goes alone). Both ways are bounded: a round's
# first answers carry every ring (1.4 MB each at 512 leaders x 196 ranks), and 256 of them in one
# batch (372 MB) passed what a client accepts and broke the relay's stream; requests stay far under
# the lighthouse's 4 MiB per message (guard.Limits.max_request_bytes).
MAX_BATCH_BYTES = 1024 * 1024
# Refused messages (malformed, unauthenticated) one batch may hold before the rest of it goes unread: each
# costs its connection the usual surcharge, and this bounds what one batch of garbage costs the lighthouse.
MAX_REFUSED_PER_BATCH = 8

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The gRPC status code of a reply's ``code`` (UNKNOWN for a number gRPC does not define)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


def check_deadline(method: str, timeout_s: float) -> None:
    """A client's own check of a request's deadline, before it waits on it: ``inf`` or a month
    would raise in the wait's timer, or be refused by the lighthouse after it was sent."""
    if not (math.isfinite(timeout_s) and 0.0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"{method}: timeout_s is {timeout_s!r}; give a finite number of seconds in "
                         f"(0, {MAX_TIMEOUT_S:g}] (the lighthouse refuses other deadlines)")


def envelope(seq: int, method: str, body: bytes, timeout_s: float = 0.0) -> bytes:
    """A client's message: ``body`` is the serialized request a unary call would send (signed:
    its credential is its last field, fthsdp.control.auth)."""
    return pb2.SessionRequest(seq=seq, method=method, body=body, timeout_s=timeout_s).SerializeToString()


def reply(seq: int, body: bytes = b"", code: grpc.StatusCode = grpc.StatusCode.OK, details: str = "") -> bytes:
    """The lighthouse's answer to message ``seq``: ``body`` when OK, else ``code`` and why."""
    return pb2.SessionReply(seq=seq, code=code.value[0], details=details, body=body).SerializeToString()


def batch(messages, withdrawn=()) -> bytes:
    """A relay's :class:`RelayBatch`: serialized session messages (and, upstream, withdrawn seqs)."""
    return pb2.RelayBatch(messages=messages, withdrawn=withdrawn).SerializeToString()


def take_batch(queue: collections.deque, max_messages: int = MAX_BATCH, max_bytes: int = MAX_BATCH_BYTES) -> list:
    """The next batch from the front of ``queue``: at least one message, then as many more as fit
    in ``max_messages`` and ``max_bytes``."""
    out = [queue.popleft()]
    size = len(out[0])
    while queue and len(out) < max_messages and size + len(queue[0]) <= max_bytes:
        size += len(queue[0])
        out.append(queue.popleft())
    return out


def batch_problem(msg) -> str | None:
    """What is wrong with a parsed ``RelayBatch`` as a whole, or None."""
    n = len(msg.messages) + len(msg.withdrawn)
    if n == 0:
        return "the relay batch is empty: send at least one message or withdrawn seq"
    if len(msg.messages) > MAX_BATCH or len(msg.withdrawn) > MAX_OPEN_RELAYED:
        return (f"the relay batch holds {len(msg.messages)} messages and {len(msg.withdrawn)} withdrawn seqs (at "
                f"most {MAX_BATCH} and {MAX_OPEN_RELAYED}): send what is queued in several batches")
    return None


UNREADABLE = ("a session message is not a valid SessionRequest protobuf message: send fthsdp's lighthouse "
              "protocol (fthsdp/proto/lighthouse.proto)")


def envelope_problem(msg) -> str | None:
    """What is wrong with a parsed ``SessionRequest`` around its body, or None."""
    if msg.seq == 0:
        return "seq is 0: number each message of a session from 1 (its reply carries the same seq)"
    if msg.method not in SESSION_METHODS:
        return (f"method {msg.method[:64]!r} is not carried on a session: send one of "
                f"{sorted(SESSION_METHODS)} here, and the other calls as unary calls")
    if not (math.isfinite(msg.timeout_s) and 0.0 <= msg.timeout_s <= MAX_TIMEOUT_S):
        return f"timeout_s is {msg.timeout_s!r}: it must be a number of seconds in [0, {MAX_TIMEOUT_S:g}] (0 = none)"
    return None


class Stream:
    """One open stream: its unanswered quorum requests and the replies waiting to be written."""

    def __init__(self, context, peer: str, relayed: bool = False) -> None:
        self.context = context
        self.peer = peer
        # A relay's stream (OpenRelay): batches both ways, many processes' requests open at once.
        self.relayed = relayed
        self.max_open = MAX_OPEN_RELAYED if relayed else MAX_OPEN
        # Whose budget its messages are charged to: a relay stream's is its own (per batch).
        self.budget = f"{peer} (relay)" if relayed else peer
        self.outbox: collections.deque[bytes] = collections.deque()
        self.wake = asyncio.Event()  # the writer has something to write (or the session ends)
        self.drained = asyncio.Event()
        self.drained.set()
        self.closed = False
        # seq -> (job, pending entry, deadline timer) of each open quorum request
        self.open: dict[int, tuple] = {}
        self.charged = 0  # refusals of the current batch charged to the connection (relayed)

    def send(self, raw: bytes) -> None:
        if self.closed:
            return
        self.outbox.append(raw)
        if len(self.outbox) >= MAX_OUTBOX:
            self.drained.clear()
        self.wake.set()

    async def incoming(self):
        """The client's messages as they come, until it half-closes; a client that does not read
        its replies (MAX_OUTBOX waiting) is not read on until it does."""
        while True:
            if not self.drained.is_set():
                await self.drained.wait()
            raw = await self.context.read()
            if raw is grpc.aio.EOF:
                return
            yield raw

    async def write(self, raw: bytes) -> None:
        """One write to the stream (fthsdp.sim.lighthouse_trace marks when each completed)."""
        await self.context.write(raw)

    async def writer(self) -> None:
        """Writes the replies in order; the only coroutine that writes to the stream."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.outbox:  # a relay's: what queued in as few batches as fit, one write for many
                await self.write(batch(take_batch(self.outbox)) if self.relayed else self.outbox.popleft())
            self.drained.set()
            if self.closed:
                return


def generic_handler(lighthouse, gate: guard.CallGate) -> grpc.GenericRpcHandler:
    """The ``LighthouseSession`` service of ``lighthouse`` (a :class:`fthsdp.control.lighthouse.Lighthouse`):
    each message passes the same :class:`fthsdp.control.guard.CallGate` as a unary call, then is
    handed to the lighthouse's ``accept_quorum_request`` / ``accept_heartbeat``."""
    from fthsdp.control.guard import Refused
    from fthsdp.control.lighthouse import answer_wait_s  # the servicer's module imports this one

    stats = lighthouse.stats
    parsers = {m: getattr(pb2, t).FromString for m, t in SESSION_METHODS.items()}

    def refused(s: Stream, seq: int, code: grpc.StatusCode, reason: str, charge: bool = True) -> None:
        gate.count(code)
        if charge:
            gate.charge(s.budget)
            s.charged += 1
        s.send(reply(seq, code=code, details=reason))

    def answered(s: Stream, seq: int, request, fut: asyncio.Future) -> None:
        """The decision completed ``fut``: push the answer (or the refusal) to the session."""
        item = s.open.pop(seq, None)
        if item is None or s.closed:
            return
        job, entry, timer = item
        if timer is not None:
            timer.cancel()
        lighthouse.withdraw(job, entry)
        if fut.cancelled():
            return
        e = fut.exception()
        if e is not None:
            err = lighthouse.quorum_error(request, e)
            s.send(reply(seq, code=err.code, details=err.reason))
            return
        try:
            s.send(reply(seq, lighthouse.quorum_answer(job, request, fut.result())))
        except Exception as e:  # noqa: BLE001 - one bad answer must not end the others' session
            log.exception("session %s: answering quorum request %d failed", s.peer, seq)
            s.send(reply(seq, code=grpc.StatusCode.INTERNAL, details=f"the lighthouse failed to answer: {e}"))

    def drop(s: Stream, seq: int):
        """Open quorum request ``seq`` waits no more (its timer stopped, its entry withdrawn, its
        future cancelled); returns its (job, entry, timer), or None if it was not open."""
        item = s.open.pop(seq, None)
        if item is None:
            return None
        job, entry, timer = item
        if timer is not None:
            timer.cancel()
        lighthouse.withdraw(job, entry)
        if not entry.future.done():
            entry.future.cancel()
        return item

    def expired(s: Stream, seq: int) -> None:
        item = drop(s, seq)
        if item is not None:
            s.send(reply(seq, code=grpc.StatusCode.DEADLINE_EXCEEDED, details=lighthouse.no_quorum_reason(item[0])))

    async def message(s: Stream, raw: bytes) -> None:
        """One message, checked in the unary call's order; its reply goes to the outbox (a relay's
        stream: its budget was charged once for the whole batch, in ``relay_batch``)."""
        if not s.relayed:
            refusal = await gate.connection(s.peer, LIGHTHOUSE_MAX_HOLD_S)
            if refusal is not None:
                msg = _parse_envelope(raw)
                return refused(s, msg.seq if msg is not None else 0, refusal.code, refusal.reason, False)
        msg = _parse_envelope(raw)
        if msg is None:
            return refused(s, 0, guard.INVALID, UNREADABLE)
        seq = msg.seq
        err = envelope_problem(msg)
        if err:
            return refused(s, seq, guard.INVALID, err)
        name = msg.method
        try:
            req = parsers[name](msg.body)
        except Exception as e:  # noqa: BLE001 - any garbage from the network
            return refused(s, seq, guard.INVALID, (
                f"the {name} body of session message {seq} is not a valid {SESSION_METHODS[name]} protobuf "
                f"message ({type(e).__name__}: {str(e)[:200]}): send fthsdp's lighthouse protocol"))
        # The credential is the body's last field, as in a unary call (the gate charges its refusals).
        refusal = await gate.request(name, req, msg.body, s.budget, lambda: LIGHTHOUSE_MAX_HOLD_S)
        if refusal is not None:
            if refusal.code != guard.EXHAUSTED:
                s.charged += 1  # the gate charged its connection for it
            return refused(s, seq, refusal.code, refusal.reason, False)
        if s.closed:
            return
        now = time.monotonic()
        try:
            if name == "Heartbeat":
                s.send(reply(seq, lighthouse.accept_heartbeat(req, s.peer, now, relayed=s.relayed)))
                return
            if seq in s.open or len(s.open) >= s.max_open:
                return refused(s, seq, guard.INVALID if seq in s.open else guard.EXHAUSTED, (
                    f"quorum request {seq} of this session is already open: number each message anew"
                    if seq in s.open else
                    f"this session has {len(s.open)} quorum requests unanswered (at most {s.max_open}): wait for "
                    "their answers"))
            got = lighthouse.accept_quorum_request(req, s.peer, now, relayed=s.relayed)
        except Refused as e:
            return refused(s, seq, e.code, e.reason, False)
        except Exception as e:  # noqa: BLE001 - a fault of the lighthouse: answered under this message's seq
            # (answered under seq 0, it reached no waiter: the request waited out its deadline, and on a
            # relay's stream the rest of the batch, other processes' heartbeats too, was never read)
            log.exception("session %s: %s message %d failed", s.peer, name, seq)
            s.send(reply(seq, code=grpc.StatusCode.INTERNAL,
                         details=f"the lighthouse failed on this {name}: {type(e).__name__}: {str(e)[:300]}"))
            return
        if isinstance(got, bytes):
            s.send(reply(seq, got))
            return
        job, entry = got
        timer = None
        if msg.timeout_s > 0:
            timer = asyncio.get_running_loop().call_later(answer_wait_s(msg.timeout_s), expired, s, seq)
        s.open[seq] = (job, entry, timer)
        entry.future.add_done_callback(lambda fut, s=s, seq=seq, req=req: answered(s, seq, req, fut))

    def refuse_each(s: Stream, messages, code: grpc.StatusCode, reason: str) -> None:
        """Every one of a batch's ``messages`` refused unread but for its seq (not charged again)."""
        for inner in messages:
            env = _parse_envelope(inner)
            refused(s, env.seq if env is not None else 0, code, reason, False)

    async def relay_batch(s: Stream, raw: bytes) -> None:
        """A relay's batch: the relay stream's budget once, then each message as on its own session."""
        try:
            msg = pb2.RelayBatch.FromString(raw)
        except Exception:  # noqa: BLE001 - any garbage from the network
            msg = None
        refusal = await gate.connection(s.budget, LIGHTHOUSE_MAX_HOLD_S, relay=True)
        if msg is None:
            return refused(s, 0, guard.INVALID, (
                "a relay message is not a valid RelayBatch protobuf message: send fthsdp's lighthouse protocol "
                "(fthsdp/proto/lighthouse.proto)"), refusal is None)
        try:
            if refusal is not None:  # each message gets the refusal, so that its client hears it at once
                return refuse_each(s, msg.messages[:MAX_BATCH], refusal.code, refusal.reason)
            err = batch_problem(msg)
            if err:
                return refused(s, 0, guard.INVALID, err)
            stats["relay_batches"] += 1
            s.charged = 0
            for i, inner in enumerate(msg.messages):
                if s.charged >= MAX_REFUSED_PER_BATCH:  # garbage: the rest of the batch goes unchecked
                    refuse_each(s, msg.messages[i:], guard.EXHAUSTED, (
                        f"{s.charged} messages of this relay batch were refused (malformed or unauthenticated): "
                        f"the rest of it was not read; fix what the relay's clients send"))
                    break
                stats["session_messages"] += 1
                stats["relayed_messages"] += 1
                try:
                    await message(s, inner)
                except Exception:  # noqa: BLE001 - one message's fault must not cost the rest of the batch
                    log.exception("relay stream %s: message %d of a batch failed", s.peer, i)
        finally:
            # After the messages: a client that sent a request and went away before the batch left
            # has both in it, and its request must not stay open. No reply: nobody waits for one (a
            # seq answered already, its answer crossing the relay's notice, is no longer open).
            # Whatever became of the messages (refused by the budget, a batch too large, a failure):
            # the relay sends a withdrawal once, and a request left open would count its replica as
            # live and keep its id from a restarted process until the request's own deadline.
            for seq in msg.withdrawn[:MAX_OPEN_RELAYED]:
                drop(s, seq)

    async def serve(relayed: bool, context: grpc.aio.ServicerContext) -> None:
        s = Stream(context, context.peer() or "", relayed)
        stats["sessions_opened"] += 1
        open_now = "relay_streams_open" if relayed else "sessions_open"
        stats[open_now] += 1
        writer = asyncio.get_running_loop().create_task(s.writer())
        try:
            async for raw in s.incoming():
                try:
                    if relayed:
                        await relay_batch(s, raw)
                    else:
                        stats["session_messages"] += 1
                        await message(s, raw)
                except Exception as e:  # noqa: BLE001 - a bug here must not end the lighthouse
                    log.exception("session %s: a message failed", s.peer)
                    s.send(reply(0, code=grpc.StatusCode.INTERNAL, details=f"the lighthouse failed: {e}"))
        finally:
            stats[open_now] -= 1
            s.closed = True
            for seq in list(s.open):  # a stream that ends withdraws its requests
                drop(s, seq)
            s.wake.set()
            try:
                await asyncio.wait_for(writer, 1.0)  # what was answered before the client half-closed
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001 - it is gone
                writer.cancel()

    async def open_session(request_iterator, context: grpc.aio.ServicerContext) -> None:
        await serve(False, context)

    async def open_relay(request_iterator, context: grpc.aio.ServicerContext) -> None:
        await serve(True, context)

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Open": grpc.stream_stream_rpc_method_handler(open_session, request_deserializer=None,
                                                      response_serializer=None),
        "OpenRelay": grpc.stream_stream_rpc_method_handler(open_relay, request_deserializer=None,
                                                           response_serializer=None)})


def _parse_envelope(raw: bytes):
    try:
        return pb2.SessionRequest.FromString(raw)
    except Exception:  # noqa: BLE001 - any garbage from the network
        return None
