"""EMULATION INSTRUMENTATION — the real lighthouse, with timestamps around its stages.

``python -m fthsdp.sim.lighthouse_trace --trace-out FILE <lighthouse arguments>``
runs exactly ``python -m fthsdp.control.lighthouse <lighthouse arguments>`` (the
real server, the real decision; nothing is replaced) and records, for every
quorum request, when its checks ran, when its handler started and returned,
every evaluation (how long it took and whether it decided), every reply built,
and the process's CPU time and heartbeat count at each of those points. It
writes them to FILE as JSON when the lighthouse exits (SIGTERM: its normal
stop).

Why a wrapper: :mod:`fthsdp.sim.emulation` runs the lighthouse in its own
process, and ``experiments/scale.py`` splits a round's latency into the
lighthouse's stages and the emulator's. ``time.perf_counter`` is
CLOCK_MONOTONIC on Linux, one clock for every process of the machine, so
these timestamps line up with the emulator's own. Only the emulation uses
this module; the lighthouse itself carries no tracing.
"""

from __future__ import annotations

import json
import sys
import time

from fthsdp.control import guard, session
from fthsdp.control import lighthouse as lh

__all__ = ["install", "main"]


class Trace:
    """Timestamped events: tuples of (kind, perf_counter, ...), kept in memory until exit.

    Tuples, not lists: a tuple of strings and numbers leaves the collector's lists at its
    first young collection, while a list stays tracked for every later full collection to
    walk (a run holds hundreds of thousands of events). The tracing still costs the round:
    at 512 x 196 on a 2-core host a traced lighthouse's round was ~8-12 ms slower at p50
    than an untraced one's in the same hour (experiments/scale.py with and without
    ``--no-breakdown``), with lists or tuples alike; the breakdown's parts are read as
    shares of a traced round."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.heartbeats = 0

    def mark(self, kind: str, *rest, cpu: bool = False) -> None:
        """One event; ``cpu``: with the process's CPU time (a clock read that sums every thread's
        time in the kernel, several times dearer than the monotonic clock: the marks of every
        session write go without it), else None in its place."""
        self.events.append((kind, time.perf_counter(), time.process_time() if cpu else None, self.heartbeats, *rest))

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"fields": ["kind", "perf_counter", "process_time", "heartbeats", "..."],
                       "events": self.events}, f)


def install(trace: Trace) -> None:
    """Wrap the lighthouse's stages (in this process) so that they record into ``trace``."""
    checks = guard.request_problem

    # Every wrapper passes its arguments on as given: the wrapped signatures may grow.
    def request_problem(method, req, *args, **kwargs):
        if method != "GetQuorum":
            return checks(method, req, *args, **kwargs)
        trace.mark("checks_start", req.replica_id, req.step)
        try:
            return checks(method, req, *args, **kwargs)
        finally:
            trace.mark("checks_end", req.replica_id, req.step)

    guard.request_problem = request_problem  # generic_handler looks it up at call time

    # The transport-free cores, which a unary call and a session message both reach.
    accept = lh.Lighthouse.accept_quorum_request

    def accept_quorum_request(self, request, *args, **kwargs):
        trace.mark("handler_enter", request.replica_id, request.step)
        try:
            return accept(self, request, *args, **kwargs)
        finally:
            trace.mark("handler_return", request.replica_id, request.step)

    lh.Lighthouse.accept_quorum_request = accept_quorum_request

    heartbeat = lh.Lighthouse.accept_heartbeat

    def accept_heartbeat(self, request, *args, **kwargs):
        trace.heartbeats += 1
        return heartbeat(self, request, *args, **kwargs)

    lh.Lighthouse.accept_heartbeat = accept_heartbeat

    # Every session write, when it completed (the fan-out's lighthouse side: the breakdown tells
    # the lighthouse's writes from the emulator's receive by the last one of a round).
    write = session.Stream.write

    async def marked_write(self, raw):
        await write(self, raw)
        trace.mark("written")

    session.Stream.write = marked_write

    evaluate = lh.Lighthouse._evaluate

    def _evaluate(self, job):
        before = job.quorum
        waiting = len(job.pending)
        t0 = time.perf_counter()
        evaluate(self, job)
        q = job.quorum
        decided = waiting - len(job.pending)
        trace.mark("evaluate", time.perf_counter() - t0, waiting, decided,
                   q.quorum_id if q is not None else 0, q.max_step if q is not None else -1, q is not before)

    lh.Lighthouse._evaluate = _evaluate

    view_reply = lh._Job.view_reply

    def _view_reply(self, q, rid, process, *args, **kwargs):
        t0 = time.perf_counter()
        raw = view_reply(self, q, rid, process, *args, **kwargs)
        trace.mark("reply", time.perf_counter() - t0, rid, process, q.max_step, len(raw), cpu=True)
        return raw

    lh._Job.view_reply = _view_reply


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--trace-out":
        print("usage: python -m fthsdp.sim.lighthouse_trace --trace-out FILE <lighthouse arguments>", file=sys.stderr)
        return 2
    path, rest = argv[1], argv[2:]
    trace = Trace()
    install(trace)
    try:
        return lh.cli(rest)
    finally:
        trace.dump(path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
