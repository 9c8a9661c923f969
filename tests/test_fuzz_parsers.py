"""The peer server's request-head, URL and credential parsers, property-tested with hypothesis on every CI run.

The same functions are fuzzed (coverage-guided, alone and behind a real
server) by experiments/fuzz.py; these properties run in a second without any
fuzzing toolchain.
"""

from __future__ import annotations

import time

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the 'test' extra")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fthsdp.checkpoint.http_head import HeadLimits, Request, head_end, parse_head  # noqa: E402
from fthsdp.checkpoint.peer_auth import CLOCK_WINDOW_S, SCHEME, ReplayCache, check_request, sign  # noqa: E402
from fthsdp.checkpoint.peer_server import Refusal, Route, parse_route  # noqa: E402

_component = st.one_of(st.integers(-5, 10**30).map(str), st.text(max_size=12))


@settings(max_examples=400, deadline=None)
@given(st.one_of(
    st.text(max_size=80),
    st.builds(lambda s: f"/v1/snapshot/{s}/manifest", _component),
    st.builds(lambda a, b, c, q: f"/v1/snapshot/{a}/leaf/{b}/piece/{c}{q}", _component, _component, _component,
              st.sampled_from(["", "?x=1", "?"])),
))
def test_parse_route_never_raises_and_routes_only_nonnegative_ints(path):
    r = parse_route(path)
    if isinstance(r, Refusal):
        assert r.status in (400, 404) and r.error
    else:
        assert isinstance(r, Route)
        assert all(v is None or (type(v) is int and v >= 0) for v in (r.step, r.leaf, r.piece))
        assert r.kind == "manifest" or None not in (r.step, r.leaf, r.piece)


_KEY = b"k" * 32
_AUTHORITY = "127.0.0.1:4242"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.text(max_size=120), st.builds(lambda t: f"{SCHEME} {t}", st.text(max_size=140)),
                 st.builds(lambda t: f"Bearer {t}", st.text(max_size=30))),
       st.text(max_size=40))
def test_arbitrary_authorization_is_refused_and_a_signature_only_once_and_only_for_its_request(header, path):
    cache = ReplayCache(CLOCK_WINDOW_S)
    now = time.time()
    r = check_request(header, _KEY, "GET", _AUTHORITY, path, now, cache)
    assert isinstance(r, Refusal) and r.status in (401, 403) and r.error
    signed = sign(_KEY, "GET", _AUTHORITY, path)
    assert check_request(signed, _KEY, "GET", _AUTHORITY, path, now, cache) is None
    again = check_request(signed, _KEY, "GET", _AUTHORITY, path, now, cache)
    assert again is not None and again.status == 403 and "already used" in again.error
    for method, host, target, key in (("GET", _AUTHORITY, path + "/", _KEY), ("GET", "127.0.0.2:4242", path, _KEY),
                                      ("POST", _AUTHORITY, path, _KEY), ("GET", _AUTHORITY, path, b"j" * 32)):
        fresh = ReplayCache(CLOCK_WINDOW_S)
        other = check_request(signed, key, method, host, target, now, fresh)
        assert other is not None and other.status == 403 and "wrong credential" in other.error


_LIMITS = HeadLimits(max_request_line=64, max_head_bytes=256, max_headers=4, max_header_line=64)
_LINE = st.one_of(st.binary(max_size=80), st.builds(lambda p, v: b"GET " + p + v, st.binary(max_size=30),
                                                     st.sampled_from([b"", b" HTTP/1.1", b" HTTP/1.0", b" HTTP/0.9",
                                                                      b" HTTP/2.0", b" HTTP/1.1 x"])))
_FIELD = st.one_of(st.binary(max_size=40), st.builds(lambda n, v: n + b": " + v,
                                                     st.sampled_from([b"Host", b"Content-Length", b"X", b"Connection",
                                                                      b"Transfer-Encoding", b"Bad Name"]),
                                                     st.binary(max_size=30)))


