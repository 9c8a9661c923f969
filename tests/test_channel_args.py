"""The control plane's channels give a slow server time to connect and find a restarted one quickly
(fthsdp.control.channel_args), with a real lighthouse behind a real TCP proxy."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from fthsdp.control.channel_args import CONNECT_TIMEOUT_S, RECONNECT_ARGS
from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import LighthouseClient, LighthouseError
from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as load_stubs

pb2, pb2_grpc = load_stubs()


class SlowProxy:
    """A TCP proxy to ``upstream_port`` whose accept queue is full for its first ``delay_s``: a
    server process too busy to take new connections, as a relay was when 256 leaders connected
    at once. The kernel drops a SYN to a full queue and the client's TCP sends it again after
    about a second, so a connection attempt takes that long."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port, self.delay_s = upstream_port, delay_s
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)  # room for one connection not yet accepted
        self.port = self.sock.getsockname()[1]
        self._filler = socket.create_connection(("127.0.0.1", self.port))  # takes that room
        self.accepted = 0
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        time.sleep(self.delay_s)
        try:
            self.sock.accept()[0].close()  # the filler
        except OSError:
            return  # closed while still full
        finally:
            self._filler.close()
        while not self._closed:
            try:
                down, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(down,), daemon=True).start()

    def _serve(self, down: socket.socket) -> None:
        try:
            up = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        except OSError:
            down.close()
            return
        self._conns += [down, up]
        for a, b in ((down, up), (up, down)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        for s in self._conns:
            s.close()


def _status(address: str, options) -> None:
    """A Status call through a fresh channel with ``options`` (no wait for ready, as the clients call)."""
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1), *options]) as ch:
        call = ch.unary_unary("/fthsdp.v1.Lighthouse/Status", request_serializer=pb2.StatusRequest.SerializeToString,
                              response_deserializer=pb2.StatusResponse.FromString)
        call(pb2.StatusRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION), timeout=4.0)


OLD_ARGS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500)]  # what the clients had: a 100 ms connect limit


def test_a_server_slow_to_take_connections_is_connected_to_not_refused_after_100_ms():
    with LighthouseThread(LighthouseConfig()) as lh:
        port = int(lh.address.rsplit(":", 1)[1])
        proxies: list[SlowProxy] = []

        def slow() -> str:  # a fresh proxy, its queue full from now on for 0.3 s
            proxies.append(SlowProxy(port, delay_s=0.3))
            return f"127.0.0.1:{proxies[-1].port}"

        try:
            # The replicas' own client, through the slow server: answered on its first connection.
            client = LighthouseClient(slow(), "job", 0, rpc_timeout_s=4.0)
            try:
                assert client.status("") == []
            finally:
                client.close()
            assert proxies[0].accepted == 1
            _status(slow(), RECONNECT_ARGS)
            # With the 100 ms limit gRPC abandons the attempt ("tcp handshaker shutdown") and the
            # call fails at once, as 76 of 512 emulated leaders' first requests did behind one relay.
            # (A deadline or an answer instead would mean the old limit was not what failed them.)
            with pytest.raises(grpc.RpcError) as e:
                _status(slow(), OLD_ARGS)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE, e.value
        finally:
            for p in proxies:
                p.close()


def test_a_restarted_lighthouse_is_found_within_the_backoff_not_the_connect_limit():
    """A server killed and restarted on its port: refused connections fail at once, so a client
    finds it again within the backoff (0.5 s at most), not after CONNECT_TIMEOUT_S."""
    lh = LighthouseThread(LighthouseConfig())
    lh.start()
    port = int(lh.address.rsplit(":", 1)[1])
    client = LighthouseClient(lh.address, "job", 0, rpc_timeout_s=1.0)
    try:
        assert client.status("") == []
        lh.stop()
        with pytest.raises(LighthouseError):
            client.status("")  # refused: the channel backs off
        time.sleep(1.0)  # several refused attempts: the backoff at its 0.5 s cap
        lh = LighthouseThread(LighthouseConfig(bind=f"127.0.0.1:{port}"))
        lh.start()
        t0 = time.monotonic()
        deadline = t0 + CONNECT_TIMEOUT_S
        while True:
            try:
                client.status("")
                break
            except LighthouseError:
                assert time.monotonic() < deadline, "the restarted lighthouse was not found again"
                time.sleep(0.02)
        assert time.monotonic() - t0 < 2.0, f"found again after {time.monotonic() - t0:.2f} s"
    finally:
        client.close()
        lh.stop()
