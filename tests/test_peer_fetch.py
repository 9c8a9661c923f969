"""Peer server + striped fetcher over real HTTP, with real server processes:
lying peers, a wrong key, a stale step, a peer SIGKILLed mid-transfer.

Run as a script (`python tests/test_peer_fetch.py serve ...`) it is one peer
server process serving a deterministic state."""

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fthsdp.checkpoint.peer_server import Fault

TOKEN = "s3cret-token"
STEP = 12
PIECE = 64 << 10


def make_state(seed: int):
    rng = np.random.default_rng(seed)
    return {
        "params": {"w": rng.standard_normal((512, 1024)).astype(np.float32), "b": rng.standard_normal(100).astype(np.float32)},
        "opt": {"mu": rng.standard_normal((256, 256)).astype(np.float32), "count": np.int32(seed)},
        "empty": np.zeros((0, 3), np.float32),
    }


def _serve(argv):
    from fthsdp.checkpoint.peer_server import PeerServer, StaticSource
    from fthsdp.checkpoint.snapshot import Snapshotter

    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", type=int, default=STEP)
    ap.add_argument("--fault", default="")
    ap.add_argument("--count", type=int, default=None)
    ap.add_argument("--delay", type=float, default=0.0)
    a = ap.parse_args(argv)
    snap = Snapshotter(piece_bytes=PIECE).take(a.step, make_state(a.seed))
    fault = Fault(a.fault, a.count, a.delay) if a.fault else None
    server = PeerServer(StaticSource(snap), TOKEN, fault=fault)
    print(server.url, flush=True)
    server.serve_forever()


