"""One Redis server by URL: ``redis://``, ``rediss://`` or ``unix://``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

import redis
import redis.asyncio
from django.core.exceptions import ImproperlyConfigured
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .. import acl, fast_path, scripts, wire
from ..acl import mask
from ..exceptions import BackendRefused, BackendUnavailable, LockError, MissingPermission
from ..forks import after_fork_in_child
from ..identity import write_seq
from ..options import check_options, pool_options
from ..scripts import Call, script
from ..waiters import Owed
from ..waiting import PubSubHub
from .base import (
    Attempt,
    BaseLockBackend,
    Kind,
    LockInfo,
    Op,
    Order,
    Released,
    Renewal,
    nest_gone,
    refence_least,
    stale_write,
)
from .cursors import parse_cursor
from .markers import queued_key
from .replies import CLASH_KINDS, kind_clash, lease_info, lock_info

logger = logging.getLogger("django_redlock")
T = TypeVar("T")

#: Errors that mean "Redis did not answer", as opposed to "Redis said no".
UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OSError)


def _rebuilt(pool: Any) -> bool:
    """Whether a client's renewals get a pool of their own made like ``pool`` (its kwargs
    rebuild it): any ``ConnectionPool``, a project's own subclass too (with exact types
    only, a ``BlockingConnectionPool`` subclass left the renewals queued behind the cache's
    callers: review wdc3, 5), but a Sentinel one (its connections ask where the master is).
    """
    from redis.sentinel import SentinelConnectionPool, SentinelManagedConnection

    connection_class = getattr(pool, "connection_class", None)
    return (
        isinstance(pool, redis.ConnectionPool)
        and not isinstance(pool, SentinelConnectionPool)
        and isinstance(connection_class, type)
        and not issubclass(connection_class, SentinelManagedConnection)
    )


#: The refusal table: an error reply about the server, not the lock, by its first word.
#: For now (BackendUnavailable: the same call may be answered later; whether this one ran
#: is unknown, as for a timeout) ...
UNAVAILABLE_FOR_NOW = {
    "BUSY": "is busy running a script or function (until it ends, or SCRIPT KILL)",
    "LOADING": "is loading its data set",
    "MASTERDOWN": "is a replica that lost its link to its master",
    "NOREPLICAS": "has too few good replicas to accept a write (min-replicas-to-write)",
    "READONLY": "is a read-only replica (a failover under way?)",
    "TRYAGAIN": "cannot serve the lock's keys during a slot migration",
    "CLUSTERDOWN": "is in a cluster that is down",
}
#: The codes redis-py strips from the messages of its own classes (before 8.2's status_code).
_CODES = (
    (redis.exceptions.OutOfMemoryError, "OOM"),
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.MasterDownError, "MASTERDOWN"),
    (redis.exceptions.TryAgainError, "TRYAGAIN"),
    (redis.exceptions.ClusterDownError, "CLUSTERDOWN"),
)
#: ... or refused (BackendRefused); any other error reply is refused too, in its own words.
REFUSED = {
    "OOM": "is out of memory (maxmemory reached, and its policy evicts nothing)",
    "MISCONF": "refuses writes after a failed snapshot (stop-writes-on-bgsave-error)",
}


def text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _flag(on: bool) -> str:
    return "1" if on else "0"


_FLAG = {False: "0", True: "1"}


def _kind_arg(kind: Kind, order: Order | None) -> str:
    """acquire.lua's and release.lua's reentrant argument: '0', '1', or an ordered write's
    'seq|levels[|fence]' (lua/_hold.lua's order_read)."""
    if order is None or not kind.reentrant:
        return _FLAG[kind.reentrant]
    return "|".join(str(part) for part in order)


_ACQUIRE, _RELEASE = script("acquire"), script("release")


class RedisBackend(BaseLockBackend):
    """Locks on one Redis through redis-py (with hiredis), on a connection pool of its own."""

    wakes_one = True
    #: Whether waiters listen on a lock's release channel (Redis Cluster, a Redlock's nodes),
    #: so that freeing it must PUBLISH there; elsewhere each waiter is woken in its process's
    #: inbox, and the scripts get the lock's own key for the channel: no PUBLISH to nobody on
    #: each release, and no key outside KEY_PREFIX (which an ACL'd user may not pass).
    publishes_releases = False
    #: The commands it sends, for its Redis user's ACL (see :mod:`~django_redlock.acl`).
    acl_commands: Mapping[str, tuple[str, ...]] = acl.COMMANDS
    default_options: dict[str, Any] = {
        "socket_timeout": 2.0,
        "socket_connect_timeout": 2.0,
    }

    def __init__(self, alias: str, params: Any) -> None:
        super().__init__(alias, params)
        self._client: Any = None
        self._aclients = PerLoop()
        self._hub: PubSubHub | None = None
        self._owed: Owed = {}  # leaves owed by closed hubs, for the next one (_owe)
        self._setup = threading.RLock()
        _backends.add(self)
        self._key_cache: dict[str, tuple[str, str, str, str, str, str, str]] = {}
        self._timeout_of: tuple[Any, float | None] | None = None  # (client, socket timeout)

    # -- connections -------------------------------------------------------------------------

    #: Whether all round trips of one op (on the thread's own connection: a reconnect's
    #: handshake, NOSCRIPT, SCRIPT LOAD, the script again) share one socket timeout.
    op_deadline = True

    #: What redis-py raises when the server did not answer (``BackendUnavailable``).
    unavailable_errors: tuple[type[Exception], ...] = UNAVAILABLE

    def client_options(self, retry: Any) -> dict[str, Any]:
        options = {**self.default_options, **self.options}
        # redis-py retries failed commands by default; a retried acquire could outlive the
        # socket timeout several times over, so one try it is (acquire is idempotent anyway).
        options.setdefault("retry", retry)
        # A burst of callers beyond max_connections waits for a connection (as long as the
        # socket timeout) instead of failing at once.
        options.setdefault("max_connections", 100)
        options.setdefault("timeout", options["socket_timeout"])
        return options

    def make_client(self) -> Any:
        options = self.client_options(redis.retry.Retry(NoBackoff(), 0))
        # redis-py's blocking pool, a connection it took or was given back found again when a
        # soft time limit lands in its checkout or give-back (see wire.WaitingPool): with a
        # plain one, each such interrupt lost a connection for good. A closed one handed over
        # reconnects within what is left of the call's socket timeout (fast_path.CallPool).
        pool = fast_path.CallPool.from_url(str(self.location), **options)
        return redis.Redis(connection_pool=pool)

    def make_async_client(self) -> Any:
        options = self.client_options(redis.asyncio.retry.Retry(NoBackoff(), 0))
        pool = AsyncPool.from_url(str(self.location), **options)
        return redis.asyncio.Redis(connection_pool=pool)

    @property
    def client(self) -> Any:
        if self._client is None:
            with self._setup:
                if self._client is None:
                    self._client = self.make_client()
        return self._client

    @property
    def aclient(self) -> Any:
        """A ``redis.asyncio`` client for the running event loop (connections are per loop),
        closed with its loop: a loop per request (``asyncio.run``, an async view under WSGI)
        must not leave a connection behind per request."""
        loop = asyncio.get_running_loop()
        entry = self._aclients.get(loop)
        if entry is None:
            with self._setup:
                entry = self._aclients[loop] = _closing_with_loop(self.make_async_client())
        return entry[0]

    @property
    def socket_timeout(self) -> float:
        kwargs = self.client.connection_pool.connection_kwargs
        return float(kwargs.get("socket_timeout") or 2.0)

    @property
    def hub(self) -> PubSubHub:
        if self._hub is None:
            with self._setup:
                if self._hub is None:
                    self._hub = self._adopt(PubSubHub(
                        self._pubsub, self.socket_timeout, self.inbox_prefix, self._refusal
                    ))  # fmt: skip
        return self._hub

    def _pubsub(self) -> Any:
        """A new pub/sub of the client's, made at each (re)connect of the hub. The hub keeps this
        bound method, not ``client.pubsub``: a backend holding its client weakly (compat's)
        must not have its hub keep the client alive."""
        return self.client.pubsub()

    def _adopt(self, hub: PubSubHub) -> PubSubHub:
        """A new hub takes the leaves its closed predecessors still owe (under ``_setup``)."""
        owed, self._owed = self._owed, {}
        hub.take_over(owed)
        return hub

    def _owe(self, owed: Owed) -> None:
        """Leaves a closed hub owes (close() hands its owed leaves to the next hub): to the
        current hub, else kept for the next one made."""
        with self._setup:
            hub = self._hub
            if hub is None:
                self._owed.update(owed)
                return
        hub.take_over(owed)  # (closed meanwhile: it hands them on to us again)

    def _refusal(self, exc: BaseException) -> MissingPermission | None:
        """``exc`` as a MissingPermission, if it is an ACL's refusal (else None)."""
        return self.refusal_error("", exc) if acl.refusal(exc) is not None else None

    # -- executing ops -----------------------------------------------------------------------

    @contextmanager
    def round_trip(self, name: str) -> Iterator[None]:
        """One round trip about lock ``name`` (a glob for a scan), counted: no answer raises
        BackendUnavailable, an ACL's refusal MissingPermission. Internal API (the Redlock
        backend's nodes, whose I/O is its own)."""
        self.round_trips += 1
        try:
            yield
        except self.unavailable_errors as exc:
            raise self._unavailable(name, exc) from exc
        except ResponseError as exc:
            if acl.refusal(exc) is None:
                raise self.server_error(name, exc) from exc
            raise self.refusal_error(name, exc) from exc

    def _unavailable(self, name: str, exc: Exception) -> BackendUnavailable:
        timed_out = isinstance(exc, (RedisTimeoutError, TimeoutError))
        message = f"lock {name!r}: backend {self.describe()} is unavailable: {exc}"
        return BackendUnavailable(message, timed_out=timed_out)

    def server_error(self, name: str, exc: ResponseError) -> LockError:
        """An error reply that is not an ACL's, as the refusal table says: BackendUnavailable
        (for now) or BackendRefused, in the server's own words. Internal API (the Cluster's
        and Sentinel's replies)."""
        code = (
            getattr(exc, "status_code", None)  # redis-py 8.2
            or next((c for cls, c in _CODES if isinstance(exc, cls)), None)  # stripped before
            or str(exc).split(" ", 1)[0]
        )
        said = str(exc) if str(exc).startswith(code) else f"{code} {exc}"
        if code in UNAVAILABLE_FOR_NOW:
            return BackendUnavailable(
                f"lock {name!r}: backend {self.describe()} {UNAVAILABLE_FOR_NOW[code]}: {said}"
            )
        what = REFUSED.get(code, "refused the command")
        return BackendRefused(f"lock {name!r}: backend {self.describe()} {what}: {said}", code)

    def refusal_error(self, name: str, exc: BaseException) -> MissingPermission:
        """An ACL's refusal as a MissingPermission; a script's command it does not name is
        found by the probe (one more round trip, on this error's path only). Internal API
        (the Redlock backend's I/O)."""
        refused: list[str] | None = None
        if acl.needs_probe(exc):
            with contextlib.suppress(LockError):
                refused = self.execute(self.op_probe())
        return acl.missing_permission(self, name, exc, refused or ())

    async def _arefused(self, name: str, exc: BaseException) -> MissingPermission:
        refused: list[str] | None = None
        if acl.needs_probe(exc):
            with contextlib.suppress(LockError):
                refused = await self.aexecute(self.op_probe())
        return acl.missing_permission(self, name, exc, refused or ())

    # -- the watchdog's renewals: a pool of their own ----------------------------------------
    # On the pool's path (a tracer wrapping execute_command, a retry option) a renewal took a
    # connection of the blocking pool as every caller did, queued behind them (a releasing
    # caller took it again before the woken renewal ran) for a socket timeout per try, and a
    # hold expired on a healthy Redis while its owner held it. Its connections now come from
    # a pool of their own, made like the client's, with no limit (one connection: the
    # backend's renewals are one worker's), as Cluster's (_own) and Sentinel's.

    # (the client, weakly: compat's backend must not keep its client alive; the renewals')
    _renewals: tuple[weakref.ref[Any], Any] | None = None

    def renew_many(self, renewals: Sequence[Renewal], shard: Hashable = None) -> list[bool | None]:
        op, client = self.op_renew(renewals), self.client
        if fast_path.on_thread_connection(client):
            return self.execute(op)  # the thread's own connection: nothing waits in the pool
        return self.execute_on(self._renewals_client(client), op)

    def _renewals_client(self, client: Any) -> Any:
        """A ``redis.Redis`` for the renewals, on a pool of their own made like ``client``'s;
        ``client`` itself when its pool is not one to rebuild from its kwargs (a Sentinel
        one, or not a ``ConnectionPool``)."""
        kept = self._renewals
        if kept is not None and kept[0]() is client:
            return kept[1]
        pool = client.connection_pool
        if not _rebuilt(pool):
            return client
        with self._setup:
            kept = self._renewals
            if kept is None or kept[0]() is not client:
                own = redis.ConnectionPool(
                    connection_class=pool.connection_class, **pool.connection_kwargs
                )
                old, kept = kept, (weakref.ref(client), redis.Redis(connection_pool=own))
                self._renewals = kept
                if old is not None:  # the client was made again (closed meanwhile)
                    _disconnect_renewals(old[1])
        return kept[1]

    def execute(self, op: Op[T]) -> T:
        return self.execute_on(self.client, op)

    def execute_on(self, client: Any, op: Op[T]) -> T:
        """``op`` on ``client`` (the backend's, or the renewals' own)."""
        request = op.request
        self.round_trips += 1
        # One deadline for all of the op's round trips (on the fast path): a reconnect's
        # handshake, NOSCRIPT and SCRIPT LOAD, the script again, an ACL probe.
        timeout, call = self._call_timeout(client), fast_path.CallDeadline()
        try:  # not `with self.round_trip()`: this is every sync operation's path
            if timeout is not None:
                fast_path.begin_call(call, time.monotonic() + timeout)
            if isinstance(request, Call):
                reply = scripts.run(client, request)
            elif isinstance(request, list):
                reply = scripts.run_many(client, request)
                refused = acl.first_refused(reply) or _first_error(reply)
                if refused is not None:  # translated below, as if raised
                    raise refused
            else:
                reply = fast_path.command(client, *request)
        except self.unavailable_errors as exc:
            raise self._unavailable(op.name, exc) from exc
        except ResponseError as exc:
            if acl.refusal(exc) is None:
                raise self.server_error(op.name, exc) from exc
            raise self.refusal_error(op.name, exc) from exc
        finally:
            if timeout is not None:
                fast_path.end_call(call)
        return op.parse(reply)

    def _call_timeout(self, client: Any) -> float | None:
        """The socket timeout of ``client``'s connections, None if they have none (kept per
        client: this is read per op)."""
        kept = self._timeout_of
        if kept is None or kept[0] is not client:
            kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
            none = "socket_timeout" in kwargs and kwargs["socket_timeout"] is None
            bounded = self.op_deadline and not none
            kept = self._timeout_of = (client, self.socket_timeout if bounded else None)
        return kept[1]

    async def aexecute(self, op: Op[T]) -> T:
        request, client = op.request, self.aclient
        self.round_trips += 1
        try:
            if isinstance(request, Call):
                reply = await scripts.arun(client, request)
            elif isinstance(request, list):
                reply = await scripts.arun_many(client, request)
                refused = acl.first_refused(reply) or _first_error(reply)
                if refused is not None:  # translated below, as if raised
                    raise refused
            else:
                reply = await client.execute_command(*request)
        except self.unavailable_errors as exc:
            raise self._unavailable(op.name, exc) from exc
        except ResponseError as exc:
            if acl.refusal(exc) is None:
                raise self.server_error(op.name, exc) from exc
            raise await self._arefused(op.name, exc) from exc
        return op.parse(reply)

    def execute_by(self, op: Op[T], deadline: float | None) -> T:
        # On the thread's own connection (the fast path); through redis-py's pool, as
        # execute() (a connection checked out cannot be bounded without redis-py's insides).
        if deadline is None:
            return self.execute(op)
        with fast_path.answered_by(deadline):
            return self.execute(op)

    async def aexecute_by(self, op: Op[T], deadline: float | None) -> T:
        if deadline is None:
            return await self.aexecute(op)
        # Not asyncio.wait_for (a cancellation racing the result can be lost, Python < 3.12):
        # the caller's cancellation reaches the command through the except below.
        command = asyncio.ensure_future(self.aexecute(op))
        # The loop's own lateness is not the server's: the bound gets as long again as the
        # loop ran other tasks meanwhile (as a connect's): a reply read late is still taken.
        patience = _Patience(max(0.0, deadline - time.monotonic()))
        try:
            looks = 0
            while not command.done():
                left = patience.left()
                if left > 0:
                    await asyncio.wait({command}, timeout=left)
                elif looks < _LAST_LOOKS:
                    # Due: a reply already in the socket is read first, then taken.
                    looks += 1
                    await asyncio.sleep(0)
                else:
                    break
        except BaseException:
            # A close (GeneratorExit) on a closed loop: cancel() needs the loop and would
            # raise "Event loop is closed" in the exit's place, and the driver would never
            # hand its clean-up to the finisher (the grant of this try held by nobody).
            with contextlib.suppress(RuntimeError):
                command.cancel()
            raise
        finally:
            patience.end()
        if not command.done():
            if op.late is not None:
                op.late(command)  # runs on: its reply, if one comes, is the caller's to undo
            else:
                command.cancel()  # (redis-py drops the connection of a command cut short)
            raise BackendUnavailable(
                f"lock {op.name!r}: backend {self.describe()} is unavailable: no answer"
                " before the wait's server went silent for the socket timeout",
                timed_out=True,
            )
        return command.result()

    # -- ops ---------------------------------------------------------------------------------

    def op_acquire(
        self,
        name: str,
        token: str,
        ttl_ms: int,
        meta: str,
        kind: Kind,
        waiter: str | None = None,
        wait_ms: int = -1,
        order: Order | None = None,
    ) -> Op[Attempt]:
        key, fence, queue, deadlines, waiting, _, inbox = self._keys(name)
        # As text: the packer then takes the arguments as they are (see wire.texts).
        # A plain (unordered) hold's flag without _kind_arg()'s call: every acquire sends one.
        flag = _FLAG[kind.reentrant] if order is None else _kind_arg(kind, order)
        args: list[Any] = [token, str(ttl_ms), meta, flag, _FLAG[kind.fair]]
        if waiter is not None or wait_ms >= 0:  # a one-off try leaves them out: less to send
            args += [waiter or token, str(wait_ms), inbox]
        back = f"{key}:b:{token}"  # handed_back_key(), without its calls
        call = Call(_ACQUIRE, (key, fence, queue, deadlines, waiting, back), args)
        return Op(name, call, lock_attempt(name, self.alias, kind))

    def _keys(self, name: str) -> tuple[str, str, str, str, str, str, str]:
        """A lock's keys, its release channel and inbox prefix, built once per name (a few
        thousand names at most are kept): every acquire and release sends them."""
        keys = self._key_cache.get(name)
        if keys is None:
            if len(self._key_cache) >= 4096:
                self._key_cache.clear()
            keys = self._key_cache[name] = (
                self.key(name), self.fence_key(name), self.queue_key(name),
                self.deadlines_key(name), self.waiting_key(name), self._release_channel(name),
                self.inbox_for(name),
            )  # fmt: skip
        return keys

    def _release_channel(self, name: str) -> str:
        return self.channel(name) if self.publishes_releases else self.key(name)

    def op_release(self, name: str, token: str, kind: Kind, order: Order | None = None) -> Op[int]:
        key, _, queue, deadlines, waiting, channel, inbox = self._keys(name)
        keys = (key, channel, waiting, queue, deadlines)
        flag = _FLAG[kind.reentrant] if order is None else _kind_arg(kind, order)  # (as above)
        call = Call(_RELEASE, keys, [token, inbox, flag])
        return Op(name, call, int if order is None else ordered_count(name, self.alias))

    def op_hand_back(self, name: str, token: str, kind: Kind, kept: bool = False) -> Op[int]:
        op = self.op_release(name, token, kind)  # (a subclass's bookkeeping too)
        call = op.request
        if kind.reentrant or not isinstance(call, Call):
            return op
        keys = (*call.keys, self.handed_back_key(name, token))
        args = [*call.args, "1"] if kept else call.args  # marked once freed too
        return Op(op.name, Call(call.script, keys, args), op.parse)

    def op_acquire_all(
        self, names: Sequence[str], token: str, ttl_ms: int, meta: str, waiter: str = ""
    ) -> Op[TakenAll]:
        """Take every one of ``names`` (distinct, canonical order) with ``token``, or none, in
        one round trip (lua/acquire_all.lua): plain locks only. ``waiter`` ('': a one-off try)
        registers on the first busy name, to be woken by its release. A subclass may add to
        the op (Sentinel: the replicas' confirmation), as :meth:`op_acquire` does; a set it
        refuses after all is given back before it raises."""
        keys: list[str] = []
        for name in names:
            key, fence, queue, deadlines, waiting, _, _ = self._keys(name)
            keys += [key, fence, queue, deadlines, waiting]
        keys.append(self.handed_back_key(names[0], token))  # (op_release_all's mark)
        args = [token, ttl_ms, meta, waiter, self.inbox_for(names[0])]  # one inbox prefix
        return Op(names[0], Call(script("acquire_all"), keys, args), taken_all(names, self.alias))

    def op_release_all(
        self, names: Sequence[str], token: str, mark: str | None = None
    ) -> Op[list[Any]]:
        """Release every one of ``names`` that ``token`` holds (plain locks), in one round trip
        (lua/release_all.lua): each name's reply as :meth:`op_release`'s. ``mark``: the
        set's first name, when this gives back a take that may still be on the wire: the
        token holding none of them, :meth:`op_acquire_all` refuses it from then on (see
        :meth:`op_hand_back`)."""
        keys: list[str] = []
        args: list[Any] = []
        for name in names:
            call = self.op_release(name, token, Kind()).request
            keys += call.keys[:5]  # release.lua's own five and three: release_all.lua's layout
            args += call.args[:3]
        if mark is not None:
            keys.append(self.handed_back_key(mark, token))
        return Op(names[0], Call(script("release_all"), keys, args), list)

    def op_extend(self, name: str, token: str, ttl_ms: int) -> Op[bool]:
        return Op(name, Call(script("extend"), [self.key(name)], [token, ttl_ms]), bool)

    def op_renew(self, renewals: Sequence[Renewal]) -> Op[list[bool | None]]:
        # One script call for the whole batch, with the tokens (and the TTL, the same for a
        # whole batch of the watchdog) in one argument each: packing arguments costs the client
        # more than anything else in a renewal.
        keys = [self.key(r.name) for r in renewals]
        ttls = {r.ttl_ms for r in renewals}
        ttl = str(ttls.pop()) if len(ttls) == 1 else "|".join(str(r.ttl_ms) for r in renewals)
        args = ["|".join([r.token for r in renewals]), ttl]
        name = renewals[0].name if renewals else ""
        return Op(name, Call(script("renew"), keys, args), renewed)

    def op_raise_fence(self, name: str, fence: int, token: str) -> Op[bool]:
        """Redlock's lift: the counter to ``fence``, and ``token``'s hold, if still here."""
        keys = [self.fence_key(name), self.key(name)]
        return Op(name, Call(script("raise_fence"), keys, [fence, token]), bool)

    def op_refence(
        self, name: str, token: str, recorded: int, client_us: int | None = None
    ) -> Op[int]:
        keys = [self.key(name), self.fence_key(name)]
        # The fence travels as the exact decimal string the scripts store, never a float.
        least = str(refence_least(client_us))
        call = Call(script("refence"), keys, [token, str(recorded), least])
        return Op(name, call, int)

    def op_settle(
        self, name: str, owner: str, count: int, seq: int = 0, mark: bool = True
    ) -> Op[int]:
        keys = [self.key(name), self._release_channel(name), self.waiting_key(name),
                self.queue_key(name), self.deadlines_key(name)]  # fmt: skip
        if mark:
            keys.append(self.handed_back_key(name, owner))
        args = [owner, count, self.inbox_for(name), *([seq] if seq else [])]
        return Op(name, Call(script("settle"), keys, args), ordered_count(name, self.alias))

    def op_leave(self, name: str, waiter: str) -> Op[None]:
        keys = [self.key(name), self.queue_key(name), self.deadlines_key(name),
                self.waiting_key(name)]  # fmt: skip
        return Op(name, Call(script("leave"), keys, [waiter, self.inbox_for(name)]), _none)

    def op_hold_count(self, name: str, token: str) -> Op[int]:
        return Op(name, Call(script("inspect"), [self.key(name), self.queue_key(name)], []),
                  lambda reply: _count_of(reply, token))  # fmt: skip

    def op_locked(self, name: str) -> Op[bool]:
        return Op(name, ("EXISTS", self.key(name)), bool)

    def op_pttl(self, name: str) -> Op[int | None]:
        return Op(name, ("PTTL", self.key(name)), _pttl)

    def op_inspect(self, name: str) -> Op[LockInfo | None]:
        keys = [self.key(name), self.queue_key(name), self.waiting_key(name),
                self.details_key(name), self.writers_key(name)]  # fmt: skip
        return Op(name, Call(script("inspect"), keys, []), lambda r: self.parse_info(name, r))

    def op_force_release(
        self, name: str, token: str | None = None, fence: int | None = None
    ) -> Op[Released]:
        keys = [self.key(name), self.channel(name), self.queue_key(name), self.deadlines_key(name),
                self.waiting_key(name), self.details_key(name), self.writers_key(name)]  # fmt: skip
        # The fence travels as the exact decimal string the scripts store, never a float.
        args = [self.inbox_for(name), token or "", "" if fence is None else str(int(fence))]
        return Op(name, Call(script("force_release"), keys, args), Released.of)

    def parse_info(self, name: str, reply: Any) -> LockInfo | None:
        """inspect.lua's reply about ``name`` as a LockInfo (None: not held). Internal API
        (the Redlock backend reads each node's reply)."""
        kind, pttl, value, waiters = reply[:4]
        if text(kind) == "zset":
            return _leases(name, self.alias, value, int(waiters), text(reply[4]))
        longest = [x for x in reply[5:6] if x is not None]
        value = _value(text(kind), value)
        if value is None:
            return None
        return lock_info(name, self.alias, value, int(pttl), int(waiters), *map(int, longest))

    def page(self, match: str, cursor: str | None, size: int) -> tuple[list[LockInfo], str | None]:
        """A page by ``SCAN`` (never ``KEYS``): the scan's cursor is the page's cursor, and
        the page's locks are inspected in one pipelined round trip."""
        pattern = self.key_pattern(match)
        names: list[str] = []
        position, count = parse_cursor(cursor), size  # BadCursor for a crafted one
        with self.round_trip(match):
            while True:
                position, keys = self.client.scan(position, match=pattern, count=count)
                names += [n for k in keys if (n := self.matching_name(text(k), match)) is not None]
                if position == 0 or len(names) >= size:
                    break
                count = min(count * 2, 10_000)  # few matches: look further per round trip
        if not names:
            return [], None
        replies = self.execute(Op(match, [self.op_inspect(n).request for n in names], list))
        infos = [
            self.parse_info(n, r)
            for n, r in zip(names, replies, strict=True)
            if not isinstance(r, Exception)
        ]
        return [i for i in infos if i is not None], (str(position) if position else None)

    def iter_locks(self, match: str = "*") -> Iterator[LockInfo]:
        pattern = self.key_pattern(match)
        with self.round_trip(match):
            keys = [text(k) for k in self.client.scan_iter(match=pattern, count=1000)]
        for key in keys:
            name = self.matching_name(key, match)
            info = self.inspect(name) if name is not None else None
            if info is not None:
                yield info

    # -- lifecycle ---------------------------------------------------------------------------

    #: What the startup check found the Redis user lacks (None: nothing, or not checked).
    missing_permission: MissingPermission | None = None
    #: Whether the startup check ran (the server answered it).
    permissions_checked = False

    #: When (monotonic) :meth:`prepare` got no answer, and what it got.
    _unanswered: tuple[float, BackendUnavailable] | None = None

    def prepare(self) -> None:
        try:
            with self.round_trip("(startup)"):
                scripts.register(self.client)
            self.check_permissions()
        except BackendUnavailable as exc:
            self._unanswered = (time.monotonic(), exc)
            logger.warning("redlock: could not load the Lua scripts at startup: %s", exc)
        except MissingPermission as exc:
            self.missing_permission, self.permissions_checked = exc, True
        except (ResponseError, BackendRefused) as exc:
            said = exc.__cause__ if isinstance(exc, BackendRefused) else exc
            if "DB index" not in str(said):
                if isinstance(exc, BackendRefused):  # the table's (OOM, ...): as unavailable
                    logger.warning("redlock: could not load the Lua scripts at startup: %s", exc)
                    return
                raise
            # A database the server lacks (/16 on a 16-database server): every command
            # would fail, so startup refuses, naming the setting.
            at = f" at {mask(self.location)}" if isinstance(self.location, str) else ""
            raise ImproperlyConfigured(
                f"{self.database_setting} names a database the server{at} does not have"
                f" ({said}): use one below its `databases` setting (16 by default: 0-15)"
            ) from None
        if self.missing_permission is not None:
            logger.warning("redlock: %s", self.missing_permission)

    def unanswered_at_startup(self) -> LockError | None:
        if self._unanswered is None:
            return None
        at, exc = self._unanswered
        return exc if time.monotonic() - at < self.socket_timeout else None

    #: The setting naming this backend's URL (a Redlock node's: an item of its list).
    location_setting = ""

    @property
    def database_setting(self) -> str:
        """The setting that chose this backend's database, for startup's errors: the URL's
        path or ?db=, else OPTIONS['db'] (Sentinel: always; its URLs name sentinels)."""
        where = self.location_setting or f"DJANGO_REDLOCK[{self.alias!r}]['LOCATION']"
        if "CACHE" in self.params or not self.location:  # a django-redis cache's connection
            cache = self.params.get("CACHE", "default")
            return f"CACHES[{cache!r}]['LOCATION'] (the cache of DJANGO_REDLOCK[{self.alias!r}])"
        if isinstance(self.location, str):
            parts = urlsplit(self.location)
            in_url = (parts.scheme != "unix" and parts.path.strip("/")) or "db=" in parts.query
            if in_url or "db" not in self.options:
                return where
        return where.split("['LOCATION']")[0] + "['OPTIONS']['db']"

    def check_permissions(self) -> MissingPermission | None:
        """Whether the Redis user lacks a permission the app needs (see :func:`acl.check`);
        BackendUnavailable when the server does not answer."""
        self.missing_permission = acl.check(self)
        self.permissions_checked = True
        return self.missing_permission

    def op_probe(self) -> Op[list[str] | None]:
        """The commands the Redis user may not run, of those the app needs (None: Redis < 7
        cannot tell); nothing is run."""
        names, args = acl.probe_args(self)
        call = Call(script("probe"), [self.key("probe")], args)
        return Op("(permissions)", call, lambda reply: acl.refused_commands(names, reply))

    def forget_after_fork(self) -> None:
        """In a forked child, before anything else runs there (no I/O, no lock taken):
        ``_setup`` may have been held by another thread of the parent at the fork (making
        the client: a cluster's reads the slots over the network): held for good in the
        child, whose first operation then waited forever."""
        self._setup = threading.RLock()
        self._owed = {}  # the parent's waiter ids: its inbox, never heard here

    def close(self) -> None:
        # Both detached first: the hub's close wakes its waiters, which must find a new hub
        # on a new client, not the closed ones.
        hub, self._hub = self._hub, None
        client, self._client = self._client, None
        renewals, self._renewals = self._renewals, None
        if renewals is not None:
            _disconnect_renewals(renewals[1])
        if hub is not None:
            hub.close()
            hub.hand_over(self._owe)
        if client is not None:
            pool = getattr(client, "connection_pool", None)  # a cluster has one per node
            if pool is not None:
                fast_path.disconnect_threads(pool)
            client.close()
            if pool is not None:
                # Ours (a cache's pool is let go before this: see DjangoRedisBackend.close):
                # closed now, not when the garbage collector gets to its connections.
                pool.disconnect()
        aclients, self._aclients = self._aclients, PerLoop()
        options = {**self.default_options, **self.options}
        # A command in flight has its connection for a socket timeout, after one for a free
        # connection (the blocking pool's), then a little for the loop to get to it.
        after = 2 * float(options.get("socket_timeout") or 2.0) + 1.0
        for loop, entry in list(aclients.items()):
            _retire(loop, entry, after)
        super().close()

    @classmethod
    def check_options(cls, alias: str, params: Mapping[str, Any]) -> None:
        # Every key goes to BlockingConnectionPool.from_url, then to the connection class
        # the URL's scheme picks: a key neither takes is a TypeError at the first connection.
        scheme = urlsplit(str(params.get("LOCATION"))).scheme
        where = f"redis-py's pool and {scheme}:// connection (BlockingConnectionPool.from_url)"
        check_options(alias, params.get("OPTIONS") or {}, pool_options(scheme), where)

    # -- queue markers (the task dedupe's: see .markers) -------------------------------------
    # One key in the lock's hash slot: Sentinel, Cluster and django-redis inherit these.

    def op_mark_queued(self, name: str, task_id: str, ttl_ms: int) -> Op[str | None]:
        call = Call(script("mark_queued"), [queued_key(self, name)], [task_id, ttl_ms])
        return Op(name, call, _queued)

    def op_clear_queued(self, name: str, task_id: str) -> Op[bool]:
        return Op(name, Call(script("clear_marker"), [queued_key(self, name)], [task_id]), bool)

    def op_swap_queued(self, name: str, expected: str, value: str, ttl_ms: int) -> Op[bool]:
        call = Call(script("swap_marker"), [queued_key(self, name)], [expected, value, ttl_ms])
        return Op(name, call, bool)

    def op_read_queued(self, name: str) -> Op[tuple[str, int] | None]:
        return Op(name, Call(script("read_marker"), [queued_key(self, name)], []), _marker)

    def queued_names(self, match: str = "*") -> list[str]:
        suffix = ":queued"
        with self.round_trip(match):
            pattern = self.key_pattern(match) + suffix
            keys = [text(k) for k in self.client.scan_iter(match=pattern, count=1000)]
        names = (self.matching_name(key[: -len(suffix)], match) for key in keys)
        return sorted({n for n in names if n is not None})

    # -- leases: semaphores and read-write locks ---------------------------------------------
    # lua/permit_*.lua; extend and renew are the lock's (extend.lua, renew.lua serve both).

    def _lease_keys(self, name: str) -> list[str]:
        return [self.key(name), self.details_key(name), self._release_channel(name),
                self.waiting_key(name), self.queue_key(name), self.deadlines_key(name),
                self.writers_key(name)]  # fmt: skip

    def op_lease_acquire(
        self,
        name: str,
        token: str,
        ttl_ms: int,
        meta: str,
        mode: str,
        limit: int = 0,
        fair: bool = False,
        waiter: str | None = None,
        wait_ms: int = -1,
        reader: str = "",
    ) -> Op[Attempt]:
        keys = self._lease_keys(name)
        keys.insert(2, self.fence_key(name))
        keys.append(self.handed_back_key(name, token))
        args: list[Any] = [token, ttl_ms, meta, mode, limit, _flag(fair)]
        if mode != "s" or waiter is not None or wait_ms >= 0:  # not a permit's one-off try
            args += [waiter or token, wait_ms, self.inbox_for(name), reader]
        if mode == "r":
            # A read's token is its owner's, taken again: its marker refuses only the reads
            # sent before the owner's settle (op_mark_reads), told by this number.
            args.append(str(write_seq()))
        return Op(name, Call(script("permit_acquire"), keys, args), lease_attempt(name, self, mode))

    def op_lease_release(self, name: str, token: str, mode: str = "") -> Op[int]:
        args = [token, self.inbox_for(name), mode] if mode else [token, self.inbox_for(name)]
        call = Call(script("permit_release"), self._lease_keys(name), args)
        return Op(name, call, int)

    def op_lease_hand_back(self, name: str, token: str, mode: str, kept: bool = False) -> Op[int]:
        op = self.op_lease_release(name, token, mode)
        if mode == "r":
            return op
        keys = [*op.request.keys, self.handed_back_key(name, token)]
        args = [token, self.inbox_for(name), mode, "1"] if kept else op.request.args
        return Op(op.name, Call(op.request.script, keys, args), op.parse)

    def op_mark_reads(self, name: str, owner: str) -> Op[int]:
        keys = [self.key(name), self.details_key(name), self.handed_back_key(name, owner)]
        return Op(name, Call(script("permit_mark"), keys, [owner, str(write_seq())]), int)

    def op_lease_leave(self, name: str, waiter: str) -> Op[None]:
        call = Call(script("permit_leave"), self._lease_keys(name), [waiter, self.inbox_for(name)])
        return Op(name, call, _none)

    def op_leases(self, name: str) -> Op[LockInfo | None]:
        return self.op_inspect(name)


_backends: weakref.WeakSet[RedisBackend] = weakref.WeakSet()


@after_fork_in_child
def _after_fork_in_child() -> None:
    for backend in list(_backends):
        backend.forget_after_fork()


def _queued(reply: Any) -> str | None:
    return None if reply is None else str(text(reply))


def _marker(reply: Any) -> tuple[str, int] | None:
    if not reply:
        return None
    return str(text(reply[0])), max(int(reply[1]), 0)


#: An event loop's heartbeat while a connect, or a wait for a pooled connection, measures
#: how long the loop was busy elsewhere (see :class:`AsyncPool`).
LOOP_BEAT = 0.005
#: Turns of the event loop a bounded try waits past its deadline (aexecute_by): one reads a
#: reply already in the socket, the next runs the command's task on it.
_LAST_LOOKS = 3
#: At most this much longer such a wait lasts for the loop's being busy (a burst of hundreds
#: of tasks keeps it busy for tenths of a second, seconds on a loaded machine: the time the
#: loop could not notice the wait end is not the server's).
LOOP_GRACE_MAX = 5.0


class _LoopStall:
    """How long one event loop's callbacks ran late (its thread busy running other tasks),
    by a heartbeat that beats only while someone measures.

    It keeps no reference to its loop (it is only ever used on it: the running loop is
    its own): it is the value of the loop's entry in the weak-keyed ``_stalls``, and a
    value holding its key keeps the entry, and the loop, for the life of the process."""

    def __init__(self) -> None:
        self._total = 0.0
        self._users = 0
        self._due: float | None = None  # the next beat's time, while it beats

    def begin(self) -> float:
        self._users += 1
        if self._due is None:
            self._due = time.monotonic() + LOOP_BEAT
            asyncio.get_running_loop().call_later(LOOP_BEAT, self._beat)
        return self.so_far()

    def end(self) -> None:
        self._users -= 1

    def so_far(self) -> float:
        """The stall counted so far, the current beat's lateness included."""
        late = 0.0 if self._due is None else time.monotonic() - self._due
        return self._total + _stalled(late)

    def _beat(self) -> None:
        now = time.monotonic()
        self._total += _stalled(now - (self._due or now))
        if self._users > 0:
            self._due = now + LOOP_BEAT
            asyncio.get_running_loop().call_later(LOOP_BEAT, self._beat)
        else:
            self._due = None  # an idle loop is not woken for nothing


def _stalled(late: float) -> float:
    return max(0.0, late - 0.002)  # (a timer's own jitter is no stall)


_stalls: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopStall] = (
    weakref.WeakKeyDictionary()
)


