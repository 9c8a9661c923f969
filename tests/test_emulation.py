"""The emulation (fthsdp.sim): the real lighthouse process and the replica step
machine driven for 10,000 emulated ranks with injected faults, and the
invariants it checks; plus its mocks' own rules, and proof that the checks can fail.

Speed is not asserted here (experiments/scale.py measures it)."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest

from fthsdp.sim.emulation import CommitRecord, EmulationConfig, EmulationReport, Fault, run_emulation
from fthsdp.sim.mock_plane import FabricConfig, MockFabric, ModelShape
from fthsdp.timeouts import Timeouts


def test_10k_ranks_with_kills_hang_ring_rank_faults_and_a_lighthouse_restart():
    faults = (
        Fault("ring", step=3, rank=1),  # one ring fails for every member: nobody commits, all retry
        Fault("kill", step=5, replica=2, seconds=1.0),  # SIGKILL mid-step; restarted, rejoins by catching up
        Fault("rank", step=8, replica=1, rank=4),  # one rank's vote says no: the others commit, 1 catches up
        Fault("hang", step=12, replica=3, seconds=1.6),  # silent past detection: survivors abort and go on
        Fault("lighthouse", step=18, seconds=0.5),  # lighthouse SIGKILLed and restarted on its port
        Fault("kill", step=21, replica=7, seconds=0.5),
    )
    cfg = EmulationConfig(replicas=32, ranks_per_replica=320, steps=30,
                          model=ModelShape(params=10**9, step_s=0.05), faults=faults, run_timeout_s=100.0)
    assert cfg.ranks == 10_240
    rep = run_emulation(cfg)
    assert rep.violations() == []
    # Every replica (the restarted ones too) ends having committed every step.
    assert rep.final_steps == {str(i): 30 for i in range(32)}
    assert sorted(rep.commits) == list(range(30))
    # Every rank of every replica replayed every decision (and agreed: no violation).
    assert rep.rank_replays >= 2 * 30 * cfg.ranks
    # The faults really happened and were handled the way the real system handles them.
    ev = "\n".join(rep.events)
    assert "replica 2: restarted" in ev and "replica 2: caught up" in ev
    assert "replica 7: restarted" in ev and "replica 7: caught up" in ev
    assert "replica 1: caught up" in ev  # its local vote failed while the others committed step 8
    assert "lighthouse declared ['3'] dead" in ev and "replica 3: caught up" in ev
    assert rep.lighthouse_starts == 2
    assert any(r.outage_s > 0 for r in rep.quorum_records), "no replica rode out the lighthouse outage"
    assert rep.fabric_failed > 0
    # Quorum ids kept rising across the lighthouse restart (it rebuilt them from the replicas' reports).
    qids = rep.qids_seen["0"]
    assert qids == sorted(qids) and qids[-1] > qids[0]
    # A replica out of the quorum trained no batch; the others' batches are each trained once.
    assert all(len(c.batches) == len(c.healthy) for c in rep.commits.values())
    assert min(len(c.healthy) for c in rep.commits.values()) < 32


def test_paced_beats_ride_out_a_short_hang_and_still_find_a_long_one_and_a_kill():
    """A lighthouse whose beat budget (80 beats/s) is below what 32 replicas beating every 0.1 s
    send (320): it asks for one beat every 0.4 s and widens its window to 3.2 s (8 beats). A
    1.6 s hang, which the configured 0.8 s window would call a death, is ridden out; a 4.5 s hang
    and a kill are still found and the replicas caught up; every invariant holds (no rank waits
    past its deadline: the 10 s all-reduce deadline is above the widened window)."""
    faults = (Fault("kill", step=3, replica=2, seconds=0.5),
              Fault("hang", step=6, replica=3, seconds=1.6),
              Fault("hang", step=10, replica=5, seconds=4.5))
    # 0.1 s steps, 30 after the long hang: the job is still training when replica 5 wakes
    cfg = EmulationConfig(replicas=32, ranks_per_replica=32, steps=40, model=ModelShape(params=10**8, step_s=0.1),
                          faults=faults, run_timeout_s=120.0, lighthouse_beats_per_s=80.0)
    rep = run_emulation(cfg)
    assert rep.violations() == []
    assert rep.final_steps == {str(i): 40 for i in range(32)}
    assert any("asked to beat every 0.4 s" in x and "now takes 3.2 s" in x for x in rep.lighthouse_log["paced"]), \
        rep.lighthouse_log
    ev = "\n".join(rep.events)
    assert "replica 2: restarted" in ev and "replica 2: caught up" in ev
    assert "lighthouse declared ['5'] dead" in ev and "replica 5: caught up" in ev
    assert "['3'] dead" not in ev and "replica 3: caught up" not in ev, ev[-3000:]


def test_a_lighthouse_killed_while_answering_costs_its_outage_not_an_all_reduce_deadline():
    """The lighthouse is SIGKILLed the moment replica 0 holds its answer for step 4, while it
    is still writing the others': the members that got one enter step 4's all-reduce, the rest
    ask the restarted lighthouse, which waits for the first ones (members of the newest quorum).
    Found here: those waited in an all-reduce that could not finish until its deadline (6 s at
    64 replicas: a stall of the whole job). Their heartbeats now hear who asks, and they abort it."""
    deadline = 10.0
    cfg = EmulationConfig(replicas=256, ranks_per_replica=2, steps=7, model=ModelShape(params=10**8, step_s=0.05),
                          faults=(Fault("lighthouse_answering", step=4, seconds=0.5),), run_timeout_s=100.0,
                          timeouts=dataclasses.replace(EmulationConfig(1, 1, 1).timeouts, allreduce_timeout_s=deadline))
    rep = run_emulation(cfg)
    assert rep.violations() == []
    assert rep.final_steps == {str(i): 7 for i in range(256)} and sorted(rep.commits) == list(range(7))
    ev = "\n".join(rep.events)
    assert "lighthouse SIGKILLed while answering step 4" in ev and rep.lighthouse_starts == 2
    # Some answers were never written (256 of them take the lighthouse milliseconds), and the
    # members holding one aborted step 4's all-reduce on hearing who asks, not at its deadline.
    assert "ask for a new quorum" in ev, ev[-2000:]
    assert "deadline" not in ev, ev[-2000:]
    waited = max(w for what, w, _ in rep.waits if "all-reduce" in what)
    assert waited < deadline / 2, waited
    assert all(len(c.batches) == len(c.healthy) for c in rep.commits.values())


def test_replicas_of_several_processes_speak_the_real_protocol():
    """Replicas of 3 processes (protocol version 2): every process heartbeats and registers
    its own shards; the leader asks, the followers fetch their own views of each new
    quorum id (their shards' rings, checked against the leader's decision); through a
    kill and a lighthouse restart (which forgets the registrations: they are sent again)."""
    faults = (Fault("kill", step=3, replica=1, seconds=0.5), Fault("lighthouse", step=6, seconds=0.5))
    cfg = EmulationConfig(replicas=4, ranks_per_replica=6, steps=9, processes_per_replica=3,
                          model=ModelShape(params=10**6, step_s=0.02), faults=faults, run_timeout_s=60.0)
    rep = run_emulation(cfg)
    assert rep.violations() == []
    assert rep.final_steps == {str(i): 9 for i in range(4)}
    assert rep.lighthouse_starts == 2 and "replica 1: caught up" in "\n".join(rep.events)
    qids = {r.quorum_id for r in rep.quorum_records}
    assert len(qids) >= 2 and rep.views_fetched >= 2 * 4 * 2  # 2 followers x 4 replicas x >= 2 quorum ids
    # A leader's answer lists its own 2 shards' rings (2 x 4 endpoints), not all 6 x 4.
    assert 0 < rep.answer_bytes < 1000


def _report(commits: dict[int, CommitRecord], **kw) -> EmulationReport:
    cfg = EmulationConfig(replicas=2, ranks_per_replica=1, steps=len(commits))
    base = dict(config=cfg, wall_s=0.0, quorum_records=[], commits=commits,
                committers={s: set(c.healthy) for s, c in commits.items()}, final_steps={}, qids_seen={},
                waits=[], events=[], problems=[], lighthouse_starts=1, rank_replays=0, fabric_completed=0,
                fabric_failed=0, decode=(0, 0), unfinished=[])
    base.update(kw)
    return EmulationReport(**base)


def test_the_invariant_checks_can_fail():
    ok = {0: CommitRecord(0, 1, ("0", "1"), ("0", "1"), (("0", 0), ("1", 0))),
          1: CommitRecord(1, 1, ("0", "1"), ("0", "1"), (("0", 1), ("1", 1)))}
    assert _report(ok).violations() == []
    dup = dict(ok)
    dup[1] = CommitRecord(1, 1, ("0", "1"), ("0", "1"), (("0", 0), ("1", 1)))
    assert any("exactly once" in v for v in _report(dup).violations())
    gap = dict(ok)
    gap[1] = CommitRecord(1, 1, ("0", "1"), ("0", "1"), (("0", 2), ("1", 1)))
    assert any("exactly once" in v for v in _report(gap).violations())
    assert any("backwards" in v for v in _report(ok, qids_seen={"0": [1, 3, 2]}).violations())
    assert any("past its deadline" in v for v in _report(ok, waits=[("x", 20.0, 10.0)]).violations())
    ran_out = _report(ok, waits=[("replica 3 all-reduce", 10.0, 10.0), ("replica 4 all-reduce", 0.2, 10.0),
                                 ("replica 5 get_quorum", 10.0, 10.0)]).violations()
    assert ran_out == ["1 all-reduce(s) ran to their deadline instead of being aborted when a member could not "
                       "join (replicas ['replica 3'])"]
    assert any("non-members" in v for v in _report(ok, committers={0: {"0", "5"}, 1: {"0"}}).violations())
    assert _report(ok, problems=["rank 3 disagrees"]).violations() == ["rank 3 disagrees"]


def test_rank_groups_replay_once_per_distinct_state_and_catch_a_diverged_rank():
    """A process's ranks replay the leader's decisions once per distinct state (exact: the
    step machine is pure) and each rank takes its own result: one rank whose state diverged
    is replayed on its own and counted, the others keep sharing the leader's state object."""
    from fthsdp.control import quorum as qm
    from fthsdp.replica import fsm
    from fthsdp.sim.emulation import RankGroup

    q = qm.Quorum(quorum_id=4, members=(qm.Member("0", 2), qm.Member("1", 2)), max_step=2,
                  healthy=("0", "1"), behind=(), num_healthy=2)
    state = fsm.initial(2, 3)
    g = RankGroup(first=8, size=5, state=state)
    g.quorum = q
    leader = fsm.plan(state, q, "0")
    assert g.disagree(state) == 0 and g.plan("0", leader) == 0
    new = fsm.after_attempt(state, leader, fsm.Outcome.COMMITTED)
    assert g.after(fsm.Outcome.COMMITTED, True, new) == 0
    assert all(s is new for s in g.states) and new.step == 3
    g.states[3] = dataclasses.replace(new, step=1)  # one rank's state diverged (a bug the check must see)
    assert g.disagree(new) == 1
    assert g.plan("0", fsm.plan(new, dataclasses.replace(q, max_step=3), "0")) == 5  # all differ: q is at step 2
    g.quorum = dataclasses.replace(q, max_step=3)
    leader = fsm.plan(new, g.quorum, "0")
    assert g.plan("0", leader) == 1  # the diverged rank plans to give up; the other 4 train
    after = fsm.after_attempt(new, leader, fsm.Outcome.COMMITTED)
    assert g.after(fsm.Outcome.COMMITTED, True, after) == 1
    assert sum(s is after for s in g.states) == 4 and g.states[3].action is fsm.Action.GIVE_UP


