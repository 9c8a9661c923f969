"""One replica's step decisions as a small pure state machine.

A replica that spans several processes (one per host, thousands of ranks)
must take every control decision of a step identically on all its ranks:
whether to rebuild the ring, whether this step trains or catches up from
peers, whether the attempt committed, whether to retry on a new quorum or
give up. Only the *leader* talks to the lighthouse (the lighthouse sees one
client per replica, which is what makes a 100,000-rank job cheap for it);
it hands the same quorum to every rank, and every rank *replays* the same
pure functions below on the same inputs. Because the functions are pure
(plain data in, plain data out, no clock, no I/O), replaying them gives
every rank the same decision without a second round of messages, and a
disagreement is a bug that a test can see (the emulation in
:mod:`fthsdp.sim.emulation` checks it on every rank of every step).

The semantics are the :class:`fthsdp.replica.manager.Manager`'s step loop, written
as transitions:

* :func:`plan` — a quorum arrived for the current attempt. Not a member:
  give up (the replica is fatal; its supervisor restarts it). A quorum id
  other than the configured one: rebuild the ring. Not in the quorum's
  healthy set: catch up (fetch the state of the end of step ``max_step - 1``
  from the assigned sources, contribute zero gradients, drop any gradients
  in hand; the catch-up counts only if the step commits). Healthy: train
  (compute gradients only if none are in hand: a retry reuses the step's
  gradients, numerically the same as retraining the step on the same batch).
* :func:`after_attempt` — the attempt's outcome, after the intra-replica
  commit vote (every rank's all-reduce succeeded, or not): committed moves
  to the next step; a failed all-reduce, a recoverable error, or a
  transient quorum-request error retries on a new quorum (the first two
  with ``commit_failed`` so the lighthouse issues a new quorum id and every
  ring reconnects), at most ``max_retries`` times, then gives up.
* :func:`rejoin_at_step_0` — a replica restarted to rejoin that a quorum calls
  healthy at step 0 (no member holds a committed step): trains at once beside a
  replica at its first start, else asks again for a while and then gives up
  (job-fatal) rather than redo the job from its start beside other rejoiners.

States are frozen dataclasses; nothing here imports jax, grpc or asyncio.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from fthsdp.control import quorum as qm

__all__ = ["Action", "Outcome", "StepState", "Plan", "initial", "plan", "after_attempt", "vote", "membership",
           "step0_rule_applies", "rejoin_at_step_0"]


class Action(enum.Enum):
    """What a replica (every one of its ranks) does next."""

    ASK = "ask"  # request the quorum of the current step (with StepState.commit_failed)
    TRAIN = "train"  # healthy: gradients (computed if none in hand), all-reduce, update
    CATCH_UP = "catch_up"  # behind: fetch the peers' state, contribute zeros
    GIVE_UP = "give_up"  # replica-fatal: retries exhausted or left out of the quorum


class Outcome(enum.Enum):
    """How one attempt ended, as the whole replica agreed (see :func:`vote`)."""

    COMMITTED = "committed"  # every rank's all-reduce succeeded: the update was applied
    FAILED = "failed"  # some rank's all-reduce failed: the state is untouched
    ERROR = "error"  # a recoverable exception (catch-up fetch, malformed chunk, ...)
    QUORUM_ERROR = "quorum_error"  # the quorum request itself failed transiently


@dataclass(frozen=True)
class StepState:
    """A replica's control state between two decisions (identical on all its ranks)."""

    step: int  # the step being run: committed steps so far
    max_retries: int
    attempt: int = 1  # 1-based attempt of this step
    has_grads: bool = False  # gradients of this step's batch are in hand
    commit_failed: bool = False  # to report with the next quorum request
    configured_qid: int = 0  # the quorum whose ring is configured (0 = none)
    action: Action = Action.ASK
    reason: str = ""  # why the last transition went where it did (logs, give-up message)

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 (ft.max_retries), got {self.max_retries}")
        if self.attempt < 1:
            raise ValueError(f"attempt is 1-based, got {self.attempt}")


@dataclass(frozen=True)
class Plan:
    """What to do with one quorum: the same on every rank of the replica."""

    action: Action  # TRAIN, CATCH_UP or GIVE_UP
    quorum_id: int
    step: int  # the step this attempt runs (after a catch-up: the quorum's max_step)
    rank: int = -1  # ring position of the replica (-1 when not a member)
    reconfigure: bool = False  # a new quorum id: tear the ring down and reconnect
    compute: bool = False  # compute gradients on the step's batch first
    sources: tuple[str, ...] = ()  # CATCH_UP: one source replica per local shard
    contributors: int = 0  # healthy members (the all-reduce divides by this)
    members: int = 0
    reason: str = ""


