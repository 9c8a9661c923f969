"""`fthsdp dashboard`: a live web page of a lighthouse's jobs, self-contained.

A small HTTP server polls a lighthouse's public Status RPC and serves:

* ``/``: the page (``observe/static``: hand-written HTML, CSS and JS, no CDN,
  no build step; the membership timeline is an inline SVG drawn by the page);
* ``/api/status``: the JSON the page polls: per job the quorum and the reason
  for the last decision, every replica's state, step, heartbeat age and step
  time, a membership timeline and recent failures (kept in memory from polls);
* ``/metrics``: the lighthouse's Prometheus metrics (``LighthouseMetrics``), so
  one process gives an operator the page and the lighthouse scrape target;
* ``/healthz``.

The server is bounded (fthsdp.observe.http_bounded): a fixed number of
connections are served at once (the rest get 503 when they connect), each
socket has a timeout, and the poll history has a fixed size. It only reads the
lighthouse, so it can run anywhere that reaches it.

Who may read it (``access``): a request's ``Host`` must name an IP address,
``localhost`` or a name given with ``--allow-host`` (a web page elsewhere that
points its own name at this address, DNS rebinding, would otherwise read the
page through the user's browser). With an access token (``--access-token-file``)
every path but ``/healthz`` needs it: ``Authorization: Bearer HEX`` (Prometheus's
``authorization.credentials_file``), or ``/?token=HEX`` once in a browser, which
sets a cookie for the page's own polls. A dashboard that holds the lighthouse's
status key serves what that key protects, so it refuses a non-loopback bind
without a token.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import importlib.resources
import ipaddress
import json
import logging
import math
import mimetypes
import pathlib
import signal
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fthsdp.addresses import join_host_port
from fthsdp.observe import http_bounded
from fthsdp.observe.lighthouse_view import History, LighthouseUnreachable, LighthouseView, StatusPoller
from fthsdp.observe.metrics import LighthouseMetrics, parse_bind

log = logging.getLogger("fthsdp.observe.dashboard")

STATIC_FILES = ("index.html", "dashboard.css", "dashboard.js")
TOKEN_COOKIE = "fthsdp_dashboard_token"
TOKEN_FILE_ENV, TOKEN_ENV = "FTHSDP_DASHBOARD_TOKEN_FILE", "FTHSDP_DASHBOARD_TOKEN"


@dataclass(frozen=True)
class Verdict:
    """What ``access`` decided about one request: its HTTP code (200 = serve it), why not, and
    whether to set the token's cookie (a browser that brought it in the URL)."""

    code: int
    reason: str = ""
    set_cookie: bool = False


def host_allowed(host_header: str | None, allowed: frozenset[str]) -> bool:
    """A request's ``Host`` names an IP address, ``localhost`` or an allowed name (no Host at
    all is an HTTP/1.0 client, not a browser: allowed)."""
    if host_header is None:
        return True
    name = host_header.strip().lower()
    if name.startswith("["):  # [v6]:port
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    if name in ("localhost", *allowed):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def cookie_value(token: str) -> str:
    """What the cookie holds: derived from the token, not the token itself (a browser sends a
    host's cookies to every port of it: another service there learns this value, which opens
    only this page, not the Bearer credential Prometheus uses)."""
    return hmac.new(token.encode(), b"fthsdp dashboard cookie", hashlib.sha256).hexdigest()


def cookie_of(header: str | None, name: str) -> str | None:
    """The value of cookie ``name`` in a Cookie header, read by hand: the standard parser drops
    every cookie after one it cannot read (another site's on the same host)."""
    for part in (header or "").split(";"):
        k, sep, v = part.strip().partition("=")
        if sep and k == name:
            return v.strip()
    return None


def access(path: str, query: str, host_header: str | None, authorization: str | None, cookie: str | None,
           token: str | None, allowed_hosts: frozenset[str] = frozenset(), cookie_name: str = TOKEN_COOKIE) -> Verdict:
    """Whether to serve a request (pure: its parts in, a verdict out)."""
    def same(a: str, b: str) -> bool:
        return hmac.compare_digest(a.encode("utf-8", "replace"), b.encode())

    bearer = authorization[7:].strip() if authorization and authorization[:7].lower() == "bearer " else None
    if bearer is not None and token is not None and same(bearer, token):
        return Verdict(HTTPStatus.OK)  # a rebinding page cannot send it: any Host (Prometheus by DNS name)
    if not host_allowed(host_header, allowed_hosts):
        return Verdict(HTTPStatus.FORBIDDEN, f"Host {host_header!r} is not this dashboard's: open it by its IP "
                                             "address or localhost, start it with --allow-host NAME, or send its "
                                             "access token as 'Authorization: Bearer HEX'")
    if token is None or path == "/healthz":
        return Verdict(HTTPStatus.OK)
    jar = cookie_of(cookie, cookie_name)
    if jar is not None and same(jar, cookie_value(token)):
        return Verdict(HTTPStatus.OK)
    asked = parse_qs(query).get("token", [])[:1]
    if asked and same(asked[0], token):
        return Verdict(HTTPStatus.OK, set_cookie=True)
    why = "a wrong access token" if (bearer is not None or jar is not None or asked) else "no access token"
    return Verdict(HTTPStatus.UNAUTHORIZED, f"{why}: this dashboard needs the hex of its --access-token-file, as "
                                            "/?token=HEX in a browser or 'Authorization: Bearer HEX'")


