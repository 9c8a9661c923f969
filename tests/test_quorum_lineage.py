"""The lineage fence (rule 6 of fthsdp.control.quorum), as pure decisions: the split
brain the emulation caught at 512 x 196 ranks, replayed step by step over plain data."""

from __future__ import annotations

import pytest

from fthsdp.control.quorum import (LINEAGE_REPORTED, Lineage, QuorumConfig, QuorumRequest, decide_quorum,
                                   fork_reason, forked_at, lineage_report, parse_lineage_report, unreported_through)

CFG = QuorumConfig(min_replicas=1, join_timeout_s=0.5, heartbeat_window_s=1.0)


def req(rid: str, step: int, at: float, last_qid: int = 0, failed: bool = False,
        members: tuple[str, ...] = ()) -> QuorumRequest:
    return QuorumRequest(replica_id=rid, step=step, arrived_at=at, ftar_addresses=(f"127.0.0.1:{20000 + int(rid)}",),
                         state_server_address=f"127.0.0.1:{21000 + int(rid)}", commit_failed=failed,
                         last_quorum_id=last_qid, last_members=members)


def by_id(*rs: QuorumRequest) -> dict[str, QuorumRequest]:
    return {r.replica_id: r for r in rs}


def test_lineage_keeps_the_smallest_step_decided_after_each_quorum():
    lin = Lineage()
    lin = lin.after(1, 0).after(1, 5)  # quorum 1 goes on: nothing new to remember
    assert lin.entries == ((1, 0),)
    lin = lin.after(2, 7).after(3, 9)
    assert lin.entries == ((1, 0), (2, 7), (3, 9))
    assert lin.first_decided_after(1) == (2, 7) and lin.first_decided_after(3) is None
    lin = lin.after(4, 7)  # quorum 4 re-decides step 7: quorums 2 and 3 can no longer be the answer
    assert lin.entries == ((1, 0), (4, 7))
    assert lin.first_decided_after(2) == (4, 7)
    # A replica at step 9 whose last quorum was 3 committed steps 7 and 8 there: quorum 4 re-decided 7.
    assert forked_at(lin, 3, 9) == (4, 7)
    assert forked_at(lin, 3, 7) is None  # it had not committed step 7: its state is step 7's input
    assert forked_at(lin, 4, 12) is None  # a member of the newest quorum
    assert forked_at(lin, 0, 12) is None  # never in a quorum (fresh or restarted process): judged by its step
    # Bounded: the oldest entries are forgotten, and a replica that old is fenced (its state cannot be checked).
    small = Lineage(limit=2).after(1, 0).after(2, 1).after(3, 2)
    assert small.entries == ((2, 1), (3, 2)) and small.dropped_through == 1
    assert forked_at(small, 1, 5) == (0, 0) and forked_at(small, 2, 2) is None


