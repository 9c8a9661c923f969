"""`fthsdp run`: a lighthouse and N replica processes on this machine, with real faults.

The launcher owns processes and signals only; what the replicas did is read
back from their files (fthsdp/launch/report.py). Faults are real: SIGKILL for
a dead machine, SIGSTOP/SIGCONT for a hung one, SIGKILL of the lighthouse.
It supervises everything it started:

* a killed replica is restarted (`--restart`) and rejoins by fetching state
  from its peers, while someone healthy is left to fetch from;
* its lighthouse is restarted on the same address when it dies, so the
  replicas reconnect;
* when no healthy replica is left, it restarts the whole job from the latest
  persistent checkpoint (as `--resume` does), at most `launch.max_job_restarts`
  times, and never after a replica's job-fatal verdict (exit 78: a bad
  config, replicas disagreeing on their state), which a restart would repeat;
* nothing it started outlives it (fthsdp/launch/lifetime.py): SIGTERM or
  SIGHUP stop the job as Ctrl-C does, and the kernel kills its children if it
  is SIGKILLed.

The decisions are plain functions (faults.due, supervise.*); this module
turns them into processes and signals. The run directory's bookkeeping
(attempts, the user's overrides, fired faults) is fthsdp/launch/rundir.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fthsdp.addresses import family, join_host_port, split_host_port
from fthsdp.atomic_file import write_atomic
from fthsdp.control.admission import FairnessLimits
from fthsdp.control.pacing import DEFAULT_BEATS_PER_S
from fthsdp.devices import launcher_gpu_env, visible_gpus
from fthsdp.digits import ascii_int
from fthsdp.errors import EXIT_JOB_FATAL, EXIT_REPLICA_FATAL
from fthsdp.launch import rundir as rundir_lib
from fthsdp.launch import lifetime, supervise
from fthsdp.launch.faults import Fault, choose_sources, due, plan

log = logging.getLogger("fthsdp.launch")

LIGHTHOUSE_START_S = 60.0  # a (re)started lighthouse must listen within this long
# A warm spare lighthouse is started this long after ours serves (not beside the replicas'
# imports or reconnections, both CPU-heavy); a second death within it restarts one cold.
STANDBY_DELAY_S = 2.0
SERVER_RESTART_TRIES = 3  # tries to start a dead lighthouse or relay again on its address


@dataclass
class ReplicaProc:
    rid: int
    proc: subprocess.Popen | None = None
    state: str = "starting"  # starting / running / killed / stopped / done / failed
    restarts: int = 0
    cont_at: float | None = None
    restart_at: float | None = None
    log_path: pathlib.Path | None = None
    mode: str = "start"  # start: with the others (initial, resumed) / rejoin: alone, from its peers
    progressed: bool = False  # its live process has committed a step
    last_step: int | None = None  # the last step a process of it reported in this attempt (kept after death)
    # Processes 1..P-1 of a multi-process replica (`proc` is process 0, its leader).
    followers: list[subprocess.Popen] = field(default_factory=list)
    stopped_process: int = 0  # which process a stop fault froze (SIGCONT goes to it)
    returncode: int | None = None  # how its last process ended (None while one runs)
    # How its group ended when the launcher stopped the rest of it (supervise.group_returncode):
    # stands for the leader's own end, which is then the launcher's SIGKILL.
    group_returncode: int | None = None
    # Until when the rest of a group whose ended processes asked for a restart may end on their own
    # (fail_groups_as_units); None: no such wait.
    group_grace_until: float | None = None
    group_killed: bool = False  # the launcher sent its group SIGKILL (fail_groups_as_units): once
    # Replica-fatal exits (or deaths by a signal the launcher did not send) in a row of processes
    # that never committed a step: a start that fails the same way each time is not restarted
    # forever (MAX_FAILED_STARTS), and waits longer each time.
    failed_starts: int = 0


# A replica whose processes exit replica-fatal (or die of a signal) this many times in a row without committing a step
# is not restarted again (a deterministic start-up fault would otherwise restart it forever).
MAX_FAILED_STARTS = 3


def _how_it_ended(returncode: int) -> str:
    return f"signal {-returncode}" if returncode < 0 else f"exit code {returncode}"


def _wait_killed(proc, seconds: float, what: str) -> bool:
    """Waits up to ``seconds`` for ``proc``, just sent SIGKILL; False (and said why) when it has not
    ended: a process in uninterruptible sleep (a hung network filesystem, a GPU driver tearing a
    context down) ends only when the kernel lets it. The launcher goes on; a later poll() reaps it."""
    try:
        proc.wait(seconds)
        return True
    except subprocess.TimeoutExpired:
        log.error("%s (pid %s) has not ended %g s after SIGKILL: it is in uninterruptible sleep (a hung "
                  "filesystem or device driver?); going on without it, it is reaped when it ends", what,
                  getattr(proc, "pid", "?"), seconds)
        return False


def _reap(proc: subprocess.Popen) -> None:
    """Kill ``proc`` if it still runs, wait for it, close the pipe the launcher held to it."""
    if proc.poll() is None:
        proc.kill()
    _wait_killed(proc, 10, "a process")
    if getattr(proc, "stdin", None) is not None:  # a Popen's (a Ray actor has none)
        with contextlib.suppress(OSError):
            proc.stdin.close()


def _start_again(start: Callable[[], object]) -> RuntimeError | None:
    """``start()`` a server that died (the lighthouse, a relay) up to SERVER_RESTART_TRIES times,
    half a second apart; None once it started, else the last try's error."""
    err: RuntimeError | None = None
    for _ in range(SERVER_RESTART_TRIES):
        try:
            start()
            return None
        except RuntimeError as e:
            err = e
            time.sleep(0.5)
    return err


def _listening_port(proc: subprocess.Popen, port_file: pathlib.Path, what: str, log_path: pathlib.Path) -> int:
    """The port a server process started by the launcher wrote to ``port_file`` once listening;
    RuntimeError if it exits first or is not listening within LIGHTHOUSE_START_S (it is killed)."""
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{what} did not start listening within {LIGHTHOUSE_START_S:.0f} s; see {log_path}")
        time.sleep(0.01)  # a standby lighthouse listens ~15 ms after its word: the restart's count is this exact
    return int(port_file.read_text().strip())


