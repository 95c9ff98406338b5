"""Fenced transactions: a lock's critical section that ends at the database.

A fenced block is ``transaction.atomic(using=...)``, opened once the lock is held, whose first
statement records the hold's fence in the lock's row of :class:`~.models.Fence` and checks it
at once: ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` on PostgreSQL and SQLite, which also
keeps the row locked until the transaction ends. A row with a larger fence raises
:class:`~.exceptions.StaleFence` before the body runs. So, per lock, committed fenced
transactions are in fence order, a stale holder never commits, and a holder's body starts only
once the previous holder's transaction ended, whatever became of that hold in Redis.

The block is a state machine (docs/topics/fencing.md draws it): waiting in Redis, holding,
row locked, committed, released. Its one rule for callers: **a block that raises committed
nothing; a block that returns committed** (a savepoint, inside an outer transaction), save
``CommitOutcomeUnknown``: the connection failed during the COMMIT and the database could not
be asked afterwards. So:

* the wait for the row is bounded (:func:`row_wait`): a cycle through Redis and the database
  (one thread holds a lock in Redis and waits for a row, the other holds the row and waits
  in Redis) is invisible to both, and would never end;
* a transaction the body left unable to commit (PostgreSQL's aborted state after a caught
  error, Django's ``needs_rollback``, SQLite's own rollback inside the body) is rolled back
  and raised, never reported as committed;
* a COMMIT whose reply was lost is settled from the lock's row, read on a new connection
  (:func:`commit_outcome`): the block's upsert wrote its fence there, in the same transaction;
* once the COMMIT happened (a first robust ``on_commit`` marks it), nothing is raised as if it
  had not: an ``on_commit`` callback's error is logged, and a lost hold at the release too
  (the lost-hold rule: raising would invite a retry, which would apply the work twice).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Protocol

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from .exceptions import CommitOutcomeUnknown, LockError, LockNotAcquired, LockNotOwned, StaleFence

logger = logging.getLogger("django_redlock")


class FencedHold(Protocol):
    """What a fenced block reads and writes of a hold (``locking.holds.Hold``)."""

    fence: int | None


class FencedLock(Protocol):
    """What a fenced block asks of its lock (``locking.base.BaseLock``: the locking layer sits
    above this module and hands itself in; this module never imports it)."""

    name: str
    using: str
    database: str | None
    blocking: bool
    timeout: float | None
    lock_ttl: float

    @property
    def exclusive(self) -> bool: ...

    def describe(self) -> str:
        """How messages name the lock."""

    def current_hold(self) -> tuple[str, FencedHold]:
        """This owner's hold; LockNotOwned or LockLost when there is none (no I/O)."""

    def refencer(self, hold: Any) -> Callable[[int], int]:
        """``hold``'s re-fence: see :meth:`~.locking.base.BaseLock.refencer`."""

    def release(self) -> None: ...


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


def row_wait(lock: FencedLock) -> float:
    """How long a block waits for its lock's row (seconds): ``timeout=`` when the lock has
    one, else the lock's TTL; ``blocking=False``: not at all. The row is locked by another
    transaction only when the previous holder's transaction outlived its hold (released early
    inside an outer transaction, lost, or paused in its block): past this wait, the lock is
    treated as busy (``LockNotAcquired``), which also breaks a wait cycle through Redis."""
    if not lock.blocking:
        return 0.0
    return lock.timeout if lock.timeout is not None else lock.lock_ttl


class _Committed:
    """Set by the block's first ``on_commit`` callback (robust: it cannot fail): Django runs
    the callbacks after the COMMIT, in order, so once this is set the COMMIT happened."""

    done = False

    def __call__(self) -> None:
        self.done = True


