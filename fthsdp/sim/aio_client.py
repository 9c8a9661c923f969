"""An asyncio lighthouse client for many replica leaders sharing one process.

The real protocol and the real server, with an asyncio face: the synchronous
:class:`fthsdp.control.lighthouse_client.LighthouseClient` runs a heartbeat thread per
replica, which is right for one replica per process and wrong for 512
emulated leaders in one. Semantics match it: every request reports the last
quorum this replica was a member of (a restarted lighthouse rebuilds the job
from these), an unreachable lighthouse is retried with the same capped
backoff for up to ``outage_s``, a finished job raises ``JobFinished``.

It speaks protocol version 2 (:mod:`fthsdp.control.lighthouse`): a client is
one *process* of a replica of ``num_processes``; it heartbeats as that process
and registers its own shards' endpoints with its heartbeats until the
lighthouse holds them; the leader (process 0) asks for quorums, the other
processes fetch their own view of their leader's quorum (``get_view``).

Each client owns its own channel on a local subchannel pool, so each process
of each replica has its own TCP connection to the lighthouse, as separate hosts
would: the lighthouse budgets calls per connection
(fthsdp/control/admission.py), so processes sharing one would be held back
as one. (``channel_of`` still lets clients share a channel, for a caller that
wants to save sockets and keeps under that budget.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from fthsdp.control import quorum as qm, session as sess
from fthsdp.control.channel_args import RECONNECT_ARGS
from fthsdp.control.pacing import reported_ms
from fthsdp.control.session_client import (SessionError, SessionUnsupported, beat_covered, parse_reply,
                                           RelayPath, SessionRoute, stop_stream, stream_error, CLOSED)
from fthsdp.replica.fsm import membership
from fthsdp.control.lighthouse_client import (
    HeartbeatReply,
    HeldEndpoints,
    JobFinished,
    LighthouseError,
    LighthouseUnavailable,
    ReplicaIdHeld,
    Registration,
    backoff_delays,
    endpoints_not_held,
    heartbeat_reply,
    keep_members,
    keep_neighbourhood,
    lighthouse_error,
    keep_ring_delta,
    keep_rings,
    new_request_id,
    quorum_from_proto,
    require_view,
    ring_request_flags,
)
from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as _load_stubs

pb2, pb2_grpc = _load_stubs()

__all__ = ["AioLighthouseClient", "QuorumReply", "DecodeCache"]

_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    *RECONNECT_ARGS,
]


_MEMBERS_WIRE: dict[int, tuple[tuple, bytes]] = {}


def _members_wire(q: qm.Quorum) -> bytes:
    """``last_members`` of ``q`` in wire form, built once per members tuple (a few kept)."""
    hit = _MEMBERS_WIRE.get(id(q.members))
    if hit is not None and hit[0] is q.members:
        return hit[1]
    raw = pb2.QuorumRequest(last_members=list(membership(q)[0])).SerializeToString()
    if len(_MEMBERS_WIRE) >= 8:
        _MEMBERS_WIRE.pop(next(iter(_MEMBERS_WIRE)))
    _MEMBERS_WIRE[id(q.members)] = (q.members, raw)
    return raw


_KEPT: dict[tuple[int, int], tuple[qm.Quorum, object, qm.Quorum]] = {}
_DELTA: dict[tuple[int, int], tuple[qm.Quorum, object, qm.Quorum]] = {}


def _completed(table: dict, q: qm.Quorum, basis: object, complete: Callable[[], qm.Quorum]) -> qm.Quorum:
    """``complete()``, once per (answer ``q``, ``basis`` it is completed from) for the leaders of
    one process: they hold the same decoded objects, so they keep sharing one result (completing
    an answer per leader would be O(N^2) a round, which 512 real hosts pay in parallel). Keyed by
    identity, the objects kept alive beside it; the last 16 are kept."""
    hit = table.get((id(q), id(basis)))
    if hit is not None and hit[0] is q and hit[1] is basis:
        return hit[2]
    merged = complete()
    if len(table) >= 16:
        table.pop(next(iter(table)))
    table[(id(q), id(basis))] = (q, basis, merged)
    return merged


def _kept_rings(q: qm.Quorum, held: qm.Quorum | None, members_omitted: bool = False) -> qm.Quorum:
    """:func:`keep_rings` (or :func:`keep_members` for a compact answer), once per (answer, held
    view's rings), the members of a compact answer once per (answer, held view's members): the
    leaders' views of one quorum share their members but, as ring neighbours, not their rings."""
    if held is None or not members_omitted:
        return _completed(_KEPT, q, held.rings if held is not None else (), lambda: keep_rings(q, held))
    shared = _completed(_KEPT, q, held.members, lambda: keep_members(q, held))
    if shared.rings is held.rings:
        return shared
    require_view(held, q.quorum_id, f"the lighthouse left out the members of quorum {q.quorum_id}")
    return dataclasses.replace(shared, rings=held.rings, first_shard=held.first_shard,
                               ring_neighbours=held.ring_neighbours)


