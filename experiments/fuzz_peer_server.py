"""atheris harness: the peer server's URL and header parsing, alone and behind a real server.

Most inputs go to the pure parsers (``parse_route`` and ``check_authorization``
in ``fthsdp/checkpoint/peer_server.py``) with arbitrary text: as the server
receives it (bytes decoded as ISO-8859-1, like ``http.server`` does) or any
Unicode. Every few inputs the same bytes are also sent, as a raw HTTP request
over a real socket, to a real ``PeerServer`` serving a small real snapshot.

What must hold: the parsers never raise; a route's step/leaf/piece are
non-negative ints; a refusal is 400/401/403/404 with a message; the
authorization check accepts exactly ``Bearer <token>``; the real server
answers every request with an HTTP status line (or closes a request it cannot
parse) within its deadline, and keeps serving the manifest to a well-formed
request. HTTP statuses seen are recorded in ``$FTHSDP_FUZZ_STATS`` (JSON).

Run by ``experiments/fuzz.py`` (``-runs=N -seed=S`` are libFuzzer's flags).
"""

from __future__ import annotations

import collections
import json
import os
import re
import socket
import sys

import atheris
import numpy as np

from fthsdp.checkpoint import peer_server as ps
from fthsdp.checkpoint.snapshot import Snapshotter

TOKEN = "fuzz-token-0123456789abcdef"
SERVER_EVERY = 8  # every Nth input also goes to the real server
SOCKET_TIMEOUT_S = 5.0
_STATUS_LINE = re.compile(rb"^HTTP/1\.[01] (\d{3}) ")


class _State:
    def __init__(self) -> None:
        state = {"w": np.arange(64, dtype=np.float32), "b": np.ones(3, np.float32)}
        self.snapshotter = Snapshotter(piece_bytes=64)
        snap = self.snapshotter.take(7, state)
        self.server = ps.PeerServer(ps.StaticSource(snap), TOKEN).start()
        host, port = self.server.url.removeprefix("http://").rsplit(":", 1)
        self.addr = (host, int(port))
        self.statuses: collections.Counter[str] = collections.Counter()
        self.routes: collections.Counter[str] = collections.Counter()
        self.inputs = 0
        self.runs = int(os.environ.get("FTHSDP_FUZZ_RUNS", "0"))
        self.stats_path = os.environ.get("FTHSDP_FUZZ_STATS", "")

    def dump(self) -> None:
        if not self.stats_path:
            return
        tmp = self.stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"inputs": self.inputs, "http_statuses": dict(self.statuses),
                       "parse_route_results": dict(self.routes)}, f, indent=1)
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
        assert v is None or (isinstance(v, int) and v >= 0), r
    assert (r.kind == "piece") == (r.leaf is not None and r.piece is not None and r.step is not None), r
    STATE.routes[r.kind] += 1


def _check_auth(header: str) -> None:
    token = TOKEN.encode()
    r = ps.check_authorization(header, token)
    scheme, _, given = header.partition(" ")
    ok = scheme == "Bearer" and given.strip().encode("utf-8", "surrogateescape") == token
    assert (r is None) == ok, (header, r)
    assert r is None or (r.status in (401, 403) and r.error), r


def _http(state: _State, request: bytes) -> int | str | None:
    """Sends one raw request; the status code, "no status line" for an HTTP/0.9-style answer, or
    None if the server closed without answering. A server that neither answers nor closes within
    the socket timeout fails the run (socket.timeout)."""
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
    if m:
        return int(m.group(1))
    if data:
        # http.server answers a request line without a (valid) version as HTTP/0.9: the bare body
        # (our JSON, a manifest, or its own error page), no status line.
        return "no status line"
    return None


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


def test_one_input(data: bytes) -> None:
    global STATE
    if STATE is None:
        STATE = _State()
    state = STATE
    fdp = atheris.FuzzedDataProvider(data)
    as_unicode = fdp.ConsumeBool()
    with_token = fdp.ConsumeIntInRange(0, 2)
    shape = fdp.ConsumeIntInRange(0, 3)
    raw_path = _path(fdp, shape)
    raw_header = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 100))
    path = raw_path.decode("iso-8859-1") if not as_unicode else fdp.ConsumeUnicode(100)
    header = raw_header.decode("iso-8859-1") if not as_unicode else fdp.ConsumeUnicode(60)
    if with_token == 1:
        header = f"Bearer {TOKEN}"
    _check_route(path)
    _check_auth(header)
    state.inputs += 1
    if state.inputs % SERVER_EVERY == 0:
        if with_token == 2:  # arbitrary bytes as the whole request head
            request = raw_path + b"\r\n" + raw_header + b"\r\n\r\n"
        else:
            request = (b"GET " + raw_path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: "
                       + header.encode("utf-8", "surrogateescape") + b"\r\nConnection: close\r\n\r\n")
        status = _http(state, request)
        state.statuses["closed" if status is None else str(status)] += 1
        probe = _http(state, (f"GET /v1/manifest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                              "Connection: close\r\n\r\n").encode())
        assert probe == 200, f"the peer server stopped serving its manifest (status {probe})"
    if state.inputs % 200 == 0 or state.inputs >= state.runs - 2:
        state.dump()


def main() -> None:
    for fn in (ps.parse_route, ps.check_authorization, ps._nonnegative):
        setattr(ps, fn.__name__, atheris.instrument_func(fn))
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
