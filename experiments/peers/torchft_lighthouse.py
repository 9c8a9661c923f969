"""torchft's lighthouse (PyPI ``torchft``) in the Python 3.11 side environment.

Run by experiments/scale.py with the side environment's python (see
experiments/setup_peers.sh). It loads torchft's native extension module
directly, so that importing torch (seconds, and nothing the lighthouse uses)
is not paid. Prints ``listening PORT``, serves until stdin closes.

    python torchft_lighthouse.py MIN_REPLICAS [JOIN_TIMEOUT_MS] [TICK_MS] [HEARTBEAT_TIMEOUT_MS]
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os
import sys


def load_native():
    spec = importlib.util.find_spec("torchft")  # locates the package without running its __init__
    if spec is None or spec.origin is None:
        raise SystemExit("torchft is not installed in this environment (pip install torchft)")
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "_torchft*.so"))
    if not found:
        raise SystemExit(f"torchft's native module _torchft*.so not found next to {spec.origin}")
    loader = importlib.machinery.ExtensionFileLoader("_torchft", found[0])
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("_torchft", loader))
    loader.exec_module(mod)
    return mod


def main() -> int:
    args = [int(a) for a in sys.argv[1:]]
    min_replicas = args[0]
    join_ms, tick_ms, hb_ms = (args[1:] + [60000, 100, 60000][len(args) - 1:])[:3]
    native = load_native()
    server = native.LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=join_ms,
                                     quorum_tick_ms=tick_ms, heartbeat_timeout_ms=hb_ms)
    port = server.address().rpartition(":")[2]
    print(f"listening {port}", flush=True)
    try:
        sys.stdin.read()  # until the parent closes our stdin (or dies)
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
