"""Inputs of the GPU FTAR tests: one place, shared by the worker and the test."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def inputs(rank: int, big: int = 0, f32: int = 100_003, bf16: int = 77_777,
           f16: int = 55_555) -> dict[str, np.ndarray]:
    """Random f32/bf16/f16 (their sums round: compared bitwise with the CPU
    FTAR) and small integers (their sums are exact: compared with numpy)."""
    rng = np.random.default_rng(1000 + rank)
    out = {
        "f32": (rng.standard_normal(f32) * 10).astype(np.float32),
        "bf16": (rng.standard_normal(bf16) * 10).astype(ml_dtypes.bfloat16),
        "f16": (rng.standard_normal(f16) * 10).astype(np.float16),
        "ints": rng.integers(-50, 50, 4099).astype(np.float32),
    }
    if big:
        out["big"] = rng.integers(-8, 8, big).astype(np.float32)
    return out
