"""What the silent-data-corruption fingerprint costs per step (issue 16, item 4; target <= 1% of a step).

    python experiments/fingerprint_cost.py [--quick] [--groups N] [--block N] [--ring N] --out results/fingerprint_cost.json

The config is the one ``make run`` trains (``configs/ft_local.py``: the
``configs/base.py`` model and data, 2 devices per replica); its step timed as
the Manager runs it (``compute_grads``, ``apply_grads``, then the commit flag
read on the host: with the fingerprint, the flag and the fingerprint come in
one read, ``metrics["commit_words"]``). Two settings of the all-reduce:

* ``--ring 1`` (the default): one replica, the all-reduce replaced by the local
  identity, so that only computation is timed. FTAR's time would only make the
  fingerprint a smaller share of a real step: the ratio is an upper bound.
* ``--ring N``: the job's real step. N replica processes (this one, rank 0,
  and N-1 it starts) in one authenticated FTAR ring on loopback, each running
  the same schedule below, so every all-reduce pairs steps of the same
  variant; rank 0 times and reports. A step then holds what a step of
  ``make run`` holds (FTAR's copies, sums and socket work), though on a
  2-core machine N processes also share the cores, which lengthens the step.

Variants:

* ``off``: ``ft.fingerprint=false``, no fingerprint;
* ``in_step``: the default, the fingerprint after every commit, inside the
  jitted ``apply_grads``;
* ``every_k``: ``ft.fingerprint_every=K`` (``--every``, default 4): computed (under a
  ``lax.cond``) after every K-th step only.

**Pairing.** The machine this runs on is shared and its load moves, so the
variants are compared side by side: each *group* is ``--block`` rounds, each
round one step of every variant in turn, the order rotating from round to
round (off, in_step, every_k; in_step, every_k, off; every_k, off, in_step) so
that no variant ever runs twice in a row. That matters: a step right after its
own variant's step finds that variant's state in the caches, and an order that
gives one variant more such steps favours it by ~2% per step (the every-4th
variant measured +1.1% with off following itself half the time, and +0.6% with
all 6 permutations cycled, where off and in_step follow themselves once in 6
rounds and every_k never). Each group gives one ratio per variant, its steps'
CPU (or wall) time over off's. The overhead is the median of the groups' ratios
minus 1, with a distribution-free 95% confidence interval (order statistics of
Binomial(n, 1/2)); the verdict on the 1% target is "met" when the whole
interval is at or under 1%, "not met" when it is all above, else "undecided".
CPU time is this process's (every thread's): the work itself, the least
sensitive to other processes; wall time is what a replica waits.

**The update part (the verdict).** All of the fingerprint's work is inside
``apply_grads``; ``compute_grads`` is a separate jitted call, the same computation
in every variant. So each step is timed in two parts, the gradients (waited
for) and the update with the commit read, and the fingerprint's cost per group is
the update part's extra time over off's, divided by off's *whole* step
(``in_step_update_part_cpu``). This leaves out the gradients' noise, which is most
of a step's and which the fingerprint does not touch: at 200 groups the whole-step
ratio's 95% CI spanned 1.1 points of a step, the update part's 0.26. The gradient part's
own difference (``in_step_gradient_part_cpu``, the whole minus the update part) is
reported beside it: a knock-on effect on the next gradients (the caches) would show
there (-0.10% of a step in that run). ``target_met`` is the update part's CPU verdict;
``target_met_whole_step`` is the whole-step ratio's.

**The work alone.** ``LOOP`` fingerprints back to back inside one jitted call (a
``fori_loop``; each of a state whose step counter differs, so none can be
hoisted), once per group: CPU seconds per fingerprint over the group's off step
(``work_fraction_of_step_cpu``): the kernel, its dispatch and the psum, without the
host read or anything the step's schedule adds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments" / "peers"))
import common  # noqa: E402 - the peers' rendezvous (publish, gather)
LOOP = 50  # fingerprints back to back in one jitted call (the work without dispatch)
TARGET = 0.01
sys.path.insert(0, str(REPO))



class StepTimes(NamedTuple):
    """One timed step: the whole (wall, CPU) and its update part (from the gradients being
    ready to the commit read), where all of the fingerprint's work is."""

    wall: float
    cpu: float
    update_wall: float
    update_cpu: float


