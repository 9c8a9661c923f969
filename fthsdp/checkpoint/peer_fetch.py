"""Striped, verified fetch of one replica's snapshot from several healthy peers.

Every peer assigned to a behind replica holds bitwise-identical state
(invariant 1), so any peer can supply any piece. The fetcher:

1. asks every source for its manifest at the wanted step and takes the
   consensus (majority step, majority layout, majority checksum per piece), so
   one lying peer cannot vouch for its own corrupt bytes;
2. runs `streams_per_source` threads per source, each with its own keep-alive
   HTTP connection, pulling pieces from one shared queue in layout order (a
   faster source simply takes more pieces: that is the striping);
3. receives each body straight into its place in one pre-faulted buffer and
   checks its CRC against the consensus manifest;
4. hands a corrupt or lying piece to another source (never back to the one
   that failed it); asks the same source again, a bounded number of times
   (``TRANSIENT_RETRIES``), after a connection-level error or a 5xx, since a
   reused keep-alive connection closed under us or a busy server says nothing
   about the source's bytes; and drops a source that is gone (refused
   connection, repeated errors, stale step, auth refusal) so the others finish
   its share.

It fails, with every source's reason, when some piece has no source left that
has not failed it, when no piece landed for the stall limit, or at the
caller's absolute ``deadline`` (a ``time.monotonic()`` value): every wait of a
fetch (connecting, the manifests, response heads, error bodies, piece bodies,
``leaf()`` and ``wait()``) ends by then, whatever a source trickles. Whoever
ends a fetch (its deadline, an error, ``close()``) shuts down every socket the
fetch holds from its own thread, so the reader threads wake at once and exit,
and a failed fetch leaves no thread, socket or buffer behind. `FetchError` is
a `PeerFetchError` (``fthsdp.errors``: recoverable), so the replica retries
from other peers. Leaves become available one by one (`leaf(i)`), in layout
order, while later leaves are still in flight: the Orbax extension uses that
to place arrays on devices as they land.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.parse
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from fthsdp.checkpoint.peer_auth import sign
from fthsdp.digits import ascii_int
from fthsdp.checkpoint.snapshot import (HostBuffer, Manifest, SnapshotError, check_matches, checksum, flatten,
                                         restore_tree)
from fthsdp.errors import PeerFetchError


class FetchError(PeerFetchError):
    """No source could supply some piece, or the fetch ran past its deadline (the message gives each
    source's reason). A PeerFetchError, so recoverable: the replica fetches again from other peers."""


class _Rejected(Exception):
    """The source answered, but this piece from it is unusable (corrupt, lying)."""


class _Gone(Exception):
    """The source cannot serve this fetch at all (stale step, auth refused)."""


class _Transient(Exception):
    """The source answered 5xx (busy, no snapshot yet): asking it again shortly may succeed."""


class _Ended(Exception):
    """The fetch is over (failed, past its deadline, closed): a worker stops without blaming its source."""


@dataclass
class SourceStats:
    url: str
    pieces: int = 0
    bytes: int = 0
    failures: list[str] = field(default_factory=list)
    dead: str | None = None  # why the source was dropped
    consecutive_errors: int = 0


def _split(url: str) -> tuple[str, int]:
    """(host, port) of a source URL ``http(s)://HOST:PORT``; ValueError saying how to write one."""
    u = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme not in ("http", "https") or not u.hostname or not port:
        raise ValueError(f"peer source {url!r} must look like http://HOST:PORT or https://HOST:PORT")
    return u.hostname, port


def client_tls(ca_file: str | None) -> ssl.SSLContext:
    """The TLS context a fetcher verifies peer servers with: the operator's CA file (the peers'
    certificates must name their advertised hosts), or the system's trust store when None."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"peer fetch TLS: cannot load the CA file {ca_file!r}: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


@dataclass(frozen=True)
class _Endpoint:
    """Where one source is and how to talk to it: connections and signed request headers."""

    url: str
    host: str
    port: int
    authority: str  # host:port as dialled: what the request is signed for (the Host header)
    tls: ssl.SSLContext | None

    @classmethod
    def of(cls, url: str, tls: ssl.SSLContext | None) -> "_Endpoint":
        host, port = _split(url)
        u = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if u.scheme == "https" and tls is None:
            tls = client_tls(None)
        if u.scheme == "http" and tls is not None:
            raise ValueError(f"peer source {url!r} is plain http but this fetcher requires TLS (a CA file was "
                             "given): the peer servers must be started with certificates")
        return cls(url, host, port, u.netloc.lower(), tls if u.scheme == "https" else None)

    def connect(self, timeout_s: float) -> http.client.HTTPConnection:
        if self.tls is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        return http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s, context=self.tls)

    def headers(self, key: bytes | None, path: str) -> dict[str, str]:
        if key is None:  # unsigned: only a server run with authenticate=False (measurements) answers
            return {"Host": self.authority}
        return {"Host": self.authority, "Authorization": sign(key, "GET", self.authority, path)}


def _key_bytes(key: bytes | str | None) -> bytes | None:
    if key is None:
        return None
    key = key.encode() if isinstance(key, str) else bytes(key)
    if not key:
        raise ValueError("the fetcher needs the job's peer key (peer_server.peer_key(job key)); got an empty one")
    return key


# A fetch waiting for pieces fails when none landed for max(STALL_FLOOR_S, STALL_TIMEOUTS x the
# per-read timeout): generous for an 8 MiB piece on a slow link, bounded against a trickling peer.
# One manifest request (connecting, its head, its body) is bounded by the same.
STALL_FLOOR_S = 30.0
STALL_TIMEOUTS = 4.0
MAX_ERROR_BODY = 64 << 10  # an error's JSON body is a sentence: more is not read
# A manifest lists each leaf's path, shape and piece checksums: 16 MiB holds ~10^5 leaves of
# ~10^3 pieces. A peer claiming more is refused before anything is allocated for it.
MAX_MANIFEST_BYTES = 16 << 20
# After a connection-level error or a 5xx (a keep-alive connection the server closed as we reused
# it, a server at its connection limit, a cut body) a piece is asked of the same source again this
# many times before that source is excluded for it: one hiccup must not fail a one-source fetch.
# Corrupt, lying or wrong-length answers exclude the source for the piece at once.
TRANSIENT_RETRIES = 2
MANIFEST_RETRIES = 2  # a manifest answered 5xx (no snapshot yet: on-demand copies) is asked again
RETRY_PAUSE_S = 0.05  # the pause before asking again, times the source's errors in a row (at most 1 s)
# A body is read in slices of this many bytes; between slices a worker checks that the fetch is
# still on, so a fetch that failed or ran out of time stops its readers within one slice.
READ_SLICE = 1 << 20
CLOSE_JOIN_S = 2.0  # close() waits this long, in all, for its threads (their sockets are shut down)


def _stall_s(timeout_s: float) -> float:
    """The stall bound for a per-read timeout of ``timeout_s`` (see STALL_FLOOR_S)."""
    return max(STALL_FLOOR_S, STALL_TIMEOUTS * timeout_s)


def _until(timeout_s: float, deadline: float | None) -> float:
    """When one request must be over: the stall bound from now, or the fetch's deadline if sooner."""
    bound = time.monotonic() + _stall_s(timeout_s)
    return bound if deadline is None else min(bound, deadline)


class _Live:
    """The sockets a fetch has open, so that whoever ends the fetch (its deadline, an error,
    ``close()``) can shut them down from its own thread. A reader blocked in recv() on a source that
    trickles (a byte within each read's timeout) then wakes at once and its thread exits, instead
    of holding the thread, the socket and the fetch's buffer for as long as the source pleases.
    Sockets are dialled here, not by http.client, so that even a connect or a TLS handshake in
    progress is cut."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: dict[http.client.HTTPConnection, list[socket.socket]] = {}
        self.cut_why: str | None = None

    def _hold(self, conn: http.client.HTTPConnection, sock: socket.socket | None = None) -> None:
        """Keeps ``sock`` to be cut; raises if the fetch is over already. With no socket, only the
        check: a cut that came while a socket was connecting found it unconnected (its shutdown a
        no-op), so the socket is checked again once connected."""
        with self._lock:
            if self.cut_why is not None:
                raise ConnectionAbortedError(f"the fetch is over: {self.cut_why}")
            if sock is not None:
                self._socks.setdefault(conn, []).append(sock)

    def open(self, ep: "_Endpoint", timeout_s: float) -> http.client.HTTPConnection:
        """A connection to `ep`, connected (and its TLS handshake done), held until close(conn)."""
        conn = ep.connect(timeout_s)
        conn.auto_open = 0  # http.client must never dial behind our back: that socket could not be cut
        sock: socket.socket | None = None
        try:
            err: OSError | None = None
            for fam, kind, proto, _, addr in socket.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM):
                sock = socket.socket(fam, kind, proto)
                self._hold(conn, sock)
                sock.settimeout(timeout_s)
                try:
                    sock.connect(addr)
                    break
                except OSError as e:
                    err, sock = e, None
            if sock is None:
                raise err or OSError(f"{ep.host!r} resolves to no address")
            self._hold(conn)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ep.tls is not None:
                sock = ep.tls.wrap_socket(sock, server_hostname=ep.host, do_handshake_on_connect=False)
                self._hold(conn, sock)
                sock.do_handshake()
                self._hold(conn)
        except BaseException:
            self.close(conn)
            if sock is not None:
                sock.close()
            raise
        conn.sock = sock
        return conn

    def close(self, conn: http.client.HTTPConnection | None) -> None:
        if conn is None:
            return
        with self._lock:
            socks = self._socks.pop(conn, [])
        conn.close()
        for s in socks:
            s.close()

    def cut(self, why: str) -> None:
        """Shuts down every held socket (not closes: its owner thread may be inside a call on it)."""
        with self._lock:
            if self.cut_why is None:
                self.cut_why = why
            for socks in self._socks.values():
                for s in socks:
                    with contextlib.suppress(OSError):
                        socket.socket.shutdown(s, socket.SHUT_RDWR)


@contextlib.contextmanager
def _cut_at(live: _Live, until: float, why: str):
    """Runs the block with `live`'s sockets shut down at `until` (a monotonic time) if still open."""
    timer = threading.Timer(max(0.0, until - time.monotonic()), live.cut, (why,))
    timer.name = "fthsdp-manifest-timer"
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _error_reason(resp: http.client.HTTPResponse, until: float) -> str:
    """The first MAX_ERROR_BODY bytes of an error's body that arrive by `until`, as a reason. The
    rest is not read (a peer could send it, or trickle it, for ever): the caller closes the
    connection after an error."""
    parts, got = [], 0
    with contextlib.suppress(OSError, http.client.HTTPException):
        while got < MAX_ERROR_BODY and time.monotonic() < until:
            chunk = resp.read1(MAX_ERROR_BODY - got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
    body = b"".join(parts)
    try:
        return f"HTTP {resp.status}: {str(json.loads(body)['error'])[:1000]}"
    except (ValueError, KeyError, TypeError, RecursionError):
        return f"HTTP {resp.status}: {body[:200]!r}"


def get_manifest(url: str, key: bytes | str | None, step: int | None = None, timeout_s: float = 10.0,
                 tls: ssl.SSLContext | None = None, deadline: float | None = None) -> Manifest:
    """One source's manifest (of `step`, or whatever it serves).

    The whole request (connecting, the head, the body; a 5xx asked again MANIFEST_RETRIES times)
    ends within the stall bound, max(STALL_FLOOR_S, STALL_TIMEOUTS x timeout_s), or by `deadline`
    (a time.monotonic() value) if sooner: a source that trickles its answer is refused with a
    SnapshotError saying so, a byte within each read's timeout no longer holds the caller."""
    ep = _Endpoint.of(url, tls)
    key_b = _key_bytes(key)
    t0 = time.monotonic()
    until = _until(timeout_s, deadline)
    slow = (f"the peer's manifest took over {until - t0:.3g}s to arrive: a stalled or trickling peer "
            "(or the fetch's deadline came)")
    live = _Live()
    with _cut_at(live, until, slow):
        for attempt in range(MANIFEST_RETRIES + 1):
            try:
                return _manifest_once(ep, key_b, step, timeout_s, until, live, slow)
            except _Transient as e:
                pause = RETRY_PAUSE_S * 2 ** attempt
                if attempt == MANIFEST_RETRIES or time.monotonic() + pause >= until:
                    raise _Gone(f"{e} (asked {attempt + 1} times)") from None
                time.sleep(pause)
    raise AssertionError("unreachable")


def _manifest_once(ep: "_Endpoint", key: bytes | None, step: int | None, timeout_s: float, until: float,
                   live: _Live, slow: str) -> Manifest:
    conn: http.client.HTTPConnection | None = None
    try:
        conn = live.open(ep, timeout_s)
        path = "/v1/manifest" if step is None else f"/v1/snapshot/{int(step)}/manifest"
        conn.request("GET", path, headers=ep.headers(key, path))
        resp = conn.getresponse()
        if resp.status != 200:
            reason = _error_reason(resp, until)
            raise _Transient(reason) if resp.status >= 500 else _Gone(reason)
        body = _read_bounded(resp, MAX_MANIFEST_BYTES, until, "manifest", slow)
        if live.cut_why is not None:  # cut at `until`, the head or body ended early (EOF looks like an end)
            raise SnapshotError(slow)
        return Manifest.from_json(body)
    except (OSError, http.client.HTTPException, SnapshotError):
        if live.cut_why is not None:  # our own timer shut the socket: say why, not how it broke
            raise SnapshotError(slow) from None
        raise
    finally:
        live.close(conn)


def _read_bounded(resp: http.client.HTTPResponse, limit: int, until: float, what: str, slow: str) -> bytes:
    """A response's body of at most ``limit`` bytes, read by ``until`` (a monotonic time): a peer
    claiming a huge body (read() allocated all of it at once) or trickling a byte within each
    read's timeout (read() waited for ever) is refused (SnapshotError: the source is dropped)."""
    claimed = resp.getheader("Content-Length")
    size = ascii_int(claimed) if claimed is not None else None
    if claimed is not None and (size is None or size > limit):
        raise SnapshotError(f"the peer's {what} claims {claimed[:32]!r} bytes: at most {limit} are read")
    parts, got = [], 0
    while True:
        chunk = resp.read1(64 << 10)
        if not chunk:  # the end, or the socket shut down at `until` (read1 does not raise on a cut body)
            if time.monotonic() >= until:
                raise SnapshotError(f"{slow} ({got} bytes so far)")
            if size is not None and got < size:
                raise SnapshotError(f"the peer's {what} ended after {got} of its {size} bytes: a cut connection")
            return b"".join(parts)
        parts.append(chunk)
        got += len(chunk)
        if got > limit:
            raise SnapshotError(f"the peer's {what} is over {limit} bytes: refused")
        if time.monotonic() > until:
            raise SnapshotError(f"{slow} ({got} bytes so far)")


class FetchSession:
    """One fetch in progress; see the module docstring.

    `deadline`: a time.monotonic() value by which the fetch is over, done or failed (None: only the
    stall limit bounds it)."""

    def __init__(
        self,
        manifest: Manifest,
        sources: Sequence[str],
        key: bytes | str | None,
        streams_per_source: int,
        timeout_s: float,
        max_consecutive_errors: int,
        excluded: dict[str, str],
        buffer: HostBuffer | None = None,
        tls: ssl.SSLContext | None = None,
        deadline: float | None = None,
    ):
        self.manifest = manifest
        self.key = _key_bytes(key)
        self.endpoints = {u: _Endpoint.of(u, tls) for u in sources}
        self.timeout_s = timeout_s
        self.max_consecutive_errors = max_consecutive_errors
        if buffer is not None and buffer.nbytes != manifest.total_bytes:
            raise ValueError(
                f"the given fetch buffer holds {buffer.nbytes} bytes but step {manifest.step}'s snapshot needs "
                f"{manifest.total_bytes}; allocate HostBuffer(manifest.total_bytes)"
            )
        self.buffer = buffer if buffer is not None else HostBuffer(manifest.total_bytes)
        self.pieces = list(manifest.pieces())
        self.stats = {u: SourceStats(u) for u in sources}
        for url, why in excluded.items():
            self.stats.setdefault(url, SourceStats(url)).dead = why
        self._alive = {u for u in sources}
        self._failed_on: list[dict[str, str]] = [{} for _ in self.pieces]
        self._transient: list[Counter[str]] = [Counter() for _ in self.pieces]  # same-source retries used
        self._busy: Counter[str] = Counter()  # pieces in flight per source (named when the deadline passes)
        self._pending = deque(range(len(self.pieces)))
        self._in_flight = 0
        self._left_per_leaf = [manifest.num_pieces(i) for i in range(len(manifest.leaves))]
        self._done = 0
        self._error: FetchError | None = None
        self._cond = threading.Condition()
        self._live = _Live()  # every socket of this fetch: shut down when it ends
        # A wait for pieces ends when none has landed for this long: a source that trickles bytes
        # (each read within timeout_s) must not hold a rejoining replica forever.
        self.stall_s = _stall_s(timeout_s)
        self.deadline = deadline
        self._progress_at = time.monotonic()
        self._began = self._progress_at
        self.retries = 0
        self.t_start = time.perf_counter()
        self.t_end: float | None = None
        self._threads = [
            threading.Thread(target=self._worker, args=(u,), name=f"fthsdp-fetch-{i}", daemon=True)
            for u in sources
            for i in range(streams_per_source)
        ]
        if not self.pieces:
            self.t_end = self.t_start
        for t in self._threads:
            t.start()

    # -- scheduling ---------------------------------------------------------

    def _next(self, url: str) -> int | None:
        with self._cond:
            while True:
                if self._error is not None or self._done == len(self.pieces) or url not in self._alive:
                    return None
                if self._past_deadline():
                    return None
                for j, pid in enumerate(self._pending):
                    if url not in self._failed_on[pid]:
                        del self._pending[j]
                        self._in_flight += 1
                        self._busy[url] += 1
                        return pid
                self._cond.wait(self._wait_s(0.5))  # others may fail pieces back to us

    def _wait_s(self, most: float) -> float:
        """How long one wait on the condition may last: `most`, or until the deadline."""
        if self.deadline is None:
            return most
        return max(0.0, min(most, self.deadline - time.monotonic()))

    def _end(self, error: FetchError) -> None:
        """Fails the fetch (the first error stands) and shuts every socket down, so the workers
        blocked reading wake now and exit. Called with the lock held."""
        if self._error is None:
            self._error = error
            self.t_end = time.perf_counter()
        self._live.cut(str(self._error)[:300])
        self._cond.notify_all()

    def _past_deadline(self) -> bool:
        """Whether the fetch has failed, ending it first if its deadline has passed. Lock held."""
        if (self._error is None and self.deadline is not None and self._done < len(self.pieces)
                and time.monotonic() >= self.deadline):
            slow = ", ".join(f"{u} ({self.stats[u].pieces} pieces landed, {self._busy[u]} in flight)"
                             for u in sorted(self._alive)) or "none left"
            self._end(FetchError(
                f"step {self.manifest.step}: the fetch did not finish by its deadline "
                f"({time.monotonic() - self._began:.1f} s into the transfer; {self._done} of {len(self.pieces)} "
                f"pieces landed): the sources still sending were too slow: {slow}; the fetch will be retried from "
                "other peers"))
        return self._error is not None

    def _going(self) -> None:
        """Raises _Ended once the fetch is over (failed, closed or past its deadline)."""
        if self._error is None and self.deadline is not None and time.monotonic() >= self.deadline:
            with self._cond:
                self._past_deadline()
        if self._error is not None:
            raise _Ended()

    def _complete(self, url: str, pid: int, nbytes: int) -> None:
        with self._cond:
            self._in_flight -= 1
            self._busy[url] -= 1
            self._done += 1
            self._progress_at = time.monotonic()
            st = self.stats[url]
            st.pieces += 1
            st.bytes += nbytes
            st.consecutive_errors = 0
            self._left_per_leaf[self.pieces[pid][0]] -= 1
            if self._done == len(self.pieces):
                self.t_end = time.perf_counter()
            self._cond.notify_all()

    def _fail(self, url: str, pid: int | None, reason: str, dead: bool = False, transient: bool = False) -> None:
        """Puts piece `pid` back in the queue. A transient failure (connection-level, 5xx) leaves it
        to the same source again, TRANSIENT_RETRIES times; any other excludes this source for it."""
        with self._cond:
            st = self.stats[url]
            if pid is not None:
                self._in_flight -= 1
                self._busy[url] -= 1
                if transient:
                    self._transient[pid][url] += 1
                if not transient or self._transient[pid][url] > TRANSIENT_RETRIES:
                    self._failed_on[pid][url] = reason
                self._pending.appendleft(pid)
                self.retries += 1
                leaf, k = self.pieces[pid]
                st.failures.append(f"leaf {leaf} piece {k}: {reason}")
            st.consecutive_errors += 1
            if dead or st.consecutive_errors >= self.max_consecutive_errors:
                if url in self._alive:
                    self._alive.discard(url)
                    st.dead = reason if dead else f"{st.consecutive_errors} errors in a row, last: {reason}"
            self._check_servable()
            self._cond.notify_all()

    def _pause(self, url: str) -> None:
        """Waits a little before the same source is asked again (ends early if the fetch does)."""
        with self._cond:
            pause = min(1.0, RETRY_PAUSE_S * self.stats[url].consecutive_errors)
            self._cond.wait_for(lambda: self._error is not None, timeout=self._wait_s(pause))

    def _check_servable(self) -> None:
        if self._error is not None:
            return
        for pid in self._pending:
            if not (self._alive - set(self._failed_on[pid])):
                leaf, k = self.pieces[pid]
                path = self.manifest.leaves[leaf].path
                why = "; ".join(
                    f"{u}: {self._failed_on[pid].get(u) or self.stats[u].dead or 'unavailable'}" for u in self.stats
                )
                self._end(FetchError(
                    f"step {self.manifest.step}: no source can supply leaf {leaf} ({path}) piece {k}: {why}"
                ))
                return

    # -- transfer -----------------------------------------------------------

    def _worker(self, url: str) -> None:
        ep = self.endpoints[url]
        conn: http.client.HTTPConnection | None = None
        try:
            while True:
                pid = self._next(url)
                if pid is None:
                    return
                try:
                    if conn is None or conn.sock is None:  # none yet, or the server said Connection: close
                        self._live.close(conn)
                        conn = None
                        conn = self._live.open(ep, self.timeout_s)
                    self._get(conn, ep, pid)
                except _Ended:
                    return
                except _Rejected as e:
                    self._live.close(conn)  # the rejected response may be unread: a fresh connection next
                    conn = None
                    self._fail(url, pid, str(e))
                except _Gone as e:
                    self._fail(url, pid, str(e), dead=True)
                    return
                except _Transient as e:
                    self._live.close(conn)
                    conn = None
                    self._fail(url, pid, str(e), transient=True)
                    self._pause(url)
                except (OSError, http.client.HTTPException) as e:
                    self._live.close(conn)
                    conn = None
                    if self._error is not None:  # the fetch ended and shut this socket: not the source's doing
                        return
                    self._fail(url, pid, f"connection error: {type(e).__name__}: {e}", transient=True)
                    try:  # a dead source refuses to reconnect; a liar that cut one body does not
                        conn = self._live.open(ep, self.timeout_s)
                    except Exception as e2:  # noqa: BLE001 - (a TLS error too): a worker must not die silently
                        if self._error is None:
                            self._fail(url, None, f"unreachable: {type(e2).__name__}: {e2}", dead=True)
                        return
                except Exception as e:  # noqa: BLE001 - whatever this source caused: it is dropped, its piece
                    self._fail(url, pid, f"{type(e).__name__}: {str(e)[:300]}", dead=True)  # goes to another
                    return
                else:
                    leaf, k = self.pieces[pid]
                    start, end = self.manifest.piece_range(leaf, k)
                    self._complete(url, pid, end - start)
        finally:
            self._live.close(conn)

    def _get(self, conn: http.client.HTTPConnection, ep: _Endpoint, pid: int) -> None:
        m = self.manifest
        leaf, k = self.pieces[pid]
        start, end = m.piece_range(leaf, k)
        n = end - start
        path = f"/v1/snapshot/{m.step}/leaf/{leaf}/piece/{k}"
        conn.request("GET", path, headers=ep.headers(self.key, path))
        resp = conn.getresponse()
        if resp.status != 200:
            reason = _error_reason(resp, _until(self.timeout_s, self.deadline))
            if resp.status in (401, 403, 409):
                raise _Gone(reason)
            if resp.status >= 500:
                raise _Transient(reason)
            raise _Rejected(reason)
        got_range = resp.getheader("X-Fthsdp-Range")
        length = resp.getheader("Content-Length")
        if resp.getheader("X-Fthsdp-Step") != str(m.step) or got_range != f"{start}-{end}" or length != str(n):
            raise _Rejected(  # (its body is not read: the connection is closed)
                f"wrong piece: step {resp.getheader('X-Fthsdp-Step')} range {got_range} length {length}, "
                f"expected step {m.step} range {start}-{end} length {n}"
            )
        off = m.leaves[leaf].offset + start
        view = memoryview(self.buffer.array[off : off + n])
        got = 0
        while got < n:
            self._going()
            r = resp.readinto(view[got : min(n, got + READ_SLICE)])
            if not r:
                raise http.client.IncompleteRead(b"", n - got)
            got += r
        if not resp.isclosed():  # an empty piece: finish the response so the connection can be reused
            resp.read()
        expected = m.checksums[leaf][k]
        try:
            claimed = int(resp.getheader("X-Fthsdp-Checksum") or "", 16)
        except ValueError:
            raise _Rejected(f"unreadable checksum header {resp.getheader('X-Fthsdp-Checksum')!r}") from None
        if claimed != expected:
            raise _Rejected(f"checksum header {claimed:08x} disagrees with the manifest's {expected:08x}")
        actual = checksum(view)
        if actual != expected:
            raise _Rejected(f"corrupt body: crc32 {actual:08x}, expected {expected:08x}")

    # -- results ------------------------------------------------------------

    def _wait_for(self, ready, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not ready():
                if self._error is not None or self._past_deadline():
                    raise self._error
                now = time.monotonic()
                left = None if deadline is None else deadline - now
                if left is not None and left <= 0:
                    raise TimeoutError(f"fetch of step {self.manifest.step} not finished after {timeout}s")
                if now - self._progress_at > self.stall_s:
                    self._end(FetchError(
                        f"no piece of step {self.manifest.step}'s state landed for {self.stall_s:g} s "
                        f"({self._done} of {len(self.pieces)} done; sources {sorted(self._alive)} are stalled "
                        "or too slow): fetching from other peers"))
                    raise self._error
                self._cond.wait(self._wait_s(0.25 if left is None else min(left, 0.25)))
            if self._error is not None:
                raise self._error

    def leaf(self, i: int, timeout: float | None = None) -> np.ndarray:
        """Leaf i as a host array, once all its pieces have landed and verified (FetchError at the
        session's deadline or stall limit; TimeoutError after `timeout`, the fetch going on)."""
        self._wait_for(lambda: self._left_per_leaf[i] == 0, timeout)
        return self.buffer.leaf_view(self.manifest.leaves[i])

    def wait(self, timeout: float | None = None) -> "FetchSession":
        self._wait_for(lambda: self._done == len(self.pieces), timeout)
        self.close()
        return self

    def close(self) -> None:
        """Ends the fetch (cancels it if unfinished), shuts its sockets and joins its threads, within
        CLOSE_JOIN_S in all: the caller (the training thread) is not held by a trickling source."""
        with self._cond:
            if self._error is None and self._done < len(self.pieces):
                self._end(FetchError(f"step {self.manifest.step}: fetch cancelled (closed before it finished)"))
            self._cond.notify_all()
        self._live.cut("the fetch was closed")
        until = time.monotonic() + CLOSE_JOIN_S
        for t in self._threads:
            t.join(timeout=max(0.0, until - time.monotonic()))

    @property
    def seconds(self) -> float:
        return (self.t_end or time.perf_counter()) - self.t_start

    @property
    def gbps(self) -> float:
        return self.manifest.total_bytes / max(self.seconds, 1e-9) / 1e9

    def report(self) -> dict:
        return {
            "step": self.manifest.step,
            "bytes": self.manifest.total_bytes,
            "seconds": self.seconds,
            "gbps": self.gbps,
            "retries": self.retries,
            "sources": {u: {"pieces": s.pieces, "bytes": s.bytes, "failures": len(s.failures), "dead": s.dead}
                        for u, s in self.stats.items()},
        }

    def tree(self, like=None, shardings=None):
        """The fetched state (see snapshot.restore_tree); waits for the fetch."""
        self.wait()
        return restore_tree(self.manifest, self.buffer, like=like, shardings=shardings)


def consensus(manifests: dict[str, Manifest], step: int | None) -> tuple[Manifest, list[str], dict[str, str]]:
    """(manifest to fetch, sources that agree with it, excluded source -> why)."""
    if not manifests:
        raise FetchError("no manifests to agree on")
    excluded: dict[str, str] = {}
    if step is None:
        counts = Counter(m.step for m in manifests.values())
        step = max(counts, key=lambda s: (counts[s], s))
    same_step = {u: m for u, m in manifests.items() if m.step == step}
    for u, m in manifests.items():
        if m.step != step:
            excluded[u] = f"serves step {m.step}, fetching step {step}"
    if not same_step:
        raise FetchError(f"no source serves step {step}")
    layouts: list[tuple[Manifest, list[str]]] = []
    for u, m in same_step.items():
        for ref, members in layouts:
            if ref.same_layout(m):
                members.append(u)
                break
        else:
            layouts.append((m, [u]))
    # A vote without a majority is not decided by the sources' order: the first one listed (a
    # liar, or a replica whose memory flipped a bit) won, and its state was installed.
    sizes = sorted((len(x[1]) for x in layouts), reverse=True)
    if len(sizes) > 1 and sizes[0] == sizes[1]:
        raise FetchError(f"the sources of step {step} disagree on the snapshot's layout with no majority "
                         f"({[sorted(x[1]) for x in layouts]}): their replicas run different models or one lies")
    ref, members = max(layouts, key=lambda x: len(x[1]))
    for u in same_step:
        if u not in members:
            excluded[u] = "its snapshot layout differs from the other peers' (different model or optimizer?)"
    sums = []
    for i in range(len(ref.leaves)):
        per_piece = []
        for k in range(ref.num_pieces(i)):
            votes = Counter(same_step[u].checksums[i][k] for u in members)
            (top, best), *rest = votes.most_common(2)
            if rest and rest[0][1] == best:
                split = {f"{c:08x}": sorted(u for u in members if same_step[u].checksums[i][k] == c) for c in votes}
                raise FetchError(f"the sources of step {step} disagree on piece {k} of leaf {i} "
                                 f"({ref.leaves[i].path[:120]}) with no majority: {split}; one of them holds "
                                 "corrupt state (silent data corruption) or lies: the lighthouse's fingerprint "
                                 "check names it, or fetch from more sources")
            per_piece.append(top)
        sums.append(tuple(per_piece))
    agreed = Manifest(step, ref.leaves, ref.piece_bytes, tuple(sums), ref.total_bytes)
    return agreed, members, excluded


class PeerFetcher:
    """Fetches one replica's state at `step` from `sources` (base URLs of peer servers).

    `key` is the job's peer key (``peer_server.peer_key(job key)``): every
    request is signed with it (``peer_auth``); None sends unsigned requests,
    which only a server run with ``authenticate=False`` (measurements) answers. `tls_ca_file`: verify https
    sources against this CA (and refuse plain-http ones); without it, https
    sources are verified against the system's trust store.

    `timeout_s` bounds each socket operation; `deadline` (a ``time.monotonic()`` value, None: no
    overall bound beyond the stall limit) is when the whole fetch must be over: the manifests get at
    most half the time left (a source slow to answer is left out, the others' manifests are used),
    the transfer the rest, and past it `start()`, `leaf()`, `wait()` and `fetch()` raise FetchError
    naming the slow sources, with every thread and socket of the fetch ended."""

    def __init__(
        self,
        sources: Sequence[str],
        key: bytes | str | None,
        step: int | None = None,
        streams_per_source: int = 2,
        timeout_s: float = 10.0,
        max_consecutive_errors: int = 3,
        tls_ca_file: str | None = None,
        deadline: float | None = None,
    ):
        if not sources:
            raise ValueError("PeerFetcher needs at least one source URL (the healthy peers assigned by the quorum)")
        if len(set(sources)) != len(sources):
            raise ValueError(f"duplicate peer sources: {list(sources)}")
        if streams_per_source < 1:
            raise ValueError(f"streams_per_source must be >= 1, got {streams_per_source}")
        self.tls = client_tls(tls_ca_file) if tls_ca_file else None
        for u in sources:
            _Endpoint.of(u, self.tls)
        self.sources = list(sources)
        self.key = _key_bytes(key)
        self.step = step
        self.streams_per_source = streams_per_source
        self.timeout_s = timeout_s
        self.max_consecutive_errors = max_consecutive_errors
        self.deadline = deadline

    def _what(self) -> str:
        return "the latest step" if self.step is None else f"step {self.step}"

    def _check_deadline(self, phase: str) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise FetchError(f"the fetch of {self._what()} from {self.sources} ran past its deadline {phase}: "
                             "the fetch will be retried from other peers")

    def manifests(self) -> tuple[dict[str, Manifest], dict[str, str]]:
        """Every reachable source's manifest; the others with their reason. Each request ends by
        the stall bound, or with a deadline by half the time left to it (so the transfer keeps the
        other half): a source that has not answered by then is left out as too slow."""
        got: dict[str, Manifest] = {}
        failed: dict[str, str] = {}
        now = time.monotonic()
        until = None if self.deadline is None else now + max(0.0, self.deadline - now) / 2

        def one(url):
            try:
                return url, get_manifest(url, self.key, self.step, self.timeout_s, self.tls, until), None
            except (_Gone, SnapshotError) as e:
                return url, None, str(e)
            except (OSError, http.client.HTTPException) as e:
                return url, None, f"unreachable: {type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - whatever one peer sent: that source fails, not the fetch
                return url, None, f"its manifest could not be read: {type(e).__name__}: {str(e)[:300]}"

        with ThreadPoolExecutor(max_workers=len(self.sources)) as pool:
            for url, m, err in pool.map(one, self.sources):
                if m is not None:
                    got[url] = m
                else:
                    failed[url] = err or "unknown error"
        return {u: got[u] for u in self.sources if u in got}, failed

    def start(self, like=None, buffer: HostBuffer | None = None) -> FetchSession:
        """Agrees on a manifest and starts the transfer; returns at once.

        `buffer`: a pre-faulted HostBuffer of the snapshot's size to receive
        into (reuse one across fetches to keep page faults off the critical path);
        by default a fresh one is made (and faulted in before the clock starts)."""
        self._check_deadline("before it began")
        manifests, failed = self.manifests()
        if not manifests:
            why = "; ".join(f"{u}: {r}" for u, r in failed.items())
            raise FetchError(f"no source could serve {self._what()}: {why}; the fetch will be retried from other "
                             "peers")
        manifest, members, excluded = consensus(manifests, self.step)
        excluded.update(failed)
        if like is not None:
            paths, leaves, _ = flatten(like)
            check_matches(manifest, paths, leaves)
        return FetchSession(
            manifest, members, self.key, self.streams_per_source, self.timeout_s, self.max_consecutive_errors, excluded,
            buffer, self.tls, self.deadline,
        )

    def fetch(self, like=None, shardings=None) -> Any:
        """Fetches and returns the state pytree (numpy, or placed on `shardings`)."""
        session = self.start(like)
        return session.tree(like=like, shardings=shardings)
