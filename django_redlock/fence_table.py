"""The fence table's protocol: the SQL that records a hold's fence in its lock's row of
:class:`~.models.Fence` and refuses a stale one, reads a row back after a lost COMMIT, and
prunes old rows under a floor. :mod:`.fencing` runs a fenced block around it.

Rows: one per lock name (key :func:`row_key`), its newest recorded fence, the token of the
hold that wrote it, when, the writing block's mark, and the fence and mark it overwrote; one
per backend with ``name=""``: the floor, the largest fence ``prune-fences`` deleted, below
which a name's first row may not start. Every statement here runs on the caller's
connection, inside its transaction (the row stays locked until that ends), except
:func:`commit_outcome`, which asks on a new connection.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from django.db import (
    DatabaseError,
    IntegrityError,
    OperationalError,
    connections,
    transaction,
)
from django.utils import timezone

from .exceptions import LockNotAcquired, StaleFence

logger = logging.getLogger("django_redlock")


#: Fences Redis hands out stay below this (Lua numbers are doubles): none re-fences past it.
FENCE_LIMIT = 2**53


def row_key(backend: str, name: str) -> str:
    """The primary key of a lock's row (``name=""``: the backend's floor)."""
    return hashlib.sha256(f"{backend}\0{name}".encode()).hexdigest()


def commit_outcome(
    using: str,
    backend: str,
    name: str,
    fence: int,
    mark: int | None,
    again: bool,
    wait: float,
    pid: int | None = None,
    *,
    ended_marks: Collection[int] = (),
) -> bool | None:
    """Whether a fenced transaction whose COMMIT's outcome is unknown (its reply lost or
    interrupted) committed, asked on a new connection: True or False only when the rows prove
    it, None when they cannot (or the database did not answer).

    ``fence`` and ``mark`` are what the block's upsert wrote in the lock's row (``mark``
    None: the fence is the block's alone, re-fenced in it); ``again``: the row already carried
    ``fence`` before the block (an earlier block of the same hold). Once a block committed,
    the row's fence never drops below its fence (later blocks only raise it; a row pruned and
    created again starts at or above the backend's floor, which rose to the pruned fence), and
    a later block's upsert keeps the fence and mark it overwrote in ``previous`` and
    ``previous_mark``. Only the block's transaction writes its mark (random, its nested blocks
    share it). So: the mark in ``mark`` or ``previous_mark``, committed; a fence below, not;
    the hold's fence with another mark, or a later fence whose ``previous`` is the hold's
    fence with another ``previous_mark``: not when that mark is one of ``ended_marks`` (blocks
    that ended before this one began: their marks are never written after its upsert), else
    unknown (another block of the hold, in another thread or a process that adopted it, may
    have written that fence after this one; NULL, a row older than the column: unknown); a
    later fence whose ``previous`` is below the block's, not, save when that ``previous``
    is the writer's own (``mark`` equal to ``previous_mark``: a first block that re-fenced
    over the floor, so the row was created after this block) while the floor is at or
    above the fence: unknown; anything else (later blocks on top, the row gone or created
    again while the floor is at or above the fence: a prune ran), unknown.

    On PostgreSQL the read locks the row (``FOR SHARE``, at most ``wait`` seconds): a server
    still finishing that transaction holds it, and the answer comes once it ended. A row the
    transaction INSERTed is neither seen nor waited for until it ended, though: no row proves
    nothing only once the block's server process ``pid`` is known to be out of that
    transaction (:func:`_ended`, at most ``wait`` seconds, shared with the row's read); else
    the outcome is unknown. (On SQLite the COMMIT ran in this process: it ended before the
    exception came out.)

    The whole check, its new connection included, takes at most ``wait`` plus
    :data:`CHECK_SLACK` seconds: a database gone silent (a partition after the handshake, a
    hung pooler) answers nothing, not even an error, and the block's lock stays held, renewed,
    while it waits. Past that, None. Elsewhere than SQLite it runs in a thread of its own for
    that (a silent socket has no other bound), which goes on alone until its connection
    fails (it connects with ``connect_timeout``, unless ``OPTIONS`` names one)."""
    if connections[using].vendor == "sqlite":  # in this process: nothing to wait for
        return _commit_outcome(using, backend, name, fence, mark, again, wait, pid,
                               ended_marks, time.monotonic())  # fmt: skip
    answer: list[tuple[bool | None, BaseException | None]] = []
    started = time.monotonic()

    def ask() -> None:
        try:
            answer.append((_commit_outcome(using, backend, name, fence, mark, again, wait, pid,
                                           ended_marks, started), None))  # fmt: skip
        except BaseException as exc:  # handed to the caller (the check's own errors are not)
            answer.append((None, exc))

    thread = threading.Thread(target=ask, name="redlock-commit-outcome", daemon=True)
    thread.start()
    thread.join(wait + CHECK_SLACK)
    if not answer:
        logger.warning("redlock: database %r did not answer the outcome check of a lost COMMIT"
                       " within %g s: unknown", using, wait + CHECK_SLACK)  # fmt: skip
        return None
    outcome, error = answer[0]
    if error is not None:
        raise error
    return outcome


#: Seconds the outcome check may take beyond its wait: its connect and round trips.
CHECK_SLACK = 5.0


def _commit_outcome(
    using: str,
    backend: str,
    name: str,
    fence: int,
    mark: int | None,
    again: bool,
    wait: float,
    pid: int | None,
    ended_marks: Collection[int],
    started: float,
) -> bool | None:
    """:func:`commit_outcome`'s check, its waits ending ``wait`` s after ``started``."""
    from .models import Fence

    connection = connections.create_connection(using)
    options = connection.settings_dict.get("OPTIONS") or {}
    if connection.vendor == "postgresql" and not {"connect_timeout", "pool"} & set(options):
        # The connect's share of the bound: whole seconds, at least 2 (libpq's). A copy: the
        # alias's settings are shared.
        timeout = max(2, math.ceil(CHECK_SLACK))
        connection.settings_dict = {
            **connection.settings_dict,
            "OPTIONS": {**options, "connect_timeout": timeout},
        }
    try:
        qn = connection.ops.quote_name
        columns = ", ".join(qn(c) for c in ("fence", "previous", "mark", "previous_mark"))
        sql = f"SELECT {columns} FROM {qn(Fence._meta.db_table)} WHERE {qn('key')} = %s"
        with connection.cursor() as cursor:
            postgresql = connection.vendor == "postgresql"
            if postgresql:
                ended = pid is not None and _ended(connection, cursor, pid, started + wait)
                if pid is not None and not ended:
                    return None  # still in it: its rows are locked, or not yet visible
            else:
                ended = connection.vendor == "sqlite"
            if postgresql:  # the bound for this read only (a pooled connection keeps GUCs)
                cursor.execute("BEGIN")
                # What is left of the wait (the whole check shares it). Should this client
                # go silent mid-check (given up on by the caller), the server ends the
                # transaction: its FOR SHARE would keep the next holder's block waiting.
                left = max(0.001, started + wait - time.monotonic())
                cursor.execute(
                    "SELECT set_config('lock_timeout', %s, true),"
                    " set_config('idle_in_transaction_session_timeout', %s, true)",
                    [_bound(left), _bound(wait + CHECK_SLACK)],
                )
            cursor.execute(sql + (" FOR SHARE" if postgresql else ""), [row_key(backend, name)])
            row = cursor.fetchone()
            cursor.execute(sql, [row_key(backend, "")])  # the floor: a prune ran?
            floor = cursor.fetchone()
            if postgresql:
                cursor.execute("COMMIT")
    except DatabaseError:
        logger.warning("redlock: database %r did not answer after a lost COMMIT", using,
                       exc_info=True)  # fmt: skip
        return None
    finally:
        with contextlib.suppress(DatabaseError):
            connection.close()
    pruned = floor is not None and int(floor[0]) >= fence  # a row with this fence may be gone
    if row is None:  # never written, or written by a COMMIT not known to have ended
        return None if pruned or not ended else False
    recorded, previous = int(row[0]), row[1]
    found, before = (None if m is None else int(m) for m in row[2:4])
    if mark is not None and mark in (found, before):  # only this block's transaction writes it
        return True
    if recorded == fence:  # the hold's fence: this block's only with its mark
        if mark is None:
            return True
        return False if found is not None and found in ended_marks else None
    if recorded < fence:
        return False
    if previous is None:  # the row was created after this block: ours never was, or pruned
        return None if pruned else False
    if int(previous) == fence:  # the next block overwrote this hold's fence: whose write?
        if mark is None:
            return None if again else True
        # Another block of the hold (this process's, or one that adopted the hold) may have
        # written this fence after this one: only an ended block's mark proves it did not.
        return False if before is not None and before in ended_marks else None
    if int(previous) < fence:
        # A block that re-fenced over its own row (same mark in both columns: a first block
        # below the floor) wrote that ``previous``: no earlier writer's. After a prune, the
        # row it created may sit where this block's committed one was deleted: unknown.
        # (Without marks, a row from before the columns, the same can't be ruled out.)
        own = found is None or before is None or found == before
        return None if own and pruned else False
    return None


def _ended(connection: Any, cursor: Any, pid: int, deadline: float) -> bool:
    """Whether PostgreSQL's server process ``pid`` is in no transaction (or gone), waiting
    until ``deadline`` (``time.monotonic()``) at most: a transaction holds its virtual
    transaction id's lock until it ended, its COMMIT included (run in autocommit: each poll
    is a new snapshot). A pid that is another process's by now is gone (ours ended) or busy
    (unknown): never a wrong yes.
    Behind a pooler (PgBouncer) the pid the driver was told is not the server's: then no."""
    cursor.execute("SELECT pg_backend_pid()")
    if pid_of(connection) != cursor.fetchone()[0]:
        return False
    pause = 0.01
    while True:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND locktype = 'virtualxid')",
            [pid],
        )
        if not cursor.fetchone()[0]:
            return True
        if time.monotonic() + pause > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def pid_of(connection: Any) -> int | None:
    """The server process the driver of ``connection`` was told it talks to (no I/O)."""
    raw = connection.connection
    with contextlib.suppress(Exception):
        info = getattr(raw, "info", None)  # psycopg 3
        pid = int(info.backend_pid if info is not None else raw.get_backend_pid())
        return pid if pid > 0 else None
    return None


