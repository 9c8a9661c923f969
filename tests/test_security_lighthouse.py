"""The lighthouse against hostile input (issue 13): credentials, limits, the attacks replayed.

Pure parts (key derivation, signatures, the replay cache, request limits, the
takeover rule) are tested as functions; the rest against a real gRPC
lighthouse on loopback, and the attacks of the issue against a real job
(lighthouse and replica processes started by the launcher) that must end
unharmed: identical final states and an exactly-once ledger.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

from fthsdp.control import auth, guard, lighthouse_client
from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread, pb2
from fthsdp.control.lighthouse_client import (JobNotFound, LighthouseClient,
                                              NotAuthorized, ReplicaIdHeld)
from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION

REPO = pathlib.Path(__file__).resolve().parents[1]
V = LIGHTHOUSE_PROTOCOL_VERSION


# -- pure: keys and credentials ---------------------------------------------------------

def test_keys_are_independent_per_job_and_purpose():
    s = auth.new_secret()
    a, b = auth.job_key(s, "a"), auth.job_key(s, "b")
    assert a != b and len(a) == auth.KEY_BYTES
    assert auth.job_key(s, "a") == a  # the lighthouse re-derives, no table
    purposes = {auth.derive(a, p) for p in ("lighthouse", "peer-server", "ftar")}
    assert len(purposes) == 3 and a not in purposes
    assert auth.job_key(auth.new_secret(), "a") != a
    assert auth.status_key(s) not in (a, b)
    with pytest.raises(auth.SecretError, match="at least 16 bytes"):
        auth.derive(b"short", "x")
    with pytest.raises(ValueError, match="purpose"):
        auth.derive(a, "")


def test_a_signature_covers_every_field():
    key = auth.derive(auth.job_key(auth.new_secret(), "j"), "lighthouse")
    c = auth.sign(key, "GetQuorum", "j", "r0", b"body", 1000.0)
    assert auth.verify(key, c, "GetQuorum", "j", "r0", b"body")
    for args in (("Heartbeat", "j", "r0", b"body"), ("GetQuorum", "k", "r0", b"body"),
                 ("GetQuorum", "j", "r1", b"body"), ("GetQuorum", "j", "r0", b"bodz")):
        assert not auth.verify(key, c, *args), args
    for field, value in (("timestamp_us", 1001_000_000), ("nonce", b"0" * 16), ("kind", "status")):
        forged = c._replace(**{field: value})
        assert not auth.verify(key, forged, "GetQuorum", "j", "r0", b"body")
    assert not auth.verify(auth.new_secret(), c, "GetQuorum", "j", "r0", b"body")


def test_the_credential_travels_last_in_the_request_and_signs_what_precedes_it():
    key = auth.derive(auth.job_key(auth.new_secret(), "j"), "lighthouse")
    req = pb2.QuorumRequest(protocol_version=V, job_id="j", replica_id="r0", step=7, ftar_addresses=["h:1"] * 300)
    body = req.SerializeToString()
    data = auth.signed_request(key, "GetQuorum", "j", "r0", body, now=1000.0)
    assert len(data) == len(body) + auth.TAIL_BYTES
    parsed = pb2.QuorumRequest.FromString(data)  # a valid message: the request with its credential set
    assert len(parsed.credential) == auth.CREDENTIAL_BYTES and parsed.step == 7
    assert list(parsed.ftar_addresses) == ["h:1"] * 300
    # protobuf's own encoding of the field, appended
    assert data[len(body):] == pb2.StatusRequest(credential=parsed.credential).SerializeToString()
    covered, cred = auth.split_signed(data)  # the signature (the last 32 bytes) covers all before it
    assert bytes(covered) == data[:-32] and cred == auth.Credential.decode(parsed.credential)
    assert cred.kind == "job" and cred.timestamp == 1000.0 and len(cred.nonce) == 16
    assert auth.verify_split(key, "GetQuorum", "j", "r0", covered, cred)
    assert auth.verify(key, cred, "GetQuorum", "j", "r0", body)  # the same check from the unsigned request
    assert not auth.verify_split(key, "GetQuorum", "j", "r1", covered, cred)
    # no credential, one not last, or of an unknown kind: nothing to check
    assert auth.split_signed(body) is None
    assert auth.split_signed(data + b"\x20\x01") is None
    unknown = bytearray(data)
    unknown[len(body) + 3] = ord("x")
    assert auth.split_signed(bytes(unknown)) is None
    with pytest.raises(ValueError, match="unknown credential kind"):
        auth.Credential.decode(bytes(unknown[len(body) + 3:]))
    with pytest.raises(ValueError, match="57 bytes"):
        auth.Credential.decode(b"j" * 10)
    # nonces are unique per call
    assert len({auth.split_signed(auth.signed_request(key, "Heartbeat", "j", "r0", b""))[1].nonce
                for _ in range(1000)}) == 1000


def test_the_authenticator_refuses_each_bad_credential_with_its_reason():
    secret = auth.new_secret()
    checker = guard.CallAuthenticator(secret)
    key = auth.derive(auth.job_key(secret, "j"), "lighthouse")
    body = pb2.HeartbeatRequest(protocol_version=V, job_id="j", replica_id="0", step=1).SerializeToString()

    def check(data: bytes, method: str = "Heartbeat", job: str = "j", **kw):
        return checker.check(method, job, "0", auth.split_signed(data), **kw)

    good = auth.signed_request(key, "Heartbeat", "j", "0", body)
    assert check(good) is None
    assert "replayed" in check(good).reason
    assert "carries no credential" in check(body).reason
    assert "gRPC metadata" in check(body, legacy_metadata=True).reason
    assert "malformed" in check(body, malformed=True).reason
    assert "does not verify" in check(auth.signed_request(key, "Heartbeat", "k", "0", body), job="k").reason
    assert "does not verify" in check(auth.signed_request(key, "GetQuorum", "j", "0", body)).reason
    flipped = bytearray(auth.signed_request(key, "Heartbeat", "j", "0", body))
    flipped[5] ^= 1  # one bit of the request
    assert "does not verify" in check(bytes(flipped)).reason
    r = check(auth.signed_request(auth.status_key(secret), "Heartbeat", "j", "0", body, kind="status"))
    assert r.code == guard.DENIED and "read-only status key" in r.reason
    assert "NTP" in check(auth.signed_request(key, "Heartbeat", "j", "0", body, now=time.time() - 600)).reason
    assert guard.CallAuthenticator(None).check("Heartbeat", "j", "0", None) is None  # off: anything goes
    # The refusals asking again cannot change are the credential's own (a replica stops job-fatal on
    # them: CredentialRefused); a replay's or the clock's are not, and while a key's own flood fills
    # its replay cache its fresh calls are asked to retry (RESOURCE_EXHAUSTED), not refused as unsigned.
    permanent = [check(body), check(body, legacy_metadata=True), check(body, malformed=True), r,
                 check(auth.signed_request(key, "GetQuorum", "j", "0", body)),
                 checker.check("Status", "", "", auth.split_signed(auth.signed_request(key, "Status", "", "", body)))]
    for refusal in permanent:
        assert any(m in refusal.reason for m in auth.PERMANENT_REFUSALS), refusal.reason
    for refusal in (check(good), check(auth.signed_request(key, "Heartbeat", "j", "0", body, now=time.time() - 600))):
        assert not any(m in refusal.reason for m in auth.PERMANENT_REFUSALS), refusal.reason
    small = guard.CallAuthenticator(secret, replay_capacity=100)
    other = auth.derive(auth.job_key(secret, "flooder"), "lighthouse")
    flood = pb2.HeartbeatRequest(protocol_version=V, job_id="flooder", replica_id="0").SerializeToString()

    def flooder(ahead_s: float) -> guard.Refusal | None:
        return small.check("Heartbeat", "flooder", "0", auth.split_signed(
            auth.signed_request(other, "Heartbeat", "flooder", "0", flood, now=time.time() + ahead_s)))

    r = flooder(29)  # inside the old ±30 s window, which let such a flood lift every job's floor
    assert r.code == guard.UNAUTHENTICATED and "more than 5 s ahead" in r.reason and "NTP" in r.reason
    for _ in range(200):  # signed 4 s ahead, twice the capacity: the floor goes up, the flooder's own
        flooder(4)
    r = flooder(0)
    assert r.code == guard.EXHAUSTED and "retry it" in r.reason  # its own fresh call waits ...
    assert small.check("Heartbeat", "j", "0", auth.split_signed(  # ... another job's is untouched
        auth.signed_request(key, "Heartbeat", "j", "0", body))) is None
    assert len(small.replays.cache("flooder")) == 100 and len(small.replays.cache("j")) == 1


def test_the_cached_pad_hmac_is_hmac_sha256():
    import hashlib
    import hmac

    for key in (b"k" * 16, os.urandom(32), os.urandom(64), os.urandom(100)):
        for msg in (b"", b"x", os.urandom(1000), os.urandom(5000)):
            assert auth.hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()


def test_replay_cache_refuses_replays_stale_calls_and_stays_bounded():
    r = auth.ReplayCache(window_s=30.0, capacity=100)
    assert r.check_and_add("n1", 1000.0, 1000.0) is None
    assert "replayed" in r.check_and_add("n1", 1000.0, 1000.5)
    assert "NTP" in r.check_and_add("n2", 900.0, 1000.0)  # 100 s old
    assert "NTP" in r.check_and_add("n3", 1100.0, 1000.0)  # from the future
    for i in range(1000):  # a flood: the cache stays bounded ...
        r.check_and_add(f"f{i}", 1000.0 + i * 1e-3, 1001.0)
    assert len(r) <= 100
    # ... and a replay of a nonce it had to drop is still refused (too old to be checked)
    assert r.check_and_add("f0", 1000.0, 1001.0) is not None
    assert r.check_and_add("fresh", 1001.5, 1001.5) is None
    # a flood far beyond the capacity within one timestamp slice (~0.12 s) still accepts each
    # fresh call once (found by the peer server's fuzzer, whose cache holds 256 nonces)
    r = auth.ReplayCache(window_s=30.0, capacity=256)
    for i in range(5000):
        t = 2000.0 + i * 1e-5
        assert r.check_and_add(f"n{i}", t, t) is None, i
        assert "replayed" in r.check_and_add(f"n{i}", t, t)
    assert len(r) <= 256
    # a cache started at t refuses every call stamped before it (it cannot know them), as retryable
    r = auth.ReplayCache(window_s=30.0, not_before=3000.0)
    assert r.check_and_add("a", 2999.0, 3000.5) == auth.ReplayCache.BEFORE_START
    assert r.check_and_add("b", 3000.2, 3000.5) is None
    assert auth.ReplayCache.BEFORE_START in auth.ReplayCache.RETRYABLE


def test_secrets_load_from_file_or_environment_and_say_what_is_wrong(tmp_path):
    s = auth.new_secret()
    f = tmp_path / "secret"
    auth.write_secret(str(f), s)
    assert f.stat().st_mode & 0o077 == 0  # owner only
    assert auth.load_secret(str(f), environ={}) == s
    assert auth.load_secret(environ={auth.SECRET_FILE_ENV: str(f)}) == s
    assert auth.load_secret(environ={auth.SECRET_ENV: s.hex()}) == s
    assert auth.load_secret(environ={}) is None
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(auth.SecretError, match="too short.*openssl rand -hex 32"):
        auth.load_secret(str(tmp_path / "short"), environ={})
    with pytest.raises(auth.SecretError, match="cannot read the secret file"):
        auth.load_secret(str(tmp_path / "missing"), environ={})
    # a launcher with its own lighthouse makes a fresh secret per job; replicas get only the job key
    lh, jk = auth.launcher_keys("", "job", own_lighthouse=True, environ={})
    assert jk == auth.job_key(lh, "job")
    env = auth.replica_env({auth.LIGHTHOUSE_SECRET_ENV: lh.hex(), auth.SECRET_FILE_ENV: "x"}, jk)
    assert env == {auth.SECRET_ENV: jk.hex()}
    assert auth.launcher_keys("", "job", own_lighthouse=False, environ={}) == (None, None)


# -- pure: limits and the takeover rule -------------------------------------------------

def quorum_req(**over) -> pb2.QuorumRequest:
    base = dict(protocol_version=V, job_id="job", replica_id="0", step=0, ftar_addresses=["127.0.0.1:7000"],
                state_server_address="http://127.0.0.1:7100", local_world_size=1, incarnation="i0")
    base.update(over)
    return pb2.QuorumRequest(**base)


@pytest.mark.parametrize("over, match", [
    ({"replica_id": "x" * 10_000}, "replica_id is 10000 characters long"),
    ({"job_id": "j" * 3_000_000}, "job_id is 3000000 characters long"),
    ({"replica_id": "r\x000"}, "control character"),
    ({"job_id": "a b"}, "space or control"),
    ({"ftar_addresses": ["not an address \0\n; rm -rf /"]}, "spaces or control characters"),
    ({"ftar_addresses": ["127.0.0.1:99999"]}, "bad port"),
    ({"ftar_addresses": ["127.0.0.1:0"]}, "port 0 cannot be connected to"),
    ({"state_server_address": "ftp://127.0.0.1:80"}, "only http:// or https://"),
    ({"step": 2**63 - 1}, "step is 9223372036854775807"),
    ({"last_quorum_id": 2**62}, "last_quorum_id is"),
    ({"local_world_size": 20000, "ftar_addresses": ["127.0.0.1:7000"] * 20000}, "local_world_size is 20000"),
    ({"num_replicas": 10**6}, "num_replicas is 1000000"),
    ({"last_members": ["m\n"]}, "control character"),
    ({"fingerprint": 7, "fingerprint_step": -1}, "fingerprint_step is -1"),
    ({"fingerprint": 7, "fingerprint_step": 3, "fingerprint_quorum_id": -2}, "fingerprint_quorum_id is -2"),
])
def test_request_limits_refuse_with_the_reason(over, match):
    err = guard.request_problem("GetQuorum", quorum_req(**over), guard.Limits())
    assert err is not None and match in err, err


def test_a_well_formed_request_passes_every_limit():
    assert guard.request_problem("GetQuorum", quorum_req(ftar_addresses=["[::1]:7000"]), guard.Limits()) is None
    hb = pb2.HeartbeatRequest(protocol_version=V, job_id="job", replica_id="0", step=5)
    assert guard.request_problem("Heartbeat", hb, guard.Limits()) is None
    fp = dict(fingerprint=7, fingerprint_step=5, fingerprint_quorum_id=3)
    assert guard.request_problem("GetQuorum", quorum_req(**fp), guard.Limits()) is None
    bad = pb2.HeartbeatRequest(protocol_version=V, job_id="job", replica_id="0", step=5, fingerprint=7,
                               fingerprint_step=5, fingerprint_quorum_id=-1)
    assert "fingerprint_quorum_id is -1" in guard.request_problem("Heartbeat", bad, guard.Limits())
    assert guard.request_problem("Status", pb2.StatusRequest(protocol_version=V), guard.Limits()) is None
    # a phase report names the streams to the process's ring neighbours: a few, not thousands
    stream = pb2.StreamRate(to_replica="1", bytes_per_s=1e9, bytes=10, busy_fraction=0.5)
    for n, ok in ((guard.MAX_PHASE_STREAMS, True), (guard.MAX_PHASE_STREAMS + 1, False)):
        hb = pb2.HeartbeatRequest(protocol_version=V, job_id="job", replica_id="0", step=5,
                                  phase=pb2.PhaseReport(phase=pb2.PHASE_ALLREDUCE, streams=[stream] * n))
        err = guard.request_problem("Heartbeat", hb, guard.Limits())
        assert (err is None) == ok and (ok or f"at most {guard.MAX_PHASE_STREAMS}" in err), err


def test_known_addresses_skip_only_what_was_found_good():
    """Endpoints found well-formed are not parsed again (the lighthouse's per-request cost at
    6,250 endpoints a request), a bad one among known ones is still refused, and the set
    empties itself at its bound instead of growing."""
    known = guard.KnownAddresses(max_chars=42)  # the two endpoints and the state server (14 characters each)
    good = [f"127.0.0.1:{7000 + k}" for k in range(2)]
    req = quorum_req(ftar_addresses=good, local_world_size=2)
    assert guard.request_problem("GetQuorum", req, guard.Limits(), known) is None
    assert all(a in known for a in good) and known.cover(good)
    bad = quorum_req(ftar_addresses=[good[0], "127.0.0.1:0"], local_world_size=2)
    err = guard.request_problem("GetQuorum", bad, guard.Limits(), known)
    assert err is not None and "ftar_addresses[1]" in err and "port 0" in err
    assert "127.0.0.1:0" not in known
    hb = pb2.HeartbeatRequest(protocol_version=V, job_id="job", replica_id="0", step=5, local_world_size=2,
                              ftar_addresses=[good[1], "bad host:1"])
    assert "spaces or control" in guard.request_problem("Heartbeat", hb, guard.Limits(), known)
    known.add("127.0.0.1:7002")  # 42 + 14 > 42: emptied first, then holds the new one
    assert len(known) == 1 and good[0] not in known and "127.0.0.1:7002" in known
    with pytest.raises(ValueError, match="max_chars"):
        guard.KnownAddresses(max_chars=0)


def test_known_addresses_cover_state_server_and_metrics_addresses():
    """A heartbeat's state server and metrics addresses join the known set once found good
    (they come with every heartbeat); a bad one is refused every time, never remembered."""
    known = guard.KnownAddresses()
    hb = pb2.HeartbeatRequest(protocol_version=V, job_id="job", replica_id="0", step=5, local_world_size=1,
                              ftar_addresses=["127.0.0.1:7000"], state_server_address="http://127.0.0.1:8000/",
                              metrics_address="127.0.0.1:9100")
    assert guard.request_problem("Heartbeat", hb, guard.Limits(), known) is None
    assert "127.0.0.1:8000" in known and "127.0.0.1:9100" in known
    for field, value, match in (("metrics_address", "127.0.0.1:0", "port 0"),
                                ("state_server_address", "http://127.0.0.1:99999", "bad port"),
                                ("state_server_address", "ftp://127.0.0.1:8000", "only http")):
        bad = pb2.HeartbeatRequest()
        bad.CopyFrom(hb)
        setattr(bad, field, value)
        for _ in range(2):
            err = guard.request_problem("Heartbeat", bad, guard.Limits(), known)
            assert err is not None and match in err, err
    assert "127.0.0.1:0" not in known and "127.0.0.1:99999" not in known


def test_takeover_rule():
    assert guard.incarnation_problem("0", "j", None, "a", holder_live=True) is None  # first registration
    assert guard.incarnation_problem("0", "j", "a", "a", holder_live=True) is None  # the holder itself
    err = guard.incarnation_problem("0", "j", "a", "b", holder_live=True)
    assert "held by another live process" in err and "detection window" in err
    assert guard.incarnation_problem("0", "j", "a", "b", holder_live=False) is None  # dead: taken over
    assert guard.incarnation_problem("0", "j", "a", "", holder_live=True) is not None  # no token: no takeover


def test_new_id_rate_is_a_token_bucket_per_host():
    r = guard.NewIdRate(rate=10.0, burst=5)
    assert all(r.take("h1", 0.0) for _ in range(5))
    assert not r.take("h1", 0.0)
    assert r.take("h2", 0.0)  # another host has its own bucket
    assert r.take("h1", 0.11)  # refilled at 10/s
    assert guard.peer_host("ipv4:127.0.0.1:5555") == "127.0.0.1"
    assert guard.peer_host("ipv6:[::1]:5555") == "[::1]"


# -- a real lighthouse on loopback ------------------------------------------------------

SECRET = bytes(range(32))


@pytest.fixture
def secure():
    with LighthouseThread(LighthouseConfig(secret=SECRET, join_timeout_s=0.2, detect_s=0.5)) as lh:
        yield lh


def raw_call(address: str, method: str, body: bytes, metadata=None, timeout: float = 5.0):
    """One call as an attacker sends it: any bytes, any metadata."""
    with grpc.insecure_channel(address) as ch:
        fn = ch.unary_unary(f"/fthsdp.v1.Lighthouse/{method}", request_serializer=None,
                            response_deserializer=None)
        return fn(body, timeout=timeout, metadata=metadata)


def refused(address: str, method: str, body: bytes, metadata=None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        raw_call(address, method, body, metadata)
    return ei.value


def signed(key: bytes, method: str, req, **kw):
    """(the request's bytes with its credential appended, no metadata): what a client sends."""
    body = req.SerializeToString()
    return auth.signed_request(key, method, req.job_id, getattr(req, "replica_id", ""), body, **kw), None


def call_key(job: str) -> bytes:
    return auth.derive(auth.job_key(SECRET, job), "lighthouse")


def test_calls_without_a_valid_credential_are_refused_with_what_to_do(secure):
    hb = pb2.HeartbeatRequest(protocol_version=V, job_id="job", replica_id="0", step=1, incarnation="x")
    e = refused(secure.address, "Heartbeat", hb.SerializeToString())
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "carries no credential" in e.details()
    assert "--secret-file" in e.details()
    # another job's key (a replica of job "other" acting for "job")
    body, md = signed(call_key("other"), "Heartbeat", hb)
    e = refused(secure.address, "Heartbeat", body, md)
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "does not verify" in e.details()
    # a valid credential for another body (the attacker changed the step, kept the credential)
    body, md = signed(call_key("job"), "Heartbeat", hb)
    tampered = pb2.HeartbeatRequest(protocol_version=V, job_id="job", replica_id="0", step=10**9,
                                    incarnation="x").SerializeToString() + body[-auth.TAIL_BYTES:]
    e = refused(secure.address, "Heartbeat", tampered)
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "does not verify" in e.details()
    # ... or put a field after the credential (only what precedes it is signed)
    e = refused(secure.address, "Heartbeat", body + pb2.HeartbeatRequest(step=10**9).SerializeToString())
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "malformed credential" in e.details()
    # the right key: accepted once ...
    raw_call(secure.address, "Heartbeat", body, md)
    # ... and its replay refused
    e = refused(secure.address, "Heartbeat", body, md)
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in e.details()
    # a call signed long ago
    body, md = signed(call_key("job"), "Heartbeat", hb, now=time.time() - 600)
    e = refused(secure.address, "Heartbeat", body, md)
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "NTP" in e.details()
    # garbage in the credential
    garbage = hb.SerializeToString() + pb2.HeartbeatRequest(credential=b"job 1 2 3").SerializeToString()
    e = refused(secure.address, "Heartbeat", garbage)
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "malformed credential" in e.details()
    # an older client's credential, in gRPC metadata: told to upgrade (and the lighthouse still serves)
    plain = hb.SerializeToString()
    old = auth.sign(call_key("job"), "Heartbeat", "job", "0", plain, time.time())
    text = f"job {old.timestamp:.6f} {old.nonce.hex()} {old.signature.hex()}"  # the old format
    e = refused(secure.address, "Heartbeat", plain, ((auth.LEGACY_METADATA_KEY, text),))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "gRPC metadata" in e.details()
    assert "upgrade fthsdp" in e.details()
    raw_call(secure.address, "Heartbeat", *signed(call_key("job"), "Heartbeat", hb))


def test_a_call_captured_before_a_lighthouse_restart_cannot_be_replayed_after_it(monkeypatch):
    """A restarted lighthouse (or a standby taking over) starts with an empty replay cache: a
    call signed before it started (past a short grace for clocks a little behind) is refused as
    one to retry afresh, never taken a second time."""
    monkeypatch.setattr(auth, "START_GRACE_S", 0.2)
    hb = pb2.HeartbeatRequest(protocol_version=V, job_id="job", replica_id="0", step=1, incarnation="x")
    cfg = LighthouseConfig(secret=SECRET, join_timeout_s=0.2, detect_s=0.5)
    with LighthouseThread(cfg) as first:
        body, md = signed(call_key("job"), "Heartbeat", hb)
        raw_call(first.address, "Heartbeat", body, md)  # the call as its replica sent it
        late = signed(call_key("job"), "Heartbeat", hb)  # signed, then held up: the restart comes right after
    time.sleep(0.3)  # (the restart comes past the grace after the first signature)
    with LighthouseThread(cfg) as restarted:
        e = refused(restarted.address, "Heartbeat", body, md)  # the captured call, replayed
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
        assert "signed before this server started" in e.details() and "retry" in e.details()
        raw_call(restarted.address, "Heartbeat", *signed(call_key("job"), "Heartbeat", hb))  # a fresh one
    monkeypatch.setattr(auth, "START_GRACE_S", 5.0)  # a call signed within the grace before a start is taken
    with LighthouseThread(cfg) as again:
        raw_call(again.address, "Heartbeat", *late)


def test_status_needs_a_credential_and_never_lists_other_jobs(secure):
    with LighthouseClient(secure.address, "job", "0", key=auth.job_key(SECRET, "job")) as c:
        c.heartbeat(0)
        assert [j.job_id for j in c.status()] == ["job"]  # a job's secret reads its own job
        assert c.status_reply().load is None  # and not the lighthouse's load (about every job)
        with pytest.raises(NotAuthorized, match="reads that job only"):
            c.status("")
        with pytest.raises(NotAuthorized, match="does not verify"):
            c.status("secret-other-job")
    with LighthouseClient(secure.address, "x", "x", status_key=auth.status_key(SECRET)) as reader:
        assert [j.job_id for j in reader.status("")] == ["job"]
        load = reader.status_reply("").load  # the status key reads every job, and the load
        assert load is not None and load.jobs == 1 and load.refused_by_code.get("PERMISSION_DENIED", 0) >= 1
        with pytest.raises(JobNotFound) as ei:
            reader.status("nope")
        assert "'job'" not in str(ei.value)  # the fuzzer's finding: no list of job ids
    hb = pb2.HeartbeatRequest(protocol_version=V, job_id="job", replica_id="9", step=1)
    body, md = signed(auth.status_key(SECRET), "Heartbeat", hb, kind="status")
    e = refused(secure.address, "Heartbeat", body, md)
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "read-only status key" in e.details()
    e = refused(secure.address, "Status", pb2.StatusRequest(protocol_version=V).SerializeToString())
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_body_that_is_not_protobuf_is_invalid_argument(secure):
    for method in ("GetQuorum", "Heartbeat", "Leave", "Status"):
        e = refused(secure.address, method, b"\xff\xff\xff\xff not protobuf")
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.code())
        assert "not a valid" in e.details()
    assert secure.server.port  # still serving


