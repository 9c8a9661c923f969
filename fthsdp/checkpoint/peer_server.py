"""HTTP server for a replica's latest host snapshot, so behind peers can fetch it.

Routes:

    GET /v1/manifest                              the served snapshot's manifest (JSON)
    GET /v1/snapshot/{step}/manifest              the manifest of `step`, if still held (latest or previous)
    GET /v1/snapshot/{step}/leaf/{i}/piece/{k}    piece k of leaf i (raw bytes)

**What is authenticated, and how.** Every request must carry a proof signed
with the job's *peer key*, ``derive(job_key, "peer-server")``
(:func:`peer_key`; the job key is the launcher's per-job secret, see
``fthsdp.control.auth``): ``Authorization: FTHSDP-HMAC-SHA256
ts=..,nonce=..,mac=..``, an HMAC-SHA256 over the method, the server's own
host:port, the path, a millisecond timestamp and a random nonce
(``fthsdp/checkpoint/peer_auth.py`` says why this and not a bearer token).
The server checks the MAC in constant time, refuses a timestamp more than 30 s
behind or 5 s ahead of its clock (``CLOCK_WINDOW_S``, ``MAX_FUTURE_S``: ``fthsdp.control.auth``), and
remembers every accepted nonce for that window, so a captured request can be replayed neither for another
resource (path, server) nor for the same one. A peer of another job holds
another key and is refused (403). No key or secret is ever sent. With
``tls=TLSFiles(cert, key)`` (in a job: ``ft.peer_tls_cert``, ``ft.peer_tls_key``
and ``ft.peer_tls_ca``) the server speaks HTTPS (``https://`` in
:attr:`PeerServer.url`), so the state bytes are secret on the wire and the
fetcher verifies the server against the operator's CA file; without TLS the
bytes travel in clear, and a party that can rewrite traffic could alter
piece bodies (each is checked against a CRC32 in the agreed manifest, which
catches faults, not forgery): give certificates on networks you do not trust.
Responses are not signed: without TLS a fetcher trusts a server because the
lighthouse listed its address, and several peers' manifests must agree
(``peer_fetch.consensus``). A job without a job secret (its lighthouse run
``--insecure``) falls back to the launcher's random per-job
``$FTHSDP_PEER_TOKEN`` as the peer key (``ReplicaProcess.load_peer_key``).

**Limits** (nothing from the network may crash or starve the server): one
event loop holds every connection that is waiting for a request (idle
keep-alives and heads still arriving cost no thread), a fixed pool of
``ServerLimits.workers`` threads writes responses, at most
``max_connections`` connections (``max_per_ip`` from one address) are held
(when full, the connection waiting longest is closed for the newcomer), a
request head must arrive within ``ft.peer_header_s`` (slowloris is cut),
an idle connection is closed after ``ft.peer_idle_s``, a response must be
written within ``ft.peer_send_s``, and heads are parsed strictly within
:class:`HeadLimits` (``fthsdp/checkpoint/http_head.py``: request-line and
header sizes, header count, no HTTP/0.9, no bodies). Unauthenticated or
malformed requests are refused by the event loop and never reach a worker.
Every refusal is logged with its reason (one line per kind and address, then
a count every few seconds, so a flood cannot flood the log) and counted in
:attr:`PeerServer.stats`; never a traceback.

A piece response carries `X-Fthsdp-Step`, `X-Fthsdp-Leaf`, `X-Fthsdp-Range`
(start-end within the leaf) and `X-Fthsdp-Checksum` (crc32, 8 hex digits,
computed once when the snapshot landed). Errors are JSON `{"error": ...}`:
400 malformed request, 401 missing/malformed/expired credential, 403 wrong
credential (another job, another secret) or replayed one, 404 unknown route,
405 not GET, 408 head too slow, 409 stale step (the body says which step is
served), 413/414/431 too large, 503 no snapshot yet or too many connections.
Bodies are sent straight from the snapshot buffer (no copy) under a lease, so
the slot is not overwritten mid-transfer.

`Fault` injects misbehaviour (corrupt bytes, truncated bodies, lying
checksums, delays, 503s) for tests and experiments of the fetcher.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import json
import logging
import queue
import re
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from fthsdp.addresses import LOOPBACK, check_host, family, is_wildcard, join_host_port, url as make_url
from fthsdp.checkpoint.http_head import HeadLimits, Request, parse_head
from fthsdp.checkpoint.peer_auth import CLOCK_WINDOW_S, PURPOSE, START_GRACE_S, ReplayCache, Refusal, check_request
from fthsdp.checkpoint.snapshot import Snapshot, StaleStepError
from fthsdp.digits import ascii_int
from fthsdp.timeouts import Timeouts

log = logging.getLogger(__name__)

_PIECE = re.compile(r"/v1/snapshot/(?P<step>[^/]+)/leaf/(?P<leaf>[^/]+)/piece/(?P<piece>[^/]+)")
_STEP_MANIFEST = re.compile(r"/v1/snapshot/(?P<step>[^/]+)/manifest")

__all__ = ["PeerServer", "StaticSource", "Fault", "ServerLimits", "TLSFiles", "Route", "Refusal", "parse_route",
           "peer_key"]


def peer_key(job_key: bytes) -> bytes:
    """The peer server's key for a job: derived from the job key under its own purpose, so that
    it authenticates nothing else (the lighthouse and FTAR derive theirs under other purposes)."""
    from fthsdp.control.auth import derive

    return derive(job_key, PURPOSE)


@dataclass(frozen=True)
class Route:
    """A request path the server understands: a manifest (the served one when
    `step` is None) or one piece of one leaf of `step`."""

    kind: str  # "manifest" | "piece"
    step: int | None = None
    leaf: int | None = None
    piece: int | None = None


def _nonnegative(name: str, text: str) -> int | Refusal:
    number = ascii_int(text)
    if number is None:
        return Refusal(400, f"{name} must be a non-negative integer (at most 18 digits), got {text[:40]!r}")
    return number


def parse_route(raw_path: str) -> Route | Refusal:
    """The route a request path asks for (the query string is ignored), or the refusal.

    Pure, so it is fuzzed on its own (experiments/fuzz.py) as well as behind the server."""
    path = raw_path.split("?", 1)[0]
    if path == "/v1/manifest":
        return Route("manifest")
    m = _STEP_MANIFEST.fullmatch(path)
    if m:
        step = _nonnegative("step", m["step"])
        return step if isinstance(step, Refusal) else Route("manifest", step=step)
    m = _PIECE.fullmatch(path)
    if m:
        values = []
        for name in ("step", "leaf", "piece"):
            v = _nonnegative(name, m[name])
            if isinstance(v, Refusal):
                return v
            values.append(v)
        return Route("piece", *values)
    return Refusal(404, f"no route {path!r}; see /v1/manifest and /v1/snapshot/STEP/leaf/I/piece/K")


class SnapshotSource(Protocol):
    """What the server serves from: `Snapshotter` or `StaticSource`."""

    def lease(self, step: int | None = None): ...  # context manager yielding a Snapshot


class StaticSource:
    """Serves one fixed snapshot (tests, benchmarks, a finished replica)."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot

    def lease(self, step: int | None = None):
        if step is not None and step != self.snapshot.step:
            raise StaleStepError(step, self.snapshot.step)
        return contextlib.nullcontext(self.snapshot)


