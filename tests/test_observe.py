"""Observability plane (issue 16): the pure parts (history of lighthouse views,
metrics fed by step records and views, scrape targets) without servers, then
the exporter, the dashboard server and its CLI against a real in-process
lighthouse with real heartbeating clients on loopback."""

import json
import pathlib
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from fthsdp.replica.manager import StepRecord
from fthsdp.observe import dashboard as dash_mod
from fthsdp.observe.lighthouse_view import (
    BEHIND,
    DEAD,
    HEALTHY,
    OUTSIDE,
    WAITING,
    History,
    JobView,
    LighthouseUnreachable,
    LighthouseView,
    QuorumView,
    ReplicaView,
    StatusPoller,
    changes,
    view_from_proto,
)
from fthsdp.observe.metrics import (
    LighthouseMetrics,
    MetricsFileFollower,
    ReplicaMetrics,
    parse_bind,
    prometheus_targets,
    ring_bus_bytes,
    scrape_config,
    serve,
    status_targets,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


# -- views by hand ------------------------------------------------------------------


def rv(rid, step=0, age=0.05, dead=False, waiting=False):
    return ReplicaView(str(rid), step, age, dead, waiting)


def qv(qid, members, behind=(), step=0, reason="r"):
    members = tuple(str(m) for m in members)
    behind = tuple(str(b) for b in behind)
    return QuorumView(qid, members, tuple(m for m in members if m not in behind), behind, step, reason)


def view(t, replicas, quorum, job="j", reason="why"):
    return LighthouseView(t, (JobView(job, tuple(replicas), quorum, reason, 3, 1),), 0.8, 1)


def kill_and_rejoin_views():
    """Replica 1 dies in quorum 1, quorum 2 forms without it, it restarts and rejoins behind in quorum 3."""
    return [
        view(0.0, [rv(0, 5), rv(1, 5), rv(2, 5)], qv(1, [0, 1, 2], step=5)),
        view(1.0, [rv(0, 6), rv(1, 6, age=0.9, dead=True), rv(2, 6)], qv(1, [0, 1, 2], step=6)),
        view(2.0, [rv(0, 8), rv(1, 6, age=1.9, dead=True), rv(2, 8)], qv(2, [0, 2], step=8)),
        view(3.0, [rv(0, 10), rv(1, 0, age=0.1), rv(2, 10)], qv(2, [0, 2], step=10)),
        view(4.0, [rv(0, 12), rv(1, 0, age=0.1, waiting=True), rv(2, 12)], qv(2, [0, 2], step=12)),
        view(5.0, [rv(0, 13), rv(1, 0), rv(2, 13)], qv(3, [0, 1, 2], behind=[1], step=13)),
        view(6.0, [rv(0, 14), rv(1, 14), rv(2, 14)], qv(3, [0, 1, 2], step=14)),
    ]


def test_history_records_a_death_its_detection_time_and_the_rejoin():
    h = History()
    found = [h.update(v) for v in kill_and_rejoin_views()]
    assert [len(f) for f in found] == [0, 1, 0, 0, 0, 0, 0]  # one loss, reported once
    (f,) = h.jobs["j"].failures
    assert (f.job, f.replica, f.kind, f.quorum_id, f.silence_s) == ("j", "1", "dead", 1, 0.9)
    assert f.back_time == 5.0 and f.back_after_s == 4.0  # back when a quorum (3) includes it again
    assert f.stall_s == 1.0  # last step before the loss (lost at 0.1) seen at 0.0; a step seen with the loss at 1.0
    assert h.jobs["j"].decisions == 3  # quorums 1, 2, 3
    states = [s.states["1"] for s in h.jobs["j"].samples]
    assert states == [HEALTHY, DEAD, DEAD, OUTSIDE, WAITING, BEHIND, HEALTHY]


def test_history_a_live_replica_dropped_from_the_quorum_is_a_failure_once():
    h = History()
    h.update(view(0.0, [rv(0), rv(1)], qv(1, [0, 1])))
    (f,) = h.update(view(1.0, [rv(0), rv(1)], qv(2, [0])))
    assert (f.replica, f.kind, f.silence_s) == ("1", "left quorum", None)
    assert h.update(view(2.0, [rv(0), rv(1, age=2.0, dead=True)], qv(2, [0]))) == []  # the same loss, now dead
    assert f.kind == "dead" and f.silence_s == 2.0
    h.update(view(3.0, [rv(0), rv(1)], qv(3, [0, 1])))
    assert f.back_after_s == 2.0


def test_history_counts_a_replica_that_left_the_job_and_not_a_lighthouse_restart():
    """A replica that fails with a fault it classified leaves (Leave) and the lighthouse forgets it:
    gone from the view, it was never counted. A restarted lighthouse lists the replicas before its
    first quorum: that window counted every member as lost. A finished job's leavers are no loss,
    and the first poll only seeds the history (a dashboard started late reports no old losses)."""
    import dataclasses

    h = History()
    assert h.update(view(0.0, [rv(0), rv(1), rv(2, age=50.0, dead=True)], qv(1, [0, 1]))) == []  # seeded
    (f,) = h.update(view(1.0, [rv(0)], qv(1, [0, 1])))  # replica 1 left (and was forgotten)
    assert (f.replica, f.kind, f.quorum_id) == ("1", "left job", 1)
    assert h.update(view(2.0, [rv(0)], qv(2, [0]))) == []  # the same loss, once
    h.update(view(3.0, [rv(0), rv(1)], qv(3, [0, 1])))
    assert f.back_time == 3.0
    # the lighthouse restarts: replicas listed, no quorum yet, then the same members again
    assert h.update(view(4.0, [rv(0), rv(1)], None)) == []
    assert h.update(view(5.0, [rv(0), rv(1)], qv(4, [0, 1]))) == []
    # the job finishes: its replicas leave one by one, no failure
    done = view(6.0, [rv(0)], qv(4, [0, 1]))
    done = dataclasses.replace(done, jobs=(dataclasses.replace(done.jobs[0], finished_step=40),))
    assert h.update(done) == []


def test_history_counts_each_death_of_a_crash_looping_replica():
    """A replica that restarts and dies again before it rejoins is a new failure each time:
    counted once, a crash loop never reached the failures alert."""
    h = History()
    h.update(view(0.0, [rv(0), rv(1)], qv(1, [0, 1])))
    deaths = []
    for t in range(1, 7):  # dead, restarted (alive, outside the quorum), dead, ...
        dead = t % 2 == 1
        deaths += h.update(view(float(t), [rv(0), rv(1, age=1.0 if dead else 0.1, dead=dead)], qv(2, [0])))
    assert [f.kind for f in deaths] == ["dead"] * 3
    assert [f.ended for f in h.jobs["j"].failures] == [True, True, False]
    h.update(view(7.0, [rv(0), rv(1)], qv(3, [0, 1])))  # back at last: only the open one closes
    assert [f.back_time for f in h.jobs["j"].failures] == [None, None, 7.0]


def test_a_lighthouse_restart_before_its_replicas_are_back_is_no_left_job():
    """A restarted lighthouse lists a job as its first replica comes back, before any quorum:
    the members not back yet have not left the job."""
    h = History()
    h.update(view(0.0, [rv(0), rv(1), rv(2), rv(3)], qv(5, [0, 1, 2, 3])))
    assert h.update(view(1.0, [rv(0)], None)) == []  # restarted: one replica back, no quorum yet
    assert h.update(view(2.0, [rv(0), rv(1), rv(2)], None)) == []
    (f,) = h.update(view(3.0, [rv(0), rv(1), rv(2)], qv(6, [0, 1, 2])))  # decided without 3: it left
    assert (f.replica, f.kind, f.quorum_id) == ("3", "left job", 5)


def test_a_replica_found_dead_after_it_left_the_quorum_has_its_detection_time_observed():
    from fthsdp.observe.metrics import LighthouseMetrics

    m = LighthouseMetrics()
    m.update(view(0.0, [rv(0), rv(1)], qv(1, [0, 1])))
    m.update(view(1.0, [rv(0), rv(1)], qv(2, [0])))  # left the quorum alive
    m.update(view(2.0, [rv(0), rv(1, age=1.5, dead=True)], qv(2, [0])))  # then found dead
    assert m.registry.get_sample_value("fthsdp_lighthouse_detection_seconds_sum", {"job": "j"}) == 1.5
    assert m.registry.get_sample_value("fthsdp_lighthouse_failures_total", {"job": "j", "kind": "left quorum"}) == 1


def test_history_measures_the_survivors_stall_from_the_job_steps():
    h = History()
    steps = [(0.0, 9, False), (0.5, 10, False), (1.0, 10, True), (2.0, 10, True), (3.0, 10, True), (4.0, 11, True)]
    for t, step, dead in steps:
        h.update(view(t, [rv(0, step), rv(1, step, age=0.9 if dead else 0.05, dead=dead)],
                      qv(1 if t < 3 else 2, [0, 1] if t < 3 else [0], step=step)))
        if t < 4.0:
            assert all(f.stall_s is None for f in h.jobs["j"].failures)  # still stalled
    (f,) = h.jobs["j"].failures
    # lost when last heard (1.0 - 0.9); the job last stepped before that at 0.0, next at 4.0
    assert f.lost_at == pytest.approx(0.1) and f.progress_before == 0.0 and f.stall_s == 4.0


def test_history_keeps_jobs_apart_and_estimates_step_time():
    h = History()
    for t in range(5):
        h.update(LighthouseView(float(t), (
            JobView("a", (rv(0, step=10 * t),), qv(1, [0]), "", 1, 1),
            JobView("b", (rv(0, step=t, dead=t >= 3),), qv(1, [0]), "", 1, 1)), 0.8, 1))
    assert h.step_seconds("a", "0") == pytest.approx(0.1)
    assert h.step_seconds("b", "0") == pytest.approx(1.0)
    assert [f.job for f in h.jobs["b"].failures] == ["b"] and not h.jobs["a"].failures
    h.update(LighthouseView(5.0, (JobView("a", (rv(0, step=1),), qv(1, [0]), "", 1, 1),), 0.8, 1))
    assert h.step_seconds("a", "0") is None  # restarted from an earlier step: estimate starts over
    h2 = History()
    for v in kill_and_rejoin_views():  # replica 1 jumps from step 0 to 14 by catching up: not a step time
        h2.update(v)
    assert h2.step_seconds("j", "1") is None
    assert h2.step_seconds("j", "0") == pytest.approx(6.0 / 9)  # 5 -> 14 healthy over 6 s


def test_history_and_exporter_forget_old_jobs_and_replicas():
    """A dashboard or exporter that runs for months keeps a bounded history: a job the lighthouse
    stopped listing an hour ago goes (with its counters), at most MAX_JOBS are kept, and a replica
    the lighthouse forgot leaves its step-time window."""
    m = LighthouseMetrics()
    h = m.history
    m.update(LighthouseView(0.0, (JobView("old", (rv(0, 1), rv(1, 1)), qv(1, [0, 1]), "", 2, 1),), 0.8, 1))
    m.update(LighthouseView(1.0, (JobView("old", (rv(0, 2),), qv(2, [0]), "", 2, 1),), 0.8, 1))  # 1 left the job
    assert set(h.jobs["old"].steps) == {"0"}
    value = m.registry.get_sample_value
    assert value("fthsdp_lighthouse_failures_total", {"job": "old", "kind": "left job"}) == 1.0
    m.update(LighthouseView(1000.0, (JobView("new", (rv(0, 1),), qv(1, [0]), "", 1, 1),), 0.8, 1))
    assert set(h.jobs) == {"old", "new"} and h.forgotten == []  # unlisted for 999 s: its failures stay
    m.update(LighthouseView(1.0 + h.FORGET_AFTER_S + 1, (JobView("new", (rv(0, 2),), qv(1, [0]), "", 1, 1),), 0.8, 1))
    assert set(h.jobs) == {"new"} and h.forgotten == ["old"]
    assert value("fthsdp_lighthouse_failures_total", {"job": "old", "kind": "left job"}) is None
    assert value("fthsdp_lighthouse_quorum_decisions_total", {"job": "old"}) is None
    assert value("fthsdp_lighthouse_quorum_decisions_total", {"job": "new"}) == 1.0
    small = History()
    small.MAX_JOBS = 3
    for t in range(6):
        small.update(LighthouseView(float(t), (JobView(f"j{t}", (rv(0),), qv(1, [0]), "", 1, 1),), 0.8, 1))
    assert sorted(small.jobs) == ["j2", "j3", "j4", "j5"]  # the listed one and 3 no longer listed
    many = tuple(JobView(f"k{i}", (rv(0),), qv(1, [0]), "", 1, 1) for i in range(5))  # more listed than kept
    for t in (10.0, 11.0):
        small.update(LighthouseView(t, many, 0.8, 1))
        assert {f"k{i}" for i in range(5)} <= set(small.jobs)  # every listed job kept
        assert small.forgotten == (["j2"] if t == 10.0 else [])  # of the unlisted, the oldest past 3


def test_timeline_json_is_the_changes_and_the_last_sample():
    h = History()
    for v in kill_and_rejoin_views():
        h.update(v)
    for t in (7.0, 8.0):  # nothing changes after 6.0
        h.update(view(t, [rv(0, 15), rv(1, 15), rv(2, 15)], qv(3, [0, 1, 2], step=15)))
    kept = changes(h.jobs["j"].samples)
    assert [s.time for s in kept] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0]  # 7.0 dropped, the last one kept
    job = h.job_json(kill_and_rejoin_views()[-1].jobs[0])
    assert [r["state"] for r in job["replicas"]] == [HEALTHY] * 3
    assert job["failures"][0]["replica"] == "1" and job["timeline"][-1]["t"] == 8.0
    json.dumps(job, allow_nan=False)


