"""The replica step machine (fthsdp.replica.fsm): pure transitions, no processes."""

from __future__ import annotations

import pytest

from fthsdp.control import quorum as qm
from fthsdp.replica import fsm


def quorum(qid: int, steps: dict[str, int], lws: int = 2) -> qm.Quorum:
    reqs = {r: qm.QuorumRequest(r, s, 0.0, tuple(f"h:{r}{k}" for k in range(lws)), f"s:{r}", lws)
            for r, s in steps.items()}
    q, why = qm.decide_quorum(reqs, {r: 0.0 for r in steps}, None, qm.QuorumConfig(), 0.0)
    assert q is not None, why
    return qm.Quorum(**{**q.__dict__, "quorum_id": qid})


def test_healthy_first_attempt_trains_and_reconfigures():
    s = fsm.initial(0, max_retries=2)
    p = fsm.plan(s, quorum(1, {"0": 0, "1": 0}), "1")
    assert (p.action, p.rank, p.reconfigure, p.compute, p.step) == (fsm.Action.TRAIN, 1, True, True, 0)
    assert (p.contributors, p.members) == (2, 2)
    s2 = fsm.after_attempt(s, p, fsm.Outcome.COMMITTED)
    assert (s2.step, s2.attempt, s2.configured_qid, s2.has_grads, s2.commit_failed) == (1, 1, 1, False, False)
    # Same quorum id next step: the ring is kept.
    p2 = fsm.plan(s2, quorum(1, {"0": 1, "1": 1}), "1")
    assert p2.reconfigure is False and p2.compute is True


def test_failed_allreduce_retries_with_grads_in_hand_and_commit_failed():
    s = fsm.initial(5, max_retries=2)
    p = fsm.plan(s, quorum(3, {"0": 5, "1": 5}), "0")
    s2 = fsm.after_attempt(s, p, fsm.Outcome.FAILED)
    assert (s2.action, s2.step, s2.attempt, s2.has_grads, s2.commit_failed) == (fsm.Action.ASK, 5, 2, True, True)
    p2 = fsm.plan(s2, quorum(4, {"0": 5}), "0")
    assert p2.action is fsm.Action.TRAIN and p2.compute is False and p2.reconfigure is True


def test_quorum_error_retries_without_touching_commit_failed():
    s = fsm.initial(2, max_retries=1)
    s2 = fsm.after_attempt(s, None, fsm.Outcome.QUORUM_ERROR)
    assert (s2.attempt, s2.commit_failed, s2.action) == (2, False, fsm.Action.ASK)
    s3 = fsm.after_attempt(s2, None, fsm.Outcome.QUORUM_ERROR)
    assert s3.action is fsm.Action.GIVE_UP and "2 attempts failed" in s3.reason
    with pytest.raises(ValueError, match="no plan"):
        fsm.after_attempt(s, fsm.plan(s, quorum(1, {"0": 2}), "0"), fsm.Outcome.QUORUM_ERROR)
    # failing for less than the lighthouse outage allowance, a quorum error uses no attempt (a
    # lighthouse holding calls back under load answers again: four went in under a second)
    assert not fsm.quorum_error_counts(5.0, 60.0) and fsm.quorum_error_counts(61.0, 60.0)
    free = fsm.after_attempt(s2, None, fsm.Outcome.QUORUM_ERROR, counted=False)
    assert (free.attempt, free.action, free.step) == (2, fsm.Action.ASK, s2.step) and "not counted" in free.reason


def test_behind_replica_catches_up_and_drops_grads():
    s = fsm.StepState(step=3, max_retries=3, has_grads=True)
    q = quorum(7, {"0": 9, "1": 9, "2": 3})
    p = fsm.plan(s, q, "2")
    assert p.action is fsm.Action.CATCH_UP and p.step == 9 and len(p.sources) == 2
    assert set(p.sources) <= {"0", "1"} and p.compute is False
    # Its all-reduce (zeros) failed: the fetched state was not installed (that happens only at a
    # commit, on every process of the replica at once): still at step 3, behind, no gradients.
    s2 = fsm.after_attempt(s, p, fsm.Outcome.FAILED)
    assert (s2.step, s2.has_grads, s2.commit_failed) == (3, False, True)
    assert fsm.plan(s2, q, "2").action is fsm.Action.CATCH_UP  # it fetches again
    s3 = fsm.after_attempt(s, p, fsm.Outcome.COMMITTED)
    assert s3.step == 10