def _delta_rings(q: qm.Quorum, rings_from: int, changed: tuple[str, ...], held: qm.Quorum | None) -> qm.Quorum:
    """:func:`keep_ring_delta`, once per (answer, held view)."""
    return _completed(_DELTA, q, held, lambda: keep_ring_delta(q, rings_from, changed, held))


class _EndpointsNotHeld(Exception):
    """The lighthouse does not hold the endpoints a request left out (it restarted)."""

    def __init__(self, outage_s: float) -> None:
        super().__init__(outage_s)
        self.outage_s = outage_s  # how long the refused request rode out the restart first


@dataclass(frozen=True)
class Answer:
    """A decoded quorum answer: the Quorum as sent, whether its rings were left out, whether its
    members were, whether the asker's endpoints may be left out next time, (rings_from > 0) the
    quorum its rings are a delta against with the members they list, and (neighbourhood_from >
    0) the quorum whose view holds its unchanged ring neighbourhood."""

    quorum: qm.Quorum
    lean: bool
    compact: bool
    omittable: bool
    rings_from: int = 0
    ring_members: tuple[str, ...] = ()
    neighbourhood_from: int = 0


class DecodeCache:
    """Quorum answers decoded once per distinct bytes, for the leaders of one process.

    A quorum of 512 members decoded by each of 512 leaders is 262,144 member
    decodes per round, an O(N^2) cost that 512 real hosts pay in parallel (each
    its own N) but one emulation process would pay serially. Leaders of one
    process therefore share decoded answers, keyed by the exact bytes the
    lighthouse sent (equal bytes, equal answer), and hold the same immutable
    object. Bounded: only the last few answers are kept.
    """

    def __init__(self, size: int = 8) -> None:
        self._size = size
        # The last few (answer bytes, decoded) pairs, newest first. Matched by equality
        # (a memcmp), not by hashing: hashing each leader's copy of a 1.45 MB answer cost
        # the emulator ~1 ms per leader, 0.5 s a round at 512 leaders.
        self._recent: list[tuple[bytes, Answer | int]] = []
        # Neighbour answers (Quorum.neighbourhood) differ per leader only in their last bytes,
        # the leader's ring neighbourhood appended to the part every leader shares (the
        # lighthouse's view_reply): the shared bytes and their decoded answer, so that each
        # leader decodes only its neighbourhood, not the members again.
        self._shared: list[tuple[bytes, Answer]] = []
        self.decoded = 0
        self.hits = 0

    @staticmethod
    def parse(raw: bytes) -> Answer | int:
        """The answer, or the finished step (an int) when the job finished."""
        resp = pb2.QuorumResponse.FromString(raw)
        if resp.job_finished:
            return int(resp.finished_step)
        p = resp.quorum
        return Answer(quorum_from_proto(p), p.rings_omitted, p.members_omitted, resp.endpoints_omittable,
                      p.rings_from, tuple(p.ring_members), p.neighbourhood_from)

    def decode(self, raw: bytes) -> Answer | int:
        n = len(raw)
        for known, q in self._recent:
            if len(known) == n and known == raw:
                self.hits += 1
                return q
        for shared, a in self._shared:
            if len(shared) < n and raw.startswith(shared):
                own = pb2.QuorumResponse.FromString(raw[len(shared):]).quorum
                if own.neighbourhood and not own.members:
                    near = quorum_from_proto(own)  # checks it as the real client does
                    self.hits += 1
                    return dataclasses.replace(a, quorum=dataclasses.replace(
                        a.quorum, rings=near.rings, first_shard=near.first_shard, ring_neighbours=True))
        q = self.parse(raw)
        self.decoded += 1
        if isinstance(q, Answer) and q.quorum.ring_neighbours and q.quorum.rings:
            own_raw = pb2.QuorumResponse(quorum=pb2.Quorum(neighbourhood=[
                pb2.MemberEndpoints(first_shard=q.quorum.first_shard, addresses=[r[pos] for r in q.quorum.rings])
                for pos in range(3)])).SerializeToString()
            if raw.endswith(own_raw) and len(own_raw) < n:
                self._shared.insert(0, (raw[:n - len(own_raw)], q))
                del self._shared[self._size:]
        else:
            self._recent.insert(0, (raw, q))
            del self._recent[self._size:]
        return q


