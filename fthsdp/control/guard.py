"""What the lighthouse refuses before a request touches any job: limits and credentials.

Everything a request can make the lighthouse hold or send is bounded here
(:class:`Limits`): lengths and characters of ids, address syntax and ports,
the step range, replicas per job, jobs per lighthouse, the dead list of a
heartbeat reply, the rate of new replica ids per client host. Each refusal says
what was wrong and what to do, with the gRPC code a client can act on:
``INVALID_ARGUMENT`` (the request is malformed: fix the caller),
``RESOURCE_EXHAUSTED`` (a limit of this lighthouse is full: raise it or wait),
``UNAUTHENTICATED`` (no or a bad credential), ``PERMISSION_DENIED`` (a valid
credential that may not do this).

The checks are pure functions over plain values and protobuf messages
(:func:`request_problem`, :class:`CallAuthenticator`, :class:`NewIdRate`,
:func:`incarnation_problem`). :class:`CallGate` runs them in their one order in
front of every request, whatever carries it (a unary call here, a session
message in :mod:`fthsdp.control.session`). :func:`generic_handler` is the only
piece that touches gRPC: it keeps each request's raw bytes (the credential, the
request's last field, signs the bytes before it), turns a body that is not
protobuf into ``INVALID_ARGUMENT`` (grpc's own deserializer answered
``UNKNOWN``), and runs the gate before the servicer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from fthsdp.addresses import split_host_port
from fthsdp.control import auth
from fthsdp.control.admission import SERVE, Admission
from fthsdp.timeouts import LIGHTHOUSE_MAX_HOLD_S

log = logging.getLogger("fthsdp.control.lighthouse")

__all__ = ["Limits", "Refusal", "request_problem", "KnownAddresses", "CallAuthenticator", "NewIdRate",
           "incarnation_problem", "CallGate", "generic_handler"]

INVALID = grpc.StatusCode.INVALID_ARGUMENT
# Stream reports in one heartbeat's phase: a process reports one (to its right neighbour); the
# limit was the replica count (16,384), which let a holder of the job's secret pin megabytes of
# phase state per process on the lighthouse, walked at every root-cause analysis.
MAX_PHASE_STREAMS = 4
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


@dataclass(frozen=True)
class Limits:
    """The lighthouse's bounds on what a request may carry or make it hold.

    Defaults fit the largest job the flat lighthouse is measured at (8,192
    replicas, experiments/scale.py) with room to spare; every reply is bounded
    by them (a quorum reply by ``max_replicas_per_job`` members, each of at most
    ``max_local_world_size`` addresses of ``max_address_len`` characters).
    """

    max_id_len: int = 128  # replica ids
    max_job_id_len: int = 128
    max_address_len: int = 262  # [v6 literal]:port or a DNS name (253) and port
    max_local_world_size: int = 16_384  # FTAR endpoints per request (the emulation sends 6,250 per replica)
    max_processes: int = 4096  # processes per replica
    max_step: int = 2**53  # a step or quorum id beyond this is a bug or an attack (2**53: exact in a double)
    max_replicas_per_job: int = 16_384
    max_jobs: int = 1024
    max_dead_listed: int = 1024  # a heartbeat reply lists at most this many dead; the oldest are forgotten
    max_status_replicas: int = 2048  # replicas listed per job by Status (the rest counted as omitted)
    max_status_jobs: int = 256  # jobs listed by one Status of every job
    new_ids_per_s: float = 2000.0  # per client host, sustained ...
    new_ids_burst: int = 16_384  # ... after a burst of this many (one host may start a whole job at once)
    max_request_bytes: int = 4 * 1024 * 1024
    # The replay cache (fthsdp.control.auth.KeyedReplayCache), one per key that signed calls (each
    # job's, the status key): the nonces one key's calls may hold within the clock window (~105
    # bytes each; the lighthouse's heartbeats are paced to 5,000/s in all, 175,000 in 35 s), ...
    replay_nonces_per_key: int = 200_000
    replay_nonces_total: int = 400_000  # ... all keys together (those holding the most are cut first) ...
    replay_keys: int = 4096  # ... and the keys held at once (each signed a call within the window)

    def __post_init__(self) -> None:
        for k, v in self.__dict__.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"Limits.{k}={v!r}: must be a finite number > 0")
        if self.replay_nonces_per_key > self.replay_nonces_total:
            raise ValueError(f"Limits.replay_nonces_per_key={self.replay_nonces_per_key} exceeds "
                             f"Limits.replay_nonces_total={self.replay_nonces_total}: one key may hold at most "
                             "what all keys together hold; raise the total or lower the per-key bound")


@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    reason: str


class Refused(Exception):
    """A request refused with a gRPC status code and the reason: the unary call aborts with
    them, a session message is answered with them (fthsdp.control.session).

    Defined here, not in the lighthouse's module: that module also runs as a program
    (``python -m fthsdp.control.lighthouse``), and a class defined in a module run so
    exists twice, so that the session handler's ``except`` missed the lighthouse's
    refusals: each became an INTERNAL error with no sequence number, and the request it
    refused waited for its deadline instead."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