def test_fabric_rendezvous_completes_fails_on_kill_and_on_deadline():
    async def main():
        fab = MockFabric(FabricConfig(latency_s=1e-3, bandwidth_Bps=1e9))
        a = asyncio.create_task(fab.allreduce(1, 0, "0", ("0", "1"), 1000, 2, 5.0))
        b = asyncio.create_task(fab.allreduce(1, 0, "1", ("0", "1"), 1000, 2, 5.0))
        ra, rb = await a, await b
        assert ra.ok and rb.ok and ra.waited_s >= fab.config.allreduce_s(1000, 2) * 0.9
        # A member killed mid-wait fails the others at once, not at their deadline.
        c = asyncio.create_task(fab.allreduce(2, 1, "0", ("0", "1"), 1000, 2, 30.0))
        await asyncio.sleep(0.01)
        fab.kill("1")
        rc = await c
        assert not rc.ok and "killed" in rc.reason and rc.waited_s < 5
        # Restarted: the rings of the quorums it was in still find its old process gone ...
        fab.revive("1", after_quorum=2)
        assert "refused" in (await fab.allreduce(2, 2, "0", ("0", "1"), 1000, 2, 5.0)).reason
        # ... and a member of a later quorum that never comes: the deadline.
        rd = await fab.allreduce(3, 2, "0", ("0", "1"), 1000, 2, 0.2)
        assert not rd.ok and "deadline" in rd.reason
        # An injected ring fault fires once, for every member.
        fab.inject_ring_fault(3, 1)
        e0 = asyncio.create_task(fab.allreduce(4, 3, "0", ("0", "1"), 10, 2, 5.0))
        e1 = asyncio.create_task(fab.allreduce(4, 3, "1", ("0", "1"), 10, 2, 5.0))
        assert (await e0).failed_rings == (await e1).failed_rings == frozenset({1})
        f0 = asyncio.create_task(fab.allreduce(5, 3, "0", ("0", "1"), 10, 2, 5.0))
        f1 = asyncio.create_task(fab.allreduce(5, 3, "1", ("0", "1"), 10, 2, 5.0))
        assert not (await f0).failed_rings and not (await f1).failed_rings
        # Handshake with different members is refused.
        g = asyncio.create_task(fab.allreduce(6, 4, "0", ("0", "1"), 10, 2, 1.0))
        await asyncio.sleep(0)
        assert "differ" in (await fab.allreduce(6, 4, "1", ("1", "2"), 10, 2, 1.0)).reason
        fab.abort(6, "test over")
        assert not (await g).ok

    asyncio.run(main())


