"""Root cause for replicas of several processes, through a real lighthouse (gRPC, its own
thread) and real heartbeating clients: a follower's phase reports reach the analysis (its
FTAR wait is its replica's edge of the wait-for graph), a frozen follower under a live
leader is named as (replica, process), and the verdict is served as a Prometheus series
on the lighthouse's --metrics-bind address."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import LighthouseClient
from fthsdp.observe.phase import Phase, PhaseSnapshot

JOB = "rcjob"


class Since:
    """A phase entered now: its report's in-phase (and waiting) time grows with the clock."""

    def __init__(self, phase: Phase, waiting_on: str = "") -> None:
        self.phase, self.waiting_on, self.t0 = phase, waiting_on, time.monotonic()

    def __call__(self) -> PhaseSnapshot:
        dt = time.monotonic() - self.t0
        return PhaseSnapshot(self.phase, 7, dt, waiting_on=self.waiting_on,
                             waiting_s=dt if self.waiting_on else 0.0)


def wait_for(fn, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except LookupError as e:  # the job is not on the lighthouse until a leader is heard (a loaded CI)
            last = e
        else:
            if last:
                return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last}")


def verdict(client: LighthouseClient):
    (job,) = client.status(JOB)
    return job.root_cause


def scrape(address: str) -> str:
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()


def test_follower_phases_and_a_frozen_follower_are_named_by_process():
    config = LighthouseConfig(detect_s=1.5, rca_interval_s=0.1, metrics_bind="127.0.0.1:0")
    with LighthouseThread(config) as lh:
        mk = lambda rid, p=0, n=1: LighthouseClient(lh.address, JOB, rid, heartbeat_interval_s=0.05,  # noqa: E731
                                                     process_index=p, num_processes=n)
        # Three replicas of 2 processes (every replica of a job has the same shape).
        (r0, r0f), (r1, r1f), (r2, r2f) = [(mk(r, 0, 2), mk(r, 1, 2)) for r in ("0", "1", "2")]
        clients = (r0, r0f, r1, r1f, r2, r2f)
        try:
            for c in (r0, r0f, r1):
                c.phase_source = Since(Phase.IDLE)
            # Only the follower of replica 1 waits, in its own ring, on replica 2, which computes on.
            r1f.phase_source = Since(Phase.ALLREDUCE, waiting_on="2")
            r2.phase_source = r2f.phase_source = Since(Phase.COMPUTING)
            # One shard per process; the addresses are registered, never dialled.
            for i, c in enumerate(clients):
                c.register([f"127.0.0.1:{9 + i}"], "", 2)
                c.start_heartbeats()
            # Every process heard first (its first beat opens its session stream, which may take a
            # while on a loaded machine): asked before replica 1 was heard, replica 0 formed a
            # quorum alone and replica 1 then waited for it in vain.
            wait_for(lambda: len([r for j in r0.status() for r in j.replicas if not r.dead
                                  and not r.silent_processes]) == 3, 10, "every process heard")
            # The analysis runs once the job has a quorum: replicas 0 and 1 ask (a majority; 2, live
            # but not asking, is left out after the join timeout); the FTAR waits need no membership.
            with ThreadPoolExecutor(2) as pool:
                asks = [pool.submit(c.get_quorum, 7, ftar_addresses=[f"127.0.0.1:{9 + 2 * i}"], local_world_size=2,
                                    timeout_s=20) for i, c in enumerate((r0, r1))]
                assert all(f.result().member_ids for f in asks)
            v = wait_for(lambda: (x := verdict(r0)) is not None and x.kind == "slow" and x, 10, "a slow verdict")
            assert (v.culprit, v.process) == ("2", 0), v
            assert v.wait_chain == ("1", "2") and "1 waits in FTAR for data from 2" in v.evidence, v

            # The follower freezes (its heartbeats stop; its leader beats on) while replica 0's
            # follower waits on replica 1 in its ring: replica 1 is the root, named by its silent process.
            r0f.phase_source = Since(Phase.ALLREDUCE, waiting_on="1")
            r1f.stop_heartbeats()
            v = wait_for(lambda: (x := verdict(r0)) is not None and x.kind in ("frozen", "dead") and x, 10,
                         "a frozen or dead verdict")
            assert (v.culprit, v.process) == ("1", 1), v
            assert "from its process(es) 1" in v.evidence and "replica 1 process 1" in v.describe(), v

            # The lighthouse serves the verdict: one info series per job, and the changes by kind.
            text = wait_for(lambda: (t := scrape(lh.server.metrics_server.address))
                            and 'replica="1"' in t and 'process="1"' in t and t, 5, "the verdict series")
            info = [ln for ln in text.splitlines() if ln.startswith("fthsdp_root_cause_info{")]
            assert len(info) == 1, info
            assert f'job="{JOB}"' in info[0] and f'kind="{v.kind}"' in info[0] and info[0].endswith(" 1.0"), info
            assert f'fthsdp_root_cause_changes_total{{job="{JOB}",kind="slow"}}' in text
            assert f'fthsdp_root_cause_changes_total{{job="{JOB}",kind="{v.kind}"}}' in text
        finally:
            for c in clients:
                c.close()


def test_status_names_the_lighthouse_metrics_target():
    from fthsdp.observe.lighthouse_view import StatusPoller
    from fthsdp.observe.metrics import status_targets

    with LighthouseThread(LighthouseConfig(metrics_bind="127.0.0.1:0")) as lh:
        address = lh.server.metrics_server.address
        poller = StatusPoller(lh.address, rpc_timeout_s=5.0)
        try:
            view = poller.poll()
        finally:
            poller.close()
        assert view.metrics_address == address
        assert {"targets": [address], "labels": {"role": "lighthouse"}} in status_targets(view)
        assert "fthsdp_root_cause" in scrape(address)  # served (the counters' help text) before any job


def test_a_bad_metrics_bind_is_refused_with_the_reason():
    import pytest

    with pytest.raises(ValueError, match="metrics_bind"):
        LighthouseConfig(metrics_bind="nonsense")
