"""The state fingerprint (fthsdp/step/fingerprint.py): any single bit flip changes it, swaps
change it, the same values give the same fingerprint under any layout, and the native CPU
kernel (ffi/fingerprint.cc) computes exactly the jax reference's value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from fthsdp.control import sdc
from fthsdp.step import fingerprint as fpm


def fp(tree) -> int:
    return fpm.to_int(jax.jit(fpm.fingerprint)(tree))


def _one_device(tree):
    """``tree`` on one device with its sharding: fingerprint(tree, shardings) runs the native kernel."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    shs = jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)
    return jax.device_put(tree, shs), shs


def test_every_single_bit_flip_changes_both_lanes():
    """The requirement: a flipped bit always changes the fingerprint -- in each lane on its own,
    with the jax reference and the native kernel alike. Distinct flips need not give distinct
    values (the module docstring says why that is fine)."""
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    words = x.view(np.uint32).reshape(-1)
    flipped = []
    for i in range(words.size):
        for bit in range(32):
            w = words.copy()
            w[i] ^= np.uint32(1 << bit)
            flipped.append(w.view(np.float32).reshape(x.shape))
    batch = np.stack([x] + flipped)  # 1 + 1,024 states, fingerprinted in one vmapped call
    ref = np.asarray(jax.jit(jax.vmap(lambda w: fpm.reference({"w": w})))(batch))
    assert (ref[1:] != ref[0]).all(axis=0).all(), "a flip left a lane unchanged"
    assert len({tuple(r) for r in ref}) > 0.9 * len(ref)  # and nearly all distinct, though not required
    tree, shs = _one_device({"w": x})
    native = jax.jit(lambda t: fpm.fingerprint(t, shs))
    assert fpm.to_int(native(tree)) == fpm.to_int(ref[0])
    for k in (0, 31, 500, 1023):  # the native kernel on a few of them
        t, _ = _one_device({"w": flipped[k]})
        assert fpm.to_int(native(t)) == fpm.to_int(ref[k + 1]) != fpm.to_int(ref[0])


def test_two_negated_values_change_it():
    """Two sign flips cancel in lane 0 (each adds 2^31); lane 1 once cancelled them half the time,
    so a state with two values negated kept the clean fingerprint. Every pair of a 256-word leaf
    (32,640 states), and pairs of bit-30 flips of neighbours, against the clean state."""
    x = np.random.default_rng(1).standard_normal(256).astype(np.float32)
    words = x.view(np.uint32)
    i, j = np.triu_indices(words.size, 1)
    pairs = np.repeat(words[None, :], i.size, axis=0)
    pairs[np.arange(i.size), i] ^= np.uint32(1 << 31)
    pairs[np.arange(i.size), j] ^= np.uint32(1 << 31)
    lanes = jax.jit(jax.vmap(lambda w: fpm.reference({"w": w.view(jnp.float32)})))
    clean = np.asarray(fpm.reference({"w": jnp.asarray(x)}))
    got = np.asarray(lanes(jnp.asarray(pairs)))
    assert not (got == clean).all(axis=1).any(), "two sign flips left the fingerprint unchanged"
    near = np.repeat(words[None, :], words.size - 1, axis=0)
    k = np.arange(words.size - 1)
    near[k, k] ^= np.uint32(1 << 30)
    near[k, k + 1] ^= np.uint32(1 << 30)
    assert not (np.asarray(lanes(jnp.asarray(near))) == clean).all(axis=1).any()
    tree, shs = _one_device({"w": pairs[7].view(np.float32)})  # the native kernel agrees
    assert fpm.to_int(jax.jit(lambda t: fpm.fingerprint(t, shs))(tree)) == fpm.to_int(got[7])


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


def _mixed_tree(rng):
    return {"w": rng.standard_normal((8, 6)).astype(np.float32), "b": rng.standard_normal(12).astype(np.float32),
            "step": np.int32(7), "h": jnp.asarray(rng.standard_normal((4, 3, 8)), jnp.bfloat16),
            "m": np.arange(5, dtype=np.int8), "flag": np.bool_(True), "e": np.zeros((0, 3), np.float32)}


@pytest.mark.parametrize("layout", ["rows4", "cols2", "replicated", "mesh2x2"])
def test_native_kernel_equals_the_reference_under_every_layout(layout):
    """The CPU kernel sees only each device's block (with its offsets) and counts a replicated
    leaf once: its value must be the reference's, bit for bit, whatever the layout."""
    tree = _mixed_tree(np.random.default_rng(3))
    want = fpm.to_int(jax.jit(fpm.reference)(tree))
    devs = np.array(jax.devices()[:4])
    if layout == "mesh2x2":
        mesh = jax.sharding.Mesh(devs.reshape(2, 2), ("a", "b"))
        specs = {"w": P(("a", "b"), None), "b": P("b"), "step": P(), "h": P("a", None, "b"), "m": P(),
                 "flag": P(), "e": P()}
    else:
        n = 2 if layout == "cols2" else 4
        mesh = jax.sharding.Mesh(devs[:n], ("fsdp",))
        specs = {"rows4": {"w": P("fsdp", None), "b": P("fsdp"), "h": P("fsdp"), "e": P(None, None)},
                 "cols2": {"w": P(None, "fsdp"), "b": P("fsdp"), "h": P(None, None, "fsdp"), "e": P(None, None)},
                 "replicated": {}}[layout]
        specs = {k: specs.get(k, P()) for k in tree}
    shs = {k: NamedSharding(mesh, v) for k, v in specs.items()}
    placed = {k: jax.device_put(v, shs[k]) for k, v in tree.items()}
    assert fpm.to_int(fpm.make_fingerprint(shs)(placed)) == want
    changed = dict(placed, h=jax.device_put(tree["h"].at[3, 2, 7].add(1), shs["h"]))  # the last device's block
    assert fpm.to_int(fpm.make_fingerprint(shs)(changed)) != want


