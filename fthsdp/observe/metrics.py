"""Prometheus metrics of a replica and of a lighthouse, an HTTP exporter, scrape targets.

Naming follows Prometheus conventions: an ``fthsdp_`` prefix, base units in
the name (``_seconds``, ``_bytes``, ``_bytes_per_second``), ``_total`` on
counters, labels for what varies (job, replica, process). The ``job`` label
collides with the label Prometheus attaches to every target (the name of its
scrape job); scrape with ``honor_labels: true`` (as :func:`scrape_config`
writes) so the training job's name is kept instead of being renamed
``exported_job``.

Each class owns its own ``CollectorRegistry``: several replicas (or a replica
and a lighthouse collector) can live in one process, as in tests, without
clashing on the global registry.

*Replica side* (:class:`ReplicaMetrics`) is fed by the Manager's per-step
``StepRecord`` (one call per commit), plus optional hooks for detection,
peer fetch and snapshots. *Lighthouse side* (:class:`LighthouseMetrics`) is fed
by the lighthouse's public Status RPC (polled), so it needs no change to the
lighthouse itself.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from fthsdp.addresses import is_wildcard, join_host_port
from fthsdp.digits import ascii_int
from fthsdp.observe import http_bounded
from fthsdp.observe.lighthouse_view import (
    FAILURE_KINDS,
    STATES,
    History,
    LighthouseUnreachable,
    LighthouseView,
    StatusPoller,
)

log = logging.getLogger("fthsdp.observe.metrics")

LABELS = ("job", "replica", "process")

# Buckets in seconds. Steps of real jobs take ~seconds to tens of seconds (the
# paper's ~20 s), tiny CPU demos ~10 ms: cover both.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
# Detection: heartbeat silence, around ft.detect_s (0.8 s by default).
DETECT_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30)
# Stalls and catch-ups: from a ring rebuild (ms) to an all-reduce deadline (s).
STALL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120)


def ring_bus_bytes(payload_bytes: int, members: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``payload_bytes`` over ``members`` ranks.

    The NCCL-tests "bus bandwidth" convention: 2 (n - 1) / n times the payload
    (reduce-scatter then all-gather), so the figure compares across ring sizes.
    """
    if members < 2:
        return 0.0
    return 2.0 * (members - 1) / members * payload_bytes


def pytree_bytes(tree: Any) -> int:
    """Bytes of a pytree of arrays (or ``ShapeDtypeStruct`` s): the payload one
    replica all-reduces when ``tree`` is its gradients (``state.params``)."""
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


