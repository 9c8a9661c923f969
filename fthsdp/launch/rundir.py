"""A run directory across attempts: what the user asked for, what already happened.

`run.json` keeps the config name and the user's overrides (so `--resume`
keeps them), the effective config (so a resume on a different shape is
refused, naming the difference), the fault plan and the faults that fired (so
a resume does not replay them), and one entry per attempt (the first start,
each `--resume`, each automatic fallback to the checkpoint) with its launch
log at `attempts/N/launch.log`; `launch.log` at the top is a link to the
latest one. When a new attempt starts, the previous attempt's per-attempt
files (metrics, status, events, replica logs, summary) move into its
`attempts/N/` folder; ledgers, loader states and checkpoints stay: the next
attempt continues them.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shlex
import shutil
import time

from fthsdp.atomic_file import write_atomic

PER_ATTEMPT = ("metrics-*.jsonl", "status-*.json", "events.jsonl", "replica-*.out", "replica-*.log",
               "summary.json", "timeline.png", "lighthouse.log", "lighthouse.port")

# Fields a resume may change: they do not alter what is trained, only how the
# run is driven, placed and observed (every ft.* timeout and policy, every
# launch.* field but the ring's shape, logging). Every other field of the
# effective config is the run's shape (state shapes, data order, the step
# count, the ring).
LAUNCH_SHAPE = ("launch.replicas", "launch.devices_per_replica")
MAY_CHANGE = ("train.out_dir", "train.log_every", "train.eval_every", "train.min_step_s", "train.pace", "name")


def may_change(key: str) -> bool:
    if key.startswith("ft."):
        return True
    if key.startswith("launch."):
        return key not in LAUNCH_SHAPE
    return key in MAY_CHANGE


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


def effective(cfg) -> dict[str, object]:
    """A config as flat `section.field -> value` (JSON-safe)."""
    return json.loads(json.dumps(flatten(dataclasses.asdict(cfg)), default=str))


def shape_differences(saved: dict[str, object], now: dict[str, object]) -> list[str]:
    """'field: V in the run, W now' for every shape field that differs."""
    diffs = []
    for key in sorted(set(saved) | set(now)):
        if may_change(key):
            continue
        if saved.get(key) != now.get(key):
            diffs.append(f"{key}: {saved.get(key)!r} in the run, {now.get(key)!r} now")
    return diffs


def merge_overrides(saved: list[str], new: list[str]) -> list[str]:
    """The run's overrides, then the new ones (a later assignment of a field wins)."""
    keys = {o.split("=", 1)[0] for o in new}
    return [o for o in saved if o.split("=", 1)[0] not in keys] + list(new)


def resume_hint(out_dir: pathlib.Path, config: str, overrides: list[str]) -> str:
    """The command that resumes this run with the user's own config and overrides."""
    return shlex.join(["fthsdp", "run", "--resume", "--out-dir", str(out_dir), "--config", config, *overrides])


@dataclasses.dataclass
class RunDir:
    """run.json and the attempt folders of one run directory."""

    out: pathlib.Path

    @property
    def path(self) -> pathlib.Path:
        return self.out / "run.json"

    def load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def save(self, doc: dict) -> None:
        write_atomic(self.path, json.dumps(doc, indent=1))

    def update(self, **fields) -> dict:
        doc = self.load()
        doc.update(fields)
        self.save(doc)
        return doc

    def attempt_dir(self, n: int) -> pathlib.Path:
        return self.out / "attempts" / str(n)

    def begin_attempt(self, kind: str, restart_id: str = "") -> tuple[int, pathlib.Path]:
        """Archive the previous attempt's files (if any), record a new attempt,
        point `launch.log` at its log. Returns (attempt number, its launch log)."""
        doc = self.load()
        attempts = doc.setdefault("attempts", [])
        if attempts:
            archive(self.out, self.attempt_dir(attempts[-1]["n"]))
        n = attempts[-1]["n"] + 1 if attempts else 0
        log = self.attempt_dir(n) / "launch.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        attempts.append({"n": n, "kind": kind, "restart_id": restart_id, "started": time.time(),
                         "launch_log": str(log.relative_to(self.out))})
        self.save(doc)
        link = self.out / "launch.log"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(log.relative_to(self.out))
        return n, log

    def record_fired(self, fault: dict) -> None:
        doc = self.load()
        doc.setdefault("fired", []).append(fault)
        self.save(doc)

    def end_attempt(self, **fields) -> None:
        doc = self.load()
        if doc.get("attempts"):
            doc["attempts"][-1].update(ended=time.time(), **fields)
            self.save(doc)


def archive(out: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Moves one attempt's per-attempt files into `dest` (ledgers, loader states
    and checkpoints stay: the next attempt continues them)."""
    dest.mkdir(parents=True, exist_ok=True)
    for pattern in PER_ATTEMPT:
        for f in out.glob(pattern):
            shutil.move(str(f), dest / f.name)
    return dest


class RunDirBusy(RuntimeError):
    """Another launcher holds the run directory."""


def hold(out: pathlib.Path):
    """Hold run directory ``out`` for this launcher's lifetime (an exclusive lock on a file in it,
    released when the returned file is closed or the process ends, however it ends). A second
    launcher on the same directory (another terminal, a forgotten run) would delete the first's
    checkpoints and ledgers for its fresh run, or resume from a state still being written: it is
    refused with who holds the directory. Raises :class:`RunDirBusy`."""
    import fcntl
    import os
    import socket

    f = open(pathlib.Path(out) / ".launcher.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process"
        f.close()
        raise RunDirBusy(f"run directory {out} is in use by another launcher ({holder}): wait for it to end, or "
                         "give this run another --out-dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def clean_for_fresh_run(out: pathlib.Path) -> None:
    """A fresh run in an old directory: nothing of the old run may be mistaken for this one's."""
    for pattern in (*PER_ATTEMPT, "ledger/*.jsonl", "loader_state/*.json", "run.json", "launch.log"):
        for f in out.glob(pattern):
            f.unlink()
    for d in ("checkpoints", "attempts"):
        shutil.rmtree(out / d, ignore_errors=True)
