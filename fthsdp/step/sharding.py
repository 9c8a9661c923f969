"""FSDP sharding inside one replica: every state array is split over the
replica's local devices along one axis, so each device holds 1/D of the
parameters and optimizer state (the "sharded" in hybrid-sharded DP)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "fsdp"


def replica_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh over the replica's devices: this process's first `num_devices`
    local devices, or, when the replica spans several processes (one JAX
    runtime per replica, fthsdp.replica.group), every process's first
    `num_devices` local devices in process order, so global shard i lives on
    process i // num_devices. The same shard index means the same slice of
    the state on every replica, whatever process holds it (FTAR rings pair
    shard i of every replica)."""
    if jax.process_count() > 1:
        per = {}
        for d in jax.devices():
            per.setdefault(d.process_index, []).append(d)
        n = min(len(v) for v in per.values()) if num_devices is None else num_devices
        short = {p: len(v) for p, v in per.items() if len(v) < n}
        if short:
            raise ValueError(f"asked for {n} devices per process but processes {short} have fewer")
        devices = [d for p in sorted(per) for d in sorted(per[p], key=lambda d: d.id)[:n]]
        return Mesh(np.array(devices), (AXIS,))
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
