"""The lighthouse's root-cause verdicts as Prometheus series (issue 16).

The verdict (fthsdp/observe/root_cause.py) is a sentence in ``fthsdp status``
and the dashboard; an alert needs it as a series. The lighthouse keeps one
:class:`RootCauseMetrics` and serves it on ``--metrics-bind``:

* ``fthsdp_root_cause_info{job, kind, replica, process, peer} = 1``: the
  current verdict of each job (one series per job: the previous verdict's
  series is removed when it changes, so a query never sees two verdicts);
  ``replica``/``process`` name the culprit ("" when there is none, as for
  ``none`` and ``unknown``), ``peer`` the receiver of a ``slow_link``.
* ``fthsdp_root_cause_confidence{job}``: the current verdict's confidence (0..1).
* ``fthsdp_root_cause_changes_total{job, kind}``: verdict changes by the kind
  changed to (a new kind, culprit, process or peer), so a flapping verdict or
  repeated stalls show as a rate.

Pure bookkeeping over a registry: no sockets (``fthsdp.observe.metrics.serve``
serves it), no clocks; tests read the registry directly.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from fthsdp.observe import root_cause as rc

__all__ = ["RootCauseMetrics"]


class RootCauseMetrics:
    """The verdict series of every job a lighthouse serves."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.info = Gauge("fthsdp_root_cause_info",
                          "The lighthouse's current root-cause verdict of a job (always 1; the labels are the "
                          "verdict: kind, the culprit replica and process, the slow link's receiving peer)",
                          ["job", "kind", "replica", "process", "peer"], registry=r)
        self.confidence = Gauge("fthsdp_root_cause_confidence", "Confidence (0..1) of the job's current verdict",
                                ["job"], registry=r)
        self.changes = Counter("fthsdp_root_cause_changes",
                               "Changes of a job's root-cause verdict, by the kind it changed to", ["job", "kind"],
                               registry=r)
        self._current: dict[str, tuple[str, ...]] = {}

    @staticmethod
    def labels(job: str, v: rc.Verdict) -> tuple[str, str, str, str, str]:
        named = bool(v.culprit)
        return (job, v.kind, v.culprit, str(v.process) if named and v.process >= 0 else "",
                v.peer if v.kind == rc.SLOW_LINK else "")

    def observe(self, job: str, v: rc.Verdict) -> bool:
        """Record ``job``'s verdict (call it after every analysis); True if it changed."""
        new = self.labels(job, v)
        self.confidence.labels(job).set(v.confidence)
        old = self._current.get(job)
        if old == new:
            return False
        if old is not None:
            self.info.remove(*old)
        self.info.labels(*new).set(1)
        self._current[job] = new
        self.changes.labels(job, v.kind).inc()
        return True

    def forget(self, job: str) -> None:
        """Drop a forgotten job's series (its change counters go with it)."""
        old = self._current.pop(job, None)
        if old is not None:
            self.info.remove(*old)
        for metric in (self.confidence,):
            try:
                metric.remove(job)
            except KeyError:
                pass
        for kind in rc.KINDS:
            try:
                self.changes.remove(job, kind)
            except KeyError:
                pass