@contextlib.contextmanager
def fenced_transaction(lock: FencedLock, using: str | None = None) -> Iterator[None]:
    """``lock.atomic(using)``: see :meth:`~.locking.base.BaseLock.atomic`.

    Raises (nothing committed): ``StaleFence``; ``LockNotAcquired`` when the row stayed
    locked past :func:`row_wait`; the body's exception; ``TransactionManagementError`` when
    the body left the transaction unable to commit; the database's error when the COMMIT
    failed. Returns once committed: an ``on_commit`` callback's ``Exception`` is then logged,
    not raised (a ``BaseException`` such as ``KeyboardInterrupt`` still propagates).

    The connection lost during the COMMIT (an ``OperationalError`` or ``InterfaceError`` from
    the outermost transaction's exit, the commit marker not run): the server may have
    committed. :func:`commit_outcome` asks on a new connection whether the lock's row carries
    this block's fence and time (the upsert wrote them in the same transaction): yes, the
    block returns as committed (a warning logged; its ``on_commit`` callbacks did not run);
    no, the database's error (nothing committed); no answer, ``CommitOutcomeUnknown``."""
    if not lock.exclusive:
        raise TypeError(
            f"{lock.describe()} is shared by several holders at once: a fenced transaction"
            " needs an exclusive lock (a lock, or the write of a read-write lock)"
        )
    using = check_database(using) if using is not None else lock.database or DEFAULT_DB_ALIAS
    _owner, hold = lock.current_hold()  # LockNotOwned / LockLost, before the database is touched
    if hold.fence is None:
        raise LockError(f"{lock.describe()}: this hold has no fencing token to record")
    committed = _Committed()
    outermost = not connections[using].in_atomic_block  # its exit is the COMMIT
    touched = timezone.now()  # the row's time: with the fence, this block's mark in the row
    fence, exiting = hold.fence, False
    try:
        with transaction.atomic(using=using):
            check_fence(using, lock.using, lock.name, hold.fence, lock.describe(),
                        lock.refencer(hold), wait=row_wait(lock), now=touched)  # fmt: skip
            transaction.on_commit(committed, using=using, robust=True)  # first: marks COMMIT
            yield
            refuse_unfinished(using, lock.describe())
            exiting = outermost  # from here on, only the COMMIT can fail
    except Exception as exc:
        if committed.done:
            pass
        elif exiting and isinstance(exc, (OperationalError, InterfaceError)):
            # Re-fenced in the block: the new fence is this block's alone, whatever the time.
            mark = None if hold.fence != fence else touched
            outcome = commit_outcome(using, row_key(lock.using, lock.name), hold.fence, mark,
                                     min(max(row_wait(lock), 5.0), 60.0))  # fmt: skip
            if outcome is None:
                raise CommitOutcomeUnknown(
                    f"{lock.describe()}: the connection to database {using!r} failed during"
                    f" the COMMIT of its fenced transaction ({exc}), and the database could not"
                    " be asked whether it committed: the outcome is UNKNOWN. Do not retry"
                    " blindly: check what the block wrote first."
                ) from exc
            if not outcome:
                raise  # the row does not carry this block's fence: nothing committed
            logger.warning(
                "redlock: %s: the connection failed during the COMMIT of its fenced transaction"
                " (%s), yet the lock's row carries its fence: it committed (its on_commit"
                " callbacks did not run)",
                lock.describe(),
                exc,
            )
            return
        else:
            raise  # nothing committed
        # The COMMIT happened; an on_commit callback raised after it. Raising now would say
        # "not committed" and invite a retry that applies the work twice.
        logger.exception(
            "redlock: %s: its fenced transaction committed; then an on_commit callback raised",
            lock.describe(),
        )


