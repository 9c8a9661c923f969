"""Reading a number from text that came from the network or the disk.

``int()`` is too forgiving for that: it reads "+5", " 5", "1_0" and other scripts' digits,
and ``str.isdigit()`` alone is not enough either, since "²" passes it and ``int()`` refuses it.
A port, a step directory, a Content-Length or a replica id is a number only when it is
spelled in ASCII digits; everything else is refused by the caller with its own message.
"""

from __future__ import annotations


def ascii_int(text: str, max_digits: int = 18) -> int | None:
    """The non-negative integer ``text`` spells in at most ``max_digits`` ASCII digits, else None.

    The default bound keeps every value inside a signed 64-bit integer (and protobuf's int64).
    """
    if text.isascii() and text.isdigit() and len(text) <= max_digits:
        return int(text)
    return None
