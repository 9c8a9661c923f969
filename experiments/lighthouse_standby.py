"""What a lighthouse SIGKILL costs a real job, with and without the launcher's warm spare.

    python experiments/lighthouse_standby.py [--quick] --out results/lighthouse_standby.json

Runs `fthsdp run` (a tiny model, ``--replicas`` replica processes, FTAR over loopback, steps
paced to ``--min-step-s``) with the lighthouse SIGKILLed at each of ``--kills`` steps, once
with ``launch.lighthouse_standby=true`` (the launcher keeps a second lighthouse process
started and waiting to bind the port: ``fthsdp lighthouse --standby``) and once with
``false`` (a dead lighthouse is started cold), ``--pairs`` times in alternating order so
both meet the same load. Per lighthouse death:

  restart_s     the launcher's own count: the death seen -> the new lighthouse listening
  outage_s      the replicas' count: how long their quorum request found the lighthouse
                unreachable ("reachable again after X s" in their logs), the longest
  stall_s       the longest step that began from a median step before the kill to 2 s after
                it, minus the run's median step (what the death cost the job)

Kills are at least 30 steps (3 s at the default pace) apart: the launcher starts the next
spare 2 s after a lighthouse serves (``STANDBY_DELAY_S``) and it takes about a second to
import, so a second death sooner than that is restarted cold in both arms.

The JSON has every run, the medians per arm and their ratios (cold / standby); the plot
shows each death's restart and stall per arm.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16", "data.seq_len=16",
        "data.batch_size=8", "data.corpus_bytes=65536", "train.eval_every=0", "ft.checkpoint_every=10"]
ARMS = ("standby", "cold")
_OUTAGE = re.compile(r"lighthouse \S+ reachable again after ([0-9.]+)s; step (\d+) goes on")


def _jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def one_run(out: pathlib.Path, arm: str, replicas: int, steps: int, kills: list[int], min_step_s: float) -> dict:
    """One `fthsdp run` with the lighthouse killed at ``kills``; what each death cost."""
    cmd = [sys.executable, "-m", "fthsdp.cli", "run", "--no-progress", "--out-dir", str(out), "--config", "base",
           "--replicas", str(replicas), "--devices-per-replica", "1",
           *[a for k in kills for a in ("--kill-lighthouse", str(k))], *TINY, f"train.steps={steps}",
           f"train.min_step_s={min_step_s}", "ft.lighthouse_outage_s=30",
           f"launch.lighthouse_standby={'true' if arm == 'standby' else 'false'}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"fthsdp run ({arm}) failed with exit {p.returncode}: {p.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    events = _jsonl(out / "events.jsonl")
    kill_times = [e["time"] for e in events if e.get("kind") == "kill_lighthouse"]
    records = [r for i in range(replicas) for r in _jsonl(out / f"metrics-{i}.jsonl") if r.get("kind") == "step"]
    durations = [r["end"] - r["start"] for r in records]
    median = statistics.median(durations)
    outages: dict[int, float] = {}  # step -> the longest outage a replica rode out asking for it
    for i in range(replicas):
        log = out / f"replica-{i}.log"
        for m in _OUTAGE.finditer(log.read_text() if log.exists() else ""):
            outages[int(m.group(2))] = max(outages.get(int(m.group(2)), 0.0), float(m.group(1)))
    deaths = []
    for k, (t, lr) in enumerate(zip(kill_times, summary["lighthouse_restarts"])):
        near = [r["end"] - r["start"] for r in records if t - median <= r["start"] <= t + 2.0]
        after = [s for s in outages if kills[k] <= s <= kills[k] + 3]
        deaths.append({"kill_step": kills[k], "restart_s": lr["restart_s"], "standby": lr.get("standby", False),
                       "outage_s": max((outages[s] for s in after), default=None),
                       "stall_s": max(near) - median if near else None})
    return {"arm": arm, "median_step_s": median, "deaths": deaths,
            "identical_final_state": summary.get("identical_final_state"), "job_restarts": summary["job_restarts"]}


def plot(runs: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.8))
    for ax, key, title in zip(axes, ("restart_s", "outage_s", "stall_s"),
                              ("launcher: death -> listening", "replicas: unreachable", "job: step stall")):
        for x, arm in enumerate(ARMS):
            ys = [d[key] for r in runs if r["arm"] == arm for d in r["deaths"] if d[key] is not None]
            ax.scatter([x] * len(ys), ys, alpha=0.6)
            if ys:
                ax.hlines(statistics.median(ys), x - 0.25, x + 0.25, color="k")
        ax.set_xticks(range(len(ARMS)), ARMS)
        ax.set_xlim(-0.6, len(ARMS) - 0.4)
        ax.set_ylabel("s")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
    fig.suptitle("A SIGKILLed lighthouse: a warm spare against a cold restart (fthsdp run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one pair, one kill, 30 steps (CI)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3, help="runs of each arm, alternating")
    ap.add_argument("--kills", type=int, nargs="*", default=[20, 55, 90], help="steps the lighthouse is killed at")
    ap.add_argument("--steps", type=int, default=110)
    ap.add_argument("--min-step-s", type=float, default=0.1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    pairs, kills, steps = (1, [12], 30) if args.quick else (args.pairs, sorted(args.kills), args.steps)
    if args.replicas < 2 or pairs < 1 or not kills or kills[0] < 5 or kills[-1] > steps - 5 or \
            any(b - a < 30 for a, b in zip(kills, kills[1:])):
        ap.error("need --replicas >= 2, --pairs >= 1, and --kills from step 5 to --steps - 5, 30 steps apart "
                 "(the next spare is started 2 s after a lighthouse serves)")
    runs = []
    with tempfile.TemporaryDirectory(prefix="fthsdp-standby-") as d:
        for i in range(pairs):
            for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
                r = one_run(pathlib.Path(d) / f"{arm}-{i}", arm, args.replicas, steps, kills, args.min_step_s)
                r["pair"] = i
                runs.append(r)
                print(f"pair {i} {arm:8s}: " + "; ".join(
                    f"step {x['kill_step']}: restart {x['restart_s']:.3f} s, outage {x['outage_s']} s, "
                    f"stall {x['stall_s']:.3f} s" for x in r["deaths"]), flush=True)

    def med(arm: str, key: str) -> float | None:
        ys = [x[key] for r in runs if r["arm"] == arm for x in r["deaths"] if x[key] is not None]
        return statistics.median(ys) if ys else None

    summary = {arm: {k: med(arm, k) for k in ("restart_s", "outage_s", "stall_s")} for arm in ARMS}
    ratios = {k: summary["cold"][k] / summary["standby"][k] for k in ("restart_s", "outage_s", "stall_s")
              if summary["cold"][k] and summary["standby"][k]}
    for k, v in ratios.items():
        print(f"{k}: cold {summary['cold'][k]:.3f} s, standby {summary['standby'][k]:.3f} s (median; x{v:.1f})")
    from before_after import commit_name

    commit = commit_name()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs, "summary": summary, "ratio_cold_over_standby": ratios,
                               "replicas": args.replicas, "kills": kills, "steps": steps, "quick": args.quick,
                               "commit": commit}, indent=1))
    plot(runs, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    ok = all(r["identical_final_state"] and not r["job_restarts"] and
             [x["standby"] for x in r["deaths"]] == [r["arm"] == "standby"] * len(kills) for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