def commit_outcome(
    using: str, key: str, fence: int, touched: datetime.datetime | None, wait: float
) -> bool | None:
    """Whether a fenced transaction whose COMMIT's reply was lost committed, asked on a new
    connection: True if the lock's row (key ``key``) carries ``fence`` (and ``touched``, unless
    None: a hold's blocks share its fence), False if not, None if the database did not answer.
    On PostgreSQL the read locks the row (``FOR SHARE``, at most ``wait`` seconds): a server
    still finishing that transaction holds it, and the answer comes once the transaction
    ended, either way."""
    from .models import Fence

    connection = connections.create_connection(using)
    try:
        qn = connection.ops.quote_name
        sql = f"SELECT {qn('fence')}, {qn('touched')} FROM {qn(Fence._meta.db_table)}"
        sql += f" WHERE {qn('key')} = %s"
        with connection.cursor() as cursor:
            postgresql = connection.vendor == "postgresql"
            if postgresql:  # the bound for this read only (a pooled connection keeps GUCs)
                cursor.execute("BEGIN")
                cursor.execute("SELECT set_config('lock_timeout', %s, true)", [_bound(wait)])
                sql += " FOR SHARE"
            cursor.execute(sql, [key])
            row = cursor.fetchone()
            if postgresql:
                cursor.execute("COMMIT")
            expected = (
                None if touched is None else connection.ops.adapt_datetimefield_value(touched)
            )
    except DatabaseError:
        logger.warning("redlock: database %r did not answer after a lost COMMIT", using,
                       exc_info=True)  # fmt: skip
        return None
    finally:
        with contextlib.suppress(DatabaseError):
            connection.close()
    if row is None or int(row[0]) != fence:
        return False
    return touched is None or row[1] == expected or str(row[1]) == str(expected)


def refuse_unfinished(using: str, describe: str) -> None:
    """Raise ``TransactionManagementError`` if the transaction cannot commit: Django marked it
    for rollback (``set_rollback(True)``, an inner ``atomic(savepoint=False)`` that failed),
    or PostgreSQL aborted it (an error the body caught without a savepoint). Its COMMIT would
    roll back, silently: the block must not return as if it had committed."""
    connection = connections[using]
    if connection.needs_rollback:
        why = "it was marked for rollback (transaction.set_rollback(True), or a failed inner block)"
    elif _rolled_back(connection):
        raise TransactionManagementError(
            f"{describe}: its fenced transaction was rolled back by the database inside the"
            " block (SQLite does so on a trigger's RAISE(ROLLBACK), a full disk, an I/O error,"
            " out of memory, an interrupt), and the body went on: nothing of the transaction"
            " committed, but statements the body ran after that error ran outside it, each"
            " committed on its own, without the fence check. Do not catch such errors in the"
            " block."
        )
    elif _aborted(connection):
        why = "an error inside it (caught by the body, without a savepoint) aborted it"
    else:
        return
    raise TransactionManagementError(
        f"{describe}: its fenced transaction cannot commit: {why}; rolled back, nothing"
        " committed. Catch database errors inside `with transaction.atomic():` in the block."
    )


def _rolled_back(connection: Any) -> bool:
    """Whether SQLite ended the block's transaction itself: some errors (a trigger's
    ``RAISE(ROLLBACK)``, SQLITE_FULL, IOERR, NOMEM, INTERRUPT) roll it back whole, and the
    statements after them autocommit. Mid-block the driver is then out of any transaction
    (the block's upsert ran in it, so it was in one)."""
    if connection.vendor != "sqlite" or connection.connection is None:
        return False
    return not connection.connection.in_transaction


def _aborted(connection: Any) -> bool:
    """Whether PostgreSQL holds the connection's transaction in its failed state."""
    if connection.vendor != "postgresql" or connection.connection is None:
        return False
    raw = connection.connection
    info = getattr(raw, "info", None)  # psycopg 3
    if info is not None:
        return bool(info.transaction_status == 3)  # pq.TransactionStatus.INERROR
    return bool(raw.get_transaction_status() == 3)  # psycopg2: TRANSACTION_STATUS_INERROR


