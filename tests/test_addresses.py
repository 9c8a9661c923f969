"""Every listener binds a configurable address and advertises another (issue 11, item 6).

Pure parsing first (fthsdp.addresses and its C++ twin in ffi/transport/wire.cc),
then real sockets: an FTAR ring over IPv6 loopback and between two emulated
hosts (127.0.0.2 / 127.0.0.3, one bound to every interface and advertising its
own), the peer state server on ::1, and two real jobs through `fthsdp run`:
one where each replica is its own emulated host and the lighthouse a third
(every listening socket of every process is inspected while the job runs, so
a listener left on 127.0.0.1 fails the test), and one over IPv6 loopback with
an external lighthouse.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fthsdp import addresses as A


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")


# -- pure ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,host,port", [
    ("127.0.0.1:80", "127.0.0.1", 80), ("[::1]:0", "::1", 0), ("[fe80::1%eth0]:5", "fe80::1%eth0", 5),
    ("localhost:65535", "localhost", 65535), ("node-7.cluster.local:29510", "node-7.cluster.local", 29510),
])
def test_split_and_join_round_trip(text, host, port):
    assert A.split_host_port(text) == (host, port)
    assert A.join_host_port(host, port) == text


@pytest.mark.parametrize("text,why", [
    ("::1:5", "IPv6 literal in brackets"), ("[127.0.0.1]:5", "only IPv6 literals go in brackets"),
    ("[::1]5", r"not \[IPV6\]:PORT"), ("host", "not HOST:PORT"), (":80", "not HOST:PORT"),
    ("h:65536", "bad port"), ("h:-1", "bad port"), ("h:", "bad port"), ("", "empty"), ("a b:1", "spaces"),
    ("bad_host!:1", "neither an IP literal nor a DNS name"), ("[:::]:1", "not a valid IPv6 literal"),
])
def test_bad_addresses_are_refused_saying_why(text, why):
    with pytest.raises(ValueError, match=why):
        A.split_host_port(text)


def test_advertised_address_replaces_the_host_and_a_bare_wildcard_is_refused():
    assert A.advertised("0.0.0.0:4242", "10.1.2.3") == "10.1.2.3:4242"
    assert A.advertised("[::]:4242", "fd00::7") == "[fd00::7]:4242"
    assert A.advertised("127.0.0.2:9", "") == "127.0.0.2:9"
    for wild in ("0.0.0.0:1", "[::]:1"):
        with pytest.raises(ValueError, match="needs an advertise host"):
            A.advertised(wild)
    with pytest.raises(ValueError, match="port 0 cannot be connected to"):
        A.split_host_port("127.0.0.1:0", allow_zero_port=False)


def test_config_rules_for_addresses():
    from fthsdp import config as config_lib

    cfg = config_lib.load("base", ["ft.bind_host=::1", "launch.lighthouse=[::1]:29510", "launch.hosts=127.0.0.2,h3",
                                   "launch.lighthouse_bind=[::1]:0"])
    assert (cfg.ft.bind_host, cfg.launch.lighthouse, cfg.launch.hosts) == ("::1", "[::1]:29510", ("127.0.0.2", "h3"))
    for bad, msg in [(["ft.bind_host=0.0.0.0"], "set ft.advertise_host"),
                     (["launch.lighthouse_bind=0.0.0.0:0"], "set launch.lighthouse_advertise"),
                     (["launch.hosts=127.0.0.2,0.0.0.0"], "cannot be advertised"),
                     (["launch.lighthouse=::1:29510"], "in brackets"),
                     (["ft.advertise_host=a b"], "spaces")]:
        with pytest.raises(config_lib.ConfigError, match=msg):
            config_lib.load("base", bad)
    assert config_lib.load("base", ["ft.bind_host=0.0.0.0", "ft.advertise_host=10.0.0.5"]).ft.advertise_host


# -- real sockets ----------------------------------------------------------------------------------


def _ring(comms, quorum_id: int = 1) -> list[np.ndarray]:
    """All-reduce (host path) over `comms` in one ring; returns each member's result."""
    members = [c.address for c in comms]
    out: list = [None] * len(comms)

    def run(i, c):
        ok = c.configure("addr-test", quorum_id, i, members, timeout_s=20)
        assert ok, ok.reason
        x = np.full(4096, float(i + 1), np.float32)
        status, reason = c.allreduce_host(x, quorum_id=quorum_id, rank=i, n=len(comms))
        assert status == 0, reason
        out[i] = x

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(comms)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@needs_ipv6
def test_ftar_ring_over_ipv6_loopback():
    from fthsdp.collective import ftar

    comms = [ftar.Communicator(1, listen_host="::1", timeout_s=20) for _ in range(3)]
    try:
        assert all(c.address.startswith("[::1]:") for c in comms), [c.address for c in comms]
        for x in _ring(comms):
            assert np.all(x == 6.0)
    finally:
        for c in comms:
            c.close()


