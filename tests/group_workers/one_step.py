"""One process of a replica (or a whole one-process replica): init, one FSDP step, hashes,
and the leader's decision channel. Writes what it saw as JSON (tests/test_replica_group.py)."""

import json
import os
import sys
import time

from fthsdp.devices import force_host_devices

out_path, index, nproc, coordinator, devices = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
kill_leader = len(sys.argv) > 6 and sys.argv[6] == "kill_leader"
force_host_devices(devices)
if os.environ.get("FTHSDP_COMPILATION_CACHE"):  # as a replica process does (a follower's programs too)
    from fthsdp.devices import enable_compilation_cache

    enable_compilation_cache()

import numpy as np  # noqa: E402

from fthsdp import config as config_lib

from fthsdp.replica import group as replica_group  # noqa: E402

spec = replica_group.GroupSpec(replica_id=3, process_index=index, num_processes=nproc, coordinator=coordinator)
replica_group.initialize(spec, timeout_s=60)

import jax  # noqa: E402

from fthsdp.step.quorum_inputs import local_allreduce, make_quorum_inputs  # noqa: E402
from fthsdp.step.sharding import replica_mesh  # noqa: E402
from fthsdp.step.functional import make_train_step, state_hash  # noqa: E402

TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16",
        "data.seq_len=16", "data.batch_size=8", "data.corpus_bytes=65536", "train.eval_every=0"]
cfg = config_lib.load("base", TINY + ["launch.devices_per_replica=1"])
mesh = replica_mesh(devices)
ts = make_train_step(cfg, mesh, allreduce=local_allreduce)
state = ts.init(0)
if kill_leader:  # the leader dies (SIGKILL) before publishing; the follower must not wait past its deadline
    import os
    import signal

    ch = replica_group.DecisionChannel(spec)
    if spec.is_leader:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        ch.receive("quorum", 5.0)
        out = {"error": None}
    except replica_group.DecisionTimeout as e:
        out = {"error": str(e)}
    out["waited_s"] = time.monotonic() - t0
    with open(out_path, "w") as f:
        json.dump(out, f)
    os._exit(0)  # the runtime's shutdown barrier would wait for the dead leader
res = {"process": jax.process_index(), "processes": jax.process_count(), "mesh_devices": int(mesh.devices.size),
       "fully_addressable": bool(jax.tree.leaves(state.params)[0].is_fully_addressable), "hash0": state_hash(state)}
rng = np.random.default_rng(0)
inputs = rng.integers(0, 256, (8, 16)).astype(np.int32)
targets = rng.integers(0, 256, (8, 16)).astype(np.int32)
for _ in range(2):
    grads, m = ts.compute_grads(state, *ts.shard_batch(inputs, targets))
    state, m2 = ts.apply_grads(state, grads, make_quorum_inputs(num_members=1))
res["hash2"] = state_hash(state)
res["loss"] = float(np.asarray(m["loss"]))
res["committed"] = bool(np.asarray(m2["committed"]))
res["compilations"] = [ts.compute_grads._cache_size(), ts.apply_grads._cache_size()]
own = ts.program_counts()
res["own_programs"] = {"loaded": own.loaded, "compiled": own.compiled}

# per-shard recovery's pieces: this process's own shards to host and back (no gather across processes)
from fthsdp.checkpoint import local_shards  # noqa: E402

abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
host = jax.tree.map(np.asarray, local_shards.local_parts(state))
like = local_shards.local_like(abstract)
res["like_matches"] = jax.tree.structure(like) == jax.tree.structure(host) and all(
    tuple(a.shape) == tuple(b.shape) for a, b in zip(jax.tree.leaves(like), jax.tree.leaves(host)))
res["local_bytes"], res["state_bytes"] = local_shards.parts_bytes(host), local_shards.parts_bytes(abstract)
res["rebuilt_hash"] = state_hash(local_shards.assemble(host, abstract))

ch = replica_group.DecisionChannel(spec)
res["quorum"] = ch.share("quorum", {"quorum_id": 7, "members": ["0", "3"]} if spec.is_leader else None, 30)
res["gathered"] = ch.gather("addresses", [f"ftar-of-{index}"], 30)
if nproc > 1 and not spec.is_leader:
    t0 = time.monotonic()
    try:
        ch.receive("never", 1.0)
        res["timeout"] = "no error"
    except replica_group.DecisionTimeout as e:
        res["timeout"] = str(e)
        res["timeout_s"] = time.monotonic() - t0
# the leader waits for its followers before tearing the coordinator down
if nproc > 1:
    ch.gather("bye", 1, 30)
    if spec.is_leader:
        time.sleep(0.5)
with open(out_path, "w") as f:
    json.dump(res, f)
