"""The lighthouse's budgets (fthsdp/control/admission.py): pure, no server."""

from __future__ import annotations

import pytest

from fthsdp.control.admission import SERVE, Admission, Bucket, FairnessLimits


def test_bucket_books_calls_into_debt_so_held_calls_leave_at_its_rate():
    b = Bucket(rate=100.0, burst=2, now=0.0)
    assert b.reserve(0.0) == 0.0 and b.reserve(0.0) == 0.0  # the burst
    waits = [b.reserve(0.0) for _ in range(3)]  # then one token every 10 ms, in arrival order
    assert waits == pytest.approx([0.01, 0.02, 0.03])
    assert b.wait_s(0.05) == pytest.approx(0.0)  # paid back after 50 ms ...
    assert b.wait_s(10.0) == 0.0 and b.tokens <= 2  # ... and never more than the burst saved


def test_a_flooding_connection_is_held_then_refused_and_another_is_untouched():
    lim = FairnessLimits(connection_calls_per_s=100.0, connection_burst=10, new_connection_tokens=10, max_held=5)
    a = Admission(lim)
    decisions = [a.connection("ipv4:10.0.0.1:1000", 0.0, max_wait_s=1.0)[0] for _ in range(20)]
    assert all(d.wait_s == 0 and not d.refusal for d in decisions[:10])  # its burst
    held = [d for d in decisions[10:] if not d.refusal]
    assert len(held) == 5 and all(d.wait_s > 0 for d in held)  # then held, at most max_held at once
    refused = [d for d in decisions[10:] if d.refusal]
    assert len(refused) == 5 and "held back already" in refused[0].refusal and "send fewer" in refused[0].refusal
    # another connection of the same host is not held back by it
    d, token = a.connection("ipv4:10.0.0.1:2000", 0.0, max_wait_s=1.0)
    assert d.wait_s == 0 and not d.refusal and token is None
    assert a.held_total == 5


def test_a_call_within_budget_gets_the_one_shared_serve_decision_and_a_held_one_its_own():
    """The common case allocates nothing and formats no words (the gate returns at once on it)."""
    a = Admission(FairnessLimits(connection_calls_per_s=10.0, connection_burst=2, new_connection_tokens=2,
                                 job_calls_per_s=1.0, replica_calls_per_s=1.0))
    assert a.connection("p", 0.0, 1.0) == (SERVE, None) and a.job("j", 0, 0.0, 1.0) == (SERVE, None)
    assert a.connection("p", 0.0, 1.0)[0] is SERVE
    d, token = a.connection("p", 0.0, 1.0)  # past its burst of 2: held, with its own decision
    assert d is not SERVE and d.wait_s == pytest.approx(0.1) and token is not None
    d, _ = a.job("j", 0, 0.0, 1.0)  # a job of no replicas: 1 call/s, a burst of 1
    assert d is not SERVE and d.wait_s == pytest.approx(1.0)
    d, _ = a.job("j", 0, 0.0, 0.5)  # over the bound: refused, its budget in words
    assert "job 'j' is over its budget (1 calls/s + 1 per registered replica = 1 calls/s)" in d.refusal


def test_a_call_that_would_wait_longer_than_its_bound_is_held_for_the_bound_then_refused():
    a = Admission(FairnessLimits(connection_calls_per_s=10.0, connection_burst=1, max_held=100))
    a.connection("p", 0.0, 1.0)
    waits = []
    for _ in range(6):
        d, _ = a.connection("p", 0.0, max_wait_s=0.5)
        waits.append(d.wait_s if not d.refusal else d.refusal)
    assert waits[:5] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert "over its budget" in waits[5] and "slow down" in waits[5]
    # refused, but only after being held for the whole bound (a flooder must not get its answer at once)
    d, token = a.connection("p", 0.0, max_wait_s=0.5)
    assert d.refusal and d.wait_s == 0.5 and token is not None


def test_releasing_a_held_call_frees_its_place():
    a = Admission(FairnessLimits(connection_calls_per_s=10.0, connection_burst=1, max_held=1))
    a.connection("p", 0.0, 1.0)
    d, token = a.connection("p", 0.0, 1.0)
    assert d.wait_s > 0 and token is not None
    assert a.connection("p", 0.0, 1.0)[0].refusal  # one held already
    a.release(token)
    assert a.held_total == 0
    assert not a.connection("p", 0.15, 1.0)[0].refusal


