"""The numerical twin against the real multi-process run (issue 7): fed the
membership the real run had, the twin reproduces its parameters bit for bit."""

import numpy as np
import pytest

from fthsdp import config as config_lib
from fthsdp.launch import report
from fthsdp.launch.faults import plan
from fthsdp.launch.local import LocalJob
from fthsdp.sim.twin import step_hashes

from test_fault_tolerance import TINY

pytestmark = pytest.mark.multiprocess


def test_twin_matches_two_replica_run_with_a_failure_bit_for_bit(tmp_path):
    steps = 14
    overrides = TINY + ["launch.replicas=2", "launch.devices_per_replica=1", f"train.steps={steps}"]
    job = LocalJob(config="base", overrides=overrides, out_dir=tmp_path, replicas=2, steps=steps,
                   faults=plan(("1@6",), (), 2), restart=False, detect_s=0.8, deadline_s=180, progress=False)
    s = job.run()
    assert s["failed_replicas"] == []
    run = report.load_run(tmp_path)
    recs = {r["step"]: r for r in run.steps["0"]}
    assert sorted(recs) == list(range(steps))
    # The membership each committed step really had, as the twin's mask.
    alive = np.array([[str(r) in recs[i]["members"] for r in range(2)] for i in range(steps)])
    assert alive[:, 1].any() and not alive[-1, 1], "the kill must fall inside the run"
    cfg = config_lib.load("base", overrides)
    twin = step_hashes(cfg, alive, intervention=cfg.ft.intervention, seed=cfg.train.seed)
    for i in range(steps):
        assert twin[i][0] == recs[i]["hash"], f"twin and real run differ after step {i} (members {recs[i]['members']})"
    # replica 1's records: steps from 0 on, none past the first step it was out of (a kill between a
    # commit and its metrics line leaves that commit unrecorded)
    mine = [r["step"] for r in run.steps["1"]]
    assert mine and mine == list(range(len(mine))) and len(mine) <= int(alive[:, 1].argmin()), mine
    for r in run.steps["1"]:
        assert twin[r["step"]][1] == r["hash"]
