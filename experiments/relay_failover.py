"""What a relay's failure costs a job (the relay tier, fthsdp/control/relay.py).

    python experiments/relay_failover.py [--quick] --out results/relay_failover.json

Runs the emulation (fthsdp/sim/emulation.py: the real lighthouse and real
relay processes, the replicas' control loop emulated) of R replicas x G ranks
behind K relays three times, with the job's own relay timings
(``RelayPath``: a return tried 5 s after leaving, a silent relay left after
3 s):

  none     no fault: the baseline round
  killed   relay 0 SIGKILLed at step S and restarted on its port 0.5 s later
           (what `fthsdp run` does with a relay that died)
  stopped  relay 0 SIGSTOPped at step S for ``--stop-s`` seconds, then continued

From the quorum answers of the replicas *not* behind relay 0 it takes each
step's *round*: the time between their last answer of the step before and
their last of this one. Per run: the median round, the longest one
(``max_round_s``) and ``stall_s``, the longest minus the median (what the
fault cost the rest of the job); ``block_out_s``, the longest any of relay
0's replicas went without an answer, beyond a median round (what it cost
them); the processes that left their relay and came back (the emulation's
count); the replicas that caught up (declared dead, then rejoined); and that
every invariant held. One JSON (``runs``) and a plot of the rounds against
the step.

What to expect: a killed relay restarted in half a second is ridden out as a
lighthouse outage by its clients (a stall of about the restart); a stopped
relay's block is declared dead (its clients leave it only after 3 s of
silence: a busy relay is slow too) while the other replicas go on, and
rejoins.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fthsdp.control.session_client import RelayPath  # noqa: E402
from fthsdp.sim.emulation import EmulationConfig, EmulationReport, Fault, run_emulation  # noqa: E402
from fthsdp.sim.mock_plane import ModelShape  # noqa: E402

SCENARIOS = ("none", "killed", "stopped")


def rounds_of(rep: EmulationReport, replicas: set[str]) -> dict[int, float]:
    """step -> its round for ``replicas``: from their last quorum answer of the step before to
    their last of this one."""
    last: dict[int, float] = {}
    for r in rep.quorum_records:
        if r.replica_id in replicas:
            last[r.step] = max(last.get(r.step, 0.0), r.received)
    steps = sorted(last)
    return {s: last[s] - last[p] for p, s in zip(steps, steps[1:]) if last[s] > last[p]}


def longest_gap(rep: EmulationReport, replicas: set[str]) -> float:
    """The longest time any of ``replicas`` went between two quorum answers (out of the job meanwhile)."""
    times: dict[str, list[float]] = {}
    for r in rep.quorum_records:
        if r.replica_id in replicas:
            times.setdefault(r.replica_id, []).append(r.received)
    return max((b - a for ts in times.values() for a, b in zip(sorted(ts), sorted(ts)[1:])), default=0.0)


def left_and_back(events: list[str]) -> tuple[int, int]:
    """How many processes left a failed relay, and how many of them are back on it (the report's line)."""
    for e in events:
        m = re.match(r"(\d+) process\(es\) left a failed relay .*; (\d+) are back on it", e)
        if m:
            return int(m.group(1)), int(m.group(2))
    return 0, 0


def run(scenario: str, replicas: int, ranks: int, relays: int, steps: int, fault_step: int, stop_s: float) -> dict:
    faults = {"none": (), "killed": (Fault("relay", step=fault_step, replica=0, seconds=0.5),),
              "stopped": (Fault("relay_stop", step=fault_step, replica=0, seconds=stop_s),)}[scenario]
    cfg = EmulationConfig(replicas=replicas, ranks_per_replica=ranks, steps=steps, relays=relays, faults=faults,
                          model=ModelShape(params=10**9, step_s=0.05), run_timeout_s=600.0)
    rep = run_emulation(cfg)
    block = {str(i) for i in range(replicas) if i * relays // replicas == 0}  # relay 0's (contiguous blocks)
    others = {str(i) for i in range(replicas)} - block
    by_step = rounds_of(rep, others)
    rounds = list(by_step.values())
    median = statistics.median(rounds)
    left, back = left_and_back(rep.events)
    dead = sorted({rid for e in rep.events for rid in re.findall(r"lighthouse declared \['([^']+)'", e)}, key=int)
    caught_up = sorted({m.group(1) for e in rep.events for m in [re.match(r"replica (\S+): caught up", e)] if m},
                       key=int)
    return {
        "scenario": scenario, "replicas": replicas, "ranks": replicas * ranks, "relays": relays, "steps": steps,
        "fault_step": fault_step if faults else None, "stop_s": stop_s if scenario == "stopped" else None,
        # the other replicas' rounds: what the fault cost the rest of the job
        "median_round_s": median, "max_round_s": max(rounds), "stall_s": max(rounds) - median,
        "stalled_step": max(by_step, key=by_step.get),
        # relay 0's replicas: the longest any of them went without a quorum answer, beyond a round
        "block_replicas": len(block), "block_out_s": longest_gap(rep, block) - median,
        "processes_left_relay": left, "processes_back_on_relay": back,
        "replicas_caught_up": caught_up, "declared_dead_events": dead,
        "violations": rep.violations()[:5], "final_steps": sorted(set(rep.final_steps.values())),
        "wall_s": rep.wall_s, "rounds_s": {str(k): round(v, 6) for k, v in sorted(by_step.items())},
    }


def plot(runs: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in runs:
        xs = [int(k) for k in r["rounds_s"]]
        ax.plot(xs, [v * 1e3 for v in r["rounds_s"].values()], lw=1.2,
                label=f"{r['scenario']}: the others' stall {r['stall_s'] * 1e3:.0f} ms, the block out "
                      f"{r['block_out_s']:.1f} s; {r['processes_left_relay']} left / {r['processes_back_on_relay']} back")
    for step in {r["fault_step"] for r in runs if r["fault_step"] is not None}:
        ax.axvline(step, color="grey", ls=":", lw=1)
    r0 = runs[0]
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("round of the replicas not behind relay 0 (ms, log)")
    ax.set_title(f"a relay's failure: {r0['replicas']} replicas x {r0['ranks'] // r0['replicas']} ranks behind "
                 f"{r0['relays']} relays (emulated)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 replicas x 64 ranks, 2 relays, a 3 s stop (CI)")
    ap.add_argument("--replicas", type=int, default=None)
    ap.add_argument("--ranks", type=int, default=None, help="ranks per replica")
    ap.add_argument("--relays", type=int, default=None)
    ap.add_argument("--stop-s", type=float, default=None, help="how long the stopped relay stays stopped")
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    replicas = args.replicas or (8 if args.quick else 32)
    ranks = args.ranks or (64 if args.quick else 320)
    relays = args.relays or (2 if args.quick else 4)
    stop_s = args.stop_s if args.stop_s is not None else (3.0 if args.quick else 15.0)
    if not (1 <= relays <= replicas and ranks >= 1 and stop_s > 0):
        ap.error(f"need 1 <= relays ({relays}) <= replicas ({replicas}), ranks >= 1 and --stop-s > 0")
    # Long enough for a stopped relay's clients to leave it (after RelayPath.SILENCE_S) and come
    # back (RETRY_S later) when the stop is that long, at ~70 ms a round on a 2-core host.
    fault_step = 10
    after = RelayPath.SILENCE_S + 2 * RelayPath.RETRY_S if stop_s >= RelayPath.SILENCE_S else 5.0
    steps = fault_step + int((stop_s + after) / 0.07)
    runs = []
    for sc in args.scenarios:
        r = run(sc, replicas, ranks, relays, steps, fault_step, stop_s)
        print(f"{sc:8s} {replicas} x {ranks} ranks, {relays} relays: the others' median round "
              f"{r['median_round_s'] * 1e3:.0f} ms, longest {r['max_round_s'] * 1e3:.0f} ms (step {r['stalled_step']}), "
              f"stall {r['stall_s'] * 1e3:.0f} ms; relay 0's {r['block_replicas']} replicas out {r['block_out_s']:.2f} s; "
              f"{r['processes_left_relay']} process(es) left a relay, {r['processes_back_on_relay']} back; "
              f"caught up: {r['replicas_caught_up'] or 'none'}; violations: {r['violations'] or 'none'}", flush=True)
        runs.append(r)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs, "quick": args.quick}, indent=1))
    plot(runs, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if all(not r["violations"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
