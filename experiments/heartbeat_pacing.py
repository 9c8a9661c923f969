"""A job's own heartbeats against one lighthouse, with and without the lighthouse's pacing.

    python experiments/heartbeat_pacing.py [--quick] --out results/heartbeat_pacing.json

Every process of a job beats the lighthouse every ``ft.heartbeat_interval_s`` (0.1 s) and is
declared dead after ``ft.detect_s`` (0.8 s) of silence: the defaults, which is what a user
scaling a job up runs with. The flat rows of ``experiments/scale.py`` could not heartbeat at
all past a few hundred replicas ("N x 10 heartbeats/s would saturate this machine"); here they
do. Each row is the emulation (fthsdp/sim/emulation.py, the real lighthouse in its own process)
of N replicas of one rank each, heartbeating at the defaults, run once per arm in alternating
order: ``unpaced`` (``fthsdp lighthouse --beats-per-s 0``, every process beats at its own
interval) and one ``paced B/s`` arm per budget B of ``--budgets`` (default: the lighthouse's
own, fthsdp/control/pacing.py: N processes are asked to beat every N / B s at most, and the
silence window widens to match).

Per row: quorum rounds complete (every replica in one quorum) out of those measured, their
latency p50 / p99 (from the last request to every rank holding the answer), how many replicas
the lighthouse declared dead (every one a false death: nobody is killed), the lighthouse's and
the emulator's CPU per round, and the lighthouse's own pacing log line. The JSON has ``rows``
and ``summary`` (per N: both arms' medians over pairs); a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))



def row(n: int, beats: float, rounds: int, heartbeat_s: float, detect_s: float) -> dict:
    """One run of ``n`` replicas against a lighthouse of budget ``beats`` (0: unpaced)."""
    from scale import fthsdp_row

    arm = arm_name(beats)
    r = fthsdp_row("fthsdp-flat", n, 1, rounds, heartbeat_s=heartbeat_s, beats_per_s=beats, detect_s=detect_s)
    keep = ("replicas", "p50_s", "p99_s", "max_s", "complete_rounds", "rounds", "lighthouse_cpu_s_per_round",
            "emulator_cpu_s_per_round", "wall_s", "loadavg", "violations", "incomplete_rounds",
            "quorum_request_errors", "timeouts_s")
    out = {"arm": arm, "beats_per_s": beats, "heartbeat_interval_s": heartbeat_s, **{k: r.get(k) for k in keep}}
    out["declared_dead"] = r["lighthouse_log"].get("declared_dead", 0)
    out["pacing_log"] = r["lighthouse_log"].get("paced", [])  # its first 20 pacing lines
    return out


def arm_name(beats: float) -> str:
    return "unpaced" if beats == 0 else f"paced {beats:g}/s"


def summary(rows: list[dict]) -> list[dict]:
    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    out = []
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    for n in sorted({r["replicas"] for r in rows}):
        s = {"replicas": n}
        for arm in arms:
            rs = [r for r in rows if r["replicas"] == n and r["arm"] == arm]
            s[arm] = {"complete_rounds": [r["complete_rounds"] for r in rs], "rounds": rs[0]["rounds"] if rs else 0,
                      "p50_s": med(r["p50_s"] for r in rs), "p99_s": med(r["p99_s"] for r in rs),
                      "declared_dead": [r["declared_dead"] for r in rs],
                      "lighthouse_cpu_s_per_round": med(r["lighthouse_cpu_s_per_round"] for r in rs),
                      "emulator_cpu_s_per_round": med(r["emulator_cpu_s_per_round"] for r in rs)}
        u = s.get("unpaced", {})
        for arm in arms[1:]:
            p = s[arm]
            s[f"p50_ratio_unpaced_over_{arm}"] = (u["p50_s"] / p["p50_s"]) if u.get("p50_s") and p["p50_s"] else None
        out.append(s)
    return out


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    arms = list(dict.fromkeys(r["arm"] for r in result["rows"]))
    summ = result["summary"]
    ns = [s["replicas"] for s in summ]
    for arm, style in zip(arms, ("o--", "s-", "^-", "v-", "d-")):
        done = [statistics.median(s[arm]["complete_rounds"] or [0]) / max(s[arm]["rounds"], 1) for s in summ]
        dead = [statistics.median(s[arm]["declared_dead"] or [0]) for s in summ]
        a.plot(ns, done, style, label=arm)
        b.plot(ns, [max(d, 0.5) for d in dead], style, label=arm)
        c.plot(ns, [s[arm]["p99_s"] or float("nan") for s in summ], style, label=arm)
    a.set(xscale="log", xlabel="replicas (one process each, beating every 0.1 s)",
          ylabel="rounds complete (fraction)", ylim=(-0.05, 1.05), title="quorum rounds with every replica")
    b.set(xscale="log", yscale="log", xlabel="replicas",
          ylabel="replicas declared dead (none was killed; 0 at 0.5)", title="false deaths")
    c.set(xscale="log", yscale="log", xlabel="replicas", ylabel="s", title="round latency p99 (complete rounds)")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("heartbeats at the defaults (0.1 s, 0.8 s window) against one lighthouse: paced or not")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, one pair (CI)")
    ap.add_argument("--out", required=True, help="JSON to write (the plot goes beside it, .png)")
    ap.add_argument("--replicas", type=int, nargs="*", default=None,
                    help="replica counts (default 512 1024 2048 4096; quick 256)")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per row (default 10; quick 3)")
    ap.add_argument("--pairs", type=int, default=None, help="unpaced/paced pairs per count (default 2; quick 1)")
    ap.add_argument("--heartbeat", type=float, default=0.1, help="the processes' own interval (default 0.1 s)")
    ap.add_argument("--detect", type=float, default=0.8, help="the configured detection window (default 0.8 s)")
    ap.add_argument("--budgets", type=float, nargs="*", default=None,
                    help="the paced arms' --beats-per-s, one arm each beside the unpaced one (default: the "
                         "lighthouse's own default)")
    args = ap.parse_args(argv)
    ns = args.replicas or ([256] if args.quick else [512, 1024, 2048, 4096])
    rounds = args.rounds or (3 if args.quick else 10)
    pairs = args.pairs or (1 if args.quick else 2)
    if rounds < 1 or pairs < 1 or any(n < 2 for n in ns):
        ap.error("--rounds and --pairs must be >= 1 and every --replicas >= 2")
    from fthsdp.control.pacing import DEFAULT_BEATS_PER_S, PACED_BEATS_PER_WINDOW

    budgets = args.budgets or [DEFAULT_BEATS_PER_S]
    if not all(b > 0 for b in budgets):
        ap.error(f"every --budgets must be > 0 beats/s (the unpaced arm is the one without), got {budgets}")
    arms = [0.0, *budgets]
    rows = []
    for n in ns:
        for i in range(pairs):
            for beats in (arms if i % 2 == 0 else arms[::-1]):  # alternate the order
                r = row(n, beats, rounds, args.heartbeat, args.detect)
                rows.append(r)
                print(f"{n:6d} replicas {r['arm']:14s}: {r['complete_rounds']}/{r['rounds']} rounds complete, "
                      f"p50 {r['p50_s'] or float('nan'):.3f} s, {r['declared_dead']} declared dead, lighthouse CPU "
                      f"{r['lighthouse_cpu_s_per_round'] or float('nan'):.3f} s a round", flush=True)
    result = {"experiment": "heartbeat_pacing", "quick": args.quick, "budgets_beats_per_s": budgets,
              "default_budget_beats_per_s": DEFAULT_BEATS_PER_S, "paced_beats_per_window": PACED_BEATS_PER_WINDOW,
              "rows": rows, "summary": summary(rows)}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