@settings(max_examples=500, deadline=None)
@given(_LINE, st.lists(_FIELD, max_size=6), st.sampled_from([b"\r\n", b"\n"]))
def test_parse_head_never_raises_and_accepts_only_bounded_get_requests(line, fields, sep):
    raw = sep.join([line, *fields]) + sep + sep
    for cut in (raw, raw[: len(raw) // 2]):
        r = parse_head(cut, _LIMITS)
        if r is None:
            assert head_end(cut) < 0 and len(cut) <= _LIMITS.max_head_bytes
        elif isinstance(r, Refusal):
            assert r.status in (400, 405, 413, 414, 431, 505) and r.error
        else:
            assert isinstance(r, Request) and r.method == "GET" and r.version in ("HTTP/1.0", "HTTP/1.1")
            assert r.target.startswith("/") and all(0x21 <= ord(c) <= 0x7E for c in r.target)
            assert len(r.headers) <= _LIMITS.max_headers and r.head_bytes <= _LIMITS.max_head_bytes
            assert line.endswith((b" HTTP/1.1", b" HTTP/1.0")) and sep == b"\r\n"


def test_http09_and_malformed_request_lines_are_refused_with_the_reason():
    lim = HeadLimits()
    for raw, status, words in ((b"GET /v1/manifest\r\n", 400, "HTTP/0.9"), (b"GET /v1/manifest HTTP/0.9\r\n", 400, "HTTP/0.9"),
                               (b"GET  /x HTTP/1.1\r\n", 400, "single spaces"), (b"GET x HTTP/1.1\r\n", 400, "target"),
                               (b"GET /x HTTP/3.0\r\n", 505, "not supported"), (b"PUT /x HTTP/1.1\r\n", 405, "read-only"),
                               (b"GET /x HTTP/1.1\n", 400, "CRLF"), (b"G" * 3000, 414, "request line longer")):
        r = parse_head(raw, lim)  # refused as soon as the line is complete, before any header arrives
        assert isinstance(r, Refusal) and r.status == status and words in r.error, (raw[:40], r)
    # a fuzzer finding: a regex anchored with $ let a target end in a newline through
    r = parse_head(b"GET /v1/manifest.\n HTTP/1.1\r\nHost: a\r\n\r\n", lim)
    assert isinstance(r, Refusal) and r.status == 400 and "target" in r.error
    assert isinstance(parse_route("/v1/snapshot/7/manifest\n"), Refusal)
    # another: a lone surrogate outside U+DC80..U+DCFF made signing raise
    cache = ReplayCache(CLOCK_WINDOW_S)
    odd = "/v1/manifes\udd73p"
    assert check_request(sign(_KEY, "GET", _AUTHORITY, odd), _KEY, "GET", _AUTHORITY, odd, time.time(), cache) is None
    r = parse_head(b"GET /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n", lim)
    assert isinstance(r, Refusal) and r.status == 413
    # "\xb2" reads as "²" (ISO-8859-1), a digit to str.isdigit() that int() refuses: it raised
    r = parse_head(b"GET /x HTTP/1.1\r\nHost: a\r\nContent-Length: \xb2\r\n\r\n", lim)
    assert isinstance(r, Refusal) and r.status == 400 and "Content-Length" in r.error
    r = parse_head(b"GET /x HTTP/1.1\r\n" + b"X: y\r\n" * 40 + b"Host: a\r\n\r\n", lim)
    assert isinstance(r, Refusal) and r.status == 431 and "header fields" in r.error
    r = parse_head(b"GET /x?q HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\nGET", lim)
    assert isinstance(r, Request) and r.target == "/x?q" and not r.keep_alive and r.head_bytes == 49


# A snapshot manifest as a lying or broken peer may send it: a real one with one field (or one
# leaf's field) replaced by any JSON value, Python's json extensions (Infinity, NaN) included.
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                  max_size=4), max_leaves=12)


def _honest_manifest() -> dict:
    import json

    import numpy as np

    from fthsdp.checkpoint.snapshot import Snapshotter

    tree = {"a": np.arange(300, dtype=np.float32), "b": np.ones((3, 5), np.int8), "c": np.zeros((0, 2), np.float16)}
    return json.loads(Snapshotter(piece_bytes=256).take(4, tree).manifest.to_json())


_HONEST = _honest_manifest()


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(sorted(_HONEST) + ["leaf.path", "leaf.shape", "leaf.dtype", "leaf.offset", "leaf.nbytes"]),
       st.integers(0, 2), _JSON)
def test_a_manifest_from_a_peer_is_read_whole_or_refused_with_a_snapshot_error(field, leaf, value):
    import copy
    import json

    from fthsdp.checkpoint.snapshot import Manifest, SnapshotError

    d = copy.deepcopy(_HONEST)
    if field.startswith("leaf."):
        d["leaves"][leaf][field[5:]] = value
    else:
        d[field] = value
    try:
        m = Manifest.from_json(json.dumps(d))
    except SnapshotError:
        return
    end = 0  # read: a buffer its leaves could fill, in order, each its shape's bytes
    for spec in m.leaves:
        assert spec.offset >= end and spec.nbytes >= 0
        end = spec.offset + spec.nbytes
    assert m.total_bytes == end and m.piece_bytes > 0
