"""JAX's own CPU collectives across processes: jax.distributed + psum (gloo under the hood)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

s = common.spec()
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=s["coordinator"], num_processes=s["n"], process_id=s["rank"])
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("r",))
sharding = NamedSharding(mesh, P("r"))
psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "r"), mesh=mesh, in_specs=P("r"), out_specs=P("r")),
               donate_argnums=0)


def make(nbytes):
    local = jnp.ones(nbytes // 4, jnp.float32)
    return jax.make_array_from_single_device_arrays((s["n"] * (nbytes // 4),), sharding,
                                                    [jax.device_put(local, jax.local_devices()[0])])


def op(x):
    y = psum(x)
    jax.block_until_ready(y)
    return y


times = common.timed(op, s["sizes"], s["iters"], s["warmup"], make)
common.write(s, times)
jax.distributed.shutdown()
