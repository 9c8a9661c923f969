"""The chaos soak's quick form (issue 10, item 6): >= 10 real faults of several
kinds through the launcher, and no invariant violated in the run's artifacts."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_chaos_soak_quick(tmp_path):
    out = tmp_path / "result.json"
    p = subprocess.run([sys.executable, str(ROOT / "experiments" / "chaos_soak.py"), "--quick", "--seed", "1",
                        "--out", str(tmp_path / "run"), "--json", str(out)],
                       capture_output=True, text=True, timeout=420)
    assert out.exists(), p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["violations"] == [], r["violations"][:10]
    assert r["finished"] and p.returncode == 0, p.stderr[-3000:]
    assert r["fault_total"] >= 10 and sum(r["faults"].values()) == r["fault_total"]
    assert len(r["faults"]) >= 4, r["faults"]
    # the job-level faults happen in every run: the launcher restarted its lighthouse
    # and fell back to the checkpoint after the whole-job kill
    assert r["faults"].get("kill_lighthouse", 0) >= 1 and r["lighthouse_restarts"] >= r["faults"]["kill_lighthouse"]
    assert r["faults"].get("whole_job_kill") == 1 and r["job_restarts"] >= 1 and r["attempts"] >= 2
    assert r["steps"] >= 150


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_soak_checker_names_each_violated_invariant(tmp_path):
    """The artifact checks catch what they claim to: a synthetic run with one
    violation of each invariant (and nothing else wrong)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import chaos_soak
    from fthsdp.data.ledger import Ledger

    (tmp_path / "run.json").write_text(json.dumps({"attempts": [{"n": 0}]}))

    def step(rid, s, pid, h, healthy=True, dur=0.1):
        return {"kind": "step", "replica": rid, "step": s, "quorum_id": 1, "members": ["0", "1"], "healthy": healthy,
                "attempts": 1, "loss": 1.0, "start": 100.0 + s, "end": 100.0 + s + dur, "position": s, "pid": pid,
                "hash": h}

    r0 = [step("0", s, 10, "h%d" % s) for s in range(4)]
    r1 = [step("1", 0, 11, "h0"), step("1", 1, 11, "DIFFERENT"), step("1", 2, 11, "h2", healthy=False),
          step("1", 3, 11, "h3", dur=30.0)]
    done = {"kind": "done", "step": 4, "hash": "h3", "positions": [2, 4]}
    _rows(tmp_path / "metrics-0.jsonl", r0 + [{**done, "replica": "0", "compilations":
                                               {"compute_grads": 1, "apply_grads": 1}}])
    _rows(tmp_path / "metrics-1.jsonl", r1 + [{**done, "replica": "1", "compilations":
                                               {"compute_grads": 2, "apply_grads": 1}}])
    _rows(tmp_path / "events.jsonl", [])
    with Ledger(tmp_path / "ledger" / "replica_0.jsonl", 0) as led:
        led.commit(1, 0)
        led.commit(2, 0)  # batch 0 twice, batch 1 never
    with Ledger(tmp_path / "ledger" / "replica_1.jsonl", 1) as led:
        for s in range(4):
            led.commit(s + 1, s)
    violations, stats = chaos_soak.check(tmp_path, steps=5, summary={"failed_replicas": []})
    got = {(v["invariant"], str(v["replica"]), v["step"]) for v in violations}
    assert got == {
        (1, "['0', '1']", 1),  # diverged after step 1
        (2, "0", 2),  # batch 0 trained again at step 2
        (2, "0", None),  # batch 1 never trained
        (3, "1", 3),  # a 30 s step
        (4, "1", 4),  # compiled twice
        (5, "1", 2),  # behind, never signalled
        (6, "['0', '1']", 4),  # done at 4, not 5
    }, sorted(got, key=str)
    assert not stats["finished"]
