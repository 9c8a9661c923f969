"""Persistent Orbax checkpoints (read back with plain Orbax) and the peer-restore Orbax extension."""

import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fthsdp.checkpoint.orbax_peer import PeerCheckpointHandler, PeerRestore, PeerSave, restore
from fthsdp.checkpoint.peer_fetch import FetchError, PeerFetcher
from fthsdp.checkpoint.peer_server import Fault, PeerServer, StaticSource
from fthsdp.checkpoint.persistent import CheckpointError, PersistentCheckpointer
from fthsdp.checkpoint.snapshot import Snapshotter
from fthsdp.config import Config, DataConfig, ModelConfig, OptimConfig
from fthsdp.data.stream import ReplicaStream
from fthsdp.step.quorum_inputs import make_quorum_inputs
from fthsdp.step.sharding import replica_mesh
from fthsdp.step.functional import make_train_step

CFG = Config(
    model=ModelConfig(d_model=32, num_layers=1, num_heads=2, max_seq_len=16),
    data=DataConfig(seq_len=16, batch_size=8, corpus_bytes=1 << 16),
    optim=OptimConfig(lr=1e-2, warmup_steps=0, decay="constant"),
)
TOKEN = "tok-123"


@pytest.fixture(scope="module")
def states():
    """(train step, state after 1 step, state after 2 steps)."""
    ts = make_train_step(CFG, replica_mesh(4))
    s0 = ts.init(0)
    out = [s0]
    for pos in range(2):
        b = ReplicaStream(CFG.data, 0).batch(pos)
        x, y = ts.shard_batch(b.inputs, b.targets)
        s, m = ts.step(out[-1], x, y, make_quorum_inputs())
        assert bool(m["committed"])
        out.append(s)
    return ts, out[1], out[2]


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _bytes(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_async_checkpoints_every_k_readable_by_plain_orbax(tmp_path, states):
    _, s1, _ = states
    with PersistentCheckpointer(tmp_path, every=3) as pc:
        started = [pc.save(step, s1, {0: step, 1: step + 100}, {"config": CFG.name}) for step in range(1, 7)]
        assert started == [False, False, True, False, False, True]
        pc.wait()
        assert pc.all_steps() == [3, 6] and pc.latest_step() == 6
        r = pc.restore(_abstract(s1))
        assert r.step == 6 and r.loader_positions == {0: 6, 1: 106} and r.metadata["config"] == CFG.name
        assert type(r.state).__name__ == "TrainState" and _bytes(r.state) == _bytes(s1)
        assert r.state.params["embed"]["embedding"].sharding == s1.params["embed"]["embedding"].sharding \
            if "embed" in r.state.params else True
    # plain Orbax, no fthsdp code involved
    mngr = ocp.CheckpointManager(tmp_path)
    assert mngr.latest_step() == 6
    got = mngr.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(s1)),
                                                  loader=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
    assert _bytes(got["state"]) == _bytes(s1)
    assert got["loader"]["positions"] == {"0": 3, "1": 103} and got["meta"]["step"] == 3
    mngr.close()
    plain = ocp.StandardCheckpointer().restore(os.path.join(tmp_path, "6", "state"), _abstract(s1))
    assert _bytes(plain) == _bytes(s1)


def test_writer_rules_and_errors(tmp_path, states):
    _, s1, _ = states
    with pytest.raises(ValueError, match="every must be >= 1"):
        PersistentCheckpointer(tmp_path / "x", every=0)
    reader = PersistentCheckpointer(tmp_path / "r", every=1, writer=False)
    assert not reader.should_save(5)
    with pytest.raises(CheckpointError, match="not the checkpoint writer"):
        reader.save(5, s1, {0: 5}, force=True)
    with pytest.raises(CheckpointError, match="no persistent checkpoint"):
        reader.restore(_abstract(s1))
    reader.close()
    with PersistentCheckpointer(tmp_path / "w", every=2) as pc:
        with pytest.raises(ValueError, match="non-negative"):
            pc.save(2, s1, {0: -1})
        pc.save(2, s1, {0: 2})
        pc.wait()
        with pytest.raises(CheckpointError, match=r"no checkpoint of step 4 .* have \[2\]"):
            pc.restore(_abstract(s1), step=4)