def test_a_replica_id_is_bound_to_the_process_that_registered_it(secure):
    key = auth.job_key(SECRET, "job")
    a = LighthouseClient(secure.address, "job", "0", key=key)
    b = LighthouseClient(secure.address, "job", "0", key=key)  # a second process, same id and secret
    try:
        a.heartbeat(3)
        with pytest.raises(ReplicaIdHeld, match="held by another live process"):
            b.heartbeat(1000)
        a.heartbeat(4)  # the holder is unaffected
        # the holder goes silent: after the detection window the id may be taken over
        time.sleep(0.8)
        b.heartbeat(5)
        with pytest.raises(ReplicaIdHeld):  # and now the old process is the stranger
            a.heartbeat(6)
        assert b.leave(5, finished=False)  # Leave releases the id
        a.heartbeat(7)
    finally:
        a.close()
        b.close()


def test_a_silent_holders_pending_request_does_not_keep_its_id_from_a_new_process():
    """A replica's host dies while its leader's quorum request is pending, and the connection stays
    open (no FIN: a power loss, a partition). The holder beats no more; its request alone must not
    count it live for the request's whole deadline: its restarted process takes the id over after
    one detection window, as after any silence. (Two replicas needed: the request stays pending.)"""
    key = auth.job_key(SECRET, "job")
    cfg = LighthouseConfig(secret=SECRET, join_timeout_s=0.2, detect_s=0.5, min_replicas=2)
    with LighthouseThread(cfg) as lh, LighthouseClient(lh.address, "job", "0", key=key) as old, \
            LighthouseClient(lh.address, "job", "0", key=key) as new:
        def ask():
            with contextlib.suppress(Exception):  # the old process's request ends either way
                old.get_quorum(3, ftar_addresses=["127.0.0.1:9000"], num_replicas=2, timeout_s=20)

        t = threading.Thread(target=ask, daemon=True)
        old.heartbeat(3)  # it beats (and so is judged by its beats) ...
        t.start()  # ... and asks; then it beats no more
        deadline = time.monotonic() + 5
        while not any(r.waiting for j in new.status() for r in j.replicas):
            assert time.monotonic() < deadline, "the old process's request never reached the lighthouse"
            time.sleep(0.02)
        with pytest.raises(ReplicaIdHeld, match="held by another live process"):
            new.heartbeat(0)  # within the window: still the old process's
        time.sleep(0.8)  # silent past the 0.5 s detection window, its request still pending
        assert any(r.waiting for j in new.status() for r in j.replicas)
        new.heartbeat(0)  # taken over at once, not after the request's 20 s
    t.join(25)


