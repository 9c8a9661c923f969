"""Root-cause analysis over plain data (fthsdp/observe/root_cause.py): one case per
verdict kind, cycles, ties and bad thresholds, without servers."""

import pytest

from fthsdp.observe import root_cause as rc
from fthsdp.observe.root_cause import JobSnapshot, ProcessReport as R, StreamRate, Thresholds

MEMBERS = ("0", "1", "2")


def snap(*reports, members=MEMBERS, detect_s=0.8):
    return JobSnapshot(tuple(reports), members, detect_s, step=7)


def test_healthy_job_is_no_stall():
    v = rc.analyse(snap(R("0", 0.05, "computing", 7, 0.01, compute_s=0.05),
                        R("1", 0.02, "allreduce", 7, 0.01, waiting_on="0", waiting_s=0.003, compute_s=0.05),
                        R("2", 0.08, "idle", 7, 0.0, compute_s=0.06)))
    assert v.kind == rc.NONE and v.culprit == "" and v.confidence == 1.0
    assert "no stall" in v.describe()


def test_a_healthy_ring_in_progress_is_not_a_cycle():
    # every rank waits a few ms on its left neighbour: the normal state of a ring
    reports = [R(m, 0.05, "allreduce", 7, 0.02, waiting_on=MEMBERS[i - 1], waiting_s=0.004, compute_s=0.05)
               for i, m in enumerate(MEMBERS)]
    assert rc.analyse(snap(*reports)).kind == rc.NONE


def test_frozen_replica_is_the_root_of_the_ring_waits():
    v = rc.analyse(snap(
        R("0", 0.05, "allreduce", 7, 0.5, waiting_on="2", waiting_s=0.45, ring_step=1, ring_steps=4),
        R("1", 0.55, "computing", 7, 0.1),  # SIGSTOPped: its last report is stale
        R("2", 0.03, "allreduce", 7, 0.5, waiting_on="1", waiting_s=0.5, ring_step=0, ring_steps=4)))
    assert (v.kind, v.culprit) == (rc.FROZEN, "1")
    assert v.chain == ("0", "2", "1")  # the longest wait chain into the culprit
    assert "no heartbeat for 0.55s" in v.evidence and "2 process(es) wait on it (0, 2)" in v.evidence
    assert "2 waits in FTAR at ring step 1/4 for data from 1" in v.evidence


def test_dead_replica_past_the_window_with_survivors_asking():
    v = rc.analyse(snap(
        R("0", 0.05, "waiting-for-quorum", 7, 0.3, asking=True),
        R("1", 1.2, "allreduce", 7, 0.3, declared_dead=True),
        R("2", 0.05, "waiting-for-quorum", 7, 0.3, asking=True)))
    assert (v.kind, v.culprit, v.confidence) == (rc.DEAD, "1", 1.0)
    assert "detection window 0.80s" in v.evidence and "asks for a quorum that waits for member 1" in v.evidence


def test_wait_chain_through_a_quorum_request():
    # 2 waits in FTAR on 0, which already asks for the next quorum, which waits for 1 (frozen)
    members = ("0", "1", "2", "3")
    v = rc.analyse(snap(R("0", 0.05, "waiting-for-quorum", 8, 0.5, asking=True),
                        R("1", 0.6, "computing", 7, 0.1),
                        R("2", 0.05, "allreduce", 7, 0.5, waiting_on="0", waiting_s=0.5),
                        R("3", 0.05, "waiting-for-quorum", 8, 0.2, asking=True), members=members))
    assert (v.kind, v.culprit, v.chain) == (rc.FROZEN, "1", ("2", "0", "1"))
    assert "3 process(es) wait on it (0, 2, 3)" in v.evidence
    assert "0 asks for a quorum that waits for member 1" in v.evidence


def test_a_replica_of_several_processes_names_its_silent_process():
    v = rc.analyse(snap(R("0", 0.05, "allreduce", 7, 0.5, waiting_on="2", waiting_s=0.5),
                        R("1", 0.5, "allreduce", 7, 0.5, silent_processes=(1,)),  # its leader beats on
                        R("2", 0.05, "allreduce", 7, 0.5, waiting_on="1", waiting_s=0.5)))
    assert (v.kind, v.culprit) == (rc.FROZEN, "1") and "no heartbeat for 0.50s from its process(es) 1" in v.evidence


