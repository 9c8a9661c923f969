"""One replica of an FTAR multi-process test (started by tests/test_ftar.py).

Usage: worker.py SPEC_JSON. The spec says the ring size, this rank, local
devices, the rendezvous directory (address files), the scenario and where to
write the results (an .npz). Every replica runs the same jitted all-reduce;
the test compares their outputs.
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

from fthsdp.devices import enable_compilation_cache, force_host_devices  # noqa: E402

force_host_devices(spec["devices"])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from fthsdp.collective import ftar  # noqa: E402
from fthsdp.step.quorum_inputs import make_quorum_inputs  # noqa: E402
from fthsdp.step.sharding import fsdp_spec, replica_mesh  # noqa: E402
from ftar_test_data import inputs  # noqa: E402  (this script's directory)

enable_compilation_cache()

N, RANK, D = spec["n"], spec["rank"], spec["devices"]
RDV = pathlib.Path(spec["rdv"])
SCENARIO = spec["scenario"]
JOB = "test-job"


def publish(name: str, value: str) -> None:
    tmp = RDV / f".{name}.tmp"
    tmp.write_text(value)
    os.rename(tmp, RDV / name)


def gather(names: list[str], timeout: float = 60.0) -> list[str]:
    deadline = time.time() + timeout
    while not all((RDV / n).exists() for n in names):
        if time.time() > deadline:
            raise TimeoutError(f"rendezvous: missing {[n for n in names if not (RDV / n).exists()]}")
        time.sleep(0.01)
    return [(RDV / n).read_text() for n in names]


def main() -> None:
    mesh = replica_mesh(D)
    comm = ftar.Communicator(num_shards=D, timeout_s=spec["timeout_s"], streams=spec.get("streams", 2),
                             chunk_bytes=spec.get("chunk_bytes", 1 << 16), chunks=4)
    publish(f"addr{RANK}", comm.address)
    members = gather([f"addr{r}" for r in range(N)])
    ok = comm.configure(JOB, 1, RANK, members, timeout_s=20.0)
    assert ok, ok.reason

    big = spec.get("big", 0)
    host = inputs(RANK, big)
    put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, fsdp_spec(x.shape, D)))  # noqa: E731
    grads = jax.tree.map(put, host)
    step = jax.jit(lambda g, q: ftar.allreduce(g, q, mesh))
    results: dict[str, np.ndarray] = {}

    def run(tag: str, rank: int, n: int, qid: int):
        q = make_quorum_inputs(num_contributing=n, num_members=n, num_configured=N, rank=rank,
                               quorum_id=qid, comm=comm.handle)
        t0 = time.perf_counter()
        sums, status = step(grads, q)
        status = np.asarray(status)
        results[f"{tag}/seconds"] = np.asarray(time.perf_counter() - t0)
        results[f"{tag}/status"] = status
        for k, v in sums.items():
            results[f"{tag}/{k}"] = np.asarray(v.astype(jnp.float32))
        return status

    if SCENARIO == "sum":
        run("q1", RANK, N, 1)
        # Quorum 2: the same replicas in reversed ring order. Must not recompile.
        new_rank = N - 1 - RANK
        ok = comm.configure(JOB, 2, new_rank, list(reversed(members)), timeout_s=20.0)
        assert ok, ok.reason
        run("q2", new_rank, N, 2)
    elif SCENARIO == "kill":
        victim = N - 1
        if RANK == victim:
            def killer():  # SIGKILL this process once the big all-reduce is moving bytes
                while True:
                    if any(s["bytes_received"] > 0 for s in comm.stats()):
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(0.0005)
            threading.Thread(target=killer, daemon=True).start()
        run("q1", RANK, N, 1)
        survivors = [m for r, m in enumerate(members) if r != victim]
        ok = comm.configure(JOB, 2, RANK, survivors, timeout_s=20.0)
        results["reason_q1"] = np.asarray(comm.stats()[0]["last_error"])
        assert ok, ok.reason
        run("q2", RANK, N - 1, 2)
    elif SCENARIO == "stop":
        victim = N - 1
        publish(f"configured{RANK}", "1")
        gather([f"configured{r}" for r in range(N)])
        if RANK == victim:
            os.kill(os.getpid(), signal.SIGSTOP)  # the test SIGKILLs us afterwards
            time.sleep(3600)
        run("q1", RANK, N, 1)
        results["reason_q1"] = np.asarray(comm.stats()[0]["last_error"])
    else:
        raise ValueError(f"unknown scenario {SCENARIO}")

    results["cache_size"] = np.asarray(step._cache_size())
    np.savez(spec["out"], **results)
    comm.close()


if __name__ == "__main__":
    main()
