"""FTAR under attack: replays of issue 13's probes against real communicators.

Real loopback sockets, real control threads, real subprocesses. The attacker
is a raw socket speaking FTAR's wire format (protocol version 2, the records of
ffi/transport/tcp.h), with or without the job's key; a misbehaving *member*
is a real communicator in a subprocess whose chunk-corruption test hook
(FTHSDP_FTAR_TEST_CORRUPT_CHUNK, off by default) flips a bit of one chunk
header it sends.

Each test checks that the attack is refused with its reason and that the
honest ring still forms and sums correctly afterwards.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import pathlib
import secrets
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from fthsdp.collective import ftar, native

REPO = pathlib.Path(__file__).resolve().parents[1]
KEY = ftar.key_from_secret(b"a fixed test secret of this job")
OTHER_KEY = ftar.key_from_secret(b"the secret of some other job")

HELLO = struct.Struct("<IIqiiii64sI16s")
REPLY = struct.Struct("<I192s16s32s")
PROOF = struct.Struct("<I32s")
HELLO_MAGIC, PROOF_MAGIC, VERSION = 0x46544152, 0x50524F46, 2
REFUSED, ACCEPTED, CHALLENGE, BUSY = 0, 1, 2, 3
LABEL_RECEIVER = b"fthsdp ftar v2 receiver proof\0"
LABEL_SENDER = b"fthsdp ftar v2 sender proof\0"


def hello_bytes(job="job", quorum=1, rank=0, n=2, stream=0, streams=2, auth=1, nonce=None) -> bytes:
    return HELLO.pack(HELLO_MAGIC, VERSION, quorum, rank, n, stream, streams, job.encode(), auth,
                      nonce if nonce is not None else secrets.token_bytes(16))


def host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def recv_exact(sock: socket.socket, n: int, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += got
    return buf


def read_reply(sock: socket.socket) -> tuple[int, str, bytes, bytes]:
    ok, reason, nonce, mac = REPLY.unpack(recv_exact(sock, REPLY.size))
    return ok, reason.split(b"\0", 1)[0].decode(), nonce, mac


def pair(key=KEY, timeout_s=10.0, **kw):
    return (ftar.Communicator(timeout_s=timeout_s, key=key, **kw),
            ftar.Communicator(timeout_s=timeout_s, key=key, **kw))


def configure_both(a, b, q, timeout_s=10.0):
    members = [a.address, b.address]
    a.configure("job", q, 0, members, timeout_s=timeout_s, wait=False)
    b.configure("job", q, 1, members, timeout_s=timeout_s, wait=False)
    return a.wait_configured(timeout_s + 1), b.wait_configured(timeout_s + 1)


def run_both(a, b, xa, xb, q):
    out = {}

    def go(name, c, x, rank):
        out[name] = c.allreduce_host(x, quorum_id=q, rank=rank, n=2)

    ts = [threading.Thread(target=go, args=("a", a, xa, 0)), threading.Thread(target=go, args=("b", b, xb, 1))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    return out


def assert_ring_sums(a, b, q):
    xa, xb = np.arange(1000, dtype=np.float32), np.full(1000, 3.0, np.float32)
    out = run_both(a, b, xa, xb, q)
    assert out["a"] == (ftar.STATUS_OK, "") and out["b"] == (ftar.STATUS_OK, ""), out
    np.testing.assert_array_equal(xa, np.arange(1000, dtype=np.float32) + 3)
    assert xa.tobytes() == xb.tobytes()


# ---------------------------------------------------------------------------
# The MAC itself.


def test_hmac_sha256_cxx_unit_test():
    """ffi/tests/hmac_sha256_test.cc: FIPS 180-4 and RFC 4231 vectors (built by CMake beside the extension)."""
    found = sorted(REPO.glob("build/*/fthsdp_hmac_sha256_test"))
    if not found:
        pytest.skip("fthsdp_hmac_sha256_test not built (pip install --no-build-isolation -e .)")
    r = subprocess.run([str(found[-1])], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout


def test_hmac_sha256_matches_hashlib():
    mod = native.module()
    rng = np.random.default_rng(0)
    for key_len in (0, 1, 16, 32, 63, 64, 65, 200):
        for msg_len in (0, 1, 55, 56, 63, 64, 65, 119, 120, 1000):
            key, msg = rng.bytes(key_len), rng.bytes(msg_len)
            assert mod.hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest(), (key_len, msg_len)


def test_short_key_and_wrong_type_are_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ftar.FtarOptions(key=b"short")
    with pytest.raises(TypeError, match="must be bytes"):
        ftar.FtarOptions(key="a string")  # type: ignore[arg-type]
    assert "key" not in repr(ftar.FtarOptions(key=KEY))


# ---------------------------------------------------------------------------
# Handshake attacks.


def test_authenticated_ring_sums_and_tags_every_chunk():
    a, b = pair(chunk_bytes=256, chunks=3, streams=3)
    with a, b:
        assert a.authenticated and b.authenticated
        ra, rb = configure_both(a, b, 1)
        assert ra and rb, (ra, rb)
        for q in (1,):
            assert_ring_sums(a, b, q)
        assert a.stats()[0]["violations"] == b.stats()[0]["violations"] == 0
        # every chunk tagged by its sender and checked by its receiver, timed where it ran
        # (what experiments/ftar_bandwidth.py --paired-auth reports as authentication's cost)
        sa, sb = a.stats()[0], b.stats()[0]
        assert sa["chunk_macs"] == sb["chunk_macs"] > 0 and sa["chunk_mac_ns"] > 0 and sb["chunk_mac_ns"] > 0
    c, d = pair(key=b"", chunk_bytes=256)
    with c, d:
        assert all(configure_both(c, d, 1))
        assert_ring_sums(c, d, 1)
        assert c.stats()[0]["chunk_macs"] == d.stats()[0]["chunk_mac_ns"] == 0  # no key: no MAC


def test_slot_hijack_before_configure_is_refused_and_the_ring_forms():
    """The probe: a stranger who read the job and quorum ids sends the hello of
    rank 0's stream 0 before rank 1 configures. It is held without a slot,
    challenged at configure, cannot prove the key, and the real neighbour takes
    the slot."""
    a, b = pair()
    with a, b:
        silent = socket.create_connection(host_port(b.address))  # claims the slot, then never proves
        liar = socket.create_connection(host_port(b.address))  # claims it and sends a made-up proof
        for s in (silent, liar):
            s.sendall(hello_bytes(quorum=1, rank=0, stream=0))
        time.sleep(0.3)  # both hellos are held before b configures
        ra, rb = configure_both(a, b, 1)
        assert ra and rb, (ra, rb)
        ok, _, _, _ = read_reply(liar)
        assert ok == CHALLENGE
        liar.sendall(PROOF.pack(PROOF_MAGIC, secrets.token_bytes(32)))
        ok, reason, _, _ = read_reply(liar)
        assert ok == REFUSED and "bad proof" in reason, reason
        assert_ring_sums(a, b, 1)
        assert b.stats()[0]["refused_handshakes"] >= 1
        silent.close()
        liar.close()


def test_hello_with_a_wrong_proof_or_none_is_refused():
    a, b = pair()
    with a, b:
        members = [a.address, b.address]
        b.configure("job", 1, 1, members, timeout_s=10, wait=False)  # a joins after the attacks
        time.sleep(0.05)
        # No auth flag at all: refused at once with the reason.
        s = socket.create_connection(host_port(b.address))
        s.sendall(hello_bytes(quorum=1, rank=0, stream=1, auth=0))
        ok, reason, _, _ = read_reply(s)
        assert ok == REFUSED and "no proof of the job secret" in reason, reason
        s.close()
        # A key of another job: the receiver's proof does not verify under it, and ours is refused.
        nonce = secrets.token_bytes(16)
        hello = hello_bytes(quorum=1, rank=0, stream=1, nonce=nonce)
        s = socket.create_connection(host_port(b.address))
        s.sendall(hello)
        ok, _, nonce_r, mac_r = read_reply(s)
        assert ok == CHALLENGE
        assert hmac.new(KEY, LABEL_RECEIVER + hello + nonce_r, hashlib.sha256).digest() == mac_r  # b proved KEY
        assert hmac.new(OTHER_KEY, LABEL_RECEIVER + hello + nonce_r, hashlib.sha256).digest() != mac_r
        s.sendall(PROOF.pack(PROOF_MAGIC, hmac.new(OTHER_KEY, LABEL_SENDER + hello + nonce_r,
                                                   hashlib.sha256).digest()))
        ok, reason, _, _ = read_reply(s)
        assert ok == REFUSED and "bad proof" in reason, reason
        s.close()
        # A proof replayed from another connection (the nonces differ): refused too.
        s = socket.create_connection(host_port(b.address))
        s.sendall(hello)
        ok, _, nonce_r2, _ = read_reply(s)
        assert ok == CHALLENGE and nonce_r2 != nonce_r
        s.sendall(PROOF.pack(PROOF_MAGIC, hmac.new(KEY, LABEL_SENDER + hello + nonce_r, hashlib.sha256).digest()))
        ok, reason, _, _ = read_reply(s)
        assert ok == REFUSED and "bad proof" in reason, reason
        s.close()
        a.configure("job", 1, 0, members, timeout_s=10, wait=False)
        ra, rb = a.wait_configured(11), b.wait_configured(11)
        assert ra and rb, (ra, rb)
        assert_ring_sums(a, b, 1)
        assert b.stats()[0]["refused_handshakes"] >= 3


def test_a_correct_proof_from_python_is_accepted():
    """Interop: a sender written from the wire description (hashlib's HMAC) completes the
    handshake, so the C++ MACs are the documented ones."""
    a, b = pair(streams=1)
    with a, b:
        b.configure("job", 1, 1, [a.address, b.address], timeout_s=3, wait=False)
        time.sleep(0.05)
        nonce = secrets.token_bytes(16)
        hello = hello_bytes(quorum=1, rank=0, stream=0, streams=1, nonce=nonce)
        s = socket.create_connection(host_port(b.address))
        s.sendall(hello)
        ok, _, nonce_r, mac_r = read_reply(s)
        assert ok == CHALLENGE
        assert hmac.compare_digest(hmac.new(KEY, LABEL_RECEIVER + hello + nonce_r, hashlib.sha256).digest(), mac_r)
        s.sendall(PROOF.pack(PROOF_MAGIC, hmac.new(KEY, LABEL_SENDER + hello + nonce_r, hashlib.sha256).digest()))
        ok, reason, _, _ = read_reply(s)
        assert ok == ACCEPTED, reason
        s.close()


def test_replica_of_another_quorum_or_job_is_refused():
    a, b = pair()
    c = ftar.Communicator(timeout_s=10.0, key=KEY)  # same job, stale quorum 3
    d = ftar.Communicator(timeout_s=10.0, key=OTHER_KEY)  # another job's secret, same ids
    with a, b, c, d:
        members = [a.address, b.address]
        b.configure("job", 4, 1, members, timeout_s=10, wait=False)
        c.configure("job", 3, 0, [c.address, b.address], timeout_s=3, wait=False)
        d.configure("job", 4, 0, [d.address, b.address], timeout_s=3, wait=False)
        rc, rd = c.wait_configured(5), d.wait_configured(5)
        assert not rc and "stale quorum id 3" in rc.reason, rc
        assert not rd and "failed to prove the job secret" in rd.reason, rd
        a.configure("job", 4, 0, members, timeout_s=10, wait=False)
        assert a.wait_configured(11) and b.wait_configured(11)
        assert_ring_sums(a, b, 4)


def test_insecure_and_authenticated_ranks_refuse_each_other():
    a = ftar.Communicator(timeout_s=5.0, key=b"")
    b = ftar.Communicator(timeout_s=5.0, key=KEY)
    with a, b:
        ra, rb = configure_both(a, b, 1, timeout_s=2.0)
        assert not ra and not rb
        assert "this rank requires one" in rb.reason or "this rank requires one" in ra.reason, (ra, rb)


def test_500_idle_connections_do_not_stop_the_ring():
    a, b = pair()
    with a, b:
        idle = []
        for c in (a, b):
            for _ in range(250):
                idle.append(socket.create_connection(host_port(c.address)))
        ra, rb = configure_both(a, b, 1)
        assert ra and rb, (ra, rb)
        assert_ring_sums(a, b, 1)
        # The flood was bounded: the oldest idle connections were closed as "busy" with the reason.
        closed = 0
        for s in idle[:50]:
            try:
                ok, reason, _, _ = read_reply(s)
                closed += ok == BUSY and "to bound pending handshakes" in reason
            except (ConnectionError, OSError):
                pass
        assert closed >= 40, closed
        for s in idle:
            s.close()


def test_a_flood_of_held_hellos_does_not_lock_out_the_neighbour():
    """Hellos for quorums this rank is not configured for are held, without a slot; 100 of
    them fill the pending table, yet the real neighbour's connection evicts the oldest (told
    "busy") and the ring forms."""
    a, b = pair()
    with a, b:
        flood = []
        for i in range(100):
            s = socket.create_connection(host_port(b.address))
            s.sendall(hello_bytes(quorum=1000 + i, rank=0, stream=i % 2))
            flood.append(s)
        time.sleep(0.3)
        ra, rb = configure_both(a, b, 1)
        assert ra and rb, (ra, rb)
        assert_ring_sums(a, b, 1)
        for s in flood:
            s.close()


def test_bytes_after_a_held_hello_are_refused_at_once():
    """A hello this rank cannot answer yet (not configured) is held; its sender must wait for the
    answer. One byte more was left unread, and poll reported it on every pass: the control thread
    spun for the hold's 120 s, for anyone who sent a hello and a byte. It is refused now."""
    a = ftar.Communicator(timeout_s=5.0, key=KEY)
    with a, socket.create_connection(host_port(a.address)) as s:
        s.sendall(hello_bytes(quorum=1, rank=0, stream=0))
        time.sleep(0.2)  # held: a is not configured
        t0 = time.monotonic()
        s.sendall(b"x")
        ok, reason, _, _ = read_reply(s)
        assert ok == REFUSED and "sent data after its hello before it was answered" in reason, reason
        assert time.monotonic() - t0 < 2.0


