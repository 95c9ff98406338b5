"""Who owns a connection: exactly one owner at a time, and a debug mode that checks it.

A connection's owner is written on the connection itself (one attribute, planted through
:mod:`django_redlock.wire`: :func:`~django_redlock.wire.owner_of`,
:func:`~django_redlock.wire.set_owner`). No owner written
means its pool (for a connection made outside any pool, as the Redlock fan-outs make theirs:
nobody, not yet handed on or closed). An owner is any object (an :class:`Owner`, a
structure that keeps connections); only the owner may send on a connection, read from it,
or hand it on.

The rule every move follows, so that an exception at any line (``BaseException`` included:
an interrupt, a time limit) leaves each connection with one owner:

* The new owner's structure is filled first, then :func:`move` commits the move in one
  attribute store. Before that store the old owner still owns it (its clean-up closes it);
  after it, the new one does.
* The old owner's structure is emptied only after the commit, and a clean-up closes only
  what it still owns (:func:`owns`): an entry left behind by an interrupted move is stale.
* A structure that hands a connection out takes only entries it owns, and drops the stale
  ones (another owner has the connection, or closed it).

``DJANGO_REDLOCK_CHECK_OWNERS=1`` in the environment (read at import; the test suite sets
it) makes a move by anyone but the owner, and :func:`using` by anyone but the owner, raise
:class:`OwnershipError`: a connection released twice, or used by two owners, fails loudly
instead of mixing two requests' replies. Without it, a move by a non-owner is refused
(returns False) and :func:`using` checks nothing.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..wire import owner_of, set_owner

CHECK = os.environ.get("DJANGO_REDLOCK_CHECK_OWNERS", "") not in ("", "0")

# Reentrant: a signal handler that runs inside a move (on the same thread) moves too.
_mutex = threading.RLock()


class OwnershipError(AssertionError):
    """A connection moved or used by an object that does not own it (debug mode)."""


class Owner:
    """A named owner: one request, a reader, a clean-up. ``held``: what it owns, filled by
    :func:`move` before the commit and emptied after, so its clean-up finds everything it
    owns whatever line an exception hit."""

    __slots__ = ("held", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.held: set[Any] = set()

    def __repr__(self) -> str:
        return f"<owner {self.name} {id(self):#x}>"


class _Pool:
    def __repr__(self) -> str:
        return "<owner pool>"


#: The pool the connection came from (no owner written on it yet, or given back).
POOL: Any = _Pool()


def owner(connection: Any) -> Any:
    return owner_of(connection, POOL)


def owns(connection: Any, who: Any) -> bool:
    """Whether ``who`` owns the connection (a clean-up closes only what it still owns)."""
    return owner_of(connection, POOL) is who


def move(connection: Any, source: Any, target: Any) -> bool:
    """Hand the connection from ``source`` to ``target``: the single store that commits it.

    False, and nothing moved, when ``source`` does not own it (debug mode: OwnershipError).
    """
    if CHECK:
        with _mutex:
            current = owner_of(connection, POOL)
            if current is not source:
                raise OwnershipError(
                    f"{connection!r} moved by {source!r} to {target!r}, but owned by {current!r}"
                )
            return _commit(connection, source, target)
    if owner_of(connection, POOL) is not source:
        return False
    return _commit(connection, source, target)


def _commit(connection: Any, source: Any, target: Any) -> bool:
    if isinstance(target, Owner):
        target.held.add(connection)
    set_owner(connection, target)  # the move
    if isinstance(source, Owner):
        source.held.discard(connection)
    return True


def using(connection: Any, who: Any) -> None:
    """Debug mode: raise unless ``who`` owns the connection it is about to send or read on."""
    if CHECK:
        current = owner_of(connection, POOL)
        if current is not who:
            raise OwnershipError(f"{connection!r} used by {who!r}, but owned by {current!r}")