def test_split_brain_sequence_is_fenced():
    """Replicas 0, 1, 2 (detection window 1 s). Replica 2 goes silent in step 1, so 0 and 1
    form quorum 2 and commit step 1; then 0 and 1 go silent in step 2 and 2 comes back at
    step 1: alone, it is a majority of the live and forms quorum 3, retraining step 1. When
    all three meet at step 3, 0 and 1 hold a forked state: without the lineage all three
    would be healthy (three replicas, two different models); with it 0 and 1 are behind."""
    lin = Lineage()
    q1, _ = decide_quorum(by_id(req("0", 0, 0.0), req("1", 0, 0.0), req("2", 0, 0.0)),
                          {"0": 0.0, "1": 0.0, "2": 0.0}, None, CFG, 0.0, lineage=lin)
    assert q1 is not None and q1.quorum_id == 1
    lin = lin.after(q1.quorum_id, q1.max_step)
    # t=3: 2 silent since t=1.5 (dead); 0 and 1 failed step 1 (aborted) and ask again.
    beats = {"0": 3.0, "1": 3.0, "2": 1.5}
    q2, why = decide_quorum(by_id(req("0", 1, 3.0, 1, failed=True), req("1", 1, 3.0, 1, failed=True)),
                            beats, q1, CFG, 3.0, lineage=lin)
    assert q2 is not None and q2.member_ids == ("0", "1") and q2.max_step == 1, why
    lin = lin.after(q2.quorum_id, q2.max_step)
    # They commit step 1 and go silent in step 2 (t=3.1). At t=5, replica 2 asks at step 1.
    beats = {"0": 3.1, "1": 3.1, "2": 5.0}
    q3, why = decide_quorum(by_id(req("2", 1, 5.0, 1, failed=True)), beats, q2, CFG, 5.0, lineage=lin)
    assert q3 is not None and q3.member_ids == ("2",) and q3.max_step == 1 and q3.healthy == ("2",), why
    lin = lin.after(q3.quorum_id, q3.max_step)
    # Replica 2 commits steps 1 and 2 (quorum 3); 0 and 1 wake up, commit step 2 in quorum 2,
    # and everybody asks at step 3.
    meet = by_id(req("0", 3, 7.0, 2), req("1", 3, 7.0, 2), req("2", 3, 7.0, 3))
    beats = {"0": 7.0, "1": 7.0, "2": 7.0}
    unfenced, _ = decide_quorum(meet, beats, q3, CFG, 7.0)
    assert unfenced is not None and unfenced.healthy == ("0", "1", "2")  # the split brain, as it was
    q4, why = decide_quorum(meet, beats, q3, CFG, 7.0, lineage=lin)
    assert q4 is not None, why
    assert q4.healthy == ("2",) and q4.behind == ("0", "1") and q4.max_step == 3
    assert q4.sources_for("0") == ("2",) and "fenced" in why and "quorum 3 re-decided step 1" in why
    # Once they caught up in quorum 4 (their last quorum), they are members of the lineage again.
    lin = lin.after(q4.quorum_id, q4.max_step)
    assert forked_at(lin, q4.quorum_id, 4) is None


def test_fenced_replicas_above_the_lineage_go_back_to_it_and_wait_without_it():
    lin = Lineage().after(1, 0).after(2, 4).after(3, 4)  # quorum 3 re-decided step 4 without 0 and 1
    beats = {"0": 9.0, "1": 9.0, "2": 9.0}
    # 0 and 1 committed steps 4 and 5 in quorum 2; 2 failed step 4 in quorum 3: the lineage's state
    # is step 4's input, so 0 and 1 go back to step 4 (behind) instead of leading the quorum.
    # (no previous quorum in memory here, so the requesters list their last quorum's members,
    # as the first members of a quorum do: rule 3a after a lighthouse restart)
    q, why = decide_quorum(by_id(req("0", 6, 9.0, 2, members=("0", "1")), req("1", 6, 9.0, 2, members=("0", "1")),
                                 req("2", 4, 9.0, 3, failed=True, members=("2",))),
                           beats, None, CFG, 9.0, lineage=lin)
    assert q is not None and q.max_step == 4 and q.healthy == ("2",) and q.behind == ("0", "1"), why
    # Nobody unfenced asks (2 is silent): no quorum, and the reason says why.
    q, why = decide_quorum(by_id(req("0", 6, 9.0, 2, members=("0", "1")), req("1", 6, 9.0, 2, members=("0", "1"))),
                           {"0": 9.0, "1": 9.0, "2": 0.0},
                           None, CFG, 9.0, lineage=lin)
    assert q is None and "lineage fence" in why and "none asks" in why
    # An unfenced replica below the forking step does not hold the lineage's state either: wait.
    q, why = decide_quorum(by_id(req("0", 6, 9.0, 2, members=("0", "1")), req("1", 6, 9.0, 2, members=("0", "1")),
                                 req("2", 0, 9.0)), beats, None, CFG, 9.0, lineage=lin)
    assert q is None and "step >= 4" in why and "the others are at step 0" in why


@pytest.mark.parametrize("limit", [0, -1])
def test_lineage_limit_must_be_positive(limit):
    with pytest.raises(ValueError, match="limit"):
        Lineage(limit=limit)