def test_ftar_ring_between_emulated_hosts_with_a_wildcard_bind_advertising_its_own_host():
    from fthsdp.collective import ftar

    a = ftar.Communicator(2, listen_host="127.0.0.2", timeout_s=20)
    b = ftar.Communicator(2, listen_host="0.0.0.0", advertise_host="127.0.0.3", timeout_s=20)
    try:
        assert all(x.startswith("127.0.0.2:") for x in a.addresses), a.addresses
        assert all(x.startswith("127.0.0.3:") for x in b.addresses), b.addresses
        for x in _ring([a, b]):
            assert np.all(x == 3.0)
        with pytest.raises(Exception, match=r"write IPv6 literals as \[addr\]:port"):
            a.configure("addr-test", 2, 0, [a.address, "::1:5,::1:6"], timeout_s=1)
    finally:
        a.close()
        b.close()
    with pytest.raises(ValueError, match="set advertise_host"):
        ftar.FtarOptions(listen_host="::")


@needs_ipv6
def test_peer_server_serves_on_ipv6_and_advertises_what_it_is_told():
    from fthsdp.checkpoint.peer_server import PeerServer
    from fthsdp.checkpoint.snapshot import Snapshotter

    with PeerServer(Snapshotter(), "tok", host="::1") as server:
        assert server.url.startswith("http://[::1]:")
        port = int(server.url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("::1", port, timeout=10)
        from fthsdp.checkpoint.peer_auth import sign

        authority = f"[::1]:{port}"
        conn.request("GET", "/v1/manifest",
                     headers={"Host": authority, "Authorization": sign(b"tok", "GET", authority, "/v1/manifest")})
        assert conn.getresponse().status == 503  # no snapshot yet: an answer, not a hang
        conn.close()
    with PeerServer(Snapshotter(), "tok", host="0.0.0.0", advertise_host="127.0.0.9") as server:
        assert server.url.startswith("http://127.0.0.9:")
    with pytest.raises(ValueError, match="needs an advertise_host"):
        PeerServer(Snapshotter(), "tok", host="0.0.0.0")


# -- real jobs ---------------------------------------------------------------------------------------


def _listening(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket process `pid` listens on (from /proc)."""
    inodes = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            rows = pathlib.Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A = LISTEN
                continue
            hex_ip, hex_port = f[1].split(":")
            raw = bytes.fromhex(hex_ip)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
            found.add((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16",
        "data.seq_len=16", "data.batch_size=8", "data.corpus_bytes=65536", "train.eval_every=0",
        "ft.allreduce_timeout_s=6", "ft.max_retries=4", "train.min_step_s=0.15"]


def _run_and_watch(out: pathlib.Path, args: list[str], replicas: int, timeout_s: float = 300):
    """`fthsdp run` in a subprocess; while it runs, every replica process's listening sockets.
    Returns (returncode, {replica: set of (ip, port)}, stderr)."""
    cmd = [sys.executable, "-m", "fthsdp.cli", "run", "--no-progress", "--out-dir", str(out), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: dict[int, set] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            for r in range(replicas):
                try:
                    st = json.loads((out / f"status-{r}.json").read_text())
                    if st.get("step", 0) >= 2 and r not in seen:
                        seen[r] = _listening(int(st["pid"]))
                except (OSError, ValueError, KeyError):
                    pass
            time.sleep(0.1)
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    return proc.returncode, seen, err


@pytest.mark.multiprocess
def test_a_job_whose_replicas_are_emulated_hosts_binds_every_listener_to_its_host(tmp_path):
    from fthsdp.launch import report
    from test_fault_tolerance import assert_identical_after_every_commit

    out = tmp_path / "run"
    hosts = ("127.0.0.2", "127.0.0.3")
    rc, seen, err = _run_and_watch(out, ["--config", "base", "--replicas", "2", "--devices-per-replica", "1",
                                         "--hosts", ",".join(hosts), "--lighthouse-bind", "127.0.0.4:0",
                                         *TINY, "train.steps=25"], replicas=2)
    assert rc == 0, err[-3000:]
    assert set(seen) == {0, 1}, f"never saw both replicas running: {seen}"
    for r, socks in seen.items():
        # FTAR endpoint, peer state server, metrics: at least 3 listeners, all on the replica's host
        assert len(socks) >= 3, (r, socks)
        assert {ip for ip, _ in socks} == {hosts[r]}, f"replica {r} listens outside its host {hosts[r]}: {socks}"
    lh = [e for e in (json.loads(x) for x in (out / "events.jsonl").read_text().splitlines())
          if e["kind"] == "lighthouse"]
    assert lh and all(e["address"].startswith("127.0.0.4:") for e in lh), lh
    run = report.load_run(out)
    assert assert_identical_after_every_commit(run) >= 20
    # what each replica told the others: its own host, nothing else
    log_text = "".join((out / f"replica-{r}.out").read_text() for r in range(2))
    assert "127.0.0.1:" not in log_text, "a replica advertised or used an address on 127.0.0.1"


@needs_ipv6
@pytest.mark.multiprocess
def test_a_job_over_ipv6_loopback_with_an_external_lighthouse(tmp_path):
    from fthsdp.launch import report
    from test_fault_tolerance import assert_identical_after_every_commit

    from test_resilience_lighthouse import lighthouse_process

    lh, port = lighthouse_process(["--bind", "[::1]:0", "--insecure", "--replicas", "2", "--detect", "0.8",
                                   "--join-timeout", "0.5"], tmp_path / "lh.port")
    try:
        address = f"[::1]:{port}"
        out = tmp_path / "run"
        rc, seen, err = _run_and_watch(out, ["--config", "base", "--replicas", "2", "--devices-per-replica", "1",
                                             "--lighthouse", address, "--bind-host", "::1", *TINY,
                                             "train.steps=20"], replicas=2)
        assert rc == 0, err[-3000:]
        assert lh.poll() is None, "the launcher must leave an external lighthouse alone"
        assert set(seen) == {0, 1}, f"never saw both replicas running: {seen}"
        for r, socks in seen.items():
            assert socks and {ip for ip, _ in socks} == {"::1"}, (r, socks)
        events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
        assert [e["address"] for e in events if e["kind"] == "lighthouse"] == [address]
        assert assert_identical_after_every_commit(report.load_run(out)) >= 15
        # every advertised address was accepted (the metrics address once went out unbracketed,
        # every heartbeat was refused and the job started only after the start-up barrier gave up)
        for r in (0, 1):
            log = (out / f"replica-{r}.log").read_text()
            assert "heartbeat rejected" not in log and "starting without the rest" not in log, log[-3000:]
    finally:
        lh.kill()
        lh.wait(30)


_ADDRESS_CHARS = "0123456789abcXYZ-_.:[]% \t\u0661\u00e9"


@settings(max_examples=3000, deadline=None)
@given(st.one_of(
    st.text(alphabet=_ADDRESS_CHARS, max_size=24),
    st.builds(lambda h, p: f"{h}:{p}", st.text(alphabet="0123456789abc-_.", min_size=1, max_size=300),
              st.text(alphabet="0123456789", min_size=1, max_size=6)),
    st.builds(lambda a, b, c, d, p: f"{a}.{b}.{c}.{d}:{p}", *[st.integers(0, 300)] * 4, st.integers(0, 70000))),
    st.booleans())
def test_the_plain_fast_path_answers_as_the_full_parse(text, zero_ok):
    """Whatever the one-match fast path accepts, the full parse accepts with the same host and
    port; whatever it leaves, the full parse decides (with its words)."""
    try:
        want = A._split_host_port(text, zero_ok)
    except ValueError as e:
        want = ValueError(str(e))
    try:
        got = A.split_host_port(text, allow_zero_port=zero_ok)
    except ValueError as e:
        got = ValueError(str(e))
    if isinstance(want, ValueError):
        assert isinstance(got, ValueError) and str(got) == str(want), (text, got, want)
    else:
        assert got == want, (text, got, want)