def test_silent_member_nobody_waits_on_yet_is_still_named():
    v = rc.analyse(snap(R("0", 0.05, "computing", 7, 0.05), R("1", 0.9, "computing", 7, 0.05),
                        R("2", 0.05, "computing", 7, 0.05)))
    assert (v.kind, v.culprit) == (rc.DEAD, "1") and "nobody reports waiting on it yet" in v.evidence
    assert v.confidence < 1.0


def test_slow_replica_computing_while_the_others_wait():
    v = rc.analyse(snap(
        R("0", 0.05, "allreduce", 7, 0.8, waiting_on="2", waiting_s=0.8, compute_s=0.05),
        R("1", 0.05, "computing", 7, 0.9, compute_s=0.95),
        R("2", 0.05, "allreduce", 7, 0.85, waiting_on="1", waiting_s=0.85, compute_s=0.06)))
    assert (v.kind, v.culprit) == (rc.SLOW, "1")
    assert "has been computing for 0.90s" in v.evidence and "median compute is 0.06s" in v.evidence


def test_slow_replica_seen_between_steps_by_its_last_compute():
    v = rc.analyse(snap(R("0", 0.05, "idle", 7, 0.0, compute_s=0.05),
                        R("1", 0.05, "allreduce", 7, 0.01, waiting_on="0", waiting_s=0.01, compute_s=0.7),
                        R("2", 0.05, "idle", 7, 0.0, compute_s=0.04)))
    assert (v.kind, v.culprit) == (rc.SLOW, "1") and "forward+backward takes 0.70s" in v.evidence


def test_busy_but_not_slow_is_not_blamed():
    v = rc.analyse(snap(
        R("0", 0.05, "allreduce", 7, 0.15, waiting_on="1", waiting_s=0.15, compute_s=0.1),
        R("1", 0.05, "computing", 7, 0.15, compute_s=0.1),
        R("2", 0.05, "idle", 7, 0.0, compute_s=0.1)))
    assert v.kind == rc.NONE


def test_throttled_stream_is_a_slow_link_naming_sender_and_receiver():
    # the ring waits on itself (a cycle): the stream rates break it
    reports = [R(m, 0.05, "allreduce", 7, 0.5, waiting_on=MEMBERS[i - 1], waiting_s=0.3, compute_s=0.05,
                 streams=(StreamRate(MEMBERS[(i + 1) % 3], rate, busy),))
               for i, (m, rate, busy) in enumerate(zip(MEMBERS, (9e8, 2e5, 7e8), (0.01, 0.7, 0.01)))]
    v = rc.analyse(snap(*reports))
    assert (v.kind, v.culprit, v.peer) == (rc.SLOW_LINK, "1", "2")
    assert "1 -> 2 carries 200.0 kB/s while busy, and is busy 70% of the time" in v.evidence
    assert v.describe().startswith("SLOW_LINK 1 -> 2")


def test_members_all_asking_for_a_quorum_wait_for_the_decision_not_in_a_cycle():
    reports = [R(m, 0.05, "waiting-for-quorum", 7, 2.0, asking=True) for m in MEMBERS]
    v = rc.analyse(snap(*reports))
    assert v.kind == rc.NONE, v.describe()
    assert "wait for the lighthouse's decision" in v.evidence and "0, 1, 2" in v.evidence


def test_a_slow_but_mostly_idle_stream_is_noise_not_a_slow_link():
    # one unlucky chunk on a loaded host: slow per busy second, but busy 1% of the time
    reports = [R(m, 0.05, "idle", 7, 0.0, streams=(StreamRate(MEMBERS[(i + 1) % 3], rate, 0.01),))
               for i, (m, rate) in enumerate(zip(MEMBERS, (4.6e8, 7.7e7, 4.6e8)))]
    assert rc.analyse(snap(*reports)).kind == rc.NONE


def test_even_streams_are_not_a_slow_link():
    reports = [R(m, 0.05, "idle", 7, 0.0, streams=(StreamRate(MEMBERS[(i + 1) % 3], rate),))
               for i, (m, rate) in enumerate(zip(MEMBERS, (9e8, 4e8, 7e8)))]
    assert rc.analyse(snap(*reports)).kind == rc.NONE