# -- metrics ------------------------------------------------------------------------


def rec(step, members=("0", "1", "2"), healthy=True, attempts=1, loss=2.5, seconds=0.5, grads=0.2, allreduce=0.1,
        rebuild=0.0, catch_up=0.0, qid=1):
    return StepRecord(step, qid, tuple(members), healthy, True, attempts, loss if healthy else None, 100.0,
                      100.0 + seconds, step if healthy else None, [], rebuild_s=rebuild, allreduce_s=allreduce,
                      grads_s=grads, catch_up_s=catch_up)


def value(registry, name, **labels):
    v = registry.get_sample_value(name, labels)
    return v


def test_replica_metrics_from_step_records():
    m = ReplicaMetrics("job1", "2", grad_bytes=3_000_000)
    lab = {"job": "job1", "replica": "2", "process": "0"}
    m.observe_step(rec(0, rebuild=0.05))
    m.observe_step(rec(1, attempts=3, seconds=4.0, grads=0.2, allreduce=0.3, members=("0", "2"), qid=2, loss=2.0))
    m.observe_step(rec(2, healthy=False, catch_up=1.5, members=("0", "1", "2"), qid=3))
    r = m.registry
    assert value(r, "fthsdp_commits_total", **lab) == 3
    assert value(r, "fthsdp_retries_total", **lab) == 2
    assert value(r, "fthsdp_catch_ups_total", **lab) == 1
    assert value(r, "fthsdp_step", **lab) == 3
    assert value(r, "fthsdp_quorum_size", **lab) == 3 and value(r, "fthsdp_quorum_id", **lab) == 3
    assert value(r, "fthsdp_loss", **lab) == 2.0  # the catch-up step has no loss: the last healthy one stays
    assert value(r, "fthsdp_healthy", **lab) == 0
    assert value(r, "fthsdp_step_seconds_count", **lab) == 3
    assert value(r, "fthsdp_step_seconds_sum", **lab) == pytest.approx(0.5 + 4.0 + 0.5)
    assert value(r, "fthsdp_stall_seconds_sum", **lab) == pytest.approx(4.0 - 0.2 - 0.3)
    assert value(r, "fthsdp_catch_up_seconds_sum", **lab) == pytest.approx(1.5)
    assert value(r, "fthsdp_ring_rebuild_seconds_count", **lab) == 1
    # the last all-reduce ran over 3 members in 0.1 s: 2*(3-1)/3 * 3 MB / 0.1 s
    assert value(r, "fthsdp_allreduce_bus_bandwidth_bytes_per_second", **lab) == pytest.approx(4e6 / 0.1)
    m.observe_fetch({"bytes": 8e6, "seconds": 2.0})
    m.observe_snapshot(0.25, 8_000_000)
    m.observe_detection(("1",), 2)
    assert value(r, "fthsdp_peer_fetch_throughput_bytes_per_second", **lab) == 4e6
    assert value(r, "fthsdp_peer_fetch_bytes_total", **lab) == 8e6
    assert value(r, "fthsdp_snapshot_seconds_sum", **lab) == 0.25
    assert value(r, "fthsdp_detections_total", **lab) == 1


