"""Each replica's stream position, recorded atomically after every committed step.

One small JSON file per replica (`replica_{r}.json` in a directory): written
to a temporary file, flushed, fsynced, then renamed over the old one with
`os.replace` (atomic on POSIX), and the directory fsynced. A crash at any
point leaves either the previous record or the new one, never a torn mix. A
CRC over the payload catches files damaged by anything else (a copy that
truncated, a disk error), and reads check format and version, each with an
error that says what is wrong and what to do.

Training does not read it back: a rejoining replica takes every replica's
position from the state it fetches from its peers (the replicated positions),
and a full restart from the positions saved with the persistent checkpoint.
The record is each replica's own durable word on where its stream stands, for
operators and checks (tests/test_ledger.py compares it with the ledger).
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from fthsdp.atomic_file import temporaries, write_atomic
from fthsdp.data.stream import LoaderState
from fthsdp.digits import ascii_int

FORMAT = "fthsdp.loader_state"
VERSION = 1


class LoaderStateError(ValueError):
    """A loader_state file is missing, damaged or of another format/version."""


@dataclass(frozen=True)
class LoaderRecord:
    """After committed step `step`, replica `replica` trains `position` next."""

    replica: int
    position: int
    step: int

    @property
    def loader_state(self) -> LoaderState:
        return LoaderState(self.replica, self.position)

    def __post_init__(self):
        for name in ("replica", "position", "step"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise LoaderStateError(f"loader_state {name} must be a non-negative int, got {v!r}")


def _payload(rec: LoaderRecord) -> dict:
    return {"replica": rec.replica, "position": rec.position, "step": rec.step}


def _crc(payload: dict) -> int:
    return zlib.crc32(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()) & 0xFFFFFFFF


def encode(rec: LoaderRecord) -> bytes:
    payload = _payload(rec)
    doc = {"format": FORMAT, "version": VERSION, **payload, "crc32": _crc(payload)}
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


def decode(data: bytes, where: str = "loader_state") -> LoaderRecord:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise LoaderStateError(
            f"{where} is not valid JSON ({e}); the file was damaged outside fthsdp's atomic writer. "
            "Delete it to restart the replica from the persistent checkpoint's positions"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise LoaderStateError(f"{where} is not a loader_state file (format {got!r}, expected {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise LoaderStateError(
            f"{where} has loader_state version {doc.get('version')!r}; this fthsdp reads version {VERSION}. "
            "Resume with the fthsdp version that wrote it"
        )
    missing = [k for k in ("replica", "position", "step", "crc32") if k not in doc]
    if missing:
        raise LoaderStateError(f"{where} lacks field(s) {', '.join(missing)}")
    payload = {k: doc[k] for k in ("replica", "position", "step")}
    if _crc(payload) != doc["crc32"]:
        raise LoaderStateError(f"{where} fails its checksum: its contents were altered after writing")
    return LoaderRecord(**payload)


class LoaderStateStore:
    """The loader_state files of a job, one per replica, in `directory`."""

    def __init__(self, directory: str | os.PathLike, durable: bool = True):
        """``durable``: each save is fsync'd (a host crash keeps it), else only replaced atomically."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.durable = durable

    def path(self, replica: int) -> Path:
        return self.directory / f"replica_{replica}.json"

    def save(self, state: LoaderState, step: int) -> LoaderRecord:
        """Records `state` (the next position to train) after committed `step`."""
        rec = LoaderRecord(state.replica, state.position, step)
        write_atomic(self.path(rec.replica), encode(rec), durable=self.durable)
        return rec

    def load(self, replica: int) -> LoaderRecord | None:
        """The replica's record, or None if it never committed a step."""
        p = self.path(replica)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:  # a directory in its place, no permission: say which file and why
            raise LoaderStateError(f"{p}: cannot read the loader state ({e.strerror or e}); fix the file or its "
                                   "permissions") from None
        rec = decode(data, str(p))
        if rec.replica != replica:
            raise LoaderStateError(f"{p} holds replica {rec.replica}'s state, not replica {replica}'s (file was moved?)")
        return rec

    def load_all(self) -> dict[int, LoaderRecord]:
        out = {}
        for p in sorted(self.directory.glob("replica_*.json")):
            number = ascii_int(p.stem.removeprefix("replica_"))
            if number is not None:
                rec = self.load(number)
                if rec is not None:
                    out[rec.replica] = rec
        return out

    def clean_temporaries(self) -> list[Path]:
        """Removes temp files left by writers that crashed mid-write; returns them."""
        gone = []
        for p in temporaries(self.directory, "replica_*.json"):
            p.unlink(missing_ok=True)
            gone.append(p)
        return gone
