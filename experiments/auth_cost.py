"""What authenticating the lighthouse costs, and what a flood of one client costs another job
(issue 13: the benchmark, and item 2's bound).

    python experiments/auth_cost.py [--quick] [--parts paired,flood,cpu] --out results/auth_cost.json

* ``paired``: two lighthouse processes run side by side, one without
  authentication (``--insecure``) and one with a secret (every request
  signed with its job's key: HMAC-SHA256 over the method, ids, the request
  bytes, a timestamp and a nonce, appended to the request as its
  ``credential`` field; checked in constant time, the nonce remembered). The same clients alternate between them call by call
  (heartbeats) or round by round (quorums), in ABBA order, so both see the
  same machine load at the same moment, and each *pair* gives a ratio
  (authenticated over not). Reported: the median of the paired ratios, its
  interquartile range and a distribution-free 95% confidence interval, and
  the verdict on the issue's target (within 10%): "met" when the whole
  interval is <= 1.10, "not met" when it is wholly above, else "undecided".
  Both send the same pre-serialized request bytes (the authenticated one
  with its credential appended), so the difference is the credential alone. The pairs are spread over ``--restarts`` fresh pairs of
  lighthouse processes (default 4): runs with one pair each gave heartbeat
  ratios from x0.98 to x1.20, more than their intervals allow, i.e. a
  process's own luck (its core, its memory layout) moved a whole run; each
  restart's median is reported beside the pooled one. Both lighthouses run with a per-connection budget far
  above what the benchmark sends (the budgets are measured by ``flood``).

  - heartbeat: one client's sequential heartbeats (the cheapest call, where
    a fixed per-call cost shows most), in blocks of 50 per lighthouse; a
    block pair's ratio of medians. A third arm, ``metadata_only``, sends the
    unauthenticated lighthouse a credential-sized gRPC metadata entry (which
    it ignores; a fresh one per call, made before the block is timed, so
    neither the clock nor the CPU columns include making it): what carrying
    the credential in metadata, as fthsdp did before, cost by itself. Each block also records the CPU time per call of
    the lighthouse that answered it and of the client process (the kernel's
    schedstat, all threads): ``cpu_us_per_call`` and the paired differences
    on minus off. On a loaded machine a call's Python code runs several times
    slower than in a hot loop (``cpu`` below): this is what it costs there.
  - quorum: N replicas emulated as asyncio tasks over a few client processes
    (one TCP connection per replica and lighthouse) ask for the quorum of the
    same step, round after round; a round pair's ratio of the request p50
    and of the round time.

* ``flood``: a victim job (8 replicas in one process, a connection each)
  heartbeats (the replicas in turn, one call every 10 ms) and asks for
  quorums (rounds 50 ms apart) without a pause, while another client floods
  the same lighthouse from its own process (16 calls in flight, as fast as it
  can): a *stranger* (unsigned heartbeats with new ids) or an *insider*
  (another job's secret: signed heartbeats with new ids). The flooder is
  stopped (SIGSTOP) and let go (SIGCONT) in 0.6 s blocks in ABBA order, so
  "alone" and "flooded" blocks alternate under the same machine load; each
  pair of blocks gives a ratio of the victim's medians, and the p99s are
  compared over all blocks of each kind. Done on a lighthouse with the
  per-connection/per-job budgets (fthsdp/control/admission.py, the default)
  and, in the same run, one without (``--no-fairness``): what the budgets
  buy. Issue 13's bound: the flood slows the victim <= 2x. On a 2-core
  machine the flooder, the lighthouse and the victim share the cores, so the
  figure includes the flooder's own CPU use.
* ``cpu``: CPU time to sign (client) and check (lighthouse) one credential,
  in this process after a warm-up (best of several repeats).

Why here and not in experiments/failure_stall.py or quorum_scale.py: a
failure's stall is dominated by detection (0.8 s) and FTAR, which bury a cost
of microseconds (failure_stall.py --auth both measures it anyway);
quorum_scale.py measures replicas of several processes and is left to that
purpose.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import grpc  # noqa: E402

from fthsdp.control import auth, guard  # noqa: E402
from fthsdp.launch.lifetime import stop_process  # noqa: E402
from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as load_stubs  # noqa: E402

pb2, _ = load_stubs()
V = LIGHTHOUSE_PROTOCOL_VERSION
SERVICE = "/fthsdp.v1.Lighthouse/"
OPTS = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel


def start_lighthouse(secret: bytes | None, *extra: str) -> tuple[subprocess.Popen, str]:
    env = auth.replica_env(dict(os.environ), None)
    if secret is not None:
        env[auth.LIGHTHOUSE_SECRET_ENV] = secret.hex()
    p = subprocess.Popen(
        [sys.executable, "-m", "fthsdp.control.lighthouse", "--bind", "127.0.0.1:0", "--join-timeout", "60",
         "--detect", "60", "--log-level", "ERROR", *([] if secret is not None else ["--insecure"]), *extra],
        cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    if not line.startswith("lighthouse listening on "):
        p.kill()
        raise RuntimeError(f"lighthouse did not start: {line!r}")
    return p, line.split()[-1]


def summary(ratios: list[float], bound: float) -> dict:
    """Median, interquartile range and a distribution-free 95% confidence interval of the median
    of paired ratios (order statistics of Binomial(n, 1/2)); the verdict on ``median <= bound``."""
    xs = sorted(ratios)
    n = len(xs)
    if n == 0:
        return {"n": 0}
    q = statistics.quantiles(xs, n=4) if n >= 2 else [xs[0]] * 3
    k = max(0, int((n - 1.96 * n ** 0.5) / 2) - 1)
    lo, hi = xs[k], xs[n - 1 - k]
    return {"n": n, "median": statistics.median(xs), "iqr": [q[0], q[2]], "median_ci95": [lo, hi],
            "verdict": "met" if hi <= bound else ("not met" if lo > bound else "undecided")}


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


# -- paired: quorum rounds ------------------------------------------------------------------

def client_main(addresses: list[str], jobs: list[str], lo: int, hi: int, n: int, rounds: int,
                timeout_s: float) -> None:
    """Child process: replicas lo..hi-1 ask both lighthouses (0: off, 1: on) for steps 0..rounds,
    in ABBA order; prints JSON records [mode, replica, step, sent, answered, "ok" | error]. The
    authenticated one is signed with $FTHSDP_JOB_SECRET."""
    key = auth.derive(auth.load_secret(), "lighthouse")

    async def main() -> list:
        chans = [[grpc.aio.insecure_channel(a, options=OPTS) for _ in range(hi - lo)] for a in addresses]
        calls = [[c.unary_unary(SERVICE + "GetQuorum", request_serializer=None,
                                response_deserializer=pb2.QuorumResponse.FromString) for c in cs] for cs in chans]
        records: list = []
        failed = False

        async def ask(mode: int, k: int, step: int) -> None:
            nonlocal failed
            i = lo + k
            body = pb2.QuorumRequest(
                protocol_version=V, job_id=jobs[mode], replica_id=str(i), step=step,
                ftar_addresses=[f"127.0.0.1:{20000 + i}"], state_server_address=f"127.0.0.1:{40000 + i}",
                local_world_size=1, num_replicas=n, incarnation=f"{i:032x}").SerializeToString()
            sent = time.perf_counter()
            if mode == 1:
                body = auth.signed_request(key, "GetQuorum", jobs[mode], str(i), body)
            try:
                resp = await calls[mode][k](body, timeout=timeout_s)
            except grpc.RpcError as e:
                records.append([mode, i, step, sent, time.perf_counter(), f"{e.code().name}: {e.details()}"])
                failed = True
                return
            ok = len(resp.quorum.members) == n
            records.append([mode, i, step, sent, time.perf_counter(), "ok" if ok else "short quorum"])
            failed = failed or not ok

        try:
            for step in range(rounds + 1):
                order = (0, 1) if step % 4 in (0, 3) else (1, 0)  # ABBA: neither mode always first
                for mode in order:
                    await asyncio.gather(*(ask(mode, k, step) for k in range(hi - lo)))
                    if failed:
                        return records
        finally:
            await asyncio.gather(*(c.close() for cs in chans for c in cs))
        return records

    print(json.dumps(asyncio.run(main())), flush=True)


def quorum_paired(n: int, rounds: int, procs: int, timeout_s: float, secret: bytes, budget: list[str],
                  restarts: int = 1) -> dict:
    """``rounds`` round pairs, over ``restarts`` fresh pairs of lighthouse processes (a process's
    own luck, its core and memory layout, must not decide a whole comparison)."""
    parts = [quorum_paired_once(n, rounds // restarts + (1 if k < rounds % restarts else 0), procs, timeout_s,
                                secret, budget) for k in range(restarts)]
    per = {m: [r for p in parts for r in p["rounds"][m]] for m in ("off", "on")}
    out = {"replicas": n, "rounds_ok": len(per["off"]), "restarts": restarts,
           "errors": sorted({e for p in parts for e in p["errors"]})[:5]}
    for k in ("request_p50_s", "round_s"):
        if per["off"]:
            out[k] = {"off_median": statistics.median(r[k] for r in per["off"]),
                      "on_median": statistics.median(r[k] for r in per["on"]),
                      "paired_on_over_off": summary([b[k] / a[k] for a, b in zip(per["off"], per["on"])], 1.10),
                      "per_restart_median": [statistics.median(b[k] / a[k] for a, b in
                                                               zip(p["rounds"]["off"], p["rounds"]["on"]))
                                             for p in parts if p["rounds"]["off"]]}
    out["rounds"] = per
    return out


def quorum_paired_once(n: int, rounds: int, procs: int, timeout_s: float, secret: bytes, budget: list[str]) -> dict:
    (lh_off, a_off), (lh_on, a_on) = start_lighthouse(None, *budget), start_lighthouse(secret, *budget)
    jobs = [f"auth-cost-{n}-off", f"auth-cost-{n}-on"]
    env = auth.replica_env(dict(os.environ), auth.job_key(secret, jobs[1]))
    try:
        procs = max(1, min(procs, n))
        kids = [subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--client", json.dumps([a_off, a_on]), json.dumps(jobs),
             str(k * n // procs), str((k + 1) * n // procs), str(n), str(rounds), str(timeout_s)],
            cwd=REPO, stdout=subprocess.PIPE, text=True, env=env) for k in range(procs)]
        records = []
        for k in kids:
            out, _ = k.communicate(timeout=2 * (rounds + 1) * timeout_s + 60)
            records += json.loads(out.strip().splitlines()[-1])
    finally:
        stop_process(lh_off)
        stop_process(lh_on)
    errors = sorted({r[5] for r in records if r[5] != "ok"})
    per = {0: [], 1: []}
    for step in range(1, rounds + 1):  # round 0: warm-up
        rows = {}
        for mode in (0, 1):
            rs = [r for r in records if r[0] == mode and r[2] == step]
            if len(rs) != n or any(r[5] != "ok" for r in rs):
                break
            lat = sorted(r[4] - r[3] for r in rs)
            rows[mode] = {"request_p50_s": lat[len(lat) // 2], "round_s": max(r[4] for r in rs) - min(r[3] for r in rs)}
        if len(rows) < 2:
            break
        per[0].append(rows[0])
        per[1].append(rows[1])
    out = {"replicas": n, "rounds_ok": len(per[0]), "errors": errors[:5]}
    for k in ("request_p50_s", "round_s"):
        if per[0]:
            out[k] = {"off_median": statistics.median(r[k] for r in per[0]),
                      "on_median": statistics.median(r[k] for r in per[1]),
                      "paired_on_over_off": summary([b[k] / a[k] for a, b in zip(per[0], per[1])], 1.10)}
    out["rounds"] = {"off": per[0], "on": per[1]}
    return out


# -- paired: heartbeat round trips -----------------------------------------------------------

# The heartbeat's arms: 0 unauthenticated, 1 authenticated (the credential in the body, as
# fthsdp sends it), 2 unauthenticated carrying a dummy credential of the same size in gRPC
# metadata (how it travelled before; the unauthenticated lighthouse ignores it): what that
# transport alone cost.
ARMS = ("off", "on", "metadata_only")
ORDERS = ((0, 1, 2), (2, 1, 0), (1, 2, 0), (0, 2, 1), (2, 0, 1), (1, 0, 2))  # each arm first, middle, last


def cpu_ns(pid: int) -> int:
    """CPU time a process's live threads have run (nanoseconds; /proc/PID/task/*/schedstat)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that just exited
            pass
    return total


