"""The split brain the emulation caught at 512 x 196 ranks (two quorums both committing
step 1), made small and deterministic with hang faults, against the real lighthouse
process: the lineage fence (fthsdp.control.quorum, rule 6) must leave every replica
with one state. Timed with 1 s steps so that the sequence does not depend on the
machine's load (each window below is about half a second wide)."""

from __future__ import annotations

import dataclasses

from fthsdp.sim.emulation import EmulationConfig, Fault, run_emulation
from fthsdp.sim.mock_plane import ModelShape


def test_a_step_retrained_by_a_minority_never_leaves_two_models():
    # Detection 0.8 s. Replica 2 hangs in step 1: 0 and 1 abort, form quorum 2 and commit
    # step 1; then both hang in step 2 (a partition from the lighthouse, or both stopped):
    # replica 2 comes back at step 1, alone a majority of the live, forms quorum 3 and
    # retrains step 1, then step 2. 0 and 1 wake up, commit step 2 in quorum 2 and ask
    # at step 3 while 2 waits for them (join timeout 3 s): all three meet at step 3.
    faults = (Fault("hang", step=1, replica=2, seconds=1.5),
              Fault("hang", step=2, replica=0, seconds=1.9), Fault("hang", step=2, replica=1, seconds=1.9))
    timeouts = dataclasses.replace(EmulationConfig.timeouts, join_timeout_s=3.0)
    cfg = EmulationConfig(replicas=3, ranks_per_replica=4, steps=5, model=ModelShape(params=10**6, step_s=1.0),
                          faults=faults, timeouts=timeouts, run_timeout_s=60.0)
    rep = run_emulation(cfg)
    ev = "\n".join(rep.events)
    # The sequence happened: steps 1 and 2 were committed in quorum 2 by 0 and 1, and again by 2 ...
    assert rep.superseded == 2, ev
    # ... and 0 and 1 were fenced (behind at the top step) and fetched 2's state, instead of
    # training on as healthy members beside it with a different model (as before the fence:
    # "step 3 in quorum 4: replica 0 committed from a different state ...: split brain").
    assert "replica 0: behind at step 3" in ev and "quorum 3 re-decided step 1" in ev, ev
    assert "replica 0: caught up to step 3 from 2" in ev and "replica 1: caught up to step 3 from 2" in ev
    assert rep.violations() == []
    assert rep.final_steps == {"0": 5, "1": 5, "2": 5}
    # The surviving lineage is replica 2's: it trained batches 0..4; 0 and 1 trained 0, then
    # (their steps 1 and 2 discarded) batch 1 at step 4 once back: each batch exactly once.
    assert [c.quorum_id for _, c in sorted(rep.commits.items())][:3] == [1, 3, 3]
    assert rep.commits[4].healthy == ("0", "1", "2")
