"""Persistent checkpoints: one replica writes an asynchronous Orbax checkpoint every K steps.

A checkpoint step directory holds three plain Orbax items, so anyone can read
it with the stock API (`ocp.CheckpointManager(dir).restore(step,
args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
loader=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))`):

    state   the TrainState pytree (StandardSave)
    loader  every replica's next stream position at this step (JSON)
    meta    free-form metadata: config name, quorum, wall time... (JSON)

Saving all replicas' loader positions *with* the state is what makes a full
restart exactly-once: the state at step s contains exactly the batches before
those positions.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import orbax.checkpoint as ocp

from fthsdp.errors import JobFatalError

log = logging.getLogger("fthsdp.checkpoint.persistent")

LOADER_FORMAT = "fthsdp.loader_positions"
LOADER_VERSION = 1
# The directory's owner: {"format": OWNER_FORMAT, "job": job id}, written once by the first
# process of the first job that checkpoints there (see claim_directory).
OWNER_FILE = "fthsdp_job.json"
OWNER_FORMAT = "fthsdp.checkpoint_owner"


class CheckpointError(RuntimeError):
    pass


LISTING_TRIES = 8  # listings of the checkpoint directory before a vanished step is an error


def _listed(list_steps):
    """``list_steps()`` (an Orbax call that lists the directory's steps and then reads each one's
    metadata) again while a step vanishes between the two: the writer replica prunes its oldest
    checkpoint (``max_to_keep``) whenever it saves, and any other process listing at that moment
    read a step directory that was no longer there. A replacement replica died of it at start-up
    in a `fthsdp ray` run (FileNotFoundError for step 30 while the writer saved step 60); a
    process listing while another saved every step failed 12% of its listings (181 of 1,528).
    The next listing no longer holds the pruned step."""
    for attempt in range(LISTING_TRIES):
        try:
            return list_steps()
        except (FileNotFoundError, NotADirectoryError):
            if attempt == LISTING_TRIES - 1:
                raise
            time.sleep(0.01 * (attempt + 1))


@dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    loader_positions: dict[int, int]  # replica -> next position to train
    metadata: dict


def _positions_to_json(step: int, positions: Mapping[int, int]) -> dict:
    bad = {r: p for r, p in positions.items() if int(r) < 0 or int(p) < 0}
    if bad:
        raise ValueError(f"loader positions must be non-negative (replica -> position), got {bad}")
    return {
        "format": LOADER_FORMAT,
        "version": LOADER_VERSION,
        "step": int(step),
        "positions": {str(int(r)): int(p) for r, p in sorted(positions.items())},
    }


def positions_from_json(d: Any, where: str) -> dict[int, int]:
    if not isinstance(d, dict) or d.get("format") != LOADER_FORMAT:
        raise CheckpointError(f"{where}: not a loader-positions item (format {d.get('format') if isinstance(d, dict) else d!r})")
    if d.get("version") != LOADER_VERSION:
        raise CheckpointError(f"{where}: loader-positions version {d.get('version')!r} unsupported (expected {LOADER_VERSION})")
    try:
        positions = {int(r): int(p) for r, p in d["positions"].items()}
    except (KeyError, AttributeError, ValueError, TypeError, OverflowError) as e:  # null, Infinity, a list
        raise CheckpointError(f"{where}: malformed loader positions: {type(e).__name__}: {e}") from None
    if any(p < 0 for p in positions.values()):
        raise CheckpointError(f"{where}: a loader position is negative ({positions}): the item is corrupt")
    return positions


class CheckpointOwnedError(CheckpointError, JobFatalError):
    """The checkpoint directory belongs to another job (no restart of this one can change that)."""


def claim_directory(directory: str, job_id: str) -> None:
    """Make ``directory`` job ``job_id``'s checkpoint directory, or refuse.

    Why: two jobs given the same output directory (a rerun under a new job id, a copied
    command line) wrote into the same Orbax step directories, and a ``--resume`` could
    restore the other job's state and loader positions without a word. The first process
    to checkpoint in a directory records its job in :data:`OWNER_FILE` (created only if
    absent: a hard link of a private temporary, atomic on POSIX file systems, so that two
    processes starting together agree on one owner); every later one must be of that job.
    A directory with checkpoints but no owner file (written before this rule) is claimed by
    whoever comes first. Raises :class:`CheckpointOwnedError` saying what to do."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, OWNER_FILE)
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            json.dump({"format": OWNER_FORMAT, "job": job_id}, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process of a job claimed it first: its claim is read below
        finally:
            os.unlink(tmp)
    try:
        with open(path) as f:
            owner = json.load(f)
        if not isinstance(owner, dict) or owner.get("format") != OWNER_FORMAT or not isinstance(owner.get("job"), str):
            raise ValueError(f"not a {OWNER_FORMAT} record")
    except (OSError, ValueError) as e:
        raise CheckpointOwnedError(
            f"{path} cannot be read as the checkpoint directory's owner ({e}): it says which job the "
            "checkpoints there belong to; restore it, or delete it if you know they are this job's "
            f"({job_id!r})") from None
    if owner["job"] != job_id:
        raise CheckpointOwnedError(
            f"the checkpoint directory {directory} belongs to job {owner['job']!r}, not to job {job_id!r}: "
            f"give this job its own output directory (--out-dir), or run it as job {owner['job']!r} "
            "(--job) to resume that job")


class PersistentCheckpointer:
    """Async Orbax checkpoints of state + loader positions + metadata every `every` steps.

    Only the writer replica (`writer=True`, usually the lowest healthy replica
    id) saves; every replica can restore."""

    def __init__(self, directory: str | os.PathLike, every: int, max_to_keep: int | None = 3,
                 writer: bool = True, async_save: bool = True, job_id: str = ""):
        """``job_id``: the job the checkpoints belong to; when given, the directory must be
        that job's or no job's yet (:func:`claim_directory`), and each checkpoint's ``meta``
        names it."""
        if every < 1:
            raise ValueError(f"checkpoint every must be >= 1 step, got {every} (set ft.checkpoint_every)")
        self.directory = os.path.abspath(os.fspath(directory))
        self.job_id = job_id
        if job_id:
            claim_directory(self.directory, job_id)
        self.every = every
        self.writer = writer
        self._in_flight: int | None = None  # the step of the last save started (named in its error)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=True,
            save_interval_steps=1,  # we decide with should_save (the committed step, not a call count)
        )
        self._mngr = _listed(lambda: ocp.CheckpointManager(self.directory, options=options,
                                                           item_names=("state", "loader", "meta")))

    def should_save(self, step: int) -> bool:
        return self.writer and step > 0 and step % self.every == 0

    def save(self, step: int, state, loader_positions: Mapping[int, int], metadata: Mapping | None = None,
             force: bool = False) -> bool:
        """Starts an async save of committed `step` if due (or `force`); returns whether it started."""
        if not (force or self.should_save(step)):
            return False
        if not self.writer:
            raise CheckpointError("this replica is not the checkpoint writer (writer=False)")
        meta = {"step": int(step), "time": time.time(), **({"job": self.job_id} if self.job_id else {}),
                **(dict(metadata) if metadata else {})}
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            loader=ocp.args.JsonSave(_positions_to_json(step, loader_positions)),
            meta=ocp.args.JsonSave(meta),
        )
        try:
            # Orbax's save() first finishes the save in flight and raises its error, which then
            # aborted this save too (two checkpoints lost, the log naming the wrong step).
            self._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - reported for the step it belongs to; this save goes on
            log.error("persistent checkpoint of step %s failed while it finished: %s: %s", self._in_flight,
                      type(e).__name__, e)
        # Steps another writer saved since this manager last listed (a new writer after a quorum
        # change): its max_to_keep pruning counts them too, or checkpoints piled up on disk. Not in a
        # replica of several processes: each would decide from its own listing whether the step
        # exists, and the Orbax calls below wait at barriers of all of them (one listing that
        # disagrees, on a shared filesystem's cache, and they wait at different ones).
        if jax.process_count() == 1:
            self._replace_existing(int(step))
        self._in_flight = int(step)
        return bool(self._mngr.save(int(step), args=args, force=True))

    def _replace_existing(self, step: int) -> None:
        _listed(self._mngr.reload)
        if int(step) in self._mngr.all_steps():
            # Another writer saved this step (a quorum change, a split brain's two writers): the
            # newer save wins, as Orbax did by itself when it had not listed that step yet; said
            # here (a writer whose state forked discards what it wrote: discard_written_by).
            try:
                was = self.metadata(int(step))
            except Exception as e:  # noqa: BLE001 - unreadable: replaced all the same
                was = {"error": f"{type(e).__name__}: {e}"}
            log.warning("checkpoint of step %d already exists (writer %s, quorum %s): replaced by this save",
                        step, was.get("writer", "?"), was.get("quorum_id", "?"))
            self._mngr.delete(int(step))

    def wait(self) -> None:
        """Blocks until the async save in flight (if any) is durable."""
        self._mngr.wait_until_finished()

    def latest_step(self) -> int | None:
        _listed(self._mngr.reload)
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        _listed(self._mngr.reload)
        return list(self._mngr.all_steps())

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def restore(self, like, step: int | None = None) -> Restored:
        """Restores `step` (default: the latest) into the structure/shardings of `like`
        (a pytree of jax.ShapeDtypeStruct with shardings, or of arrays)."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no persistent checkpoint under {self.directory}")
        elif step not in self.all_steps():
            raise CheckpointError(f"no checkpoint of step {step} under {self.directory}; have {self.all_steps()}")
        out = self._mngr.restore(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(like), loader=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()
            ),
        )
        return Restored(int(step), out["state"], positions_from_json(out["loader"], self.step_dir(step)), dict(out["meta"]))

    def metadata(self, step: int) -> dict:
        """The ``meta`` item of checkpoint ``step`` (writer, quorum id, time ...)."""
        out = self._mngr.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def discard_written_by(self, writer: str, first: int, last: int) -> list[int]:
        """Delete the checkpoints of steps ``first``..``last`` whose metadata names ``writer``;
        returns their steps. For a replica whose state forked from the job's lineage (rule 6
        of fthsdp.control.quorum): as the lowest healthy replica of its quorum it saved the
        forked state, and a later restart restoring it would bring back commits its ledger
        rolled back. A step the lineage's writer saved since (the same directory, its own
        metadata) is kept. Waits for this process's own save in flight first.

        Plain file operations, no Orbax call: only a replica's leader discards, and Orbax's
        restore and delete wait at a barrier of every process of the replica, which its
        followers never reach (the leader hung there, or paired it with their next collective).
        A step is renamed aside (atomic: a reader lists it whole or not at all), then removed."""
        self.wait()
        gone = []
        for step in self.all_steps():
            if first <= step <= last:
                try:
                    with open(os.path.join(self.step_dir(step), "meta", "metadata"), encoding="utf-8") as f:
                        mine = str(json.load(f).get("writer")) == str(writer)
                except (OSError, ValueError, AttributeError):  # being rewritten or removed by another process
                    continue
                if mine:
                    aside = f"{self.step_dir(step)}.discarded-{uuid.uuid4().hex[:8]}"
                    try:
                        os.rename(self.step_dir(step), aside)
                    except OSError as e:
                        log.warning("could not discard the checkpoint of step %d (%s): %s", step, aside, e)
                        continue
                    shutil.rmtree(aside, ignore_errors=True)
                    gone.append(step)
        if gone:
            _listed(self._mngr.reload)
        return gone

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()

    def __enter__(self) -> "PersistentCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
