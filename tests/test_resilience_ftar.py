"""A malformed FTAR chunk is not fatal (issue 10, item 5), end to end.

The test plays replica 1 of a two-replica job by hand: it heartbeats and asks
the (real) lighthouse for quorums like a replica, and speaks FTAR's wire
protocol (ffi/transport/tcp.h, version 2) on real loopback sockets to a real
replica process: it accepts the replica's connection, completes the
challenge-response handshakes with the job's key (it is a member of the job
that misbehaves, not a stranger), then sends a chunk header with a bad magic
(correctly tagged) into the replica's all-reduce and goes silent. The
replica's all-reduce must return RECOVERABLE naming rank 1, the Manager blame
replica 1, retry the step on a new quorum (alone, once the lighthouse
declares the impostor dead) and finish the job with exit code 0.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pathlib
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from fthsdp.collective import ftar
from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import LighthouseClient

from test_fault_tolerance import TINY

pytestmark = pytest.mark.multiprocess

REPO = pathlib.Path(__file__).resolve().parents[1]
# magic, version, quorum_id, rank, n, stream, streams, job_id, auth, nonce
HELLO = struct.Struct("<IIqiiii64sI16s")
REPLY = struct.Struct("<I192s16s32s")  # ok, reason, nonce, mac
PROOF = struct.Struct("<I32s")  # magic, mac
CHUNK = struct.Struct("<IIQqQ16s")  # magic, lane, op_seq, index, bytes, tag
TAGGED = struct.Struct("<QIIQqQ")  # what a chunk tag covers: seq, magic, lane, op_seq, index, bytes
HELLO_MAGIC, CHUNK_MAGIC, PROOF_MAGIC, VERSION = 0x46544152, 0x4348554E, 0x50524F46, 2
LABEL_RECEIVER, LABEL_SENDER = b"fthsdp ftar v2 receiver proof\0", b"fthsdp ftar v2 sender proof\0"
LABEL_CHUNKS = b"fthsdp ftar v2 chunk key\0"
STEPS = 4
JOB = "ftar-impostor"
SECRET = "impostor-test-job-secret"
KEY = ftar.key_from_secret(SECRET)


def mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += part
    return buf


class Impostor:
    """Replica 1 on the lighthouse and on the FTAR ring; sends one malformed chunk."""

    def __init__(self, lighthouse: str):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(60)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.client = LighthouseClient(lighthouse, JOB, "1")
        self.socks: list[socket.socket] = []
        self.outbound: list[socket.socket] = []  # ours to the replica: it reads chunks from these
        self.accepted: list[tuple] = []
        self.chunk_keys: list[bytes] = []  # per outbound stream

    def accept_streams(self, streams: int) -> None:
        """The real replica's right-neighbour streams: read each Hello, accept it."""
        for _ in range(streams):
            conn, _ = self.listener.accept()
            conn.settimeout(60)
            self.socks.append(conn)
            raw = recv_exact(conn, HELLO.size)
            hello = HELLO.unpack(raw)
            nonce_r = os.urandom(16)
            conn.sendall(REPLY.pack(2, b"", nonce_r, mac(KEY, LABEL_RECEIVER, raw, nonce_r)))
            magic, proof = PROOF.unpack(recv_exact(conn, PROOF.size))
            assert magic == PROOF_MAGIC and hmac.compare_digest(proof, mac(KEY, LABEL_SENDER, raw, nonce_r))
            self.accepted.append(hello)
            conn.sendall(REPLY.pack(1, b"", bytes(16), bytes(32)))

    def run(self, streams: int) -> int:
        self.client.start_heartbeats()
        t = threading.Thread(target=self.accept_streams, args=(streams,), daemon=True)
        t.start()
        deadline = time.monotonic() + 240  # the real replica compiles, then heartbeats
        while not any(r.replica_id == "0" and not r.dead for j in self._status() for r in j.replicas):
            assert time.monotonic() < deadline, "the replica never checked in with the lighthouse"
            time.sleep(0.1)
        q = self.client.get_quorum(0, ftar_addresses=[self.address], num_replicas=2, timeout_s=240)
        assert q.member_ids == ("0", "1"), q
        host, port = q.ring_addresses("1")[q.rank_of("0")][0].rsplit(":", 1)
        rank, n = q.rank_of("1"), q.num_members
        for stream in range(streams):  # connect to the replica as its left neighbour
            s = socket.create_connection((host, int(port)), timeout=60)
            self.socks.append(s)
            self.outbound.append(s)
            raw = HELLO.pack(HELLO_MAGIC, VERSION, q.quorum_id, rank, n, stream, streams, JOB.encode(), 1,
                             os.urandom(16))
            s.sendall(raw)
            ok, reason, nonce_r, their = REPLY.unpack(recv_exact(s, REPLY.size))
            assert ok == 2, reason.rstrip(b"\0")
            assert hmac.compare_digest(their, mac(KEY, LABEL_RECEIVER, raw, nonce_r))  # the replica holds the key
            s.sendall(PROOF.pack(PROOF_MAGIC, mac(KEY, LABEL_SENDER, raw, nonce_r)))
            ok, reason, _, _ = REPLY.unpack(recv_exact(s, REPLY.size))
            assert ok == 1, reason.rstrip(b"\0")
            self.chunk_keys.append(mac(KEY, LABEL_CHUNKS, raw, nonce_r))
        t.join(60)
        # The malformed chunk: wrong magic (correctly tagged: a member with the key misbehaves), on
        # stream 0, for the replica's first all-reduce.
        fields = (0xBADC0DE, 0, 0, 0, 64)
        tag = hmac.new(self.chunk_keys[0], TAGGED.pack(0, *fields), hashlib.sha256).digest()[:16]
        self.outbound[0].sendall(CHUNK.pack(*fields, tag) + b"\xff" * 64)
        self.client.stop_heartbeats()  # then vanish: the lighthouse declares replica 1 dead
        return q.quorum_id

    def _status(self):
        try:
            return self.client.status()
        except LookupError:
            return []

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.listener.close()
        self.client.close()


