"""`fthsdp status --prometheus-targets` against a real job: every replica process advertises
its /metrics address with its heartbeats, the lighthouse keeps it, and the command prints a
Prometheus file_sd list whose targets really serve that replica's metrics, and the
lighthouse's own (`fthsdp lighthouse --metrics-bind`: the root-cause verdict series)."""

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from test_fault_tolerance import TINY

pytestmark = pytest.mark.multiprocess


def start_lighthouse(tmp_path) -> tuple[subprocess.Popen, str]:
    port_file = tmp_path / "lighthouse.port"
    p = subprocess.Popen([sys.executable, "-m", "fthsdp.cli", "lighthouse", "--bind", "127.0.0.1:0", "--insecure",
                          "--port-file", str(port_file), "--metrics-bind", "127.0.0.1:0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert p.poll() is None and time.monotonic() < deadline, "the lighthouse did not start"
        time.sleep(0.05)
    return p, f"127.0.0.1:{port_file.read_text().strip()}"


def targets(lighthouse: str, *extra: str) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-m", "fthsdp.cli", "status", "--lighthouse", lighthouse,
                        "--prometheus-targets", *extra], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def test_status_prints_the_scrape_targets_of_a_running_job(tmp_path):
    lh, address = start_lighthouse(tmp_path)
    job = None
    try:
        job = subprocess.Popen(
            [sys.executable, "-m", "fthsdp.cli", "run", "--config", "base", "--replicas", "2",
             "--devices-per-replica", "1", "--lighthouse", address, "--out-dir", str(tmp_path / "run"),
             "--no-progress", *TINY, "train.steps=400", "train.min_step_s=0.05"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        found: list = []
        while time.monotonic() < deadline:
            rc, out, err = targets(address)
            assert rc == 0, err
            listed = json.loads(out)
            found = [g for g in listed if g["labels"]["role"] == "replica"]
            if len(found) == 2:
                break
            assert job.poll() is None, "the job ended before both replicas were listed"
            time.sleep(0.5)
        assert sorted(g["labels"]["replica"] for g in found) == ["0", "1"], found
        # the job's lighthouse (started by `fthsdp run`) names where it serves its own metrics
        (lh_group,) = [g for g in listed if g["labels"]["role"] == "lighthouse"]
        assert "fthsdp_root_cause" in urllib.request.urlopen(f"http://{lh_group['targets'][0]}/metrics",
                                                             timeout=10).read().decode()
        for g in found:
            assert g["labels"]["job"] == "fthsdp" and g["labels"]["process"] == "0"
            assert g["labels"]["role"] == "replica" and len(g["targets"]) == 1
            host, _, port = g["targets"][0].rpartition(":")
            assert host == "127.0.0.1" and port.isdigit()
            # the advertised address really serves that replica's metrics
            text = urllib.request.urlopen(f"http://{g['targets'][0]}/metrics", timeout=10).read().decode()
            assert f'replica="{g["labels"]["replica"]}"' in text and "fthsdp_step_seconds" in text
        # one job only, and a job the lighthouse does not know: a clear error
        rc, out, _ = targets(address, "--job", "fthsdp")
        assert rc == 0 and len([g for g in json.loads(out) if g["labels"]["role"] == "replica"]) == 2
        rc, _, err = targets(address, "--job", "nope")
        assert rc == 1 and "no job 'nope'" in err
    finally:
        for p in (job, lh):
            if p is not None and p.poll() is None:
                # SIGINT: the launcher stops its replicas on the way out (SIGTERM would orphan them)
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
    rc, _, err = targets(address)  # the lighthouse is gone: says so, non-zero
    assert rc == 1 and "Status failed" in err
