"""The numerical twin: same step code, identical replicas, exact catch-up, exactly-once data.

There is no multi-process run to compare with yet; these tests pin what the
twin must share with it: invariant 1 (identical replicas after every commit),
the single-replica split path bit for bit, zero gradients from non-contributing
replicas, the quorum counts, and per-replica exactly-once batch consumption.
"""

import dataclasses

import jax
import numpy as np
import pytest

from fthsdp.sim import schedules
from fthsdp.config import Config, DataConfig, LaunchConfig, ModelConfig, OptimConfig, TrainConfig
from fthsdp.data import ReplicaStream
from fthsdp.step.intervention import Intervention
from fthsdp.step.quorum_inputs import make_quorum_inputs
from fthsdp.sim.twin import Twin, TwinError, state_hash, step_hashes

CFG = Config(
    model=ModelConfig(d_model=16, num_layers=1, num_heads=2, max_seq_len=16),
    data=DataConfig(seq_len=16, batch_size=4, corpus_bytes=1 << 16, eval_batches=1),
    optim=OptimConfig(lr=1e-2, warmup_steps=2, decay="cosine"),
    launch=LaunchConfig(devices_per_replica=1),
    train=TrainConfig(steps=12, seed=3, log_every=1, eval_every=0),
)


@pytest.fixture(scope="module")
def twin3():
    return Twin(CFG, 3)


def _mask(steps, n, down=()):
    alive = np.ones((steps, n), dtype=bool)
    for r, lo, hi in down:
        alive[lo:hi, r] = False
    return alive


def test_no_failures_keeps_every_replica_bitwise_identical(twin3):
    res = twin3.run(_mask(6, 3), seed=1, record_hashes=True, check_identical=True)
    for rec in res.steps:
        assert rec.num_contributing == 3 and rec.num_members == 3
        assert len(set(rec.hashes)) == 1, f"step {rec.step}: replicas differ"
    assert len({rec.hashes[0] for rec in res.steps}) == 6  # and the state does change every step
    assert [ld.position for ld in res.loaders] == [6, 6, 6]


def test_one_replica_matches_the_single_replica_split_path_bit_for_bit():
    """Same programs as a lone replica: jitted compute_grads + apply_grads, stream of replica 0."""
    cfg = CFG
    twin = Twin(cfg, 1)
    steps = 5
    res = twin.run(_mask(steps, 1), intervention="sqrt", seed=cfg.train.seed, record_hashes=True)
    ts = twin.ts
    state = ts.init(cfg.train.seed)
    q = make_quorum_inputs(lr_mode=Intervention.SQRT)
    stream = ReplicaStream(cfg.data, 0)
    for i in range(steps):
        b = stream.batch(i)
        x, y = ts.shard_batch(b.inputs, b.targets)
        grads, m = ts.compute_grads(state, x, y)
        state, _ = ts.apply_grads(state, grads, q)
        assert res.steps[i].hashes[0] == state_hash(state), f"twin and single replica differ at step {i}"
        assert res.steps[i].loss == float(m["loss"])


def test_one_replica_agrees_with_fthsdp_train_to_rounding(tmp_path):
    """fthsdp.step.train runs the fused step, which agrees with the split path only to rounding
    (step.py); Adam turns rounding in near-zero gradients into small, bounded differences."""
    from fthsdp.step.train import train

    cfg = dataclasses.replace(CFG, train=dataclasses.replace(CFG.train, steps=6, out_dir=str(tmp_path)))
    ref = train(cfg, progress=False)
    twin = Twin(cfg, 1)
    res = twin.run(_mask(6, 1), intervention=cfg.ft.intervention, seed=cfg.train.seed)
    assert ref.loader.position == res.loaders[0].position == 6
    assert ref.first_loss == res.steps[0].loss  # same init, same batch, same forward pass
    assert res.steps[-1].loss == pytest.approx(ref.last_loss, rel=1e-5)
    flat = lambda s: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(s.params)])  # noqa: E731
    moved = np.linalg.norm(flat(ref.state) - flat(twin.ts.init(cfg.train.seed)))
    assert np.linalg.norm(flat(ref.state) - flat(res.states[0])) < 1e-2 * moved


