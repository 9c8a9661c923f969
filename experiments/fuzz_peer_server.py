"""atheris harness: the peer server's request parsing, alone and behind a real server.

Most inputs go to the pure parsers of ``fthsdp/checkpoint/``: ``parse_head``
(``http_head.py``: the request line, headers, limits, HTTP/0.9),
``parse_route`` (``peer_server.py``) and ``parse_credential`` /
``check_request`` (``peer_auth.py``: the signed Authorization header), with
arbitrary bytes or text, and with heads shaped like real requests so every
branch is reached. Every few inputs the same bytes are also sent, as a raw
HTTP request over a real socket, to a real ``PeerServer`` serving a small
real snapshot, sometimes correctly signed with the job's peer key.

What must hold: the parsers never raise; a parsed head has a GET method, an
absolute visible-ASCII target and a version of HTTP/1.0 or 1.1, and
respects every limit; a route's step/leaf/piece are non-negative ints; a
refusal carries a status and a message; a credential is accepted only when it
is a signature of this very request with the key, and only once (a replay is
refused); the real server answers every request with an HTTP/1.1 status line
(never a bare HTTP/0.9 body: a finding of this fuzzer) or closes a request
that never completed, within its deadline, and keeps serving the manifest to
a well-formed signed request. HTTP statuses seen are recorded in
``$FTHSDP_FUZZ_STATS`` (JSON).

Run by ``experiments/fuzz.py`` (``-runs=N -seed=S`` are libFuzzer's flags).
"""

from __future__ import annotations

import collections
import json
import os
import re
import socket
import sys
import time

import atheris
import numpy as np

from fthsdp.checkpoint import http_head as hh
from fthsdp.checkpoint import peer_auth as pa
from fthsdp.checkpoint import peer_server as ps
from fthsdp.checkpoint.snapshot import Snapshotter

KEY = b"fuzz-peer-key-0123456789abcdef!!"
SERVER_EVERY = 8  # every Nth input also goes to the real server
SOCKET_TIMEOUT_S = 5.0
LIMITS = hh.HeadLimits(max_request_line=256, max_head_bytes=1024, max_headers=8, max_header_line=256)
_STATUS_LINE = re.compile(rb"^HTTP/1\.1 (\d{3}) ")


class _State:
    def __init__(self) -> None:
        state = {"w": np.arange(64, dtype=np.float32), "b": np.ones(3, np.float32)}
        self.snapshotter = Snapshotter(piece_bytes=64)
        snap = self.snapshotter.take(7, state)
        self.server = ps.PeerServer(ps.StaticSource(snap), KEY, limits=ps.ServerLimits(head=LIMITS)).start()
        self.authority = self.server.url.removeprefix("http://")
        host, port = self.authority.rsplit(":", 1)
        self.addr = (host, int(port))
        self.cache = pa.ReplayCache(pa.CLOCK_WINDOW_S, capacity=256)
        self.statuses: collections.Counter[str] = collections.Counter()
        self.routes: collections.Counter[str] = collections.Counter()
        self.heads: collections.Counter[str] = collections.Counter()
        self.credentials: collections.Counter[str] = collections.Counter()
        self.inputs = 0
        self.runs = int(os.environ.get("FTHSDP_FUZZ_RUNS", "0"))
        self.stats_path = os.environ.get("FTHSDP_FUZZ_STATS", "")

    def dump(self) -> None:
        if not self.stats_path:
            return
        tmp = self.stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"inputs": self.inputs, "http_statuses": dict(self.statuses),
                       "parse_route_results": dict(self.routes), "parse_head_results": dict(self.heads),
                       "credential_results": dict(self.credentials),
                       "server_refusals": self.server.stats["refused"]}, f, indent=1)
        os.replace(tmp, self.stats_path)


STATE: _State | None = None


