"""The read-write lock: many readers at once, or one writer.

Reads and the write are leases on one name (see :mod:`.leases`), so a reader or writer that
dies frees its hold at its TTL. A waiting writer holds a lease on its place (renewed as it
waits): while it lives, new readers are refused, so a stream of readers never starves a
writer. Reads are reentrant per owner (thread or asyncio task); a read-to-write upgrade is
refused with a LockError (two readers upgrading would wait for each other forever). Every
hold gets a fence from the name's counter: writers' fences strictly increase.
"""

from __future__ import annotations

from typing import Any

from ..backends.base import Attempt, LockInfo, Op
from ..exceptions import LockError
from ..fencing import database_of
from ..handler import DEFAULT_LOCK_ALIAS
from ..identity import owner_id
from .holds import holds_it
from .leases import LeaseLock
from .steps import Steps


class ReadLock(LeaseLock):
    """A read hold of a :class:`ReadWriteLock`'s name: shared with other readers."""

    noun = "read lock"
    mode = "r"
    offered_as = "read-write locks"
    reentrant = True  # the owner (thread or task) holds it, and may take it again
    exclusive = False

    def __init__(self, name: str, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self._check_backend()

    def _acquire(self, blocking: bool, timeout: float | None) -> Steps[bool]:
        if blocking and timeout is None and holds_it(self.backend, self.name, owner_id()):
            raise LockError(
                f"{self.describe()}: this thread or task holds the write lock; reading now"
                " with no timeout would wait for itself forever: release the write lock first"
            )
        return (yield from super()._acquire(blocking, timeout))

    def _settle(self, owner: str, marks: bool = True) -> Steps[None]:
        yield from self._settle_reads(owner, marks)

    def _busy(self, info: LockInfo | None) -> bool:
        return info is not None and any(h.kind == "write" for h in info.holders)


class WriteLock(LeaseLock):
    """The write hold of a :class:`ReadWriteLock`'s name: no readers, no other writer."""

    noun = "write lock"
    mode = "w"
    offered_as = "read-write locks"
    queued = True  # a waiting writer keeps a lease on its place: readers wait behind it
    exclusive = True

    def __init__(self, name: str, *, atomic: bool | str | None = None, **kwargs: Any) -> None:
        self.database = database_of(atomic)
        super().__init__(name, **kwargs)
        self._check_backend()

    def _init_kwargs(self) -> dict[str, Any]:
        return {**super()._init_kwargs(), "atomic": self.database}

    def _acquire(self, blocking: bool, timeout: float | None) -> Steps[bool]:
        # A read of this owner's whose reply was lost is settled first, not refused as an
        # upgrade.
        yield from self._settle_reads(owner_id())
        return (yield from super()._acquire(blocking, timeout))

    def _op_acquire(
        self, token: str, ttl_ms: int, meta: str, waiter: str | None, wait_ms: int
    ) -> Op[Attempt]:
        # The owner's read token goes along: holding a read, it is refused (an upgrade).
        return self.backend.op_lease_acquire(
            self.name, token, ttl_ms, meta, "w", 0, False, waiter, wait_ms, owner_id()
        )

    def _busy(self, info: LockInfo | None) -> bool:
        return info is not None and bool(info.holders)


class ReadWriteLock:
    """Many readers or one writer of ``name``: ``with rw.read(): ...``, ``with rw.write():``.

    ``read()`` and ``write()`` give lock objects with the whole Lock API (acquire, release,
    extend, owned, fence, token, ``with``, ``async with``, decorator), built with this
    object's settings, overridden by their own arguments.
    """

    def __init__(
        self,
        name: str,
        *,
        ttl: float | None = None,
        using: str = DEFAULT_LOCK_ALIAS,
        timeout: float | None = None,
        blocking: bool = True,
        auto_renew: bool = True,
        max_hold: float | None = None,
    ) -> None:
        self.settings: dict[str, Any] = {
            "ttl": ttl,
            "using": using,
            "timeout": timeout,
            "blocking": blocking,
            "auto_renew": auto_renew,
            "max_hold": max_hold,
        }
        # Checked (name, TTL, timeout, backend) now, before any I/O, by a first read lock.
        self._reader = ReadLock(name, **self.settings)
        self.name = self._reader.name
        self.using = using

    def __repr__(self) -> str:
        return f"<ReadWriteLock {self.name!r} on {self.using!r}>"

    def read(self, **overrides: Any) -> ReadLock:
        """A read lock object: many readers hold at once; waits while a writer holds or
        waits. Arguments as :func:`read_write_lock`'s, overriding this object's."""
        if "atomic" in overrides:
            raise TypeError(
                f"read lock {self.name!r}: atomic= is for write(): readers hold at once, and a"
                " fenced transaction needs one holder at a time"
            )
        return ReadLock(self.name, **{**self.settings, **overrides})

    def write(self, **overrides: Any) -> WriteLock:
        """A write lock object: one writer, no readers. ``atomic=True`` (or a ``DATABASES``
        alias): ``with`` runs the body in a fenced transaction, as ``lock(..., atomic=)``."""
        return WriteLock(self.name, **{**self.settings, **overrides})

    def holders(self) -> list[LockInfo]:
        """Every live read and write hold (kind "read" or "write")."""
        return self._reader.holders()

    async def aholders(self) -> list[LockInfo]:
        return await self._reader.aholders()


def read_write_lock(
    name: str,
    *,
    ttl: float | None = None,
    using: str = DEFAULT_LOCK_ALIAS,
    timeout: float | None = None,
    blocking: bool = True,
    auto_renew: bool = True,
    max_hold: float | None = None,
) -> ReadWriteLock:
    """A :class:`ReadWriteLock` on backend ``using``."""
    return ReadWriteLock(
        name,
        ttl=ttl,
        using=using,
        timeout=timeout,
        blocking=blocking,
        auto_renew=auto_renew,
        max_hold=max_hold,
    )
