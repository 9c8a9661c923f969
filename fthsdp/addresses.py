"""Network addresses of fthsdp's listeners: bind vs advertise, IPv4 and IPv6.

Every listener (the lighthouse, each FTAR ring endpoint, the peer state
server, the metrics endpoint) binds one address and *advertises* another:
a process on a multi-homed host, in a container or behind NAT binds
``0.0.0.0`` (or ``::``) or one interface, while its peers must be told an
address they can reach. The advertised address is what goes to the
lighthouse and from there to every other replica; the bind address never
leaves the process.

Addresses are written ``host:port``; an IPv6 literal is written in brackets,
``[::1]:port`` (as in URLs), so that its own colons are not taken for the
port's. The same grammar is parsed by the FTAR transport
(``ffi/transport/wire.cc``, ``split_host_port``).

Pure functions only: no sockets are opened here.
"""

from __future__ import annotations

import ipaddress
import re
import socket

from fthsdp.digits import ascii_int

__all__ = ["LOOPBACK", "WILDCARDS", "split_host_port", "join_host_port", "check_host", "is_wildcard",
           "advertised", "family", "url"]

LOOPBACK = "127.0.0.1"  # the default bind host of every listener: nothing leaves the machine unless asked
WILDCARDS = ("0.0.0.0", "::", "")
# The common case, decided in one C-level match: an IPv4 literal or a DNS name (labels of ASCII
# letters, digits, '-' and '_', an optional trailing dot) and a port of ASCII digits. Every host
# it matches is one check_host accepts (as an IP literal or as a name); whatever it does not match
# takes the full parse, which says what is wrong. A restarted lighthouse checks every endpoint of
# every replica again (100,352 at 512 x 196): the full parse was ~0.6 s of its CPU there.
_PLAIN = re.compile(r"([A-Za-z0-9_-]{1,63}(?:\.[A-Za-z0-9_-]{1,63})*\.?):([0-9]{1,5})")


def split_host_port(address: str, *, allow_zero_port: bool = True) -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port`` -> (host without brackets, port).

    Raises ValueError saying what is wrong and how to write it."""
    m = _PLAIN.fullmatch(address) if isinstance(address, str) else None
    if m is not None:
        host, port = m.group(1), int(m.group(2))
        if len(host) <= 253 and port <= 65535 and (port or allow_zero_port):
            return host, port
    return _split_host_port(address, allow_zero_port)


def _split_host_port(address: str, allow_zero_port: bool) -> tuple[str, int]:
    """:func:`split_host_port` in full: every form, and the words of every refusal."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"address {address!r} is empty; expected HOST:PORT (or [IPV6]:PORT)")
    if any(c.isspace() or ord(c) < 32 for c in address):
        raise ValueError(f"address {address!r} contains spaces or control characters")
    if address.startswith("["):
        close = address.find("]")
        if close < 0 or address[close + 1:close + 2] != ":":
            raise ValueError(f"address {address!r} is not [IPV6]:PORT")
        host, port = address[1:close], address[close + 2:]
        if ":" not in host or "[" in host or "]" in host:
            raise ValueError(f"address {address!r}: only IPv6 literals go in brackets")
    else:
        host, sep, port = address.rpartition(":")
        if not sep or not host:
            raise ValueError(f"address {address!r} is not HOST:PORT (e.g. 127.0.0.1:29510)")
        if ":" in host or "[" in host or "]" in host:
            raise ValueError(f"address {address!r} is not HOST:PORT: write an IPv6 literal in brackets, "
                             f"e.g. [::1]:29510")
    number = ascii_int(port, max_digits=5)
    if number is None or number > 65535:
        raise ValueError(f"address {address!r} has a bad port {port!r} (0..65535)")
    if number == 0 and not allow_zero_port:
        raise ValueError(f"address {address!r}: port 0 cannot be connected to (give the listener's real port)")
    check_host(host)
    return host, number


def join_host_port(host: str, port: int) -> str:
    """The inverse of :func:`split_host_port` (brackets around an IPv6 host)."""
    return f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}"


def url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://{join_host_port(host, port)}"


def check_host(host: str) -> None:
    """A bind or advertise host: an IPv4/IPv6 literal or a DNS name (not resolved here)."""
    if not isinstance(host, str) or not host:
        raise ValueError("the host is empty")
    if any(c.isspace() or ord(c) < 32 for c in host):
        raise ValueError(f"host {host!r} contains spaces or control characters")
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if ":" in host:
        raise ValueError(f"host {host!r} is not a valid IPv6 literal")
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(1 <= len(x) <= 63 and all(c.isalnum() or c in "-_" for c in x) for x in labels):
        raise ValueError(f"host {host!r} is neither an IP literal nor a DNS name")


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface (then it cannot be advertised)."""
    if host in WILDCARDS:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def advertised(bound: str, advertise_host: str = "") -> str:
    """The address peers should use for a listener bound at ``bound`` (host:port as the
    socket reports it): the same port on ``advertise_host`` when one is given.

    Refuses a wildcard bound host with no advertise host: 0.0.0.0 is not an
    address another machine can connect to."""
    host, port = split_host_port(bound)
    if advertise_host:
        check_host(advertise_host)
        return join_host_port(advertise_host, port)
    if is_wildcard(host):
        raise ValueError(f"listener bound to {bound} (every interface) needs an advertise host that peers can "
                         "reach (ft.advertise_host / --advertise-host)")
    return join_host_port(host, port)


def family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal, else AF_INET (names resolve as IPv4 for binding)."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET
