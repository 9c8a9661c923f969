"""FTAR through the jitted custom call (the path the training step uses), donated buffers."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

s = common.spec()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fthsdp.devices import enable_compilation_cache  # noqa: E402
from fthsdp.step.sharding import replica_mesh  # noqa: E402

enable_compilation_cache()
mesh = replica_mesh(1)
import ftar_ring  # noqa: E402  (imports jax: after the spec, like the rest)

comm, op = ftar_ring.ring_op(s, mesh)


def make(nbytes):
    return {"x": jnp.zeros(nbytes // 4, jnp.float32) + 1.0}


times = common.timed(op, s["sizes"], s["iters"], s["warmup"], make)
common.write(s, times, stats=comm.stats())
comm.close()
