"""Per-request proofs for the peer state server: HMAC-SHA256 over what is asked, when, of whom.

Why a per-request HMAC rather than a bearer token: a bearer token travels in
every request, so anyone who sees one request (no TLS, or a log line) holds
the job's peer credential for good and can ask for anything. Here the key
never leaves the process; each request carries

    Authorization: FTHSDP-HMAC-SHA256 ts=<unix ms>,nonce=<32 hex>,mac=<64 hex>

with ``mac = HMAC-SHA256(peer_key, "fthsdp-peer-v1\\n" || METHOD || HOST ||
TARGET || ts || nonce)``, each field prefixed with its length. HOST is the server's own address as the
fetcher dialled it (the ``Host`` header, which the server must recognise as
itself) and TARGET the request path, so a captured request cannot be
replayed for another piece, another step or another server; the timestamp
bounds how long it is worth anything (the control plane's one clock window,
``fthsdp.control.auth``: ``CLOCK_WINDOW_S`` behind the server's clock to
``MAX_FUTURE_S`` ahead), and each server remembers the nonces it accepted
inside that window (the control plane's bounded ``ReplayCache``; one cache
suffices, every request a server takes being signed with its own job's key),
so it cannot be replayed to the same server either. The key is derived from the job's
secret (``peer_key``), so a replica of another job signs with another key
and is refused. TLS, when the operator gives certificates, adds secrecy of
the state bytes and lets the fetcher verify the server; the HMAC stays on,
so authentication does not depend on TLS being configured.

Pure functions over plain data (plus the cache, which holds no sockets):
checked by unit tests and the fuzzer without a server.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

from fthsdp.control.auth import CLOCK_WINDOW_S, MAX_FUTURE_S, START_GRACE_S, ReplayCache, clock_problem

__all__ = ["SCHEME", "PURPOSE", "Refusal", "Credential", "sign", "parse_credential", "check_request",
           "ReplayCache", "CLOCK_WINDOW_S", "MAX_FUTURE_S", "START_GRACE_S"]

SCHEME = "FTHSDP-HMAC-SHA256"
PURPOSE = "peer-server"  # the purpose string the peer key is derived under from the job key
_DOMAIN = b"fthsdp-peer-v1\n"
_CREDENTIAL = re.compile(r"ts=(?P<ts>[0-9]{1,16}),nonce=(?P<nonce>[0-9a-f]{32}),mac=(?P<mac>[0-9a-f]{64})")


@dataclass(frozen=True)
class Refusal:
    """An HTTP error status and the text that says what was wrong (and what to do)."""

    status: int
    error: str


@dataclass(frozen=True)
class Credential:
    """The parsed fields of one request's Authorization header."""

    ts_ms: int
    nonce: str
    mac: bytes


def _message(method: str, host: str, target: str, ts_ms: int, nonce: str) -> bytes:
    # Length-prefixed fields: no two different requests give the same bytes, whatever they contain.
    # surrogatepass: text with lone surrogates (not valid Unicode) still signs and compares, never
    # raises (a fuzzer finding: surrogateescape raised on surrogates outside U+DC80..U+DCFF).
    parts = [p.encode("utf-8", "surrogatepass") for p in (method, host.lower(), target, str(ts_ms), nonce)]
    return _DOMAIN + b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def sign(key: bytes, method: str, host: str, target: str, ts_ms: int | None = None, nonce: str | None = None) -> str:
    """The Authorization header value for one request (fresh timestamp and nonce unless given)."""
    ts_ms = int(time.time() * 1000) if ts_ms is None else ts_ms
    nonce = secrets.token_hex(16) if nonce is None else nonce
    mac = hmac.new(key, _message(method, host, target, ts_ms, nonce), hashlib.sha256).hexdigest()
    return f"{SCHEME} ts={ts_ms},nonce={nonce},mac={mac}"


def parse_credential(header: str | None) -> Credential | Refusal:
    """The credential in an Authorization header, or why it is not one. Never raises."""
    if not header:
        return Refusal(401, f"missing credential: sign each request with the job's peer key "
                            f"('Authorization: {SCHEME} ts=..,nonce=..,mac=..', fthsdp.checkpoint.peer_auth.sign)")
    scheme, _, rest = header.partition(" ")
    if scheme == "Bearer":
        return Refusal(401, "bearer tokens are not accepted (they can be replayed): sign each request with "
                            f"the job's peer key ({SCHEME})")
    if scheme != SCHEME:
        return Refusal(401, f"unknown authorization scheme {scheme[:40]!r}: expected {SCHEME}")
    m = _CREDENTIAL.fullmatch(rest.strip())
    if m is None:
        return Refusal(401, f"malformed {SCHEME} credential: expected ts=<unix ms>,nonce=<32 hex>,mac=<64 hex>")
    return Credential(int(m["ts"]), m["nonce"], bytes.fromhex(m["mac"]))


def check_request(header: str | None, key: bytes, method: str, host: str, target: str, now_s: float,
                  cache: ReplayCache) -> Refusal | None:
    """None when `header` proves a request for (method, host, target) signed with `key` now, else why not.

    The MAC is checked (in constant time) before the clock and the nonce, so a
    stranger can neither learn anything from the timing nor fill the replay
    cache. Never raises."""
    cred = parse_credential(header)
    if isinstance(cred, Refusal):
        return cred
    want = hmac.new(key, _message(method, host, target, cred.ts_ms, cred.nonce), hashlib.sha256).digest()
    if not hmac.compare_digest(want, cred.mac):
        return Refusal(403, "wrong credential: not signed with this job's peer key for this request "
                            "(a peer of another job, a different job secret, or a request altered in transit)")
    ts_s = cred.ts_ms / 1000
    clock = clock_problem(ts_s, now_s, cache.window_s, cache.max_future_s, "this peer server's")
    if clock is not None:
        return Refusal(401, f"credential {clock}; then sign afresh")
    why = cache.check_and_add(cred.nonce, ts_s, now_s)
    return None if why is None else Refusal(403, f"{why.replace('the lighthouse', 'this peer server')}")
