"""The relay: many processes' session streams carried to the lighthouse on one.

**Why.** The lighthouse is one Python event loop, and at hundreds of replica
leaders its cost is per message, not per decision: each quorum request and
heartbeat is one gRPC read on its process's stream and each answer one write
(README, "The session stream": at 512 leaders x 196 ranks the lighthouse spent
~110-240 ms of CPU a round, a third to a half of it in gRPC and asyncio
around the messages). A relay takes the sessions of a group of processes (a
rack, a block of replicas) and forwards their messages to the lighthouse as
batches on one stream (``LighthouseSession.OpenRelay``, :class:`RelayBatch`):
whatever queued while its last write went out leaves in the next one, and the
lighthouse answers in batches too. Nothing waits to fill a batch. Measured at
512 leaders x 196 ranks with 2 relays (experiments/scale.py --relays): 6.7
requests a batch up, 8.8 answers down, and the lighthouse's CPU a round fell
from 142 to 64 ms (README, "The relay tier"; the relays' own CPU is spent on
their hosts).

**What it does not change.** A process talks to a relay exactly as to the
lighthouse (``LighthouseSession.Open``; the relay is a drop-in address for the
session stream only, unary calls still go to the lighthouse). The relay opens
nothing: it renumbers each message's ``seq`` (unique on its one upstream
stream) and passes the very bytes on, so the lighthouse checks every message
as it would on the process's own stream, credential included; the relay holds
no secret and cannot forge or alter a request (the credential signs the
request's body, not the envelope's ``seq``), only drop or delay it, as any
network can. Liveness still comes from each process's own heartbeats, so a
stopped process is still found by its silence. A process whose stream to the
relay ends has its open quorum requests *withdrawn* at the lighthouse (the
batch's ``withdrawn`` seqs), as if its own stream to the lighthouse had ended.

**Failures.** When the relay's stream to the lighthouse ends (the lighthouse
restarted or is unreachable) every open request is answered ``UNAVAILABLE``
with the reason, which clients ride out and retry exactly as a lighthouse
outage; the next message opens a new upstream stream. A relay that dies ends
its clients' streams, and a stopped one answers nothing; after a few such
failures in a row its clients speak to the lighthouse directly, and try the
relay again after a while (:class:`fthsdp.control.session_client.RelayPath`;
``fthsdp run`` restarts a dead relay on its port), so a relay is never a single
point of failure, only of fan-in. A relay is not nested behind another relay.

The seq renumbering is :func:`renumbered` (pure); :class:`Relay` is the
transport; ``fthsdp relay`` serves one.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import logging
import sys
import time
from dataclasses import dataclass

import grpc

from fthsdp.addresses import split_host_port
from fthsdp.control import session as sess
from fthsdp.control.admission import Bucket
from fthsdp.control.channel_args import NO_REUSEPORT, RECONNECT_ARGS
from fthsdp.control.guard import Limits
from fthsdp.control.server_thread import ServerThread
from fthsdp.control.session_client import stop_stream
from fthsdp.control.wire import varint
from fthsdp.proto import lighthouse as _load_stubs

pb2, _ = _load_stubs()
log = logging.getLogger("fthsdp.control.relay")
MESSAGE_MARGIN = 64 * 1024  # a batch's framing around one client's message, with room to spare

__all__ = ["RefusalHold", "RelayConfig", "Relay", "RelayThread", "renumbered", "relay_index", "block_first", "relay_of",
           "cli"]

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),  # a batch of the largest quorum answers
    *RECONNECT_ARGS,
]


def renumbered(raw: bytes, seq: int) -> bytes:
    """``raw`` (a serialized ``SessionRequest`` or ``SessionReply``) with its ``seq`` (field 1)
    set to ``seq``, without parsing or re-serializing its body: protobuf reads the last value of
    a scalar field that occurs twice, so appending the field is setting it."""
    if seq <= 0:
        raise ValueError(f"seq {seq}: a session's seqs are numbered from 1")
    return raw + b"\x08" + varint(seq)


def relay_index(relays: int, replica: int, replicas: int) -> int:
    """Which of ``relays`` relays carries replica ``replica`` of ``replicas``: contiguous blocks,
    so that a relay serves neighbouring replicas (launched together, often one rack). A replica
    numbered past ``replicas`` (a launcher's own numbering) wraps around: any relay serves any
    replica, the blocks only spread the load."""
    if relays < 1:
        raise ValueError(f"relays={relays}: a block needs a relay")
    replicas = max(replicas, 1)
    return (replica % replicas) * relays // replicas


def block_first(index: int, relays: int, replicas: int) -> int:
    """The lowest-numbered replica that relay ``index`` carries (its block's first): where
    ``launch.relay_placement=replicas`` puts the relay."""
    if not 0 <= index < relays <= max(replicas, 1):
        raise ValueError(f"relay {index} of {relays} for {replicas} replica(s): no such block")
    return -(-index * max(replicas, 1) // relays)  # the smallest r with r * relays // replicas >= index


def relay_of(relays: tuple[str, ...], replica: int, replicas: int) -> str:
    """The address in ``relays`` that carries replica ``replica`` of ``replicas`` ("" = none), by
    :func:`relay_index`."""
    return relays[relay_index(len(relays), replica, replicas)] if relays else ""


class RefusalHold:
    """The relay's hold on one client that the lighthouse keeps refusing for what its messages
    carry (``INVALID_ARGUMENT``: malformed; ``UNAUTHENTICATED``: a wrong or missing credential).

    Why: the lighthouse charges each such refusal to the relay's one stream, at the price of
    ``FairnessLimits.failure_cost`` calls of a connection scaled to the relay's rate (~1,000 of its
    5,000 batches/s), so one misconfigured process beating at 10 Hz would put the whole block's
    stream in debt and every other process behind the relay would have its beats held back or
    refused, and be declared dead. After ``BURST`` such refusals the relay answers that client's
    messages itself, with the lighthouse's last refusal (the same code, so the client reacts as it
    would to the lighthouse), and lets one through every ``1 / PER_S`` s to see whether it was
    fixed; a message the lighthouse accepts lifts the hold at once. Plain data: the relay feeds it
    each reply's code and asks it before forwarding."""

    BURST = 3
    PER_S = 0.2
    CODES = (grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.UNAUTHENTICATED.value[0])

    def __init__(self) -> None:
        self.bucket = Bucket(rate=self.PER_S, burst=self.BURST, now=0.0)  # only refusals take tokens
        self.refusals = 0  # in a row, since the last accepted message
        self.last: tuple[int, str] = (0, "")  # the lighthouse's last refusal: code, details

    def reply(self, now: float, code: int, details: str) -> None:
        """The lighthouse answered one of this client's messages with ``code``."""
        if code == 0:
            self.bucket.tokens, self.refusals = self.bucket.burst, 0
        elif code in self.CODES:
            self.bucket.charge(now, 1.0, max_debt=1.0)  # held at most one let-through interval past refill
            self.refusals += 1
            self.last = (code, details)

    def holds(self, now: float) -> bool:
        """Whether the client's next message is answered by the relay instead of forwarded."""
        return self.bucket.wait_s(now) > 0.0

    def answer(self) -> tuple[grpc.StatusCode, str]:
        code, details = self.last
        return sess.status_code(code), (
            f"{details} [repeated by the relay, which holds back this process's messages: the lighthouse "
            f"refused {self.refusals} in a row for what they carry, and each refusal costs the budget of "
            f"every process behind the relay; it lets one through every {1 / self.PER_S:g} s to see whether "
            f"this was fixed]")


