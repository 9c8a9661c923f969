"""One replica of a GPU FTAR test (started by tests/test_gpu_ftar.py).

Usage: ftar_gpu_worker.py SPEC_JSON. Runs `fthsdp.collective.ftar.allreduce` jitted on
this process's GPU (several workers share one GPU) and, for comparison, the
same all-reduce on the CPU through the same communicator; writes what it got
to an .npz for the test to compare.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import threading
import time

spec = json.loads(sys.argv[1])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from fthsdp.collective import ftar

from fthsdp.collective import native

from fthsdp.collective import ops  # noqa: E402
from fthsdp.step.quorum_inputs import make_quorum_inputs  # noqa: E402
from fthsdp.step.sharding import AXIS  # noqa: E402
from gpu_test_data import inputs  # noqa: E402  (this script's directory)

N, RANK = spec["n"], spec["rank"]
RDV = pathlib.Path(spec["rdv"])
SCENARIO = spec["scenario"]
JOB = "gpu-test-job"


def publish(name: str, value: str) -> None:
    tmp = RDV / f".{name}.tmp"
    tmp.write_text(value)
    os.rename(tmp, RDV / name)


def gather(names: list[str], timeout: float = 120.0) -> list[str]:
    deadline = time.time() + timeout
    while not all((RDV / n).exists() for n in names):
        if time.time() > deadline:
            raise TimeoutError(f"rendezvous: missing {[n for n in names if not (RDV / n).exists()]}")
        time.sleep(0.01)
    return [(RDV / n).read_text() for n in names]


def reduce_scenario() -> dict[str, np.ndarray]:
    """The CUDA reduce kernel against numpy, bitwise, for every dtype."""
    gpu = jax.devices("gpu")[0]
    res = {}
    for name, dt in (("f32", np.float32), ("bf16", ml_dtypes.bfloat16), ("f16", np.float16)):
        rng = np.random.default_rng(7)
        a = (rng.standard_normal(100_003) * 10).astype(dt)
        b = (rng.standard_normal(100_003) * 10).astype(dt)
        got = np.asarray(jax.jit(ops.reduce_sum)(jax.device_put(a, gpu), jax.device_put(b, gpu)))
        res[f"{name}/got"] = got.view(np.uint8)
        res[f"{name}/expected"] = (a.astype(np.float32) + b.astype(np.float32)).astype(dt).view(np.uint8)
    return res


def main() -> None:
    native.ensure_registered()
    if SCENARIO == "reduce":
        np.savez(spec["out"], **reduce_scenario())
        return
    gpu_mesh = Mesh(np.array(jax.devices("gpu")[:1]), (AXIS,))
    cpu_mesh = Mesh(np.array(jax.devices("cpu")[:1]), (AXIS,))
    comm = ftar.Communicator(num_shards=1, timeout_s=spec["timeout_s"], streams=2,
                             chunk_bytes=spec.get("chunk_bytes", 1 << 16), chunks=4)
    publish(f"addr{RANK}", comm.address)
    members = gather([f"addr{r}" for r in range(N)])
    ok = comm.configure(JOB, 1, RANK, members, timeout_s=30.0)
    assert ok, ok.reason

    def report_stuck(tag: str) -> None:  # an all-reduce past 10 s: say where its ring is
        print(f"rank {RANK} {tag}: still running after 10 s; progress {comm.progress()}; "
              f"stats {comm.stats()}", file=sys.stderr, flush=True)

    host = inputs(RANK, spec.get("big", 0))
    steps = {}
    results: dict[str, np.ndarray] = {}

    def run(tag: str, mesh: Mesh, rank: int, n: int, qid: int):
        dev = mesh.devices.flat[0]
        grads = {k: jax.device_put(v, dev) for k, v in host.items()}
        step = steps.setdefault(mesh, jax.jit(lambda g, q: ftar.allreduce(g, q, mesh)))
        q = make_quorum_inputs(num_contributing=n, num_members=n, num_configured=N, rank=rank,
                               quorum_id=qid, comm=comm.handle)
        t0 = time.perf_counter()
        watch = threading.Timer(10.0, report_stuck, args=(tag,))
        watch.daemon = True
        watch.start()
        sums, status = step(grads, q)
        status = np.asarray(status)
        seconds = time.perf_counter() - t0
        watch.cancel()
        print(f"rank {RANK} {tag}: status {status.tolist()} in {seconds:.3f} s "
              f"(last error: {comm.stats()[0]['last_error']!r})", flush=True)
        results[f"{tag}/seconds"] = np.asarray(seconds)
        results[f"{tag}/status"] = status
        for k, v in sums.items():
            results[f"{tag}/{k}"] = np.asarray(v).view(np.uint8)  # raw bytes: bitwise comparisons
        results[f"{tag}/platform"] = np.asarray(str(dev.platform))
        return status

    if SCENARIO == "sum":
        run("gpu1", gpu_mesh, RANK, N, 1)
        run("cpu1", cpu_mesh, RANK, N, 1)
        new_rank = N - 1 - RANK  # quorum 2: reversed ring, must not recompile
        ok = comm.configure(JOB, 2, new_rank, list(reversed(members)), timeout_s=30.0)
        assert ok, ok.reason
        run("gpu2", gpu_mesh, new_rank, N, 2)
    elif SCENARIO == "kill":
        victim = N - 1
        if RANK == victim:
            def killer():  # SIGKILL this process once the big GPU all-reduce is moving bytes
                while True:
                    if any(s["bytes_received"] > 0 for s in comm.stats()):
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(0.0005)
            threading.Thread(target=killer, daemon=True).start()
        run("gpu1", gpu_mesh, RANK, N, 1)
        results["reason_q1"] = np.asarray(comm.stats()[0]["last_error"])
        survivors = [m for r, m in enumerate(members) if r != victim]
        ok = comm.configure(JOB, 2, RANK, survivors, timeout_s=30.0)
        assert ok, ok.reason
        run("gpu2", gpu_mesh, RANK, N - 1, 2)
    elif SCENARIO == "stop":
        victim = N - 1
        publish(f"configured{RANK}", "1")
        gather([f"configured{r}" for r in range(N)])
        if RANK == victim:
            os.kill(os.getpid(), signal.SIGSTOP)  # the test SIGKILLs us afterwards
            time.sleep(3600)
        run("gpu1", gpu_mesh, RANK, N, 1)
        results["reason_q1"] = np.asarray(comm.stats()[0]["last_error"])
    else:
        raise ValueError(f"unknown scenario {SCENARIO}")
    results["gpu_cache_size"] = np.asarray(steps[gpu_mesh]._cache_size())
    np.savez(spec["out"], **results)
    comm.close()


if __name__ == "__main__":
    main()
