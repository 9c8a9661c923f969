"""HTTP servers that a crowd of slow clients cannot exhaust.

Python's threading HTTP servers (``http.server.ThreadingHTTPServer``, and the
WSGI server prometheus_client's ``start_http_server`` builds) start a thread per
connection as soon as it is accepted, and prometheus_client's handler sets no
socket timeout: a client that connects and never sends its request holds a
thread for ever, and ten thousand of them hold ten thousand threads. Every
fthsdp listener that speaks HTTP for people or Prometheus (a replica's and the
lighthouse's ``/metrics``, the dashboard) is built here instead:

* at most ``max_connections`` connections are served at once; one more is
  answered ``503`` at once (best effort, without blocking the accept loop) and
  closed;
* each connection's socket has a timeout, so a client that stops sending or
  reading frees its slot after ``socket_timeout_s``. (Each read has it: a client
  trickling a byte within it keeps its slot. The bound on slots is what keeps
  such clients from taking the process down.)
"""

from __future__ import annotations

import logging
import sys
import threading
from http.server import ThreadingHTTPServer
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from fthsdp.addresses import family

log = logging.getLogger("fthsdp.observe.http")

MAX_CONNECTIONS = 32  # connections served at once per listener (Prometheus needs one; a person a few)
SOCKET_TIMEOUT_S = 10.0  # a connection silent this long is closed
_BUSY_BODY = b"busy: too many connections at once\n"
BUSY_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: "
              + str(len(_BUSY_BODY)).encode() + b"\r\nConnection: close\r\n\r\n" + _BUSY_BODY)


class BoundedConnections(ThreadingMixIn):
    """A ThreadingMixIn that serves at most ``max_connections`` connections at once."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS

    def _slots(self) -> threading.BoundedSemaphore:
        slots = getattr(self, "_connection_slots", None)
        if slots is None:
            slots = self._connection_slots = threading.BoundedSemaphore(self.max_connections)
        return slots

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots().acquire(blocking=False):
            try:
                request.setblocking(False)
                request.send(BUSY_REPLY)  # best effort: a full send buffer just loses the reply
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # the thread did not start: its slot is not coming back otherwise
            self._slots().release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots().release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went silent (the socket timeout) or away is routine: a line at debug
        level, not socketserver's traceback on stderr; anything else is logged with its trace."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("HTTP client %s: %s", client_address, exc)
        else:
            log.warning("HTTP client %s: error while serving it", client_address, exc_info=True)


def http_server(host: str, port: int, handler: type, max_connections: int = MAX_CONNECTIONS) -> ThreadingHTTPServer:
    """A bounded ``ThreadingHTTPServer`` on ``host:port`` (its handler sets its own ``timeout``)."""
    cls = type("BoundedHTTPServer", (BoundedConnections, ThreadingHTTPServer),
               {"address_family": family(host), "max_connections": max_connections})
    return cls((host, port), handler)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


def wsgi_server(host: str, port: int, app: Any, max_connections: int = MAX_CONNECTIONS,
                socket_timeout_s: float = SOCKET_TIMEOUT_S) -> WSGIServer:
    """A bounded WSGI server on ``host:port`` serving ``app`` (prometheus_client's
    ``make_wsgi_app``), each connection with a socket timeout."""
    cls = type("BoundedWSGIServer", (BoundedConnections, WSGIServer),
               {"address_family": family(host), "max_connections": max_connections})
    server = cls((host, port), type("Handler", (_QuietHandler,), {"timeout": socket_timeout_s}))
    server.set_app(app)
    return server