@pytest.fixture()
def peer_and_disk(tmp_path, states):
    """Peers serve step 2 from memory; the persistent checkpoint on disk is step 1."""
    _, s1, s2 = states
    pc = PersistentCheckpointer(tmp_path, every=1)
    pc.save(1, s1, {0: 1}, force=True)
    pc.wait()
    snaps = Snapshotter(piece_bytes=8 << 10)
    snaps.take(2, s2)
    server = PeerServer(snaps, TOKEN).start()
    yield server, pc, s1, s2
    server.close()
    snaps.close()
    pc.close()


def test_corrupt_loader_positions_are_a_checkpoint_error():
    """A loader-positions item with a null, infinite, non-number or negative position (a corrupt
    file) says so as a CheckpointError, not a TypeError from deep inside the restore."""
    from fthsdp.checkpoint.persistent import LOADER_FORMAT, LOADER_VERSION, positions_from_json

    ok = {"format": LOADER_FORMAT, "version": LOADER_VERSION, "step": 3, "positions": {"0": 3, "1": 103}}
    assert positions_from_json(ok, "x") == {0: 3, 1: 103}
    for bad in (None, float("inf"), "three", [1], -1):
        with pytest.raises(CheckpointError, match="x: .*(malformed|negative)"):
            positions_from_json({**ok, "positions": {"0": bad}}, "x")


def test_orbax_handler_restores_from_peers(peer_and_disk):
    server, pc, s1, s2 = peer_and_disk
    handler = PeerCheckpointHandler()
    got = ocp.Checkpointer(handler).restore(pc.step_dir(1) + "/state",
                                            args=PeerRestore(_abstract(s2), [server.url], TOKEN, step=2))
    assert handler.last_restore.source == "peers" and handler.last_restore.step == 2
    assert _bytes(got) == _bytes(s2)
    assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(s2)))


@pytest.mark.parametrize("why", ["wrong token", "dead peer"])
def test_orbax_handler_falls_back_to_the_persistent_checkpoint(peer_and_disk, why):
    server, pc, s1, s2 = peer_and_disk
    if why == "dead peer":
        url, token = server.url, TOKEN
        server.close()
    else:
        url, token = server.url, "wrong"
    tree, info = restore(_abstract(s2), [url], token, step=2, checkpoint_dir=pc.step_dir(1) + "/state", timeout_s=2)
    assert info.source == "persistent" and info.step == 1  # a whole, consistent older state, never a mix
    assert _bytes(tree) == _bytes(s1)
    assert ("403" if why == "wrong token" else "unreachable") in info.detail["peer_error"]
    with pytest.raises(FetchError, match="no persistent checkpoint to fall back to"):
        restore(_abstract(s2), [url], token, step=2, checkpoint_dir=None, timeout_s=2)
    with pytest.raises(FetchError):
        restore(_abstract(s2), [url], token, step=2, checkpoint_dir=pc.step_dir(1) + "/state", fallback=False,
                timeout_s=2)


def test_checkpoint_manager_item_handler(peer_and_disk):
    server, pc, s1, s2 = peer_and_disk
    handler = PeerCheckpointHandler()
    mngr = ocp.CheckpointManager(pc.directory, item_handlers={"state": handler, "loader": ocp.JsonCheckpointHandler(),
                                                               "meta": ocp.JsonCheckpointHandler()})
    got = mngr.restore(1, args=ocp.args.Composite(state=PeerRestore(_abstract(s2), [server.url], TOKEN, step=2),
                                                  loader=ocp.args.JsonRestore()))
    assert _bytes(got["state"]) == _bytes(s2) and handler.last_restore.source == "peers"
    mngr.close()


def test_saving_through_the_handler_writes_plain_orbax(tmp_path, states):
    _, s1, _ = states
    ocp.Checkpointer(PeerCheckpointHandler()).save(tmp_path / "ck", args=PeerSave(s1))
    assert _bytes(ocp.StandardCheckpointer().restore(tmp_path / "ck", _abstract(s1))) == _bytes(s1)