# A control character (< 32, 127) or any character str.isspace() calls a space (re's \s is
# exactly that set for str patterns): one C-level search instead of a Python loop per character.
_BAD_CHAR = re.compile(r"[\x00-\x1f\x7f\s]")


def _text_problem(what: str, value: str, max_len: int, ctx: str = "") -> str | None:
    if len(value) > max_len:
        return (f"{what} is {len(value)} characters long{ctx}; at most {max_len} are allowed "
                f"(it starts {value[:32]!r})")
    bad = _BAD_CHAR.search(value)
    if bad is not None:
        return (f"{what} {value[:64]!r}{ctx} contains a space or control character ({bad.group()!r}): "
                "use printable characters")
    return None


def _texts_problem(what: str, values, max_len: int, ctx: str = "") -> str | None:
    """:func:`_text_problem` of each of ``values``, in two C-level passes while all are good.

    A quorum request lists every member of the replica's last quorum: checking them one
    by one in Python cost 8 ms per request at 1,024 replicas (a round: 8 s of the
    lighthouse's CPU, O(N^2)), the flat lighthouse's regression after limits were added."""
    if not values:
        return None
    if max(map(len, values)) <= max_len and _BAD_CHAR.search("/".join(values)) is None:
        return None
    for v in values:
        err = _text_problem(what, v, max_len, ctx)
        if err:
            return err
    return None


def _ids_problem(limits: Limits, job_id: str, replica_id: str | None) -> str | None:
    if not job_id:
        return "job_id is empty: pass the job's name (every replica of one job uses the same job_id)"
    err = _text_problem("job_id", job_id, limits.max_job_id_len)
    if err:
        return err
    if replica_id is None:
        return None
    if not replica_id:
        return f"replica_id is empty (job {job_id!r}): pass this replica's id, unique within the job"
    return _text_problem("replica_id", replica_id, limits.max_id_len, f" (job {job_id!r})")


def _step_problem(limits: Limits, what: str, value: int, who: str) -> str | None:
    if not 0 <= value <= limits.max_step:
        return f"{what} is {value} ({who}): it must be in [0, {limits.max_step}]"
    return None


class KnownAddresses:
    """Addresses already found well-formed under one :class:`Limits` (a set of strings).

    A replica's leader sends every one of its shards' FTAR endpoints with each
    quorum request: 6,250 per request at 16 replicas x 6,250 ranks. Parsing each
    of them again on every request cost the lighthouse ~0.1 s per request, 1.6 s
    of one core per round, and was most of the round's latency
    (experiments/scale.py, its ``where_time_goes``). Whether an address is
    well-formed depends only on its text and the limits, so an address seen
    before is known good by a set lookup. Bounded by the characters it holds
    (``max_chars``): when full it is emptied and refills from the requests that
    follow, so a flood of distinct addresses costs memory it cannot grow past.
    """

    def __init__(self, max_chars: int = 16 << 20) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self._known: set[str] = set()
        self._chars = 0

    def __contains__(self, address: str) -> bool:
        return address in self._known

    def cover(self, addresses) -> bool:
        """Whether every one of ``addresses`` is known good (one C-level pass: the common case)."""
        return self._known.issuperset(addresses)

    def __len__(self) -> int:
        return len(self._known)

    def add(self, address: str) -> None:
        if self._chars + len(address) > self.max_chars:
            self._known.clear()
            self._chars = 0
        self._known.add(address)
        self._chars += len(address)


def _address_ok(limits: Limits, address: str, known: KnownAddresses | None) -> bool:
    """Whether ``address`` is a connectable host:port (then it joins ``known``): the check of
    :func:`_address_problem` without the words, which a registration of 100,352 endpoints (512
    replicas x 196 shards) would format for each one to throw away."""
    if known is not None and address in known:
        return True
    if not address or len(address) > limits.max_address_len:
        return False
    try:
        split_host_port(address, allow_zero_port=False)
    except ValueError:
        return False
    if known is not None:
        known.add(address)
    return True