def test_a_stuck_cycle_with_nothing_to_blame_is_unknown():
    reports = [R(m, 0.05, "allreduce", 7, 2.0, waiting_on=MEMBERS[i - 1], waiting_s=2.0)
               for i, m in enumerate(MEMBERS)]
    v = rc.analyse(snap(*reports))
    assert v.kind == rc.UNKNOWN and "cycle" in v.evidence and v.confidence < 0.5


def test_tie_between_two_frozen_roots_is_deterministic_and_less_confident():
    members = ("0", "1", "2", "3")
    reports = (R("0", 0.05, "allreduce", 7, 0.6, waiting_on="3", waiting_s=0.6),
               R("1", 0.6, "computing", 7, 0.1),
               R("2", 0.05, "allreduce", 7, 0.6, waiting_on="1", waiting_s=0.6),
               R("3", 0.6, "computing", 7, 0.1))
    v = rc.analyse(snap(*reports, members=members))
    assert (v.kind, v.culprit) == (rc.FROZEN, "1") and v.confidence == 0.5
    assert "also silent and waited on: 3" in v.evidence
    # the longer silence wins a tie in waiters
    reports = reports[:3] + (R("3", 0.7, "computing", 7, 0.1),)
    assert rc.analyse(snap(*reports, members=members)).culprit == "3"


def test_more_waiters_beats_longer_silence():
    members = ("0", "1", "2", "3")
    v = rc.analyse(snap(R("0", 0.05, "allreduce", 7, 0.6, waiting_on="3", waiting_s=0.6),
                        R("1", 0.7, "computing", 7, 0.1),
                        R("2", 0.05, "allreduce", 7, 0.6, waiting_on="0", waiting_s=0.6),
                        R("3", 0.5, "computing", 7, 0.1), members=members))
    assert v.culprit == "3" and v.chain == ("2", "0", "3") and "2 process(es) wait on it (0, 2)" in v.evidence


def test_dead_beats_slow_and_reports_without_phase():
    # a lighthouse with replicas that send no phase reports still names the dead one
    v = rc.analyse(snap(R("0", 0.05, asking=True), R("1", 2.0, declared_dead=True), R("2", 0.05, asking=True)))
    assert (v.kind, v.culprit) == (rc.DEAD, "1")


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="frozen_after_s=0 must be > 0"):
        Thresholds(frozen_after_s=0)
    with pytest.raises(ValueError, match="must be > 1"):
        Thresholds(link_factor=1.0)


# -- the phase report a process sends (fthsdp/observe/phase.py), over plain data --

from fthsdp.observe.phase import Phase, PhaseTracker  # noqa: E402


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def progress_of(**kw):
    p = {"in_op": True, "rank": 1, "n": 3, "ring_step": 2, "ring_steps": 4, "since_recv_s": 0.7,
         "bytes_sent": [0, 0], "send_busy_s": [0.0, 0.0], "bytes_received": [100, 20]}
    p.update(kw)
    return p


def test_phase_tracker_reports_phase_time_and_who_it_waits_on():
    clock, shards = Clock(), [progress_of()]
    t = PhaseTracker(progress=lambda: shards, clock=clock)
    t.set(Phase.WAITING_FOR_QUORUM, 4)
    clock.t += 0.3
    r = t.report("1")
    assert (r.phase, r.step, r.in_phase_s, r.waiting_on) == (Phase.WAITING_FOR_QUORUM, 4, pytest.approx(0.3), "")
    t.set(Phase.ALLREDUCE, quorum_id=9, members=("0", "1", "2"))
    clock.t += 0.5
    r = t.report("1")
    assert (r.step, r.quorum_id, r.in_phase_s) == (4, 9, pytest.approx(0.5))
    assert (r.waiting_on, r.waiting_s, r.ring_step, r.ring_steps, r.bytes_moved) == ("0", 0.7, 2, 4, 120)
    shards[0] = progress_of(in_op=False)
    assert t.report("1").waiting_on == ""  # the op finished: waiting on nobody


