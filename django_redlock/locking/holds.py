"""What a lock object knows of its holds, and which holds this process's actors have."""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..backends.base import BaseLockBackend
from ..forks import after_fork_in_child


@dataclass(slots=True)  # no __dict__: made and read on every acquire
class Hold:
    token: str
    fence: int | None
    actor: str  # the thread or asyncio task that took it
    depth: int = 0  # acquisitions through this lock object by this owner
    renewer: Any = None  # the Renewer renewing it, if any
    stop_at: float | None = None  # when renewing stops (monotonic): acquisition + max_hold
    releasing: bool = False  # a release was sent whose outcome is unknown
    # When the release that frees it began (monotonic; marked before it is sent): a "gone"
    # answered after that is this release's doing, no loss.
    release_began: float | None = None
    taken: Any = None  # its handle in the registry below (until its release is sent)
    observed: Any = None  # what metrics and spans keep of it (observe.Held)
    prior: str | None = None  # the token of the hold given a fence before it (Attempt.prior)
    # A number per level held (index: level - 1), new each time the level is taken: an owed
    # release (fencing's) names its hold and level by it, so it never releases a later hold
    # or a level taken again since (a reentrant owner's token is the same for every hold).
    stamps: tuple[int, ...] = ()
    # When it has run out at the latest (monotonic), a hold not renewed for good
    # (auto_renew=False, max_hold): past it, it no longer counts as its actor's (holds_it);
    # None: renewed until released.
    ends_by: float | None = None
    # Taken with a token kept from an unanswered try, whose request may still land after
    # this hold is released: its release marks the token (the late try is refused then).
    kept: bool = False


#: The source of :attr:`Hold.stamps` (``next()`` on it is atomic: no lock needed).
_stamps = itertools.count(1)


def new_stamp() -> int:
    return next(_stamps)


#: Which process this is, as a count of forks: checked on every lock operation, where
#: ``os.getpid()`` would be a system call each time.
process = 0


def _forked() -> None:
    global process
    process += 1


after_fork_in_child(_forked)


# Exclusive holds of this process (plain, reentrant, capped or not renewed) by (backend,
# name) -> the actors holding them: taking a name again that one's own thread or task holds
# would wait for itself (forever while the hold is renewed, else to its cap or TTL).
# A hold counts from take() until untake(), or until its Lock object is collected without
# a release (abandoned: no longer renewed, it runs out at its TTL), or (not renewed for good)
# until its Hold.ends_by. Its taker's: a Lock object handed on cannot be told from one kept.
_taken: dict[tuple[int, str], dict[str, int]] = {}
# id(handle) -> (handle, key, actor): the handles (weak references to the holding Lock
# objects) are kept here, not by the Lock, so their callbacks run whatever the Lock's fate.
_handles: dict[int, tuple[Any, tuple[int, str], str]] = {}
_abandoned: deque[int] = deque()  # ids of handles whose Lock was collected: to uncount
_mutex = threading.Lock()


def _count(key: tuple[int, str], actor: str, delta: int) -> None:
    actors = _taken.setdefault(key, {})
    count = actors.get(actor, 0) + delta
    if count > 0:
        actors[actor] = count
    else:
        actors.pop(actor, None)
        if not actors:
            del _taken[key]


def _collected(handle: Any) -> None:
    _abandoned.append(id(handle))  # only an append: this runs wherever the collector runs


def _sweep() -> None:
    """Uncount the holds whose Lock objects were collected (called locked)."""
    while _abandoned:
        item = _handles.pop(_abandoned.popleft(), None)
        if item is not None:
            _count(item[1], item[2], -1)


def take(backend: BaseLockBackend, name: str, actor: str, lock: Any) -> Any:
    """Count an exclusive hold of ``lock`` as taken by ``actor``; the handle for
    :func:`untake`."""
    key = (id(backend), name)
    handle = weakref.ref(lock, _collected)
    with _mutex:
        if _abandoned:
            _sweep()
        hid, item = id(handle), (handle, key, actor)
        old = _taken.get(key)  # a new dict, stored in one step below (no call between)
        actors = {actor: 1} if old is None else {**old, actor: old.get(actor, 0) + 1}
        # The handle and its count in two stores with no call between them (an interrupt
        # lands at a call): both or neither. A handle without its count would uncount
        # another object's hold when collected; a count without its handle never goes.
        _handles[hid] = item
        _taken[key] = actors
    return handle


def untake(handle: Any) -> None:
    with _mutex:
        if _abandoned:
            _sweep()
        item = _handles.pop(id(handle), None)
        if item is not None:
            _count(item[1], item[2], -1)


def taken_count() -> int:
    """How many (backend, name) pairs this process counts as taken (tests, diagnostics)."""
    with _mutex:
        _sweep()
        return len(_taken)


def holds_it(backend: BaseLockBackend, name: str, actor: str) -> bool:
    """Whether ``actor`` holds ``name`` through a Lock object, by this process's count: a
    hold not renewed for good counts only until it has run out (then a wait for the name is
    no wait for itself: the name is free, or someone else's)."""
    return bool(holding(backend, name, actor))