def test_mock_timings_and_config_errors():
    f = FabricConfig(latency_s=0.0, bandwidth_Bps=1e9)
    assert f.allreduce_s(10**9, 1) == 0.0
    assert f.allreduce_s(10**9, 2) == pytest.approx(1.0)
    assert f.allreduce_s(10**9, 4) == pytest.approx(1.5)
    assert ModelShape(params=100, grad_bytes_per_param=2).shard_bytes(4) == 50
    with pytest.raises(ValueError, match="kind"):
        Fault("explode", 1)
    with pytest.raises(ValueError, match="replica 5"):
        EmulationConfig(replicas=2, ranks_per_replica=1, steps=3, faults=(Fault("kill", 1, replica=5),))
    with pytest.raises(ValueError, match=">= 1"):
        EmulationConfig(replicas=0, ranks_per_replica=1, steps=3)
    with pytest.raises(ValueError, match="divide"):
        EmulationConfig(replicas=2, ranks_per_replica=5, steps=3, processes_per_replica=2)
    with pytest.raises(ValueError, match="heartbeats"):
        EmulationConfig(replicas=2, ranks_per_replica=4, steps=3, processes_per_replica=2, heartbeats=False)
    with pytest.raises(ValueError, match="bandwidth"):
        FabricConfig(bandwidth_Bps=0)
    with pytest.raises(ValueError, match="holds no fthsdp package"):
        EmulationConfig(replicas=2, ranks_per_replica=1, steps=3, lighthouse_from=os.path.dirname(__file__))
    with pytest.raises(ValueError):
        dataclasses.replace(EmulationConfig(replicas=1, ranks_per_replica=1, steps=1),
                            timeouts=dataclasses.replace(EmulationConfig.timeouts, detect_s=0.01))