def test_job_and_replica_limits_and_the_dead_list_are_bounded():
    lim = guard.Limits(max_replicas_per_job=4, max_jobs=2, max_dead_listed=2, new_ids_burst=100)
    with LighthouseThread(LighthouseConfig(limits=lim, detect_s=0.3, join_timeout_s=0.1)) as lh:
        clients = [LighthouseClient(lh.address, "job", str(i)) for i in range(5)]
        try:
            for c in clients[:4]:
                c.heartbeat(0)
            with pytest.raises(Exception) as ei:
                clients[4].heartbeat(0)
            assert "this lighthouse's limit" in str(ei.value) and "RESOURCE_EXHAUSTED" in str(ei.value)
            with LighthouseClient(lh.address, "second", "0") as c2, LighthouseClient(lh.address, "third", "0") as c3:
                c2.heartbeat(0)
                with pytest.raises(Exception, match="serves 2 jobs, its limit"):
                    c3.heartbeat(0)
            time.sleep(0.6)  # the four go silent: dead ...
            clients[0].heartbeat(1)
            time.sleep(0.1)
            reply = clients[0].heartbeat(1)
            assert len(reply.dead_replica_ids) <= 2  # ... but at most 2 listed, the oldest forgotten
            assert lh.server.stats["forgotten_dead"] >= 1
        finally:
            for c in clients:
                c.close()
    with LighthouseThread(LighthouseConfig(limits=guard.Limits(new_ids_burst=3, new_ids_per_s=1.0))) as lh:
        cs = [LighthouseClient(lh.address, "job", str(i)) for i in range(4)]
        try:
            for c in cs[:3]:
                c.heartbeat(0)
            with pytest.raises(Exception, match="too many new replica ids"):
                cs[3].heartbeat(0)
            cs[0].heartbeat(1)  # known ids are not charged
        finally:
            for c in cs:
                c.close()


