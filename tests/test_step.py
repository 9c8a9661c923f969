"""The functional step on one replica: FSDP sharding, commit vote, LR intervention, no recompilation.

These are CPU tests: they build their meshes over the CPU devices and make
the CPU the default device, so they pass unchanged on a host whose default
jax backend is a GPU (where `replica_mesh` would pick the GPUs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fthsdp.step import intervention
from fthsdp.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig
from fthsdp.data import ReplicaStream
from fthsdp.step.intervention import Intervention
from fthsdp.step.quorum_inputs import STATUS_OK, STATUS_RECOVERABLE, make_quorum_inputs
from fthsdp.step.sharding import AXIS
from fthsdp.step.functional import make_train_step

CFG = Config(
    model=ModelConfig(d_model=32, num_layers=1, num_heads=2, max_seq_len=16),
    data=DataConfig(seq_len=16, batch_size=8, corpus_bytes=1 << 16),
    optim=OptimConfig(lr=1e-2, warmup_steps=0, decay="constant"),
    train=TrainConfig(steps=10),
)


def cpu_devices():
    return jax.local_devices(backend="cpu")


def replica_mesh(n: int) -> Mesh:
    """fthsdp.step.sharding.replica_mesh, pinned to the CPU platform."""
    devices = cpu_devices()
    assert len(devices) >= n, f"conftest forces 4 host devices, got {len(devices)}"
    return Mesh(np.array(devices[:n]), (AXIS,))


@pytest.fixture(autouse=True)
def _cpu_default_device():
    with jax.default_device(cpu_devices()[0]):
        yield


def _batch(ts, pos=0, cfg=CFG):
    b = ReplicaStream(cfg.data, 0).batch(pos)
    return ts.shard_batch(b.inputs, b.targets)


def _tree_bytes(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def ts4():
    return make_train_step(CFG, replica_mesh(4))


def test_parameters_and_optimizer_state_are_sharded_over_local_devices(ts4):
    state = ts4.init(0)
    assert len(cpu_devices()) == 4
    sharded = 0
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        if leaf.ndim == 0 or leaf.size < 4:
            continue
        shards = leaf.addressable_shards
        assert {s.device for s in shards} == set(cpu_devices())
        if not leaf.sharding.is_fully_replicated:
            sharded += 1
            # each device holds a quarter of the array, and the quarters differ in place
            assert all(s.data.size * 4 == leaf.size for s in shards)
            assert len({s.index for s in shards}) == 4
    big = [x for x in jax.tree.leaves(state.params) if x.ndim >= 2]
    assert all(not x.sharding.is_fully_replicated for x in big), "every matrix must be FSDP-sharded"
    assert sharded >= 3 * len(big)  # params + adam mu + nu


def test_committed_step_changes_state_and_advances_counter(ts4):
    state = ts4.init(0)
    x, y = _batch(ts4)
    new, m = ts4.step(state, x, y, make_quorum_inputs())
    assert bool(m["committed"]) and int(new.step) == 1
    assert _tree_bytes(new.params) != _tree_bytes(state.params)


def _failing_allreduce(bad_shard):
    def allreduce(grads, quorum, mesh):
        status = jnp.full((mesh.devices.size,), STATUS_OK, jnp.int32).at[bad_shard].set(STATUS_RECOVERABLE)
        status = jax.lax.with_sharding_constraint(status, NamedSharding(mesh, P(mesh.axis_names)))
        return grads, status

    return allreduce


@pytest.mark.parametrize("bad_shard", [0, 3])
def test_failed_allreduce_on_any_shard_leaves_state_bitwise_untouched(bad_shard):
    ts = make_train_step(CFG, replica_mesh(4), allreduce=_failing_allreduce(bad_shard))
    state = ts.init(0)
    before = _tree_bytes(state)
    x, y = _batch(ts)
    new, m = ts.step(state, x, y, make_quorum_inputs())
    assert not bool(m["committed"])
    assert _tree_bytes(new) == before
    assert int(new.step) == 0


def test_a_step_that_does_not_commit_returns_its_input_learning_rate_included():
    """With a warm-up the rate differs at every step: a failed step must not leave the rate it
    would have used in the state it returns (the optimizer's hyperparameters were once written
    into the input state's dict while tracing, so the returned state carried the new rate)."""
    import dataclasses

    cfg = dataclasses.replace(CFG, optim=OptimConfig(lr=1e-2, warmup_steps=10, decay="constant"))
    ok = make_train_step(cfg, replica_mesh(4))
    state, _ = ok.step(ok.init(0), *_batch(ok), make_quorum_inputs())  # step 1: the state holds step 0's rate
    failing = make_train_step(cfg, replica_mesh(4), allreduce=_failing_allreduce(1))
    before = _tree_bytes(state)
    new, m = failing.step(state, *_batch(failing, 1), make_quorum_inputs())
    assert not bool(m["committed"]) and float(m["lr"]) != float(state.opt_state.hyperparams["learning_rate"])
    assert _tree_bytes(new) == before


def _poisoning_allreduce(value):
    """An all-reduce whose sum holds ``value`` in its first element (a peer's NaN contribution)."""
    def allreduce(grads, quorum, mesh):
        leaves, treedef = jax.tree.flatten(grads)
        leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(value)
        status = jax.lax.with_sharding_constraint(jnp.full((mesh.devices.size,), STATUS_OK, jnp.int32),
                                                  NamedSharding(mesh, P(mesh.axis_names)))
        return jax.tree.unflatten(treedef, leaves), status

    return allreduce


@pytest.mark.parametrize("value", [jnp.nan, jnp.inf])
def test_non_finite_averaged_gradients_commit_the_step_with_the_update_skipped(value):
    """optim.nonfinite=skip: the step commits (its batch is spent, the counter moves), the
    parameters and optimizer state stay bit for bit, and the flags say so; with
    optim.nonfinite=apply the NaN goes into the state."""
    import dataclasses

    skip = make_train_step(CFG, replica_mesh(4), allreduce=_poisoning_allreduce(value), fingerprint=True)
    state = skip.init(0)
    new, m = skip.step(state, *_batch(skip), make_quorum_inputs())
    assert bool(m["committed"]) and bool(m["skipped"]) and int(new.step) == 1
    assert _tree_bytes((new.params, new.opt_state)) == _tree_bytes((state.params, state.opt_state))
    assert int(m["commit_words"][0]) == 3  # committed | skipped, in the one word the Manager reads
    bare = make_train_step(CFG, replica_mesh(4), allreduce=_poisoning_allreduce(value), fingerprint=False)
    _, m = bare.step(state, *_batch(bare), make_quorum_inputs())
    assert "commit_words" not in m and int(m["commit_flags"]) == 3  # without the fingerprint: the flags alone

    cfg = dataclasses.replace(CFG, optim=dataclasses.replace(CFG.optim, nonfinite="apply"))
    apply = make_train_step(cfg, replica_mesh(4), allreduce=_poisoning_allreduce(value))
    new, m = apply.step(state, *_batch(apply), make_quorum_inputs())
    assert bool(m["committed"]) and not bool(m["skipped"]) and int(new.step) == 1
    assert not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(new.params))

    # finite gradients are applied under skip as before
    fine = make_train_step(CFG, replica_mesh(4), fingerprint=True)
    new, m = fine.step(state, *_batch(fine), make_quorum_inputs())
    assert bool(m["committed"]) and not bool(m["skipped"]) and int(m["commit_words"][0]) == 1
    assert _tree_bytes(new.params) != _tree_bytes(state.params)


