"""A peer fetch ends when it must, and leaves nothing behind: over real sockets and real HTTP
servers, sources that trickle (a byte within every read's timeout, so no read ever times out)
meet the fetch's deadline and its stall limit, a failed or closed fetch shuts its sockets and
its threads exit at once, one hiccup of a lone source (a cut body, a 503) no longer fails the
fetch, and a peer server closes without waiting on a worker stuck writing to a slow reader."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from fthsdp.checkpoint.peer_auth import sign
from fthsdp.checkpoint.peer_fetch import FetchError, PeerFetcher
from fthsdp.checkpoint.peer_server import Fault, PeerServer, StaticSource
from fthsdp.checkpoint.snapshot import Snapshot, Snapshotter, StaleStepError
from fthsdp.errors import classify

TOKEN = "s3cret-token"
STEP = 12
PIECE = 64 << 10
TRICKLE_S = 0.05  # one byte this often: far inside any read timeout used here


def make_state() -> dict:
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((256, 256)).astype(np.float32), "b": rng.standard_normal(100).astype(np.float32)}


def same(tree: dict, ref: dict) -> bool:
    return all(np.asarray(tree[k]).tobytes() == ref[k].tobytes() for k in ref)


@pytest.fixture(scope="module")
def snap() -> Snapshot:
    return Snapshotter(piece_bytes=PIECE).take(STEP, make_state())


def fetch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fthsdp-fetch-") and t.is_alive()]


def no_fetch_thread_within(seconds: float) -> list[str]:
    """The fetch threads still alive after waiting up to `seconds` for them to go."""
    until = time.monotonic() + seconds
    while fetch_threads() and time.monotonic() < until:
        time.sleep(0.02)
    return fetch_threads()


@contextlib.contextmanager
def trickler(snap: Snapshot, what: str):
    """A real HTTP server that trickles, one byte every TRICKLE_S, either the head of its manifest
    answer (`what="head"`) or, after an honest manifest and honest piece headers, every piece
    body (`what="body"`). Yields its URL."""
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def trickle(self, data: bytes) -> None:
            for i in range(len(data)):
                if stop.wait(TRICKLE_S):
                    return
                self.wfile.write(data[i: i + 1])

        def do_GET(self) -> None:
            with contextlib.suppress(OSError):
                if what == "head":
                    self.trickle(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 60000)
                    return
                if self.path.endswith("/manifest"):
                    body = snap.manifest.to_json().encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                _, _, _, _, leaf, _, k = self.path.split("/")[1:]
                man = snap.manifest
                start, end = man.piece_range(int(leaf), int(k))
                self.send_response(200)
                for name, value in (("Content-Length", str(end - start)), ("X-Fthsdp-Step", str(STEP)),
                                    ("X-Fthsdp-Range", f"{start}-{end}"),
                                    ("X-Fthsdp-Checksum", f"{man.checksums[int(leaf)][int(k)]:08x}")):
                    self.send_header(name, value)
                self.end_headers()
                self.trickle(bytes(snap.piece(int(leaf), int(k))))

        def log_message(self, *args) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        stop.set()
        srv.shutdown()
        srv.server_close()


def test_a_trickled_manifest_is_left_out_at_half_the_deadline_and_the_others_serve(snap):
    """A source that trickles its manifest's head held PeerFetcher.manifests() for ever (only each
    read had a timeout). Now the manifests get half the time left to the deadline: the slow source
    is left out, saying why, and the honest one's manifest and pieces are used; alone, the slow
    source fails the fetch at that point with a recoverable FetchError."""
    with trickler(snap, "head") as slow, PeerServer(StaticSource(snap), TOKEN) as honest:
        t0 = time.monotonic()
        session = PeerFetcher([slow, honest.url], TOKEN, step=STEP, timeout_s=5, deadline=t0 + 3.0).start()
        assert 1.3 < time.monotonic() - t0 < 2.8
        assert same(session.tree(like=make_state()), make_state())
        assert "manifest took over" in session.stats[slow].dead and session.stats[slow].pieces == 0
        t0 = time.monotonic()
        with pytest.raises(FetchError, match="trickling peer.*retried from other peers") as e:
            PeerFetcher([slow], TOKEN, step=STEP, timeout_s=5, deadline=t0 + 2.0).start()
        assert time.monotonic() - t0 < 2.5
        assert slow in str(e.value) and classify(e.value).recoverable
    assert no_fetch_thread_within(1.0) == []


def test_a_trickled_body_fails_at_the_deadline_naming_the_source_and_leaves_no_thread(snap):
    """Piece bodies trickled a byte at a time: no read times out and a piece lands rarely, so
    only the fetch's deadline ends it. The wait raises then (naming the slow source), every
    socket is shut down from the waiting thread, and the workers are gone within a second."""
    with trickler(snap, "body") as slow:
        t0 = time.monotonic()
        session = PeerFetcher([slow], TOKEN, step=STEP, timeout_s=5, deadline=t0 + 2.0).start()
        with pytest.raises(FetchError, match="did not finish by its deadline.*too slow.*retried from other peers") as e:
            session.leaf(0)
        assert 1.9 < time.monotonic() - t0 < 3.5
        assert slow in str(e.value) and "in flight" in str(e.value)
        assert no_fetch_thread_within(1.0) == []
        t0 = time.monotonic()
        session.close()
        assert time.monotonic() - t0 < 0.5


def test_the_orbax_restore_passes_the_deadline_to_every_wait(snap):
    """orbax_peer.restore (the replica's path) waits leaf by leaf: with a deadline it fails by then
    (no persistent checkpoint to fall back to here), whatever the source trickles."""
    from fthsdp.checkpoint import orbax_peer

    with trickler(snap, "body") as slow:
        t0 = time.monotonic()
        with pytest.raises(FetchError, match="no persistent checkpoint.*did not finish by its deadline"):
            orbax_peer.restore(make_state(), [slow], TOKEN, STEP, timeout_s=5, deadline=t0 + 2.0)
        assert time.monotonic() - t0 < 3.5
        assert no_fetch_thread_within(1.0) == []


def test_a_fetch_that_stalls_without_a_deadline_stops_its_workers_and_closes_at_once(snap):
    """Without a deadline the stall limit ends a trickled fetch; its workers went on reading the
    8 MiB-bounded bodies (holding their sockets and the state-sized buffer, a fresh one per retry)
    and close() joined each for timeout_s + 1 s in turn. Now both end at once."""
    with trickler(snap, "body") as slow:
        session = PeerFetcher([slow], TOKEN, step=STEP, timeout_s=5, streams_per_source=2).start()
        session.stall_s = 1.0
        with pytest.raises(FetchError, match="no piece of step 12's state landed for 1 s"):
            session.wait()
        t0 = time.monotonic()
        session.close()
        assert time.monotonic() - t0 < 1.0
        assert no_fetch_thread_within(1.0) == []


@pytest.mark.parametrize("kind", ["truncate", "unavailable"])
def test_one_source_that_cuts_one_body_or_answers_503_once_still_serves_the_fetch(snap, kind):
    """With one source, one connection-level hiccup on one piece (a cut body, a 503 from a server
    at its limits) failed the whole fetch: a piece failed on a source never went back to it. Now it
    is asked again (a few times at most), keeping the pieces already landed."""
    with PeerServer(StaticSource(snap), TOKEN, fault=Fault(kind, count=1)) as server:
        session = PeerFetcher([server.url], TOKEN, step=STEP, timeout_s=5).start()
        assert same(session.tree(like=make_state()), make_state())
        assert session.retries == 1 and session.stats[server.url].dead is None, session.report()
        assert sum(s["pieces"] for s in session.report()["sources"].values()) == len(session.pieces)


def test_a_source_that_always_answers_503_fails_the_fetch_within_a_bound(snap):
    """The retries on the same source are bounded: a source answering 503 for ever fails the fetch
    quickly, saying so."""
    with PeerServer(StaticSource(snap), TOKEN, fault=Fault("unavailable")) as server:
        t0 = time.monotonic()
        with pytest.raises(FetchError, match="HTTP 503: fault injection: unavailable"):
            PeerFetcher([server.url], TOKEN, step=STEP, timeout_s=5).fetch()
        assert time.monotonic() - t0 < 5.0


def test_a_manifest_answered_503_once_is_asked_again(snap):
    """A peer that has not finished its on-demand copy answers 503 ("no snapshot yet") for a few ms:
    the source was dropped at once; now its manifest is asked for again."""

    class Late:
        def __init__(self) -> None:
            self.refused = 0

        def lease(self, step: int | None = None):
            if self.refused < 1:
                self.refused += 1
                raise StaleStepError(STEP if step is None else step, None)
            return StaticSource(snap).lease(step)

    source = Late()
    with PeerServer(source, TOKEN) as server:
        got = PeerFetcher([server.url], TOKEN, step=STEP, timeout_s=5).fetch(like=make_state())
    assert same(got, make_state()) and source.refused == 1


def test_server_close_does_not_wait_for_a_worker_stuck_on_a_slow_reader():
    """A client that asks for a large piece and reads nothing blocks a server worker in sendall
    for up to ft.peer_send_s (60 s); server_close joined that worker for 5 s before closing its
    socket. Now busy connections are shut down first and close() returns at once."""
    big = Snapshotter(piece_bytes=48 << 20).take(STEP, {"w": np.ones(12 << 20, np.float32)})
    with PeerServer(StaticSource(big), TOKEN) as server:
        host_port = server.url.removeprefix("http://")
        host, port = host_port.rsplit(":", 1)
        path = f"/v1/snapshot/{STEP}/leaf/0/piece/0"
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect((host, int(port)))
        reader.sendall(f"GET {path} HTTP/1.1\r\nHost: {host_port}\r\nAuthorization: "
                       f"{sign(TOKEN.encode(), 'GET', host_port, path)}\r\n\r\n".encode())
        time.sleep(0.5)  # the worker is writing 48 MiB into a full socket
        t0 = time.monotonic()
        server.close()
        took = time.monotonic() - t0
        reader.close()
    assert took < 1.5, f"server close took {took:.1f} s"
