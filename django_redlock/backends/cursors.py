"""Page cursors: where an operator's list of held locks (the admin, ``redlock list``) goes on.

A cursor travels in a URL, so it is anyone's input: a backend reads it with
:func:`parse_cursor` and refuses one it did not make with :class:`BadCursor` (a
``ValueError``), before any Redis call. What a cursor means is the backend's own (a ``SCAN``
cursor; Redlock's ``node:cursor:nodes scanned``; an offset for the default ``page()``).
"""

from __future__ import annotations

from typing import Any


class BadCursor(ValueError):
    """A page cursor the backend did not make (page cursors travel in URLs)."""


def parse_cursor(cursor: Any, limit: int = 2**64) -> int:
    """A number in a page cursor, as it comes from a URL: ``0 <= n < limit`` (a ``SCAN``
    cursor is an unsigned 64-bit number), else BadCursor: a crafted cursor is bad input."""
    if cursor is None or cursor == "":
        return 0
    if not (isinstance(cursor, str) and cursor.isascii() and cursor.isdigit()) or len(cursor) > 20:
        raise BadCursor(f"bad page cursor {cursor!r}")
    number = int(cursor)
    if number >= limit:
        raise BadCursor(f"bad page cursor {cursor!r}: out of range")
    return number