def timed_step(ts, state, batch, quorum) -> tuple[object, StepTimes]:
    """One committed step as the Manager runs it (gradients, update, the commit read):
    (new state, its times). Shared with experiments/fingerprint_parts.py so that both time
    exactly the same thing.

    The gradients are waited for before the update is dispatched, so that the update's
    part can be timed on its own (every variant alike: the Manager would dispatch the
    update while they compute, which saves only the dispatch's few tens of microseconds)."""
    import jax

    from fthsdp.step import fingerprint as fpm  # lazily, as main() does (jax starts with it)

    x, y = batch
    t0, c0 = time.perf_counter(), time.process_time()
    grads, _ = ts.compute_grads(state, x, y)
    jax.block_until_ready(grads)
    t1, c1 = time.perf_counter(), time.process_time()
    state, m = ts.apply_grads(state, grads, quorum)
    committed = fpm.read_commit(m["commit_words"])[0] if "commit_words" in m else bool(m["committed"])
    t2, c2 = time.perf_counter(), time.process_time()
    assert committed, "the timed step did not commit"
    return state, StepTimes(t2 - t0, c2 - c0, t2 - t1, c2 - c1)


def median_ci(xs: list[float], bound: float) -> dict:
    """Median of ``xs`` with a distribution-free 95% confidence interval (order statistics of
    Binomial(n, 1/2)), and the verdict on ``median <= bound``."""
    xs = sorted(xs)
    n = len(xs)
    if n == 0:
        return {"n": 0}
    k = max(0, int((n - 1.96 * math.sqrt(n)) / 2) - 1)
    lo, hi = xs[k], xs[n - 1 - k]
    return {"n": n, "median": statistics.median(xs), "ci95": [lo, hi],
            "verdict": "met" if hi <= bound else ("not met" if lo > bound else "undecided")}


