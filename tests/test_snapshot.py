"""Lazy host snapshots: sharded state assembled whole, checksummed, double-buffered."""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fthsdp.checkpoint.snapshot import (
    FORMAT_VERSION,
    HostBuffer,
    Manifest,
    SnapshotError,
    Snapshotter,
    StaleStepError,
    checksum,
    restore_tree,
)
from fthsdp.config import Config, DataConfig, ModelConfig, OptimConfig
from fthsdp.step.sharding import fsdp_shardings, replica_mesh
from fthsdp.step.functional import make_train_step

CFG = Config(
    model=ModelConfig(d_model=32, num_layers=1, num_heads=2, max_seq_len=16),
    data=DataConfig(seq_len=16, batch_size=8, corpus_bytes=1 << 16),
    optim=OptimConfig(lr=1e-2, warmup_steps=0, decay="constant"),
)


def _tree(seed=0):
    mesh = replica_mesh(4)
    rng = np.random.default_rng(seed)
    tree = {
        "w": rng.standard_normal((64, 48)).astype(np.float32),  # sharded on axis 0
        "v": rng.standard_normal((3, 5)).astype(np.float32),  # cannot split by 4: replicated
        "h": jnp.asarray(rng.standard_normal((8, 4)), jnp.bfloat16),
        "n": np.int32(seed + 11),
    }
    return jax.device_put(tree, fsdp_shardings(tree, mesh))


def _host(tree):
    return {k: np.asarray(v) for k, v in tree.items()}