def _address_problem(limits: Limits, what: str, address: str, who: str,
                     known: KnownAddresses | None = None) -> str | None:
    """Why ``address`` is not a connectable host:port, or None (then it joins ``known``:
    a leader's state server and metrics address come with every heartbeat, and parsing
    them each time was ~10% of the lighthouse's busy time at 512 replicas)."""
    if _address_ok(limits, address, known):
        return None
    if not address:
        return f"{what} is an empty address ({who}): give host:port"
    if len(address) > limits.max_address_len:
        return f"{what} is {len(address)} characters long ({who}); at most {limits.max_address_len} are allowed"
    try:
        split_host_port(address, allow_zero_port=False)
    except ValueError as e:
        return f"{what} ({who}): {e}"
    return f"{what} ({who}): not a connectable host:port"  # not reached: _address_ok refused it for a reason above


def request_problem(method: str, req, limits: Limits, known: KnownAddresses | None = None) -> str | None:
    """Why ``req`` (a parsed request of ``method``) is malformed, or None.

    Only what needs no job state: a request passing this cannot make the
    lighthouse hold or send more than :class:`Limits` allows per replica.
    ``known``: FTAR endpoints already found well-formed under ``limits`` (not parsed
    again; the ones found well-formed here are added).
    """
    if method == "Status":
        return _ids_problem(limits, req.job_id, None) if req.job_id else None
    err = _ids_problem(limits, req.job_id, req.replica_id)
    if err:
        return err
    who = f"replica {req.replica_id!r} of job {req.job_id!r}"
    if method == "GetView":
        return (_step_problem(limits, "quorum_id", req.quorum_id, who)
                or _step_problem(limits, "held_quorum_id", req.held_quorum_id, who)
                or _processes_problem(limits, req.process_index, 1, who, index_only=True))
    err = _step_problem(limits, "step", req.step, who)
    if err:
        return err
    if len(req.incarnation) > 64 or (req.incarnation and _text_problem("incarnation", req.incarnation, 64)):
        return f"incarnation ({who}) must be at most 64 printable characters (a random token chosen at process start)"
    if method == "Leave":
        return None
    err = (_step_problem(limits, "last_quorum_id", req.last_quorum_id, who)
           or _processes_problem(limits, req.process_index, req.num_processes, who)
           or _fingerprint_problem(req, limits, who))
    if err:
        return err
    if method == "Heartbeat":
        return _heartbeat_problem(req, limits, who, known)
    err = _texts_problem("an accused_replica_ids id", req.accused_replica_ids, limits.max_id_len, f" ({who})")
    if err:
        return err
    return _endpoints_problem(req, limits, who, True, known) or _quorum_fields_problem(req, limits, who)


def _processes_problem(limits: Limits, index: int, count: int, who: str, index_only: bool = False) -> str | None:
    if not 0 <= index < limits.max_processes:
        return f"process_index is {index} ({who}): it must be in [0, {limits.max_processes})"
    if not index_only and not 0 <= count <= limits.max_processes:
        return f"num_processes is {count} ({who}): it must be in [0, {limits.max_processes}] (0 = 1)"
    return None


def _fingerprint_problem(req, limits: Limits, who: str) -> str | None:
    """The step and the quorum a state fingerprint belongs to (QuorumRequest, Heartbeat)."""
    if not req.HasField("fingerprint"):
        return None
    return (_step_problem(limits, "fingerprint_step", req.fingerprint_step, who)
            or _step_problem(limits, "fingerprint_quorum_id", req.fingerprint_quorum_id, who))


def _heartbeat_problem(req, limits: Limits, who: str, known: KnownAddresses | None = None) -> str | None:
    err = _endpoints_problem(req, limits, who, False, known)
    if err:
        return err
    if req.metrics_address:
        err = _address_problem(limits, f"metrics_address {req.metrics_address[:64]!r}", req.metrics_address, who,
                               known)
        if err:
            return err
    if req.HasField("phase"):
        ph = req.phase
        if len(ph.streams) > MAX_PHASE_STREAMS:
            return (f"phase.streams has {len(ph.streams)} entries ({who}); at most {MAX_PHASE_STREAMS} (a process "
                    "reports the stream to its right ring neighbour: fthsdp.observe.phase)")
        err = _texts_problem("a replica id in phase", [ph.waiting_on, *(s.to_replica for s in ph.streams)],
                             limits.max_id_len, f" ({who})")
        if err:
            return err
        # Kept as sent and shown by `fthsdp status`, the dashboard (its JSON refuses NaN) and the
        # root-cause analysis: every number must be finite (-1 is "not known yet", PhaseSnapshot).
        values = [ph.in_phase_s, ph.waiting_s, ph.compute_s, ph.last_step_s,
                  *(x for st in ph.streams for x in (st.bytes_per_s, st.busy_fraction))]
        if not all(math.isfinite(v) for v in values):
            return f"phase has a time, rate or fraction that is NaN or infinite ({who}): report finite numbers"
    return None