def test_arrays_become_available_one_by_one():
    """The lazy part: leaf 0 is usable while later leaves are still on the wire."""
    tree = {f"l{i}": np.full((64 << 10,), i, np.float32) for i in range(6)}  # 256 KB each
    snap = Snapshotter(piece_bytes=64 << 10).take(4, tree)
    with PeerServer(StaticSource(snap), TOKEN, fault=Fault("delay", delay_s=0.02)) as server:
        session = PeerFetcher([server.url], TOKEN, step=4, streams_per_source=1).start(like=tree)
        first = session.leaf(0, timeout=10)
        assert np.array_equal(first, tree["l0"])
        assert session.stats[server.url].pieces < len(list(session.manifest.pieces()))
        session.wait(timeout=30)
        assert all(np.array_equal(session.leaf(i), tree[f"l{i}"]) for i in range(6))


def _hash(tree) -> str:
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        h.update(np.asarray(x).tobytes())
    return h.hexdigest()


def _train_and_serve(steps: int) -> None:
    """Script mode: a healthy replica that trains, snapshots after every commit and serves."""
    import time

    from fthsdp.devices import enable_compilation_cache

    enable_compilation_cache()
    ts = make_train_step(CFG, replica_mesh(4))
    state = ts.init(0)
    snaps = Snapshotter(piece_bytes=16 << 10)
    server = PeerServer(snaps, TOKEN).start()
    print(json.dumps({"url": server.url}), flush=True)
    stream = ReplicaStream(CFG.data, 0)
    for step in range(1, steps + 1):
        b = stream.batch(step - 1)
        x, y = ts.shard_batch(b.inputs, b.targets)
        state, m = ts.step(state, x, y, make_quorum_inputs())
        assert bool(m["committed"])
        snaps.begin(step, state)
        print(json.dumps({"step": step, "hash": _hash(state)}), flush=True)
        time.sleep(0.1)  # the rest of a training step
    sys.stdin.read()


def test_rejoin_from_a_training_peer_process(states):
    """A replica process keeps training and snapshotting; a rejoiner fetches a committed step through
    the Orbax handler while it does, then takes the next step itself and lands on the same bytes."""
    ts, s1, _ = states
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "train", "12"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        url = json.loads(proc.stdout.readline())["url"]
        hashes: dict[int, str] = {}

        def read_until(step):
            while step not in hashes:
                line = proc.stdout.readline()
                assert line, "the training peer died"
                d = json.loads(line)
                hashes[d["step"]] = d["hash"]

        read_until(3)
        abstract = _abstract(s1)
        for _ in range(5):  # the peer moves on; a fetch that loses the race retries at the newer step
            want = max(hashes)
            try:
                tree, info = restore(abstract, [url], TOKEN, step=want, checkpoint_dir=None, timeout_s=5)
                break
            except FetchError as e:
                assert "is not available" in str(e)
                read_until(want + 1)
        else:
            raise AssertionError("never caught up with the training peer")
        assert info.source == "peers" and info.step == want and int(tree.step) == want
        assert _hash(tree) == hashes[want]  # parameters and optimizer state, bit for bit
        b = ReplicaStream(CFG.data, 0).batch(want)  # the next step, on the same batch as the peer
        x, y = ts.shard_batch(b.inputs, b.targets)
        mine, _ = ts.step(tree, x, y, make_quorum_inputs())
        read_until(want + 1)
        assert _hash(mine) == hashes[want + 1]
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "train":
    _train_and_serve(int(sys.argv[2]))


def test_a_forked_writer_discards_its_own_checkpoints_of_the_discarded_steps(tmp_path):
    """Two writers in one directory, as in a split brain (rule 6 of fthsdp.control.quorum):
    replica 0 saved steps 4, 6, 8 in the quorum that forked, the lineage's writer 2 saved
    step 6 over it. When 0 learns that its steps 6..8 were discarded it deletes what it
    wrote there (step 8), and keeps step 4 (before the fork) and 2's step 6."""
    import numpy as np

    st = {"w": np.zeros(3, np.float32)}
    forked = PersistentCheckpointer(tmp_path / "ckpt", every=2, max_to_keep=None)
    lineage = PersistentCheckpointer(tmp_path / "ckpt", every=2, max_to_keep=None)
    try:
        for step in (4, 6, 8):
            forked.save(step, st, {0: step}, metadata={"writer": "0", "quorum_id": 2})
        forked.wait()
        lineage.save(6, {"w": np.ones(3, np.float32)}, {0: 5}, metadata={"writer": "2", "quorum_id": 3})
        lineage.wait()

        def barrier(*a, **k):  # Orbax's restore and delete wait for every process of a replica
            raise AssertionError("an Orbax call with a barrier (only the leader discards)")

        forked._mngr.delete, forked.metadata = barrier, barrier
        assert forked.discard_written_by("0", 6, 8) == [8]
        del forked._mngr.delete, forked.metadata
        assert not list((tmp_path / "ckpt").glob("*.discarded-*"))
        assert forked.all_steps() == [4, 6]
        assert lineage.metadata(6)["writer"] == "2" and forked.metadata(4)["writer"] == "0"
        assert forked.discard_written_by("0", 6, 8) == []
    finally:
        forked.close()
        lineage.close()


