"""fthsdp's Prometheus alerting rules (fthsdp/observe/alerts.yml), checked and evaluated by
Prometheus's own rule engine (``promtool check rules`` / ``promtool test rules``): every alert
fires on the series it is about, with its labels and summary, and stays quiet on a healthy
job's. Loaded into a real Prometheus against a real job: tests/test_observe_e2e.py."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from fthsdp.cli import main as fthsdp_main
from fthsdp.observe.metrics import alerts_file, scrape_config

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    not PROMTOOL, reason="promtool is not installed (scripts/install_system_deps.sh installs Debian's prometheus)")


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(alerts_file().read_text())["groups"] for r in g["rules"]]


def test_every_alert_says_how_bad_what_and_what_to_do(capsys):
    alerts = rules()
    names = [r["alert"] for r in alerts]
    assert len(names) == len(set(names)) == 12, names
    for r in alerts:
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r
        assert r["annotations"]["summary"] and len(r["annotations"]["description"]) > 80, r
    assert fthsdp_main(["status", "--prometheus-rules"]) == 0  # no lighthouse needed
    assert capsys.readouterr().out == alerts_file().read_text()
    config = json.loads(scrape_config("targets.json", rule_files=[alerts_file()]))
    assert config["rule_files"] == [str(alerts_file())] and "rule_files" not in json.loads(scrape_config("t.json"))


@needs_promtool
def test_promtool_accepts_the_rules():
    p = subprocess.run([PROMTOOL, "check", "rules", str(alerts_file())], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "SUCCESS: 12 rules found" in p.stdout, p.stdout + p.stderr


def alert(name: str, at: str, labels: dict | None = None, summary: str | None = None) -> dict:
    """A promtool alert_rule_test: ``name`` at ``at`` is quiet (``labels`` None) or fires once with
    these labels and summary."""
    exp = [] if labels is None else [{"exp_labels": labels, "exp_annotations": {"summary": summary}}]
    return {"eval_time": at, "alertname": name, "exp_alerts": exp}


# (input series, alert tests) per case; one minute between samples. promtool compares every
# annotation, so the test's copy of the rules keeps each alert's summary only (its description's
# template is checked by `promtool check rules` above).
CASES = {
    "lighthouse unreachable for a minute": (
        [("fthsdp_lighthouse_up{instance='dash:1'}", "1 1 0 0 0 0"),
         ("fthsdp_lighthouse_up{instance='dash:2'}", "1x5")],
        [alert("FthsdpLighthouseUnreachable", "2m"),  # just gone: pending, not firing
         alert("FthsdpLighthouseUnreachable", "4m", {"severity": "critical", "instance": "dash:1"},
               "The dashboard at dash:1 cannot read the lighthouse's Status")]),
    "a job below its configured replicas for 10 minutes; another whole; one that finished short": (
        [("fthsdp_lighthouse_quorum_size{job='j',instance='d'}", "3x5 2x20"),
         ("fthsdp_lighthouse_replicas_configured{job='j',instance='d'}", "3x26"),
         ("fthsdp_lighthouse_job_finished{job='j',instance='d'}", "0x26"),
         ("fthsdp_lighthouse_quorum_size{job='f',instance='d'}", "3x5 2x20"),
         ("fthsdp_lighthouse_replicas_configured{job='f',instance='d'}", "3x26"),
         ("fthsdp_lighthouse_job_finished{job='f',instance='d'}", "0x5 1x20"),
         ("fthsdp_lighthouse_quorum_size{job='k',instance='d'}", "3x26"),
         ("fthsdp_lighthouse_replicas_configured{job='k',instance='d'}", "3x26")],
        [alert("FthsdpJobDegraded", "12m"),
         alert("FthsdpJobDegraded", "20m", {"severity": "warning", "job": "j", "instance": "d"},
               "Job j trains on 2 replica(s), fewer than configured")]),
    "a job whose steps stopped; another stepping; one that finished": (
        [("fthsdp_lighthouse_replica_step{job='f',replica='0',instance='d'}", "0+1x10 10x30"),
         ("fthsdp_lighthouse_job_finished{job='f',instance='d'}", "0x10 1x30"),
         ("fthsdp_lighthouse_replica_step{job='j',replica='0',instance='d'}", "0+1x10 10x30"),
         ("fthsdp_lighthouse_replica_step{job='j',replica='1',instance='d'}", "0+1x10 10x30"),
         ("fthsdp_lighthouse_replica_step{job='k',replica='0',instance='d'}", "0+1x40")],
        [alert("FthsdpJobStalled", "22m"),  # stalled 12 minutes: not yet
         alert("FthsdpJobStalled", "30m", {"severity": "critical", "job": "j"},
               "Job j: no replica's step changed for 15 minutes")]),
    "failures: four in a few minutes (exported at 0 before the first); one elsewhere": (
        [("fthsdp_lighthouse_failures_total{job='j',kind='dead',instance='d'}", "0 0 0 1 2 2 3 3 3"),
         ("fthsdp_lighthouse_failures_total{job='j',kind='left quorum',instance='d'}", "0x6 1 1"),
         ("fthsdp_lighthouse_failures_total{job='k',kind='dead',instance='d'}", "0x4 1x4")],
        [alert("FthsdpReplicaFailures", "6m"),  # 3 so far
         alert("FthsdpReplicaFailures", "8m", {"severity": "warning", "job": "j"},
               "Job j: more than 3 replica failures in the last hour")]),
    "silent data corruption: the counter's first sample is the event": (
        [("fthsdp_lighthouse_sdc_mismatches_total{job='j',replica='2',fatal='false',instance='d'}", "_x5 1x40")],
        [alert("FthsdpSilentDataCorruption", "5m", {"severity": "critical", "job": "j", "replica": "2",
                                                    "fatal": "false", "instance": "d"},
               "Job j: replica 2's state disagreed with the others (fatal=false)"),
         alert("FthsdpSilentDataCorruption", "25m")]),  # 20 minutes later, nothing new: quiet again
    "a straggler named for 5 minutes; a job without a culprit": (
        [("fthsdp_root_cause_info{job='j',kind='slow',replica='2',process='0',peer='',instance='lh'}", "1x10"),
         ("fthsdp_root_cause_info{job='k',kind='none',replica='',process='',peer='',instance='lh'}", "1x10")],
        [alert("FthsdpStraggler", "3m"),
         alert("FthsdpStraggler", "8m", {"severity": "warning", "job": "j", "kind": "slow", "replica": "2",
                                         "process": "0", "instance": "lh"},
               "Job j waits on replica 2 (slow)")]),
    "heartbeats paced at the cap, detection slowed; another lighthouse paced below it": (
        [("fthsdp_lighthouse_beat_interval_seconds{instance='lh:1'}", "1x20"),
         ("fthsdp_lighthouse_detect_seconds{instance='lh:1'}", "8x20"),
         ("fthsdp_lighthouse_beat_interval_seconds{instance='lh:2'}", "0.4x20"),
         ("fthsdp_lighthouse_detect_seconds{instance='lh:2'}", "3.2x20")],
        [alert("FthsdpHeartbeatsOverBudget", "15m", {"severity": "warning", "instance": "lh:1"},
               "The lighthouse at lh:1 paces heartbeats at its 1 s cap"),
         alert("FthsdpSlowFailureDetection", "15m", {"severity": "info", "instance": "lh:1"},
               "The lighthouse at lh:1 declares a death after 8 s of silence")]),
    "wrong credentials, 5 a minute; malformed calls elsewhere do not count": (
        [("fthsdp_lighthouse_calls_refused_total{instance='lh:1',code='UNAUTHENTICATED'}", "0+5x20"),
         ("fthsdp_lighthouse_calls_refused_total{instance='lh:2',code='INVALID_ARGUMENT'}", "0+100x20")],
        [alert("FthsdpUnauthenticatedCalls", "20m", {"severity": "warning", "instance": "lh:1"},
               "The lighthouse at lh:1 refused 50 calls with a wrong credential in 10 minutes")]),
    "calls held back by a budget for 5 minutes": (
        [("fthsdp_lighthouse_calls_parked{instance='lh:1'}", "3x10"),
         ("fthsdp_lighthouse_calls_parked{instance='lh:2'}", "0x10")],
        [alert("FthsdpLighthouseShedding", "8m", {"severity": "warning", "instance": "lh:1"},
               "The lighthouse at lh:1 has held calls back for 5 minutes")]),
    "a replica retrying a step every 10 s; another once in 20 minutes": (
        [("fthsdp_retries_total{job='j',replica='1',instance='r1'}", "0+6x30"),
         ("fthsdp_retries_total{job='j',replica='0',instance='r0'}", "0x10 1x20")],
        [alert("FthsdpRetryStorm", "25m", {"severity": "warning", "job": "j", "replica": "1", "instance": "r1"},
               "Replica 1 of job j retries 0.1 steps a second")]),
    "a replica that skipped one update for non-finite gradients (exported at 0 before); another none": (
        [("fthsdp_nonfinite_skips_total{job='j',replica='0',instance='r0'}", "0x5 1x30"),
         ("fthsdp_nonfinite_skips_total{job='j',replica='1',instance='r1'}", "0x35")],
        [alert("FthsdpNonFiniteGradients", "4m"),
         alert("FthsdpNonFiniteGradients", "8m", {"severity": "warning", "job": "j", "replica": "0", "instance": "r0"},
               "Replica 0 of job j skipped updates for non-finite gradients"),
         alert("FthsdpNonFiniteGradients", "30m")]),  # 24 minutes later, nothing new: quiet again
}


@needs_promtool
def test_each_alert_fires_on_its_series_and_stays_quiet_on_a_healthy_job(tmp_path):
    doc = yaml.safe_load(alerts_file().read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            r["annotations"] = {"summary": r["annotations"]["summary"]}
    (tmp_path / "rules.yml").write_text(json.dumps(doc))
    tested = {t["alertname"] for _, tests in CASES.values() for t in tests if t["exp_alerts"]}
    assert tested == {r["alert"] for r in rules()}, "every alert has a firing case"
    spec = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [
        {"name": name, "interval": "1m",
         "input_series": [{"series": s.replace("'", '"'), "values": v} for s, v in series],
         "alert_rule_test": [{**t, "exp_alerts": [{**a, "exp_labels": {"alertname": t["alertname"], **a["exp_labels"]}}
                                                  for a in t["exp_alerts"]]} for t in tests]}
        for name, (series, tests) in CASES.items()]}
    (tmp_path / "tests.yml").write_text(json.dumps(spec, indent=1))
    p = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert "SUCCESS" in p.stdout, p.stdout