def test_a_fork_is_not_judged_as_silent_data_corruption():
    """Found by the real-process fork (tests/test_lineage_fork.py): 0 and 1 committed step 5
    in quorum 2 and reported their state of step 6; replica 2 then re-decided step 5 alone
    (quorum 3) and reported its own, different, state of step 6. Compared as one step, 2 of
    3 agree and the lineage's only holder was condemned: fenced 0 and 1 and condemned 2
    left nobody to rejoin from, and the job hung. A quorum decided at step 5 drops what was
    reported for later steps (the lighthouse also ignores reports of forked states)."""
    from fthsdp.control.sdc import MISMATCH, SdcTracker

    sdc = SdcTracker()
    sdc.set_voters(6, ("0", "1"))  # quorum 2, decided at step 5
    sdc.record("0", 6, 0xA)
    sdc.record("1", 6, 0xA)
    sdc.update({"0", "1", "2"})
    sdc.forget_after(5)  # quorum 3 re-decides step 5
    sdc.set_voters(6, ("2",))
    sdc.record("2", 6, 0xB)
    assert sdc.update({"0", "1", "2"}) == [] and sdc.condemned == {}
    # Without forgetting, the lineage's holder was the culprit (what the fork test hit); now only the
    # members of the quorum that ran a step vote on it, so the forked holders' reports do not count.
    old = SdcTracker()
    old.set_voters(6, ("0", "1"))
    for rid, fp in (("0", 0xA), ("1", 0xA)):
        old.record(rid, 6, fp)
    old.update({"0", "1", "2"})
    old.set_voters(6, ("2",))
    old.record("2", 6, 0xB)
    assert old.update({"0", "1", "2"}) == [] and old.condemned == {}
    # Without voters known for the step (a lighthouse restarted since), every report votes: a mismatch.
    unknown = SdcTracker()
    for rid, fp in (("0", 0xA), ("1", 0xA), ("2", 0xB)):
        unknown.record(rid, 6, fp)
    (v,) = unknown.update({"0", "1", "2"})
    assert v.kind == MISMATCH and v.culprits == ("2",)
    # A condemnation made from a forked step is lifted too; earlier steps are kept.
    sdc = SdcTracker()
    for rid, fp in (("0", 1), ("1", 1), ("2", 2)):
        sdc.record(rid, 4, 0)
        sdc.record(rid, 7, fp)
    sdc.update({"0", "1", "2"})
    assert set(sdc.condemned) == {"2"}
    sdc.forget_after(5)
    assert sdc.condemned == {} and set(sdc.reports) == {4}
    # The reports of a forked state are recognised by the lineage: 0 reports step 7 with last quorum 2.
    lin = Lineage().after(1, 0).after(2, 5).after(3, 5)
    assert forked_at(lin, 2, 7) == (3, 5) and forked_at(lin, 3, 7) is None and forked_at(lin, 2, 5) is None


def test_merging_reported_lineages_gives_the_lineage_of_all_decisions():
    """A restarted lighthouse rebuilds the lineage from the replicas' reports: each holds the
    stack of the quorums it was answered; merged in any order they give the stack of every
    decision (what the lighthouse had before it restarted)."""
    import itertools
    import random

    rng = random.Random(7)
    for _ in range(200):
        decisions, step = [], 0
        for qid in range(1, rng.randrange(2, 12)):
            step = max(0, step + rng.randrange(-3, 4))  # a later quorum may re-decide earlier steps
            decisions.append((qid, step))
        full = Lineage()
        for q, s in decisions:
            full = full.after(q, s)
        # Each replica saw a random subset of the quorums (the ones it was a member of).
        seen = [[d for d in decisions if rng.random() < 0.6] for _ in range(3)]
        seen[rng.randrange(3)] = decisions  # someone held every quorum: the union is complete
        stacks = []
        for ds in seen:
            lin = Lineage()
            for q, s in ds:
                lin = lin.after(q, s)
            stacks.append(lin.entries)
        for order in itertools.permutations(stacks):
            got = Lineage()
            for st in order:
                got = got.merged(st)
            assert got.entries == full.entries, (decisions, seen)
    lin = Lineage().after(1, 0).after(3, 5)
    assert lin.merged([(1, 0), (3, 5)]) is lin  # nothing new: the same object (a repeated report costs nothing)
    # The split brain's reports: 0 and 1 were answered quorums 1 and 2, replica 2 quorums 1 and 3.
    merged = Lineage().merged([(1, 0), (2, 1)]).merged([(1, 0), (3, 1)])
    assert merged.entries == ((1, 0), (3, 1)) and forked_at(merged, 2, 3) == (3, 1)


