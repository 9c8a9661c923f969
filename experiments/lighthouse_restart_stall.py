"""What a lighthouse SIGKILL costs a job, by when it lands.

    python experiments/lighthouse_restart_stall.py [--quick] [--baseline COMMIT] \\
        --out results/lighthouse_restart_stall.json

Runs the emulation (fthsdp/sim/emulation.py: the real lighthouse process, the replicas'
control loop emulated) of R replicas x G ranks with the lighthouse SIGKILLed once and
restarted on its port ``--down-s`` later, in two places:

  between    as replica 0 begins step S (the others are computing or asking): every replica
             rides the outage out in its quorum request
  answering  the moment replica 0 holds its answer for step S, while the lighthouse is still
             writing the other members' answers: those that got one enter the all-reduce, the
             rest ask the restarted lighthouse

Per run: the job's *stall* (the longest round minus the median round, a round being the
time between the replicas' last quorum answers of two consecutive steps), the longest
all-reduce wait against its deadline, how many replicas were in the all-reduce when the
lighthouse died (aborted it on hearing the others ask, or waited out its deadline), and
that every invariant held. With ``--baseline COMMIT`` each arm also runs against that
commit's lighthouse (``EmulationConfig.lighthouse_from``, the emulator being this tree's),
in alternating order, and the JSON gives the ratios of the stalls (baseline / now); with
``--baseline-whole`` the baseline arm runs that commit's clients too (the whole emulation
from its extract, in a process of its own: for a change on the replicas' side; the commit
must know the fault kinds).

What to expect: ``between`` costs about the outage; before the heartbeat replies named the
replicas asking (``HeartbeatResponse.asking_replica_ids``), ``answering`` cost the
all-reduce's deadline (``--deadline``), now about the outage too. Past 500 processes (e.g.
``--replicas 2048 --ranks 1``) the lighthouse paces their beats (fthsdp/control/pacing.py);
each run also counts the deaths it declared (every one false: only the lighthouse is killed)
and keeps its pacing lines, which show whether the restarted one kept the pace its processes
brought (``BeatPacer.inherit``) or rebuilt it from a growing count.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

from fthsdp.sim.emulation import EmulationConfig, Fault, run_emulation  # noqa: E402
from fthsdp.sim.mock_plane import ModelShape  # noqa: E402
from fthsdp.timeouts import Timeouts  # noqa: E402

from relay_failover import rounds_of  # noqa: E402

WHERE = {"between": "lighthouse", "answering": "lighthouse_answering"}

def run_whole(root: str, *args, fn: str = "run") -> dict:
    """``fn`` (:func:`run`, :func:`client_reconnect`) with the fthsdp of the extract ``root``
    (emulator, clients and servers)."""
    from before_after import call_with

    return call_with(root, "lighthouse_restart_stall", fn, *args)


def run(where: str, replicas: int, ranks: int, steps: int, fault_step: int, down_s: float, deadline_s: float,
        lighthouse_from: str = "") -> dict:
    t = Timeouts(detect_s=0.8, join_timeout_s=0.5, allreduce_timeout_s=deadline_s, catch_up_timeout_s=5.0,
                 quorum_timeout_s=60.0, lighthouse_outage_s=30.0)
    cfg = EmulationConfig(replicas=replicas, ranks_per_replica=ranks, steps=steps, timeouts=t,
                          model=ModelShape(params=10**8, step_s=0.05), run_timeout_s=300.0,
                          faults=(Fault(WHERE[where], step=fault_step, seconds=down_s),),
                          lighthouse_from=lighthouse_from)
    rep = run_emulation(cfg)
    by_step = rounds_of(rep, {str(i) for i in range(replicas)})
    if not by_step:  # no stall can be read: say why instead of failing on an empty median
        raise SystemExit(f"lighthouse_restart_stall: no round of {replicas} replicas x {ranks} ranks completed "
                         f"(killed {where}); first violations: {rep.violations()[:3]}; this host is likely too "
                         f"small for the shape: try fewer --replicas or a longer --deadline")
    median = statistics.median(by_step.values())
    waits = [w for what, w, _ in rep.waits if "all-reduce" in what]
    failed = [e for e in rep.events if f"step {fault_step} " in e and "all-reduce failed" in e]
    return {
        "where": where, "replicas": replicas, "ranks": replicas * ranks, "fault_step": fault_step,
        "down_s": down_s, "allreduce_deadline_s": deadline_s,
        "median_round_s": median, "max_round_s": max(by_step.values()), "stall_s": max(by_step.values()) - median,
        "stalled_step": max(by_step, key=by_step.get), "max_allreduce_wait_s": max(waits, default=0.0),
        # the members answered before the SIGKILL, and how their all-reduce ended
        "in_allreduce_at_kill": len(failed),
        "aborted_on_asking": sum("ask for a quorum" in e for e in failed),
        "failed_at_deadline": sum("deadline" in e for e in failed),
        "violations": rep.violations()[:5], "final_steps": sorted(set(rep.final_steps.values())),
        "lighthouse_starts": rep.lighthouse_starts, "wall_s": rep.wall_s,
        # nobody is killed but the lighthouse: every death it declared is false (beats taken for
        # silence); and its pacing lines, both starts (past 500 processes at the defaults)
        "declared_dead": rep.lighthouse_log.get("declared_dead", 0), "pacing_log": rep.lighthouse_log.get("paced", []),
        "rounds_s": {str(k): round(v, 6) for k, v in sorted(by_step.items())},
    }


def client_reconnect(trials: int, down_s: float) -> dict:
    """The replicas' own (threaded) client across a restart: a LighthouseClient asks while its
    lighthouse (in-process, a one-replica job) is down, and the seconds from the restarted one
    serving to the answer are taken, ``trials`` times, the outage lengthened by up to 0.5 s (the
    retry backoff's cap) from one to the next so that the restart falls at every point of the
    client's retry cycle."""
    import socket
    import threading

    from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
    from fthsdp.control.lighthouse_client import LighthouseClient

    after: list[float] = []
    for k in range(trials):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cfg = LighthouseConfig(bind=f"127.0.0.1:{port}", join_timeout_s=0.05, detect_s=0.6)
        first = LighthouseThread(cfg)
        first.start()
        client = LighthouseClient(f"127.0.0.1:{port}", "restart-stall", 0, outage_s=30.0)
        second = LighthouseThread(cfg)
        try:
            client.get_quorum(0, ftar_addresses=["127.0.0.1:1"], num_replicas=1, timeout_s=10)
            first.stop()
            answered: list[float] = []
            asker = threading.Thread(target=lambda: answered.append(
                client.get_quorum(1, ftar_addresses=["127.0.0.1:1"], num_replicas=1, timeout_s=30) and
                time.monotonic()))
            asker.start()
            time.sleep(down_s + 0.5 * k / max(1, trials))
            second.start()
            serving = time.monotonic()
            asker.join(30)
            if not answered:
                raise RuntimeError("the client was not answered by the restarted lighthouse within 30 s")
            after.append(answered[0] - serving)
        finally:
            client.close()
            first.stop()
            second.stop()
    return {"trials": trials, "down_s": down_s, "after_serving_s": after, "median_s": statistics.median(after),
            "max_s": max(after)}


def plot(runs: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in runs:
        if r.get("pair", 0) != 0:
            continue
        xs = [int(k) for k in r["rounds_s"]]
        ax.plot(xs, list(r["rounds_s"].values()), lw=1.2, marker=".",
                label=f"{r['side']}, killed {r['where']}: stall {r['stall_s']:.2f} s "
                      f"({r['aborted_on_asking']} aborted on hearing who asks, "
                      f"{r['failed_at_deadline']} at the deadline)")
    r0 = runs[0]
    ax.axvline(r0["fault_step"], color="grey", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("round (s, log)")
    ax.set_title(f"a lighthouse SIGKILL, restarted after {r0['down_s']:g} s: {r0['replicas']} replicas x "
                 f"{r0['ranks'] // r0['replicas']} ranks (emulated), "
                 f"all-reduce deadline {r0['allreduce_deadline_s']:g} s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 replicas, one pair (CI)")
    ap.add_argument("--replicas", type=int, default=None, help="default 256 (64 with --quick)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks per replica")
    ap.add_argument("--down-s", type=float, default=0.5, help="seconds the lighthouse stays down")
    ap.add_argument("--deadline", type=float, default=6.0, help="the all-reduce's deadline (s)")
    ap.add_argument("--pairs", type=int, default=None, help="runs of each arm (default 3, 1 with --quick)")
    ap.add_argument("--where", nargs="*", default=list(WHERE), choices=list(WHERE))
    ap.add_argument("--baseline", default="", help="also run each arm against this commit's lighthouse")
    ap.add_argument("--baseline-whole", action="store_true",
                    help="the baseline arm runs that commit's whole emulation (its clients too), "
                         "not only its lighthouse")
    ap.add_argument("--client-trials", type=int, default=None,
                    help="restarts the threaded client rides out, per side (default 10, 3 with --quick; 0: none)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    client_trials = args.client_trials if args.client_trials is not None else (3 if args.quick else 10)
    replicas = args.replicas or (64 if args.quick else 256)
    pairs = args.pairs or (1 if args.quick else 3)
    if replicas < 2 or args.ranks < 1 or not 0 < args.down_s < args.deadline or pairs < 1:
        ap.error("need --replicas >= 2, --ranks >= 1, 0 < --down-s < --deadline and --pairs >= 1")
    if args.baseline_whole and not args.baseline:
        ap.error("--baseline-whole needs --baseline COMMIT")
    fault_step, steps = 5, 10
    from before_after import sides as baseline_sides

    runs = []
    with tempfile.TemporaryDirectory(prefix="fthsdp-baseline-") as d:
        sides = baseline_sides(args.baseline, pathlib.Path(d))
        for i in range(pairs):
            for where in args.where:
                for side, root in (sides if i % 2 == 0 else sides[::-1]):
                    if root and args.baseline_whole:
                        r = run_whole(root, where, replicas, args.ranks, steps, fault_step, args.down_s, args.deadline)
                    else:
                        r = run(where, replicas, args.ranks, steps, fault_step, args.down_s, args.deadline, root)
                    r.update(side=side, pair=i)
                    runs.append(r)
                    print(f"pair {i} {side:8s} killed {where:9s}: median round {r['median_round_s'] * 1e3:.0f} ms, "
                          f"stall {r['stall_s']:.2f} s (step {r['stalled_step']}), longest all-reduce wait "
                          f"{r['max_allreduce_wait_s']:.2f} s of {args.deadline:g}; {r['in_allreduce_at_kill']} in "
                          f"the all-reduce: {r['aborted_on_asking']} aborted on hearing who asks, "
                          f"{r['failed_at_deadline']} at the deadline; {r['declared_dead']} declared dead; "
                          f"violations: {r['violations'] or 'none'}",
                          flush=True)

        clients = {}
        for side, root in sides if client_trials > 0 else ():
            clients[side] = (run_whole(root, client_trials, args.down_s, fn="client_reconnect")
                             if root and args.baseline_whole else client_reconnect(client_trials, args.down_s))
            c = clients[side]
            print(f"{side:8s} threaded client: answered {c['median_s']:.3f} s (median; max {c['max_s']:.3f} s) after "
                  f"the restarted lighthouse serves, {client_trials} restarts", flush=True)
        if "baseline" in clients and clients["now"]["median_s"] > 0:
            clients["ratio_baseline_over_now"] = clients["baseline"]["median_s"] / clients["now"]["median_s"]

    def med(side: str, where: str) -> float | None:
        xs = [r["stall_s"] for r in runs if r["side"] == side and r["where"] == where]
        return statistics.median(xs) if xs else None

    summary = {w: {"now_stall_s": med("now", w), "baseline_stall_s": med("baseline", w)} for w in args.where}
    for w, s in summary.items():
        if s["baseline_stall_s"] is not None and s["now_stall_s"]:
            s["ratio_baseline_over_now"] = s["baseline_stall_s"] / s["now_stall_s"]
        print(f"killed {w}: median stall now {s['now_stall_s']:.2f} s"
              + (f", baseline {s['baseline_stall_s']:.2f} s (x{s['ratio_baseline_over_now']:.1f})"
                 if "ratio_baseline_over_now" in s else ""))
    from before_after import commit_name

    head = commit_name()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs, "summary": summary, "threaded_client": clients, "quick": args.quick,
                               "commit": head,
                               "baseline": commit_name(args.baseline) if args.baseline else None,
                               "baseline_runs": ("whole emulation" if args.baseline_whole else "lighthouse only")
                               if args.baseline else None}, indent=1))
    plot(runs, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if all(not r["violations"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