def test_refused_calls_cost_their_connection_more_and_a_new_connection_starts_nearly_empty():
    lim = FairnessLimits(connection_calls_per_s=100.0, connection_burst=200, new_connection_tokens=20,
                         failure_cost=20.0)
    a = Admission(lim)
    # a stranger: its first refusal spends what a new connection starts with ...
    assert a.connection("stranger:1", 0.0, 1.0)[0].wait_s == 0
    a.refused("stranger:1", 0.0)
    d, _ = a.connection("stranger:1", 0.0, 1.0)
    assert d.wait_s == pytest.approx(0.02)  # 20 - 21 - 1 tokens: 20 ms at 100/s
    # ... and so does a fresh connection per call: one free refusal per handshake
    assert a.connection("stranger:2", 0.0, 1.0)[0].wait_s == 0
    a.refused("stranger:2", 0.0)
    assert a.connection("stranger:2", 0.0, 1.0)[0].wait_s > 0
    # registering new replica ids costs more too (a process registers one, once)
    assert a.connection("insider:1", 0.0, 1.0)[0].wait_s == 0
    a.new_id("insider:1", 0.0)
    assert a.connection("insider:1", 0.0, 1.0)[0].wait_s == 0  # 20 - 1 - 10 - 1: still in budget
    a.new_id("insider:1", 0.0)
    assert a.connection("insider:1", 0.0, 1.0)[0].wait_s > 0
    # a replica's connection that is never refused fills up to its burst and keeps a steady 100/s
    assert all(a.connection("replica:1", t / 100, 1.0)[0].wait_s == 0 for t in range(1000))


def test_a_relay_stream_has_its_own_per_batch_budget_and_pays_for_its_refusals_alike():
    lim = FairnessLimits(connection_calls_per_s=100.0, relay_batches_per_s=5000.0, relay_burst=10000,
                         new_connection_tokens=20, failure_cost=20.0)
    a = Admission(lim)
    # batches trickling in one message each, 1,000/s for a second: a connection's budget would hold them
    assert all(a.connection("relay:1", t / 1000, 1.0, relay=True)[0].wait_s == 0 for t in range(1000))
    assert any(a.connection("conn:1", t / 1000, 1.0)[0].wait_s > 0 for t in range(1000))
    # a stranger's relay stream: a refused message costs it the time it costs a connection (0.2 s)
    assert a.connection("stranger:1", 0.0, 1.0, relay=True)[0].wait_s == 0
    a.refused("stranger:1", 0.0)
    d, _ = a.connection("stranger:1", 0.0, 1.0, relay=True)
    assert d.wait_s == pytest.approx(0.2, abs=0.01)
    for _ in range(8):  # a batch of garbage (fthsdp.control.session.MAX_REFUSED_PER_BATCH refusals)
        a.refused("stranger:1", 0.0)
    d, _ = a.connection("stranger:1", 0.0, max_wait_s=1.0, relay=True)
    assert d.refusal and "relay stream stranger:1 is over its budget" in d.refusal and "batches/s" in d.refusal


def test_a_jobs_budget_follows_its_registered_size():
    lim = FairnessLimits(job_calls_per_s=100.0, replica_calls_per_s=10.0)
    a = Admission(lim)
    # a 16,384-replica job heartbeating at 10 Hz (163,840 calls/s) is never held
    for i in range(2000):
        d, _ = a.job("big", 16_384, i / 163_840, max_wait_s=1.0)
        assert d.wait_s == 0 and not d.refusal
    # a job of one replica sending as fast as it can is held after its budget (110/s)
    waits = [a.job("small", 1, 0.0, max_wait_s=1.0)[0] for _ in range(200)]
    assert sum(1 for d in waits if d.wait_s == 0 and not d.refusal) == 110
    assert sum(1 for d in waits if d.wait_s > 0) == lim.max_held  # held, then ...
    refusals = [d.refusal for d in waits if d.refusal]
    assert len(refusals) == 200 - 110 - lim.max_held and "job 'small'" in refusals[0]  # ... refused


def test_principals_are_bounded_and_limits_are_checked():
    a = Admission(FairnessLimits(max_principals=10))
    for i in range(100):
        a.connection(f"p{i}", 0.0, 1.0)
        a.job(f"j{i}", 1, 0.0, 1.0)
    assert len(a._connections) <= 10 and len(a._jobs) <= 10
    with pytest.raises(ValueError, match="connection_calls_per_s"):
        FairnessLimits(connection_calls_per_s=0)
    with pytest.raises(ValueError, match="max_held"):
        FairnessLimits(max_held=float("nan"))
