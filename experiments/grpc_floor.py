"""The transport's floor: a bare grpc.aio round of N streams, the least any Python lighthouse can do.

    python experiments/grpc_floor.py --streams 512 --out results/grpc_floor.json
    (experiments/scale.py measures it beside each hierarchical shape in the same run)

**Why.** experiments/scale.py's 512 x 196 row is a round of 512 replica leaders, each on
its own gRPC stream to the lighthouse: every leader writes one request, the lighthouse
answers all of them once the last is in, and the round ends when every leader holds its
answer. Whatever the lighthouse does, the two Python processes still pay gRPC's cost per
message: 512 reads and 512 writes in the lighthouse, as many in the emulator. This
measures that cost alone, with the same definition of latency (from the last request
written to every stream holding its answer) and the same sizes on the wire, so a row
of scale.py can be read against it: its ratio to the floor is the lighthouse's own
work; a target below the floor cannot be met by any lighthouse on this transport and
this machine.

The server here does nothing but count: one task reads each stream, and when N
requests are in it hands the same reply bytes to every stream's writer task (the
lighthouse's session writer has the same shape: one writer per stream). The server is
its own process, under the lighthouse's collector policy (fthsdp.gc_policy); the
clients share this process, one channel and TCP connection each, as the emulated leaders
do. No checks, no credentials, no decision, no heartbeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import grpc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fthsdp.gc_policy import low_pause_gc  # noqa: E402

SERVICE = "fthsdp.experiments.Floor"
METHOD = f"/{SERVICE}/Round"
READY = "floor server ready on port"  # then the port it bound


async def serve(streams: int, reply_bytes: int) -> None:
    """Answer every ``streams`` requests (from any streams) with one ``reply_bytes`` reply each, on a
    loopback port of the system's choosing (printed after READY)."""
    answer = b"a" * reply_bytes
    waiting: list[asyncio.Queue] = []

    async def round_(request_iterator, context) -> None:
        outbox: asyncio.Queue = asyncio.Queue()

        async def writer() -> None:
            while (raw := await outbox.get()) is not None:
                await context.write(raw)

        w = asyncio.get_running_loop().create_task(writer())
        try:
            while await context.read() is not grpc.aio.EOF:
                waiting.append(outbox)
                if len(waiting) >= streams:
                    for q in waiting:
                        q.put_nowait(answer)
                    waiting.clear()
        finally:
            outbox.put_nowait(None)
            try:
                await asyncio.wait_for(w, 1.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001 - it is gone
                w.cancel()

    handler = grpc.stream_stream_rpc_method_handler(round_, request_deserializer=None, response_serializer=None)
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1 << 20),
                                      ("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"Round": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"{READY} {port}", flush=True)
    await server.wait_for_termination()


async def _rounds(port: int, streams: int, rounds: int, warmup: int, request_bytes: int, reply_bytes: int,
                  timeout_s: float, warm=lambda: None) -> list[float]:
    """The measured rounds' latencies; ``warm()`` is called once the warm-up rounds are done."""
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1),
                                                                    ("grpc.max_receive_message_length", 64 << 20)])
             for _ in range(streams)]
    try:
        calls = [c.stream_stream(METHOD, request_serializer=None, response_deserializer=None)() for c in chans]
        request = b"r" * request_bytes
        lat: list[float] = []
        for r in range(warmup + rounds):
            if r == warmup:
                warm()
            got = [0.0] * streams
            sent = [0.0] * streams

            async def one(i: int) -> None:
                await calls[i].write(request)
                sent[i] = time.perf_counter()
                raw = await calls[i].read()
                if raw is grpc.aio.EOF or len(raw) != reply_bytes:
                    raise RuntimeError(f"stream {i} got {'no answer' if raw is grpc.aio.EOF else f'{len(raw)} bytes'} "
                                       f"in round {r}, not {reply_bytes}")
                got[i] = time.perf_counter()

            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(streams))), timeout_s)
            if r >= warmup:
                lat.append(max(got) - max(sent))
            await asyncio.sleep(0.05)  # the rounds of scale.py are apart too (the ranks' work)
        for c in calls:
            await c.done_writing()
        return lat
    finally:
        for c in chans:
            await c.close()