def test_two_replica_metrics_in_one_process_do_not_clash():
    a, b = ReplicaMetrics("j", "0"), ReplicaMetrics("j", "1")
    a.observe_step(rec(0))
    assert value(a.registry, "fthsdp_commits_total", job="j", replica="0", process="0") == 1
    assert value(b.registry, "fthsdp_commits_total", job="j", replica="1", process="0") == 0


def test_bus_bytes_follow_the_ring_convention():
    assert ring_bus_bytes(100, 1) == 0
    assert ring_bus_bytes(100, 2) == 100
    assert ring_bus_bytes(100, 4) == 150


def test_metrics_file_follower_reads_complete_lines_only(tmp_path):
    path = tmp_path / "metrics-0.jsonl"
    m = ReplicaMetrics("j", "0")
    follow = MetricsFileFollower(path, m)
    assert follow.poll() == 0  # no file yet
    line = {"kind": "step", "replica": "0", "step": 0, "quorum_id": 1, "members": ["0", "1"], "healthy": True,
            "attempts": 2, "loss": 3.0, "start": 1.0, "end": 2.0, "position": 0, "events": [], "rebuild_s": 0.1,
            "allreduce_s": 0.2, "grads_s": 0.3, "catch_up_s": 0.0}
    with open(path, "w") as f:
        f.write(json.dumps(line) + "\n" + json.dumps({**line, "step": 1})[:20])  # a torn second line
    assert follow.poll() == 1
    with open(path, "a") as f:
        f.write(json.dumps({**line, "step": 1})[20:] + "\n")
    assert follow.poll() == 1 and follow.steps == 2
    assert value(m.registry, "fthsdp_retries_total", job="j", replica="0", process="0") == 2
    assert value(m.registry, "fthsdp_step", job="j", replica="0", process="0") == 2
    # a line it cannot read (a step without its fields, not an object) is skipped, not the rest
    with open(path, "a") as f:
        f.write(json.dumps({"kind": "step"}) + "\n" + "[1]\n" + json.dumps({**line, "step": 2}) + "\n")
    assert follow.poll() == 1 and follow.steps == 3
    # the file replaced by a shorter one (a restarted writer): read from its start again
    path.write_text(json.dumps({**line, "step": 0}) + "\n")
    assert follow.poll() == 1 and follow.steps == 4