def test_a_flood_of_challenged_strangers_does_not_lock_out_the_neighbour():
    """A hello's fields are public: a stranger earns a challenge with them and never answers it. A
    flood keeping all 64 pending slots in that state told every newcomer "busy", the real neighbour
    too, until its connect deadline; the oldest challenged connection is now closed for a newcomer
    (an honest neighbour proves itself within a round trip)."""
    a, b = pair()
    stop = threading.Event()
    flood: list[socket.socket] = []

    def strangers():
        while not stop.is_set():  # ~100 a second, each challenged and silent until its 5 s deadline
            try:
                s = socket.create_connection(host_port(b.address), timeout=1.0)
                s.sendall(hello_bytes(quorum=1, rank=0, stream=len(flood) % 2))
                flood.append(s)
            except OSError:
                pass
            time.sleep(0.01)

    with a, b:
        b.configure("job", 1, 1, [a.address, b.address], timeout_s=8.0, wait=False)
        t = threading.Thread(target=strangers, daemon=True)
        t.start()
        try:
            time.sleep(1.0)  # the pending table is full of challenged strangers
            # 3 s to connect: the strangers' first challenges expire only 4 s from now (5 s deadline)
            a.configure("job", 1, 0, [a.address, b.address], timeout_s=3.0, wait=False)
            ra, rb = a.wait_configured(4.0), b.wait_configured(9.0)
            assert ra and rb, (ra, rb)
            assert_ring_sums(a, b, 1)
        finally:
            stop.set()
            t.join(5)
            for s in flood:
                s.close()