class AioSession:
    """The session stream (fthsdp.control.session) from asyncio: one stream per client, its
    requests' replies matched by ``seq`` (the same protocol as the threaded
    :class:`fthsdp.control.session_client.SyncSession`). Messages go out through one writer
    task: a caller's deadline never cancels a write, because gRPC cancels the whole stream
    (every request open on it) when a write is cancelled."""

    def __init__(self, channel, relayed: bool = False) -> None:
        self.relayed = relayed  # the channel is a relay's (the client's bookkeeping: RelayPath)
        self.probe = False  # a return to the relay, not yet answered (the client's bookkeeping)
        self._open = channel.stream_stream(sess.METHOD, request_serializer=None, response_deserializer=None)
        self._seq = itertools.count(1)
        self._call = None
        self._tasks: tuple[asyncio.Task, ...] = ()
        self._outbox: asyncio.Queue | None = None
        self._waiters: dict[int, asyncio.Future] = {}
        self.confirmed = False  # a reply came back on the current stream

    def _put(self, raw: bytes) -> None:
        if self._call is None:
            self._call = self._open()
            self.confirmed = False
            self._outbox = asyncio.Queue()
            loop = asyncio.get_running_loop()
            self._tasks = (loop.create_task(self._read(self._call)),
                           loop.create_task(self._write(self._call, self._outbox)))
        self._outbox.put_nowait(raw)

    async def request(self, method: str, body: bytes, timeout_s: float) -> bytes:
        """``body``'s reply body; raises SessionError (the unary call's status)."""
        sess.check_deadline(method, timeout_s)
        seq = next(self._seq)
        fut = asyncio.get_running_loop().create_future()
        self._waiters[seq] = fut
        try:
            self._put(sess.envelope(seq, method, body, timeout_s))
            async with asyncio.timeout(timeout_s):
                rep = await fut
        except TimeoutError:
            raise SessionError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no reply to {method} on the session stream within {timeout_s:g}s",
                               unanswered=True) from None
        finally:
            self._waiters.pop(seq, None)
        if rep.code != 0:
            raise SessionError(sess.status_code(rep.code), rep.details)
        return rep.body

    async def _write(self, call, outbox: asyncio.Queue) -> None:
        try:
            while True:
                await call.write(await outbox.get())
        except grpc.aio.AioRpcError as e:
            self._broken(call, stream_error(e))
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            self._broken(call, stream_error(RuntimeError(str(e))))

    async def _read(self, call) -> None:
        error: SessionError
        try:
            while True:
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    error = stream_error(RuntimeError("the lighthouse closed it"))
                    break
                rep = parse_reply(raw)
                self.confirmed = True
                fut = self._waiters.pop(rep.seq, None)
                if fut is not None and not fut.done():
                    fut.set_result(rep)
        except grpc.aio.AioRpcError as e:
            error = stream_error(e)
        except SessionError as e:
            error = e
        except asyncio.CancelledError:
            error = SessionError(grpc.StatusCode.UNAVAILABLE, "the session stream was cancelled")
        self._broken(call, error)

    def _broken(self, call, error: SessionError) -> None:
        """``call`` ended: fail its open requests (a new stream opens with the next request)."""
        if self._call is not call:
            return
        self._call, self._outbox, self.confirmed = None, None, False
        stop_stream(call, self._tasks)
        self._tasks = ()
        waiters, self._waiters = self._waiters, {}
        for fut in waiters.values():
            if not fut.done():
                fut.set_exception(error)
                fut.exception()  # its request may be gone (cancelled) before it reads this: no warning

    @property
    def idle(self) -> bool:
        """Nothing is waiting for a reply on it (it can be closed without failing a request; as
        SyncSession.idle)."""
        return not self._waiters

    async def close(self) -> None:
        call, tasks = self._call, self._tasks
        if call is not None:
            # Its open requests go again elsewhere, as after a break (their client left this stream).
            self._broken(call, SessionError(grpc.StatusCode.UNAVAILABLE, CLOSED, broken=True))
        for t in tasks:
            t.cancel()
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing
                pass


