"""HTTP server for a replica's latest host snapshot, so behind peers can fetch it.

Routes (every one needs `Authorization: Bearer <token>`; the token is compared
in constant time):

    GET /v1/manifest                              the served snapshot's manifest (JSON)
    GET /v1/snapshot/{step}/manifest              the manifest of `step`, if still held (latest or previous)
    GET /v1/snapshot/{step}/leaf/{i}/piece/{k}    piece k of leaf i (raw bytes)

A piece response carries `X-Fthsdp-Step`, `X-Fthsdp-Leaf`, `X-Fthsdp-Range`
(start-end within the leaf) and `X-Fthsdp-Checksum` (crc32, 8 hex digits,
computed once when the snapshot landed). Errors are JSON `{"error": ...}`:
400 malformed request, 401 missing token, 403 wrong token, 404 unknown
route, 409 stale step (the body says which step is served), 503 no snapshot
yet. Bodies are sent straight from the snapshot buffer (no copy) under a
lease, so the slot is not overwritten mid-transfer.

`Fault` injects misbehaviour (corrupt bytes, truncated bodies, lying
checksums, delays) for tests and experiments of the fetcher.
"""

from __future__ import annotations

import hmac
import json
import re
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from fthsdp.addresses import LOOPBACK, check_host, family, is_wildcard, url as make_url
from fthsdp.checkpoint.snapshot import Snapshot, StaleStepError

_PIECE = re.compile(r"^/v1/snapshot/(?P<step>[^/]+)/leaf/(?P<leaf>[^/]+)/piece/(?P<piece>[^/]+)$")
_STEP_MANIFEST = re.compile(r"^/v1/snapshot/(?P<step>[^/]+)/manifest$")


@dataclass(frozen=True)
class Route:
    """A request path the server understands: a manifest (the served one when
    `step` is None) or one piece of one leaf of `step`."""

    kind: str  # "manifest" | "piece"
    step: int | None = None
    leaf: int | None = None
    piece: int | None = None


@dataclass(frozen=True)
class Refusal:
    """An HTTP error status and the JSON error text that says what was wrong."""

    status: int
    error: str


def check_authorization(header: str | None, token: bytes) -> Refusal | None:
    """None when `header` is ``Bearer <token>`` (compared in constant time), else why not.

    Pure, so it is fuzzed on its own (experiments/fuzz.py) as well as behind the server."""
    if not header:
        return Refusal(401, "missing token: send 'Authorization: Bearer <token>'")
    scheme, _, given = header.partition(" ")
    if scheme != "Bearer" or not given:
        return Refusal(401, "malformed Authorization header: expected 'Bearer <token>'")
    # surrogateescape: a header that is not valid text still compares (unequal), never raises.
    if not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token):
        return Refusal(403, "wrong token: this peer serves another job or the secret differs")
    return None


def _nonnegative(name: str, text: str) -> int | Refusal:
    try:
        v = int(text)
    except ValueError:
        return Refusal(400, f"{name} must be a non-negative integer, got {text!r}")
    if v < 0:
        return Refusal(400, f"{name} must be a non-negative integer, got {v}")
    return v


def parse_route(raw_path: str) -> Route | Refusal:
    """The route a request path asks for (the query string is ignored), or the refusal.

    Pure, so it is fuzzed on its own (experiments/fuzz.py) as well as behind the server."""
    path = raw_path.split("?", 1)[0]
    if path == "/v1/manifest":
        return Route("manifest")
    m = _STEP_MANIFEST.match(path)
    if m:
        step = _nonnegative("step", m["step"])
        return step if isinstance(step, Refusal) else Route("manifest", step=step)
    m = _PIECE.match(path)
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
        import contextlib

        if step is not None and step != self.snapshot.step:
            raise StaleStepError(step, self.snapshot.step)
        return contextlib.nullcontext(self.snapshot)


