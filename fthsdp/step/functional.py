"""The functional training step.

`make_train_step` returns jitted functions whose quorum (who contributes, how
many, the LR intervention, the communicator) is an array input, so membership
changes never recompile (invariant 4). The step is split in two so that the
Manager can retry only the all-reduce and update with the gradients it already
holds after a recoverable failure (numerically identical to retraining the
step on the same batch):

    compute_grads(state, batch)        -> grads, metrics
    apply_grads(state, grads, quorum)  -> state, metrics   (FTAR + vote + update)
    step(state, batch, quorum)         -> state, metrics   (the two fused)

The split path is bitwise reproducible (same bytes on a retry, and on every
replica); the fused step is the same maths, but XLA may fuse it differently,
so it agrees with the split path only to rounding. Multi-replica code (the
Manager, the numerical twin) uses the split path everywhere.

The intra-replica commit vote of the paper's two-phase commit is a collective
inside `apply_grads`: the update is applied only if every local shard's
all-reduce reported success; otherwise the state is returned bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fthsdp.step import intervention
from fthsdp.config import Config, OptimConfig
from fthsdp.models import DecoderLM
from fthsdp.step.fingerprint import fingerprint as state_fingerprint
from fthsdp.step.program_cache import ProgramCounts, counts_of, persistent_jit
from fthsdp.step.quorum_inputs import STATUS_OK, AllReduceFn, QuorumInputs, local_allreduce
from fthsdp.step.sharding import batch_sharding, fsdp_shardings


class TrainState(NamedTuple):
    """Everything a replica must hold identically to its peers after a commit."""

    step: jax.Array  # int32 scalar: committed steps
    params: Any  # pure nested dict of arrays (flax NNX Params)
    opt_state: Any


def state_hash(state: TrainState) -> str:
    """sha256 over every leaf's dtype and bytes (step, params, optimizer state), in
    tree order: what invariant 1 (identical replicas) is checked with, by the
    replicas, the launcher's report and the numerical twin alike."""
    import hashlib

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            # A replica of several processes: gather the whole array (a collective of the
            # replica's runtime, so every process of the replica hashes at the same point).
            from jax.experimental import multihost_utils

            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        a = np.asarray(leaf)
        h.update(str(a.dtype).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    lr = float(cfg.lr)  # (an int from a config file made a weak int32 leaf that turned float32 at step 1)
    warmup = cfg.warmup_steps
    if cfg.decay == "constant":
        return optax.linear_schedule(0.0, lr, warmup) if warmup else optax.constant_schedule(lr)
    if cfg.decay != "cosine":
        raise ValueError(f"optim.decay must be 'cosine' or 'constant', got {cfg.decay!r}")
    # (warmup 0 is optax's own "no warm-up": step 0 at the full rate; rounded up to 1, step 0
    # trained at rate 0)
    return optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup, max(total_steps, warmup + 1), end_value=lr * 0.1
    )


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """AdamW behind inject_hyperparams: the LR is set from an array inside jit."""

    def build(learning_rate):
        return optax.chain(
            optax.clip_by_global_norm(cfg.grad_clip),
            optax.adamw(learning_rate, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
        )

    return optax.inject_hyperparams(build)(learning_rate=float(cfg.lr))


def _all_finite(tree: Any) -> jax.Array:
    """One bool: every element of every leaf is finite (no NaN, no infinity)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def nonfinite_skipped(step: int, run: int, limit: int) -> str:
    """What a step whose update was skipped for non-finite gradients says (optim.nonfinite=skip)."""
    return (f"the averaged gradients of step {step} hold a NaN or an infinity: the update was skipped "
            f"(optim.nonfinite=skip; {run} in a row, the job stops at optim.nonfinite_limit={limit})")


def nonfinite_stop(step: int, run: int, limit: int) -> str:
    """Why a run stops after ``run`` (>= optim.nonfinite_limit) skipped updates in a row, and what to do."""
    return (f"steps {step - run + 1}..{step}: the averaged gradients held a NaN or an infinity {run} times in a "
            f"row (optim.nonfinite_limit={limit}); the updates were skipped, and the run has diverged or a "
            "replica's device computes wrong values. Look for a loss spike in the logs before those steps; "
            "resume from a persistent checkpoint before them (fthsdp run --resume) with a lower optim.lr or "
            "optim.grad_clip, or raise optim.nonfinite_limit to skip on")


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@dataclass(frozen=True)
class TrainStep:
    init: Callable[[int], TrainState]
    compute_grads: Callable
    apply_grads: Callable
    step: Callable
    eval_loss: Callable
    state_shardings: Any
    mesh: jax.sharding.Mesh
    # The same functions before jit, for callers that transform them further
    # (the numerical twin vmaps them over a replica axis).
    raw_compute_grads: Callable
    raw_apply_grads: Callable
    raw_init: Callable
    jit_init: Callable | None = None  # what `init` calls, for program_counts

    def program_counts(self) -> ProgramCounts:
        """Programs this process loaded from, or compiled into, its own program cache
        (fthsdp/step/program_cache.py; all zero where JAX's cache serves it)."""
        return counts_of(self.jit_init, self.compute_grads, self.apply_grads, self.step, self.eval_loss)

    def shard_batch(self, inputs: np.ndarray, targets: np.ndarray):
        """The replica's global batch (the same rows on every process of the replica) as arrays
        sharded over its mesh; across processes each one places only its own devices' rows."""
        s = batch_sharding(self.mesh)
        if s.is_fully_addressable:
            return jax.device_put(inputs, s), jax.device_put(targets, s)
        return tuple(jax.make_array_from_callback(a.shape, s, lambda idx, a=a: a[idx]) for a in (inputs, targets))


def make_train_step(
    cfg: Config,
    mesh: jax.sharding.Mesh,
    allreduce: AllReduceFn = local_allreduce,
    fingerprint: bool | None = None,
) -> TrainStep:
    """Builds the jitted step functions of one replica over `mesh`.

    ``fingerprint`` (default ``cfg.ft.fingerprint``): ``apply_grads`` also returns
    ``metrics["commit_words"]``, uint32[3]: the commit flags (bit 0 committed, bit 1 the update
    skipped for non-finite gradients), then the state fingerprint (fthsdp/step/fingerprint.py)
    of the state it returns, computed on the devices inside the same jitted call;
    ``fingerprint.read_commit`` reads them with one transfer. Without it, the flags alone:
    ``metrics["commit_flags"]``, uint32."""
    cfg.validate()
    if fingerprint is None:
        fingerprint = cfg.ft.fingerprint
    every = int(cfg.ft.fingerprint_every)
    skip_nonfinite = cfg.optim.nonfinite == "skip"
    model_cfg = cfg.model
    tx = make_optimizer(cfg.optim)
    schedule = lr_schedule(cfg.optim, cfg.train.steps)

    abstract_model = nnx.eval_shape(lambda: DecoderLM(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)

    def to_model(params):
        state = jax.tree.map(lambda x: x, abstract_params)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def init_fn(seed):
        model = DecoderLM(model_cfg, rngs=nnx.Rngs(jax.random.key(seed)))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    abstract_state = jax.eval_shape(init_fn, jnp.uint32(0))
    state_shardings = fsdp_shardings(abstract_state, mesh)
    param_shardings = state_shardings.params
    bsh = batch_sharding(mesh)

    def loss_fn(params, inputs, targets):
        return cross_entropy(to_model(params)(inputs), targets)

    def compute_grads(state: TrainState, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, inputs, targets)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        return grads, {"loss": loss}

    def apply_grads(state: TrainState, grads, quorum: QuorumInputs):
        contribute = quorum.contribute > 0
        grads = jax.tree.map(lambda g: jnp.where(contribute, g, jnp.zeros_like(g)), grads)
        summed, status = allreduce(grads, quorum, mesh)
        n = jnp.maximum(quorum.num_contributing, 1).astype(jnp.float32)
        mean = jax.tree.map(lambda g: (g / n.astype(g.dtype)).astype(g.dtype), summed)
        mean = jax.lax.with_sharding_constraint(mean, param_shardings)
        # The commit vote: every local shard's all-reduce must have succeeded.
        ok = jnp.all(status == STATUS_OK) & (quorum.num_contributing > 0)

        scale = intervention.lr_scale(quorum.lr_mode, quorum.num_contributing, quorum.num_configured, xp=jnp)
        lr = schedule(state.step) * scale
        # A new hyperparams dict, not the input's written into: a step that does not commit
        # must return its input state bit for bit, learning rate included.
        opt_state = state.opt_state._replace(
            hyperparams={**state.opt_state.hyperparams, "learning_rate": jnp.asarray(lr, jnp.float32)})
        updates, new_opt = tx.update(mean, opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        new_state = TrainState(state.step + 1, new_params, new_opt)
        # optim.nonfinite=skip: averaged gradients with a NaN or an infinity commit the step (its
        # batch is spent, the counter moves) and leave the parameters and the optimizer state as
        # they were. Every replica holds the same averaged bytes, so all of them skip alike.
        skipped = ok & ~_all_finite(mean) if skip_nonfinite else jnp.zeros((), bool)
        keep = lambda new, old: jnp.where(ok & ~skipped, new, old)  # noqa: E731
        out = jax.tree.map(keep, new_state, state)._replace(step=jnp.where(ok, state.step + 1, state.step))
        metrics = {
            "committed": ok,
            "skipped": skipped,
            "lr": lr,
            "lr_scale": scale,
            "grad_norm": optax.tree.norm(mean),
            "status": status,
        }
        # The commit flags (and the fingerprint) in one output, read with one transfer
        # (fingerprint.read_commit): each read of a step output costs ~60 us of host time
        # and each output ~10 us of dispatch, 0.2% and 0.03% of a make-run step.
        flags = ok.astype(jnp.uint32) | (skipped.astype(jnp.uint32) << 1)
        if fingerprint:  # of the state returned (the committed one when ok): silent-data-corruption check
            fp_of = lambda s: state_fingerprint(s, state_shardings)  # noqa: E731
            if every == 1:
                fp = fp_of(out)
            else:  # only when the state's step is a multiple of K (the Manager reports those only)
                fp = jax.lax.cond(out.step % every == 0, fp_of, lambda s: jnp.zeros((2,), jnp.uint32), out)
            metrics["commit_words"] = jnp.concatenate([flags[None], fp])
        else:
            metrics["commit_flags"] = flags
        return out, metrics

    def step(state, inputs, targets, quorum):
        grads, m1 = compute_grads(state, inputs, targets)
        new_state, m2 = apply_grads(state, grads, quorum)
        return new_state, {**m1, **m2}

    def eval_loss(state, inputs, targets):
        return loss_fn(state.params, inputs, targets)

    # persistent_jit: jax.jit, except that a replica's follower processes keep their programs on
    # disk, which JAX's own cache does not do for them (fthsdp/step/program_cache.py).
    jit_init = persistent_jit(init_fn, out_shardings=state_shardings)
    return TrainStep(
        init=lambda seed: jit_init(jnp.asarray(seed, jnp.uint32)),
        compute_grads=persistent_jit(compute_grads, in_shardings=(state_shardings, bsh, bsh)),
        apply_grads=persistent_jit(apply_grads, out_shardings=(state_shardings, None)),
        step=persistent_jit(step, in_shardings=(state_shardings, bsh, bsh, None),
                            out_shardings=(state_shardings, None)),
        eval_loss=persistent_jit(eval_loss, in_shardings=(state_shardings, bsh, bsh)),
        state_shardings=state_shardings,
        mesh=mesh,
        raw_compute_grads=compute_grads,
        raw_apply_grads=apply_grads,
        raw_init=init_fn,
        jit_init=jit_init,
    )
