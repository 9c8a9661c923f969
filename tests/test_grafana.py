"""fthsdp's Grafana dashboard (fthsdp/observe/grafana.py, ``fthsdp status --grafana-dashboard``):
a well-formed dashboard JSON model, every query parsed by Prometheus's own PromQL parser
(``promtool check rules`` over the queries as recording rules), and every series it names served
by one of fthsdp's exporters. Its queries return the series of a real job in a real Prometheus:
tests/test_observe_e2e.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from fthsdp.cli import main as fthsdp_main
from fthsdp.observe.grafana import ROWS, dashboard, dashboard_json, queries
from fthsdp.observe.load_metrics import LoadCollector, LoadSnapshot
from fthsdp.observe.metrics import LighthouseMetrics, ReplicaMetrics
from fthsdp.observe.verdict_metrics import RootCauseMetrics

PROMTOOL = shutil.which("promtool")


def as_promql(expr: str, job: str = ".*", window: str = "1m") -> str:
    """A panel's query as Prometheus takes it: Grafana's variables replaced as Grafana would."""
    return expr.replace("$job", job).replace("$__rate_interval", window)


def served_series() -> set[str]:
    """The sample names fthsdp's exporters serve (replica, dashboard, lighthouse load, verdicts)."""
    names: set[str] = set()
    registries = [ReplicaMetrics("j", "0").registry, LighthouseMetrics().registry, RootCauseMetrics().registry]
    registries[-1].register(LoadCollector(LoadSnapshot))
    for r in registries:
        for fam in r.collect():
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(fam.type, ("",))
            names.update(fam.name + s for s in suffixes)
    return names


def test_the_cli_prints_the_dashboard_and_it_is_well_formed(capsys):
    assert fthsdp_main(["status", "--grafana-dashboard"]) == 0  # no lighthouse needed
    board = json.loads(capsys.readouterr().out)
    assert board == dashboard() and dashboard_json() == json.dumps(board, indent=1) + "\n"
    assert board["uid"] == "fthsdp" and isinstance(board["schemaVersion"], int)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus" and variables["job"]["allValue"] == ".*"
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert [p["title"] for p in panels if p["type"] == "row"] == [r.title for r in ROWS]
    assert sum(p["type"] == "timeseries" for p in panels) == sum(len(r.panels) for r in ROWS)
    # the grid: inside its 24 columns, and no two panels overlap
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']!r} overlaps another panel"
        cells |= mine
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["description"] and p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["legendFormat"] for t in p["targets"]), p["title"]


def test_every_series_a_panel_reads_is_one_fthsdp_serves():
    served = served_series()
    assert {"fthsdp_commits_total", "fthsdp_step_seconds_bucket", "fthsdp_lighthouse_heartbeats_total",
            "fthsdp_root_cause_info", "fthsdp_lighthouse_quorum_size"} <= served  # the exporters were read
    for title, expr in queries(dashboard()):
        named = set(re.findall(r"\bfthsdp_[a-z_]+", expr))
        # a panel reads fthsdp's series; the annotation, Prometheus's ALERTS of fthsdp's alerts
        assert (named or expr.startswith('ALERTS{alertname=~"Fthsdp.*"')) and named <= served, (title, named - served)


def test_the_job_variable_scopes_every_series_that_carries_a_job():
    """A series exported with a training job's label is read for the chosen jobs only; the
    lighthouse's own load and whether the lighthouse answers (no job label) are read whole."""
    without_job = {"fthsdp_lighthouse_up"} | {
        fam.name + ("_total" if fam.type == "counter" else "") for fam in LoadCollector(LoadSnapshot).collect()}
    unscoped = [(title, name) for title, expr in queries(dashboard())
                for name, matcher in re.findall(r"\b(fthsdp_[a-z_]+)(\{[^}]*\})?", expr)
                if name not in without_job and 'job=~"$job"' not in matcher]
    assert not unscoped, unscoped


@pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (scripts/install_system_deps.sh installs "
                                         "Debian's prometheus)")
def test_promtool_parses_every_query(tmp_path):
    qs = queries(dashboard())
    rules = {"groups": [{"name": "grafana", "rules": [
        {"record": f"fthsdp:panel_{i}", "expr": as_promql(expr)} for i, (_, expr) in enumerate(qs)]}]}
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    p = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and f"SUCCESS: {len(qs)} rules found" in p.stdout, p.stdout + p.stderr
    # and the check can fail: a query with an unbalanced parenthesis is refused
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "fthsdp:bad", "expr": as_promql(qs[0][1]) + ")"}]}]}))
    assert subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, timeout=60).returncode != 0
