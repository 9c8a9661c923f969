"""A process's own shards of a replica's state: what it serves to, and fetches from, its peers.

In a replica of several processes the state is FSDP-sharded over all their
devices, and process p holds the same pieces (the same index ranges of every
leaf) in every replica, because every replica has the same P x D mesh. So
per-shard recovery needs no new wire format: each process snapshots and serves
only its *local parts* (every leaf cut to its distinct addressable shards, in
index order), a rejoining process fetches exactly that pytree from the matching
processes of the healthy replicas (striped over them by the peer fetcher), and
puts the parts back onto its own devices. Nothing crosses the processes of a
replica (no gather to host), and each process moves about 1/P of the state.

A leaf replicated over the replica (a step counter, an unsharded bias) is one
whole part on every process: small, and needed by each.

Each part is named by where it starts in its leaf (``at:8,0``), and the name is
part of the leaf's path in the snapshot's manifest: a source whose parts lie
elsewhere (another process index, another device order) fails the fetch's check
of the manifest against what this process expects, instead of being installed
at the wrong indices.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["local_parts", "local_like", "assemble", "parts_bytes"]


def _key(index: tuple) -> tuple:
    return tuple((s.start or 0) if isinstance(s, slice) else int(s) for s in index)


def _name(key: tuple) -> str:
    """A part's name: its start in the leaf (part of the leaf's path in a snapshot's manifest)."""
    return "at:" + ",".join(str(k) for k in key)


def _shape_of(index: tuple, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(d))) if isinstance(s, slice) else 1 for s, d in zip(index, shape))


def _local_indices(sharding, shape: tuple[int, ...]) -> list[tuple]:
    """This process's distinct shard indices of an array of ``shape`` on ``sharding``, in index order."""
    seen: dict[tuple, tuple] = {}
    for index in sharding.addressable_devices_indices_map(shape).values():
        seen.setdefault(_key(index), index)
    return [seen[k] for k in sorted(seen)]


def _is_sharded(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and getattr(x, "sharding", None) is not None


def local_parts(tree) -> Any:
    """``tree`` with every jax.Array leaf replaced by its distinct local shards (single-device
    arrays), a dict by each one's start in the leaf (:func:`_name`); other leaves as they are."""
    def cut(x):
        if not isinstance(x, jax.Array):
            return x
        by_key = {}
        for s in x.addressable_shards:
            by_key.setdefault(_key(s.index), s.data)
        return {_name(k): by_key[k] for k in sorted(by_key)}

    return jax.tree.map(cut, tree)


def local_like(abstract) -> Any:
    """The structure :func:`local_parts` gives for ``abstract`` (ShapeDtypeStructs with
    shardings): host ShapeDtypeStructs (no sharding), one per local part."""
    def cut(x):
        if not _is_sharded(x):
            return x
        return {_name(_key(i)): jax.ShapeDtypeStruct(_shape_of(i, x.shape), x.dtype)
                for i in _local_indices(x.sharding, x.shape)}

    return jax.tree.map(cut, abstract)


def assemble(parts, abstract) -> Any:
    """Global arrays on ``abstract``'s shardings from this process's local parts (host
    arrays as fetched): each device takes the part with its index."""
    def build(x, got):
        if not _is_sharded(x):
            return got
        indices = _local_indices(x.sharding, x.shape)
        want = {_name(_key(i)) for i in indices}
        if set(got) != want:
            raise ValueError(f"local parts {sorted(got)} for an array whose distinct local shards start at "
                             f"{sorted(want)}: the parts are another process's (or another mesh's)")
        by_key = {_key(i): np.asarray(got[_name(_key(i))]) for i in indices}
        arrays = [jax.device_put(by_key[_key(i)], d) for d, i in x.sharding.addressable_devices_indices_map(x.shape).items()]
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)

    return jax.tree.map(build, abstract, parts, is_leaf=lambda v: isinstance(v, jax.ShapeDtypeStruct))


def parts_bytes(tree) -> int:
    """Bytes of a pytree of arrays / ShapeDtypeStructs (what a fetch of it moves)."""
    return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
                   if hasattr(x, "shape")))