def test_a_flooding_connection_is_held_to_its_budget_while_another_job_is_served():
    """Per-connection budgets (fthsdp/control/admission.py) against a real server: a client with
    32 calls in flight gets no more answers than its budget allows; its calls over budget wait
    (held, not answered at once); another job's replica on its own connection is answered."""
    import asyncio

    from fthsdp.control.admission import FairnessLimits

    fair = FairnessLimits(connection_calls_per_s=50.0, connection_burst=20)
    with LighthouseThread(LighthouseConfig(secret=SECRET, detect_s=5.0, join_timeout_s=0.2, fairness=fair)) as lh:
        insider = call_key("flood")
        victim = call_key("victim")
        answered: dict[str, int] = {}

        async def flood(seconds: float) -> None:
            async with grpc.aio.insecure_channel(lh.address) as ch:
                call = ch.unary_unary("/fthsdp.v1.Lighthouse/Heartbeat", request_serializer=None,
                                      response_deserializer=None)
                end = time.monotonic() + seconds

                async def worker(w: int) -> None:
                    i = 0
                    while time.monotonic() < end:
                        i += 1
                        req = pb2.HeartbeatRequest(protocol_version=V, job_id="flood", replica_id="flooder",
                                                   step=i, incarnation="w")
                        body, md = signed(insider, "Heartbeat", req)
                        try:
                            await call(body, timeout=5)
                            answered["OK"] = answered.get("OK", 0) + 1
                        except grpc.RpcError as e:
                            answered[e.code().name] = answered.get(e.code().name, 0) + 1

                await asyncio.gather(*(worker(w) for w in range(32)))

        victim_lat = []

        def victim_calls() -> None:
            time.sleep(0.3)  # the flood is under way
            with grpc.insecure_channel(lh.address) as ch:
                for i in range(10):
                    req = pb2.HeartbeatRequest(protocol_version=V, job_id="victim", replica_id="0", step=i,
                                               incarnation="v")
                    body, md = signed(victim, "Heartbeat", req)
                    t0 = time.monotonic()
                    ch.unary_unary("/fthsdp.v1.Lighthouse/Heartbeat", request_serializer=None,
                                   response_deserializer=None)(body, timeout=5)
                    victim_lat.append(time.monotonic() - t0)
                    time.sleep(0.05)

        t = threading.Thread(target=victim_calls)
        t.start()
        t0 = time.monotonic()
        asyncio.run(flood(1.5))
        took = time.monotonic() - t0
        t.join()
    # the budget is a hard bound on what the flood got served: burst + rate x time (+ the held
    # calls let go as the flood ends)
    assert answered.get("OK", 0) <= fair.connection_burst + fair.connection_calls_per_s * took + 32, answered
    assert answered.get("OK", 0) >= fair.connection_burst, answered  # ... and it was served, not shut out
    assert set(answered) <= {"OK", "RESOURCE_EXHAUSTED"}, answered
    assert len(victim_lat) == 10  # every call of the other job answered (its latency is measured in
    # experiments/auth_cost.py, not asserted here)