def check_fence(
    using: str,
    backend: str,
    name: str,
    fence: int,
    describe: str = "",
    refence: Callable[[int], int] | None = None,
    wait: float | None = None,
    now: datetime.datetime | None = None,
    token: str | None = None,
    prior: str | None = None,
    current: bool = False,
    mark: int | None = None,
) -> bool:
    """Record ``fence`` as the newest of lock ``name`` on ``backend``, or raise StaleFence if
    a larger one is recorded; whether the row already carried ``fence`` (an earlier block of
    the same hold recorded it: :func:`commit_outcome` needs to know). In a transaction: the
    row stays locked until it ends. One statement when the row exists; two or three the first
    time (the floor of ``prune-fences``). ``wait``: at most so many seconds for a row another
    transaction holds (PostgreSQL's ``lock_timeout``; SQLite's own timeout and other
    databases' lock wait timeouts bound it too), then ``LockNotAcquired``; None: the
    database's own bound.

    A larger fence recorded does not yet make the hold stale: the Redis server's clock may
    have gone back while the name's counter was lost. ``refence(recorded)`` (see
    :func:`refencer`) then asks Redis, and a hold still current comes back with a fence above
    the recorded one, checked again here while the row stays locked; only a hold that is not
    current (``refence`` answers 0 or -1) raises StaleFence.

    A smaller fence recorded does not yet make the hold the newer one either: after such a
    step a hold granted *after* this one (while this one was lost) may have recorded a smaller
    fence. The row keeps its writer's ``token``. Written by this hold, or by ``prior`` (the
    hold Redis gave a fence just before this one), it was granted before this hold: the block
    goes on, with no question to Redis. Any other writer (or none known: a row written before
    tokens were kept, a name's first row once ``prune-fences`` left a floor) costs one
    ``refence``: a hold current in Redis was granted after every writer, and goes on with its
    new fence; one that is not is refused. ``token`` None (or ``current``: the hold was
    just found current, with the row locked): the fence alone decides. ``mark``: the
    block's, kept in the row for :func:`commit_outcome` (None: none)."""
    connection = connections[using]
    now = timezone.now() if now is None else now  # the row's ``touched``
    key = row_key(backend, name)
    holder = None if token is None else holder_of(token)
    # The writers that need no question to Redis; None: any writer.
    known = None if current or holder is None else (holder, prior and holder_of(prior))
    try:
        if connection.vendor in ("postgresql", "sqlite") and (
            connection.features.can_return_columns_from_insert  # SQLite >= 3.35
        ):
            outcome, previous = _upsert(
                connection, key, backend, name, fence, now, wait, holder, known, mark
            )
        else:
            outcome, previous = _portable(
                using, key, backend, name, fence, now, holder, known, mark
            )
        # A name's first row, or one pruned: fences below the floor are older than the rows
        # prune-fences forgot, so they may be below what those rows held.
        floor = _floor(using, backend, wait) if outcome == "new" else None
    except OperationalError as exc:
        if _lock_timeout(exc):
            waited = "the database's lock_timeout" if wait is None else f"{wait:g} s"
            if connection.vendor == "sqlite":  # SQLite's own wait bounds it (its timeout)
                waited = "SQLite's busy timeout"
            raise LockNotAcquired(
                f"{describe or repr(name)}: its database row stayed locked by another"
                f" transaction for {waited} (a previous holder's transaction outlived its hold:"
                " released inside an outer transaction, lost, or paused); nothing committed"
            ) from exc
        raise
    if outcome == "new":
        recorded = floor
        if recorded is None or (recorded <= fence and known is None):
            return False
    elif outcome == "stale":
        recorded = _recorded(using, key)
    else:
        return previous == fence
    assert recorded is not None  # the row is locked: it cannot have gone meanwhile
    # Not refused by the fence: by the row's writer, not known to be granted before this hold.
    unsure = recorded <= fence
    # Redis's Lua numbers are exact below 2**53 (the clock's us reach it in year 2255): no
    # re-fence can pass a recorded fence beyond that.
    top = max(recorded, fence)
    refenced = refence(top) if refence is not None and top < FENCE_LIMIT else -1
    if refenced > top:  # current in Redis: check the new fence (once: no re-fence then)
        return check_fence(using, backend, name, refenced, describe, wait=wait, now=now,
                           token=token, current=True, mark=mark)  # fmt: skip
    message = stale_message(
        describe or repr(name), using, fence, recorded, outcome == "new", refenced, unsure
    )
    raise StaleFence(message, fence, recorded)