def test_sharded_state_lands_whole_with_checksums():
    tree = _tree()
    assert not tree["w"].sharding.is_fully_replicated and tree["v"].sharding.is_fully_replicated
    snaps = Snapshotter(piece_bytes=1000)
    snap = snaps.take(3, tree)
    m = snap.manifest
    assert m.step == 3 and m.version == FORMAT_VERSION
    assert [s.path for s in m.leaves] == ["['h']", "['n']", "['v']", "['w']"]
    assert all(s.offset % 64 == 0 for s in m.leaves)
    assert m.leaves[3].nbytes == 64 * 48 * 4 and len(m.checksums[3]) == -(-64 * 48 * 4 // 1000)
    for i, leaf in enumerate(["h", "n", "v", "w"]):
        assert snap.leaf(i).tobytes() == np.asarray(tree[leaf]).tobytes()
        assert snap.leaf(i).dtype == np.asarray(tree[leaf]).dtype
    for i, k in m.pieces():
        assert checksum(snap.piece(i, k)) == m.checksums[i][k]
    back = restore_tree(m, snap.buffer, like=tree)
    assert back["w"].sharding == tree["w"].sharding
    for k in tree:
        assert np.asarray(back[k]).tobytes() == np.asarray(tree[k]).tobytes()
    flat = restore_tree(m, snap.buffer)
    assert set(flat) == {"['h']", "['n']", "['v']", "['w']"}
    snaps.close()


def test_train_state_roundtrip_bitwise():
    ts = make_train_step(CFG, replica_mesh(4))
    state = ts.init(0)
    snaps = Snapshotter(piece_bytes=4096)
    snap = snaps.take(0, state)
    snap.verify()
    back = restore_tree(snap.manifest, snap.buffer, like=state)
    assert type(back).__name__ == "TrainState"
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        assert a.sharding == b.sharding and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    snaps.close()


def test_begin_returns_before_the_state_is_even_computed():
    @jax.jit
    def slow(x):
        def body(_, y):
            return jnp.tanh(y @ y.T @ y * 1e-3)

        return jax.lax.fori_loop(0, 60, body, x)

    x = jnp.ones((512, 512), jnp.float32)
    slow(x).block_until_ready()  # compile outside the timing
    snaps = Snapshotter()
    y = slow(x)  # async dispatch: still computing
    t0 = time.perf_counter()
    snaps.begin(1, {"y": y})
    t_begin = time.perf_counter() - t0
    snap = snaps.wait()
    t_total = time.perf_counter() - t0
    assert snap.step == 1 and snap.leaf(0).tobytes() == np.asarray(y).tobytes()
    assert t_begin < 0.5 * t_total, (t_begin, t_total)
    snaps.close()


def test_double_buffering_and_leases():
    snaps = Snapshotter(piece_bytes=4096, lease_timeout_s=0.3)
    a, b, c = _tree(1), _tree(2), _tree(3)
    s1 = snaps.take(1, a)
    buf1 = s1.buffer
    with snaps.lease(1) as held:
        s2 = snaps.take(2, b)  # goes to the other slot: the served one is untouched
        assert s2.buffer is not buf1 and snaps.served_step() == 2
        assert held.leaf(3).tobytes() == np.asarray(a["w"]).tobytes()
        with snaps.lease(1) as again:  # the previous step stays servable until its slot is reused
            assert again.step == 1
        with snaps.lease() as latest:
            assert latest.step == 2
        # step 3 would overwrite step 1's slot, still being read: refused after the lease timeout
        with pytest.raises(SnapshotError, match="still being read by a peer"):
            snaps.take(3, c)
    s3 = snaps.take(3, c)
    assert s3.buffer is buf1  # slots are reused, not reallocated
    assert s3.leaf(3).tobytes() == np.asarray(c["w"]).tobytes()
    with pytest.raises(StaleStepError, match="step 1 is not available: step 3 is served"):
        with snaps.lease(1):
            pass
    with snaps.lease(2) as held:
        assert held.step == 2 and held.leaf(3).tobytes() == np.asarray(b["w"]).tobytes()
    with snaps.lease(3) as held:
        assert held.step == 3
    snaps.close()


def test_a_replica_whose_snapshot_cannot_be_taken_trains_on():
    """The replica's snapshot hook runs after a commit: a peer holding every spare slot past the
    lease (a stuck fetch) made it raise, the healthy replica exited replica-fatal, and, as it
    ran before the commit's ledger line, left a committed batch out of the ledger. Now it
    serves no snapshot of that step (a fetch is told to ask again) and trains on, at once."""
    import collections
    import types

    from fthsdp.replica.process import ReplicaProcess

    State = collections.namedtuple("State", "step w")
    snaps = Snapshotter(piece_bytes=4096, lease_timeout_s=0.2)
    fake = types.SimpleNamespace(snapshots=snaps, _snapshot_step=-1, rid="1", group=types.SimpleNamespace(
        num_processes=1), mgr=types.SimpleNamespace(state=None, data_state=lambda: {"p": np.zeros(2, np.int64)}))

    def at(step):
        fake.mgr.state = State(np.int32(step), np.full(1000, step, np.float32))

    at(1)
    ReplicaProcess.snapshot(fake)
    snaps.wait()
    assert fake._snapshot_step == 1
    at(2)
    ReplicaProcess.snapshot(fake)
    snaps.wait()
    with snaps.lease(1):  # a stuck peer reads step 1, the slot step 3 must reuse
        at(3)
        t0 = time.monotonic()
        ReplicaProcess.snapshot(fake)  # no exception, no wait for the peer: no snapshot of step 3
        assert time.monotonic() - t0 < 0.1 and not snaps.pending and snaps.served_step() == 2
        ReplicaProcess.snapshot(fake)  # not taken, so asked again at step 3 it is tried again: skipped again
        assert not snaps.pending and snaps.served_step() == 2
    at(4)
    ReplicaProcess.snapshot(fake)  # the lease is gone: the next commit's snapshot is taken
    snaps.wait()
    assert fake._snapshot_step == 4 and snaps.served_step() == 4
    # a copy that fails in the background: the same step is taken again when asked (a retry of
    # the step), and its failure does not cost the next step's snapshot
    land, failed = snaps._land, []

    def fails_once(*args):
        if not failed:
            failed.append(True)
            raise OSError("host memory exhausted")
        return land(*args)

    snaps._land = fails_once
    at(5)
    ReplicaProcess.snapshot(fake)  # its copy fails off the training thread
    while snaps.pending:
        time.sleep(0.01)
    assert failed and snaps.served_step() == 4
    ReplicaProcess.snapshot(fake)  # asked again at step 5: taken again, the old failure only logged
    snaps.wait()
    assert fake._snapshot_step == 5 and snaps.served_step() == 5
    snaps.close()


def test_a_slot_to_reuse_takes_no_new_lease_so_overlapping_readers_cannot_hold_it():
    """A peer fetching the older step with two streams takes a lease per piece and the leases
    overlap, so the slot's count may never reach 0 on its own: begin() of the next-but-one step
    stops new leases of that slot (their fetch is told the step is stale) and waits only for the
    pieces in flight, instead of timing out and failing the healthy replica."""
    import threading

    snaps = Snapshotter(piece_bytes=4096, lease_timeout_s=5.0)
    snaps.take(1, _tree(1))
    snaps.take(2, _tree(2))
    stop, stale, served = threading.Event(), [], []

    def stream():
        while not stop.is_set():
            try:
                with snaps.lease(1):
                    served.append(1)
                    time.sleep(0.03)
            except StaleStepError:
                stale.append(1)
                return

    readers = [threading.Thread(target=stream) for _ in range(2)]
    for t in readers:
        t.start()
        time.sleep(0.015)  # staggered: one of them holds a lease at every moment
    try:
        while len(served) < 6:
            time.sleep(0.01)
        t0 = time.monotonic()
        s3 = snaps.take(3, _tree(3))
        assert time.monotonic() - t0 < 1.0 and s3.step == 3  # not the 5 s lease timeout
        for t in readers:
            t.join(5)
        assert len(stale) == 2  # both streams were told step 1 is gone
    finally:
        stop.set()
        for t in readers:
            t.join(5)
        snaps.close()


def test_no_snapshot_yet_is_stale():
    with pytest.raises(StaleStepError, match="no snapshot yet"):
        with Snapshotter().lease(0):
            pass


def test_manifest_json_roundtrip_and_validation():
    snap = Snapshotter(piece_bytes=512).take(9, {"a": np.arange(1000, dtype=np.float32)})
    m = Manifest.from_json(snap.manifest.to_json())
    assert m == snap.manifest
    d = json.loads(snap.manifest.to_json())
    with pytest.raises(SnapshotError, match="version 99 is not supported"):
        Manifest.from_json(json.dumps({**d, "version": 99}))
    with pytest.raises(SnapshotError, match="not a snapshot manifest"):
        Manifest.from_json(json.dumps({**d, "format": "x"}))
    with pytest.raises(SnapshotError, match="not valid JSON"):
        Manifest.from_json(b"<html>")
    bad = {**d, "checksums": [[1]]}
    with pytest.raises(SnapshotError, match="checksums for 8 pieces"):
        Manifest.from_json(json.dumps(bad))


def test_a_manifest_that_describes_no_real_buffer_is_refused():
    """What a lying or broken peer could claim: each is refused before anything is allocated."""
    tree = {"a": np.arange(1000, dtype=np.float32), "b": np.ones((3, 5), np.int8)}
    snap = Snapshotter(piece_bytes=512).take(9, tree)
    d = json.loads(snap.manifest.to_json())
    a, b = d["leaves"]

    def refused(match: str, **changes) -> None:
        with pytest.raises(SnapshotError, match=match):
            Manifest.from_json(json.dumps({**d, **changes}).replace('"HUGE"', "1e400"))

    refused("says 0 bytes for shape", leaves=[{**a, "nbytes": 0}, b], checksums=[[0], d["checksums"][1]])
    refused("says -4 bytes", leaves=[{**a, "nbytes": -4}, b])
    refused("overlaps the leaf before it", leaves=[a, {**b, "offset": a["offset"] + 64}])
    refused("lies outside", leaves=[a, {**b, "offset": d["total_bytes"]}])
    refused("buffer for leaves that end at byte", total_bytes=10**30)
    refused("dtype 'float99'", leaves=[{**a, "dtype": "float99"}, b])
    refused("dtype 'object'", leaves=[{**a, "dtype": "object", "nbytes": 8000}, b])
    refused("malformed: OverflowError", step="HUGE")
    with pytest.raises(SnapshotError, match="not valid JSON"):
        Manifest.from_json("[" * 100_000)
    assert Manifest.from_json(json.dumps(d)) == snap.manifest  # the honest one still reads
    # a manifest valid on its own, but not where this build lays those leaves out: refused on restore
    moved = Manifest.from_json(json.dumps({**d, "leaves": [a, {**b, "offset": b["offset"] + 64}],
                                           "total_bytes": d["total_bytes"] + 64}))
    with pytest.raises(SnapshotError, match="lays its leaves out"):
        restore_tree(moved, HostBuffer(moved.total_bytes), like=tree)


def test_restore_into_a_different_structure_is_refused():
    snap = Snapshotter().take(1, {"a": np.zeros(4, np.float32)})
    with pytest.raises(SnapshotError, match="target pytree has 2 leaves"):
        restore_tree(snap.manifest, snap.buffer, like={"a": np.zeros(4, np.float32), "b": np.zeros(1)})
    with pytest.raises(SnapshotError, match=r"leaf 0 differs"):
        restore_tree(snap.manifest, snap.buffer, like={"a": np.zeros(5, np.float32)})


def test_host_buffer_is_page_aligned():
    buf = HostBuffer(3 * 4096 + 5)
    assert buf.array.ctypes.data % 4096 == 0 and buf.array.size == 3 * 4096 + 5
    buf.array[:] = 7
    assert int(buf.array.sum()) == 7 * buf.array.size


def test_bad_arguments():
    with pytest.raises(ValueError, match="piece_bytes"):
        Snapshotter(piece_bytes=0)
    with pytest.raises(ValueError, match="slots must be >= 2"):
        Snapshotter(slots=1)


def test_copy_thread_runs_below_the_training_threads():
    snaps = Snapshotter(nice=7)
    snaps.take(1, {"a": np.zeros(8, np.float32)})
    assert os.getpriority(os.PRIO_PROCESS, snaps.worker_tid) == os.getpriority(os.PRIO_PROCESS, 0) + 7
    snaps.close()


def _w(snap) -> bytes:
    """The bytes of leaf 'w' (leaf 3 in jax.tree_util order) of a snapshot of `_tree`."""
    return snap.leaf(3).tobytes()


def test_begin_never_waits_for_a_peer_holding_the_slot_to_reuse(caplog):
    """A rejoiner stopped mid-piece (SIGSTOP) holds its lease until the server's send deadline
    (ft.peer_send_s, 60 s). The survivors commit twice; the second begin() must reuse that slot.
    It waited for the lease, the replica missed its all-reduce deadline and everyone retried. Now
    it skips that snapshot at once (logged once) and keeps serving the previous one."""
    import logging
    import threading

    caplog.set_level(logging.INFO, logger="fthsdp.checkpoint.snapshot")
    snaps = Snapshotter(piece_bytes=4096, lease_timeout_s=5.0)
    trees = {s: _tree(s) for s in range(1, 7)}
    snaps.take(1, trees[1])
    snaps.take(2, trees[2])
    holding, release = threading.Event(), threading.Event()

    def stopped_peer() -> None:  # it leased step 2, the newest when it asked, and stopped
        with snaps.lease(2):
            holding.set()
            release.wait(30)

    peer = threading.Thread(target=stopped_peer)
    peer.start()
    try:
        assert holding.wait(5)
        took = []
        for step in (3, 4, 5):  # 3 lands in step 1's slot; 4 and 5 need step 2's, which the peer reads
            t0 = time.monotonic()
            started = snaps.begin(step, trees[step])
            snaps.wait()
            took.append(time.monotonic() - t0)
            assert started == (step == 3)
        assert max(took) < 1.0, took  # not the 5 s lease timeout, nor the peer's send deadline
        assert snaps.served_step() == 3
        with snaps.lease() as latest:
            assert latest.step == 3 and _w(latest) == np.asarray(trees[3]["w"]).tobytes()
        with pytest.raises(StaleStepError, match="step 4 is not available: step 3 is served"):
            with snaps.lease(4):
                pass
        with pytest.raises(StaleStepError, match="step 2 is not available"):  # the slot to reuse takes no new lease
            with snaps.lease(2):
                pass
        skipped = [r for r in caplog.records if r.levelno == logging.WARNING and "skipped" in r.getMessage()]
        assert len(skipped) == 1, [r.getMessage() for r in skipped]  # once per run of skips, not per step
    finally:
        release.set()
        peer.join(5)
    assert snaps.begin(6, trees[6])  # the peer let go: the next commit's snapshot is taken
    snap = snaps.wait()
    assert snap.step == 6 and _w(snap) == np.asarray(trees[6]["w"]).tobytes()
    snap.verify()
    assert any("resume" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    with snaps.lease(3) as prev:  # the previous step is still servable, whole
        assert _w(prev) == np.asarray(trees[3]["w"]).tobytes()
    snaps.close()


def test_a_later_snapshot_of_a_step_supersedes_the_earlier_one():
    """After a lineage fence a forked replica's state at step s is replaced by the lineage's state at
    step s, and the replica snapshots step s again. lease(s) served the first slot holding step s,
    which could be the forked copy; a fetcher would install it, checksums and all."""
    snaps = Snapshotter(piece_bytes=4096)
    forked, lineage = _tree(1), _tree(2)
    snaps.take(7, forked)
    snap = snaps.take(7, lineage)
    assert snap.step == 7 and _w(snap) == np.asarray(lineage["w"]).tobytes()
    for step in (7, None):
        with snaps.lease(step) as held:
            assert held.step == 7 and _w(held) == np.asarray(lineage["w"]).tobytes()
    assert [s.snap.step for s in snaps._slots if s.snap is not None] == [7]  # the forked copy is gone
    snaps.close()


def test_a_superseded_snapshot_is_not_served_while_its_replacement_lands():
    """From the moment the replica begins a new snapshot of a step, the old bytes of that step are
    not served to a new lease; one already being read finishes on the bytes its manifest describes.
    A snapshot of a later step (a replica rewound to an earlier one) is not served either."""
    import threading

    snaps = Snapshotter(piece_bytes=4096)
    forked, lineage = _tree(1), _tree(2)
    snaps.take(6, _tree(0))
    snaps.take(7, forked)
    gate, land = threading.Event(), snaps._land

    def land_when_let(*args) -> None:  # holds the copy in flight: the real copy, once let go
        gate.wait(10)
        land(*args)

    snaps._land = land_when_let
    with snaps.lease(7) as reading:
        assert snaps.begin(7, lineage)  # the replica's state at step 7 was replaced
        with pytest.raises(StaleStepError, match="step 7 is not available: no snapshot yet"):
            with snaps.lease(7):
                pass
        with pytest.raises(StaleStepError, match="no snapshot yet"):
            with snaps.lease():
                pass
        gate.set()
        snaps.wait()
        assert _w(reading) == np.asarray(forked["w"]).tobytes()  # the reader's bytes were not touched
    with snaps.lease(7) as held:
        assert _w(held) == np.asarray(lineage["w"]).tobytes()
    snaps._land = land
    snaps.take(5, _tree(5))  # rewound to step 5: step 7 is no longer this replica's history
    with pytest.raises(StaleStepError, match="step 7 is not available: step 5 is served"):
        with snaps.lease(7):
            pass
    snaps.close()


def test_concurrent_begins_land_in_separate_slots():
    """begin() from two threads picked the same free slot: the later copy overwrote the bytes of the
    one just served (under any lease of it), and one of the two snapshots was lost. Now begins run
    one at a time: the one begun last is served, and the other one stays servable in its own slot
    unless it was of a later step (then the replica was rewound past it, see the module docstring)."""
    import threading

    snaps = Snapshotter(piece_bytes=4096)
    trees = [_tree(s) for s in range(4)]
    for rnd in range(20):
        barrier = threading.Barrier(2)
        steps = (2 * rnd + 1, 2 * rnd + 2)

        def go(step: int) -> None:
            barrier.wait(5)
            snaps.begin(step, trees[step % 4])

        threads = [threading.Thread(target=go, args=(s,)) for s in steps]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        last = snaps.wait()
        assert last is not None and last.step in steps
        if last.step == steps[0]:  # step 2r+2 was begun first: the begin of 2r+1 rewound past it
            with pytest.raises(StaleStepError, match=f"step {steps[1]} is not available"):
                with snaps.lease(steps[1]):
                    pass
            servable = steps[:1]
        else:
            servable = steps
        for step in servable:  # each landed whole, in its own slot
            with snaps.lease(step) as held:
                held.verify()
                assert _w(held) == np.asarray(trees[step % 4]["w"]).tobytes()
    snaps.close()