@dataclass(frozen=True)
class QuorumReply:
    quorum: qm.Quorum
    sent_at: float  # perf_counter when the (last, successful) request was sent
    received_at: float
    outage_s: float  # time spent riding out an unreachable lighthouse


async def _closing(sessions) -> None:
    """Close the sessions a switch of path dropped (SessionRoute; a relayed one's channel stays open)."""
    for x in sessions:
        await x.close()


class AioLighthouseClient:
    """One emulated replica leader's connection to the lighthouse."""

    def __init__(self, address: str, job_id: str, replica_id: str, *, outage_s: float,
                 heartbeat_timeout_s: float, rejoin: bool = False, process_index: int = 0,
                 num_processes: int = 1, channel_of: "AioLighthouseClient | None" = None,
                 session: bool = True, relay: str = "", relay_retry_s: float = RelayPath.RETRY_S,
                 relay_silence_s: float = RelayPath.SILENCE_S, ring_form: str = "neighbours") -> None:
        if num_processes < 1 or not 0 <= process_index < num_processes:
            raise ValueError(f"process_index {process_index} must be in 0..num_processes-1 ({num_processes})")
        self.address = address
        self.job_id = job_id
        self.replica_id = replica_id
        self.outage_s = outage_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.rejoin = rejoin
        self.process_index = process_index
        self.num_processes = num_processes
        # This process's own shards' endpoints: sent with heartbeats until a reply says the
        # lighthouse holds them (the same Registration the synchronous client uses).
        self.registration = Registration()
        self.paced_s = 0.0  # HeartbeatResponse.beat_interval_ms of the last beat (0 = none)
        self.held_endpoints = HeldEndpoints()  # may the quorum requests leave the endpoints out
        # Its newest entries go with every request, as the real client's (a restarted
        # lighthouse rebuilds the job's lineage fence from them, fthsdp.control.quorum rule 6).
        self.lineage = qm.Lineage(limit=qm.LINEAGE_REPORTED)
        self._sent_endpoints: tuple[tuple[str, ...], str] = ((), "")  # what the last request spoke for
        self._omittable = False  # the last answer's endpoints_omittable
        self._owns_channel = channel_of is None
        self._channel = grpc.aio.insecure_channel(address, options=_OPTIONS) if channel_of is None \
            else channel_of._channel
        self._stub = pb2_grpc.LighthouseStub(self._channel)
        # GetQuorum with the answer left as bytes: decoded through decode_cache.
        self._get_quorum_raw = self._channel.unary_unary(
            "/fthsdp.v1.Lighthouse/GetQuorum", request_serializer=None, response_deserializer=None)
        self._heartbeat_raw = self._channel.unary_unary(
            "/fthsdp.v1.Lighthouse/Heartbeat", request_serializer=pb2.HeartbeatRequest.SerializeToString,
            response_deserializer=None)
        self._get_view_raw = self._channel.unary_unary(
            "/fthsdp.v1.Lighthouse/GetView", request_serializer=pb2.ViewRequest.SerializeToString,
            response_deserializer=None)
        # Heartbeats and quorum requests as messages of one stream (None: unary calls; also once
        # the lighthouse said it offers no sessions). A shared channel shares its owner's stream.
        # ``relay``: a relay's address carries the session (fthsdp.control.relay); the lighthouse
        # directly while it is gone (RelayPath, as the threaded client). A client sharing a
        # channel shares its owner's relay channel.
        path = RelayPath("" if not session else relay if channel_of is None else channel_of.relay_path.relay,
                         relay_retry_s, relay_silence_s)
        self._relay_channel = (None if not path.relay else channel_of._relay_channel if channel_of
                               else grpc.aio.insecure_channel(path.relay, options=_OPTIONS))
        self.route = SessionRoute(path, (
            None if not session else channel_of.session if channel_of is not None
            else AioSession(self._relay_channel, relayed=True) if self._relay_channel else AioSession(self._channel)))
        self.last_quorum: qm.Quorum | None = None
        self.asked_at = -math.inf  # when get_quorum last sent a request (perf_counter)
        self.step = 0
        self.outages: list[float] = []
        self.ring_flags = ring_request_flags(ring_form)  # how a new quorum's rings are asked for (RING_FORMS)
        self.last_reply_bytes = 0  # size of the last quorum answer or view on the wire
        self.last_request_bytes = 0  # size of the last quorum request or view request
        # Answers decoded once per distinct answer bytes, shared by the leaders of
        # one process (see DecodeCache).
        self.decode_cache: DecodeCache | None = None

    def register(self, ftar_addresses: Sequence[str], state_server_address: str, local_world_size: int) -> None:
        """This process's own shards' endpoints, sent with its heartbeats until held."""
        self.registration.give(ftar_addresses, state_server_address, local_world_size)

    def _request(self, step: int, ftar: Sequence[str], state_server: str, commit_failed: bool,
                 num_replicas: int, local_world_size: int, request_id: int) -> bytes:
        """The QuorumRequest, serialized. Its ``last_members`` (every member id of the last
        quorum, identical for all its members; sent by its first few members only, see
        :func:`fthsdp.control.quorum.sends_last_members`) is serialized once per quorum and appended:
        protobuf concatenation is a merge, so the bytes on the wire are exactly the real
        client's, without each of R leaders of one process rebuilding an R-long list."""
        last = self.last_quorum
        head = pb2.QuorumRequest(
            protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id=self.job_id, replica_id=self.replica_id,
            step=step, local_world_size=local_world_size, commit_failed=commit_failed, num_replicas=num_replicas,
            last_quorum_id=last.quorum_id if last is not None else 0,
            rejoin=self.rejoin, fresh_start=last is None and not self.rejoin,
            process_index=self.process_index, num_processes=self.num_processes, accepts_members_omitted=True,
            **self.ring_flags,
            lineage=qm.lineage_report(self.lineage), request_id=request_id,
        )
        self._sent_endpoints = self.held_endpoints.fill(head, ftar, state_server)
        return head.SerializeToString() + (
            _members_wire(last) if last is not None and qm.sends_last_members(last, self.replica_id) else b"")

    def _decode(self, raw: bytes) -> Answer | int:
        if self.decode_cache is not None:
            return self.decode_cache.decode(raw)
        return DecodeCache.parse(raw)

    async def get_quorum(self, step: int, *, ftar_addresses: Sequence[str], state_server_address: str,
                         commit_failed: bool, num_replicas: int, timeout_s: float,
                         local_world_size: int | None = None) -> QuorumReply:
        """The leader's quorum for ``step`` (its own view: its shards' rings).
        ``local_world_size``: the replica's shards over all its processes (default: this
        process's ``ftar_addresses`` times ``num_processes``)."""
        self.step = step
        self.asked_at = time.perf_counter()
        lws = len(ftar_addresses) * self.num_processes if local_world_size is None else local_world_size
        rid = new_request_id()  # the same on every send of this request (a lost answer is answered again)
        req = self._request(step, ftar_addresses, state_server_address, commit_failed, num_replicas, lws, rid)
        sent = self._sent_endpoints
        try:
            reply = await self._call(self._get_quorum_raw, req, f"get_quorum(step={step})", timeout_s, "GetQuorum")
        except _EndpointsNotHeld as e:  # the lighthouse restarted: the same request with the endpoints
            self.held_endpoints.lost()
            req = self._request(step, ftar_addresses, state_server_address, commit_failed, num_replicas, lws, rid)
            reply = await self._call(self._get_quorum_raw, req, f"get_quorum(step={step})", timeout_s, "GetQuorum")
            if e.outage_s:
                self.outages.append(e.outage_s)
                reply = dataclasses.replace(reply, outage_s=reply.outage_s + e.outage_s)
        self.held_endpoints.heard(sent, self._omittable)
        return reply

    async def get_view(self, quorum_id: int, *, timeout_s: float) -> QuorumReply:
        """This (follower) process's view of quorum ``quorum_id``, which its leader got."""
        held = self.last_quorum  # the rings may come as a delta against it (_call rebuilds them)
        req = pb2.ViewRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id=self.job_id,
                              replica_id=self.replica_id, process_index=self.process_index, quorum_id=quorum_id,
                              held_quorum_id=held.quorum_id if held is not None else 0, **self.ring_flags)
        return await self._call(self._get_view_raw, req, f"get_view(quorum {quorum_id})", timeout_s)

    async def _send(self, method, req, timeout_s: float, name: str) -> bytes:
        """One request: on the session when there is one and it carries ``name``, else unary."""
        s = await self._session_now(name) if name in sess.SESSION_METHODS else None
        if s is not None:
            body = req if isinstance(req, bytes) else req.SerializeToString()
            start = time.monotonic()
            try:
                out = await s.request(name, body, timeout_s / 2 if s.probe else timeout_s)
                await self._relay_answered(s)
                return out
            except SessionError as e:
                if isinstance(e, SessionUnsupported) and not s.probe:
                    await _closing(self.route.unsupported(s))
                else:
                    routed = self.route.failed(s, e, time.monotonic(), lambda: AioSession(self._channel))
                    await _closing(routed.close)
                    if not routed.again:
                        raise  # e.g. UNAVAILABLE from a live relay: retried as across an outage
                    return await self.session.request(name, body, max(0.001, timeout_s - (time.monotonic() - start)))
        return await method(req, timeout=timeout_s)

    @property
    def session(self) -> "AioSession | None":
        """The session its requests go on now (None: unary calls)."""
        return self.route.session

    @property
    def relay_path(self) -> RelayPath:
        return self.route.path

    @property
    def relay(self) -> str:
        """The relay its session goes through ("": the lighthouse directly)."""
        return self.relay_path.relay if self.relay_path.via_relay else ""

    async def _session_now(self, name: str) -> "AioSession | None":
        """The session a request goes on (SessionRoute.pick, the threaded client's rule)."""
        s, close = self.route.pick(name, time.monotonic(), lambda: AioSession(self._relay_channel, relayed=True))
        await _closing(close)
        return s

    async def _relay_answered(self, s: "AioSession") -> None:
        if s.relayed:
            await _closing(self.route.answered(s).close)

    async def _call(self, method, req, what: str, timeout_s: float, name: str = "") -> QuorumReply:
        self.last_request_bytes = len(req) if isinstance(req, bytes) else req.ByteSize()
        down_since: float | None = None
        delays = backoff_delays()
        paused = ""
        held_until = time.monotonic() + timeout_s
        while True:
            sent = time.perf_counter()
            try:
                raw = await self._send(method, req, timeout_s, name)
                break
            except (grpc.aio.AioRpcError, SessionError) as e:
                code = e.code()
                if endpoints_not_held(code, e.details()):
                    raise _EndpointsNotHeld(0.0 if down_since is None else time.monotonic() - down_since) from None
                where = f"lighthouse {self.address} (replica {self.replica_id}, process {self.process_index})"
                err = lighthouse_error(what, where, code, e.details() or str(e))
                if isinstance(err, ReplicaIdHeld) and name == "GetQuorum" and time.monotonic() < held_until:
                    # as the real get_quorum: a restart that came back before its old process was
                    # declared dead waits that out
                    await asyncio.sleep(0.2)
                    continue
                if not isinstance(err, LighthouseUnavailable):
                    raise err from None
            now = time.monotonic()
            down_since = now if down_since is None else down_since
            if now - down_since >= self.outage_s:
                raise LighthouseUnavailable(f"lighthouse {self.address} unreachable for {now - down_since:.1f}s",
                                            grpc.StatusCode.UNAVAILABLE, outage_s=now - down_since)
            paused = await self._pause(min(next(delays), max(0.0, down_since + self.outage_s - now)), paused)
            if paused == "connected":
                delays = backoff_delays()  # connected again: the next tries start short
        received = time.perf_counter()
        self.last_reply_bytes = len(raw)
        outage = 0.0 if down_since is None else time.monotonic() - down_since
        if outage:
            self.outages.append(outage)
        got = self._decode(raw)
        if isinstance(got, int):
            raise JobFinished(f"job {self.job_id!r} finished at step {got}", got)
        q, self._omittable = got.quorum, got.omittable
        if got.lean:
            q = _kept_rings(q, self.last_quorum, got.compact)
        elif got.rings_from:
            q = _delta_rings(q, got.rings_from, got.ring_members, self.last_quorum)
        elif got.neighbourhood_from:
            q = keep_neighbourhood(q, self.replica_id, got.neighbourhood_from, self.last_quorum)
        if self.replica_id in membership(q)[0]:
            self.lineage = self.lineage.answered_quorum(q)
            self.last_quorum = q
        return QuorumReply(q, sent, received, outage)

    async def _pause(self, delay_s: float, last: str) -> str:
        """Between two tries across an outage (the threaded client's rule, LighthouseClient._pause)."""
        if self.relay_path.via_relay:
            await asyncio.sleep(delay_s)
            return "up"
        if self._channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY:
            if last == "down":
                return "connected"
            await asyncio.sleep(delay_s)
            return "up"
        try:
            await asyncio.wait_for(self._channel.channel_ready(), delay_s)
            return "connected"
        except TimeoutError:
            return "down"

    async def connect(self, timeout_s: float) -> bool:
        """Wait until the channel is connected (a replica's start-up); False if it is not within
        ``timeout_s``. (Not its relay's: a relay that is not there is left by RelayPath.)"""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def heartbeat(self, step: int, *, skip_within_s: float = 0.0, allreduce: tuple[int, int] | None = None,
                        own_interval_s: float = 0.0) -> HeartbeatReply | None:
        """One heartbeat and its reply. A leader on a session that sent a quorum request less than
        ``skip_within_s`` ago skips the beat and returns None (the lighthouse counts the request
        as one; the synchronous client's heartbeat thread does the same). ``allreduce``: the
        (quorum id, step) whose all-reduce the replica is in, reported as its phase (the reply
        then names the replicas asking for a quorum at or before that step). ``own_interval_s``:
        the process's own beat interval, so that the beat says when it is paced slower."""
        path = self.relay_path
        if path.watching:  # away from a relay left by its broken streams: is it back? (RelayPath.channel_state)
            path.channel_state(self._relay_channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY,
                               time.monotonic())
        if beat_covered(self.session, self.process_index, self.registration.endpoints is not None,
                        time.perf_counter() - self.asked_at, skip_within_s, path.return_due(time.monotonic())):
            return None
        last = self.last_quorum
        req = pb2.HeartbeatRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id=self.job_id,
                                   replica_id=self.replica_id, step=step,
                                   last_quorum_id=last.quorum_id if last is not None else 0,
                                   process_index=self.process_index, num_processes=self.num_processes,
                                   beat_interval_ms=reported_ms(own_interval_s, self.paced_s) if own_interval_s else 0)
        if allreduce is not None:
            req.phase.phase, req.phase.quorum_id, req.phase.step = pb2.PHASE_ALLREDUCE, *allreduce
        sent = self.registration.fill(req)
        try:
            raw = await self._send(self._heartbeat_raw, req, self.heartbeat_timeout_s, "Heartbeat")
            resp = pb2.HeartbeatResponse.FromString(raw)
        except (grpc.aio.AioRpcError, SessionError) as e:
            raise LighthouseError(f"heartbeat: {e.code()}: {e.details()}", e.code()) from None
        self.registration.heard(sent, resp.addresses_registered)
        reply = heartbeat_reply(resp, allreduce)
        self.paced_s = reply.beat_interval_s  # the lighthouse's pace (fthsdp.control.pacing)
        return reply

    async def leave(self, step: int, *, finished: bool, timeout_s: float = 5.0) -> bool:
        req = pb2.LeaveRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id=self.job_id,
                               replica_id=self.replica_id, step=step, finished=finished)
        try:
            await self._stub.Leave(req, timeout=timeout_s)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def close(self) -> None:
        if self._owns_channel:
            await _closing(self.route.sessions())
            if self._relay_channel is not None:
                await self._relay_channel.close()
            await self._channel.close()