def test_a_new_writer_prunes_the_old_writers_steps_and_a_failed_save_costs_only_itself(tmp_path, monkeypatch,
                                                                                        caplog):
    """Writers change with the quorum (the lowest healthy replica saves). A manager listed its
    steps once, so each pruned only its own: two writers kept twice max_to_keep on disk, and more
    with every change. And Orbax's save() raised the previous save's error, losing the next
    checkpoint too, under its own step's name."""
    import logging

    import numpy as np

    st = {"w": np.zeros(3, np.float32)}
    a = PersistentCheckpointer(tmp_path / "ckpt", every=1, max_to_keep=3)
    b = PersistentCheckpointer(tmp_path / "ckpt", every=1, max_to_keep=3)
    try:
        for step in (1, 2, 3):
            a.save(step, st, {0: step})
        a.wait()
        for step in (4, 5, 6):
            b.save(step, st, {0: step})
        b.wait()
        assert b.all_steps() == [4, 5, 6]

        real, calls = b._mngr.wait_until_finished, []

        def finish_fails():  # step 6's save fails as it finishes (once: it is reported once)
            calls.append(1)
            if len(calls) == 1:
                raise OSError("disk full while finishing step 6")
            return real()

        monkeypatch.setattr(b._mngr, "wait_until_finished", finish_fails)
        with caplog.at_level(logging.ERROR, logger="fthsdp.checkpoint.persistent"):
            assert b.save(7, st, {0: 7})
        assert "checkpoint of step 6 failed while it finished: OSError: disk full" in caplog.text
        monkeypatch.undo()
        b.wait()
        assert b.all_steps() == [5, 6, 7]
    finally:
        a.close()
        b.close()


def test_a_resume_skips_a_torn_checkpoint_and_says_when_none_restores(tmp_path):
    """A host crash can leave the newest checkpoint's JSON items empty (Orbax writes them without
    fsync). A resume restored only the latest step, failed, and was restarted into the same
    failure; now it restores the newest step that reads, and with none it fails naming each
    step's error (replica-fatal: the launcher's failed-start limit ends a lasting cause). A
    replica of several processes tries the latest only (a process falling back alone would mix
    steps)."""
    import types

    import numpy as np

    from fthsdp.errors import ReplicaFatalError
    from fthsdp.replica.process import ReplicaProcess

    ckpt = PersistentCheckpointer(tmp_path / "ckpt", every=10, async_save=False)
    for step in (10, 20):
        ckpt.save(step, {"w": np.full(3, step, np.float32)}, {0: step})
    ckpt.wait()
    fake = types.SimpleNamespace(ckpt=ckpt, abstract={"w": np.zeros(3, np.float32)}, rid="0",
                                 group=types.SimpleNamespace(num_processes=1))
    (tmp_path / "ckpt" / "20" / "loader" / "metadata").write_text("")  # torn
    restored = ReplicaProcess._restore_newest_readable(fake, 20)
    assert restored.step == 10 and float(np.asarray(restored.state["w"])[0]) == 10.0
    fake.group.num_processes = 2  # several processes: the step their leader listed only (resume)
    with pytest.raises(ReplicaFatalError, match="can be restored: step 20: [^;]*; move"):
        ReplicaProcess._restore_newest_readable(fake, 20)
    fake.group.num_processes = 1
    (tmp_path / "ckpt" / "10" / "loader" / "metadata").write_text("{")
    with pytest.raises(ReplicaFatalError, match="no persistent checkpoint .* can be restored: step 20: .*; step 10: "):
        ReplicaProcess._restore_newest_readable(fake, 20)
    ckpt.close()


