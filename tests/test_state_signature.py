"""A replica's state signature (fthsdp/step/signature.py): equal for replicas built alike, different
for any change of structure, shape, dtype or of the model/optimizer/data settings; and a replica
whose signature differs from a live one's is refused by the lighthouse and exits job-fatal."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fthsdp import config as config_lib
from fthsdp.step.signature import describe, state_signature

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_the_signature_is_of_structure_shapes_dtypes_and_settings_not_values():
    a = {"w": jnp.zeros((4, 3), jnp.float32), "b": jnp.zeros(3, jnp.float32), "step": np.int32(0)}
    same = {"b": np.ones(3, np.float32), "w": np.full((4, 3), 7, np.float32), "step": 9}
    assert state_signature(a) == state_signature({**same, "step": np.int32(9)}) > 0
    assert describe(a).splitlines()[1:] == ["(3,) float32", "() int32", "(4, 3) float32"]
    assert state_signature(a) != state_signature({**a, "w": jnp.zeros((4, 3), jnp.bfloat16)})
    assert state_signature({**a, "w": jnp.zeros((4, 3), jnp.float16)}) != state_signature(
        {**a, "w": jnp.zeros((4, 3), jnp.bfloat16)})  # the same bytes, unlike values
    assert state_signature(a) != state_signature({**a, "w": jnp.zeros((3, 4), jnp.float32)})  # same size
    assert state_signature(a) != state_signature({"v": a["w"], "b": a["b"], "step": a["step"]})  # a renamed field
    assert state_signature(a) != state_signature([a["w"], a["b"], a["step"]])
    cfg = config_lib.load("base")
    assert state_signature(a, cfg) == state_signature(a, config_lib.load("base"))
    for override in ("optim.lr=0.01", "model.dtype=bfloat16", "data.seed=1", "train.steps=7", "train.seed=3",
                     "ft.intervention=none", "ft.fingerprint=false", "ft.fingerprint_every=4"):
        assert state_signature(a, cfg) != state_signature(a, config_lib.load("base", [override])), override
    # one intervention mode however it is spelt
    assert state_signature(a, config_lib.load("base", ["ft.intervention=SQRT"])) == state_signature(
        a, config_lib.load("base", ["ft.intervention=sqrt"]))
    # the runtime that computes the numbers: another jax, backend or device kind rounds differently
    text = describe(a, cfg)
    assert f"jax={jax.__version__}" in text and "backend=cpu" in text and "device_kind=cpu" in text
    # settings a replica may hold alone (where it listens, its output) are not in it
    assert state_signature(a, cfg) == state_signature(a, config_lib.load("base", ["ft.bind_host=127.0.0.2"]))


@pytest.mark.multiprocess
def test_a_replica_unlike_the_live_one_is_refused_and_exits_job_fatal(tmp_path):
    """Replica 1 runs with another learning rate (its state has the same shapes: FTAR would
    have averaged its gradients with replica 0's and trained on). Whichever of the two asks for
    a quorum second is refused, naming both signatures, and exits 78 at once, not after retries;
    the first trains alone (both pass the start-up barrier together, so either may ask first)."""
    from fthsdp.errors import EXIT_JOB_FATAL
    from test_fault_tolerance import TINY
    from test_resilience_lighthouse import free_port, start_lighthouse

    port = free_port()
    lh = start_lighthouse(port, tmp_path / "lighthouse.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", FTHSDP_PEER_TOKEN="state-signature-test-token")

    def start(rid: int, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "fthsdp.replica.process", "--config", "base", "--replica-id", str(rid),
             "--lighthouse", f"127.0.0.1:{port}", "--job", "sig", "--out-dir", str(tmp_path / f"r{rid}"), *TINY,
             "launch.replicas=2", "launch.devices_per_replica=1", "train.steps=4", *extra],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = {"0": start(0), "1": start(1, "optim.lr=0.01")}
    try:
        outs = {rid: p.communicate(timeout=240)[0] for rid, p in procs.items()}
        codes = {rid: p.returncode for rid, p in procs.items()}
        assert sorted(codes.values()) == [0, EXIT_JOB_FATAL], (codes, {r: o[-2000:] for r, o in outs.items()})
        (refused,) = [r for r, c in codes.items() if c == EXIT_JOB_FATAL]
        other = "1" if refused == "0" else "0"
        out = outs[refused]
        assert f"is not made like that of live replica '{other}'" in out and "optimizer" in out, out[-3000:]
        assert "attempt 2" not in out  # refused once, not retried
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
        lh.kill()
        lh.wait(30)