@dataclass(frozen=True)
class RelayConfig:
    """Where the relay listens and which lighthouse it carries its clients' sessions to."""

    lighthouse: str  # HOST:PORT of the lighthouse
    bind: str = "127.0.0.1:0"  # where its clients reach it (port 0: any free port)
    tls_cert_file: str = ""  # PEM chain and key: serve TLS to the clients
    tls_key_file: str = ""
    lighthouse_tls_ca: str = ""  # PEM CA the lighthouse's certificate is checked against (TLS upstream)
    max_batch: int = sess.MAX_BATCH  # messages in one batch to the lighthouse
    # The lighthouse's own message limit (guard.Limits.max_request_bytes): a client's message must
    # fit in a batch under it, so a larger one is refused here, on its own client's stream.
    lighthouse_max_request_bytes: int = Limits().max_request_bytes

    def __post_init__(self) -> None:
        for name in ("lighthouse", "bind"):
            try:
                split_host_port(getattr(self, name), allow_zero_port=name == "bind")
            except ValueError as e:
                raise ValueError(f"relay {name} {getattr(self, name)!r}: {e}") from None
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("TLS needs both a certificate file and its key file (--tls-cert, --tls-key)")
        if not 1 <= self.max_batch <= sess.MAX_BATCH:
            raise ValueError(f"max_batch {self.max_batch}: must be in 1..{sess.MAX_BATCH} (the lighthouse's limit)")
        if self.lighthouse_max_request_bytes < 2 * MESSAGE_MARGIN:
            raise ValueError(f"lighthouse_max_request_bytes {self.lighthouse_max_request_bytes}: give the lighthouse's "
                             f"limit (guard.Limits.max_request_bytes), at least {2 * MESSAGE_MARGIN} bytes")


