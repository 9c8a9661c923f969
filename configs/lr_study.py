"""The LR-intervention study (paper section 6.2, figures 8 and 9), scaled to this machine.

`config` is the model/data/optimizer every run of the study shares (composed
from configs/base.py); `study` is what the study sweeps: failure schedules in
the paper's `freq_fp_len_con_lr` grammar x interventions x seeds, on
`launch.replicas` replicas simulated by the numerical twin (fthsdp/sim/twin.py).
The schedules mirror figure 9: short (1k-step) and long (4k-step) failures
killing 1 or 3 replicas at once. Runs for a few tens of minutes on 2 cores:
`python experiments/lr_intervention.py --out results/lr_study.json`.
"""

import dataclasses

from configs.base import config as base
from fthsdp.sim.schedules import StudyConfig

config = dataclasses.replace(
    base,
    name="lr_study",
    model=dataclasses.replace(base.model, d_model=64, num_layers=2, num_heads=4, max_seq_len=64),
    data=dataclasses.replace(base.data, seq_len=64, batch_size=8, corpus_bytes=1 << 20, eval_batches=4),
    optim=dataclasses.replace(base.optim, lr=3e-3, warmup_steps=40, decay="cosine"),
    launch=dataclasses.replace(base.launch, replicas=8, devices_per_replica=1),
    train=dataclasses.replace(base.train, steps=800, out_dir="runs/lr_study"),
)

study = StudyConfig(
    schedules=("d2x_fp32_for1k_1reps", "d2x_fp32_for1k_3reps", "d2x_fp32_for4k_1reps", "d2x_fp32_for4k_3reps"),
    interventions=("none", "linear", "sqrt"),
    seeds=(0, 1, 2, 3, 4),
    start_frac=0.4,
    end_frac=0.85,
    periods=2,
    eval_every=10,
    smooth=16,
    window_margin=20,
    honor_precision=True,
)