def test_data_state_is_shared_and_a_replica_left_behind_still_shows():
    """The replicated data state is computed once per (state, quorum) and shared by the
    replicas that commit it; a replica that committed from an older state still trains
    different batches, which the exactly-once check sees."""
    from fthsdp.control import quorum as qm
    from fthsdp.sim.emulation import DataState

    def quorum(qid: int) -> qm.Quorum:
        return qm.Quorum(quorum_id=qid, members=(qm.Member("0", 0), qm.Member("1", 0)), max_step=0,
                         healthy=("0", "1"), behind=())

    q1, q2 = quorum(1), quorum(2)
    s0 = DataState()
    b1, s1 = s0.commit(q1)
    assert s0.commit(q1) == (b1, s1) and s0.commit(q1)[1] is s1  # shared, not recomputed
    assert b1 == (("0", 0), ("1", 0)) and s0.positions == {}  # the old state is untouched
    b2, _ = s1.commit(q2)
    assert b2 == (("0", 1), ("1", 1))
    stale, _ = s0.commit(q2)  # a replica that missed step 0's commit
    commits = {0: CommitRecord(0, 1, ("0", "1"), ("0", "1"), b1), 1: CommitRecord(1, 2, ("0", "1"), ("0", "1"), stale)}
    assert any("exactly once" in v for v in _report(commits).violations())


