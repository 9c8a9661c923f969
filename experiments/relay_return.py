"""How soon replicas come back to a relay restarted on its port, against an earlier commit.

    python experiments/relay_return.py [--quick] [--baseline COMMIT] --out results/relay_return.json

A real relay process (``python -m fthsdp.control.relay``) in front of a lighthouse (in
process, a job of ``--clients`` replicas), and ``--clients`` of the replicas' own threaded
clients (``LighthouseClient``) behind it with their heartbeat threads (every 0.1 s), as in
a job between steps. Each trial SIGKILLs the relay and starts it again on its address
``down`` seconds later (``--down-s`` lengthened by up to 0.5 s from one trial to the next,
so the restart falls at every point of the clients' retries); the clients' paths are read
every 5 ms. Per client and trial: whether it left the relay for the lighthouse
(``RelayPath``: three broken streams over at least 0.3 s), when it was back on the relay
after the restarted one listened (``back_after_serving_s``) and how long it spoke to the
lighthouse directly (``away_s``). A relay restarted within the grace is ridden out (no
leave); one restarted later is left, and its clients came back 5 s after leaving
(``RelayPath.RETRY_S``) before they watched its channel, now within a reconnect backoff
and a beat of it listening again.

With ``--baseline COMMIT`` every trial runs with that commit's fthsdp too (clients, relay
and lighthouse: ``before_after.call_with``), each side in a process of its own, in
alternating order, and the JSON gives the ratio of the medians (baseline / now). JSON
(``sides``: per side the trials and the summary) and a plot of each return against the
restart's delay.
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
sys.path.insert(0, str(REPO / "experiments"))


def _relay(lighthouse: str, bind: str):
    """A relay process; (its address, Popen) once it listens."""
    p = subprocess.Popen([sys.executable, "-m", "fthsdp.control.relay", "--lighthouse", lighthouse, "--bind", bind,
                          "--log-level", "WARNING"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if not line.startswith("relay listening on "):
        p.kill()
        raise RuntimeError(f"the relay did not start: {line!r}")
    return line.split()[-1], p


def trials(n_clients: int, down_s: list[float], watch_s: float) -> dict:
    """The trials of one side (this process's fthsdp): see the module docstring."""
    import time

    from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
    from fthsdp.control.lighthouse_client import LighthouseClient
    from concurrent.futures import ThreadPoolExecutor

    out = []
    with LighthouseThread(LighthouseConfig(join_timeout_s=0.3, detect_s=0.8, tick_s=0.02)) as lh:
        addr, relay = _relay(lh.address, "127.0.0.1:0")
        clients = [LighthouseClient(lh.address, "relay-return", r, relay=addr, rpc_timeout_s=5.0,
                                    heartbeat_timeout_s=0.4, outage_s=30.0) for r in range(n_clients)]
        try:
            with ThreadPoolExecutor(n_clients) as ex:
                list(ex.map(lambda r: clients[r].get_quorum(0, ftar_addresses=[f"127.0.0.1:{9000 + r}"],
                                                            num_replicas=n_clients, timeout_s=30), range(n_clients)))
            for c in clients:
                c.start_heartbeats(lambda *_: None)
            for k, down in enumerate(down_s):
                if any(c.relay != addr for c in clients):
                    raise RuntimeError(f"trial {k}: a client is not on the relay at its start")
                time.sleep(0.5)
                relay.kill()
                killed = time.monotonic()
                relay.wait(10)
                relay.stdout.close()
                left_at: list[float | None] = [None] * n_clients
                while time.monotonic() - killed < down:
                    now = time.monotonic()
                    for i, c in enumerate(clients):
                        if left_at[i] is None and c.relay != addr:
                            left_at[i] = now
                    time.sleep(0.005)
                _, relay = _relay(lh.address, addr)
                serving = time.monotonic()
                back_at: list[float | None] = [None] * n_clients
                while time.monotonic() - serving < watch_s and any(b is None for b in back_at):
                    now = time.monotonic()
                    for i, c in enumerate(clients):
                        on = c.relay == addr
                        if left_at[i] is None and not on:
                            left_at[i] = now
                        if back_at[i] is None and left_at[i] is not None and on:
                            back_at[i] = now
                        elif back_at[i] is None and left_at[i] is None and now - serving > 1.0:
                            back_at[i] = -1.0  # never left: rode the restart out
                    time.sleep(0.005)
                for i in range(n_clients):
                    left = left_at[i] is not None
                    back = back_at[i] if back_at[i] is not None and back_at[i] >= 0 else None
                    out.append({"trial": k, "client": i, "down_s": round(serving - killed, 4), "left": left,
                                "back": (back is not None) if left else True,
                                "left_after_kill_s": round(left_at[i] - killed, 4) if left else None,
                                "back_after_serving_s": round(back - serving, 4) if back is not None else None,
                                "away_s": round(back - left_at[i], 4) if back is not None else None})
        finally:
            for c in clients:
                c.close()
            relay.kill()
            relay.wait(10)
    return {"trials": out, **summary(out)}


def summary(ts: list[dict]) -> dict:
    """Over client trials ``ts``: how many, how many left the relay and were not back, and the
    median / max seconds from the restarted relay listening to a leaver back on it, and away."""
    back = [t["back_after_serving_s"] for t in ts if t["left"] and t["back_after_serving_s"] is not None]
    away = [t["away_s"] for t in ts if t["away_s"] is not None]
    return {"client_trials": len(ts), "left": sum(t["left"] for t in ts), "not_back": sum(not t["back"] for t in ts),
            "median_back_after_serving_s": statistics.median(back) if back else None,
            "max_back_after_serving_s": max(back) if back else None,
            "median_away_s": statistics.median(away) if away else None}


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def plot(sides: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (side, s), marker in zip(sides.items(), "os"):
        pts = [(t["down_s"], t["back_after_serving_s"]) for t in s["trials"] if t["back_after_serving_s"] is not None]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=f"{side} ({s['commit']})", alpha=0.7)
    ax.set_xlabel("relay down (kill -> restarted one listening), s")
    ax.set_ylabel("client back on the relay after it listened, s")
    ax.set_yscale("log")
    ax.set_title("Clients that left a killed relay, back on it restarted")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 clients, 2 trials, one pair (CI)")
    ap.add_argument("--clients", type=int, default=None, help="clients behind the relay (default 4, 2 with --quick)")
    ap.add_argument("--trials", type=int, default=None, help="relay restarts per side (default 6, 2 with --quick)")
    ap.add_argument("--down-s", type=float, default=0.4, help="the shortest wait from the kill to the restart (s)")
    ap.add_argument("--pairs", type=int, default=2, help="runs of each side, alternating (the trials split over them)")
    ap.add_argument("--baseline", default="", help="also run every trial with this commit's fthsdp")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    n = args.clients or (2 if args.quick else 4)
    k = args.trials or (2 if args.quick else 6)
    pairs = 1 if args.quick else args.pairs
    if n < 1 or k < 1 or not 0 < args.down_s <= 10 or pairs < 1 or k < pairs:
        ap.error("need --clients >= 1, --trials >= --pairs >= 1 and 0 < --down-s <= 10")
    from before_after import call_with, commit_name, extract

    downs = [args.down_s + 0.5 * i / k for i in range(k)]
    sides: dict[str, dict] = {"now": {"commit": commit_name(), "trials": []}}
    with tempfile.TemporaryDirectory(prefix="fthsdp-baseline-") as d:
        order = [("now", None)]
        if args.baseline:
            extract(args.baseline, pathlib.Path(d))
            order.append(("baseline", d))
            sides["baseline"] = {"commit": commit_name(args.baseline), "trials": []}
        for i in range(pairs):
            mine = downs[i::pairs]
            for side, root in (order if i % 2 == 0 else order[::-1]):
                got = call_with(root, "relay_return", "trials", n, mine, 8.0)
                for t in got["trials"]:
                    t["trial"] = downs.index(mine[t["trial"]])
                sides[side]["trials"] += got["trials"]
                print(f"pair {i} {side:8s}: {got['left']} of {got['client_trials']} left the relay; back "
                      f"{_s(got['median_back_after_serving_s'])} (median) after it listened again; "
                      f"{got['not_back']} not back within 8 s", flush=True)
    for side, s in sides.items():
        s.update(summary(s["trials"]))
        print(f"{side:8s} ({s['commit']}): {s['left']} of {s['client_trials']} left; back {_s(s['median_back_after_serving_s'])} "
              f"after it listened (median; max {_s(s['max_back_after_serving_s'])}), away {_s(s['median_away_s'])}")
    result = {"clients": n, "down_s": downs, "quick": args.quick, "sides": sides}
    b, m = sides.get("baseline", {}).get("median_back_after_serving_s"), sides["now"]["median_back_after_serving_s"]
    if b and m:
        result["ratio_baseline_over_now"] = b / m
        print(f"back after the restarted relay listened: x{b / m:.1f} sooner (medians, baseline / now)")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(sides, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if all(s["not_back"] == 0 for s in sides.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