def test_deadlines_must_be_finite():
    with pytest.raises(ValueError, match="finite number of seconds"):
        ftar.Communicator(timeout_s=math.inf, key=KEY)
    a = ftar.Communicator(timeout_s=5.0, key=KEY)
    with a:
        with pytest.raises(Exception, match="finite number of seconds"):
            a.configure("job", 1, 0, [a.address], timeout_s=math.inf)
        with pytest.raises(Exception, match="finite number of seconds"):
            a.wait_configured(math.inf)


def test_a_silent_connection_is_refused_at_the_handshake_deadline():
    a = ftar.Communicator(timeout_s=5.0, key=KEY)
    with a:
        s = socket.create_connection(host_port(a.address))
        t0 = time.monotonic()
        ok, reason, _, _ = read_reply(s)
        took = time.monotonic() - t0
        assert ok == REFUSED and "handshake deadline" in reason, reason
        assert 4.0 < took < 9.0, took
        s.close()


# ---------------------------------------------------------------------------
# Chunk attacks: a member that sends a corrupt chunk header (the test hook, in a
# subprocess), the receiver stays alive and names it.

PEER = textwrap.dedent("""
    import json, os, sys, time, pathlib
    import numpy as np
    from fthsdp.collective import ftar
    spec = json.loads(sys.argv[1])
    comm = ftar.Communicator(timeout_s=10.0, key=bytes.fromhex(spec["key"]), streams=1, chunk_bytes=4096)
    pathlib.Path(spec["addr_file"]).write_text(comm.address)
    while not os.path.exists(spec["peer_file"]):
        time.sleep(0.02)
    peer = pathlib.Path(spec["peer_file"]).read_text()
    for q in (1, 2):
        comm.configure("job", q, 0, [comm.address, peer], timeout_s=10)
        status, reason = comm.allreduce_host(np.ones(10000, np.float32), quorum_id=q, rank=0, n=2)
        print(json.dumps({"q": q, "status": status, "reason": reason}), flush=True)
    comm.close()
""")


