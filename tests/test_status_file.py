"""A replica's status file: a final record (why the process leaves) is never replaced by a
write from another thread, and concurrent writers never corrupt the file."""

from __future__ import annotations

import json
import threading

from fthsdp.atomic_file import temporaries
from fthsdp.replica.status_file import StatusFile


def test_the_final_record_stays_and_later_writes_are_dropped(tmp_path):
    st = StatusFile(tmp_path / "status-1.json", {"replica": "1", "started": 5.0})
    assert st.write(step=7, state="training") and st.final is None
    assert st.write(final=True, step=8, state="failed (replica-fatal)", fault="process 1 of replica 1 silent")
    assert not st.write(step=8, state="training")  # the training thread's commit, a moment later
    rec = json.loads((tmp_path / "status-1.json").read_text())
    assert rec["state"] == "failed (replica-fatal)" and rec["fault"].startswith("process 1") and rec["replica"] == "1"
    assert st.final == rec


def test_threads_racing_a_final_write_leave_it_whole_and_last(tmp_path):
    """Many threads write 'training' while one writes the fault: every read of the file is a
    whole record, and the file ends holding the fault."""
    path = tmp_path / "status-0.json"
    st = StatusFile(path, {"replica": "0"})
    st.write(step=0, state="training")
    start, stop = threading.Barrier(5), threading.Event()
    seen_bad: list[str] = []

    def trainer(k: int) -> None:
        start.wait()
        n = 0
        while not stop.is_set():
            st.write(step=n, state="training", writer=k)
            n += 1

    def reader() -> None:
        start.wait()
        while not stop.is_set():
            text = path.read_text()
            try:
                json.loads(text)
            except ValueError:
                seen_bad.append(text)

    threads = [threading.Thread(target=trainer, args=(k,)) for k in range(3)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    start.wait()
    st.write(final=True, step=8, state="failed (replica-fatal)", fault="frozen follower")
    for _ in range(200):  # the trainers keep writing after the fault
        st.write(step=99, state="training")
    stop.set()
    for t in threads:
        t.join()
    assert not seen_bad
    rec = json.loads(path.read_text())
    assert rec["state"] == "failed (replica-fatal)" and rec["fault"] == "frozen follower"
    assert not temporaries(tmp_path, path.name)  # no temporary file left behind
