"""What one session message costs the lighthouse's Python, without gRPC.

    python experiments/lighthouse_message_cost.py [--quick] [--baseline COMMIT] \\
        --out results/lighthouse_message_cost.json

**Why.** At 512 replica leaders a quorum round is mostly the lighthouse's work per
message (experiments/scale.py's breakdown): its gRPC reads and writes, which the bare
transport measures (experiments/grpc_floor.py), and its own Python: the session
envelope, the budgets (fthsdp/control/admission.py), the guard's checks, the
bookkeeping of a heartbeat or a quorum request, the decision, the answer. This measures
the second alone, steadily: the real lighthouse's session handler (the very function
gRPC calls for ``LighthouseSession.Open``) is fed R leaders' streams through stand-in
stream contexts (an asyncio queue to read from, a list to write to), each round one
heartbeat and one quorum request per leader at the same step, held endpoints, answers
as ring neighbourhoods, as the emulated leaders of scale.py send them. The process CPU
time of the measured rounds over their messages is the cost of one message (the
stand-ins' own few microseconds included). A round is complete when every leader holds
its answer, and every answer is checked to be an OK quorum.

Arms, each in its own process, alternating over ``--repeats``: ``now`` (this tree),
``now-no-budgets`` (the lighthouse without its per-connection and per-job budgets, as
``fthsdp lighthouse --no-fairness``: what they cost), and with ``--baseline COMMIT``
the same at that commit (its fthsdp extracted with ``git archive``, as
experiments/before_after.py does). Reported: each arm's median microseconds per message
and the ratios to ``now``; and the CPU of its first round, in which every leader registers
its endpoints (``ranks`` of them; 100,352 at 512 x 196), as after a lighthouse restart or
at a job's start, and its ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHILD = "MESSAGE_COST "  # the child's result line


class _Stream:
    """A stand-in for gRPC's stream context: reads from a queue, keeps what is written."""

    def __init__(self, i: int) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.out: list[bytes] = []
        self.i = i

    def peer(self) -> str:
        return f"ipv4:127.0.0.1:{20000 + self.i}"

    async def read(self):
        return await self.inbox.get()

    async def write(self, raw: bytes) -> None:
        self.out.append(raw)


async def _rounds(replicas: int, ranks: int, rounds: int, budgets: bool) -> dict:
    from fthsdp.control import lighthouse as lh, session
    from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as stubs

    pb2, _ = stubs()
    config = lh.LighthouseConfig(min_replicas=replicas, join_timeout_s=60.0)
    if not budgets:
        config = lh.LighthouseConfig(min_replicas=replicas, join_timeout_s=60.0, fairness=None)
    light = lh.Lighthouse(config)
    serve = session.generic_handler(light, light._gate).service(
        type("Details", (), {"method": session.METHOD})()).stream_stream
    streams = [_Stream(i) for i in range(replicas)]
    tasks = [asyncio.get_running_loop().create_task(serve(None, s)) for s in streams]
    seq, held_qid = [0] * replicas, [0] * replicas

    def envelope(i: int, method: str, body: bytes) -> bytes:
        seq[i] += 1
        return session.envelope(seq[i], method, body, 30.0)

    def quorum_request(i: int, step: int) -> bytes:
        r = pb2.QuorumRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="cost", replica_id=f"r{i:05d}",
                              step=step, local_world_size=ranks, last_quorum_id=held_qid[i], fresh_start=step == 0,
                              incarnation=f"inc{i}", num_processes=1, accepts_members_omitted=True,
                              accepts_ring_neighbours=True, request_id=step * 1_000_000 + i + 1)
        if step == 0:  # registers its endpoints; held after
            r.ftar_addresses.extend(f"127.0.{i // 250}.{i % 250 + 1}:{10000 + k}" for k in range(ranks))
            r.state_server_address = f"127.0.{i // 250}.{i % 250 + 1}:9000"
        else:
            r.endpoints_held = True
        return r.SerializeToString()

    def heartbeat(i: int, step: int) -> bytes:
        return pb2.HeartbeatRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="cost",
                                    replica_id=f"r{i:05d}", step=step, last_quorum_id=held_qid[i], num_processes=1,
                                    incarnation=f"inc{i}").SerializeToString()

    async def round_(step: int) -> None:
        beats = step > 0
        msgs = [([envelope(i, "Heartbeat", heartbeat(i, step))] if beats else [])
                + [envelope(i, "GetQuorum", quorum_request(i, step))] for i in range(replicas)]
        want = [len(s.out) + len(m) for s, m in zip(streams, msgs)]
        for s, m in zip(streams, msgs):
            for raw in m:
                s.inbox.put_nowait(raw)
        deadline = time.monotonic() + 60.0
        while any(len(s.out) < w for s, w in zip(streams, want)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"round {step}: not every leader was answered within 60 s")
            await asyncio.sleep(0)
        for i, s in enumerate(streams):
            rep = pb2.SessionReply.FromString(s.out[-1])
            if rep.code != 0:
                raise RuntimeError(f"round {step}: leader {i} was refused ({rep.code}): {rep.details}")
            held_qid[i] = pb2.QuorumResponse.FromString(rep.body).quorum.quorum_id

    cpu0 = time.process_time()
    await round_(0)  # registration: every leader's endpoints (ranks of them), as after a lighthouse restart
    registration = time.process_time() - cpu0
    await round_(1)  # the first round with held endpoints and beats
    cpu0, t0 = time.process_time(), time.perf_counter()
    for step in range(2, 2 + rounds):
        await round_(step)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    messages = 2 * replicas
    return {"cpu_s_per_round": cpu / rounds, "wall_s_per_round": wall / rounds, "messages_per_round": messages,
            "us_per_message": cpu / rounds / messages * 1e6, "quorum_id": held_qid[0],
            "registration_cpu_s": registration}


