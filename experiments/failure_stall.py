"""What one replica failure costs the survivors (issue 5 benchmark).

    python experiments/failure_stall.py [--quick] --out results/failure_stall.json

Runs a real job (lighthouse + 3 or 4 replica processes, FTAR over loopback)
and SIGKILLs one replica at a known step, several times. From the replicas'
step records it measures:

  detection_s    kill -> a survivor's heartbeat reply names the replica dead
                 (it then aborts its in-flight all-reduce at once)
  rebuild_s      the survivors' ring reconfiguration onto the smaller quorum
  allreduce_s    one all-reduce + update (the survivors' median, no failure)
  median_step_s  the survivors' median step
  stall_s        extra wall time of the step that straddles the kill over the
                 median step (what the failure cost the survivors)

Replicas of several processes (issue 11) run beside one-process replicas in
the same invocation: shape "RxD Pp" is R replicas of P processes x D devices;
in a P > 1 shape one *follower* process of the victim is SIGKILLed (the
launcher then kills the rest of its replica) and every process of every
replica keeps the same state.

``--auth both`` runs every configuration with the control plane's
authentication off and on, alternated run by run, each with a lighthouse the
experiment starts itself (the same flags as the launcher's): off = a
lighthouse run ``--insecure``, unsigned replica calls and an unkeyed FTAR
ring; on = a lighthouse secret, the job's key handed to the replicas (signed
calls, FTAR's challenge-response and per-chunk MACs). ``auth_compare`` gives
the medians of each and the on/off ratios. The default (``--auth own``) is
the launcher's own lighthouse, authenticated, as before.

Target: detection <= 1 s and stall <= detection + 0.5 s + one all-reduce.
For scale: torchft's defaults declare a replica dead after a 5 s heartbeat
timeout and then wait out the collective timeout; the FT-HSDP paper used a
60 s timeout (section 4.1), a ~3 min stall with rebuild and retraining.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fthsdp import logs  # noqa: E402
from fthsdp.control import auth  # noqa: E402
from fthsdp.launch import report  # noqa: E402
from fthsdp.launch.faults import plan  # noqa: E402
from fthsdp.launch.lifetime import stop_process  # noqa: E402
from fthsdp.launch.local import LocalJob  # noqa: E402

SMALL = ["train.eval_every=0", "ft.allreduce_timeout_s=10", "model.d_model=64", "model.num_layers=2",
         "data.batch_size=8", "data.seq_len=32", "model.max_seq_len=32"]


DETECT_S, JOIN_TIMEOUT_S = 0.8, 0.5


def start_lighthouse(out: pathlib.Path, replicas: int, secure: bool) -> tuple[subprocess.Popen, str, str]:
    """A lighthouse of this experiment's own, as the launcher starts one: (process, address, the
    job secret file for the launcher or "" when it runs without authentication)."""
    out = out.parent / f"{out.name}-lighthouse"  # beside the run directory, not in it
    out.mkdir(parents=True, exist_ok=True)
    env = auth.replica_env(dict(os.environ), None)
    secret_file = ""
    if secure:
        secret = auth.new_secret()
        env[auth.LIGHTHOUSE_SECRET_ENV] = secret.hex()
        secret_file = str(out / "job.secret")
        auth.write_secret(secret_file, auth.job_key(secret, "fthsdp"))  # LocalJob's job id
    log = open(out / "external-lighthouse.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "fthsdp.control.lighthouse", "--bind", "127.0.0.1:0",
                          "--detect", str(DETECT_S), "--join-timeout", str(JOIN_TIMEOUT_S), "--replicas",
                          str(replicas), *([] if secure else ["--insecure"])],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    log.close()
    line = p.stdout.readline()
    if not line.startswith("lighthouse listening on "):
        p.kill()
        raise RuntimeError(f"lighthouse did not start: {line!r}")
    return p, line.split()[-1], secret_file


def one_run(out: pathlib.Path, replicas: int, devices: int, steps: int, kill_step: int, victim: int,
            processes: int = 1, auth_mode: str = "own") -> dict:
    overrides = SMALL + [f"launch.replicas={replicas}", f"launch.devices_per_replica={devices}",
                         f"launch.processes_per_replica={processes}", f"train.steps={steps}"]
    who = f"{victim}.{processes - 1}" if processes > 1 else str(victim)  # P > 1: a follower dies
    lighthouse, address, secret_file = (None, "", "") if auth_mode == "own" else \
        start_lighthouse(out, replicas, secure=auth_mode == "on")
    try:
        job = LocalJob(config="base", overrides=overrides, out_dir=out, replicas=replicas, steps=steps,
                       faults=plan((f"{who}@{kill_step}",), (), replicas), detect_s=DETECT_S, progress=False,
                       hash_every=0, processes=processes, external_lighthouse=address, secret_file=secret_file,
                       join_timeout_s=JOIN_TIMEOUT_S)
        summary = job.run()
    finally:
        if lighthouse is not None:
            stop_process(lighthouse)
    run = report.load_run(out)
    (failure,) = report.analyse_failures(run)
    survivors = [rid for rid in run.steps if rid != str(victim)]
    recs = [r for rid in survivors for r in run.steps[rid]]
    straddle = [r for rid in survivors for r in run.steps[rid] if r["step"] == failure.straddling_step.get(rid)]
    later = [r for r in recs if r["start"] >= failure.time]
    rebuild = [r["rebuild_s"] for r in straddle + later if r["rebuild_s"] > 0][:len(survivors)]
    steady = [r for r in recs if r["step"] > 3 and r["attempts"] == 1 and r["rebuild_s"] == 0]
    return {
        "replicas": replicas, "devices_per_replica": devices, "processes_per_replica": processes,
        "shape": f"{replicas}x{devices} P{processes}", "victim": who, "kill_step": kill_step,
        "detection_s": failure.detection_s,
        "rebuild_s": statistics.median(rebuild) if rebuild else None,
        "allreduce_s": statistics.median(r["allreduce_s"] for r in steady),
        "median_step_s": statistics.median(r["end"] - r["start"] for r in steady),
        "stall_s": statistics.median(failure.stall_s.values()),
        "stall_by_survivor": failure.stall_s,
        "identical_final_state": summary["identical_final_state"], "auth": auth_mode,
        "out_dir": out.name,  # under this run's work folder (no path of this machine in the results)
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one short run per configuration (CI)")
    p.add_argument("--out", default="results/failure_stall.json")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--auth", choices=("own", "on", "off", "both"), default="own",
                   help="own: the launcher's lighthouse (authenticated; default); on/off: a lighthouse of this "
                        "experiment's with/without authentication; both: off and on alternated run by run")
    p.add_argument("--configs", default=None,
                   help="comma-separated RxD or RxDpP shapes (e.g. 3x2,3x1p2); default: every shape")
    args = p.parse_args(argv)
    logs.setup("fthsdp.experiments")
    repeats = args.repeats or (1 if args.quick else 3)
    steps, kill_step = (24, 10) if args.quick else (60, 25)
    # (replicas, devices per process, processes per replica)
    configs = [(3, 2, 1), (3, 1, 2)] if args.quick else [(3, 2, 1), (4, 1, 1), (3, 1, 2), (3, 2, 2)]
    if args.configs:
        try:
            configs = [(int(c.split("x")[0]), int(c.split("x")[1].split("p")[0]),
                        int(c.split("p")[1]) if "p" in c else 1) for c in args.configs.split(",")]
        except (IndexError, ValueError):
            p.error(f"--configs {args.configs!r}: shapes like 3x2 (replicas x devices) or 3x1p2 (x processes)")
    modes = {"both": ("off", "on"), "on": ("on",), "off": ("off",), "own": ("own",)}[args.auth]
    out_path = pathlib.Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="failure_stall-"))
    runs = []
    for replicas, devices, processes in configs:
        for i in range(repeats):
            for mode in (modes if i % 2 == 0 else tuple(reversed(modes))):  # neither always first
                victim = (i + 1) % replicas
                t0 = time.time()
                r = one_run(work / f"r{replicas}x{devices}p{processes}-{i}-{mode}", replicas, devices, steps, kill_step,
                            victim, processes, auth_mode=mode)
                r["wall_s"] = time.time() - t0
                runs.append(r)
                print(f"[{r['shape']} #{i} auth {mode}] detection {r['detection_s']:.3f}s rebuild {r['rebuild_s'] or 0:.3f}s "
                      f"allreduce {r['allreduce_s'] * 1e3:.1f}ms step {r['median_step_s'] * 1e3:.1f}ms "
                      f"stall {r['stall_s']:.3f}s", flush=True)

    def med(key, rows=None):
        vals = [r[key] for r in (runs if rows is None else rows) if r[key] is not None]
        return statistics.median(vals) if vals else None

    keys = ("detection_s", "rebuild_s", "allreduce_s", "median_step_s", "stall_s")
    single = [r for r in runs if r["processes_per_replica"] == 1]
    by_shape = {}
    for r in runs:
        by_shape.setdefault(r["shape"], []).append(r)
    result = {
        # top level: one-process replicas, as before; every shape side by side under "shapes"
        **{k: med(k, single) for k in keys}, "runs": runs,
        "shapes": {shape: {k: med(k, rows) for k in keys} for shape, rows in by_shape.items()},
        "targets": {"detection_s_max": 1.0},
        "baselines": {"torchft_heartbeat_timeout_s": 5.0, "paper_timeout_s": 60.0},
    }
    budget = result["detection_s"] + 0.5 + result["allreduce_s"]
    result["targets"]["stall_s_max"] = budget
    result["targets_met"] = {"detection": result["detection_s"] <= 1.0, "stall": result["stall_s"] <= budget}
    for shape, m in result["shapes"].items():
        b = m["detection_s"] + 0.5 + m["allreduce_s"]
        m["targets_met"] = {"detection": m["detection_s"] <= 1.0, "stall": m["stall_s"] <= b}
    if len(modes) > 1:
        result["auth_compare"] = {}
        for shape, rows in by_shape.items():
            m = {mode: {k: med(k, [r for r in rows if r["auth"] == mode]) for k in keys} for mode in modes}
            m["on_over_off"] = {k: (m["on"][k] / m["off"][k] if m["on"][k] and m["off"][k] else None) for k in keys}
            result["auth_compare"][shape] = m
        result["load_average_after"] = list(os.getloadavg())
    out_path.write_text(json.dumps(result, indent=2, default=str))
    plot = report.plot_timeline(work / runs[0]["out_dir"], out_path.with_suffix(".png"),
                                num_configured=runs[0]["replicas"])
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2, default=str))
    print(f"wrote {out_path} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
