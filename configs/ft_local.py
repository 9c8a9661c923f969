"""The README's main job: 3 replicas x 2 devices, replica 1 killed mid-run and restarted."""

import dataclasses

from configs.base import config as base

config = dataclasses.replace(
    base,
    name="ft_local",
    launch=dataclasses.replace(base.launch, replicas=3, devices_per_replica=2, kill=("1@40",)),
    train=dataclasses.replace(base.train, steps=120, out_dir="runs/ft_local"),
)
