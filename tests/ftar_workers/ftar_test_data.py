"""Gradients each rank of the FTAR tests contributes (shared by the workers and the tests)."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def inputs(rank: int, big: int = 0) -> dict[str, np.ndarray]:
    """Integer-valued leaves (their sums are exact) and random ones (checked for identity)."""
    rng = np.random.default_rng(1000 + rank)
    g = {
        "ints": (np.arange(12 * 8, dtype=np.float32).reshape(12, 8) % 7) * (rank + 1),
        "rand": rng.standard_normal((16, 10)).astype(np.float32),
        "bf16": rng.standard_normal(37).astype(ml_dtypes.bfloat16),
        "f16": ((np.arange(6) % 5) * (rank + 1)).astype(np.float16),
    }
    if big:
        g["big"] = rng.standard_normal(big).astype(np.float32)
    return g
