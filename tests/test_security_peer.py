"""Attacks on the peer state server, replayed over real sockets (issue 13): each is refused with its
reason, the server keeps serving, and a real job rejoining through attacked servers is unharmed.

The attacker is this test process: idle connections by the hundred from several loopback
addresses, a slowloris head, missing, wrong, replayed and re-targeted credentials, a peer of
another job, path traversal, HTTP/0.9, garbage and resets, TLS without the right CA.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import pathlib
import shutil
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from fthsdp.checkpoint.peer_auth import sign
from fthsdp.checkpoint.peer_fetch import FetchError, PeerFetcher
from fthsdp.checkpoint.peer_server import PeerServer, ServerLimits, StaticSource, TLSFiles, peer_key
from fthsdp.checkpoint.snapshot import Snapshotter
from fthsdp.control import auth
from fthsdp.timeouts import Timeouts, TimeoutsError

STEP = 9
PIECE = 64 << 10
LIGHTHOUSE_SECRET = b"s" * 32
KEY = peer_key(auth.job_key(LIGHTHOUSE_SECRET, "job-a"))
OTHER_JOB_KEY = peer_key(auth.job_key(LIGHTHOUSE_SECRET, "job-b"))  # same lighthouse, another job


def make_state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((512, 512)).astype(np.float32), "b": rng.standard_normal(77).astype(np.float32)}


def same(tree, ref) -> bool:
    return all(np.asarray(tree[k]).tobytes() == ref[k].tobytes() for k in ref)


@pytest.fixture(scope="module")
def snap():
    return Snapshotter(piece_bytes=PIECE).take(STEP, make_state())


@pytest.fixture
def server(snap):
    with PeerServer(StaticSource(snap), KEY) as s:
        yield s


def authority(url: str) -> str:
    return url.split("://", 1)[1]


def raw(url: str, data: bytes, timeout: float = 5.0, source: str = "") -> bytes:
    """Sends `data` on a fresh connection and returns everything the server says before closing."""
    host, port = authority(url).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout,
                                  source_address=(source, 0) if source else None) as s:
        s.sendall(data)
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def signed_request(url: str, path: str, key: bytes = KEY, method: str = "GET", close: bool = True, **kw) -> bytes:
    a = authority(url)
    return (f"{method} {path} HTTP/1.1\r\nHost: {a}\r\nAuthorization: {sign(key, method, a, path, **kw)}\r\n"
            f"{'Connection: close' if close else 'X-Keep: 1'}\r\n\r\n").encode()


def status_and_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), answer[:100]
    status = int(head.split()[1])
    return status, (json.loads(body)["error"] if status != 200 else "")


# -- credentials ----------------------------------------------------------------------------------


def test_missing_wrong_replayed_retargeted_and_other_jobs_credentials_are_refused(server, snap, caplog):
    caplog.set_level(logging.WARNING, "fthsdp.checkpoint.peer_server")
    url, path = server.url, "/v1/manifest"
    assert status_and_error(raw(url, signed_request(url, path)))[0] == 200
    # missing, and the old bearer scheme (a token that travels can be replayed)
    s, e = status_and_error(raw(url, f"GET {path} HTTP/1.1\r\nHost: {authority(url)}\r\n\r\n".encode()))
    assert s == 401 and "missing credential" in e
    s, e = status_and_error(raw(url, f"GET {path} HTTP/1.1\r\nHost: {authority(url)}\r\n"
                                     "Authorization: Bearer whatever\r\n\r\n".encode()))
    assert s == 401 and "bearer tokens are not accepted" in e
    # a peer of another job, on the same lighthouse: its key differs
    s, e = status_and_error(raw(url, signed_request(url, path, key=OTHER_JOB_KEY)))
    assert s == 403 and "another job" in e
    with pytest.raises(FetchError, match="403: wrong credential"):
        PeerFetcher([url], OTHER_JOB_KEY, step=STEP, timeout_s=5).fetch()
    # an eavesdropper's copy of a real request: replayed as is, then for another piece, then to another server
    captured = signed_request(url, f"/v1/snapshot/{STEP}/leaf/0/piece/0")
    assert status_and_error(raw(url, captured))[0] == 200
    s, e = status_and_error(raw(url, captured))
    assert s == 403 and "nonce already used" in e
    retargeted = captured.replace(b"piece/0 HTTP", b"piece/1 HTTP")
    s, e = status_and_error(raw(url, retargeted))
    assert s == 403 and "wrong credential" in e
    fresh = signed_request(url, path)
    with PeerServer(StaticSource(snap), KEY) as other:
        s, e = status_and_error(raw(other.url, fresh))  # same job, same key: but addressed to the first server
        assert s == 403 and "addressed to" in e
    # an old signature (outside the clock window) and a malformed one
    s, e = status_and_error(raw(url, signed_request(url, path, ts_ms=int((time.time() - 3600) * 1000))))
    assert s == 401 and "from this peer server's clock" in e
    s, e = status_and_error(raw(url, f"GET {path} HTTP/1.1\r\nHost: {authority(url)}\r\nAuthorization: "
                                     "FTHSDP-HMAC-SHA256 ts=1,nonce=zz,mac=00\r\n\r\n".encode()))
    assert s == 401 and "malformed" in e
    refused = server.stats["refused"]
    assert refused["credential"] == 8 and "wrong host" not in refused, refused
    # refusals are logged with their reason, once per kind and address (then counted, so that a flood
    # cannot flood the log), never with a traceback
    lines = [r.getMessage() for r in caplog.records if "peer server refused" in r.getMessage()]
    assert any("refused credential from 127.0.0.1: 401 missing credential" in m for m in lines), lines
    assert len([m for m in lines if "refused credential" in m]) == 1
    assert all(r.exc_info is None for r in caplog.records)


def test_path_traversal_and_junk_routes_serve_nothing(server):
    url = server.url
    for path, status in (("/v1/snapshot/../../../etc/passwd", 404), (f"/v1/snapshot/{STEP}/leaf/../piece/0", 400),
                         ("/v1/snapshot/%2e%2e/manifest", 400), ("/../v1/manifest", 404),
                         (f"/v1/snapshot/{STEP}/leaf/+1/piece/0", 400), (f"/v1/snapshot/{STEP}/leaf/1_0/piece/0", 400),
                         ("/etc/passwd", 404)):
        s, e = status_and_error(raw(url, signed_request(url, path)))
        assert s == status and e, (path, s, e)
    s, e = status_and_error(raw(url, b"GET //etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert s == 403  # unauthenticated: refused before any route is looked at


def test_http09_and_malformed_heads_get_400_with_a_reason(server):
    url = server.url
    s, e = status_and_error(raw(url, b"GET /v1/manifest\r\n"))  # HTTP/0.9: answered at once, with a status line
    assert s == 400 and "HTTP/0.9" in e
    for data, status, words in ((b"GET /v1/manifest HTTP/0.9\r\n\r\n", 400, "HTTP/0.9"),
                                (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40) + b"\r\n", 400, "malformed"),
                                (b"GET /v1/manifest HTTP/1.1\r\n" + b"X: y\r\n" * 100 + b"\r\n", 431, "header fields"),
                                (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n", 414, "request line"),
                                (b"POST /v1/manifest HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n", 405, "read-only"),
                                (b"GET /v1/manifest HTTP/1.1\r\nHost: a\r\nContent-Length: 99999\r\n\r\n", 413, "bodies"),
                                (b"GET /v1/manifest HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n", 400, "folded")):
        s, e = status_and_error(raw(url, data))
        assert s == status and words in e, (data[:30], s, e)
    assert status_and_error(raw(url, signed_request(url, "/v1/manifest")))[0] == 200


def test_garbage_and_resets_never_stop_the_server(server, caplog):
    caplog.set_level(logging.DEBUG, "fthsdp.checkpoint.peer_server")
    url = server.url
    rng = np.random.default_rng(3)
    host, port = authority(url).rsplit(":", 1)
    for i in range(60):
        s = socket.create_connection((host, int(port)), timeout=5)
        if i % 3 == 0:
            s.sendall(rng.bytes(int(rng.integers(1, 3000))))
        elif i % 3 == 1:  # a real piece request, then a reset (RST) before the body is read
            s.sendall(signed_request(url, f"/v1/snapshot/{STEP}/leaf/0/piece/{i % 10}", close=False))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
    got = PeerFetcher([url], KEY, step=STEP, timeout_s=5).fetch(like=make_state())
    assert same(got, make_state())
    assert all(r.exc_info is None and "Traceback" not in r.getMessage() for r in caplog.records)


# -- connection limits ----------------------------------------------------------------------------


def _hold(url: str, n: int, sources: list[str], partial_every: int = 4) -> list[socket.socket]:
    """Opens `n` connections spread over `sources` and keeps them: most idle, some mid-head."""
    host, port = authority(url).rsplit(":", 1)
    held = []
    for i in range(n):
        try:
            s = socket.create_connection((host, int(port)), timeout=5, source_address=(sources[i % len(sources)], 0))
        except OSError:
            continue  # refused at the door: fine, that is a limit working
        if i % partial_every == 0:
            with contextlib.suppress(OSError):
                s.sendall(b"GET /v1/manifest HTTP/1.1\r\nHo")
        held.append(s)
    return held


def test_500_idle_connections_do_not_starve_a_fetch_and_cost_no_threads(snap):
    limits = ServerLimits()
    attackers = [f"127.0.0.{i}" for i in range(2, 12)] + ["127.0.0.1"]
    with PeerServer(StaticSource(snap), KEY) as server:
        threads_before = threading.active_count()
        held = _hold(server.url, 500, attackers)
        try:
            time.sleep(0.5)  # let the server take them all in
            assert threading.active_count() - threads_before < 5  # no thread per connection any more
            assert server.stats["open_connections"] <= limits.max_connections
            t0 = time.monotonic()
            session = PeerFetcher([server.url], KEY, step=STEP, timeout_s=5).start()
            session.wait(timeout=20)  # the fetch's deadline, while all 500 are still held by the attacker
            assert same(session.tree(like=make_state()), make_state()) and session.retries == 0
            assert time.monotonic() - t0 < 20
            refused = server.stats["refused"]
            assert refused.get("evicted", 0) + refused.get("per-address limit", 0) >= 500 - limits.max_connections
        finally:
            for s in held:
                s.close()


def test_per_address_cap_and_idle_timeout(snap):
    t = Timeouts(peer_header_s=1.0, peer_idle_s=2.0)
    with PeerServer(StaticSource(snap), KEY, timeouts=t, limits=ServerLimits(max_per_ip=8)) as server:
        held = _hold(server.url, 20, ["127.0.0.7"], partial_every=10**9)
        try:
            time.sleep(0.3)
            assert server.stats["open_connections"] == 8  # the older 12 were closed for the newer
            deadline = time.monotonic() + 10
            while server.stats["open_connections"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert server.stats["open_connections"] == 0 and server.stats["refused"]["idle"] == 8
        finally:
            for s in held:
                s.close()


def test_slowloris_one_header_byte_a_second_is_cut(snap):
    t = Timeouts(peer_header_s=2.5, peer_idle_s=5.0)
    with PeerServer(StaticSource(snap), KEY, timeouts=t) as server:
        host, port = authority(server.url).rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=10)
        t0 = time.monotonic()
        answer = b""
        try:
            for b in b"GET /v1/manifest HTTP/1.1\r\nHost: 127.0.0.1\r\n":
                s.sendall(bytes([b]))
                time.sleep(1.0)
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    answer += s.recv(4096)
                s.setblocking(True)
                if answer:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            s.close()
        cut_after = time.monotonic() - t0
        assert answer.startswith(b"HTTP/1.1 408") and b"ft.peer_header_s" in answer, answer
        assert cut_after < 2.5 + 2.5, cut_after
        assert server.stats["refused"]["slow request head"] == 1


def test_timeouts_order_is_checked():
    with pytest.raises(TimeoutsError, match="ft.peer_header_s=40 must be < ft.peer_idle_s=30"):
        Timeouts(peer_header_s=40.0).check()
    with pytest.raises(TimeoutsError, match="credential clock"):
        Timeouts(peer_header_s=31.0, peer_idle_s=60.0).check()


# -- TLS --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> pathlib.Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (Debian: apt-get install openssl)")
    d = tmp_path_factory.mktemp("certs")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=fthsdp test peer", "-addext",
                    "subjectAltName=IP:127.0.0.1", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                   check=True, capture_output=True, timeout=60)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=someone else", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(d / "other-key.pem"), "-out", str(d / "other.pem")],
                   check=True, capture_output=True, timeout=60)
    return d


def test_tls_fetch_verifies_the_server_and_refuses_strangers(snap, certs):
    tls = TLSFiles(str(certs / "cert.pem"), str(certs / "key.pem"))
    with PeerServer(StaticSource(snap), KEY, tls=tls) as server:
        assert server.url.startswith("https://127.0.0.1:")
        got = PeerFetcher([server.url], KEY, step=STEP, tls_ca_file=str(certs / "cert.pem")).fetch(like=make_state())
        assert same(got, make_state())
        # a server whose certificate this CA did not sign (an impostor) is not trusted
        with pytest.raises(FetchError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            PeerFetcher([server.url], KEY, step=STEP, timeout_s=5, tls_ca_file=str(certs / "other.pem")).fetch()
        # plain HTTP to the TLS port: the handshake fails, the server says why once and goes on
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            c = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=5)
            c.request("GET", "/v1/manifest")
            c.getresponse().read()
        assert server.stats["refused"].get("TLS handshake", 0) >= 1
        # TLS is no substitute for the key: another job's peer is still refused
        with pytest.raises(FetchError, match="403: wrong credential"):
            PeerFetcher([server.url], OTHER_JOB_KEY, step=STEP, tls_ca_file=str(certs / "cert.pem")).fetch(like=make_state())
    with pytest.raises(ValueError, match="requires TLS"):
        PeerFetcher(["http://127.0.0.1:1"], KEY, tls_ca_file=str(certs / "cert.pem"))
    with pytest.raises(ValueError, match="cannot load certificate"):
        PeerServer(StaticSource(snap), KEY, tls=TLSFiles(str(certs / "missing.pem"), str(certs / "key.pem")))


def test_peer_tls_config_is_checked_before_anything_starts(certs):
    from fthsdp.config import ConfigError, load

    cfg = load("base", [f"ft.peer_tls_cert={certs / 'cert.pem'}", f"ft.peer_tls_key={certs / 'key.pem'}",
                        f"ft.peer_tls_ca={certs / 'cert.pem'}"]).validate()
    assert cfg.ft.peer_tls_ca.endswith("cert.pem")
    with pytest.raises(ConfigError, match="ft.peer_tls_cert given without the rest"):
        load("base", [f"ft.peer_tls_cert={certs / 'cert.pem'}"]).validate()
    with pytest.raises(ConfigError, match="ft.peer_tls_key=.*not a readable file"):
        load("base", [f"ft.peer_tls_key={certs / 'nope.pem'}"]).validate()


# -- a real job, rejoining through attacked peer servers -------------------------------------------


class Attacker(threading.Thread):
    """Holds `per_server` idle connections (some with half a request head) to every URL it is given,
    from several loopback addresses, and keeps topping them up as the servers close them."""

    SOURCES = [f"127.0.0.{i}" for i in range(20, 25)]

    def __init__(self, per_server: int):
        super().__init__(daemon=True)
        self.per_server = per_server
        self.urls: list[str] = []
        self.held: dict[str, list[socket.socket]] = {}
        self.opened = 0
        self.stop = threading.Event()

    def run(self) -> None:
        import select

        while not self.stop.is_set():
            for url in list(self.urls):
                socks = self.held.setdefault(url, [])
                readable = select.select(socks, [], [], 0)[0] if socks else []
                for s in readable:  # the server answered (a refusal) or closed it: replace it
                    socks.remove(s)
                    s.close()
                new = _hold(url, self.per_server - len(socks), self.SOURCES)
                self.opened += len(new)
                socks.extend(new)
            self.stop.wait(1.0)
        for socks in self.held.values():
            for s in socks:
                s.close()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["http", "https"])
def test_rejoin_fetches_through_survivors_held_by_an_attacker(tmp_path, scheme, request):
    """Over plain HTTP (requests signed), and over HTTPS configured as an operator would (ft.peer_tls_*)."""
    from test_rejoin import exactly_once, job  # a real LocalJob: lighthouse, 3 replicas, FTAR, SIGKILL

    from fthsdp.launch import report

    attacker = Attacker(per_server=300)  # above the server's 256-connection cap: the limits are exercised
    attacker.start()
    found = threading.Event()

    def watch() -> None:  # the survivors' peer servers, from their status files, as soon as they exist
        while not found.is_set() and not attacker.stop.is_set():
            urls = []
            for rid in ("0", "2"):
                with contextlib.suppress(OSError, ValueError):
                    urls.append(json.loads((tmp_path / "run" / f"status-{rid}.json").read_text())["peer_server"])
            if len(urls) == 2:
                attacker.urls = urls
                found.set()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        tls = []
        if scheme == "https":
            d = request.getfixturevalue("certs")
            tls = [f"ft.peer_tls_cert={d / 'cert.pem'}", f"ft.peer_tls_key={d / 'key.pem'}",
                   f"ft.peer_tls_ca={d / 'cert.pem'}"]
        # 200 steps of >= 0.2 s after a kill at step 10: room for a slow restart on a loaded machine
        s = job(tmp_path / "run", steps=200, kills=["1@10"], extra=[*tls, "train.min_step_s=0.2"]).run()
    finally:
        attacker.stop.set()
        attacker.join(10)
    assert found.is_set() and attacker.opened >= 600, attacker.opened
    out = tmp_path / "run"
    run = report.load_run(out)
    assert all(u.startswith(f"{scheme}://") for u in attacker.urls), attacker.urls
    assert s["failed_replicas"] == [] and sorted(run.done) == ["0", "1", "2"]
    assert s["identical_final_state"], s["final_hashes"]
    catch_up = [r for r in run.steps["1"] if not r["healthy"]]
    assert catch_up and any("caught up" in e for e in catch_up[0]["events"])
    exactly_once(out, run)
    assert "fetched state of step" in (out / "replica-1.log").read_text()  # from its peers, not from disk
    # the attack reached the survivors' servers, which refused it with reasons and no traceback
    for rid in ("0", "2"):
        text = (out / f"replica-{rid}.log").read_text()
        assert "peer server refused" in text, rid
        assert "Traceback" not in text, rid