# Ring positions and the healthy set of recent quorums, so that replaying plan()
# on every rank of a replica costs O(1) per rank instead of a scan of the
# members (a 512-member quorum replayed on 100,000 ranks). Keyed by the members
# and healthy tuples themselves (the only inputs): views of one decision that
# differ only in their rings (each process's ring neighbours) share them. Holding
# them keeps their ids from being reused while cached; results never depend on the cache.
_INDEX: dict[tuple[int, int], tuple[tuple, tuple, dict[str, int], frozenset[str]]] = {}
_INDEX_SIZE = 16


def membership(quorum: qm.Quorum) -> tuple[dict[str, int], frozenset[str]]:
    """``(ring position by replica id, healthy ids)`` of ``quorum``, computed once per members
    and healthy tuple."""
    key = (id(quorum.members), id(quorum.healthy))
    hit = _INDEX.get(key)
    if hit is not None and hit[0] is quorum.members and hit[1] is quorum.healthy:
        return hit[2], hit[3]
    ranks = qm.positions(quorum.members)
    healthy = frozenset(quorum.healthy)
    if len(_INDEX) >= _INDEX_SIZE:
        _INDEX.pop(next(iter(_INDEX)))
    _INDEX[key] = (quorum.members, quorum.healthy, ranks, healthy)
    return ranks, healthy


_index = membership


def initial(step: int, max_retries: int) -> StepState:
    """A replica process that starts (or restarts) at ``step`` committed steps."""
    return StepState(step=step, max_retries=max_retries)


def plan(state: StepState, quorum: qm.Quorum, replica_id: str) -> Plan:
    """Decide what one attempt does with ``quorum`` (state.action must be ASK)."""
    if state.action is not Action.ASK:
        raise ValueError(f"plan() needs a replica waiting for a quorum (action ASK), not {state.action.value}")
    ranks, healthy = _index(quorum)
    rank = ranks.get(replica_id)
    if rank is None:
        return Plan(Action.GIVE_UP, quorum.quorum_id, state.step,
                    reason=f"quorum {quorum.quorum_id} does not include replica {replica_id}: {quorum.reason}")
    reconfigure = quorum.quorum_id != state.configured_qid
    common = dict(quorum_id=quorum.quorum_id, rank=rank, reconfigure=reconfigure,
                  contributors=quorum.num_healthy, members=len(ranks))
    if replica_id not in healthy:
        sources = quorum.sources_for(replica_id)
        if not sources:
            return Plan(Action.GIVE_UP, step=state.step, **common,
                        reason=f"behind in quorum {quorum.quorum_id} but no recovery source assigned")
        return Plan(Action.CATCH_UP, step=quorum.max_step, sources=sources, **common,
                    reason=f"behind (at step {state.step}, quorum at {quorum.max_step}): catch up from {list(sources)}")
    if state.step != quorum.max_step:  # healthy means at max_step; anything else is a broken quorum
        return Plan(Action.GIVE_UP, step=state.step, **common,
                    reason=f"listed healthy in quorum {quorum.quorum_id} at max step {quorum.max_step} "
                           f"but this replica is at step {state.step}")
    return Plan(Action.TRAIN, step=state.step, compute=not state.has_grads, **common,
                reason="train" if not state.has_grads else "retry the all-reduce with the gradients in hand")


def quorum_error_counts(failing_for_s: float, outage_s: float) -> bool:
    """Whether a transient failure of the quorum request uses up one of the step's attempts: not
    while the requests have failed for less than the lighthouse outage allowance (a lighthouse
    restarting, or holding calls back under load, answers again; four attempts went in under a
    second and the replica restarted), and then yes (a lighthouse that keeps refusing)."""
    return failing_for_s > outage_s


