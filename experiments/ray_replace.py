"""A replica's replacement under Ray beside the local launcher: time to its first commit, and the survivors' stall.

    python experiments/ray_replace.py [--quick] --out results/ray_replace.json

Runs one job twice, as a user does, once with `fthsdp run` (processes on this
machine) and once with `fthsdp ray` (a fresh local Ray cluster: a lighthouse
actor, one placement group and actor per replica): 3 replicas x 1 device,
replica 1 killed at step K (SIGKILL locally; `ray.kill` of its actor under
Ray), restarted by the launcher after `launch.restart_delay_s`, rejoining
from its peers. From each run's own records (the same report code for both):

* ``replace_s``: the kill (the launcher's event) -> the end of the
  replacement's first committed step (its catch-up step: it fetched the state
  from its peers and joined the ring). Includes the restart delay, the new
  process's start (under Ray: placement group + actor start), jax start-up and
  compilation (a warm compilation cache in both), and the fetch;
* ``stall_s``: the survivors' stall at the kill (the report's figure: the
  extra wall time of the step that straddles the failure over the survivor's
  median step; the median over survivors);
* under Ray, also ``placed_s``: the kill -> the new actor placed and started.

Targets (from the issue): Ray's survivors' stall within 0.1 s of the local
launcher's, and Ray's replacement-to-first-commit <= 1.5x the local one's.
One run of each (the machine is shared: the numbers are what one run saw).
The JSON and a bar chart beside it are written.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fthsdp.launch import report  # noqa: E402
from fthsdp.logs import read_metrics  # noqa: E402

TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16", "data.seq_len=16",
        "data.batch_size=8", "data.corpus_bytes=65536", "train.eval_every=0"]
TARGET_STALL_DIFF_S = 0.1
TARGET_REPLACE_RATIO = 1.5


def job_args(quick: bool) -> tuple[list[str], int, int]:
    steps, kill = (150, 15) if quick else (300, 30)
    model = TINY if quick else []
    return (["--config", "base", "--replicas", "3", "--devices-per-replica", "1", "--kill", f"1@{kill}",
             "--no-progress", *model, "train.min_step_s=0.1", f"train.steps={steps}"], steps, kill)


def measure(out: pathlib.Path) -> dict:
    events = read_metrics(out / "events.jsonl")
    (kill,) = [e for e in events if e["kind"] == "kill"]
    t = kill["time"]
    run = report.load_run(out)
    after = [r for r in run.steps["1"] if r["start"] > t]
    if not after:
        raise RuntimeError(f"replica 1 never committed after its kill in {out} (raise train.steps)")
    first = after[0]
    summary = json.loads((out / "summary.json").read_text())
    (failure,) = summary["failures"]
    stalls = list(failure["stall_s"].values())
    placed = [e["time"] - t for e in events if e["kind"] == "placed" and e["replica"] == 1 and e["time"] > t]
    restart = [e["time"] - t for e in events if e["kind"] == "restart" and e["replica"] == 1]
    return {
        "replace_s": first["end"] - t,
        "first_commit_step": first["step"],
        "first_commit_caught_up": not first["healthy"],
        "catch_up_s": first.get("catch_up_s"),
        "restart_s": restart[0] if restart else None,
        "placed_s": placed[0] if placed else None,
        "stall_s": statistics.median(stalls) if stalls else None,
        "stall_s_by_survivor": failure["stall_s"],
        "detection_s": failure["detection_s"],
        "identical_final_state": summary["identical_final_state"],
        "median_step_s": statistics.median(r["median_step_s"] for r in summary["replicas"].values()),
    }


def one(launcher: str, out: pathlib.Path, args: list[str], ray_tmp: str | None) -> dict:
    cmd = [sys.executable, "-m", "fthsdp.cli", launcher, "--out-dir", str(out), *args]
    if launcher == "ray":
        cmd[4:4] = ["--temp-dir", ray_tmp]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ))
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}:\n{p.stderr[-3000:]}")
    return {**measure(out), "wall_s": time.monotonic() - t0}


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    names = ["local", "ray"]
    a.bar(names, [result[n]["replace_s"] for n in names], color=["tab:blue", "tab:orange"])
    a.set_ylabel("s")
    a.set_title("kill -> replacement's first commit")
    b.bar(names, [result[n]["stall_s"] or 0 for n in names], color=["tab:blue", "tab:orange"])
    b.set_title("survivors' stall at the kill")
    b.set_ylabel("s")
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 150 steps")
    p.add_argument("--out", default="results/ray_replace.json")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    job, steps, kill = job_args(args.quick)
    work = pathlib.Path(tempfile.mkdtemp(prefix="rr-"))
    try:
        result: dict = {"job": {"replicas": 3, "devices_per_replica": 1, "steps": steps, "kill": f"1@{kill}",
                                "model": "tiny" if args.quick else "base", "paced_step_s": 0.1}}
        result["local"] = one("run", work / "local", job, None)
        result["ray"] = one("ray", work / "ray", job, str(work / "r"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lo, ra = result["local"], result["ray"]
    diff = (ra["stall_s"] or 0) - (lo["stall_s"] or 0)
    ratio = ra["replace_s"] / lo["replace_s"]
    result["stall_diff_s"] = diff
    result["replace_ratio"] = ratio
    result["targets"] = {
        "stall_within_s": TARGET_STALL_DIFF_S, "stall_met": abs(diff) <= TARGET_STALL_DIFF_S,
        "replace_ratio_at_most": TARGET_REPLACE_RATIO, "replace_met": ratio <= TARGET_REPLACE_RATIO,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
