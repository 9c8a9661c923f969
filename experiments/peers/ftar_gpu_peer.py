"""FTAR through the jitted custom call on one device of a chosen platform
(`platform`: "gpu" = the host-staged CUDA path, "cpu" = the CPU path), several
peers sharing one GPU. Donated buffers, status checked every call."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

s = common.spec()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from fthsdp import ftar  # noqa: E402
from fthsdp.quorum_inputs import make_quorum_inputs  # noqa: E402
from fthsdp.sharding import AXIS  # noqa: E402

rank, n = s["rank"], s["n"]
device = jax.devices(s["platform"])[0]
mesh = Mesh(np.array([device]), (AXIS,))
comm = ftar.Communicator(streams=s.get("streams", 2), chunk_bytes=s.get("chunk_bytes", 1 << 20),
                         chunks=s.get("chunks", 4), timeout_s=120.0)
common.publish(s["rdv"], f"addr{rank}", comm.address)
members = common.gather(s["rdv"], [f"addr{r}" for r in range(n)])
res = comm.configure("bench", 1, rank, members, timeout_s=60.0)
assert res, res.reason
q = make_quorum_inputs(num_contributing=n, num_members=n, num_configured=n, rank=rank, quorum_id=1,
                       comm=comm.handle)
step = jax.jit(lambda g, q: ftar.allreduce(g, q, mesh), donate_argnums=0)


def op(buf):
    out, status = step(buf, q)
    jax.block_until_ready(out)
    assert int(np.asarray(status)[0]) == 0, comm.stats()
    return out


def make(nbytes):
    return {"x": jax.device_put(jnp.ones(nbytes // 4, jnp.float32), device)}


times = common.timed(op, s["sizes"], s["iters"], s["warmup"], make)
common.write(s, times, stats=comm.stats())
comm.close()