def static_dir() -> Any:
    """The page's files, wherever the package is installed (a wheel, an editable tree)."""
    return importlib.resources.files("fthsdp.observe").joinpath("static")


def status_json(address: str, view: LighthouseView | None, history: History, error: str) -> dict:
    """The body of ``/api/status`` (pure: view + history in, JSON-ready data out)."""
    return {
        "lighthouse": address,
        "up": view is not None and not error,
        "error": error,
        "time": view.time if view is not None else time.time(),
        "detect_s": view.detect_s if view is not None else None,
        "beat_interval_s": view.beat_interval_s if view is not None else None,
        "jobs": [history.job_json(j) for j in view.jobs] if view is not None else [],
    }


def _finite(value):
    """``value`` (plain JSON data) with every NaN or infinity as None: JSON has no such numbers, and
    one sent by an older or lying lighthouse must not fail every answer of /api/status."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class Dashboard:
    """Polls one lighthouse and serves the page. ``start()`` returns self;
    ``address`` is where it listens (port 0 binds a free port)."""

    def __init__(self, lighthouse: str, bind: str = "127.0.0.1:8765", interval_s: float = 0.5,
                 max_concurrent: int = 16, socket_timeout_s: float = 10.0, status_key: bytes | None = None,
                 access_token: bytes | None = None, allow_hosts: tuple[str, ...] = ()) -> None:
        if interval_s <= 0:
            raise ValueError(f"poll interval {interval_s!r}: must be > 0 seconds")
        from fthsdp.control.lighthouse import is_loopback

        host, port = parse_bind(bind)
        if status_key is not None and access_token is None and not is_loopback(host):
            raise ValueError(f"--bind {bind}: this dashboard reads the lighthouse with its status key and would "
                             "serve what the key protects to anyone who reaches that address; give it an access "
                             "token (--access-token-file, e.g. from `openssl rand -hex 32`) or bind a loopback "
                             "address")
        self.access_token = access_token.hex() if access_token is not None else None
        self.allow_hosts = frozenset(h.strip().lower() for h in allow_hosts if h.strip())
        self.poller = StatusPoller(lighthouse, rpc_timeout_s=max(1.0, 4 * interval_s), status_key=status_key)
        self.lighthouse = lighthouse
        self.interval_s = interval_s
        self.metrics = LighthouseMetrics()
        self.history = self.metrics.history
        self._view: LighthouseView | None = None
        self._error = "not polled yet"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._static = {name: static_dir().joinpath(name).read_bytes() for name in STATIC_FILES}
        # connections past max_concurrent get a 503 at accept (a thread each only for those served)
        self._httpd = http_bounded.http_server(host, port, self._handler_class(socket_timeout_s), max_concurrent)
        # one cookie per port: a browser sends a host's cookies to all its ports (two dashboards on one
        # host overwrote each other's)
        self.cookie_name = f"{TOKEN_COOKIE}_{self._httpd.server_address[1]}"
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return join_host_port(host, port)

    @property
    def url(self) -> str:
        return f"http://{self.address}/"

    # -- polling ------------------------------------------------------------------

    def poll_once(self) -> None:
        try:
            view = self.poller.poll()
        except LighthouseUnreachable as e:
            with self._lock:
                self._error = str(e)
            self.metrics.up.set(0)
            return
        with self._lock:
            self.metrics.update(view)  # also updates self.history
            self._view, self._error = view, ""

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - the page must outlive a bad answer; say it in the log
                log.exception("dashboard: polling %s failed", self.lighthouse)
            self._stop.wait(self.interval_s)

    def snapshot(self) -> dict:
        with self._lock:
            return status_json(self.lighthouse, self._view, self.history, self._error)

    # -- serving ------------------------------------------------------------------

    def _handler_class(self, socket_timeout_s: float):
        dash = self

        class Handler(BaseHTTPRequestHandler):
            timeout = socket_timeout_s
            server_version = "fthsdp-dashboard"
            _set_cookie = False

            def log_message(self, fmt: str, *args: Any) -> None:  # quiet: polled every second
                log.debug("%s " + fmt, self.address_string(), *args)

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                if self._set_cookie:  # HttpOnly: no script reads it; Strict: no other site's page sends it
                    self.send_header("Set-Cookie", f"{dash.cookie_name}={cookie_value(dash.access_token)}; Path=/; "
                                                   "HttpOnly; SameSite=Strict")
                if code == HTTPStatus.UNAUTHORIZED:
                    self.send_header("WWW-Authenticate", 'Bearer realm="fthsdp dashboard"')
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                verdict = access(path, query, self.headers.get("Host"), self.headers.get("Authorization"),
                                 self.headers.get("Cookie"), dash.access_token, dash.allow_hosts, dash.cookie_name)
                self._set_cookie = verdict.set_cookie
                if verdict.code != HTTPStatus.OK:
                    self._send(verdict.code, verdict.reason.encode() + b"\n", "text/plain; charset=utf-8")
                    return
                self._route(path)

            def _route(self, path: str) -> None:
                if path in ("/", "/index.html"):
                    self._send(200, dash._static["index.html"], "text/html; charset=utf-8")
                elif path.startswith("/static/") and path[len("/static/"):] in dash._static:
                    name = path[len("/static/"):]
                    ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
                    self._send(200, dash._static[name], f"{ctype}; charset=utf-8")
                elif path == "/api/status":
                    body = json.dumps(_finite(dash.snapshot()), allow_nan=False, default=str).encode()
                    self._send(200, body, "application/json")
                elif path == "/metrics":
                    with dash._lock:
                        body = generate_latest(dash.metrics.registry)
                    self._send(200, body, CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._send(200, b"ok\n", "text/plain")
                else:
                    self._send(404, f"not found: {path}; try / or /api/status\n".encode(), "text/plain")

        return Handler

    def start(self) -> "Dashboard":
        for target, name in ((self._poll_loop, "fthsdp-dashboard-poll"), (self._httpd.serve_forever, "fthsdp-dashboard-http")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        for t in self._threads:
            t.join(5.0)
        self.poller.close()

    def __enter__(self) -> "Dashboard":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def cli(argv: list[str]) -> int:
    """``fthsdp dashboard --lighthouse HOST:PORT [--bind HOST:PORT]``."""
    from fthsdp import logs

    p = argparse.ArgumentParser(prog="fthsdp dashboard",
                                description="Serve a live web page (and /metrics) of a lighthouse's jobs.")
    p.add_argument("--lighthouse", required=True, help="HOST:PORT of `fthsdp lighthouse`")
    p.add_argument("--bind", default="127.0.0.1:8765",
                   help="HOST:PORT to serve on (default %(default)s, loopback; port 0 = any free port)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between Status polls (default %(default)s)")
    p.add_argument("--port-file", default="", help="write the bound port here once listening (for scripts)")
    p.add_argument("--status-key-file", default=None,
                   help="the lighthouse's read-only status key (`fthsdp run` writes status.key in its run directory)")
    p.add_argument("--access-token-file", default=None,
                   help="64 hex digits every reader must present (/?token=HEX once in a browser, or "
                        "'Authorization: Bearer HEX'); needed to serve a status key's view beyond loopback "
                        f"(or ${TOKEN_FILE_ENV}, ${TOKEN_ENV})")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a host name this dashboard is reached by (requests naming another are refused; IP "
                        "addresses and localhost always work); repeatable")
    logs.add_format_argument(p)
    args = p.parse_args(argv)
    logs.setup("fthsdp.observe.dashboard", fmt=args.log_format)
    from fthsdp.control import auth

    try:
        key = auth.load_secret(args.status_key_file) if args.status_key_file else None
        token = auth.load_secret(args.access_token_file, file_env=TOKEN_FILE_ENV, env=TOKEN_ENV)
        dash = Dashboard(args.lighthouse, args.bind, interval_s=args.interval, status_key=key, access_token=token,
                         allow_hosts=tuple(args.allow_host))
    except (ValueError, OSError) as e:
        p.error(str(e))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # close the server cleanly on `kill`
    with dash:
        log.info("dashboard of lighthouse %s at %s%s", args.lighthouse, dash.url,
                 "?token=HEX (HEX: the access token)" if token is not None else "")
        if args.port_file:
            path = pathlib.Path(args.port_file)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(str(dash.address.rpartition(":")[2]))
            tmp.replace(path)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
