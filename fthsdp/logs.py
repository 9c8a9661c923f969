"""Logs: one format for every process (readable text, or JSON lines for log
pipelines), plus JSON-lines metrics files.

The format is chosen by ``setup(fmt=...)``, else by the ``FTHSDP_LOG_FORMAT``
environment variable (``text`` or ``json``), else text. The variable is what
makes ``--log-format json`` reach every process of a job: ``fthsdp`` sets it
from the option (:func:`take_format_option`), and the launcher's children
inherit the environment.

A JSON line carries ``ts`` (UTC, ISO 8601 with ms), ``level``, ``logger``,
``msg``, ``pid``, the process context (:func:`set_context`: job, replica,
process — the labels the Prometheus metrics carry) and any ``extra={...}`` fields
of the call (``step``, ``quorum_id``...), so a log line joins the metrics on the
same keys.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pathlib
import sys
import time
from typing import Any

FORMATS = ("text", "json")
ENV_FORMAT = "FTHSDP_LOG_FORMAT"

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
_context: dict[str, Any] = {}


def set_context(**fields: Any) -> None:
    """Fields added to every JSON log line of this process (e.g. job, replica).
    ``None`` removes a field."""
    for k, v in fields.items():
        if v is None:
            _context.pop(k, None)
        else:
            _context[k] = v


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, pid, context, extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        out.update(_context)
        for k, v in vars(record).items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=_jsonable, ensure_ascii=False)


def resolve_format(fmt: str | None = None) -> str:
    """The log format to use: ``fmt``, else $FTHSDP_LOG_FORMAT, else text."""
    chosen = fmt or os.environ.get(ENV_FORMAT, "") or "text"
    if chosen not in FORMATS:
        src = "--log-format" if fmt else f"${ENV_FORMAT}"
        raise ValueError(f"{src}={chosen!r}: the log format must be one of {', '.join(FORMATS)}")
    return chosen


def formatter(fmt: str | None = None) -> logging.Formatter:
    if resolve_format(fmt) == "json":
        return JsonFormatter()
    return logging.Formatter("%(asctime)s.%(msecs)03d %(levelname).1s %(name)s | %(message)s", "%H:%M:%S")


def add_format_argument(parser) -> None:
    """``--log-format text|json`` on an argparse parser (default: $FTHSDP_LOG_FORMAT, else text)."""
    parser.add_argument("--log-format", choices=FORMATS, default=None,
                        help=f"log lines as text or one JSON object per line (default: ${ENV_FORMAT}, else text)")


def take_format_option(argv: list[str]) -> list[str]:
    """Removes ``--log-format X`` / ``--log-format=X`` from a command line and
    exports it as $FTHSDP_LOG_FORMAT, so every subcommand (and every process a
    launcher starts) logs in that format. Returns the remaining arguments."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out.extend(argv[i:])
            break
        if a == "--log-format" or a.startswith("--log-format="):
            if "=" in a:
                value = a.split("=", 1)[1]
            elif i + 1 < len(argv):
                value = argv[i + 1]
                i += 1
            else:
                raise SystemExit("fthsdp: --log-format needs a value: text or json")
            if value not in FORMATS:
                raise SystemExit(f"fthsdp: --log-format {value!r}: choose one of {', '.join(FORMATS)}")
            os.environ[ENV_FORMAT] = value
        else:
            out.append(a)
        i += 1
    return out


def setup(name: str = "fthsdp", level: int = logging.INFO, file: str | None = None,
          fmt: str | None = None) -> logging.Logger:
    """Handlers of the ``fthsdp`` logger tree: stderr, and ``file`` if given.
    ``fmt``: "text" | "json" | None ($FTHSDP_LOG_FORMAT, else text)."""
    fmt = formatter(fmt)
    root = logging.getLogger("fthsdp")
    root.setLevel(level)
    root.handlers.clear()
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(fmt)
    root.addHandler(h)
    if file:
        pathlib.Path(file).parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(file)
        fh.setFormatter(fmt)
        root.addHandler(fh)
    root.propagate = False
    return logging.getLogger(name)


class MetricsWriter:
    """Appends one JSON object per line; flushes each line so a crash loses nothing written."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, **record) -> None:
        record.setdefault("time", time.time())
        self._f.write(json.dumps(record, default=_jsonable) + "\n")

    def close(self) -> None:
        self._f.close()


def _jsonable(x):
    try:
        return x.item()
    except AttributeError:
        return str(x)


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line from a killed writer
    return out
