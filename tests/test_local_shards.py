"""A process's own shards of a state (fthsdp/checkpoint/local_shards.py), in one process.

Across processes (each process's parts about 1/P of the state, rebuilt bitwise)
see tests/test_replica_group.py; here: the parts' layout on 4 local devices and
the round trip through host memory and a real snapshot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fthsdp.checkpoint import local_shards
from fthsdp.checkpoint.snapshot import Snapshotter, restore_tree


@pytest.fixture
def state():
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    sharded = NamedSharding(mesh, P("fsdp"))
    replicated = NamedSharding(mesh, P())
    w = jax.device_put(jnp.arange(32 * 3, dtype=jnp.float32).reshape(32, 3), sharded)
    b = jax.device_put(jnp.arange(5, dtype=jnp.int32), replicated)
    return {"w": w, "b": b, "step": np.int64(7)}


def test_parts_are_the_distinct_local_shards_in_index_order(state):
    parts = local_shards.local_parts(state)
    assert [p.shape for p in parts["w"]] == [(8, 3)] * 4
    assert np.array_equal(np.concatenate([np.asarray(p) for p in parts["w"]]), np.asarray(state["w"]))
    assert len(parts["b"]) == 1 and parts["step"] == 7  # replicated: one part; numpy: as is
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, state)
    like = local_shards.local_like(abstract)
    assert [x.shape for x in like["w"]] == [(8, 3)] * 4 and like["w"][0].sharding is None
    assert local_shards.parts_bytes(like["w"]) == 32 * 3 * 4


def test_parts_round_trip_through_a_snapshot_bitwise(state):
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, state)
    snaps = Snapshotter()
    try:
        snap = snaps.take(3, local_shards.local_parts(state))
        host = restore_tree(snap.manifest, snap.buffer, like=local_shards.local_like(abstract))
        rebuilt = local_shards.assemble(host, abstract)
    finally:
        snaps.close()
    assert rebuilt["w"].sharding == state["w"].sharding
    assert np.array_equal(np.asarray(rebuilt["w"]), np.asarray(state["w"]))
    assert np.array_equal(np.asarray(rebuilt["b"]), np.asarray(state["b"])) and rebuilt["step"] == 7
    with pytest.raises(ValueError, match="local parts"):
        local_shards.assemble({**host, "w": host["w"][:2]}, abstract)
