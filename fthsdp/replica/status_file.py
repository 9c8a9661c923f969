"""A replica's status file: what the launcher, ``fthsdp status`` and the tests read of it.

Written whole (a temporary file renamed over it), by one thread at a time, and
never again once a final state is in it. Why the last rule: a replica that
leaves from another thread than its training loop (the group watchdog's, when
a follower froze) writes its fault and exits at once, while the training thread
may still be finishing a commit; that commit's ``training`` record, renamed
over the fault a moment later, erased why the replica left (seen once under a
doubly loaded CI machine: a frozen follower's replica left with no fault on
record). And two threads of one process sharing the temporary file's name could
interleave their writes.
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import time

from fthsdp.atomic_file import write_atomic

__all__ = ["StatusFile"]


class StatusFile:
    """``status-<replica>.json``: ``base`` fields plus each write's, with the writer's pid and time."""

    def __init__(self, path: pathlib.Path, base: dict) -> None:
        self.path = pathlib.Path(path)
        self.base = dict(base)
        self._lock = threading.Lock()
        self._final: dict | None = None

    @property
    def final(self) -> dict | None:
        """The final record once one was written (then every later write is dropped)."""
        return self._final

    def write(self, final: bool = False, **fields) -> bool:
        """Write the status (``final``: the process's last word, e.g. why it leaves); False when
        a final status was written before, and this one was dropped."""
        with self._lock:
            if self._final is not None:
                return False
            rec = {**self.base, "pid": os.getpid(), "time": time.time(), **fields, **({"final": True} if final else {})}
            write_atomic(self.path, json.dumps(rec))
            if final:
                self._final = rec
            return True
