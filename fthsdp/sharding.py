"""FSDP sharding inside one replica: every state array is split over the
replica's local devices along one axis, so each device holds 1/D of the
parameters and optimizer state (the "sharded" in hybrid-sharded DP)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "fsdp"


def replica_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh over this process's first `num_devices` local devices."""
    devices = jax.local_devices()
    n = len(devices) if num_devices is None else num_devices
    if n > len(devices):
        raise ValueError(
            f"asked for {n} devices per replica but this process has {len(devices)}; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax"
        )
    return Mesh(np.array(devices[:n]), (AXIS,))


def fsdp_spec(shape: tuple[int, ...], num_shards: int) -> P:
    """Shard the largest axis divisible by `num_shards`; replicate what cannot be split."""
    if num_shards == 1:
        return P()
    best = None
    for axis, size in enumerate(shape):
        if size % num_shards == 0 and size >= num_shards and (best is None or size > shape[best]):
            best = axis
    if best is None:
        return P()
    # No trailing Nones: jit normalises output specs that way, and jit's dispatch
    # cache compares specs literally, so P('fsdp', None) on an input would
    # recompile a step that was compiled with P('fsdp').
    return P(*([None] * best), AXIS)


def fsdp_shardings(tree, mesh: Mesh):
    """NamedShardings for every leaf of `tree` (arrays or ShapeDtypeStructs)."""
    n = mesh.devices.size
    return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(tuple(x.shape), n)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are split along their leading (example) axis."""
    return NamedSharding(mesh, P(AXIS))
