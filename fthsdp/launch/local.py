"""`fthsdp run`: a lighthouse and N replica processes on this machine, with real faults.

The launcher owns processes and signals only; what the replicas did is read
back from their files (fthsdp/launch/report.py). Faults are real: SIGKILL for
a dead machine, SIGSTOP/SIGCONT for a hung one. With `--restart`, a killed
replica is started again and rejoins by fetching state from its peers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from fthsdp.launch.faults import Fault, plan

log = logging.getLogger("fthsdp.launch")


@dataclass
class ReplicaProc:
    rid: int
    proc: subprocess.Popen | None = None
    state: str = "starting"  # starting / running / killed / stopped / done / failed
    restarts: int = 0
    cont_at: float | None = None
    restart_at: float | None = None
    log_path: pathlib.Path | None = None


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
    deadline_s: float = 900.0
    progress: bool = True
    hash_every: int = 1
    resume: str = ""  # full restart id: replicas resume from the latest persistent checkpoint
    kill_all_at: int | None = None  # SIGKILL every process once a replica reaches this step
    late: dict[int, float] = field(default_factory=dict)  # replica -> start it this many seconds after the others
    procs: dict[int, ReplicaProc] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.resume:
            archive_previous_attempt(self.out_dir, self.resume)
        self.pending = sorted(self.faults)
        self._events = open(self.out_dir / "events.jsonl", "a", buffering=1)
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_addr = ""
        self.token = secrets.token_hex(16)  # the job's shared secret for peer state transfer
        self.killed_all = False

    # -- bookkeeping ---------------------------------------------------------

    def event(self, kind: str, replica: int | None = None, **extra) -> None:
        rec = {"time": time.time(), "kind": kind, "replica": replica, **extra}
        self._events.write(json.dumps(rec) + "\n")
        log.info("%s%s %s", kind, f" replica {replica}" if replica is not None else "",
                 " ".join(f"{k}={v}" for k, v in extra.items()))

    def status(self, rid: int) -> dict:
        try:
            return json.loads((self.out_dir / f"status-{rid}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def _env(self) -> dict:
        env = dict(os.environ)
        env.setdefault("FTHSDP_COMPILATION_CACHE", str(pathlib.Path.home() / ".cache" / "fthsdp" / "xla"))
        env["PYTHONUNBUFFERED"] = "1"
        env["FTHSDP_PEER_TOKEN"] = self.token
        return env

    # -- processes -----------------------------------------------------------

    def start_lighthouse(self) -> None:
        port_file = self.out_dir / "lighthouse.port"
        port_file.unlink(missing_ok=True)
        logf = open(self.out_dir / "lighthouse.log", "w")
        self.lighthouse = subprocess.Popen(
            [sys.executable, "-m", "fthsdp.lighthouse", "--bind", "127.0.0.1:0", "--port-file", str(port_file),
             "--detect", str(self.detect_s), "--join-timeout", str(self.join_timeout_s),
             "--replicas", str(self.replicas)],
            stdout=logf, stderr=subprocess.STDOUT, env=self._env(), start_new_session=True)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.lighthouse.poll() is not None:
                raise RuntimeError(f"the lighthouse exited with {self.lighthouse.returncode}; see "
                                   f"{self.out_dir / 'lighthouse.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError("the lighthouse did not start listening within 60 s")
            time.sleep(0.05)
        self.lighthouse_addr = f"127.0.0.1:{port_file.read_text().strip()}"
        self.event("lighthouse", address=self.lighthouse_addr)

    def start_replica(self, rid: int, rejoin: bool = False) -> None:
        rp = self.procs.setdefault(rid, ReplicaProc(rid))
        rp.log_path = self.out_dir / f"replica-{rid}.out"
        logf = open(rp.log_path, "a")
        rp.proc = subprocess.Popen(
            [sys.executable, "-m", "fthsdp.replica", "--config", self.config, "--replica-id", str(rid),
             "--lighthouse", self.lighthouse_addr, "--job", self.job_id, "--out-dir", str(self.out_dir),
             "--allreduce", self.allreduce, "--hash-every", str(self.hash_every),
             *(["--resume", self.resume] if self.resume and rp.restarts == 0 else []),
             *(["--rejoin"] if rejoin else []), *self.overrides],
            stdout=logf, stderr=subprocess.STDOUT, env=self._env(), start_new_session=True)
        rp.state = "running"
        rp.restart_at = None

    def signal_replica(self, rid: int, sig: int) -> None:
        rp = self.procs[rid]
        if rp.proc is not None and rp.proc.poll() is None:
            os.kill(rp.proc.pid, sig)

    # -- main loop -------------------------------------------------------------

    def apply_faults(self) -> None:
        now = time.time()
        if self.kill_all_at is not None and not self.killed_all and self._max_step() >= self.kill_all_at:
            step = self._max_step()
            for rp in self.procs.values():
                self.signal_replica(rp.rid, signal.SIGKILL)
                rp.state, rp.restart_at = "killed", None
            if self.lighthouse is not None:
                self.lighthouse.kill()
            self.killed_all = True
            self.event("kill_all", None, step=step)
            return
        for rp in self.procs.values():
            if rp.state == "stopped" and rp.cont_at is not None and now >= rp.cont_at:
                self.signal_replica(rp.rid, signal.SIGCONT)
                rp.state, rp.cont_at = "running", None
                self.event("cont", rp.rid)
            if rp.state == "killed" and rp.restart_at is not None and now >= rp.restart_at:
                if rp.restarts >= 0 and not any(o.state in ("running", "stopped") for o in self.procs.values()
                                                if o.rid != rp.rid):
                    rp.restart_at = None
                    self.event("no_restart", rp.rid, reason="no other replica is running to rejoin")
                    continue
                rp.restarts += 1
                self.event("restart" if rp.restarts else "late_start", rp.rid, step=self._max_step())
                self.start_replica(rp.rid, rejoin=True)
        while self.pending:
            f = self.pending[0]
            rp = self.procs.get(f.replica)
            step = self.status(f.replica).get("step", 0)
            if rp is None or rp.state != "running" or step < f.step:
                break
            self.pending.pop(0)
            if f.kind == "kill":
                self.signal_replica(f.replica, signal.SIGKILL)
                rp.proc.wait(10)
                rp.state = "killed"
                self.event("kill", f.replica, step=step)
                if self.restart:
                    rp.restart_at = time.time() + self.restart_delay_s
            else:
                self.signal_replica(f.replica, signal.SIGSTOP)
                rp.state, rp.cont_at = "stopped", time.time() + f.stop_s
                self.event("stop", f.replica, step=step, seconds=f.stop_s)

    def _max_step(self) -> int:
        return max((self.status(r).get("step", 0) for r in self.procs), default=0)

    def reap(self) -> None:
        for rp in self.procs.values():
            if rp.state in ("running", "starting") and rp.proc is not None and rp.proc.poll() is not None:
                rc = rp.proc.returncode
                rp.state = "done" if rc == 0 else "failed"
                self.event("exit", rp.rid, returncode=rc)
                if rc != 0:
                    tail = rp.log_path.read_text().splitlines()[-15:] if rp.log_path else []
                    log.error("replica %d exited with %d; last lines of %s:\n%s", rp.rid, rc, rp.log_path,
                              "\n".join(tail))

    def status_line(self) -> str:
        parts = []
        for rid in sorted(self.procs):
            rp, st = self.procs[rid], self.status(rid)
            if rp.state in ("killed", "stopped", "failed"):
                parts.append(f"r{rid}: {rp.state.upper()}")
                continue
            loss = st.get("loss")
            parts.append(f"r{rid}: step {st.get('step', 0):>4} "
                         f"{'loss %.3f' % loss if loss is not None else 'loss  -   '} "
                         f"q{st.get('quorum_id', '-')} {st.get('members', [])} {st.get('state', rp.state)}")
        return " | ".join(parts)

    def finished(self) -> bool:
        live = [rp for rp in self.procs.values() if rp.state in ("running", "starting", "stopped")]
        waiting_restart = any(rp.restart_at is not None for rp in self.procs.values())
        return not live and not waiting_restart

    def run(self) -> dict:
        from fthsdp.launch import report

        self.start_lighthouse()
        for rid in range(self.replicas):
            if rid in self.late:
                rp = self.procs.setdefault(rid, ReplicaProc(rid, state="killed"))
                rp.restart_at = time.time() + self.late[rid]
                rp.restarts = -1  # becomes 0 at its first start, which joins as a late joiner
                continue
            self.start_replica(rid)
        t0 = time.monotonic()
        last_print = 0.0
        live = None
        if self.progress:
            from rich.live import Live

            live = Live("", refresh_per_second=4, transient=False)
            live.start()
        try:
            while not self.finished():
                if time.monotonic() - t0 > self.deadline_s:
                    raise RuntimeError(f"the job did not finish within {self.deadline_s:.0f} s; logs in {self.out_dir}")
                self.apply_faults()
                self.reap()
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
        summary = report.write_summary(self.out_dir)
        plot = report.plot_timeline(self.out_dir, num_configured=self.replicas)
        for line in report.describe(summary):
            log.info("%s", line)
        log.info("wrote %s and %s", self.out_dir / "summary.json", plot)
        failed = [rp.rid for rp in self.procs.values() if rp.state == "failed"]
        summary["failed_replicas"] = failed
        return summary

    def shutdown(self) -> None:
        for rp in self.procs.values():
            if rp.proc is not None and rp.proc.poll() is None:
                try:
                    os.kill(rp.proc.pid, signal.SIGCONT)
                    rp.proc.kill()
                    rp.proc.wait(10)
                except ProcessLookupError:
                    pass
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            self.lighthouse.terminate()
            try:
                self.lighthouse.wait(10)
            except subprocess.TimeoutExpired:
                self.lighthouse.kill()
        self._events.close()


def archive_previous_attempt(out: pathlib.Path, name: str) -> pathlib.Path:
    """Moves the per-attempt files of a previous run aside (ledgers, loader states
    and checkpoints stay: the resumed run continues them)."""
    dest = out / "attempts" / name
    dest.mkdir(parents=True, exist_ok=True)
    for pattern in ("metrics-*.jsonl", "status-*.json", "events.jsonl", "replica-*.out", "replica-*.log",
                    "summary.json", "timeline.png", "lighthouse.*", "launch.log"):
        for f in out.glob(pattern):
            shutil.move(str(f), dest / f.name)
    return dest


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fthsdp run", description="Run a fault-tolerant job locally: a lighthouse "
                                "and N replica processes, with injected faults.")
    p.add_argument("--config", default="ft_local")
    p.add_argument("--replicas", type=int, default=None, help="overrides launch.replicas")
    p.add_argument("--devices-per-replica", type=int, default=None, help="overrides launch.devices_per_replica")
    p.add_argument("--kill", action="append", default=None, metavar="REPLICA@STEP", help="SIGKILL a replica at a step")
    p.add_argument("--stop", action="append", default=None, metavar="REPLICA@STEP", help="SIGSTOP a replica at a step")
    p.add_argument("--stop-seconds", type=float, default=3.0, help="SIGCONT a stopped replica after this long")
    p.add_argument("--random-kills", type=int, default=None, help="this many seeded random SIGKILLs")
    p.add_argument("--seed", type=int, default=None, help="seed of the random kills")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=None,
                   help="restart killed replicas; they rejoin by fetching state from peers (default: launch.restart)")
    p.add_argument("--kill-all", type=int, default=None, metavar="STEP",
                   help="SIGKILL every replica and the lighthouse at STEP (then try --resume)")
    p.add_argument("--resume", action="store_true",
                   help="full restart of a job in --out-dir: every replica resumes from the latest persistent "
                        "checkpoint and the loader positions saved with it")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--allreduce", choices=("ftar", "local"), default="ftar")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", help="section.field=value")
    args = p.parse_args(argv)

    from fthsdp import config as config_lib
    from fthsdp import logs

    overrides = list(args.overrides)
    if args.replicas is not None:
        overrides.append(f"launch.replicas={args.replicas}")
    if args.devices_per_replica is not None:
        overrides.append(f"launch.devices_per_replica={args.devices_per_replica}")
    try:
        cfg = config_lib.load(args.config, overrides)
    except ValueError as e:
        p.error(str(e))
    kills = tuple(args.kill) if args.kill is not None else cfg.launch.kill
    stops = tuple(args.stop) if args.stop is not None else cfg.launch.stop
    try:
        faults = plan(kills, stops, cfg.launch.replicas,
                      random_count=args.random_kills if args.random_kills is not None else cfg.launch.random_kills,
                      steps=cfg.train.steps, seed=args.seed if args.seed is not None else cfg.launch.fault_seed,
                      stop_s=args.stop_seconds)
    except ValueError as e:
        p.error(str(e))
    out = pathlib.Path(args.out_dir or cfg.train.out_dir)
    resume = ""
    if args.resume:
        if not (out / "checkpoints").is_dir():
            p.error(f"--resume: no checkpoints under {out / 'checkpoints'}; run the job first (or pass its --out-dir)")
        resume = f"restart-{int(time.time())}"
    elif out.exists():
        for pattern in ("metrics-*.jsonl", "status-*.json", "events.jsonl", "replica-*.out", "replica-*.log",
                        "ledger/*.jsonl", "loader_state/*.json"):
            for f in out.glob(pattern):
                f.unlink()
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    logs.setup("fthsdp.launch", file=str(out / "launch.log"))
    job = LocalJob(config=args.config, overrides=overrides, out_dir=out, replicas=cfg.launch.replicas,
                   steps=cfg.train.steps, faults=faults,
                   restart=cfg.launch.restart if args.restart is None else args.restart,
                   restart_delay_s=cfg.launch.restart_delay_s, resume=resume, allreduce=args.allreduce,
                   kill_all_at=args.kill_all,
                   detect_s=cfg.ft.detect_s, join_timeout_s=cfg.ft.join_timeout_s,
                   progress=not args.no_progress and sys.stderr.isatty())
    log.info("job: %d replicas x %d devices, %d steps, faults %s; logs in %s", cfg.launch.replicas,
             cfg.launch.devices_per_replica, cfg.train.steps,
             [f"{f.kind} r{f.replica}@{f.step}" for f in faults] or "none", out)
    summary = job.run()
    if job.killed_all:
        log.info("every process was killed at step %s; resume with: fthsdp run --resume --out-dir %s --config %s",
                 args.kill_all, out, args.config)
        return 0
    if summary["failed_replicas"]:
        return 1
    return 0 if summary["identical_final_state"] else 3