def _child(argv: list[str]) -> int:
    replicas, ranks, rounds, budgets = int(argv[0]), int(argv[1]), int(argv[2]), argv[3] == "1"
    from fthsdp.gc_policy import low_pause_gc  # as the lighthouse's command runs

    with low_pause_gc():
        out = asyncio.run(_rounds(replicas, ranks, rounds, budgets))
    import fthsdp

    out["fthsdp_from"] = "baseline extract" if "fthsdp-baseline-" in fthsdp.__file__ else "working tree"
    print(CHILD + json.dumps(out), flush=True)
    return 0


def measure(root: Path | None, replicas: int, ranks: int, rounds: int, budgets: bool, timeout_s: float) -> dict:
    """One arm in a fresh process; ``root``: a baseline's extract to import fthsdp from."""
    from fthsdp.sim.emulation import package_first

    env = dict(os.environ) if root is None else package_first(root)
    with tempfile.TemporaryDirectory(prefix="fthsdp-message-cost-") as cwd:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(replicas), str(ranks),
                            str(rounds), "1" if budgets else "0"], env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=timeout_s)
    line = next((x for x in p.stdout.splitlines() if x.startswith(CHILD)), None)
    if line is None:
        return {"error": f"exit {p.returncode}: {p.stderr.strip()[-600:]}"}
    return json.loads(line[len(CHILD):])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 leaders x 8 ranks, 5 rounds, 1 repeat (CI)")
    ap.add_argument("--replicas", type=int, default=None, help="leaders (default 512)")
    ap.add_argument("--ranks", type=int, default=None, help="ranks (shards) per replica (default 196)")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per arm (default 30)")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each arm, alternating (default 3)")
    ap.add_argument("--baseline", default="", help="also measure this earlier commit (git revision)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per run (s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    replicas = args.replicas or (64 if args.quick else 512)
    ranks = args.ranks or (8 if args.quick else 196)
    rounds = args.rounds or (5 if args.quick else 30)
    repeats = args.repeats or (1 if args.quick else 3)
    if min(replicas, ranks, rounds, repeats) < 1:
        ap.error("--replicas, --ranks, --rounds and --repeats must be >= 1")
    sys.path.insert(0, str(HERE))
    from before_after import extract  # the baseline's fthsdp, with this build's stubs

    arms = [("now", None, True), ("now-no-budgets", None, False)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="fthsdp-baseline-") as d:
        if args.baseline:
            extract(args.baseline, Path(d))
            arms += [("baseline", Path(d), True), ("baseline-no-budgets", Path(d), False)]
        for k in range(repeats):
            for name, root, budgets in (arms if k % 2 == 0 else arms[::-1]):
                r = {"arm": name, "repeat": k, **measure(root, replicas, ranks, rounds, budgets, args.timeout)}
                runs.append(r)
                print(f"{name:20s} repeat {k}: " + (f"{r['us_per_message']:.1f} us a message "
                                                    f"({r['cpu_s_per_round'] * 1e3:.1f} ms of CPU a round of "
                                                    f"{r['messages_per_round']} messages; registration "
                                                    f"{r['registration_cpu_s'] * 1e3:.0f} ms)" if "error" not in r
                                                    else r["error"]), flush=True)
    def median_of(key: str) -> dict:
        xs = {name: [r[key] for r in runs if r["arm"] == name and "error" not in r] for name, _, _ in arms}
        return {name: statistics.median(v) if v else None for name, v in xs.items()}

    medians, registration = median_of("us_per_message"), median_of("registration_cpu_s")
    now, reg_now = medians["now"], registration["now"]
    from before_after import commit_name

    out = {"experiment": "lighthouse_message_cost", "quick": args.quick, "replicas": replicas, "ranks": ranks,
           "rounds": rounds, "repeats": repeats, "baseline": args.baseline or None,
           "now": commit_name(),
           "definition": "process CPU of the lighthouse's session handler per message (a heartbeat and a quorum "
                         "request per leader a round), stand-in streams instead of gRPC",
           "median_us_per_message": medians,
           "ratio_to_now": {k: (v / now if v and now else None) for k, v in medians.items() if k != "now"},
           # the first round's CPU, every leader registering its endpoints (as after a lighthouse restart)
           "median_registration_cpu_s": registration,
           "registration_ratio_to_now": {k: (v / reg_now if v and reg_now else None)
                                         for k, v in registration.items() if k != "now"},
           "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("median_us_per_message", "ratio_to_now", "median_registration_cpu_s",
                                          "registration_ratio_to_now")}))
    print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
