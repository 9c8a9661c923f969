"""Keys and per-call credentials of the control plane: pure functions over bytes.

**Why this design.** One lighthouse serves many jobs, and a replica of one job
must not be able to act for another. So the lighthouse holds a *lighthouse
secret* (32 random bytes) and each job's key is derived from it and the job id,
``job_key = HMAC(lighthouse_secret, "fthsdp job key" || job_id)``. A launcher
hands its replicas only their job key: with it they can sign calls for their
own job and nothing else, while the lighthouse, holding the lighthouse secret,
re-derives any job's key on demand and so keeps no per-job key table. Every
other key of a job (peer state server token, FTAR handshake, ...) is derived
from the job key with :func:`derive` and a purpose string, so one secret per
job authenticates everything and a leaked purpose key (say, the peer server's
token) cannot be turned into another (the lighthouse credential). The read-only
*status key* is derived from the lighthouse secret: it lets ``fthsdp status``
read every job's status but sign nothing else (the lighthouse checks the
purpose of each call's key).

A job key is never sent: the per-call credential (:func:`sign`) is an HMAC over
the method, job id, replica id, the key's kind, a timestamp, a nonce and the
request's bytes; the lighthouse recomputes it, compares in constant time, refuses a
timestamp more than :data:`CLOCK_WINDOW_S` behind its clock or :data:`MAX_FUTURE_S` ahead,
and a nonce the same key signed in that window (:class:`KeyedReplayCache`: one
:class:`ReplayCache` per key, so one job's calls can crowd out no other job's). It travels
inside the request, as its last field, in a
fixed binary layout (:func:`signed_request`, :func:`split_signed`; below says
why not gRPC metadata).

Everything here is pure (bytes in, bytes out) and unit-tested without servers;
:mod:`fthsdp.control.lighthouse` and :mod:`fthsdp.control.lighthouse_client`
do the transport.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
import struct
import time
from typing import NamedTuple

from fthsdp.control.wire import varint

__all__ = [
    "KEY_BYTES", "CLOCK_WINDOW_S", "MAX_FUTURE_S", "derive", "job_key", "status_key", "new_secret",
    "load_secret", "SecretError", "ReplayCache", "KeyedReplayCache", "clock_problem",
]

KEY_BYTES = 32  # every secret and derived key: 256 bits (HMAC-SHA256's output)

# How far a call's timestamp may be behind the server's clock (seconds). Replicas and
# lighthouse of one job run on hosts with NTP; 30 s tolerates their skew and a call's
# delays on its way (held by a budget, retried, a peer request's slow head: timeouts.py),
# which only ever make a call older. (A protocol constant, not a timeout: nothing waits on it.)
CLOCK_WINDOW_S = 30.0
# How far a call's timestamp may be *ahead* of the server's clock (seconds). Only a client's
# clock running ahead makes an honest call look early (no delay does), and NTP keeps hosts
# well within a second of each other, so a few seconds is ample. Why not the full window: a
# replay cache must remember a nonce until its timestamp leaves the window, and when it
# overflows it forgets the earliest-stamped first and refuses everything stamped before them
# (the floor, ReplayCache): calls stamped far ahead are what lift that floor past the present,
# so that fresh calls of the same key are refused until the clock catches up. Bounded here, a
# flood's own key recovers within this many seconds, and a nonce is remembered 35 s at most, not 60.
MAX_FUTURE_S = 5.0
# A server (re)started refuses calls signed more than this before its start (ReplayCache.not_before):
# it cannot know which of them it saw. The grace spares a client whose clock is a little behind.
START_GRACE_S = 1.0

# Where an operator puts a secret (never on a command line: it would show in `ps`).
SECRET_FILE_ENV = "FTHSDP_JOB_SECRET_FILE"
SECRET_ENV = "FTHSDP_JOB_SECRET"  # hex
LIGHTHOUSE_SECRET_FILE_ENV = "FTHSDP_LIGHTHOUSE_SECRET_FILE"
LIGHTHOUSE_SECRET_ENV = "FTHSDP_LIGHTHOUSE_SECRET"  # hex


class SecretError(ValueError):
    """A secret that cannot be used (missing, unreadable, too short); the message says what to do."""


def _check_key(key: bytes, what: str) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        got = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise SecretError(f"{what} must be at least 16 bytes of secret (got {got})")


def derive(job_key: bytes, purpose: str) -> bytes:
    """The key for one ``purpose`` (e.g. ``"peer-server"``, ``"ftar"``,
    ``"lighthouse"``) derived from ``job_key``: HMAC-SHA256(job_key, "fthsdp/" || purpose).

    Different purposes give independent keys, so knowing one tells nothing of
    the others or of the job key.
    """
    _check_key(job_key, "job_key")
    if not purpose or "\0" in purpose:
        raise ValueError(f"purpose must be a non-empty string without NUL, got {purpose!r}")
    return hmac.new(bytes(job_key), b"fthsdp/" + purpose.encode(), hashlib.sha256).digest()


def job_key(lighthouse_secret: bytes, job_id: str) -> bytes:
    """The key of job ``job_id`` on a lighthouse holding ``lighthouse_secret``."""
    _check_key(lighthouse_secret, "lighthouse secret")
    return hmac.new(bytes(lighthouse_secret), b"fthsdp job key\0" + job_id.encode(), hashlib.sha256).digest()


def status_key(lighthouse_secret: bytes) -> bytes:
    """The read-only key of a lighthouse: signs Status calls of every job, nothing else."""
    _check_key(lighthouse_secret, "lighthouse secret")
    return hmac.new(bytes(lighthouse_secret), b"fthsdp status key\0", hashlib.sha256).digest()


def new_secret() -> bytes:
    """A fresh random secret (a launcher's per-job lighthouse secret)."""
    return secrets.token_bytes(KEY_BYTES)


def parse_secret(text: bytes, where: str) -> bytes:
    """A secret as stored: 64 hex digits (what fthsdp writes), or raw bytes (>= 16)."""
    stripped = text.strip()
    try:
        s = stripped.decode("ascii")
        if len(s) >= 32 and len(s) % 2 == 0 and all(c in "0123456789abcdefABCDEF" for c in s):
            return bytes.fromhex(s)
    except UnicodeDecodeError:
        pass
    if len(text) < 16:
        raise SecretError(f"the secret in {where} is too short ({len(text)} bytes): "
                          "write at least 16 random bytes, e.g. 64 hex digits from `openssl rand -hex 32`")
    return bytes(text)


def load_secret(path: str | None = None, *, file_env: str = SECRET_FILE_ENV, env: str = SECRET_ENV,
                environ: dict | None = None) -> bytes | None:
    """The secret from ``path``, else from the file named by ``$file_env``, else ``$env``
    (hex); None when none is given. Raises :class:`SecretError` saying what is wrong."""
    environ = os.environ if environ is None else environ
    path = path or environ.get(file_env) or None
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read(4096)
        except OSError as e:
            raise SecretError(f"cannot read the secret file {path}: {e.strerror or e}") from e
        return parse_secret(data, f"file {path}")
    text = environ.get(env)
    if text:
        return parse_secret(text.encode(), f"${env}")
    return None


def write_secret(path: str, secret: bytes) -> None:
    """Write ``secret`` as hex to a new file readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")


# -- per-call credentials ------------------------------------------------------
#
# A call's credential travels inside its request message, as its last field
# (``bytes credential = 130`` in every request of fthsdp/proto/lighthouse.proto), in
# a fixed binary layout: kind (1 byte), timestamp (int64, microseconds since the
# epoch), nonce (16 bytes), signature (32 bytes, HMAC-SHA256). The signature covers
# the method, job id, replica id, kind, timestamp, nonce and every byte of the
# request before that field; the field's encoding is a fixed 3 bytes (tag 130,
# length 57) then those 57, so the lighthouse finds it at the end of the bytes it
# received without parsing anything (:func:`split_signed`). Whatever protobuf makes
# of the bytes, they are exactly the signed prefix and the credential: a request
# cannot be changed without the key.
#
# Older clients sent a text credential in gRPC metadata (``LEGACY_METADATA_KEY``);
# Python gRPC spent more on that one metadata entry, on both ends, than on the HMAC
# (experiments/auth_cost.py: a heartbeat x1.08 of an unsigned one's from the metadata
# alone), and parsing hex text cost the lighthouse's event loop more than the binary
# fields do. Such a call is refused with a reason naming the upgrade.

CREDENTIAL_FIELD = 130
LEGACY_METADATA_KEY = "fthsdp-auth"  # where older clients sent it: refused with a reason saying so
_KIND_BYTES = {"job": b"j", "status": b"s"}  # "job": a job's replica; "status": the read-only key
_KIND_NAMES = {v: k for k, v in _KIND_BYTES.items()}
_SIGNED_FIELDS = struct.Struct(">cq16s")  # kind, timestamp (us), nonce: signed as they travel
_LAYOUT = struct.Struct(">cq16s32s")  # ... and the signature
CREDENTIAL_BYTES = _LAYOUT.size  # 57


_FIELD_HEAD = varint(CREDENTIAL_FIELD << 3 | 2) + varint(CREDENTIAL_BYTES)  # tag 130 (2 bytes), length 57
TAIL_BYTES = len(_FIELD_HEAD) + CREDENTIAL_BYTES  # what signing appends to a request: 60 bytes


class Credential(NamedTuple):
    """What a call carries besides what it asks (:meth:`encode`: the ``credential`` field's
    bytes). A named tuple: built for every call the lighthouse checks, at a fraction of a
    frozen dataclass's cost."""

    kind: str  # "job" (a job's replica) or "status" (read-only)
    timestamp_us: int  # microseconds since the epoch
    nonce: bytes  # 16
    signature: bytes  # 32

    @property
    def timestamp(self) -> float:
        return self.timestamp_us / 1e6

    def encode(self) -> bytes:
        return _LAYOUT.pack(_KIND_BYTES[self.kind], self.timestamp_us, self.nonce, self.signature)

    @staticmethod
    def decode(data: bytes) -> "Credential":
        """Raises ValueError for anything but the 57-byte layout of a known kind."""
        if len(data) != CREDENTIAL_BYTES:
            raise ValueError(f"a credential is {CREDENTIAL_BYTES} bytes, got {len(data)}")
        kind, ts, nonce, sig = _LAYOUT.unpack(data)
        name = _KIND_NAMES.get(kind)
        if name is None:
            raise ValueError(f"unknown credential kind {kind!r} (job or status)")
        return tuple.__new__(Credential, (name, ts, nonce, sig))


class _Pads:
    """HMAC-SHA256's two keyed SHA-256 states, computed once per key and copied per call.

    The same bytes as ``hmac.new(key, msg, sha256)``, without a key schedule per call; and
    unlike OpenSSL's one-shot ``hmac.digest``, which gives the GIL up around every call,
    SHA-256 updates this small keep it. With one other Python thread running (every gRPC
    process has some), a 150-byte hmac.digest took 10.4 us and these pads 2.5 us (measured
    here, same process). End to end the change is within the noise of
    experiments/auth_cost.py (a signed heartbeat x1.11 and x1.20 of an unsigned one's before
    it, x0.98, x1.19 and x1.15 after).
    """

    def __init__(self, cap: int = 4096) -> None:
        self._pads: dict[bytes, tuple] = {}
        self._cap = cap

    def get(self, key: bytes) -> tuple:
        p = self._pads.get(key)
        if p is None:
            k = hashlib.sha256(key).digest() if len(key) > 64 else bytes(key)
            k = k.ljust(64, b"\0")
            p = (hashlib.sha256(bytes(x ^ 0x36 for x in k)), hashlib.sha256(bytes(x ^ 0x5C for x in k)))
            if len(self._pads) >= self._cap:
                self._pads.clear()
            self._pads[bytes(key)] = p
        return p


_PADS = _Pads()


def hmac_sha256(key: bytes, msg: bytes) -> bytes:
    """HMAC-SHA256(key, msg) (RFC 2104), from the key's cached pads."""
    inner, outer = _PADS.get(key)
    i = inner.copy()
    i.update(msg)
    o = outer.copy()
    o.update(i.digest())
    return o.digest()


def _call_prefix(method: str, job_id: str, replica_id: str) -> bytes:
    # The ids, each prefixed with its length in characters (they are arbitrary text): with the
    # request's bytes after them (its fields, the credential field's head, kind, timestamp and
    # nonce), no two different calls give the same bytes.
    return f"fthsdp call v2\0{len(method)}:{method}{len(job_id)}:{job_id}{len(replica_id)}:{replica_id}".encode()


class _CallStates:
    """HMAC-SHA256 states already keyed and fed a call's prefix (:func:`_call_prefix`), per
    (key, method, job id, replica id): a call then hashes only its own request bytes.

    Why: the lighthouse checks every request on its event loop, between gRPC's own work,
    where each Python-level operation costs several times what it does in a hot loop (the
    caches are cold). A replica sends the same few (method, ids) for its whole life, so the
    keyed state after the prefix is kept and copied instead of building, encoding and hashing
    the prefix per call: timed inside a running lighthouse, the MAC went from 5.9 to 5.2 us
    per heartbeat (in a hot loop, 0.6 us).
    The bytes hashed are exactly those of ``hmac.new(key, prefix || covered, sha256)``.
    Bounded: emptied when ``cap`` states are held (a flood of made-up ids refills it, never
    grows it; each state is a few hundred bytes).
    """

    def __init__(self, cap: int = 1 << 16) -> None:
        self._states: dict[tuple, tuple] = {}
        self._cap = cap

    def get(self, key: bytes, method: str, job_id: str, replica_id: str) -> tuple:
        """``(inner, outer, prefix)``: keyed SHA-256 states, the inner one fed the prefix (copy
        before use), and the prefix's bytes (for :data:`_native_hmac`)."""
        k = (key, method, job_id, replica_id)
        s = self._states.get(k)
        if s is None:
            inner, outer = _PADS.get(key)
            inner = inner.copy()
            prefix = _call_prefix(method, job_id, replica_id)
            inner.update(prefix)
            if len(self._states) >= self._cap:
                self._states.clear()
            s = self._states[(bytes(key), method, job_id, replica_id)] = (inner, outer, prefix)
        return s


_STATES = _CallStates()

# HMAC-SHA256 in one native call (fthsdp._ffi, FTAR's own SHA-256, ffi/crypto/hmac_sha256.h),
# for requests of at most _NATIVE_MAX_BYTES. Why: inside a running lighthouse every step of
# the hashlib path (copy a keyed state, update, copy, update, digest) costs ~1 us, the caches
# being cold from gRPC's work between calls. With one native call for the MAC, checking a
# heartbeat's credential (tail, MAC, comparison) took 6.0 us in place where the hashlib steps
# took 8.8 (same machine, alternating runs); in a hot loop the native call is the slower one.
# Above the bound hashlib's SHA-256 (OpenSSL, with the CPU's SHA instructions where it has
# them) is faster per byte than FTAR's portable one, and a large quorum request is dominated
# by its bytes. Without the extension (not built) the hashlib path does everything.
_NATIVE_MAX_BYTES = 4096
try:
    from fthsdp._ffi import hmac_sha256 as _native_hmac  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the install
    _native_hmac = None


def _mac(key: bytes, method: str, job_id: str, replica_id: str, covered: bytes | memoryview) -> bytes:
    """HMAC-SHA256(key, prefix || covered) from the cached states of this call's key and ids."""
    inner, outer, _ = _STATES.get(key, method, job_id, replica_id)
    i = inner.copy()
    i.update(covered)
    o = outer.copy()
    o.update(i.digest())
    return o.digest()


class _Nonces:
    """Unique nonces without a system call per call: a random 64-bit prefix per process (drawn
    again in a forked child) and a counter. Unique is all a nonce needs to be (the replay cache
    refuses a repeat); it need not be unpredictable, the signature covers it."""

    _U64 = struct.Struct(">Q").pack

    def __init__(self) -> None:
        self._reseed()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._reseed)

    def _reseed(self) -> None:
        self._prefix = os.urandom(8)
        self._counter = itertools.count()

    def next(self) -> bytes:
        return self._prefix + self._U64(next(self._counter) & 0xFFFFFFFFFFFFFFFF)

    _TAIL = struct.Struct(">3scq8sQ").pack  # the field's head, kind, timestamp, nonce (prefix, counter)

    def tail(self, kind: bytes, timestamp_us: int) -> bytes:
        """The credential field's head and signed fields with a fresh nonce, packed at once."""
        return self._TAIL(_FIELD_HEAD, kind, timestamp_us, self._prefix, next(self._counter) & 0xFFFFFFFFFFFFFFFF)