def cpu_isa() -> str:
    """The widest vector ISA the native kernel picks on this CPU (ffi/fingerprint.cc)."""
    try:
        flags = next(line for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.machine()
    return "avx512f" if "avx512f" in flags else ("avx2" if "avx2" in flags else "baseline")


RING_JOB = "fingerprint-cost"
RING_QUORUM = 1
RING_WAIT_S = 300.0  # for the peers to start (jax import, compilation) and publish their addresses
# FTAR's deadline per all-reduce here: the ranks compile each variant at its first step, each
# at its own pace, so a first all-reduce may wait a compilation long for its partner (the job's
# 10 s default is for steady steps; in steady steps here no call comes near either).
RING_ALLREDUCE_TIMEOUT_S = 300.0


def start_peers(ring: int, ring_dir: pathlib.Path, argv: list[str]) -> list[subprocess.Popen]:
    """Ranks 1..ring-1 of the FTAR ring: this script again, with the same arguments (so the
    same schedule), its own rank, and the shared folder for addresses and the secret."""
    (ring_dir / "secret").write_text(secrets.token_hex(32))
    peers = []
    for rank in range(1, ring):
        log = open(ring_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv, "--ring-rank", str(rank),
               "--ring-dir", str(ring_dir), "--out", str(ring_dir / f"rank{rank}.json")]
        peers.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return peers


def join_ring(ring: int, rank: int, ring_dir: pathlib.Path, cfg, devices: int, peers: list[subprocess.Popen]):
    """This process's Communicator, connected to the ring's other ranks (addresses exchanged
    through files in ``ring_dir``), and the quorum inputs every step passes. ``peers``: the
    processes rank 0 started (a peer that dies before publishing its address ends the wait)."""
    from fthsdp.collective import ftar
    from fthsdp.step.quorum_inputs import make_quorum_inputs

    key = ftar.key_from_secret((ring_dir / "secret").read_text())
    comm = ftar.Communicator(num_shards=devices, streams=cfg.ft.streams_per_peer,
                             timeout_s=RING_ALLREDUCE_TIMEOUT_S, key=key)
    common.publish(str(ring_dir), f"addr{rank}", comm.address)
    members = common.gather(str(ring_dir), [f"addr{k}" for k in range(ring)], timeout=RING_WAIT_S,
                            alive=lambda: all(proc.poll() is None for proc in peers))
    res = comm.configure(RING_JOB, RING_QUORUM, rank, members, timeout_s=60.0)
    if not res:
        raise SystemExit(f"ring rank {rank}: the FTAR ring did not connect: {res.reason}")
    quorum = make_quorum_inputs(contribute=True, num_contributing=ring, num_members=ring, num_configured=ring,
                                lr_mode=0, rank=rank, quorum_id=RING_QUORUM, comm=comm.handle)
    return comm, quorum


def peer_failure(peers: list[subprocess.Popen], ring_dir: pathlib.Path) -> str:
    """What the ring's other ranks said, for an error message (the end of each failed log)."""
    out = []
    for rank, proc in enumerate(peers, start=1):
        if proc.poll() not in (None, 0):
            tail = (ring_dir / f"rank{rank}.log").read_text(errors="replace")[-2000:]
            out.append(f"rank {rank} exited with {proc.returncode}:\n{tail}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="ft_local", help="config (default: ft_local, what `make run` trains)")
    p.add_argument("--groups", type=int, default=100, help="groups (one ratio per variant each)")
    p.add_argument("--block", type=int, default=12,
                   help="steps per variant per group (a multiple of --every: every group of every_k then "
                        "holds the same number of fingerprints)")
    p.add_argument("--quick", action="store_true", help="3 groups of 4 steps (CI: the schema, not the figure)")
    p.add_argument("--every", type=int, default=4, help="K of the every_k variant (ft.fingerprint_every)")
    p.add_argument("--ring", type=int, default=1,
                   help="replicas in a real FTAR ring, one process each (1: the local identity all-reduce, "
                        "computation only)")
    p.add_argument("--ring-rank", type=int, default=0, help=argparse.SUPPRESS)  # set on the peers it starts
    p.add_argument("--ring-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="results/fingerprint_cost.json")
    p.add_argument("overrides", nargs="*")
    raw_argv = list(argv if argv is not None else sys.argv[1:])
    args = p.parse_args(raw_argv)
    if args.quick:
        args.groups, args.block = 3, 4
    if args.groups < 1 or args.block < 1 or args.every < 2:
        p.error("--groups and --block must be >= 1 and --every >= 2")
    if not 1 <= args.ring <= 8:
        p.error(f"--ring must be in [1, 8] (replica processes on this machine), got {args.ring}")
    if args.ring_rank and not args.ring_dir:
        p.error("--ring-rank is set by rank 0 on the processes it starts, with --ring-dir")
    with contextlib.ExitStack() as stack:
        ring_dir = pathlib.Path(args.ring_dir) if args.ring_dir else None
        peers: list[subprocess.Popen] = []
        if args.ring > 1 and ring_dir is None:  # rank 0: a folder for the ring, and its peers
            ring_dir = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fingerprint_cost-")))
            peers = start_peers(args.ring, ring_dir, raw_argv)
            stack.callback(stop_peers, peers)
        try:
            return run(args, raw_argv, ring_dir, peers)
        except BaseException:
            if peers:
                why = peer_failure(peers, ring_dir)
                if why:
                    print(f"the ring's other ranks failed:\n{why}", file=sys.stderr)
                for proc in peers:  # they cannot finish without this rank
                    proc.kill()
            raise


def stop_peers(peers: list[subprocess.Popen]) -> None:
    """Wait for the peers to finish their schedule (they end with rank 0), then stop stragglers."""
    for proc in peers:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace, raw_argv: list[str], ring_dir: pathlib.Path | None,
        peers: list[subprocess.Popen]) -> int:
    """The measurement, on every rank of the ring (rank 0 reports)."""
    load_start = list(os.getloadavg())  # the shared machine's 1/5/15-minute load before the run

    from fthsdp import config as config_lib
    from fthsdp.devices import enable_compilation_cache, force_host_devices

    cfg = config_lib.load(args.config, args.overrides)
    devices = cfg.launch.devices_per_replica
    force_host_devices(devices)
    enable_compilation_cache()  # a rerun (and the ring's other ranks) load the programs, not compile them
    import jax

    from fthsdp.data import ReplicaStream
    from fthsdp.observe.metrics import pytree_bytes
    from fthsdp.step import fingerprint as fpm
    from fthsdp.step.functional import make_train_step
    from fthsdp.step.quorum_inputs import local_allreduce, make_quorum_inputs
    from fthsdp.step.sharding import replica_mesh

    mesh = replica_mesh(devices)
    every_cfg = config_lib.override(cfg, [f"ft.fingerprint_every={args.every}"]).validate()
    if args.ring > 1:
        from fthsdp.collective import ftar

        comm, quorum = join_ring(args.ring, args.ring_rank, ring_dir, cfg, devices, peers)
        allreduce = ftar.allreduce
    else:
        comm, allreduce = None, local_allreduce
        quorum = make_quorum_inputs(contribute=True, num_contributing=1, num_members=1, num_configured=1, lr_mode=0)
    steps = {"off": make_train_step(cfg, mesh, allreduce=allreduce, fingerprint=False),
             "in_step": make_train_step(cfg, mesh, allreduce=allreduce, fingerprint=True),
             "every_k": make_train_step(every_cfg, mesh, allreduce=allreduce, fingerprint=True)}
    variants = tuple(steps)
    shardings = steps["off"].state_shardings

    @jax.jit
    def loop(state):
        def body(i, acc):
            return acc + fpm.fingerprint(state._replace(step=state.step + i), shardings)
        return jax.lax.fori_loop(0, LOOP, body, jax.numpy.zeros((2,), jax.numpy.uint32))

    stream = ReplicaStream(cfg.data, args.ring_rank)
    states = {v: steps[v].init(cfg.train.seed) for v in variants}
    batches = [steps["off"].shard_batch(b.inputs, b.targets) for b in (stream.batch(i) for i in range(8))]

    def one(variant: str, i: int) -> StepTimes:
        """One step as the Manager runs it."""
        states[variant], times = timed_step(steps[variant], states[variant], batches[i % len(batches)], quorum)
        return times

    def fp_loop() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        fpm.to_int(loop(states["off"]))
        return (time.perf_counter() - t0) / LOOP, (time.process_time() - c0) / LOOP

    for v in variants:  # warm up: compile, then a few steps of each
        for i in range(3 + args.every):
            one(v, i)
    fp_loop()
    fp_loop()
    ratios: dict[str, dict[str, list[float]]] = {v: {"cpu": [], "wall": []} for v in variants if v != "off"}
    work: dict[str, list[float]] = {"cpu": [], "wall": []}
    # The update part's extra time over off's, per group, as a share of off's whole step
    # (the fingerprint's only work is there: "The update part" in the module docstring).
    update_share: dict[str, dict[str, list[float]]] = {v: {"cpu": [], "wall": []} for v in ratios}
    gradient_share: dict[str, dict[str, list[float]]] = {v: {"cpu": [], "wall": []} for v in ratios}
    step_cpu: list[float] = []
    step_wall: list[float] = []
    # Rotations, cycled: no variant ever runs twice in a row, within or across rounds (a
    # step right after its own variant's step finds its state in the caches; with all 6
    # permutations cycled, off and in_step did so once every 6 rounds and every_k never).
    orders = [variants[k:] + variants[:k] for k in range(len(variants))]
    t_start = time.perf_counter()
    n = 0
    for g in range(args.groups):
        got: dict[str, list[StepTimes]] = {v: [] for v in variants}
        for i in range(args.block):
            for v in orders[n % len(orders)]:
                got[v].append(one(v, i))
            n += 1
        tot = {v: {"wall": sum(t.wall for t in got[v]), "cpu": sum(t.cpu for t in got[v]),
                   "update_wall": sum(t.update_wall for t in got[v]), "update_cpu": sum(t.update_cpu for t in got[v])}
               for v in variants}
        off_w, off_c = tot["off"]["wall"], tot["off"]["cpu"]
        for v in ratios:
            for clock, whole in (("wall", off_w), ("cpu", off_c)):
                ratios[v][clock].append(tot[v][clock] / whole)
                extra_update = tot[v][f"update_{clock}"] - tot["off"][f"update_{clock}"]
                update_share[v][clock].append(extra_update / whole)
                gradient_share[v][clock].append((tot[v][clock] - tot["off"][clock] - extra_update) / whole)
        per_step_w, per_step_c = off_w / args.block, off_c / args.block
        step_wall.append(per_step_w)
        step_cpu.append(per_step_c)
        lw, lc = fp_loop()
        work["wall"].append(lw / per_step_w)
        work["cpu"].append(lc / per_step_c)
        if (g + 1) % max(1, args.groups // 10) == 0 or g + 1 == args.groups:
            print(f"group {g + 1}/{args.groups}: step {per_step_c * 1e3:.2f} ms CPU; in_step "
                  f"{(ratios['in_step']['cpu'][-1] - 1) * 100:+.2f}% CPU, every_{args.every} "
                  f"{(ratios['every_k']['cpu'][-1] - 1) * 100:+.2f}%; the update part in_step "
                  f"{update_share['in_step']['cpu'][-1] * 100:+.2f}%; the work alone {work['cpu'][-1] * 100:.2f}%",
                  flush=True)

    def overhead(xs: list[float]) -> dict:
        return median_ci([x - 1.0 for x in xs], TARGET)

    state_bytes = pytree_bytes(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), states["off"]))
    result = {
        "command": " ".join(["python", "experiments/fingerprint_cost.py", *raw_argv]),
        "config": args.config, "overrides": args.overrides, "devices_per_replica": devices,
        "state_bytes": state_bytes, "params_bytes": pytree_bytes(states["off"].params),
        "groups": args.groups, "block": args.block, "every": args.every,
        "design": "groups of `block` rounds, each round one step of every variant in turn, the order rotating "
                  "so that no variant runs twice in a row; one ratio per variant and group (its steps' time "
                  "over off's); median over groups with a distribution-free 95% CI",
        "target": f"fingerprint <= {TARGET:.0%} of a step, per commit (ft.fingerprint_every=1, the default)",
        "median_step_s": {"cpu": statistics.median(step_cpu), "wall": statistics.median(step_wall)},
        "in_step_overhead_cpu": overhead(ratios["in_step"]["cpu"]),
        "in_step_overhead_wall": overhead(ratios["in_step"]["wall"]),
        "every_k_overhead_cpu": overhead(ratios["every_k"]["cpu"]),
        "every_k_overhead_wall": overhead(ratios["every_k"]["wall"]),
        "in_step_update_part_cpu": median_ci(update_share["in_step"]["cpu"], TARGET),
        "in_step_update_part_wall": median_ci(update_share["in_step"]["wall"], TARGET),
        "in_step_gradient_part_cpu": median_ci(gradient_share["in_step"]["cpu"], TARGET),
        "every_k_update_part_cpu": median_ci(update_share["every_k"]["cpu"], TARGET),
        "loop": LOOP,
        "work_fraction_of_step_cpu": median_ci(work["cpu"], TARGET),
        "work_fraction_of_step_wall": median_ci(work["wall"], TARGET),
        "ratios": ratios, "work_fractions": work, "update_part_shares": update_share,
        "gradient_part_shares": gradient_share,
        "seconds": time.perf_counter() - t_start,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, kernel ISA {cpu_isa()}; shared, so compare "
                   "the paired ratios, not absolute times",
        "ring": args.ring,
        "allreduce": (f"FTAR, an authenticated ring of {args.ring} replica processes on loopback (the job's real "
                      "step; the processes share this machine's cores)" if args.ring > 1 else
                      "local identity (computation only: an upper bound on the fingerprint's share of a real step)"),
        "kernel": "native CPU kernel per device (ffi/fingerprint.cc) inside shard_map, one psum; the commit flag "
                  "and the fingerprint read with one transfer",
    }
    ov = result["in_step_overhead_cpu"]
    up = result["in_step_update_part_cpu"]
    result["target_met"] = up["verdict"]  # "met" / "not met" / "undecided" (the CI straddles 1%)
    result["target_met_whole_step"] = ov["verdict"]
    result["k_for_target"] = max(1, math.ceil(up["median"] / TARGET - 1e-9))
    result["load_average_start"] = load_start
    result["load_average_end"] = list(os.getloadavg())
    if comm is not None:
        comm.close()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    def fmt(d: dict) -> str:
        return f"{d['median'] * 100:+.2f}% (95% CI {d['ci95'][0] * 100:+.2f}..{d['ci95'][1] * 100:+.2f}%)"

    print(f"state {state_bytes / 1e6:.2f} MB; step {result['median_step_s']['cpu'] * 1e3:.2f} ms CPU; per commit, "
          f"the update part: CPU {fmt(up)}, wall {fmt(result['in_step_update_part_wall'])}: target {up['verdict']}; "
          f"the whole step: CPU {fmt(ov)} (target {ov['verdict']}), wall {fmt(result['in_step_overhead_wall'])}; "
          f"the gradient part: CPU {fmt(result['in_step_gradient_part_cpu'])}; every "
          f"{args.every}th commit: CPU {fmt(result['every_k_overhead_cpu'])}; the work alone "
          f"{result['work_fraction_of_step_cpu']['median'] * 100:.2f}% of a step's CPU -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
