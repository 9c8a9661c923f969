"""Where the fingerprint's in-step cost goes (issue 16, item 4): the kernel, the psum, the sync point.

    python experiments/fingerprint_parts.py [--quick] [--groups N] [--block N] --out results/fingerprint_parts.json

``experiments/fingerprint_cost.py`` measures the fingerprint inside ``apply_grads``
at about twice the CPU of its work timed alone. This splits the in-step cost
with diagnostic variants of the same train step (``configs/ft_local.py``, 2
devices, the all-reduce replaced by the local identity), each the default step
with one part of the fingerprint taken out. The diagnostic variants compute a
*wrong* value on purpose: they exist only here, to be timed.

* ``off``: no fingerprint;
* ``in_step``: the default (the native kernel on every device's blocks, then one
  ``psum`` of the devices' two words, read with the commit flag);
* ``no_psum``: the kernel on every device, no ``psum``: each device's own two
  words, declared replicated so that the host reads device 0's, as in
  ``in_step`` (the kernel without the devices meeting);
* ``psum_only``: no kernel: each device adds the first word of each of its
  blocks (so it waits for the whole update) and the two devices meet in the
  same ``psum`` (the meeting without the kernel);
* ``reference``: no native kernel: :func:`fthsdp.step.fingerprint.reference`
  (jax ops, one reduction per leaf and lane, which XLA partitions and may fuse
  with the update) -- the same value as ``in_step``, checked below.

Pairing and statistics as in ``fingerprint_cost.py``: groups of ``--block``
rounds, each round one step of every variant, the order rotating so that no
variant runs twice in a row; per group and variant its CPU (and wall) time over
``off``'s; median over groups with a distribution-free 95% CI. Each step's
update part is also timed on its own (the gradients waited for), and
``update_part_cpu`` gives each variant's extra update-part CPU over ``off``'s,
as a share of ``off``'s whole step: the same question without the gradients'
noise (the fingerprint touches only the update part).

**Hot or cold.** The work alone (``fingerprint_cost.py``'s loop) reads one
state again and again, from the caches; in the step it reads a state the
update has just written while it streamed ~4x as many bytes. So: ``COPIES``
fingerprints in one jitted call, of ``COPIES`` distinct copies of the state
(their bytes far over the L3 cache: each read from memory) against the same
state passed ``COPIES`` times (the same buffers: cached after the first), paired
and alternating, ``--groups`` times: CPU per fingerprint over a step's. Both
arms carry the same dispatch (``COPIES`` states' buffers as arguments, which
makes each arm's own figure larger than the loop's), so only their difference,
``cold_minus_hot_cpu``, is the price of reading the state from memory.

**The meeting alone.** Besides, ``--calls`` back-to-back calls of a jitted
2-device ``psum`` of two words with nothing else in it: its CPU and wall time
per call. CPU well above wall there means the devices' threads burn CPU while
they wait for each other, which the in-step CPU figure counts as the
fingerprint's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

COPIES = 8  # distinct states in the cold arm: 8 x 5.6 MB, over the 32 MB L3 this was written on
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

from fingerprint_cost import TARGET, cpu_isa, median_ci, timed_step  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="ft_local")
    p.add_argument("--groups", type=int, default=60)
    p.add_argument("--block", type=int, default=12)
    p.add_argument("--calls", type=int, default=2000, help="back-to-back calls of the bare psum")
    p.add_argument("--quick", action="store_true", help="3 groups of 4 steps, 100 calls (the schema only)")
    p.add_argument("--out", default="results/fingerprint_parts.json")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.block, args.calls = 3, 4, 100
    if args.groups < 1 or args.block < 1 or args.calls < 1:
        p.error("--groups, --block and --calls must be >= 1")
    load_start = list(os.getloadavg())

    from fthsdp import config as config_lib
    from fthsdp.devices import enable_compilation_cache, force_host_devices

    cfg = config_lib.load(args.config, [])
    devices = cfg.launch.devices_per_replica
    force_host_devices(devices)
    enable_compilation_cache()  # a rerun (and the ring's other ranks) load the programs, not compile them
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    from fthsdp.data import ReplicaStream
    from fthsdp.step import fingerprint as fpm
    from fthsdp.step import functional
    from fthsdp.step.quorum_inputs import local_allreduce, make_quorum_inputs
    from fthsdp.step.sharding import replica_mesh

    mesh = replica_mesh(devices)
    names = tuple(mesh.axis_names)
    real_fp = functional.state_fingerprint

    def psum_only(tree, shardings):
        """Each device: the first word of each of its blocks, summed; then the same psum."""
        leaves = jax.tree.leaves(tree)
        specs = tuple(sh.spec for sh in jax.tree.leaves(shardings))

        def body(*blocks):
            acc = jnp.zeros((2,), jnp.uint32)
            for b in blocks:
                acc = acc + fpm._words(b).reshape(-1)[:1].astype(jnp.uint32)
            return jax.lax.psum(acc, names)

        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=PartitionSpec(), check_vma=False)(*leaves)

    def no_psum(tree, shardings):
        """The real kernel with its psum replaced by the identity (each device keeps its words)."""
        real_psum = jax.lax.psum
        jax.lax.psum = lambda x, axes: x  # only while this traces; restored below
        try:
            return real_fp(tree, shardings)
        finally:
            jax.lax.psum = real_psum

    fps = {"off": None, "in_step": real_fp, "no_psum": no_psum, "psum_only": psum_only,
           "reference": lambda tree, shardings: fpm.reference(tree)}
    variants = tuple(fps)
    stream = ReplicaStream(cfg.data, 0)
    quorum = make_quorum_inputs(contribute=True, num_contributing=1, num_members=1, num_configured=1, lr_mode=0)
    steps, states = {}, {}
    batches = None

    def one(variant: str, i: int):
        states[variant], times = timed_step(steps[variant], states[variant], batches[i % len(batches)], quorum)
        return times

    for v in variants:  # each variant traced with its own fingerprint function in place
        functional.state_fingerprint = fps[v] or real_fp
        try:
            steps[v] = functional.make_train_step(cfg, mesh, allreduce=local_allreduce, fingerprint=fps[v] is not None)
            states[v] = steps[v].init(cfg.train.seed)
            if batches is None:
                batches = [steps[v].shard_batch(b.inputs, b.targets) for b in (stream.batch(i) for i in range(8))]
            for i in range(6):
                one(v, i)
        finally:
            functional.state_fingerprint = real_fp
    check = {v: fpm.read_commit(steps[v].apply_grads(states[v], steps[v].compute_grads(states[v], *batches[0])[0],
                                                     quorum)[1]["commit_words"])[1]
             for v in ("in_step", "no_psum", "reference")}

    orders = [variants[k:] + variants[:k] for k in range(len(variants))]
    ratios = {v: {"cpu": [], "wall": []} for v in variants if v != "off"}
    update_part = {v: [] for v in ratios}  # the update part's extra CPU over off's, as a share of off's step
    step_cpu: list[float] = []
    t_start = time.perf_counter()
    n = 0
    for g in range(args.groups):
        got = {v: [] for v in variants}
        for i in range(args.block):
            for v in orders[n % len(orders)]:
                got[v].append(one(v, i))
            n += 1
        off_w, off_c = sum(t.wall for t in got["off"]), sum(t.cpu for t in got["off"])
        off_update = sum(t.update_cpu for t in got["off"])
        for v in ratios:
            ratios[v]["wall"].append(sum(t.wall for t in got[v]) / off_w - 1)
            ratios[v]["cpu"].append(sum(t.cpu for t in got[v]) / off_c - 1)
            update_part[v].append((sum(t.update_cpu for t in got[v]) - off_update) / off_c)
        step_cpu.append(off_c / args.block)
        if (g + 1) % max(1, args.groups // 10) == 0:
            print(f"group {g + 1}/{args.groups}: " + ", ".join(
                f"{v} {ratios[v]['cpu'][-1] * 100:+.2f}% (update part {update_part[v][-1] * 100:+.2f}%)"
                for v in ratios), flush=True)
    seconds = time.perf_counter() - t_start

    # Hot or cold: COPIES fingerprints of COPIES distinct states, or of one state COPIES times.
    shardings = steps["off"].state_shardings
    copy = jax.jit(lambda t: jax.tree.map(lambda a: a + jnp.zeros((), a.dtype), t), out_shardings=shardings)
    distinct = [copy(states["off"]._replace(step=states["off"].step + k)) for k in range(COPIES)]

    @jax.jit
    def many(*trees):
        return sum(functional.state_fingerprint(t, shardings) for t in trees)

    def per_fp(trees) -> float:
        c0 = time.process_time()
        fpm.to_int(many(*trees))
        return (time.process_time() - c0) / COPIES

    same = [distinct[0]] * COPIES
    for _ in range(3):
        per_fp(distinct), per_fp(same)
    hot, cold = [], []
    for g in range(args.groups):
        pair = (("hot", same), ("cold", distinct)) if g % 2 else (("cold", distinct), ("hot", same))
        for name, trees in pair:
            (hot if name == "hot" else cold).append(per_fp(trees) / step_cpu[g])

    # The meeting alone: a 2-device psum of two words, back to back.
    @jax.jit
    def bare(x):
        return jax.shard_map(lambda b: jax.lax.psum(b, names), mesh=mesh, in_specs=PartitionSpec(names),
                             out_specs=PartitionSpec(), check_vma=False)(x)

    x = jax.device_put(jnp.arange(2 * devices, dtype=jnp.uint32),
                       jax.sharding.NamedSharding(mesh, PartitionSpec(names)))
    for _ in range(50):
        bare(x).block_until_ready()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.calls):
        bare(x).block_until_ready()
    bare_wall = (time.perf_counter() - t0) / args.calls
    bare_cpu = (time.process_time() - c0) / args.calls

    result = {
        "command": " ".join(["python", "experiments/fingerprint_parts.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": args.config, "devices_per_replica": devices, "groups": args.groups, "block": args.block,
        "design": "as experiments/fingerprint_cost.py: rotating rounds, one ratio per variant and group, median "
                  "with a distribution-free 95% CI (overheads over `off`)",
        "variants": {
            "in_step": "the default: native kernel per device + one psum, read with the commit flag",
            "no_psum": "diagnostic (wrong value): the kernel per device, no psum; device 0's words read",
            "psum_only": "diagnostic (wrong value): no kernel; first word of each block, then the same psum",
            "reference": "the jax-ops form (fingerprint.reference), same value, XLA's reductions",
        },
        "median_step_cpu_s": statistics.median(step_cpu),
        "overhead_cpu": {v: median_ci(ratios[v]["cpu"], TARGET) for v in ratios},
        "update_part_cpu": {v: median_ci(update_part[v], TARGET) for v in ratios},
        "overhead_wall": {v: median_ci(ratios[v]["wall"], TARGET) for v in ratios},
        "psum_minus_no_psum_cpu": median_ci([a - b for a, b in zip(ratios["in_step"]["cpu"],
                                                                    ratios["no_psum"]["cpu"])], TARGET),
        "bare_psum": {"calls": args.calls, "wall_s": bare_wall, "cpu_s": bare_cpu, "cpu_over_wall": bare_cpu / bare_wall,
                      "cpu_fraction_of_step": bare_cpu / statistics.median(step_cpu)},
        "check": {"in_step_fp": fpm.to_hex(check["in_step"]), "no_psum_fp_device0": fpm.to_hex(check["no_psum"]),
                  "reference_fp": fpm.to_hex(check["reference"]),
                  "reference_equals_in_step": check["reference"] == check["in_step"]},
        "work_fraction_hot_cpu": median_ci(hot, TARGET), "work_fraction_cold_cpu": median_ci(cold, TARGET),
        "cold_minus_hot_cpu": median_ci([c - h for c, h in zip(cold, hot)], TARGET), "copies": COPIES,
        "ratios": ratios, "update_part_shares": update_part, "seconds": seconds,
        "machine": f"{os.cpu_count()} CPUs, kernel ISA {cpu_isa()}; shared: compare the paired ratios",
        "load_average_start": load_start, "load_average_end": list(os.getloadavg()),
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    def fmt(d: dict) -> str:
        return f"{d['median'] * 100:+.2f}% (CI {d['ci95'][0] * 100:+.2f}..{d['ci95'][1] * 100:+.2f}%)"

    for v in ratios:
        print(f"{v:10s} CPU {fmt(result['overhead_cpu'][v])}  wall {fmt(result['overhead_wall'][v])}")
    print(f"the work alone, CPU per fingerprint over a step's: hot {fmt(result['work_fraction_hot_cpu'])}, cold "
          f"{fmt(result['work_fraction_cold_cpu'])}, cold - hot {fmt(result['cold_minus_hot_cpu'])}")
    print(f"in_step - no_psum CPU {fmt(result['psum_minus_no_psum_cpu'])}; bare psum {bare_cpu * 1e6:.0f} us CPU, "
          f"{bare_wall * 1e6:.0f} us wall per call ({bare_cpu / bare_wall:.2f} CPU/wall) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