_NONCES = _Nonces()


def sign(key: bytes, method: str, job_id: str, replica_id: str, body: bytes | memoryview, timestamp: float,
         nonce: bytes | None = None, kind: str = "job") -> Credential:
    """The credential of one call signed with ``key`` (a job's lighthouse key or the status
    key); ``body``: the request's bytes before the credential field."""
    nonce = nonce if nonce is not None else _NONCES.next()
    ts = round(timestamp * 1e6)
    covered = b"".join((body, _FIELD_HEAD, _SIGNED_FIELDS.pack(_KIND_BYTES[kind], ts, nonce)))
    return tuple.__new__(Credential, (kind, ts, nonce, _mac(key, method, job_id, replica_id, covered)))


def verify(key: bytes, cred: Credential, method: str, job_id: str, replica_id: str,
           body: bytes | memoryview) -> bool:
    """Whether ``cred`` signs this call, whose request's bytes before the credential field are
    ``body``, with ``key`` (constant-time comparison)."""
    covered = b"".join((body, _FIELD_HEAD, _SIGNED_FIELDS.pack(_KIND_BYTES[cred.kind], cred.timestamp_us, cred.nonce)))
    return hmac.compare_digest(_mac(key, method, job_id, replica_id, covered), cred.signature)


def signed_request(key: bytes, method: str, job_id: str, replica_id: str, body: bytes, kind: str = "job",
                   now: float | None = None) -> bytes:
    """``body`` (a serialized request without a credential) with its credential appended.

    Appending a field to a serialized protobuf message is a valid encoding of the
    message with that field set, so the lighthouse parses the whole as usual and checks
    the signature, the last 32 bytes, over what precedes it (:func:`split_signed`)."""
    # Written out rather than through sign(): every step costs a replica's process far more
    # between gRPC's work than in a hot loop (cold caches), so the body is hashed in place and
    # copied once, with the tail packed in one go (timed in a running client: 9.0 -> 8.2 us per heartbeat; 1.4 us
    # in a hot loop).
    tail = _NONCES.tail(_KIND_BYTES[kind], round((time.time() if now is None else now) * 1e6))
    inner, outer, prefix = _STATES.get(key, method, job_id, replica_id)
    if len(body) <= _NATIVE_MAX_BYTES and _native_hmac is not None:
        covered = body + tail
        return covered + _native_hmac(key, prefix + covered)
    i = inner.copy()
    i.update(body)
    i.update(tail)
    o = outer.copy()
    o.update(i.digest())
    return b"".join((body, tail, o.digest()))