def test_lineage_reports_are_bounded_and_checked():
    lin = Lineage()
    for q, s in ((1, 0), (2, 3), (4, 7), (5, 9), (8, 12), (9, 15)):
        lin = lin.after(q, s)
    values = lineage_report(lin)
    assert values == [2, 3, 4, 7, 5, 9, 8, 12, 9, 15][-2 * LINEAGE_REPORTED:]
    assert parse_lineage_report(values) == ((4, 7), (5, 9), (8, 12), (9, 15))
    assert parse_lineage_report([]) == ()
    for bad, what in (([1, 0, 2], "pairs"), ([1, 0] * (LINEAGE_REPORTED + 1), "at most"),
                      ([0, 1], "quorum ids must be > 0"), ([1, -1], "steps >= 0"),
                      ([3, 5, 2, 7], "rise in quorum id and step"), ([2, 5, 3, 5], "rise in quorum id and step")):
        with pytest.raises(ValueError, match=what):
            parse_lineage_report(bad)
    # checked against the request: its newest entry is the replica's last quorum (its step is not
    # compared: a replica whose catch-up did not commit asks at its old step)
    assert parse_lineage_report(values, last_quorum_id=9) == ((4, 7), (5, 9), (8, 12), (9, 15))
    assert parse_lineage_report([3, 40, 7, 100], last_quorum_id=7) == ((3, 40), (7, 100))
    with pytest.raises(ValueError, match="past the last quorum this replica was a member of"):
        parse_lineage_report(values, last_quorum_id=8)
    with pytest.raises(ValueError, match="past 4503599627370496"):  # a huge id broke a restarted lighthouse's order
        parse_lineage_report([2**62, 0], last_quorum_id=2**62)
    assert "quorum 3 re-decided step 5 after its last quorum 2" in fork_reason("0", 8, 2, (3, 5))
    assert "steps 5..7 are not in the job's model" in fork_reason("0", 8, 2, (3, 5))
    assert "older than the lineage kept" in fork_reason("0", 8, 1, (0, 0))


