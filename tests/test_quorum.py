"""Unit tests of the pure quorum decision: one test (at least) per rule, no server."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from fthsdp.control.quorum import (
    MAX_REPORTED_QUORUM_ID,
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


def req(rid: str, step: int = 0, at: float = 0.0, *, lws: int = 1, port: int | None = None, failed: bool = False,
        last_qid: int = 0, last_members: tuple[str, ...] = ()):
    base = 10000 + 10 * int(rid) if port is None else port
    return QuorumRequest(
        replica_id=rid,
        step=step,
        arrived_at=at,
        ftar_addresses=tuple(f"127.0.0.1:{base + k}" for k in range(lws)),
        state_server_address=f"127.0.0.1:{base + 9}",
        local_world_size=lws,
        commit_failed=failed,
        last_quorum_id=last_qid,
        last_members=last_members,
    )


def reqs(*rs: QuorumRequest) -> dict[str, QuorumRequest]:
    return {r.replica_id: r for r in rs}


def decide(requests, heartbeats=None, previous=None, config=CFG, now=0.0, floor=0):
    return decide_quorum(requests, heartbeats or {}, previous, config, now, quorum_id_floor=floor)


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
    assert "without live newcomer(s) [2]" in reason


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


# -- issue 10: incumbents are never left out by a timer; the join limit is for newcomers --------------------


def survivors_quorum() -> Quorum:
    """Quorum 2 of a job whose replica 1 died: members 0 and 2 at step 40."""
    return Quorum(2, (Member("0", 40, ("127.0.0.1:10000",), "127.0.0.1:10009"),
                      Member("2", 40, ("127.0.0.1:10020",), "127.0.0.1:10029")), 40, ("0", "2"), ())


def test_rejoiner_asking_first_does_not_drop_a_busy_incumbent():
    # The restarted replica 1 asks at t=0; survivor 2 finishes its step at 0.3, survivor 0 is
    # still computing (heartbeating) at t=5, far past the join limit: nobody is dropped.
    prev = survivors_quorum()
    r = reqs(req("1", 0, at=0.0), req("2", 41, at=0.3))
    hb = {"0": 4.95, "1": 4.95, "2": 4.95}
    q, reason = decide(r, hb, prev, now=5.0)
    assert q is None, reason
    assert "live member(s) of quorum 2 not asking yet [0]" in reason
    r["0"] = req("0", 41, at=5.1)
    q, reason = decide(r, {k: 5.1 for k in hb}, prev, now=5.1)
    assert q is not None, reason
    assert q.member_ids == ("0", "1", "2") and q.healthy == ("0", "2") and q.behind == ("1",)
    assert q.left_out == () and q.quorum_id == 3 and "+[1]" in reason


def test_incumbent_is_waited_for_only_until_declared_dead():
    prev = survivors_quorum()
    r = reqs(req("1", 0, at=0.0), req("2", 41, at=0.3))
    # 0 last heard at 0.2: within the window at 1.1 (still waited for), silent > 1.0 at 1.3 (dead).
    q, reason = decide(r, {"0": 0.2, "1": 1.1, "2": 1.1}, prev, now=1.1)
    assert q is None and "[0]" in reason, reason
    q, reason = decide(r, {"0": 0.2, "1": 1.3, "2": 1.3}, prev, now=1.3)
    assert q is not None and q.member_ids == ("1", "2") and "-[0]" in reason, reason


def test_newcomer_join_limit_counts_from_the_last_incumbent_request():
    # Incumbents 0 and 2 ask 3 s apart (a long step); newcomer 1 is live but not asking.
    prev = survivors_quorum()
    r = reqs(req("0", 41, at=0.0), req("2", 41, at=3.0))
    hb = {"0": 3.0, "1": 3.0, "2": 3.0}
    q, reason = decide(r, hb, prev, now=3.01)
    assert q is None and "newcomer(s) not asking yet [1]" in reason, reason
    q, reason = decide(r, {k: 4.0 for k in hb}, prev, now=4.01)  # 1.01 s after the last incumbent
    assert q is not None and q.member_ids == ("0", "2") and q.left_out == ("1",), reason
    assert q.quorum_id == 2 and "same membership" in reason


@pytest.mark.parametrize("order", list(itertools.permutations(["0", "1", "2", "3"])))
def test_no_arrival_order_makes_a_live_incumbent_behind(order):
    # Incumbents 0, 2, 3 at step 40, rejoiner 1 at step 0, arriving in any order 0.7 s apart
    # (longer than the join limit); everyone heartbeats. Each decision point is checked.
    prev = Quorum(5, tuple(Member(r, 40) for r in ("0", "2", "3")), 40, ("0", "2", "3"), ())
    r: dict[str, QuorumRequest] = {}
    for i, rid in enumerate(order):
        t = 0.7 * i
        r[rid] = QuorumRequest(rid, 0 if rid == "1" else 40, t)
        q, reason = decide(dict(r), {k: t for k in "0123"}, prev, config=QuorumConfig(join_timeout_s=0.5), now=t + 0.6)
        if q is not None:
            assert set(q.healthy) >= {"0", "2", "3"}, (order, reason)
            assert "1" not in q.healthy
    assert q is not None and q.member_ids == ("0", "1", "2", "3") and q.behind == ("1",)


def test_restarted_lighthouse_waits_for_reported_members_and_continues_ids():
    # A lighthouse restarted mid-run remembers nothing; 0 and 1 report quorum 7 = {0, 1, 2}.
    r = reqs(req("0", 88, at=0.0, last_qid=7, last_members=("0", "1", "2")),
             req("1", 88, at=0.0, last_qid=7, last_members=("0", "1", "2")))
    hb = {"0": 5.0, "1": 5.0, "2": 5.0}
    q, reason = decide(r, hb, now=5.0)
    assert q is None and "member(s) of quorum 7" in reason and "[2]" in reason, reason
    r["2"] = req("2", 88, at=5.0, last_qid=7, last_members=("0", "1", "2"))
    q, reason = decide(r, hb, now=5.0)
    assert q is not None and q.member_ids == ("0", "1", "2"), reason
    assert q.quorum_id == 8 and "lighthouse restarted" in reason
    assert q.healthy == ("0", "1", "2")  # same step: nobody is behind, nobody trains twice


def test_restarted_lighthouse_gives_unheard_reported_members_two_windows_then_goes_on():
    r = reqs(req("0", 88, at=0.0, last_qid=7, last_members=("0", "1", "2")),
             req("1", 88, at=0.0, last_qid=7, last_members=("0", "1", "2")))
    cfg = QuorumConfig(num_configured=3, heartbeat_window_s=1.0)
    # 2 was never heard from by this lighthouse: probably still reconnecting, so it is waited for...
    q, reason = decide(r, {"0": 1.5, "1": 1.5}, config=cfg, now=1.5)
    assert q is None and "not heard from yet [2]" in reason, reason
    # ...for two detection windows; then it is taken for dead and the job goes on.
    q, reason = decide(r, {"0": 2.0, "1": 2.0}, config=cfg, now=2.0)
    assert q is not None and q.member_ids == ("0", "1") and q.quorum_id == 8, reason


def test_restarted_lighthouse_does_not_let_a_slow_replica_form_a_quorum_alone_without_the_member_list():
    # Only the first members list the quorum's members (sends_last_members). Replica 3 hung past
    # a lighthouse restart: it asks at step 12 reporting quorum 4, while the others, at step 18 in
    # quorum 5 of the old lighthouse, have not heartbeat to the new one yet. Without the list the
    # lighthouse must not take 3's word for the job: it gives the others two windows to be heard.
    r = reqs(req("3", 12, at=0.0, last_qid=4))
    q, reason = decide(r, {"3": 0.1}, now=0.1)
    assert q is None and "the members of quorum 4 (no requester listed them)" in reason, reason
    # The others' heartbeats report quorum 5: they are its members, mid-step, waited for; 3 is not one.
    rep = {"0": 5, "1": 5, "2": 5, "3": 4}
    q, reason = decide_quorum(r, {k: 0.5 for k in rep}, None, CFG, 0.5, reported_quorum_ids=rep)
    assert q is None and "member(s) of quorum 5 not asking yet" in reason, reason
    for rid in ("0", "1", "2"):
        r[rid] = req(rid, 18, at=0.6, last_qid=5)
    q, reason = decide_quorum(r, {k: 2.1 for k in rep}, None, CFG, 2.1, reported_quorum_ids=rep)
    assert q is not None and q.quorum_id == 6 and q.max_step == 18, reason
    assert q.behind == ("3",) and q.healthy == ("0", "1", "2")  # 3 fetches; it never trained alone
    # A requester that lists the members lets the restarted lighthouse decide at once, as before.
    q, reason = decide(reqs(req("0", 7, at=0.0, last_qid=4, last_members=("0",))), {"0": 0.1}, now=0.1)
    assert q is not None and q.quorum_id == 5, reason


def test_quorum_id_never_at_or_below_a_reported_one():
    q, reason = decide(reqs(req("0"), req("1")), {"0": 0.0, "1": 0.0}, now=0.0, floor=12)
    assert q is not None and q.quorum_id == 13 and "above quorum 12" in reason
    # A replica reporting a higher id than the lighthouse's previous quorum bumps a changed one past it.
    prev = Quorum(3, (Member("0", 5),), 5, ("0",), ())
    q, reason = decide(reqs(req("0", 5), req("1", 0, last_qid=9)), {}, prev, now=0.0)
    assert q is not None and q.quorum_id == 10, reason
    # ...while an unchanged quorum keeps its id.
    q1, _ = decide(reqs(req("0", 0), req("1", 0)), now=0.0)
    q2, reason = decide(reqs(req("0", 1, last_qid=1), req("1", 1, last_qid=1)), {}, q1, now=1.0)
    assert q2.quorum_id == 1 and "same membership" in reason


def test_restarted_lighthouse_never_lets_restarted_replicas_train_from_step_0_alone():
    # Lighthouse storm: a fresh lighthouse hears two restarted replicas (step 0, no quorum yet)
    # asking, while survivor 0 (member of quorum 7, at step 50) is mid-step: it only heartbeats.
    r = reqs(req("1", 0, at=0.0), req("2", 0, at=0.0))
    hb = {"0": 3.0, "1": 3.0, "2": 3.0}
    q, reason = decide_quorum(r, hb, None, CFG, 3.0, reported_quorum_ids={"0": 7, "1": 0, "2": 0})
    assert q is None and "member(s) of quorum 7 not asking yet [0]" in reason, reason
    r["0"] = req("0", 50, at=3.1, last_qid=7, last_members=("0",))
    q, reason = decide_quorum(r, {k: 3.1 for k in hb}, None, CFG, 3.1, reported_quorum_ids={"0": 7})
    assert q is not None and q.quorum_id == 8, reason
    assert q.healthy == ("0",) and q.behind == ("1", "2") and q.max_step == 50


def test_a_member_restarted_to_rejoin_at_step_0_is_marked_rejoining_and_a_rejoiner_decides_from_it():
    """Member.rejoining: asked as restarted to rejoin (QuorumRequest.rejoin) at step 0, holding
    none of the job's state; a rejoiner past step 0 (it caught up) is not. What a rejoiner healthy
    at step 0 does with it (fsm.rejoin_at_step_0): trains at once beside a first start, waits
    and then gives up in a quorum of only rejoiners."""
    import dataclasses

    from fthsdp.replica.fsm import rejoin_at_step_0

    r = reqs(dataclasses.replace(req("0"), rejoin=True), req("1"))
    q, reason = decide(r, {"0": 0.0, "1": 0.0}, now=0.01)
    assert q is not None, reason
    assert [m.rejoining for m in q.members] == [True, False]
    assert rejoin_at_step_0(q, "0", 0.0, 4.0) == ("train", "['1'] at their first start (the job's first step "
                                                          "never committed)")
    only = reqs(*(dataclasses.replace(req(k), rejoin=True) for k in ("1", "2")))
    q2, _ = decide(only, {"1": 0.0, "2": 0.0}, now=0.01)
    assert all(m.rejoining for m in q2.members)
    assert rejoin_at_step_0(q2, "1", 3.9, 4.0) == ("wait", "it holds only replicas restarted to rejoin (['1', '2'])")
    verdict, why = rejoin_at_step_0(q2, "1", 4.0, 4.0)
    assert verdict == "give up" and "has been running for 4.0 s (it holds only replicas restarted" in why
    alone = Quorum(1, (Member("1", 0),), 0, ("1",), ())  # an older lighthouse sets no flag: itself counts
    assert rejoin_at_step_0(alone, "1", 0.0, 4.0) == ("wait", "it is alone")
    caught_up = reqs(dataclasses.replace(req("0", step=5), rejoin=True), req("1", step=5))
    q3, _ = decide(caught_up, {"0": 0.0, "1": 0.0}, now=0.01)
    assert not any(m.rejoining for m in q3.members)


def test_the_step0_rule_applies_only_to_a_stateless_rejoiner_healthy_at_step_0_of_a_multi_replica_job():
    """fsm.step0_rule_applies: the one guard the Manager and the emulation share before
    fsm.rejoin_at_step_0. Each condition alone turns it off."""
    import dataclasses

    from fthsdp.replica.fsm import step0_rule_applies

    q, reason = decide(reqs(dataclasses.replace(req("0"), rejoin=True), req("1")), {"0": 0.0, "1": 0.0}, now=0.01)
    assert q is not None, reason
    yes = dict(rejoin=True, step=0, replicas=2, trusted=False)
    assert step0_rule_applies(q, "0", **yes)
    assert not step0_rule_applies(q, "0", **{**yes, "rejoin": False})  # a first start: step 0 is the truth
    assert not step0_rule_applies(q, "0", **{**yes, "step": 3})  # it holds a committed step
    assert not step0_rule_applies(q, "0", **{**yes, "replicas": 1})  # alone by design, it is the job
    assert not step0_rule_applies(q, "0", **{**yes, "trusted": True})  # already told to train
    assert not step0_rule_applies(q, "9", **yes)  # not healthy in q (not a member)
    later, _ = decide(reqs(dataclasses.replace(req("0"), rejoin=True), req("1", step=5)), {"0": 0.0, "1": 0.0},
                      now=0.01)
    assert later is not None and later.max_step == 5
    assert not step0_rule_applies(later, "0", **yes)  # a member holds steps: it catches up instead


def test_a_reported_quorum_id_moves_the_ids_only_up_to_the_cap():
    """A replica may report any id up to the protocol's 2**53; followed whole, 2**53 would leave no
    id to issue. The floor follows reports up to 2**52 (the job keeps 2**52 ids), lower ones exactly;
    a restarted lighthouse continues past its members' last quorum; ids end, with a reason, at 2**53."""
    hb = {"0": 0.0, "1": 0.0}
    both = ("0", "1")
    # a restarted lighthouse continues from the quorum its members name: never an id they saw, past the cap too
    q, reason = decide(reqs(req("0", last_qid=2**52 + 5, last_members=both),
                            req("1", last_qid=2**52 + 5, last_members=both)), hb, now=0.01, floor=2**52 + 5)
    assert q is not None and q.quorum_id == 2**52 + 6, reason
    # ids are used up at the protocol's limit: refused with the reason, no id past it
    q, reason = decide(reqs(req("0", last_qid=2**53, last_members=both), req("1", last_qid=2**53, last_members=both)),
                       hb, now=0.01)
    assert q is None and "quorum ids of this job are used up" in reason and "new job id" in reason
    capped, reason = decide(reqs(req("0"), req("1")), hb, now=0.01, floor=2**53)
    assert capped is not None and capped.quorum_id == MAX_REPORTED_QUORUM_ID + 1 == 2**52 + 1, reason
    assert "followed only up to" in reason
    again, reason = decide(reqs(req("0", last_qid=2**52 + 1), req("1", last_qid=2**52 + 1)), hb, capped, now=0.02,
                           floor=2**53)
    assert again is not None and again.quorum_id == 2**52 + 1, reason  # unchanged membership keeps its id
    q, reason = decide(reqs(req("0"), req("1")), hb, now=0.01, floor=1000)
    assert q is not None and q.quorum_id == 1001 and "followed only" not in reason, reason