SIGNATURE_BYTES = 32


def split_signed(data: bytes) -> tuple[memoryview, Credential] | None:
    """``(the bytes the signature covers, the credential)`` of a request as received: the
    request up to its last 32 bytes, which are the signature; None when it does not end
    with a well-formed credential field (no credential, or one fthsdp did not encode).
    A view, not a copy: a large replica's quorum request is megabytes. Check it with
    :func:`verify_split`."""
    n = len(data) - TAIL_BYTES
    if n < 0 or data[n:n + len(_FIELD_HEAD)] != _FIELD_HEAD:
        return None
    kind, ts, nonce, sig = _LAYOUT.unpack_from(data, n + len(_FIELD_HEAD))
    name = _KIND_NAMES.get(kind)
    if name is None:
        return None
    return memoryview(data)[:-SIGNATURE_BYTES], tuple.__new__(Credential, (name, ts, nonce, sig))


def verify_split(key: bytes, method: str, job_id: str, replica_id: str, covered: memoryview,
                 cred: Credential) -> bool:
    """:func:`verify` of a request as :func:`split_signed` split it (no bytes rebuilt)."""
    return hmac.compare_digest(_mac(key, method, job_id, replica_id, covered), cred.signature)


_JOB_TAIL_HEAD = _FIELD_HEAD + _KIND_BYTES["job"]  # how a job-key credential's field starts
_TS_NONCE = struct.Struct(">q16s")


