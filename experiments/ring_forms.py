"""What a change of membership costs the lighthouse's answers: rings whole, as a delta, or as
each process's ring neighbours only.

    python experiments/ring_forms.py [--quick] --out results/ring_forms.json

A leader's answer carries the FTAR rings of its shards. Whole, that is every member's
endpoint of each shard, O(members x shards): 1.45 MB a leader and 0.74 GB a round at
512 replicas x 196 shards. A steady round leaves them out (the leader holds that quorum
id's view); the first round and every new quorum id (a replica died, one rejoined, a
commit failed) send them to every leader. Three forms, as the request asks
(``fthsdp.control.lighthouse_client.RING_FORMS``):

* ``whole``: as the oldest clients;
* ``delta`` (``accepts_ring_delta``): against the view the leader holds (its last
  quorum), only the endpoints of members new since then or whose endpoints changed;
  the first round, and a leader holding no view, still get them whole;
* ``neighbours`` (``accepts_ring_neighbours``, the client's default): a ring all-reduce
  connects each endpoint to its two neighbours only, so each leader gets just their
  endpoints of its shards, O(shards), in every round that carries rings.

Runs the emulation (fthsdp/sim/emulation.py: the real lighthouse process, the
replicas' control loop emulated) of R replicas x G ranks once per form and repeat, in
the same run, alternating, with one replica SIGKILL-like killed at step S and restarted
0.5 s later (two changes of membership: it leaves, it rejoins), one commit failure, and
the lighthouse SIGKILLed and restarted 1 s later. For the first round and for the rounds
whose quorum id changed after it: the bytes of all leaders' answers, the round's latency
(from the last request to every rank holding the answer, as experiments/scale.py), and
the emulator's CPU over the run; for the restarted lighthouse's first decision, its
answers' bytes and its round's latency from the restarted lighthouse serving to every
rank holding the answer (what the replicas' retries, the lighthouse's rebuilding of the
job from their reports and the answers take once it is back; the outage is not in it).
JSON ``runs`` and ``ratios`` (each form against ``whole``, and ``delta`` against
``neighbours``), and a plot.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fthsdp.sim.emulation import EmulationConfig, Fault, run_emulation  # noqa: E402
from fthsdp.sim.mock_plane import ModelShape  # noqa: E402
from fthsdp.timeouts import Timeouts  # noqa: E402

ARMS = ("whole", "delta", "neighbours")


def one_run(arm: str, replicas: int, ranks: int, steps: int, kill_step: int) -> dict:
    faults = (Fault("kill", step=kill_step, replica=replicas // 3, seconds=0.5),
              Fault("ring", step=kill_step + 4, rank=1),
              Fault("lighthouse", step=kill_step + 6, seconds=1.0))
    # Detection and join limits as experiments/scale.py's (a steady round never waits on them):
    # the first round at this size moves every ring whole, seconds on a shared 2-core host.
    t = Timeouts(heartbeat_interval_s=0.1, detect_s=5.0, join_timeout_s=30.0, allreduce_timeout_s=60.0,
                 quorum_timeout_s=120.0, lighthouse_outage_s=60.0)
    cfg = EmulationConfig(replicas=replicas, ranks_per_replica=ranks, steps=steps, timeouts=t, faults=faults,
                          model=ModelShape(params=8_000_000_000, step_s=0.02), round_barrier=True,
                          run_timeout_s=600.0, ring_form=arm, job_id=f"ring-forms-{arm}")
    t0 = time.monotonic()
    rep = run_emulation(cfg)
    wall = time.monotonic() - t0
    # Each new quorum id after the first (a change of membership or a failed commit), as its
    # members first got it: the bytes of those answers and the round, from the last of those
    # requests to every rank holding the answer (experiments/scale.py's latency).
    first: dict[tuple[int, str], tuple] = {}
    for rec, (_, answer) in zip(rep.quorum_records, rep.wire_sizes):
        first.setdefault((rec.quorum_id, rec.replica_id), (rec, answer))
    qids = sorted({q for q, _ in first})
    rounds = []
    for qid in qids:
        got = [v for (q, _), v in first.items() if q == qid]
        if any(rec.outage_s for rec, _ in got):
            continue
        rounds.append({"quorum_id": qid, "replicas": len(got), "answer_bytes": sum(b for _, b in got),
                       "answer_bytes_max": max(b for _, b in got),
                       "latency_s": max(r.all_ranks_hold for r, _ in got) - max(r.last_rank_request for r, _ in got)})
    opening = rounds[0] if rounds and rounds[0]["quorum_id"] == qids[0] else None
    changes = [r for r in rounds if r is not opening]
    # The restarted lighthouse's first decision (its askers rode the outage out: the round from
    # their last request is the outage's; from the restarted lighthouse serving to every rank
    # holding the answer is the restart's own): it holds no earlier view, so a delta has nothing
    # to be against.
    rode = sorted({rec.quorum_id for rec, _ in first.values() if rec.outage_s})
    restart = None
    if rode:
        got = [v for (q, _), v in first.items() if q == rode[0]]
        back = [t for t in rep.lighthouse_started_at[1:] if t < min(r.all_ranks_hold for r, _ in got)]
        restart = {"quorum_id": rode[0], "replicas": len(got), "answer_bytes": sum(b for _, b in got),
                   "answer_bytes_max": max(b for _, b in got),
                   "latency_from_lighthouse_back_s": max(r.all_ranks_hold for r, _ in got) - back[-1] if back else None}
    return {
        "arm": arm, "replicas": replicas, "ranks": replicas * ranks, "wall_s": wall,
        "violations": rep.violations(), "final_steps": sorted(set(rep.final_steps.values())),
        "first_round": opening, "changes": changes, "restart_round": restart,
        "lighthouse_starts": rep.lighthouse_starts,
        "change_answer_bytes_median": statistics.median([c["answer_bytes"] for c in changes]) if changes else None,
        "change_latency_median_s": statistics.median([c["latency_s"] for c in changes]) if changes else None,
        "first_answer_bytes_max": rep.answer_bytes,
        "emulator_cpu_s": rep.emulator_cpu_s,
    }


def plot(runs: list[dict], path: pathlib.Path) -> None:
    """Each change round of each run: its answers' bytes and its latency, per form."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_l) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(ARMS)
    for k, (arm, color) in enumerate(zip(ARMS, ("tab:red", "tab:blue", "tab:green"))):
        cs = [c for r in runs if r["arm"] == arm for c in ([r["first_round"]] if r["first_round"] else []) + r["changes"]]
        xs = range(len(cs))
        off = (k - (len(ARMS) - 1) / 2) * width
        ax_b.bar([x + off for x in xs], [c["answer_bytes"] / 1e6 for c in cs], width, color=color, label=arm)
        ax_l.bar([x + off for x in xs], [c["latency_s"] * 1e3 for c in cs], width, color=color, label=arm)
    ax_b.set(ylabel="MB of answers in the round", xlabel="first round, then each change of quorum id (runs in order)",
             yscale="log")
    ax_l.set(ylabel="round latency (ms)", xlabel="first round, then each change of quorum id (runs in order)",
             yscale="log")
    ax_b.legend()
    fig.suptitle(f"a new quorum's rings: whole, as a delta, or ring neighbours only ({runs[0]['replicas']} replicas, "
                 f"{runs[0]['ranks']} ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=512)
    p.add_argument("--ranks", type=int, default=196, help="ranks (shards) per replica")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating")
    p.add_argument("--quick", action="store_true", help="64 x 32, 12 steps, one run each (CI)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the forms to run (default all)")
    p.add_argument("--out", default="results/ring_forms.json")
    a = p.parse_args(argv)
    if a.quick:
        a.replicas, a.ranks, a.steps, a.repeats = 64, 32, 12, 1
    kill_step = max(3, a.steps // 4)
    runs = []
    for k in range(a.repeats):
        for arm in a.arms:
            r = one_run(arm, a.replicas, a.ranks, a.steps, kill_step)
            runs.append(r)
            first = r["first_round"] or {}
            print(f"[{k + 1}/{a.repeats}] {arm}: first round {first.get('answer_bytes')} B of answers, after the "
                  f"lighthouse's restart {(r['restart_round'] or {}).get('answer_bytes')} B in "
                  f"{(r['restart_round'] or {}).get('latency_from_lighthouse_back_s')} s from its start, "
                  f"{len(r['changes'])} changes of quorum id, answers "
                  f"{r['change_answer_bytes_median']} B a change round (median), latency "
                  f"{r['change_latency_median_s']} s, emulator CPU {r['emulator_cpu_s']:.1f} s, "
                  f"violations {len(r['violations'])}", flush=True)

    def med(arm: str, key: str) -> float | None:
        xs = [r[key] for r in runs if r["arm"] == arm and r[key] is not None]
        return statistics.median(xs) if xs else None

    for r in runs:  # the first round's and the restart's figures, for med()
        r["first_answer_bytes"] = (r["first_round"] or {}).get("answer_bytes")
        r["first_latency_s"] = (r["first_round"] or {}).get("latency_s")
        r["restart_answer_bytes"] = (r["restart_round"] or {}).get("answer_bytes")
        r["restart_latency_s"] = (r["restart_round"] or {}).get("latency_from_lighthouse_back_s")
    ratios: dict[str, dict] = {}
    for num, den in (("whole", "delta"), ("whole", "neighbours"), ("delta", "neighbours")):
        ratios[f"{num}_over_{den}"] = {
            key: (med(num, key) / med(den, key)) if med(num, key) and med(den, key) else None
            for key in ("first_answer_bytes", "first_latency_s", "change_answer_bytes_median",
                        "change_latency_median_s", "restart_answer_bytes", "restart_latency_s", "emulator_cpu_s")}
    out = {"shape": f"{a.replicas}x{a.ranks}", "kill_step": kill_step, "runs": runs, "ratios": ratios}
    path = pathlib.Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    plot(runs, path.with_suffix(".png"))
    print(f"ratios: {json.dumps(ratios)}; wrote {path} and {path.with_suffix('.png')}")
    return 0 if all(not r["violations"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
