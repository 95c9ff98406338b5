"""Fenced transactions: a lock's critical section that ends at the database.

A fenced block is ``transaction.atomic(using=...)``, opened once the lock is held, whose first
statement records the hold's fence in the lock's row of :class:`~.models.Fence` and checks it
at once: ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` on PostgreSQL and SQLite, which also
keeps the row locked until the transaction ends. A row with a larger fence raises
:class:`~.exceptions.StaleFence` before the body runs. So, per lock, committed fenced
transactions are in fence order, a stale holder never commits, and a holder's body starts only
once the previous holder's transaction ended, whatever became of that hold in Redis.

The lost-hold rule: a fenced block that committed never raises a lock error on the way out
(raising would invite a retry, which would apply the work twice); one that raises has
committed nothing. A hold found lost at the release is logged and signalled (``lock_lost``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction
from django.db.models import Max
from django.utils import timezone

from .exceptions import LockError, LockNotOwned, StaleFence

if TYPE_CHECKING:
    from .locking.base import BaseLock
    from .locking.holds import Hold

logger = logging.getLogger("django_redlock")


def database_of(atomic: Any) -> str | None:
    """The database alias ``atomic=`` names (True: Django's default), or None for no fenced
    transaction. Checked when the lock is built, before any Redis call."""
    if atomic is None or atomic is False:
        return None
    if atomic is True:
        return DEFAULT_DB_ALIAS
    if not isinstance(atomic, str):
        raise TypeError(f"atomic must be True, False or a DATABASES alias (str), not {atomic!r}")
    return check_database(atomic)


def check_database(alias: str) -> str:
    known = list(connections)
    if alias not in known:
        raise ValueError(
            f"atomic={alias!r} names no database: DATABASES has {', '.join(map(repr, known))}"
        )
    return alias


#: Fences Redis hands out stay below this (Lua numbers are doubles): none re-fences past it.
FENCE_LIMIT = 2**53


def row_key(backend: str, name: str) -> str:
    """The primary key of a lock's row (``name=""``: the backend's floor)."""
    return hashlib.sha256(f"{backend}\0{name}".encode()).hexdigest()


@contextlib.contextmanager
def fenced_transaction(lock: BaseLock, using: str | None = None) -> Iterator[None]:
    """``lock.atomic(using)``: see :meth:`~.locking.base.BaseLock.atomic`."""
    if not lock.exclusive:
        raise TypeError(
            f"{lock._describe()} is shared by several holders at once: a fenced transaction"
            " needs an exclusive lock (a lock, or the write of a read-write lock)"
        )
    using = check_database(using) if using is not None else lock.database or DEFAULT_DB_ALIAS
    _owner, hold = lock._held()  # LockNotOwned / LockLost, before the database is touched
    if hold.fence is None:
        raise LockError(f"{lock._describe()}: this hold has no fencing token to record")
    with transaction.atomic(using=using):
        check_fence(
            using, lock.using, lock.name, hold.fence, lock._describe(), refencer(lock, hold)
        )
        yield


def check_fence(
    using: str,
    backend: str,
    name: str,
    fence: int,
    describe: str = "",
    refence: Callable[[int], int] | None = None,
) -> None:
    """Record ``fence`` as the newest of lock ``name`` on ``backend``, or raise StaleFence if
    a larger one is recorded. In a transaction: the row stays locked until it ends. One
    statement when the row exists; two the first time (the floor of ``prune-fences``).

    A larger fence recorded does not yet make the hold stale: the Redis server's clock may
    have gone back while the name's counter was lost. ``refence(recorded)`` (see
    :func:`refencer`) then asks Redis, and a hold still current comes back with a fence above
    the recorded one, checked again here while the row stays locked; only a hold that is not
    current (``refence`` answers 0 or -1) raises StaleFence."""
    connection = connections[using]
    now = timezone.now()
    key = row_key(backend, name)
    if connection.vendor in ("postgresql", "sqlite") and (
        connection.features.can_return_columns_from_insert  # SQLite >= 3.35
    ):
        outcome = _upsert(connection, key, backend, name, fence, now)
    else:
        outcome = _portable(using, key, backend, name, fence, now)
    floor = outcome == "new"
    if floor:
        # A name's first row, or one pruned: fences below the floor are older than the rows
        # prune-fences forgot, so they may be below what those rows held.
        recorded = _recorded(using, row_key(backend, ""))
        if recorded is None or recorded <= fence:
            return
    elif outcome == "stale":
        recorded = _recorded(using, key)
    else:
        return
    assert recorded is not None  # the row is locked: it cannot have gone meanwhile
    # Redis's Lua numbers are exact below 2**53 (the clock's us reach it in year 2255): no
    # re-fence can pass a recorded fence beyond that.
    refenced = refence(recorded) if refence is not None and recorded < FENCE_LIMIT else -1
    if refenced > recorded:  # current in Redis: check the new fence (once: no re-fence then)
        check_fence(using, backend, name, refenced, describe)
        return
    raise StaleFence(stale_message(describe or repr(name), using, fence, recorded, floor, refenced),
                     fence, recorded)  # fmt: skip


def refencer(lock: BaseLock, hold: Hold) -> Callable[[int], int]:
    """``hold``'s re-fence (:meth:`~.backends.base.BaseLockBackend.op_refence`), one round
    trip: the new fence, which the hold takes; or 0 (nobody holds the lock) or -1 (another
    hold does) when the hold is not current. No answer raises (BackendUnavailable,
    QuorumNotReached): unknown is not stale, and the transaction rolls back all the same."""

    def refence(recorded: int) -> int:
        backend = lock.backend
        fence = backend.execute(backend.op_refence(lock.name, hold.token, recorded))
        if fence > 0:
            hold.fence = fence
        return fence

    return refence


def stale_message(
    describe: str, using: str, fence: int, recorded: int, floor: bool, refenced: int
) -> str:
    """What StaleFence says: whose fence is recorded, and why this hold is outdated."""
    what = f"the floor {recorded} left by prune-fences" if floor else f"fence {recorded} recorded"
    if recorded >= FENCE_LIMIT:
        why = f"no fence Redis hands out can pass it (they are exact below {FENCE_LIMIT})"
    elif refenced == 0:
        why = (
            "this hold is not current any more (its token no longer holds the lock in Redis:"
            " it expired or was released)"
        )
    else:
        why = "a later hold has the lock: this hold is outdated"
    return (
        f"{describe}: fence {fence} is older than {what} in database {using!r}; {why};"
        " nothing was committed"
    )


def _upsert(connection: Any, key: str, backend: str, name: str, fence: int, now: Any) -> str:
    sql = _UPSERT_SQL.get(connection.vendor) or _UPSERT_SQL.setdefault(
        connection.vendor, _upsert_sql(connection)
    )
    touched = connection.ops.adapt_datetimefield_value(now)
    with connection.cursor() as cursor:
        cursor.execute(sql, [key, backend, name, fence, touched])
        row = cursor.fetchone()
    if row is None:
        return "stale"
    return "new" if row[0] is None else "newest"


_UPSERT_SQL: dict[str, str] = {}  # by vendor: the text is built once, not per block


def _upsert_sql(connection: Any) -> str:
    from .models import Fence

    qn = connection.ops.quote_name
    table = qn(Fence._meta.db_table)
    key_, fence_, previous, at = qn("key"), qn("fence"), qn("previous"), qn("touched")
    # The WHERE false on a conflict: no row returned (the row is locked all the same).
    return (
        f"INSERT INTO {table} ({key_}, {qn('backend')}, {qn('name')}, {fence_}, {previous},"
        f" {at}) VALUES (%s, %s, %s, %s, NULL, %s)"
        f" ON CONFLICT ({key_}) DO UPDATE SET {previous} = {table}.{fence_},"
        f" {fence_} = EXCLUDED.{fence_}, {at} = EXCLUDED.{at}"
        f" WHERE {table}.{fence_} <= EXCLUDED.{fence_} RETURNING {previous}"
    )


def _portable(using: str, key: str, backend: str, name: str, fence: int, now: Any) -> str:
    """Other databases: SELECT ... FOR UPDATE, then UPDATE or INSERT (Django's ORM)."""
    from .models import Fence

    rows = Fence.objects.using(using)
    while True:
        found = list(rows.select_for_update().filter(key=key).values_list("fence", flat=True))
        if found:
            if found[0] > fence:
                return "stale"
            rows.filter(key=key).update(fence=fence, previous=found[0], touched=now)
            return "newest"
        try:
            with transaction.atomic(using=using):  # a savepoint: a concurrent insert may win
                rows.create(key=key, backend=backend, name=name, fence=fence, touched=now)
        except IntegrityError:
            continue  # then lock its row and compare
        return "new"


def _recorded(using: str, key: str) -> int | None:
    from .models import Fence

    found = Fence.objects.using(using).filter(key=key).values_list("fence", flat=True)
    return next(iter(found), None)


# -- ``with lock`` for a lock built with ``atomic=`` -------------------------------------------

_open = threading.local()  # the fenced blocks this thread is in, innermost last


def enter_block(lock: BaseLock) -> None:
    """After the acquire: open the fenced block, or release the lock and raise."""
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(fenced_transaction(lock))
    except BaseException:
        # StaleFence, or the database failed: nothing committed. Free the lock for others (a
        # stale hold is most likely lost: that is logged).
        with contextlib.suppress(LockError):
            lock.release()
        raise
    _blocks().append((lock, stack))


def leave_block(
    lock: BaseLock,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> None:
    """Commit (or roll back), then release: never the release first."""
    blocks = _blocks()
    index = max(i for i, (held, _) in enumerate(blocks) if held is lock)
    _, stack = blocks.pop(index)
    try:
        stack.__exit__(exc_type, exc, tb)
    except BaseException:  # the commit failed: nothing committed
        with contextlib.suppress(LockError):
            lock.release()
        raise
    if exc_type is None:
        release_after_commit(lock)
        return
    # Rolled back: as any lock's `with`, the body's exception says more than a loss.
    with contextlib.suppress(LockNotOwned):
        lock.release()


def release_after_commit(lock: BaseLock) -> None:
    """Release after a fenced block committed (the lost-hold rule): whatever the release
    finds (lost, or no answer: the hold then runs out at its TTL), nothing is raised. The
    commit stands, in fence order (the lock's row was locked from the check to the commit),
    and raising would invite a retry that applies the work twice."""
    try:
        lock.release()
    except LockError as exc:
        logger.warning("redlock: %s: its fenced transaction committed; then: %s",
                       lock._describe(), exc)  # fmt: skip


def _blocks() -> list[tuple[BaseLock, contextlib.ExitStack]]:
    blocks = getattr(_open, "blocks", None)
    if blocks is None:
        blocks = _open.blocks = []
    return blocks


# -- manage.py redlock prune-fences ----------------------------------------------------------


def prune_fences(using: str, older_than: datetime.timedelta) -> int:
    """Delete the rows of locks whose last fenced block is older than ``older_than``; how many.

    Each backend's floor (its row with an empty name) rises to the largest fence deleted, in
    the same transaction: a first block below the floor is refused as its pruned row would
    have refused it. New holds are not: their fences come from the Redis server's clock (ms x
    1000), above those of rows untouched since, even when Redis lost its counters.
    """
    from .models import Fence

    rows = Fence.objects.using(using)
    now = timezone.now()
    with transaction.atomic(using=using):
        old = rows.filter(touched__lt=now - older_than).exclude(name="")
        by_backend = old.order_by().values("backend").annotate(top=Max("fence"))
        tops = dict(by_backend.values_list("backend", "top"))
        deleted, _ = old.delete()
        for backend, top in tops.items():
            key = row_key(backend, "")
            floor = list(rows.select_for_update().filter(key=key).values_list("fence", flat=True))
            if not floor:
                rows.create(key=key, backend=backend, name="", fence=top, touched=now)
            elif floor[0] < top:
                rows.filter(key=key).update(fence=top, touched=now)
    return deleted
