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

from fthsdp.step.sharding import AXIS  # noqa: E402

device = jax.devices(s["platform"])[0]
mesh = Mesh(np.array([device]), (AXIS,))
import ftar_ring  # noqa: E402  (imports jax: after the spec, like the rest)

comm, op = ftar_ring.ring_op(s, mesh)


def make(nbytes):
    return {"x": jax.device_put(jnp.ones(nbytes // 4, jnp.float32), device)}


times = common.timed(op, s["sizes"], s["iters"], s["warmup"], make)
common.write(s, times, stats=comm.stats())
comm.close()
