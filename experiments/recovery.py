"""Recovery, all in one run (issue 6 benchmark).

    python experiments/recovery.py [--quick] --out results/recovery.json

Two parts:

1. Transfer (experiments/recovery_fetch.py, run as a subprocess with the same
   --quick): peer-fetch throughput of 1-2 GB of state from 1, 2 and 3 sources
   beside plain Orbax restoring the same state from a local directory,
   torchft's HTTP checkpoint transport (when a side environment has torchft)
   and the loopback TCP ceiling; and the slowdown of healthy steps while
   snapshots are taken and served. Fields `fetch_gbps`, `orbax_local_gbps`,
   `torchft_gbps`, `loopback_gbps`, `snapshot_overhead` come from there.

2. Rejoin (a real job: lighthouse + 3 replica processes, FTAR, SIGKILL, the
   launcher restarts the replica): `rejoin_stall_fraction` = the survivors'
   extra time on the step where the restarted replica caught up, as a fraction
   of their median step; `restart_to_commit_s` = restart -> the restarted
   replica's first committed step. Steps are paced (train.min_step_s) so the
   ratio of step time to state size is closer to a real job's than a 20 ms
   toy step; the pacing is recorded in the JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fthsdp import logs  # noqa: E402
from fthsdp.launch import report  # noqa: E402
from fthsdp.launch.faults import plan  # noqa: E402
from fthsdp.launch.local import LocalJob  # noqa: E402


def rejoin_run(out: pathlib.Path, steps: int, kill_step: int, min_step_s: float) -> dict:
    overrides = ["launch.replicas=3", "launch.devices_per_replica=2", f"train.steps={steps}",
                 "train.eval_every=0", f"train.min_step_s={min_step_s}", "ft.checkpoint_every=1000"]
    job = LocalJob(config="base", overrides=overrides, out_dir=out, replicas=3, steps=steps,
                   faults=plan((f"1@{kill_step}",), (), 3), restart=True, restart_delay_s=0.5,
                   detect_s=0.8, progress=False, hash_every=0)
    summary = job.run()
    run = report.load_run(out)
    restart = next(e for e in run.events if e["kind"] == "restart")
    back = [r for r in run.steps["1"] if r["start"] >= restart["time"]]
    catch_up = next(r for r in back if not r["healthy"])
    fractions, extra = [], []
    for rid in ("0", "2"):
        recs = run.steps[rid]
        steady = [r["end"] - r["start"] for r in recs if r["step"] > kill_step + 3 and r["attempts"] == 1
                  and r["step"] != catch_up["step"]]
        med = statistics.median(steady)
        at = next(r for r in recs if r["step"] == catch_up["step"])
        extra.append((at["end"] - at["start"]) - med)
        fractions.append(extra[-1] / med)
    return {
        "rejoin_step": catch_up["step"],
        "rejoin_stall_fraction": statistics.median(fractions),
        "rejoin_stall_s": statistics.median(extra),
        "restart_to_commit_s": catch_up["end"] - restart["time"],
        "catch_up_fetch_s": catch_up["catch_up_s"],
        "identical_final_state": summary["identical_final_state"],
        "min_step_s": min_step_s,
        "out_dir": str(out),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="results/recovery.json")
    p.add_argument("--skip-transfer", action="store_true", help="only the rejoin part")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args(argv)
    logs.setup("fthsdp.experiments")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    if not args.skip_transfer:
        transfer = out.with_name(out.stem + "_transfer.json")
        cmd = [sys.executable, str(REPO / "experiments" / "recovery_fetch.py"), "--out", str(transfer)]
        if args.quick:
            cmd.append("--quick")
        subprocess.run(cmd, check=True)
        t = json.loads(transfer.read_text())
        result.update({k: t.get(k) for k in ("fetch_gbps", "orbax_local_gbps", "torchft_gbps", "loopback_gbps",
                                             "snapshot_overhead")})
        result["transfer"] = t
    repeats = args.repeats or (1 if args.quick else 3)
    steps, kill = (70, 8) if args.quick else (120, 10)
    work = pathlib.Path(tempfile.mkdtemp(prefix="recovery-"))
    runs = [rejoin_run(work / f"rejoin-{i}", steps, kill, min_step_s=0.25) for i in range(repeats)]
    for r in runs:
        print(f"rejoin at step {r['rejoin_step']}: survivors' stall {r['rejoin_stall_s'] * 1e3:+.0f} ms "
              f"({r['rejoin_stall_fraction'] * 100:+.1f}% of a step), restart -> commit {r['restart_to_commit_s']:.1f}s, "
              f"fetch {r['catch_up_fetch_s']}", flush=True)
    result["rejoin_stall_fraction"] = statistics.median(r["rejoin_stall_fraction"] for r in runs)
    result["restart_to_commit_s"] = statistics.median(r["restart_to_commit_s"] for r in runs)
    result["rejoin_runs"] = runs
    result["targets"] = {"rejoin_stall_fraction_max": 0.05}
    result["targets_met"] = {"rejoin_stall": result["rejoin_stall_fraction"] <= 0.05}
    out.write_text(json.dumps(result, indent=2, default=str))
    plot = report.plot_timeline(runs[0]["out_dir"], out.with_suffix(".png"), num_configured=3)
    print(json.dumps({k: v for k, v in result.items() if k not in ("transfer", "rejoin_runs")}, indent=2, default=str))
    print(f"wrote {out} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
