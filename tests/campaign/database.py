"""The campaign's database resource (kind ``database``): fenced transactions on PostgreSQL.

Each hold runs one fenced transaction (``atomic=`` on the lock, a throwaway PostgreSQL the
harness starts) that reads a counter, works a while (sometimes past the TTL: the watchdog
renews, the lock's fence row stays locked), writes the counter plus one, and appends a
history row (client, hold, fence, value read, value written). Two forms, half each: ``held``
(``acquire()``, ``with lk.atomic()``, ``release()``) and ``with`` (``with lock(...,
atomic=...)``: commit, then release). One transaction in 20 raises in its body: rolled back.
One hold in 10 is not renewed, and its holder idles past the TTL: before its block (held
form: a later holder may commit first, and this block must raise StaleFence), or inside it
(``with``: the commit stands, the release finds the hold lost and raises nothing). One block
in 10 registers an ``on_commit`` callback that raises: the block must still be told it
committed. Each client's connection runs READ COMMITTED, REPEATABLE READ or SERIALIZABLE
(chosen by its seed): the stricter levels fail with a serialization error where READ
COMMITTED waits, never commit stale. Beside the buyers, each client runs a pruner thread:
``prune_fences`` with a tiny age (the lock's row and floor churn), a ``pre_delete`` receiver
connected on ``Fence`` (an audit log that takes its time) -- the receiver that made Django
delete a row a block had just committed.

The checker reads the committed history back from PostgreSQL. Under READ COMMITTED a read
sees only committed values, so the transaction that read ``v`` committed after the one that
wrote ``v``: the chain of values is the commit order. Properties:

* ``lost-update``: two committed transactions read the same value;
* ``counter-mismatch``: the values read are not 0..N-1 each written plus one, or the counter
  is not the number of committed transactions N;
* ``fence-order``: along the commit order, a fence not above the one before (a stale holder
  committed after a later holder, or one hold committed twice);
* ``commit-lost``: a client was told its block committed (it left the block without an
  exception), and its history row is not there, or says another fence or value;
* ``refused-but-committed``: a block that raised before committing (``StaleFence``, the
  lock not held or its row wait ran out, the body's exception, a serialization error) has a
  history row;
* ``raised-after-commit``: a block raised an ``on_commit`` callback's error (it committed:
  the caller is told it did not, and would do the work again);
* ``fence-not-granted``: a row's fence is not the fence its hold was granted.

``CAMPAIGN_DB_UNFENCED=1`` runs the held form in a plain ``transaction.atomic()`` (no fence
check): the checker must then find lost updates and fences out of order (a self-test).

The harness side (:class:`Database`) runs in the pytest process and talks psycopg directly;
``python -m tests.campaign.database CONFIG_JSON`` migrates the database (Django, in a process
of its own), and the client side (:func:`database_settings`, :func:`run_held`,
:func:`run_with`) runs in the campaign's client processes.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NAME = "campaign"
ALIAS = "default"
#: The pruner's alias: the same database, not through the proxy (its COMMITs, many a second,
#: would take the COMMIT faults meant for the blocks).
PRUNER = "pruner"
ABORT_RATE = 0.05
CALLBACK_FAIL_RATE = 0.1  # blocks registering an on_commit callback that raises
#: psycopg's IsolationLevel values: READ COMMITTED, REPEATABLE READ, SERIALIZABLE.
LEVELS = {2: "read committed", 3: "repeatable read", 4: "serializable"}
DAWDLE_RATE = 0.1  # holds whose lock is not renewed, their holder idling past the TTL
NEST_RATE = 0.5  # held blocks with a nested block of the same hold inside
SCHEMA = [
    "CREATE TABLE campaign_counter (id integer PRIMARY KEY, value bigint NOT NULL)",
    "INSERT INTO campaign_counter VALUES (1, 0)",
    "CREATE TABLE campaign_history (id bigserial PRIMARY KEY, client text NOT NULL,"
    " hold integer NOT NULL, fence bigint NOT NULL, seen bigint NOT NULL, wrote bigint NOT NULL,"
    " form text NOT NULL, at double precision NOT NULL"
    " DEFAULT extract(epoch FROM clock_timestamp()))",
]


@dataclass
class Row:
    """A committed history row."""

    id: int
    client: str
    hold: int
    fence: int
    seen: int
    wrote: int
    form: str
    at: float  # the server's clock at the insert (epoch seconds)


@dataclass
class History:
    rows: list[Row]
    counter: int


# -- the harness's side (the pytest process) -------------------------------------------------


class Database:
    """A throwaway PostgreSQL with the campaign's tables and django_redlock's fence table.
    ``launch`` starts processes from the harness's launcher thread (they die with it)."""

    def __init__(self, launch: Callable[[Callable[[], Any]], Any]) -> None:
        from django_redlock.testing import PostgresServer

        self.server = launch(PostgresServer().start)
        with self.connect("postgres") as conn:
            conn.execute(f"CREATE DATABASE {NAME}")
        with self.connect() as conn:
            for statement in SCHEMA:
                conn.execute(statement)
        migrate = [sys.executable, "-m", "tests.campaign.database", json.dumps(self.settings())]
        done = subprocess.run(
            migrate, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"migrate failed ({done.returncode}): {done.stderr[-3000:]}")
        # The clients go through a proxy that loses and delays COMMIT replies (tests/proxy.py);
        # the harness reads the history straight from the server.
        from ..support.proxy import LossyProxy

        self.proxy = LossyProxy(self.server.port)

    def connect(self, name: str = NAME) -> Any:
        import psycopg

        return psycopg.connect(
            host=self.server.host, port=self.server.port, user=self.server.user, dbname=name,
            autocommit=True, connect_timeout=10,
        )  # fmt: skip

    def direct(self) -> dict[str, Any]:
        """Where the server itself is (the pruner goes there, not through the proxy)."""
        return {"HOST": self.server.host, "PORT": str(self.server.port)}

    def settings(self) -> dict[str, Any]:
        """The clients' DATABASES entry. A hung wait fails, never freezes a client."""
        options = "-c lock_timeout=20000 -c idle_in_transaction_session_timeout=30000"
        entry = self.server.settings(NAME, OPTIONS={"connect_timeout": 5, "options": options})
        if getattr(self, "proxy", None) is not None:
            entry.update(HOST="127.0.0.1", PORT=str(self.proxy.port))
        return dict(entry)

    def history(self) -> History:
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT id, client, hold, fence, seen, wrote, form, at FROM campaign_history"
                " ORDER BY id"
            ).fetchall()
            (counter,) = conn.execute("SELECT value FROM campaign_counter WHERE id = 1").fetchone()
        return History([Row(*row) for row in rows], int(counter))

    def close(self) -> None:
        self.proxy.close()
        self.server.stop()