def check_fence(
    using: str,
    backend: str,
    name: str,
    fence: int,
    describe: str = "",
    refence: Callable[[int], int] | None = None,
    wait: float | None = None,
    now: datetime.datetime | None = None,
) -> None:
    """Record ``fence`` as the newest of lock ``name`` on ``backend``, or raise StaleFence if
    a larger one is recorded. In a transaction: the row stays locked until it ends. One
    statement when the row exists; two or three the first time (the floor of
    ``prune-fences``). ``wait``: at most so many seconds for a row another transaction holds
    (PostgreSQL's ``lock_timeout``; SQLite's own timeout and other databases' lock wait
    timeouts bound it too), then ``LockNotAcquired``; None: the database's own bound.

    A larger fence recorded does not yet make the hold stale: the Redis server's clock may
    have gone back while the name's counter was lost. ``refence(recorded)`` (see
    :func:`refencer`) then asks Redis, and a hold still current comes back with a fence above
    the recorded one, checked again here while the row stays locked; only a hold that is not
    current (``refence`` answers 0 or -1) raises StaleFence."""
    connection = connections[using]
    now = timezone.now() if now is None else now  # the row's ``touched``
    key = row_key(backend, name)
    try:
        if connection.vendor in ("postgresql", "sqlite") and (
            connection.features.can_return_columns_from_insert  # SQLite >= 3.35
        ):
            outcome = _upsert(connection, key, backend, name, fence, now, wait)
        else:
            outcome = _portable(using, key, backend, name, fence, now)
        # A name's first row, or one pruned: fences below the floor are older than the rows
        # prune-fences forgot, so they may be below what those rows held.
        floor = _floor(using, backend, wait) if outcome == "new" else None
    except OperationalError as exc:
        if _lock_timeout(exc):
            waited = "the database's lock_timeout" if wait is None else f"{wait:g} s"
            raise LockNotAcquired(
                f"{describe or repr(name)}: its database row stayed locked by another"
                f" transaction for {waited} (a previous holder's transaction outlived its hold:"
                " released inside an outer transaction, lost, or paused); nothing committed"
            ) from exc
        raise
    if outcome == "new":
        recorded = floor
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
        check_fence(using, backend, name, refenced, describe, wait=wait)
        return
    message = stale_message(
        describe or repr(name), using, fence, recorded, outcome == "new", refenced
    )
    raise StaleFence(message, fence, recorded)


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


#: PostgreSQL's largest ``lock_timeout`` (ms, a 32-bit int): above it, SET fails.
MAX_LOCK_TIMEOUT_MS = 2**31 - 1


def _bound(wait: float) -> str:
    """``wait`` seconds as a ``lock_timeout`` value: ms, at least 1 (0 would mean none), at
    most PostgreSQL's maximum (a TTL of weeks waits that long, about 24.8 days)."""
    return str(min(MAX_LOCK_TIMEOUT_MS, max(1, round(wait * 1000))))


def _lock_timeout(exc: BaseException) -> bool:
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) == "55P03" or getattr(cause, "pgcode", None) == "55P03"


def _upsert(
    connection: Any, key: str, backend: str, name: str, fence: int, now: Any, wait: float | None
) -> str:
    bounded = wait is not None and connection.vendor == "postgresql"
    sql = _upsert_sql(connection, bounded)
    touched = connection.ops.adapt_datetimefield_value(now)
    params: list[Any] = [key, backend, name, fence, touched]
    if bounded:
        params.append(_bound(wait))  # type: ignore[arg-type]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
        if row is None and bounded:  # RETURNING did not run: restore lock_timeout here
            cursor.execute(_RESTORE)
    if row is None:
        return "stale"
    return "new" if row[0] is None else "newest"


_UPSERT_SQL: dict[tuple[str, bool], str] = {}  # the text is built once, not per block
_SAVED = "django_redlock.lock_timeout"
# Restores the transaction's lock_timeout the bounded upsert saved.
_RESTORE = f"SELECT set_config('lock_timeout', current_setting('{_SAVED}'), true)"


