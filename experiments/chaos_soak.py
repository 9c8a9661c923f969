"""Chaos soak: a long seeded run through the public launcher under many real faults,
checked afterwards from the run's own artifacts.

    python experiments/chaos_soak.py [--quick] [--seed S] [--relays K] [--out DIR]

The job runs under `fthsdp run`'s Python entry (LocalJob: its lighthouse
supervision, restarts and whole-job fallback are what is being soaked). A
chaos thread, seeded, injects faults as an operator's bad day would, timed to
the replicas' phases it can see from outside (processes, their logs, the
checkpoint folder):

* kill_healthy / stop_healthy   SIGKILL / SIGSTOP(+SIGCONT) of a replica that is training
* kill_catching_up / stop_catching_up  the same, of a restarted replica that has
                                not rejoined yet (compiled, waiting or fetching)
* kill_fetch_dest               a rejoiner while its quorum says it is behind (fetching)
* kill_fetch_source             a healthy replica while a rejoiner fetches from it
* kill_mid_checkpoint           the checkpoint writer while an async checkpoint is in flight
* kill_lighthouse               SIGKILL of the launcher's lighthouse (it restarts it)
* whole_job_kill                SIGKILL of every replica (the launcher falls back to the checkpoint)
* cpu_hog                       a busy process competing for the cores for a few seconds
* kill_relay / stop_relay       with --relays K: SIGKILL of one of the launcher's relays (it
                                restarts it on its address) / SIGSTOP(+SIGCONT) of one: its
                                block's processes leave it and speak to the lighthouse directly

Fetches are slowed with ft.peer_serve_cap_gbps so that "mid-fetch" is a
window that can be hit. The faults go to faults.jsonl in the run directory.

Then, from the artifacts only (step records with state hashes, ledgers, done
records, events), it checks:
  1  identical states after every commit (per attempt: a fallback re-runs steps)
  2  every batch trained exactly once (the ledgers, over all attempts)
  3  no step waited past its deadline (2 all-reduce deadlines + the detection
     window, not counting time the replica itself was stopped or the lighthouse was down)
  4  one compilation per process (done records)
  5  a process never signalled is never behind after its first step
  6  the job finished (a replica done at the last step; the launcher reports no failure)
and writes JSON: faults (counts per kind), violations (each naming invariant,
replica, step), steps, finished, plus timings.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16",
        "data.seq_len=16", "data.batch_size=8", "data.corpus_bytes=65536", "train.eval_every=0"]
ALLREDUCE_S, DETECT_S = 6.0, 0.8


class Chaos:
    """The seeded fault injector: a thread that watches the job and signals its processes."""

    def __init__(self, job, rng: random.Random, target: int, steps: int, ckpt_every: int, log_path: pathlib.Path,
                 gap_s: tuple[float, float], whole_job_kills: int, lighthouse_gap: int = 20):
        self.job, self.rng, self.target, self.steps, self.ckpt_every = job, rng, target, steps, ckpt_every
        self.gap_s, self.whole_left, self.lighthouse_gap = gap_s, whole_job_kills, lighthouse_gap
        self.log = open(log_path, "a", buffering=1)
        self.counts: collections.Counter = collections.Counter()
        self.stopped: dict[int, float] = {}  # pid -> SIGCONT time
        self.stopped_relays: dict[int, float] = {}  # a relay's pid -> SIGCONT time
        self.hogs: list[tuple[subprocess.Popen, float]] = []
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self._log_offsets: dict[int, int] = {}  # pid -> offset of its replica log at first sight
        # a replica whose restart was just killed is spared next time, so it does rejoin
        self.spared: set[int] = set()  # pids
        self.spared_next: set[int] = set()  # replicas whose next process is spared
        self.killed_pids: set[int] = set()
        self.last_lighthouse_kill = -100
        self.whole_at = int(steps * 0.45)

    # -- what the chaos can see ------------------------------------------------------

    def procs(self):
        return [rp for rp in list(self.job.procs.values()) if rp.proc is not None and rp.proc.poll() is None]

    def healthy(self):
        """The launcher's own rule (live, committed, at the latest step), less what we stopped."""
        from fthsdp.launch import supervise

        ok = supervise.healthy(self.job.views())
        return [rp for rp in self.procs() if rp.rid in ok and rp.proc.pid not in self.stopped]

    def new_log(self, rp) -> str:
        """What this process wrote to its replica log (the file is shared by its predecessors)."""
        path = self.job.out_dir / f"replica-{rp.rid}.log"
        pid = rp.proc.pid
        if pid not in self._log_offsets:  # first sight: right after its spawn (it compiles for seconds)
            self._log_offsets[pid] = path.stat().st_size if rp.mode == "rejoin" and path.exists() else 0
        try:
            with open(path) as f:
                f.seek(self._log_offsets[pid])
                return f.read()
        except FileNotFoundError:
            return ""

    def rejoining(self):
        """Restarted processes that have not committed: (replica, phase) with phase
        compiling / waiting (compiled, not behind yet) / fetching (its quorum says behind)."""
        out = []
        for rp in self.procs():
            if rp.mode != "rejoin" or rp.progressed or rp.proc.pid in self.stopped or rp.proc.pid in self.spared:
                continue
            text = self.new_log(rp)
            if "caught up" in text:
                continue
            phase = "compiling"
            if "compiled the step" in text:
                phase = "fetching" if f"'{rp.rid}'" in text.split("behind=")[-1][:60] and "behind=" in text \
                    else "waiting"
            out.append((rp, phase))
        return out

    def step(self) -> int:
        return max((p for p in self.job.progress_by_replica().values() if p is not None), default=0)

    # -- acting ------------------------------------------------------------------------

    def record(self, kind: str, rp=None, **extra) -> None:
        self.counts[kind] += 1
        rec = {"time": time.time(), "kind": kind, "replica": rp.rid if rp else None,
               "pid": rp.proc.pid if rp else None, "step": self.step(), **extra}
        self.log.write(json.dumps(rec) + "\n")
        print(f"chaos: {kind} {'r%d' % rp.rid if rp else ''} at step {rec['step']}", file=sys.stderr, flush=True)

    def checkpoint_window(self, healthy) -> bool:
        """The writer (lowest healthy id) has just committed a checkpoint step: its
        async save is in flight."""
        if not healthy:
            return False
        writer = min(healthy, key=lambda rp: rp.rid)
        st = self.job.live_status(writer.rid)
        return bool(st) and st.get("step", 0) > 0 and st["step"] % self.ckpt_every == 0

    def kill(self, kind: str, rp) -> None:
        if kind in ("kill_catching_up", "kill_fetch_dest"):
            self.spared_next.add(rp.rid)
        self.killed_pids.add(rp.proc.pid)
        try:
            os.kill(rp.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.record(kind, rp)

    def stop(self, kind: str, rp, seconds: float) -> None:
        try:
            os.kill(rp.proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        self.stopped[rp.proc.pid] = time.time() + seconds
        self.record(kind, rp, seconds=seconds)

    def relay_fault(self, kind: str, index: int) -> None:
        """A relay killed (the launcher restarts it) or stopped for a while: its block's processes
        are cut off from the lighthouse until they leave it (RelayPath: ~0.3 s for broken streams,
        SILENCE_S of silence), so the check excuses them as if signalled, for that long."""
        from fthsdp.control.relay import relay_index
        from fthsdp.control.session_client import RelayPath

        relay = self.job.relay_procs[index]
        n = len(self.job.relay_procs)
        block = [rp for rp in self.procs() if relay_index(n, rp.rid, self.job.replicas) == index]
        now = time.time()
        try:
            os.kill(relay.pid, signal.SIGKILL if kind == "kill_relay" else signal.SIGSTOP)
        except ProcessLookupError:
            return
        if kind == "stop_relay":
            seconds = self.rng.uniform(1.0, 4.0)
            self.stopped_relays[relay.pid] = now + seconds
            until = now + seconds + RelayPath.SILENCE_S + 1.0
        else:
            seconds, until = 0.0, now + 2.0
        pids = [rp.proc.pid for rp in block] + [f.pid for rp in block for f in rp.followers]
        self.record(kind, index=index, seconds=seconds, until=until, pids=pids)

    def wake(self, force: bool = False) -> None:
        for pid, at in list(self.stopped.items()):
            if force or time.time() >= at:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                self.stopped.pop(pid)
                self.log.write(json.dumps({"time": time.time(), "kind": "cont", "pid": pid}) + "\n")
        for pid, at in list(self.stopped_relays.items()):
            if force or time.time() >= at:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                self.stopped_relays.pop(pid)
        for hog, until in list(self.hogs):
            if force or time.time() >= until:
                hog.kill()
                hog.wait()
                self.hogs.remove((hog, until))

    def try_fault(self) -> bool:
        """One fault that the job's current phase allows; False if none does now."""
        rng, healthy, rejoin = self.rng, self.healthy(), self.rejoining()
        options: list[tuple[str, float]] = []
        spare = len(healthy) >= 2  # never take the last healthy replica (except a whole-job kill)
        if spare:
            options += [("kill_healthy", 3), ("stop_healthy", 2)]
            if self.checkpoint_window(healthy):
                options.append(("kill_mid_checkpoint", 6))
        fetching = [rp for rp, ph in rejoin if ph == "fetching"]
        if fetching:
            options.append(("kill_fetch_dest", 8))
            if spare:
                options.append(("kill_fetch_source", 8))
        if any(ph in ("waiting", "compiling") for _, ph in rejoin):
            options += [("kill_catching_up", 3), ("stop_catching_up", 2)]
        if self.job.lighthouse is not None and self.job.lighthouse.poll() is None \
                and self.step() >= self.last_lighthouse_kill + self.lighthouse_gap:  # one outage at a time
            options.append(("kill_lighthouse", 1))
        if not self.counts["kill_lighthouse"] and self.step() >= self.steps // 4 and options:
            options = [("kill_lighthouse", 1)]  # at least one in every run
        if self.whole_left and healthy and self.step() >= self.whole_at:
            options = [("whole_job_kill", 1)]  # due: every replica at once, whatever its phase
        if not self.hogs:
            options.append(("cpu_hog", 1))
        relays = [i for i, p in enumerate(self.job.relay_procs) if p is not None and p.poll() is None]
        if relays and not self.stopped_relays:
            options += [("kill_relay", 1), ("stop_relay", 1)]
        if not options:
            return False
        # kinds not seen yet first, so that even a short run covers each kind it can
        weights = [w * (4 if self.counts[k] == 0 else 1) for k, w in options]
        kind = rng.choices([k for k, _ in options], weights=weights)[0]
        if kind == "kill_healthy":
            self.kill(kind, rng.choice(healthy))
        elif kind == "stop_healthy":
            self.stop(kind, rng.choice(healthy), rng.uniform(1.0, 2.5))
        elif kind == "kill_mid_checkpoint":
            self.kill(kind, min(healthy, key=lambda rp: rp.rid))  # the writer: the lowest healthy id
        elif kind == "kill_fetch_dest":
            self.kill(kind, rng.choice(fetching))
        elif kind == "kill_fetch_source":
            self.kill(kind, rng.choice(healthy))
        elif kind == "kill_catching_up":
            self.kill(kind, rng.choice([rp for rp, ph in rejoin if ph != "fetching"]))
        elif kind == "stop_catching_up":
            self.stop(kind, rng.choice([rp for rp, ph in rejoin if ph != "fetching"]), rng.uniform(1.0, 2.0))
        elif kind == "kill_lighthouse":
            self.last_lighthouse_kill = self.step()
            self.job.lighthouse.kill()
            self.record(kind)
        elif kind == "whole_job_kill":
            for rp in self.procs():
                try:
                    os.kill(rp.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.whole_left -= 1
            self.whole_at = self.step() + (self.steps - self.step()) // 2
            self.record(kind)
        elif kind in ("kill_relay", "stop_relay"):
            self.relay_fault(kind, rng.choice(relays))
        elif kind == "cpu_hog":
            secs = rng.uniform(1.5, 3.0)
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            self.hogs.append((hog, time.time() + secs))
            self.record(kind, seconds=secs)
        return True

    def loop(self) -> None:
        next_at = time.time() + self.rng.uniform(*self.gap_s)
        while not self.halt.is_set():
            self.wake()
            s = self.step()
            for rp in self.procs():  # the process after a killed rejoin is let through
                if rp.rid in self.spared_next and rp.mode == "rejoin" and not rp.progressed \
                        and rp.proc.pid not in self.killed_pids:
                    self.spared.add(rp.proc.pid)
                    self.spared_next.discard(rp.rid)
            fetch_window = any(ph == "fetching" for _, ph in self.rejoining()) or (
                self.counts["kill_mid_checkpoint"] < 2 and len(self.healthy()) >= 2
                and self.checkpoint_window(self.healthy()))
            if s >= self.steps - 15:
                break  # let the job finish: faults at its very end only test the finish line
            if (time.time() >= next_at or (fetch_window and self.rng.random() < 0.5)) and s > 3:
                if self.try_fault():
                    next_at = time.time() + self.rng.uniform(*self.gap_s)
            time.sleep(0.05)
        self.wake(force=True)

    def close(self) -> None:
        self.halt.set()
        self.thread.join(30)
        self.wake(force=True)
        self.log.close()


# -- the checks, from artifacts only ---------------------------------------------------------


def attempt_dirs(out: pathlib.Path) -> list[pathlib.Path]:
    doc = json.loads((out / "run.json").read_text())
    ns = [a["n"] for a in doc.get("attempts", [])]
    return [out / "attempts" / str(n) for n in ns[:-1]] + [out]


def check(out: pathlib.Path, steps: int, summary: dict) -> tuple[list[dict], dict]:
    from fthsdp.data.ledger import check_exactly_once
    from fthsdp.launch import report
    from fthsdp.logs import read_metrics

    violations: list[dict] = []

    def bad(inv: int, replica, step, detail: str) -> None:
        violations.append({"invariant": inv, "replica": replica, "step": step, "detail": detail})

    chaos = read_metrics(out / "faults.jsonl") if (out / "faults.jsonl").exists() else []
    stops: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)  # pid -> stop windows
    conts = {c["pid"]: c["time"] for c in chaos if c["kind"] == "cont"}
    signalled = {c["pid"] for c in chaos if c.get("pid")}
    for c in chaos:
        if c["kind"] in ("kill_relay", "stop_relay"):  # the block's processes: cut off for a while
            signalled.update(c["pids"])
            for pid in c["pids"]:
                stops[pid].append((c["time"], c["until"]))
        elif c["kind"].startswith("stop"):
            stops[c["pid"]].append((c["time"], conts.get(c["pid"], c["time"] + c.get("seconds", 0))))
    lighthouse_down: list[tuple[float, float]] = []
    runs = [(d, report.load_run(d)) for d in attempt_dirs(out)]
    for _, run in runs:
        kills = [e["time"] for e in run.events if e["kind"] in ("kill_lighthouse",)]
        kills += [c["time"] for c in chaos if c["kind"] == "kill_lighthouse"]
        for e in run.events:
            if e["kind"] == "lighthouse_restart":
                before = [k for k in kills if k <= e["time"]]
                lighthouse_down.append((max(before) if before else e["time"] - e.get("restart_s", 0), e["time"]))

    def overlap(a0, a1, windows) -> float:
        return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in windows)

    final_positions = None
    for d, run in runs:
        # 1: identical bytes after every commit, within the attempt
        # (a forked replica's commits that it rolled back when fenced are not in the lineage)
        for step, hashes in sorted(report.hashes_after_commits(run).items()):
            if len(set(hashes.values())) > 1:
                bad(1, sorted(hashes), step, f"attempt {d.name}: hashes differ {hashes}")
        by_pid: dict[int, list[dict]] = collections.defaultdict(list)
        for recs in run.steps.values():
            for r in recs:
                by_pid[r["pid"]].append(r)
        for pid, recs in by_pid.items():
            for r in recs[1:]:
                # 3: no wait past a deadline
                took = r["end"] - r["start"]
                excused = overlap(r["start"], r["end"], stops.get(pid, [])) + overlap(r["start"], r["end"],
                                                                                      lighthouse_down)
                if took - excused > 2 * ALLREDUCE_S + DETECT_S:
                    bad(3, r["replica"], r["step"], f"step took {took:.1f}s ({excused:.1f}s excused)")
                # 5: a process nobody signalled is never behind after its first step
                if not r["healthy"] and pid not in signalled:
                    bad(5, r["replica"], r["step"], f"pid {pid} was never signalled but was behind")
        # 4: one compilation per process
        for rid, done in run.done.items():
            if done.get("compilations") != {"compute_grads": 1, "apply_grads": 1}:
                bad(4, rid, done.get("step"), f"compilations {done.get('compilations')}")
        if run.done:
            final_positions = next(iter(run.done.values()))["positions"]
    last = runs[-1][1]
    # 6: the job finished
    finished = bool(last.done) and all(d["step"] == steps for d in last.done.values()) \
        and not summary.get("failed_replicas") and not summary.get("gave_up")
    if not finished:
        bad(6, sorted(last.done), max((d["step"] for d in last.done.values()), default=None),
            f"the job did not finish: done {[(r, d['step']) for r, d in last.done.items()]}, "
            f"failed {summary.get('failed_replicas')}, gave up: {summary.get('gave_up')}")
    # 2: exactly once, over every attempt's ledger
    if final_positions is not None:
        rep = check_exactly_once(sorted((out / "ledger").glob("*.jsonl")), dict(enumerate(final_positions)))
        for (rid, pos), at in rep.duplicates.items():
            bad(2, rid, max(at), f"batch {pos} trained at steps {at}")
        for rid, gaps in rep.gaps.items():
            bad(2, rid, None, f"batches never trained: {gaps[:10]}")
        for (rid, step), pos in rep.step_conflicts.items():
            bad(2, rid, step, f"two batches at one step: {pos}")
    stats = {"attempts": len(runs), "lighthouse_restarts": len(lighthouse_down),
             "processes": sum(len({r['pid'] for recs in run.steps.values() for r in recs}) for _, run in runs),
             "finished": finished}
    return violations, stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the CI form: >= 10 faults over ~150 steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="run directory (default runs/chaos_soak[_quick])")
    p.add_argument("--lighthouse-gap", type=int, default=20,
                   help="fewest steps between two lighthouse kills (0: storms, which once let two rejoiners "
                        "train from step 0 on a freshly restarted lighthouse)")
    p.add_argument("--json", default=None, help="result file (default results/chaos_soak[_quick].json)")
    p.add_argument("--relays", type=int, default=0,
                   help="relays the launcher starts (launch.relays); > 0 adds the faults kill_relay and stop_relay")
    args = p.parse_args(argv)

    from fthsdp.launch.local import LocalJob

    quick = args.quick
    name = "chaos_soak_quick" if quick else "chaos_soak"
    out = pathlib.Path(args.out or ROOT / "runs" / name)
    replicas, steps = (3, 160) if quick else (4, 600)
    if not 0 <= args.relays <= replicas:
        p.error(f"--relays {args.relays}: 0..{replicas} (each relay carries a block of the {replicas} replicas)")
    target = 12 if quick else 60
    ckpt_every = 10 if quick else 25
    step_s = 0.15
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    overrides = TINY + [f"launch.replicas={replicas}", "launch.devices_per_replica=1", f"train.steps={steps}",
                        f"ft.checkpoint_every={ckpt_every}", f"train.min_step_s={step_s}",
                        f"ft.allreduce_timeout_s={ALLREDUCE_S}", "ft.max_retries=8", f"ft.detect_s={DETECT_S}",
                        "ft.peer_serve_cap_gbps=0.002",  # ~1.5 s to fetch the tiny state: a window to hit
                        "ft.lighthouse_outage_s=30", f"launch.relays={args.relays}"]
    job = LocalJob(config="base", overrides=overrides, out_dir=out, replicas=replicas, steps=steps, faults=[],
                   restart=True, restart_delay_s=0.3, detect_s=DETECT_S, join_timeout_s=0.5, relays=args.relays,
                   deadline_s=240 if quick else 1500, progress=False, max_job_restarts=3 if quick else 6)
    chaos = Chaos(job, random.Random(args.seed), target, steps, ckpt_every, out / "faults.jsonl",
                  gap_s=(0.8, 1.8) if quick else (1.0, 2.5), whole_job_kills=1 if quick else 2,
                  lighthouse_gap=args.lighthouse_gap)
    t0 = time.time()
    chaos.thread.start()
    error = None
    try:
        summary = job.run()
    except RuntimeError as e:  # the launcher's own deadline
        error, summary = str(e), {"failed_replicas": [], "gave_up": str(e)}
    finally:
        chaos.close()
    violations, stats = check(out, steps, summary)
    result = {"quick": quick, "seed": args.seed, "replicas": replicas, "steps": steps, "relays": args.relays,
              "faults": dict(sorted(chaos.counts.items())), "fault_total": sum(chaos.counts.values()),
              "violations": violations, "finished": stats["finished"], "wall_s": round(time.time() - t0, 1),
              "job_restarts": len(summary.get("job_restarts") or []), "error": error, **stats,
              "run_dir": str(out)}
    path = pathlib.Path(args.json or ROOT / "results" / f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "violations"}, indent=1))
    for v in violations[:20]:
        print("VIOLATION", v)
    print(f"wrote {path}")
    return 0 if not violations and result["finished"] else 1


if __name__ == "__main__":
    sys.exit(main())