def test_tls_with_a_self_signed_certificate(tmp_path):
    cert, key = _self_signed(tmp_path)
    cfg = LighthouseConfig(secret=SECRET, tls_cert_file=str(cert), tls_key_file=str(key), join_timeout_s=0.1)
    with LighthouseThread(cfg) as lh:
        with LighthouseClient(lh.address, "job", "0", key=auth.job_key(SECRET, "job"), tls_ca_file=str(cert)) as c:
            q = c.get_quorum(0, ftar_addresses=["127.0.0.1:7000"], timeout_s=10)
            assert q.member_ids == ("0",)
        # plain TCP to a TLS port gets nowhere
        with LighthouseClient(lh.address, "job", "1", key=auth.job_key(SECRET, "job"), rpc_timeout_s=2) as plain:
            with pytest.raises(Exception):
                plain.heartbeat(0)


def _self_signed(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.mark.multiprocess
def test_fthsdp_run_serves_its_own_lighthouse_over_tls(tmp_path):
    """launch.lighthouse_tls_cert/key: the launcher's lighthouse speaks only TLS, and the replicas
    reach it with ft.lighthouse_tls_ca. Either half unwired fails the job: a TLS client cannot talk
    to a plain lighthouse, nor a plain client to a TLS one."""
    from fthsdp import config as config_lib
    from test_launcher import fthsdp_run, job_args, summary

    cert, key = _self_signed(tmp_path)
    out = tmp_path / "run"
    p = fthsdp_run(out, *job_args(2, 12, "--lighthouse-tls-cert", str(cert), "--lighthouse-tls-key", str(key),
                                  "--lighthouse-tls-ca", str(cert)), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert summary(out)["identical_final_state"]
    for r in (0, 1):
        log = (out / f"replica-{r}.log").read_text()
        assert "heartbeat failure" not in log, log[-2000:]
    # misconfigurations are refused before anything starts, naming the field and what to do
    for overrides, says in ((["launch.lighthouse_tls_cert=" + str(cert)], "given without its pair"),
                            ([f"launch.lighthouse_tls_cert={cert}", f"launch.lighthouse_tls_key={key}"],
                             "ft.lighthouse_tls_ca is empty"),
                            ([f"launch.lighthouse_tls_cert={cert}", f"launch.lighthouse_tls_key={key}",
                              f"ft.lighthouse_tls_ca={cert}", "launch.lighthouse=127.0.0.1:1"], "--tls-cert/--tls-key"),
                            ([f"ft.lighthouse_tls_ca={tmp_path / 'missing.pem'}"], "ft.lighthouse_tls_ca")):
        with pytest.raises(ValueError, match=re.escape(says)):
            config_lib.load("base", overrides)


def test_the_cli_needs_a_secret_or_an_explicit_insecure_loopback_choice(tmp_path):
    def lighthouse(*args, env=None):
        return subprocess.run([sys.executable, "-m", "fthsdp.control.lighthouse", *args], cwd=REPO, timeout=60,
                              capture_output=True, text=True, env={**os.environ, **(env or {})})

    p = lighthouse("--bind", "127.0.0.1:0")
    assert p.returncode == 2 and "--secret-file" in p.stderr and "--insecure" in p.stderr
    p = lighthouse("--bind", "0.0.0.0:0", "--insecure")
    assert p.returncode == 2 and "without authentication beyond loopback" in p.stderr
    f = tmp_path / "lh.secret"
    auth.write_secret(str(f), SECRET)
    p = lighthouse("--print-job-secret", "job", env={auth.LIGHTHOUSE_SECRET_FILE_ENV: str(f)})
    assert p.returncode == 0 and bytes.fromhex(p.stdout.strip()) == auth.job_key(SECRET, "job")
    p = lighthouse("--print-status-key", "--secret-file", str(f))
    assert bytes.fromhex(p.stdout.strip()) == auth.status_key(SECRET)


# -- the issue's attacks, replayed against a real job -----------------------------------

def attack(address: str, lighthouse_secret: bytes, job: str, stop: threading.Event, killed) -> dict[str, list]:
    """Every lighthouse attack of issue 13, as a stranger (no secret) and as insiders (another job's
    secret; this job's secret in a second process). Returns the status codes each attack got."""
    got: dict[str, list] = {}
    # One connection per kind of attack, as separate attackers: the lighthouse holds each
    # connection's refused calls to ~5/s (fthsdp/control/admission.py; its own test), and on
    # one connection the attacks in sequence would outlast the job.
    channels: dict[str, grpc.Channel] = {}

    def note(name: str, method: str, body: bytes, metadata=None) -> None:
        ch = channels.get(name)
        if ch is None:
            ch = channels[name] = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        try:
            ch.unary_unary(f"/fthsdp.v1.Lighthouse/{method}", request_serializer=None,
                           response_deserializer=None)(body, timeout=10, metadata=metadata)
            got.setdefault(name, []).append("OK")
        except grpc.RpcError as e:
            got.setdefault(name, []).append(e.code().name)

    def qreq(**over):
        return quorum_req(job_id=job, **over)

    # first the insiders, while every replica is surely live
    # an insider of another job (its own secret from the same lighthouse) acts for this job
    other = auth.derive(auth.job_key(lighthouse_secret, "other-job"), "lighthouse")
    hb = pb2.HeartbeatRequest(protocol_version=V, job_id=job, replica_id="0", step=10**6, incarnation="evil")
    note("another job's secret", "Heartbeat", *signed(other, "Heartbeat", hb))
    # this job's secret in a second process: may not take the id of a live replica
    mine = auth.derive(auth.job_key(lighthouse_secret, job), "lighthouse")
    for _ in range(3):
        req = qreq(replica_id="0", step=10**12, ftar_addresses=["127.0.0.9:1"], incarnation="second-process")
        note("second process for a live id", "GetQuorum", *signed(mine, "GetQuorum", req))
        stop.wait(0.2)
    # a stranger impersonates replica 1 with its own addresses and a huge step (to supersede it)
    note("impersonate", "GetQuorum", qreq(replica_id="1", step=10**12, ftar_addresses=["127.0.0.9:1"])
         .SerializeToString())
    # forged heartbeats with ghost ids (to block every quorum), and as replica 1 (killed meanwhile)
    for _ in range(3):
        for rid in ("ghost-0", "ghost-1", "ghost-2", "1"):
            note("forged heartbeat", "Heartbeat", pb2.HeartbeatRequest(
                protocol_version=V, job_id=job, replica_id=rid, step=10**6).SerializeToString())
    note("3 MB job id", "Heartbeat", pb2.HeartbeatRequest(
        protocol_version=V, job_id="j" * 3_000_000, replica_id="0").SerializeToString())
    note("junk address", "GetQuorum", qreq(replica_id="9", ftar_addresses=["not an address \0\n; rm -rf /"])
         .SerializeToString())
    note("step 2**63-1", "GetQuorum", qreq(replica_id="9", step=2**63 - 1).SerializeToString())
    note("not protobuf", "GetQuorum", b"\x08\x96\x01\xff\xff\xff garbage")
    note("status without credential", "Status", pb2.StatusRequest(protocol_version=V).SerializeToString())
    # last a flood of 10 KB ids (refused; each refusal spends 21 of its connection's budget of 100
    # calls/s, so the flood is held to ~5 calls/s: 20 show the refusal without a long wait)
    for i in range(20):
        note("10 KB ids", "Heartbeat", pb2.HeartbeatRequest(
            protocol_version=V, job_id=job, replica_id=f"{i}".rjust(10_000, "x")).SerializeToString())
    # heartbeats as replica 1 once it was SIGKILLed (to keep a dead replica "live")
    deadline = time.monotonic() + 60
    while not killed() and time.monotonic() < deadline and not stop.is_set():
        stop.wait(0.1)
    assert killed(), "the job's kill of replica 1 never fired"
    for _ in range(10):
        note("heartbeat as the dead replica", "Heartbeat", pb2.HeartbeatRequest(
            protocol_version=V, job_id=job, replica_id="1", step=10**6).SerializeToString())
        stop.wait(0.1)
    for ch in channels.values():
        ch.close()
    return got


@pytest.mark.multiprocess
def test_attacks_are_refused_and_a_real_job_beside_them_is_unharmed(tmp_path):
    from fthsdp.launch import report
    from fthsdp.launch.faults import plan
    from fthsdp.launch.local import LocalJob

    from test_fault_tolerance import TINY, assert_identical_after_every_commit
    from test_launcher import exactly_once

    # long enough that the attacks (~7 s, paced by the lighthouse's budgets) end while it trains:
    # on an idle machine 40 steps finished first and the closing Status read found no lighthouse
    steps = 90
    job = LocalJob(config="base", overrides=TINY + ["launch.replicas=3", "launch.devices_per_replica=1",
                                                    f"train.steps={steps}", "train.min_step_s=0.15"],
                   out_dir=tmp_path, replicas=3, steps=steps, faults=plan(("1@8",), (), 3), restart=True,
                   detect_s=0.8, join_timeout_s=0.5, deadline_s=300, progress=False)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(summary=job.run()), daemon=True)
    runner.start()
    stop = threading.Event()
    reader = None
    try:
        deadline = time.monotonic() + 240
        while not job.lighthouse_addr and time.monotonic() < deadline:
            time.sleep(0.1)
        reader = LighthouseClient(job.lighthouse_addr, "x", "x",
                                  status_key=auth.load_secret(str(tmp_path / "status.key")))
        # attack once the job trains (a replica at step >= 3)
        while time.monotonic() < deadline and runner.is_alive():
            try:
                if max((r.step for j in reader.status(job.job_id) for r in j.replicas), default=0) >= 3:
                    break
            except JobNotFound:
                pass
            time.sleep(0.2)
        got = attack(job.lighthouse_addr, job.lighthouse_secret, job.job_id, stop,
                     killed=lambda: any(f.get("kind") == "kill" for f in job.fired))
        assert runner.is_alive(), "the job finished before the attacks did: make it longer"
        [st] = reader.status(job.job_id)
        assert {r.replica_id for r in st.replicas} <= {"0", "1", "2"}, st.replicas  # no ghost ever registered
    finally:
        stop.set()
        runner.join(300)
        if reader is not None:
            reader.close()
    assert not runner.is_alive(), "the job did not finish"
    expected = {
        "impersonate": {"UNAUTHENTICATED"},
        "forged heartbeat": {"UNAUTHENTICATED"},
        "heartbeat as the dead replica": {"UNAUTHENTICATED"},
        "10 KB ids": {"INVALID_ARGUMENT"},
        "3 MB job id": {"INVALID_ARGUMENT"},
        "junk address": {"INVALID_ARGUMENT"},
        "step 2**63-1": {"INVALID_ARGUMENT"},
        "not protobuf": {"INVALID_ARGUMENT"},
        "status without credential": {"UNAUTHENTICATED"},
        "another job's secret": {"UNAUTHENTICATED"},
        "second process for a live id": {"PERMISSION_DENIED"},
    }
    assert {k: set(v) for k, v in got.items()} == expected
    s = result["summary"]
    assert s["identical_final_state"], s
    assert not s["failed_replicas"], s
    run = report.load_run(tmp_path)
    assert_identical_after_every_commit(run)
    exactly_once(tmp_path, run)
    log = (tmp_path / "lighthouse.log").read_text()
    assert "ghost" not in log and "xxxxxxxx" not in log and "new job 'other-job'" not in log


# -- a client newer than its lighthouse -----------------------------------------------------

# What a lighthouse from before the credential field answered a call without a credential in
# gRPC metadata (fthsdp/control/guard.py before the field existed, word for word).
OLDER_LIGHTHOUSE_REFUSAL = (
    "Heartbeat of job 'job' replica '0' carries no credential: this lighthouse requires one. Replicas: give the "
    "launcher the job's secret (fthsdp run generates it; --secret-file, $FTHSDP_JOB_SECRET_FILE); fthsdp status: "
    "--status-key-file or --secret-file (see the README's Security section)")


def test_the_older_lighthouse_advice_fires_only_for_a_signed_call_refused_for_lack_of_a_credential():
    advice = lighthouse_client.older_lighthouse_advice
    u = grpc.StatusCode.UNAUTHENTICATED
    text = advice(True, u, OLDER_LIGHTHOUSE_REFUSAL)
    assert "older than this client" in text and "upgrade fthsdp on the lighthouse" in text
    assert f"({auth.CREDENTIAL_FIELD})" in text and OLDER_LIGHTHOUSE_REFUSAL in text  # its own words kept
    assert advice(False, u, OLDER_LIGHTHOUSE_REFUSAL) is None  # unsigned: the refusal is right
    assert advice(True, grpc.StatusCode.PERMISSION_DENIED, OLDER_LIGHTHOUSE_REFUSAL) is None
    assert advice(True, u, "Heartbeat of job 'job': the credential does not verify: ...") is None
    # a current lighthouse's refusal names the field: it read the request and found none there
    current = guard.CallAuthenticator(auth.new_secret()).check("Heartbeat", "job", "0", None)
    assert "carries no credential" in current.reason and advice(True, u, current.reason) is None


def test_a_signed_client_told_no_credential_by_an_older_lighthouse_is_told_to_upgrade_it():
    """A real gRPC server on loopback answering as a lighthouse from before field 130 did (it
    skips the field as unknown and finds nothing in metadata); the session stream it does not
    offer (UNIMPLEMENTED), so the client falls back to unary calls, as with that lighthouse."""
    seen: list[bytes] = []

    def heartbeat(data: bytes, context: grpc.ServicerContext) -> bytes:
        seen.append(data)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, OLDER_LIGHTHOUSE_REFUSAL)

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("fthsdp.v1.Lighthouse", {
        "Heartbeat": grpc.unary_unary_rpc_method_handler(heartbeat)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        signed = LighthouseClient(f"127.0.0.1:{port}", "job", 0, key=auth.new_secret(), rpc_timeout_s=5.0)
        unsigned = LighthouseClient(f"127.0.0.1:{port}", "job", 0, rpc_timeout_s=5.0)
        try:
            with pytest.raises(NotAuthorized, match="older than this client") as ei:
                signed.heartbeat(0)
            assert "upgrade fthsdp on the lighthouse" in str(ei.value)
            assert auth.split_signed(seen[-1]) is not None  # the call did carry its credential
            with pytest.raises(NotAuthorized) as ei:
                unsigned.heartbeat(0)
            assert "older than this client" not in str(ei.value) and "carries no credential" in str(ei.value)
        finally:
            signed.close()
            unsigned.close()
    finally:
        server.stop(0)


def test_the_one_step_check_of_a_job_signed_request_agrees_with_the_full_check():
    secret = auth.new_secret()
    key = auth.derive(auth.job_key(secret, "j"), "lighthouse")
    req = pb2.HeartbeatRequest(protocol_version=V, job_id="j", replica_id="0", step=3)
    body = req.SerializeToString()
    good = auth.signed_request(key, "Heartbeat", "j", "0", body, now=1000.0)
    ts, nonce = auth.verify_job_request(key, "Heartbeat", "j", "0", good)
    cred = auth.split_signed(good)[1]
    assert (ts, nonce) == (cred.timestamp_us, cred.nonce) == (1_000_000_000, cred.nonce)
    flipped = bytearray(good)
    flipped[4] ^= 1
    assert auth.verify_job_request(key, "Heartbeat", "j", "0", bytes(flipped)) is False
    assert auth.verify_job_request(key, "Heartbeat", "j", "1", good) is False  # another replica's
    assert auth.verify_job_request(key, "GetQuorum", "j", "0", good) is False  # another method's
    assert auth.verify_job_request(key, "Heartbeat", "j", "0", body) is None  # unsigned: the full check says why
    status = auth.signed_request(auth.status_key(secret), "Heartbeat", "j", "0", body, kind="status")
    assert auth.verify_job_request(key, "Heartbeat", "j", "0", status) is None
    # through the authenticator: the same verdicts as check(), replay included
    checker = guard.CallAuthenticator(secret)
    fresh = auth.signed_request(key, "Heartbeat", "j", "0", body)
    assert checker.check_request("Heartbeat", req, fresh) is None
    assert "replayed" in checker.check_request("Heartbeat", req, fresh).reason
    assert "does not verify" in checker.check_request("Heartbeat", req, bytes(flipped)).reason
    assert "read-only status key" in checker.check_request("Heartbeat", req, status).reason
    assert "carries no credential" in checker.check_request("Heartbeat", req, body).reason
    other = pb2.HeartbeatRequest(protocol_version=V, job_id="k", replica_id="0", step=3)  # j's key, k's request
    assert "does not verify" in checker.check_request(
        "Heartbeat", other, auth.signed_request(key, "Heartbeat", "k", "0", other.SerializeToString())).reason


@pytest.mark.parametrize("size", [0, 100, 4000, 5000, 100_000])  # both sides of the native path's bound
def test_native_and_hashlib_macs_sign_and_check_the_same_bytes(size, monkeypatch):
    import hashlib
    import hmac

    key = auth.derive(auth.job_key(auth.new_secret(), "j"), "lighthouse")
    body = pb2.HeartbeatRequest(protocol_version=V, job_id="j", replica_id="0", metrics_address="x" * size,
                                step=1).SerializeToString()
    prefix = b"fthsdp call v2\x009:Heartbeat1:j1:0"
    assert auth._native_hmac is not None  # the extension is built with the package
    native = auth.signed_request(key, "Heartbeat", "j", "0", body, now=5.0)
    assert native[-32:] == hmac.new(key, prefix + native[:-32], hashlib.sha256).digest()
    monkeypatch.setattr(auth, "_native_hmac", None)  # as without the extension
    plain = auth.signed_request(key, "Heartbeat", "j", "0", body, now=5.0)
    assert plain[-32:] == hmac.new(key, prefix + plain[:-32], hashlib.sha256).digest()
    for data in (native, plain):
        assert auth.verify_job_request(key, "Heartbeat", "j", "0", data)[0] == 5_000_000
    monkeypatch.undo()
    for data in (native, plain):
        assert auth.verify_job_request(key, "Heartbeat", "j", "0", data)[0] == 5_000_000
        assert auth.verify_job_request(key, "Heartbeat", "j", "1", data) is False