def test_a_fork_more_quorum_changes_back_than_reported_is_still_fenced():
    """A restarted lighthouse hears only each replica's newest LINEAGE_REPORTED entries. Quorum 3
    forked 0 and 1 at step 1; replica 2 then went through quorums 4..7, so its report no longer
    holds quorum 3's entry, and by the entries alone 0 and 1 (last quorum 2, at step 3) look
    clean. A full report's older ids are forgotten instead: 0 and 1 are fenced (their state
    cannot be checked), and with replica 2 gone they get no quorum rather than lead the job."""
    holder = Lineage()
    for q, s in ((1, 0), (3, 1), (4, 3), (5, 5), (6, 7), (7, 9)):
        holder = holder.after(q, s)
    forked = Lineage().after(1, 0).after(2, 1)
    reports = [parse_lineage_report(lineage_report(x)) for x in (forked, holder)]
    assert reports[1] == ((4, 3), (5, 5), (6, 7), (7, 9))  # quorum 3's entry was cut
    assert [unreported_through(r) for r in reports] == [0, 3]
    by_entries = Lineage().merged(reports[0]).merged(reports[1])
    assert forked_at(by_entries, 2, 3) is None  # the gap: step 3 is below quorum 4's step
    for order in (reports, reports[::-1]):
        lin = Lineage()
        for r in order:
            lin = lin.merged(r).forgotten_through(unreported_through(r))
        assert lin.dropped_through == 3 and lin.entries == ((4, 3), (5, 5), (6, 7), (7, 9)), order
        assert forked_at(lin, 2, 3) == (0, 0) and forked_at(lin, 7, 10) is None and forked_at(lin, 5, 6) is None
    beats = {"0": 9.0, "1": 9.0, "2": 0.0}
    q, why = decide_quorum(by_id(req("0", 3, 9.0, 2, members=("0", "1")), req("1", 3, 9.0, 2, members=("0", "1"))),
                           beats, None, CFG, 9.0, lineage=lin)
    assert q is None and "lineage fence" in why and "older than the lineage kept" in why, why
    # With the holder asking, it leads and 0 and 1 fetch its state.
    beats["2"] = 9.0
    q, why = decide_quorum(by_id(req("0", 3, 9.0, 2, members=("0", "1")), req("1", 3, 9.0, 2, members=("0", "1")),
                                 req("2", 10, 9.0, 7, members=("2",))), beats, None, CFG, 9.0, lineage=lin)
    assert q is not None and q.healthy == ("2",) and q.behind == ("0", "1"), why
    assert lin.forgotten_through(2) is lin and Lineage().merged([(2, 1)]).forgotten_through(2).entries == ()


def test_a_quorum_of_only_rejoiners_decides_no_step_and_fences_no_returning_state_holder():
    """Replayed from a chaos soak (seed 8 with 2 relays): after a lighthouse restart the only
    replica holding the job's state (2, at step 90, last in quorum 4) was cut off; a rejoiner (0,
    holding nothing) asked alone and was answered quorum 5 at step 0, and waited (fsm.rejoin_at_step_0).
    Recorded in the lineage, that quorum "re-decided step 0" and fenced replica 2 as forked when it
    came back: the rejoiners were then healthy at step 0 beside a member behind, and trained the
    job from its start. A quorum of only rejoiners decides nothing (Lineage.after_quorum)."""
    import dataclasses

    from fthsdp.replica.fsm import rejoin_at_step_0

    def rejoiner(rid: str, at: float) -> QuorumRequest:
        return dataclasses.replace(req(rid, 0, at), rejoin=True)

    lin = Lineage(((4, 89),))  # what replica 2 reported to the restarted lighthouse
    beats = {"0": 9.0, "1": 9.0, "2": 9.0}
    q5, why = decide_quorum(by_id(rejoiner("0", 9.0)), {"0": 9.0}, None, CFG, 9.0, lineage=lin, quorum_id_floor=4)
    assert q5 is not None and q5.quorum_id == 5 and q5.only_rejoining, why
    assert lin.after_quorum(q5) is lin and lin.answered_quorum(q5) is lin
    assert rejoin_at_step_0(q5, "0", 0.0, 8.0)[0] == "wait"
    back = by_id(rejoiner("0", 10.0), rejoiner("1", 10.0), req("2", 90, 10.0, 4))
    q6, why = decide_quorum(back, beats, q5, CFG, 10.0, lineage=lin.after_quorum(q5))
    assert q6 is not None and q6.healthy == ("2",) and q6.behind == ("0", "1") and "fenced" not in why, why
    assert not q6.only_rejoining and lin.after_quorum(q6).entries[-1] == (6, 90)
    # recorded as before, the rejoiners' quorum fenced the state holder and left them healthy at step 0;
    # they wait for it then (a member behind is no first start), not train
    q6_old, why = decide_quorum(back, beats, q5, CFG, 10.0, lineage=lin.after(5, 0))
    assert q6_old.healthy == ("0", "1") and q6_old.behind == ("2",) and "fenced, behind" in why, why
    verdict, said = rejoin_at_step_0(q6_old, "0", 0.0, 8.0)
    assert verdict == "wait" and "['2'] hold steps the lighthouse fenced as forked" in said, said