def test_lighthouse_metrics_from_views_and_stale_series_removed():
    lm = LighthouseMetrics()
    r = lm.registry
    views = kill_and_rejoin_views()
    lm.update(views[0])  # before any failure, each kind is exported at 0 (alerts.yml's increase() counts the first)
    assert [value(r, "fthsdp_lighthouse_failures_total", job="j", kind=k) for k in ("dead", "left quorum")] == [0, 0]
    for v in views[1:3]:
        lm.update(v)
    assert value(r, "fthsdp_lighthouse_quorum_size", job="j") == 2
    assert value(r, "fthsdp_lighthouse_quorum_id", job="j") == 2
    assert value(r, "fthsdp_lighthouse_replicas", job="j", state="dead") == 1
    assert value(r, "fthsdp_lighthouse_replicas", job="j", state="healthy") == 2
    assert value(r, "fthsdp_lighthouse_failures_total", job="j", kind="dead") == 1
    assert value(r, "fthsdp_lighthouse_detection_seconds_sum", job="j") == pytest.approx(0.9)
    assert value(r, "fthsdp_lighthouse_heartbeat_age_seconds", job="j", replica="1") == 1.9
    assert value(r, "fthsdp_lighthouse_quorum_decisions_total", job="j") == 2
    assert value(r, "fthsdp_lighthouse_stall_seconds_sum", job="j") == 1.0
    for v in views[3:]:
        lm.update(v)
    assert value(r, "fthsdp_lighthouse_quorum_size", job="j") == 3
    assert value(r, "fthsdp_lighthouse_replicas", job="j", state="dead") == 0
    assert value(r, "fthsdp_lighthouse_failures_total", job="j", kind="dead") == 1
    lm.update(view(9.0, [rv(0, 20)], qv(4, [0]), job="other"))  # job "j" is gone from the lighthouse
    assert value(r, "fthsdp_lighthouse_quorum_size", job="j") is None
    assert value(r, "fthsdp_lighthouse_heartbeat_age_seconds", job="j", replica="0") is None
    assert value(r, "fthsdp_lighthouse_quorum_size", job="other") == 1


