"""What the lineage reports cost (rule 6 of fthsdp.control.quorum across a lighthouse restart).

    python experiments/lineage_cost.py [--quick] --out results/lineage_cost.json

Every quorum request carries the newest entries (at most 4) of the replica's own lineage,
so that a restarted lighthouse can rebuild the lineage fence. Measured, in one process:

* ``bytes``: a quorum request as LighthouseClient sends it (1 and 8 shards, quorum ids
  and steps of a long job), serialized with and without its lineage entries.
* ``lighthouse_s``: what the lighthouse spends on them per request, beside what it spends
  parsing the request at all (``FromString``, the baseline, in the same run): on a
  lighthouse that decided the job's first quorum itself (it never reads them: one
  comparison), on a restarted one hearing a report it already merged (its last quorum id compared),
  and on a restarted one hearing a new report (checked and merged). Each is the median of
  ``--blocks`` blocks of ``--calls`` calls, after a warm-up block, the arms interleaved
  block by block so that they see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time

from fthsdp.control import quorum as qm
from fthsdp.control.lighthouse import Lighthouse, _Job, _reads_lineage
from fthsdp.control.lighthouse_client import LIGHTHOUSE_PROTOCOL_VERSION
from fthsdp.proto import lighthouse_pb2 as pb2


def request(shards: int, lineage: list[int]) -> pb2.QuorumRequest:
    """A quorum request of replica 17 of a long job, as LighthouseClient fills it."""
    return pb2.QuorumRequest(
        protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="fthsdp", replica_id="17", step=182_345,
        ftar_addresses=[f"127.0.0.1:{40000 + i}" for i in range(shards)], state_server_address="127.0.0.1:39999",
        local_world_size=shards, num_replicas=512, last_quorum_id=1_203, rejoin=False, process_index=0,
        num_processes=1, fingerprint=0x1234_5678_9ABC_DEF0, fingerprint_step=182_345,
        incarnation="9f" * 16, accepts_members_omitted=True, lineage=lineage)


def lineage_values() -> list[int]:
    lin = qm.Lineage(limit=qm.LINEAGE_REPORTED)
    for qid, step in ((1_180, 170_002), (1_191, 175_410), (1_197, 179_977), (1_203, 182_301)):
        lin = lin.after(qid, step)
    return qm.lineage_report(lin)


def block(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer blocks and calls (a smoke run)")
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--out", default="results/lineage_cost.json")
    args = p.parse_args(argv)
    if args.quick:
        args.blocks, args.calls = 5, 2_000
    values = lineage_values()
    sizes = []
    for shards in (1, 8):
        with_ = len(request(shards, values).SerializeToString())
        without = len(request(shards, []).SerializeToString())
        sizes.append({"shards": shards, "bytes_with": with_, "bytes_without": without, "added": with_ - without,
                      "ratio": with_ / without})

    data = request(1, values).SerializeToString()
    req = pb2.QuorumRequest.FromString(data)
    never = _Job("fresh")
    never.lineage_from = 1  # decided the job's quorum 1 itself: it never reads the entries
    restarted = _Job("restarted")
    restarted.lineage_from = 1_204
    restarted.lineage_reports["17"] = req.last_quorum_id  # the same report, merged before
    fresh_lineage = qm.Lineage().after(1_204, 182_345)

    def parse():
        pb2.QuorumRequest.FromString(data)

    # The lighthouse's own test and merge, as accept_quorum_request writes them.
    def seen(job: _Job) -> None:
        if _reads_lineage(job, "17", req.last_quorum_id):
            job.lineage_reports["17"] = req.last_quorum_id
            if req.lineage and (job.lineage_from == 0 or req.lineage[0] < job.lineage_from):
                Lighthouse._merge_lineage(job, "17", req.lineage)

    def gate_never():
        seen(never)

    def gate_repeat():
        seen(restarted)

    def merge_new():
        job = _Job("merge")
        job.lineage, job.lineage_from = fresh_lineage, 1_204
        qm.parse_lineage_report(req.lineage)  # the check in front (_check_quorum_request)
        seen(job)

    arms = {"parse_request (baseline)": parse, "not_restarted": gate_never, "restarted_repeat": gate_repeat,
            "restarted_new_report": merge_new}
    for fn in arms.values():  # warm-up
        block(fn, max(100, args.calls // 10))
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(args.blocks):
        for name, fn in arms.items():
            times[name].append(block(fn, args.calls))
    base = statistics.median(times["parse_request (baseline)"])
    per_request = {name: {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts),
                          "ratio_to_parse": statistics.median(ts) / base} for name, ts in times.items()}
    out = {"what": "lineage reports in quorum requests: bytes and lighthouse cost per request",
           "command": "python experiments/lineage_cost.py" + (" --quick" if args.quick else ""),
           "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine()},
           "lineage_entries": len(values) // 2, "bytes": sizes, "blocks": args.blocks, "calls": args.calls,
           "lighthouse_s": per_request}
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    for s in sizes:
        print(f"{s['shards']} shard(s): {s['bytes_without']} -> {s['bytes_with']} bytes (+{s['added']}, x{s['ratio']:.2f})")
    for name, r in per_request.items():
        print(f"{name:>26}: {r['median_s'] * 1e9:8.0f} ns/request (x{r['ratio_to_parse']:.2f} of parsing it)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