def holding(backend: BaseLockBackend, name: str, actor: str) -> list[tuple[Any, str]]:
    """The holds :func:`holds_it` counts: each as (its Lock object, its token)."""
    key = (id(backend), name)
    if _abandoned:
        with _mutex:
            _sweep()
    if actor not in _taken.get(key, ()):
        return []  # the usual case: no scan
    now = time.monotonic()
    with _mutex:
        mine = [item[0]() for item in _handles.values() if item[1] == key and item[2] == actor]
    return [(lock, token) for lock in mine if lock is not None
            for token in lock.held_tokens(actor, now)]  # fmt: skip


# Reentrant owners' hold counts as this process knows them, by (backend, name, owner), and
# whether the server may disagree: then it is told before the owner's next operation on that
# lock. An owner is a thread or task of this process, so only this process changes its
# count, and its belief is the truth to restore. The count is not kept apart: it is the sum
# of the owner's levels in the Lock objects that recorded some (``BaseLock.levels``), so a
# level taken or given up is one store in its object (a depth, a hold in or out), and an
# interrupt at any line (a burst of them too) leaves the count what the objects hold. The
# server's count changes first (a grant, a release's answer): the owner's count is marked
# unsure before the request is sent, and settled once its object is up to date.
# The owner's hold is one hold in Redis whichever Lock objects hold levels of it: a re-fence
# through one of them gives it a new fence, which every other takes (refenced(), below).
# -> [unsure, fence given by the last re-fence (0: none), a re-fence went unanswered,
#     the Lock objects that recorded levels (weakly)]
_believed: dict[tuple[int, str, str], list[Any]] = {}


def _levels(entry: list[Any], owner: str) -> int:
    return sum(lock.levels(owner) for lock in list(entry[3]))


def holds_levels(backend: BaseLockBackend, name: str, owner: str, lock: Any) -> None:
    """``lock`` is to record a level of ``owner``'s reentrant hold: its levels count from
    now on (called before the level goes in; again is nothing)."""
    key = (id(backend), name, owner)
    with _mutex:
        entry = _believed.get(key)
        if entry is None:
            entry = _believed[key] = [False, 0, False, weakref.WeakSet()]
        entry[3].add(lock)


def unsure(backend: BaseLockBackend, name: str, owner: str) -> None:
    """The server may disagree with the owner's count (a request sent whose answer is not in
    its object yet, or lost): told before the owner's next operation (:func:`unsettled`)."""
    key = (id(backend), name, owner)
    with _mutex:
        entry = _believed.get(key)
        if entry is None:
            entry = _believed[key] = [True, 0, False, weakref.WeakSet()]
        entry[0] = True


def believed(backend: BaseLockBackend, name: str, owner: str) -> int:
    """The owner's hold count as this process knows it (0: none)."""
    entry = _believed.get((id(backend), name, owner))
    return 0 if entry is None else _levels(entry, owner)


def unsettled(backend: BaseLockBackend, name: str, owner: str) -> int | None:
    """The count to tell the server, when it may disagree; else None."""
    entry = _believed.get((id(backend), name, owner))
    return _levels(entry, owner) if entry is not None and entry[0] else None


def settled(backend: BaseLockBackend, name: str, owner: str, count: int) -> None:
    """The server was told ``count`` (or agrees with it): sure again, unless the owner's
    count changed meanwhile. An entry with nothing held and nothing to tell goes (and its
    re-fence with it)."""
    key = (id(backend), name, owner)
    with _mutex:
        entry = _believed.get(key)
        if entry is not None and _levels(entry, owner) == count:  # nothing changed meanwhile
            entry[0] = False
            if count == 0:
                del _believed[key]


def refenced(backend: BaseLockBackend, name: str, owner: str, fence: int | None) -> None:
    """A re-fence of reentrant ``owner``'s hold answered: its new ``fence``, which every Lock
    object holding levels of it takes (:func:`refence_of`); None: no answer (the hold may
    have a new fence, unknown here). Nothing when the owner holds nothing here."""
    with _mutex:
        entry = _believed.get((id(backend), name, owner))
        if entry is None or not _levels(entry, owner):
            return
        if fence is None:
            entry[2] = True
        else:  # the hold's fence is known again
            entry[1], entry[2] = max(entry[1], fence), False


def refence_of(backend: BaseLockBackend, name: str, owner: str) -> tuple[int, bool]:
    """The fence the last re-fence of ``owner``'s reentrant hold gave it (0: none), and
    whether a re-fence went unanswered since it holds levels here."""
    entry = _believed.get((id(backend), name, owner))
    return (0, False) if entry is None else (int(entry[1]), bool(entry[2]))


def _forget_after_fork() -> None:
    global _mutex
    _taken.clear()  # the child holds nothing: its parent's holds are the parent's
    _handles.clear()
    _abandoned.clear()
    _believed.clear()
    _mutex = threading.Lock()


after_fork_in_child(_forget_after_fork)