@dataclass(frozen=True)
class Fault:
    """Misbehaviour to inject into piece responses (fault injection, not a mock).

    kind: corrupt (flip a byte), truncate (send half the body, then close),
    bad_checksum (header lies), delay (sleep `delay_s` before each piece),
    unavailable (answer 503, as a server at its limits does).
    count: how many piece responses to affect (None: all)."""

    kind: str
    count: int | None = None
    delay_s: float = 0.0

    KINDS = ("corrupt", "truncate", "bad_checksum", "delay", "unavailable")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {', '.join(self.KINDS)}")


class _Pacer:
    """Caps the bytes per second a server sends, over all its connections together."""

    def __init__(self, bytes_per_s: float):
        self.bytes_per_s = float(bytes_per_s)
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait_for(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.bytes_per_s
        if start > now:
            time.sleep(start - now)


@dataclass(frozen=True)
class ServerLimits:
    """How much the network may make one peer server hold (see the module docstring)."""

    workers: int = 8  # threads that write responses; a rejoining replica uses ft.peer_streams per source
    max_connections: int = 256
    max_per_ip: int = 64
    head: HeadLimits = field(default_factory=HeadLimits)
    replay_capacity: int = 1 << 16  # accepted nonces remembered (per server) within the clock window

    def __post_init__(self) -> None:
        for name in ("workers", "max_connections", "max_per_ip", "replay_capacity"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ServerLimits.{name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class TLSFiles:
    """The operator's certificate chain and private key (PEM files) for serving HTTPS."""

    cert_file: str
    key_file: str

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"peer server TLS: cannot load certificate {self.cert_file!r} with key "
                             f"{self.key_file!r}: {e}; give PEM files of a certificate and its key") from None
        return ctx


class _Conn:
    """One accepted connection. Owned by the event loop, or by exactly one worker while `busy`."""

    __slots__ = ("sock", "ip", "buf", "since", "head_started", "busy", "handshaking")

    def __init__(self, sock: socket.socket, ip: str, now: float, handshaking: bool):
        self.sock = sock
        self.ip = ip
        self.buf = bytearray()
        self.since = now  # when it started waiting (accepted, or its last response was written)
        self.head_started: float | None = None  # first byte of the request head now arriving
        self.busy = False
        self.handshaking = handshaking


class _RefusalLog:
    """Counts refusals by kind and logs each (kind, address) once, then a count at most every
    `every_s`: a flood of bad requests costs a few log lines, not a line each."""

    def __init__(self, every_s: float = 10.0, max_keys: int = 4096):
        self.every_s = every_s
        self.max_keys = max_keys
        self.counts: collections.Counter[str] = collections.Counter()
        self._last: dict[tuple[str, str], list] = {}
        self._lock = threading.Lock()

    def note(self, kind: str, ip: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[kind] += 1
            entry = self._last.get((kind, ip))
            if entry is not None and now - entry[0] < self.every_s:
                entry[1] += 1
                return
            more = entry[1] if entry is not None else 0
            if len(self._last) >= self.max_keys:
                self._last.clear()
            self._last[(kind, ip)] = [now, 0]
        log.warning("peer server refused %s from %s: %s%s", kind, ip, reason,
                    f" ({more} more like it in the last {self.every_s:g} s)" if more else "")


def _response_head(status: int, headers: list[tuple[str, str]], keep_alive: bool) -> bytes:
    reason = _REASONS.get(status, "Error")
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers),
             f"Connection: {'keep-alive' if keep_alive else 'close'}", "", ""]
    return "\r\n".join(lines).encode("latin-1")


def _json_response(status: int, body: dict, keep_alive: bool) -> bytes:
    data = json.dumps(body).encode()
    return _response_head(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
                          keep_alive) + data


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 413: "Content Too Large",
            414: "URI Too Long", 431: "Request Header Fields Too Large", 503: "Service Unavailable",
            505: "HTTP Version Not Supported"}
