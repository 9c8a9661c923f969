"""The emulation's checks can fail: each test injects one defect the check is there to see (an
answer the real client would call fatal, a loader that retrains a batch, a job redone from its
start, a fault that never fired) and shows that the report names it. Small runs (3 replicas,
a few 50 ms steps) against the real lighthouse process."""

from __future__ import annotations

import dataclasses
import types

import grpc
import pytest

from fthsdp.control.lighthouse_client import LighthouseClient
from fthsdp.errors import FaultClass, classify
from fthsdp.replica import fsm
from fthsdp.sim import emulation
from fthsdp.control.lighthouse_client import lighthouse_error
from fthsdp.sim.aio_client import AioLighthouseClient
from fthsdp.sim.emulation import DataState, EmulationConfig, Fault, run_emulation
from fthsdp.sim.mock_plane import ModelShape

_DETAILS = {grpc.StatusCode.PERMISSION_DENIED: "replica id held by another live process",
            grpc.StatusCode.UNAUTHENTICATED: "the credential does not verify"}


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_the_real_client_raises_the_shared_mapping(code):
    """The real client's errors are lighthouse_error's, which the emulated client raises too: the
    class is what classify() and so the replica's fate follow."""
    details = _DETAILS.get(code, "injected")
    e = types.SimpleNamespace(code=lambda: code, details=lambda: details)
    real_self = types.SimpleNamespace(address="a:1", job_id="j", replica_id="0", _call_key=None, _status_key=None)
    real = LighthouseClient._error(real_self, "get_quorum", e, 1.0)
    mine = lighthouse_error("get_quorum", "a:1", code, details)
    assert type(mine) is type(real) and mine.code == code
    assert classify(mine).kind is classify(real).kind


def test_fatal_lighthouse_errors_are_classified_as_the_manager_does():
    kinds = {c: classify(lighthouse_error("x", "a:1", c, _DETAILS.get(c, "d"))).kind for c in grpc.StatusCode}
    assert kinds[grpc.StatusCode.INVALID_ARGUMENT] is FaultClass.JOB_FATAL
    assert kinds[grpc.StatusCode.DATA_LOSS] is FaultClass.JOB_FATAL
    assert kinds[grpc.StatusCode.UNAUTHENTICATED] is FaultClass.JOB_FATAL  # a credential refused for good
    assert kinds[grpc.StatusCode.DEADLINE_EXCEEDED] is FaultClass.REPLICA_FATAL
    assert kinds[grpc.StatusCode.INTERNAL] is FaultClass.RECOVERABLE
    assert emulation.retry_pause_s(3) == pytest.approx(0.3) and emulation.retry_pause_s(50) == 1.0


def _cfg(steps: int = 6, faults: tuple[Fault, ...] = (), **kw) -> EmulationConfig:
    return EmulationConfig(replicas=3, ranks_per_replica=2, steps=steps, model=ModelShape(params=10**6, step_s=0.05),
                           faults=faults, run_timeout_s=60.0, **kw)


def _fail_once(monkeypatch, code: grpc.StatusCode, rid: str = "1", step: int = 2) -> list[int]:
    """Replica ``rid``'s first quorum request at ``step`` is answered with ``code``."""
    orig = AioLighthouseClient._send
    fired: list[int] = []

    async def send(self, method, req, timeout_s, name):
        if name == "GetQuorum" and self.replica_id == rid and self.step == step and not fired:
            fired.append(step)
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="injected")
        return await orig(self, method, req, timeout_s, name)

    monkeypatch.setattr(AioLighthouseClient, "_send", send)
    return fired


def test_a_job_fatal_answer_stops_the_job(monkeypatch):
    """DATA_LOSS (the lighthouse stopped the job: silent data corruption) is job-fatal for the
    real replica; the emulated one used to retry it as a transient error and train on."""
    fired = _fail_once(monkeypatch, grpc.StatusCode.DATA_LOSS)
    cfg = _cfg(steps=30)
    rep = run_emulation(cfg)
    assert fired == [2]
    v = rep.violations()
    assert any("job-fatal" in x and "SilentDataCorruption" in x for x in v), v
    assert "replica 1: job-fatal error: the job stops" in rep.events
    assert max(rep.final_steps.values()) < cfg.steps and rep.final_steps["1"] == 2, rep.final_steps
    assert "replica 1: restarted" not in "\n".join(rep.events)


