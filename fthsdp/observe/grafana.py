"""A Grafana dashboard of fthsdp's Prometheus series (``fthsdp status --grafana-dashboard``).

The panels are declared once, below, as plain data (a row's title, then each
panel's title, unit, what it tells and its PromQL); :func:`dashboard` turns them
into Grafana's dashboard JSON model, laid out two panels a line, with two
variables: the Prometheus data source and the training job(s) to show. Import
the printed JSON into Grafana (Dashboards, New, Import).

Which series each row reads, and who serves them:

* *Job* and *failures*: ``fthsdp dashboard``'s /metrics (the lighthouse's Status,
  polled: ``fthsdp_lighthouse_*{job}``) and the replicas' own (``fthsdp_step``,
  ``fthsdp_commits_total``, ...);
* *data plane*: the replicas' own;
* *lighthouse*: the lighthouse's own /metrics (``fthsdp lighthouse
  --metrics-bind``; ``fthsdp run`` and ``fthsdp ray`` always serve it): its load,
  and the root-cause verdicts (those carry ``job``).

Every query is checked against a real Prometheus that scrapes a real job
(``tests/test_observe_e2e.py``), so a renamed series breaks a test, not a
user's dashboard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["Panel", "Row", "ROWS", "dashboard", "queries", "dashboard_json"]

UID = "fthsdp"
# Grafana's dashboard JSON model as of Grafana 10/11 (schemaVersion 39 imports into later versions too).
SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
J = '{job=~"$job"}'  # the job variable's matcher ("All" is ".*")
RATE = "$__rate_interval"  # Grafana's window for rate(): at least four scrape intervals


@dataclass(frozen=True)
class Panel:
    """One time-series panel: ``targets`` are (PromQL, legend) pairs."""

    title: str
    unit: str  # Grafana's unit id: "s", "short", "Bps", "percentunit", "none"
    description: str
    targets: tuple[tuple[str, str], ...]
    stack: bool = False  # stacked areas (parts of a whole, e.g. replicas per state)


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def _quantile(q: float, histogram: str, by: str = "job", window: str = RATE, matcher: str = J) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({histogram}_bucket{matcher}[{window}])))"


ROWS: tuple[Row, ...] = (
    Row("Job", (
        Panel("Quorum size against configured replicas", "short",
              "Replicas in the current quorum, those of them at its step (contributing gradients), and the "
              "replicas the job is configured with. Below the configured line the job trains degraded.",
              ((f"fthsdp_lighthouse_quorum_size{J}", "{{job}} in the quorum"),
               (f"fthsdp_lighthouse_quorum_healthy{J}", "{{job}} healthy"),
               (f"fthsdp_lighthouse_replicas_configured{J}", "{{job}} configured"))),
        Panel("Replicas by state", "short",
              "The lighthouse's word for each replica: healthy, behind (catching up), waiting (asking for a "
              "quorum), outside (heard, not a member) or dead (silent past the detection window).",
              ((f"sum by (state) (fthsdp_lighthouse_replicas{J})", "{{state}}"),), stack=True),
        Panel("Step", "short", "The current quorum's step, and the step each replica last committed.",
              ((f"fthsdp_lighthouse_quorum_max_step{J}", "{{job}} quorum"),
               (f"fthsdp_step{J}", "{{job}} replica {{replica}}"))),
        Panel("Committed steps per second", "short",
              "Each replica's commits per second (caught-up steps count); every process of a replica counts "
              "its commits, so a replica's is the max over them.",
              ((f"max by (job, replica) (rate(fthsdp_commits_total{J}[{RATE}]))", "{{job}} replica {{replica}}"),)),
        Panel("Step time", "s", "Wall time of a committed step (quorum, compute, all-reduce, retries): p50 and p99.",
              ((_quantile(0.5, "fthsdp_step_seconds"), "{{job}} p50"),
               (_quantile(0.99, "fthsdp_step_seconds"), "{{job}} p99"))),
        Panel("Loss", "none", "Training loss of each replica's last healthy step.",
              ((f"fthsdp_loss{J}", "{{job}} replica {{replica}}"),)),
    )),
    Row("Failures and stalls", (
        Panel("Replica failures in the last hour", "short",
              "Replicas declared dead, dropped from the quorum while alive, or gone from the job (left after a "
              "fault), counted over the hour before each point.",
              ((f"sum by (job, kind) (increase(fthsdp_lighthouse_failures_total{J}[1h]))", "{{job}} {{kind}}"),)),
        Panel("Heartbeat age", "s",
              "Seconds since the lighthouse last heard each replica; a replica is declared dead past the detection "
              "window.",
              ((f"fthsdp_lighthouse_heartbeat_age_seconds{J}", "{{job}} replica {{replica}}"),)),
        Panel("Failure detection and the survivors' stall (last hour)", "s",
              "p99 over the last hour of a dead replica's heartbeat silence when declared dead, and of the job's "
              "progress gap around a loss (its last step before to its first after).",
              ((_quantile(0.99, "fthsdp_lighthouse_detection_seconds", window="1h"), "{{job}} detection"),
               (_quantile(0.99, "fthsdp_lighthouse_stall_seconds", window="1h"), "{{job}} stall"))),
        Panel("Retried all-reduces, catch-ups and skipped updates", "short",
              "All-reduce attempts that failed and were retried on a new quorum, steps on which a replica was "
              "behind and fetched the live state from its peers, and updates skipped because the averaged "
              "gradients held a NaN or an infinity, per second.",
              ((f"max by (job, replica) (rate(fthsdp_retries_total{J}[{RATE}]))", "{{job}} {{replica}} retries"),
               (f"max by (job, replica) (rate(fthsdp_catch_ups_total{J}[{RATE}]))",
                "{{job}} {{replica}} catch-ups"),
               (f"max by (job, replica) (rate(fthsdp_nonfinite_skips_total{J}[{RATE}]))",
                "{{job}} {{replica}} skipped updates"))),
        Panel("Who is stalling the job", "short",
              "The lighthouse's root-cause verdict: 1 for the current one, labelled with its kind (none, dead, "
              "frozen, slow, slow_link, unknown) and the culprit replica and process.",
              ((f"fthsdp_root_cause_info{J}", "{{job}}: {{kind}} {{replica}} {{process}} {{peer}}"),)),
        Panel("Silent data corruption", "short",
              "Replicas whose state fingerprint disagreed with the others' after a commit (fatal: no majority, "
              "the job was stopped).",
              ((f"sum by (job, replica, fatal) (fthsdp_lighthouse_sdc_mismatches_total{J})",
                "{{job}} replica {{replica}} fatal={{fatal}}"),)),
    )),
    Row("Data plane", (
        Panel("All-reduce bus bandwidth", "Bps",
              "Ring bus bandwidth of each replica's last committing all-reduce (2(n-1)/n x gradient bytes / time; "
              "a lower bound on FTAR's: the time includes the commit vote and the update).",
              ((f"fthsdp_allreduce_bus_bandwidth_bytes_per_second{J}", "{{job}} replica {{replica}}"),)),
        Panel("Compute and all-reduce time", "s", "p50 of a healthy step's forward and backward, and of the "
              "committing all-reduce with its commit vote and update.",
              ((_quantile(0.5, "fthsdp_compute_seconds"), "{{job}} compute p50"),
               (_quantile(0.5, "fthsdp_allreduce_seconds"), "{{job}} all-reduce p50"))),
    )),
    Row("Lighthouse", (
        Panel("Lighthouse reachable", "short",
              "1 while fthsdp dashboard's polls of the lighthouse's Status succeed.",
              (("fthsdp_lighthouse_up", "{{instance}}"),)),
        Panel("Messages read per second", "short",
              "Heartbeats and session messages the lighthouse reads, and the share that came through relays.",
              ((f"rate(fthsdp_lighthouse_heartbeats_total[{RATE}])", "{{instance}} heartbeats"),
               (f"rate(fthsdp_lighthouse_session_messages_total[{RATE}])", "{{instance}} session messages"),
               (f"rate(fthsdp_lighthouse_relayed_messages_total[{RATE}])", "{{instance}} through relays"))),
        Panel("Quorum decision CPU", "percentunit",
              "Share of a core the lighthouse spends in the quorum decision.",
              ((f"rate(fthsdp_lighthouse_quorum_evaluation_seconds_total[{RATE}])", "{{instance}}"),)),
        Panel("Failure detection in force", "s",
              "The silence that declares a process dead now, and the slowest interval the processes are asked to "
              "beat at (0: their own); both widen while the lighthouse paces beats past its budget.",
              (("fthsdp_lighthouse_detect_seconds", "{{instance}} detection"),
               ("fthsdp_lighthouse_beat_interval_seconds", "{{instance}} beat interval"))),
        Panel("Processes, sessions and relays", "short",
              "Processes beating the lighthouse, their own session streams, and relays' streams.",
              (("fthsdp_lighthouse_beating_processes", "{{instance}} beating"),
               ("fthsdp_lighthouse_sessions_open", "{{instance}} sessions"),
               ("fthsdp_lighthouse_relay_streams_open", "{{instance}} relay streams"))),
        Panel("Calls held back and refused", "short",
              "Calls per second held back by a connection's or a job's budget, and refused (by the gRPC code the "
              "caller got: a wrong credential is UNAUTHENTICATED).",
              ((f"rate(fthsdp_lighthouse_calls_held_total[{RATE}])", "{{instance}} held"),
               (f"sum by (instance, code) (rate(fthsdp_lighthouse_calls_refused_total[{RATE}]))",
                "{{instance}} refused {{code}}"))),
    )),
)

PANEL_H, PANEL_W = 8, 12  # Grafana's grid is 24 wide
# fthsdp's alerts (alerts.yml) marked on every panel while they fire: Prometheus's ALERTS series.
ALERTS_ANNOTATION = {"name": "fthsdp alerts firing", "datasource": DATASOURCE, "enable": True, "iconColor": "red",
                     "expr": 'ALERTS{alertname=~"Fthsdp.*", alertstate="firing"}', "step": "30s",
                     "titleFormat": "{{alertname}}", "textFormat": "{{job}} {{replica}} {{severity}}"}


def _panel(p: Panel, pid: int, x: int, y: int) -> dict:
    custom = {"fillOpacity": 30 if p.stack else 10, "showPoints": "never",
              "stacking": {"mode": "normal" if p.stack else "none", "group": "A"}}
    return {
        "id": pid, "type": "timeseries", "title": p.title, "description": p.description, "datasource": DATASOURCE,
        "gridPos": {"h": PANEL_H, "w": PANEL_W, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "range": True} for i, (expr, legend) in enumerate(p.targets)],
    }


def dashboard(title: str = "fthsdp", rows: tuple[Row, ...] = ROWS) -> dict:
    """Grafana's dashboard JSON model of ``rows``: a row header, then its panels two a line."""
    panels: list[dict] = []
    y, pid = 0, 1
    for row in rows:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, p in enumerate(row.panels):
            panels.append(_panel(p, pid, (i % 2) * PANEL_W, y + (i // 2) * PANEL_H))
            pid += 1
        y += -(-len(row.panels) // 2) * PANEL_H
    job_var = {
        "name": "job", "label": "job", "type": "query", "datasource": DATASOURCE,
        "definition": "label_values(fthsdp_lighthouse_quorum_size, job)",
        "query": {"query": "label_values(fthsdp_lighthouse_quorum_size, job)", "refId": "jobs"},
        "multi": True, "includeAll": True, "allValue": ".*", "refresh": 2, "sort": 1,
        "current": {"text": ["All"], "value": ["$__all"]},
    }
    return {
        "uid": UID, "title": title, "tags": ["fthsdp"], "editable": True, "schemaVersion": SCHEMA_VERSION,
        "version": 1, "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "timezone": "",
        "description": "Fault-tolerant training with fthsdp: quorum, failures, stalls, the data plane and the "
                       "lighthouse's load (fthsdp status --grafana-dashboard).",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            job_var,
        ]},
        "annotations": {"list": [ALERTS_ANNOTATION]},
        "panels": panels,
    }


def dashboard_json(title: str = "fthsdp") -> str:
    return json.dumps(dashboard(title), indent=1) + "\n"


def queries(board: dict) -> list[tuple[str, str]]:
    """Every (panel or annotation title, PromQL) of a dashboard, row headers skipped."""
    return ([(p["title"], t["expr"]) for p in board["panels"] if p["type"] != "row" for t in p["targets"]]
            + [(a["name"], a["expr"]) for a in board["annotations"]["list"]])
