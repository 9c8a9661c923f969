"""Shared by the benchmark peers (runs under Python 3.11 and 3.12; stdlib + numpy only).

Every peer gets one JSON spec on argv: rank, n, sizes (bytes), iters, warmup,
rdv (a directory for rendezvous files), out (rank 0 writes its timings there),
plus system-specific keys. Rank 0 writes {"times": {bytes: [seconds, ...]}}.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time


def spec() -> dict:
    return json.loads(sys.argv[1])


def publish(rdv: str, name: str, value: str) -> None:
    d = pathlib.Path(rdv)
    tmp = d / f".{name}.tmp"
    tmp.write_text(value)
    os.rename(tmp, d / name)


def gather(rdv: str, names: list[str], timeout: float = 120.0, alive=None) -> list[str]:
    """The values published under ``names``, once all are there. ``alive``: a callable that says
    whether every peer that should publish still runs (a dead one ends the wait at once)."""
    d = pathlib.Path(rdv)
    deadline = time.time() + timeout
    while not all((d / n).exists() for n in names):
        if alive is not None and not alive():
            raise RuntimeError(f"a peer exited before the rendezvous completed (waiting for {names})")
        if time.time() > deadline:
            raise TimeoutError(f"rendezvous timed out waiting for {names}")
        time.sleep(0.01)
    return [(d / n).read_text() for n in names]


def timed(op, sizes, iters, warmup, make_buffer):
    """Runs op(buf) `warmup` + `iters` times per size; returns per-iteration seconds."""
    out = {}
    for nbytes in sizes:
        buf = make_buffer(nbytes)
        for _ in range(warmup):
            buf = op(buf)
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            buf = op(buf)
            ts.append(time.perf_counter() - t0)
        out[str(nbytes)] = ts
        del buf
    return out


def write(s: dict, times: dict, **extra) -> None:
    if s["rank"] == 0:
        pathlib.Path(s["out"]).write_text(json.dumps({"times": times, **extra}))
