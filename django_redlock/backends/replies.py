"""The scripts' replies about a hold, read into :class:`~.base.LockInfo`: a plain or
reentrant hold (``lock_info``) and a semaphore's or read-write lock's leases
(``lease_info``), as the Lua scripts write them (the formats are named in each function).
Parsing only: no I/O, and nothing here knows a backend."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from ..exceptions import LockError
from ..identity import parse_holder
from .base import Kind, LockInfo


def _when(ms: Any) -> datetime | None:
    text = ms.decode() if isinstance(ms, bytes) else str(ms)
    return datetime.fromtimestamp(int(text) / 1000, tz=timezone.utc) if text.isdigit() else None


def _holder(meta: str) -> dict[str, Any]:
    holder: dict[str, Any] = parse_holder(meta)
    if holder.get("p", "").isdigit():
        holder["p"] = int(holder["p"])
    return holder


def lock_info(
    name: str,
    alias: str,
    value: str | dict[str, str],
    pttl_ms: int,
    waiters: int,
    longest_wait_ms: int = -1,
) -> LockInfo:
    """Read a hold as the scripts write it: a plain string or a reentrant hash."""
    ttl = pttl_ms / 1000 if pttl_ms >= 0 else None
    if isinstance(value, str):  # token|fence|acquired-ms|holder
        parts = [*value.split("|", 3), "", "", ""]
        fence = int(parts[1]) if parts[1].isdigit() else None
        holder = _holder(parts[3])
        count = 1
        reentrant = False
        token = parts[0]
    else:
        fence = int(value[":fence"]) if value.get(":fence", "").isdigit() else None
        holder = _holder(value.get(":meta", ""))
        counts = [int(v) for k, v in value.items() if not k.startswith(":") and v.isdigit()]
        count = sum(counts)
        parts = ["", "", value.get(":at", "")]
        reentrant = True
        token = None
    kind = Kind(reentrant=reentrant, fair=bool(holder.pop("q", False)))
    longest = longest_wait_ms / 1000 if longest_wait_ms >= 0 else None
    return LockInfo(
        name,
        alias,
        kind.label,
        fence,
        ttl,
        _when(parts[2]),
        holder,
        count,
        waiters,
        token,
        longest_wait=longest,
    )


#: What a lease's mode letter (lua/_permits.lua) is called.
LEASE_KINDS = {"s": "permit", "r": "read", "w": "write"}


def lease_info(
    name: str, alias: str, leases: Sequence[tuple[str, int, str]], waiters: int, limit: Any
) -> LockInfo | None:
    """A semaphore or read-write lock from its live leases, (token, ms left, detail) each,
    the detail as the scripts write it: 'fence|acquired-ms|count|mode|holder'."""
    if not leases:
        return None
    holders = []
    for token, ms_left, detail in leases:
        parts = [*detail.split("|", 4), "", "", "", "", ""]
        fence = int(parts[0]) if parts[0].isdigit() else None
        count = int(parts[2]) if parts[2].isdigit() else 1
        kind = LEASE_KINDS.get(parts[3], "permit")
        holder = _holder(parts[4])
        holder.pop("q", None)
        holders.append(LockInfo(name, alias, kind, fence, ms_left / 1000, _when(parts[1]),
                                holder, count, 0, token))  # fmt: skip
    kinds = {h.kind for h in holders}
    limit = int(limit) if isinstance(limit, (int, str)) and str(limit).isdigit() else None
    kind = "semaphore" if "permit" in kinds else "read-write"
    ttl = max(h.ttl or 0.0 for h in holders)
    held = len(holders) if kind == "semaphore" else sum(h.hold_count for h in holders)
    return LockInfo(name, alias, kind, None, ttl, min(h.acquired_at or _EPOCH for h in holders),
                    {}, held, waiters, None, limit, holders)  # fmt: skip


_EPOCH = datetime.fromtimestamp(0, tz=timezone.utc)


#: What a lease's mode letter is a hold of, in a kind clash's message.
CLASH_KINDS = {"s": "semaphore", "r": "read-write lock (a read)", "w": "read-write lock (a write)"}


def kind_clash(name: str, alias: str, asking: str, held: Any) -> LockError:
    """The error for one name used as two kinds (one name is one kind at a time): ``held``,
    the kind a script found holding it ('lock', 'semaphore', 'read-write lock'), and
    ``asking``, the caller's. Raised before anything is granted or waited for."""
    held = held.decode() if isinstance(held, bytes) else str(held)
    if held == "lock":
        held = "lock (plain, reentrant or fair)"
    return LockError(
        f"{name!r} on backend {alias!r} is held as another kind, a {held}: a {asking} cannot"
        " take it (one name is one kind at a time: a lock, a semaphore or a read-write"
        " lock); use another name"
    )