def test_phase_tracker_stream_rate_windows():
    clock = Clock()
    shards = [progress_of(bytes_sent=[0, 0], send_busy_s=[0.0, 0.0])]
    t = PhaseTracker(progress=lambda: shards, clock=clock)
    t.set(Phase.IDLE, 0, quorum_id=1, members=("0", "1", "2"))
    assert t.report("1").streams == ()  # the window starts
    clock.t += 0.5
    shards[0] = progress_of(bytes_sent=[1000, 1000], send_busy_s=[0.2, 0.2])
    (s,) = t.report("1").streams  # young window, none finished yet: the current one
    assert (s.to_replica, s.bytes_per_s, s.bytes, s.busy_fraction) == ("2", 5000.0, 2000, pytest.approx(0.4))
    t.set(Phase.IDLE, quorum_id=2, members=("1", "2"))  # a new ring: rates start over
    assert t.report("1").streams == ()


# -- what the dashboard gets of a verdict (lighthouse_view over a Status answer) --


def test_dashboard_view_carries_the_verdict_and_each_replicas_phase():
    from fthsdp.observe.lighthouse_view import History, view_from_proto
    from fthsdp.proto import lighthouse

    pb2, _ = lighthouse()
    resp = pb2.StatusResponse(detect_s=0.8, jobs=[pb2.JobStatus(
        job_id="j", replicas=[
            pb2.ReplicaStatus(replica_id="0", step=5, last_heartbeat_age_s=0.05, phase=pb2.PhaseReport(
                phase=pb2.PHASE_ALLREDUCE, in_phase_s=0.6, waiting_on="1")),
            pb2.ReplicaStatus(replica_id="1", step=5, last_heartbeat_age_s=0.9, dead=True)],
        root_cause=pb2.RootCause(kind="none", evidence="fine"),
        last_stall=pb2.RootCause(kind="dead", culprit="1", evidence="no heartbeat for 0.90s", confidence=1.0,
                                 step=5, age_s=3.0, process=1))])
    view = view_from_proto(resp, 1000.0)
    job = view.job("j")
    assert job.root_cause.kind == "none" and (job.last_stall.kind, job.last_stall.culprit) == ("dead", "1")
    h = History()
    h.update(view)
    data = h.job_json(job)
    assert data["last_stall"]["culprit"] == "1" and data["last_stall"]["evidence"].startswith("no heartbeat")
    assert data["last_stall"]["process"] == 1  # the dashboard shows "replica 1 process 1"
    rows = {r["replica_id"]: r for r in data["replicas"]}
    assert (rows["0"]["phase"], rows["0"]["waiting_on"]) == ("allreduce", "1") and rows["1"]["phase"] == ""
    # an older lighthouse without these fields still gives a view
    old = view_from_proto(pb2.StatusResponse(jobs=[pb2.JobStatus(job_id="j")]), 0.0).job("j")
    assert old.root_cause is None and old.last_stall is None


def test_phase_tracker_compute_time_is_a_median_so_one_hiccup_is_not_slow():
    t = PhaseTracker()
    for s in (0.05, 0.05, 0.4, 0.05):  # one 0.4 s hiccup of a loaded host
        t.computed(s)
    assert t.report("0").compute_s == 0.05
    for s in (0.6, 0.6, 0.6):  # slow for good (train.min_step_s)
        t.computed(s)
    assert t.report("0").compute_s == 0.6


def test_a_replica_named_like_the_virtual_quorum_node_is_ignored_not_fatal():
    v = rc.analyse(snap(R("0", 0.05, "waiting-for-quorum", 7, 0.5, asking=True), R(rc.QUORUM, 0.05, "computing"),
                        R("1", 0.9, "computing", 7, 0.1), members=("0", "1", rc.QUORUM)))
    assert (v.kind, v.culprit) == (rc.DEAD, "1")


# -- replicas of several processes (merge_processes) -------------------------------------------


def test_a_followers_ftar_wait_is_its_replicas_edge_and_names_the_busy_process():
    # replica 1: its leader is idle, its follower waits in its own ring on replica 2, whose
    # follower computes far longer than its leader
    one = rc.merge_processes([R("1", 0.05, "idle", 7, 0.4, process=0),
                              R("1", 0.05, "allreduce", 7, 0.9, waiting_on="2", waiting_s=0.9, process=1)])
    two = rc.merge_processes([R("2", 0.05, "computing", 7, 0.3, compute_s=0.05, process=0),
                              R("2", 0.05, "computing", 7, 1.9, compute_s=0.06, process=1)])
    assert (one.waiting_on, one.process) == ("2", 1) and (two.process, two.compute_s) == (1, 0.06)
    v = rc.analyse(snap(R("0", 0.05, "idle", 7, 0.1, compute_s=0.05), one, two))
    assert (v.kind, v.culprit, v.process, v.chain) == (rc.SLOW, "2", 1, ("1", "2"))
    assert "replica 2 process 1 has been computing" in v.evidence and "replica 2 process 1" in v.describe()


