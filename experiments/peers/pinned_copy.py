"""The staging ceiling: pinned host <-> device copy bandwidth (torch, one process).
Writes {"d2h_gbps": {bytes: GB/s}, "h2d_gbps": {...}} (median of timed copies)."""

from __future__ import annotations

import json
import statistics
import sys
import time

s = json.loads(sys.argv[1])
import torch  # noqa: E402

out = {"d2h_gbps": {}, "h2d_gbps": {}}
for nbytes in s["sizes"]:
    dev = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    for name, dst, src in (("d2h_gbps", host, dev), ("h2d_gbps", dev, host)):
        ts = []
        for i in range(s["warmup"] + s["iters"]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            if i >= s["warmup"]:
                ts.append(time.perf_counter() - t0)
        out[name][str(nbytes)] = nbytes / statistics.median(ts) / 1e9
open(s["out"], "w").write(json.dumps(out))