def holder_of(token: str) -> str:
    """What a row keeps of a hold's token (the column's 64 characters: a longer token, one a
    compat shim was given, by its hash)."""
    if len(token) <= 64:
        return token
    return "#" + hashlib.sha256(token.encode()).hexdigest()[:63]


def stale_message(
    describe: str,
    using: str,
    fence: int,
    recorded: int,
    floor: bool,
    refenced: int,
    unsure: bool = False,
) -> str:
    """What StaleFence says: whose fence is recorded, and why this hold is outdated.
    ``unsure``: the recorded fence is not above this one, but its writer may have been
    granted the lock after this hold (a clock gone back hands out smaller fences)."""
    what = f"the floor {recorded} left by prune-fences" if floor else f"fence {recorded} recorded"
    if unsure:
        why = "this hold is not current any more" if refenced == 0 else "a later hold has the lock"
        return (
            f"{describe}: {what} in database {using!r} is not above fence {fence}, yet it may"
            " come from a hold granted after this one (after the Redis server's clock went"
            f" back), and {why}: this hold is outdated; nothing was committed"
        )
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
    """Whether the database gave up waiting for a lock: PostgreSQL's lock_timeout (55P03),
    SQLite's busy timeout (SQLITE_BUSY, "database is locked": its only row wait)."""
    cause = exc.__cause__
    if getattr(cause, "sqlstate", None) == "55P03" or getattr(cause, "pgcode", None) == "55P03":
        return True
    code = getattr(cause, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return bool(code & 0xFF == _SQLITE_BUSY)  # extended codes keep the primary low byte
    sqlite = type(cause).__module__.startswith("sqlite3")  # (not imported where unused)
    return sqlite and str(cause) == "database is locked"


_SQLITE_BUSY = 5


def _upsert(
    connection: Any,
    key: str,
    backend: str,
    name: str,
    fence: int,
    now: Any,
    wait: float | None,
    holder: str | None = None,
    known: tuple[str, str | None] | None = None,
    mark: int | None = None,
) -> tuple[str, int | None]:
    """("new", None), ("newest", the fence the row had) or ("stale", None): a larger fence
    recorded, or (``known`` given) a writer other than those two tokens."""
    bounded = wait is not None and connection.vendor == "postgresql"
    sql = _upsert_sql(connection, bounded)
    touched = connection.ops.adapt_datetimefield_value(now)
    params: list[Any] = [key, backend, name, fence, holder, touched, mark]
    if bounded:
        params.append(_bound(wait))  # type: ignore[arg-type]
    params += [known is None, *(known or (None, None))]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
        if row is None and bounded:  # RETURNING did not run: restore lock_timeout here
            cursor.execute(_RESTORE)
    if row is None:
        return "stale", None
    return ("new", None) if row[0] is None else ("newest", int(row[0]))


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
    holder, mark, previous_mark = qn("holder"), qn("mark"), qn("previous_mark")
    columns = ", ".join([key_, qn("backend"), qn("name"), fence_, holder, previous, at, mark])
    # The WHERE false on a conflict: no row returned (the row is locked all the same). The
    # writer is checked only when asked (not after a re-fence): this hold's own, or the hold
    # given a fence before it (NULL compares as false: an unknown writer is not trusted).
    # A write with the mark the row has is a block nested in the transaction that wrote it
    # (only a block's own transaction writes its mark): it keeps the previous fence and mark
    # that transaction's first write found, which a lost COMMIT's check reads (review fen3, 2).
    # Not when that write created the row (no previous): RETURNING NULL means "a new row".
    nested = f"{table}.{mark} = EXCLUDED.{mark} AND {table}.{previous} IS NOT NULL"
    conflict = (
        f" ON CONFLICT ({key_}) DO UPDATE SET"
        f" {previous} = CASE WHEN {nested} THEN {table}.{previous} ELSE {table}.{fence_} END,"
        f" {fence_} = EXCLUDED.{fence_}, {holder} = EXCLUDED.{holder}, {at} = EXCLUDED.{at},"
        f" {mark} = EXCLUDED.{mark}, {previous_mark} = CASE WHEN {nested}"
        f" THEN {table}.{previous_mark} ELSE {table}.{mark} END"
        f" WHERE {table}.{fence_} <= EXCLUDED.{fence_} AND (%s OR {table}.{holder} = %s"
        f" OR {table}.{holder} = %s)"
    )
    if not bounded:
        sql = (
            f"INSERT INTO {table} ({columns}) VALUES (%s, %s, %s, %s, %s, NULL, %s, %s){conflict}"
            f" RETURNING {previous}"
        )
    else:
        # Still one statement (one round trip): the row's source sets lock_timeout for the
        # wait on the row, having saved the transaction's own (the nesting orders the two
        # calls), and RETURNING, evaluated once the row is locked, restores it.
        sql = (
            f"INSERT INTO {table} ({columns}) SELECT %s, %s, %s, %s, %s, NULL, %s, %s"
            f" WHERE set_config('lock_timeout', %s || left(set_config('{_SAVED}',"
            f" current_setting('lock_timeout'), true), 0), true) IS NOT NULL{conflict}"
            f" RETURNING {previous}, set_config('lock_timeout', current_setting('{_SAVED}'),"
            " true)"
        )
    return _UPSERT_SQL.setdefault((connection.vendor, bounded), sql)


def _portable(
    using: str,
    key: str,
    backend: str,
    name: str,
    fence: int,
    now: Any,
    holder: str | None = None,
    known: tuple[str, str | None] | None = None,
    mark: int | None = None,
) -> tuple[str, int | None]:
    """Other databases: SELECT ... FOR UPDATE, then UPDATE or INSERT (Django's ORM)."""
    from .models import Fence

    rows = Fence.objects.using(using)
    while True:
        found = list(
            rows.select_for_update()
            .filter(key=key)
            .values_list("fence", "holder", "mark", "previous", "previous_mark")
        )
        if found:
            recorded, writer, written, before, before_mark = found[0]
            if recorded > fence or (known is not None and (writer is None or writer not in known)):
                return "stale", None
            if mark is None or written != mark or before is None:  # else nested (see SQL)
                before, before_mark = recorded, written
            rows.filter(key=key).update(
                fence=fence, holder=holder, previous=before, touched=now, mark=mark,
                previous_mark=before_mark,
            )  # fmt: skip
            return "newest", before
        try:
            with transaction.atomic(using=using):  # a savepoint: a concurrent insert may win
                rows.create(key=key, backend=backend, name=name, fence=fence, holder=holder,
                            touched=now, mark=mark)  # fmt: skip
        except IntegrityError:
            continue  # then lock its row and compare
        return "new", None


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