class ReplicaMetrics:
    """One replica process's metrics, fed by its Manager's ``StepRecord`` s.

    ``grad_bytes`` (the bytes one replica all-reduces per step: its gradient
    pytree) turns the all-reduce time into a bus bandwidth; 0 leaves that gauge
    out. The all-reduce time is that of the committing ``apply_grads`` (all-reduce,
    commit vote and update in one jitted call), so the bandwidth is a lower
    bound on FTAR's.
    """

    def __init__(self, job: str, replica: str, process: str = "0", grad_bytes: int = 0,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.grad_bytes = int(grad_bytes)
        labels = {"job": job, "replica": str(replica), "process": str(process)}
        r = self.registry

        def make(kind, name, doc, **kw):
            return kind(name, doc, LABELS, registry=r, **kw).labels(**labels)

        self.step_seconds = make(Histogram, "fthsdp_step_seconds",
                                 "Wall time of a committed step: quorum, compute, all-reduce, retries", buckets=STEP_BUCKETS)
        self.compute_seconds = make(Histogram, "fthsdp_compute_seconds",
                                    "Forward and backward of a healthy step", buckets=STEP_BUCKETS)
        self.allreduce_seconds = make(Histogram, "fthsdp_allreduce_seconds",
                                      "The committing all-reduce + commit vote + update", buckets=STEP_BUCKETS)
        self.rebuild_seconds = make(Histogram, "fthsdp_ring_rebuild_seconds",
                                    "FTAR ring reconfiguration after a quorum change", buckets=STALL_BUCKETS)
        self.stall_seconds = make(Histogram, "fthsdp_stall_seconds",
                                  "Time a step lost to failures: its wall time minus compute and the committing "
                                  "all-reduce, for steps that retried", buckets=STALL_BUCKETS)
        self.catch_up_seconds = make(Histogram, "fthsdp_catch_up_seconds",
                                     "Fetching and installing the peers' state on a behind step", buckets=STALL_BUCKETS)
        self.step = make(Gauge, "fthsdp_step", "Committed steps (the step this replica runs next)")
        self.loss = make(Gauge, "fthsdp_loss", "Training loss of the last healthy step")
        self.quorum_size = make(Gauge, "fthsdp_quorum_size", "Members of the quorum of the last committed step")
        self.quorum_id = make(Gauge, "fthsdp_quorum_id", "Id of the quorum of the last committed step")
        self.healthy = make(Gauge, "fthsdp_healthy", "1 if the last committed step contributed gradients, 0 if it caught up")
        self.commits = make(Counter, "fthsdp_commits", "Committed steps")
        self.retries = make(Counter, "fthsdp_retries", "All-reduce attempts that failed and were retried on a new quorum")
        self.catch_ups = make(Counter, "fthsdp_catch_ups", "Steps on which this replica was behind and fetched state")
        self.skipped = make(Counter, "fthsdp_nonfinite_skips", "Committed steps whose update was skipped: "
                            "the averaged gradients held a NaN or an infinity")
        self.bus_bandwidth = make(Gauge, "fthsdp_allreduce_bus_bandwidth_bytes_per_second",
                                  "Ring bus bandwidth of the last committing all-reduce: 2(n-1)/n x gradient bytes / time")
        self.detections = make(Counter, "fthsdp_detections",
                               "Times the lighthouse declared a member of this replica's ring dead")
        self.fetch_bytes = make(Counter, "fthsdp_peer_fetch_bytes", "State bytes fetched from peers")
        self.fetch_seconds = make(Histogram, "fthsdp_peer_fetch_seconds", "Duration of a state fetch from peers",
                                  buckets=STALL_BUCKETS)
        self.fetch_throughput = make(Gauge, "fthsdp_peer_fetch_throughput_bytes_per_second",
                                     "Throughput of the last state fetch from peers")
        self.snapshot_seconds = make(Histogram, "fthsdp_snapshot_seconds",
                                     "Device-to-host copy of the committed state for peers", buckets=STALL_BUCKETS)
        self.snapshot_bytes = make(Gauge, "fthsdp_snapshot_bytes", "Size of the last host snapshot")

    def observe_step(self, rec: Any) -> None:
        """Record one committed step (a ``fthsdp.replica.manager.StepRecord``)."""
        seconds = float(rec.end - rec.start)
        self.step_seconds.observe(seconds)
        self.commits.inc()
        self.step.set(rec.step + 1)
        self.quorum_size.set(len(rec.members))
        self.quorum_id.set(rec.quorum_id)
        self.healthy.set(1 if rec.healthy else 0)
        if rec.skipped:
            self.skipped.inc()
        if rec.attempts > 1:
            self.retries.inc(rec.attempts - 1)
            self.stall_seconds.observe(max(0.0, seconds - rec.grads_s - rec.allreduce_s))
        if rec.rebuild_s > 0:
            self.rebuild_seconds.observe(rec.rebuild_s)
        if rec.healthy:
            if rec.grads_s > 0:
                self.compute_seconds.observe(rec.grads_s)
            if rec.loss is not None:
                self.loss.set(rec.loss)
        else:
            self.catch_ups.inc()
            self.catch_up_seconds.observe(rec.catch_up_s)
        if rec.allreduce_s > 0:
            self.allreduce_seconds.observe(rec.allreduce_s)
            bus = ring_bus_bytes(self.grad_bytes, len(rec.members))
            if bus > 0:
                self.bus_bandwidth.set(bus / rec.allreduce_s)

    def observe_detection(self, dead: Sequence[str] = (), quorum_id: int = 0) -> None:
        """The lighthouse declared ring members dead (the Manager's ``on_dead`` abort)."""
        self.detections.inc()

    def observe_fetch(self, report: Mapping[str, Any]) -> None:
        """One state fetch from peers (``peer_fetch`` report: ``bytes``, ``seconds``)."""
        nbytes, seconds = float(report.get("bytes", 0)), float(report.get("seconds", 0))
        self.fetch_bytes.inc(nbytes)
        self.fetch_seconds.observe(seconds)
        if seconds > 0:
            self.fetch_throughput.set(nbytes / seconds)

    def observe_snapshot(self, seconds: float, nbytes: int | None = None) -> None:
        self.snapshot_seconds.observe(seconds)
        if nbytes is not None:
            self.snapshot_bytes.set(nbytes)


def step_record_from_json(d: Mapping[str, Any]) -> Any:
    """A ``StepRecord`` from a ``metrics-R.jsonl`` "step" line (what replica.py writes),
    so a finished or running job's files can feed :class:`ReplicaMetrics`."""
    from fthsdp.replica.manager import StepRecord

    return StepRecord(step=int(d["step"]), quorum_id=int(d["quorum_id"]), members=tuple(d["members"]),
                      healthy=bool(d["healthy"]), committed=True, attempts=int(d["attempts"]), loss=d.get("loss"),
                      start=float(d["start"]), end=float(d["end"]), position=d.get("position"),
                      events=list(d.get("events", ())), rebuild_s=float(d.get("rebuild_s", 0.0)),
                      allreduce_s=float(d.get("allreduce_s", 0.0)), grads_s=float(d.get("grads_s", 0.0)),
                      catch_up_s=float(d.get("catch_up_s", 0.0)), skipped=bool(d.get("skipped", False)))


class MetricsFileFollower:
    """Feeds a :class:`ReplicaMetrics` from a growing ``metrics-R.jsonl`` (the
    replica's own per-commit lines). Call :meth:`poll` repeatedly; it reads only
    complete new lines, so a line being written is taken on the next call."""

    def __init__(self, path: str | pathlib.Path, metrics: ReplicaMetrics) -> None:
        self.path = pathlib.Path(path)
        self.metrics = metrics
        self._offset = 0
        self.steps = 0

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:  # replaced or truncated: read it anew
                    self._offset = 0
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        end = data.rfind(b"\n")
        if end < 0:
            return 0
        self._offset += end + 1
        n = 0
        for line in data[: end + 1].splitlines():
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    continue
                if d.get("kind") == "step":
                    self.metrics.observe_step(step_record_from_json(d))
                    n += 1
                elif d.get("kind") == "detection":
                    self.metrics.observe_detection(d.get("dead", ()), int(d.get("quorum_id", 0)))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a torn line of a killed writer, or one this version cannot read: the rest still counts
        self.steps += n
        return n


class LighthouseMetrics:
    """A lighthouse's metrics from its Status answers (quorum, replicas per
    state, heartbeat ages, decisions, failures and their detection times).

    :meth:`update` takes one :class:`LighthouseView` (pure: tests feed views);
    :meth:`start` polls a lighthouse in a daemon thread. Label sets of replicas
    or jobs that disappear from the lighthouse are removed, not left stale.
    """

    def __init__(self, registry: CollectorRegistry | None = None, history: History | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.history = history if history is not None else History()
        r = self.registry
        self.up = Gauge("fthsdp_lighthouse_up", "1 if the last Status poll of the lighthouse succeeded", registry=r)
        self.quorum_id = Gauge("fthsdp_lighthouse_quorum_id", "Current quorum id", ["job"], registry=r)
        self.quorum_size = Gauge("fthsdp_lighthouse_quorum_size", "Members of the current quorum", ["job"], registry=r)
        self.quorum_healthy = Gauge("fthsdp_lighthouse_quorum_healthy",
                                    "Members of the current quorum at its max step (contributing)", ["job"], registry=r)
        self.max_step = Gauge("fthsdp_lighthouse_quorum_max_step", "Step of the current quorum", ["job"], registry=r)
        self.configured = Gauge("fthsdp_lighthouse_replicas_configured", "Replicas the job is configured with",
                                ["job"], registry=r)
        self.finished = Gauge("fthsdp_lighthouse_job_finished", "1 once a replica left the job having reached its "
                              "last step (the lighthouse forgets the job later), else 0", ["job"], registry=r)
        self.replicas = Gauge("fthsdp_lighthouse_replicas", "Replicas per state (healthy, behind, waiting, outside, dead)",
                              ["job", "state"], registry=r)
        self.heartbeat_age = Gauge("fthsdp_lighthouse_heartbeat_age_seconds", "Seconds since a replica was last heard",
                                   ["job", "replica"], registry=r)
        self.replica_step = Gauge("fthsdp_lighthouse_replica_step", "Step a replica last reported", ["job", "replica"],
                                  registry=r)
        self.decisions = Counter("fthsdp_lighthouse_quorum_decisions", "Quorum changes seen", ["job"], registry=r)
        self.failures = Counter("fthsdp_lighthouse_failures", "Replicas lost: declared dead or dropped from the quorum",
                                ["job", "kind"], registry=r)
        self.detection = Histogram("fthsdp_lighthouse_detection_seconds",
                                   "Heartbeat silence of a replica when first seen dead (detection time, "
                                   "to within one poll)", ["job"], buckets=DETECT_BUCKETS, registry=r)
        self.stall = Histogram("fthsdp_lighthouse_stall_seconds",
                               "The job's progress gap around a loss: from its last step before to its first step "
                               "after (to within one poll)", ["job"], buckets=STALL_BUCKETS, registry=r)
        self.sdc = Counter("fthsdp_lighthouse_sdc_mismatches",
                           "Replicas whose state fingerprint disagreed with the others' after a commit (silent data "
                           "corruption); fatal=true: no majority, the job was stopped", ["job", "replica", "fatal"],
                           registry=r)
        self._sdc_seen: set[tuple] = set()  # (job, step, culprits, fatal) already counted
        self._sdc_labels: dict[str, set[tuple[str, ...]]] = {}  # job -> its SDC counter's label sets
        self._polled = False  # the first view seeds what was counted (see update)
        self._stall_pending: list = []  # failures whose stall has not ended yet
        self._decisions_seen: dict[str, int] = {}
        self._labels: dict[Any, set[tuple[str, ...]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error = ""

    def _set(self, gauge: Gauge, labels: tuple[str, ...], value: float, seen: dict) -> None:
        gauge.labels(*labels).set(value)
        seen.setdefault(gauge, set()).add(labels)

    def update(self, view: LighthouseView) -> None:
        failures = self.history.update(view)
        self.up.set(1)
        seen: dict[Any, set[tuple[str, ...]]] = {}
        for job in view.jobs:
            j = job.job_id
            q = job.quorum
            self._set(self.quorum_id, (j,), q.quorum_id if q else 0, seen)
            self._set(self.quorum_size, (j,), len(q.members) if q else 0, seen)
            self._set(self.quorum_healthy, (j,), len(q.healthy) if q else 0, seen)
            self._set(self.max_step, (j,), q.max_step if q else 0, seen)
            self._set(self.configured, (j,), job.num_configured, seen)
            self._set(self.finished, (j,), 0 if job.finished_step is None else 1, seen)
            for kind in FAILURE_KINDS:  # exported at 0 from the start, so increase() counts the first failure
                self.failures.labels(j, kind)
            self.detection.labels(j)  # (and a histogram's rate() its first observation)
            self.stall.labels(j)
            counts = dict.fromkeys(STATES, 0)
            for r in job.replicas:
                counts[job.state_of(r)] += 1
                self._set(self.heartbeat_age, (j, r.replica_id), r.heartbeat_age_s, seen)
                self._set(self.replica_step, (j, r.replica_id), r.step, seen)
            for state, n in counts.items():
                self._set(self.replicas, (j, state), n, seen)
            h = self.history.jobs[j]
            grew = h.decisions - self._decisions_seen.get(j, 0)
            if grew > 0:
                self.decisions.labels(j).inc(grew)
            self._decisions_seen[j] = h.decisions
        for job in view.jobs:
            for e in job.sdc_events:
                key = (job.job_id, e.step, e.culprits, e.fatal)
                if key in self._sdc_seen:
                    continue
                self._sdc_seen.add(key)
                if not self._polled:
                    # found before this exporter started (or restarted): counting it again would
                    # read as a new mismatch to increase() and fire its alert a second time
                    continue
                for who in (e.culprits or ("-",)):  # a fatal mismatch names no culprit
                    labels = (job.job_id, who, "true" if e.fatal else "false")
                    self.sdc.labels(*labels).inc()
                    self._sdc_labels.setdefault(job.job_id, set()).add(labels)
        self._polled = True
        self._forget(self.history.forgotten)
        for f in failures:
            job = f.job
            self.failures.labels(job, f.kind).inc()
            if f.silence_s is not None:
                self.detection.labels(job).observe(f.silence_s)
            log.warning("job %r: replica %s %s (quorum %d)%s", job, f.replica, f.kind, f.quorum_id,
                        f", silent {f.silence_s:.2f}s" if f.silence_s is not None else "")
        for f in self.history.upgraded:  # left the quorum first, found dead now: its detection time
            if f.silence_s is not None:
                self.detection.labels(f.job).observe(f.silence_s)
        self._stall_pending.extend(failures)
        for f in [f for f in self._stall_pending if f.stall_s is not None]:
            self.stall.labels(f.job).observe(f.stall_s)
            self._stall_pending.remove(f)
        del self._stall_pending[:-100]  # a loss the job never stepped past stays at most this long
        for gauge, old in self._labels.items():
            for labels in old - seen.get(gauge, set()):
                gauge.remove(*labels)
        self._labels = seen

    def _forget(self, jobs: list[str]) -> None:
        """Drop the counters of jobs the history forgot (kept an hour after the lighthouse stopped
        listing them): an exporter that runs for months holds a bounded number of series."""
        for j in jobs:
            for kind in FAILURE_KINDS:
                self._remove(self.failures, j, kind)
            for metric in (self.detection, self.stall, self.decisions):
                self._remove(metric, j)
            for labels in self._sdc_labels.pop(j, ()):
                self._remove(self.sdc, *labels)
            self._decisions_seen.pop(j, None)
            self._sdc_seen = {k for k in self._sdc_seen if k[0] != j}
            self._stall_pending = [f for f in self._stall_pending if f.job != j]

    @staticmethod
    def _remove(metric, *labels: str) -> None:
        try:
            metric.remove(*labels)
        except KeyError:  # never created
            pass

    def poll_once(self, poller: StatusPoller) -> LighthouseView | None:
        try:
            view = poller.poll()
        except LighthouseUnreachable as e:
            self.up.set(0)
            self.last_error = str(e)
            return None
        self.last_error = ""
        self.update(view)
        return view

    def start(self, poller: StatusPoller, interval_s: float = 0.5) -> "LighthouseMetrics":
        def loop() -> None:
            while not self._stop.is_set():
                self.poll_once(poller)
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=loop, name="fthsdp-lighthouse-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


# -- serving and discovery ---------------------------------------------------------


def parse_bind(bind: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` -> (host, port); port 0 = ephemeral."""
    host, sep, port = bind.rpartition(":")
    if not sep:
        host, port = "", bind
    host = host.strip("[]") or default_host
    number = ascii_int(port, max_digits=5)
    if number is None or number > 65535:
        raise ValueError(f"bind address {bind!r}: expected HOST:PORT with a port in 0..65535 (0 = any free port)")
    return host, number


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint (a bounded WSGI server in a thread: fthsdp.observe.http_bounded)."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def address(self) -> str:
        """``HOST:PORT`` as the lighthouse and Prometheus read it (IPv6 in brackets)."""
        return join_host_port(self.host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def serve(registry: CollectorRegistry, bind: str = "127.0.0.1:0") -> MetricsServer:
    """Serve ``registry`` at ``http://HOST:PORT/metrics``. Loopback by default:
    exposing metrics beyond the machine is a decision, not a default."""
    host, port = parse_bind(bind)
    server = http_bounded.wsgi_server(host, port, make_wsgi_app(registry))
    thread = threading.Thread(target=server.serve_forever, name="fthsdp-metrics-http", daemon=True)
    thread.start()
    return MetricsServer(host, server.server_address[1], server, thread)


def prometheus_targets(targets: Iterable[tuple[str, Mapping[str, str]]]) -> list[dict]:
    """A Prometheus ``file_sd`` target list from (``host:port``, labels) pairs.

    Targets sharing the same labels are grouped; the output is deterministic
    (sorted) so rewriting the file only changes it when the targets change.
    Labels must be valid Prometheus label names, and addresses ``HOST:PORT``.
    """
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for address, labels in targets:
        parse_bind(address)
        if address.rpartition(":")[0] == "":
            raise ValueError(f"target {address!r}: expected HOST:PORT")
        for k in labels:
            if not k or not (k[0].isalpha() or k[0] == "_") or not all(c.isalnum() or c == "_" for c in k):
                raise ValueError(f"label name {k!r} is not a valid Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)")
        key = tuple(sorted((str(k), str(v)) for k, v in labels.items()))
        groups.setdefault(key, []).append(address)
    return [{"targets": sorted(set(addrs)), "labels": dict(key)} for key, addrs in sorted(groups.items())]


def status_targets(view: LighthouseView, lighthouse_metrics: str = "", lighthouse_host: str = "") -> list[dict]:
    """The scrape targets of everything a lighthouse knows: every process of each
    live replica that advertised its metrics address (with its heartbeats;
    labelled job, replica, process) and, if given, the address serving the
    lighthouse's own metrics (default: where the lighthouse says it serves them,
    ``fthsdp lighthouse --metrics-bind``; a wildcard host there is replaced by
    ``lighthouse_host``, the host the lighthouse was reached on, since 0.0.0.0 would
    make Prometheus scrape its own host). What ``fthsdp status --prometheus-targets`` prints."""
    pairs: list[tuple[str, Mapping[str, str]]] = []
    if not lighthouse_metrics and view.metrics_address:
        try:
            host, port = parse_bind(view.metrics_address)
        except ValueError:  # not HOST:PORT (a lighthouse's word): no target rather than a traceback
            host, port = "", 0
        if port:
            lighthouse_metrics = (join_host_port(lighthouse_host, port) if is_wildcard(host) and lighthouse_host
                                  else view.metrics_address)
    if lighthouse_metrics:
        pairs.append((lighthouse_metrics, {"role": "lighthouse"}))
    for job in view.jobs:
        for r in job.replicas:
            if r.dead:
                continue
            addresses = r.metrics_addresses or ((r.metrics_address,) if r.metrics_address else ())
            for p, address in enumerate(addresses):
                if address:
                    pairs.append((address, {"role": "replica", "job": job.job_id, "replica": r.replica_id,
                                            "process": str(p)}))
    return prometheus_targets(pairs)


def write_targets(path: str | pathlib.Path, targets: Iterable[tuple[str, Mapping[str, str]]]) -> pathlib.Path:
    """Writes the ``file_sd`` list atomically (Prometheus re-reads it on change)."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(prometheus_targets(targets), indent=1))
    tmp.replace(path)
    return path


def alerts_file() -> pathlib.Path:
    """The alerting rules shipped with fthsdp (``alerts.yml`` beside this module; ``fthsdp status
    --prometheus-rules`` prints it): a Prometheus ``rule_files`` entry."""
    return pathlib.Path(__file__).with_name("alerts.yml")


def scrape_config(file_sd_path: str | pathlib.Path, scrape_interval: str = "15s", job_name: str = "fthsdp",
                  rule_files: Sequence[str | pathlib.Path] = ()) -> str:
    """A minimal ``prometheus.yml`` scraping the targets of a file_sd list (YAML is
    a JSON superset, so this is JSON). ``honor_labels`` keeps fthsdp's ``job`` label;
    ``rule_files``: e.g. ``[alerts_file()]``, evaluated every ``scrape_interval``."""
    config: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [{
            "job_name": job_name,
            "honor_labels": True,
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "file_sd_configs": [{"files": [str(file_sd_path)], "refresh_interval": "1s"}],
        }],
    }
    if rule_files:
        config["rule_files"] = [str(f) for f in rule_files]
    return json.dumps(config, indent=1)
