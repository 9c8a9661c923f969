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
4. hands a failed, truncated or corrupt piece to another source (never back to
   one that failed it), and drops a source that is gone (refused connection,
   repeated errors, stale step, auth refusal) so the others finish its share.

It fails, with every source's reason, only when some piece has no source left
that has not failed it. Leaves become available one by one (`leaf(i)`), in
layout order, while later leaves are still in flight: the Orbax extension uses
that to place arrays on devices as they land.
"""

from __future__ import annotations

import http.client
import json
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
from fthsdp.checkpoint.snapshot import HostBuffer, Manifest, SnapshotError, checksum, check_matches, flatten, restore_tree


class FetchError(RuntimeError):
    """No source could supply some piece (the message gives each source's reason)."""


class _Rejected(Exception):
    """The source answered, but this piece from it is unusable (corrupt, lying)."""


class _Gone(Exception):
    """The source cannot serve this fetch at all (stale step, auth refused)."""


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
STALL_FLOOR_S = 30.0
STALL_TIMEOUTS = 4.0
MAX_ERROR_BODY = 64 << 10  # an error's JSON body is a sentence: more is not read
# A manifest lists each leaf's path, shape and piece checksums: 16 MiB holds ~10^5 leaves of
# ~10^3 pieces. A peer claiming more is refused before anything is allocated for it.
MAX_MANIFEST_BYTES = 16 << 20


def _error_reason(resp: http.client.HTTPResponse) -> str:
    """The first MAX_ERROR_BODY bytes of an error's body, as a reason. The rest is not read (a peer
    could send it for ever): the caller closes the connection after an error."""
    body = resp.read(MAX_ERROR_BODY)
    try:
        return f"HTTP {resp.status}: {str(json.loads(body)['error'])[:1000]}"
    except (ValueError, KeyError, TypeError, RecursionError):
        return f"HTTP {resp.status}: {body[:200]!r}"


def get_manifest(url: str, key: bytes | str | None, step: int | None = None, timeout_s: float = 10.0,
                 tls: ssl.SSLContext | None = None) -> Manifest:
    """One source's manifest (of `step`, or whatever it serves)."""
    ep = _Endpoint.of(url, tls)
    conn = ep.connect(timeout_s)
    try:
        path = "/v1/manifest" if step is None else f"/v1/snapshot/{int(step)}/manifest"
        conn.request("GET", path, headers=ep.headers(_key_bytes(key), path))
        resp = conn.getresponse()
        if resp.status != 200:
            raise _Gone(_error_reason(resp))
        deadline_s = max(STALL_FLOOR_S, STALL_TIMEOUTS * timeout_s)
        return Manifest.from_json(_read_bounded(resp, MAX_MANIFEST_BYTES, deadline_s, "manifest"))
    finally:
        conn.close()


def _read_bounded(resp: http.client.HTTPResponse, limit: int, deadline_s: float, what: str) -> bytes:
    """A response's body of at most ``limit`` bytes, read within ``deadline_s`` overall: a peer
    claiming a huge body (read() allocated all of it at once) or trickling a byte within each
    read's timeout (read() waited for ever) is refused (SnapshotError: the source is dropped)."""
    claimed = resp.getheader("Content-Length")
    size = ascii_int(claimed) if claimed is not None else None
    if claimed is not None and (size is None or size > limit):
        raise SnapshotError(f"the peer's {what} claims {claimed[:32]!r} bytes: at most {limit} are read")
    deadline = time.monotonic() + deadline_s
    parts, got = [], 0
    while True:
        chunk = resp.read1(64 << 10)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        got += len(chunk)
        if got > limit:
            raise SnapshotError(f"the peer's {what} is over {limit} bytes: refused")
        if time.monotonic() > deadline:
            raise SnapshotError(f"the peer's {what} took over {deadline_s:g}s to arrive ({got} bytes so far): "
                                "a stalled or trickling peer")


class FetchSession:
    """One fetch in progress; see the module docstring."""

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
        self._pending = deque(range(len(self.pieces)))
        self._in_flight = 0
        self._left_per_leaf = [manifest.num_pieces(i) for i in range(len(manifest.leaves))]
        self._done = 0
        self._error: FetchError | None = None
        self._cond = threading.Condition()
        # A wait for pieces ends when none has landed for this long: a source that trickles bytes
        # (each read within timeout_s) must not hold a rejoining replica forever.
        self.stall_s = max(STALL_FLOOR_S, STALL_TIMEOUTS * timeout_s)
        self._progress_at = time.monotonic()
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
                for j, pid in enumerate(self._pending):
                    if url not in self._failed_on[pid]:
                        del self._pending[j]
                        self._in_flight += 1
                        return pid
                self._cond.wait(0.5)  # others may fail pieces back to us

    def _complete(self, url: str, pid: int, nbytes: int) -> None:
        with self._cond:
            self._in_flight -= 1
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

    def _fail(self, url: str, pid: int | None, reason: str, dead: bool = False) -> None:
        with self._cond:
            st = self.stats[url]
            if pid is not None:
                self._in_flight -= 1
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
                self._error = FetchError(
                    f"step {self.manifest.step}: no source can supply leaf {leaf} ({path}) piece {k}: {why}"
                )
                self.t_end = time.perf_counter()
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
                    if conn is None:
                        conn = ep.connect(self.timeout_s)
                    self._get(conn, ep, pid)
                except _Rejected as e:
                    conn.close()  # the rejected response may be unread: a fresh connection for the next piece
                    conn = None
                    self._fail(url, pid, str(e))
                except _Gone as e:
                    self._fail(url, pid, str(e), dead=True)
                    return
                except (OSError, http.client.HTTPException) as e:
                    if conn is not None:
                        conn.close()
                    conn = None
                    self._fail(url, pid, f"connection error: {type(e).__name__}: {e}")
                    try:  # a dead source refuses to reconnect; a liar that cut one body does not
                        probe = ep.connect(self.timeout_s)
                        probe.connect()
                        conn = probe
                    except OSError as e2:
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
            if conn is not None:
                conn.close()

    def _get(self, conn: http.client.HTTPConnection, ep: _Endpoint, pid: int) -> None:
        m = self.manifest
        leaf, k = self.pieces[pid]
        start, end = m.piece_range(leaf, k)
        n = end - start
        path = f"/v1/snapshot/{m.step}/leaf/{leaf}/piece/{k}"
        conn.request("GET", path, headers=ep.headers(self.key, path))
        resp = conn.getresponse()
        if resp.status != 200:
            reason = _error_reason(resp)
            if resp.status in (401, 403, 409, 503):
                raise _Gone(reason)
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
            r = resp.readinto(view[got:])
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
                if self._error is not None:
                    raise self._error
                now = time.monotonic()
                left = None if deadline is None else deadline - now
                if left is not None and left <= 0:
                    raise TimeoutError(f"fetch of step {self.manifest.step} not finished after {timeout}s")
                if now - self._progress_at > self.stall_s:
                    self._error = FetchError(
                        f"no piece of step {self.manifest.step}'s state landed for {self.stall_s:g} s "
                        f"({self._done} of {len(self.pieces)} done; sources {sorted(self._alive)} are stalled "
                        "or too slow): fetching from other peers")
                    self._cond.notify_all()
                    raise self._error
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            if self._error is not None:
                raise self._error

    def leaf(self, i: int, timeout: float | None = None) -> np.ndarray:
        """Leaf i as a host array, once all its pieces have landed and verified."""
        self._wait_for(lambda: self._left_per_leaf[i] == 0, timeout)
        return self.buffer.leaf_view(self.manifest.leaves[i])

    def wait(self, timeout: float | None = None) -> "FetchSession":
        self._wait_for(lambda: self._done == len(self.pieces), timeout)
        self.close()
        return self

    def close(self) -> None:
        with self._cond:
            if self._error is None and self._done < len(self.pieces):
                self._error = FetchError("fetch cancelled")
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 1)

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
    sources are verified against the system's trust store."""

    def __init__(
        self,
        sources: Sequence[str],
        key: bytes | str | None,
        step: int | None = None,
        streams_per_source: int = 2,
        timeout_s: float = 10.0,
        max_consecutive_errors: int = 3,
        tls_ca_file: str | None = None,
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

    def manifests(self) -> tuple[dict[str, Manifest], dict[str, str]]:
        """Every reachable source's manifest; the others with their reason."""
        got: dict[str, Manifest] = {}
        failed: dict[str, str] = {}

        def one(url):
            try:
                return url, get_manifest(url, self.key, self.step, self.timeout_s, self.tls), None
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
        manifests, failed = self.manifests()
        if not manifests:
            why = "; ".join(f"{u}: {r}" for u, r in failed.items())
            raise FetchError(f"no source could serve {'the latest step' if self.step is None else f'step {self.step}'}: {why}")
        manifest, members, excluded = consensus(manifests, self.step)
        excluded.update(failed)
        if like is not None:
            paths, leaves, _ = flatten(like)
            check_matches(manifest, paths, leaves)
        return FetchSession(
            manifest, members, self.key, self.streams_per_source, self.timeout_s, self.max_consecutive_errors, excluded,
            buffer, self.tls,
        )

    def fetch(self, like=None, shardings=None) -> Any:
        """Fetches and returns the state pytree (numpy, or placed on `shardings`)."""
        session = self.start(like)
        return session.tree(like=like, shardings=shardings)