def heartbeat_paired(blocks: int, block: int, secret: bytes, budget: list[str], restarts: int = 1) -> dict:
    """``blocks`` block triples over ``restarts`` fresh pairs of lighthouse processes.

    Beside the latencies, each block's CPU time per call of the lighthouse that answered it
    and of this client process (all threads, from the kernel's schedstat): what each arm
    costs in CPU, which a loaded machine cannot inflate the way it inflates latency."""
    lat: dict[int, list[list[float]]] = {m: [] for m in range(len(ARMS))}
    cpu: dict[int, list[tuple[float, float]]] = {m: [] for m in range(len(ARMS))}
    per_restart = []
    for k in range(restarts):
        part, part_cpu = heartbeat_paired_once(blocks // restarts + (1 if k < blocks % restarts else 0), block,
                                               secret, budget)
        per_restart.append(statistics.median(statistics.median(b) / statistics.median(a)
                                             for a, b in zip(part[0], part[1])))
        for m in lat:
            lat[m] += part[m]
            cpu[m] += part_cpu[m]
    flat = {m: [x for blk in lat[m] for x in blk] for m in lat}
    out = {"blocks": blocks, "calls_per_block": block, "restarts": restarts,
           "p50_s": {ARMS[m]: pct(flat[m], 0.5) for m in lat},
           "p99_s": {ARMS[m]: pct(flat[m], 0.99) for m in lat},
           "paired_p50_on_over_off": summary([statistics.median(b) / statistics.median(a)
                                              for a, b in zip(lat[0], lat[1])], 1.10),
           "paired_p50_metadata_only_over_off": summary([statistics.median(b) / statistics.median(a)
                                                         for a, b in zip(lat[0], lat[2])], 1.10),
           "per_restart_median": per_restart,
           "cpu_us_per_call": {ARMS[m]: {"lighthouse": statistics.median(c[0] for c in cpu[m]),
                                         "client": statistics.median(c[1] for c in cpu[m])} for m in cpu}}
    for m in (1, 2):
        out[f"cpu_us_per_call_{ARMS[m]}_minus_off"] = {
            side: summary([b[i] - a[i] for a, b in zip(cpu[0], cpu[m])], float("inf"))
            for i, side in enumerate(("lighthouse", "client"))}
    return out