def test_processes_a_little_apart_do_not_flap_the_verdict():
    """Two processes of one replica in the same phase report a little apart: the lower one is
    kept unless another is PROCESS_MARGIN_S longer, so the verdict does not alternate."""
    for lead, follow in ((1.00, 1.05), (1.05, 1.00)):
        m = rc.merge_processes([R("2", 0.05, "computing", 7, lead, process=0),
                                R("2", 0.05, "computing", 7, follow, process=1)])
        assert m.process == 0


def test_a_frozen_follower_under_a_live_leader_is_named_by_process():
    one = rc.merge_processes([R("1", 0.6, "idle", 7, 0.1, silent_processes=(1,), process=0),
                              R("1", 0.6, "allreduce", 7, 0.5, waiting_on="2", waiting_s=0.5, process=1)])
    v = rc.analyse(snap(R("0", 0.05, "allreduce", 7, 0.5, waiting_on="1", waiting_s=0.5), one,
                        R("2", 0.05, "idle", 7, 0.5)))
    assert (v.kind, v.culprit, v.process) == (rc.FROZEN, "1", 1)


def test_a_followers_slow_stream_names_its_process():
    fast = [StreamRate("0", 50e6, 0.5)]
    one = rc.merge_processes([R("1", 0.05, "idle", 7, 0.1, streams=(StreamRate("2", 50e6, 0.5),), process=0),
                              R("1", 0.05, "idle", 7, 0.1, streams=(StreamRate("2", 1e6, 0.9),), process=1)])
    v = rc.analyse(snap(R("0", 0.05, "idle", 7, 0.1, streams=(StreamRate("1", 50e6, 0.5),)), one,
                        R("2", 0.05, "idle", 7, 0.1, streams=tuple(fast))))
    assert (v.kind, v.culprit, v.peer, v.process) == (rc.SLOW_LINK, "1", "2", 1)
    assert "1 (process 1) -> 2" in v.evidence


def test_merge_of_no_reports_is_refused():
    with pytest.raises(ValueError, match="no reports"):
        rc.merge_processes([])


def test_verdict_metrics_keep_one_series_per_job_and_count_changes():
    from fthsdp.observe.verdict_metrics import RootCauseMetrics

    m = RootCauseMetrics()
    get = m.registry.get_sample_value
    assert m.observe("j", rc.Verdict(rc.NONE, confidence=1.0))
    assert get("fthsdp_root_cause_info", {"job": "j", "kind": "none", "replica": "", "process": "", "peer": ""}) == 1
    assert not m.observe("j", rc.Verdict(rc.NONE, confidence=1.0))  # the same verdict: nothing changes
    assert m.observe("j", rc.Verdict(rc.FROZEN, "1", confidence=0.9, process=1))
    assert get("fthsdp_root_cause_info", {"job": "j", "kind": "none", "replica": "", "process": "", "peer": ""}) is None
    assert get("fthsdp_root_cause_info", {"job": "j", "kind": "frozen", "replica": "1", "process": "1", "peer": ""}) == 1
    assert get("fthsdp_root_cause_confidence", {"job": "j"}) == 0.9
    m.observe("j", rc.Verdict(rc.SLOW_LINK, "1", "2", confidence=0.7, process=0))
    assert get("fthsdp_root_cause_info", {"job": "j", "kind": "slow_link", "replica": "1", "process": "0",
                                          "peer": "2"}) == 1
    m.observe("j", rc.Verdict(rc.FROZEN, "1", confidence=0.9, process=1))
    assert get("fthsdp_root_cause_changes_total", {"job": "j", "kind": "frozen"}) == 2
    assert get("fthsdp_root_cause_changes_total", {"job": "j", "kind": "none"}) == 1
    m.forget("j")
    assert get("fthsdp_root_cause_info", {"job": "j", "kind": "frozen", "replica": "1", "process": "1", "peer": ""}) is None
    assert get("fthsdp_root_cause_changes_total", {"job": "j", "kind": "frozen"}) is None
