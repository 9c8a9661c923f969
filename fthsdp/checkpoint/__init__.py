"""Checkpoints of a replica's state, in memory and on disk.

    snapshot      lazy, double-buffered device->host snapshots after each commit (DataStates-style)
    peer_server   HTTP(S) serving of the latest snapshot by (step, leaf, piece): signed requests, bounded
    peer_auth     the per-request HMAC proof (job's peer key, timestamp, nonce) the server checks
    http_head     strict, bounded parsing of one HTTP/1.x request head
    peer_fetch    striped, checksummed fetch of a snapshot from several healthy peers
    orbax_peer    the peer fetch as an Orbax CheckpointHandler, falling back to disk
    persistent    asynchronous Orbax checkpoints (state + loader positions + metadata) every K steps

Submodules are imported on first use (orbax and jax are heavy; a peer
server process needs neither of the Orbax parts).
"""

import importlib

_EXPORTS = {
    "Snapshotter": "snapshot",
    "Snapshot": "snapshot",
    "Manifest": "snapshot",
    "SnapshotError": "snapshot",
    "StaleStepError": "snapshot",
    "restore_tree": "snapshot",
    "PeerServer": "peer_server",
    "StaticSource": "peer_server",
    "Fault": "peer_server",
    "PeerFetcher": "peer_fetch",
    "FetchError": "peer_fetch",
    "PeerCheckpointHandler": "orbax_peer",
    "PeerRestore": "orbax_peer",
    "RestoreInfo": "orbax_peer",
    "PersistentCheckpointer": "persistent",
    "Restored": "persistent",
    "CheckpointError": "persistent",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'fthsdp.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fthsdp.checkpoint.{mod}"), name)
