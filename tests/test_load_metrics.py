"""The lighthouse's load as Prometheus series (fthsdp.observe.load_metrics): calls its budgets
held back, calls its checks refused (by status code), its budget, the decision's cost."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fthsdp.control import auth
from fthsdp.control.admission import FairnessLimits
from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
from fthsdp.control.lighthouse_client import LighthouseClient, LighthouseError
from fthsdp.observe.load_metrics import LoadCollector, LoadSnapshot


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus text exposition: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_snapshot_becomes_conventional_series():
    snap = LoadSnapshot(held_total=7, held_now=2, refused_by_code={"UNAUTHENTICATED": 3, "INVALID_ARGUMENT": 1},
                        connection_budget_calls_per_s=100.0, sessions_opened=4, session_messages=900,
                        relay_batches=120, evaluations=50, evaluation_s=0.25, jobs=1, sessions_open=3,
                        relay_streams_open=1, relayed_messages=600, heartbeats=5_000, beating_processes=2_048,
                        detect_s=3.27, beat_interval_s=0.409)
    reg = CollectorRegistry()
    reg.register(LoadCollector(lambda: snap))
    got = samples(generate_latest(reg).decode())
    assert got[("fthsdp_lighthouse_calls_held_total", ())] == 7
    assert got[("fthsdp_lighthouse_calls_parked", ())] == 2
    assert got[("fthsdp_lighthouse_calls_refused_total", (("code", "UNAUTHENTICATED"),))] == 3
    assert got[("fthsdp_lighthouse_calls_refused_total", (("code", "INVALID_ARGUMENT"),))] == 1
    assert got[("fthsdp_lighthouse_connection_budget_calls_per_second", ())] == 100.0
    assert got[("fthsdp_lighthouse_session_messages_total", ())] == 900
    assert got[("fthsdp_lighthouse_relay_batches_total", ())] == 120
    assert got[("fthsdp_lighthouse_relayed_messages_total", ())] == 600
    assert got[("fthsdp_lighthouse_sessions_open", ())] == 3 and got[("fthsdp_lighthouse_relay_streams_open", ())] == 1
    assert got[("fthsdp_lighthouse_quorum_evaluation_seconds_total", ())] == 0.25
    assert got[("fthsdp_lighthouse_jobs", ())] == 1
    assert got[("fthsdp_lighthouse_heartbeats_total", ())] == 5_000
    assert got[("fthsdp_lighthouse_beating_processes", ())] == 2_048
    assert got[("fthsdp_lighthouse_detect_seconds", ())] == 3.27  # an alert: detection wider than configured
    assert got[("fthsdp_lighthouse_beat_interval_seconds", ())] == 0.409


@pytest.fixture
def busy_lighthouse():
    secret = auth.new_secret()
    config = LighthouseConfig(secret=secret, metrics_bind="127.0.0.1:0",
                              fairness=FairnessLimits(connection_calls_per_s=20.0, connection_burst=2,
                                                      new_connection_tokens=2))
    with LighthouseThread(config) as lh:
        yield lh, secret


def test_a_running_lighthouse_serves_what_it_held_and_refused(busy_lighthouse):
    """A real lighthouse over HTTP: a status reader past its connection's budget is held (not
    refused), a wrong secret and a malformed body are refused, and /metrics says so by code."""
    lh, secret = busy_lighthouse
    with LighthouseClient(lh.address, "x", "x", status_key=auth.status_key(secret)) as reader:
        for _ in range(8):  # 2 tokens, then 20 calls/s: ~6 held
            reader.status(job_id="")
    with LighthouseClient(lh.address, "job", "0", key=auth.job_key(auth.new_secret(), "job"),
                          rpc_timeout_s=5.0) as stranger:
        with pytest.raises(LighthouseError) as e:
            stranger.heartbeat()
        assert e.value.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    with grpc.insecure_channel(lh.address) as ch:
        call = ch.unary_unary("/fthsdp.v1.Lighthouse/Heartbeat", request_serializer=None,
                              response_deserializer=None)
        with pytest.raises(grpc.RpcError) as bad:
            call(b"\xff\xff\xff not a protobuf", timeout=5)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with LighthouseClient(lh.address, "job", "0", key=auth.job_key(secret, "job")) as member:
        member.heartbeat(0)
        time.sleep(0.6)  # the lighthouse recounts its beating processes every 0.25 s
    url = f"http://{lh.server.metrics_server.address}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    got = samples(text)
    assert got[("fthsdp_lighthouse_calls_held_total", ())] >= 4, got
    assert got[("fthsdp_lighthouse_connection_budget_calls_per_second", ())] == 20.0
    assert got[("fthsdp_lighthouse_calls_refused_total", (("code", "INVALID_ARGUMENT"),))] >= 1
    assert sum(v for (name, labels), v in got.items() if name == "fthsdp_lighthouse_calls_refused_total"
               and labels[0][1] in ("UNAUTHENTICATED", "PERMISSION_DENIED")) >= 1
    assert got[("fthsdp_lighthouse_calls_parked", ())] == 0  # every held call was served by now
    assert got[("fthsdp_lighthouse_heartbeats_total", ())] == 1  # the member's (the stranger's was refused)
    assert got[("fthsdp_lighthouse_beating_processes", ())] == 1
    assert got[("fthsdp_lighthouse_detect_seconds", ())] == lh.config.detect_s  # one process: not paced
    assert got[("fthsdp_lighthouse_beat_interval_seconds", ())] == 0
    assert "# TYPE fthsdp_root_cause_info gauge" in text  # beside the verdicts, in one exposition