class Peer:
    def __init__(self, *args: str):
        here = os.path.abspath(__file__)
        self.proc = subprocess.Popen([sys.executable, here, "serve", *args], stdout=subprocess.PIPE)
        self._url = None

    @property
    def url(self) -> str:
        if self._url is None:
            line = self.proc.stdout.readline().decode().strip()
            assert line.startswith("http://"), f"peer server did not start: {line!r}"
            self._url = line
        return self._url

    def kill(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def peers():
    ps = {
        "a": Peer(), "b": Peer(), "c": Peer(),
        "corrupt": Peer("--fault", "corrupt"),
        "truncate": Peer("--fault", "truncate"),
        "liar": Peer("--fault", "bad_checksum"),
        "other_step": Peer("--step", str(STEP + 1)),
        "diverged": Peer("--seed", "1"),  # consistent manifest, but of different bytes (a diverged replica)
    }
    for p in ps.values():
        p.url  # wait for every server
    yield ps
    for p in ps.values():
        p.kill()


def _same(tree, ref):
    from fthsdp.checkpoint.snapshot import flatten

    pa, la, _ = flatten(tree)
    pb, lb, _ = flatten(ref)
    return pa == pb and all(np.asarray(x).tobytes() == np.asarray(y).tobytes() and np.asarray(x).dtype == np.asarray(y).dtype
                            for x, y in zip(la, lb))


def _get(url, path, token=TOKEN):
    from fthsdp.checkpoint.peer_auth import sign
    from fthsdp.checkpoint.peer_fetch import _split

    conn = http.client.HTTPConnection(*_split(url), timeout=5)
    authority = url.removeprefix("http://")
    headers = {} if token is None else {"Authorization": sign(token.encode(), "GET", authority, path)}
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body, resp


def test_striped_over_three_peers(peers):
    from fthsdp.checkpoint.peer_fetch import PeerFetcher
    from fthsdp.checkpoint.peer_server import PeerServer, StaticSource
    from fthsdp.checkpoint.snapshot import Snapshotter

    ref = make_state(0)
    f = PeerFetcher([peers[k].url for k in "abc"], TOKEN, step=STEP, streams_per_source=2)
    session = f.start(like=ref)
    assert _same(session.tree(like=ref), ref)
    rep = session.report()
    assert rep["retries"] == 0
    counts = [s["pieces"] for s in rep["sources"].values()]
    assert sum(counts) == sum(1 for _ in session.manifest.pieces())
    # with pieces that take a while each (5 ms), every peer carries a share, however loaded the machine
    snap = Snapshotter(piece_bytes=PIECE).take(STEP, ref)
    servers = [PeerServer(StaticSource(snap), TOKEN, fault=Fault("delay", delay_s=0.005)).start() for _ in range(3)]
    try:
        session = PeerFetcher([s.url for s in servers], TOKEN, step=STEP).start()
        assert _same(session.tree(like=ref), ref)
        counts = [s.pieces for s in session.stats.values()]
        assert all(c >= 3 for c in counts), counts
    finally:
        for s in servers:
            s.close()


def test_lying_peers_are_caught_and_their_pieces_refetched(peers):
    from fthsdp.checkpoint.peer_fetch import PeerFetcher

    ref = make_state(0)
    liars = [peers[k].url for k in ("corrupt", "truncate", "liar")]
    f = PeerFetcher([*liars, peers["a"].url], TOKEN, step=STEP)
    session = f.start()
    out = session.tree(like=ref)
    assert _same(out, ref)
    rep = session.report()
    # every byte came from the honest peer (a liar may still hand over an empty piece intact)
    assert rep["sources"][peers["a"].url]["bytes"] == sum(leaf.nbytes for leaf in session.manifest.leaves)
    for url in liars:
        assert rep["sources"][url]["bytes"] == 0 and rep["sources"][url]["failures"] >= 1
    reasons = " ".join(session.stats[u].failures[0] for u in liars)
    # (a cut body reads as IncompleteRead, or as a reset if the server's close raced our read)
    assert "corrupt body" in reasons and "connection error" in reasons and "disagrees with the manifest" in reasons


def test_a_peer_whose_manifest_lies_is_left_out_and_the_honest_one_serves(peers):
    """A source whose manifest is not a manifest of anything (a number out of any range, a body
    nested past the parser, leaves whose bytes do not follow from their shapes, overlapping leaves)
    fails alone, with its reason; the fetch goes on from the honest peer."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from fthsdp.checkpoint.peer_fetch import PeerFetcher

    status, body, _ = _get(peers["a"].url, f"/v1/snapshot/{STEP}/manifest")
    assert status == 200
    honest = json.loads(body)
    leaves = honest["leaves"]
    lies = {
        "/huge": {**honest, "step": "__HUGE__"},
        "/deep": "[" * 100_000 + "]" * 100_000,
        "/zero-bytes": {**honest, "leaves": [{**x, "nbytes": 0} for x in leaves]},
        "/overlap": {**honest, "leaves": [*leaves[:-1], {**leaves[-1], "offset": leaves[-2]["offset"]}]},
    }

    class Liar(BaseHTTPRequestHandler):
        def do_GET(self):
            lie = lies[self.server.lie]
            out = (lie if isinstance(lie, str) else json.dumps(lie).replace('"__HUGE__"', "1e400")).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    servers = []
    try:
        for lie in lies:
            srv = ThreadingHTTPServer(("127.0.0.1", 0), Liar)
            srv.lie = lie
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            servers.append(srv)
        urls = [f"http://127.0.0.1:{srv.server_address[1]}" for srv in servers]
        session = PeerFetcher([*urls, peers["a"].url], TOKEN, step=STEP, timeout_s=5).start()
        assert _same(session.tree(like=make_state(0)), make_state(0))
        reasons = dict(zip(lies, (session.stats[u].dead for u in urls)))
        assert "OverflowError" in reasons["/huge"], reasons
        assert "not valid JSON" in reasons["/deep"], reasons
        assert "says 0 bytes for shape" in reasons["/zero-bytes"], reasons
        assert "overlaps the leaf before it" in reasons["/overlap"], reasons
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()


def test_only_liars_fail_with_every_reason(peers):
    from fthsdp.checkpoint.peer_fetch import FetchError, PeerFetcher

    f = PeerFetcher([peers["corrupt"].url, peers["liar"].url], TOKEN, step=STEP)
    with pytest.raises(FetchError, match="no source can supply") as e:
        f.fetch()
    assert "corrupt body" in str(e.value) and "disagrees with the manifest" in str(e.value)


def test_wrong_or_missing_token_is_refused(peers):
    from fthsdp.checkpoint.peer_fetch import FetchError, PeerFetcher

    with pytest.raises(FetchError, match="HTTP 403: wrong credential"):
        PeerFetcher([peers["a"].url], "not-the-token", step=STEP).fetch()
    status, body, _ = _get(peers["a"].url, "/v1/manifest", token=None)
    assert status == 401 and "missing credential" in json.loads(body)["error"]
    status, body, _ = _get(peers["a"].url, f"/v1/snapshot/{STEP}/leaf/0/piece/0", token="x" * 12)
    assert status == 403


def test_stale_step_is_refused_with_the_served_step(peers):
    from fthsdp.checkpoint.peer_fetch import FetchError, PeerFetcher

    status, body, _ = _get(peers["a"].url, f"/v1/snapshot/{STEP - 1}/leaf/0/piece/0")
    assert status == 409 and json.loads(body)["served_step"] == STEP
    with pytest.raises(FetchError, match=f"step {STEP - 1} is not available: step {STEP} is served"):
        PeerFetcher([peers["a"].url], TOKEN, step=STEP - 1).fetch()
    # a peer that already moved on is left out; the others finish the fetch
    f = PeerFetcher([peers["other_step"].url, peers["b"].url], TOKEN, step=STEP)
    session = f.start()
    assert _same(session.tree(like=make_state(0)), make_state(0))
    assert "409" in session.stats[peers["other_step"].url].dead


def test_majority_manifest_outvotes_a_diverged_peer(peers):
    from fthsdp.checkpoint.peer_fetch import PeerFetcher

    f = PeerFetcher([peers["diverged"].url, peers["a"].url, peers["b"].url], TOKEN, step=STEP)
    session = f.start()
    assert _same(session.tree(like=make_state(0)), make_state(0))
    st = session.stats[peers["diverged"].url]
    assert st.bytes == 0 and all("disagrees with the manifest" in x for x in st.failures)


def test_a_vote_without_a_majority_is_refused_not_won_by_the_first_source():
    """Two sources whose states differ (one flipped a bit, or lies): the first one listed won each
    tied piece and its state was installed. Now a tie is a FetchError naming both sides; with a
    third source the majority wins whatever the order."""
    import itertools

    from fthsdp.checkpoint.peer_fetch import FetchError, consensus
    from fthsdp.checkpoint.snapshot import Snapshotter

    good, bad = make_state(0), make_state(0)
    bad["params"]["b"][0] += 1  # one value of one leaf: one piece differs
    m_good = Snapshotter(piece_bytes=PIECE).take(STEP, good).manifest
    m_bad = Snapshotter(piece_bytes=PIECE).take(STEP, bad).manifest
    for order in (("liar", "honest"), ("honest", "liar")):
        manifests = {u: (m_bad if u == "liar" else m_good) for u in order}
        with pytest.raises(FetchError, match="no majority.*silent data corruption"):
            consensus(manifests, STEP)
    for order in itertools.permutations(("liar", "a", "b")):
        agreed, members, _ = consensus({u: (m_bad if u == "liar" else m_good) for u in order}, STEP)
        assert agreed.checksums == m_good.checksums and "liar" in members  # its other pieces still count


def test_peer_frozen_mid_transfer_times_out_and_the_other_finishes():
    from fthsdp.checkpoint.peer_fetch import PeerFetcher

    frozen, other = Peer("--fault", "delay", "--delay", "0.02"), Peer("--fault", "delay", "--delay", "0.02")
    try:
        f = PeerFetcher([frozen.url, other.url], TOKEN, step=STEP, timeout_s=0.5, max_consecutive_errors=2)
        session = f.start()
        deadline = time.monotonic() + 20
        while session.stats[frozen.url].pieces < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.kill(frozen.proc.pid, signal.SIGSTOP)  # alive, holds its port and connections, answers nothing
        t0 = time.monotonic()
        assert _same(session.tree(like=make_state(0)), make_state(0))
        assert time.monotonic() - t0 < 10
        assert "timed out" in session.stats[frozen.url].dead
        assert session.stats[other.url].pieces > session.stats[frozen.url].pieces
        # a frozen peer is also left out up front, when its manifest request times out
        s2 = PeerFetcher([frozen.url, other.url], TOKEN, step=STEP, timeout_s=0.5).start()
        assert _same(s2.tree(like=make_state(0)), make_state(0)) and s2.stats[frozen.url].pieces == 0
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
        frozen.kill()
        other.kill()


def test_malformed_requests_get_400_with_the_reason(peers):
    url = peers["a"].url
    status, body, _ = _get(url, f"/v1/snapshot/{STEP}/leaf/x/piece/0")
    assert status == 400 and "leaf must be a non-negative integer" in json.loads(body)["error"]
    status, body, _ = _get(url, f"/v1/snapshot/{STEP}/leaf/99/piece/0")
    assert status == 400 and "out of range" in json.loads(body)["error"]
    status, body, _ = _get(url, f"/v1/snapshot/{STEP}/leaf/0/piece/99")
    assert status == 400 and "piece 99 out of range" in json.loads(body)["error"]
    status, body, _ = _get(url, "/v2/whatever")
    assert status == 404
    status, body, resp = _get(url, f"/v1/snapshot/{STEP}/leaf/4/piece/1")
    assert status == 200 and resp.getheader("X-Fthsdp-Range") == f"{PIECE}-{2 * PIECE}" and len(body) == PIECE
    from fthsdp.checkpoint.snapshot import checksum

    assert int(resp.getheader("X-Fthsdp-Checksum"), 16) == checksum(body)


def test_peer_killed_mid_transfer_is_finished_by_the_other():
    from fthsdp.checkpoint.peer_fetch import PeerFetcher

    victim, survivor = Peer("--fault", "delay", "--delay", "0.02"), Peer("--fault", "delay", "--delay", "0.02")
    try:
        f = PeerFetcher([victim.url, survivor.url], TOKEN, step=STEP, timeout_s=5)
        session = f.start()
        total = sum(1 for _ in session.manifest.pieces())
        deadline = time.monotonic() + 20
        while session.stats[victim.url].pieces < 4:
            assert time.monotonic() < deadline, "the victim never served a piece"
            time.sleep(0.005)
        victim.kill()  # SIGKILL, mid-transfer
        out = session.tree(like=make_state(0))
        assert _same(out, make_state(0))
        got_victim = session.stats[victim.url].pieces
        assert 4 <= got_victim < total
        assert session.stats[survivor.url].pieces == total - got_victim
        assert session.stats[victim.url].dead is not None
    finally:
        victim.kill()
        survivor.kill()


def test_a_fetch_where_no_piece_lands_for_the_stall_limit_fails_instead_of_waiting_forever():
    """Every read of a slow source may come within its timeout while no piece lands (a peer that
    trickles, or one sleeping just under the timeout before each piece): the wait for the state
    ends with a FetchError once nothing landed for the session's stall limit (by default
    max(30 s, 4 x the read timeout); shortened here), and the rejoiner tries other sources."""
    from fthsdp.checkpoint.peer_fetch import STALL_FLOOR_S, FetchError, PeerFetcher
    from fthsdp.checkpoint.peer_server import PeerServer, StaticSource
    from fthsdp.checkpoint.snapshot import Snapshotter

    snap = Snapshotter(piece_bytes=PIECE).take(STEP, make_state(0))
    with PeerServer(StaticSource(snap), TOKEN, fault=Fault("delay", delay_s=3.0)) as slow:
        session = PeerFetcher([slow.url], TOKEN, step=STEP, timeout_s=5.0, streams_per_source=1).start()
        assert session.stall_s == max(STALL_FLOOR_S, 20.0)
        session.stall_s = 1.0
        t0 = time.monotonic()
        with pytest.raises(FetchError, match=r"no piece of step 12's state landed for 1 s \(0 of"):
            session.wait()
        assert time.monotonic() - t0 < 2.9  # before the first piece could land
        session.close()


def test_a_manifest_too_large_or_trickled_is_refused_within_a_bound():
    """A peer (or anyone on the path without TLS) answering the manifest request with a huge
    Content-Length made read() allocate all of it at once; one trickling a byte within each read's
    timeout kept get_manifest waiting for ever. Both are refused: the size before reading, the
    trickle at the manifest's deadline."""
    import socket
    import threading

    from fthsdp.checkpoint import peer_fetch
    from fthsdp.checkpoint.snapshot import SnapshotError

    def serve(reply_head: bytes, trickle: bool) -> tuple[socket.socket, threading.Event]:
        srv = socket.create_server(("127.0.0.1", 0))
        stop = threading.Event()

        def run():
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply_head)
                while trickle and not stop.wait(0.05):
                    try:
                        conn.sendall(b" ")
                    except OSError:
                        return

        threading.Thread(target=run, daemon=True).start()
        return srv, stop

    huge = b"HTTP/1.1 200 OK\r\nContent-Length: 20000000000\r\n\r\n{"
    srv, stop = serve(huge, trickle=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(SnapshotError, match="claims '20000000000' bytes: at most"):
            peer_fetch.get_manifest(f"http://127.0.0.1:{srv.getsockname()[1]}", TOKEN, timeout_s=5.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        stop.set()
        srv.close()
    srv, stop = serve(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n{", trickle=True)
    old = peer_fetch.STALL_FLOOR_S
    try:
        peer_fetch.STALL_FLOOR_S = 1.0
        t0 = time.monotonic()
        with pytest.raises(SnapshotError, match="took over 1s to arrive"):
            peer_fetch.get_manifest(f"http://127.0.0.1:{srv.getsockname()[1]}", TOKEN, timeout_s=0.2)
        assert time.monotonic() - t0 < 3.0
    finally:
        peer_fetch.STALL_FLOOR_S = old
        stop.set()
        srv.close()


def test_capped_peers_each_serve_a_part_when_striped():
    """Each server caps its serving bandwidth, and a fetch stripes over both (each serves a part
    within its cap); how much faster two are than one is measured, not asserted here."""
    from fthsdp.checkpoint.peer_fetch import PeerFetcher
    from fthsdp.checkpoint.peer_server import PeerServer, StaticSource
    from fthsdp.checkpoint.snapshot import Snapshotter

    snap = Snapshotter(piece_bytes=PIECE).take(STEP, make_state(0))
    cap = 5e6  # 5 MB/s each: the 2.4 MB state takes ~0.47 s from one, ~0.24 s from two
    with PeerServer(StaticSource(snap), TOKEN, max_bytes_per_s=cap) as a, \
            PeerServer(StaticSource(snap), TOKEN, max_bytes_per_s=cap) as b:
        one = PeerFetcher([a.url], TOKEN, step=STEP).start()
        one.wait()
        two = PeerFetcher([a.url, b.url], TOKEN, step=STEP).start()
        assert _same(two.tree(like=make_state(0)), make_state(0))
    assert one.gbps * 1e9 < 1.3 * cap  # the cap holds
    # striped, each server sent part of the state (how much faster that is: experiments/recovery_fetch.py)
    src = two.report()["sources"]
    assert len(src) == 2 and all(v["bytes"] > 0 and not v["dead"] for v in src.values()), src
    assert two.gbps * 1e9 < 2 * 1.3 * cap  # each within its cap
    with pytest.raises(ValueError, match="max_bytes_per_s must be > 0"):
        PeerServer(StaticSource(snap), TOKEN, max_bytes_per_s=0)


def test_no_reachable_source(tmp_path):
    import socket

    from fthsdp.checkpoint.peer_fetch import FetchError, PeerFetcher

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(FetchError, match="unreachable"):
        PeerFetcher([f"http://127.0.0.1:{port}"], TOKEN, step=1, timeout_s=2).fetch()
    with pytest.raises(ValueError, match="must look like http://HOST:PORT"):
        PeerFetcher(["ftp://x"], TOKEN)
    with pytest.raises(ValueError, match="at least one source"):
        PeerFetcher([], TOKEN)


def test_in_process_fetch_places_on_shardings_and_follows_the_snapshotter():
    """A live Snapshotter behind the server: the served step moves on, the lease keeps bytes stable."""
    import jax

    from fthsdp.checkpoint.peer_fetch import PeerFetcher
    from fthsdp.checkpoint.peer_server import PeerServer
    from fthsdp.checkpoint.snapshot import Snapshotter
    from fthsdp.step.sharding import fsdp_shardings, replica_mesh

    mesh = replica_mesh(4)
    ref = make_state(5)
    sh = fsdp_shardings(ref, mesh)
    state = jax.device_put(ref, sh)
    snaps = Snapshotter(piece_bytes=PIECE)
    with PeerServer(snaps, TOKEN) as server:
        status, body, _ = _get(server.url, "/v1/manifest")
        assert status == 503 and "no snapshot is served yet" in json.loads(body)["error"]
        snaps.take(1, state)
        out = PeerFetcher([server.url], TOKEN, step=1).fetch(like=state)
        assert out["params"]["w"].sharding == state["params"]["w"].sharding
        assert _same(out, ref)
        snaps.take(2, jax.device_put(make_state(6), sh))
        latest = PeerFetcher([server.url], TOKEN).fetch(like=ref)  # step=None: whatever the peers serve
        assert _same(latest, make_state(6))
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), ref, sh)
        placed = PeerFetcher([server.url], TOKEN, step=2).fetch(like=abstract)
        assert isinstance(placed["opt"]["mu"], jax.Array) and _same(placed, make_state(6))
    snaps.close()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "serve":
    _serve(sys.argv[2:])