def test_failed_replica_contributes_nothing_and_rejoins_identical():
    seen = []

    def recording_fold(grads_in_rank_order):
        seen.append([float(sum(np.abs(np.asarray(x)).sum() for x in jax.tree.leaves(g))) for g in grads_in_rank_order])
        total = grads_in_rank_order[0]
        for g in grads_in_rank_order[1:]:
            total = jax.tree.map(lambda a, b: a + b, total, g)
        return total

    twin = Twin(CFG, 3, reduce=recording_fold)
    alive = _mask(8, 3, down=[(1, 2, 5)])  # replica 1 is absent for steps 2, 3, 4
    res = twin.run(alive, intervention="linear", record_hashes=True, check_identical=True)
    assert [r.num_contributing for r in res.steps] == [3, 3, 2, 2, 2, 2, 3, 3]
    assert [r.num_members for r in res.steps] == [3, 3, 2, 2, 2, 3, 3, 3]
    assert [r.lr_scale for r in res.steps] == pytest.approx([1, 1] + [2 / 3] * 4 + [1, 1])  # linear: healthy/total
    # on the ring: two members while it is away; at its rejoin step (5) it sends exactly zero
    assert [len(s) for s in seen] == [3, 3, 2, 2, 2, 3, 3, 3]
    assert seen[5][1] == 0.0 and seen[5][0] > 0 and seen[5][2] > 0
    assert all(v > 0 for s in seen[6:] for v in s)
    # absent: no hash; behind at step 5, then identical to the others from the rejoin on
    assert [r.hashes[1] is None for r in res.steps] == [False, False, True, True, True, False, False, False]
    for rec in res.steps[5:]:
        assert len(set(rec.hashes)) == 1
    # exactly once: replica 1 trained 2 + 2 batches (not the 3 absent steps, not its behind step)
    assert [ld.position for ld in res.loaders] == [8, 4, 8]
    assert res.steps[-1].batches == 20
    # membership changed four times, yet each program compiled once (invariant 4)
    assert twin._apply_jit._cache_size() == 1 and twin.ts.compute_grads._cache_size() == 1


def test_intervention_only_matters_while_replicas_are_missing(twin3):
    clean = {m: step_hashes(CFG, _mask(4, 3), intervention=m)[-1][0] for m in ("none", "sqrt")}
    assert clean["none"] == clean["sqrt"]
    alive = _mask(4, 3, down=[(2, 1, 3)])
    a = twin3.run(alive, intervention="none", record_hashes=True).steps
    b = twin3.run(alive, intervention="sqrt", record_hashes=True).steps
    assert a[0].hashes == b[0].hashes and a[1].hashes != b[1].hashes


def test_until_batches_trains_the_baselines_amount_of_data(twin3):
    alive = _mask(6, 3, down=[(0, 2, 4)])
    res = twin3.run(alive, until_batches=18, eval_every=2)
    # replica 0 misses 2 steps absent + 1 behind = 3 batches = exactly one extra step of 3 replicas
    assert res.steps[-1].batches == 18 and len(res.steps) == 7
    assert [ld.position for ld in res.loaders] == [4, 7, 7]
    assert res.evals[-1][0] == len(res.steps) and all(np.isfinite(e[2]) for e in res.evals)


def test_bad_masks_are_refused_clearly(twin3):
    with pytest.raises(TwinError, match=r"shape \(steps, 3\)"):
        twin3.run(np.ones((4, 2), bool))
    with pytest.raises(TwinError, match="no replica is up at step 2"):
        twin3.run(_mask(4, 3, down=[(0, 2, 3), (1, 2, 3), (2, 2, 3)]))
    with pytest.raises(TwinError, match="up at step 0"):
        twin3.run(_mask(4, 3, down=[(0, 0, 1)]))
    # windows back to back: at step 2, 0 and 1 come back as 2 goes; none of them can catch up
    # from anyone (before: ZeroDivisionError at the catch-up)
    with pytest.raises(TwinError, match="no replica is healthy at step 2"):
        twin3.run(_mask(4, 3, down=[(0, 1, 2), (1, 1, 2), (2, 2, 3)]))


def test_scaled_failure_windows_leave_a_healthy_replica_between_them():
    """A schedule whose windows fill their slots leaves a step between consecutive ones (before:
    back to back, replica 0 went down the step replica 1 came back, and the twin divided by 0)."""
    sc = schedules.scale("d2x_fp32_for2.5k_1reps", schedules.ScaleRule(200, 2), seed=0)
    (a, b) = sc.failures
    assert a.end < b.start and schedules.no_healthy_steps(sc.alive) == []
    stranded = np.ones((5, 2), bool)
    stranded[1, 0] = stranded[2, 1] = False
    assert schedules.no_healthy_steps(stranded) == [2]
    with pytest.raises(schedules.ScheduleError, match="healthy at step 2"):
        schedules.mask_from_outages(5, 2, [(0, 1, 2), (1, 2, 3)])


def test_twin_runs_a_scaled_paper_schedule(twin3):
    sc = schedules.scale("d1x_fp32_for4k_2reps", schedules.ScaleRule(20, 3), seed=0)
    res = twin3.run(sc.alive, intervention="sqrt", check_identical=True)
    f = sc.failures[0]
    assert min(r.num_contributing for r in res.steps) == 1
    assert [r.num_contributing for r in res.steps[f.start:f.end]] == [1] * (f.end - f.start)
