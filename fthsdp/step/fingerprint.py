"""A cheap fingerprint of a replica's state, computed on its devices (silent-data-corruption check).

Invariant 1 says every replica that committed a step holds the same bytes.
A bit flipped by faulty hardware breaks it silently: the job goes on, the
replicas drift apart, and someone finds out days later. Comparing the
replicas' states after each commit catches it at the next step, but a full
host copy (``state_hash``) costs seconds on a real model; this costs a few
element-wise integer operations per word, on the devices, and brings two
32-bit words to the host.

**What it is.** Every leaf is bitcast to unsigned words (16- and 8-bit types
widened, 64-bit types split in two), each word ``w`` at global flat index
``i`` of leaf ``k`` is mixed into

    h(w, i, k) = mix(w XOR (i * A + seed_k))      (mix: multiply-xorshift rounds)

and the fingerprint is the wrapping (mod 2^32) *sum* of ``h`` over every word
of every leaf, in two lanes with independent constants (64 bits in all).

**Why it detects what it must.** For a fixed position ``h`` is a bijection of
``w`` (XOR with a constant, multiplication by an odd constant and
``x ^ (x >> s)`` are each invertible mod 2^32), so changing any one word --
one flipped bit, or any other change of one element -- changes its term and
therefore the sum, with certainty, in each lane. Because the term depends on
the position (and the leaf), moving values around (two elements swapped, a
transposed shard) changes it too, except with probability about 2^-64; a
plain sum of words would miss every permutation.

**Why it is the same everywhere.** A modular sum does not depend on the
order of its terms, so the fingerprint is the same however the state is
sharded or reduced (one device, FSDP over several, several processes of one
replica: XLA reduces each shard locally and all-reduces two words), and the
same on every replica that holds the same bytes.

Used inside the jitted ``apply_grads`` (after the update, no extra dispatch:
see ``make_train_step(fingerprint=True)``) or on its own through
:func:`make_fingerprint`; ``experiments/fingerprint_cost.py`` measures both.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["fingerprint", "make_fingerprint", "to_int", "to_hex", "flip_bit"]

_M32 = 0xFFFFFFFF
# Two independent lanes: (index multiplier, leaf-seed multiplier, seed offset, mix constants).
_LANES = (
    (0x9E3779B1, 0x27D4EB2F, 0x165667B1, 0x85EBCA77, 0xC2B2AE3D),
    (0x7FEB352D, 0x846CA68B, 0x5BD1E995, 0xCC9E2D51, 0x1B873593),
)


def _words(x: jax.Array) -> jax.Array:
    """``x``'s bits as uint32 words (same number of elements, or two per 64-bit element)."""
    dt = jnp.dtype(x.dtype)
    if dt == jnp.bool_:
        return x.astype(jnp.uint32)
    size = dt.itemsize
    if size == 4:
        return x if dt == jnp.uint32 else jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        u = jnp.uint8 if size == 1 else jnp.uint16
        return (x if dt == u else jax.lax.bitcast_convert_type(x, u)).astype(jnp.uint32)
    if size == 8:  # only with jax_enable_x64: two words per element, a trailing axis of 2
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    raise TypeError(f"cannot fingerprint dtype {dt}: expected a 1, 2, 4 or 8 byte type")


def _flat_index(shape: tuple[int, ...], global_shape: tuple[int, ...] | None = None,
                offsets: tuple[Any, ...] | None = None) -> jax.Array:
    """The global row-major flat index of every element, as uint32 (wrapping past 2^32 elements).
    For a local block of a sharded array, ``global_shape`` is the whole array's shape and
    ``offsets`` the block's start along each axis (0 or a traced value)."""
    global_shape = global_shape or shape
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        coord = jax.lax.broadcasted_iota(jnp.uint32, shape, d)
        if offsets is not None and not (isinstance(offsets[d], int) and offsets[d] == 0):
            coord = coord + jnp.asarray(offsets[d], jnp.uint32)
        idx = idx + coord * jnp.uint32(stride & _M32)
        stride *= global_shape[d]
    return idx


def _mix(x: jax.Array, m1: int, m2: int) -> jax.Array:
    x = x * jnp.uint32(m1)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(m2)
    return x ^ (x >> 16)


