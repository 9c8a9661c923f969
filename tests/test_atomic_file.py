"""fthsdp.atomic_file: a reader never sees half a file, and no writer leaves a temporary behind."""

from __future__ import annotations

import os
import threading

import pytest

from fthsdp.atomic_file import TMP_MARK, temporaries, write_atomic


def test_writes_text_and_bytes_and_replaces(tmp_path):
    p = tmp_path / "port"
    write_atomic(p, "123\n")
    assert p.read_text() == "123\n"
    write_atomic(p, b"\x00\x01", durable=True)
    assert p.read_bytes() == b"\x00\x01"
    assert os.listdir(tmp_path) == ["port"]


def test_failed_write_leaves_the_old_contents_and_no_temporary(tmp_path, monkeypatch):
    p = tmp_path / "state.json"
    write_atomic(p, "old")

    def no_space(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", no_space)
    with pytest.raises(OSError, match="No space"):
        write_atomic(p, "new")
    monkeypatch.undo()
    assert p.read_text() == "old"
    assert not temporaries(tmp_path, "state.json")


def test_missing_directory_raises_without_leaving_anything(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "absent" / "f", "x")
    assert not (tmp_path / "absent").exists()


def test_temporaries_finds_a_dead_writers_file_only(tmp_path):
    (tmp_path / "replica_1.json").write_text("{}")
    torn = tmp_path / f"replica_1.json{TMP_MARK}4242.77"
    torn.write_text("{")
    (tmp_path / f"replica_2.json{TMP_MARK}1.2").write_text("{")
    assert temporaries(tmp_path, "replica_1.json") == [torn]
    assert len(temporaries(tmp_path, "replica_*.json")) == 2


def test_concurrent_writers_never_show_a_torn_file(tmp_path):
    """Threads of one process rewrite one file (as a replica's training thread and its watchdog
    do): every read is one whole version, and no temporary is left."""
    p = tmp_path / "status.json"
    versions = {str(k) * 5000 for k in range(4)}
    write_atomic(p, "0" * 5000)
    stop = threading.Event()
    bad: list[str] = []

    def writer(k: int) -> None:
        for _ in range(300):
            write_atomic(p, str(k) * 5000)

    def reader() -> None:
        while not stop.is_set():
            text = p.read_text()
            if text not in versions:
                bad.append(text[:20] + "...")

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    r.join()
    assert not bad
    assert p.read_text() in versions
    assert not temporaries(tmp_path, "status.json")
