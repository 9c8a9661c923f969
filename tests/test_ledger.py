"""The exactly-once ledger: duplicates, gaps, restores, torn tails."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fthsdp.data.ledger import (Ledger, LedgerError, Restore, Rollback, check_exactly_once, discarded_commits,
                                live_commits, live_positions, read_ledger)


def _run(tmp_path, script):
    """Writes ledgers through the given callables, one per replica."""
    paths = {}
    for r, events in script.items():
        paths[r] = tmp_path / f"ledger_{r}.jsonl"
        with Ledger(paths[r], r) as led:
            for kind, *args in events:
                getattr(led, kind)(*args)
    return paths


def test_clean_run_is_exactly_once(tmp_path):
    paths = _run(tmp_path, {0: [("commit", s, s - 1) for s in range(1, 6)], 1: [("commit", s, s - 1) for s in range(1, 6)]})
    rep = check_exactly_once(paths.values(), {0: 5, 1: 5})
    assert rep.ok and rep.counted == 10, rep.summary()


def test_duplicate_and_gap_are_named(tmp_path):
    # replica 0 trains position 2 twice (a retried step that had in fact committed), replica 1 skips position 3
    paths = _run(tmp_path, {
        0: [("commit", 1, 0), ("commit", 2, 1), ("commit", 3, 2), ("commit", 4, 2), ("commit", 5, 3)],
        1: [("commit", 1, 0), ("commit", 2, 1), ("commit", 3, 2), ("commit", 4, 4)],
    })
    rep = check_exactly_once(paths.values(), {0: 4, 1: 5})
    assert not rep.ok
    assert rep.duplicates == {(0, 2): [3, 4]}
    assert rep.gaps == {1: [3]}
    assert "replica 0, position 2" in rep.summary() and "replica 1: 3" in rep.summary()


def test_batches_past_the_end_and_two_batches_in_one_step(tmp_path):
    paths = _run(tmp_path, {0: [("commit", 1, 0), ("commit", 1, 1), ("commit", 2, 2)]})
    rep = check_exactly_once(paths.values(), {0: 2})
    assert rep.unexpected == {0: [2]}
    assert rep.step_conflicts == {(0, 1): [0, 1]}
    assert not rep.ok


def test_full_restart_rolls_back_commits_after_the_checkpoint(tmp_path):
    # steps 1..4 committed, the job dies, resumes from the checkpoint of step 2 and retrains positions 2, 3
    pre = [("commit", s, s - 1) for s in range(1, 5)]
    paths = _run(tmp_path, {0: pre, 1: pre})
    time.sleep(0.001)
    for r in (0, 1):
        with Ledger(paths[r], r) as led:
            led.restore(2, "restart-1")
            led.commit(3, 2)
            led.commit(4, 3)
    rep = check_exactly_once(paths.values(), {0: 4, 1: 4})
    assert rep.ok, rep.summary()
    assert rep.rolled_back == 4
    # a replica that did not log the restore itself is still rolled back (restores apply to every ledger)
    paths2 = _run(tmp_path / "b", {0: pre, 1: pre})
    with Ledger(paths2[0], 0) as led:
        led.restore(2, "restart-1")
        led.commit(3, 2)
        led.commit(4, 3)
    rep2 = check_exactly_once(paths2.values(), {0: 4, 1: 4})
    assert rep2.gaps == {1: [2, 3]} and not rep2.duplicates


def test_a_fenced_replica_rolls_back_its_discarded_commits(tmp_path):
    """The split brain of rule 6 (fthsdp.control.quorum): replicas 0 and 1 commit steps 3..5
    in a quorum that replica 2 (alone) later re-decides from step 3 on; 0 and 1 are fenced
    and install 2's state of step 6, which holds their batches 0 and 1 only, then train
    batches 2, 3 ... again. Without a rollback their batches 2..4 count twice."""
    fork = [("commit", 1, 0), ("commit", 2, 1), ("commit", 3, 2), ("commit", 4, 3), ("commit", 5, 4)]
    paths = _run(tmp_path, {0: fork, 1: fork, 2: [("commit", s, s - 1) for s in range(1, 3)]})
    for r in (0, 1):
        with Ledger(paths[r], r) as led:
            for s in (7, 8, 9):
                led.commit(s, s - 5)  # batches 2, 3, 4 again, on the lineage's state
    with Ledger(paths[2], 2) as led:
        for s in range(3, 10):
            led.commit(s, s - 1)
    rep = check_exactly_once(paths.values(), {0: 5, 1: 5, 2: 9})
    assert rep.duplicates and not rep.ok  # the over-count this fixes
    assert rep.duplicates[(0, 2)] == [3, 7]
    # The same, with the rollback each fenced replica writes when it installs the lineage's state.
    paths = _run(tmp_path / "b", {0: fork, 1: fork, 2: [("commit", s, s - 1) for s in range(1, 3)]})
    for r in (0, 1):
        with Ledger(paths[r], r) as led:
            gone = discarded_commits(read_ledger(paths[r]), 2)
            assert [c.step for c in gone] == [3, 4, 5]
            led.rollback(6, min(c.step for c in gone), max(c.step for c in gone))
            for s in (7, 8, 9):
                led.commit(s, s - 5)
    with Ledger(paths[2], 2) as led:
        for s in range(3, 10):
            led.commit(s, s - 1)
    rep = check_exactly_once(paths.values(), {0: 5, 1: 5, 2: 9})
    assert rep.ok and rep.rolled_back == 6 and rep.counted == 19, rep.summary()
    (rb,) = [r for r in read_ledger(paths[0]).records if isinstance(r, Rollback)]
    assert (rb.step, rb.first, rb.last, rb.replica) == (6, 3, 5, 0)
    # The rollback voids its own replica's commits only, and only those recorded before it.
    assert live_positions(read_ledger(paths[0])) == {0, 1, 2, 3, 4}
    assert [c.step for c in live_commits(read_ledger(paths[0]))] == [1, 2, 7, 8, 9]


def test_a_ledgers_own_order_is_its_file_order_whatever_the_clock_says(tmp_path, monkeypatch):
    """A rollback or restore voids the commits above it in its own ledger, even when the clock
    was stepped back between them (a reboot, NTP): by wall clock the rollback came "first" and
    voided nothing, and the retrained batch counted twice."""
    import fthsdp.data.ledger as ledger_mod

    clock = iter([100, 50, 60, 70, 40, 45])  # each append reads it once
    monkeypatch.setattr(ledger_mod.time, "time_ns", lambda: next(clock))
    p = tmp_path / "ledger_0.jsonl"
    with Ledger(p, 0) as led:
        led.commit(3, 2)  # t=100
        led.rollback(2, 3, 3)  # t=50: the clock went back
        led.commit(3, 2)  # t=60: the batch trained again, on the installed state
        led.commit(4, 3)  # t=70
        led.restore(3, "r1")  # t=40: a restart from step 3 voids the commit of step 4 above it
        led.commit(4, 3)  # t=45
    contents = read_ledger(p)
    assert [c.t_ns for c in live_commits(contents)] == [60, 45]
    rep = check_exactly_once([p], {0: 4})
    assert not rep.duplicates and not rep.step_conflicts and rep.rolled_back == 2, rep.summary()


def test_a_record_written_in_part_is_cut_back_so_the_ledger_stays_readable(tmp_path):
    """A short write (a nearly full disk) never leaves half a line for the next record to
    follow: that line in the middle of the file made every later read refuse the ledger."""
    p = tmp_path / "l.jsonl"

    class ShortWrites:  # the raw file's write() stores part of the line, then fails
        def __init__(self, f):
            self.f, self.calls = f, 0

        def write(self, view):
            self.calls += 1
            if self.calls == 1:
                return self.f.write(bytes(view[:10]))
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    with Ledger(p, 0) as led:
        led.commit(1, 0)
        real = led._f
        for _ in range(2):  # twice in a row: the second cut must not pad the file with NULs
            led._f = ShortWrites(real)
            with pytest.raises(OSError, match="No space"):
                led.commit(2, 1)
        led._f = real
        led.commit(2, 1)  # space again: the next record starts on its own line
    assert b"\x00" not in p.read_bytes()
    assert [r.position for r in read_ledger(p).records] == [0, 1]


@pytest.mark.parametrize("line", [b"null", b"5", b'"x"', b"[1, 2]"])
def test_a_line_that_is_not_a_record_is_named_not_a_crash(tmp_path, line):
    p = tmp_path / "l.jsonl"
    with Ledger(p, 0) as led:
        led.commit(1, 0)
    p.write_bytes(line + b"\n" + p.read_bytes())
    with pytest.raises(LedgerError, match="line 1 is damaged.*not a JSON object"):
        read_ledger(p)


def test_rollback_arguments_are_checked(tmp_path):
    with Ledger(tmp_path / "l.jsonl", 0) as led:
        for bad in ((5, 0, 2), (5, 4, 3), (-1, 1, 2)):
            with pytest.raises(ValueError, match="rollback"):
                led.rollback(*bad)


def test_replicas_disagreeing_on_a_restart_is_an_error(tmp_path):
    paths = _run(tmp_path, {0: [("restore", 2, "r1")], 1: [("restore", 3, "r1")]})
    with pytest.raises(LedgerError, match="restore one checkpoint everywhere"):
        check_exactly_once(paths.values(), {})


def test_torn_last_line_is_skipped_and_cut_before_appending(tmp_path):
    p = tmp_path / "ledger_0.jsonl"
    with Ledger(p, 0) as led:
        led.commit(1, 0)
        led.commit(2, 1)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 10])  # the second record lost its end in a crash
    got = read_ledger(p)
    assert got.torn_tail and len(got.records) == 1
    with Ledger(p, 0) as led:
        assert led.repaired
        led.commit(2, 1)
    got = read_ledger(p)
    assert not got.torn_tail and [r.position for r in got.records] == [0, 1]
    assert check_exactly_once([p], {0: 2}).ok


def test_record_missing_only_its_newline_is_kept(tmp_path):
    p = tmp_path / "l.jsonl"
    with Ledger(p, 0) as led:
        led.commit(1, 0)
    p.write_bytes(p.read_bytes().rstrip(b"\n"))
    assert len(read_ledger(p).records) == 1
    with Ledger(p, 0) as led:
        assert not led.repaired
        led.commit(2, 1)
    assert [r.position for r in read_ledger(p).records] == [0, 1]


def test_damaged_middle_line_is_an_error(tmp_path):
    p = tmp_path / "l.jsonl"
    with Ledger(p, 0) as led:
        for s in range(1, 4):
            led.commit(s, s - 1)
    lines = p.read_bytes().split(b"\n")
    doc = json.loads(lines[1])
    doc["position"] = 7  # altered after the fact: the CRC no longer matches
    lines[1] = json.dumps(doc).encode()
    p.write_bytes(b"\n".join(lines))
    with pytest.raises(LedgerError, match="line 2 is damaged"):
        read_ledger(p)


def test_writer_killed_mid_stream_leaves_a_readable_ledger(tmp_path):
    p = tmp_path / "l.jsonl"
    code = (
        "import sys\nfrom fthsdp.data.ledger import Ledger\n"
        f"led = Ledger({str(p)!r}, 3)\n"
        "s = 1\n"
        "while True:\n"
        "    led.commit(s, s - 1); s += 1\n"
        "    if s == 50: print('go', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=os.getcwd())
    assert proc.stdout.readline().strip() == b"go"
    proc.kill()
    proc.wait(timeout=10)
    got = read_ledger(p)
    n = len(got.records)
    assert n >= 49
    assert [r.position for r in got.records] == list(range(n))
    assert check_exactly_once([got], {3: n}).ok


def test_bad_arguments_are_refused(tmp_path):
    with Ledger(tmp_path / "x", 0) as led:
        with pytest.raises(ValueError, match="step >= 1"):
            led.commit(0, 0)
        with pytest.raises(ValueError, match="restore step"):
            led.restore(-1, "r")
        with pytest.raises(ValueError, match="restart id"):
            led.restore(1, "")
    with pytest.raises(ValueError, match="replica"):
        Ledger(tmp_path / "y", -1)


# -- a full restart, end to end: persistent checkpoint + loader positions + ledger ----------------

def _cfg():
    from fthsdp.config import Config, DataConfig, ModelConfig, OptimConfig

    return Config(
        model=ModelConfig(d_model=32, num_layers=1, num_heads=2, max_seq_len=16),
        data=DataConfig(seq_len=16, batch_size=8, corpus_bytes=1 << 16),
        optim=OptimConfig(lr=1e-2, warmup_steps=0, decay="constant"),
    )


def _train(workdir: str, steps: int, every: int, restart: str) -> None:
    """Script mode: one replica's loop with everything issue 6 records after each commit."""
    import jax

    from fthsdp.checkpoint.persistent import PersistentCheckpointer
    from fthsdp.data import LoaderState, ReplicaStream
    from fthsdp.data.loader_state import LoaderStateStore
    from fthsdp.devices import enable_compilation_cache
    from fthsdp.step.quorum_inputs import make_quorum_inputs
    from fthsdp.step.sharding import replica_mesh
    from fthsdp.step.functional import make_train_step

    enable_compilation_cache()
    cfg = _cfg()
    ts = make_train_step(cfg, replica_mesh(4))
    pc = PersistentCheckpointer(os.path.join(workdir, "ckpt"), every=every)
    store = LoaderStateStore(os.path.join(workdir, "loader"))
    ledger = Ledger(os.path.join(workdir, "ledger_0.jsonl"), 0)
    state, step, pos = ts.init(0), 0, 0
    if pc.latest_step() is not None:  # a full restart: the checkpoint's state *and* its loader positions
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        r = pc.restore(abstract)
        state, step, pos = r.state, r.step, r.loader_positions[0]
    # Every (re)start logs where it starts from, step 0 included: a job killed before its first
    # checkpoint was durable starts over, and what it had committed is void.
    ledger.restore(step, restart)
    stream = ReplicaStream(cfg.data, 0)
    while step < steps:
        b = stream.batch(pos)
        x, y = ts.shard_batch(b.inputs, b.targets)
        state, m = ts.step(state, x, y, make_quorum_inputs())
        assert bool(m["committed"])
        step, pos = step + 1, pos + 1
        ledger.commit(step, pos - 1)
        store.save(LoaderState(0, pos), step)
        pc.save(step, state, {0: pos})
        print(step, flush=True)
        time.sleep(0.05)
    pc.close()
    print("done", flush=True)