def _endpoints_problem(req, limits: Limits, who: str, required: bool,
                       known: KnownAddresses | None = None) -> str | None:
    """A process's own FTAR endpoints and state server (QuorumRequest; a Heartbeat that registers them)."""
    if not required and not req.ftar_addresses and not req.state_server_address:
        return None
    if not 1 <= req.local_world_size <= limits.max_local_world_size:
        return (f"local_world_size is {req.local_world_size} ({who}): it must be the number of devices (shards) "
                f"per replica, 1..{limits.max_local_world_size}")
    if len(req.ftar_addresses) > req.local_world_size:
        return (f"ftar_addresses has {len(req.ftar_addresses)} entries but local_world_size is "
                f"{req.local_world_size} ({who}): send one FTAR endpoint (host:port) per shard of this process")
    if required and req.endpoints_held and (req.ftar_addresses or req.state_server_address):
        return (f"endpoints_held is set but the request also carries ftar_addresses or state_server_address "
                f"({who}): send the endpoints, or leave them out and set endpoints_held, not both")
    fresh = known is None or not known.cover(req.ftar_addresses)
    for k, a in enumerate(req.ftar_addresses if fresh else ()):
        if not _address_ok(limits, a, known):
            return _address_problem(limits, f"ftar_addresses[{k}] {a[:64]!r}", a, who)
    if req.state_server_address:  # a URL (http://host:port) or host:port
        a = req.state_server_address
        hostport = a.split("://", 1)[1] if "://" in a else a
        if "://" in a and not a.startswith(("http://", "https://")):
            return f"state_server_address {a[:64]!r} ({who}): only http:// or https:// URLs"
        err = _address_problem(limits, f"state_server_address {a[:64]!r}", hostport.rstrip("/"), who, known)
        if err:
            return err
    return None


def _quorum_fields_problem(req, limits: Limits, who: str) -> str | None:
    if not 0 <= req.num_replicas <= limits.max_replicas_per_job:
        return (f"num_replicas is {req.num_replicas} ({who}): it must be in [0, {limits.max_replicas_per_job}] "
                "(0 = not stated)")
    if len(req.last_members) > limits.max_replicas_per_job:
        return f"last_members lists {len(req.last_members)} replicas ({who}); at most {limits.max_replicas_per_job}"
    return _texts_problem("a last_members id", req.last_members, limits.max_id_len, f" ({who})")


def incarnation_problem(rid: str, job_id: str, holder: str | None, incoming: str, holder_live: bool) -> str | None:
    """The takeover rule of a replica id: why ``incoming`` may not act as ``rid``, or None.

    A replica id belongs to the process that first registered it (its
    *incarnation*, a random token chosen at process start and sent, signed,
    with every call). Another incarnation may take the id over only when the
    holder is gone: it left (``Leave`` releases the id) or the failure
    detector declared it dead (silent longer than the detection window, with
    no quorum request open). A restarted replica therefore waits at most one
    detection window for its old process to be declared dead. A request with
    no incarnation (a client that does not send one, e.g. the emulation's)
    neither binds nor takes over an id.
    """
    if holder is None or holder == incoming or not holder_live:
        return None
    return (f"replica id {rid!r} of job {job_id!r} is held by another live process (incarnation {holder[:8]}…); "
            "a second process may take it over only once the holder left or the failure detector declared it "
            "dead (silent for the detection window): if it is a restart, retry after that window; otherwise "
            "give this process another replica id")


