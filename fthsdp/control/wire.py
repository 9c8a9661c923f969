"""Protobuf fields written by hand, for the few hot paths that append to bytes built once.

Protobuf reads a message from concatenated encodings: a scalar field that
occurs twice takes its last value, a repeated field gathers every occurrence,
and an embedded message field that occurs twice is merged. So a server that
serializes the part of an answer every asker shares once can append what one
asker alone gets as a few fields, without parsing or re-serializing the rest:
the relay appends a message's new ``seq`` (:func:`fthsdp.control.relay.
renumbered`), a credential is appended to the body it signs
(:mod:`fthsdp.control.auth`), and the lighthouse appends each asker's ring
neighbourhood to the view it built once (``Lighthouse.view_reply``).
"""

from __future__ import annotations

__all__ = ["varint", "field_bytes", "varint_field"]


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def varint_field(number: int, value: int) -> bytes:
    """A varint field (int32/int64 >= 0, uint, bool) ``number`` holding ``value``."""
    return varint(number << 3) + varint(value)


def field_bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited field (bytes, string, embedded message) ``number`` holding ``payload``."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload
