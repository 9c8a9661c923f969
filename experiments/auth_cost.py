"""What authenticating the lighthouse costs a quorum (issue 13 benchmark).

    python experiments/auth_cost.py [--quick] --out results/auth_cost.json

The same measurements with the lighthouse's per-call credentials off (the
lighthouse run ``--insecure``) and on (a lighthouse secret; every request
signed with its job's key: HMAC-SHA256 over the method, ids, the request
bytes, a timestamp and a nonce, in gRPC metadata; the lighthouse checks it in
constant time and remembers the nonce), alternating off/on ``--pairs`` times
in one run so both see the same machine load. Both modes send the same
pre-serialized request bytes, so the difference is the credential alone.

* ``quorum``: N replicas emulated as asyncio tasks over a few client
  processes (one TCP connection each) ask a real lighthouse process for the
  quorum of the same step, round after round (round 0 is a warm-up):
  per-request p50 and the round time, medians over rounds and pairs.
* ``heartbeat``: one client's sequential heartbeats to a lighthouse process:
  the round trip of the cheapest call, where a fixed per-call cost shows most.
* ``flood``: one job's heartbeat round trip while another client floods
  the same lighthouse from its own process (16 calls in flight, as fast as
  it can): a stranger's unsigned heartbeats with new ids, and an insider's
  (another job's secret) signed heartbeats with new ids; the ratio to the
  same job's round trip without the flood. Issue 13's bound is 2x; on a
  2-core machine the flooder, the lighthouse and the victim share the cores,
  so the figure is an upper bound of what the lighthouse alone adds.
* ``credential_cpu_us``: CPU time to sign (client) and check (lighthouse) one
  credential, in this process after a warm-up.

Target: quorum latency with authentication within 10% of without
(``within_10_percent`` per N, on the medians). Why here and not in
experiments/failure_stall.py or quorum_scale.py: a failure's stall is
dominated by detection (0.8 s) and FTAR, which bury a cost of tens of
microseconds; quorum_scale.py measures replicas of several processes and is
left to that purpose. Every process shares this machine's cores: on a loaded
2-core machine the off/on figures of one pair can differ by 2x either way, so
only the medians over pairs are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import grpc  # noqa: E402

from fthsdp.control import auth, guard  # noqa: E402
from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse as load_stubs  # noqa: E402

pb2, _ = load_stubs()
V = LIGHTHOUSE_PROTOCOL_VERSION
SERVICE = "/fthsdp.v1.Lighthouse/"


def start_lighthouse(secret: bytes | None) -> tuple[subprocess.Popen, str]:
    env = auth.replica_env(dict(os.environ), None)
    if secret is not None:
        env[auth.LIGHTHOUSE_SECRET_ENV] = secret.hex()
    p = subprocess.Popen(
        [sys.executable, "-m", "fthsdp.control.lighthouse", "--bind", "127.0.0.1:0", "--join-timeout", "60",
         "--detect", "60", "--log-level", "ERROR", *([] if secret is not None else ["--insecure"])],
        cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    if not line.startswith("lighthouse listening on "):
        p.kill()
        raise RuntimeError(f"lighthouse did not start: {line!r}")
    return p, line.split()[-1]


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(10)


# -- quorum rounds ------------------------------------------------------------------------

def client_main(address: str, job: str, lo: int, hi: int, n: int, rounds: int, timeout_s: float) -> None:
    """Child process: replicas lo..hi-1 ask for steps 0..rounds; prints JSON records
    [replica, step, sent, answered, "ok" | error]. Signs with $FTHSDP_JOB_SECRET when set."""
    job_key = auth.load_secret()
    key = auth.derive(job_key, "lighthouse") if job_key is not None else None

    async def main() -> list:
        opts = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per replica
        channels = [grpc.aio.insecure_channel(address, options=opts) for _ in range(hi - lo)]
        records: list = []

        async def replica(i: int, channel) -> None:
            call = channel.unary_unary(SERVICE + "GetQuorum", request_serializer=None,
                                       response_deserializer=pb2.QuorumResponse.FromString)
            for step in range(rounds + 1):
                body = pb2.QuorumRequest(
                    protocol_version=V, job_id=job, replica_id=str(i), step=step,
                    ftar_addresses=[f"127.0.0.1:{20000 + i}"], state_server_address=f"127.0.0.1:{40000 + i}",
                    local_world_size=1, num_replicas=n, incarnation=f"{i:032x}").SerializeToString()
                sent = time.perf_counter()
                md = auth.call_metadata(key, "GetQuorum", job, str(i), body) if key is not None else None
                try:
                    resp = await call(body, timeout=timeout_s, metadata=md)
                except grpc.RpcError as e:
                    records.append([i, step, sent, time.perf_counter(), f"{e.code().name}: {e.details()}"])
                    return
                ok = len(resp.quorum.members) == n
                records.append([i, step, sent, time.perf_counter(), "ok" if ok else "short quorum"])
                if not ok:
                    return

        try:
            await asyncio.gather(*(replica(lo + k, c) for k, c in enumerate(channels)))
        finally:
            await asyncio.gather(*(c.close() for c in channels))
        return records

    print(json.dumps(asyncio.run(main())), flush=True)


def quorum_rounds(n: int, rounds: int, procs: int, timeout_s: float, secret: bytes | None) -> dict:
    lh, address = start_lighthouse(secret)
    job = f"auth-cost-{n}-{time.monotonic_ns()}"
    env = auth.replica_env(dict(os.environ), auth.job_key(secret, job) if secret is not None else None)
    try:
        procs = max(1, min(procs, n))
        kids = [subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--client", address, job, str(k * n // procs),
             str((k + 1) * n // procs), str(n), str(rounds), str(timeout_s)],
            cwd=REPO, stdout=subprocess.PIPE, text=True, env=env) for k in range(procs)]
        records = []
        for k in kids:
            out, _ = k.communicate(timeout=(rounds + 1) * timeout_s + 60)
            records += json.loads(out.strip().splitlines()[-1])
    finally:
        stop(lh)
    errors = sorted({r[4] for r in records if r[4] != "ok"})
    per_round = []
    for step in range(1, rounds + 1):
        rs = [r for r in records if r[1] == step]
        if len(rs) != n or any(r[4] != "ok" for r in rs):
            break
        lat = sorted(r[3] - r[2] for r in rs)
        per_round.append({"request_p50_s": lat[len(lat) // 2],
                          "round_s": max(r[3] for r in rs) - min(r[2] for r in rs)})
    out = {"replicas": n, "authenticated": secret is not None, "rounds_ok": len(per_round), "errors": errors[:5]}
    if per_round:
        out.update({k: statistics.median(r[k] for r in per_round) for k in per_round[0]})
    return out


# -- heartbeat round trip -----------------------------------------------------------------

def heartbeat_rtt(calls: int, secret: bytes | None) -> dict:
    lh, address = start_lighthouse(secret)
    key = auth.derive(auth.job_key(secret, "hb"), "lighthouse") if secret is not None else None
    lat = []
    try:
        with grpc.insecure_channel(address) as ch:
            call = ch.unary_unary(SERVICE + "Heartbeat", request_serializer=None, response_deserializer=None)
            for i in range(calls + 200):  # the first 200: warm-up
                body = pb2.HeartbeatRequest(protocol_version=V, job_id="hb", replica_id="0", step=i,
                                            incarnation="0" * 32).SerializeToString()
                t0 = time.perf_counter()
                md = auth.call_metadata(key, "Heartbeat", "hb", "0", body) if key is not None else None
                call(body, timeout=10, metadata=md)
                if i >= 200:
                    lat.append(time.perf_counter() - t0)
    finally:
        stop(lh)
    lat.sort()
    return {"authenticated": secret is not None, "calls": calls, "p50_s": lat[len(lat) // 2],
            "p90_s": lat[int(0.9 * len(lat))]}


def flood_main(address: str, mode: str, seconds: float, key_hex: str) -> None:
    """Child process: floods ``address`` for ``seconds``; prints the calls sent and their status codes."""
    key = auth.derive(bytes.fromhex(key_hex), "lighthouse") if key_hex else None
    codes: dict[str, int] = {}

    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            call = ch.unary_unary(SERVICE + "Heartbeat", request_serializer=None, response_deserializer=None)
            end = time.monotonic() + seconds

            async def worker(w: int) -> None:
                i = 0
                while time.monotonic() < end:
                    rid = f"ghost-{w}-{i}"
                    i += 1
                    body = pb2.HeartbeatRequest(protocol_version=V, job_id="flood", replica_id=rid, step=1,
                                                incarnation="f" * 32).SerializeToString()
                    md = auth.call_metadata(key, "Heartbeat", "flood", rid, body) if key is not None else None
                    try:
                        await call(body, timeout=5, metadata=md)
                        codes["OK"] = codes.get("OK", 0) + 1
                    except grpc.RpcError as e:
                        codes[e.code().name] = codes.get(e.code().name, 0) + 1

            await asyncio.gather(*(worker(w) for w in range(16)))

    asyncio.run(main())
    print(json.dumps(codes), flush=True)


def flood(seconds: float, calls: int) -> dict:
    """The victim job's heartbeat p50 alone, then under each kind of flood, on one lighthouse."""
    secret = auth.new_secret()
    lh, address = start_lighthouse(secret)
    key = auth.derive(auth.job_key(secret, "victim"), "lighthouse")
    out: dict = {}
    try:
        with grpc.insecure_channel(address) as ch:
            call = ch.unary_unary(SERVICE + "Heartbeat", request_serializer=None, response_deserializer=None)

            def victim(n: int) -> float:
                lat = []
                for i in range(n):
                    body = pb2.HeartbeatRequest(protocol_version=V, job_id="victim", replica_id="0", step=i,
                                                incarnation="v" * 32).SerializeToString()
                    t0 = time.perf_counter()
                    call(body, timeout=10, metadata=auth.call_metadata(key, "Heartbeat", "victim", "0", body))
                    lat.append(time.perf_counter() - t0)
                return statistics.median(lat)

            victim(200)  # warm-up
            out["alone_p50_s"] = victim(calls)
            for mode, key_hex in (("stranger", ""), ("insider", auth.job_key(secret, "flood").hex())):
                kid = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--flood", address, mode,
                                        str(seconds), key_hex], cwd=REPO, stdout=subprocess.PIPE, text=True)
                time.sleep(min(1.0, seconds / 4))  # the flood is under way
                p50 = victim(calls)
                got, _ = kid.communicate(timeout=seconds + 60)
                out[mode] = {"victim_p50_s": p50, "over_alone": p50 / out["alone_p50_s"],
                             "flood_codes": json.loads(got.strip().splitlines()[-1])}
    finally:
        stop(lh)
    return out