def _upsert_sql(connection: Any, bounded: bool) -> str:
    found = _UPSERT_SQL.get((connection.vendor, bounded))
    if found is not None:
        return found
    from .models import Fence

    qn = connection.ops.quote_name
    table = qn(Fence._meta.db_table)
    key_, fence_, previous, at = qn("key"), qn("fence"), qn("previous"), qn("touched")
    columns = f"{key_}, {qn('backend')}, {qn('name')}, {fence_}, {previous}, {at}"
    # The WHERE false on a conflict: no row returned (the row is locked all the same).
    conflict = (
        f" ON CONFLICT ({key_}) DO UPDATE SET {previous} = {table}.{fence_},"
        f" {fence_} = EXCLUDED.{fence_}, {at} = EXCLUDED.{at}"
        f" WHERE {table}.{fence_} <= EXCLUDED.{fence_}"
    )
    if not bounded:
        sql = (
            f"INSERT INTO {table} ({columns}) VALUES (%s, %s, %s, %s, NULL, %s){conflict}"
            f" RETURNING {previous}"
        )
    else:
        # Still one statement (one round trip): the row's source sets lock_timeout for the
        # wait on the row, having saved the transaction's own (the nesting orders the two
        # calls), and RETURNING, evaluated once the row is locked, restores it.
        sql = (
            f"INSERT INTO {table} ({columns}) SELECT %s, %s, %s, %s, NULL, %s"
            f" WHERE set_config('lock_timeout', %s || left(set_config('{_SAVED}',"
            f" current_setting('lock_timeout'), true), 0), true) IS NOT NULL{conflict}"
            f" RETURNING {previous}, set_config('lock_timeout', current_setting('{_SAVED}'),"
            " true)"
        )
    return _UPSERT_SQL.setdefault((connection.vendor, bounded), sql)


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


def _floor(using: str, backend: str, wait: float | None) -> int | None:
    """The backend's floor, read with a locking read: a plain read would see the snapshot of
    a REPEATABLE READ transaction, taken before a prune it waited for (its row deleted) had
    raised the floor. On PostgreSQL ``FOR SHARE`` (first blocks of other names do not wait
    for each other) reads the newest floor, or fails with a serialization error when that is
    newer than the snapshot. Under REPEATABLE READ or SERIALIZABLE a floor the snapshot does
    not have at all may have been created since, by that very prune: a probe (an insert of
    it, rolled back to a savepoint) fails the same way when it exists. On SQLite the block
    holds the database's write lock: its reads are the newest."""
    from .models import Fence

    key = row_key(backend, "")
    connection = connections[using]
    qn = connection.ops.quote_name
    table, fence_, key_ = qn(Fence._meta.db_table), qn("fence"), qn("key")
    if connection.vendor == "mysql":  # a shared lock, the newest row (InnoDB's locking read)
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {fence_} FROM {table} WHERE {key_} = %s LOCK IN SHARE MODE",
                           [key])  # fmt: skip
            row = cursor.fetchone()
        return None if row is None else int(row[0])
    if connection.vendor != "postgresql":
        rows = Fence.objects.using(using).filter(key=key)
        if connection.features.has_select_for_update:  # (Oracle: no shared row lock)
            rows = rows.select_for_update()
        return next(iter(rows.values_list("fence", flat=True)), None)
    with connection.cursor() as cursor:
        if wait is None:
            cursor.execute(
                f"SELECT (SELECT {fence_} FROM {table} WHERE {key_} = %s FOR SHARE),"
                " current_setting('transaction_isolation')",
                [key],
            )
        else:
            # The wait for the floor (a prune holds it while it deletes) is bounded like the
            # row's, in the same statement: the FROM sets the bound (saving the transaction's
            # own) before the columns run the locking read, then restore it.
            cursor.execute(
                f"SELECT (SELECT {fence_} FROM {table} WHERE {key_} = %s FOR SHARE),"
                " current_setting('transaction_isolation'),"
                f" set_config('lock_timeout', current_setting('{_SAVED}'), true)"
                f" FROM (SELECT set_config('lock_timeout', %s || left(set_config('{_SAVED}',"
                " current_setting('lock_timeout'), true), 0), true)) AS bound",
                [key, _bound(wait)],
            )
        floor, isolation = cursor.fetchone()[:2]
        if floor is not None or isolation in ("read committed", "read uncommitted"):
            return None if floor is None else int(floor)
        bound = "0" if wait is None else _bound(wait)
        columns = ", ".join(qn(c) for c in ("key", "backend", "name", "fence", "touched"))
        cursor.execute("SAVEPOINT django_redlock_floor")
        # Serialization error if a floor our snapshot cannot see exists (ON CONFLICT checks
        # that); rolled back either way: a floor insert would be locked until this
        # transaction ends, and first blocks of other names would wait for it. The wait for
        # a floor being inserted (by a prune) is bounded like the row's.
        cursor.execute(
            f"INSERT INTO {table} ({columns}) SELECT %s, %s, '', 0, now()"
            f" WHERE set_config('lock_timeout', %s, true) IS NOT NULL"
            f" ON CONFLICT ({key_}) DO NOTHING",
            [key, backend, bound],
        )
        cursor.execute("ROLLBACK TO SAVEPOINT django_redlock_floor")
        cursor.execute("RELEASE SAVEPOINT django_redlock_floor")
    return None


