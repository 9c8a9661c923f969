"""Learning-rate intervention while replicas are missing (paper, section 6.2).

When only `healthy` of `total` replicas contribute, the effective batch shrinks;
scaling the learning rate by sqrt(healthy/total) (the square-root scaling rule
for adaptive optimizers) flattened the loss fluctuation in the paper, linear
scaling was worse. Pure functions: they work on Python numbers, numpy and jax
arrays alike, so the same code runs on the host and inside the jitted step.
"""

from __future__ import annotations

import enum

import numpy as np


class Intervention(enum.IntEnum):
    NONE = 0
    LINEAR = 1
    SQRT = 2

    @classmethod
    def parse(cls, value: "str | int | Intervention") -> "Intervention":
        if isinstance(value, Intervention):
            return value
        if isinstance(value, (int, np.integer)):
            return cls(int(value))
        try:
            return cls[str(value).strip().upper()]
        except KeyError:
            names = ", ".join(m.name.lower() for m in cls)
            raise ValueError(f"unknown LR intervention {value!r}; choose one of: {names}") from None


def lr_scale(mode, healthy, total, xp=np):
    """Multiplier of the learning rate for `healthy` of `total` replicas.

    `xp` is the array namespace (numpy or jax.numpy); inside jit pass jnp so the
    mode selects by value, not by Python control flow (no recompilation).
    A degenerate quorum (total <= 0) gets scale 1.
    """
    total_f = xp.maximum(xp.asarray(total, dtype=xp.float32), 1.0)
    frac = xp.clip(xp.asarray(healthy, dtype=xp.float32) / total_f, 0.0, 1.0)
    mode = xp.asarray(mode)
    return xp.where(mode == Intervention.LINEAR, frac,
                    xp.where(mode == Intervention.SQRT, xp.sqrt(frac), xp.ones_like(frac)))
