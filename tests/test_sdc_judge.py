"""The lighthouse's silent-data-corruption verdicts (fthsdp/control/sdc.py), over plain data."""

import pytest

from fthsdp.control import sdc
from fthsdp.control import quorum as qm


def test_agreement_and_a_single_report():
    assert sdc.judge(5, {"0": 7, "1": 7, "2": 7}, {"0", "1", "2"}).kind == sdc.AGREE
    assert sdc.judge(5, {"0": 7}, {"0", "1", "2"}).kind == sdc.AGREE  # nothing to compare yet


def test_majority_names_the_replica_that_disagrees():
    v = sdc.judge(9, {"0": 7, "1": 8, "2": 7}, {"0", "1", "2"})
    assert v.kind == sdc.MISMATCH and v.culprits == ("1",) and v.majority == 7
    assert "replica(s) 1 disagree" in v.reason and "after step 9" in v.reason
    v = sdc.judge(9, {"0": 1, "1": 1, "2": 1, "3": 2, "4": 3}, [])
    assert v.kind == sdc.MISMATCH and v.culprits == ("3", "4")


def test_two_replicas_that_differ_stop_the_job():
    v = sdc.judge(4, {"0": 0xAB, "1": 0xCD}, {"0", "1"})
    assert v.kind == sdc.NO_MAJORITY and v.fatal
    assert "00000000000000ab" in v.reason and "00000000000000cd" in v.reason and "rather than guess" in v.reason


def test_ties_and_three_way_splits_have_no_majority():
    assert sdc.judge(3, {"0": 1, "1": 1, "2": 2, "3": 2}, {"0", "1", "2", "3"}).kind == sdc.NO_MAJORITY
    assert sdc.judge(3, {"0": 1, "1": 2, "2": 3}, {"0", "1", "2"}).kind == sdc.NO_MAJORITY


def test_late_reports_pending_then_settled():
    # 0 and 1 differ; 2 has not reported: it could still make a majority either way
    v = sdc.judge(6, {"0": 1, "1": 2}, {"0", "1", "2"})
    assert v.kind == sdc.PENDING and "waiting for 2" in v.reason
    assert sdc.judge(6, {"0": 1, "1": 2, "2": 1}, {"0", "1", "2"}).culprits == ("1",)
    # with 5 voters, 3 reporting 1 already convict the other one without waiting
    v = sdc.judge(6, {"0": 1, "1": 1, "2": 1, "3": 9}, {"0", "1", "2", "3", "4"})
    assert v.kind == sdc.MISMATCH and v.culprits == ("3",)


def test_tracker_condemns_then_clears_after_a_matching_later_state():
    t = sdc.SdcTracker()
    t.set_voters(10, ["0", "1", "2"])
    for r, f in (("0", 5), ("1", 6), ("2", 5)):
        t.record(r, 10, f)
    new = t.update({"0", "1", "2"})
    assert [v.kind for v in new] == [sdc.MISMATCH] and set(t.condemned) == {"1"}
    assert t.update({"0", "1", "2"}) == []  # reported once
    # it catches up (still condemned while it reports the bad state of step 10) ...
    t.record("1", 10, 6)
    t.update({"0", "1", "2"})
    assert set(t.condemned) == {"1"}
    # ... and its state after the next step matches the others: clean again
    t.set_voters(11, ["0", "1", "2"])
    for r in ("0", "1", "2"):
        t.record(r, 11, 42)
    t.update({"0", "1", "2"})
    assert t.condemned == {}
    # a late report of step 10 does not condemn it again: it holds a later, good state
    t.record("3", 10, 5)
    t.update({"0", "1", "2", "3"})
    assert t.condemned == {}
    assert len(t.events) == 1 and t.fatal is None


def test_tracker_pending_until_the_missing_voter_reports_or_dies():
    t = sdc.SdcTracker()
    t.set_voters(3, ["0", "1", "2"])
    t.record("0", 3, 1)
    t.record("1", 3, 2)
    assert t.update({"0", "1", "2"}) == [] and t.pending(3) is not None
    # the missing voter died: two replicas that differ, nobody to settle it
    new = t.update({"0", "1"})
    assert [v.kind for v in new] == [sdc.NO_MAJORITY] and t.fatal is new[0] and t.pending(3) is None
    t.reset()
    assert t.fatal is None and t.events == [] and t.reports == {}


def test_tracker_replica_that_skipped_steps_and_old_reports():
    t = sdc.SdcTracker(keep=4)
    for step in range(10):
        t.set_voters(step, ["0", "1"])
        t.record("0", step, step)
        if step % 3 == 0:  # replica 1 reports only some steps (it was behind or restarting)
            t.record("1", step, step)
        assert t.update({"0", "1"}) == []
    assert sorted(t.reports) == [6, 7, 8, 9]
    t.record("1", 2, 999)  # far too old to compare: ignored
    assert t.update({"0", "1"}) == [] and 2 not in t.reports
    assert t.latest["1"] == (9, 9)
    with pytest.raises(ValueError):
        t.record("0", -1, 0)