@pytest.mark.parametrize("every", [1, 3])
def test_train_step_reports_the_reference_fingerprint(every):
    """The fingerprint apply_grads returns (native, inside the step) is the reference's value of
    the state it returns; with ft.fingerprint_every=K only after every K-th step (zeros between)."""
    from fthsdp import config as config_lib
    from fthsdp.step.functional import make_train_step
    from fthsdp.step.quorum_inputs import local_allreduce, make_quorum_inputs
    from fthsdp.step.sharding import replica_mesh

    cfg = config_lib.load("base", ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16",
                                   "data.seq_len=16", "data.batch_size=8", f"ft.fingerprint_every={every}"])
    ts = make_train_step(cfg, replica_mesh(2), allreduce=local_allreduce, fingerprint=True)
    state = ts.init(0)
    x = np.zeros((cfg.data.batch_size, cfg.data.seq_len), np.int32)
    quorum = make_quorum_inputs(contribute=True, num_contributing=1, num_members=1, num_configured=1, lr_mode=0)
    for step in range(1, every + 1):
        grads, _ = ts.compute_grads(state, *ts.shard_batch(x, x))
        new, m = ts.apply_grads(state, grads, quorum)
        assert int(new.step) == step
        committed, got, skipped = fpm.read_commit(m["commit_words"])
        assert committed and not skipped
        if step % every:
            assert got == 0
        else:
            assert got == fpm.to_int(jax.jit(fpm.reference)(new))
            assert got != fpm.to_int(jax.jit(fpm.reference)(state))
        state = new
    # a step that does not commit (no contributor) says so in the same words, and fingerprints
    # the state it returns
    idle = make_quorum_inputs(contribute=False, num_contributing=0, num_members=1, num_configured=1, lr_mode=0)
    grads, _ = ts.compute_grads(state, *ts.shard_batch(x, x))
    kept, m = ts.apply_grads(state, grads, idle)
    committed, got, skipped = fpm.read_commit(m["commit_words"])
    assert not committed and not skipped and int(kept.step) == every  # a multiple of K: fingerprinted
    assert got == fpm.to_int(jax.jit(fpm.reference)(kept))


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.uint8])
@pytest.mark.parametrize("spec", [P("fsdp"), P(None, "fsdp"), P(None, None, "fsdp"), P()])
def test_native_kernel_long_runs_every_dtype(dtype, spec):
    """Blocks long enough for the kernel's vector loop (16-lane vectors, two at a time), with
    tails, whose axes merge into runs: split along the first axis (one run per block), a
    middle axis (runs that start at an offset), the last axis (short runs). The native value
    equals the reference's, and a change of any one element -- in a vector body, in a tail, on
    either device -- changes both lanes."""
    shape = (6, 10, 38)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.integers(0, 250, shape).astype(np.float32)).astype(dtype)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    shs = {"x": NamedSharding(mesh, spec), "s": NamedSharding(mesh, P())}
    native = fpm.make_fingerprint(shs)
    tree = {"x": x, "s": jnp.int32(3)}
    placed = jax.device_put(tree, shs)
    base = np.asarray(native(placed))
    assert fpm.to_int(base) == fpm.to_int(jax.jit(fpm.reference)(tree))
    for idx in [(0, 0, 0), (0, 0, 17), (2, 3, 31), (3, 9, 37), (5, 9, 37), (5, 0, 1)]:
        changed = dict(tree, x=x.at[idx].set(x[idx] + jnp.asarray(1, dtype)))
        got = np.asarray(native(jax.device_put(changed, shs)))
        assert (got != base).all(), (idx, got, base)
        assert fpm.to_int(got) == fpm.to_int(jax.jit(fpm.reference)(changed)), idx


def test_read_commit_reads_flags_and_fingerprint():
    words = jnp.asarray([1, 0x89ABCDEF, 0x01234567], jnp.uint32)
    assert fpm.read_commit(words) == (True, 0x89ABCDEF01234567, False)
    assert fpm.read_commit(words.at[0].set(0)) == (False, 0x89ABCDEF01234567, False)
    assert fpm.read_commit(words.at[0].set(3)) == (True, 0x89ABCDEF01234567, True)


def test_cpp_kernel_copies_equal_the_definition():
    """ffi/tests/fingerprint_test.cc (built by CMake beside the extension; skipped if not built):
    every vector copy of the kernel this CPU runs (baseline, AVX2, AVX-512) against the
    definition computed one element at a time, on random blocks of every element size."""
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    found = sorted(root.glob("build/*/fthsdp_fingerprint_test"))
    if not found:
        pytest.skip("fthsdp_fingerprint_test not built (pip install --no-build-isolation -e .)")
    r = subprocess.run([str(found[-1])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all copies equal the definition" in r.stdout and "baseline: 300 trials" in r.stdout
