"""The lighthouse's own load as Prometheus series: what its budgets and checks hold back or refuse.

A replica that steps faster than its connection's budget is slowed, and a
client that sends garbage or a wrong secret is refused; the lighthouse's log
says so (``guard.ThrottleLog``), but an operator alerts on series, not on log
lines. The lighthouse serves these beside its root-cause verdicts on
``--metrics-bind``:

* ``fthsdp_lighthouse_calls_held_total``: calls held back by a budget (a
  connection's or a job's) before being served; its rate is how hard the
  budgets bite. ``fthsdp_lighthouse_calls_parked``: calls held right now.
* ``fthsdp_lighthouse_calls_refused_total{code}``: calls the lighthouse
  refused, by the gRPC status code the caller got: ``INVALID_ARGUMENT``
  (malformed), ``UNAUTHENTICATED`` / ``PERMISSION_DENIED`` (credential),
  ``RESOURCE_EXHAUSTED`` (over a budget or a limit), and the job-state
  refusals (``FAILED_PRECONDITION``: a stale incarnation, endpoints the
  lighthouse does not hold, ...).
* ``fthsdp_lighthouse_connection_budget_calls_per_second``: the budget itself
  (0 when the lighthouse runs without budgets), so a dashboard shows it beside
  the rate of held calls without anyone looking up the command line.
* ``fthsdp_lighthouse_sessions_opened_total``,
  ``fthsdp_lighthouse_session_messages_total``, ``fthsdp_lighthouse_relay_batches_total``,
  ``fthsdp_lighthouse_relayed_messages_total``, and the gauges
  ``fthsdp_lighthouse_sessions_open`` and ``fthsdp_lighthouse_relay_streams_open``:
  the session transport's use (messages per relay batch: how well the relays
  batch; the relayed share of the messages: whether processes left their relays).
* ``fthsdp_lighthouse_quorum_evaluations_total`` and
  ``fthsdp_lighthouse_quorum_evaluation_seconds_total``: how often and for how
  long the quorum decision ran (their ratio is the mean cost of one).
* ``fthsdp_lighthouse_jobs``: jobs the lighthouse holds.

**Read at scrape time, never on the hot path.** The lighthouse already counts
all of this in plain dicts; :class:`LoadCollector` is a custom collector that
copies a snapshot (``snapshot()``: plain data) when Prometheus scrapes, from
the exporter's thread. A copy of a dict of ints is one C call under the GIL,
so it never sees a half-updated dict, and the event loop pays nothing per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["LoadSnapshot", "LoadCollector"]


@dataclass(frozen=True)
class LoadSnapshot:
    """The lighthouse's load counters at one moment (plain data; tests build these by hand).
    The same record travels in a Status of every job (``LighthouseLoad``, its fields by these
    names; ``detect_s`` and ``beat_interval_s`` as the reply's own fields) to ``fthsdp status``,
    with two fields only that line shows."""

    held_total: int = 0
    held_now: int = 0
    refused_by_code: dict[str, int] = field(default_factory=dict)
    connection_budget_calls_per_s: float = 0.0
    sessions_opened: int = 0
    session_messages: int = 0
    relay_batches: int = 0  # batches of session messages read from relays' streams
    sessions_open: int = 0  # processes' own session streams open now
    relay_streams_open: int = 0  # relays' streams open now
    relayed_messages: int = 0  # session messages that came through relays (of session_messages)
    evaluations: int = 0
    evaluation_s: float = 0.0
    jobs: int = 0
    heartbeats: int = 0  # heartbeats read
    beating_processes: int = 0  # processes beating it, at its last count (what the pace is set for)
    detect_s: float = 0.0  # the silence that declares a process dead now (wider while paced)
    beat_interval_s: float = 0.0  # the slowest it asks its processes to beat (0: their own interval)
    uptime_s: float = 0.0  # since the lighthouse started (fthsdp status; not a series)
    cpu_s: float = 0.0  # the lighthouse process's CPU time (fthsdp status; not a series)


class LoadCollector(Collector):
    """Yields the series of one :class:`LoadSnapshot`, taken from ``snapshot()`` at each scrape."""

    def __init__(self, snapshot: Callable[[], LoadSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator:
        s = self.snapshot()
        held = CounterMetricFamily("fthsdp_lighthouse_calls_held",
                                   "Calls held back by a connection's or a job's budget before being served")
        held.add_metric([], s.held_total)
        yield held
        now = GaugeMetricFamily("fthsdp_lighthouse_calls_parked", "Calls held by a budget right now")
        now.add_metric([], s.held_now)
        yield now
        refused = CounterMetricFamily("fthsdp_lighthouse_calls_refused",
                                      "Calls refused by the lighthouse's checks and budgets, by the gRPC status "
                                      "code the caller got", labels=["code"])
        for code, n in sorted(s.refused_by_code.items()):
            refused.add_metric([code], n)
        yield refused
        budget = GaugeMetricFamily("fthsdp_lighthouse_connection_budget_calls_per_second",
                                   "Calls per second one client connection may make before the rest are held back "
                                   "(0: no budgets)")
        budget.add_metric([], s.connection_budget_calls_per_s)
        yield budget
        for name, doc, value in (
                ("fthsdp_lighthouse_sessions_opened", "Session streams opened by clients", s.sessions_opened),
                ("fthsdp_lighthouse_session_messages", "Calls received as session messages", s.session_messages),
                ("fthsdp_lighthouse_relay_batches", "Batches of session messages read from relays' streams",
                 s.relay_batches),
                ("fthsdp_lighthouse_relayed_messages", "Session messages that came through relays",
                 s.relayed_messages),
                ("fthsdp_lighthouse_quorum_evaluations", "Runs of the quorum decision", s.evaluations),
                ("fthsdp_lighthouse_quorum_evaluation_seconds", "Seconds spent in the quorum decision",
                 s.evaluation_s),
                ("fthsdp_lighthouse_heartbeats", "Heartbeats read", s.heartbeats)):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        for name, doc, value in (
                ("fthsdp_lighthouse_jobs", "Jobs the lighthouse holds", s.jobs),
                ("fthsdp_lighthouse_sessions_open", "Processes' own session streams open now", s.sessions_open),
                ("fthsdp_lighthouse_relay_streams_open", "Relays' streams open now", s.relay_streams_open),
                ("fthsdp_lighthouse_beating_processes", "Processes beating the lighthouse (its last count)",
                 s.beating_processes),
                ("fthsdp_lighthouse_detect_seconds", "Silence that declares a process dead now: wider than "
                 "configured while the beats are paced", s.detect_s),
                ("fthsdp_lighthouse_beat_interval_seconds", "Slowest interval the processes are asked to beat at "
                 "(0: their own)", s.beat_interval_s)):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