def verify_job_request(key: bytes, method: str, job_id: str, replica_id: str,
                       data: bytes) -> tuple[int, bytes] | bool | None:
    """The common case of a request as received, in one step: ``data`` ends with a job-key
    credential that ``key`` signed for this call: ``(timestamp_us, nonce)`` (for the replay
    check); signed otherwise: False; no job-key credential at its end (none, the status
    key's, or malformed): None, for :func:`split_signed` and the full check to say why.

    The same check as :func:`split_signed` then :func:`verify_split`, without building the
    view, the :class:`Credential` or the call's prefix (:class:`_CallStates`): the lighthouse
    runs it for every request, where each step costs far more than in a hot loop.
    """
    n = len(data) - TAIL_BYTES
    if n < 0 or data[n:n + 4] != _JOB_TAIL_HEAD:
        return None
    inner, outer, prefix = _STATES.get(key, method, job_id, replica_id)
    if n <= _NATIVE_MAX_BYTES and _native_hmac is not None:
        mac = _native_hmac(key, prefix + data[:-SIGNATURE_BYTES])
    else:
        i = inner.copy()
        i.update(memoryview(data)[:-SIGNATURE_BYTES])
        o = outer.copy()
        o.update(i.digest())
        mac = o.digest()
    if not hmac.compare_digest(mac, data[-SIGNATURE_BYTES:]):
        return False
    return _TS_NONCE.unpack_from(data, n + 4)


