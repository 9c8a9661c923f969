"""What the silent-data-corruption fingerprint costs per step (issue 16, item 4; target <= 1% of a step).

    python experiments/fingerprint_cost.py [--quick] [--repeats N] [--steps N] --out results/fingerprint_cost.json

The config is the one ``make run`` trains (``configs/ft_local.py``: the
``configs/base.py`` model and data, 2 devices per replica); one replica, its
step timed as the Manager runs it (``compute_grads``, ``apply_grads``, the
commit flag read on the host), with the all-reduce replaced by the local
identity so that only computation is timed (FTAR's network time would only
make the fingerprint a smaller share of a real step: the ratio here is an
upper bound). Three variants, interleaved within every repeat so that a
loaded machine slows them alike:

* ``off``: ``ft.fingerprint=false``, no fingerprint;
* ``in_step``: the fingerprint inside the jitted ``apply_grads`` (what replicas
  run: no extra dispatch), its two words read on the host after the step;
* ``separate``: ``off`` plus the fingerprint as its own jitted call after the step;
* ``every_k``: ``in_step`` with ``ft.fingerprint_every=K`` (``--every``, default 4): the
  fingerprint computed (and read) after every K-th step only.

The fingerprint's own work is also measured without dispatch or host reads:
``LOOP`` fingerprints back to back inside one jitted call (a ``fori_loop``; each of a
state whose step counter differs, so none can be hoisted), CPU seconds per
fingerprint over the ``off`` step's CPU seconds (``loop_fraction_of_step_cpu``).

``k_for_target`` is the K that the measured per-commit CPU overhead says would bring
it under 1% (ceil(overhead / 1%)).

Besides the step-time ratios (small differences on a noisy machine), the
fingerprint call alone is timed on the same state, interleaved with the
steps: ``alone_s / off step`` is its cost measured directly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
LOOP = 50  # fingerprints back to back in one jitted call (the work without dispatch)
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="ft_local", help="config (default: ft_local, what `make run` trains)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant per repeat")
    p.add_argument("--quick", action="store_true", help="3 repeats x 8 steps (CI)")
    p.add_argument("--every", type=int, default=4, help="K of the every_k variant (ft.fingerprint_every)")
    p.add_argument("--out", default="results/fingerprint_cost.json")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 3, 8
    load_start = list(os.getloadavg())  # the shared machine's 1/5/15-minute load before the run

    from fthsdp import config as config_lib
    from fthsdp.devices import force_host_devices

    cfg = config_lib.load(args.config, args.overrides)
    devices = cfg.launch.devices_per_replica
    force_host_devices(devices)
    import jax
    import numpy as np

    from fthsdp.data import ReplicaStream
    from fthsdp.observe.metrics import pytree_bytes
    from fthsdp.step import fingerprint as fpm
    from fthsdp.step.functional import make_train_step
    from fthsdp.step.quorum_inputs import local_allreduce, make_quorum_inputs
    from fthsdp.step.sharding import replica_mesh

    mesh = replica_mesh(devices)
    steps = {name: make_train_step(cfg, mesh, allreduce=local_allreduce, fingerprint=on)
             for name, on in (("off", False), ("in_step", True))}
    every_cfg = config_lib.override(cfg, [f"ft.fingerprint_every={args.every}"]).validate()
    steps["every_k"] = make_train_step(every_cfg, mesh, allreduce=local_allreduce, fingerprint=True)
    alone = fpm.make_fingerprint(steps["off"].state_shardings)
    shardings = steps["off"].state_shardings

    @jax.jit
    def loop(state):
        def body(i, acc):
            return acc + fpm.fingerprint(state._replace(step=state.step + i), shardings)
        return jax.lax.fori_loop(0, LOOP, body, jax.numpy.zeros((2,), jax.numpy.uint32))
    stream = ReplicaStream(cfg.data, 0)
    quorum = make_quorum_inputs(contribute=True, num_contributing=1, num_members=1, num_configured=1, lr_mode=0)
    states = {v: steps["off" if v == "separate" else v].init(cfg.train.seed)
              for v in ("off", "in_step", "separate", "every_k")}
    batches = [steps["off"].shard_batch(b.inputs, b.targets) for b in (stream.batch(i) for i in range(8))]

    def one(variant: str, i: int) -> float:
        ts = steps["off" if variant == "separate" else variant]
        x, y = batches[i % len(batches)]
        t0, c0 = time.perf_counter(), time.process_time()
        grads, _ = ts.compute_grads(states[variant], x, y)
        state, m = ts.apply_grads(states[variant], grads, quorum)
        assert bool(m["committed"])
        if variant == "in_step":
            fpm.to_int(m["fingerprint"])
        elif variant == "every_k" and int(state.step) % args.every == 0:  # what the Manager reads
            fpm.to_int(m["fingerprint"])
        elif variant == "separate":
            fpm.to_int(alone(state))
        jax.block_until_ready(state)
        states[variant] = state
        return time.perf_counter() - t0, time.process_time() - c0

    def fp_loop() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        fpm.to_int(loop(states["off"]))
        return (time.perf_counter() - t0) / LOOP, (time.process_time() - c0) / LOOP

    def fp_alone() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        fpm.to_int(alone(states["off"]))
        return time.perf_counter() - t0, time.process_time() - c0

    variants = ("off", "in_step", "separate", "every_k")
    for v in variants:  # warm up: compile, then a few steps
        for i in range(3):
            one(v, i)
    for _ in range(3):
        fp_alone()
    fp_loop()
    per_repeat = []
    for r in range(args.repeats):
        times: dict[str, list[tuple[float, float]]] = {v: [] for v in (*variants, "alone", "loop")}
        for i in range(args.steps):
            for v in (variants if (i + r) % 2 == 0 else variants[::-1]):  # alternate the order
                times[v].append(one(v, i))
            times["alone"].append(fp_alone())
            if i % 4 == 0:
                times["loop"].append(fp_loop())
        med = {v: statistics.median(w for w, _ in t) for v, t in times.items()}
        med.update({f"{v}_min": min(w for w, _ in t) for v, t in times.items()})
        med.update({f"{v}_cpu": statistics.median(c for _, c in t) for v, t in times.items()})
        per_repeat.append(med)
        print(f"repeat {r + 1}/{args.repeats}: step off {med['off'] * 1e3:.2f} ms, in_step {med['in_step'] * 1e3:.2f} ms, "
              f"separate {med['separate'] * 1e3:.2f} ms, every_{args.every} {med['every_k'] * 1e3:.2f} ms, "
              f"fingerprint alone {med['alone'] * 1e3:.3f} ms", flush=True)

    def ratio(a: str, b: str) -> float:  # median over repeats of the paired ratio
        return statistics.median(m[a] / m[b] for m in per_repeat)

    state_bytes = pytree_bytes(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), states["off"]))
    result = {
        "config": args.config, "overrides": args.overrides, "devices_per_replica": devices,
        "state_bytes": state_bytes, "params_bytes": pytree_bytes(states["off"].params),
        "repeats": args.repeats, "steps_per_repeat": args.steps,
        "median_step_s": {v: statistics.median(m[v] for m in per_repeat) for v in variants},
        "fingerprint_alone_s": statistics.median(m["alone"] for m in per_repeat),
        "in_step_overhead": ratio("in_step", "off") - 1.0,
        "separate_overhead": ratio("separate", "off") - 1.0,
        "alone_fraction_of_step": ratio("alone", "off"),
        # the same from each repeat's fastest step (the least disturbed by the machine's load)
        "in_step_overhead_min": ratio("in_step_min", "off_min") - 1.0,
        "separate_overhead_min": ratio("separate_min", "off_min") - 1.0,
        "alone_fraction_of_step_min": ratio("alone_min", "off_min"),
        # CPU seconds this process spent (all its threads): the work itself, the least
        # sensitive to other processes on a shared machine
        "in_step_overhead_cpu": ratio("in_step_cpu", "off_cpu") - 1.0,
        "every": args.every,
        "every_k_overhead": ratio("every_k", "off") - 1.0,
        "every_k_overhead_cpu": ratio("every_k_cpu", "off_cpu") - 1.0,
        "separate_overhead_cpu": ratio("separate_cpu", "off_cpu") - 1.0,
        "alone_fraction_of_step_cpu": ratio("alone_cpu", "off_cpu"),
        "loop": LOOP,
        "loop_fraction_of_step": ratio("loop", "off"),
        "loop_fraction_of_step_cpu": ratio("loop_cpu", "off_cpu"),
        "target": "fingerprint <= 1% of a step",
        "per_repeat": per_repeat,
        "machine": "shared 2-core CPU host, noisy: compare the ratios (measured side by side), not absolute times",
        "allreduce": "local identity (computation only: an upper bound on the fingerprint's share of a real step)",
    }
    result["target_met"] = bool(result["in_step_overhead_cpu"] <= 0.01)  # per commit, as the issue asks
    result["k_for_target"] = max(1, math.ceil(result["in_step_overhead_cpu"] / 0.01 - 1e-9))
    result["every_k_target_met"] = bool(result["every_k_overhead_cpu"] <= 0.01)
    result["load_average_start"] = load_start
    result["load_average_end"] = list(os.getloadavg())
    result["kernel"] = "native CPU kernel per device (ffi/fingerprint.cc) inside shard_map, one psum"
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"state {state_bytes / 1e6:.2f} MB; step {result['median_step_s']['off'] * 1e3:.2f} ms; fingerprint in the "
          f"step: {result['in_step_overhead'] * 100:+.2f}%, as a separate call: {result['separate_overhead'] * 100:+.2f}%,"
          f" the call alone: {result['alone_fraction_of_step'] * 100:.2f}% of a step (fastest steps: in the step "
          f"{result['in_step_overhead_min'] * 100:+.2f}%, alone {result['alone_fraction_of_step_min'] * 100:.2f}%; CPU time: "
          f"in the step {result['in_step_overhead_cpu'] * 100:+.2f}%, separate {result['separate_overhead_cpu'] * 100:+.2f}%, "
          f"alone {result['alone_fraction_of_step_cpu'] * 100:.2f}%); every {args.every}th step: "
          f"{result['every_k_overhead'] * 100:+.2f}% (CPU {result['every_k_overhead_cpu'] * 100:+.2f}%); "
          f"{LOOP} back to back in one call: {result['loop_fraction_of_step'] * 100:.2f}% of a step each "
          f"(CPU {result['loop_fraction_of_step_cpu'] * 100:.2f}%); "
          f"K for 1%: {result['k_for_target']} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