def test_retrying_the_update_with_held_gradients_is_bitwise_identical(ts4):
    """Retrying only the all-reduce + update with held gradients == retraining the step.

    The split path is bitwise reproducible; the fused step is the same maths
    but XLA may fuse it differently, so it agrees only to rounding.
    """
    state = ts4.init(1)
    x, y = _batch(ts4, 3)
    q = make_quorum_inputs()
    grads1, _ = ts4.compute_grads(state, x, y)
    grads2, _ = ts4.compute_grads(state, x, y)  # "retraining" the step
    first, _ = ts4.apply_grads(state, grads1, q)
    retry, _ = ts4.apply_grads(state, grads1, q)
    retrain, _ = ts4.apply_grads(state, grads2, q)
    assert _tree_bytes(first) == _tree_bytes(retry) == _tree_bytes(retrain)
    fused, _ = ts4.step(state, x, y, q)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(first)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_non_contributing_replica_sends_zero_gradient(ts4):
    """contribute=0 zeroes the gradient before the all-reduce (the catch-up rule)."""
    seen = {}

    def spy_allreduce(grads, quorum, mesh):
        seen["norm"] = sum(jnp.sum(jnp.abs(g)) for g in jax.tree.leaves(grads))
        status = jnp.zeros((mesh.devices.size,), jnp.int32)
        return grads, status

    ts = make_train_step(CFG, replica_mesh(4), allreduce=spy_allreduce)
    state = ts.init(0)
    x, y = _batch(ts)
    grads, _ = ts.compute_grads(state, x, y)
    out, m = ts.apply_grads(state, grads, make_quorum_inputs(contribute=False, num_contributing=1, num_members=2, num_configured=2))
    # With zero gradient the only change is weight decay + Adam of zero: mu/nu stay zero.
    mu = out.opt_state.inner_state[1][0].mu
    assert all(float(jnp.max(jnp.abs(v))) == 0.0 for v in jax.tree.leaves(mu))
    assert bool(m["committed"])
    assert float(m["grad_norm"]) == 0.0