def test_a_finished_job_is_read_from_the_status_shown_and_exported():
    """JobStatus.finished_step (-1 on the wire: not finished) reaches `fthsdp status`, the view and
    fthsdp_lighthouse_job_finished, which alerts.yml's degraded and stalled rules leave out."""
    from fthsdp.control.lighthouse_client import format_status, status_from_proto
    from fthsdp.proto import lighthouse

    pb2, _ = lighthouse()
    resp = pb2.StatusResponse(jobs=[pb2.JobStatus(job_id="done", num_configured=3, finished_step=40),
                                    pb2.JobStatus(job_id="going", num_configured=3, finished_step=-1)])
    reply = status_from_proto(resp)
    assert [j.finished_step for j in reply.jobs] == [40, None]
    text = format_status(reply.jobs)
    assert "job 'done': 3 configured, finished at step 40" in text and "going': 3 configured\n" in text, text
    lm = LighthouseMetrics()
    lm.update(view_from_proto(resp, 1.0))
    assert value(lm.registry, "fthsdp_lighthouse_job_finished", job="done") == 1
    assert value(lm.registry, "fthsdp_lighthouse_job_finished", job="going") == 0


def test_exporter_serves_the_registry_on_an_ephemeral_loopback_port():
    m = ReplicaMetrics("j", "0")
    m.observe_step(rec(0))
    srv = serve(m.registry, "127.0.0.1:0")
    try:
        assert srv.host == "127.0.0.1" and srv.port > 0
        text = urllib.request.urlopen(f"http://{srv.address}/metrics", timeout=10).read().decode()
        assert re.search(r'^fthsdp_commits_total\{job="j",process="0",replica="0"\} 1\.0$', text, re.M)
        assert "# TYPE fthsdp_step_seconds histogram" in text
    finally:
        srv.close()


def test_http_listeners_bound_their_connections_and_close_silent_ones():
    """A client that connects and sends nothing held a thread of prometheus_client's server for
    ever (no socket timeout), and every new connection got a thread: enough of them exhaust the
    process, and the scrape waits behind them. Now a listener serves a bounded number at once
    (one more is answered 503 at once) and closes a silent one after its socket timeout."""
    import socket

    from prometheus_client import make_wsgi_app

    from fthsdp.observe import http_bounded

    srv = http_bounded.wsgi_server("127.0.0.1", 0, make_wsgi_app(ReplicaMetrics("j", "0").registry),
                                   max_connections=3, socket_timeout_s=1.0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    addr = srv.server_address[:2]
    idle = [socket.create_connection(addr, timeout=10) for _ in range(3)]
    try:
        time.sleep(0.3)  # accepted, each on its thread, waiting for a request line

        def ask() -> bytes:
            with socket.create_connection(addr, timeout=10) as s:
                s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
                return data

        t0 = time.monotonic()
        assert ask().startswith(b"HTTP/1.1 503") and time.monotonic() - t0 < 0.5  # at once, not queued
        for s in idle:  # the server closes each silent connection after its timeout
            assert s.recv(1) == b""
        assert time.monotonic() - t0 < 5
        time.sleep(0.1)
        reply = ask()
        assert reply.startswith(b"HTTP/1.0 200") and b"fthsdp_commits_total" in reply
    finally:
        for s in idle:
            s.close()
        srv.shutdown()
        srv.server_close()
    board = dash_mod.Dashboard("127.0.0.1:1", "127.0.0.1:0", max_concurrent=1, socket_timeout_s=1.0)
    with board:
        host, port = board.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10):
            time.sleep(0.3)
            with pytest.raises(urllib.error.HTTPError, match="503"):
                get(board.url + "healthz")
        time.sleep(0.2)
        assert get(board.url + "healthz")[0] == 200