def process_cpu_s(pid: int) -> float | None:
    """CPU time (user + system) of process ``pid`` so far, from /proc (None where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def floor_row(streams: int, rounds: int, request_bytes: int, reply_bytes: int) -> dict:
    """:func:`measure` in a process of its own (this script's command), so that the caller's
    process never holds the floor's channels: grpc.aio's poller outlives an event loop run
    with ``asyncio.run`` and complains when the next one starts (scale.py runs several)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fthsdp-grpc-floor-") as d:
        out = Path(d) / "floor.json"
        p = subprocess.run([sys.executable, __file__, "--streams", str(streams), "--rounds", str(rounds),
                            "--request-bytes", str(request_bytes), "--reply-bytes", str(reply_bytes),
                            "--out", str(out)], capture_output=True, text=True)
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"the floor measurement failed (exit {p.returncode}): {p.stderr[-2000:]}")
        return json.loads(out.read_text())["rows"][0]


def measure(streams: int, rounds: int, request_bytes: int, reply_bytes: int, warmup: int = 2,
            timeout_s: float = 120.0) -> dict:
    """One row in scale.py's schema (``system`` ``grpc-floor``): the bare round of ``streams``
    streams, the server in its own process and the clients in this one. A round that does not
    finish within ``timeout_s`` ends the row (``error`` says why, no round counted)."""
    if streams < 1 or rounds < 1 or request_bytes < 0 or reply_bytes < 0:
        raise ValueError(f"streams ({streams}) and rounds ({rounds}) must be >= 1 and the sizes >= 0")
    load = os.getloadavg()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", "--streams", str(streams),
                             "--reply-bytes", str(reply_bytes)], stdout=subprocess.PIPE, text=True)
    error = None
    try:
        line = proc.stdout.readline().strip()
        head, _, port = line.rpartition(" ")
        if head != READY or not port.isdigit():
            raise RuntimeError(f"the floor server did not start (it printed {line!r}, exit {proc.poll()})")
        cpu0 = None

        def warm() -> None:
            nonlocal cpu0
            cpu0 = process_cpu_s(proc.pid)

        try:
            lat = asyncio.run(_rounds(int(port), streams, rounds, warmup, request_bytes, reply_bytes, timeout_s,
                                      warm))
        except (asyncio.TimeoutError, RuntimeError, grpc.aio.AioRpcError) as e:
            lat, error = [], f"{type(e).__name__}: {e}"
        cpu1 = process_cpu_s(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    return {
        "system": "grpc-floor", "transport": "session", "replicas": streams, "ranks": streams,
        "processes_per_replica": 1, "request_bytes": request_bytes, "reply_bytes": reply_bytes,
        "p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99), "max_s": max(lat) if lat else None,
        "complete_rounds": len(lat), "rounds": rounds, "warmup_rounds": warmup,
        "round_latencies_s": [round(x, 6) for x in lat], "loadavg": load,
        # the server's CPU per measured round (each round is 50 ms apart: its idle loop is in it too)
        "server_cpu_s_per_round": (cpu1 - cpu0) / rounds if cpu0 is not None and cpu1 is not None and lat else None,
        **({"error": error} if error else {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    ap.add_argument("--streams", type=int, default=512, help="streams (replica leaders) per round (default 512)")
    ap.add_argument("--rounds", type=int, default=20, help="measured rounds (default 20)")
    ap.add_argument("--request-bytes", type=int, default=200, help="bytes of each request (default 200)")
    ap.add_argument("--reply-bytes", type=int, default=200, help="bytes of each answer (default 200)")
    ap.add_argument("--out", help="JSON file to write")
    args = ap.parse_args(argv)
    if args.streams < 1 or args.rounds < 1 or args.request_bytes < 0 or args.reply_bytes < 0:
        ap.error("--streams and --rounds must be >= 1, the byte counts >= 0")
    if args.serve:
        with low_pause_gc():
            asyncio.run(serve(args.streams, args.reply_bytes))
        return 0
    if not args.out:
        ap.error("--out is required")
    row = measure(args.streams, args.rounds, args.request_bytes, args.reply_bytes)
    out = {"experiment": "grpc_floor", "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                "grpc": grpc.__version__}, "rows": [row]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    p50 = "-" if row["p50_s"] is None else f"{row['p50_s'] * 1e3:.1f} ms"
    p99 = "-" if row["p99_s"] is None else f"{row['p99_s'] * 1e3:.1f} ms"
    cpu = row["server_cpu_s_per_round"]
    print(f"grpc-floor {row['replicas']} streams: p50 {p50} p99 {p99} ({row['complete_rounds']}/{row['rounds']} "
          f"rounds{'' if cpu is None else f'; server CPU {cpu * 1e3:.1f} ms a round'})"
          f"{' ' + row['error'] if 'error' in row else ''}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
