"""FTAR's progress counters (issue 16, root-cause analysis): real rings over
loopback sockets in one process. What a stuck all-reduce reports (the ring
step, which neighbour's data it waits for, for how long) and what the
throttle test hook (FTHSDP_FTAR_TEST_SEND_DELAY_S) does to one stream's
carried rate, which is how the lighthouse names a slow link."""

import os
import threading
import time

import numpy as np
import pytest

from fthsdp.collective import ftar

ENV = "FTHSDP_FTAR_TEST_SEND_DELAY_S"


def ring(n, throttled=(), delay_s=0.02, **kw):
    comms = []
    for i in range(n):
        if i in throttled:
            os.environ[ENV] = str(delay_s)
        try:
            comms.append(ftar.Communicator(timeout_s=20.0, **kw))
        finally:
            os.environ.pop(ENV, None)
    members = [c.address for c in comms]
    for r, c in enumerate(comms):
        c.configure("job", 1, r, members, timeout_s=10.0, wait=False)
    for c in comms:
        assert c.wait_configured(11.0)
    return comms


def run_all(comms, xs):
    out = {}

    def go(r):
        out[r] = comms[r].allreduce_host(xs[r], quorum_id=1, rank=r, n=len(comms))

    ts = [threading.Thread(target=go, args=(r,)) for r in range(len(comms))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    return out


def rate(p):
    busy = sum(p["send_busy_s"])
    return sum(p["bytes_sent"]) / busy if busy > 0 else float("inf")


def test_idle_endpoint_reports_no_op():
    with ftar.Communicator(num_shards=2) as c:
        ps = c.progress()
        assert len(ps) == 2
        for p in ps:
            assert p["in_op"] is False and p["rank"] == -1 and p["op_s"] == 0
            assert len(p["bytes_sent"]) == c.options.streams and not any(p["bytes_sent"]) and not any(p["bytes_received"])


def test_stuck_allreduce_reports_its_ring_step_and_how_long_it_has_waited_on_the_left():
    a, b = ftar.Communicator(timeout_s=30.0), ftar.Communicator(timeout_s=30.0)
    with a, b:
        members = [a.address, b.address]
        a.configure("job", 1, 0, members, timeout_s=5.0, wait=False)
        b.configure("job", 1, 1, members, timeout_s=5.0, wait=False)
        assert a.wait_configured(6.0) and b.wait_configured(6.0)
        result = {}
        t = threading.Thread(target=lambda: result.update(r=a.allreduce_host(
            np.ones(1 << 14, np.float32), quorum_id=1, rank=0, n=2)))
        t.start()  # b never joins: a sent its first chunks and waits for b's
        try:
            time.sleep(0.5)
            p = a.progress()[0]
            assert p["in_op"] and p["rank"] == 0 and p["n"] == 2 and p["ring_steps"] == 2
            assert p["ring_step"] == 0 and p["recv_done"] == 0 and p["recv_total"] >= 2
            assert p["op_s"] >= 0.4 and p["since_recv_s"] >= 0.4  # nothing came from the left
            assert p["bytes_sent"][0] > 0  # its own first segment left
            assert b.progress()[0]["in_op"] is False  # the culprit is not in the op at all
        finally:
            a.abort("test over")
            t.join(timeout=5)
        assert result["r"][0] == ftar.STATUS_RECOVERABLE
        assert a.progress()[0]["in_op"] is False


def test_counters_move_with_a_finished_allreduce():
    comms = ring(3, chunk_bytes=4096, chunks=2)
    try:
        xs = [np.full(50_000, float(r), np.float32) for r in range(3)]
        out = run_all(comms, xs)
        assert all(out[r] == (0, "") for r in range(3)), out
        for c in comms:
            p = c.progress()[0]
            assert p["in_op"] is False and p["n"] == 3 and p["op_seq"] == 1
            # 2(n-1)/n of the buffer (plus chunk headers) went each way, over the streams
            assert sum(p["bytes_sent"]) >= 0.99 * 50_000 * 4 * 2 * 2 / 3
            assert sum(p["bytes_received"]) >= 0.99 * 50_000 * 4 * 2 * 2 / 3
            assert all(b > 0 for b in p["send_busy_s"])
    finally:
        for c in comms:
            c.close()


def test_throttle_hook_slows_exactly_one_stream():
    comms = ring(3, throttled=(1,), delay_s=0.02, chunk_bytes=16384, chunks=2)
    try:
        xs = [np.full(60_000, 1.0, np.float32) for _ in range(3)]
        out = run_all(comms, xs)
        assert all(out[r] == (0, "") for r in range(3)), out
        np.testing.assert_array_equal(xs[0], np.full(60_000, 3.0, np.float32))
        rates = [rate(c.progress()[0]) for c in comms]
        # rank 1's sender waits 20 ms per 16 KiB chunk (<= 0.8 MB/s); the others move GB/s on loopback
        assert rates[1] < 1e6, rates
        assert min(rates[0], rates[2]) > 10 * rates[1], rates
    finally:
        for c in comms:
            c.close()


def test_bad_throttle_value_is_refused_with_what_to_do():
    os.environ[ENV] = "fast"
    try:
        with pytest.raises(ValueError, match=f"{ENV}=fast is not a number of seconds.*unset it"):
            ftar.Communicator()
    finally:
        os.environ.pop(ENV, None)