def test_ipv6_listeners_advertise_bracketed_addresses():
    """An address a process advertises must parse back as HOST:PORT: the lighthouse refuses
    heartbeats whose metrics address does not (an IPv6 job once lost every heartbeat to it)."""
    from fthsdp.addresses import split_host_port

    srv = serve(ReplicaMetrics("j", "0").registry, "[::1]:0")
    try:
        assert srv.address == f"[::1]:{srv.port}" and split_host_port(srv.address) == ("::1", srv.port)
        text = urllib.request.urlopen(f"http://{srv.address}/metrics", timeout=10).read().decode()
        assert "fthsdp_commits_total" in text
    finally:
        srv.close()
    board = dash_mod.Dashboard("127.0.0.1:1", bind="[::1]:0")
    try:
        host, port = split_host_port(board.address)
        assert host == "::1" and port > 0 and board.url == f"http://[::1]:{port}/"
    finally:
        board._httpd.server_close()


@pytest.mark.parametrize("bad", ["127.0.0.1:x", "host:70000", "a:b:"])
def test_bad_bind_address_says_what_is_expected(bad):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_bind(bad)


def test_prometheus_targets_group_by_labels_sorted():
    out = prometheus_targets([
        ("127.0.0.1:9102", {"job": "j", "replica": "1"}),
        ("127.0.0.1:9101", {"job": "j", "replica": "0"}),
        ("127.0.0.1:9100", {"role": "lighthouse"}),
        ("127.0.0.1:9103", {"job": "j", "replica": "0"}),
    ])
    assert out == [
        {"targets": ["127.0.0.1:9101", "127.0.0.1:9103"], "labels": {"job": "j", "replica": "0"}},
        {"targets": ["127.0.0.1:9102"], "labels": {"job": "j", "replica": "1"}},
        {"targets": ["127.0.0.1:9100"], "labels": {"role": "lighthouse"}},
    ]
    with pytest.raises(ValueError, match="label name"):
        prometheus_targets([("127.0.0.1:1", {"bad-name": "x"})])
    with pytest.raises(ValueError, match="HOST:PORT"):
        prometheus_targets([("9100", {})])
    v = LighthouseView(0.0, (JobView("j", (
        ReplicaView("0", 1, 0.1, False, False, "127.0.0.1:9200"),
        ReplicaView("1", 1, 2.0, True, False, "127.0.0.1:9201"),  # dead: not a target
        ReplicaView("2", 1, 0.1, False, False, "")), None, "", 3, 1),), 0.8, 1)  # not advertised
    assert status_targets(v, "127.0.0.1:9100") == [
        {"targets": ["127.0.0.1:9200"], "labels": {"job": "j", "process": "0", "replica": "0", "role": "replica"}},
        {"targets": ["127.0.0.1:9100"], "labels": {"role": "lighthouse"}},
    ]
    # a lighthouse serving its metrics on every interface is scraped on the host it was reached on
    import dataclasses

    wild = dataclasses.replace(v, metrics_address="0.0.0.0:9100")
    assert status_targets(wild, lighthouse_host="10.1.2.3")[-1]["targets"] == ["10.1.2.3:9100"]
    assert status_targets(dataclasses.replace(v, metrics_address="not an address"))[-1]["labels"]["role"] == "replica"
    cfg = json.loads(scrape_config("/tmp/t.json", "1s"))
    assert cfg["scrape_configs"][0]["honor_labels"] is True


# -- dashboard ----------------------------------------------------------------------


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


def test_static_files_ship_in_the_package_and_reference_nothing_outside():
    d = dash_mod.static_dir()
    for name in dash_mod.STATIC_FILES:
        data = d.joinpath(name).read_text()
        assert not re.search(r"(src|href)=\"(https?:)?//", data), f"{name} loads something from outside"
        assert "http://" not in data.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in data
    html = d.joinpath("index.html").read_text()
    assert set(re.findall(r'"/static/([^"]+)"', html)) == {"dashboard.css", "dashboard.js"}


