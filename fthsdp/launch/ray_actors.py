"""The processes of a Ray launch: the lighthouse, its relays and one replica process, as Ray actors.

These classes run inside Ray worker processes, so this module imports
nothing heavy at the top: jax must not be imported before the replica's
entry point has set the host-device count (fthsdp.replica.process.main does that).

A replica actor *is* the replica process: its `run` method calls the same
entry point as `python -m fthsdp.replica.process` (fthsdp.replica.process.main) with the same
flags, in the actor's own worker process. Only the process management
differs from the local launcher. Everything the launcher hands it (replica
id, lighthouse address, the job's peer secret, the config file's text, the
replica's ledger and loader position so far) comes as call arguments through
Ray; nothing is read from a file system that the driver and the actor share.
The replica writes its records into a node-local work directory, and the
driver collects them through `poll` (new complete lines, the latest status).
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import threading
import time

from fthsdp.control.admission import FairnessLimits
from fthsdp.control.pacing import DEFAULT_BEATS_PER_S

# Files a replica appends to, relative to its work directory ({rid} filled in):
# streamed to the driver line by line, in order.
APPENDED = ("metrics-{rid}.jsonl", "replica-{rid}.log", "ledger/replica_{rid}.jsonl")
# Files a replica rewrites whole: the driver gets their latest content.
REWRITTEN = ("status-{rid}.json", "loader_state/replica_{rid}.json")
# Where the driver writes a process's relay when it places it elsewhere (ft.lighthouse_relay_file).
RELAY_FILE = "relay"
NOT_SHARED = "checkpoint directory not shared"  # (the launcher reads it as job-fatal)


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class _ServerActor:
    """A server of ours (a :class:`fthsdp.control.server_thread.ServerThread`, started here) in a
    Ray actor: ``serve`` stays pending while it serves, so the driver's call tells it whether the
    actor is alive (pending) or dead (an error)."""

    def __init__(self, thread, standby: bool = False) -> None:
        self.thread = thread
        self._stop = threading.Event()
        if not standby:
            thread.start()

    def start(self) -> str:
        """A standby's (a warm spare: its process and imports ready, not bound): bind and serve now;
        its address."""
        return self.thread.start()

    def address(self) -> str:
        return self.thread.address

    def pid(self) -> int:
        return os.getpid()

    def serve(self) -> int:
        """Returns when stopped."""
        self._stop.wait()
        return 0

    def stop(self) -> None:
        self.thread.stop()
        self._stop.set()


class LighthouseActor(_ServerActor):
    """`fthsdp lighthouse` in a Ray actor: the in-process LighthouseThread.

    Not detached: its lifetime is the job's (the driver owns it), so a driver
    that exits, cleanly or not, leaves no lighthouse behind on the cluster;
    the replicas ride out the driver's own restarts of it (same address) like
    any lighthouse outage.
    """

    def __init__(self, host: str, port: int, detect_s: float, join_timeout_s: float, replicas: int,
                 secret: bytes | None = None, tls: tuple[str, str] = ("", ""),
                 connection_calls_per_s: float = FairnessLimits.connection_calls_per_s,
                 beats_per_s: float = DEFAULT_BEATS_PER_S, standby: bool = False) -> None:
        from fthsdp.addresses import join_host_port
        from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread

        fairness = FairnessLimits(connection_calls_per_s=connection_calls_per_s)
        # Its own /metrics (verdicts and load) on a free port of its host, as `fthsdp run`'s
        # lighthouse: named in its Status answers, so `fthsdp status --prometheus-targets` lists it.
        super().__init__(LighthouseThread(LighthouseConfig(
            bind=join_host_port(host, port), detect_s=detect_s, join_timeout_s=join_timeout_s,
            num_replicas=replicas, secret=secret, tls_cert_file=tls[0], tls_key_file=tls[1], fairness=fairness,
            metrics_bind=join_host_port(host, 0), beats_per_s=beats_per_s)), standby=standby)

    def facts(self) -> dict:
        """What the driver records of the running lighthouse (its events): where its /metrics
        are, and the connection and beat budgets it runs with."""
        server = self.thread.server
        return {"metrics_address": server.metrics_server.address if server.metrics_server is not None else "",
                "connection_calls_per_s": server.config.fairness.connection_calls_per_s,
                "beats_per_s": server.config.beats_per_s}


class RelayActor(_ServerActor):
    """`fthsdp relay` in a Ray actor (the in-process RelayThread), on the lighthouse's node as
    `fthsdp run` starts its relays; its lifetime is the job's, as the lighthouse actor's. It gets
    no secret: it passes signed requests on and checks none."""

    def __init__(self, host: str, port: int, lighthouse: str, tls: tuple[str, str] = ("", ""),
                 lighthouse_tls_ca: str = "") -> None:
        from fthsdp.addresses import join_host_port
        from fthsdp.control.relay import RelayConfig, RelayThread

        super().__init__(RelayThread(RelayConfig(lighthouse=lighthouse, bind=join_host_port(host, port),
                                                 tls_cert_file=tls[0], tls_key_file=tls[1],
                                                 lighthouse_tls_ca=lighthouse_tls_ca)))

    def stats(self) -> dict:
        """What it carried so far (fthsdp.control.relay.Relay.stats)."""
        return self.thread.stats


class ReplicaActor:
    """One replica process (one per replica until replicas span several processes).

    `seed` holds the files a replacement continues (its ledger, its loader
    position): the driver's copies, handed over through Ray.
    """

    def __init__(self, rid: int, env: dict[str, str], seed: dict[str, str], config_text: str | None,
                 work_prefix: str) -> None:
        os.environ.update(env)
        os.environ.setdefault("FTHSDP_COMPILATION_CACHE", str(pathlib.Path.home() / ".cache" / "fthsdp" / "xla"))
        self.rid = rid
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix=f"{work_prefix}r{rid}-"))
        self.offsets: dict[str, int] = {}
        for rel, text in seed.items():
            p = self.dir / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
            self.offsets[rel] = len(text.encode())  # the driver has these bytes already
        self.config_path = None
        if config_text is not None:
            self.config_path = self.dir / "config.py"
            self.config_path.write_text(config_text)
        self.returncode: int | None = None

    def where(self) -> dict:
        """Node, host and pids: the driver's handle for signals and node faults."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "parent_pid": os.getppid(), "host": socket.gethostname(), "ip": node_ip(),
                "work_dir": str(self.dir)}

    def link_checkpoints(self, path: str, marker: str = "", wait_s: float = 5.0) -> None:
        """The persistent checkpoints' home: storage every node reaches (a Ray job's storage path).
        ``marker``: a file the driver wrote there; not finding it, this node does not share that
        storage (a path on the driver's disk, created empty here), and the job's checkpoints would
        scatter across nodes: refused, job-fatal (see fthsdp.launch.ray)."""
        seen = not marker or (pathlib.Path(path) / marker).exists()
        deadline = time.monotonic() + wait_s  # a FUSE mount may show a file written elsewhere late
        while not seen and time.monotonic() < deadline:
            time.sleep(0.25)
            seen = (pathlib.Path(path) / marker).exists()
        if not seen:
            raise RuntimeError(f"{NOT_SHARED}: {path} on node {socket.gethostname()} does not hold the file "
                               f"{marker} the driver wrote there, so it is not storage the driver shares; give "
                               "fthsdp ray --checkpoint-dir a path every node mounts (a shared filesystem)")
        link = self.dir / "checkpoints"
        if not link.exists():
            pathlib.Path(path).mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)

    def run(self, argv: list[str]) -> int:
        """The replica's entry point, as `python -m fthsdp.replica.process ARGV --out-dir WORKDIR` runs it."""
        from fthsdp.replica import process as replica

        if self.config_path is not None:
            argv = [*argv, "--config", str(self.config_path)]
        try:
            code = replica.main([*argv, "--out-dir", str(self.dir)])
        except SystemExit as e:  # the entry point's refusals (bad flags, missing secret)
            code = e.code if isinstance(e.code, int) else 2
        except BaseException:  # noqa: BLE001 - an unclassified crash, as a process would exit with 1
            import traceback

            with open(self.dir / f"replica-{self.rid}.log", "a") as f:
                f.write(traceback.format_exc())
            code = 1
        self.returncode = int(code)
        return self.returncode

    def poll(self) -> dict:
        """New complete lines of the appended files, the rewritten files' latest text."""
        out: dict[str, object] = {"append": {}, "latest": {}}
        for pattern in APPENDED:
            rel = pattern.format(rid=self.rid)
            p = self.dir / rel
            try:
                with open(p, "rb") as f:
                    f.seek(self.offsets.get(rel, 0))
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # only whole lines: a record is never torn in two
            if end:
                out["append"][rel] = data[:end].decode(errors="replace")
                self.offsets[rel] = self.offsets.get(rel, 0) + end
        for pattern in REWRITTEN:
            rel = pattern.format(rid=self.rid)
            try:
                out["latest"][rel] = (self.dir / rel).read_text()
            except FileNotFoundError:
                pass
        return out

    def set_relay(self, address: str) -> None:
        """The replica process's relay was placed elsewhere: the new HOST:PORT goes to the file its
        client follows (ft.lighthouse_relay_file, :data:`RELAY_FILE` in this actor's work dir)."""
        from fthsdp.atomic_file import write_atomic

        write_atomic(self.dir / RELAY_FILE, address + "\n")

    def free_port(self, host: str) -> int:
        """A free port on this node (process 0 serves the replica's JAX coordinator on it)."""
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    def sigkill_self(self) -> None:
        """A SIGKILL of this actor's worker process, from inside it (works on any node)."""
        os.kill(os.getpid(), signal.SIGKILL)

    def kill_node(self) -> str:
        """Removes this actor's whole node: SIGKILL of its raylet (the parent of Ray's
        worker processes); every worker of the node dies with it, and the cluster
        marks the node dead."""
        ppid = os.getppid()
        try:
            cmd = pathlib.Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmd = ""
        if "raylet" not in cmd:
            raise RuntimeError(f"the parent of this Ray worker (pid {ppid}) is not a raylet ({cmd[:80]!r}); "
                               "cannot remove the node")
        # A helper outside this worker sends the signal, so the reply can leave first.
        subprocess.Popen(["sh", "-c", f"sleep 0.2; kill -9 {ppid}"], start_new_session=True)
        time.sleep(0.05)
        return cmd.split()[0]



def remove_work_dirs(work_prefix: str) -> int:
    """Removes this node's work directories of one job (the dead actors' too); returns how many."""
    import shutil

    n = 0
    for d in pathlib.Path(tempfile.gettempdir()).glob(f"{work_prefix}*"):
        shutil.rmtree(d, ignore_errors=True)
        n += 1
    return n


def node_host(nodes: list[dict], node_id: str) -> str:
    """Where a server on node ``node_id`` (the lighthouse, a relay) listens: loopback when every
    live node is this machine (a local cluster), else that node's address, which the others can
    reach."""
    live = [n for n in nodes if n.get("Alive")]
    me = next((n for n in live if n.get("NodeID") == node_id), None)
    if me is None:
        return "127.0.0.1"
    if all(n.get("NodeManagerHostname") == me.get("NodeManagerHostname") for n in live):
        return "127.0.0.1"
    return str(me.get("NodeManagerAddress") or "127.0.0.1")
