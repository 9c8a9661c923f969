"""One replica's training step on its device, timed: the FT-HSDP step whose
gradients go through FTAR (a ring of n replica processes sharing the GPU), or
the same step with a local identity all-reduce (`allreduce: "local"`), under
the same process count and contention. Writes median step seconds."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

s = common.spec()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from fthsdp import config as config_lib  # noqa: E402
from fthsdp.collective import ftar  # noqa: E402
from fthsdp.data import ReplicaStream  # noqa: E402
from fthsdp.step.quorum_inputs import local_allreduce, make_quorum_inputs  # noqa: E402
from fthsdp.step.sharding import AXIS  # noqa: E402
from fthsdp.step.functional import make_train_step  # noqa: E402
from fthsdp.devices import enable_compilation_cache  # noqa: E402

enable_compilation_cache()  # a rerun loads the step instead of compiling it

rank, n = s["rank"], s["n"]
cfg = config_lib.load(s.get("config", "base"), list(s.get("overrides", [])))
mesh = Mesh(np.array(jax.devices(s["platform"])[:1]), (AXIS,))
if s["allreduce"] == "ftar":
    comm = ftar.Communicator(timeout_s=120.0)
    common.publish(s["rdv"], f"addr{rank}", comm.address)
    members = common.gather(s["rdv"], [f"addr{r}" for r in range(n)])
    assert comm.configure("bench-step", 1, rank, members, timeout_s=60.0)
    q = make_quorum_inputs(num_contributing=n, num_members=n, num_configured=n, rank=rank, quorum_id=1,
                           comm=comm.handle)
    ts = make_train_step(cfg, mesh, allreduce=ftar.allreduce)
else:
    comm = None
    q = make_quorum_inputs()
    ts = make_train_step(cfg, mesh, allreduce=local_allreduce)
state = ts.init(0)
stream = ReplicaStream(cfg.data, rank)
times = []
n_params = sum(x.size for x in jax.tree.leaves(state.params))
for i in range(s["warmup"] + s["iters"]):
    b = stream.batch(i)
    x, y = ts.shard_batch(b.inputs, b.targets)
    t0 = common.time.perf_counter()
    state, m = ts.step(state, x, y, q)
    jax.block_until_ready(state)
    assert bool(m["committed"]), "step did not commit"
    if i >= s["warmup"]:
        times.append(common.time.perf_counter() - t0)
common.write(s, {"step": times}, params=int(n_params))
if comm is not None:
    comm.close()