def wait_until(pred, timeout_s=20.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def test_dashboard_against_a_real_lighthouse_shows_a_replica_dying():
    from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
    from fthsdp.control.lighthouse_client import LighthouseClient

    with LighthouseThread(LighthouseConfig(detect_s=0.5)) as lh:
        clients = [LighthouseClient(lh.address, "jobA", str(i), heartbeat_interval_s=0.1) for i in range(2)]
        try:
            for c in clients:
                c.start_heartbeats()
            with dash_mod.Dashboard(lh.address, "127.0.0.1:0", interval_s=0.1) as d:
                status = lambda: json.loads(get(d.url + "api/status")[2])  # noqa: E731
                s = wait_until(lambda: (x := status())["jobs"] and len(x["jobs"][0]["replicas"]) == 2 and x,
                               what="both replicas on the dashboard")
                assert s["up"] and s["lighthouse"] == lh.address
                assert s["detect_s"] == 0.5 and s["beat_interval_s"] == 0  # 2 processes: not paced
                assert {r["state"] for r in s["jobs"][0]["replicas"]} == {OUTSIDE}  # alive, no quorum asked for
                clients[1].stop_heartbeats()
                s = wait_until(lambda: (x := status())["jobs"][0]["failures"] and x, what="the failure")
                (f,) = s["jobs"][0]["failures"]
                assert f["replica"] == "1" and f["kind"] == "dead" and f["silence_s"] >= 0.5
                states = {r["replica_id"]: r["state"] for r in s["jobs"][0]["replicas"]}
                assert states == {"0": OUTSIDE, "1": DEAD}
                code, ctype, body = get(d.url)
                assert code == 200 and ctype.startswith("text/html") and b"/static/dashboard.js" in body
                assert get(d.url + "static/dashboard.js")[1].startswith("text/javascript")
                metrics = get(d.url + "metrics")[2].decode()
                assert 'fthsdp_lighthouse_failures_total{job="jobA",kind="dead"} 1.0' in metrics
                for bad in ("static/../dashboard.py", "static/missing.js", "nope"):
                    with pytest.raises(urllib.error.HTTPError) as e:
                        get(d.url + bad)
                    assert e.value.code == 404
        finally:
            for c in clients:
                c.close()


def test_dashboard_reports_an_unreachable_lighthouse():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with dash_mod.Dashboard(f"127.0.0.1:{port}", "127.0.0.1:0", interval_s=0.1) as d:
        s = wait_until(lambda: (x := json.loads(get(d.url + "api/status")[2]))["error"] != "not polled yet" and x,
                       what="a poll")
        assert not s["up"] and s["jobs"] == [] and f"127.0.0.1:{port}" in s["error"]
        assert "fthsdp_lighthouse_up 0.0" in get(d.url + "metrics")[2].decode()
    with pytest.raises(ValueError, match="HOST:PORT"):
        StatusPoller("no-port")


def test_a_status_answer_that_cannot_be_read_is_reported_not_raised():
    """A lighthouse (mismatched or lying) whose Status quorum carries a ring neighbourhood that is
    not three runs of endpoints: the poller says so as it says an unreachable lighthouse, which the
    dashboard and the exporter report, instead of an error that ends their poll loop."""
    from concurrent import futures

    import grpc

    from fthsdp.proto import lighthouse

    pb2, _ = lighthouse()
    bad = pb2.StatusResponse(detect_s=0.8, jobs=[pb2.JobStatus(job_id="j", has_quorum=True, quorum=pb2.Quorum(
        quorum_id=3, neighbourhood=[pb2.MemberEndpoints(first_shard=0, addresses=["127.0.0.1:1"])]))])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("fthsdp.v1.Lighthouse", {
        "Status": grpc.unary_unary_rpc_method_handler(lambda req, ctx: bad.SerializeToString())})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    poller = StatusPoller(f"127.0.0.1:{port}", rpc_timeout_s=5.0)
    try:
        with pytest.raises(LighthouseUnreachable, match="Status answer cannot be read.*neighbourhood"):
            poller.poll()
    finally:
        poller.close()
        server.stop(None)


def test_dashboard_access_rules_are_one_pure_decision():
    a = dash_mod.access
    tok = "ab" * 32
    assert a("/api/status", "", "127.0.0.1:8765", None, None, None).code == 200  # no token: open
    assert a("/", "", "[::1]:8765", None, None, None).code == 200
    assert a("/", "", "localhost:8765", None, None, None).code == 200
    assert a("/", "", None, None, None, None).code == 200  # HTTP/1.0, no Host: not a browser
    rebind = a("/api/status", "", "evil.example:8765", None, None, None)
    assert rebind.code == 403 and "--allow-host" in rebind.reason
    assert a("/", "", "Dash.Internal:80", None, None, None, frozenset({"dash.internal"})).code == 200
    assert a("/", "", "[::1", None, None, None).code == 200 and a("/", "", "a:b:c", None, None, None).code == 403
    missing = a("/api/status", "", "127.0.0.1", None, None, tok)
    assert missing.code == 401 and "no access token" in missing.reason and "--access-token-file" in missing.reason
    assert a("/api/status", "", "127.0.0.1", "Bearer " + "cd" * 32, None, tok).reason.startswith("a wrong")
    assert a("/metrics", "", "127.0.0.1", "bearer " + tok, None, tok) == dash_mod.Verdict(200)
    assert a("/", "token=" + tok, "127.0.0.1", None, None, tok) == dash_mod.Verdict(200, set_cookie=True)
    # the cookie holds a value derived from the token (not the token: other ports of the host see it),
    # read by hand (the standard parser dropped every cookie after another site's odd one)
    good = f"{dash_mod.TOKEN_COOKIE}={dash_mod.cookie_value(tok)}"
    assert a("/", "", "127.0.0.1", None, f'a={{"x":1}}; {good}', tok) == dash_mod.Verdict(200)
    assert a("/", "", "127.0.0.1", None, f"{dash_mod.TOKEN_COOKIE}={tok}", tok).code == 401  # the raw token
    assert a("/", "", "127.0.0.1", None, good, tok, cookie_name="other_port").code == 401  # another dashboard's
    assert a("/", "", "127.0.0.1", None, 'bad"cookie; =;', tok).code == 401  # unreadable cookie: no token
    # a valid Bearer token opens it by any Host (Prometheus by a DNS name; a rebinding page cannot send it)
    assert a("/metrics", "", "dash.example:8765", "Bearer " + tok, None, tok) == dash_mod.Verdict(200)
    assert a("/metrics", "", "dash.example:8765", "Bearer " + "cd" * 32, None, tok).code == 403
    assert a("/", "token=\u00e9", "127.0.0.1", "Bearer \u00e9", None, tok).code == 401
    assert a("/healthz", "", "127.0.0.1", None, None, tok).code == 200  # liveness probes need no token


def test_dashboard_with_a_status_key_needs_a_token_beyond_loopback_and_serves_only_with_it(tmp_path):
    """The dashboard reads the lighthouse with its status key; served on a non-loopback address
    without a token it would hand what that key protects to anyone who reaches it."""
    import urllib.error

    key, tok = b"k" * 32, bytes(range(32))
    with pytest.raises(ValueError, match="access token.*--access-token-file"):
        dash_mod.Dashboard("127.0.0.1:1", "0.0.0.0:0", status_key=key)
    dash_mod.Dashboard("127.0.0.1:1", "127.0.0.1:0", status_key=key)._httpd.server_close()  # loopback: fine
    # bound to every address, reached here over loopback only
    with dash_mod.Dashboard("127.0.0.1:1", "0.0.0.0:0", interval_s=0.2, status_key=key, access_token=tok) as d:
        base = f"http://127.0.0.1:{d.address.rpartition(':')[2]}/"

        def fetch(path, **headers):
            try:
                with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers), timeout=10) as r:
                    return r.status, r.headers, r.read()
            except urllib.error.HTTPError as e:
                return e.code, e.headers, e.read()

        code, headers, body = fetch("api/status")
        assert code == 401 and b"no access token" in body and headers["WWW-Authenticate"].startswith("Bearer")
        assert fetch("metrics", Authorization="Bearer " + "00" * 32)[0] == 401
        assert fetch("metrics", Authorization="Bearer " + tok.hex())[0] == 200
        code, headers, body = fetch("?token=" + tok.hex())
        assert code == 200 and b"<html" in body.lower()
        cookie = headers["Set-Cookie"]
        name = f"{dash_mod.TOKEN_COOKIE}_{d.address.rpartition(':')[2]}"  # one per port
        assert cookie.startswith(f"{name}={dash_mod.cookie_value(tok.hex())};") and "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        code, _, body = fetch("api/status", Cookie=cookie.partition(";")[0])  # the page's own polls
        assert code == 200 and json.loads(body)["lighthouse"] == "127.0.0.1:1"
        assert fetch("healthz")[0] == 200
        assert fetch("api/status", Host="rebound.example", Cookie=cookie.partition(";")[0])[0] == 403  # rebinding
        assert fetch("metrics", Host="dash.example", Authorization="Bearer " + tok.hex())[0] == 200  # by DNS name
    tok_file = tmp_path / "token"
    tok_file.write_text(tok.hex() + "\n")
    tok_file.chmod(0o600)
    key_file = tmp_path / "status.key"
    key_file.write_text(key.hex() + "\n")
    key_file.chmod(0o600)
    bad = subprocess.run([sys.executable, "-m", "fthsdp.cli", "dashboard", "--lighthouse", "127.0.0.1:1", "--bind",
                          "0.0.0.0:0", "--status-key-file", str(key_file)], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--access-token-file" in bad.stderr


def test_dashboard_cli_serves_on_the_port_it_writes(tmp_path):
    from fthsdp.control.lighthouse import LighthouseThread

    port_file = tmp_path / "port"
    with LighthouseThread() as lh:
        proc = subprocess.Popen([sys.executable, "-m", "fthsdp.cli", "dashboard", "--lighthouse", lh.address,
                                 "--bind", "127.0.0.1:0", "--port-file", str(port_file), "--interval", "0.2"],
                                cwd=REPO, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: port_file.exists() or proc.poll() is not None, 60, "the port file")
            assert proc.poll() is None, proc.stderr.read()
            s = json.loads(get(f"http://127.0.0.1:{port_file.read_text()}/api/status")[2])
            assert s["lighthouse"] == lh.address and s["jobs"] == []
        finally:
            proc.terminate()
            assert proc.wait(20) == 0
    bad = subprocess.run([sys.executable, "-m", "fthsdp.cli", "dashboard", "--lighthouse", "x"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