def _loop_stall() -> _LoopStall:
    loop = asyncio.get_running_loop()
    stall = _stalls.get(loop)
    if stall is None:
        stall = _stalls[loop] = _LoopStall()
    return stall


class _Patience:
    """A deadline ``limit`` from now, that gets as long again as the loop spent running
    other tasks meanwhile (LOOP_GRACE_MAX at most): the time counted is the time the loop
    could have noticed the wait end."""

    def __init__(self, limit: float) -> None:
        self._limit = limit
        self._started = time.monotonic()
        self._stall = _loop_stall()
        self._mark = self._stall.begin()

    def left(self, since: float = 0.0) -> float:
        """What is left of it, counted from ``since`` if that is later (progress seen)."""
        grace = min(self._stall.so_far() - self._mark, LOOP_GRACE_MAX)
        return max(self._started, since) + self._limit + grace - time.monotonic()

    def end(self) -> None:
        self._stall.end()


class _ReadDeadline:
    """A read's ``socket_timeout``, looked at when it comes: while the loop's grace
    (:class:`_Patience`) lasts it is put off, else the reading task is cancelled. As
    asyncio's timeout scope does, by hand: a scope's deadline cannot be moved from a
    callback with async_timeout 4 (redis-py's below Python 3.11.3)."""

    def __init__(self, patience: _Patience, limit: float) -> None:
        self.expired = False
        self._patience = patience
        task = asyncio.current_task()
        assert task is not None  # (read_response makes one in a task only)
        self._task: asyncio.Task[Any] = task
        cancelling = getattr(self._task, "cancelling", None)  # (Python 3.11+)
        self._cancelling: int = cancelling() if cancelling is not None else 0
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(limit, self._check)

    def _check(self) -> None:
        left = self._patience.left()
        if left > 0:
            self._handle = self._loop.call_later(left, self._check)
        else:
            self.expired = True
            self._task.cancel()

    def cancel(self) -> None:
        self._handle.cancel()

    def timed_out(self) -> bool:
        """Whether the CancelledError being handled was this deadline's alone (then taken
        back). Not if another cancel came too (Python 3.11+: counted; 3.10 cannot tell, as
        with redis-py's own timeout there)."""
        if not self.expired:
            return False
        uncancel = getattr(self._task, "uncancel", None)
        return uncancel is None or uncancel() <= self._cancelling


