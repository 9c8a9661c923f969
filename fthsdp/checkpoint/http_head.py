"""Parsing of one HTTP/1.x request head, strictly and within limits, for the peer state server.

The peer server speaks a very small HTTP: GET requests without bodies from
fthsdp's own fetcher. It parses request heads itself instead of through
``http.server`` because that parser answers a request line without a version
as HTTP/0.9 (a bare body, no status line: a fuzzer finding), reads headers
without a count or a deadline, and raises on some malformed input. Here
every way a head can be wrong is a :class:`Refusal` with the status and the
reason, decided as early as the bytes allow (:func:`check_partial` looks at
a head still arriving), and nothing raises.

Pure functions over bytes; the server's event loop owns the sockets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fthsdp.checkpoint.peer_auth import Refusal
from fthsdp.digits import ascii_int

_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token (method, header name)
_TARGET = re.compile(rb"/[\x21-\x7e]*")  # origin-form, visible ASCII only
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # control characters other than HT
_METHODS = ("GET",)
# Headers that may appear at most once: two of them would let two parsers disagree.
_SINGLE = ("host", "authorization", "content-length", "connection")


@dataclass(frozen=True)
class HeadLimits:
    """Upper bounds on what one request head may hold; beyond them it is refused, never buffered."""

    max_request_line: int = 2048  # bytes of "METHOD TARGET VERSION"
    max_head_bytes: int = 16384  # the whole head, request line and headers
    max_headers: int = 32
    max_header_line: int = 8192

    def __post_init__(self) -> None:
        for name in ("max_request_line", "max_head_bytes", "max_headers", "max_header_line"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"HeadLimits.{name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class Request:
    """One parsed request head. Header names are lower-cased; values are text (ISO-8859-1)."""

    method: str
    target: str
    version: str
    headers: dict[str, str]
    keep_alive: bool
    head_bytes: int  # bytes of the head, up to and including the blank line


def head_end(buf: bytes | bytearray) -> int:
    """The length of the complete head at the start of `buf` (through its blank line), or -1."""
    i = buf.find(b"\r\n\r\n")
    return -1 if i < 0 else i + 4


def _request_line(line: bytes) -> tuple[str, str, str] | Refusal:
    parts = line.split(b" ")
    if len(parts) == 2 or (len(parts) == 3 and not parts[2]):
        return Refusal(400, "HTTP/0.9 and request lines without a version are not served: send "
                            "'GET /v1/manifest HTTP/1.1'")
    if len(parts) != 3 or not all(parts):
        return Refusal(400, "malformed request line: expected 'METHOD /path HTTP/1.1' (single spaces)")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        return Refusal(400, "malformed request line: the method is not a token")
    if not version.startswith(b"HTTP/") or not re.fullmatch(rb"HTTP/[0-9]\.[0-9]", version):
        return Refusal(400, "malformed request line: the version must look like HTTP/1.1")
    if version in (b"HTTP/0.9",):
        return Refusal(400, "HTTP/0.9 is not served: send HTTP/1.1 requests")
    if version not in (b"HTTP/1.0", b"HTTP/1.1"):
        return Refusal(505, f"HTTP version {version.decode('ascii')} is not supported: use HTTP/1.1")
    if not _TARGET.fullmatch(target):
        return Refusal(400, "malformed request target: expected an absolute path of visible ASCII, e.g. /v1/manifest")
    m = method.decode("ascii")
    if m not in _METHODS:
        return Refusal(405, f"method {m[:20]!r} is not allowed: the peer server is read-only, use GET")
    return m, target.decode("ascii"), version.decode("ascii")


def check_partial(buf: bytes | bytearray, limits: HeadLimits) -> Refusal | None:
    """Why a head still arriving (no blank line yet) is already unacceptable, or None to wait for more.

    Refuses as soon as the request line is complete and wrong (an HTTP/0.9 line
    is answered at once, not after a timeout), or the bytes outgrow a limit."""
    nl = buf.find(b"\n")
    first = buf if nl < 0 else buf[:nl]
    if len(first) > limits.max_request_line:
        return Refusal(414, f"request line longer than {limits.max_request_line} bytes")
    if nl >= 0:
        if not first.endswith(b"\r"):
            return Refusal(400, "malformed request: lines must end in CRLF")
        r = _request_line(bytes(first[:-1]))
        if isinstance(r, Refusal):
            return r
    if len(buf) > limits.max_head_bytes:
        return Refusal(431, f"request head larger than {limits.max_head_bytes} bytes")
    return None


def parse_head(buf: bytes | bytearray, limits: HeadLimits) -> Request | Refusal | None:
    """The request whose head starts `buf`, a refusal, or None while the head is incomplete. Never raises."""
    end = head_end(buf)
    if end < 0:
        return check_partial(buf, limits)
    if end > limits.max_head_bytes:
        return Refusal(431, f"request head larger than {limits.max_head_bytes} bytes")
    lines = bytes(buf[: end - 4]).split(b"\r\n")
    first = lines[0]
    if len(first) > limits.max_request_line:
        return Refusal(414, f"request line longer than {limits.max_request_line} bytes")
    line = _request_line(first)
    if isinstance(line, Refusal):
        return line
    method, target, version = line
    if len(lines) - 1 > limits.max_headers:
        return Refusal(431, f"more than {limits.max_headers} header fields")
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        if len(raw) > limits.max_header_line:
            return Refusal(431, f"a header line is longer than {limits.max_header_line} bytes")
        if b"\n" in raw or b"\r" in raw:
            return Refusal(400, "malformed header: bare CR or LF inside a header line")
        if raw[:1] in (b" ", b"\t"):
            return Refusal(400, "malformed header: folded (obs-fold) header lines are not accepted")
        name, colon, value = raw.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            return Refusal(400, "malformed header: expected 'Name: value'")
        value = value.strip(b" \t")
        if _BAD_VALUE.search(value):
            return Refusal(400, "malformed header: control characters in a header value")
        key = name.decode("ascii").lower()
        if key in headers and key in _SINGLE:
            return Refusal(400, f"duplicate {key} header")
        text = value.decode("iso-8859-1")
        headers[key] = text if key not in headers else headers[key] + ", " + text
    if "transfer-encoding" in headers:
        return Refusal(400, "request bodies are not accepted (Transfer-Encoding): the peer server is read-only")
    length = headers.get("content-length", "0")
    nbytes = ascii_int(length)
    if nbytes is None:
        return Refusal(400, "malformed Content-Length")
    if nbytes != 0:
        return Refusal(413, "request bodies are not accepted: the peer server is read-only, send GET without a body")
    if version == "HTTP/1.1" and "host" not in headers:
        return Refusal(400, "missing Host header (required by HTTP/1.1)")
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = ("close" not in tokens) if version == "HTTP/1.1" else ("keep-alive" in tokens)
    return Request(method, target, version, headers, keep_alive, end)