def heartbeat_paired_once(blocks: int, block: int, secret: bytes,
                          budget: list[str]) -> tuple[dict[int, list[list[float]]], dict[int, list[tuple[float, float]]]]:
    (lh_off, a_off), (lh_on, a_on) = start_lighthouse(None, *budget), start_lighthouse(secret, *budget)
    key = auth.derive(auth.job_key(secret, "hb"), "lighthouse")
    lat: dict[int, list[list[float]]] = {m: [] for m in range(len(ARMS))}
    cpu: dict[int, list[tuple[float, float]]] = {m: [] for m in range(len(ARMS))}
    servers = (lh_off.pid, lh_on.pid, lh_off.pid)
    try:
        chans = [grpc.insecure_channel(a, options=OPTS) for a in (a_off, a_on, a_off)]
        calls = [c.unary_unary(SERVICE + "Heartbeat", request_serializer=None, response_deserializer=None)
                 for c in chans]
        step = 0

        def dummies(mode: int, count: int) -> list:
            """The metadata arm's per-call entries, made before its block is timed (clock and CPU):
            the old text credential's size and shape ("job TIMESTAMP NONCE SIGNATURE", hex), a
            fresh one per call as before (a repeated value would be cheaper: HPACK indexes it)."""
            if mode != 2:
                return [None] * count
            out = []
            for k in range(count):
                c = auth.sign(key, "Heartbeat", "hb", "0", b"%d" % k, time.time())
                out.append(((auth.LEGACY_METADATA_KEY, f"job {c.timestamp:.6f} {c.nonce.hex()} {c.signature.hex()}"),))
            return out

        def run(mode: int, count: int, mds: list | None = None) -> list[float]:
            nonlocal step
            out = []
            for md in (mds if mds is not None else dummies(mode, count)):
                step += 1
                body = pb2.HeartbeatRequest(protocol_version=V, job_id="hb", replica_id="0", step=step,
                                            incarnation="0" * 32).SerializeToString()
                t0 = time.perf_counter()
                if mode == 1:
                    body = auth.signed_request(key, "Heartbeat", "hb", "0", body)
                calls[mode](body, timeout=10, metadata=md)
                out.append(time.perf_counter() - t0)
            return out

        for mode in lat:  # warm-up
            run(mode, 300)
        me = os.getpid()
        for b in range(blocks):
            for mode in ORDERS[b % len(ORDERS)]:
                mds = dummies(mode, block)
                s0, c0 = cpu_ns(servers[mode]), cpu_ns(me)
                lat[mode].append(run(mode, block, mds))
                cpu[mode].append(((cpu_ns(servers[mode]) - s0) / block / 1e3, (cpu_ns(me) - c0) / block / 1e3))
        for c in chans:
            c.close()
    finally:
        stop_process(lh_off)
        stop_process(lh_on)
    return lat, cpu


