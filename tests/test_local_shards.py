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
    starts = ["at:0,0", "at:8,0", "at:16,0", "at:24,0"]  # each part named by where it starts in the leaf
    assert sorted(parts["w"], key=lambda k: int(k[3:].split(",")[0])) == starts
    assert [parts["w"][k].shape for k in starts] == [(8, 3)] * 4
    assert np.array_equal(np.concatenate([np.asarray(parts["w"][k]) for k in starts]), np.asarray(state["w"]))
    assert len(parts["b"]) == 1 and parts["step"] == 7  # replicated: one part; numpy: as is
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, state)
    like = local_shards.local_like(abstract)
    assert set(like["w"]) == set(starts) and [like["w"][k].shape for k in starts] == [(8, 3)] * 4
    assert like["w"]["at:0,0"].sharding is None
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
        local_shards.assemble({**host, "w": {k: host["w"][k] for k in ("at:0,0", "at:8,0")}}, abstract)


def test_parts_of_another_process_fail_the_fetchs_check_not_installed_misplaced(state):
    """Parts whose starts differ from this process's (another process index's, another device
    order's) carry other names in the snapshot's paths: the manifest does not match what this
    process expects (a SnapshotError the fetch reports), and assemble refuses them too."""
    from fthsdp.checkpoint.snapshot import SnapshotError, check_matches, flatten

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, state)
    parts = local_shards.local_parts(state)
    other = {**parts, "w": {f"at:{32 + 8 * i},0": v for i, v in enumerate(parts["w"].values())}}
    snaps = Snapshotter()
    try:
        snap = snaps.take(3, other)
        paths, leaves, _ = flatten(local_shards.local_like(abstract))
        with pytest.raises(SnapshotError, match="differs from the snapshot"):
            check_matches(snap.manifest, paths, leaves)
    finally:
        snaps.close()
    with pytest.raises(ValueError, match="another process's"):
        local_shards.assemble(other, abstract)