def _check_route(path: str) -> None:
    r = ps.parse_route(path)
    if isinstance(r, ps.Refusal):
        assert r.status in (400, 404) and r.error, r
        STATE.routes[f"refused {r.status}"] += 1
        return
    assert isinstance(r, ps.Route) and r.kind in ("manifest", "piece"), r
    for v in (r.step, r.leaf, r.piece):
        assert v is None or (type(v) is int and v >= 0), r
    assert (r.kind == "piece") == (r.leaf is not None and r.piece is not None and r.step is not None), r
    STATE.routes[r.kind] += 1


def _check_head(raw: bytes) -> None:
    r = hh.parse_head(raw, LIMITS)
    if r is None:
        assert hh.head_end(raw) < 0 and len(raw) <= LIMITS.max_head_bytes, raw[:80]
        STATE.heads["incomplete"] += 1
        return
    if isinstance(r, hh.Refusal):
        assert r.status in (400, 405, 413, 414, 431, 505) and r.error, r
        STATE.heads[f"refused {r.status}"] += 1
        return
    assert r.method == "GET" and r.target.startswith("/") and r.version in ("HTTP/1.0", "HTTP/1.1"), r
    assert all(0x21 <= ord(c) <= 0x7E for c in r.target), r
    assert 0 < r.head_bytes <= min(len(raw), LIMITS.max_head_bytes), r
    assert len(r.headers) <= LIMITS.max_headers and all(k == k.lower() for k in r.headers), r
    assert r.version == "HTTP/1.0" or "host" in r.headers, r
    STATE.heads["request"] += 1


def _check_credential(header: str, method: str, target: str, signed: bool) -> None:
    state = STATE
    r = pa.parse_credential(header)
    assert isinstance(r, (pa.Credential, pa.Refusal)), r
    now = time.time()
    got = pa.check_request(header, KEY, method, state.authority, target, now, state.cache)
    if signed:  # a correct signature of this request: accepted once, then refused as a replay
        assert got is None, got
        again = pa.check_request(header, KEY, method, state.authority, target, now, state.cache)
        assert isinstance(again, pa.Refusal) and again.status == 403 and "nonce already used" in again.error, again
        other = pa.check_request(header, KEY, method, state.authority, target + "x", now, state.cache)
        assert isinstance(other, pa.Refusal) and other.status == 403, other  # not valid for another resource
        state.credentials["accepted once"] += 1
    else:  # arbitrary text is never a valid signature
        assert isinstance(got, pa.Refusal) and got.status in (401, 403) and got.error, (header, got)
        state.credentials[f"refused {got.status}"] += 1


def _http(state: _State, request: bytes) -> int | None:
    """Sends one raw request; the status code, or None if the server closed without answering (a
    head it never saw end). A server that neither answers nor closes within the socket timeout
    fails the run (socket.timeout); an answer without an HTTP/1.1 status line fails it too."""
    with socket.create_connection(state.addr, timeout=SOCKET_TIMEOUT_S) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)  # socket.timeout here = the server hung: fails the run
            if not chunk:
                break
            data += chunk
    m = _STATUS_LINE.match(data)
    assert m or not data, f"answer without an HTTP/1.1 status line (HTTP/0.9 style?): {data[:80]!r}"
    return int(m.group(1)) if m else None


def _component(fdp: atheris.FuzzedDataProvider) -> bytes:
    """A path component: mostly a small number (reaches the serving code), else anything."""
    pick = fdp.ConsumeIntInRange(0, 3)
    if pick < 2:
        return str(fdp.ConsumeIntInRange(0, 9) if pick == 0 else fdp.ConsumeInt(8)).encode()
    return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 30))


def _path(fdp: atheris.FuzzedDataProvider, shape: int) -> bytes:
    """A request path shaped like each route (so every branch is reached), or raw bytes."""
    if shape == 0:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 200))
    if shape == 1:
        return b"/v1/manifest" + fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 20))
    if shape == 2:
        return b"/v1/snapshot/" + _component(fdp) + b"/manifest"
    return (b"/v1/snapshot/" + (b"7" if fdp.ConsumeBool() else _component(fdp)) + b"/leaf/" + _component(fdp)
            + b"/piece/" + _component(fdp))


