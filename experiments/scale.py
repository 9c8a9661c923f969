"""get_quorum latency at 1K-100K ranks: fthsdp's hierarchy, its flat lighthouse, torchft's lighthouse.

    python experiments/scale.py [--quick] --out results/scale.json      (plot: results/scale.png)

Three systems, one definition of latency: per round, from the *last* request
(the last rank handing its request to its replica's leader; for flat systems
the last replica's request) to *every rank holding the answer*. p50 and p99
are over the measured rounds (round 0, which connects and forms the first
quorum, is a warm-up); a round is *complete* when every replica got a
quorum with every replica in it.

* ``fthsdp-hierarchical`` — the emulation (:mod:`fthsdp.sim.emulation`),
  speaking the real protocol (version 2): a replica is P processes x D ranks
  (G = P x D); every process heartbeats every 100 ms and registers its own
  shards' endpoints; the leader gathers its ranks' requests, asks once and gets
  its view (the members, and its D shards' rings: the ring neighbours' endpoints
  of each, O(R + D) bytes; whole rings, O(R x D), with older clients), the other
  processes fetch theirs when the quorum id changes; the ranks then replay the
  step machine, run the mock all-reduce and vote. Shapes 16 x G and 512 x G at
  1K, 10K and 100K ranks, each with one process per replica (D = G: the
  leader's answer lists every ring) and with several (written RxG/P). With
  ``--relays K``, also through K relay processes (fthsdp/control/relay.py)
  that carry contiguous blocks of the leaders' sessions to the lighthouse;
  such rows add the relays' CPU per round and how many messages they batched.
  With ``--emulator-processes K``, the emulated replicas are split over K
  processes (fthsdp/sim/shards.py; one process reads every leader's answer in
  turn, real leaders each read their own); with ``--lighthouse-cpus``, the
  lighthouse is bound to CPUs of its own and everything else to the rest.
* ``fthsdp-flat`` — the same lighthouse with N directly connected replicas
  of one rank each (the emulation with G = 1), N = 16 ... 8,192. These do not
  heartbeat (N x 10 heartbeats/s would saturate this machine before the
  quorum path is measured; experiments/heartbeat_pacing.py measures flat rows
  that do, with and without the lighthouse pacing the beats); an open quorum call is their sign of life, and
  their detection window is 30 s (it must outlast a round trip of the
  emulator itself, or all are declared dead between two rounds).
* ``grpc-floor`` — beside each hierarchical row, the bare transport
  (experiments/grpc_floor.py): a grpc.aio server that only counts, answering a
  round of R streams (one per replica leader) with that row's median request
  and answer sizes, measured the same way. No lighthouse on this transport and
  this machine can do a round in less; a row's ratio to it is the lighthouse's
  own work (``ratio_to_floor_p99`` in the verdict).
* ``torchft`` — torchft's lighthouse (PyPI ``torchft``, Rust) from the Python
  3.11 side environment of experiments/setup_peers.sh, in its own process,
  driven by N asyncio clients of this process (one gRPC connection each), all
  asking for the same step, with ``min_replicas = N`` so each quorum holds
  everyone.

Everything shares this machine's cores with the lighthouse under test (and,
on a shared machine, with other people's jobs: the load average is recorded
with every row), so the figures are upper bounds for the lighthouse alone.
This supersedes experiments/quorum_scale.py's flat measurement, which stays
as the older per-request view.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from fthsdp.sim.emulation import EmulationConfig, percentile_failing, run_emulation  # noqa: E402
from fthsdp.sim.mock_plane import ModelShape  # noqa: E402
from fthsdp.timeouts import Timeouts  # noqa: E402

sys.path.insert(0, str(HERE))
from grpc_floor import floor_row, percentile  # noqa: E402

PAPER = {"get_quorum_s_100k_before": 9.0, "get_quorum_s_100k_after": 0.7, "target_p99_s_100k": 0.07}


# -- fthsdp (emulation) ------------------------------------------------------


BREAKDOWN_PARTS = {
    "request_build_s": "the last leader builds and sends its request (emulator)",
    "to_lighthouse_s": "until the lighthouse starts checking it: loopback and the lighthouse's queue of earlier calls",
    "checks_s": "the lighthouse's request checks (fthsdp.control.guard)",
    "until_decision_s": "from its handler to the end of the deciding evaluation",
    "decide_s": "of which the evaluation itself (decide_quorum and bookkeeping)",
    "replies_s": "from the decision to the last reply built (every waiting call answered)",
    "to_leaders_s": "from the last reply built to the last leader holding it: gRPC send, loopback, the emulator's receive",
    "of_which_writes_s": ("of which the lighthouse's own writes (session transport: from the last reply built to the "
                          "last session write of the round completed; unary: not traced)"),
    "fanout_s": "the leaders hand the answer to their ranks (and followers fetch their views)",
}


def round_breakdown(rep, trace: dict, warmup: int = 1) -> dict:
    """Where one round's latency goes, per measured round: the last request's path through
    the lighthouse (timestamps of fthsdp.sim.lighthouse_trace, the same monotonic clock as
    the emulator's) and the emulator's parts; plus the lighthouse's CPU and heartbeats per
    round and the emulated ranks' own Python work (not in the latency: it precedes the
    requests)."""
    ev = trace.get("events", [])
    by_step: dict[int, list] = {}
    for r in rep.quorum_records:
        if r.attempt == 1:
            by_step.setdefault(r.step, []).append(r)
    rounds = []
    prev_cpu = prev_hb = None
    for step in sorted(by_step):
        rs = by_step[step]
        last = max(rs, key=lambda r: r.last_rank_request)
        t0, hold, recv = last.last_rank_request, max(r.all_ranks_hold for r in rs), max(r.received for r in rs)

        def first(kind, after, pred=lambda e: True):
            return next((e for e in ev if e[0] == kind and e[1] >= after and pred(e)), None)

        mine = lambda e: e[4] == last.replica_id and e[5] == step  # noqa: E731
        chk0 = first("checks_start", last.sent - 1.0, mine)
        chk1 = first("checks_end", last.sent - 1.0, mine)
        enter = first("handler_enter", last.sent - 1.0, mine)
        dec = first("evaluate", t0 - 1.0, lambda e: e[6] > 0 and e[8] == step and e[1] >= (enter[1] if enter else 0))
        replies = [e for e in ev if e[0] == "reply" and e[7] == step and dec and dec[1] <= e[1] <= hold]
        if not (chk0 and chk1 and enter and dec and replies) or len(rs) < rep.config.replicas:
            continue
        last_reply = max(replies, key=lambda e: e[1])
        cpu, hb = last_reply[2], last_reply[3]
        row = {
            "step": step, "latency_s": hold - t0,
            "request_build_s": last.sent - t0, "to_lighthouse_s": chk0[1] - last.sent, "checks_s": chk1[1] - chk0[1],
            "until_decision_s": dec[1] - enter[1], "decide_s": dec[4], "replies_s": last_reply[1] - dec[1],
            "to_leaders_s": recv - last_reply[1], "fanout_s": hold - recv,
            "of_which_writes_s": max((e[1] for e in ev if e[0] == "written" and last_reply[1] <= e[1] <= recv),
                                     default=last_reply[1]) - last_reply[1],
            "replies_built": len(replies), "reply_build_s_total": sum(e[4] for e in replies),
            "reply_bytes_max": max(e[8] for e in replies),
            "lighthouse_cpu_s_this_round": None if prev_cpu is None else cpu - prev_cpu,
            "heartbeats_this_round": None if prev_hb is None else hb - prev_hb,
            "rank_work_s_this_round": rep.rank_work_s.get(step, 0.0),
        }
        prev_cpu, prev_hb = cpu, hb
        rounds.append(row)
    measured = [r for r in rounds if r["step"] >= warmup]  # round 0 connects and forms the first quorum
    keys = list(BREAKDOWN_PARTS) + ["latency_s", "reply_build_s_total", "lighthouse_cpu_s_this_round",
                                    "heartbeats_this_round", "rank_work_s_this_round"]
    median = {k: percentile([r[k] for r in measured if r[k] is not None], 0.5) for k in keys}
    return {"parts": BREAKDOWN_PARTS, "median": median, "rounds": [{k: (round(v, 6) if isinstance(v, float) else v)
                                                                    for k, v in r.items()} for r in measured],
            "emulator_cpu_s_per_round": rep.emulator_cpu_s / max(1, len(by_step))}


def fthsdp_row(system: str, replicas: int, ranks_per_replica: int, rounds: int, heartbeat_s: float,
               profile: str = "", processes: int = 1, trace: bool = False, warmup: int = 1,
               transport: str = "session", relays: int = 0, emulator_processes: int = 1,
               lighthouse_cpus: tuple[int, ...] = (), beats_per_s: float | None = None,
               detect_s: float | None = None, faults: tuple = (), lighthouse_from: str = "") -> dict:
    """``heartbeat_s``: the leaders' heartbeat interval (0: no heartbeats). ``trace``: run the
    lighthouse under fthsdp.sim.lighthouse_trace and add each round's breakdown. ``warmup``:
    rounds run first and not measured (round 0 connects and forms the first quorum). ``transport``:
    ``session`` (heartbeats and quorum requests on one stream per process, fthsdp.control.session)
    or ``unary`` (a call each). ``relays``: relay processes between the leaders and the lighthouse
    (fthsdp.control.relay; each carries a contiguous block of replicas), 0: none.
    ``emulator_processes``: processes the emulated replicas are split over (fthsdp.sim.shards).
    ``lighthouse_cpus``: the CPUs the lighthouse is bound to (the emulator's are the caller's).
    ``beats_per_s``: the lighthouse's beat budget (None: its default; 0: no pacing,
    fthsdp.control.pacing). ``detect_s``: the detection window (None: 5 s with heartbeats).
    ``faults``: the emulation's (fthsdp.sim.emulation.Fault). ``lighthouse_from``: an extract of
    another commit to run the lighthouse from (EmulationConfig.lighthouse_from)."""
    import tempfile

    tmp = tempfile.TemporaryDirectory(prefix="fthsdp-scale-trace-") if trace else None
    trace_path = os.path.join(tmp.name, "trace.json") if tmp else ""
    load = os.getloadavg()
    heartbeats = heartbeat_s > 0
    # Without heartbeats the lighthouse judges a replica by its requests alone, so the
    # window must outlast the emulator's own turnaround between two requests (seconds at
    # 8,192 replicas on a loaded machine): 5 s let every replica be declared dead between
    # rounds, and the first requester then formed a quorum of one.
    # Above 2,048 flat replicas every limit grows with N: on this shared machine the first round
    # (8,192 connections, first answers of 0.5 MB each) outlasted a 30 s join limit, the
    # late replicas joined behind, each change of membership sent every member the full
    # answer again, and no round completed. The limits bound waits; a steady round (nobody
    # new, nobody dead) never waits on them, so they do not change what is measured.
    f = 1.0 if heartbeats else max(1.0, replicas / 2048)
    window = detect_s if detect_s is not None else 5.0 if heartbeats else 30.0 * f
    t = Timeouts(heartbeat_interval_s=heartbeat_s if heartbeats else 0.1, detect_s=window,
                 join_timeout_s=30.0 * f,
                 allreduce_timeout_s=60.0 * f, quorum_timeout_s=120.0 * f, lighthouse_outage_s=60.0 * f)
    cfg = EmulationConfig(
        replicas=replicas, ranks_per_replica=ranks_per_replica, steps=rounds + warmup,
        model=ModelShape(params=8_000_000_000, step_s=0.02), timeouts=t, heartbeats=heartbeats,
        # The run's cap (a row past it reports its incomplete rounds): 30 s a round, more for
        # large flat rows, whose round on this shared machine is seconds of gRPC calls.
        round_barrier=True, run_timeout_s=max(120.0, (rounds + 1) * max(30.0, 0.03 * replicas)),
        job_id=f"scale-{replicas}x{ranks_per_replica}",
        lighthouse_profile=profile, processes_per_replica=processes, lighthouse_trace=trace_path,
        lighthouse_session=transport == "session", relays=relays, emulator_processes=emulator_processes,
        lighthouse_cpus=lighthouse_cpus, lighthouse_beats_per_s=beats_per_s, faults=faults,
        lighthouse_from=lighthouse_from)
    rep = run_emulation(cfg)
    where = None
    if tmp is not None:
        try:
            with open(trace_path) as f:
                where = round_breakdown(rep, json.load(f), warmup)
        except (OSError, ValueError) as e:
            where = {"error": f"no lighthouse trace: {e}"}
        tmp.cleanup()
    rounds_ = [r for r in rep.rounds() if r["attempt"] == 1]
    emulator_cpu, relay_cpu, lighthouse_cpu = rep.cpu_per_round(warmup)
    measured = rounds_[warmup:]
    complete = [r for r in measured if r["replicas"] == replicas and len(r["quorum_ids"]) == 1]
    lat = [r["latency_s"] for r in complete]
    # p50/p99 over every measured round: one not every replica completed (or never asked) ranks
    # slower than any, so that dropping it cannot improve them (None when a quantile falls on one)
    every = lat + [None] * max(0, rounds - len(complete))
    return {
        "system": system, "transport": transport, "relays": relays, "emulator_processes": emulator_processes,
        "lighthouse_cpus": list(lighthouse_cpus),
        "emulator_cpus": sorted(os.sched_getaffinity(0)) if lighthouse_cpus else None, "replicas": replicas,
        "ranks": replicas * ranks_per_replica,
        "ranks_per_replica": ranks_per_replica, "heartbeat_interval_s": heartbeat_s,
        "processes_per_replica": processes, "shards_per_process": ranks_per_replica // processes,
        "timeouts_s": {"detect": t.detect_s, "join": t.join_timeout_s, "allreduce": t.allreduce_timeout_s,
                       "quorum": t.quorum_timeout_s},
        "leader_answer_bytes": rep.answer_bytes, "follower_views_fetched": rep.views_fetched,
        # a round's typical sizes on the wire (the first answers carry every ring, later ones keep them)
        "leader_request_bytes_median": int(statistics.median(q for q, _ in rep.wire_sizes)) if rep.wire_sizes else 0,
        "leader_answer_bytes_median": int(statistics.median(a for _, a in rep.wire_sizes)) if rep.wire_sizes else 0,
        "p50_s": percentile_failing(every, 0.5), "p99_s": percentile_failing(every, 0.99),
        "max_s": max(lat) if lat else None,  # of the complete rounds
        "complete_rounds": len(complete), "rounds": rounds, "warmup_rounds": warmup,
        "lighthouse_p50_s": percentile([r["lighthouse_s"] for r in complete], 0.5),
        # the relays' CPU a measured round (from the first measured round on: without their start-up
        # and the warm-up rounds, whose answers carry every ring), and over the whole run per round
        "relay_cpu_s_per_round": relay_cpu if relays else None,
        "relay_cpu_s_per_round_whole_run": rep.relay_cpu_s / (rounds + warmup) if relays else None,
        "emulator_cpu_s_per_round": emulator_cpu,
        # the lighthouse's CPU a measured round (from /proc, traced or not; the breakdown's is per round)
        "lighthouse_cpu_s_per_round": lighthouse_cpu,
        # how well they batched: messages per batch to the lighthouse, replies per batch back
        "relay_messages_per_batch": _ratio(rep.relay_stats, "messages_up", "batches_up") if relays else None,
        "relay_replies_per_batch": _ratio(rep.relay_stats, "replies_down", "batches_down") if relays else None,
        "fanout_p50_s": percentile([r["fanout_s"] for r in complete], 0.5),
        "round_latencies_s": [round(x, 6) for x in lat],
        "violations": rep.violations()[:5], "wall_s": rep.wall_s, "loadavg": load,
        "incomplete_rounds": [{k: r[k] for k in ("step", "replicas", "quorum_ids", "latency_s")}
                              for r in measured if r not in complete][:5],
        "final_steps": sorted(set(rep.final_steps.values())), "events_head": rep.events[:5],
        # A lost request shows here (a failed call, or one re-sent after UNAVAILABLE), never hidden by a retry.
        "quorum_request_errors": sum(1 for e in rep.events if "quorum request failed" in e),
        # What they were (digits blanked, so that one kind counts once): the first place to look.
        "quorum_request_error_kinds": collections.Counter(
            re.sub(r"\d+", "N", e.partition("quorum request failed: ")[2])[:160]
            for e in rep.events if "quorum request failed" in e).most_common(5),
        "requests_resent_after_unavailable": sum(1 for r in rep.quorum_records if r.outage_s > 0),
        # how many replicas the lighthouse declared dead, and its beat-pacing lines (fthsdp.control.pacing)
        "lighthouse_log": {k: rep.lighthouse_log.get(k) for k in ("declared_dead", "paced")},
        **({"breakdown": where} if where is not None else {}),
    }


def _ratio(stats: list[dict], num: str, den: str) -> float | None:
    d = sum(s.get(den, 0) for s in stats)
    return sum(s.get(num, 0) for s in stats) / d if d else None


# -- torchft -------------------------------------------------------------------


def _torchft_messages():
    """torchft's lighthouse messages, described here from its published wire format
    (package torchft; only the fields a quorum round uses)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FileDescriptorProto(name="fthsdp_scale_torchft.proto", package="torchft", syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto

    def msg(name, *fields):
        m = f.message_type.add(name=name)
        for fname, num, typ, label, tname in fields:
            fd = m.field.add(name=fname, number=num, type=typ, label=label)
            if tname:
                fd.type_name = tname

    opt, rep = T.LABEL_OPTIONAL, T.LABEL_REPEATED
    msg("QuorumMember", ("replica_id", 1, T.TYPE_STRING, opt, None), ("address", 2, T.TYPE_STRING, opt, None),
        ("store_address", 3, T.TYPE_STRING, opt, None), ("step", 4, T.TYPE_INT64, opt, None),
        ("world_size", 5, T.TYPE_UINT64, opt, None), ("shrink_only", 6, T.TYPE_BOOL, opt, None),
        ("data", 7, T.TYPE_STRING, opt, None), ("commit_failures", 8, T.TYPE_INT64, opt, None))
    msg("Quorum", ("quorum_id", 1, T.TYPE_INT64, opt, None),
        ("participants", 2, T.TYPE_MESSAGE, rep, ".torchft.QuorumMember"))
    msg("LighthouseQuorumRequest", ("requester", 1, T.TYPE_MESSAGE, opt, ".torchft.QuorumMember"))
    msg("LighthouseQuorumResponse", ("quorum", 1, T.TYPE_MESSAGE, opt, ".torchft.Quorum"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    get = message_factory.GetMessageClass
    return (get(pool.FindMessageTypeByName("torchft.QuorumMember")),
            get(pool.FindMessageTypeByName("torchft.LighthouseQuorumRequest")),
            get(pool.FindMessageTypeByName("torchft.LighthouseQuorumResponse")))


def default_peer_python() -> str:
    """The side environment's python: $FTHSDP_PEER_PYTHON, else setup_peers.sh's environment."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from peer_env import default_peer_python as peer_python

    return peer_python()


def torchft_available(peer_python: str) -> tuple[bool, str]:
    if not os.path.exists(peer_python):
        return False, (f"side environment python {peer_python} missing: run `bash experiments/setup_peers.sh` "
                       "then `<env>/bin/pip install torchft`")
    r = subprocess.run([peer_python, "-c", "import importlib.util as u, importlib.metadata as m; "
                        "assert u.find_spec('torchft'), 'torchft not installed'; print(m.version('torchft'))"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return False, f"torchft not importable in {peer_python}: {r.stderr.strip()[-300:]}"
    return True, r.stdout.strip()


async def _torchft_rounds(port: int, n: int, rounds: int, timeout_s: float) -> list[dict]:
    Member, Req, Resp = _torchft_messages()
    opts = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) for _ in range(n)]
    calls = [ch.unary_unary("/torchft.LighthouseService/Quorum", request_serializer=Req.SerializeToString,
                            response_deserializer=Resp.FromString) for ch in channels]
    out = []
    try:
        for rnd in range(rounds + 1):
            sent = [0.0] * n
            got = [0.0] * n

            async def one(i: int) -> int:
                req = Req(requester=Member(replica_id=f"replica-{i}", address=f"127.0.0.1:{20000 + i}",
                                           store_address=f"127.0.0.1:{40000 + i}", step=rnd, world_size=1))
                sent[i] = time.perf_counter()
                resp = await calls[i](req, timeout=timeout_s)
                got[i] = time.perf_counter()
                return len(resp.quorum.participants)

            res = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
            errors = sorted({f"{type(r).__name__}: {getattr(r, 'code', lambda: '')()}" for r in res
                             if isinstance(r, BaseException)})
            ok = not errors and all(r == n for r in res)
            out.append({"round": rnd, "complete": ok, "errors": errors[:3],
                        "latency_s": max(got) - max(sent) if ok else None})
            if not ok:
                break
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    return out


def torchft_row(peer_python: str, n: int, rounds: int, timeout_s: float) -> dict:
    load = os.getloadavg()
    # Its log (every quorum in full at INFO, its default) goes nowhere, as on a quiet production host.
    proc = subprocess.Popen([peer_python, str(HERE / "peers" / "torchft_lighthouse.py"), str(n), "60000", "100",
                             "60000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("listening "):
            raise RuntimeError(f"torchft lighthouse did not start: {line!r}")
        t0 = time.perf_counter()
        rs = asyncio.run(_torchft_rounds(int(line.split()[1]), n, rounds, timeout_s))
        wall = time.perf_counter() - t0
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    complete = [r for r in rs[1:] if r["complete"]]
    lat = [r["latency_s"] for r in complete]
    every = lat + [None] * max(0, rounds - len(complete))  # an incomplete round ranks slowest (emulate_row)
    return {"system": "torchft", "replicas": n, "ranks": n, "p50_s": percentile_failing(every, 0.5),
            "p99_s": percentile_failing(every, 0.99), "max_s": max(lat) if lat else None,
            "complete_rounds": len(complete), "rounds": rounds, "round_latencies_s": [round(x, 6) for x in lat],
            "errors": sorted({e for r in rs for e in r["errors"]}), "wall_s": wall, "loadavg": load}


# -- where the time goes ---------------------------------------------------------


def breakdown(n: int, calls: int) -> dict:
    """The parts of one flat round at ``n`` replicas, each measured alone on this machine:
    the pure decision, building the reply (once, and the old way: once per call),
    asyncio waking ``n`` waiting calls, and gRPC's per-call cost (``calls`` concurrent
    Heartbeat RPCs against a real lighthouse process, client and server)."""
    from fthsdp.control import quorum as qm
    from fthsdp.control.lighthouse import pb2, quorum_to_proto
    from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION
    from fthsdp.sim.aio_client import AioLighthouseClient
    from fthsdp.sim.emulation import LighthouseProcess

    reqs = {str(i): qm.QuorumRequest(str(i), 7, 0.0, (f"127.0.0.1:{20000 + i}",), f"127.0.0.1:{40000 + i}", 1)
            for i in range(n)}
    beats = {r: 0.0 for r in reqs}
    t = time.perf_counter()
    q, _ = qm.decide_quorum(reqs, beats, None, qm.QuorumConfig(num_configured=n), 0.1)
    decide = time.perf_counter() - t
    t = time.perf_counter()
    proto = quorum_to_proto(q)
    to_proto = time.perf_counter() - t
    t = time.perf_counter()
    raw = pb2.QuorumResponse(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, quorum=proto).SerializeToString()
    once = time.perf_counter() - t
    k = max(1, min(n, 200))
    t = time.perf_counter()
    for _ in range(k):
        pb2.QuorumResponse(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, quorum=proto).SerializeToString()
    per_call_build = (time.perf_counter() - t) / k

    async def wake() -> float:
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(n)]
        done = 0

        async def waiter(f):
            nonlocal done
            await f
            done += 1

        tasks = [loop.create_task(waiter(f)) for f in futs]
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        for f in futs:
            f.set_result(q)
        await asyncio.gather(*tasks)
        return time.perf_counter() - t0

    asyncio_wake = asyncio.run(wake())

    cfg = EmulationConfig(replicas=calls, ranks_per_replica=1, steps=1)
    with tempfile_dir() as d:
        lh = LighthouseProcess(cfg, os.path.join(d, "lh.log"))
        lh.start()
        try:
            async def beat() -> float:
                clients = [AioLighthouseClient(lh.address, "breakdown", str(i), outage_s=5.0, heartbeat_timeout_s=30.0)
                           for i in range(calls)]
                async def connect(c) -> None:  # a storm of connects may be refused (listen backlog): retry
                    for attempt in range(100):
                        try:
                            await c.heartbeat(0)
                            return
                        except Exception:  # noqa: BLE001 - UNAVAILABLE while connecting
                            await asyncio.sleep(0.05 * (1 + attempt % 10))
                    await c.heartbeat(0)

                await asyncio.gather(*(connect(c) for c in clients))
                best = math.inf
                for _ in range(3):
                    t0 = time.perf_counter()
                    await asyncio.gather(*(c.heartbeat(0) for c in clients))
                    best = min(best, time.perf_counter() - t0)
                await asyncio.gather(*(c.close() for c in clients))
                return best

            grpc_round = asyncio.run(beat())
        finally:
            lh.stop()
    return {
        "replicas": n, "reply_bytes": len(raw),
        "decide_s": decide, "quorum_to_proto_s": to_proto, "serialize_once_s": once,
        "old_per_call_build_s": per_call_build, "old_round_build_s": per_call_build * n,
        "asyncio_wake_n_calls_s": asyncio_wake,
        "grpc_concurrent_heartbeats": calls, "grpc_round_s": grpc_round, "grpc_per_call_s": grpc_round / calls,
        "grpc_round_at_n_s_est": grpc_round / calls * n,
    }


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) against log(x): the growth exponent."""
    pts = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def _n_log_n_slope(ns: list[int]) -> float | None:
    """The log-log slope N log N itself has over ``ns`` (what "no worse than N log N" means there)."""
    return _slope([(n, n * math.log2(n)) for n in ns if n > 1])


def _best(f, repeats: int, collector: str = "on") -> float:
    """The fastest of ``repeats`` timed calls of ``f``, after one untimed warm-up call.

    ``collector``: ``"on"`` (CPython's defaults), ``"paused"`` (a full collection before
    each call, none during it: the work itself, what an O() claim is about) or
    ``"lighthouse"`` (the lighthouse's own policy, :func:`fthsdp.gc_policy.low_pause_gc`)."""
    from fthsdp.gc_policy import low_pause_gc

    f()
    t = math.inf
    with low_pause_gc() if collector == "lighthouse" else contextlib.nullcontext():
        for _ in range(repeats):
            if collector == "paused":
                gc.collect()
                gc.disable()
            try:
                t0 = time.perf_counter()
                f()
                t = min(t, time.perf_counter() - t0)
            finally:
                if collector == "paused":
                    gc.enable()
    return t


def decision_benchmark(ns: list[int], repeats: int = 3) -> dict:
    """The quorum decision over plain data, no server: ``decide_quorum`` for n replicas all
    asking (the first quorum, and the next round given the previous one), then one member's
    view and its serialization (what a round builds once), best of ``repeats`` after a
    warm-up; with each part's log-log slope against n (1 = linear; N log N over the same
    range is given beside it).

    The parts are timed with the garbage collector paused (a full collection before each
    call: the work itself, what the O() claim is about; with CPython's defaults a call can
    also pay a collection walking the whole heap). The next round is also timed under the
    defaults and under the lighthouse's own collector policy (``decide_next_gc_*_s``), so
    what the collector adds stays in the record. (A slope of 1.47 was once recorded here:
    that run was at load 20-30; idle, all three give 1.11-1.13, N log N's 1.11.)"""
    from fthsdp.control import quorum as qm
    from fthsdp.control.lighthouse import pb2, quorum_to_proto
    from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION

    points = []
    for n in ns:
        reqs = {str(i): qm.QuorumRequest(str(i), 7, 0.0, (f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}:29600",),
                                         f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}:29700", 1) for i in range(n)}
        beats = {r: 0.0 for r in reqs}
        cfg = qm.QuorumConfig(num_configured=n)
        first, _ = qm.decide_quorum(reqs, beats, None, cfg, 0.1)
        view = qm.process_view(first, "0", 0, 1)
        points.append({
            "replicas": n,
            "decide_first_s": _best(lambda: qm.decide_quorum(reqs, beats, None, cfg, 0.1), repeats, "paused"),
            "decide_next_s": _best(lambda: qm.decide_quorum(reqs, beats, first, cfg, 0.1), repeats, "paused"),
            "view_s": _best(lambda: qm.process_view(first, "0", 0, 1), repeats, "paused"),
            "serialize_view_s": _best(lambda: pb2.QuorumResponse(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION,
                                                                 quorum=quorum_to_proto(view)).SerializeToString(),
                                      repeats, "paused"),
            "decide_next_gc_defaults_s": _best(lambda: qm.decide_quorum(reqs, beats, first, cfg, 0.1), repeats),
            "decide_next_gc_lighthouse_s": _best(lambda: qm.decide_quorum(reqs, beats, first, cfg, 0.1), repeats,
                                                 "lighthouse"),
        })
    xs = [p["replicas"] for p in points]
    return {"points": points, "n_log_n_slope": _n_log_n_slope(xs),
            "slopes": {k: _slope([(p["replicas"], p[k]) for p in points])
                       for k in ("decide_first_s", "decide_next_s", "view_s", "serialize_view_s")},
            "collector": "parts timed with the collector paused; decide_next_gc_*_s with it running",
            "slopes_with_collector": {k: _slope([(p["replicas"], p[k]) for p in points])
                                      for k in ("decide_next_gc_defaults_s", "decide_next_gc_lighthouse_s")}}


def guard_cost(ns: list[int], repeats: int = 5) -> dict:
    """What checking one quorum request's ``last_members`` (n ids) costs the lighthouse:
    the check as it was (a Python test per character of every id, measured here as the
    baseline) and fthsdp.control.guard's (one regex search over the joined ids), side by
    side in this process, best of ``repeats``. Every request carried the list until only
    the first members sent it (fthsdp.control.quorum.sends_last_members), so a round paid
    n times this."""
    from fthsdp.control import guard

    def per_char(ids) -> str | None:  # the check before: one generator step per character
        for v in ids:
            if len(v) > 128:
                return "long"
            if next((c for c in v if ord(c) < 32 or ord(c) == 127 or c.isspace()), None) is not None:
                return "bad"
        return None

    out = []
    for n in ns:
        ids = [str(i) for i in range(n)]
        old = _best(lambda: per_char(ids), repeats)
        new = _best(lambda: guard._texts_problem("a last_members id", ids, 128), repeats)
        out.append({"replicas": n, "per_character_s": old, "guard_s": new, "ratio": old / new if new else None,
                    "round_before_s": old * n})
    return {"points": out, "note": "one request's last_members check; a round before the fix paid it per replica"}


def tempfile_dir():
    import tempfile

    return tempfile.TemporaryDirectory(prefix="fthsdp-scale-")


def lighthouse_profile(n: int, rounds: int, ranks_per_replica: int = 1, processes: int = 1,
                       heartbeat_s: float = 0.0) -> dict:
    """cProfile of the lighthouse process over a run of ``n`` replicas (flat: one rank
    each, no heartbeats; or a hierarchical shape): its busy time split into the decision,
    reply building, the RPC handlers, gRPC's own machinery (time inside its Cython
    callbacks) and asyncio, the number of calls of each RPC handler, plus the top functions."""
    import pstats
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fthsdp-scale-prof-") as d:
        path = os.path.join(d, "lighthouse.prof")
        system = "fthsdp-flat" if ranks_per_replica == 1 and processes == 1 else "fthsdp-hierarchical"
        row = fthsdp_row(system, n, ranks_per_replica, rounds, heartbeat_s=heartbeat_s, profile=path,
                         processes=processes)
        st = pstats.Stats(path)
    total = idle = 0.0
    buckets = {"decision (fthsdp/control/quorum.py)": 0.0, "reply building (quorum_to_proto, replies)": 0.0,
               "RPC handlers and bookkeeping (fthsdp/control/lighthouse.py)": 0.0,
               "session stream transport (fthsdp/control/session.py)": 0.0,
               "gRPC machinery (Cython callbacks, C-core)": 0.0, "asyncio event loop": 0.0,
               "root-cause and SDC analysis (fthsdp/observe, fthsdp/control/sdc.py)": 0.0,
               "limits and credentials (fthsdp/control/guard.py, auth.py)": 0.0,
               "start-up (imports)": 0.0, "other": 0.0}
    handler_calls: dict[str, int] = {}
    top = []
    for (fname, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        total += tt
        where = f"{os.path.basename(fname)}:{line}({func})"
        if "poll" in func and "epoll" in func:
            idle += tt
            continue
        if fname.startswith("<frozen") or func in ("<built-in method marshal.loads>", "<built-in method builtins.exec>",
                                                    "<built-in method _imp.create_dynamic>") or "enum.py" in fname:
            b = "start-up (imports)"
        elif fname.endswith(os.path.join("control", "quorum.py")):
            b = "decision (fthsdp/control/quorum.py)"
        elif func in ("quorum_to_proto", "quorum_reply", "quorum_proto", "heartbeat_reply", "view_reply"):
            b = "reply building (quorum_to_proto, replies)"
        elif fname.endswith(os.path.join("control", "lighthouse.py")):
            b = "RPC handlers and bookkeeping (fthsdp/control/lighthouse.py)"
            # Requests by kind, whatever carried them (a unary call or a session message, which
            # both reach the accept_* cores); GetView, Leave and Status are unary calls only.
            name = {"accept_quorum_request": "GetQuorum", "accept_heartbeat": "Heartbeat"}.get(func, func)
            if name in ("GetQuorum", "Heartbeat", "GetView", "Leave", "Status") and func not in (
                    "GetQuorum", "Heartbeat"):
                handler_calls[name] = nc
        elif fname.endswith(os.path.join("control", "session.py")):
            b = "session stream transport (fthsdp/control/session.py)"
        elif fname.endswith((os.path.join("control", "guard.py"), os.path.join("control", "auth.py"))):
            b = "limits and credentials (fthsdp/control/guard.py, auth.py)"
        elif os.path.join("fthsdp", "observe") in fname or fname.endswith(os.path.join("control", "sdc.py")):
            b = "root-cause and SDC analysis (fthsdp/observe, fthsdp/control/sdc.py)"
        elif "_contextvars.Context" in func or "grpc" in fname:
            b = "gRPC machinery (Cython callbacks, C-core)"
        elif "asyncio" in fname or "selectors" in fname:
            b = "asyncio event loop"
        else:
            b = "other"
        buckets[b] += tt
        top.append((tt, where, nc))
    top.sort(reverse=True)
    return {"replicas": n, "ranks_per_replica": ranks_per_replica, "processes_per_replica": processes,
            "heartbeat_interval_s": heartbeat_s, "rounds": rounds, "p50_s": row["p50_s"], "p99_s": row["p99_s"],
            "complete_rounds": row["complete_rounds"], "loadavg": row["loadavg"], "profiled_s": total,
            "idle_in_epoll_s": idle, "busy_s_by_part": buckets, "handler_calls": handler_calls,
            "top": [{"where": w, "tottime_s": t, "calls": c} for t, w, c in top[:15]]}


# -- report ----------------------------------------------------------------------


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"fthsdp-flat": ("tab:blue", "o"), "torchft": ("tab:red", "s")}
    for system in ("fthsdp-flat", "torchft"):
        rs = sorted((r for r in rows if r["system"] == system and r["p50_s"]), key=lambda r: r["ranks"])
        if rs:
            c, m = styles[system]
            ax.plot([r["ranks"] for r in rs], [r["p50_s"] for r in rs], f"{m}-", color=c, label=f"{system} p50")
            ax.plot([r["ranks"] for r in rs], [r["p99_s"] for r in rs], f"{m}:", color=c, alpha=0.6,
                    label=f"{system} p99")
    hier = [r for r in rows if r["system"] == "fthsdp-hierarchical" and r["p50_s"]]
    colors = {16: "tab:green", 512: "tab:purple"}
    def tr(r: dict) -> str:
        t = r.get("transport", "unary")  # rows measured before sessions existed were unary
        return f"{t}, {r['relays']} relays" if r.get("relays") else t

    for rpr, nproc, t in sorted({(r["replicas"], r.get("processes_per_replica", 1), tr(r)) for r in hier}):
        rs = sorted((r for r in hier if r["replicas"] == rpr and r.get("processes_per_replica", 1) == nproc
                     and tr(r) == t), key=lambda r: r["ranks"])
        color = colors.get(rpr, "tab:gray")
        ls = ("-" if nproc == 1 else "--") if t == "session" else "-." if t.startswith("session") else ":"
        mk = {1: "^", 2: "v", 4: "<", 5: "D", 8: ">", 10: "s"}.get(nproc, "o")  # one marker per process count
        ax.plot([r["ranks"] for r in rs], [r["p50_s"] for r in rs], mk + ls, color=color,
                alpha=1.0 if t.startswith("session") else 0.5,
                label=f"fthsdp-hierarchical {rpr} replicas x {nproc} process(es), {t}, p50")
        ax.plot([r["ranks"] for r in rs], [r["p99_s"] for r in rs], mk, color=color, alpha=0.4, mfc="none",
                label=f"fthsdp-hierarchical {rpr} replicas x {nproc} process(es), {t}, p99")
    floor = sorted((r for r in rows if r["system"] == "grpc-floor" and r["p99_s"] and r.get("beside_ranks")),
                   key=lambda r: r["beside_ranks"])
    if floor:  # drawn at the ranks of the row it stands beside: R streams, no ranks behind them
        ax.plot([r["beside_ranks"] for r in floor], [r["p99_s"] for r in floor], "kx", ms=8,
                label="bare gRPC round of the row's R leaders (grpc_floor.py), p99")
    flat = sorted((r for r in rows if r["system"] == "fthsdp-flat" and r["p50_s"]), key=lambda r: r["ranks"])
    if flat:
        n0, t0 = flat[0]["ranks"], flat[0]["p50_s"]
        xs = [r["ranks"] for r in flat]
        ax.plot(xs, [t0 * (x * math.log2(x)) / (n0 * math.log2(n0)) for x in xs], "--", color="gray",
                label="N log N from the smallest flat point")
    ax.axhline(PAPER["target_p99_s_100k"], color="black", lw=0.8, ls="-.", label="target: 70 ms p99 at 100K ranks")
    ax.axhline(PAPER["get_quorum_s_100k_after"], color="black", lw=0.8, ls=":", label="paper: 700 ms at 100K GPUs")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ranks (flat and torchft: replicas, one rank each)")
    ax.set_ylabel("get_quorum latency, last request -> every rank holds it (s)")
    ax.set_title("Quorum latency on one shared machine")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_breakdown(rows: list[dict], path: Path) -> bool:
    """One stacked bar per hierarchical row with a breakdown: its median round split along
    the last request's path (BREAKDOWN_PARTS), beside the 70 ms target. False if none."""
    hier = sorted((r for r in rows if r["system"] == "fthsdp-hierarchical" and r.get("breakdown", {}).get("median")
                   and r["breakdown"]["median"].get("latency_s")), key=lambda r: (r["ranks"], r["replicas"]))
    if not hier:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [k for k in BREAKDOWN_PARTS if k not in ("decide_s", "of_which_writes_s")]  # inside other parts
    fig, ax = plt.subplots(figsize=(11, 5.5))
    labels = [f"{r['replicas']}x{r['ranks_per_replica']}/{r.get('processes_per_replica', 1)}\n"
              f"{r.get('transport', 'unary')}{', %d relays' % r['relays'] if r.get('relays') else ''}, "
              f"load {r['loadavg'][0]:.0f}" for r in hier]
    bottom = [0.0] * len(hier)
    colors = plt.get_cmap("tab10")
    for i, k in enumerate(parts):
        vals = [(r["breakdown"]["median"].get(k) or 0.0) * 1e3 for r in hier]
        ax.bar(labels, vals, bottom=bottom, color=colors(i), label=k[:-2].replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(labels, [(r["breakdown"]["median"]["latency_s"]) * 1e3 for r in hier], "k_", ms=30, mew=2,
            label="median round latency")
    ax.plot(labels, [(r["p99_s"] or 0) * 1e3 for r in hier], "rv", label="p99 latency")
    ax.axhline(PAPER["target_p99_s_100k"] * 1e3, color="black", lw=0.8, ls="-.", label="target: 70 ms p99")
    ax.set_ylabel("ms: each part's median over the rounds, stacked\nalong the last request's path")
    ax.set_title("Where a hierarchical round's latency goes (replicas x ranks/processes)")
    ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, axis="y", which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"1"``, ``"0-3,8"`` -> the CPU numbers, sorted ("" -> none)."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise ValueError(f"{part!r} is not a CPU number or a range a-b (e.g. 1 or 0-3,8)")
        out.update(range(int(lo), int(hi if dash else lo) + 1))
    return tuple(sorted(out))


def shape_key(r: dict) -> str:
    """A hierarchical row's shape as written on the command line: RxG/P (and its relays, emulator
    processes and the lighthouse's CPUs, when not the defaults)."""
    relays = f" relays {r['relays']}" if r.get("relays") else ""
    emulators = f" emulators {r['emulator_processes']}" if r.get("emulator_processes", 1) > 1 else ""
    cpus = f" lighthouse on CPUs {','.join(map(str, r['lighthouse_cpus']))}" if r.get("lighthouse_cpus") else ""
    return f"{r['replicas']}x{r['ranks_per_replica']}/{r.get('processes_per_replica', 1)}{relays}{emulators}{cpus}"


def meets_target(row: dict, target_s: float) -> bool:
    """A row meets a p99 target only if every round it ran completed (an incomplete round is a
    failed one, however fast the others) and its p99 is within the target."""
    return row["complete_rounds"] == row["rounds"] and row["p99_s"] is not None and row["p99_s"] <= target_s


def verdict(rows: list[dict], decision: dict | None = None) -> dict:
    out: dict = {}
    if decision and len(decision["points"]) >= 2:
        ns = [p["replicas"] for p in decision["points"]]
        out["decision_growth"] = {"from": min(ns), "to": max(ns), "slopes": decision["slopes"],
                                  "n_log_n_slope": decision["n_log_n_slope"],
                                  "no_worse_than_n_log_n": all(v is not None and v <= decision["n_log_n_slope"] + 0.1
                                                               for v in decision["slopes"].values())}
    big = [r for r in rows if r["system"] == "fthsdp-hierarchical" and r["ranks"] >= 100_000]
    if big:
        key = lambda r: shape_key(r) + ("" if r.get("transport", "unary") == "session" else " unary")  # noqa: E731
        out["p99_s_at_100k_ranks"] = {key(r): r["p99_s"] for r in big}
        out["meets_70ms_p99_at_100k"] = {key(r): meets_target(r, PAPER["target_p99_s_100k"]) for r in big}
    floors = {r["beside"]: r for r in rows if r["system"] == "grpc-floor" and r.get("beside") and r["p99_s"]}
    beside = [r for r in rows if r["system"] == "fthsdp-hierarchical" and r.get("transport") == "session"
              and r["p99_s"] and shape_key(r) in floors]
    if beside:  # the bare transport's round at the same leaders and sizes: what no lighthouse here can beat
        out["transport_floor_p99_s"] = {shape_key(r): floors[shape_key(r)]["p99_s"] for r in beside}
        out["ratio_to_floor_p99"] = {shape_key(r): r["p99_s"] / floors[shape_key(r)]["p99_s"] for r in beside}
        out["target_below_floor"] = {shape_key(r): floors[shape_key(r)]["p99_s"] > PAPER["target_p99_s_100k"]
                                     for r in beside if r["ranks"] >= 100_000}
        # the lighthouse's CPU per round against the bare server's: how much of it is its own work
        cpu = {shape_key(r): (r.get("breakdown", {}).get("median", {}).get("lighthouse_cpu_s_this_round"),
                              floors[shape_key(r)].get("server_cpu_s_per_round")) for r in beside}
        out["lighthouse_cpu_over_floor_server_cpu"] = {k: a / b for k, (a, b) in cpu.items() if a and b}
    flat = sorted((r for r in rows if r["system"] == "fthsdp-flat"), key=lambda r: r["replicas"])
    if flat:
        out["flat_every_round_complete"] = {r["replicas"]: r["complete_rounds"] == r["rounds"] for r in flat}
        ok = [r for r in flat if r["p50_s"]]
        if len(ok) >= 2:
            a, b = ok[0], ok[-1]
            growth = b["p50_s"] / a["p50_s"]
            nlogn = (b["replicas"] * math.log2(b["replicas"])) / (a["replicas"] * math.log2(a["replicas"]))
            out["flat_growth"] = {"from": a["replicas"], "to": b["replicas"], "p50_ratio": growth,
                                  "n_log_n_ratio": nlogn, "no_worse_than_n_log_n": growth <= nlogn}
            xs = [math.log(r["replicas"]) for r in ok]
            ys = [math.log(r["p50_s"]) for r in ok]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            out["flat_loglog_slope"] = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            out["flat_n_log_n_slope"] = _n_log_n_slope([r["replicas"] for r in ok])
    return out


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit (the lighthouse and
    torchft's, started from here, inherit it): every flat replica is a channel, a socket
    on each side, and 2,048 of them passed a soft limit of 1,024 ("Too many open files").
    Returns the (soft, hard) limits now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            print(f"could not raise the open-files limit from {soft} to {want}: {e}", file=sys.stderr)
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few rounds (CI)")
    ap.add_argument("--out", required=True, help="JSON file to write (the plot goes beside it, .png)")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per row (default 20; quick 4)")
    ap.add_argument("--peer-python", default=None, help="python of the side environment with torchft")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["hierarchical", "floor", "flat", "torchft", "profile", "decision"])
    ap.add_argument("--decision", type=int, nargs="*", default=None,
                    help="replica counts of the decision micro-benchmark (default 1K..100K; quick 256 1024 4096)")
    ap.add_argument("--flat", type=int, nargs="*", default=None, help="flat replica counts")
    ap.add_argument("--torchft", type=int, nargs="*", default=None, help="torchft replica counts")
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="hierarchical shapes RxG or RxG/P (replicas x ranks per replica, P processes per replica; "
                         "e.g. 16x6250 16x6250/10 512x196/4)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="hierarchical rows: rounds run before the measured ones (default 2: round 0 forms the "
                         "first quorum, round 1 is the first with every leader holding its view)")
    ap.add_argument("--no-breakdown", action="store_true",
                    help="hierarchical rows without the per-round breakdown (the lighthouse runs untraced: at "
                         "512 x 196 its rounds were ~8-12 ms faster at p50 than traced ones here)")
    ap.add_argument("--heartbeat", type=float, default=0.1,
                    help="hierarchical leaders' heartbeat interval in s (default 0.1, ft's default; 0 = none)")
    ap.add_argument("--profile", type=int, nargs="*", default=None,
                    help="replica counts for the time breakdown and the lighthouse cProfile (default 1024 8192; quick 256)")
    ap.add_argument("--replot", action="store_true",
                    help="measure nothing: redraw the plot and the verdict from what --out holds")
    ap.add_argument("--append", action="store_true",
                    help="keep what --out already holds and replace only the rows (and parts) this run measures")
    ap.add_argument("--profile-shapes", nargs="*", default=None,
                    help="hierarchical shapes RxG[/P] to profile the lighthouse at, with heartbeats (default 512x196)")
    ap.add_argument("--torchft-timeout", type=float, default=120.0, help="per-call deadline for torchft (s)")
    ap.add_argument("--relays", type=int, nargs="+", default=[0],
                    help="hierarchical rows: relay processes between the leaders and the lighthouse "
                         "(fthsdp/control/relay.py), each row measured with each count (default 0: none; "
                         "session transport only)")
    ap.add_argument("--transport", nargs="+", default=["session"], choices=["session", "unary"],
                    help="how fthsdp's replicas reach the lighthouse: session (one stream per process, the "
                         "default) and/or unary (a call each, the earlier transport): each row is measured with "
                         "each, one after the other (default: session)")
    ap.add_argument("--emulator-processes", type=int, nargs="+", default=[1],
                    help="hierarchical rows: processes the emulated replicas are split over (fthsdp/sim/shards.py), "
                         "each row measured with each count (default 1; fault-free rows: on a host with cores "
                         "to spare, one process reading every leader's answer in turn is what a round would show)")
    ap.add_argument("--lighthouse-cpus", default="",
                    help="bind the lighthouse to these CPUs (e.g. 1 or 0-3,8) and the emulator, its processes "
                         "and the relays to the others: the lighthouse's round with cores of its own")
    args = ap.parse_args(argv)
    rounds = args.rounds or (4 if args.quick else 20)
    try:
        lh_cpus = parse_cpus(args.lighthouse_cpus)
    except ValueError as e:
        ap.error(f"--lighthouse-cpus: {e}")
    if lh_cpus:
        rest = os.sched_getaffinity(0) - set(lh_cpus)
        if not rest or not set(lh_cpus) <= os.sched_getaffinity(0):
            ap.error(f"--lighthouse-cpus {args.lighthouse_cpus}: name some but not all of this process's CPUs "
                     f"{sorted(os.sched_getaffinity(0))} (the emulator runs on the others)")
        os.sched_setaffinity(0, rest)  # inherited by the emulator processes and relays it starts
    if any(k < 1 for k in args.emulator_processes):
        ap.error(f"--emulator-processes takes counts >= 1, got {args.emulator_processes}")
    def parse_shape(text: str) -> tuple[int, int, int]:
        rg, _, nproc = text.lower().partition("/")
        parts = rg.split("x") + [nproc or "1"]
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[1]) % int(parts[2]):
            ap.error(f"--shapes takes RxG or RxG/P (replicas x ranks per replica, P processes per replica "
                     f"dividing G, e.g. 16x6250 or 16x6250/10), got {text!r}")
        return int(parts[0]), int(parts[1]), int(parts[2])

    prof_shapes = [parse_shape(x) for x in (args.profile_shapes if args.profile_shapes is not None else
                                            ([] if args.quick else ["512x196"]))]
    if args.shapes is not None:
        shapes = [parse_shape(x) for x in args.shapes]
    elif args.quick:
        shapes = [(16, 63, 1), (512, 2, 1), (16, 625, 1), (512, 20, 1), (16, 624, 8)]
    else:
        # 512 x G with P > 1 is 2,048+ heartbeating processes: measure it apart, with few
        # rounds (--shapes 512x196/4 --rounds 5 --append): this machine cannot carry it.
        shapes = [(16, 63, 1), (512, 2, 1), (16, 625, 1), (16, 625, 5), (512, 20, 1),
                  (16, 6250, 1), (16, 6250, 10), (512, 196, 1)]
    flat_ns = args.flat if args.flat is not None else ([16, 64, 256] if args.quick else
                                                      [16, 64, 256, 1024, 2048, 4096, 8192])
    tft_ns = args.torchft if args.torchft is not None else ([16, 64, 256] if args.quick else
                                                            [16, 64, 256, 1024, 2048, 4096, 8192])
    peer_python = args.peer_python or default_peer_python()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "experiment": "scale", "quick": args.quick,
        "definition": ("latency per round = from the last request (last rank to its leader; flat: last replica) "
                       "to every rank holding the answer; p50/p99 over the measured rounds (round 0 excluded)"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpc": grpc.__version__,
                 "loadavg_at_start": os.getloadavg(), "open_files_limit": raise_open_files_limit()},
        "paper": PAPER, "rows": [], "torchft": {},
    }

    if args.replot:
        d = json.loads(out_path.read_text())
        d["verdict"] = verdict(d["rows"], d.get("where_time_goes", {}).get("decision"))
        out_path.write_text(json.dumps(d, indent=2))
        plot(d["rows"], out_path.with_suffix(".png"))
        plot_breakdown(d["rows"], out_path.with_name(out_path.stem + "_breakdown.png"))
        print(json.dumps(d["verdict"], indent=1))
        return 0
    if args.append and out_path.exists():
        old = json.loads(out_path.read_text())
        result["rows"] = old.get("rows", [])
        result["torchft"] = old.get("torchft", {})
        if "where_time_goes" in old:
            result["where_time_goes"] = old["where_time_goes"]
        result["earlier_runs"] = old.get("earlier_runs", []) + [old.get("host", {})]

    def row_key(r: dict) -> tuple:
        return (r["system"], r["replicas"], r["ranks"], r.get("processes_per_replica", 1),
                r.get("transport", "unary"), r.get("relays", 0), r.get("beside", ""), r.get("emulator_processes", 1),
                tuple(r.get("lighthouse_cpus") or ()))

    def add(r: dict) -> None:
        result["rows"] = [x for x in result["rows"] if row_key(x) != row_key(r)] + [r]

    def save() -> None:
        result["host"]["loadavg_now"] = os.getloadavg()
        result["verdict"] = verdict(result["rows"], result.get("where_time_goes", {}).get("decision"))
        out_path.write_text(json.dumps(result, indent=2))

    def show(r: dict) -> None:
        p50 = "-" if r["p50_s"] is None else f"{r['p50_s'] * 1e3:8.1f} ms"
        p99 = "-" if r["p99_s"] is None else f"{r['p99_s'] * 1e3:8.1f} ms"
        procs = f"{r['processes_per_replica']} proc" if "processes_per_replica" in r else ""
        relays = f"{r['relays']} relays" if r.get("relays") else ""
        relays += f" {r['emulator_processes']} emulators" if r.get("emulator_processes", 1) > 1 else ""
        print(f"{r['system']:20s} {r.get('transport', 'unary'):7s} {relays:9s} {procs:8s} {r['replicas']:5d} replicas {r['ranks']:7d} ranks: p50 {p50} p99 {p99} "
              f"({r['complete_rounds']}/{r['rounds']} rounds; load {r['loadavg'][0]:.1f})"
              + (f"; beside {r['beside']}, {r['request_bytes']} B requests, {r['reply_bytes']} B answers, server "
                 f"CPU {(r.get('server_cpu_s_per_round') or 0) * 1e3:.0f} ms a round" if r.get("beside") else "")
              + (f"; CPU a round: lighthouse {r['lighthouse_cpu_s_per_round'] * 1e3:.0f} ms, emulator "
                 f"{r['emulator_cpu_s_per_round'] * 1e3:.0f} ms" if r.get("lighthouse_cpu_s_per_round") is not None
                 and r.get("emulator_cpu_s_per_round") is not None else "")
              + (f"; {r['error']}" if r.get("error") else ""), flush=True)

    if "hierarchical" not in args.skip:
        runs = [(x, t, k, e) for x in shapes for t in args.transport for k in args.relays
                for e in args.emulator_processes if k <= x[0] and e <= x[0] and (k == 0 or t == "session")]
        for (rpr, g, nproc), transport, relays, emulators in runs:
            r = fthsdp_row("fthsdp-hierarchical", rpr, g, rounds, heartbeat_s=args.heartbeat, processes=nproc,
                           trace=not args.no_breakdown, warmup=args.warmup, transport=transport, relays=relays,
                           emulator_processes=emulators, lighthouse_cpus=lh_cpus)
            add(r)
            show(r)
            b = r.get("breakdown", {}).get("median")
            if b:
                print("  median round: " + ", ".join(f"{k[:-2]} {v * 1e3:.1f} ms" for k, v in b.items()
                                                      if k in BREAKDOWN_PARTS and v is not None)
                      + f"; per round: lighthouse CPU {(b['lighthouse_cpu_s_this_round'] or 0) * 1e3:.0f} ms, "
                        f"{b['heartbeats_this_round']} heartbeats, ranks' own work "
                        f"{(b['rank_work_s_this_round'] or 0) * 1e3:.1f} ms"
                      + (f", emulator CPU {r['emulator_cpu_s_per_round'] * 1e3:.0f} ms"
                         if r.get("emulator_cpu_s_per_round") is not None else "")
                      + (f", relays' CPU {r['relay_cpu_s_per_round'] * 1e3:.0f} ms"
                         if r.get("relay_cpu_s_per_round") is not None else ""), flush=True)
            save()
            if "floor" not in args.skip and transport == "session" and not relays and emulators == 1:
                fl = floor_row(rpr, rounds, r["leader_request_bytes_median"], r["leader_answer_bytes_median"])
                fl.update(beside=shape_key(r), beside_ranks=r["ranks"])
                add(fl)
                show(fl)
                save()
    if "flat" not in args.skip:
        for n, transport in ((n, t) for n in flat_ns for t in args.transport):
            r = fthsdp_row("fthsdp-flat", n, 1, max(3, rounds // 2) if n > 1024 else rounds, heartbeat_s=0.0,
                           transport=transport)
            add(r)
            show(r)
            save()
    if "decision" not in args.skip:
        dec_ns = args.decision if args.decision is not None else (
            [256, 1024, 4096] if args.quick else [1000, 2000, 4000, 8000, 16000, 32000, 64000, 100000])
        d = decision_benchmark(dec_ns)
        result.setdefault("where_time_goes", {})["decision"] = d
        print("decision: " + ", ".join(f"{p['replicas']}: {p['decide_next_s'] * 1e3:.1f} ms" for p in d["points"])
              + f"; log-log slopes {d['slopes']} (N log N: {d['n_log_n_slope']:.3f})", flush=True)
        save()
    if "profile" not in args.skip:
        g = guard_cost([1024, 4096, 8192])
        result.setdefault("where_time_goes", {})["guard_last_members"] = g
        print("guard: " + ", ".join(f"{p['replicas']}: {p['per_character_s'] * 1e3:.2f} ms -> {p['guard_s'] * 1e3:.3f} ms"
                                    for p in g["points"]), flush=True)
        prof_ns = args.profile if args.profile is not None else ([256] if args.quick else [1024, 8192])
        result.setdefault("where_time_goes", {})
        if prof_ns:
            result["where_time_goes"].update({"breakdown": [], "lighthouse_profile": None})
        for n in prof_ns:
            b = breakdown(n, calls=min(n, 1024))
            result["where_time_goes"]["breakdown"].append(b)
            print(f"breakdown {n}: decide {b['decide_s'] * 1e3:.1f} ms, to_proto {b['quorum_to_proto_s'] * 1e3:.1f} ms, "
                  f"serialize once {b['serialize_once_s'] * 1e3:.2f} ms (old way per round "
                  f"{b['old_round_build_s'] * 1e3:.0f} ms), asyncio wake {b['asyncio_wake_n_calls_s'] * 1e3:.1f} ms, "
                  f"gRPC {b['grpc_per_call_s'] * 1e6:.0f} us/call", flush=True)
            save()
        if prof_ns:
            n = min(prof_ns)
            result["where_time_goes"]["lighthouse_profile"] = lighthouse_profile(n, max(3, rounds // 2))
            lp = result["where_time_goes"]["lighthouse_profile"]
            print(f"lighthouse profile at {n}: busy {lp['profiled_s'] - lp['idle_in_epoll_s']:.2f}s of "
                  f"{lp['profiled_s']:.2f}s: " + ", ".join(f"{k} {v:.2f}s" for k, v in lp["busy_s_by_part"].items()),
                  flush=True)
            save()
        if prof_shapes:
            result["where_time_goes"]["hierarchical_profiles"] = []
        for rpr, g, nproc in prof_shapes:
            hp = lighthouse_profile(rpr, max(3, rounds // 4), g, nproc, heartbeat_s=args.heartbeat)
            result["where_time_goes"]["hierarchical_profiles"].append(hp)
            print(f"lighthouse profile at {rpr}x{g}/{nproc}: busy {hp['profiled_s'] - hp['idle_in_epoll_s']:.2f}s "
                  f"of {hp['profiled_s']:.2f}s; handler calls {hp['handler_calls']}: "
                  + ", ".join(f"{k} {v:.2f}s" for k, v in hp["busy_s_by_part"].items()), flush=True)
            save()
    if "torchft" not in args.skip:
        ok, why = torchft_available(peer_python)
        result["torchft"] = {"available": ok, "version" if ok else "why_not": why,
                             # which interpreter, not where it lives on this machine
                             "python": "the side environment of experiments/setup_peers.sh (experiments/peer_env.py)"}
        if ok:
            for n in tft_ns:
                r = torchft_row(peer_python, n, max(3, rounds // 4) if n > 1024 else max(3, rounds // 2),
                                args.torchft_timeout)
                add(r)
                show(r)
                save()
                if r["complete_rounds"] == 0 or (r["p50_s"] or 0) > 20:
                    result["torchft"]["stopped_at"] = (f"{n} replicas: "
                                                       f"{'no complete round' if not r['complete_rounds'] else 'p50 > 20 s'}"
                                                       "; larger counts not tried")
                    break
        else:
            print(f"torchft: not measured: {why}", flush=True)
    save()
    plot(result["rows"], out_path.with_suffix(".png"))
    if plot_breakdown(result["rows"], out_path.with_name(out_path.stem + "_breakdown.png")):
        print(f"wrote {out_path.with_name(out_path.stem + '_breakdown.png')}")
    print(json.dumps(result["verdict"], indent=1))
    print(f"wrote {out_path} and {out_path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