def migrate(config: dict[str, Any]) -> None:
    import django
    from django.conf import settings
    from django.core.management import call_command

    settings.configure(
        INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_redlock"],
        DATABASES={ALIAS: config},
        USE_TZ=True,
    )
    django.setup()
    call_command("migrate", verbosity=0)


# -- the clients' side -------------------------------------------------------------------------


class Abort(Exception):
    """Raised in a block's body on purpose: the transaction must roll back."""


class CallbackFailed(Exception):
    """Raised by an on_commit callback, after the COMMIT: the block must not raise it."""


def isolation_of(config: dict[str, Any]) -> int:
    """The client's isolation level (psycopg's IsolationLevel value), by its seed."""
    return random.Random(config["seed"] * 31 + 7).choice(sorted(LEVELS))


def database_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The client's DATABASES (empty for other kinds), at the client's isolation level."""
    if not config.get("database"):
        return {}
    entry = dict(config["database"])
    entry["OPTIONS"] = {**entry.get("OPTIONS", {}), "isolation_level": isolation_of(config)}
    direct = dict(entry, **(config.get("database_direct") or {}))
    return {ALIAS: entry, PRUNER: direct}


def start_pruner(config: dict[str, Any], log: Any, stop: Any) -> None:
    """A thread pruning the fence rows beside the buyers, a delete-signal receiver connected
    (an audit log that takes its time). Its age is tiny: the lock's row is deleted between
    blocks, and the next first block checks the floor."""
    import datetime
    import threading

    from django.db import DatabaseError, connections
    from django.db.models.signals import pre_delete

    from django_redlock.fence_table import prune_fences
    from django_redlock.models import Fence

    rng = random.Random(config["seed"] * 17 + 3)

    def audit(sender: Any, **kwargs: Any) -> None:
        time.sleep(rng.uniform(0, 0.02))

    pre_delete.connect(audit, sender=Fence, weak=False, dispatch_uid="campaign-audit")
    log("db_client", level=LEVELS[isolation_of(config)])

    def prune() -> None:
        while not stop.wait(rng.uniform(0.1, 0.6)):
            age = datetime.timedelta(seconds=rng.uniform(0.02, 0.5))
            try:
                log("db_prune", n=prune_fences(PRUNER, age), age=age.total_seconds())
            except DatabaseError as exc:
                log("db_prune_err", err=type(exc).__name__, msg=str(exc)[:300])
                connections[PRUNER].close()

    threading.Thread(target=prune, daemon=True, name="pruner").start()


def _fail_after_commit() -> None:
    raise CallbackFailed("the mail server is down")


def held_lock(config: dict[str, Any], prefix: str, rng: random.Random) -> Any:
    """The held form's lock. One in 10 is not renewed: its holder dawdles past the TTL before
    its block (a later holder may commit first: StaleFence)."""
    from django_redlock import lock

    return lock(config["name"], ttl=float(config["ttl"]), token_prefix=prefix, atomic=ALIAS,
                auto_renew=rng.random() >= DAWDLE_RATE)  # fmt: skip


def increment(hold: int, cid: str, fence: int, form: str, rng: random.Random, ttl: float,
              dawdle: bool = False) -> int:  # fmt: skip
    """Read the counter, work, write it plus one, append the history row: the value read.
    ``dawdle``: work past the TTL (a lock not renewed then expires in the block)."""
    from django.db import connections, transaction

    if rng.random() < CALLBACK_FAIL_RATE:  # registered first: it runs first after the COMMIT
        transaction.on_commit(_fail_after_commit, using=ALIAS)
    with connections[ALIAS].cursor() as cursor:
        cursor.execute("SELECT value FROM campaign_counter WHERE id = 1")
        seen = int(cursor.fetchone()[0])
        roll = rng.random()
        if dawdle:
            time.sleep(rng.uniform(1.2, 2.0) * ttl)
        elif roll < 0.04:
            time.sleep(rng.uniform(0.8 * ttl, 1.8 * ttl))  # the watchdog must renew
        elif roll < 0.2:
            time.sleep(rng.uniform(0.02, 0.15))
        else:
            time.sleep(rng.uniform(0, 0.01))
        cursor.execute("UPDATE campaign_counter SET value = %s WHERE id = 1", [seen + 1])
        cursor.execute(
            "INSERT INTO campaign_history (client, hold, fence, seen, wrote, form)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            [cid, hold, fence, seen, seen + 1, form],
        )
    if rng.random() < ABORT_RATE:
        raise Abort()
    return seen


def _failed(log: Any, hold: int, fence: int | None, exc: BaseException, when: str) -> None:
    """A block that raised: what it raised, logged for the checker."""
    from django.db import DatabaseError, connections

    from django_redlock import CommitOutcomeUnknown, LockError, StaleFence

    from .interrupts import TimeLimit

    if isinstance(exc, CommitOutcomeUnknown):  # either way: not a refusal
        log("db_err", h=hold, fence=fence, when=when, err=type(exc).__name__, msg=str(exc)[:300])
    elif isinstance(exc, StaleFence):
        log("db_stale", h=hold, fence=fence, recorded=exc.recorded)
    elif isinstance(exc, Abort):
        log("db_abort", h=hold, fence=fence)
    elif isinstance(exc, TimeLimit):  # a time limit's exception: "nothing committed"
        log("db_failed", h=hold, fence=fence, when=when, err=type(exc).__name__,
            msg=str(exc)[:300])  # fmt: skip
        connections[ALIAS].close()
    elif isinstance(exc, CallbackFailed):  # the block committed, and said it did not
        log("db_raised_after_commit", h=hold, fence=fence, msg=str(exc)[:300])
    elif isinstance(exc, LockError):  # not held, or its row wait ran out: nothing committed
        log("db_refused", h=hold, fence=fence, err=type(exc).__name__, msg=str(exc)[:300])
    elif isinstance(exc, DatabaseError) and "could not serialize" in str(exc):
        log("db_serial", h=hold, fence=fence, msg=str(exc)[:300])  # nothing committed
        connections[ALIAS].close()
    elif isinstance(exc, DatabaseError):  # "nothing committed" (CommitOutcomeUnknown: unknown)
        log("db_failed", h=hold, fence=fence, when=when, err=type(exc).__name__,
            msg=str(exc)[:300])  # fmt: skip
        connections[ALIAS].close()  # a broken connection is not reused
    else:
        raise exc


def run_held(lk: Any, hold: int, fence: int, cid: str, rng: random.Random, log: Any,
             ttl: float) -> int | None:  # fmt: skip
    """The held form's block: ``with lk.atomic()`` inside a hold taken by ``acquire()``. The
    hold's fence after it (a re-fence raises it); None when a re-fence may have given the
    hold a fence the client was not told (see :func:`fence_unknown`)."""
    from django.db import transaction

    unfenced = bool(os.environ.get("CAMPAIGN_DB_UNFENCED"))
    if not lk.auto_renew:  # it expires meanwhile: another hold may commit first
        time.sleep(rng.uniform(1.2, 2.0) * ttl)
    log("db_begin", h=hold, fence=fence, form="held")
    try:
        with transaction.atomic(using=ALIAS) if unfenced else lk.atomic():
            if not unfenced:
                fence = refenced(log, hold, fence, checked_fence(lk))
            seen = increment(hold, cid, fence, "held", rng, ttl)
            if not unfenced and rng.random() < NEST_RATE:
                with lk.atomic():  # a nested block of the same hold (a savepoint)
                    checked_fence(lk)
                log("db_nested", h=hold)
    except Exception as exc:
        _failed(log, hold, fence, exc, "body")
        return None if fence_unknown(exc) else fence
    log("db_ok", h=hold, fence=fence, seen=seen)
    return fence


def fence_unknown(exc: BaseException) -> bool:
    """Whether a block that raised ``exc`` may have left its hold with a fence it was not
    told: a re-fence Redis ran whose reply was lost (BackendUnavailable, QuorumNotReached),
    or cut short by a time limit. The hold is the same (its token), its fence in Redis the
    new one (docs/topics/fencing.md: "the owner's next re-entry finds the larger fence")."""
    from django_redlock import LockError, LockNotAcquired, StaleFence

    from .interrupts import TimeLimit

    if isinstance(exc, (StaleFence, LockNotAcquired)):  # no re-fence ran, or it answered
        return False
    return isinstance(exc, (LockError, TimeLimit))


def checked_fence(lk: Any) -> int:
    """The fence the block's check recorded: its row's, read in the block's transaction (the
    row stays locked until it ends). ``lk.fence`` would be None if the hold was found lost
    meanwhile (a pause), and is the granted one unless a re-fence raised it."""
    from django_redlock.fence_table import row_key
    from django_redlock.models import Fence

    rows = Fence.objects.using(ALIAS).filter(key=row_key(lk.using, lk.name))
    return int(rows.values_list("fence", flat=True).get())


def refenced(log: Any, hold: int, granted: int, fence: int | None) -> int:
    """The fence a block runs with: the one granted, or the one a re-fence gave the hold
    (the Redis server's clock went back with the counter lost), logged for the checker."""
    if fence is not None and fence != granted:
        log("db_refenced", h=hold, fence=fence, granted=granted)
        return fence
    return granted


#: The ``with`` form's holds by id(lock): told of the acquire by the lock_acquired signal, sent
#: as the acquire returns, before the block opens (its fence check may wait for the row).
_on_acquired: dict[int, Callable[[int | None], None]] = {}


def _acquired(sender: Any, lock: Any, fence: int | None = None, **kwargs: Any) -> None:
    callback = _on_acquired.pop(id(lock), None)
    if callback is not None:
        callback(fence)


def run_with(config: dict[str, Any], hold: int, prefix: str, rng: random.Random, log: Any,
             check: Callable[..., None], holds: dict[int, Any]) -> None:  # fmt: skip
    """The ``with`` form, a whole hold: ``with lock(..., atomic=...)`` acquires, runs the
    fenced block, commits, then releases (a lost or unknown release raises nothing). One in
    10 is not renewed, and works past its TTL in the block: the commit stands, the release
    finds the hold lost and says so (lock_lost), raising nothing."""
    from django_redlock import LockError, LockNotAcquired, lock
    from django_redlock.signals import lock_acquired

    lock_acquired.connect(_acquired, weak=False, dispatch_uid="campaign-with-form")
    cid, ttl = config["id"], float(config["ttl"])
    blocking = rng.random() < 0.8
    timeout = rng.choice([0.5, 1.0, 2.0, 3.0, 4.0]) if blocking else None
    dawdle = rng.random() < DAWDLE_RATE
    lk = lock(config["name"], ttl=ttl, token_prefix=prefix, atomic=ALIAS, blocking=blocking,
              timeout=timeout, auto_renew=not dawdle)  # fmt: skip
    holds[id(lk)] = (hold, prefix, None)  # the client's lock_lost handler finds the hold
    granted: list[int | None] = []

    def acquired(fence: int | None) -> None:
        granted.append(fence)
        holds[id(lk)] = (hold, prefix, fence)
        log("acq_ok", h=hold, fence=fence)
        check(hold, "acquired", prefix, fence)

    _on_acquired[id(lk)] = acquired
    log("acq", h=hold, mode="block" if blocking else "try", timeout=timeout, role="x", form="with")
    inside = False
    try:
        with lk:
            inside = True
            fence = checked_fence(lk)
            if granted and granted[0] is not None:
                fence = refenced(log, hold, granted[0], fence)
                holds[id(lk)] = (hold, prefix, fence)  # what the servers hold now
            log("db_begin", h=hold, fence=fence, form="with")
            seen = increment(hold, cid, fence if fence is not None else -1, "with", rng, ttl,
                             dawdle)  # fmt: skip
    except LockNotAcquired as exc:
        if granted:  # held, but its row stayed locked past the wait: nothing committed
            _failed(log, hold, granted[0], exc, "enter")
        else:
            log("acq_no", h=hold)
        return
    except Exception as exc:
        if not granted and isinstance(exc, LockError):
            log("acq_err", h=hold, err=type(exc).__name__, msg=str(exc)[:300])
            time.sleep(rng.uniform(0.01, 0.1))
            return
        # After the acquire: StaleFence or the database's error as the block opened, or the
        # body's exception, or the commit's.
        _failed(log, hold, granted[0] if granted else None, exc, "body" if inside else "enter")
        return
    finally:
        _on_acquired.pop(id(lk), None)
    log("db_ok", h=hold, fence=fence, seen=seen)


# -- the checker's side ------------------------------------------------------------------------


def judge(history: History, events: list[dict[str, Any]]) -> tuple[list[tuple[Any, ...]], dict]:
    """The violations, as (property, time, message, clients), and the figures."""
    found: list[tuple[Any, ...]] = []
    rows = history.rows
    by_seen: dict[int, list[Row]] = defaultdict(list)
    for row in rows:
        by_seen[row.seen].append(row)
    for seen, same in sorted(by_seen.items()):
        if len(same) > 1:
            found.append((
                "lost-update", same[1].at,
                f"{len(same)} committed transactions read the counter at {seen}: "
                + ", ".join(f"{r.client}/h{r.hold} (fence {r.fence}, row #{r.id})" for r in same),
                {r.client for r in same},
            ))  # fmt: skip
    bad = [r for r in rows if r.wrote != r.seen + 1]
    if sorted(by_seen) != list(range(len(by_seen))) or bad or history.counter != len(rows):
        found.append((
            "counter-mismatch", rows[-1].at if rows else 0.0,
            f"{len(rows)} committed transactions, the counter at {history.counter}; values read:"
            f" {sorted(by_seen)[:5]}...{sorted(by_seen)[-5:]}; rows not writing read + 1:"
            f" {[r.id for r in bad][:10]}",
            set(),
        ))  # fmt: skip
    chain = sorted(rows, key=lambda r: (r.seen, r.id))  # the commit order
    for before, after in itertools.pairwise(chain):
        if after.fence <= before.fence:
            found.append((
                "fence-order", after.at,
                f"{after.client}/h{after.hold} committed fence {after.fence} (read {after.seen})"
                f" after {before.client}/h{before.hold} had committed fence {before.fence}"
                f" (read {before.seen}): a stale holder's transaction committed",
                {after.client, before.client},
            ))  # fmt: skip
    by_hold = {(r.client, r.hold): r for r in rows}
    granted: dict[tuple[str, int], int | None] = {}
    refences = refenced_holds(events)
    outcome: Counter[str] = Counter()
    forms: Counter[str] = Counter()
    levels: Counter[str] = Counter()
    for ev in events:
        e, key = ev["e"], (ev["c"], ev.get("h"))
        if e == "acq_ok":
            granted[key] = ev["fence"]
        elif e == "db_begin":
            forms[ev["form"]] += 1
        elif e == "db_ok":
            outcome["ok"] += 1
            row = by_hold.get(key)
            if row is None or row.fence != ev["fence"] or row.seen != ev["seen"]:
                found.append((
                    "commit-lost", ev["t"],
                    f"{ev['c']}/h{ev['h']} left its block at {ev['t']:.3f} (fence {ev['fence']},"
                    f" read {ev['seen']}): committed, yet the history has "
                    + (f"fence {row.fence}, read {row.seen}" if row else "no row"),
                    {ev["c"]},
                ))  # fmt: skip
        elif e == "db_raised_after_commit":
            outcome["raised_after_commit"] += 1
            found.append((
                "raised-after-commit", ev["t"],
                f"{ev['c']}/h{ev['h']} raised an on_commit callback's error at {ev['t']:.3f}"
                f" (fence {ev['fence']}): its block had committed"
                + (f" (row #{by_hold[key].id})" if key in by_hold else ", yet no row"),
                {ev["c"]},
            ))  # fmt: skip
        elif e == "db_client":
            levels[ev["level"]] += 1
        elif e == "db_prune":
            outcome["prunes"] += 1
            outcome["pruned"] += ev["n"]
        elif e in ("db_stale", "db_abort", "db_refused", "db_serial", "db_failed"):
            outcome[e[3:]] += 1
            if key in by_hold:
                found.append((
                    "refused-but-committed", ev["t"],
                    f"{ev['c']}/h{ev['h']} raised ({e}) at {ev['t']:.3f}, yet its transaction"
                    f" committed (row #{by_hold[key].id}, fence {by_hold[key].fence})",
                    {ev["c"]},
                ))  # fmt: skip
        elif e == "db_err":
            outcome["error"] += 1
    for row in rows:
        fence = granted.get((row.client, row.hold))
        if (
            fence is not None
            and fence != row.fence
            and refences.get((row.client, row.hold)) != row.fence
        ):
            found.append((
                "fence-not-granted", row.at,
                f"row #{row.id} of {row.client}/h{row.hold} has fence {row.fence}, but the hold"
                f" was granted fence {fence}",
                {row.client},
            ))  # fmt: skip
    stats = {
        "committed": len(rows),
        "counter": history.counter,
        "told_committed": outcome["ok"],
        "stale": outcome["stale"],
        "refenced": len(refences),
        "aborted": outcome["abort"],
        "refused": outcome["refused"],
        "errors": outcome["error"] + outcome["failed"],
        "unknown": outcome["error"],
        "serialization": outcome["serial"],
        "prunes": outcome["prunes"],
        "pruned": outcome["pruned"],
        "forms": dict(forms),
        "levels": dict(levels),
    }
    return found, stats


def refenced_holds(events: list[dict[str, Any]]) -> dict[tuple[str, int], int]:
    """The holds re-fenced in their block (a clock step): their new fence, above the one
    granted (a re-fence only ever raises it)."""
    found = {}
    for ev in events:
        if ev["e"] == "db_refenced" and ev["fence"] > ev["granted"]:
            found[(ev["c"], ev["h"])] = ev["fence"]
    return found


def summary(stats: dict[str, Any]) -> str:
    forms = ", ".join(f"{n} {form}" for form, n in sorted(stats["forms"].items()))
    return (
        f"  database: {stats['committed']} fenced transactions committed (counter"
        f" {stats['counter']}; {forms} blocks), {stats['stale']} refused by StaleFence,"
        f" {stats.get('refenced', 0)} re-fenced,"
        f" {stats['refused']} not held (or row wait ran out), {stats['aborted']} rolled back"
        f" on purpose, {stats.get('serialization', 0)} serialization failures,"
        f" {stats['errors']} database errors; {stats.get('prunes', 0)} prunes deleted"
        f" {stats.get('pruned', 0)} rows; clients by isolation level:"
        f" {stats.get('levels', {})}"
    )


if __name__ == "__main__":
    migrate(json.loads(sys.argv[1]))