class _PatientConnect:
    """A connection class's connect and reads, bounded by :class:`_Patience` (see
    AsyncPool)."""

    socket_connect_timeout: float | None
    socket_timeout: float | None

    async def read_response(
        self, disable_decoding: bool = False, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        limit = self.socket_timeout
        if timeout is not None or not limit or asyncio.current_task() is None:
            # The caller's own bound (pub/sub), or none: as redis-py does.
            return await super().read_response(  # type: ignore[misc]
                disable_decoding, timeout, **kwargs
            )
        # redis-py's bound on the read fired before the loop ran the reply's wake-up when
        # both were due as the loop resumed from running another task: a reply in the
        # socket for long was reported as a timeout. The loop's busyness is not the
        # server's: the bound gets as long again, as a connect's does.
        patience = _Patience(limit)
        deadline = _ReadDeadline(patience, limit)
        self.socket_timeout = None  # bounded here instead
        try:
            return await super().read_response(disable_decoding, **kwargs)  # type: ignore[misc]
        except asyncio.CancelledError:
            if not deadline.timed_out():
                raise
            # As redis-py's own (the read, cancelled, dropped the connection).
            host = self._host_error()  # type: ignore[attr-defined]
            raise RedisTimeoutError(f"Timeout reading from {host}") from None
        finally:
            deadline.cancel()
            self.socket_timeout = limit
            patience.end()

    async def _connect(self) -> None:
        limit = self.socket_connect_timeout
        if not limit:
            await super()._connect()  # type: ignore[misc]
            return
        patience = _Patience(limit)
        self.socket_connect_timeout = None  # bounded here instead
        connect = asyncio.ensure_future(super()._connect())  # type: ignore[misc]
        try:
            while not connect.done():
                left = patience.left()
                if left <= 0:
                    raise asyncio.TimeoutError  # redis-py: "Timeout connecting to server"
                await asyncio.wait({connect}, timeout=left)
            connect.result()
        except BaseException:
            connect.cancel()  # (before its next step: nothing of it is kept)
            raise
        finally:
            self.socket_connect_timeout = limit
            patience.end()


_patient_classes: dict[type, type] = {}


def _patient(connection_class: type) -> type:
    patient = _patient_classes.get(connection_class)
    if patient is None:
        name = f"Patient{connection_class.__name__}"
        patient = _patient_classes[connection_class] = type(
            name, (_PatientConnect, connection_class), {}
        )
    return patient


class AsyncPool(redis.asyncio.BlockingConnectionPool):
    """redis.asyncio's blocking pool, its check of a pooled connection made on the socket as
    the sync fast path's (``fast_path._stale``): see :func:`.wire.closed_while_idle`.

    Its waits count the time its event loop spent running other tasks as the sync path's
    connects count a stalled process: a connect (``socket_connect_timeout``), a wait for
    a pooled connection (``timeout``), and a wait for a reply (``socket_timeout``), found
    past its deadline gets as long again as the loop was busy meanwhile (LOOP_GRACE_MAX at
    most). And a wait for a pooled connection
    lasts while connections are given back open: its timeout counts from the last one (a
    burst beyond ``max_connections`` is served in turn; one given back closed, its command
    failed, is no progress: a server that keeps them all, paused, fails it within the
    timeout). redis-py's count the loop's clock: a burst
    of hundreds of tasks on a fresh loop (a Redlock's 0.1 s node timeout, three connects per
    acquire) spent it running the other tasks, and a healthy server was reported
    unavailable ("Timeout connecting to server"). A server that does not connect, beside a
    loop that is not busy, still fails within its timeout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection_class = _patient(self.connection_class)
        self._given_back = 0.0  # when a connection was last given back (monotonic)

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        free = getattr(self, "can_get_connection", None)
        if not self.timeout or (free is not None and free()):
            # None to wait for (the common case): no heartbeat started.
            return await super().get_connection(*args, **kwargs)
        patience = _Patience(self.timeout)
        try:
            while True:
                try:
                    return await super().get_connection(*args, **kwargs)
                except RedisConnectionError as exc:
                    # None free within the timeout: again while connections come back (a
                    # burst is served, however long its queue), or the loop's grace lasts.
                    left = patience.left(since=self._given_back)
                    if "No connection available" not in str(exc) or left <= 0:
                        raise
        finally:
            patience.end()

    async def release(self, connection: Any) -> None:
        if connection.is_connected:
            # Answered (a busy pool's progress): the waits go on. One given back closed (its
            # command timed out on a silent server) is none: counted, it restarted every
            # waiter's timeout, one socket timeout more per max_connections of a burst.
            self._given_back = time.monotonic()
        await super().release(connection)

    async def ensure_connection(self, connection: Any) -> None:
        if wire.closed_while_idle(connection):
            # Checked out: ours, nothing sent on it yet. Not waiting for the close (a TLS
            # one to a server gone would wait for its reply a connect timeout).
            await connection.disconnect(nowait=True)
        await super().ensure_connection(connection)


AsyncEntry = tuple[Any, AsyncGenerator[None, None]]  # a loop's client, and its closer


class PerLoop:
    """Each event loop's async client (:func:`_closing_with_loop`), kept by the loop itself.

    Not by the backend: the client references its loop (its connections' transports), so a
    backend's map kept a loop closed without ``shutdown_asyncgens()``, its connections and any
    task waiting on them, until another loop's first client. That task was never collected:
    its clean-up never ran (a grant or a hold held by nobody, renewed for good inside ``async
    with``; review asy4 2-4). Kept by the loop, they are garbage together. Changed under the
    backend's ``_setup``."""

    _attribute = "django_redlock_clients"

    def __init__(self) -> None:
        self._loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
        # A loop that takes no attributes (uvloop's): kept here, as every loop's was before.
        self._kept: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncEntry] = (
            weakref.WeakKeyDictionary()
        )

    def _of(
        self, loop: asyncio.AbstractEventLoop
    ) -> weakref.WeakKeyDictionary[PerLoop, AsyncEntry]:
        return getattr(loop, self._attribute, None) or weakref.WeakKeyDictionary()

    def get(self, loop: asyncio.AbstractEventLoop) -> AsyncEntry | None:
        mine = getattr(loop, self._attribute, None)
        return self._kept.get(loop) if mine is None else mine.get(self)

    def __setitem__(self, loop: asyncio.AbstractEventLoop, entry: AsyncEntry) -> None:
        for old in [old for old in self._loops if old.is_closed()]:
            self._of(old).pop(self, None)  # closed without shutdown_asyncgens(): let go
            self._loops.discard(old)
        for old in [old for old in self._kept if old.is_closed()]:
            del self._kept[old]
        mine = getattr(loop, self._attribute, None)
        if mine is None:
            mine = weakref.WeakKeyDictionary()
            try:
                setattr(loop, self._attribute, mine)
            except AttributeError:
                self._kept[loop] = entry
                return
        mine[self] = entry
        self._loops.add(loop)

    def items(self) -> list[tuple[asyncio.AbstractEventLoop, AsyncEntry]]:
        found = [(loop, self._of(loop).get(self)) for loop in list(self._loops)]
        return [(loop, entry) for loop, entry in found if entry is not None] + list(
            self._kept.items()
        )

    def values(self) -> list[AsyncEntry]:
        return [entry for _, entry in self.items()]

    def __bool__(self) -> bool:
        return bool(self.items())


def _closing_with_loop(client: Any) -> AsyncEntry:
    """``client`` and an async generator that closes it when its loop shuts down.

    The generator is started here, so the running loop tracks it (asyncgen hooks);
    ``asyncio.run`` and asgiref close every tracked generator before closing the loop
    (``shutdown_asyncgens``), which runs its ``finally``: the connections close on their loop.
    """

    async def closer() -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            await client.aclose(close_connection_pool=True)
            # A Sentinel client's sentinels' clients (one per sentinel, a pool each: the
            # loop's questions where the master is) too: they stayed connected until the
            # garbage collector got to their cycles, one connection per closed loop.
            manager = getattr(client.connection_pool, "sentinel_manager", None)
            for sentinel in getattr(manager, "sentinels", ()):
                with contextlib.suppress(Exception):
                    await sentinel.aclose(close_connection_pool=True)

    generator = closer()
    step = generator.__anext__()
    with contextlib.suppress(StopIteration):
        step.send(None)  # runs up to the yield: nothing in it awaits
    return client, generator


_retiring: set[asyncio.Task[None]] = set()  # (a loop keeps only weak references to tasks)


def _disconnect_renewals(client: Any) -> None:
    """The renewals' own client of a closed backend (see ``RedisBackend.renew_many``): its
    thread connections and its pool's, closed now."""
    pool = client.connection_pool
    fast_path.disconnect_threads(pool)
    pool.disconnect()


def _retire(loop: asyncio.AbstractEventLoop, entry: AsyncEntry, after: float) -> None:
    """Close a closed backend's async client on its loop without cutting a command in
    flight: its idle connections now, the rest ``after`` the last command could have ended
    (dropped instead, its closer was finalised at once and closed the connections still in
    use: an arelease() in flight failed with "Connection closed", on a healthy server). A
    loop that ends first closes it at its shutdown, as any client of the loop."""
    client, closer = entry

    async def retire() -> None:
        try:
            pool = getattr(client, "connection_pool", None)
            if pool is not None:
                with contextlib.suppress(Exception):
                    await pool.disconnect(inuse_connections=False)
            await asyncio.sleep(after)
        finally:  # (cancelled by the loop's shutdown too: else collected, closed too late)
            await closer.aclose()  # its finally closes the client and its pool

    def start() -> None:
        task = loop.create_task(retire())
        _retiring.add(task)
        task.add_done_callback(_retiring.discard)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nothing of it in use
        loop.call_soon_threadsafe(start)


def lease_attempt(name: str, backend: BaseLockBackend, mode: str) -> Any:
    """permit_acquire.lua's reply: an Attempt, or a LockError for a refused try."""

    def parse(reply: Any) -> Attempt:
        code = int(reply[0])
        if code == -2:
            raise kind_clash(name, backend.alias, CLASH_KINDS[mode], reply[1])
        if code == -3:
            raise LockError(
                f"read-write lock {name!r} on backend {backend.alias!r}: this owner holds a"
                " read lock, and a read-to-write upgrade is refused (two readers upgrading"
                " would wait for each other forever): release the read lock first"
            )
        return _attempt(reply)

    return parse


def _leases(name: str, alias: str, value: Any, waiters: int, limit: Any) -> LockInfo | None:
    items = [text(v) for v in value]
    leases = [(items[i], int(items[i + 1]), items[i + 2]) for i in range(0, len(items), 3)]
    return lease_info(name, alias, leases, waiters, limit)


class TakenAll(NamedTuple):
    """acquire_all.lua's reply: every fence, or the first busy name's index and wait hint."""

    acquired: bool
    fences: tuple[int, ...] = ()
    busy: int = 0  # index into the names
    wait_ms: int = -1
    priors: tuple[str | None, ...] = ()  # each name's Attempt.prior


def taken_all(names: Sequence[str], alias: str) -> Any:
    """acquire_all.lua's reply: a TakenAll, or a LockError when a name is another kind's."""

    def parse(reply: Any) -> TakenAll:
        code = int(reply[0])
        if code == -2:
            raise kind_clash(names[int(reply[1]) - 1], alias, "plain lock", reply[2])
        if code:
            n = len(names)
            fences = tuple(int(f) for f in reply[1 : n + 1])
            priors = tuple(prior_of(reply[n + 1 + i : n + 2 + i]) for i in range(n))
            return TakenAll(True, fences, priors=priors)
        return TakenAll(False, (), int(reply[1]) - 1, int(reply[2]))

    return parse


def lock_attempt(name: str, alias: str, kind: Kind) -> Any:
    """acquire.lua's reply: an Attempt, or a LockError when another kind holds the name."""

    def parse(reply: Any) -> Attempt:
        if int(reply[0]) < 0:
            if int(reply[0]) == -3:
                raise stale_write(name, alias)
            if int(reply[0]) == -4:
                raise nest_gone(name, alias)
            raise kind_clash(name, alias, f"{kind.label} lock", reply[1])
        return _attempt(reply)

    return parse


def ordered_count(name: str, alias: str) -> Any:
    """release.lua's and settle.lua's count: an int, or a LockError for a late write."""

    def parse(reply: Any) -> int:
        count = int(reply)
        if count == -3:
            raise stale_write(name, alias)
        return count

    return parse


def _attempt(reply: Any) -> Attempt:
    if int(reply[0]):
        # tuple.__new__: a NamedTuple's own __new__ is Python code (every acquire parses one).
        return tuple.__new__(Attempt, (True, int(reply[1]), int(reply[2]), prior_of(reply[3:4])))
    return Attempt(False, None, int(reply[1]))


def prior_of(reply: Any) -> str | None:
    """The prior token of an acquire's reply (its last item, if any): None when '' or left out."""
    return str(text(reply[0])) or None if reply else None


def renewed(replies: list[Any]) -> list[bool | None]:
    """renew.lua's list of 0/1, or a pipeline's replies, one per lock."""
    if replies.count(1) == len(replies):  # the common case, in C: all extended (1 or True)
        return [True] * len(replies)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return [bool(reply) for reply in replies]


def _first_error(replies: list[Any]) -> BaseException | None:
    """A pipeline's first error reply (every one is the server's, as for one command)."""
    return next((r for r in replies if isinstance(r, ResponseError)), None)


def _none(reply: Any) -> None:
    return None


def _pttl(reply: Any) -> int | None:
    pttl = int(reply)
    return pttl if pttl >= 0 else None


def _value(kind: str, value: Any) -> str | dict[str, str] | None:
    if kind == "string":
        return str(text(value))
    if kind == "hash":
        items = [text(v) for v in value]
        return dict(zip(items[::2], items[1::2], strict=True))
    return None


def _count_of(reply: Any, token: str) -> int:
    value = _value(text(reply[0]), reply[2])
    if isinstance(value, str):
        return 1 if value.startswith(f"{token}|") else 0
    if isinstance(value, dict):
        count = value.get(token, "0")
        return int(count) if count.isdigit() else 0
    return 0
