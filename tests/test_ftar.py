"""FTAR end to end: real processes, real sockets on loopback, real signals.

Each multi-process test starts one worker per replica (tests/ftar_workers/
worker.py); the workers run the jitted `fthsdp.collective.ftar.allreduce` and write what
they got; the test checks it against numpy. In-process tests drive the same
native path through the host API to check handshakes, aborts and errors.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fthsdp.collective import ftar

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "ftar_workers" / "worker.py"
sys.path.insert(0, str(HERE / "ftar_workers"))
from ftar_test_data import inputs  # noqa: E402

pytestmark = pytest.mark.multiprocess


# The workers are CPU replicas (forced host devices): pin them to the CPU
# platform so these tests mean the same on a host whose default backend is a
# GPU (the GPU path has its own tests, tests/test_gpu_ftar.py).
CPU_ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def launch(tmp_path, n, devices, scenario, **extra):
    rdv = tmp_path / "rdv"
    rdv.mkdir(exist_ok=True)
    procs = []
    for rank in range(n):
        spec = dict(n=n, rank=rank, devices=devices, rdv=str(rdv), scenario=scenario,
                    out=str(tmp_path / f"out{rank}.npz"), timeout_s=20.0)
        spec.update(extra)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env=CPU_ENV,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs, ranks, timeout=120):
    outs = {}
    for r in ranks:
        try:
            log, _ = procs[r].communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert procs[r].returncode == 0, f"rank {r} failed:\n{log}"
    return outs


def load(tmp_path, rank):
    with np.load(tmp_path / f"out{rank}.npz") as z:
        return {k: z[k] for k in z.files}


def check_sums(results, tag, ranks_in_ring):
    expected = [inputs(r) for r in ranks_in_ring]
    first = results[0]
    for res in results:
        assert np.all(res[f"{tag}/status"] == ftar.STATUS_OK), res[f"{tag}/status"]
        for key in ("ints", "rand", "bf16", "f16"):  # invariant 1: bitwise identical everywhere
            assert res[f"{tag}/{key}"].tobytes() == first[f"{tag}/{key}"].tobytes(), key
    np.testing.assert_array_equal(first[f"{tag}/ints"], sum(e["ints"] for e in expected))
    np.testing.assert_array_equal(first[f"{tag}/f16"], sum(e["f16"].astype(np.float32) for e in expected))
    np.testing.assert_allclose(first[f"{tag}/rand"], sum(e["rand"] for e in expected), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(first[f"{tag}/bf16"], sum(e["bf16"].astype(np.float32) for e in expected),
                               rtol=0.05, atol=0.05)


@pytest.mark.parametrize("n,devices", [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 2)])
def test_sum_is_exact_identical_and_survives_reconfiguration(tmp_path, n, devices):
    procs = launch(tmp_path, n, devices, "sum")
    finish(procs, range(n))
    results = [load(tmp_path, r) for r in range(n)]
    check_sums(results, "q1", range(n))
    check_sums(results, "q2", range(n))
    for res in results:
        assert res["q1/status"].shape == (devices,)
        assert int(res["cache_size"]) == 1, "reconfiguring recompiled the step"


@pytest.mark.parametrize("devices", [1, 2])
def test_sigkill_mid_allreduce_then_smaller_ring(tmp_path, devices):
    n, big = 3, 4 << 20  # 16 MiB of float32 per rank
    procs = launch(tmp_path, n, devices, "kill", big=big, chunk_bytes=1 << 16)
    finish(procs, range(n - 1))
    procs[n - 1].wait(timeout=30)
    assert procs[n - 1].returncode == -signal.SIGKILL
    survivors = [load(tmp_path, r) for r in range(n - 1)]
    for res in survivors:
        assert np.all(res["q1/status"] == ftar.STATUS_RECOVERABLE), str(res.get("reason_q1"))
        assert float(res["q1/seconds"]) < 20.0, "not detected before the deadline"
        assert int(res["cache_size"]) == 1
    check_sums(survivors, "q2", range(n - 1))
    exp_big = sum(inputs(r, big)["big"] for r in range(n - 1))
    np.testing.assert_allclose(survivors[0]["q2/big"], exp_big, rtol=1e-5, atol=1e-5)
    assert survivors[0]["q2/big"].tobytes() == survivors[1]["q2/big"].tobytes()


def test_sigstopped_peer_hits_the_deadline(tmp_path):
    n, timeout = 3, 2.0
    procs = launch(tmp_path, n, 1, "stop", timeout_s=timeout)
    try:
        rdv = tmp_path / "rdv"
        deadline = time.time() + 120
        while not all((rdv / f"configured{r}").exists() for r in range(n)):
            assert time.time() < deadline
            time.sleep(0.05)
        finish(procs, range(n - 1), timeout=120)
    finally:
        procs[n - 1].send_signal(signal.SIGCONT)
        procs[n - 1].kill()
        procs[n - 1].wait(timeout=30)
    for r in range(n - 1):
        res = load(tmp_path, r)
        assert np.all(res["q1/status"] == ftar.STATUS_RECOVERABLE)
        secs = float(res["q1/seconds"])
        # Bounded by the deadline: not before it (nobody closed anything), not long after.
        assert 0.9 * timeout <= secs < timeout + 3.0, secs
        assert "timeout" in str(res["reason_q1"]) or "lost" in str(res["reason_q1"]), str(res["reason_q1"])


# ---------------------------------------------------------------------------
# In-process: two communicators of this process form a ring of two through
# real loopback sockets, driven by the host API (the handler's code path).


def pair(timeout_s=5.0, **kw):
    a = ftar.Communicator(timeout_s=timeout_s, **kw)
    b = ftar.Communicator(timeout_s=timeout_s, **kw)
    return a, b


def configure_both(a, b, qa, qb, job_a="job", job_b="job", timeout_s=5.0):
    members = [a.address, b.address]
    a.configure(job_a, qa, 0, members, timeout_s=timeout_s, wait=False)
    b.configure(job_b, qb, 1, members, timeout_s=timeout_s, wait=False)
    return a.wait_configured(timeout_s + 1), b.wait_configured(timeout_s + 1)


def run_both(a, b, xa, xb, qa, qb):
    out = {}

    def go(name, c, x, q, rank):
        out[name] = (c.allreduce_host(x, quorum_id=q, rank=rank, n=2), time.perf_counter())

    ts = [threading.Thread(target=go, args=("a", a, xa, qa, 0)),
          threading.Thread(target=go, args=("b", b, xb, qb, 1))]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    return out, t0


def test_host_allreduce_sums_odd_sizes_in_process():
    a, b = pair(chunk_bytes=256, chunks=3, streams=3)
    with a, b:
        ra, rb = configure_both(a, b, 1, 1)
        assert ra and rb, (ra, rb)
        for size in (0, 1, 2, 3, 1001, 100_003):
            xa = np.arange(size, dtype=np.float32)
            xb = np.full(size, 2.0, np.float32)
            out, _ = run_both(a, b, xa, xb, 1, 1)
            assert out["a"][0] == (0, "") and out["b"][0] == (0, ""), out
            np.testing.assert_array_equal(xa, np.arange(size, dtype=np.float32) + 2)
            assert xa.tobytes() == xb.tobytes()


def test_a_rings_all_reduce_deadline_is_the_one_its_configure_gave():
    """A quorum with a member catching up gives its all-reduce a longer deadline (that member
    fetches the state first): configure's op_timeout_s, for that ring only; 0 is the
    communicator's own timeout_s. A deadline that is not a finite number of seconds in [0, a
    week] is refused."""
    a, b = pair(timeout_s=0.5)
    with a, b:
        members = [a.address, b.address]
        for qid, op_timeout_s, lo, hi in ((3, 2.5, 2.2, 4.5), (4, 0.0, 0.3, 1.8)):
            a.configure("job", qid, 0, members, timeout_s=5.0, wait=False, op_timeout_s=op_timeout_s)
            b.configure("job", qid, 1, members, timeout_s=5.0, wait=False, op_timeout_s=op_timeout_s)
            assert a.wait_configured(6.0) and b.wait_configured(6.0)
            t0 = time.perf_counter()  # b never joins: a's all-reduce ends at its deadline
            status, reason = a.allreduce_host(np.ones(64, np.float32), quorum_id=qid, rank=0, n=2)
            took = time.perf_counter() - t0
            assert status == ftar.STATUS_RECOVERABLE and "timeout" in reason, reason
            assert lo < took < hi, (op_timeout_s, took)
        a.configure("job", 5, 0, members, timeout_s=5.0, wait=False)
        b.configure("job", 5, 1, members, timeout_s=5.0, wait=False)
        assert a.wait_configured(6.0) and b.wait_configured(6.0)
        a.set_op_timeout(1.5)  # the same ring, another deadline (its quorum's behind member caught up)
        t0 = time.perf_counter()
        status, reason = a.allreduce_host(np.ones(64, np.float32), quorum_id=5, rank=0, n=2)
        took = time.perf_counter() - t0
        assert status == ftar.STATUS_RECOVERABLE and 1.2 < took < 3.5
        said = float(reason.split("did not finish within ")[1].split(" s")[0])  # how long this op ran
        assert abs(said - took) < 0.5, (said, took, reason)
        for bad in (-1.0, float("inf"), float("nan"), 8 * 24 * 3600.0):
            with pytest.raises(ValueError, match="op_timeout_s must be a finite number"):
                a.configure("job", 6, 0, members, timeout_s=1.0, wait=False, op_timeout_s=bad)
            with pytest.raises(ValueError, match="op_timeout_s must be a finite number"):
                a.set_op_timeout(bad)


def test_stale_quorum_id_is_refused_at_the_handshake():
    a, b = pair()
    with a, b:
        ra, rb = configure_both(a, b, qa=5, qb=4, timeout_s=1.0)
        assert not rb and "stale quorum id 4" in rb.reason, rb
        assert not ra and "timeout connecting" in ra.reason, ra
        assert a.stats()[0]["refused_handshakes"] >= 1
        # The all-reduce on a failed ring returns RECOVERABLE at once, with the reason.
        status, reason = a.allreduce_host(np.ones(4, np.float32), quorum_id=5, rank=0, n=2)
        assert status == ftar.STATUS_RECOVERABLE and "timeout connecting" in reason
        # Both move on to quorum 6: the ring comes up.
        ra, rb = configure_both(a, b, 6, 6)
        assert ra and rb, (ra, rb)
        out, _ = run_both(a, b, np.ones(8, np.float32), np.ones(8, np.float32), 6, 6)
        assert out["a"][0][0] == out["b"][0][0] == ftar.STATUS_OK


def test_job_id_mismatch_is_refused():
    a, b = pair()
    with a, b:
        ra, rb = configure_both(a, b, 1, 1, job_a="job-a", job_b="job-b", timeout_s=1.0)
        reasons = ra.reason + rb.reason
        assert "job id mismatch" in reasons, (ra, rb)


def test_step_with_stale_quorum_id_is_recoverable_and_bad_rank_is_fatal():
    a, b = pair()
    with a, b:
        assert all(configure_both(a, b, 3, 3))
        status, reason = a.allreduce_host(np.ones(4, np.float32), quorum_id=2, rank=0, n=2)
        assert status == ftar.STATUS_RECOVERABLE and "stale quorum id" in reason
        with pytest.raises(RuntimeError, match="configured this communicator as rank 0 of 2"):
            a.allreduce_host(np.ones(4, np.float32), quorum_id=3, rank=1, n=2)


def test_a_quorum_id_past_int32_is_checked_on_the_low_31_bits_the_step_carries():
    """Quorum ids run to 2**53; the jitted step carries them as int32 scalars (their low 31 bits)."""
    from fthsdp.step.quorum_inputs import STEP_QUORUM_ID_MASK, make_quorum_inputs

    qid = 2**40 + 3
    step_qid = int(make_quorum_inputs(quorum_id=qid).quorum_id)
    assert step_qid == qid & STEP_QUORUM_ID_MASK == 3
    a, b = pair()
    with a, b:
        assert all(configure_both(a, b, qid, qid))
        out, _ = run_both(a, b, np.ones(4, np.float32), np.ones(4, np.float32), step_qid, step_qid)
        assert out["a"][0][0] == out["b"][0][0] == ftar.STATUS_OK, out
        status, reason = a.allreduce_host(np.ones(4, np.float32), quorum_id=qid - 1, rank=0, n=2)
        assert status == ftar.STATUS_RECOVERABLE and "stale quorum id" in reason


def test_abort_unblocks_an_inflight_allreduce_promptly():
    a, b = pair(timeout_s=30.0)
    with a, b:
        assert all(configure_both(a, b, 1, 1))
        result = {}

        def go():
            result["r"] = a.allreduce_host(np.ones(1 << 16, np.float32), quorum_id=1, rank=0, n=2)

        t = threading.Thread(target=go)
        t.start()  # b never joins: a would wait for its 30 s deadline
        time.sleep(0.3)
        t0 = time.perf_counter()
        a.abort("lighthouse declared the peer dead")
        t.join(timeout=5)
        assert not t.is_alive() and time.perf_counter() - t0 < 1.0
        assert result["r"][0] == ftar.STATUS_RECOVERABLE and "aborted" in result["r"][1]
        # Aborted until reconfigured.
        status, reason = a.allreduce_host(np.ones(4, np.float32), quorum_id=1, rank=0, n=2)
        assert status == ftar.STATUS_RECOVERABLE and "aborted" in reason


def test_a_ring_whose_endpoints_know_only_their_neighbours_sums_exactly():
    """Four replicas of two shards, each configured as the Manager configures it: from its
    neighbour view of the quorum as the lighthouse encodes it (fthsdp.control.lighthouse
    _Job.view_reply) and the client decodes it, ``ring_addresses(viewer)``: its own and its two
    neighbours' endpoints, every other member's empty. Both shards' rings form over real
    sockets and sum exactly; a neighbour left empty is refused with the member named."""
    import collections

    from fthsdp.control import quorum as qm
    from fthsdp.control.lighthouse import _Job, pb2
    from fthsdp.control.lighthouse_client import quorum_from_proto

    n, shards = 4, 2
    comms = [ftar.Communicator(num_shards=shards, timeout_s=5.0, chunk_bytes=256, chunks=2, streams=2)
             for _ in range(n)]
    try:
        q = qm.Quorum(1, tuple(qm.Member(str(r), 0, tuple(c.addresses), f"127.0.0.1:{30000 + r}", shards)
                               for r, c in enumerate(comms)), 0, tuple(map(str, range(n))), ())
        job = _Job("job")
        for r, c in enumerate(comms):
            raw = job.view_reply(q, str(r), 0, collections.Counter(), neighbours=True)
            view = quorum_from_proto(pb2.QuorumResponse.FromString(raw).quorum)
            members = view.ring_addresses(str(r))
            assert sum(m == [""] * shards for m in members) == 1  # the one member it does not connect to
            c.configure("job", 1, r, members, timeout_s=5.0, wait=False)
        assert all(c.wait_configured(6.0) for c in comms)
        xs = {(r, k): np.arange(1001, dtype=np.float32) * (r + 1) + k for r in range(n) for k in range(shards)}
        out: dict[tuple[int, int], tuple] = {}

        def go(r: int, k: int) -> None:
            out[(r, k)] = comms[r].allreduce_host(xs[(r, k)], quorum_id=1, rank=r, n=n, shard=k)

        ts = [threading.Thread(target=go, args=key) for key in xs]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=60)
        assert all(out[key] == (0, "") for key in xs), out
        for (r, k), x in xs.items():
            np.testing.assert_array_equal(x, np.arange(1001, dtype=np.float32) * sum(range(1, n + 1)) + n * k)
        with pytest.raises(ValueError, match="member 1: "):
            comms[0].configure("job", 2, 0, [comms[0].address, ",", ",", comms[3].address])
    finally:
        for c in comms:
            c.close()


def test_bad_arguments_fail_with_a_clear_message():
    with pytest.raises(ValueError, match="streams must be in"):
        ftar.Communicator(streams=0)
    c = ftar.Communicator()
    with c:
        with pytest.raises(ValueError, match="rank 2 outside ring of 2"):
            c.configure("job", 1, 2, [c.address, c.address])
        with pytest.raises(ValueError, match="not host:port"):
            c.configure("job", 1, 0, [c.address, "nonsense"])
        # a name that does not resolve fails the ring (RECOVERABLE, with why), not the process;
        # and only the right neighbour's is looked up (rank 1 of 3: member 2). (A 64-character
        # label is no DNS name: the resolver refuses it at once, with no query to a name server.)
        gone = "a" * 64 + ".invalid:7000"
        r = c.configure("job", 2, 1, [gone, c.address, gone], timeout_s=5)
        assert not r and f"right neighbour {gone}: cannot resolve host" in r.reason, r
        status, reason = c.allreduce_host(np.ones(4, np.float32), quorum_id=2, rank=1, n=3)
        assert status == ftar.STATUS_RECOVERABLE and "cannot resolve host" in reason, (status, reason)
        # an all-reduce in place needs the caller's own buffer: a strided view would be summed as a copy
        with pytest.raises(ValueError, match="C-contiguous"):
            c.allreduce_host(np.ones((4, 4), np.float32)[:, ::2], quorum_id=2, rank=1, n=3)
        with pytest.raises(ValueError, match="a week"):  # (its deadline's nanoseconds overflowed)
            c.configure("job", 3, 0, [c.address, c.address], timeout_s=1e10)
    with pytest.raises(ValueError, match="a week"):
        ftar.Communicator(timeout_s=1e10)


def test_unknown_communicator_handle_raises_inside_jit():
    import jax
    import jax.numpy as jnp

    from jax.sharding import Mesh

    from fthsdp.step.quorum_inputs import make_quorum_inputs
    from fthsdp.step.sharding import AXIS

    cpu = jax.local_devices(backend="cpu")[0]
    mesh = Mesh(np.array([cpu]), (AXIS,))  # the CPU handler raises at once (the GPU one reports later)
    q = make_quorum_inputs(num_contributing=2, num_members=2, num_configured=2, rank=0, quorum_id=1, comm=999)
    put = lambda x: jax.device_put(x, cpu)  # noqa: E731
    with pytest.raises(jax.errors.JaxRuntimeError, match="unknown communicator handle 999"):
        jax.block_until_ready(jax.jit(lambda g, q: ftar.allreduce(g, q, mesh))({"w": put(jnp.ones(4))}, q))
    # A ring of one needs no communicator: the sum is the input, status OK.
    q1 = make_quorum_inputs(comm=-1)
    s, st = jax.jit(lambda g, q: ftar.allreduce(g, q, mesh))({"w": put(jnp.arange(4.0))}, q1)
    np.testing.assert_array_equal(np.asarray(s["w"]), np.arange(4.0))
    assert np.asarray(st).tolist() == [0]