def test_a_quorum_timeout_is_replica_fatal_and_the_replica_rejoins(monkeypatch):
    """A QuorumTimeout ends the real replica process (replica-fatal): restarted, it rejoins."""
    fired = _fail_once(monkeypatch, grpc.StatusCode.DEADLINE_EXCEEDED)
    cfg = _cfg()
    rep = run_emulation(cfg)
    assert fired == [2]
    v = rep.violations()
    assert [x for x in v if "replica-fatal" in x and "QuorumTimeout" in x] == v and len(v) == 1, v
    ev = "\n".join(rep.events)
    assert "replica 1: restarted" in ev and "replica 1: caught up" in ev, ev
    assert rep.final_steps == {str(i): cfg.steps for i in range(3)}


def test_a_batch_the_data_state_hands_out_twice_is_caught_by_the_loader(monkeypatch):
    """A data state that does not advance replica 1's position after step 2 (so step 3 trains
    its batch 2 again) disagrees with replica 1's own loader, which is at 3."""
    orig = DataState.commit
    done: list[int] = []

    def skipping(self, q):
        batches, new = orig(self, q)
        if new.step == 2 and not done:
            done.append(1)
            new.positions["1"] -= 1
        return batches, new

    monkeypatch.setattr(DataState, "commit", skipping)
    rep = run_emulation(_cfg())
    assert done
    v = rep.violations()
    assert any("replica 1.0: trained stream position 2 at step 3, but its loader is at 3" in x for x in v), v


def test_a_job_redone_from_its_start_is_a_violation(monkeypatch):
    """Every replica killed at step 3; restarted to rejoin, they would (were fsm.rejoin_at_step_0
    wrong) train the job again from step 0. The lineage they finish with then checks out on its
    own (each batch once, no step gap), so only comparing it with the abandoned one shows it."""
    monkeypatch.setattr(fsm, "rejoin_at_step_0", lambda *a, **k: ("train", "injected: trusts itself"))
    faults = tuple(Fault("kill", step=3, replica=i, seconds=0.3) for i in range(3))
    cfg = _cfg(faults=faults)
    rep = run_emulation(cfg)
    assert rep.final_steps == {str(i): cfg.steps for i in range(3)}, rep.violations()
    assert rep.superseded >= 3
    v = rep.violations()
    assert any("redone from scratch" in x for x in v), v


def test_redone_from_scratch_and_commit_problems_directly():
    """The pure checks on their own: each says nothing on a sound input and names each defect."""
    rec = emulation.CommitRecord
    first = rec(0, 5, ("0",), ("0",), (("0", 0),), at=10.0)
    assert emulation.redone_from_scratch(first, [rec(0, 1, ("0",), ("0",), (("0", 0),), at=1.0)]) == ""
    assert emulation.redone_from_scratch(first, [rec(2, 1, ("0",), ("0",), (("0", 2),), at=11.0)]) == ""
    assert "step 2" in emulation.redone_from_scratch(first, [rec(2, 1, ("0",), ("0",), (("0", 2),), at=3.0)])
    from fthsdp.control import quorum as qm

    q = qm.Quorum(quorum_id=4, members=(qm.Member("0", 2), qm.Member("1", 1)), max_step=2,
                  healthy=("0",), behind=("1",), num_healthy=1)
    train = fsm.plan(fsm.initial(2, 3), q, "0")
    assert train.action is fsm.Action.TRAIN
    catch = dataclasses.replace(train, action=fsm.Action.CATCH_UP, compute=False, rank=1)
    assert emulation.commit_problems("0", train, q, 7, 1, 7, True) == []
    assert emulation.commit_problems("1", catch, q, 7, 1, None, False) == []
    assert "loader is at 8" in emulation.commit_problems("0", train, q, 8, 1, 7, True)[0]
    assert "last step is 2" in emulation.commit_problems("0", train, q, 7, 2, 7, True)[0]
    assert "while catching up" in emulation.commit_problems("1", catch, q, 7, 1, 3, False)[0]
    assert "does not name it" in emulation.commit_problems("9", train, q, 7, 1, 7, True)[0]
    assert "calls it behind" in emulation.commit_problems("1", train, q, 7, 1, 7, True)[0]


def test_a_fault_that_never_fires_is_reported_and_a_late_one_fires_at_the_next_step():
    """A kill at a step past the run's end cannot fire: a problem, not a run that silently tests
    less than it says. A ring or rank fault at a step whose all-reduce never finished (aborted,
    say) fires at the next one instead of waiting forever for its exact step."""
    import asyncio

    from fthsdp.sim.mock_plane import MockFabric

    async def fabric() -> None:
        fab = MockFabric()
        fab.inject_ring_fault(2, 1)
        fab.inject_rank_fault(2, "0", 3)
        assert fab.pending_faults() == {("ring", 2, "", 1), ("rank", 2, "0", 3)}
        assert fab.rank_faults_of(1, "0") == set() and fab.rank_faults_of(4, "0") == {3}
        assert (await fab.allreduce(1, 1, "0", ("0",), 10, 1, 5.0)).failed_rings == frozenset()
        assert (await fab.allreduce(2, 4, "0", ("0",), 10, 1, 5.0)).failed_rings == frozenset({1})
        assert fab.pending_faults() == set()

    asyncio.run(fabric())
    rep = run_emulation(_cfg(steps=4, faults=(Fault("kill", step=9, replica=1),)))
    v = rep.violations()
    assert len(v) == 1 and "never fired" in v[0] and "kind='kill', step=9" in v[0], v
    assert rep.final_steps == {str(i): 4 for i in range(3)}