class Relay:
    """One relay: a gRPC server of ``LighthouseSession.Open`` for its clients, and one
    ``OpenRelay`` stream to the lighthouse (opened with the first message, reopened after it
    ends). All of it runs on one asyncio event loop."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._channel = None
        self._open_upstream = None
        self._call = None  # the current upstream stream
        self._tasks: tuple[asyncio.Task, ...] = ()
        # upstream seq -> message not yet sent upstream, in arrival order (a client that goes away
        # takes its unsent messages with it: sent late, a quorum request would supersede the one
        # its process sent again elsewhere)
        self._queue: dict[int, bytes] = {}
        self._withdrawn: list[int] = []  # upstream seqs to withdraw (their client went away)
        self._wake: asyncio.Event | None = None
        self._seq = itertools.count(1)
        # upstream seq -> (the client's stream, the client's own seq) of every message not yet answered
        self._routes: dict[int, tuple[sess.Stream, int]] = {}
        self.stats = {"clients": 0, "messages_up": 0, "batches_up": 0, "replies_down": 0, "batches_down": 0,
                      "withdrawn": 0, "upstream_streams": 0, "upstream_breaks": 0, "held_back": 0}

    @property
    def address(self) -> str:
        return f"{self.config.bind.rpartition(':')[0]}:{self.port}"

    async def start(self) -> int:
        """Bind and serve; returns the bound port."""
        c = self.config
        if c.lighthouse_tls_ca:
            with open(c.lighthouse_tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self._channel = grpc.aio.secure_channel(c.lighthouse, creds, options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(c.lighthouse, options=_CHANNEL_OPTIONS)
        self._open_upstream = self._channel.stream_stream(sess.RELAY_METHOD, request_serializer=None,
                                                          response_deserializer=None)
        self._wake = asyncio.Event()
        # A client's message must fit the lighthouse's limit inside a batch: a larger one would break
        # the relay's one stream (every client's), so it breaks only its own client's stream here.
        limit = c.lighthouse_max_request_bytes - MESSAGE_MARGIN
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit), NO_REUSEPORT])
        handler = grpc.stream_stream_rpc_method_handler(self._serve, request_deserializer=None,
                                                        response_serializer=None)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(sess.SERVICE, {"Open": handler}),))
        try:
            if c.tls_cert_file:
                with open(c.tls_key_file, "rb") as k, open(c.tls_cert_file, "rb") as crt:
                    self.port = self._server.add_secure_port(c.bind, grpc.ssl_server_credentials([(k.read(), crt.read())]))
            else:
                self.port = self._server.add_insecure_port(c.bind)
        except RuntimeError as e:
            raise OSError(f"relay cannot bind {c.bind}: {e} (is the port in use?)") from e
        if self.port == 0:
            raise OSError(f"relay cannot bind {c.bind} (is the port in use?)")
        await self._server.start()
        log.info("relay on %s carries sessions to lighthouse %s", self.address, c.lighthouse)
        return self.port

    async def stop(self, grace_s: float = 0.2) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._call is not None:
            self._broken(self._call, "the relay is stopping")
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # -- the clients' side ------------------------------------------------------------------

    async def _serve(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        """One client's session: each message renumbered and queued upstream."""
        c = sess.Stream(context, context.peer() or "")
        c.hold = RefusalHold()  # type: ignore[attr-defined] - the relay's own bookkeeping of this client
        self.stats["clients"] += 1
        writer = asyncio.get_running_loop().create_task(c.writer())
        half_closed = False
        try:
            async for raw in c.incoming():
                self._forward(c, raw)
            half_closed = True
        finally:
            try:
                # A client that goes away withdraws its open quorum requests, as on its own stream.
                self._withdraw(c, [up for up, (_, quorum) in c.open.items() if quorum])
                if half_closed and c.open:
                    # It only stopped sending: its heartbeats' answers are on their way (the lighthouse
                    # itself answers those before it reads on), so they are still delivered.
                    deadline = asyncio.get_running_loop().time() + 1.0
                    while c.open and asyncio.get_running_loop().time() < deadline:
                        await asyncio.sleep(0.005)
            finally:  # even when the wait above is cancelled (the client cancelled its call)
                self._withdraw(c, list(c.open))
                c.closed = True
                c.wake.set()
            try:
                await asyncio.wait_for(writer, 1.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001 - it is gone
                writer.cancel()

    def _withdraw(self, c: sess.Stream, ups: list[int]) -> None:
        if not ups:
            return
        for up in ups:
            self._routes.pop(up, None)
            c.open.pop(up, None)
            if self._queue.pop(up, None) is None:  # sent: the lighthouse withdraws it
                self._withdrawn.append(up)
        self.stats["withdrawn"] += len(ups)
        if self._call is not None:
            self._wake.set()

    def _forward(self, c: sess.Stream, raw: bytes) -> None:
        try:
            env = pb2.SessionRequest.FromString(raw)
        except Exception:  # noqa: BLE001 - any garbage from the network
            c.send(sess.reply(0, code=grpc.StatusCode.INVALID_ARGUMENT, details=sess.UNREADABLE))
            return
        seq = env.seq
        err = sess.envelope_problem(env)  # the lighthouse's own envelope checks, answered here
        if err:
            c.send(sess.reply(seq, code=grpc.StatusCode.INVALID_ARGUMENT, details=err))
            return
        if c.hold.holds(time.monotonic()):  # the lighthouse keeps refusing it: spare the block's budget
            code, details = c.hold.answer()
            self.stats["held_back"] += 1
            c.send(sess.reply(seq, code=code, details=details))
            return
        if len(c.open) >= sess.MAX_OPEN:
            c.send(sess.reply(seq, code=grpc.StatusCode.RESOURCE_EXHAUSTED, details=(
                f"this session has {len(c.open)} messages unanswered (at most {sess.MAX_OPEN}): wait for their "
                "answers")))
            return
        up = next(self._seq)
        self._routes[up] = (c, seq)
        c.open[up] = (seq, env.method == "GetQuorum")
        self._queue[up] = renumbered(raw, up)
        self.stats["messages_up"] += 1
        if self._call is None:
            self._connect()
        self._wake.set()

    # -- the lighthouse's side -----------------------------------------------------------------

    def _connect(self) -> None:
        call = self._call = self._open_upstream()
        self.stats["upstream_streams"] += 1
        loop = asyncio.get_running_loop()
        self._tasks = (loop.create_task(self._write(call)), loop.create_task(self._read(call)))

    async def _write(self, call) -> None:
        """The only writer upstream: whatever queued goes in one batch (none waits to fill one).
        Withdrawals go with the batch that empties the queue, after every message of the client
        they withdraw (the lighthouse handles a batch's messages before its withdrawals)."""
        mb = self.config.max_batch
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queue or self._withdrawn:
                    out = self._take(mb) if self._queue else []
                    gone: list[int] = []
                    if not self._queue:
                        gone, self._withdrawn = self._withdrawn, []
                    self.stats["batches_up"] += 1
                    await call.write(sess.batch(out, gone))
        except grpc.aio.AioRpcError as e:
            self._broken(call, f"{e.code().name}: {e.details()}")
        except (grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            self._broken(call, str(e))

    def _take(self, max_messages: int) -> list[bytes]:
        """The next batch of unsent messages (bounded as sess.take_batch bounds it)."""
        out = sess.take_batch(collections.deque(itertools.islice(self._queue.values(), max_messages)), max_messages)
        for up in list(itertools.islice(self._queue, len(out))):
            del self._queue[up]
        return out

    async def _read(self, call) -> None:
        why = "the lighthouse closed it"
        try:
            while True:
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    break
                self.stats["batches_down"] += 1
                try:
                    replies = pb2.RelayBatch.FromString(raw).messages
                except Exception as e:  # noqa: BLE001 - the lighthouse sent garbage: start over
                    why = f"an unreadable batch from the lighthouse ({type(e).__name__})"
                    break
                for r in replies:
                    self._route(r)
        except grpc.aio.AioRpcError as e:
            why = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            why = "the relay stopped it"
        self._broken(call, why)

    def _route(self, raw: bytes) -> None:
        try:
            rep = pb2.SessionReply.FromString(raw)
        except Exception:  # noqa: BLE001 - one unreadable reply: its client times out, the rest go on
            log.warning("relay: an unreadable reply from the lighthouse was dropped")
            return
        if rep.seq == 0:  # about a message it could not tell apart: this relay sent something wrong
            log.error("relay: the lighthouse refused a batch: %s: %s", sess.status_code(rep.code).name, rep.details)
            return
        route = self._routes.pop(rep.seq, None)
        if route is None:  # its client went away (the request was withdrawn)
            return
        c, seq = route
        c.open.pop(rep.seq, None)
        c.hold.reply(time.monotonic(), rep.code, rep.details)
        self.stats["replies_down"] += 1
        c.send(renumbered(raw, seq))

    def _broken(self, call, why: str) -> None:
        """The upstream stream ended: every message not yet answered gets UNAVAILABLE (its
        client retries it as across a lighthouse outage); the next message opens a new stream."""
        if self._call is not call:
            return
        self._call = None
        self.stats["upstream_breaks"] += 1
        stop_stream(call, self._tasks)
        self._tasks = ()
        routes, self._routes = self._routes, {}
        self._queue.clear()
        self._withdrawn.clear()
        if routes:
            log.warning("relay: its stream to lighthouse %s ended (%s): %d open requests answered UNAVAILABLE",
                        self.config.lighthouse, why, len(routes))
        for up, (c, seq) in routes.items():
            c.open.pop(up, None)
            c.send(sess.reply(seq, code=grpc.StatusCode.UNAVAILABLE, details=(
                f"the relay's stream to lighthouse {self.config.lighthouse} ended ({why}): retry")))


class RelayThread(ServerThread):
    """A relay on its own event loop in a daemon thread (a Ray actor, tests): ``start()`` returns
    its address; ``stats`` is what it carried so far."""

    def __init__(self, config: RelayConfig, *, start_timeout_s: float = 10.0) -> None:
        self.config = config
        super().__init__(lambda: Relay(self.config), "fthsdp-relay", start_timeout_s)

    @property
    def stats(self) -> dict:
        return dict(self.server.stats) if self.server is not None else {}


# -- command line ----------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fthsdp relay",
        description="Carry many processes' lighthouse session streams to the lighthouse on one (fan-in for "
                    "hundreds of replicas; name it in ft.lighthouse_relays, which splits the replicas among the relays).")
    p.add_argument("--lighthouse", required=True, metavar="HOST:PORT", help="the lighthouse to carry sessions to")
    p.add_argument("--bind", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the replicas reach this relay (port 0: any free port; default %(default)s)")
    p.add_argument("--tls-cert", default="", help="PEM certificate chain: serve TLS to the replicas (with --tls-key)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--lighthouse-tls-ca", default="", help="PEM CA to check a TLS lighthouse's certificate against")
    p.add_argument("--port-file", default=None, help="write the bound port to this file (atomically) once listening")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


async def _serve(config: RelayConfig, port_file: str | None) -> None:
    from fthsdp.launch.lifetime import serve_until_terminated

    relay = Relay(config)
    await relay.start()
    await serve_until_terminated(relay.port, port_file, f"relay listening on {relay.address}")
    log.info("relay stopping (%s)", relay.stats)
    await relay.stop()


def cli(argv: list[str]) -> int:
    """``fthsdp relay ...``: serve until SIGTERM/SIGINT; returns the exit code."""
    from fthsdp import logs
    from fthsdp.control.lighthouse import is_loopback
    from fthsdp.launch.lifetime import die_with_launcher

    die_with_launcher()
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = RelayConfig(lighthouse=args.lighthouse, bind=args.bind, tls_cert_file=args.tls_cert,
                             tls_key_file=args.tls_key, lighthouse_tls_ca=args.lighthouse_tls_ca)
    except ValueError as e:
        parser.error(str(e))
    logs.setup("fthsdp.control.relay", level=getattr(logging, args.log_level))
    if not config.tls_cert_file and not is_loopback(split_host_port(config.bind)[0]):
        log.warning("relay on %s serves plain TCP beyond loopback: its clients' requests are signed but readable "
                    "on the network (give --tls-cert and --tls-key)", config.bind)
    try:
        asyncio.run(_serve(config, args.port_file))
    except OSError as e:
        print(f"fthsdp relay: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