def _recorded(using: str, key: str) -> int | None:
    from .models import Fence

    found = Fence.objects.using(using).filter(key=key).values_list("fence", flat=True)
    return next(iter(found), None)


# -- ``with lock`` for a lock built with ``atomic=`` -------------------------------------------

_open = threading.local()  # the fenced blocks this thread is in, innermost last


def enter_block(lock: FencedLock) -> None:
    """After the acquire: open the fenced block, or release the lock and raise."""
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(fenced_transaction(lock))
    except BaseException:
        # StaleFence, the row wait ran out, or the database failed: nothing committed. Free
        # the lock for others (a stale hold is most likely lost: that is logged).
        with contextlib.suppress(LockError):
            lock.release()
        raise
    _blocks().append((lock, stack))


def leave_block(
    lock: FencedLock,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> None:
    """Commit (or roll back), then release: never the release first. The fenced transaction
    raises only when nothing committed, save a ``BaseException`` (``KeyboardInterrupt``) from
    an ``on_commit`` callback after the COMMIT: released all the same, and raised."""
    blocks = _blocks()
    index = max(i for i, (held, _) in enumerate(blocks) if held is lock)
    _, stack = blocks.pop(index)
    try:
        stack.__exit__(exc_type, exc, tb)
    except BaseException:  # nothing committed (or an interrupt after the COMMIT)
        with contextlib.suppress(LockError):
            lock.release()
        raise
    if exc_type is None:
        release_after_commit(lock)
        return
    # Rolled back: as any lock's `with`, the body's exception says more than a loss.
    with contextlib.suppress(LockNotOwned):
        lock.release()


def release_after_commit(lock: FencedLock) -> None:
    """Release after a fenced block committed (the lost-hold rule): whatever the release
    finds (lost, or no answer: the hold then runs out at its TTL), nothing is raised. The
    commit stands, in fence order (the lock's row was locked from the check to the commit),
    and raising would invite a retry that applies the work twice."""
    try:
        lock.release()
    except LockError as exc:
        logger.warning("redlock: %s: its fenced transaction committed; then: %s",
                       lock.describe(), exc)  # fmt: skip


def _blocks() -> list[tuple[FencedLock, contextlib.ExitStack]]:
    blocks = getattr(_open, "blocks", None)
    if blocks is None:
        blocks = _open.blocks = []
    return blocks


# -- manage.py redlock prune-fences ----------------------------------------------------------


def prune_fences(using: str, older_than: datetime.timedelta) -> int:
    """Delete the rows of locks whose last fenced block is older than ``older_than``; how many.

    One statement deletes by age and returns what it deleted (``DELETE ... RETURNING``, or
    elsewhere the old rows locked with ``SELECT ... FOR UPDATE`` first, then deleted): a row
    a block touches meanwhile is either re-checked and kept, or deleted before that block
    locks it (the block then finds no row, and the raised floor). Never the ORM's
    ``delete()``, which with a delete-signal receiver connected selects the rows, then
    deletes them by key without re-checking their age (no signal is sent for these rows).

    Each backend's floor (its row with an empty name) rises to the largest fence deleted, in
    the same transaction: a first block below the floor is refused as its pruned row would
    have refused it. New holds are not: their fences come from the Redis server's clock (ms x
    1000), above those of rows untouched since, even when Redis lost its counters.

    The prune never makes fenced blocks wait for long: the rows it deletes stay locked until
    it commits, so it waits for nothing while holding them. On PostgreSQL a row locked by an
    open transaction is in use, not idle: it is skipped (``SKIP LOCKED``); and the wait for a
    floor (a first block's transaction reading it) is bounded by :data:`PRUNE_WAIT`: past it,
    ``LockNotAcquired``, nothing deleted (run it again later).
    """
    now = timezone.now()
    with transaction.atomic(using=using):
        if connections[using].vendor == "postgresql":
            with connections[using].cursor() as cursor:
                cursor.execute("SELECT set_config('lock_timeout', %s, true)",
                               [_bound(PRUNE_WAIT)])  # fmt: skip
        try:
            deleted = _delete_old(using, now - older_than)
            tops: dict[str, int] = {}
            for backend, fence in deleted:
                tops[backend] = max(fence, tops.get(backend, fence))
            for backend, top in tops.items():
                _raise_floor(using, backend, top, now)
        except OperationalError as exc:
            if not _lock_timeout(exc):
                raise
            raise LockNotAcquired(
                f"prune-fences: a floor of database {using!r} stayed locked by a fenced"
                f" transaction for {PRUNE_WAIT:g} s; nothing deleted, run it again later"
            ) from exc
    return len(deleted)


#: How long prune-fences waits for a floor another transaction holds (seconds).
PRUNE_WAIT = 2.0


def _delete_old(using: str, before: datetime.datetime) -> list[tuple[str, int]]:
    """Delete the rows (not floors) last touched before ``before``: (backend, fence) each."""
    from .models import Fence

    connection = connections[using]
    qn = connection.ops.quote_name
    table, touched, name = qn(Fence._meta.db_table), qn("touched"), qn("name")
    cutoff = connection.ops.adapt_datetimefield_value(before)
    delete = f"DELETE FROM {table} WHERE {touched} < %s AND {name} <> ''"
    with connection.cursor() as cursor:
        if connection.vendor in ("postgresql", "sqlite") and (
            connection.features.can_return_columns_from_insert  # SQLite >= 3.35: RETURNING
        ):
            params: list[Any] = [cutoff]
            if connection.vendor == "postgresql":  # rows in use are not idle: not waited for
                delete += (
                    f" AND {qn('key')} IN (SELECT {qn('key')} FROM {table} WHERE {touched} < %s"
                    f" AND {name} <> '' FOR UPDATE SKIP LOCKED)"
                )
                params.append(cutoff)
            cursor.execute(f"{delete} RETURNING {qn('backend')}, {qn('fence')}", params)
            return [(str(b), int(f)) for b, f in cursor.fetchall()]
        old = Fence.objects.using(using).filter(touched__lt=before).exclude(name="")
        if connection.features.has_select_for_update:
            old = old.select_for_update()  # locked: unchanged until this transaction ends
        found = list(old.values_list("key", "backend", "fence"))
        for start in range(0, len(found), 500):
            keys = [key for key, _, _ in found[start : start + 500]]
            marks = ", ".join(["%s"] * len(keys))
            cursor.execute(f"{delete} AND {qn('key')} IN ({marks})", [cutoff, *keys])
        return [(backend, fence) for _, backend, fence in found]


def _raise_floor(using: str, backend: str, top: int, now: datetime.datetime) -> None:
    from .models import Fence

    rows = Fence.objects.using(using)
    key = row_key(backend, "")
    while True:
        floor = list(rows.select_for_update().filter(key=key).values_list("fence", flat=True))
        if floor:
            if floor[0] < top:
                rows.filter(key=key).update(fence=top, touched=now)
            return
        try:
            with transaction.atomic(using=using):  # a first block may create it meanwhile
                rows.create(key=key, backend=backend, name="", fence=top, touched=now)
        except IntegrityError:
            continue
        return
