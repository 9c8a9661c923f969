"""The embedded default: a tiny byte-level LM that trains in well under a minute on 2 CPU cores."""

from fthsdp.config import Config, TrainConfig

config = Config(name="base", train=TrainConfig(steps=300, log_every=10, eval_every=100, out_dir="runs/base"))