@pytest.mark.parametrize("secure", [True, False], ids=["authenticated", "insecure"])
def test_corrupt_chunk_is_recoverable_and_names_the_peer(tmp_path, secure):
    key = KEY if secure else b""
    b = ftar.Communicator(timeout_s=10.0, key=key, streams=1, chunk_bytes=4096)
    with b:
        spec = {"key": key.hex(), "addr_file": str(tmp_path / "a"), "peer_file": str(tmp_path / "b")}
        env = {**os.environ, "FTHSDP_FTAR_TEST_CORRUPT_CHUNK": "2", "JAX_PLATFORMS": "cpu"}
        proc = subprocess.Popen([sys.executable, "-c", PEER, json.dumps(spec)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 60
            while not (tmp_path / "a").exists():
                assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.02)
            a_addr = (tmp_path / "a").read_text()
            (tmp_path / "b").write_text(b.address)
            b.configure("job", 1, 1, [a_addr, b.address], timeout_s=10)
            status, reason = b.allreduce_host(np.ones(10000, np.float32), quorum_id=1, rank=1, n=2)
            assert status == ftar.STATUS_RECOVERABLE, reason
            assert f"protocol violation from left neighbour {a_addr} (rank 0 of quorum 1)" in reason, reason
            want = "unauthenticated chunk header" if secure else "bad chunk magic"
            assert want in reason, reason
            violations = b.take_violations()
            assert [(v.rank, v.address, v.quorum_id) for v in violations] == [(0, a_addr, 1)], violations
            assert b.take_violations() == []
            # Alive, and the next quorum's ring (the hook fired once) sums correctly.
            b.configure("job", 2, 1, [a_addr, b.address], timeout_s=10)
            x = np.ones(10000, np.float32)
            status, reason = b.allreduce_host(x, quorum_id=2, rank=1, n=2)
            assert status == ftar.STATUS_OK, reason
            np.testing.assert_array_equal(x, 2.0)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
        assert [l["status"] for l in lines] == [ftar.STATUS_RECOVERABLE, ftar.STATUS_OK], out


# ---------------------------------------------------------------------------
# From the violation to the quorum: accusations (pure) and the lighthouse leaving the accused out.

from fthsdp.control import quorum as qm  # noqa: E402


def _quorum(qid: int, ids: tuple[str, ...]) -> qm.Quorum:
    members = tuple(qm.Member(r, 3, (f"127.0.0.1:{20000 + int(r)}",)) for r in ids)
    return qm.Quorum(qid, members, 3, ids, ())


def test_admit_accusation_rules():
    q = _quorum(5, ("0", "1", "2"))
    ok, why = qm.admit_accusation(qm.Accusation("0", "2", 5), q, set(), {})
    assert ok and "2 is left out of the next quorum" in why
    refusals = [
        (qm.Accusation("0", "2", 4), set(), {}, "names quorum 4, the job's latest is 5"),
        (qm.Accusation("0", "7", 5), set(), {}, "both be members"),
        (qm.Accusation("9", "1", 5), set(), {}, "both be members"),
        (qm.Accusation("1", "1", 5), set(), {}, "cannot accuse itself"),
        (qm.Accusation("0", "2", 5), {"0"}, {}, "accuser 0 is itself excluded"),
        (qm.Accusation("1", "2", 5), {"2"}, {}, "already excluded"),
        (qm.Accusation("0", "2", 5), set(), {"0": 1}, "at most one per 10 quorums"),
    ]
    for acc, excluded, last, want in refusals:
        ok, why = qm.admit_accusation(acc, q, excluded, last)
        assert not ok and want in why, (acc, why)
    assert qm.admit_accusation(qm.Accusation("1", "2", 5), None, set(), {})[0] is False
    # The cooldown ends: one admitted accusation per ACCUSATION_COOLDOWN_QUORUMS quorum ids.
    later = _quorum(5 + qm.ACCUSATION_COOLDOWN_QUORUMS, ("0", "1", "2"))
    assert qm.admit_accusation(qm.Accusation("0", "2", later.quorum_id), later, set(), {"0": 5})[0]


def test_decide_quorum_leaves_the_excluded_out_entirely():
    cfg = qm.QuorumConfig(min_replicas=1, join_timeout_s=1.0, heartbeat_window_s=1.0)
    prev = _quorum(5, ("0", "1", "2"))
    requests = {r: qm.QuorumRequest(r, 3, 0.0, (f"127.0.0.1:{20000 + int(r)}",), commit_failed=True)
                for r in ("0", "1", "2")}
    beats = {r: 0.0 for r in ("0", "1", "2")}
    q, reason = qm.decide_quorum(requests, beats, prev, cfg, 0.01, excluded={"2"})
    assert q is not None and q.member_ids == ("0", "1") and q.quorum_id == 6, reason
    assert "excluded [2]" in reason and q.left_out == ()
    # An excluded incumbent that is not asking is not waited for either, and in a job of two
    # the survivor is not stopped by the split-brain guard (the excluded one is not a rival).
    q, reason = qm.decide_quorum({"0": requests["0"]}, {"0": 0.0, "1": 0.0}, _quorum(5, ("0", "1")), cfg, 0.01,
                                 excluded={"1"})
    assert q is not None and q.member_ids == ("0",), reason
    # Without the exclusion the same inputs wait for the incumbent (the rule it bypasses).
    q, reason = qm.decide_quorum({"0": requests["0"]}, {"0": 0.0, "1": 0.0}, _quorum(5, ("0", "1")), cfg, 0.01)
    assert q is None and "not asking yet" in reason


def test_an_exclusion_that_leaves_too_few_for_any_quorum_is_lifted():
    """An exclusion holds until a quorum forms; if the replicas left are too few for one (a job
    of two with min_replicas=2, or the accuser died and only the accused asks), no quorum would
    ever form and the job would wait for ever: the exclusion is lifted, and the reason says so."""
    prev = _quorum(5, ("0", "1"))
    requests = {r: qm.QuorumRequest(r, 3, 0.0, (f"127.0.0.1:{20000 + int(r)}",), commit_failed=True)
                for r in ("0", "1")}
    beats = {"0": 0.0, "1": 0.0}
    two = qm.QuorumConfig(min_replicas=2, join_timeout_s=1.0, heartbeat_window_s=1.0)
    q, reason = qm.decide_quorum(requests, beats, prev, two, 0.01, excluded={"1"})
    assert q is not None and q.member_ids == ("0", "1"), reason
    assert "exclusion of [1] lifted: without them waiting for replicas: 1 live requesting, min_replicas=2" in reason
    one = qm.QuorumConfig(min_replicas=1, join_timeout_s=1.0, heartbeat_window_s=1.0)
    # the accuser 0 died (silent past the window): only the accused asks
    q, reason = qm.decide_quorum({"1": requests["1"]}, {"0": -5.0, "1": 0.0}, prev, one, 0.01, excluded={"1"})
    assert q is not None and q.member_ids == ("1",) and "exclusion of [1] lifted" in reason, reason
    # enough without the accused: the exclusion holds
    q, reason = qm.decide_quorum(requests, beats, prev, one, 0.01, excluded={"1"})
    assert q is not None and q.member_ids == ("0",) and "lifted" not in reason, reason


def test_lighthouse_leaves_an_accused_replica_out_of_the_next_quorum_only():
    from concurrent.futures import ThreadPoolExecutor

    from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
    from fthsdp.control.lighthouse_client import LighthouseClient

    def ask(c, step, **kw):
        return c.get_quorum(step, ftar_addresses=[f"127.0.0.1:{20000 + int(c.replica_id)}"], timeout_s=20, **kw)

    with LighthouseThread(LighthouseConfig(join_timeout_s=0.3, detect_s=1.0)) as lh:
        clients = [LighthouseClient(lh.address, "job", str(i)) for i in range(3)]
        try:
            for c in clients:
                c.start_heartbeats()
            time.sleep(0.2)
            with ThreadPoolExecutor(3) as ex:
                first = [f.result() for f in [ex.submit(ask, c, 0) for c in clients]]
                assert {q.member_ids for q in first} == {("0", "1", "2")}
                qid = first[0].quorum_id
                # Replica 0 caught replica 2 corrupting a chunk; everyone retries step 0.
                accused = ex.submit(ask, clients[2], 0, commit_failed=True)
                time.sleep(0.1)
                f1 = ex.submit(ask, clients[1], 0, commit_failed=True)
                q0 = ask(clients[0], 0, commit_failed=True, accused=["2"])
                q1 = f1.result()
                assert q0.member_ids == q1.member_ids == ("0", "1") and q0.quorum_id > qid, q0
                assert "excluded [2]" in q0.reason
                assert not accused.done()  # its request waits: it is left out of this quorum
                # The survivors commit step 0 and ask for step 1: the accused rejoins, behind.
                f1 = ex.submit(ask, clients[1], 1)
                q0 = ask(clients[0], 1)
                q2 = accused.result(timeout=20)
                assert q0.member_ids == q2.member_ids == ("0", "1", "2"), q0
                assert q2.behind == ("2",) and q2.max_step == 1
                f1.result()
                # A repeated accusation by the same accuser within the cooldown is ignored.
                qa = ex.submit(ask, clients[2], 1, commit_failed=True)
                f1 = ex.submit(ask, clients[1], 1, commit_failed=True)
                q0 = ask(clients[0], 1, commit_failed=True, accused=["2"])
                assert q0.member_ids == ("0", "1", "2") and "excluded" not in q0.reason, q0
                qa.result(timeout=20)
                f1.result()
        finally:
            for c in clients:
                c.close()


@pytest.mark.multiprocess
def test_job_with_a_misbehaving_replica_leaves_it_out_and_ends_identical(tmp_path, monkeypatch):
    """A real `fthsdp run`-style job of 3 replicas (authenticated rings: the launcher's per-job
    secret): replica 1's process corrupts one chunk header it sends (the test hook). Its right
    neighbour's all-reduce returns RECOVERABLE naming it, the Manager accuses it, the lighthouse
    leaves it out of the next quorum, the others commit, replica 1 rejoins behind and fetches
    their state; every replica ends with identical bytes and every batch counted exactly once."""
    from fthsdp.data.ledger import check_exactly_once
    from fthsdp.launch import report
    from fthsdp.launch.faults import plan
    from fthsdp.launch.local import LocalJob

    sys.path.insert(0, str(REPO / "tests"))
    from test_fault_tolerance import TINY, assert_identical_after_every_commit

    monkeypatch.setenv(ftar.CORRUPT_CHUNK_ENV, "5")
    monkeypatch.setenv(ftar.CORRUPT_REPLICA_ENV, "1")
    steps = 12
    overrides = TINY + ["launch.replicas=3", "launch.devices_per_replica=1", f"train.steps={steps}",
                        "ft.streams_per_peer=1"]
    job = LocalJob(config="base", overrides=overrides, out_dir=tmp_path, replicas=3, steps=steps,
                   faults=plan((), (), 3), restart=False, detect_s=0.8, join_timeout_s=0.5, deadline_s=240,
                   progress=False)
    s = job.run()
    run = report.load_run(tmp_path)
    assert s["failed_replicas"] == [] and sorted(run.done) == ["0", "1", "2"], s
    assert all(d["step"] == steps for d in run.done.values())
    assert s["identical_final_state"], s["final_hashes"]
    assert_identical_after_every_commit(run)
    # Replica 2 (replica 1's right neighbour) named and blamed it.
    events = " ".join(e for r in run.steps["2"] for e in r["events"])
    assert "protocol violation from left neighbour" in events and "blamed replica 1" in events, events
    # The next quorum left replica 1 out; a later one took it back, behind (it fetched the state).
    members = [q["members"] for q in s["quorum_changes"]]
    assert ["0", "2"] in members, members
    assert members[-1] == ["0", "1", "2"], members
    catch_up = [r for r in run.steps["1"] if not r["healthy"]]
    assert len(catch_up) == 1 and any("caught up" in e for e in catch_up[0]["events"]), run.steps["1"]
    lighthouse_log = (tmp_path / "lighthouse.log").read_text()
    assert "is left out of the next quorum" in lighthouse_log
    (positions,) = {tuple(d["positions"]) for d in run.done.values()}
    rep = check_exactly_once(sorted((tmp_path / "ledger").glob("*.jsonl")), dict(enumerate(positions)))
    assert rep.ok, rep.summary()