def test_a_checkpoint_directory_belongs_to_one_job(tmp_path, states):
    """Two jobs pointed at one directory: the second is refused with what to do, the first goes
    on (its checkpoints restore, the owner file is not mistaken for a step, its meta names the job)."""
    from fthsdp.checkpoint.persistent import OWNER_FILE, CheckpointOwnedError
    from fthsdp.errors import FaultClass, classify

    _, s1, _ = states
    d = tmp_path / "ckpt"
    with PersistentCheckpointer(d, every=1, job_id="job-a", async_save=False) as pc:
        assert pc.save(2, s1, {0: 2}, {"writer": "0"})
    with pytest.raises(CheckpointOwnedError) as e:
        PersistentCheckpointer(d, every=1, job_id="job-b")
    msg = str(e.value)
    assert "belongs to job 'job-a', not to job 'job-b'" in msg and "--out-dir" in msg and "--job" in msg
    assert classify(e.value).kind is FaultClass.JOB_FATAL  # no restart of job-b can help
    with PersistentCheckpointer(d, every=1, job_id="job-a") as pc:  # the owner resumes
        assert pc.all_steps() == [2]
        r = pc.restore(_abstract(s1))
        assert r.step == 2 and _bytes(r.state) == _bytes(s1) and r.metadata["job"] == "job-a"
    assert json.loads((d / OWNER_FILE).read_text())["job"] == "job-a"
    # A reader that names no job (inspection tools) is not refused.
    assert PersistentCheckpointer(d, every=1, writer=False).latest_step() == 2
    # A damaged owner record is an error that says what the file is for, not a silent claim.
    (d / OWNER_FILE).write_text("{not json")
    with pytest.raises(CheckpointOwnedError, match="cannot be read as the checkpoint directory's owner"):
        PersistentCheckpointer(d, every=1, job_id="job-a")


def test_processes_starting_together_agree_on_one_owner(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from fthsdp.checkpoint.persistent import CheckpointOwnedError, claim_directory

    d = str(tmp_path / "race")

    def claim(i: int) -> str | None:
        job = f"job-{i % 2}"
        try:
            claim_directory(d, job)
            return job
        except CheckpointOwnedError:
            return None

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(claim, range(32)))
    winners = {w for w in won if w is not None}
    assert len(winners) == 1 and won.count(None) == 16  # one job owns it; every claim of the other refused
    assert not [p for p in os.listdir(d) if p.endswith(".tmp")]  # no temporaries left behind


def test_a_process_lists_the_checkpoints_while_the_writer_prunes_them(tmp_path):
    """The writer replica prunes its oldest checkpoint (max_to_keep) whenever it saves; another
    process opening or listing the directory meanwhile read a step directory that was gone and
    died of FileNotFoundError (a replacement replica at start-up, in a `fthsdp ray` run). Here a
    writer process saves every step, keeping one, while this one opens and lists the directory
    over and over: without the retry about one listing in eight failed."""
    import time

    d = str(tmp_path / "ckpt")
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys, numpy as np\n"
        "from fthsdp.checkpoint.persistent import PersistentCheckpointer\n"
        f"w = PersistentCheckpointer({d!r}, every=1, max_to_keep=1, async_save=False, job_id='j')\n"
        "s = 1\n"
        "while True:\n"
        "    w.save(s, {'w': np.zeros(4, np.float32)}, {0: s}); s += 1\n")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (os.path.isdir(d) and any(p.isdigit() for p in os.listdir(d))) and time.monotonic() < deadline:
            assert writer.poll() is None, writer.stderr.read()[-2000:]
            time.sleep(0.1)
        listings, steps, end = 0, set(), time.monotonic() + 4.0
        while listings < 150 and time.monotonic() < end:
            reader = PersistentCheckpointer(d, every=1, writer=False, job_id="j")
            steps.update(reader.all_steps())
            reader.latest_step()
            reader.close()
            listings += 1
        assert writer.poll() is None, writer.stderr.read()[-2000:]
    finally:
        writer.kill()
        writer.wait(10)
    assert listings >= 40 and len(steps) >= 10, (listings, sorted(steps))  # it saved and pruned meanwhile