def test_full_restart_trains_every_batch_exactly_once(tmp_path):
    import jax
    import numpy as np

    from fthsdp.checkpoint.persistent import PersistentCheckpointer
    from fthsdp.data import ReplicaStream
    from fthsdp.data.loader_state import LoaderStateStore
    from fthsdp.step.quorum_inputs import make_quorum_inputs
    from fthsdp.step.sharding import replica_mesh
    from fthsdp.step.functional import make_train_step

    steps, every = 12, 4
    here = os.path.abspath(__file__)
    run1 = subprocess.Popen([sys.executable, here, "train", str(tmp_path), str(steps), str(every), "first"],
                            stdout=subprocess.PIPE)
    try:
        while run1.stdout.readline().strip() != b"7":
            assert run1.poll() is None, "the first run died before step 7"
        os.kill(run1.pid, signal.SIGKILL)  # every process of the job killed
    finally:
        run1.kill()
        run1.wait()
    before = LoaderStateStore(tmp_path / "loader").load(0)
    assert before.position >= 7
    run2 = subprocess.run([sys.executable, here, "train", str(tmp_path), str(steps), str(every), "second"],
                          capture_output=True, timeout=240)
    assert run2.returncode == 0 and run2.stdout.strip().endswith(b"done"), run2.stderr.decode()[-2000:]

    ledger = read_ledger(tmp_path / "ledger_0.jsonl")
    restores = [r for r in ledger.records if isinstance(r, Restore)]
    assert [r.restart for r in restores] == ["first", "second"] and restores[0].step == 0
    resumed = restores[1].step  # the last durable checkpoint when the job died (0 if none was yet)
    assert resumed % every == 0 and resumed < before.position
    rep = check_exactly_once([ledger], {0: steps})
    assert rep.ok, rep.summary()
    assert rep.rolled_back == before.position - resumed  # trained after the checkpoint, then discarded
    # and the model is the one an uninterrupted run trains, bit for bit
    cfg = _cfg()
    ts = make_train_step(cfg, replica_mesh(4))
    state = ts.init(0)
    for pos in range(steps):
        b = ReplicaStream(cfg.data, 0).batch(pos)
        x, y = ts.shard_batch(b.inputs, b.targets)
        state, _ = ts.step(state, x, y, make_quorum_inputs())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    with PersistentCheckpointer(tmp_path / "ckpt", every=every, writer=False) as pc:
        final = pc.restore(abstract)
    assert final.step == steps and final.loader_positions == {0: steps}
    assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree.leaves(final.state), jax.tree.leaves(state)))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "train":
    _train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
