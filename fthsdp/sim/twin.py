"""The numerical twin: N replicas of FT-HSDP simulated in one process.

Why: an LR-intervention study needs dozens of runs with failures; real
processes, sockets and kills cost minutes each on this machine, while the
numbers only depend on who contributes at each step. The twin replays a
membership mask (fthsdp.sim.schedules) through the SAME step code the replicas run:

* every replica holds its own `TrainState` on a one-device replica mesh and
  computes its gradients with the jitted `TrainStep.compute_grads` on its own
  batch `ReplicaStream(cfg.data, r).batch(position)`;
* the quorum of each step is built from the mask exactly as the lighthouse
  would: healthy replicas contribute, a replica that comes back is *behind*
  for its first step (member of the ring with contribute=0: zero gradient,
  no batch consumed) and takes a healthy peer's state from the end of the
  previous step (catch-up, peers assigned round-robin like the lighthouse's
  load balancing), absent replicas are not members;
* the cross-replica all-reduce is a sum, in ring (rank) order, of the
  members' gradients after the step's own contribute-zeroing; it is handed to
  the replicas' own jitted `apply_grads` (FTAR custom call included) as the
  gradient of a ring of one, which FTAR passes through unchanged, so the rest
  of the step (mean, LR intervention, commit vote, update) is the very
  program a real replica runs;
* each replica keeps its own loader position: a committed contributing step
  advances it by one, an absent or behind step does not, so every batch of
  every stream is trained exactly once (invariant 2).

Why a loop over replicas and not `jax.vmap` over a replica axis: vmapping
the step changes its numerics. Measured here (jax 0.12, XLA:CPU): a vmapped
`raw_compute_grads` with a replica axis of size 1 already returns gradients
that differ in the last bits from the unbatched jitted `compute_grads` at the
first step (the batched dot is lowered differently), so a vmapped twin could
never match a real replica bit for bit. The loop runs each replica's own
compiled program (2N + 1 dispatches a step); with a tiny model that is still
about 1-2 ms per replica-step here, and one compilation serves every run of a study.

Where the twin may differ from the multi-process run, bit for bit:

1. Summation order, for N >= 3. The twin folds the members' gradients left to
   right in rank order: ((g0 + g1) + g2) + ... The ring's reduce-scatter sums
   each chunk starting at a different rank, so for N >= 3 the float additions
   happen in another order per chunk and results differ in the last bits. For
   N = 2, a + b == b + a exactly: tests/test_twin_crosscheck.py shows the twin
   reproduces a real two-replica run with a SIGKILL in it bit for bit, every
   step. `Twin(..., reduce=...)` accepts another fold for a ring-order check.
2. Local devices. The twin runs each replica on one device; a replica FSDP-
   sharded over D > 1 devices computes its gradients with sharded reductions,
   which round differently. Cross-check with devices_per_replica=1.
3. Timing-driven membership. A real run's quorum follows heartbeats and
   timeouts (a slow rejoin may stay behind for more than one step); the twin's
   follows the mask exactly. The cross-check feeds the twin the membership the
   real run's committed steps had.
4. Zero signs agree: a behind replica's zero gradient is summed as in the ring.

With ONE replica the twin uses `local_allreduce` (the identity), the program
`fthsdp.step.train` compiles, and matches it bit for bit.
`step_hashes(cfg, alive, ...)` returns the per-step, per-replica state hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fthsdp.config import Config
from fthsdp.data import LoaderState, ReplicaStream, eval_batches
from fthsdp.step.intervention import Intervention
from fthsdp.step.quorum_inputs import make_quorum_inputs
from fthsdp.step.sharding import replica_mesh
from fthsdp.step.functional import TrainState, make_train_step, state_hash
from fthsdp.sim.schedules import no_healthy_steps

ReduceFn = Callable[[list], object]  # list of gradient pytrees in rank order -> their sum


class TwinError(ValueError):
    pass


def _fold_in_rank_order(grads_in_rank_order: list):
    total = grads_in_rank_order[0]
    for g in grads_in_rank_order[1:]:
        total = _tree_add(total, g)
    return total


@jax.jit
def _tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


@jax.jit
def _zero_unless(grads, contribute):
    """The step's own contribute-zeroing, applied to what a member puts on the ring."""
    return jax.tree.map(lambda g: jnp.where(contribute > 0, g, jnp.zeros_like(g)), grads)


