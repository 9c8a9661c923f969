"""A lighthouse restarted under paced heartbeats: does it keep the pace, or call a storm of beats?

    python experiments/paced_restart.py [--quick] [--baseline COMMIT] --out results/paced_restart.json

Past ``budget x interval`` processes (500 at the defaults) the lighthouse paces their beats
(fthsdp/control/pacing.py). A restarted lighthouse knows none of them at first and counts them
as they come back; built on that count alone, its first replies ask every process to beat at its
own interval (0.1 s) again, at the moment it is busiest. Now each beat says the pace it was given
and a lighthouse keeps the slowest reported for its first seconds (``BeatPacer.inherit``).

Each run is the emulation (fthsdp/sim/emulation.py, the real lighthouse in its own process) of N
replicas of ``--processes`` processes (one rank each) beating at the defaults (0.1 s, a 0.8 s
window) against the lighthouse's beat budget (its default unless ``--budget``), the lighthouse
SIGKILLed when replica 0 reaches step ``--fault-step`` and restarted on its port ``--down-s``
later. With ``--baseline COMMIT`` every pair also runs that commit's lighthouse (the emulated
clients are this tree's; an older lighthouse ignores what their beats say of their pace), in
alternating order. Per run: the deaths the lighthouse declared (every one false: only the
lighthouse is killed), quorum rounds complete (every replica in one quorum), the longest
complete round, the restart's round (the requests in flight at the SIGKILL fail and are asked
again, so it is not complete), the lighthouse's pacing lines from both of its starts, and every
invariant of the emulation. JSON: ``runs`` and ``summary`` (per side: medians over pairs).

What was found (2,048 x 1 on a 2-core host): the restarted lighthouse also counts processes from
their quorum requests (a leader's counts its followers), which come back as fast as the beats, so
its own count was right within 0.25-0.5 s; no death was declared on either side.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))


def run(n: int, rounds: int, fault_step: int, down_s: float, lighthouse_from: str, budget: float | None,
        processes: int = 1) -> dict:
    """One emulated job of ``n`` replicas of ``processes`` processes (one rank each) through one
    lighthouse restart (``budget``: the lighthouse's beats/s, None: its default)."""
    from scale import fthsdp_row

    from fthsdp.sim.emulation import Fault

    r = fthsdp_row("fthsdp-flat", n, processes, rounds, heartbeat_s=0.1, detect_s=0.8, beats_per_s=budget,
                   processes=processes,
                   faults=(Fault("lighthouse", step=fault_step, seconds=down_s),), lighthouse_from=lighthouse_from)
    log = r["lighthouse_log"]
    return {
        "replicas": n, "processes_per_replica": processes, "beats_per_s": budget, "fault_step": fault_step,
        "down_s": down_s, "rounds": r["rounds"],
        "complete_rounds": r["complete_rounds"], "p50_s": r["p50_s"], "max_s": r["max_s"],
        "incomplete_rounds": r["incomplete_rounds"], "declared_dead": log.get("declared_dead", 0),
        # the restart's round (the requests in flight at the SIGKILL fail and are asked again, so it
        # is not among the complete ones): from the last request to every replica holding an answer
        "restart_round_s": next((x["latency_s"] for x in r["incomplete_rounds"] if x["step"] == fault_step), None),
        "pacing_log": log.get("paced", []), "violations": r["violations"], "final_steps": r["final_steps"],
        "quorum_request_errors": r["quorum_request_errors"], "wall_s": r["wall_s"], "loadavg": r["loadavg"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="128 replicas of 2 processes against a budget of 500 beats/s (paced to 0.512 s), 5 rounds, "
                         "one pair (CI)")
    ap.add_argument("--out", required=True, help="JSON to write")
    ap.add_argument("--replicas", type=int, default=None, help="default 2048 (quick 128)")
    ap.add_argument("--processes", type=int, default=None,
                    help="processes per replica (default 1; quick 2): a leader's beats are mostly its quorum "
                         "requests, a follower's are beats")
    ap.add_argument("--budget", type=float, default=None,
                    help="the lighthouse's --beats-per-s (default: its own; quick 500)")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds (default 8; quick 5)")
    ap.add_argument("--fault-step", type=int, default=None,
                    help="the step at which the lighthouse is SIGKILLed (default 4; quick 3)")
    ap.add_argument("--down-s", type=float, default=0.5, help="seconds it stays down")
    ap.add_argument("--pairs", type=int, default=None, help="runs of each side (default 2; quick 1)")
    ap.add_argument("--baseline", default="", help="also run each pair against this commit's lighthouse")
    args = ap.parse_args(argv)
    n = args.replicas or (128 if args.quick else 2048)
    procs = args.processes or (2 if args.quick else 1)
    budget = args.budget if args.budget is not None else (500.0 if args.quick else None)
    rounds, fault_step = args.rounds or (5 if args.quick else 8), args.fault_step or (3 if args.quick else 4)
    pairs = args.pairs or (1 if args.quick else 2)
    if (n < 2 or procs < 1 or pairs < 1 or not 1 <= fault_step < rounds or args.down_s <= 0
            or (budget is not None and budget <= 0)):
        ap.error("need --replicas >= 2, --pairs >= 1, 1 <= --fault-step < --rounds, --down-s > 0 and --budget > 0")
    from before_after import commit_name, sides as baseline_sides

    runs = []
    with tempfile.TemporaryDirectory(prefix="fthsdp-baseline-") as d:
        sides = baseline_sides(args.baseline, pathlib.Path(d))
        for i in range(pairs):
            for side, root in (sides if i % 2 == 0 else sides[::-1]):
                r = run(n, rounds, fault_step, args.down_s, root, budget, procs)
                r.update(side=side, pair=i)
                runs.append(r)
                print(f"pair {i} {side:8s}: {r['declared_dead']} declared dead, {r['complete_rounds']}/{r['rounds']} "
                      f"rounds complete, longest {r['max_s'] or float('nan'):.2f} s, the restart's "
                      + (f"{r['restart_round_s']:.2f} s" if r["restart_round_s"] is not None else "complete")
                      + f", violations: "
                      f"{r['violations'] or 'none'}; pacing: {r['pacing_log'][-3:]}", flush=True)

    def med(side: str, key: str):
        xs = [r[key] for r in runs if r["side"] == side and r[key] is not None]
        return statistics.median(xs) if xs else None

    keys = ("declared_dead", "complete_rounds", "max_s", "p50_s", "restart_round_s")
    summary = {side: {k: med(side, k) for k in keys}
               for side in dict.fromkeys(r["side"] for r in runs)}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"experiment": "paced_restart", "quick": args.quick, "commit": commit_name(),
                               "baseline": commit_name(args.baseline) if args.baseline else None,
                               "runs": runs, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