@pytest.mark.parametrize("mode", list(Intervention))
@pytest.mark.parametrize("healthy,total", [(4, 4), (3, 4), (1, 4), (2, 3)])
def test_lr_intervention_scale_inside_the_step(ts4, mode, healthy, total):
    state = ts4.init(0)
    x, y = _batch(ts4)
    q = make_quorum_inputs(num_contributing=healthy, num_members=total, num_configured=total, lr_mode=int(mode))
    _, m = ts4.step(state, x, y, q)
    expected = {Intervention.NONE: 1.0, Intervention.LINEAR: healthy / total,
                Intervention.SQRT: np.sqrt(healthy / total)}[mode]
    assert float(m["lr_scale"]) == pytest.approx(expected, rel=1e-6)
    assert float(m["lr"]) == pytest.approx(CFG.optim.lr * expected, rel=1e-6)
    assert float(intervention.lr_scale(int(mode), healthy, total)) == pytest.approx(expected, rel=1e-6)


def test_lr_scale_changes_the_update_size(ts4):
    state = ts4.init(0)
    x, y = _batch(ts4)
    deltas = {}
    for mode in Intervention:
        q = make_quorum_inputs(num_contributing=1, num_members=4, num_configured=4, lr_mode=int(mode))
        new, _ = ts4.step(state, x, y, q)
        deltas[mode] = float(jnp.max(jnp.abs(new.params["head"]["kernel"] - state.params["head"]["kernel"])))
    assert deltas[Intervention.LINEAR] < deltas[Intervention.SQRT] < deltas[Intervention.NONE]


def test_no_recompilation_when_quorum_values_change():
    ts = make_train_step(CFG, replica_mesh(4))
    state = ts.init(0)
    x, y = _batch(ts)
    quorums = [
        make_quorum_inputs(),
        make_quorum_inputs(num_contributing=2, num_members=3, num_configured=3, lr_mode=2, rank=1, quorum_id=7, comm=3),
        make_quorum_inputs(contribute=False, num_contributing=1, num_members=2, num_configured=5, lr_mode=1, rank=1, quorum_id=9),
        make_quorum_inputs(num_contributing=5, num_members=5, num_configured=5, lr_mode=0, rank=4, quorum_id=10),
    ]
    grads, _ = ts.compute_grads(state, x, y)
    for q in quorums:
        state, _ = ts.step(state, x, y, q)
        ts.apply_grads(state, grads, q)
    assert ts.step._cache_size() == 1
    assert ts.apply_grads._cache_size() == 1
    assert ts.compute_grads._cache_size() == 1


def test_invalid_quorum_is_refused_on_the_host():
    with pytest.raises(ValueError, match="inconsistent quorum"):
        make_quorum_inputs(num_contributing=3, num_members=2)
    with pytest.raises(ValueError, match="rank 2 outside ring of 2"):
        make_quorum_inputs(num_contributing=2, rank=2)
    # this replica's own part must agree with the count (the old check compared a number with itself)
    with pytest.raises(ValueError, match="contributes but 0 replicas"):
        make_quorum_inputs(contribute=True, num_contributing=0, num_members=2, num_configured=2)
    with pytest.raises(ValueError, match="contributes nothing but all 2 members"):
        make_quorum_inputs(contribute=False, num_contributing=2, num_members=2, num_configured=2)


def test_the_learning_rate_schedule_and_its_leaf_are_what_the_config_says():
    """A cosine schedule with no warm-up starts at the full rate (rounded up to one warm-up step,
    step 0 trained at rate 0); an integer rate from a config file is a float32 leaf from the start
    (a weak int32 leaf turned float32 after the first commit: a recompilation, and every fetch or
    restore of that state refused against the initial template)."""
    from fthsdp.step.functional import lr_schedule, make_optimizer

    cosine = lr_schedule(OptimConfig(lr=0.5, warmup_steps=0, decay="cosine"), 100)
    assert float(cosine(0)) == 0.5 and float(cosine(1)) < 0.5
    assert float(lr_schedule(OptimConfig(lr=0.5, warmup_steps=10, decay="cosine"), 100)(0)) == 0.0
    opt = make_optimizer(OptimConfig(lr=1, warmup_steps=0, decay="constant"))
    state = opt.init({"w": jnp.zeros((2,), jnp.float32)})
    assert state.hyperparams["learning_rate"].dtype == jnp.float32


def test_loss_decreases_over_a_few_steps(ts4):
    state = ts4.init(0)
    q = make_quorum_inputs()
    losses = []
    for pos in range(25):
        x, y = _batch(ts4, pos)
        state, m = ts4.step(state, x, y, q)
        losses.append(float(m["loss"]))
    assert np.mean(losses[-5:]) < losses[0] - 1.0


def test_init_and_step_are_deterministic():
    ts = make_train_step(CFG, replica_mesh(2))
    a, b = ts.init(5), ts.init(5)
    assert _tree_bytes(a) == _tree_bytes(b)
    x, y = _batch(ts)
    q = make_quorum_inputs()
    assert _tree_bytes(ts.step(a, x, y, q)[0]) == _tree_bytes(ts.step(b, x, y, q)[0])