def after_attempt(state: StepState, p: Plan | None, outcome: Outcome, counted: bool = True) -> StepState:
    """The next state after an attempt ended with ``outcome`` (``p`` None for QUORUM_ERROR, which
    uses up an attempt only when ``counted``: :func:`quorum_error_counts`)."""
    if outcome is Outcome.QUORUM_ERROR:
        if p is not None:
            raise ValueError("a quorum error has no plan (the quorum never arrived)")
        if not counted:
            return replace(state, action=Action.ASK, reason="quorum request failed: asking again (not counted)")
        return _retry(state, commit_failed=state.commit_failed, has_grads=state.has_grads,
                      step=state.step, configured=state.configured_qid, why="quorum request failed")
    if p is None:
        raise ValueError(f"outcome {outcome.value} needs the attempt's plan")
    if p.action is Action.GIVE_UP:
        return replace(state, action=Action.GIVE_UP, reason=p.reason)
    # The ring of p is configured now, whatever happened in it.
    configured = p.quorum_id
    if outcome is Outcome.COMMITTED:
        return StepState(step=p.step + 1, max_retries=state.max_retries, configured_qid=configured,
                         reason=f"committed step {p.step} on quorum {p.quorum_id}")
    # A catch-up counts only when its step commits (on every process of the replica at
    # once), so a failed one leaves the replica at its old step, still behind, with no
    # gradients (it trained no batch).
    if p.action is Action.TRAIN:
        has_grads, step = state.has_grads or p.compute, p.step
    else:
        has_grads, step = False, state.step
    return _retry(state, commit_failed=True, has_grads=has_grads, step=step, configured=configured,
                  why=f"{outcome.value} on quorum {p.quorum_id}")


def _retry(state: StepState, *, commit_failed: bool, has_grads: bool, step: int, configured: int,
           why: str) -> StepState:
    if state.attempt >= state.max_retries + 1:
        return replace(state, action=Action.GIVE_UP, step=step, configured_qid=configured,
                       reason=f"step {step}: {state.attempt} attempts failed (last: {why}); giving up "
                              "(raise ft.max_retries or check the failing peer)")
    return StepState(step=step, max_retries=state.max_retries, attempt=state.attempt + 1, has_grads=has_grads,
                     commit_failed=commit_failed, configured_qid=configured, reason=f"retry: {why}")


def vote(rank_ok: "list[bool] | tuple[bool, ...]") -> Outcome:
    """The intra-replica two-phase-commit vote: committed only if every rank's all-reduce succeeded."""
    if len(rank_ok) == 0:
        raise ValueError("a vote needs at least one rank")
    return Outcome.COMMITTED if all(rank_ok) else Outcome.FAILED


def step0_rule_applies(q: qm.Quorum, replica_id: str, *, rejoin: bool, step: int, replicas: int,
                       trusted: bool) -> bool:
    """Whether :func:`rejoin_at_step_0` decides what replica ``replica_id`` does with quorum ``q``:
    it was restarted to rejoin (``rejoin``), holds no committed step (``step`` 0), ``q`` calls it
    healthy with no member's step counting (max step 0), the job has more than one replica
    (``replicas``: alone by design, it is the job) and it has not yet been told to train from
    step 0 in this step (``trusted``). The Manager and the emulation both ask this, so the rule
    cannot apply in one and not the other."""
    return (rejoin and not trusted and step == 0 and q.max_step == 0 and replicas > 1
            and replica_id in q.healthy)


def rejoin_at_step_0(q: qm.Quorum, replica_id: str, waited_s: float, grace_s: float) -> tuple[str, str]:
    """What a replica restarted to rejoin, holding no state, does when quorum ``q`` calls it
    healthy at step 0, having asked so for ``waited_s``: ("train" | "wait" | "give up", why).

    Healthy at step 0 means no member's step counts. With a healthy member at its first start
    (not Member.rejoining) that is the truth: the job's first step never committed, so it trains
    at once (waiting would only cost that member its step attempts, its all-reduces aborted). A
    member behind (fenced: it holds steps the lighthouse judged forked) is no such proof: it is
    waited for as a rejoiner is (a chaos soak trained the job from step 0 beside one). A quorum
    of only replicas restarted to rejoin (this one alone, or others) proves nothing: every
    replica holding the job's state died, or they are cut off from a lighthouse that forgot them
    (restarted) for a moment. Trained, it would redo the job from its start beside them, a fork (a
    chaos soak saw both that and a job given up while its healthy replica was away for seconds),
    so it asks again for ``grace_s`` (Timeouts.alone_rejoin_s), then gives up (job-fatal)."""
    restarted = [m.replica_id for m in q.members if m.rejoining or m.replica_id == replica_id]
    healthy = set(q.healthy)
    first = [m.replica_id for m in q.members if m.replica_id not in restarted and m.replica_id in healthy]
    if first:
        return "train", f"{first[:4]} at their first start (the job's first step never committed)"
    held = [m.replica_id for m in q.members if m.replica_id not in restarted]  # behind: fenced, holding steps
    who = ("it is alone" if q.num_members == 1 else
           f"it holds only replicas restarted to rejoin ({restarted[:8]})" if not held else
           f"its other members {held[:8]} hold steps the lighthouse fenced as forked")
    if waited_s < grace_s:
        return "wait", who
    return "give up", f"no replica holding the job's state has been running for {grace_s:.1f} s ({who})"
