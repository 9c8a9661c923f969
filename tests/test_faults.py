"""Fault plans (pure) and the run report over synthetic run files."""

import json

import pytest

from fthsdp.launch import report
from fthsdp.launch.faults import Fault, parse_fault, plan, random_kills


def test_parse_and_plan():
    assert parse_fault("1@40", "kill") == Fault(step=40, replica=1, kind="kill")
    assert parse_fault("0@3", "stop", 2.0).stop_s == 2.0
    faults = plan(("2@9",), ("0@5",), replicas=3)
    assert [(f.kind, f.replica, f.step) for f in faults] == [("stop", 0, 5), ("kill", 2, 9)]


@pytest.mark.parametrize("spec,msg", [("1", "expected REPLICA@STEP"), ("a@b", "expected REPLICA@STEP"),
                                      ("-1@3", "must be >= 0"), ("5@3", "replicas 0..2")])
def test_bad_fault_specs(spec, msg):
    with pytest.raises(ValueError, match=msg):
        plan((spec,), (), replicas=3)


def test_random_kills_are_seeded_and_sane():
    a = random_kills(4, replicas=3, steps=100, seed=7)
    assert a == random_kills(4, replicas=3, steps=100, seed=7)
    assert a != random_kills(4, replicas=3, steps=100, seed=8)
    assert len({f.step for f in a}) == 4 and all(5 <= f.step < 95 and 0 <= f.replica < 3 for f in a)
    with pytest.raises(ValueError, match="at least 2 replicas"):
        random_kills(1, replicas=1, steps=100, seed=0)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_finds_detection_and_stall(tmp_path):
    # replica 0 and 1 train 10 steps of 0.1 s; replica 2 is killed at t=100.45 during step 4;
    # the survivors' step 4 takes 1.2 s, and they learn of the death at t=101.0.
    t = 100.0
    rows = {"0": [], "1": [], "2": []}
    for rid in rows:
        clock = t
        for s in range(10):
            if rid == "2" and s >= 4:
                break
            dur = 1.2 if s == 4 else 0.1
            members = ["0", "1", "2"] if s < 5 else ["0", "1"]
            rows[rid].append({"kind": "step", "replica": rid, "step": s, "quorum_id": 1 if s < 5 else 2,
                              "members": members, "healthy": True, "attempts": 2 if s == 4 else 1,
                              "loss": 5.0 - s * 0.1, "start": clock, "end": clock + dur, "position": s})
            clock += dur
    rows["0"].append({"kind": "detection", "replica": "0", "time": 101.0, "dead": ["2"], "quorum_id": 1})
    for rid in ("0", "1"):
        rows[rid].append({"kind": "done", "replica": rid, "step": 10, "hash": "abc"})
    for rid, rs in rows.items():
        _write(tmp_path / f"metrics-{rid}.jsonl", rs)
    _write(tmp_path / "events.jsonl", [{"time": 100.45, "kind": "kill", "replica": 2, "step": 4}])
    s = report.write_summary(tmp_path)
    (f,) = s["failures"]
    assert f["detection_s"] == pytest.approx(0.55)
    assert f["stall_s"]["0"] == pytest.approx(1.1) and f["straddling_step"]["1"] == 4
    assert [q["members"] for q in s["quorum_changes"]] == [["0", "1", "2"], ["0", "1"]]
    assert s["identical_final_state"] is True
    assert s["replicas"]["0"]["retried_steps"] == 1
    assert any("detected in 0.55s" in line for line in report.describe(s))
    png = report.plot_timeline(tmp_path, num_configured=3)
    assert png.stat().st_size > 10_000


def test_report_flags_divergent_replicas(tmp_path):
    _write(tmp_path / "metrics-0.jsonl", [{"kind": "done", "replica": "0", "step": 5, "hash": "a"}])
    _write(tmp_path / "metrics-1.jsonl", [{"kind": "done", "replica": "1", "step": 5, "hash": "b"}])
    s = report.summarize(tmp_path)
    assert s["identical_final_state"] is False
    assert "NO" in report.describe(s)[-1]