# -- flood ------------------------------------------------------------------------------------

def flood_main(address: str, mode: str, key_hex: str) -> None:
    """Child process: floods ``address`` until its stdin closes; prints the calls' status codes."""
    key = auth.derive(bytes.fromhex(key_hex), "lighthouse") if key_hex else None
    codes: dict[str, int] = {}
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()

    async def main() -> None:
        async with grpc.aio.insecure_channel(address, options=OPTS) as ch:
            call = ch.unary_unary(SERVICE + "Heartbeat", request_serializer=None, response_deserializer=None)
            try:  # a first call, then tell the parent the flood starts (its interpreter's start-up is over)
                await call(b"", timeout=5)
            except grpc.RpcError:
                pass
            print("flooding", flush=True)

            async def worker(w: int) -> None:
                i = 0
                while not done.is_set():
                    rid = f"ghost-{w}-{i}"
                    i += 1
                    body = pb2.HeartbeatRequest(protocol_version=V, job_id="flood", replica_id=rid, step=1,
                                                incarnation="f" * 32).SerializeToString()
                    if key is not None:
                        body = auth.signed_request(key, "Heartbeat", "flood", rid, body)
                    try:
                        await call(body, timeout=5)
                        codes["OK"] = codes.get("OK", 0) + 1
                    except grpc.RpcError as e:
                        codes[e.code().name] = codes.get(e.code().name, 0) + 1

            await asyncio.gather(*(worker(w) for w in range(16)))

    asyncio.run(main())
    print(json.dumps(codes), flush=True)