def test_every_replica_killed_its_rejoiners_ask_again_then_give_up_rather_than_redo_the_job():
    """Both replicas of a job killed in the same step: restarted to rejoin, holding no state, they
    meet in a quorum at step 0 of only rejoiners (Member.rejoining). As the real Manager
    (fsm.rejoin_at_step_0) they ask again for Timeouts.alone_rejoin_s and then give up job-fatal;
    they never train the job from its start again (before, the emulated ones did: its first
    batches trained twice)."""
    t = Timeouts(detect_s=0.4, join_timeout_s=0.2, allreduce_timeout_s=2.0, catch_up_timeout_s=5.0,
                 quorum_timeout_s=20.0, lighthouse_outage_s=10.0)
    cfg = EmulationConfig(replicas=2, ranks_per_replica=2, steps=30, model=ModelShape(params=10**6, step_s=0.05),
                          timeouts=t, faults=(Fault("kill", step=4, replica=0, seconds=0.3),
                                              Fault("kill", step=4, replica=1, seconds=0.3)), run_timeout_s=60.0)
    rep = run_emulation(cfg)
    gave_up = [v for v in rep.violations() if "job-fatal: restarted to rejoin" in v]
    assert len(gave_up) == 2 and all("has been running for 4.0 s" in v for v in gave_up), rep.violations()
    assert not [v for v in rep.violations() if "exactly once" in v or "job-fatal" not in v and "still" not in v], \
        rep.violations()
    ev = "\n".join(rep.events)
    assert "at step 0 (it holds only replicas restarted to rejoin" in ev or "(it is alone): asks again" in ev, ev
    assert rep.final_steps == {"0": 0, "1": 0}, rep.final_steps  # no second run of the job from step 0
