"""Readable logs: one format for every process, plus JSON-lines metrics files."""

from __future__ import annotations

import json
import logging
import pathlib
import sys
import time


def setup(name: str = "fthsdp", level: int = logging.INFO, file: str | None = None) -> logging.Logger:
    fmt = logging.Formatter("%(asctime)s.%(msecs)03d %(levelname).1s %(name)s | %(message)s", "%H:%M:%S")
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
