"""The lighthouse's checks of id lists (fthsdp.control.guard): one C-level pass while every
id is good, the same answer as checking each id when one is not."""

from __future__ import annotations

from fthsdp.control import guard


def test_a_list_of_ids_is_checked_like_each_id():
    good = [str(i) for i in range(5000)]
    assert guard._texts_problem("a last_members id", good, 128) is None
    assert guard._texts_problem("a last_members id", [], 128) is None
    for bad, word in (("m\n", "control character"), ("a b", "space"), ("x\u00a0y", "space"), ("z\x7f", "control"),
                      ("q" * 129, "129 characters long")):
        ids = good[:100] + [bad] + good[100:]
        err = guard._texts_problem("a last_members id", ids, 128, " (replica '3')")
        assert err == guard._text_problem("a last_members id", bad, 128, " (replica '3')")
        assert err is not None and word in err and "(replica '3')" in err
    # The separator joining the ids is no character of an id: "/" is allowed in ids.
    assert guard._texts_problem("id", ["a/b", "c"], 128) is None


def test_only_the_first_members_list_the_last_quorum():
    """Each quorum request listed every member of the last quorum: O(N) bytes per request,
    O(N^2) per round. Only the first LAST_MEMBERS_SENDERS members in ring order do now."""
    from fthsdp.control import quorum as qm

    q = qm.Quorum(quorum_id=4, members=tuple(qm.Member(str(i), 9) for i in (0, 2, 5, 10, 11)), max_step=9,
                  healthy=("0", "2", "5", "10", "11"), behind=())
    assert [r for r in ("0", "2", "5", "10", "11") if qm.sends_last_members(q, r)] == ["0", "2", "5"]
    assert qm.LAST_MEMBERS_SENDERS == 3 and not qm.sends_last_members(q, "7")


def test_a_heartbeats_phase_numbers_must_be_finite():
    """A phase report is kept as sent and shown by `fthsdp status` and the dashboard, whose JSON has
    no NaN: one NaN from any process failed every /api/status answer for every job."""
    import math

    from fthsdp.observe.dashboard import _finite
    from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION, lighthouse

    pb2, _ = lighthouse()

    def beat(**phase):
        return pb2.HeartbeatRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="j", replica_id="0",
                                    phase=pb2.PhaseReport(**phase))

    ok = beat(in_phase_s=1.5, waiting_s=0.0, compute_s=-1.0, last_step_s=-1.0)  # -1: not known yet
    assert guard.request_problem("Heartbeat", ok, guard.Limits()) is None
    for bad in (dict(in_phase_s=math.nan), dict(compute_s=math.inf), dict(last_step_s=-math.inf),
                dict(streams=[pb2.StreamRate(to_replica="1", bytes_per_s=math.nan)])):
        err = guard.request_problem("Heartbeat", beat(**bad), guard.Limits())
        assert err is not None and "NaN or infinite" in err, (bad, err)
    # and the dashboard's JSON turns any that still come (an older lighthouse) into null
    assert _finite({"a": [1.0, math.nan, {"b": -math.inf}], "c": "x", "d": 2}) == {"a": [1.0, None, {"b": None}],
                                                                                 "c": "x", "d": 2}