_PACE_SLICE = 1 << 20
_SEND_SLICE = 4 << 20  # the send deadline is checked between slices


class _Server:
    """The transport: one event loop (accept, TLS handshakes, reading and checking request heads,
    timeouts, refusals) and a fixed pool of workers (writing responses)."""

    def __init__(self, addr: tuple[str, int], source: "SnapshotSource", key: bytes, fault: "Fault | None",
                 max_bytes_per_s: float | None, timeouts: Timeouts, limits: ServerLimits,
                 tls: ssl.SSLContext | None):
        self.source = source
        self.key = key
        self.fault = fault
        self.pacer = None if not max_bytes_per_s else _Pacer(max_bytes_per_s)
        self.timeouts = timeouts
        self.limits = limits
        self.tls = tls
        self._fault_lock = threading.Lock()
        self._faults_left = None if fault is None else fault.count
        self.requests = 0
        self.bytes_served = 0
        self.pieces_served = 0
        self.refusals = _RefusalLog()
        # empty at start: requests signed before it cannot be checked, and are refused
        self.replay = ReplayCache(CLOCK_WINDOW_S, limits.replay_capacity, not_before=time.time() - START_GRACE_S)
        self.listener = socket.socket(family(addr[0]), socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind(addr)
            self.listener.listen(128)
            self.listener.setblocking(False)
        except OSError:
            self.listener.close()
            raise
        self.server_address = self.listener.getsockname()
        self.authorities: set[str] = set()  # Host values that name this server (set by PeerServer)
        self.authenticate = True
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: set[_Conn] = set()
        self._per_ip: collections.Counter[str] = collections.Counter()
        self._returns: list[tuple[_Conn, bool]] = []
        self._returns_lock = threading.Lock()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._workers = [threading.Thread(target=self._worker, name=f"fthsdp-peer-worker-{i}", daemon=True)
                         for i in range(limits.workers)]
        for t in self._workers:
            t.start()

    # -- event loop -----------------------------------------------------------

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    events = self._sel.select(self._wait_s())
                except OSError as e:  # never expected; keep serving rather than die
                    log.warning("peer server: select failed: %s", e)
                    time.sleep(0.01)
                    continue
                for key, mask in events:
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    elif not key.data.busy:
                        self._guard(self._on_io, key.data)
                self._take_returns()
                self._sweep()
        finally:
            self._done.set()

    def _guard(self, fn, conn: _Conn) -> None:
        """Runs one event-loop step for `conn`; an unexpected error closes that connection, with one
        log line, and the loop goes on."""
        try:
            fn(conn)
        except Exception as e:  # noqa: BLE001 - nothing from the network may stop the server
            self.refusals.note("internal error", conn.ip, f"{type(e).__name__}: {e}")
            self._close(conn)

    def _wait_s(self) -> float:
        t = self.timeouts
        return min(0.25, t.peer_header_s / 4, t.peer_idle_s / 4)

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _accept(self) -> None:
        for _ in range(64):  # a burst of connections must not keep the loop from the others
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: refuse by not accepting, say why once
                self.refusals.note("accept failed", "-", f"{type(e).__name__}: {e}")
                return
            ip = addr[0]
            now = time.monotonic()
            if self._per_ip[ip] >= self.limits.max_per_ip and not self._evict(now, ip):
                self._reject_raw(sock, ip, "per-address limit",
                                 f"{self.limits.max_per_ip} connections from {ip} already (ServerLimits.max_per_ip)")
                continue
            if len(self._conns) >= self.limits.max_connections and not self._evict(now, None):
                self._reject_raw(sock, ip, "connection limit",
                                 f"{self.limits.max_connections} connections already, every one busy "
                                 "(ServerLimits.max_connections)")
                continue
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no delayed-ACK stall per piece
                if self.tls is not None:
                    sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except OSError as e:
                self.refusals.note("accept failed", ip, f"{type(e).__name__}: {e}")
                sock.close()
                continue
            conn = _Conn(sock, ip, now, handshaking=self.tls is not None)
            self._conns.add(conn)
            self._per_ip[ip] += 1
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _evict(self, now: float, ip: str | None) -> bool:
        """Closes the connection (of `ip`, or any) that has waited longest without a request being
        served, to make room for a newcomer; False when every one is busy."""
        waiting = [c for c in self._conns if not c.busy and (ip is None or c.ip == ip)]
        if not waiting:
            return False
        victim = min(waiting, key=lambda c: c.since)
        self.refusals.note("evicted", victim.ip, f"connection waiting {now - victim.since:.1f} s for a request "
                                                 "closed to make room for a new one (connection limits)")
        self._close(victim)
        return True

    def _reject_raw(self, sock: socket.socket, ip: str, kind: str, reason: str) -> None:
        self.refusals.note(kind, ip, reason)
        with contextlib.suppress(OSError):
            if self.tls is None:  # a plain-text answer would be noise to a TLS client
                sock.setblocking(False)
                sock.send(_json_response(503, {"error": f"too many connections: {reason}"}, False))
        sock.close()

    def _on_io(self, conn: _Conn) -> None:
        if conn.handshaking:
            try:
                conn.sock.do_handshake()
            except ssl.SSLWantReadError:
                self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
                return
            except ssl.SSLWantWriteError:
                self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
                return
            except (ssl.SSLError, OSError) as e:
                self.refusals.note("TLS handshake", conn.ip, f"{type(e).__name__}: {e}")
                self._close(conn)
                return
            conn.handshaking = False
            conn.since = time.monotonic()
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        if not self._read(conn):
            return
        self._advance(conn)

    def _read(self, conn: _Conn) -> bool:
        """Reads what has arrived into the connection's buffer; False if it was closed."""
        got = 0
        while True:
            try:
                data = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except (ssl.SSLError, OSError) as e:
                if not isinstance(e, ConnectionError):
                    self.refusals.note("read error", conn.ip, f"{type(e).__name__}: {e}")
                self._close(conn)
                return False
            if not data:
                self._close(conn)  # the peer hung up: done, or gave up on us
                return False
            conn.buf += data
            got += len(data)
            if len(conn.buf) > self.limits.head.max_head_bytes or len(data) < 65536 and not self._pending(conn):
                break
        if got and conn.head_started is None:
            conn.head_started = time.monotonic()
        return True

    @staticmethod
    def _pending(conn: _Conn) -> int:
        return conn.sock.pending() if isinstance(conn.sock, ssl.SSLSocket) else 0

    def _advance(self, conn: _Conn) -> None:
        """Acts on a buffered request head: refuses it, or hands it to a worker."""
        if not conn.buf:
            return
        parsed = parse_head(conn.buf, self.limits.head)
        if parsed is None:
            return
        if isinstance(parsed, Refusal):
            return self._refuse(conn, "malformed request", parsed)
        req: Request = parsed
        del conn.buf[: req.head_bytes]
        self.requests += 1
        host = req.headers.get("host", "")
        if not self.authenticate:
            pass  # measurements only (PeerServer(authenticate=False) binds loopback alone)
        elif host.lower() not in self.authorities:
            return self._refuse(conn, "wrong host", Refusal(
                403, f"request addressed to {host[:100]!r}; this server is {' or '.join(sorted(self.authorities))}"))
        else:
            refusal = check_request(req.headers.get("authorization"), self.key, req.method, host, req.target,
                                    time.time(), self.replay)
            if refusal is not None:
                return self._refuse(conn, "credential", refusal)
        route = parse_route(req.target)
        if isinstance(route, Refusal):
            return self._refuse(conn, "bad route", route)
        conn.busy = True
        conn.head_started = None
        self._sel.unregister(conn.sock)
        self._work.put((conn, req, route))

    def _refuse(self, conn: _Conn, kind: str, refusal: Refusal) -> None:
        """Answers `refusal` without blocking (a short JSON body fits any socket buffer) and closes."""
        self.refusals.note(kind, conn.ip, f"{refusal.status} {refusal.error}")
        with contextlib.suppress(OSError, ssl.SSLError):
            conn.sock.send(_json_response(refusal.status, {"error": refusal.error}, False))
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn in self._conns:
            self._conns.discard(conn)
            self._per_ip[conn.ip] -= 1
            if self._per_ip[conn.ip] <= 0:
                del self._per_ip[conn.ip]
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _take_returns(self) -> None:
        with self._returns_lock:
            returns, self._returns = self._returns, []
        now = time.monotonic()
        for conn, keep in returns:
            if not keep or self._stop.is_set():
                self._close(conn)
                continue
            conn.busy = False
            conn.since = now
            conn.head_started = now if conn.buf else None
            try:
                conn.sock.setblocking(False)
                self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            except (OSError, ValueError):
                self._close(conn)
                continue
            if self._pending(conn):  # TLS: bytes already decrypted wait inside the socket, not in the kernel
                self._guard(self._on_io, conn)
            else:
                self._guard(self._advance, conn)  # a pipelined request may already be buffered

    def _sweep(self) -> None:
        now = time.monotonic()
        t = self.timeouts
        for conn in list(self._conns):
            if conn.busy:
                continue
            if conn.handshaking and now - conn.since > t.peer_header_s:
                self.refusals.note("slow TLS handshake", conn.ip,
                                   f"not finished within {t.peer_header_s:g} s (ft.peer_header_s)")
                self._close(conn)
            elif conn.head_started is not None and now - conn.head_started > t.peer_header_s:
                self._refuse(conn, "slow request head", Refusal(
                    408, f"request head not complete within {t.peer_header_s:g} s (ft.peer_header_s)"))
            elif conn.head_started is None and now - conn.since > t.peer_idle_s:
                self.refusals.note("idle", conn.ip, f"no request for {t.peer_idle_s:g} s (ft.peer_idle_s)")
                self._close(conn)

    # -- workers ----------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            conn, req, route = item
            keep = False
            try:
                conn.sock.setblocking(True)
                keep = self._serve(conn, req, route) and req.keep_alive
            except (OSError, ssl.SSLError) as e:  # the fetcher hung up, or read too slowly
                if not isinstance(e, (BrokenPipeError, ConnectionResetError)):
                    self.refusals.note("send", conn.ip, f"response not delivered: {type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001 - a worker never dies, and never prints a traceback
                self.refusals.note("internal error", conn.ip, f"{req.target[:100]}: {type(e).__name__}: {e}")
            with self._returns_lock:
                self._returns.append((conn, keep))
            self._wake()

    def _send(self, conn: _Conn, data, deadline: float) -> None:
        """Writes `data` whole, or raises TimeoutError once past `deadline` (ft.peer_send_s)."""
        view = memoryview(data).cast("B")
        for at in range(0, len(view), _SEND_SLICE):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"response not written within {self.timeouts.peer_send_s:g} s (ft.peer_send_s)")
            conn.sock.settimeout(left)
            conn.sock.sendall(view[at: at + _SEND_SLICE])

    def _serve(self, conn: _Conn, req: Request, route: Route) -> bool:
        """Writes the response; whether the connection may be kept."""
        deadline = time.monotonic() + self.timeouts.peer_send_s
        if route.kind == "manifest":
            try:
                with self.source.lease(route.step) as snap:
                    text = snap.manifest.to_json()
            except StaleStepError as e:
                self._send(conn, self._stale(e, req.keep_alive), deadline)
                return True
            data = text.encode()
            self._send(conn, _response_head(200, [("Content-Type", "application/json"),
                                                  ("Content-Length", str(len(data)))], req.keep_alive) + data,
                       deadline)
            return True
        return self._piece(conn, req, route.step, route.leaf, route.piece, deadline)

    @staticmethod
    def _stale(e: StaleStepError, keep_alive: bool) -> bytes:
        if e.served is None:
            return _json_response(503, {"error": "no snapshot is served yet", "served_step": None}, keep_alive)
        return _json_response(409, {"error": str(e), "requested_step": e.requested, "served_step": e.served},
                              keep_alive)

    def _piece(self, conn: _Conn, req: Request, step: int, leaf: int, piece: int, deadline: float) -> bool:
        try:
            lease = self.source.lease(step)
            snap = lease.__enter__()
        except StaleStepError as e:
            self._send(conn, self._stale(e, req.keep_alive), deadline)
            return True
        try:
            man = snap.manifest
            if leaf >= len(man.leaves):
                self._send(conn, _json_response(
                    400, {"error": f"leaf {leaf} out of range: step {step} has {len(man.leaves)} leaves"},
                    req.keep_alive), deadline)
                return True
            if piece >= man.num_pieces(leaf):
                self._send(conn, _json_response(
                    400, {"error": f"piece {piece} out of range: leaf {leaf} has {man.num_pieces(leaf)} pieces"},
                    req.keep_alive), deadline)
                return True
            start, end = man.piece_range(leaf, piece)
            body = snap.piece(leaf, piece)
            crc = man.checksums[leaf][piece]
            fault = self.take_fault()
            if fault is not None and fault.kind == "unavailable":
                self._send(conn, _json_response(503, {"error": "fault injection: unavailable, try again"},
                                                req.keep_alive), deadline)
                return True
            if fault is not None and fault.kind == "delay":
                time.sleep(fault.delay_s)
            if fault is not None and fault.kind == "bad_checksum":
                crc ^= 0x5A5A5A5A
            if fault is not None and fault.kind == "corrupt" and len(body):
                damaged = bytearray(body)
                damaged[len(damaged) // 2] ^= 0xFF
                body = memoryview(damaged)
            head = _response_head(200, [
                ("Content-Type", "application/octet-stream"), ("Content-Length", str(len(body))),
                ("X-Fthsdp-Step", str(man.step)), ("X-Fthsdp-Leaf", str(leaf)),
                ("X-Fthsdp-Range", f"{start}-{end}"), ("X-Fthsdp-Checksum", f"{crc:08x}")], req.keep_alive)
            self._send(conn, head, deadline)
            if fault is not None and fault.kind == "truncate":
                self._send(conn, body[: len(body) // 2], deadline)
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
                return False
            if self.pacer is None:
                self._send(conn, body, deadline)
            else:  # paced in slices so a capped server streams smoothly instead of in bursts
                for at in range(0, len(body), _PACE_SLICE):
                    part = body[at: at + _PACE_SLICE]
                    self.pacer.wait_for(len(part))
                    self._send(conn, part, deadline)
            self.bytes_served += len(body)
            self.pieces_served += 1
            return True
        finally:
            lease.__exit__(None, None, None)

    def take_fault(self) -> "Fault | None":
        if self.fault is None:
            return None
        with self._fault_lock:
            if self._faults_left is None:
                return self.fault
            if self._faults_left <= 0:
                return None
            self._faults_left -= 1
            return self.fault

    # -- shutdown ---------------------------------------------------------------

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake()

    def _conns_now(self) -> list:
        """A copy of the open connections, from another thread than the loop's: a loop that has not
        stopped may change the set while it is copied (RuntimeError), and the copy is taken again."""
        for _ in range(100):
            try:
                return list(self._conns)
            except RuntimeError:
                continue
        return []

    def server_close(self, timeout: float = 5.0) -> None:
        """Stops the workers and closes every socket, within `timeout` in all. A worker writing to a
        slow reader would hold it for up to ft.peer_send_s: the busy connections are shut down first,
        so their writes fail at once, and only then are the workers joined."""
        until = time.monotonic() + timeout
        self._done.wait(timeout / 2)  # the loop's end; the rest of the budget is the workers'
        for conn in self._conns_now():
            if conn.busy:  # its worker may be blocked in sendall: shut down, not close (the worker owns it)
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
        for _ in self._workers:
            self._work.put(None)
        for t in self._workers:
            t.join(max(0.0, until - time.monotonic()))
        for conn in self._conns_now():
            self._close(conn)
        for s in (self.listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()
        self._sel.close()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class PeerServer:
    """Serves `source`'s latest snapshot on host:port (loopback, any free port by default).

    `key` is the job's peer key (:func:`peer_key` of the job key; a str is
    taken as its UTF-8 bytes). `host` is the bind address (an IPv4/IPv6
    literal or a name; 0.0.0.0 or :: for every interface); `advertise_host`
    is the host put in :attr:`url`, the address peers fetch from (empty: the
    bound host). `timeouts` supplies ``peer_header_s``, ``peer_idle_s``,
    and ``peer_send_s`` (the job's :class:`Timeouts`;
    the defaults otherwise), `limits` the connection and head limits, `tls`
    the operator's certificate files (then the server speaks HTTPS).
    `authenticate=False` turns the request check off, on loopback only: it
    exists to measure what authentication costs (experiments/recovery_fetch.py).

    `max_bytes_per_s` caps what this replica spends on serving (all fetchers
    together), so that feeding a rejoining peer cannot slow its own training
    steps beyond a budget; a fetcher striping over several capped peers still
    gets their sum."""

    def __init__(
        self,
        source: SnapshotSource,
        key: bytes | str,
        host: str = LOOPBACK,
        port: int = 0,
        fault: Fault | None = None,
        max_bytes_per_s: float | None = None,
        advertise_host: str = "",
        timeouts: Timeouts | None = None,
        limits: ServerLimits | None = None,
        tls: TLSFiles | None = None,
        authenticate: bool = True,
    ):
        key = key.encode() if isinstance(key, str) else bytes(key)
        if not key:
            raise ValueError("the peer server needs a non-empty key (peer_key(job key))")
        if not authenticate and not _is_loopback(host):
            raise ValueError(f"an unauthenticated peer server (authenticate=False, for measuring the cost of "
                             f"authentication) may only bind loopback, not {host!r}")
        if max_bytes_per_s is not None and max_bytes_per_s <= 0:
            raise ValueError(f"max_bytes_per_s must be > 0 (or None for no cap), got {max_bytes_per_s}")
        # Checked before binding: a wildcard with nothing to advertise is refused up front.
        if advertise_host:
            check_host(advertise_host)
        elif is_wildcard(host):
            raise ValueError(f"peer server bound to {host!r} (every interface) needs an advertise_host "
                             "that peers can reach")
        timeouts = (timeouts or Timeouts()).check()
        self.advertise_host = advertise_host
        self.scheme = "https" if tls is not None else "http"
        self._server = _Server((host, port), source, key, fault, max_bytes_per_s, timeouts,
                               limits or ServerLimits(), tls.context() if tls is not None else None)
        bound, bound_port = self._server.server_address[:2]
        names = {join_host_port(advertise_host or bound, bound_port)}
        if not is_wildcard(bound):
            names.add(join_host_port(bound, bound_port))
        self._server.authorities = {n.lower() for n in names}
        self._server.authenticate = authenticate
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The advertised address peers fetch from: http(s)://HOST:PORT (http://[V6]:PORT)."""
        host, port = self._server.server_address[:2]
        return make_url(self.advertise_host or host, port, self.scheme)

    @property
    def stats(self) -> dict:
        s = self._server
        return {"requests": s.requests, "pieces_served": s.pieces_served, "bytes_served": s.bytes_served,
                "open_connections": s.open_connections, "refused": dict(s.refusals.counts)}

    def start(self) -> "PeerServer":
        self._thread = threading.Thread(target=self._server.serve_forever, name="fthsdp-peer-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        self._server.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server.server_close()

    def __enter__(self) -> "PeerServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
