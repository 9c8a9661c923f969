"""Logs (issue 16, item 5): JSON lines with the fields the metrics carry,
chosen by --log-format on any command or $FTHSDP_LOG_FORMAT in any process."""

import json
import logging
import os
import pathlib
import subprocess
import sys
import time

import pytest

from fthsdp import logs

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_logging():
    root = logging.getLogger("fthsdp")
    handlers, level, ctx = list(root.handlers), root.level, dict(logs._context)
    env = os.environ.get(logs.ENV_FORMAT)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logs._context.clear()
    logs._context.update(ctx)
    if env is None:
        os.environ.pop(logs.ENV_FORMAT, None)
    else:
        os.environ[logs.ENV_FORMAT] = env


def test_json_lines_carry_context_extra_fields_and_exceptions(tmp_path, restore_logging, capsys):
    path = tmp_path / "r.log"
    logs.set_context(job="job7", replica="2", process="0")
    log = logs.setup("fthsdp.test", file=str(path), fmt="json")
    log.info("step %d committed", 41, extra={"step": 41, "quorum_id": 3})
    try:
        raise RuntimeError("peer gone")
    except RuntimeError:
        log.exception("all-reduce failed")
    logs.set_context(replica=None)
    log.warning("no replica now")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 3
    a, b, c = lines
    assert a["msg"] == "step 41 committed" and a["level"] == "INFO" and a["logger"] == "fthsdp.test"
    assert (a["job"], a["replica"], a["process"], a["step"], a["quorum_id"]) == ("job7", "2", "0", 41, 3)
    assert a["ts"].endswith("Z") and a["pid"] == os.getpid()
    assert abs(time.time() - _parse_ts(a["ts"])) < 60
    assert b["level"] == "ERROR" and "RuntimeError: peer gone" in b["exc"] and "step" not in b
    assert "replica" not in c and c["job"] == "job7"
    err = capsys.readouterr().err.strip().splitlines()
    assert [json.loads(x)["msg"] for x in err] == ["step 41 committed", "all-reduce failed", "no replica now"]


def _parse_ts(ts: str) -> float:
    import datetime

    return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def test_text_is_the_default_and_the_environment_chooses_json(restore_logging, monkeypatch):
    monkeypatch.delenv(logs.ENV_FORMAT, raising=False)
    assert logs.resolve_format() == "text"
    assert not isinstance(logs.formatter(), logs.JsonFormatter)
    monkeypatch.setenv(logs.ENV_FORMAT, "json")
    assert isinstance(logs.formatter(), logs.JsonFormatter)
    assert logs.resolve_format("text") == "text"  # an explicit choice wins over the environment
    monkeypatch.setenv(logs.ENV_FORMAT, "xml")
    with pytest.raises(ValueError, match=r"\$FTHSDP_LOG_FORMAT='xml'.*text, json"):
        logs.resolve_format()


def test_take_format_option_anywhere_on_the_command_line(restore_logging, monkeypatch):
    monkeypatch.delenv(logs.ENV_FORMAT, raising=False)
    assert logs.take_format_option(["run", "--log-format", "json", "train.steps=3"]) == ["run", "train.steps=3"]
    assert os.environ[logs.ENV_FORMAT] == "json"
    assert logs.take_format_option(["--log-format=text", "status"]) == ["status"]
    assert os.environ[logs.ENV_FORMAT] == "text"
    assert logs.take_format_option(["x", "--", "--log-format", "json"]) == ["x", "--", "--log-format", "json"]
    with pytest.raises(SystemExit, match="choose one of text, json"):
        logs.take_format_option(["--log-format", "yaml"])
    with pytest.raises(SystemExit, match="needs a value"):
        logs.take_format_option(["status", "--log-format"])


def test_fthsdp_log_format_json_reaches_a_subcommand_process(tmp_path):
    """`fthsdp <cmd> --log-format json`: the command's own log lines are JSON."""
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if k != logs.ENV_FORMAT}
    proc = subprocess.Popen([sys.executable, "-m", "fthsdp.cli", "dashboard", "--log-format", "json",
                             "--lighthouse", "127.0.0.1:1", "--bind", "127.0.0.1:0", "--port-file", str(port_file)],
                            cwd=REPO, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert port_file.exists(), proc.stderr.read() if proc.poll() is not None else "no port file in 60 s"
    finally:
        proc.terminate()
        proc.wait(20)
    lines = [json.loads(x) for x in proc.stderr.read().splitlines() if x.startswith("{")]
    started = [x for x in lines if x["msg"].startswith("dashboard of lighthouse 127.0.0.1:1")]
    assert started and started[0]["logger"] == "fthsdp.observe.dashboard" and started[0]["level"] == "INFO"
