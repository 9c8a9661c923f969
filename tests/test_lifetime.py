"""Nothing a launcher starts outlives it: a SIGTERM'd `fthsdp run` stops its
replicas and lighthouse, and a SIGKILL'd launcher's children are killed by the
kernel (PR_SET_PDEATHSIG), with real processes and real signals."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from fthsdp.launch import lifetime

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


CHILD = textwrap.dedent("""
    import sys, time
    from fthsdp.launch.lifetime import die_with_launcher
    print("armed" if die_with_launcher() else "unarmed", flush=True)
    time.sleep(120)
""")

LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    from fthsdp.launch.lifetime import child_env
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=child_env(dict(os.environ)),
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    print(child.pid, child.stdout.readline().strip(), flush=True)
    time.sleep(120)
""")


def test_a_sigkilled_launchers_child_is_killed_by_the_kernel():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILD], stdout=subprocess.PIPE, text=True)
    try:
        pid_s, armed = launcher.stdout.readline().split()
        child = int(pid_s)
        assert armed == "armed"
        assert alive(child)
        launcher.kill()  # no handler, no finally: only the kernel can stop the child now
        launcher.wait(10)
        assert wait_gone([child], 10) == [], "the child outlived its SIGKILLed launcher"
    finally:
        launcher.kill()


def test_a_child_whose_launcher_is_already_gone_exits_at_once():
    # its environment names a launcher that is not its parent (it died before the child armed itself)
    env = {**os.environ, lifetime.LAUNCHER_PID_ENV: str(os.getpid() + 1_000_000)}
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "is gone; exiting" in p.stderr, p.stderr
    bad = subprocess.run([sys.executable, "-c", CHILD.replace("time.sleep(120)", "")], capture_output=True,
                         text=True, timeout=60, env={**os.environ, lifetime.LAUNCHER_PID_ENV: "banana"})
    assert bad.returncode == 0 and "unarmed" in bad.stdout and "not a process id" in bad.stderr


def children_of(launcher: int) -> list[int]:
    """Pids of the processes whose environment names `launcher` as theirs (from /proc)."""
    tag = f"{lifetime.LAUNCHER_PID_ENV}={launcher}".encode()
    found = []
    for d in pathlib.Path("/proc").iterdir():
        try:
            if d.name.isdigit() and tag in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except OSError:
            continue
    return found


@pytest.mark.multiprocess
def test_sigterm_stops_fthsdp_run_with_its_replicas_and_lighthouse(tmp_path):
    from test_fault_tolerance import TINY

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fthsdp.cli", "run", "--no-progress", "--out-dir", str(out), "--config", "base",
           "--replicas", "2", "--devices-per-replica", "1", *TINY, "train.steps=100000", "train.min_step_s=0.1"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not all(
                (out / f"status-{r}.json").exists() for r in (0, 1)):
            assert job.poll() is None, job.communicate()[1][-3000:]
            time.sleep(0.5)
        mine = [p for p in children_of(job.pid) if alive(p)]
        assert len(mine) >= 3, f"expected 2 replicas and a lighthouse, found {mine}"
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
        assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert "stopped by a signal" in err and "fthsdp run --resume" in err, err[-3000:]
        assert wait_gone(mine, 15) == [], "replicas or the lighthouse outlived the SIGTERMed launcher"
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)


def test_a_standby_server_waits_for_its_word_and_refuses_other_lines(capsys):
    import io

    assert lifetime.wait_to_serve(io.StringIO("hello\n\nserve\nignored\n"), "fthsdp x")
    err = capsys.readouterr().err
    assert "fthsdp x --standby: ignoring 'hello' on stdin: only 'serve' makes it serve" in err
    assert not lifetime.wait_to_serve(io.StringIO("nope\n"), "fthsdp x")  # its stdin ended: no spare needed


def _refused(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_a_standby_lighthouse_binds_only_when_told_and_exits_when_its_stdin_closes(tmp_path):
    """`fthsdp lighthouse --standby` (the launcher's warm spare): started and imported, not
    listening until the line `serve`; then it serves on its --bind port at once. One whose stdin
    closes first exits 0 without ever binding."""
    import socket

    from fthsdp.control.lighthouse_client import LighthouseClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    port_file = tmp_path / "lh.port"
    cmd = [sys.executable, "-m", "fthsdp.control.lighthouse", "--insecure", "--standby", "--bind",
           f"127.0.0.1:{port}", "--port-file", str(port_file), "--log-level", "WARNING"]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)  # started (its imports done), waiting
        assert p.poll() is None and _refused(port) and not port_file.exists()
        p.stdin.write("now\n")
        p.stdin.flush()
        time.sleep(0.3)
        assert p.poll() is None and _refused(port)  # a wrong word binds nothing
        told = time.monotonic()
        p.stdin.write("serve\n")
        p.stdin.close()
        while not port_file.exists() and time.monotonic() - told < 10:
            time.sleep(0.01)
        took = time.monotonic() - told
        assert port_file.read_text().strip() == str(port), p.stderr.read()[-2000:] if p.poll() is not None else ""
        with LighthouseClient(f"127.0.0.1:{port}", "standby", 0) as c:  # a real lighthouse answers
            q = c.get_quorum(0, ftar_addresses=["127.0.0.1:1"], num_replicas=1, timeout_s=10)
        assert q.quorum_id >= 1
        print(f"standby served {took:.3f} s after its word")
    finally:
        lifetime.stop_process(p)
        err = p.stderr.read()
        p.stdout.close()
        p.stderr.close()
    assert "ignoring 'now' on stdin" in err
    spare = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    spare.stdin.close()
    assert spare.wait(60) == 0, spare.stderr.read()[-2000:]
    spare.stderr.close()
    assert _refused(port)