def clock_problem(timestamp: float, now: float, behind_s: float = CLOCK_WINDOW_S, ahead_s: float = MAX_FUTURE_S,
                  clock: str = "the lighthouse's") -> str | None:
    """Why a call stamped ``timestamp`` is refused by a server whose clock reads ``now``, or None
    when it is within ``behind_s`` behind to ``ahead_s`` ahead. ``clock``: whose clock, for the
    text (the lighthouse's, a peer server's)."""
    off = timestamp - now
    if -behind_s <= off <= ahead_s:
        return None
    side = f"more than {behind_s:g} s behind" if off < 0 else f"more than {ahead_s:g} s ahead of"
    return (f"timestamp is {off:+.1f} s from {clock} clock, {side} it (accepted: from {behind_s:g} s behind to "
            f"{ahead_s:g} s ahead): synchronise the clocks (NTP) of this host and {clock} host")


# Refusals of a verified call that the same call signed afresh (a new nonce and timestamp) answers:
# the server asks it to retry (the lighthouse: RESOURCE_EXHAUSTED), not to change its secret.
TOO_OLD = ("the call is too old to be checked for replay: this key's calls overflowed the lighthouse's replay "
           "cache (more of them within the clock window than it holds, or stamped ahead of this one), which then "
           "refuses every call stamped as early as those it forgot: retry it (a fresh nonce and timestamp)")