_LINE_SHAPES = (b"GET %s HTTP/1.1", b"GET %s", b"GET %s HTTP/0.9", b"GET %s HTTP/2.0", b"POST %s HTTP/1.1",
                b"GET  %s HTTP/1.1", b"%s", b"GET %s HTTP/1.0")


def _request(fdp: atheris.FuzzedDataProvider, state: _State, raw_path: bytes, auth: bytes) -> bytes:
    """A request head: a (possibly broken) request line, Host, Authorization, and extra headers."""
    line = _LINE_SHAPES[fdp.ConsumeIntInRange(0, len(_LINE_SHAPES) - 1)].replace(b"%s", raw_path)
    host = fdp.ConsumeBytes(20) if fdp.ConsumeIntInRange(0, 3) == 3 else state.authority.encode()
    headers = [b"Host: " + host, b"Authorization: " + auth]
    for i in range(fdp.ConsumeIntInRange(0, 10) if fdp.ConsumeIntInRange(0, 3) == 0 else 0):
        raw = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 40))
        # mostly a well-formed field with any visible value (reaches the later checks), else raw bytes
        headers.append(b"X-F%d: " % i + bytes(c for c in raw if 0x20 <= c < 0x7F) if fdp.ConsumeBool() else raw)
    sep = b"\n" if fdp.ConsumeIntInRange(0, 7) == 7 else b"\r\n"
    return sep.join([line, *headers, b"Connection: close"]) + sep + sep


def test_one_input(data: bytes) -> None:
    global STATE
    if STATE is None:
        STATE = _State()
    state = STATE
    fdp = atheris.FuzzedDataProvider(data)
    as_unicode = fdp.ConsumeBool()
    # (choices are rotated so that an all-zero input, libFuzzer's first, is a valid signed request)
    with_key = (fdp.ConsumeIntInRange(0, 2) + 1) % 3  # 0: arbitrary header, 1: signed with the key, 2: arbitrary head
    shape = (fdp.ConsumeIntInRange(0, 3) + 1) % 4
    raw_path = _path(fdp, shape)
    raw_header = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 120))
    path = raw_path.decode("iso-8859-1") if not as_unicode else fdp.ConsumeUnicode(100)
    header = raw_header.decode("iso-8859-1") if not as_unicode else fdp.ConsumeUnicode(60)
    if with_key == 1:
        header = pa.sign(KEY, "GET", state.authority, path)
    _check_route(path)
    _check_credential(header, "GET", path, signed=with_key == 1)
    head = (raw_path + b"\r\n" + raw_header + b"\r\n\r\n" if with_key == 2
            else _request(fdp, state, raw_path, header.encode("utf-8", "surrogatepass")))
    _check_head(head)
    _check_head(head[: fdp.ConsumeIntInRange(0, len(head))])  # a head cut anywhere: incomplete, or refused early
    state.inputs += 1
    if state.inputs % SERVER_EVERY == 0:
        if with_key == 1:  # sign afresh: the pure check above already spent this nonce
            fresh = pa.sign(KEY, "GET", state.authority, raw_path.decode("iso-8859-1"))
            head = (b"GET " + raw_path + b" HTTP/1.1\r\nHost: " + state.authority.encode() + b"\r\nAuthorization: "
                    + fresh.encode() + b"\r\nConnection: close\r\n\r\n")
        status = _http(state, head)
        state.statuses["closed" if status is None else str(status)] += 1
        probe_path = "/v1/manifest"
        probe = _http(state, (f"GET {probe_path} HTTP/1.1\r\nHost: {state.authority}\r\nAuthorization: "
                              f"{pa.sign(KEY, 'GET', state.authority, probe_path)}\r\nConnection: close\r\n\r\n"
                              ).encode())
        assert probe == 200, f"the peer server stopped serving its manifest (status {probe})"
    if state.inputs % 200 == 0 or state.inputs >= state.runs - 2:
        state.dump()


def main() -> None:
    for mod, names in ((ps, ("parse_route", "_nonnegative")), (hh, ("parse_head", "check_partial", "_request_line")),
                       (pa, ("parse_credential", "check_request"))):
        for name in names:
            setattr(mod, name, atheris.instrument_func(getattr(mod, name)))
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