@dataclass
class LocalJob:
    config: str
    overrides: list[str]
    out_dir: pathlib.Path
    replicas: int
    steps: int
    faults: list[Fault]
    job_id: str = "fthsdp"
    restart: bool = False
    restart_delay_s: float = 1.0
    allreduce: str = "ftar"
    detect_s: float = 1.0
    join_timeout_s: float = 0.5
    deadline_s: float = 0.0  # stop an unfinished job after this many seconds (0: no limit; launch.deadline_s)
    progress: bool = True
    hash_every: int = 1
    resume: str = ""  # full restart id: replicas resume from the latest persistent checkpoint
    kill_all_at: int | None = None  # SIGKILL every process once a replica reaches this step
    run_dir_lock: object = field(default=None, repr=False)  # rundir.hold's file: the run directory is ours
    late: dict[int, float] = field(default_factory=dict)  # replica -> start it this many seconds after the others
    max_job_restarts: int = 2  # automatic whole-job fallbacks to the checkpoint
    # Addresses (fthsdp.addresses): a running lighthouse to use instead of starting
    # one; else where ours binds and the host the replicas are told. `hosts`
    # emulates machines: replica r's listeners bind and advertise hosts[r % len].
    external_lighthouse: str = ""
    lighthouse_bind: str = "127.0.0.1:0"
    lighthouse_advertise: str = ""
    hosts: tuple[str, ...] = ()
    processes: int = 1  # processes per replica (one JAX runtime per replica; process 0 leads)
    devices: int = 1  # devices per process of a replica (launch.devices_per_replica): its GPUs, on a GPU host
    procs: dict[int, ReplicaProc] = field(default_factory=dict)
    # The operator's secret (launch.secret_file; fthsdp.control.auth.launcher_keys): with our own
    # lighthouse its secret (default: a fresh one per job), with launch.lighthouse the job's secret.
    secret_file: str = ""
    # TLS for our own lighthouse (launch.lighthouse_tls_cert/key): PEM files, both or neither.
    lighthouse_tls: tuple[str, str] = ("", "")
    # Our own lighthouse's budget per client connection (launch.lighthouse_connection_calls_per_s).
    lighthouse_calls_per_s: float = FairnessLimits.connection_calls_per_s
    # Our own lighthouse's beat budget (launch.lighthouse_beats_per_s, fthsdp.control.pacing).
    lighthouse_beats_per_s: float = DEFAULT_BEATS_PER_S
    relays: int = 0  # relay processes between the replicas and the lighthouse (launch.relays)
    relay_placement: str = "lighthouse"  # where they run (launch.relay_placement): "lighthouse" or "replicas"
    lighthouse_tls_ca: str = ""  # what the relays check the lighthouse's certificate against (ft.lighthouse_tls_ca)
    # A warm spare of our own lighthouse (launch.lighthouse_standby): started, waiting to bind its
    # port, so that a lighthouse that dies is replaced without Python's start-up.
    lighthouse_standby: bool = True

    def __post_init__(self) -> None:
        self.out_dir = pathlib.Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.gpus = visible_gpus()  # the launcher's: split among the replicas' processes (_env)
        if self.gpus:  # the shape the replicas build (a library caller sets it through the overrides alone)
            from fthsdp import config as config_lib

            shape = config_lib.load(self.config, self.overrides).launch
            self.devices, self.processes = shape.devices_per_replica, shape.processes_per_replica
        self.rundir = rundir_lib.RunDir(self.out_dir)
        if not self.rundir.load():  # used as a library (tests): record what the run is
            self.rundir.save({"config": self.config, "overrides": list(self.overrides),
                              "faults": [f.to_json() for f in self.faults], "fired": [], "attempts": []})
        if self.kill_all_at is not None:
            self.faults = sorted([*self.faults, *plan((), (), self.replicas, kill_all=(self.kill_all_at,))])
        self.pending = sorted(self.faults)
        self.fired: list[dict] = []
        self._log_handler: logging.Handler | None = None
        self._events = None
        self._begin_attempt("resume" if self.resume else "fresh")
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_addr = ""
        self.lighthouse_port = 0
        self._lighthouse_down_ok = False  # we took it down on purpose (kill-all, fallback, shutdown)
        self.lighthouse_restarts: list[dict] = []
        self._standby: subprocess.Popen | None = None  # the warm spare (lighthouse_standby), once started
        self._standby_due = math.inf  # when the next spare is started (monotonic)
        self.from_standby = False  # the lighthouse serving now was a standby told to serve
        self.job_restarts: list[dict] = []
        self.gave_up = ""  # why the launcher ended the job early, with the resume hint
        self.token = secrets.token_hex(16)  # the job's shared secret for peer state transfer
        from fthsdp.control import auth

        self.lighthouse_secret, self.job_key = auth.launcher_keys(self.secret_file, self.job_id,
                                                                  own_lighthouse=not self.external_lighthouse)
        if self.job_key is None:
            log.warning("no job secret for the lighthouse %s: the replicas' calls are unsigned, which only a "
                        "lighthouse run with --insecure accepts (give --secret-file or $%s)",
                        self.external_lighthouse, auth.SECRET_FILE_ENV)
        if self.lighthouse_secret is not None:  # `fthsdp status --status-key-file OUT/status.key`
            auth.write_secret(str(self.out_dir / "status.key"), auth.status_key(self.lighthouse_secret))
        self.killed_all = False
        self.relay_procs: list[subprocess.Popen | None] = []  # None: died and could not be restarted
        self.relay_restarts: list[dict] = []
        self.relay_addrs: list[str] = []

    # -- bookkeeping ---------------------------------------------------------

    def _begin_attempt(self, kind: str) -> None:
        """A new attempt: the previous one's files archived, its own launch log and events file."""
        if self._events is not None:
            self._events.close()
        self.attempt, log_path = self.rundir.begin_attempt(kind, self.resume)
        root = logging.getLogger("fthsdp")
        if self._log_handler is not None:
            root.removeHandler(self._log_handler)
            self._log_handler.close()
        self._log_handler = logging.FileHandler(log_path)
        self._log_handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(levelname).1s %(name)s | "
                                                         "%(message)s", "%H:%M:%S"))
        root.addHandler(self._log_handler)
        if root.level == logging.NOTSET or root.level > logging.INFO:
            root.setLevel(logging.INFO)
        self._events = open(self.out_dir / "events.jsonl", "a", buffering=1)
        log.info("attempt %d (%s)%s; this attempt's log: %s", self.attempt, kind,
                 f", restart id {self.resume}" if self.resume else "", log_path)

    def event(self, kind: str, replica: int | None = None, **extra) -> None:
        rec = {"time": time.time(), "kind": kind, "replica": replica, "attempt": self.attempt, **extra}
        self._events.write(json.dumps(rec) + "\n")
        log.info("%s%s %s", kind, f" replica {replica}" if replica is not None else "",
                 " ".join(f"{k}={v}" for k, v in extra.items()))

    def live_status(self, rid: int) -> dict:
        """The status its *live* process wrote; {} before that process commits
        (a killed predecessor's file says nothing about the new process). A process
        that finished (exit 0) but is not reaped yet still has its last word: one that
        exits between reap() and a decision must not read as running without a commit
        (a finisher then looked like "no healthy replica left"). One that died holds
        nothing any more, reaped or not."""
        rp = self.procs.get(rid)
        if rp is None or rp.proc is None or rp.proc.poll() not in (None, 0):
            return {}
        try:
            st = json.loads((self.out_dir / f"status-{rid}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return st if st.get("pid") == rp.proc.pid else {}

    def progress_by_replica(self) -> dict[int, int | None]:
        out: dict[int, int | None] = {}
        for rid, rp in self.procs.items():
            st = self.live_status(rid) if rp.state in ("running", "starting") else {}
            out[rid] = st.get("step") if st else None
            if st:
                rp.progressed = rp.progressed or not st.get("final")  # a final word alone is no commit
                rp.last_step = st.get("step")
        return out

    def views(self) -> list[supervise.ReplicaView]:
        prog = self.progress_by_replica()
        return [supervise.ReplicaView(rid, rp.state, prog[rid], rp.mode, rp.progressed, rp.last_step,
                                      rp.returncode)
                for rid, rp in sorted(self.procs.items())]

    def _env(self, rid: int | None = None, process: int = 0) -> dict:
        """A child's environment; replica ``rid``'s process ``process`` also gets its GPUs (on a
        host with GPUs: devices.launcher_gpu_env)."""
        env = lifetime.child_env(dict(os.environ))  # its processes die with the launcher
        if rid is not None and self.gpus:
            env.update(launcher_gpu_env(rid, self.replicas, self.devices, process, self.processes, self.gpus, env))
        env.setdefault("FTHSDP_COMPILATION_CACHE", str(pathlib.Path.home() / ".cache" / "fthsdp" / "xla"))
        env["PYTHONUNBUFFERED"] = "1"
        env["FTHSDP_PEER_TOKEN"] = self.token
        from fthsdp.control import auth

        return auth.replica_env(env, self.job_key)

    def _relay_env(self) -> dict:
        """A relay's environment: no secret at all (it passes signed requests on, and checks none)."""
        from fthsdp.control import auth

        env = auth.replica_env(self._env(), None)
        env.pop("FTHSDP_PEER_TOKEN", None)
        return env

    def _lighthouse_env(self) -> dict:
        """The lighthouse's environment: its secret in $FTHSDP_LIGHTHOUSE_SECRET (never on its command line)."""
        from fthsdp.control import auth

        env = auth.replica_env(self._env(), None)
        env[auth.LIGHTHOUSE_SECRET_ENV] = self.lighthouse_secret.hex()
        return env

    def resume_hint(self) -> str:
        return rundir_lib.resume_hint(self.out_dir, self.config, self.overrides)

    # -- processes -----------------------------------------------------------

    def start_lighthouse(self) -> None:
        """Starts the lighthouse; on a restart, on the same port (the replicas know that address).
        With an external lighthouse (launch.lighthouse), only records its address: it is not ours to
        start, restart or kill."""
        if self.external_lighthouse:
            self.lighthouse_addr = self.external_lighthouse
            self.event("lighthouse", address=self.lighthouse_addr, external=True)
            return
        bind_host, bind_port = split_host_port(self.lighthouse_bind)
        port_file = self.out_dir / "lighthouse.port"
        port_file.unlink(missing_ok=True)
        self.lighthouse = self._take_standby() or \
            self._spawn_lighthouse(join_host_port(bind_host, self.lighthouse_port or bind_port))
        self.lighthouse_port = _listening_port(self.lighthouse, port_file, "the lighthouse",
                                               self.out_dir / "lighthouse.log")
        self.lighthouse_addr = join_host_port(self.lighthouse_advertise or bind_host, self.lighthouse_port)
        self._serving()
        self.event("lighthouse", address=self.lighthouse_addr, standby=self.from_standby)

    def _take_standby(self):
        """The warm spare, told to serve (``from_standby`` says so); None when there is none or it
        cannot (the caller starts one cold). Shared by `fthsdp run` and `fthsdp ray` (its ``_promote``)."""
        spare, self._standby = self._standby, None
        got = self._promote(spare) if spare is not None else None
        self.from_standby = got is not None
        return got

    def _serving(self) -> None:
        """Our lighthouse listens: supervised again, and its next spare is due a little later, not
        beside the replicas' (re)connections."""
        self._lighthouse_down_ok = False
        self._standby_due = time.monotonic() + STANDBY_DELAY_S if self.lighthouse_standby else math.inf

    def _spawn_lighthouse(self, bind: str, standby: bool = False) -> subprocess.Popen:
        """A lighthouse process on ``bind``, logging to lighthouse.log; ``standby``: a warm spare
        that binds when told (its stdin, ``fthsdp lighthouse --standby``)."""
        bind_host = split_host_port(bind)[0]
        with open(self.out_dir / "lighthouse.log", "a") as logf:
            what = "standby started" if standby else "start"
            logf.write(f"--- lighthouse {what} {time.strftime('%H:%M:%S')} (attempt {self.attempt}) ---\n")
            logf.flush()
            return subprocess.Popen(
                [sys.executable, "-m", "fthsdp.control.lighthouse", "--bind", bind,
                 "--port-file", str(self.out_dir / "lighthouse.port"), "--detect", str(self.detect_s),
                 "--join-timeout", str(self.join_timeout_s), "--replicas", str(self.replicas),
                 # its own /metrics (root-cause verdicts) on any free port of its bind host, named in
                 # its Status answers: `fthsdp status --prometheus-targets` lists it
                 "--metrics-bind", join_host_port(bind_host, 0),
                 "--connection-calls-per-s", repr(float(self.lighthouse_calls_per_s)),
                 "--beats-per-s", repr(float(self.lighthouse_beats_per_s)),
                 *(["--tls-cert", self.lighthouse_tls[0], "--tls-key", self.lighthouse_tls[1]]
                   if self.lighthouse_tls[0] else []), *(["--standby"] if standby else [])],
                stdin=subprocess.PIPE if standby else subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                env=self._lighthouse_env(), start_new_session=True, text=True)

    def _promote(self, spare: subprocess.Popen) -> subprocess.Popen | None:
        """Tell the warm spare to serve; None if it cannot be (it died: a cold start then)."""
        why = f"it exited with {spare.returncode}" if spare.poll() is not None else ""
        if not why:
            with open(self.out_dir / "lighthouse.log", "a") as logf:
                logf.write(f"--- lighthouse standby takes over {time.strftime('%H:%M:%S')} ---\n")
            try:
                spare.stdin.write(lifetime.STANDBY_COMMAND + "\n")
                spare.stdin.close()
                return spare
            except OSError as e:  # it died since
                why = str(e)
        log.warning("the standby lighthouse cannot take over (%s): starting one", why)
        _reap(spare)
        return None

    def keep_standby(self) -> None:
        """Start the warm spare when it is due: our lighthouse serves on its final port, and none
        is waiting (or the last one died)."""
        if self._standby is not None and self._standby.poll() is not None:
            log.warning("the standby lighthouse exited (%s); starting another", _how_it_ended(self._standby.returncode))
            _reap(self._standby)
            self._standby, self._standby_due = None, time.monotonic() + STANDBY_DELAY_S
        if self._standby is not None or time.monotonic() < self._standby_due or self._lighthouse_down_ok:
            return
        if self.lighthouse is None or self.lighthouse.poll() is not None:
            return
        self._standby = self._new_standby()
        self._standby_due = math.inf

    def _new_standby(self):
        """A warm spare of the lighthouse serving now, for its port (``fthsdp ray``: an actor)."""
        return self._spawn_lighthouse(join_host_port(split_host_port(self.lighthouse_bind)[0], self.lighthouse_port),
                                      standby=True)

    def stop_standby(self) -> None:
        if self._standby is not None:
            _reap(self._standby)
            self._standby = None
        self._standby_due = math.inf

    def start_relays(self) -> None:
        """Starts ``relays`` relay processes (any free port each) in front of the lighthouse, each on
        :meth:`_relay_host`; the replicas are told their addresses (ft.lighthouse_relays)."""
        for i in range(self.relays):
            proc, address = self._start_relay(i, 0)
            self.relay_procs.append(proc)
            self.relay_addrs.append(address)
            write_atomic(self._relay_file(i), address + "\n")
            self.event("relay", address=address, index=i)

    def _relay_file(self, i: int) -> pathlib.Path:
        """Where relay ``i``'s address is kept for the processes of its block to follow
        (ft.lighthouse_relay_file): rewritten when it had to move to another port."""
        return self.out_dir / f"relay-{i}.address"

    def relay_file_override(self, rid: int) -> list[str]:
        """The relay file replica ``rid``'s processes follow (none without the launcher's relays)."""
        if not self.relay_addrs:
            return []
        from fthsdp.control.relay import relay_index

        return [f"ft.lighthouse_relay_file={self._relay_file(relay_index(self.relays, rid, self.replicas))}"]

    def relay_overrides(self) -> list[str]:
        """The launcher's relays, named to a replica as its relays (it starts none itself)."""
        return ["launch.relays=0", f"ft.lighthouse_relays={','.join(self.relay_addrs)}"] if self.relay_addrs else []

    def _relay_host(self, i: int) -> str:
        """Where relay ``i`` listens: the lighthouse's host, or with ``relay_placement="replicas"``
        and emulated hosts (launch.hosts) the host of the first replica of its block."""
        if self.relay_placement == "replicas" and self.hosts:
            from fthsdp.control.relay import block_first

            return self.hosts[block_first(i, self.relays, self.replicas) % len(self.hosts)]
        return split_host_port(self.lighthouse_addr)[0]

    def _start_relay(self, i: int, port: int) -> tuple[subprocess.Popen, str]:
        """Relay ``i`` on ``port`` of :meth:`_relay_host` (0: any free port); (process, address)."""
        host = self._relay_host(i)
        port_file = self.out_dir / f"relay-{i}.port"
        port_file.unlink(missing_ok=True)
        logf = open(self.out_dir / f"relay-{i}.log", "a")
        proc = subprocess.Popen(
            [sys.executable, "-m", "fthsdp.control.relay", "--lighthouse", self.lighthouse_addr,
             "--bind", join_host_port(host, port), "--port-file", str(port_file),
             *(["--tls-cert", self.lighthouse_tls[0], "--tls-key", self.lighthouse_tls[1]]
               if self.lighthouse_tls[0] else []),
             *(["--lighthouse-tls-ca", self.lighthouse_tls_ca] if self.lighthouse_tls_ca else [])],
            stdout=logf, stderr=subprocess.STDOUT, env=self._relay_env(), start_new_session=True)
        logf.close()
        try:
            bound = _listening_port(proc, port_file, f"relay {i}", self.out_dir / f"relay-{i}.log")
        except RuntimeError:
            if proc.poll() is None:
                proc.kill()
            _wait_killed(proc, 10, f"relay {i}")
            raise
        return proc, join_host_port(host, bound)

    def stop_relays(self) -> None:
        for proc in self.relay_procs:  # SIGTERM: each logs what it carried
            if proc is not None and proc.poll() is None:
                lifetime.stop_process(proc)

    def supervise_relays(self) -> None:
        """Restarts a relay that died on its own address (its replicas went to the lighthouse
        directly and come back to it: fthsdp.control.session_client.RelayPath). One whose address
        cannot be taken again (another process holds its port) is started on another port of its
        host, and its block's processes are told through their relay file (they move to it, as
        under `fthsdp ray`); one that cannot be started at all is left dead: its replicas stay on
        the lighthouse, the job goes on."""
        for i, proc in enumerate(self.relay_procs):
            if proc is None or proc.poll() is None:
                continue
            why = _how_it_ended(proc.returncode)
            t0 = time.monotonic()

            def again(i: int = i) -> None:  # on its own address: its replicas know it
                self.relay_procs[i] = self._start_relay(i, split_host_port(self.relay_addrs[i])[1])[0]

            err = _start_again(again)
            moved_from = ""
            if err is not None:
                moved_from, err = self._move_relay(i, why, err)
            if err is not None:
                self.relay_procs[i] = None
                log.warning("relay %d at %s died (%s) and could not be restarted (%s); its replicas speak to the "
                            "lighthouse directly", i, self.relay_addrs[i], why, err)
                self.event("relay_lost", index=i, reason=why, error=str(err))
                continue
            took = time.monotonic() - t0
            self.relay_restarts.append({"index": i, "died": why, "restart_s": took, "time": time.time(),
                                        **({"moved_from": moved_from} if moved_from else {})})
            self.event("relay_restart", index=i, died=why, restart_s=round(took, 3), address=self.relay_addrs[i])
            log.warning("relay %d died (%s); restarted in %.2f s on %s%s", i, why, took, self.relay_addrs[i],
                        "" if not moved_from else
                        f" (its address {moved_from} could not be taken again: its replicas move to it)")

    def _move_relay(self, i: int, why: str, err: RuntimeError) -> tuple[str, RuntimeError | None]:
        """Relay ``i`` could not start on its own address (``err``): start it on any free port of
        its host and write the new address to its relay file. (the old address, None) once it
        listens; ("", the error) if it cannot start there either."""
        old = self.relay_addrs[i]
        log.warning("relay %d died (%s) and could not be restarted on %s (%s): starting it on another port", i, why,
                    old, err)

        def elsewhere() -> None:
            self.relay_procs[i], self.relay_addrs[i] = self._start_relay(i, 0)

        again = _start_again(elsewhere)
        if again is not None:
            return "", again
        write_atomic(self._relay_file(i), self.relay_addrs[i] + "\n")
        self.event("relay_moved", index=i, address=self.relay_addrs[i], moved_from=old)
        return old, None

    def stop_lighthouse(self) -> None:
        self._lighthouse_down_ok = True
        self.stop_standby()
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            self.lighthouse.kill()
            _wait_killed(self.lighthouse, 10, "the lighthouse")

    def supervise_lighthouse(self) -> bool:
        """Restarts a lighthouse that died; False (and `gave_up` set) if it cannot be."""
        if self.lighthouse is None or self._lighthouse_down_ok or self.lighthouse.poll() is None:
            self.keep_standby()
            return True
        why = _how_it_ended(self.lighthouse.returncode)
        t0 = time.monotonic()
        err = _start_again(self.start_lighthouse)
        if err is not None:
            self.gave_up = (f"the lighthouse at {self.lighthouse_addr} died ({why}) and could not be restarted "
                            f"({err}); resume the job with: {self.resume_hint()}")
            log.error("%s", self.gave_up)
            self.event("lighthouse_lost", reason=why, error=str(err))
            return False
        took = time.monotonic() - t0
        self.lighthouse_restarts.append({"died": why, "restart_s": took, "time": time.time(),
                                         "standby": self.from_standby})
        self.event("lighthouse_restart", died=why, restart_s=round(took, 3), standby=self.from_standby)
        log.warning("lighthouse died (%s); %s in %.2f s on %s", why,
                    "its standby took over" if self.from_standby else "restarted", took, self.lighthouse_addr)
        return True

    def start_replica(self, rid: int, mode: str = "start") -> None:
        """Starts replica `rid`: one process, or a group of `processes` sharing one JAX runtime
        whose coordinator process 0 serves on the replica's host."""
        rp = self.procs.setdefault(rid, ReplicaProc(rid))
        rp.log_path = self.out_dir / f"replica-{rid}.out"
        rp.group_returncode, rp.group_killed, rp.group_grace_until = None, False, None
        group: list[str] = []
        if self.processes > 1:
            host = self.hosts[rid % len(self.hosts)] if self.hosts else "127.0.0.1"
            with socket.socket(family(host)) as s:  # a free port for the replica's coordinator
                s.bind((host, 0))
                coordinator = join_host_port(host, s.getsockname()[1])
            group = ["--num-processes", str(self.processes), "--coordinator", coordinator]
        rp.followers = []
        for index in range(self.processes):
            path = rp.log_path if index == 0 else self.out_dir / f"replica-{rid}.{index}.out"
            logf = open(path, "a")
            proc = subprocess.Popen(
                [sys.executable, "-m", "fthsdp.replica.process", "--config", self.config, "--replica-id", str(rid),
                 *(["--process-index", str(index), *group] if group else []),
                 "--lighthouse", self.lighthouse_addr, "--job", self.job_id, "--out-dir", str(self.out_dir),
                 "--allreduce", self.allreduce, "--hash-every", str(self.hash_every),
                 *(["--resume", self.resume] if self.resume and mode == "start" else []),
                 *(["--rejoin"] if mode == "rejoin" else []), *self.host_flags(rid), *self.overrides,
                 *self.relay_overrides(), *self.relay_file_override(rid)],
                stdout=logf, stderr=subprocess.STDOUT, env=self._env(rid, index), start_new_session=True)
            logf.close()
            if index == 0:
                rp.proc = proc
            else:
                rp.followers.append(proc)
        rp.state, rp.mode, rp.progressed, rp.returncode = "running", mode, False, None
        rp.restart_at = rp.cont_at = None

    def host_flags(self, rid: int) -> list[str]:
        """Replica `rid`'s emulated host: every listener of it binds and advertises that address."""
        if not self.hosts:
            return []
        host = self.hosts[rid % len(self.hosts)]
        return ["--bind-host", host, "--advertise-host", host]

    def signal_replica(self, rid: int, sig: int, process: int | None = None) -> None:
        """Send ``sig`` to process ``process`` of replica ``rid`` (default: its leader; a SIGCONT
        goes to the process a stop froze)."""
        rp = self.procs[rid]
        target = self._signal_target(rp, sig, process)
        if target is not None and target.poll() is None:
            os.kill(target.pid, sig)

    def _signal_target(self, rp: ReplicaProc, sig: int, process: int | None):
        """The process of ``rp``'s group a signal goes to (None: none runs); a SIGCONT with no
        process named wakes the one a stop froze."""
        if process is None:
            process = rp.stopped_process if sig == signal.SIGCONT else 0
        if sig == signal.SIGCONT:
            rp.stopped_process = 0
        return None if rp.proc is None else self.group_process(rp, process)

    def kill_replica(self, rid: int) -> None:
        rp = self.procs[rid]
        self.kill_followers(rp)
        if rp.proc is not None and rp.proc.poll() is None:
            try:
                os.kill(rp.proc.pid, signal.SIGCONT)
                rp.proc.kill()
            except ProcessLookupError:
                pass
            _wait_killed(rp.proc, 30, f"replica {rid}")

    # -- faults ------------------------------------------------------------------

    def _fire(self, f: Fault, progress: dict[int, int | None], healthy: set[int]) -> None:
        step = progress.get(f.replica) if f.replica >= 0 else max(p for p in progress.values() if p is not None)
        self.fired.append({**f.to_json(), "attempt": self.attempt, "at_step": step, "time": time.time()})
        self.rundir.record_fired(self.fired[-1])
        if f.kind == "kill":
            rp = self.procs[f.replica]
            if rp.followers:  # one process of the group dies first; the rest go with it (a unit)
                target = self.group_process(rp, f.process)
                if target.poll() is None:
                    target.kill()
                    _wait_killed(target, 30, f"replica {f.replica} process {f.process}")
            self.kill_replica(f.replica)
            rp.state = "killed"
            self.event("kill", f.replica, step=step, healthy=sorted(healthy - {f.replica}))
            if self.restart:
                rp.restart_at = time.time() + self.restart_delay_s
        elif f.kind == "stop":
            rp = self.procs[f.replica]
            process = max(f.process, 0) if rp.followers else 0
            self.signal_replica(f.replica, signal.SIGSTOP, process)
            rp.stopped_process = process
            rp.state, rp.cont_at = "stopped", time.time() + f.stop_s
            self.event("stop", f.replica, step=step, seconds=f.stop_s, healthy=sorted(healthy - {f.replica}))
        elif f.kind == "lighthouse":
            if self.lighthouse is not None and self.lighthouse.poll() is None:
                self.lighthouse.kill()
                _wait_killed(self.lighthouse, 10, "the lighthouse")
            self.event("kill_lighthouse", step=step)
        elif f.kind == "relay":
            i = f.relay_index
            proc = self.relay_procs[i] if i < len(self.relay_procs) else None
            if proc is not None and proc.poll() is None:
                proc.kill()
                _wait_killed(proc, 10, f"relay {i}")
            self.event("kill_relay", step=step, index=i)
        elif f.kind == "kill_all":
            for rp in self.procs.values():
                self.kill_replica(rp.rid)
                rp.state, rp.restart_at = "killed", None
            self.stop_lighthouse()
            self.killed_all = True
            self.pending.clear()
            self.event("kill_all", None, step=step)

    def apply_faults(self) -> None:
        now = time.time()
        for rp in self.procs.values():
            if rp.state == "stopped" and rp.cont_at is not None and now >= rp.cont_at:
                self.signal_replica(rp.rid, signal.SIGCONT)
                rp.state, rp.cont_at = "running", None
                self.event("cont", rp.rid)
        i = 0
        while i < len(self.pending):
            f = self.pending[i]
            progress = self.progress_by_replica()
            healthy = supervise.healthy(self.views())
            target = self.procs.get(f.replica) if f.replica >= 0 else None
            exited = target is not None and (target.proc is None or target.proc.poll() is not None)
            if due(f, progress, healthy) == "fire" and not exited:  # (exited: reap() decides what it was)
                self.pending.pop(i)
                self._fire(f, progress, healthy)
                if self.killed_all:
                    return
            else:
                i += 1

    def restart_killed(self) -> None:
        now = time.time()
        for rp in self.procs.values():
            if rp.state != "killed" or rp.restart_at is None or now < rp.restart_at:
                continue
            if any(p.poll() is None for p in (rp.proc, *rp.followers) if p is not None):
                continue  # killed but not ended yet (see _wait_killed): its successor would share its devices
            views = self.views()
            if supervise.job_done(views):
                rp.restart_at = None
                self.event("no_restart", rp.rid, reason="the job finished")
            elif supervise.restart_allowed(views, rp.rid):
                late = rp.restarts < 0
                rp.restarts = max(rp.restarts, 0) + (0 if late else 1)
                self.event("late_start" if late else "restart", rp.rid,
                           step=max((p for p in self.progress_by_replica().values() if p is not None), default=0))
                self.start_replica(rp.rid, mode="rejoin")
            # else: nobody to rejoin; needs_fallback() decides what happens to the job

    def group_process(self, rp: ReplicaProc, index: int) -> subprocess.Popen:
        group = [rp.proc, *rp.followers]
        if not -1 <= index < len(group):
            raise ValueError(f"replica {rp.rid} has processes 0..{len(group) - 1}, not {index}")
        return group[max(index, 0)]

    def kill_followers(self, rp: ReplicaProc) -> None:
        for f in rp.followers:
            if f.poll() is None:
                try:
                    os.kill(f.pid, signal.SIGCONT)
                    f.kill()
                except ProcessLookupError:
                    pass
                _wait_killed(f, 30, f"a process of replica {rp.rid}")

    def fail_groups_as_units(self) -> None:
        """A multi-process replica fails as a unit: when one of its processes dies (or ends with
        an error) the others, which may be stuck in an intra-replica collective, are killed; the
        leader's end then stands for the replica's (a follower's death reads as a kill).

        When a process ended with its own restart verdict (exit 70) and none with a worse one, the
        others get a moment (detect_s + 2 s) to end on their own first: a follower on its way out
        with a job-fatal verdict (78) was killed by the launcher after its leader noticed its
        silence and exited 70, and the group was restarted into the same failure. (A death by a
        signal is no verdict: the rest are killed at once.) The kill is sent once: a process that
        does not end (see _wait_killed) is left to end, and reap goes on without it."""
        now = time.time()
        for rp in self.procs.values():
            group = self.group_of(rp)
            if group is None or rp.group_killed:
                continue
            codes = [p.returncode for p in group if p.poll() is not None and p.returncode != 0]
            if not codes or all(p.poll() is not None for p in group):
                rp.group_grace_until = None
                continue
            if EXIT_REPLICA_FATAL in codes and all(supervise.after_exit(c) == "restart" for c in codes):
                if rp.group_grace_until is None:
                    rp.group_grace_until = now + self.detect_s + 2.0
                if now < rp.group_grace_until:
                    continue
            rp.group_grace_until = None
            if self.group_failed(rp.rid, group):
                rp.group_killed = True
                self.kill_replica(rp.rid)

    def group_of(self, rp: ReplicaProc) -> list | None:
        """Replica ``rp``'s running group, its leader first (None: a replica of one process, or
        none started): what fail_groups_as_units judges (the Ray launcher's are actors)."""
        if not rp.followers or rp.proc is None:
            return None
        return [rp.proc, *rp.followers]

    def group_failed(self, rid: int, group: list) -> bool:
        """True (and logged) when a process of replica ``rid``'s group ended with an error
        while others still run: the rest must be stopped (the replica fails as a unit).
        ``group``: the leader first, then its followers (anything with poll()/returncode)."""
        ended = [(i, p.returncode) for i, p in enumerate(group) if p.poll() is not None and p.returncode != 0]
        if not ended or all(p.poll() is not None for p in group):
            return False
        self.event("group_failed", rid, processes=[f"{rid}.{i}" for i, _ in ended],
                   returncodes=[rc for _, rc in ended])
        self.procs[rid].group_returncode = supervise.group_returncode([rc for _, rc in ended])
        log.warning("replica %d: process(es) %s ended (%s); stopping the rest of the replica", rid,
                    [i for i, _ in ended], [rc for _, rc in ended])
        return True

    def reap(self) -> None:
        self.fail_groups_as_units()
        for rp in self.procs.values():
            if rp.state in ("running", "starting") and rp.proc is not None and rp.proc.poll() is not None:
                failing = rp.proc.returncode != 0
                if failing and not rp.group_killed and any(f.poll() is None for f in rp.followers):
                    continue  # its followers may still say how they end (fail_groups_as_units)
                rc = rp.proc.returncode if rp.group_returncode is None else rp.group_returncode
                rp.group_returncode = None
                if failing and rp.followers and all(f.poll() is not None for f in rp.followers):
                    # a failing group whose processes all ended: it ends as its worst process did (a
                    # leader that finished is done, whatever its followers' teardown did)
                    codes = [c for c in (rc, *(f.returncode for f in rp.followers)) if c != 0]
                    rc = supervise.group_returncode(codes) if codes else 0
                if supervise.after_exit(rc) == "restart":
                    # killed by a signal we did not send (a dead machine, the OOM killer,
                    # an operator), or a replica-fatal fault (the replica's own verdict:
                    # restart me): like a --kill, it is restarted and rejoins
                    rp.state = "killed"
                    # A start that dies before its first commit counts, whether by its own verdict or
                    # by a signal (a SIGSEGV or SIGABRT in XLA or the FFI on a bad GPU, the OOM killer at
                    # every compile): each restart would fail the same way, so at MAX_FAILED_STARTS in a
                    # row it is not restarted. (The launcher's own kills never reach here: _fire.)
                    rp.failed_starts = 0 if rp.progressed else rp.failed_starts + 1
                    how = f"died of signal {-rc}" if rc < 0 else f"exited replica-fatal ({rc})"
                    if rc < 0:
                        self.event("died", rp.rid, signal=-rc)
                    else:
                        self.event("replica_fatal", rp.rid, returncode=rc)
                    lines = rp.log_path.read_text(errors="replace").splitlines() if rp.log_path else []
                    if rp.failed_starts >= MAX_FAILED_STARTS:
                        rp.state, rp.returncode = "failed", rc
                        self.event("exit", rp.rid, returncode=rc, failed_starts=rp.failed_starts)
                        log.error("replica %d %s %d times in a row without committing a step: a restart would "
                                  "fail the same way, so it is not restarted; fix the cause (last lines of %s "
                                  "below), then resume the job with: %s\n%s", rp.rid, how, rp.failed_starts,
                                  rp.log_path, self.resume_hint(), "\n".join(lines[-15:]))
                        continue
                    log.warning("replica %d %s; restarting it:\n%s", rp.rid, how, "\n".join(lines[-3:]))
                    if self.restart:  # a multi-process replica restarts as a group (start_replica)
                        # a start that keeps failing waits longer each time (1, 2, 4 x the delay)
                        rp.restart_at = time.time() + self.restart_delay_s * 2 ** rp.failed_starts
                    continue
                rp.state = "done" if rc == 0 else "failed"
                rp.returncode = rc
                self.event("exit", rp.rid, returncode=rc)
                if rc != 0:
                    tail = rp.log_path.read_text().splitlines()[-15:] if rp.log_path else []
                    log.error("replica %d exited with %d; last lines of %s:\n%s", rp.rid, rc, rp.log_path,
                              "\n".join(tail))

    # -- whole-job fallback -----------------------------------------------------------

    def log_names(self, rids: list[int]) -> str:
        return ", ".join(self.procs[r].log_path.name for r in rids if self.procs[r].log_path is not None) or "the logs"

    def checkpoints(self) -> pathlib.Path:
        """The job's persistent checkpoints."""
        return self.out_dir / "checkpoints"

    def latest_checkpoint(self) -> int | None:
        steps = (ascii_int(p.name) for p in self.checkpoints().glob("*"))
        return max((s for s in steps if s is not None), default=None)

    def maybe_fall_back(self) -> None:
        if self.killed_all or self.gave_up or not supervise.needs_fallback(self.views()):
            return
        front = supervise.frontier(self.views())
        dead = {rp.rid: (rp.state if rp.state != "running" else
                         "restarting, not rejoined" if rp.last_step is None or not rp.progressed else
                         f"behind at step {rp.last_step}") for rp in self.procs.values()}
        dead["latest step"] = front
        ckpt = self.latest_checkpoint()
        where = f"the checkpoint of step {ckpt}" if ckpt is not None else "step 0 (no finished checkpoint yet)"
        fatal = supervise.job_fatal(self.views())
        if fatal or len(self.job_restarts) >= self.max_job_restarts:
            if fatal:  # its own verdict: a restart would fail the same way (a bad config, corrupt data, ...)
                self.gave_up = (f"no healthy replica is left ({dead}) and replica(s) {fatal} exited job-fatal "
                                f"(exit code {EXIT_JOB_FATAL}): a restart would fail the same way, so the job is "
                                f"not restarted; the reason is at the end of {self.log_names(fatal)}; fix it, then "
                                f"resume from {where} with: {self.resume_hint()}")
            else:
                self.gave_up = (f"no healthy replica is left ({dead}) and launch.max_job_restarts="
                                f"{self.max_job_restarts} automatic restart(s) are used up; resume the job from "
                                f"{where} with: {self.resume_hint()}")
            log.error("%s", self.gave_up)
            self.event("gave_up", reason="job_fatal" if fatal else "max_job_restarts", replicas=dead)
            for rp in self.procs.values():
                self.kill_replica(rp.rid)
                rp.restart_at = None
                if rp.state == "running":
                    rp.state = "killed"
            return
        n = len(self.job_restarts) + 1
        log.warning("no healthy replica is left (%s): restarting the whole job from %s, automatic restart %d of %d",
                    dead, where, n, self.max_job_restarts)
        self.event("job_restart", replicas=dead, checkpoint=ckpt, n=n)
        for rp in self.procs.values():
            self.kill_replica(rp.rid)
            rp.last_step = None  # a new attempt: its frontier starts at the checkpoint
        self.stop_lighthouse()
        self.rundir.end_attempt(result="no healthy replica left")
        self.resume = f"fallback-{self.attempt + 1}"
        self._begin_attempt("fallback")
        self.job_restarts.append({"attempt": self.attempt, "checkpoint": ckpt, "time": time.time(),
                                  "replicas": dead})
        err = _start_again(self.start_lighthouse)  # (its port, just freed: tried as a dead one is)
        if err is not None:
            where = self.lighthouse_addr or "its port"
            self.gave_up = (f"the whole-job restart could not start the lighthouse on {where} ({err}); resume "
                            f"the job with: {self.resume_hint()}")
            log.error("%s", self.gave_up)
            self.event("lighthouse_lost", reason="whole-job restart", error=str(err))
            return
        for rid in range(self.replicas):
            self.start_replica(rid, mode="start")

    # -- main loop -------------------------------------------------------------

    def status_line(self) -> str:
        parts = []
        for rid in sorted(self.procs):
            rp, st = self.procs[rid], self.live_status(rid)
            if rp.state in ("killed", "stopped", "failed"):
                parts.append(f"r{rid}: {rp.state.upper()}")
                continue
            if rp.state == "done":  # exited 0: its status file is no longer live
                parts.append(f"r{rid}: done")
                continue
            if not st:
                parts.append(f"r{rid}: {'starting' if rp.mode == 'start' else 'rejoining'}")
                continue
            loss = st.get("loss")
            parts.append(f"r{rid}: step {st.get('step', 0):>4} "
                         f"{'loss %.3f' % loss if loss is not None else 'loss  -   '} "
                         f"q{st.get('quorum_id', '-')} {st.get('members', [])} {st.get('state', rp.state)}")
        return " | ".join(parts)

    def finished(self) -> bool:
        if self.gave_up:
            return True
        live = [rp for rp in self.procs.values() if rp.state in ("running", "starting", "stopped")]
        waiting_restart = any(rp.restart_at is not None for rp in self.procs.values())
        return not live and not waiting_restart

    def run(self) -> dict:
        from fthsdp.launch import report

        t0 = time.monotonic()
        last_print = 0.0
        live = None
        try:  # (start-up too: what started before a failure or a Ctrl-C in it is stopped)
            self.start_lighthouse()
            self.start_relays()
            for rid in range(self.replicas):
                if rid in self.late:
                    rp = self.procs.setdefault(rid, ReplicaProc(rid, state="killed"))
                    rp.restart_at = time.time() + self.late[rid]
                    rp.restarts = -1  # its first start joins as a late joiner
                    continue
                self.start_replica(rid)
            t0 = time.monotonic()
            if self.progress:
                from rich.live import Live

                live = Live("", refresh_per_second=4, transient=False)
                live.start()
            while not self.finished():
                if self.deadline_s and time.monotonic() - t0 > self.deadline_s:
                    self.gave_up = (f"the job did not finish within launch.deadline_s = {self.deadline_s:g} s; its "
                                    f"processes were stopped; resume it with: {self.resume_hint()}")
                    log.error("%s", self.gave_up)
                    self.event("gave_up", reason="deadline", deadline_s=self.deadline_s)
                    break
                if not self.supervise_lighthouse():
                    break
                self.supervise_relays()
                self.reap()  # first: a fault must not fire at a replica that finished but is not reaped yet
                self.apply_faults()
                self.restart_killed()
                self.maybe_fall_back()
                line = self.status_line()
                if live is not None:
                    live.update(line.replace(" | ", "\n"))
                elif time.monotonic() - last_print > 2.0:
                    log.info("%s", line)
                    last_print = time.monotonic()
                time.sleep(0.05)
        finally:
            if live is not None:
                live.stop()
            self.shutdown()
        failed = sorted(rp.rid for rp in self.procs.values() if rp.state == "failed")
        extra = {"failed_replicas": failed, "attempt": self.attempt, "job_restarts": self.job_restarts,
                 "lighthouse_restarts": self.lighthouse_restarts, "relay_restarts": self.relay_restarts,
                 "faults_fired": self.fired,
                 "faults_not_fired": [f.label() for f in self.pending], "gave_up": self.gave_up or None}
        summary = report.write_summary(self.out_dir, extra=extra)
        plot = report.plot_timeline(self.out_dir, num_configured=self.replicas)
        for line in report.describe(summary):
            log.info("%s", line)
        log.info("wrote %s and %s", self.out_dir / "summary.json", plot)
        self.rundir.end_attempt(result="killed_all" if self.killed_all else ("gave up" if self.gave_up else "ended"))
        return summary

    def shutdown(self) -> None:
        for rp in self.procs.values():
            if rp.proc is not None and rp.proc.poll() is None:
                self.kill_replica(rp.rid)
        self._lighthouse_down_ok = True
        self.stop_relays()
        self.stop_standby()
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            lifetime.stop_process(self.lighthouse)
        self._events.close()
        if self._log_handler is not None:
            logging.getLogger("fthsdp").removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None


def _steps(values: list[str] | None, flag: str, p: argparse.ArgumentParser) -> tuple[int, ...] | None:
    if values is None:
        return None
    try:
        return tuple(int(v) for v in values)
    except ValueError:
        p.error(f"{flag} expects a step number, got {values}")



def shape_overrides(args: argparse.Namespace) -> list[str]:
    """The job-shape flags every launcher shares (--replicas, --devices-per-replica,
    --processes-per-replica) as config overrides after the user's own ones."""
    out = list(args.overrides)
    for flag, key in (("replicas", "launch.replicas"), ("devices_per_replica", "launch.devices_per_replica"),
                      ("processes_per_replica", "launch.processes_per_replica")):
        if getattr(args, flag, None) is not None:
            out.append(f"{key}={getattr(args, flag)}")
    return out


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fthsdp run", description="Run a fault-tolerant job locally: a lighthouse "
                                "and N replica processes, with injected faults. Any fault flag on the command "
                                "line replaces the config's fault plan (launch.kill/stop/random_kills).")
    p.add_argument("--config", default=None, help="config name or file (default: ft_local; on --resume, the run's)")
    p.add_argument("--replicas", type=int, default=None, help="overrides launch.replicas")
    p.add_argument("--devices-per-replica", type=int, default=None,
                   help="devices per process of a replica (overrides launch.devices_per_replica)")
    p.add_argument("--processes-per-replica", type=int, default=None,
                   help="processes per replica, one JAX runtime per replica (overrides launch.processes_per_replica)")
    p.add_argument("--kill", action="append", default=None, metavar="REPLICA@STEP", help="SIGKILL a replica at a step")
    p.add_argument("--stop", action="append", default=None, metavar="REPLICA@STEP", help="SIGSTOP a replica at a step")
    p.add_argument("--stop-seconds", type=float, default=3.0, help="SIGCONT a stopped replica after this long")
    p.add_argument("--random-kills", type=int, default=None,
                   help="exactly this many seeded random SIGKILLs (never of the last healthy replica)")
    p.add_argument("--seed", type=int, default=None, help="seed of the random kills")
    p.add_argument("--kill-lighthouse", action="append", default=None, metavar="STEP",
                   help="SIGKILL the launcher's lighthouse at STEP (it is restarted on the same address)")
    p.add_argument("--kill-relay", action="append", default=None, metavar="[INDEX@]STEP",
                   help="SIGKILL the launcher's relay INDEX (default 0, the first) at STEP (launch.relays >= 1; it is "
                        "restarted on the same address, and its replicas come back to it)")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=None,
                   help="restart killed replicas; they rejoin by fetching state from peers (default: launch.restart)")
    p.add_argument("--kill-all", action="append", default=None, metavar="STEP",
                   help="SIGKILL every replica and the lighthouse at STEP and end (then try --resume)")
    p.add_argument("--resume", action="store_true",
                   help="full restart of a job in --out-dir: every replica resumes from the latest persistent "
                        "checkpoint and the loader positions saved with it; the run's config and overrides are "
                        "kept, a different shape is refused, faults that fired are not replayed")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--allreduce", choices=("ftar", "local"), default="ftar")
    p.add_argument("--lighthouse", default=None, metavar="HOST:PORT",
                   help="use this running lighthouse instead of starting one (launch.lighthouse)")
    p.add_argument("--lighthouse-bind", default=None, metavar="HOST:PORT",
                   help="where the launcher's lighthouse listens, port 0 = any (launch.lighthouse_bind)")
    p.add_argument("--lighthouse-advertise", default=None, metavar="HOST",
                   help="host the replicas reach that lighthouse on (launch.lighthouse_advertise)")
    p.add_argument("--bind-host", default=None, metavar="HOST",
                   help="interface the replicas' listeners bind (ft.bind_host; 0.0.0.0 or :: = all)")
    p.add_argument("--advertise-host", default=None, metavar="HOST",
                   help="host the replicas tell each other to connect to (ft.advertise_host)")
    p.add_argument("--hosts", default=None, metavar="H1,H2,...",
                   help="emulated machines: replica r binds and advertises host r mod N (launch.hosts), e.g. "
                        "127.0.0.2,127.0.0.3")
    p.add_argument("--job", default=None, metavar="NAME",
                   help="the job's name at its lighthouse (launch.job_id, default fthsdp): one per job on a shared "
                        "lighthouse; with --secret-file, the JOB its secret was printed for")
    p.add_argument("--secret-file", default=None, metavar="FILE",
                   help="the lighthouse secret for the launcher's own lighthouse (default: a fresh one per job), or "
                        "with --lighthouse the job's secret (`fthsdp lighthouse --print-job-secret JOB`); "
                        "also $FTHSDP_JOB_SECRET_FILE (launch.secret_file)")
    p.add_argument("--lighthouse-tls-cert", default=None, metavar="PEM",
                   help="serve the launcher's own lighthouse over TLS with this certificate chain "
                        "(launch.lighthouse_tls_cert; needs --lighthouse-tls-key and --lighthouse-tls-ca)")
    p.add_argument("--lighthouse-tls-key", default=None, metavar="PEM",
                   help="the private key of --lighthouse-tls-cert (launch.lighthouse_tls_key)")
    p.add_argument("--lighthouse-tls-ca", default=None, metavar="PEM",
                   help="the CA the replicas trust to reach the lighthouse over TLS; a self-signed certificate "
                        "is its own CA (ft.lighthouse_tls_ca)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", help="section.field=value")
    args = p.parse_args(argv)

    from fthsdp import config as config_lib
    from fthsdp import logs

    new_overrides = shape_overrides(args)
    for flag, key in (("job", "launch.job_id"), ("lighthouse", "launch.lighthouse"),
                      ("lighthouse_bind", "launch.lighthouse_bind"),
                      ("lighthouse_advertise", "launch.lighthouse_advertise"), ("bind_host", "ft.bind_host"),
                      ("advertise_host", "ft.advertise_host"), ("hosts", "launch.hosts"),
                      ("secret_file", "launch.secret_file"), ("lighthouse_tls_cert", "launch.lighthouse_tls_cert"),
                      ("lighthouse_tls_key", "launch.lighthouse_tls_key"),
                      ("lighthouse_tls_ca", "ft.lighthouse_tls_ca")):
        if getattr(args, flag) is not None:
            new_overrides.append(f"{key}={getattr(args, flag)}")
    config_name, overrides = args.config or "ft_local", new_overrides
    saved: dict = {}
    out: pathlib.Path | None = None
    if args.resume:
        if args.out_dir is None:
            try:
                out = pathlib.Path(config_lib.load(config_name, new_overrides).train.out_dir)
            except ValueError as e:
                p.error(str(e))
        else:
            out = pathlib.Path(args.out_dir)
        saved = rundir_lib.RunDir(out).load()
        if not (out / "checkpoints").is_dir() and not saved:
            p.error(f"--resume: no run in {out} (no run.json, no checkpoints); run the job first (or pass its "
                    "--out-dir)")
        if saved:
            config_name = args.config or saved["config"]
            overrides = rundir_lib.merge_overrides(saved.get("overrides", []), new_overrides)
    try:
        cfg = config_lib.load(config_name, overrides)
    except ValueError as e:
        p.error(str(e))
    out = out or pathlib.Path(args.out_dir or cfg.train.out_dir)
    if saved.get("effective"):
        diffs = rundir_lib.shape_differences(saved["effective"], rundir_lib.effective(cfg))
        if diffs:
            p.error(f"--resume: the run in {out} has a different shape; " + "; ".join(diffs)
                    + ". Resume with the run's own shape (drop those overrides), or start a new run in another "
                    "--out-dir")

    sources = choose_sources(args.kill, args.stop, args.random_kills, _steps(args.kill_lighthouse,
                             "--kill-lighthouse", p), _steps(args.kill_all, "--kill-all", p),
                             cfg.launch.kill, cfg.launch.stop, cfg.launch.random_kills, args.kill_relay)
    try:
        faults = plan(sources.kills, sources.stops, cfg.launch.replicas, random_count=sources.random_count,
                      steps=cfg.train.steps, seed=args.seed if args.seed is not None else cfg.launch.fault_seed,
                      stop_s=args.stop_seconds, lighthouse=sources.lighthouse, kill_all=sources.kill_all,
                      relay=sources.relay, relays=cfg.launch.relays)
    except ValueError as e:
        p.error(str(e))
    bad = [f.label() for f in faults if f.process >= cfg.launch.processes_per_replica]
    if bad:
        p.error(f"{', '.join(bad)}: a replica has processes 0..{cfg.launch.processes_per_replica - 1} "
                "(launch.processes_per_replica)")
    if cfg.launch.lighthouse and any(f.kind == "lighthouse" for f in faults):
        p.error(f"--kill-lighthouse: the job uses the external lighthouse {cfg.launch.lighthouse} "
                "(launch.lighthouse), which the launcher does not own; drop one of the two")
    out.mkdir(parents=True, exist_ok=True)
    try:
        held = rundir_lib.hold(out)  # for the launcher's lifetime (job.run_dir_lock)
    except rundir_lib.RunDirBusy as e:
        p.error(str(e))
    resume = ""
    if args.resume:
        resume = f"restart-{int(time.time())}"
        if saved and sources.origin == "config":
            # the run's own plan, less what already fired: a resume does not replay faults
            planned = [Fault.from_json(d) for d in saved.get("faults", [])]
            for d in saved.get("fired", []):
                f = Fault.from_json(d)
                if f in planned:
                    planned.remove(f)
            faults = sorted(planned)
            sources = sources.__class__(**{**sources.__dict__, "origin": "the run (less the fired faults)"})
        rundir_lib.RunDir(out).update(overrides=overrides, config=config_name,
                                      effective=saved.get("effective") or rundir_lib.effective(cfg),
                                      faults=[f.to_json() for f in faults])
    else:
        rundir_lib.clean_for_fresh_run(out)
        rundir_lib.RunDir(out).save({"config": config_name, "overrides": overrides,
                                     "effective": rundir_lib.effective(cfg),
                                     "faults": [f.to_json() for f in faults], "fired": [], "attempts": []})
    logs.setup("fthsdp.launch")
    job = LocalJob(config=config_name, overrides=overrides, out_dir=out, replicas=cfg.launch.replicas,
                   steps=cfg.train.steps, faults=faults, job_id=cfg.launch.job_id,
                   restart=cfg.launch.restart if args.restart is None else args.restart,
                   restart_delay_s=cfg.launch.restart_delay_s, resume=resume, allreduce=args.allreduce,
                   deadline_s=cfg.launch.deadline_s,
                   max_job_restarts=cfg.launch.max_job_restarts,
                   detect_s=cfg.ft.detect_s, join_timeout_s=cfg.ft.join_timeout_s,
                   external_lighthouse=cfg.launch.lighthouse, lighthouse_bind=cfg.launch.lighthouse_bind,
                   lighthouse_advertise=cfg.launch.lighthouse_advertise, hosts=tuple(cfg.launch.hosts),
                   processes=cfg.launch.processes_per_replica, devices=cfg.launch.devices_per_replica,
                   secret_file=cfg.launch.secret_file,
                   lighthouse_tls=(cfg.launch.lighthouse_tls_cert, cfg.launch.lighthouse_tls_key),
                   lighthouse_calls_per_s=cfg.launch.lighthouse_connection_calls_per_s,
                   lighthouse_beats_per_s=cfg.launch.lighthouse_beats_per_s,
                   relays=cfg.launch.relays, relay_placement=cfg.launch.relay_placement,
                   lighthouse_tls_ca=cfg.ft.lighthouse_tls_ca, lighthouse_standby=cfg.launch.lighthouse_standby,
                   progress=not args.no_progress and sys.stderr.isatty())
    job.run_dir_lock = held
    log.info("job: %d replicas x %d devices, %d steps, faults (from %s) %s; logs in %s", cfg.launch.replicas,
             cfg.launch.devices_per_replica, cfg.train.steps, sources.origin,
             [f.label() for f in faults] or "none", out)
    lifetime.exit_on_termination_signals()  # a SIGTERM'd launcher still stops its replicas
    try:
        summary = job.run()
    except lifetime.Terminated as e:
        log.warning("the launcher was stopped by a signal (exit %s); its replicas and lighthouse were stopped; "
                    "resume with: %s", e.code, job.resume_hint())
        raise
    except KeyboardInterrupt:  # (no traceback: the job was stopped as asked)
        log.warning("interrupted: the replicas and lighthouse were stopped; resume with: %s", job.resume_hint())
        return 130
    if job.killed_all:
        log.info("every process was killed at step %s; resume with: %s",
                 job.fired[-1].get("at_step") if job.fired else "?", job.resume_hint())
        return 0
    if job.gave_up:
        return 4
    if summary["failed_replicas"]:
        log.info("resume the job from its latest checkpoint with: %s", job.resume_hint())
        return 1
    return 0 if summary["identical_final_state"] else 3