def test_a_follower_process_plans_on_its_own_view(monkeypatch):
    """Replicas of 2 processes; replica 1 is killed and catches up. Its follower process's view
    is made to lose its recovery sources: planning on it (as the real follower does), its ranks
    give up where the leader's catch up, which the replay check reports. (Before, every rank
    planned on the leader's answer and the follower's view was checked and dropped.)"""
    orig = AioLighthouseClient.get_view
    stripped: list[int] = []

    async def get_view(self, quorum_id, *, timeout_s):
        reply = await orig(self, quorum_id, timeout_s=timeout_s)
        if self.replica_id == "1" and reply.quorum.recovery and not stripped:
            stripped.append(quorum_id)
            reply = dataclasses.replace(reply, quorum=dataclasses.replace(reply.quorum, recovery={}, sources=()))
        return reply

    monkeypatch.setattr(AioLighthouseClient, "get_view", get_view)
    cfg = EmulationConfig(replicas=3, ranks_per_replica=4, steps=6, processes_per_replica=2,
                          model=ModelShape(params=10**6, step_s=0.05), run_timeout_s=60.0,
                          faults=(Fault("kill", step=2, replica=1, seconds=0.3),))
    rep = run_emulation(cfg)
    assert stripped
    v = rep.violations()
    assert any("replica 1.1: 2 rank(s) planned differently from the leader" in x for x in v), v


def test_an_abort_slower_than_detection_is_a_violation_well_before_the_deadline(monkeypatch):
    """Replica 2 hangs; the survivors' aborts on hearing it dead are held back 2.5 s (a survivor
    slow to act on its heartbeat's news). Their all-reduce still fails long before its 10 s
    deadline, which was all the check looked at; the detection bound (window + a beat + its RPC,
    1.3 s here) sees it."""
    import asyncio

    from fthsdp.sim.mock_plane import MockFabric

    orig = MockFabric.abort

    def slow_abort(self, quorum_id, reason):
        if "lighthouse declared" in reason:
            asyncio.get_running_loop().call_later(2.5, orig, self, quorum_id, reason)
            return 1
        return orig(self, quorum_id, reason)

    monkeypatch.setattr(MockFabric, "abort", slow_abort)
    rep = run_emulation(_cfg(faults=(Fault("hang", step=2, replica=2, seconds=3.5),)))
    v = rep.violations(deadline_slack_s=0.5)
    assert any("abort on a death waited" in x for x in v), v
    assert not any("ran to their deadline" in x for x in v), v
    t = EmulationConfig(1, 1, 1).timeouts
    assert emulation.detection_bound_s(t, 0.0) == pytest.approx(t.detect_s + t.heartbeat_interval_s + 0.4)
    assert emulation.detection_bound_s(t, 0.4) == pytest.approx(8 * 0.4 + 0.4 + 0.4)  # a paced, widened window
    assert emulation.DECLARED_DEAD == "lighthouse declared"


def test_a_request_asked_again_keeps_its_rounds_clock(monkeypatch):
    """Replica 1's first request at step 2 fails with a transient error: it pauses (the Manager's
    min(1, 0.1 x failing)), asks again, within the same attempt. The round's latency and its
    get_quorum wait run from the first ask: the failure and the pause count, instead of the round
    looking as fast as the re-sent request."""
    fired = _fail_once(monkeypatch, grpc.StatusCode.INTERNAL)
    rep = run_emulation(_cfg())
    assert fired == [2] and rep.violations() == []
    (r,) = [r for r in rep.quorum_records if r.replica_id == "1" and r.step == 2]
    assert r.attempt == 1 and r.received - r.last_rank_request >= 0.1, r
    (rnd,) = [x for x in rep.rounds() if (x["step"], x["attempt"]) == (2, 1)]
    assert rnd["latency_s"] >= 0.1 and rnd["replicas"] == 3
    assert emulation.quorum_wait_deadline(EmulationConfig(1, 1, 1).timeouts, 0.5) == 60.0 + 30.0
