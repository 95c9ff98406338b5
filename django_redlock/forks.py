"""What a forked child forgets: the package's one ``os.register_at_fork``.

A child of ``fork()`` (multiprocessing, a Celery prefork worker, gunicorn) starts with a copy
of its parent's memory and only the thread that forked. What that memory says about holds,
owners, connections, subscribers and worker threads is the parent's, not the child's: each
module that keeps such state registers a hook here (:func:`after_fork_in_child`), and the
hooks run in the child before ``os.fork()`` returns there, so before any lock operation.

Rules: hooks run in the order registered, each once per fork; a hook must not do I/O or take
a lock another thread may have held at the fork (it may start afresh: a new ``Lock()``). One
that raises does not stop the others; the first error then goes where Python sends an at-fork
callback's (printed as unraisable; the fork goes on).
"""

from __future__ import annotations

import os
from collections.abc import Callable

_hooks: list[Callable[[], None]] = []


def after_fork_in_child(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook()`` in every forked child, right after the fork; returns ``hook`` (so it
    serves as a decorator). Registering the same hook twice runs it once."""
    if hook not in _hooks:
        _hooks.append(hook)
    return hook


def _in_child() -> None:
    first: BaseException | None = None
    for hook in tuple(_hooks):
        try:
            hook()
        except BaseException as exc:  # the others still run: the child's state is at stake
            first = first or exc
    if first is not None:
        raise first


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork()
    os.register_at_fork(after_in_child=_in_child)
