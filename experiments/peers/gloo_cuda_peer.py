"""torch.distributed + Gloo all-reducing CUDA tensors (Gloo stages them through
the host itself), several peers sharing one GPU."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

s = common.spec()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", init_method=f"file://{s['rdv']}/gloo_store", rank=s["rank"],
                        world_size=s["n"])


def op(t):
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return t


times = common.timed(op, s["sizes"], s["iters"], s["warmup"],
                     lambda nbytes: torch.ones(nbytes // 4, dtype=torch.float32, device="cuda"))
common.write(s, times)
dist.destroy_process_group()