def test_retries_exhausted_give_up_and_not_member_gives_up():
    s = fsm.initial(0, max_retries=0)
    p = fsm.plan(s, quorum(1, {"0": 0}), "0")
    assert fsm.after_attempt(s, p, fsm.Outcome.ERROR).action is fsm.Action.GIVE_UP
    p = fsm.plan(s, quorum(1, {"0": 0, "1": 0}), "9")
    assert p.action is fsm.Action.GIVE_UP and "does not include replica 9" in p.reason
    assert fsm.after_attempt(s, p, fsm.Outcome.FAILED).action is fsm.Action.GIVE_UP


def test_healthy_at_wrong_step_is_refused():
    s = fsm.initial(4, max_retries=1)
    q = quorum(2, {"0": 6})
    q = qm.Quorum(**{**q.__dict__, "members": (qm.Member("0", 4),), "healthy": ("0",)})
    assert fsm.plan(s, q, "0").action is fsm.Action.GIVE_UP


def test_plan_needs_ask_and_bad_states_are_refused():
    with pytest.raises(ValueError, match="max_retries"):
        fsm.initial(0, -1)
    with pytest.raises(ValueError, match="step"):
        fsm.initial(-1, 1)
    gave_up = fsm.StepState(step=0, max_retries=0, action=fsm.Action.GIVE_UP)
    with pytest.raises(ValueError, match="ASK"):
        fsm.plan(gave_up, quorum(1, {"0": 0}), "0")
    assert fsm.vote([True, True]) is fsm.Outcome.COMMITTED
    assert fsm.vote((True, False)) is fsm.Outcome.FAILED
    with pytest.raises(ValueError):
        fsm.vote([])


def test_a_long_random_walk_keeps_the_step_machines_invariants():
    """300 attempts on random quorums (healthy, or behind a member one step ahead) with random
    outcomes; each transition is checked against the rules it must follow, computed here apart:
    the step never goes back and moves by one only at a commit (or a catch-up's commit), the ring
    is rebuilt exactly when the quorum id changes, gradients are kept across failed attempts of a
    healthy step and never after a catch-up, and a replica gives up exactly when its attempt
    count passes max_retries + 1."""
    import random

    rng = random.Random(0)
    max_retries = 3
    s = fsm.initial(0, max_retries)
    qid, failed_in_a_row, gave_up, commits = 0, 0, 0, 0
    for _ in range(300):
        qid += rng.random() < 0.3
        ahead = rng.choice([0, 0, 1])
        q = quorum(max(qid, 1), {"0": s.step, "1": s.step + ahead})
        p = fsm.plan(s, q, "0")
        assert p.reconfigure == (q.quorum_id != s.configured_qid)
        if ahead:
            assert (p.action, p.step, p.sources, p.compute) == (fsm.Action.CATCH_UP, s.step + 1, ("1", "1"), False)
        else:
            assert (p.action, p.step, p.compute) == (fsm.Action.TRAIN, s.step, not s.has_grads)
        out = rng.choice([fsm.Outcome.COMMITTED, fsm.Outcome.FAILED, fsm.Outcome.ERROR])
        n = fsm.after_attempt(s, p, out)
        assert n.configured_qid == q.quorum_id
        if out is fsm.Outcome.COMMITTED:
            commits += 1
            failed_in_a_row = 0
            assert (n.step, n.attempt, n.has_grads, n.commit_failed, n.action) == \
                (p.step + 1, 1, False, False, fsm.Action.ASK)
        else:
            failed_in_a_row += 1
            assert n.step == s.step and n.commit_failed
            if failed_in_a_row == max_retries + 1:
                assert n.action is fsm.Action.GIVE_UP and "attempts failed" in n.reason
                gave_up += 1
                failed_in_a_row = 0
                n = fsm.initial(n.step, max_retries)  # the replica restarts at its committed step
            else:
                assert (n.action, n.attempt) == (fsm.Action.ASK, s.attempt + 1)
                assert n.has_grads == (p.action is fsm.Action.TRAIN)
        s = n
    assert commits > 50 and gave_up >= 1  # the walk went through both kinds of end
