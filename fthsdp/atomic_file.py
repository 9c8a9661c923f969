"""Files that readers see whole or not at all: written beside the target, then renamed over it.

Several files of a run are read while they are rewritten: the launcher polls
the lighthouse's port file, ``fthsdp status`` and the launcher read every
replica's status, a restarted replica reads its loader state, the Ray driver
mirrors the actors' latest files. Each is written to a temporary file in the
same directory and moved over the old one with ``os.replace``, which POSIX
makes atomic, so a reader finds the old contents or the new ones, never half.

The temporary's name is ``<name>.tmp.<pid>.<thread>``: two threads or two
processes writing the same file never share one (they interleaved their bytes
when they did), and a writer that died mid-write leaves a temporary that
:func:`temporaries` finds for whoever cleans up. With ``durable=True`` the
file and its directory are fsynced, so the new contents survive a power loss
once the call returns (the loader state, on which exactly-once batches rest);
the others only need atomicity.
"""

from __future__ import annotations

import os
import pathlib
import threading

__all__ = ["TMP_MARK", "write_atomic", "temporaries"]

TMP_MARK = ".tmp."


def temporaries(directory: str | os.PathLike, name_pattern: str) -> list[pathlib.Path]:
    """Temporaries left in ``directory`` by writers of files matching ``name_pattern`` (a glob,
    e.g. ``replica_3.json``) that died before renaming them."""
    return sorted(pathlib.Path(directory).glob(f"{name_pattern}{TMP_MARK}*"))


def write_atomic(path: str | os.PathLike, data: bytes | str, *, durable: bool = False) -> None:
    """Replace ``path``'s contents with ``data`` (str is written as UTF-8) in one step.

    ``durable``: fsync the file before the rename and the directory after it."""
    path = pathlib.Path(path)
    raw = data.encode() if isinstance(data, str) else bytes(data)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
