"""Holds in words, the same everywhere they are shown (the admin, the example shop)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .backends.base import LockInfo

SHORT_ID = 8  # a Celery task id's first characters: enough to tell tasks apart on a screen


def holder_parts(holder: Mapping[str, Any]) -> tuple[str, str]:
    """Who holds it and where: (``task nightly_sync 2c256f78`` or ``MainThread``,
    ``pid 9101 on web-1``); either may be empty (``holder`` as ``LockInfo.holder``)."""
    if holder.get("k"):
        name = str(holder.get("n") or "").rsplit(".", 1)[-1]
        who = " ".join(part for part in ("task", name, str(holder["k"])[:SHORT_ID]) if part)
    else:
        who = str(holder.get("t") or "")
    group = multi_text(holder)
    if group:
        who = f"{who} ({group})" if who else group
    pid = f"pid {holder['p']}" if holder.get("p") else ""
    where = " on ".join(part for part in (pid, str(holder.get("h") or "")) if part)
    return who, where


def holder_text(holder: Mapping[str, Any]) -> str:
    """Who holds it, short: ``task nightly_sync 2c256f78 · pid 9101 on web-1`` for a Celery
    task, ``MainThread · pid 9102 on web-1`` for a thread."""
    return " · ".join(part for part in holder_parts(holder) if part) or "unknown holder"


def holder_title(holder: Mapping[str, Any]) -> str:
    """Who holds it, in full (a hover text): the whole task id and name, the thread, the pid
    and the host."""
    parts = []
    if holder.get("k"):
        task = f"task {holder['k']}"
        parts.append(f"{task} ({holder['n']})" if holder.get("n") else task)
    if holder.get("t"):
        parts.append(f"thread {holder['t']}")
    if holder.get("p"):
        parts.append(f"pid {holder['p']}")
    if holder.get("h"):
        parts.append(f"host {holder['h']}")
    group = multi_text(holder, full=True)
    if group:
        parts.append(group)
    return ", ".join(parts) or "unknown holder"


def multi_text(holder: Mapping[str, Any], full: bool = False) -> str:
    """``multi-lock 1a2b3c4d of 2 names`` for a hold ``lock_all`` took with others (the
    same group id on each of them), else ""; ``full``: the whole group id."""
    size, _, group = str(holder.get("m") or "").partition(".")
    if not (size.isdigit() and group):
        return ""
    return f"multi-lock {group if full else group[-SHORT_ID:]} of {size} names"


def kind_text(lock: LockInfo, hold: LockInfo | None = None) -> str:
    """The kind of a lock, or of one of its holds (an item of ``lock.holders``): ``fair``,
    ``semaphore, 2 of 3 permits held``, ``read-write, read``."""
    if hold is None or not lock.holders:
        return lock.kind
    if hold.kind == "permit":
        of = f" of {lock.limit}" if lock.limit else ""
        return f"{lock.kind}, {len(lock.holders)}{of} permits held"
    return f"{lock.kind}, {hold.kind}"


def holds(lock: LockInfo) -> list[tuple[LockInfo, str]]:
    """The rows a lock is listed as (``LockInfo.rows``: its own hold, or one per permit or
    reader), each with its kind in words."""
    if not lock.holders:
        return [(lock, lock.kind)]
    pairs = zip(lock.holders, lock.rows(), strict=True)
    return [(row, kind_text(lock, lease)) for lease, row in pairs]
