"""The exactly-once instrument: which batches went into the model, at which step.

Each replica appends one line per committed step to its own ledger file:
`(step, replica, position)` of the batch it contributed (a catching-up
replica's zero-gradient step contributes none and records nothing). A full
restart that resumes from checkpoint step s appends a `restore` line naming
the restart: every commit recorded before the restart's first `restore` line
(in wall-clock time, on any replica's ledger) at a step after s was rolled
back with the discarded model. Log it at every (re)start of the job, step 0
included: a job killed before its first checkpoint was durable starts over.
(Wall-clock order: the replicas' clocks must agree to well within the time a
restart takes, as they do on one host or under NTP. Within one ledger, which
record came first is its order in the file, never the clock: a clock stepped
back, after a reboot, must not revive a commit its own later line voided.)

A replica that finds its own commits missing from the state it installed
appends a `rollback` line naming the steps of the discarded commits: it was
fenced (its state forked from the job's lineage, rule 6 of
fthsdp.control.quorum: another quorum re-decided a step it had committed) and
fetched the lineage's state, or its last commit succeeded while its peers'
failed and they went on without it. The model it holds no longer contains
those batches, and it trains them again from the positions it fetched. A
rollback voids only that replica's own commits, recorded before it, at the
steps it names (its batches are in its ledger alone); it is written before
the replica commits anything on the installed state, so no clock comparison
across replicas is involved.

`check_exactly_once` replays the ledgers (honouring restores and rollbacks)
and reports, relative to the final model, every batch trained twice (duplicates), every expected batch never
trained (gaps), batches past the expected end, and replicas recording two
batches for one step.

Lines are JSON with a CRC each. A crash mid-append leaves a torn last line:
readers skip it (and say so), and reopening for append cuts it off first, so
the next record starts on its own line. A damaged line anywhere else is an
error: the file was altered.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

FORMAT_VERSION = 1


class LedgerError(ValueError):
    pass


@dataclass(frozen=True)
class Commit:
    step: int
    replica: int
    position: int
    t_ns: int
    seq: int = 0  # its line's index in its ledger (read_ledger): the order within the file


@dataclass(frozen=True)
class Rollback:
    """The replica's commits at steps ``first``..``last`` recorded before this line were
    discarded: it installed a state of step ``step`` that does not contain them."""

    step: int  # the step of the state it installed (the job's lineage)
    first: int  # the discarded commits' steps (ledger steps: committed steps after the commit)
    last: int
    replica: int
    t_ns: int
    seq: int = 0

    def voids(self, c: Commit) -> bool:
        """Whether it voids ``c``, a commit of the same ledger (by their order in the file)."""
        return c.replica == self.replica and c.seq < self.seq and self.first <= c.step <= self.last


@dataclass(frozen=True)
class Restore:
    step: int  # the checkpoint step the job resumed from
    replica: int
    t_ns: int
    restart: str  # names the job restart (every replica of it logs the same id)
    seq: int = 0


def _line(doc: dict) -> bytes:
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return f'{body[:-1]},"crc":{zlib.crc32(body.encode()) & 0xFFFFFFFF}}}\n'.encode()


Record = Commit | Restore | Rollback


def _parse(raw: bytes, where: str, seq: int = 0) -> Record:
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError(f"not a JSON object but {type(doc).__name__}")
    crc = doc.pop("crc")
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    if zlib.crc32(body.encode()) & 0xFFFFFFFF != crc:
        raise ValueError("checksum mismatch")
    if doc.get("v") != FORMAT_VERSION:
        raise LedgerError(f"{where}: ledger version {doc.get('v')!r} unsupported (this fthsdp reads {FORMAT_VERSION})")
    if doc["kind"] == "commit":
        return Commit(int(doc["step"]), int(doc["replica"]), int(doc["position"]), int(doc["t"]), seq)
    if doc["kind"] == "restore":
        return Restore(int(doc["step"]), int(doc["replica"]), int(doc["t"]), str(doc["restart"]), seq)
    if doc["kind"] == "rollback":
        return Rollback(int(doc["step"]), int(doc["first"]), int(doc["last"]), int(doc["replica"]), int(doc["t"]),
                        seq)
    raise ValueError(f"unknown record kind {doc['kind']!r}")


@dataclass
class LedgerContents:
    path: str
    records: list[Record]
    torn_tail: bool = False  # the last line was cut short by a crash and was skipped


def read_ledger(path: str | os.PathLike) -> LedgerContents:
    p = Path(path)
    data = p.read_bytes()
    lines = data.split(b"\n")
    records: list[Record] = []
    torn = False
    for i, raw in enumerate(lines):
        if not raw:
            continue
        last = i == len(lines) - 1  # no newline after it: an append that did not finish
        try:
            records.append(_parse(raw, str(p), len(records)))
        except LedgerError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            if last:
                torn = True
                continue
            raise LedgerError(f"{p}: line {i + 1} is damaged ({type(e).__name__}: {e}); the ledger was altered") from None
        if last:  # a complete record without its newline: the crash hit between the two writes
            torn = False
    return LedgerContents(str(p), records, torn)


class Ledger:
    """Append-only ledger of one replica (each record is flushed; fsync optional)."""

    def __init__(self, path: str | os.PathLike, replica: int, fsync: bool = False):
        if replica < 0:
            raise ValueError(f"replica must be >= 0, got {replica}")
        self.path = Path(path)
        self.replica = replica
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.repaired = self._cut_torn_tail()
        self._f = open(self.path, "ab", buffering=0)

    def _cut_torn_tail(self) -> bool:
        if not self.path.exists():
            return False
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return False
        keep = data.rfind(b"\n") + 1
        try:  # a whole record whose newline never made it: keep it (readers count it too)
            _parse(data[keep:], str(self.path))
            whole = True
        except LedgerError:
            raise  # a whole record of another version: never cut (read_ledger refuses the file too)
        except (ValueError, KeyError, TypeError):
            whole = False
        with open(self.path, "r+b") as f:
            if whole:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
            else:
                f.truncate(keep)
            os.fsync(f.fileno())
        return not whole

    def _append(self, doc: dict) -> None:
        view = memoryview(_line({"v": FORMAT_VERSION, "t": time.time_ns(), "replica": self.replica, **doc}))
        start = os.fstat(self._f.fileno()).st_size  # (the file's end: appends go there, whatever the offset)
        try:
            while view:  # a raw file may write part of the line (a nearly full disk)
                n = self._f.write(view)
                if not n:
                    raise OSError(f"ledger {self.path}: no byte written (is the disk full?)")
                view = view[n:]
        except OSError:
            # Half a line followed by the next append would be one damaged line in the middle,
            # which every later read refuses as an altered ledger: cut back to the last whole line.
            try:
                self._f.truncate(start)
                self._f.seek(start)  # (truncate leaves the offset past the end: a later cut would pad with NULs)
            except OSError as e:
                raise OSError(f"ledger {self.path}: a record was written in part and could not be cut off ({e}): "
                              "the file now ends with a torn line, which its next opening removes") from None
            raise
        if self.fsync:
            os.fsync(self._f.fileno())

    def commit(self, step: int, position: int) -> None:
        """Batch (replica, position) was committed into the model by step `step`."""
        if step < 1 or position < 0:
            raise ValueError(f"commit needs step >= 1 and position >= 0, got step={step} position={position}")
        self._append({"kind": "commit", "step": int(step), "position": int(position)})

    def restore(self, step: int, restart: str) -> None:
        """The job restart `restart` resumed from checkpoint step `step`: later steps were rolled back.

        `restart` names the restart (the launcher's incarnation id): every
        replica that comes back in it logs the same id, and the restart counts
        from the first of them, so a replica that logs it late does not void
        commits the others made after the restart."""
        if step < 0:
            raise ValueError(f"restore step must be >= 0, got {step}")
        if not restart:
            raise ValueError("restore needs a non-empty restart id (the same on every replica of the restart)")
        self._append({"kind": "restore", "step": int(step), "restart": str(restart)})

    def rollback(self, step: int, first: int, last: int) -> None:
        """This replica installed the state of step ``step``, which does not contain its
        commits at steps ``first``..``last`` recorded so far: they are void (see the module
        docstring). Written before anything is committed on the installed state."""
        if not 1 <= first <= last:
            raise ValueError(f"rollback needs 1 <= first <= last (the discarded commits' steps), got "
                             f"first={first} last={last}")
        if step < 0:
            raise ValueError(f"rollback step (of the installed state) must be >= 0, got {step}")
        self._append({"kind": "rollback", "step": int(step), "first": int(first), "last": int(last)})

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def live_commits(contents: LedgerContents) -> list[Commit]:
    """One ledger's commits that no later restore or rollback in it voided."""
    restores = [r for r in contents.records if isinstance(r, Restore)]
    rollbacks = [r for r in contents.records if isinstance(r, Rollback)]
    return [c for c in contents.records if isinstance(c, Commit)
            and not any(r.seq > c.seq and r.step < c.step for r in restores)
            and not any(r.voids(c) for r in rollbacks)]


def live_positions(contents: LedgerContents) -> set[int]:
    """Positions of one ledger's commits that no later restore or rollback in it voided."""
    return {c.position for c in live_commits(contents)}


def discarded_commits(contents: LedgerContents, kept_positions: int) -> list[Commit]:
    """The live commits of one replica's ledger whose batches a state holding only its
    positions ``0 .. kept_positions - 1`` lacks (each replica's stream is trained in
    order, so those are its latest commits): what a rollback must void when the replica
    installs that state."""
    return [c for c in live_commits(contents) if c.position >= kept_positions]


@dataclass
class ExactlyOnceReport:
    ok: bool
    duplicates: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (replica, position) -> steps
    gaps: dict[int, list[int]] = field(default_factory=dict)  # replica -> positions never trained
    unexpected: dict[int, list[int]] = field(default_factory=dict)  # replica -> positions past the expected end
    step_conflicts: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (replica, step) -> positions
    rolled_back: int = 0  # commits voided by restores and rollbacks
    torn_tails: list[str] = field(default_factory=list)
    counted: int = 0

    def summary(self) -> str:
        if self.ok:
            return f"exactly once: {self.counted} batches, {self.rolled_back} rolled back by restores or rollbacks"
        parts = []
        if self.duplicates:
            parts.append(f"{len(self.duplicates)} duplicated, e.g. " + ", ".join(
                f"(replica {r}, position {p}) at steps {s}" for (r, p), s in list(self.duplicates.items())[:3]))
        if self.gaps:
            parts.append("gaps: " + "; ".join(f"replica {r}: {_ranges(ps)}" for r, ps in self.gaps.items()))
        if self.unexpected:
            parts.append("past the end: " + "; ".join(f"replica {r}: {_ranges(ps)}" for r, ps in self.unexpected.items()))
        if self.step_conflicts:
            parts.append(f"{len(self.step_conflicts)} (replica, step) pairs with several batches")
        return "NOT exactly once: " + " | ".join(parts)


def _ranges(ps: list[int]) -> str:
    out, i = [], 0
    while i < len(ps):
        j = i
        while j + 1 < len(ps) and ps[j + 1] == ps[j] + 1:
            j += 1
        out.append(str(ps[i]) if i == j else f"{ps[i]}-{ps[j]}")
        i = j + 1
    return ",".join(out)


def check_exactly_once(
    ledgers: Iterable[str | os.PathLike | LedgerContents],
    expected_positions: Mapping[int, int],
) -> ExactlyOnceReport:
    """Replays `ledgers`; `expected_positions[r] = n` means positions 0..n-1 of replica r
    must each be in the final model exactly once."""
    contents = [c if isinstance(c, LedgerContents) else read_ledger(c) for c in ledgers]
    commits: list[tuple[int, Commit]] = []  # (its ledger's index, the commit)
    restores: list[Restore] = []
    own: dict[int, list[Restore | Rollback]] = {}  # ledger index -> its restores and rollbacks (file order)
    for i, c in enumerate(contents):
        for rec in c.records:
            if isinstance(rec, Commit):
                commits.append((i, rec))
            else:
                own.setdefault(i, []).append(rec)
                if isinstance(rec, Restore):
                    restores.append(rec)
    report = ExactlyOnceReport(ok=True, torn_tails=[c.path for c in contents if c.torn_tail])

    restarts: dict[str, tuple[int, int]] = {}  # restart id -> (first time logged, step)
    for r in restores:
        t, step = restarts.get(r.restart, (r.t_ns, r.step))
        if step != r.step:
            raise LedgerError(
                f"restart {r.restart!r} resumed from step {step} on one replica and step {r.step} on replica "
                f"{r.replica}: a restart must restore one checkpoint everywhere"
            )
        restarts[r.restart] = (min(t, r.t_ns), step)

    def rolled_back(i: int, c: Commit) -> bool:
        # a restart voids later steps on every replica from its first restore line (wall clock);
        # a ledger's own later restore or rollback voids its commit whatever the clocks say
        return (any(t > c.t_ns and step < c.step for t, step in restarts.values())
                or any(r.voids(c) if isinstance(r, Rollback) else (r.seq > c.seq and r.step < c.step)
                       for r in own.get(i, ())))

    live = [c for i, c in commits if not rolled_back(i, c)]
    report.rolled_back = len(commits) - len(live)
    report.counted = len(live)
    seen: dict[tuple[int, int], list[int]] = {}
    per_step: dict[tuple[int, int], list[int]] = {}
    for c in live:
        seen.setdefault((c.replica, c.position), []).append(c.step)
        per_step.setdefault((c.replica, c.step), []).append(c.position)
    report.duplicates = {k: sorted(v) for k, v in sorted(seen.items()) if len(v) > 1}
    report.step_conflicts = {k: sorted(v) for k, v in sorted(per_step.items()) if len(v) > 1}
    replicas = set(expected_positions) | {r for r, _ in seen}
    for r in sorted(replicas):
        n = int(expected_positions.get(r, 0))
        have = {p for (rr, p) in seen if rr == r}
        gaps = [p for p in range(n) if p not in have]
        extra = sorted(p for p in have if p >= n)
        if gaps:
            report.gaps[r] = gaps
        if extra:
            report.unexpected[r] = extra
    report.ok = not (report.duplicates or report.gaps or report.unexpected or report.step_conflicts)
    return report