@dataclass(frozen=True)
class Fault:
    """Misbehaviour to inject into piece responses (fault injection, not a mock).

    kind: corrupt (flip a byte), truncate (send half the body, then close),
    bad_checksum (header lies), delay (sleep `delay_s` before each piece).
    count: how many piece responses to affect (None: all)."""

    kind: str
    count: int | None = None
    delay_s: float = 0.0

    KINDS = ("corrupt", "truncate", "bad_checksum", "delay")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {', '.join(self.KINDS)}")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall per piece
    server: "_Server"

    def log_message(self, format, *args):  # noqa: A002 - quiet by default
        pass

    # -- helpers ------------------------------------------------------------

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        refusal = check_authorization(self.headers.get("Authorization"), self.server.token)
        if refusal is not None:
            self._json(refusal.status, {"error": refusal.error})
            return False
        return True

    # -- routes -------------------------------------------------------------

    def do_GET(self):  # noqa: N802
        self.server.requests += 1
        if not self._authorised():
            return
        route = parse_route(self.path)
        if isinstance(route, Refusal):
            return self._json(route.status, {"error": route.error})
        if route.kind == "manifest":
            return self._manifest(route.step)
        return self._piece(route.step, route.leaf, route.piece)

    def do_POST(self):  # noqa: N802
        self._json(405, {"error": "the peer server is read-only: use GET"})

    def _stale(self, e: StaleStepError) -> None:
        if e.served is None:
            self._json(503, {"error": "no snapshot is served yet", "served_step": None})
        else:
            self._json(409, {"error": str(e), "requested_step": e.requested, "served_step": e.served})

    def _manifest(self, step: int | None) -> None:
        try:
            with self.server.source.lease(step) as snap:
                text = snap.manifest.to_json()
        except StaleStepError as e:
            return self._stale(e)
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _piece(self, step: int, leaf: int, piece: int) -> None:
        try:
            lease = self.server.source.lease(step)
            snap = lease.__enter__()
        except StaleStepError as e:
            return self._stale(e)
        try:
            man = snap.manifest
            if leaf >= len(man.leaves):
                return self._json(400, {"error": f"leaf {leaf} out of range: step {step} has {len(man.leaves)} leaves"})
            if piece >= man.num_pieces(leaf):
                return self._json(
                    400, {"error": f"piece {piece} out of range: leaf {leaf} has {man.num_pieces(leaf)} pieces"}
                )
            start, end = man.piece_range(leaf, piece)
            body = snap.piece(leaf, piece)
            crc = man.checksums[leaf][piece]
            fault = self.server.take_fault()
            if fault is not None and fault.kind == "delay":
                time.sleep(fault.delay_s)
            if fault is not None and fault.kind == "bad_checksum":
                crc ^= 0x5A5A5A5A
            if fault is not None and fault.kind == "corrupt" and len(body):
                damaged = bytearray(body)
                damaged[len(damaged) // 2] ^= 0xFF
                body = memoryview(damaged)
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Fthsdp-Step", str(man.step))
            self.send_header("X-Fthsdp-Leaf", str(leaf))
            self.send_header("X-Fthsdp-Range", f"{start}-{end}")
            self.send_header("X-Fthsdp-Checksum", f"{crc:08x}")
            self.end_headers()
            if fault is not None and fault.kind == "truncate":
                self.wfile.write(body[: len(body) // 2])
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return None
            pacer = self.server.pacer
            if pacer is None:
                self.wfile.write(body)
            else:  # paced in slices so a capped server streams smoothly instead of in bursts
                for at in range(0, len(body), _PACE_SLICE):
                    part = body[at : at + _PACE_SLICE]
                    pacer.wait_for(len(part))
                    self.wfile.write(part)
            self.server.bytes_served += len(body)
            self.server.pieces_served += 1
        finally:
            lease.__exit__(None, None, None)
        return None


_PACE_SLICE = 1 << 20


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, addr, source: SnapshotSource, token: bytes, fault: Fault | None, max_bytes_per_s: float | None):
        self.address_family = family(addr[0])  # an IPv6 host needs an AF_INET6 socket
        super().__init__(addr, _Handler)
        self.pacer = None if not max_bytes_per_s else _Pacer(max_bytes_per_s)
        self.source = source
        self.token = token
        self.fault = fault
        self._fault_lock = threading.Lock()
        self._faults_left = None if fault is None else fault.count
        self.requests = 0
        self.bytes_served = 0
        self.pieces_served = 0

    def handle_error(self, request, client_address) -> None:
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return  # a fetcher hung up (done, or gave up on us): nothing to report
        super().handle_error(request, client_address)

    def take_fault(self) -> Fault | None:
        if self.fault is None:
            return None
        with self._fault_lock:
            if self._faults_left is None:
                return self.fault
            if self._faults_left <= 0:
                return None
            self._faults_left -= 1
            return self.fault


class PeerServer:
    """Serves `source`'s latest snapshot on host:port (loopback, any free port by default).

    `host` is the bind address (an IPv4/IPv6 literal or a name; 0.0.0.0 or ::
    for every interface); `advertise_host` is the host put in :attr:`url`,
    the address peers fetch from (empty: the bound host).

    `max_bytes_per_s` caps what this replica spends on serving (all fetchers
    together), so that feeding a rejoining peer cannot slow its own training
    steps beyond a budget; a fetcher striping over several capped peers still
    gets their sum."""

    def __init__(
        self,
        source: SnapshotSource,
        token: str,
        host: str = LOOPBACK,
        port: int = 0,
        fault: Fault | None = None,
        max_bytes_per_s: float | None = None,
        advertise_host: str = "",
    ):
        if not token:
            raise ValueError("the peer server needs a non-empty shared-secret token")
        if max_bytes_per_s is not None and max_bytes_per_s <= 0:
            raise ValueError(f"max_bytes_per_s must be > 0 (or None for no cap), got {max_bytes_per_s}")
        # Checked before binding: a wildcard with nothing to advertise is refused up front.
        if advertise_host:
            check_host(advertise_host)
        elif is_wildcard(host):
            raise ValueError(f"peer server bound to {host!r} (every interface) needs an advertise_host "
                             "that peers can reach")
        self.advertise_host = advertise_host
        self._server = _Server((host, port), source, token.encode(), fault, max_bytes_per_s)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The advertised address peers fetch from: http://HOST:PORT (http://[V6]:PORT)."""
        host, port = self._server.server_address[:2]
        return make_url(self.advertise_host or host, port)

    @property
    def stats(self) -> dict:
        s = self._server
        return {"requests": s.requests, "pieces_served": s.pieces_served, "bytes_served": s.bytes_served}

    def start(self) -> "PeerServer":
        self._thread = threading.Thread(target=self._server.serve_forever, name="fthsdp-peer-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "PeerServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
