"""Single-replica training: the step loop of one replica with no peers.

This is the foundation's main job and the reference the fault-tolerant
Manager must reproduce bit for bit when no failure happens.
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
from dataclasses import dataclass

import jax
import numpy as np

from fthsdp import logs
from fthsdp.config import Config, to_dict
from fthsdp.data import LoaderState, ReplicaStream, eval_batches
from fthsdp.step.intervention import Intervention
from fthsdp.step.quorum_inputs import make_quorum_inputs
from fthsdp.step.sharding import replica_mesh
from fthsdp.errors import JobFatalError
from fthsdp.step.functional import TrainState, make_train_step, nonfinite_skipped, nonfinite_stop

log = logging.getLogger("fthsdp.step.train")


@dataclass
class TrainResult:
    state: TrainState
    loader: LoaderState
    first_loss: float
    last_loss: float
    eval_loss: float
    steps_per_s: float
    out_dir: pathlib.Path


def evaluate(ts, state, cfg: Config) -> float:
    losses = [float(ts.eval_loss(state, *ts.shard_batch(x, y))) for x, y in eval_batches(cfg.data)]
    return float(np.mean(losses))


def train(cfg: Config, *, progress: bool = True) -> TrainResult:
    out = pathlib.Path(cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    metrics = logs.MetricsWriter(out / "metrics.jsonl")

    mesh = replica_mesh(cfg.launch.devices_per_replica)
    log.info("replica mesh: %d %s device(s); model %d layers x %d wide", mesh.devices.size,
             jax.default_backend(), cfg.model.num_layers, cfg.model.d_model)
    ts = make_train_step(cfg, mesh)
    state = ts.init(cfg.train.seed)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    log.info("%s parameters, sharded over %d device(s)", f"{n_params:,}", mesh.devices.size)

    stream = ReplicaStream(cfg.data, replica=0)
    loader = LoaderState(replica=0)
    quorum = make_quorum_inputs(lr_mode=Intervention.parse(cfg.ft.intervention))

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn(),
                   disable=not progress, transient=False)
    first_loss = last_loss = float("nan")
    eval_loss = float("nan")
    skipped_run = 0  # steps in a row whose update was skipped for non-finite gradients
    t0 = time.perf_counter()
    with bar:
        task = bar.add_task("train", total=cfg.train.steps, loss=float("nan"))
        for i in range(cfg.train.steps):
            batch = stream.batch(loader.position)
            x, y = ts.shard_batch(batch.inputs, batch.targets)
            # The split path, as the Manager and the numerical twin run it, so a
            # one-replica run is bit for bit the reference for both.
            grads, m = ts.compute_grads(state, x, y)
            state, m2 = ts.apply_grads(state, grads, quorum)
            m = {**m, **m2}
            if bool(m["committed"]):
                loader = loader.advanced()
                # optim.nonfinite=skip, as in the Manager: the run stops at nonfinite_limit skips in a row
                skipped_run = skipped_run + 1 if bool(m["skipped"]) else 0
                if skipped_run:
                    log.warning("%s", nonfinite_skipped(i, skipped_run, cfg.optim.nonfinite_limit))
                if skipped_run >= cfg.optim.nonfinite_limit:
                    metrics.close()
                    raise JobFatalError(nonfinite_stop(i, skipped_run, cfg.optim.nonfinite_limit))
            if i == 0:
                first_loss = float(m["loss"])
                t0 = time.perf_counter()  # exclude compilation from throughput
            if (i + 1) % cfg.train.log_every == 0 or i + 1 == cfg.train.steps:
                last_loss = float(m["loss"])
                metrics.write(kind="train", step=i + 1, loss=last_loss, lr=float(m["lr"]),
                              grad_norm=float(m["grad_norm"]))
                bar.update(task, loss=last_loss)
                if not progress:
                    log.info("step %4d  loss %.4f  lr %.2e", i + 1, last_loss, float(m["lr"]))
            if cfg.train.eval_every and ((i + 1) % cfg.train.eval_every == 0 or i + 1 == cfg.train.steps):
                eval_loss = evaluate(ts, state, cfg)
                metrics.write(kind="eval", step=i + 1, eval_loss=eval_loss)
                log.info("step %4d  held-out loss %.4f", i + 1, eval_loss)
            bar.advance(task)
    elapsed = time.perf_counter() - t0
    steps_per_s = (cfg.train.steps - 1) / elapsed if cfg.train.steps > 1 and elapsed > 0 else 0.0
    metrics.close()
    from fthsdp.plots import loss_curve

    plot = loss_curve(logs.read_metrics(out / "metrics.jsonl"), out / "loss.png", title=f"fthsdp train: {cfg.name}")
    summary = {"first_loss": first_loss, "last_loss": last_loss, "eval_loss": eval_loss,
               "steps": int(state.step), "steps_per_s": steps_per_s, "loader_position": loader.position}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("done: loss %.3f -> %.3f (held-out %.3f), %.1f steps/s; wrote %s and %s",
             first_loss, last_loss, eval_loss, steps_per_s, out / "metrics.jsonl", plot)
    return TrainResult(state, loader, first_loss, last_loss, eval_loss, steps_per_s, out)
