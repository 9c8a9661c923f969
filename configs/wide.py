"""A wider model for benchmarks (not for CI): base with 4 layers of width 256."""

import dataclasses

from configs.base import config as base

config = dataclasses.replace(
    base,
    name="wide",
    model=dataclasses.replace(base.model, d_model=256, num_layers=4, num_heads=8, max_seq_len=128),
    data=dataclasses.replace(base.data, seq_len=128, batch_size=32),
)
