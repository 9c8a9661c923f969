"""The state fingerprint (fthsdp/step/fingerprint.py): any single bit flip changes it, swaps
change it, and the same values give the same fingerprint under any layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from fthsdp.control import sdc
from fthsdp.step import fingerprint as fpm


def fp(tree) -> int:
    return fpm.to_int(jax.jit(fpm.fingerprint)(tree))


def test_every_single_bit_flip_gives_a_distinct_fingerprint():
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    words = x.view(np.uint32).reshape(-1)
    seen = {fp({"w": x})}
    for i in range(words.size):
        for bit in range(32):
            w = words.copy()
            w[i] ^= np.uint32(1 << bit)
            seen.add(fp({"w": w.view(np.float32).reshape(x.shape)}))
    assert len(seen) == 1 + words.size * 32  # the original and every flip: all distinct


def test_swaps_and_moves_between_leaves_change_it():
    x = np.arange(16, dtype=np.float32)
    base = fp({"a": x, "b": x + 100})
    swapped = x.copy()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert fp({"a": swapped, "b": x + 100}) != base
    assert fp({"a": x + 100, "b": x}) != base  # values exchanged between leaves
    assert fp({"a": x.reshape(4, 4).T.copy(), "b": x + 100}) != base  # a transposed copy
    assert fp({"a": x, "b": x + 100}) == base


def test_dtypes_16_and_8_bit_and_integers():
    for dt in (jnp.bfloat16, jnp.float16, jnp.int8, jnp.int32, jnp.bool_):
        x = jnp.arange(12).astype(dt).reshape(3, 4)
        y = x.at[1, 2].set(jnp.logical_not(x[1, 2]) if dt == jnp.bool_ else x[1, 2] + 1)
        assert fp(x) != fp(y), dt
        assert fp(x) == fp(jnp.array(x)), dt


def test_same_values_same_fingerprint_whatever_the_sharding():
    devs = jax.devices()[:4]
    assert len(devs) == 4
    mesh = jax.sharding.Mesh(np.array(devs), ("fsdp",))
    rng = np.random.default_rng(1)
    tree = {"w": rng.standard_normal((8, 6)).astype(np.float32), "b": rng.standard_normal(12).astype(np.float32),
            "step": np.int32(7)}
    plain = fp(tree)
    sharded = {"w": jax.device_put(tree["w"], NamedSharding(mesh, P("fsdp", None))),
               "b": jax.device_put(tree["b"], NamedSharding(mesh, P("fsdp"))),
               "step": jax.device_put(tree["step"], NamedSharding(mesh, P()))}
    shardings = jax.tree.map(lambda a: a.sharding, sharded)
    assert fpm.to_int(fpm.make_fingerprint(shardings)(sharded)) == plain
    mesh2 = jax.sharding.Mesh(np.array(devs[:2]), ("fsdp",))
    other = {"w": jax.device_put(tree["w"], NamedSharding(mesh2, P(None, "fsdp"))),  # columns, 2 devices
             "b": jax.device_put(tree["b"], NamedSharding(mesh2, P("fsdp"))), "step": tree["step"]}
    assert fp(other) == plain


def test_flip_bit_hook_changes_one_word_and_keeps_the_layout():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    sh = NamedSharding(mesh, P("fsdp", None))
    x = jax.device_put(np.ones((4, 3), np.float32), sh)
    tree = {"a": x, "n": jnp.int8(3)}
    out = fpm.flip_bit(tree, 16, shardings={"a": sh, "n": None})
    assert out["a"].sharding == sh
    diff = np.asarray(out["a"]).view(np.uint32) ^ np.asarray(x).view(np.uint32)
    assert diff.reshape(-1).tolist() == [1 << 16] + [0] * 11
    assert fp(out) != fp(tree)


def test_parse_flip():
    assert sdc.parse_flip("") is None
    s = sdc.parse_flip("1@20")
    assert (s.replica, s.step, s.bit) == (1, 20, 16)
    s = sdc.parse_flip("2@5:3")
    assert (s.replica, s.step, s.bit) == (2, 5, 3)
    for bad in ("1", "a@2", "1@2:40", "1@-2", "1@2:x"):
        with pytest.raises(ValueError):
            sdc.parse_flip(bad)
