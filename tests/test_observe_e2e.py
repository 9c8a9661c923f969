"""Observability of a real job (issue 16): `fthsdp run` with 2 replicas x 1
device and a SIGKILL of replica 1, watched by the dashboard in headless
Chromium and scraped by a real Prometheus server, queried over its HTTP API.
Prometheus also scrapes what `fthsdp status --prometheus-targets` lists (its
output fed to a file_sd_configs file as is): every replica process's own
/metrics and the lighthouse's, whose root-cause verdict series it must hold.

One job serves both tests (module fixture) to spare the shared CPUs: the
dashboard test watches it live (replica 1 dead, then back), the Prometheus test
then checks the recorded series. The replica-side metrics come from the
replicas' own per-commit records (`metrics-R.jsonl`, followed as they are
written) until replica.py feeds `ReplicaMetrics` directly; the lighthouse-side
metrics from polling the job's lighthouse over its Status RPC.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest

from fthsdp.observe import grafana
from fthsdp.observe.dashboard import Dashboard
from fthsdp.observe.lighthouse_view import BEHIND, DEAD, HEALTHY
from fthsdp.observe.metrics import (
    LighthouseMetrics,
    MetricsFileFollower,
    ReplicaMetrics,
    alerts_file,
    pytree_bytes,
    scrape_config,
    serve,
    write_targets,
)

pytestmark = pytest.mark.multiprocess

REPO = pathlib.Path(__file__).resolve().parents[1]
JOB = "fthsdp"  # the launcher's job id
KILL_STEP = 40  # 4 s of a full quorum first (0.1 s steps): several scrapes see it
TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16",
        "data.seq_len=16", "data.batch_size=8", "data.corpus_bytes=65536", "train.eval_every=0",
        "ft.allreduce_timeout_s=6", "ft.max_retries=4", "ft.checkpoint_every=1000",
        # Long enough to outlive the restart of the killed replica under a loaded
        # machine; the fixture stops the job as soon as the tests have seen it rejoin.
        "train.steps=3000", "train.min_step_s=0.1", "launch.restart_delay_s=0.2"]
START_S = 240.0  # bounded waits: generous, the machine is shared
PROMETHEUS = shutil.which("prometheus")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def children(pid: int) -> set[int]:
    out = set()
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def param_bytes() -> int:
    """The bytes a replica all-reduces per step in this job (its parameters' gradients)."""
    import jax

    from fthsdp import config as config_lib
    from fthsdp.step.sharding import replica_mesh
    from fthsdp.step.functional import make_train_step

    ts = make_train_step(config_lib.load("base", TINY), replica_mesh(1))
    return pytree_bytes(jax.eval_shape(ts.init, 0).params)


def is_subsequence(want: list, seq: list) -> bool:
    it = iter(seq)
    return all(any(x == y for y in it) for x in want)


class ObservedJob:
    """The job and everything watching it; `close()` stops all of it."""

    def __init__(self, out: pathlib.Path) -> None:
        self.out = out
        self.started: list = []  # things to close, in reverse
        self.kids: set[int] = set()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fthsdp.cli", "run", "--config", "base", "--replicas", "2",
             "--devices-per-replica", "1", "--kill", f"1@{KILL_STEP}", "--out-dir", str(out), "--no-progress", *TINY],
            cwd=REPO, stdout=(launcher_out := open(out.parent / "launcher.out", "w")), stderr=subprocess.STDOUT)
        self.started.append(launcher_out.close)
        self._stop = threading.Event()
        threading.Thread(target=self._watch_children, daemon=True).start()

    def setup(self) -> None:
        out = self.out
        port_file = out / "lighthouse.port"
        wait_until(lambda: port_file.exists() or self.proc.poll() is not None, START_S, "the job's lighthouse")
        assert self.proc.poll() is None, (out.parent / "launcher.out").read_text()[-3000:]
        self.lighthouse = f"127.0.0.1:{port_file.read_text().strip()}"

        from fthsdp.control.auth import load_secret
        from fthsdp.observe.lighthouse_view import StatusPoller

        status_key = load_secret(str(out / "status.key"))  # the launcher's lighthouse authenticates Status
        poller = StatusPoller(self.lighthouse, status_key=status_key)
        self.started.append(poller.close)
        self.lh_metrics = LighthouseMetrics().start(poller, interval_s=0.25)
        self.started.append(self.lh_metrics.stop)
        self.lh_server = serve(self.lh_metrics.registry)
        self.started.append(self.lh_server.close)
        grad_bytes = param_bytes()
        self.replicas = {r: ReplicaMetrics(JOB, str(r), grad_bytes=grad_bytes) for r in (0, 1)}
        self.followers = {r: MetricsFileFollower(out / f"metrics-{r}.jsonl", m) for r, m in self.replicas.items()}
        self.rep_servers = {r: serve(m.registry) for r, m in self.replicas.items()}
        self.started.extend(s.close for s in self.rep_servers.values())
        threading.Thread(target=self._follow, daemon=True).start()
        self.dashboard = Dashboard(self.lighthouse, "127.0.0.1:0", interval_s=0.25, status_key=status_key).start()
        self.started.append(self.dashboard.close)
        self.prometheus_url = None
        if PROMETHEUS:
            self._start_prometheus()

    def _watch_children(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            self.kids |= children(self.proc.pid)
            self._stop.wait(0.2)

    def _follow(self) -> None:
        while not self._stop.is_set():
            for f in self.followers.values():
                f.poll()
            self._stop.wait(0.2)

    def _start_prometheus(self) -> None:
        targets = [(self.lh_server.address, {"role": "lighthouse"})]
        targets += [(s.address, {"role": "replica"}) for s in self.rep_servers.values()]
        sd = write_targets(self.out.parent / "targets.json", targets)
        cfg = self.out.parent / "prometheus.yml"
        # fthsdp's alerting rules, evaluated every 500 ms against the job's real series
        config = json.loads(scrape_config(sd, scrape_interval="500ms", rule_files=[alerts_file()]))
        # A second scrape job over `fthsdp status --prometheus-targets` (refreshed by
        # status_targets()): its series carry sd="status"; the lighthouse's own /metrics (its load
        # and verdicts) are kept whole, and of what the replicas serve only the verdict series,
        # so the first job's series are not counted twice.
        self.status_sd = self.out.parent / "status-targets.json"
        self.status_sd.write_text("[]")
        status_job = json.loads(scrape_config(self.status_sd, scrape_interval="500ms",
                                              job_name="fthsdp-status"))["scrape_configs"][0]
        status_job["relabel_configs"] = [{"target_label": "sd", "replacement": "status"}]
        status_job["metric_relabel_configs"] = [{"source_labels": ["role", "__name__"],
                                                 "regex": "lighthouse;.*|.*;fthsdp_root_cause_.*", "action": "keep"}]
        config["scrape_configs"].append(status_job)
        cfg.write_text(json.dumps(config, indent=1))
        port = free_port()
        self.prom_log = open(self.out.parent / "prometheus.log", "w")
        self.prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={self.out.parent / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=self.prom_log, stderr=subprocess.STDOUT)
        self.started.append(self._stop_prometheus)
        self.prometheus_url = f"http://127.0.0.1:{port}"

        def ready():
            try:
                return urllib.request.urlopen(self.prometheus_url + "/-/ready", timeout=2).status == 200
            except OSError:
                assert self.prom.poll() is None, (self.out.parent / "prometheus.log").read_text()[-2000:]
                return False

        wait_until(ready, 60, "Prometheus to be ready")

    def _stop_prometheus(self) -> None:
        self.prom.terminate()
        try:
            self.prom.wait(20)
        except subprocess.TimeoutExpired:
            self.prom.kill()
            self.prom.wait(10)
        self.prom_log.close()

    def status_targets(self) -> list[dict]:
        """Runs `fthsdp status --prometheus-targets` against the job's lighthouse and hands its
        output to Prometheus unchanged (file_sd: re-read within a second)."""
        p = subprocess.run([sys.executable, "-m", "fthsdp.cli", "status", "--lighthouse", self.lighthouse,
                            "--prometheus-targets", "--status-key-file", str(self.out / "status.key")],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
        assert p.returncode == 0, p.stderr[-2000:]
        tmp = self.status_sd.with_name(".status-targets.tmp")
        tmp.write_text(p.stdout)
        tmp.replace(self.status_sd)
        return json.loads(p.stdout)

    def job_view(self) -> dict | None:
        jobs = self.dashboard.snapshot()["jobs"]
        return next((j for j in jobs if j["job_id"] == JOB), None)

    def wait_for_rejoin(self) -> dict:
        """Replica 1 declared dead, then a quorum member again (closed failure)."""
        assert self.proc.poll() is None or self.proc.returncode == 0, "the job ended early; see launcher.out"

        def rejoined():
            j = self.job_view()
            return j and any(f["replica"] == "1" and f["kind"] == "dead" and f["back_time"] for f in j["failures"]) and j

        return wait_until(rejoined, START_S, "replica 1 to die and rejoin")

    def stop_job(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the launcher's `finally` kills its replicas and lighthouse
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.kids:  # anything the launcher left behind (it starts them in their own sessions)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.kids |= children(self.proc.pid)
        self.stop_job()
        self._stop.set()
        for close in reversed(self.started):
            close()


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    if not PROMETHEUS and not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("neither prometheus nor chromium + chromedriver is installed (scripts/install_system_deps.sh)")
    base = tmp_path_factory.mktemp("observe")
    job = ObservedJob(base / "run")
    try:
        job.setup()
        yield job
    finally:
        job.close()


def headless_chromium():
    """A Selenium driver of headless Chromium (skips the test where either is not installed)."""
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("chromium and chromium-driver are not installed (scripts/install_system_deps.sh installs them)")
    pytest.importorskip("selenium", reason="selenium is in the `test` extra: pip install -e '.[test]'")
    from selenium import webdriver

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,1100"):
        opts.add_argument(a)
    return webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))


def test_dashboard_in_headless_chromium_shows_the_kill_and_the_rejoin(observed, tmp_path):
    driver = headless_chromium()
    try:
        driver.get(observed.dashboard.url + "?interval=250")

        def page():
            """What the page shows of the job, read in one script (the page re-renders every poll)."""
            return driver.execute_script(PAGE_STATE_JS, JOB)

        first = wait_until(lambda: (p := page()) and set(p["rows"]) == {"0", "1"} and HEALTHY in p["rows"].values()
                           and p["quorum_id"] and p, START_S, "both replicas on the page in a quorum")
        dead = wait_until(lambda: (p := page()) and p["rows"].get("1") == DEAD and p, START_S,
                          "the page to show replica 1 dead")
        assert dead["rows"]["0"] != DEAD and "DEAD" in dead["row_text"]["1"]
        shown = driver.execute_script("return document.getElementById('detection').textContent")
        assert re.fullmatch(r"· failure detection [0-9.]+ s of silence", shown), shown  # 2 processes: not paced
        driver.save_screenshot(str(tmp_path / "dashboard-dead.png"))
        back = wait_until(lambda: (p := page()) and p["rows"].get("1") in (HEALTHY, BEHIND)
                          and any(f["replica"] == "1" and f["kind"] == "dead" and f["back"] == "1" for f in p["failures"])
                          and p, START_S, "the page to show replica 1 back, and its failure closed")
        assert back["quorum_id"] > first["quorum_id"]  # the membership changed twice since the first quorum seen
        assert back["dead_spans"]["1"] >= 1 and back["dead_spans"].get("0", 0) == 0  # the timeline's red span
        assert back["reason"].startswith("last decision:") and len(back["reason"]) > len("last decision: —")
        # root-cause analysis: the page names the killed replica as the stall's culprit (kept after it is back)
        named = wait_until(lambda: (p := page()) and [v for v in p["verdicts"] if v["culprit"] == "1"] and p,
                           30, "the page to name replica 1 as the root cause of the stall")
        culprits = [v for v in named["verdicts"] if v["kind"] not in ("none", "unknown")]
        assert culprits and all(v["culprit"] == "1" and v["kind"] in ("dead", "frozen") for v in culprits), culprits
        time.sleep(1.0)  # let a few more samples land so the timeline shows the rejoined run
        path = tmp_path / "dashboard.png"
        driver.save_screenshot(str(path))
        assert path.stat().st_size > 10_000
        shutil.copy(path, observed.out.parent / "dashboard.png")
        print(f"screenshots: {tmp_path / 'dashboard-dead.png'} {path}")
    finally:
        driver.quit()


def test_dashboard_page_shows_a_finished_job(tmp_path):
    """A job the lighthouse reports finished (a replica left having trained its last step) reads
    "finished at step N" in its summary, so a quorum short of members is not taken for a degraded
    job; a job still training shows no such line. The Status comes from a real gRPC server."""
    from concurrent import futures

    import grpc

    from fthsdp.proto import lighthouse

    pb2, _ = lighthouse()
    answer = pb2.StatusResponse(detect_s=0.8, jobs=[
        pb2.JobStatus(job_id="done", num_configured=3, finished_step=40, has_quorum=True,
                      quorum=pb2.Quorum(quorum_id=7, max_step=40)),
        pb2.JobStatus(job_id="going", num_configured=3, finished_step=-1)]).SerializeToString()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("fthsdp.v1.Lighthouse", {
        "Status": grpc.unary_unary_rpc_method_handler(lambda req, ctx: answer)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    board = Dashboard(f"127.0.0.1:{port}", "127.0.0.1:0", interval_s=0.25).start()
    driver = None
    try:
        driver = headless_chromium()
        driver.get(board.url + "?interval=250")
        summary = """const s = {}; for (const j of document.querySelectorAll('section.job')) {
          const f = j.querySelector('.summary .finished'); s[j.dataset.job] = {
          finished: f ? f.textContent : null, text: j.querySelector('.summary').innerText}; } return s;"""
        shown = wait_until(lambda: (s := driver.execute_script(summary)) and len(s) == 2 and s, 60, "both jobs shown")
        assert shown["done"]["finished"] == "40" and "finished at step 40" in shown["done"]["text"], shown
        assert shown["going"]["finished"] is None and "finished" not in shown["going"]["text"], shown
    finally:
        if driver is not None:
            driver.quit()
        board.close()
        server.stop(None)


PAGE_STATE_JS = """
const job = [...document.querySelectorAll('section.job')].find(e => e.dataset.job === arguments[0]);
if (!job) return null;
const rows = {}, rowText = {}, deadSpans = {};
for (const r of job.querySelectorAll('tr.replica')) { rows[r.dataset.replica] = r.dataset.state; rowText[r.dataset.replica] = r.innerText; }
for (const r of job.querySelectorAll('svg.timeline rect[data-state="dead"]')) {
  const id = r.getAttribute('data-replica'); deadSpans[id] = (deadSpans[id] || 0) + 1; }
const q = job.querySelector('.quorum-id');
return {rows, row_text: rowText, dead_spans: deadSpans,
        quorum_id: q && /^\\d+$/.test(q.textContent) ? Number(q.textContent) : null,
        reason: job.querySelector('.reason').textContent,
        verdicts: [...job.querySelectorAll('.rootcause .verdict[data-kind]')].map(v => ({kind: v.dataset.kind, culprit: v.dataset.culprit})),
        failures: [...job.querySelectorAll('tr.failure')].map(f => ({replica: f.dataset.replica, kind: f.dataset.kind, back: f.dataset.back}))};
"""


def prom_query(url: str, query: str, **params) -> list:
    endpoint = "query_range" if "start" in params else "query"
    qs = urllib.parse.urlencode({"query": query, **params})
    body = json.loads(urllib.request.urlopen(f"{url}/api/v1/{endpoint}?{qs}", timeout=10).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def scalar(url: str, query: str) -> float | None:
    res = prom_query(url, query)
    return float(res[0]["value"][1]) if res else None


def test_prometheus_scrapes_the_job_and_sees_the_kill(observed):
    if not PROMETHEUS:
        pytest.skip("prometheus is not installed (scripts/install_system_deps.sh installs Debian's prometheus)")
    url = observed.prometheus_url
    t_start = time.time() - 600
    observed.wait_for_rejoin()
    # the rejoined replica committed a few steps, and Prometheus scraped them
    wait_until(lambda: (scalar(url, f'fthsdp_commits_total{{job="{JOB}",replica="1"}}') or 0) > KILL_STEP + 3,
               START_S, "replica 1 to commit steps after rejoining")

    # `fthsdp status --prometheus-targets`, fed to Prometheus as is: every replica process it lists
    # (replica 1: its restarted process) and the lighthouse are scraped and up, and the lighthouse's
    # root-cause series are there: one current verdict, and the kill's dead/frozen verdict counted.
    groups = observed.status_targets()
    listed = {(g["labels"]["replica"], g["labels"]["process"]) for g in groups if g["labels"]["role"] == "replica"}
    assert listed == {("0", "0"), ("1", "0")}, groups
    assert [g for g in groups if g["labels"]["role"] == "lighthouse"], groups
    up = wait_until(lambda: (u := prom_query(url, 'up{sd="status"}')) and len(u) == 3
                    and all(x["value"][1] == "1" for x in u) and u, 30, "every listed target scraped and up")
    assert {(u["metric"].get("replica"), u["metric"].get("process")) for u in up
            if u["metric"].get("role") == "replica"} == listed, up
    info = wait_until(lambda: prom_query(url, f'fthsdp_root_cause_info{{job="{JOB}",sd="status"}}'), 30,
                      "the lighthouse's verdict series in Prometheus")
    assert len(info) == 1 and info[0]["value"][1] == "1", info
    assert info[0]["metric"]["kind"] in ("none", "dead", "frozen", "slow", "slow_link", "unknown"), info
    stalls = scalar(url, f'sum(fthsdp_root_cause_changes_total{{job="{JOB}",sd="status",kind=~"dead|frozen"}})')
    assert stalls is not None and stalls >= 1, stalls  # the SIGKILL of replica 1 was a verdict
    # a few scrapes of the lighthouse's own /metrics (its load), for the Grafana queries below
    wait_until(lambda: (scalar(url, 'count_over_time(fthsdp_lighthouse_heartbeats_total{sd="status"}[1m])') or 0)
               >= 6, 30, "six scrapes of the lighthouse's own /metrics")
    observed.stop_job()
    steps = {r: f.poll() or f.steps for r, f in observed.followers.items()}
    time.sleep(1.5)  # three scrape intervals: the final values are in Prometheus

    ups = prom_query(url, 'up{sd=""}')  # the first job's targets (the status job's: above)
    assert len(ups) == 3 and all(u["value"][1] == "1" for u in ups), ups
    # commits: what Prometheus holds is exactly what the replicas recorded
    for r, f in observed.followers.items():
        assert scalar(url, f'fthsdp_commits_total{{job="{JOB}",replica="{r}"}}') == f.steps, (r, steps)
    assert scalar(url, f'fthsdp_catch_ups_total{{job="{JOB}",replica="1"}}') >= 1  # it rejoined by fetching state
    assert scalar(url, f'fthsdp_catch_ups_total{{job="{JOB}",replica="0"}}') == 0
    assert scalar(url, f'fthsdp_lighthouse_failures_total{{job="{JOB}",kind="dead"}}') >= 1
    detect = scalar(url, f'fthsdp_lighthouse_detection_seconds_sum{{job="{JOB}"}} / '
                         f'fthsdp_lighthouse_detection_seconds_count{{job="{JOB}"}}')
    assert 0.8 <= detect < 10, detect  # heartbeat silence at detection: at least ft.detect_s
    stall = scalar(url, f'fthsdp_lighthouse_stall_seconds_sum{{job="{JOB}"}} / '
                        f'fthsdp_lighthouse_stall_seconds_count{{job="{JOB}"}}')
    assert 0.5 <= stall < 60, stall  # the survivor waits for the detection (0.8 s) before it steps again

    # the lighthouse's quorum size over the run: 2, then 1 after the kill, then 2 again
    series = prom_query(url, f'fthsdp_lighthouse_quorum_size{{job="{JOB}"}}', start=t_start, end=time.time(),
                        step="0.5")
    assert len(series) == 1
    sizes = [int(float(v)) for _, v in series[0]["values"]]
    changes = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
    assert is_subsequence([2, 1, 2], changes), changes
    # replica 0's commits only grow, and its quorum size gauge also saw 1 then 2
    commits = prom_query(url, f'fthsdp_commits_total{{job="{JOB}",replica="0"}}', start=t_start, end=time.time(),
                         step="0.5")[0]["values"]
    c = [float(v) for _, v in commits]
    assert c == sorted(c) and c[-1] > c[0]
    seen = prom_query(url, f'fthsdp_quorum_size{{job="{JOB}",replica="0"}} > 0', start=t_start, end=time.time(),
                      step="0.5")[0]["values"]  # > 0: before its first commit the gauge reads 0
    sizes = [int(float(v)) for _, v in seen]
    assert is_subsequence([2, 1, 2], [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]), sizes
    bw = scalar(url, f'fthsdp_allreduce_bus_bandwidth_bytes_per_second{{job="{JOB}",replica="0"}}')
    assert bw is not None and bw > 0

    # fthsdp's alerting rules (fthsdp/observe/alerts.yml) loaded and evaluated without an error, and
    # the kill made FthsdpJobDegraded pending (its 10 minutes never passed): its expression matched
    # the lighthouse's real quorum_size and replicas_configured series.
    body = json.loads(urllib.request.urlopen(f"{url}/api/v1/rules?type=alert", timeout=10).read())
    loaded = [r for g in body["data"]["groups"] for r in g["rules"]]
    assert len(loaded) == 12 and all(r["health"] == "ok" for r in loaded), [(r["name"], r.get("lastError"))
                                                                            for r in loaded]
    degraded = prom_query(url, f'ALERTS{{alertname="FthsdpJobDegraded",job="{JOB}"}}', start=t_start,
                          end=time.time(), step="0.5")
    assert degraded and {s["metric"]["alertstate"] for s in degraded} == {"pending"}, degraded
    assert not prom_query(url, 'ALERTS{alertstate="firing"}', start=t_start, end=time.time(), step="0.5")

    # fthsdp's Grafana dashboard (`fthsdp status --grafana-dashboard`): every panel's query, as Grafana
    # sends it with this job chosen, returns this job's series over its run (the lighthouse's load
    # through the status job's scrape of its /metrics). Only the events this job has none of may
    # come back empty: silent data corruption, refused calls, and the annotation of firing alerts.
    eventless = ("fthsdp_lighthouse_sdc_mismatches_total", "fthsdp_lighthouse_calls_refused_total", "ALERTS{")
    empty = []
    for title, expr in grafana.queries(grafana.dashboard()):
        promql = expr.replace("$job", JOB).replace("$__rate_interval", "5s")  # 10 scrapes a window
        got = prom_query(url, promql, start=t_start, end=time.time(), step="0.5")
        finite = [v for s in got for _, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
        if not finite and not any(e in expr for e in eventless):
            empty.append((title, promql))
    assert not empty, empty