KEYS = ("heartbeat_p50_s", "heartbeat_p99_s", "quorum_p50_s", "quorum_p99_s")


def victim_run(address: str, key: bytes, flooder: subprocess.Popen, pairs: int, block_s: float) -> dict:
    """The victim job (8 replicas, a connection each) heartbeats (the replicas in turn, one call
    every 10 ms: each every 80 ms, as a replica does every 100 ms) and asks for quorums (rounds
    50 ms apart, a quick training step) without a pause, while the flooder is
    stopped (SIGSTOP: "alone") and let go (SIGCONT: "flooded") in blocks of ``block_s``, in ABBA
    order, ``pairs`` pairs. Each sample is tagged with the block it was sent in; samples sent in
    the first 0.1 s of a block (the flood starting or draining) are left out."""
    job, n = "victim", 8
    samples: list[tuple[int, str, float]] = []  # (block, "heartbeat" | "quorum", seconds)
    state = {"block": -1, "since": 0.0, "flooded": False}
    order = [(i // 2) % 2 == (i % 2) for i in range(2 * pairs)]  # F A A F F A ... : ABBA pairs

    async def main() -> None:
        chans = [grpc.aio.insecure_channel(address, options=OPTS) for _ in range(n)]
        hb = [c.unary_unary(SERVICE + "Heartbeat", request_serializer=None, response_deserializer=None)
              for c in chans]
        gq = [c.unary_unary(SERVICE + "GetQuorum", request_serializer=None,
                            response_deserializer=pb2.QuorumResponse.FromString) for c in chans]
        stop_at = asyncio.Event()

        def inc(r: int) -> str:
            return f"{r + 10:x}" * 16

        def tag() -> int | None:
            return state["block"] if time.monotonic() - state["since"] >= 0.1 and state["block"] >= 0 else None

        async def heartbeats() -> None:
            i = 0
            while not stop_at.is_set():
                r = i % n
                i += 1
                body = pb2.HeartbeatRequest(protocol_version=V, job_id=job, replica_id=str(r), step=i,
                                            incarnation=inc(r)).SerializeToString()
                b, t0 = tag(), time.perf_counter()
                await hb[r](auth.signed_request(key, "Heartbeat", job, str(r), body), timeout=10)
                if b is not None and tag() == b:
                    samples.append((b, "heartbeat", time.perf_counter() - t0))
                await asyncio.sleep(0.01)

        async def quorums() -> None:
            step = 0
            while not stop_at.is_set():
                step += 1

                async def ask(r: int) -> float:
                    body = pb2.QuorumRequest(protocol_version=V, job_id=job, replica_id=str(r), step=step,
                                             ftar_addresses=[f"127.0.0.1:{21000 + r}"], local_world_size=1,
                                             state_server_address=f"127.0.0.1:{41000 + r}", num_replicas=n,
                                             incarnation=inc(r)).SerializeToString()
                    t0 = time.perf_counter()
                    resp = await gq[r](auth.signed_request(key, "GetQuorum", job, str(r), body), timeout=10)
                    assert len(resp.quorum.members) == n, resp
                    return time.perf_counter() - t0

                b = tag()
                lat = await asyncio.gather(*(ask(r) for r in range(n)))
                if b is not None and tag() == b:
                    samples.extend((b, "quorum", x) for x in lat)
                await asyncio.sleep(0.05)

        async def conductor() -> None:
            await asyncio.sleep(1.0)  # warm-up, flooder stopped
            for blk, flooded in enumerate(order):
                os.kill(flooder.pid, signal.SIGCONT if flooded else signal.SIGSTOP)
                state.update(block=blk, since=time.monotonic(), flooded=flooded)
                await asyncio.sleep(block_s)
            os.kill(flooder.pid, signal.SIGCONT)
            stop_at.set()

        try:
            await asyncio.gather(heartbeats(), quorums(), conductor())
        finally:
            await asyncio.gather(*(c.close() for c in chans))

    os.kill(flooder.pid, signal.SIGSTOP)
    try:
        asyncio.run(main())
    finally:
        os.kill(flooder.pid, signal.SIGCONT)
    per_block = {}
    for blk, kind, x in samples:
        per_block.setdefault(blk, {}).setdefault(kind, []).append(x)
    out: dict = {"pairs": pairs, "block_s": block_s}
    for kind in ("heartbeat", "quorum"):
        pooled = {f: [x for blk, k, x in samples if k == kind and order[blk] == f] for f in (False, True)}
        ratios = []
        for pr in range(pairs):
            blocks = {order[b]: per_block.get(b, {}).get(kind) for b in (2 * pr, 2 * pr + 1)}
            if blocks.get(True) and blocks.get(False):
                ratios.append(statistics.median(blocks[True]) / statistics.median(blocks[False]))
        out[kind] = {"alone_p50_s": pct(pooled[False], 0.5), "flooded_p50_s": pct(pooled[True], 0.5),
                     "alone_p99_s": pct(pooled[False], 0.99), "flooded_p99_s": pct(pooled[True], 0.99),
                     "p99_ratio": (pct(pooled[True], 0.99) / pct(pooled[False], 0.99)
                                   if pooled[True] and pooled[False] else None),
                     "samples": {"alone": len(pooled[False]), "flooded": len(pooled[True])},
                     "paired_p50_ratio": summary(ratios, 2.0)}
    return out


def flood(pairs: int, block_s: float, fairness: bool) -> dict:
    """The victim job beside each kind of flooder, on a lighthouse with or without budgets."""
    secret = auth.new_secret()
    key = auth.derive(auth.job_key(secret, "victim"), "lighthouse")
    out: dict = {"fairness": fairness}
    for mode, key_hex in (("stranger", ""), ("insider", auth.job_key(secret, "flood").hex())):
        lh, address = start_lighthouse(secret, *([] if fairness else ["--no-fairness"]))
        try:
            kid = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--flood", address, mode, key_hex],
                                   cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert kid.stdout.readline().strip() == "flooding"
            r = victim_run(address, key, kid, pairs, block_s)
            kid.stdin.close()  # the flooder stops, lets its calls in flight finish and prints its tally
            got = kid.stdout.read()
            kid.wait(60)
        finally:
            stop_process(lh)
        r["flood_codes"] = json.loads(got.strip().splitlines()[-1])
        out[mode] = r
        print(f"  {'budgets' if fairness else 'no budgets'}, {mode}: " + "; ".join(
            f"{k} p50 x{r[k]['paired_p50_ratio'].get('median', float('nan')):.2f} "
            f"({r[k]['paired_p50_ratio']['n']} pairs) p99 x{r[k]['p99_ratio'] or float('nan'):.2f}"
            for k in ("heartbeat", "quorum")) + f"; flood answers {r['flood_codes']}", flush=True)
    return out


def credential_cpu_us(calls: int = 5_000, repeats: int = 7) -> dict:
    """Sign (client: HMAC and append the field) and check (lighthouse: find the signed part,
    parse, verify, replay cache) one credential, per call, in this process."""
    secret = auth.new_secret()
    checker = guard.CallAuthenticator(secret)
    key = auth.derive(auth.job_key(secret, "job"), "lighthouse")
    body = pb2.QuorumRequest(protocol_version=V, job_id="job", replica_id="7", step=1234,
                             ftar_addresses=["127.0.0.1:20007"], state_server_address="127.0.0.1:40007",
                             local_world_size=1).SerializeToString()

    def check(data: bytes) -> guard.Refusal | None:
        req = pb2.QuorumRequest.FromString(data)
        return checker.check_request("GetQuorum", req, data)  # what the lighthouse's gate runs

    for _ in range(1000):  # warm-up
        check(auth.signed_request(key, "GetQuorum", "job", "7", body))
    sign, chk = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        signed = [auth.signed_request(key, "GetQuorum", "job", "7", body) for _ in range(calls)]
        t1 = time.perf_counter()
        for data in signed:
            assert check(data) is None
        t2 = time.perf_counter()
        sign.append((t1 - t0) / calls * 1e6)
        chk.append((t2 - t1) / calls * 1e6)
    return {"sign_us": min(sign), "check_us": min(chk), "sign_us_median": statistics.median(sign),
            "check_us_median": statistics.median(chk), "calls": calls, "repeats": repeats,
            "note": "check includes parsing the request (the lighthouse parses it anyway)"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--client":
        a = argv[1:]
        client_main(json.loads(a[0]), json.loads(a[1]), int(a[2]), int(a[3]), int(a[4]), int(a[5]), float(a[6]))
        return 0
    if argv and argv[0] == "--flood":
        flood_main(argv[1], argv[2], argv[3] if len(argv) > 3 else "")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 and 64 replicas, few rounds and reps (CI-sized)")
    ap.add_argument("--parts", default="paired,flood,cpu", help="comma-separated: paired, flood, cpu")
    ap.add_argument("--replicas", type=int, nargs="*", help="replica counts (default 16 64 256)")
    ap.add_argument("--rounds", type=int, default=None, help="paired quorum rounds per N (default 40; --quick 6)")
    ap.add_argument("--procs", type=int, default=4, help="client processes the replicas are spread over")
    ap.add_argument("--restarts", type=int, default=None,
                    help="fresh lighthouse pairs the paired rounds and blocks are spread over (default 4; --quick 1)")
    ap.add_argument("--heartbeat-blocks", type=int, default=None,
                    help="paired heartbeat blocks of 50 calls per lighthouse (default 60; --quick 8)")
    ap.add_argument("--flood-pairs", type=int, default=None, help="alone/flooded block pairs per flooder (default "
                    "40; --quick 6)")
    ap.add_argument("--timeout", type=float, default=20.0, help="per-call deadline (s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"paired", "flood", "cpu"} or not parts:
        ap.error(f"--parts {args.parts!r}: choose among paired, flood, cpu")
    counts = args.replicas or ([16, 64] if args.quick else [16, 64, 256])
    rounds = args.rounds or (6 if args.quick else 40)
    blocks = args.heartbeat_blocks or (8 if args.quick else 60)
    restarts = args.restarts or (1 if args.quick else 4)
    out = {
        "experiment": "auth_cost",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpc": grpc.__version__},
        "load_average_before": list(os.getloadavg()),
        "targets": {"paired": "quorum (and heartbeat) latency with authentication within 10% of without",
                    "flood": "a flood of another client slows a job's heartbeats and quorums <= 2x"},
    }
    secret = auth.new_secret()
    # The benchmark's clients send faster than a replica ever does: budgets far above them.
    budget = ["--connection-calls-per-s", "1000000"]
    if "paired" in parts:
        out["setup_paired"] = (f"two real lighthouse processes (off: --insecure, on: a secret) side by side, loopback; "
                               f"heartbeat: one client, {blocks} blocks of 50 sequential calls per arm (off, on, off with a dummy "
                               f"metadata credential), the arms' order rotated; "
                               f"quorum: N replicas over {args.procs} client processes, {rounds} rounds (+1 warm-up) "
                               f"per lighthouse in ABBA order; both over {restarts} fresh lighthouse pairs; every "
                               "process shares this machine's cores")
        out["heartbeat"] = heartbeat_paired(blocks, 50, secret, budget, restarts)
        h = out["heartbeat"]
        print(f"heartbeat p50 off {h['p50_s']['off'] * 1e6:.0f} us, on {h['p50_s']['on'] * 1e6:.0f} us; paired "
              f"ratio {h['paired_p50_on_over_off']['median']:.3f} (IQR {h['paired_p50_on_over_off']['iqr'][0]:.3f}.."
              f"{h['paired_p50_on_over_off']['iqr'][1]:.3f}, CI {h['paired_p50_on_over_off']['median_ci95']}): "
              f"{h['paired_p50_on_over_off']['verdict']}; metadata alone "
              f"x{h['paired_p50_metadata_only_over_off']['median']:.3f} "
              f"(CI {h['paired_p50_metadata_only_over_off']['median_ci95']})", flush=True)
        cm = h["cpu_us_per_call_on_minus_off"]
        print(f"heartbeat CPU per call, on minus off: lighthouse {cm['lighthouse']['median']:+.1f} us "
              f"(CI {cm['lighthouse']['median_ci95'][0]:+.1f}..{cm['lighthouse']['median_ci95'][1]:+.1f}), client "
              f"{cm['client']['median']:+.1f} us (CI {cm['client']['median_ci95'][0]:+.1f}.."
              f"{cm['client']['median_ci95'][1]:+.1f}); off: lighthouse "
              f"{h['cpu_us_per_call']['off']['lighthouse']:.0f} us, client {h['cpu_us_per_call']['off']['client']:.0f} us",
              flush=True)
        out["quorum"] = []
        for n in counts:
            r = quorum_paired(n, rounds, args.procs, args.timeout, secret, budget, restarts)
            out["quorum"].append(r)
            if not r["rounds_ok"]:
                print(f"{n:4d} replicas: no complete round pair {r['errors']}", flush=True)
                continue
            for k in ("request_p50_s", "round_s"):
                s_ = r[k]["paired_on_over_off"]
                print(f"{n:4d} replicas {k}: off {r[k]['off_median'] * 1e3:.2f} ms on {r[k]['on_median'] * 1e3:.2f} ms; "
                      f"paired ratio {s_['median']:.3f} (IQR {s_['iqr'][0]:.3f}..{s_['iqr'][1]:.3f}, CI "
                      f"{s_['median_ci95'][0]:.3f}..{s_['median_ci95'][1]:.3f}, {s_['n']} pairs): {s_['verdict']}",
                      flush=True)
    if "cpu" in parts:
        out["credential_cpu_us"] = credential_cpu_us()
        c = out["credential_cpu_us"]
        print(f"credential: sign {c['sign_us']:.1f} us, check {c['check_us']:.1f} us per call (best of repeats)")
    if "flood" in parts:
        fpairs, block_s = args.flood_pairs or (6 if args.quick else 40), 0.6
        out["setup_flood"] = (f"one lighthouse process with a secret per (budgets, flooder); victim: 8 replicas in one "
                              "process heartbeating in turn every 10 ms and asking quorums in rounds 50 ms apart, "
                              f"without a pause; flooder: its own process, 16 calls in flight, stopped (SIGSTOP) "
                              f"and let go (SIGCONT) in {block_s} s blocks, {fpairs} ABBA pairs; samples of a "
                              "block's first 0.1 s left out; with budgets and without, one after the other")
        out["flood"] = {"budgets": flood(fpairs, block_s, True), "no_budgets": flood(fpairs, block_s, False)}
        for name, f in out["flood"].items():
            for mode in ("stranger", "insider"):
                r = f[mode]
                r["within_2x"] = all(r[k]["paired_p50_ratio"].get("median", float("inf")) <= 2.0
                                     and (r[k]["p99_ratio"] or float("inf")) <= 2.0 for k in ("heartbeat", "quorum"))
                print(f"flood by a {mode} ({name}): " + ", ".join(
                    f"{k} p50 x{r[k]['paired_p50_ratio'].get('median', float('nan')):.2f} "
                    f"p99 x{r[k]['p99_ratio'] or float('nan'):.2f}" for k in ("heartbeat", "quorum"))
                    + f"; within 2x: {r['within_2x']}")
    out["load_average_after"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