def test_malformed_ftar_chunk_is_retried_on_a_new_quorum(tmp_path):
    streams = 1
    with LighthouseThread(LighthouseConfig(detect_s=0.8, join_timeout_s=0.5)) as lh:
        env = dict(os.environ, PYTHONUNBUFFERED="1", FTHSDP_PEER_TOKEN=SECRET)
        cmd = [sys.executable, "-m", "fthsdp.replica.process", "--config", "base", "--replica-id", "0",
               "--lighthouse", lh.address, "--job", JOB, "--out-dir", str(tmp_path),
               *TINY, "launch.replicas=2", "launch.devices_per_replica=1", f"train.steps={STEPS}",
               f"ft.streams_per_peer={streams}", "ft.startup_timeout_s=200"]
        out = open(tmp_path / "replica-0.out", "w")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        impostor = Impostor(lh.address)
        try:
            qid = impostor.run(streams)
            rc = proc.wait(240)
        finally:
            impostor.close()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log = (tmp_path / "replica-0.out").read_text()
        assert rc == 0, log[-4000:]
    # The impostor's handshakes were real: the replica connected to it for the quorum it joined.
    assert impostor.accepted and impostor.accepted[0][0] == HELLO_MAGIC and impostor.accepted[0][2] == qid
    recs = [json.loads(line) for line in (tmp_path / "metrics-0.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    first = steps[0]
    assert first["step"] == 0 and first["attempts"] >= 2, first
    failed = " ".join(first["events"])
    assert "bad chunk magic" in failed and "blamed replica 1" in failed, first["events"]
    assert first["members"] == ["0"] and first["quorum_id"] > qid  # retried alone, on a new quorum
    assert [r["step"] for r in steps] == list(range(STEPS))
    (done,) = [r for r in recs if r["kind"] == "done"]
    assert done["step"] == STEPS
    assert "recoverable fault (blamed replica 1)" in log
