"""Peer fetch as an Orbax extension: restore a pytree from peers, falling back to disk.

`PeerCheckpointHandler` is an Orbax `CheckpointHandler`. Saving through it
writes an ordinary Orbax checkpoint (it delegates to
`StandardCheckpointHandler`), so plain Orbax reads what it saves. Restoring
with `PeerRestore` args draws the pytree from the healthy peers' in-memory
snapshots (`peer_fetch`): the fetch is striped over every peer and runs in
layout order, and each array is placed on its sharding as soon as its pieces
have landed and verified, while later arrays are still in flight.

If the peers cannot supply the state (all gone, lying, or serving another
step), it restores the whole tree from the persistent checkpoint in the
directory Orbax hands it. The fallback is whole-tree on purpose: mixing arrays
of the peers' step with arrays of an older checkpoint step would build a state
that never existed. `handler.last_restore` says which source was used and at
which step, so the caller resumes the loader positions of that step.

Use it directly, through `ocp.Checkpointer(PeerCheckpointHandler())`, or as
an item handler of a `CheckpointManager`:

    mngr = ocp.CheckpointManager(root, item_handlers={"state": PeerCheckpointHandler(), ...})
    mngr.restore(step, args=ocp.args.Composite(state=PeerRestore(abstract, sources, peer_key, peer_step)))
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from fthsdp.checkpoint.peer_fetch import FetchError, PeerFetcher
from fthsdp.checkpoint.snapshot import SnapshotError, flatten, place
from fthsdp.digits import ascii_int

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreInfo:
    source: str  # "peers" | "persistent"
    step: int | None  # the step of the restored state (None: unknown, persistent dir not named by step)
    detail: dict = field(default_factory=dict)  # fetch report, or the peers' failure that caused the fallback


class PeerCheckpointHandler(ocp.CheckpointHandler):
    """Restores from peers (PeerRestore) or disk; saves plain Orbax (PeerSave = StandardSave)."""

    def __init__(self):
        self._standard = ocp.StandardCheckpointHandler()
        self.last_restore: RestoreInfo | None = None

    def save(self, directory: epath.Path, args: ocp.args.StandardSave) -> None:
        if not isinstance(args, ocp.args.StandardSave):  # PeerSave is one
            raise TypeError(f"PeerCheckpointHandler saves with PeerSave or StandardSave, got {type(args).__name__}")
        self._standard.save(directory, args=ocp.args.StandardSave(args.item, args.save_args, args.custom_metadata))

    def restore(self, directory: epath.Path | None, args: "PeerRestore | ocp.args.StandardRestore") -> Any:
        if isinstance(args, ocp.args.StandardRestore):
            out = self._standard.restore(directory, args=args)
            self.last_restore = RestoreInfo("persistent", _step_of(directory))
            return out
        if not isinstance(args, PeerRestore):
            raise TypeError("PeerCheckpointHandler restores with PeerRestore or StandardRestore, "
                            f"got {type(args).__name__}")
        try:
            tree, report = restore_from_peers(args)
        except (FetchError, SnapshotError, OSError) as e:
            if not args.fallback or directory is None or not epath.Path(directory).exists():
                raise FetchError(
                    f"restoring from peers failed and there is no persistent checkpoint to fall back to: {e}"
                ) from e
            log.warning("peer restore failed (%s); restoring from the persistent checkpoint %s", e, directory)
            out = self._standard.restore(directory, args=ocp.args.StandardRestore(args.item))
            self.last_restore = RestoreInfo("persistent", _step_of(directory), {"peer_error": str(e)})
            return out
        self.last_restore = RestoreInfo("peers", report["step"], report)
        return tree

    def metadata(self, directory: epath.Path):
        return self._standard.metadata(directory)

    def finalize(self, directory: epath.Path) -> None:
        self._standard.finalize(directory)

    def close(self) -> None:
        self._standard.close()


@ocp.args.register_with_handler(PeerCheckpointHandler, for_save=True)
@dataclass
class PeerSave(ocp.args.StandardSave):
    """StandardSave under another name: Orbax needs a save-args class per handler.
    What it writes is a plain StandardCheckpointHandler checkpoint."""


@ocp.args.register_with_handler(PeerCheckpointHandler, for_restore=True)
@dataclass
class PeerRestore(ocp.args.CheckpointArgs):
    """Restore `item`'s structure, dtypes and shardings from `sources` at `step`.

    item: pytree of jax.ShapeDtypeStruct (with .sharding) or arrays; numpy
    leaves or ShapeDtypeStructs without a sharding come back as numpy.
    deadline: a time.monotonic() value by which the fetch is over (PeerFetcher): past it the
    peers' restore fails (FetchError naming the slow sources; then the fallback, if any). None:
    only the fetch's stall limit bounds it."""

    item: Any
    sources: Sequence[str]
    key: bytes | str  # the job's peer key (peer_server.peer_key)
    step: int | None = None
    streams_per_source: int = 2
    timeout_s: float = 10.0
    fallback: bool = True
    tls_ca_file: str | None = None  # https sources: verify them against this CA (PeerFetcher)
    deadline: float | None = None


def _step_of(directory) -> int | None:
    if directory is None:
        return None
    p = epath.Path(directory)
    for name in (p.name, p.parent.name):
        if (step := ascii_int(name)) is not None:
            return step
    return None


def restore_from_peers(args: PeerRestore) -> tuple[Any, dict]:
    """The pytree, array by array as each lands, and the fetch report. Every wait (the manifests,
    each leaf, the rest) ends by `args.deadline`: the session enforces it and, on any failure, the
    `finally` closes the session, which shuts its sockets and joins its threads quickly."""
    if not args.sources:
        raise FetchError("no peer sources were given")
    fetcher = PeerFetcher(args.sources, args.key, step=args.step, streams_per_source=args.streams_per_source,
                          timeout_s=args.timeout_s, tls_ca_file=args.tls_ca_file, deadline=args.deadline)
    session = fetcher.start(like=args.item)
    try:
        paths, leaves, treedef = flatten(args.item)
        out = []
        for i, x in enumerate(leaves):
            host = session.leaf(i)
            sharding = None if isinstance(x, np.ndarray) else getattr(x, "sharding", None)
            out.append(host if sharding is None else place(host, sharding))  # views into the session's own buffer
        session.wait()
    finally:
        session.close()
    return jax.tree_util.tree_unflatten(treedef, out), session.report()


def restore(like, sources: Sequence[str], key: bytes | str, step: int | None, checkpoint_dir: str | None = None,
            **kwargs) -> tuple[Any, RestoreInfo]:
    """Peers first, else the persistent checkpoint item at `checkpoint_dir` (…/STEP/state).

    `kwargs` are PeerRestore's fields: streams_per_source, timeout_s, fallback, tls_ca_file, and
    deadline (a time.monotonic() value by which the peers' fetch must be over)."""
    handler = PeerCheckpointHandler()
    args = PeerRestore(like, list(sources), key, step, **kwargs)
    if checkpoint_dir is not None:
        tree = ocp.Checkpointer(handler).restore(checkpoint_dir, args=args)
    else:
        tree = handler.restore(None, args)
    assert handler.last_restore is not None
    return tree, handler.last_restore


__all__ = ["PeerCheckpointHandler", "PeerRestore", "PeerSave", "RestoreInfo", "restore", "restore_from_peers"]
