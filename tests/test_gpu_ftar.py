"""FTAR on the GPU (marked `gpu`; skipped where jax has no CUDA device).

Real worker processes share the GPU (each takes a slice of its memory) and
all-reduce through the CUDA `fthsdp_ftar` handler: the stream stages the
gradient through pinned host memory, the C++ control thread runs the ring
over loopback TCP, a reduce worker kernel sums the received chunks on the
GPU. Checked: bitwise equality with the CPU FTAR (f32, bf16, f16;
rings of 2-4; sizes that are not multiples of the chunk), exact integer sums,
identical bytes on every rank, no recompilation on reconfiguration; a peer
SIGKILLed mid-all-reduce -> RECOVERABLE within the deadline and the next
all-reduce on the smaller ring succeeds; a SIGSTOPped peer -> the deadline;
`fthsdp run` with replicas sharing the GPU, a kill and a rejoin, identical
final state and one compilation per process. The CUDA reduce kernel is
checked bitwise against numpy.

The test process itself stays on the CPU (tests/conftest.py pins it); GPU
work happens in subprocesses that are given the CUDA platform explicitly.
The host-side protocol of this path is also tested without a GPU:
tests/test_staging.py.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fthsdp.collective import ftar

from fthsdp.collective import native

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "gpu_workers" / "ftar_gpu_worker.py"
sys.path.insert(0, str(HERE / "gpu_workers"))
from gpu_test_data import inputs  # noqa: E402


def gpu_env(procs_per_gpu: int = 4) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cuda,cpu",
           "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.8 / procs_per_gpu:.3f}"}
    return env


@functools.cache
def cuda_devices() -> int:
    """CUDA devices jax sees in a fresh process given the CUDA platform (0 if none)."""
    if native.cuda_library_path() is None:
        return 0
    r = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices('gpu')))"],
                       env=gpu_env(1), capture_output=True, text=True, timeout=300)
    try:
        return int(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else 0
    except (ValueError, IndexError):
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.skipif("not cuda_devices()", reason="no CUDA device (or fthsdp's CUDA library was not built)"),
]


def launch(tmp_path, n, scenario, **extra):
    rdv = tmp_path / "rdv"
    rdv.mkdir(exist_ok=True)
    procs = []
    for rank in range(n):
        spec = dict(n=n, rank=rank, rdv=str(rdv), scenario=scenario, out=str(tmp_path / f"out{rank}.npz"),
                    timeout_s=20.0)
        spec.update(extra)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env=gpu_env(max(n, 2)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs, ranks, timeout=300):
    for r in ranks:
        try:
            log, _ = procs[r].communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert procs[r].returncode == 0, f"rank {r} failed:\n{log}"


def load(tmp_path, rank):
    with np.load(tmp_path / f"out{rank}.npz") as z:
        return {k: z[k] for k in z.files}


def worker_inputs(rank, big=0):
    return inputs(rank, big)


def test_cuda_reduce_kernel_is_bitwise_numpy(tmp_path):
    procs = launch(tmp_path, 1, "reduce")
    finish(procs, [0])
    res = load(tmp_path, 0)
    for dt in ("f32", "bf16", "f16"):
        assert res[f"{dt}/got"].tobytes() == res[f"{dt}/expected"].tobytes(), dt


@pytest.mark.parametrize("n", [2, 3, 4])
def test_gpu_ftar_is_bitwise_the_cpu_ftar(tmp_path, n):
    # 100003 f32 / 77777 bf16 / 55555 f16 elements with 64 KiB chunks: not multiples of the chunk
    procs = launch(tmp_path, n, "sum", chunk_bytes=1 << 16)
    finish(procs, range(n))
    results = [load(tmp_path, r) for r in range(n)]
    for res in results:
        assert str(res["gpu1/platform"]) == "gpu" and str(res["cpu1/platform"]) == "cpu"
        for tag in ("gpu1", "cpu1", "gpu2"):
            assert np.all(res[f"{tag}/status"] == ftar.STATUS_OK), (tag, res[f"{tag}/status"])
        for key in ("f32", "bf16", "f16", "ints"):
            assert res[f"gpu1/{key}"].tobytes() == res[f"cpu1/{key}"].tobytes(), f"GPU != CPU FTAR for {key}"
            assert res[f"gpu1/{key}"].tobytes() == results[0][f"gpu1/{key}"].tobytes(), f"ranks differ: {key}"
        assert int(res["gpu_cache_size"]) == 1, "reconfiguring recompiled the GPU step"
    expected = sum(worker_inputs(r)["ints"] for r in range(n))
    np.testing.assert_array_equal(results[0]["gpu1/ints"].view(np.float32), expected)
    f32 = results[0]["gpu1/f32"].view(np.float32)
    np.testing.assert_allclose(f32, sum(worker_inputs(r)["f32"] for r in range(n)), rtol=1e-5, atol=1e-4)
    # the reversed ring (quorum 2) sums the same integers exactly
    np.testing.assert_array_equal(results[0]["gpu2/ints"].view(np.float32), expected)


def test_gpu_sigkill_mid_allreduce_then_smaller_ring(tmp_path):
    n, big, timeout = 3, 16 << 20, 20.0  # 64 MiB of float32 per rank
    procs = launch(tmp_path, n, "kill", big=big, chunk_bytes=1 << 16, timeout_s=timeout)
    finish(procs, range(n - 1))
    procs[n - 1].wait(timeout=60)
    assert procs[n - 1].returncode == -signal.SIGKILL
    survivors = [load(tmp_path, r) for r in range(n - 1)]
    for res in survivors:
        assert np.all(res["gpu1/status"] == ftar.STATUS_RECOVERABLE), str(res.get("reason_q1"))
        assert float(res["gpu1/seconds"]) < timeout, "not released before the deadline"
        assert np.all(res["gpu2/status"] == ftar.STATUS_OK)
        assert int(res["gpu_cache_size"]) == 1
    exp = sum(worker_inputs(r, big=big)["big"] for r in range(n - 1))
    np.testing.assert_array_equal(survivors[0]["gpu2/big"].view(np.float32), exp)
    assert survivors[0]["gpu2/big"].tobytes() == survivors[1]["gpu2/big"].tobytes()


def test_gpu_sigstopped_peer_hits_the_deadline(tmp_path):
    n, timeout = 3, 3.0
    procs = launch(tmp_path, n, "stop", timeout_s=timeout)
    try:
        rdv = tmp_path / "rdv"
        deadline = time.time() + 300
        while not all((rdv / f"configured{r}").exists() for r in range(n)):
            assert time.time() < deadline
            time.sleep(0.05)
        finish(procs, range(n - 1))
    finally:
        procs[n - 1].send_signal(signal.SIGCONT)
        procs[n - 1].kill()
        procs[n - 1].wait(timeout=30)
    for r in range(n - 1):
        res = load(tmp_path, r)
        assert np.all(res["gpu1/status"] == ftar.STATUS_RECOVERABLE)
        secs = float(res["gpu1/seconds"])
        assert 0.9 * timeout <= secs < timeout + 5.0, secs
        assert "timeout" in str(res["reason_q1"]) or "lost" in str(res["reason_q1"]), str(res["reason_q1"])


@pytest.mark.parametrize("replicas", [2, 3])
def test_fthsdp_run_on_a_shared_gpu_with_kill_and_rejoin(tmp_path, replicas):
    """The real job on the GPU: replicas share it, one is SIGKILLed and restarted."""
    out = tmp_path / "run"
    tiny = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16",
            "data.seq_len=16", "data.batch_size=8", "data.corpus_bytes=65536", "train.eval_every=0",
            "ft.allreduce_timeout_s=10", "ft.max_retries=4", "train.min_step_s=0.1"]
    cmd = [sys.executable, "-m", "fthsdp.cli", "run", "--config", "base", "--replicas", str(replicas),
           "--devices-per-replica", "1", "--kill", "1@15", "--out-dir", str(out), "train.steps=60", *tiny]
    env = {k: v for k, v in gpu_env(replicas).items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    env["JAX_PLATFORMS"] = "cuda,cpu"  # replica processes split the GPU's memory themselves
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical_final_state"], summary.get("final_hashes")
    assert summary["failed_replicas"] == []
    from fthsdp.launch import report

    run = report.load_run(out)
    assert sorted(run.done) == [str(i) for i in range(replicas)]
    for rid, done in run.done.items():
        assert done["compilations"] == {"compute_grads": 1, "apply_grads": 1}, (rid, done["compilations"])
        assert done.get("platform") == "gpu", (rid, "picked no GPU with no flag", done.get("platform"))
    assert any(not rec["healthy"] for rec in run.steps["1"]), "the killed replica never rejoined behind"
