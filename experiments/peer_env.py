"""Where the side environment of the side-by-side peers lives (Gloo, MPI, torchft).

`experiments/setup_peers.sh` builds it: a Python 3.11 venv with the CPU torch
wheel, mpi4py and torchft, kept out of the project's 3.12 venv. One place
answers "which python runs the peers" for every benchmark.
"""

from __future__ import annotations

import os
import pathlib


def peers_env() -> pathlib.Path:
    """$FTHSDP_PEERS_ENV, else the user's cache directory (what setup_peers.sh uses)."""
    if os.environ.get("FTHSDP_PEERS_ENV"):
        return pathlib.Path(os.environ["FTHSDP_PEERS_ENV"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "fthsdp" / "peers311"


def default_peer_python() -> str:
    """$FTHSDP_PEER_PYTHON, else the side environment's python."""
    return os.environ.get("FTHSDP_PEER_PYTHON") or str(peers_env() / "bin" / "python")
