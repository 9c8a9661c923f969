"""loader_state: atomic per-replica records that survive a writer killed mid-write."""

import json
import os
import signal
import subprocess
import sys

import pytest

from fthsdp.data import LoaderState
from fthsdp.data.loader_state import LoaderRecord, LoaderStateError, LoaderStateStore, decode, encode


def test_roundtrip_and_load_all(tmp_path):
    store = LoaderStateStore(tmp_path)
    assert store.load(0) is None
    store.save(LoaderState(0, 5), step=5)
    store.save(LoaderState(1, 4), step=5)
    store.save(LoaderState(0, 6), step=6)
    assert store.load(0) == LoaderRecord(0, 6, 6)
    assert store.load(0).loader_state == LoaderState(0, 6)
    assert store.load_all() == {0: LoaderRecord(0, 6, 6), 1: LoaderRecord(1, 4, 5)}


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d[: len(d) // 2], "not valid JSON"),
        (lambda d: json.dumps({**json.loads(d), "format": "other"}).encode(), "not a loader_state file"),
        (lambda d: json.dumps({**json.loads(d), "version": 99}).encode(), "version 99"),
        (lambda d: json.dumps({**json.loads(d), "position": 7}).encode(), "fails its checksum"),
        (lambda d: json.dumps({k: v for k, v in json.loads(d).items() if k != "step"}).encode(), "lacks field"),
    ],
)
def test_damaged_files_fail_with_a_clear_reason(tmp_path, mutate, match):
    store = LoaderStateStore(tmp_path)
    store.save(LoaderState(2, 9), step=3)
    p = store.path(2)
    p.write_bytes(mutate(p.read_bytes()))
    with pytest.raises(LoaderStateError, match=match):
        store.load(2)


def test_record_of_another_replica_is_refused(tmp_path):
    store = LoaderStateStore(tmp_path)
    store.path(1).write_bytes(encode(LoaderRecord(0, 3, 3)))
    with pytest.raises(LoaderStateError, match="replica 0's state, not replica 1's"):
        store.load(1)


def test_an_unreadable_record_is_named_not_an_os_error(tmp_path):
    store = LoaderStateStore(tmp_path)
    store.path(1).mkdir(parents=True)  # a directory where the record belongs
    with pytest.raises(LoaderStateError, match="replica_1.json: cannot read the loader state"):
        store.load(1)


def test_invalid_records_are_refused():
    with pytest.raises(LoaderStateError, match="position must be a non-negative int"):
        LoaderRecord(0, -1, 0)
    assert decode(encode(LoaderRecord(1, 2, 3))) == LoaderRecord(1, 2, 3)


def test_torn_temp_file_leaves_the_previous_record(tmp_path):
    store = LoaderStateStore(tmp_path)
    store.save(LoaderState(0, 10), step=10)
    # a writer died after writing half of the next temp file, before the rename
    torn = store.path(0).with_name(store.path(0).name + ".tmp.12345")
    torn.write_bytes(encode(LoaderRecord(0, 11, 11))[:17])
    assert store.load(0) == LoaderRecord(0, 10, 10)
    assert store.load_all() == {0: LoaderRecord(0, 10, 10)}
    assert store.clean_temporaries() == [torn] and not torn.exists()


_WRITER = r"""
import os, sys
from fthsdp.data import LoaderState
from fthsdp.data.loader_state import LoaderStateStore
store = LoaderStateStore(sys.argv[1])
store.save(LoaderState(0, 100), step=100)
real_fsync = os.fsync
def slow_fsync(fd):  # the temp file is written but not yet renamed: tell the parent and wait to be killed
    if os.fstat(fd).st_size and f".tmp.{os.getpid()}." in os.readlink(f"/proc/self/fd/{fd}"):
        print("in-fsync", flush=True)
        import time; time.sleep(60)
    real_fsync(fd)
os.fsync = slow_fsync
store.save(LoaderState(0, 101), step=101)
print("not killed", flush=True)
"""


def test_writer_killed_mid_write_leaves_previous_record(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"in-fsync"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    store = LoaderStateStore(tmp_path)
    assert store.load(0) == LoaderRecord(0, 100, 100)  # the new record never replaced the old
    leftovers = store.clean_temporaries()
    assert len(leftovers) == 1  # the killed writer's complete-but-unrenamed temp file
    store.save(LoaderState(0, 101), step=101)
    assert store.load(0) == LoaderRecord(0, 101, 101)


def test_many_kills_never_leave_a_torn_record(tmp_path):
    code = (
        "import sys\nfrom fthsdp.data import LoaderState\nfrom fthsdp.data.loader_state import LoaderStateStore\n"
        "s = LoaderStateStore(sys.argv[1]); i = 0\n"
        "while True:\n"
        "    s.save(LoaderState(0, i), step=i); i += 1\n"
        "    if i == 20: print('go', flush=True)\n"
    )
    for delay in (0.0, 0.01, 0.03):
        proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"go"
        if delay:
            import time

            time.sleep(delay)
        proc.kill()
        proc.wait(timeout=10)
        rec = LoaderStateStore(tmp_path).load(0)
        assert rec is not None and rec.position == rec.step and rec.step >= 19