@dataclass
class StepRecord:
    step: int
    loss: float  # mean training loss over the contributing replicas
    num_contributing: int
    num_members: int
    lr: float
    lr_scale: float
    batches: int  # batches consumed so far (all replicas)
    hashes: list[str | None] | None = None  # per replica; None where absent


@dataclass
class TwinResult:
    steps: list[StepRecord]
    evals: list[tuple[int, int, float]]  # (step, batches consumed, held-out loss)
    loaders: list[LoaderState]
    states: list[TrainState] = field(repr=False)
    alive_final: np.ndarray = field(repr=False)

    @property
    def final_eval(self) -> float:
        return self.evals[-1][2]


class Twin:
    """N replicas through the same jitted step code; see the module docstring."""

    def __init__(self, cfg: Config, num_replicas: int, *, reduce: ReduceFn | None = None):
        if num_replicas < 1:
            raise TwinError(f"the twin needs at least 1 replica, got {num_replicas}")
        self.cfg = cfg
        self.n = num_replicas
        self.mesh = replica_mesh(1)
        self.reduce = reduce or _fold_in_rank_order
        self.ts = make_train_step(cfg, self.mesh)  # compute_grads, eval, init: the replica's own programs
        if num_replicas == 1:
            self._apply = lambda state, grads, quorum, summed: self.ts.apply_grads(state, grads, quorum)
            self._apply_jit = None
        else:
            # The replicas' own compiled program, FTAR custom call included, on a
            # ring of one: the twin hands it the ring's sum as this member's
            # gradient (contribute=1), FTAR passes it through unchanged, and the
            # rest of the step (mean, LR intervention, vote, update) is the very
            # program a real replica runs. Same HLO, same bits (quorum values are
            # array inputs, so num_members=1 here compiles nothing new).
            from fthsdp.collective import ftar

            ts_ring = make_train_step(cfg, self.mesh, allreduce=ftar.allreduce)

            def apply(state, grads, quorum, summed):
                del grads
                ring_of_one = quorum._replace(contribute=np.int32(1), num_members=np.int32(1),
                                              rank=np.int32(0), comm=np.int32(-1))
                return ts_ring.apply_grads(state, summed, ring_of_one)

            self._apply_jit = ts_ring.apply_grads
            self._apply = apply
        self._evals = None
        self._zeros = None
        self._streams = [ReplicaStream(cfg.data, r) for r in range(num_replicas)]

    # -- pieces -------------------------------------------------------------

    def eval_loss(self, state: TrainState) -> float:
        if self._evals is None:
            self._evals = [self.ts.shard_batch(x, y) for x, y in eval_batches(self.cfg.data)]
        return float(np.mean([float(self.ts.eval_loss(state, x, y)) for x, y in self._evals]))

    def _zero_grads(self, state):
        if self._zeros is None:
            self._zeros = jax.tree.map(jnp.zeros_like, state.params)
        return self._zeros

    # -- the run ------------------------------------------------------------

    def run(
        self,
        alive: np.ndarray,
        *,
        intervention: str | int = "none",
        seed: int = 0,
        eval_every: int = 0,
        eval_steps: tuple[int, ...] = (),
        until_batches: int | None = None,
        record_hashes: bool = False,
        check_identical: bool = False,
    ) -> TwinResult:
        """Trains N replicas through `alive` (steps x replicas, bool).

        until_batches: keep training with everyone up after the mask ends until
        the replicas together consumed this many batches (equal data as the
        baseline). eval_every/eval_steps: when to record the held-out loss of
        the healthy state (always at the end). check_identical: assert after
        every step that all members hold bitwise-identical states (invariant 1).
        """
        alive = np.asarray(alive, dtype=bool)
        if alive.ndim != 2 or alive.shape[1] != self.n:
            raise TwinError(f"membership mask must have shape (steps, {self.n}), got {alive.shape}")
        if alive.shape[0] and not alive[0].all():
            raise TwinError("every replica must be up at step 0 (they all start from the same init)")
        dead_steps = np.flatnonzero(~alive.any(axis=1))
        if dead_steps.size:
            raise TwinError(f"no replica is up at step {int(dead_steps[0])}: at least one must survive every step")
        stranded = no_healthy_steps(alive)
        if stranded:  # (the catch-up below would divide by the empty healthy set)
            raise TwinError(f"no replica is healthy at step {stranded[0]} (up then and the step before): the ones "
                            "coming back there have nobody to catch up from")
        mode = int(Intervention.parse(intervention))
        eval_at = set(eval_steps)

        init = self.ts.init(seed)
        states = [init] * self.n
        loaders = [LoaderState(r) for r in range(self.n)]
        prev_up = np.ones(self.n, dtype=bool)
        records: list[StepRecord] = []
        evals: list[tuple[int, int, float]] = []
        consumed = 0
        step = 0
        total_steps = alive.shape[0]
        while True:
            if step < total_steps:
                up = alive[step]
            elif until_batches is not None and consumed < until_batches:
                up = np.ones(self.n, dtype=bool)
            else:
                break
            healthy = [r for r in range(self.n) if up[r] and prev_up[r]]
            behind = [r for r in range(self.n) if up[r] and not prev_up[r]]
            members = sorted(healthy + behind)
            # Catch-up: a rejoining replica starts from a healthy peer's state (end of the previous step).
            for i, r in enumerate(behind):
                states[r] = states[healthy[i % len(healthy)]]
            grads, losses = {}, []
            for r in healthy:
                b = self._streams[r].batch(loaders[r].position)
                x, y = self.ts.shard_batch(b.inputs, b.targets)
                g, m = self.ts.compute_grads(states[r], x, y)
                grads[r] = g
                losses.append(m["loss"])
            quorums = {
                r: make_quorum_inputs(contribute=r in grads, num_contributing=len(healthy),
                                      num_members=len(members), num_configured=self.n, lr_mode=mode,
                                      rank=rank, quorum_id=0)
                for rank, r in enumerate(members)
            }
            zero = self._zero_grads(states[healthy[0]])
            on_ring = [_zero_unless(grads.get(r, zero), quorums[r].contribute) for r in members]
            summed = self.reduce(on_ring) if self.n > 1 else None
            metrics = None
            for r in members:
                new_state, m = self._apply(states[r], grads.get(r, zero), quorums[r], summed)
                if not bool(m["committed"]):
                    raise TwinError(f"replica {r} did not commit step {step}: the twin's all-reduce never fails")
                states[r] = new_state
                if r in grads:
                    loaders[r] = loaders[r].advanced()
                    consumed += 1
                metrics = m
            if check_identical:
                ref = state_hash(states[members[0]])
                bad = [r for r in members[1:] if state_hash(states[r]) != ref]
                if bad:
                    raise TwinError(f"step {step}: replicas {bad} differ from replica {members[0]} after the commit")
            records.append(StepRecord(
                step=step, loss=float(np.mean([float(v) for v in losses])), num_contributing=len(healthy),
                num_members=len(members), lr=float(metrics["lr"]), lr_scale=float(metrics["lr_scale"]),
                batches=consumed,
                hashes=[state_hash(states[r]) if up[r] else None for r in range(self.n)] if record_hashes else None,
            ))
            prev_up = up.copy()
            step += 1
            if (eval_every and step % eval_every == 0) or step in eval_at:
                evals.append((step, consumed, self.eval_loss(states[healthy[0]])))
        last = [r for r in range(self.n) if prev_up[r]][0]
        if not evals or evals[-1][0] != step:
            evals.append((step, consumed, self.eval_loss(states[last])))
        return TwinResult(records, evals, loaders, states, prev_up)


def step_hashes(
    cfg: Config,
    alive: np.ndarray,
    *,
    intervention: str | int = "none",
    seed: int = 0,
    reduce: ReduceFn | None = None,
) -> list[list[str | None]]:
    """The twin's state hash per step and replica (None where absent) for a membership mask.

    For the cross-check against the multi-process run: feed both the same
    effective membership; compare hashes per step (see the module docstring
    for where bits may legitimately differ).
    """
    alive = np.asarray(alive, dtype=bool)
    twin = Twin(cfg, alive.shape[1], reduce=reduce)
    res = twin.run(alive, intervention=intervention, seed=seed, record_hashes=True)
    return [rec.hashes for rec in res.steps]