BEFORE_START = ("the call was signed before this server started, so it cannot be checked for replay: "
                "retry it (a fresh nonce and timestamp); if every call is refused so, this host's clock "
                "is behind the server's: synchronise them (NTP)")
TOO_MANY_KEYS = ("the lighthouse is checking the calls of as many keys (jobs and the status key) as it may at once "
                 "(guard.Limits.replay_keys), each of which signed a call within the clock window: retry it "
                 "(a fresh nonce and timestamp) once one of them has been silent for the clock window, or raise "
                 "the limit")


class ReplayCache:
    """Nonces seen within the clock window, bounded: refuses a nonce seen before.

    One cache serves one key (one principal: a job, the status key, a peer
    server's job); the lighthouse, which serves many, keeps one per key
    (:class:`KeyedReplayCache`).

    Nonces are kept by their call's *timestamp*, in slices of 1/256 of the
    window (~0.12 s), each in arrival order: a replay carries the same signed
    timestamp, so one lookup in one slice decides, and a slice whose every
    timestamp is outside the window is dropped whole (such a call is refused
    by its timestamp anyway). Keyed by timestamp rather than arrival, a call
    stamped ahead of the server's clock (at most ``max_future_s``) stays
    remembered as long as it could be replayed. When more than ``capacity``
    nonces are held, the earliest-stamped are dropped one by one, oldest slice
    first, and, to stay safe, every call stamped at or before the latest
    dropped timestamp is refused as possibly replayed (``floor``): a flood can
    make old-but-valid calls retry, never let a replay through, and a fresh
    call stays accepted. (A flood stamped ahead lifts the floor up to
    ``max_future_s`` past the present: only for the key that sent it, since
    each key has its own cache.)

    A cache starts empty, so a server (re)started less than a window after
    a call was captured could not tell its replay from the call: calls stamped
    at or before ``not_before`` (the server's start, :meth:`started`) are
    refused as :data:`BEFORE_START`, which a client retries with a fresh
    credential. Without it, a lighthouse restart (or a standby taking over)
    opened a window's worth of replays of every call signed before it.
    """

    SLICES = 256

    def __init__(self, window_s: float = CLOCK_WINDOW_S, capacity: int = 200_000,
                 not_before: float = -float("inf"), max_future_s: float = MAX_FUTURE_S) -> None:
        self.window_s = window_s
        self.max_future_s = max_future_s
        self.capacity = capacity
        self._width = window_s / self.SLICES
        self._slices: dict[int, dict] = {}  # slice (timestamp // width) -> nonce -> timestamp
        self._count = 0
        self._oldest: int | None = None  # the smallest slice index held
        self.floor = -float("inf")  # calls with timestamp <= floor are refused (TOO_OLD)
        self.not_before = not_before  # calls with timestamp <= not_before are refused (BEFORE_START)

    def started(self, now: float) -> None:
        """The server starts serving at ``now`` (wall clock): calls signed before are refused."""
        self.not_before = now

    def __len__(self) -> int:
        return self._count

    def _drop(self, index: int) -> None:
        self._count -= len(self._slices.pop(index))
        self._oldest = min(self._slices) if self._slices else None

    TOO_OLD = TOO_OLD
    BEFORE_START = BEFORE_START
    RETRYABLE = (TOO_OLD, BEFORE_START, TOO_MANY_KEYS)  # refusals a fresh credential answers

    def expire(self, now: float) -> None:
        """Forget the slices wholly outside the window at ``now`` (their calls are refused by their
        timestamp anyway)."""
        oldest = self._oldest
        if oldest is not None and (oldest + 1) * self._width < now - self.window_s:
            for i in [i for i in self._slices if (i + 1) * self._width < now - self.window_s]:
                self._drop(i)

    def check_and_add(self, nonce: bytes | str, timestamp: float, now: float) -> str | None:
        """None when fresh (and remembered); otherwise why it is refused. (Every accepted call
        runs this on the lighthouse's event loop: the common path is kept to few operations.)"""
        if not -self.window_s <= timestamp - now <= self.max_future_s:
            return clock_problem(timestamp, now, self.window_s, self.max_future_s)
        oldest = self._oldest
        if oldest is not None and (oldest + 1) * self._width < now - self.window_s:
            self.expire(now)
        if timestamp <= self.floor:
            return TOO_OLD
        if timestamp <= self.not_before:
            return BEFORE_START
        index = int(timestamp // self._width)
        seen = self._slices.get(index)
        if seen is None:
            seen = self._slices[index] = {}  # insertion-ordered: the oldest arrival first
            if self._oldest is None or index < self._oldest:
                self._oldest = index
        elif nonce in seen:
            return "nonce already used: a replayed call (each call must carry a fresh nonce)"
        seen[nonce] = timestamp
        self._count += 1
        if self._count > self.capacity:
            if self._drop_oldest(self.capacity, nonce) or timestamp <= self.floor:
                return TOO_OLD  # the call just added was dropped, or is now below the floor
        return None

    def shed(self, keep: int) -> None:
        """Hold at most ``keep`` nonces, dropping the earliest-stamped (and raising ``floor`` past
        them): :class:`KeyedReplayCache` keeps its keys together within its total bound so."""
        self._drop_oldest(keep, None)

    def _drop_oldest(self, keep: int, nonce: bytes | str | None) -> bool:
        """Drop the earliest-stamped nonces down to ``keep``, raising ``floor`` past them; whether
        ``nonce`` was among them."""
        dropped = False
        while self._count > keep:
            oldest = self._slices[self._oldest]
            n = next(iter(oldest))
            t = oldest.pop(n)
            self._count -= 1
            self.floor = max(self.floor, t)
            dropped = dropped or n == nonce
            if not oldest:
                self._drop(self._oldest)
        return dropped


class KeyedReplayCache:
    """One :class:`ReplayCache` per key (principal) that signed calls, within bounds on the
    nonces each key and all keys together may hold and on the keys held.

    Why per key: a lighthouse serves many jobs, and one cache shared by all let a holder
    of any one job's key (or of the read-only status key) refuse every other job's calls.
    Its calls, stamped ahead of the clock and more of them than the cache held, made it
    forget the earliest-stamped nonces first, the honest calls stamped now, and refuse
    every call stamped before them (the floor): every fresh call of every job, for as
    long as the flood went on, and a nonce another job had used was refused as a replay.
    Here a key's nonces, floor and capacity are its own: a flood lifts the floor of the
    key that sent it only, and nonces are compared within a key only.

    Memory stays bounded: each key holds at most ``capacity`` nonces, all together at
    most ``total_capacity`` (when over, the keys holding the most are cut down to one
    level, earliest-stamped first, so a flood's own key pays for it and a key holding
    fewer than its share is not touched), and at most ``max_keys`` keys are held. A key
    enters only once a call signed with it verified, so the keys held are keys someone
    was given (a job's, the status key), never what a stranger makes up; a key whose
    nonces all left the window is forgotten, and a new key beyond ``max_keys`` is refused
    as :data:`TOO_MANY_KEYS` (retryable) until one falls silent.

    The lighthouse passes the job id as the key of a job-signed call and a token of its
    own for the status key (fthsdp.control.guard.CallAuthenticator); any hashable will do.
    """

    TOO_MANY_KEYS = TOO_MANY_KEYS

    def __init__(self, window_s: float = CLOCK_WINDOW_S, capacity: int = 200_000, total_capacity: int = 400_000,
                 max_keys: int = 4096, not_before: float = -float("inf"),
                 max_future_s: float = MAX_FUTURE_S) -> None:
        for name, v in (("capacity", capacity), ("total_capacity", total_capacity), ("max_keys", max_keys)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KeyedReplayCache {name}={v!r}: must be an integer >= 1")
        if capacity > total_capacity:
            raise ValueError(f"KeyedReplayCache capacity={capacity} (nonces per key) exceeds total_capacity="
                             f"{total_capacity} (all keys together): raise the total or lower the per-key bound")
        self.window_s = window_s
        self.max_future_s = max_future_s
        self.capacity = capacity
        self.total_capacity = total_capacity
        self.max_keys = max_keys
        self.not_before = not_before
        self._caches: dict[object, ReplayCache] = {}
        # Nonces held by every key's cache together, at least: counted up per accepted call and
        # recounted over every key only when past the bound (the common path is one addition).
        self._total = 0
        # What a recount leaves under the bound (cutting the keys that hold the most if need be),
        # so that a sustained flood pays for a pass over every key once per this many calls at most.
        self._slack = max(1, total_capacity // 64)

    def started(self, now: float) -> None:
        """The server starts serving at ``now`` (wall clock): calls signed before are refused, for every key."""
        self.not_before = now
        for c in self._caches.values():
            c.started(now)

    def __len__(self) -> int:
        """Nonces held, every key together (calls that left the window included until their key is next checked)."""
        return sum(c._count for c in self._caches.values())

    def keys(self) -> int:
        """Keys held (the replay cache of each)."""
        return len(self._caches)

    def cache(self, key: object) -> ReplayCache | None:
        """``key``'s own cache, None when none is held (for tests and metrics)."""
        return self._caches.get(key)

    def check_and_add(self, key: object, nonce: bytes | str, timestamp: float, now: float) -> str | None:
        """None when ``nonce`` is fresh for ``key`` (and remembered); otherwise why it is refused.
        ``key`` must be the principal the call's signature verified as (one per job key)."""
        cache = self._caches.get(key)
        if cache is None:
            if not -self.window_s <= timestamp - now <= self.max_future_s:  # holds no key for such a call
                return clock_problem(timestamp, now, self.window_s, self.max_future_s)
            cache = self._new_key(key, now)
            if cache is None:
                return TOO_MANY_KEYS
        why = cache.check_and_add(nonce, timestamp, now)
        if why is None:
            self._total += 1
            if self._total > self.total_capacity:
                self._shed(now)
                if timestamp <= cache.floor:
                    why = TOO_OLD  # cut along with its key's earliest calls: refused as ReplayCache refuses it
        return why

    def _new_key(self, key: object, now: float) -> ReplayCache | None:
        if len(self._caches) >= self.max_keys:
            self._forget_idle(now)
            if len(self._caches) >= self.max_keys:
                return None
        cache = self._caches[key] = ReplayCache(self.window_s, self.capacity, self.not_before, self.max_future_s)
        return cache

    def _forget_idle(self, now: float) -> None:
        """Expire every key's calls outside the window; forget a key holding none whose floor is
        outside it too (anything at or below that floor is refused by its timestamp: nothing the
        key's cache knows is lost)."""
        total = 0
        for key, c in list(self._caches.items()):
            c.expire(now)
            if not c._count and c.floor < now - self.window_s:
                del self._caches[key]
            total += c._count
        self._total = total

    def _shed(self, now: float) -> None:
        """The count passed the total bound: recount; if less than ``_slack`` under the bound, cut the
        keys holding the most down to one level (water-filling), earliest-stamped first, until it is."""
        self._forget_idle(now)
        target = self.total_capacity - self._slack
        if self._total <= target:
            return
        caches = sorted(self._caches.values(), key=len, reverse=True)
        level = _water_level([len(c) for c in caches], target)
        for c in caches:
            if len(c) <= level:
                break
            self._total -= len(c) - level
            c.shed(level)


def _water_level(sizes: list[int], target: int) -> int:
    """The largest level such that cutting every size above it down to it leaves at most
    ``target`` in all (``sizes`` in decreasing order)."""
    rest = sum(sizes)
    for k, s in enumerate(sizes, 1):
        rest -= s
        below = sizes[k] if k < len(sizes) else 0
        level = (target - rest) // k
        if level >= below:
            return max(level, 0)
    return 0


# The refusals of a call's credential that asking again cannot change (fthsdp.control.guard
# builds them; a client raises CredentialRefused for them, and the replica stops job-fatal): the
# wrong secret, none, or a client that signs otherwise. A replay or clock refusal is not among
# them: a new call carries a new nonce and timestamp.
PERMANENT_REFUSALS = ("the credential does not verify", "carries no credential", "malformed credential",
                      "is signed in gRPC metadata", "signed with the read-only status key",
                      "a job's secret reads that job only")


def launcher_keys(secret_file: str, job_id: str, own_lighthouse: bool,
                  environ: dict | None = None) -> tuple[bytes | None, bytes | None]:
    """``(lighthouse_secret, job_key)`` for a launcher.

    With its own lighthouse the launcher needs the lighthouse secret: the one
    the operator gives (``secret_file``, else ``$FTHSDP_JOB_SECRET_FILE`` /
    ``$FTHSDP_JOB_SECRET``) or a fresh random one per job, and derives the
    job's key from it. With a running lighthouse (``launch.lighthouse``) the
    operator gives the job's secret itself (``fthsdp lighthouse
    --print-job-secret JOB``); without one the replicas' calls are unsigned,
    which only a lighthouse run with ``--insecure`` accepts.
    """
    given = load_secret(secret_file or None, environ=environ)
    if own_lighthouse:
        lighthouse_secret = given if given is not None else new_secret()
        return lighthouse_secret, job_key(lighthouse_secret, job_id)
    return None, given


def replica_env(env: dict, job_key_: bytes | None) -> dict:
    """``env`` for a replica process: the job's key in ``$FTHSDP_JOB_SECRET`` and no other secret
    (the lighthouse secret, or a file an operator named, must not reach a replica)."""
    for k in (SECRET_FILE_ENV, SECRET_ENV, LIGHTHOUSE_SECRET_FILE_ENV, LIGHTHOUSE_SECRET_ENV):
        env.pop(k, None)
    if job_key_ is not None:
        env[SECRET_ENV] = job_key_.hex()
    return env