class NewIdRate:
    """A token bucket per client host: how many new replica ids it may introduce.

    Bounds the bookkeeping a single client (a bug, or a holder of a job secret
    gone rogue) can create: ``burst`` ids at once, then ``rate`` per second.
    Hosts are forgotten after a minute idle, oldest first beyond ``max_hosts``.
    """

    def __init__(self, rate: float, burst: int, max_hosts: int = 4096) -> None:
        self.rate, self.burst, self.max_hosts = rate, burst, max_hosts
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # host -> (tokens, at)

    def take(self, host: str, now: float) -> bool:
        tokens, at = self._buckets.pop(host, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[host] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > self.max_hosts:
            self._buckets.popitem(last=False)
        return ok


def peer_host(peer: str) -> str:
    """The host of a grpc peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, ``unix:...``)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0]
    return peer


def _where(method: str, job_id: str, replica_id: str) -> str:
    """The call a refusal names (built only when refusing: an accepted call pays nothing for it)."""
    return f"{method} of job {job_id!r}" + (f" replica {replica_id!r}" if replica_id else "")


def _does_not_verify(method: str, job_id: str, replica_id: str) -> Refusal:
    return Refusal(UNAUTHENTICATED, (
        f"{_where(method, job_id, replica_id)}: the credential does not verify: the caller's secret is not "
        "this lighthouse's key for this job (another lighthouse's secret, another job's, or a stale one): "
        "give the replicas the secret of this lighthouse and job"))


# The replay-cache key of calls signed with the read-only status key: a job's is its job id (a
# str), so no job id, whatever its text, shares the status key's nonces, floor or capacity.
STATUS_PRINCIPAL = ("status key",)


class CallAuthenticator:
    """Checks each call's credential against the lighthouse secret (None: authentication off).

    A replica's call must be signed with its job's lighthouse key
    (``derive(job_key(secret, job_id), "lighthouse")``): knowing one job's key
    signs nothing for another job. ``Status`` may also be signed with the
    read-only status key (any job, or all) or, for its own job, a job key.

    A verified call's nonce is then checked for replay against the nonces of
    the key it verified under only (:attr:`replays`, a
    :class:`auth.KeyedReplayCache`: the job id, or :data:`STATUS_PRINCIPAL`):
    one key's flood fills and lifts the floor of its own cache, never another
    job's. Its bounds are ``limits``' (``replay_*``, default :class:`Limits`);
    ``replay_capacity``, when given, is the nonces per key instead (the total
    then at least as large).
    """

    PURPOSE = "lighthouse"

    def __init__(self, secret: bytes | None, window_s: float = auth.CLOCK_WINDOW_S,
                 replay_capacity: int | None = None, *, limits: Limits | None = None) -> None:
        self.secret = secret
        self.window_s = window_s
        self._replay_capacity = replay_capacity
        self.replays = self._replay_cache(limits or Limits())
        self._keys: OrderedDict[str, bytes] = OrderedDict()
        self._status_key = auth.status_key(secret) if secret is not None else b""

    def _replay_cache(self, limits: Limits) -> auth.KeyedReplayCache:
        per_key = limits.replay_nonces_per_key if self._replay_capacity is None else self._replay_capacity
        return auth.KeyedReplayCache(self.window_s, per_key, max(per_key, limits.replay_nonces_total),
                                     limits.replay_keys)

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def job_call_key(self, job_id: str) -> bytes:
        key = self._keys.get(job_id)
        if key is None:
            key = self._keys[job_id] = auth.derive(auth.job_key(self.secret, job_id), self.PURPOSE)
            if len(self._keys) > 4096:
                self._keys.popitem(last=False)
        return key

    def check_request(self, method: str, req, data: bytes,
                      legacy_metadata: Callable[[], bool] = lambda: False) -> Refusal | None:
        """:meth:`check` of the parsed request ``req`` of ``method`` as received (``data``).

        A replica's request signed with its job's key, the one every heartbeat and quorum
        request is, is checked in one step (:func:`auth.verify_job_request`) and its nonce
        remembered; anything else (no credential, the status key's, a malformed one, a bad
        signature) goes through :meth:`check`, which says why. Same checks, same order."""
        job_id = req.job_id
        replica_id = getattr(req, "replica_id", "")
        if job_id:
            key = self._keys.get(job_id) or self.job_call_key(job_id)
            ok = auth.verify_job_request(key, method, job_id, replica_id, data)
            if ok:
                why = self.replays.check_and_add(job_id, ok[1], ok[0] / 1e6, time.time())
                return None if why is None else _replay_refusal(why, method, job_id, replica_id)
            if ok is False:
                return _does_not_verify(method, job_id, replica_id)
        signed = auth.split_signed(data)
        return self.check(method, job_id, replica_id, signed, malformed=signed is None and bool(req.credential),
                          legacy_metadata=signed is None and not req.credential and legacy_metadata())

    def check(self, method: str, job_id: str, replica_id: str,
              signed: tuple[memoryview, auth.Credential] | None, now: float | None = None, *,
              malformed: bool = False, legacy_metadata: bool = False) -> Refusal | None:
        """Why a call may not go on, or None.

        ``signed``: the request's signed bytes and credential (:func:`auth.split_signed`),
        None when it does not end with one; then ``malformed``: it has a credential field
        all the same (not last, or not fthsdp's layout), and ``legacy_metadata``: it has
        none but carries a credential in gRPC metadata, as older clients sent it."""
        if self.secret is None:
            return None
        if signed is None:
            where = _where(method, job_id, replica_id)
            if malformed:
                return Refusal(UNAUTHENTICATED, (
                    f"{where}: malformed credential (the credential field must be the request's last field, "
                    f"{auth.CREDENTIAL_BYTES} bytes of a known kind): use fthsdp's LighthouseClient "
                    "(fthsdp.control.auth.signed_request)"))
            if legacy_metadata:
                return Refusal(UNAUTHENTICATED, (
                    f"{where} is signed in gRPC metadata ({auth.LEGACY_METADATA_KEY}), as older fthsdp clients "
                    "did: this lighthouse takes the credential in the request's credential field (field "
                    f"{auth.CREDENTIAL_FIELD}): upgrade fthsdp on the replicas (or status reader) to the "
                    "lighthouse's version"))
            return Refusal(UNAUTHENTICATED, (
                f"{where} carries no credential (none in the request's credential field "
                f"{auth.CREDENTIAL_FIELD}): this lighthouse requires one. Replicas: give the launcher the "
                f"job's secret (fthsdp run generates it; --secret-file, ${auth.SECRET_FILE_ENV}); fthsdp status: "
                "--status-key-file or --secret-file (see the README's Security section)"))
        covered, cred = signed
        if cred.kind == "status":
            if method != "Status":
                return Refusal(DENIED, f"{_where(method, job_id, replica_id)} is signed with the read-only status "
                                       "key, which may call Status only: a replica needs its job's secret")
            key = self._status_key
        else:  # "job" (split_signed knows no other kind)
            if not job_id:
                return Refusal(DENIED, f"{_where(method, job_id, replica_id)}: a job's secret reads that job only: "
                                       "name it (--job), or use the lighthouse's status key to list every job")
            key = self.job_call_key(job_id)
        if not auth.verify_split(key, method, job_id, replica_id, covered, cred):
            return _does_not_verify(method, job_id, replica_id)
        principal = STATUS_PRINCIPAL if cred.kind == "status" else job_id  # the key it verified under
        why = self.replays.check_and_add(principal, cred.nonce, cred.timestamp_us / 1e6,
                                         time.time() if now is None else now)
        if why is not None:
            return _replay_refusal(why, method, job_id, replica_id)
        return None


def _replay_refusal(why: str, method: str, job_id: str, replica_id: str) -> Refusal:
    """A verified call the replay check refused: while its key's cache is flooded (TOO_OLD), when
    the call was signed before the lighthouse started (BEFORE_START) or while the cache holds as
    many keys as it may (TOO_MANY_KEYS), a call is asked to retry (RESOURCE_EXHAUSTED, which
    clients retry), not told its credential is bad."""
    code = EXHAUSTED if why in auth.ReplayCache.RETRYABLE else UNAUTHENTICATED
    return Refusal(code, f"{_where(method, job_id, replica_id)}: {why}")


# -- transport ------------------------------------------------------------------

class _Raw:
    """A request as received: its bytes (what the credential signs), parsed only when asked
    (a call held or refused by its connection's budget is never parsed)."""

    __slots__ = ("data", "_parse", "_message", "error")

    def __init__(self, data: bytes, parse) -> None:
        self.data = data
        self._parse = parse
        self._message = None
        self.error = ""

    @property
    def message(self):
        if self._message is None and not self.error:
            try:
                self._message = self._parse(self.data)
            except Exception as e:  # noqa: BLE001 - any garbage from the network
                self.error = f"{type(e).__name__}: {str(e)[:200]}"
        return self._message


def _has_legacy_credential(context) -> bool:
    """Whether the call carries a credential in gRPC metadata (older clients): read only for a
    call without one in its body, so a signed call never pays for Python gRPC's metadata."""
    return any(k == auth.LEGACY_METADATA_KEY for k, _ in (context.invocation_metadata() or ()))


def _hold_bound(context) -> float:
    """How long a call may be held back: LIGHTHOUSE_MAX_HOLD_S, at most half its remaining deadline."""
    remaining = context.time_remaining()
    return LIGHTHOUSE_MAX_HOLD_S if remaining is None else min(LIGHTHOUSE_MAX_HOLD_S, 0.5 * remaining)


THROTTLE_LOG_EVERY_S = 60.0  # one line per throttled principal per minute ...
THROTTLE_LOG_GAP_S = 1.0  # ... and at most one a second in all (a flood opens many connections)
THROTTLE_LOG_MEMORY = 1024  # principals whose last line is remembered


class ThrottleLog:
    """Says in the lighthouse's log that calls were held back or refused by a budget.

    A held call is the lighthouse working as designed, so nothing else reports it. But an
    operator must be able to see it: a replica that steps faster than its connection's
    budget (a quorum request per step, plus heartbeats) is slowed to that budget, and the
    fix is a flag. One line per principal a minute, and at most one a second in all."""

    def __init__(self) -> None:
        self._last: OrderedDict[str, float] = OrderedDict()
        self._last_any = -math.inf
        self.suppressed = 0  # lines not written because of the limits since the last one written

    def note(self, who: str, decision, budget: str, advice: str, now: float) -> bool:
        """Log ``decision`` (held or refused) of ``who``; False when the limits dropped it."""
        last = self._last.get(who)
        if (last is not None and now - last < THROTTLE_LOG_EVERY_S) or now - self._last_any < THROTTLE_LOG_GAP_S:
            self.suppressed += 1
            return False
        self._last[who] = now
        self._last.move_to_end(who)
        while len(self._last) > THROTTLE_LOG_MEMORY:
            self._last.popitem(last=False)
        self._last_any = now
        what = (f"a call was refused: {decision.refusal}" if decision.refusal else
                f"a call was held back {decision.wait_s:.3f} s for its budget ({budget})")
        log.warning("%s: %s. %s (such a line at most once a minute per connection or job; %d not written "
                    "since the last one)", who, what, advice, self.suppressed)
        self.suppressed = 0
        return True


_CONNECTION_ADVICE = ("If this is a replica process, it sends more calls than that (a quorum request per step "
                      "plus heartbeats at ft.heartbeat_interval_s) and is slowed to the budget: run the lighthouse "
                      "(python -m fthsdp.control.lighthouse) with a larger --connection-calls-per-s, or for the "
                      "lighthouse `fthsdp run` / `fthsdp ray` start, set launch.lighthouse_connection_calls_per_s")
_RELAY_ADVICE = ("A relay's batches are held back when its clients' messages were refused (each costs its stream "
                 "more than a batch): look for refusals in the relay's clients, or split them among more relays")
_JOB_ADVICE = "The job sends more calls than its budget, which grows with its registered replicas"


async def _hold(admission: Admission, decision, held) -> None:
    if decision.wait_s > 0:
        try:
            await asyncio.sleep(decision.wait_s)
        finally:
            admission.release(held)


@dataclass
class CallGate:
    """The checks in front of every request, in their one order, each cheaper than the next:
    the connection's budget (before the body is parsed: a request over it is held, idle, or
    refused), the body's shape (:func:`request_problem`), the credential, then the job's budget
    (``job_size(job_id)``: its registered replicas). Transport-free: a unary call
    (:func:`generic_handler`) and a session message (:mod:`fthsdp.control.session`) pass the
    same gate, so the two paths cannot drift apart. A refusal of a malformed or
    unauthenticated request is charged to its connection (:meth:`charge`)."""

    authenticator: CallAuthenticator
    limits: Limits
    admission: Admission | None = None
    job_size: Callable[[str], int] = lambda job_id: 0
    known: KnownAddresses = field(default_factory=lambda: KnownAddresses())  # FTAR endpoints found well-formed
    throttled: ThrottleLog = field(default_factory=ThrottleLog)
    # Calls refused, by the gRPC status code's name (fthsdp.observe.load_metrics serves them).
    refused: dict[str, int] = field(default_factory=dict)

    def count(self, code: grpc.StatusCode) -> None:
        """One call was refused with ``code`` (every transport's refusal path calls this once)."""
        self.refused[code.name] = self.refused.get(code.name, 0) + 1

    def charge(self, peer: str) -> None:
        """A refused request costs its connection more than an accepted one (a flood of garbage parks)."""
        if self.admission is not None:
            self.admission.refused(peer, time.monotonic())

    async def connection(self, peer: str, hold_bound: float, relay: bool = False) -> Refusal | None:
        """The connection's budget (``relay``: a relay stream's, per batch): None, after holding
        the request if it must wait, or the refusal."""
        if self.admission is None:
            return None
        now = time.monotonic()
        decision, held = self.admission.connection(peer, now, hold_bound, relay)
        if decision is SERVE:  # most calls: nothing to note or wait for
            return None
        if decision.wait_s > 0 or decision.refusal:
            lim = self.admission.limits
            if relay:
                self.throttled.note(f"relay stream {peer}", decision, f"{lim.relay_batches_per_s:g} batches/s, burst "
                                    f"{lim.relay_burst}", _RELAY_ADVICE, now)
            else:
                self.throttled.note(f"connection {peer}", decision, f"{lim.connection_calls_per_s:g} calls/s, burst "
                                    f"{lim.connection_burst}", _CONNECTION_ADVICE, now)
        await _hold(self.admission, decision, held)
        return Refusal(EXHAUSTED, decision.refusal) if decision.refusal else None

    async def request(self, method: str, req, data: bytes, peer: str, hold_bound: Callable[[], float],
                      legacy_metadata: Callable[[], bool] = lambda: False) -> Refusal | None:
        """The parsed request ``req`` of ``method`` (its bytes ``data``, which the credential signs):
        its limits, its credential, then its job's budget. ``legacy_metadata()`` is asked only for
        a request without a credential in its body (whether it carries an older client's one in
        gRPC metadata, for the refusal's advice)."""
        err = request_problem(method, req, self.limits, self.known)  # a module global: traced by the emulation
        if err:
            self.charge(peer)
            return Refusal(INVALID, err)
        if self.authenticator.secret is not None:
            refusal = self.authenticator.check_request(method, req, data, legacy_metadata)
            if refusal is not None:
                self.charge(peer)
                return refusal
        if self.admission is not None and req.job_id:
            now = time.monotonic()
            decision, held = self.admission.job(req.job_id, self.job_size(req.job_id), now, hold_bound())
            if decision is SERVE:
                return None
            if decision.wait_s > 0 or decision.refusal:
                self.throttled.note(f"job {req.job_id!r}", decision, "its calls per second", _JOB_ADVICE, now)
            await _hold(self.admission, decision, held)
            if decision.refusal:
                return Refusal(EXHAUSTED, decision.refusal)
        return None


def generic_handler(pb2, servicer, gate: CallGate, response_serializer):
    """The Lighthouse service's handlers with the :class:`CallGate` in front of each method.

    ``servicer.<Method>(request, context)`` then only sees well-formed, authenticated requests
    within budget (the job-state checks: replicas per job, jobs, incarnations, live in the
    servicer, which holds that state).
    """
    service = pb2.DESCRIPTOR.services_by_name["Lighthouse"]

    def refuse(context, refusal: Refusal) -> bytes:
        # Set the status and return, instead of context.abort: abort raises through grpc's
        # handler machinery, which made each refusal several times dearer than an answer
        # (a flood of refused calls then slowed every other job far more; experiments/auth_cost.py).
        gate.count(refusal.code)
        context.set_code(refusal.code)
        context.set_details(refusal.reason)
        return b""

    def guarded(name: str, type_name: str, inner):
        async def handle(raw: _Raw, context: grpc.aio.ServicerContext):
            peer = context.peer() or ""
            refusal = await gate.connection(peer, _hold_bound(context))
            if refusal is not None:
                return refuse(context, refusal)
            req = raw.message
            if req is None:
                gate.charge(peer)
                return refuse(context, Refusal(INVALID, (
                    f"the {name} request body is not a valid {type_name} protobuf message "
                    f"({raw.error}): send fthsdp's lighthouse protocol (fthsdp/proto/lighthouse.proto)")))
            refusal = await gate.request(name, req, raw.data, peer, lambda: _hold_bound(context),
                                         lambda: _has_legacy_credential(context))
            if refusal is not None:
                return refuse(context, refusal)
            return await inner(req, context)
        return handle

    handlers = {}
    for m in service.methods:
        parse = getattr(pb2, m.input_type.name).FromString
        handlers[m.name] = grpc.unary_unary_rpc_method_handler(
            guarded(m.name, m.input_type.name, getattr(servicer, m.name)),
            request_deserializer=lambda data, parse=parse: _Raw(data, parse),
            response_serializer=response_serializer)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)