def credential_cpu_us(calls: int = 20_000) -> dict:
    secret = auth.new_secret()
    checker = guard.CallAuthenticator(secret)
    key = auth.derive(auth.job_key(secret, "job"), "lighthouse")
    body = pb2.QuorumRequest(protocol_version=V, job_id="job", replica_id="7", step=1234,
                             ftar_addresses=["127.0.0.1:20007"], state_server_address="127.0.0.1:40007",
                             local_world_size=1).SerializeToString()
    for _ in range(1000):  # warm-up
        checker.check("GetQuorum", auth.call_metadata(key, "GetQuorum", "job", "7", body), "job", "7", body)
    t0 = time.perf_counter()
    mds = [auth.call_metadata(key, "GetQuorum", "job", "7", body) for _ in range(calls)]
    t1 = time.perf_counter()
    for md in mds:
        assert checker.check("GetQuorum", md, "job", "7", body) is None
    t2 = time.perf_counter()
    return {"sign_us": (t1 - t0) / calls * 1e6, "check_us": (t2 - t1) / calls * 1e6, "calls": calls}


def ratios(rows: list[dict], keys: tuple[str, ...]) -> dict:
    out = {}
    for k in keys:
        off = [r[k] for r in rows if not r["authenticated"] and k in r]
        on = [r[k] for r in rows if r["authenticated"] and k in r]
        if off and on:
            a, b = statistics.median(off), statistics.median(on)
            out[k] = {"off": a, "on": b, "on_over_off": b / a}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--client":
        a = argv[1:]
        client_main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), float(a[6]))
        return 0
    if argv and argv[0] == "--flood":
        flood_main(argv[1], argv[2], float(argv[3]), argv[4] if len(argv) > 4 else "")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 and 64 replicas, 2 pairs (CI-sized)")
    ap.add_argument("--replicas", type=int, nargs="*", help="replica counts (default 16 64 256)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=None, help="off/on alternations (default 3; --quick 2)")
    ap.add_argument("--procs", type=int, default=4, help="client processes the replicas are spread over")
    ap.add_argument("--heartbeats", type=int, default=2000, help="sequential heartbeats per mode and pair")
    ap.add_argument("--timeout", type=float, default=20.0, help="per-call deadline (s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    counts = args.replicas or ([16, 64] if args.quick else [16, 64, 256])
    pairs = args.pairs or (2 if args.quick else 3)
    heartbeats = min(args.heartbeats, 500) if args.quick else args.heartbeats
    secret = auth.new_secret()
    quorum, hb = [], []
    for p in range(pairs):
        for s in (None, secret):
            hb.append(heartbeat_rtt(heartbeats, s))
            print(f"pair {p} heartbeat auth {'on ' if s else 'off'}: p50 {hb[-1]['p50_s'] * 1e6:7.0f} us", flush=True)
            for n in counts:
                r = quorum_rounds(n, args.rounds, args.procs, args.timeout, s)
                quorum.append(r)
                print(f"pair {p} {n:4d} replicas auth {'on ' if s else 'off'}: "
                      + (f"request p50 {r['request_p50_s'] * 1e3:7.2f} ms, round {r['round_s'] * 1e3:7.2f} ms"
                         if r["rounds_ok"] else f"no complete round {r['errors']}"), flush=True)
    per_n = []
    for n in counts:
        rows = [r for r in quorum if r["replicas"] == n and r["rounds_ok"]]
        row = {"replicas": n, **ratios(rows, ("request_p50_s", "round_s"))}
        row["within_10_percent"] = all(v["on_over_off"] <= 1.10 for k, v in row.items() if isinstance(v, dict)) \
            if len(row) > 1 else None
        per_n.append(row)
    out = {
        "experiment": "auth_cost",
        "setup": (f"real lighthouse process, loopback; quorum: N replicas over {args.procs} client processes, "
                  f"{args.rounds} rounds (+1 warm-up); heartbeat: one client, {heartbeats} sequential calls; "
                  f"credentials off/on alternated {pairs} times; every process shares this machine's cores"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpc": grpc.__version__},
        "target": "quorum latency with authentication within 10% of without",
        "quorum": per_n,
        "heartbeat": ratios(hb, ("p50_s", "p90_s")),
        "credential_cpu_us": credential_cpu_us(),
        "flood": flood(seconds=4.0 if args.quick else 8.0, calls=300 if args.quick else 1000),
        "runs": {"quorum": quorum, "heartbeat": hb},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    for row in per_n:
        print(f"{row['replicas']:4d} replicas: " + ", ".join(
            f"{k} on/off {v['on_over_off']:.2f}" for k, v in row.items() if isinstance(v, dict))
              + f" (within 10%: {row['within_10_percent']})")
    h = out["heartbeat"].get("p50_s")
    if h:
        print(f"heartbeat p50 on/off {h['on_over_off']:.2f} ({h['off'] * 1e6:.0f} -> {h['on'] * 1e6:.0f} us)")
    c = out["credential_cpu_us"]
    print(f"credential: sign {c['sign_us']:.1f} us, check {c['check_us']:.1f} us per call")
    f = out["flood"]
    for mode in ("stranger", "insider"):
        print(f"flood by a {mode}: the other job's heartbeat p50 x{f[mode]['over_alone']:.2f} "
              f"({f['alone_p50_s'] * 1e6:.0f} -> {f[mode]['victim_p50_s'] * 1e6:.0f} us; flood answers "
              f"{f[mode]['flood_codes']})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
