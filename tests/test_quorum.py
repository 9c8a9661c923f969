"""Unit tests of the pure quorum decision: one test (at least) per rule, no server."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from fthsdp.quorum import (
    Member,
    Quorum,
    QuorumConfig,
    QuorumRequest,
    assign_sources,
    dead_replicas,
    decide_quorum,
    ring_key,
)

CFG = QuorumConfig(min_replicas=1, join_timeout_s=1.0, heartbeat_window_s=1.0)


def req(rid: str, step: int = 0, at: float = 0.0, *, lws: int = 1, port: int | None = None, failed: bool = False):
    base = 10000 + 10 * int(rid) if port is None else port
    return QuorumRequest(
        replica_id=rid,
        step=step,
        arrived_at=at,
        ftar_addresses=tuple(f"127.0.0.1:{base + k}" for k in range(lws)),
        state_server_address=f"127.0.0.1:{base + 9}",
        local_world_size=lws,
        commit_failed=failed,
    )


def reqs(*rs: QuorumRequest) -> dict[str, QuorumRequest]:
    return {r.replica_id: r for r in rs}


def decide(requests, heartbeats=None, previous=None, config=CFG, now=0.0):
    return decide_quorum(requests, heartbeats or {}, previous, config, now)


def test_no_requests_no_quorum():
    q, reason = decide({}, {"0": 0.0})
    assert q is None and "no replica is asking" in reason


def test_every_live_replica_asking_forms_at_once():
    q, reason = decide(reqs(req("0"), req("1"), req("2")), {"0": 0.0, "1": 0.0, "2": 0.0}, now=0.01)
    assert q is not None, reason
    assert q.member_ids == ("0", "1", "2")
    assert q.quorum_id == 1 and q.num_healthy == 3 and q.num_configured == 3
    assert q.left_out == () and "every live replica asking" in reason


def test_min_replicas():
    cfg = QuorumConfig(min_replicas=3, join_timeout_s=0.0)
    q, reason = decide(reqs(req("0"), req("1")), {"0": 0.0, "1": 0.0}, config=cfg, now=5.0 - 4.5)
    assert q is None
    assert "min_replicas=3" in reason and "2 live requesting" in reason
    q, reason = decide(reqs(req("0"), req("1"), req("2")), {}, config=cfg, now=0.5)
    assert q is not None and q.num_members == 3, reason


def test_join_timeout_waits_then_forms_without_the_straggler():
    hb = {"0": 0.0, "1": 0.0, "2": 0.8}  # 2 is live (heartbeating) but not asking
    r = reqs(req("0", at=0.1), req("1", at=0.2))
    q, reason = decide(r, hb, now=0.6)
    assert q is None
    assert "waiting up to 0.50s more" in reason and "[2]" in reason
    hb = {"0": 1.1, "1": 1.1, "2": 0.8}  # everyone keeps heartbeating
    q, reason = decide(r, hb, now=1.15)  # join timeout (1.0 s after the first request) passed
    assert q is not None, reason
    assert q.member_ids == ("0", "1") and q.left_out == ("2",)
    assert "without live [2]" in reason


def test_left_out_replica_is_not_waited_for_again():
    hb = {"0": 10.0, "1": 10.0, "2": 10.0}
    prev = Quorum(1, (Member("0", 9), Member("1", 9)), 9, ("0", "1"), (), left_out=("2",))
    r = reqs(req("0", 10, at=10.0), req("1", 10, at=10.0))
    q, reason = decide(r, hb, prev, now=10.01)
    assert q is not None, reason
    assert q.left_out == ("2",)
    # ...but when it does ask, it joins (behind, since it is at an older step).
    q2, reason = decide(reqs(req("0", 11, at=11.0), req("1", 11, at=11.0), req("2", 3, at=10.5)), hb, q, now=11.0)
    assert q2 is not None and q2.member_ids == ("0", "1", "2") and q2.behind == ("2",), reason


def test_dead_replica_is_not_waited_for():
    hb = {"0": 5.0, "1": 5.0, "2": 3.5}  # 2 silent for 1.5 s > window 1.0
    q, reason = decide(reqs(req("0", at=5.0), req("1", at=5.0)), hb, now=5.0)
    assert q is not None and q.member_ids == ("0", "1"), reason


def test_first_quorum_waits_for_configured_replicas_never_heard_from():
    cfg = QuorumConfig(join_timeout_s=1.0, num_configured=3)
    r = reqs(req("0", at=0.0), req("1", at=0.0))
    q, reason = decide(r, {"0": 0.0, "1": 0.0}, config=cfg, now=0.5)
    assert q is None and "never heard from" in reason
    q, reason = decide(r, {"0": 0.6, "1": 0.6}, config=cfg, now=1.01)
    assert q is not None and q.num_members == 2 and q.num_configured == 3, reason
    # Without a stated count, nobody unheard-of is waited for.
    q, reason = decide(r, {"0": 0.0, "1": 0.0}, now=0.01)
    assert q is not None, reason


def test_split_brain_guard_needs_strict_majority_of_live():
    hb = {"0": 2.0, "1": 2.0, "2": 2.0}
    q, reason = decide(reqs(req("0", at=0.0)), hb, now=2.0)  # join timeout passed
    assert q is None
    assert "split-brain guard" in reason and "1 of 3 live" in reason and "(2)" in reason
    hb4 = {"0": 2.0, "1": 2.0, "2": 2.0, "3": 2.0}
    q, reason = decide(reqs(req("0", at=0.0), req("1", at=0.0)), hb4, now=2.0)
    assert q is None and "2 of 4 live" in reason  # a tie is not a majority
    q, reason = decide(reqs(req("0", at=0.0), req("1", at=0.0)), hb, now=2.0)
    assert q is not None and q.member_ids == ("0", "1"), reason  # 2 of 3 is


def test_losing_half_of_the_replicas_does_not_stall_the_survivors():
    # Kill two of four: the dead ones are no longer live, so 2 of 2 live is a majority.
    hb = {"0": 10.0, "1": 10.0, "2": 8.0, "3": 8.5}
    prev = Quorum(4, tuple(Member(r, 9) for r in "0123"), 9, tuple("0123"), ())
    q, reason = decide(reqs(req("0", 9, at=10.0), req("1", 9, at=10.0)), hb, prev, now=10.0)
    assert q is not None and q.member_ids == ("0", "1") and q.quorum_id == 5, reason
    assert q.num_configured == 4


def test_silent_requester_is_ignored():
    # 1 asked at t=0 but has been silent since (no heartbeats): not live at t=1.5.
    hb = {"0": 1.5}
    q, reason = decide(reqs(req("0", at=1.5), req("1", at=0.0)), hb, now=1.5)
    assert q is not None and q.member_ids == ("0",), reason
    assert "ignoring requests of [1]" in reason


def test_members_in_natural_ring_order():
    ids = ["10", "2", "1", "b", "a"]
    q, _ = decide({r: QuorumRequest(r, 0, 0.0) for r in ids}, now=0.0)
    assert q is not None
    assert q.member_ids == ("1", "2", "10", "a", "b")
    assert sorted(ids, key=ring_key) == list(q.member_ids)
    assert q.rank_of("10") == 2
    with pytest.raises(ValueError, match="not in quorum"):
        q.rank_of("zz")


def test_healthy_behind_and_load_balanced_sources():
    r = reqs(req("0", 5, lws=2), req("1", 5, lws=2), req("2", 5, lws=2), req("3", 0, lws=2), req("4", 2, lws=2))
    q, reason = decide(r, now=0.0)
    assert q is not None, reason
    assert q.max_step == 5
    assert q.healthy == ("0", "1", "2") and q.behind == ("3", "4")
    assert q.num_healthy == 3
    assert q.sources_for("3") == ("0", "1")
    assert q.sources_for("4") == ("2", "0")
    assert q.sources_for("0") == ()


@pytest.mark.parametrize("healthy_n,behind_n,shards", list(itertools.product([1, 2, 3, 5], [1, 2, 4], [1, 2, 4])))
def test_assign_sources_spreads_load(healthy_n, behind_n, shards):
    healthy = tuple(str(i) for i in range(healthy_n))
    behind = [(f"b{i}", shards) for i in range(behind_n)]
    out = assign_sources(behind, healthy)
    load = Counter(s for srcs in out.values() for s in srcs)
    assert sum(load.values()) == behind_n * shards
    counts = [load.get(h, 0) for h in healthy]
    assert max(counts) - min(counts) <= 1  # even spread
    for srcs in out.values():
        assert len(srcs) == shards
        # different shards come from different sources whenever there are enough
        assert len(set(srcs)) == min(shards, healthy_n)


def test_assign_sources_without_healthy_is_an_error():
    with pytest.raises(ValueError, match="no healthy replica"):
        assign_sources([("1", 1)], ())


def test_quorum_id_stable_with_same_membership():
    q1, _ = decide(reqs(req("0", 0), req("1", 0)), now=0.0)
    q2, reason = decide(reqs(req("0", 1, at=1.0), req("1", 1, at=1.0)), {"0": 1.0, "1": 1.0}, q1, now=1.0)
    assert q1.quorum_id == 1 and q2.quorum_id == 1 and "same membership" in reason
    # A behind replica catching up is not a membership change either.
    q3, _ = decide(reqs(req("0", 2, at=2.0), req("1", 2, at=2.0)), {"0": 2.0, "1": 2.0}, q2, now=2.0)
    assert q3.quorum_id == 1


def test_quorum_id_changes_on_membership_change():
    q1, _ = decide(reqs(req("0"), req("1")), now=0.0)
    q2, reason = decide(reqs(req("0", 1, at=1.0), req("1", 1, at=1.0), req("2", 0, at=1.0)), {}, q1, now=1.0)
    assert q2.quorum_id == 2 and "+[2]" in reason
    q3, reason = decide(reqs(req("0", 2, at=2.0), req("2", 2, at=2.0)), {"1": 0.5}, q2, now=2.0)
    assert q3.quorum_id == 3 and "-[1]" in reason


def test_quorum_id_changes_when_a_member_restarts_with_new_addresses():
    q1, _ = decide(reqs(req("0"), req("1")), now=0.0)
    q2, reason = decide(reqs(req("0", 1, at=1.0), req("1", 0, at=1.0, port=20000)), {}, q1, now=1.0)
    assert q2.quorum_id == 2 and "addresses changed" in reason


def test_quorum_id_changes_on_commit_failure():
    q1, _ = decide(reqs(req("0"), req("1")), now=0.0)
    q2, reason = decide(reqs(req("0", 1, at=1.0, failed=True), req("1", 1, at=1.0)), {}, q1, now=1.0)
    assert q2.quorum_id == 2 and "commit failed on [0]" in reason
    q3, _ = decide(reqs(req("0", 1, at=2.0), req("1", 1, at=2.0)), {}, q2, now=2.0)
    assert q3.quorum_id == 2


def test_dead_replicas():
    hb = {"0": 10.0, "1": 9.5, "2": 8.9, "10": 1.0}
    assert dead_replicas(hb, 10.0, 1.0) == ["2", "10"]
    assert dead_replicas(hb, 10.0, 0.4) == ["1", "2", "10"]
    assert dead_replicas({}, 10.0, 1.0) == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"min_replicas": 0}, "min_replicas"),
        ({"join_timeout_s": -1}, "join_timeout_s"),
        ({"join_timeout_s": float("inf")}, "join_timeout_s"),
        ({"heartbeat_window_s": 0}, "heartbeat_window_s"),
        ({"num_configured": -2}, "num_configured"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuorumConfig(**kwargs)