def _group_lanes(words: jax.Array, leaf_ids: list[int]) -> jax.Array:
    """uint32[2]: both lanes' sums over a stack of same-shaped leaves' words (axis 0: the leaf),
    as one fused elementwise pass and one reduction."""
    shape = words.shape[1:]
    idx = _flat_index(shape)[None]
    ks = jnp.asarray(np.array(leaf_ids, np.uint32)).reshape((-1,) + (1,) * len(shape))
    out = []
    for a, s, off, m1, m2 in _LANES:
        pos = idx * jnp.uint32(a) + (ks * jnp.uint32(s) + jnp.uint32(off))
        out.append(jnp.sum(_mix(words ^ pos, m1, m2), dtype=jnp.uint32))
    return jnp.stack(out)


def fingerprint(tree: Any) -> jax.Array:
    """The fingerprint of a pytree of arrays: a uint32[2] array (traceable; call it inside jit).

    Leaves of the same shape and layout (a parameter and its optimizer moments) are stacked
    and fingerprinted together: a state of ~100 leaves then costs ~a dozen fused passes
    instead of a few small kernels per leaf, which on a CPU was most of the time. The value
    is the sum over every word of every leaf, whatever the grouping or the sharding."""
    groups: dict[tuple, list[tuple[int, jax.Array]]] = {}
    for k, leaf in enumerate(jax.tree.leaves(tree)):
        w = _words(jnp.asarray(leaf))
        sh = getattr(leaf, "sharding", None)
        key = (w.shape, str(getattr(sh, "spec", "")) if sh is not None else "")
        groups.setdefault(key, []).append((k, w))
    total = jnp.zeros((2,), jnp.uint32)
    for members in groups.values():
        ids = [k for k, _ in members]
        stacked = members[0][1][None] if len(members) == 1 else jnp.stack([w for _, w in members])
        total = total + _group_lanes(stacked, ids)
    return total


def make_fingerprint(shardings: Any = None):
    """``fingerprint`` as its own jitted call over a state laid out by ``shardings`` (the same
    pytree of shardings as the state, or None to take the inputs' layout)."""
    if shardings is None:
        return jax.jit(fingerprint)
    return jax.jit(fingerprint, in_shardings=(shardings,))


def to_int(fp: Any) -> int:
    """The two words of a fingerprint as one 64-bit integer (a host-side value).

    ``fp`` may span several devices or processes of one replica: it is the same
    (replicated) on all of them, so the first local copy is read."""
    if isinstance(fp, jax.Array) and not fp.is_fully_addressable:
        fp = fp.addressable_shards[0].data
    a, b = (int(v) for v in np.asarray(fp, np.uint32).reshape(2))
    return (a << 32) | b


def to_hex(fp: int | None) -> str:
    return "-" if fp is None else f"{fp:016x}"


# -- the test hook (ft.test_flip_bit, parsed by fthsdp.control.sdc.parse_flip) ---------------


def flip_bit(tree: Any, bit: int, shardings: Any = None) -> Any:
    """``tree`` with bit ``bit`` of the first element of its first 4-byte leaf flipped (on the
    devices, keeping every leaf's layout). Every process of a multi-process replica calls it."""
    leaves, treedef = jax.tree.flatten(tree)
    k = next((i for i, x in enumerate(leaves) if jnp.dtype(x.dtype).itemsize == 4 and x.size > 0), None)
    if k is None:
        raise ValueError("flip_bit: the tree has no 4-byte leaf to flip a bit in")
    sh = jax.tree.leaves(shardings)[k] if shardings is not None else None

    def flip(x):
        w = jax.lax.bitcast_convert_type(x, jnp.uint32)
        mask = jnp.where(_flat_index(w.shape) == 0, jnp.uint32(1 << bit), jnp.uint32(0))
        return jax.lax.bitcast_convert_type(w ^ mask, x.dtype)

    fn = jax.jit(flip) if sh is None else jax.jit(flip, in_shardings=(sh,), out_shardings=sh)
    leaves = list(leaves)
    leaves[k] = fn(leaves[k])
    return jax.tree.unflatten(treedef, leaves)
