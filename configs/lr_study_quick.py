"""The quick LR-intervention study: lr_study shrunk to run in a few minutes on 2 cores.

A tiny model (1 layer, width 32, 32-byte sequences), 8 replicas, 200 steps,
three schedules (short failures of 1 and 3 replicas, long failures of 3),
three seeds: `python experiments/lr_intervention.py --quick --out results/lr_quick.json`.
"""

import dataclasses

from configs.lr_study import config as full
from configs.lr_study import study as full_study

config = dataclasses.replace(
    full,
    name="lr_study_quick",
    model=dataclasses.replace(full.model, d_model=32, num_layers=1, num_heads=2, max_seq_len=32),
    data=dataclasses.replace(full.data, seq_len=32, batch_size=8, corpus_bytes=1 << 18, eval_batches=2),
    optim=dataclasses.replace(full.optim, warmup_steps=10),
    train=dataclasses.replace(full.train, steps=200, out_dir="runs/lr_study_quick"),
)

study = dataclasses.replace(
    full_study,
    schedules=("d2x_fp32_for1k_1reps", "d2x_fp32_for1k_3reps", "d2x_fp32_for4k_3reps"),
    seeds=(0, 1, 2),
    periods=1,
    eval_every=5,
    smooth=8,
    window_margin=10,
)