def test_quorum_puts_a_condemned_replica_behind_with_sources_from_the_majority():
    reqs = {r: qm.QuorumRequest(r, 12, 0.0, (f"h:{r}",), f"s{r}", 1) for r in ("0", "1", "2")}
    hb = {r: 0.0 for r in reqs}
    q, why = qm.decide_quorum(reqs, hb, None, qm.QuorumConfig(num_configured=3), 0.0, condemned={"1"})
    assert q.healthy == ("0", "2") and q.behind == ("1",) and q.max_step == 12
    assert q.sources_for("1") == ("0",) and "condemned" in why
    # nobody clean at the top step: no quorum, and the reason says why
    q, why = qm.decide_quorum({"1": reqs["1"]}, {"1": 0.0}, None, qm.QuorumConfig(), 0.0, condemned={"1"})
    assert q is None and "condemned" in why


def test_status_view_metrics_and_text_show_a_mismatch():
    from fthsdp.control.lighthouse import _sdc_event
    from fthsdp.control.lighthouse_client import JobStatus, ReplicaStatus, format_status
    from fthsdp.observe.lighthouse_view import view_from_proto
    from fthsdp.observe.metrics import LighthouseMetrics
    from fthsdp.proto import lighthouse as stubs

    pb2, _ = stubs()
    v = sdc.judge(9, {"0": 7, "1": 8, "2": 7}, {"0", "1", "2"})
    resp = pb2.StatusResponse(jobs=[pb2.JobStatus(
        job_id="j", sdc_events=[_sdc_event(v)],
        replicas=[pb2.ReplicaStatus(replica_id="1", step=9, fingerprint=8, fingerprint_step=9, condemned=v.reason,
                                    metrics_addresses=["127.0.0.1:9100", "127.0.0.1:9101"])])])
    view = view_from_proto(resp, 0.0)
    (r,) = view.jobs[0].replicas
    assert r.condemned == v.reason and r.fingerprint == "0000000000000008@9"
    assert r.metrics_addresses == ("127.0.0.1:9100", "127.0.0.1:9101") and r.metrics_address == "127.0.0.1:9100"
    (e,) = view.jobs[0].sdc_events
    assert e.culprits == ("1",) and e.step == 9 and not e.fatal
    m = LighthouseMetrics()
    m.update(view_from_proto(pb2.StatusResponse(jobs=[pb2.JobStatus(job_id="j")]), 0.0))  # before the mismatch
    m.update(view)
    m.update(view)  # the same event seen twice counts once
    assert m.registry.get_sample_value("fthsdp_lighthouse_sdc_mismatches_total",
                                       {"job": "j", "replica": "1", "fatal": "false"}) == 1.0
    late = LighthouseMetrics()  # started (or restarted) after it: not counted again
    late.update(view)
    late.update(view)
    assert late.registry.get_sample_value("fthsdp_lighthouse_sdc_mismatches_total",
                                          {"job": "j", "replica": "1", "fatal": "false"}) is None
    text = format_status([JobStatus("j", (ReplicaStatus("1", 9, 0.1, False, False, fingerprint=8, fingerprint_step=9,
                                                        condemned=v.reason),), None, "", 1, 3,
                                    sdc_events=tuple(resp.jobs[0].sdc_events))])
    assert "CONDEMNED" in text and "fingerprint 0000000000000008@9" in text and "SDC: silent data corruption" in text


@pytest.mark.parametrize("fakes", [2, 3])
def test_only_the_members_of_the_quorum_that_ran_a_step_vote_on_it(fakes):
    """Replica ids that were never in the step's quorum (registered with the job's key, beating a
    made-up fingerprint) neither tie the two members (2 fakes: no majority, the job stopped) nor
    outvote them (3 fakes: the members condemned). A member declared dead since keeps its report."""
    t = sdc.SdcTracker()
    t.set_voters(7, ["0", "1"])
    t.record("0", 7, 5)
    t.record("1", 7, 5)
    for i in range(fakes):
        t.record(f"fake{i}", 7, 6)
    alive = {"0", "1"} | {f"fake{i}" for i in range(fakes)}
    assert t.update(alive) == [] and t.condemned == {} and t.fatal is None
    assert t.verdicts[7].kind == sdc.AGREE and [r for r, _ in t.verdicts[7].reports] == ["0", "1"]
    # a dead member's report still counts toward the majority: replica 2 is out-voted by 0 and the dead 1
    t.set_voters(8, ["0", "1", "2"])
    for r, f in (("0", 1), ("1", 1), ("2", 2)):
        t.record(r, 8, f)
    new = t.update({"0", "2"})
    assert [(v.kind, v.culprits) for v in new] == [(sdc.MISMATCH, ("2",))]
    # where the step's quorum is not known (a lighthouse restarted since), every report votes
    t.record("0", 9, 3)
    t.record("9", 9, 4)
    assert t.update({"0", "9"})[0].kind == sdc.NO_MAJORITY
