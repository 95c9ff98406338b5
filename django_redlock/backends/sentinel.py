"""Redis Sentinel: the master is found through the sentinels, and found again after a failover.

LOCATION: the sentinels' URLs. OPTIONS: ``service_name`` (required), ``min_replicas`` and
``min_replicas_timeout`` (seconds), ``sentinel_kwargs``, plus connection options.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from django.core.exceptions import ImproperlyConfigured
from redis.backoff import NoBackoff

from .. import acl, fast_path, wire
from ..exceptions import BackendUnavailable, QuorumNotReached, quorum_failure
from ..options import check_options, sentinel_options
from .base import Attempt, Kind, Op, moved
from .redis import RedisBackend, TakenAll

T = TypeVar("T")
logger = logging.getLogger("django_redlock")
MASTER_CHECK = 1.0  # seconds between looks at where the sentinels say the master is
# ... after a look that found no master: as often, for redis-py says "no master" also when
# the sentinels answered that it is down (every unplanned failover, until the promotion), and
# a look 5 s later left takes on the old master for seconds after the switch.
MASTER_CHECK_FAILED = 1.0
LOOKER_IDLE = 60.0  # the looker ends after this long without an operation
OWN_OPTIONS = ("service_name", "min_replicas", "min_replicas_timeout", "sentinel_kwargs")


class _Replicated(NamedTuple):
    attempt: Attempt | TakenAll  # the take's own reply: whether it took is .acquired
    replicas: int
    release: Op[Any]


def _sentinel_url_kwargs(url: str) -> dict[str, Any]:
    """How to reach the sentinels, from the first one's URL: their own user and password
    (``redis://user:password@host:26379``) and TLS (``rediss://...?ssl_ca_certs=...``).
    ``sentinel_kwargs`` overrides any of it; the master's are in OPTIONS."""
    kwargs = redis.connection.parse_url(url)
    for key in ("host", "port", "db", "path"):
        kwargs.pop(key, None)
    if issubclass(kwargs.pop("connection_class", redis.Connection), redis.SSLConnection):
        kwargs["ssl"] = True
    return kwargs


class SentinelBackend(RedisBackend):
    """Locks on the master of a Sentinel-monitored service.

    With ``min_replicas``, an acquire also waits (``WAIT``, in the same round trip) until that
    many replicas have the lock, and fails, releasing it, if they do not in time. That narrows
    the failover gap without closing it: a failover may still promote a replica that had not
    acknowledged yet, or one that acknowledged and then restarted empty (fence what matters).
    """

    location_is_list = True
    acl_commands = {**acl.COMMANDS, **acl.SENTINEL_COMMANDS}

    @classmethod
    def check_params(cls, alias: str, params: Mapping[str, Any]) -> None:
        super().check_params(alias, params)
        options = params.get("OPTIONS") or {}
        if not isinstance(options.get("service_name"), str) or not options["service_name"]:
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['service_name'] must name the service"
            )
        replicas = options.get("min_replicas", 0)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['min_replicas'] must be an int >= 0"
            )

    def __init__(self, alias: str, params: Any) -> None:
        super().__init__(alias, params)
        own = {key: self.options.pop(key) for key in OWN_OPTIONS if key in self.options}
        # Sentinel pools refuse a caller past max_connections instead of making it wait, as
        # the other backends' blocking pools do: these gates make it wait.
        self._limit = int(self.options.pop("max_connections", 100))
        self._gate = threading.BoundedSemaphore(self._limit)
        self._agates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self.service_name: str = own["service_name"]
        self.min_replicas = int(own.get("min_replicas", 0))
        self.min_replicas_timeout = float(own.get("min_replicas_timeout", 0.5))
        self.sentinel_kwargs = dict(own.get("sentinel_kwargs") or {})
        self._master: tuple[str, int] | None = None  # where the last look found the master
        self._looker: threading.Thread | None = None  # see _look_for_master
        self._looking = threading.Lock()
        self._used = 0.0  # when an operation last ran (monotonic)
        self._looker_ran = False
        self._first_look: threading.Event | None = None  # set by a restarted looker's 1st look
        if self.min_replicas and self.min_replicas_timeout >= self.socket_timeout:
            # WAIT's reply comes after min_replicas_timeout: a socket that gives up first
            # turns every slow replica into "unavailable" instead of QuorumNotReached.
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['min_replicas_timeout']"
                f" ({self.min_replicas_timeout:g} s) must be shorter than socket_timeout"
                f" ({self.socket_timeout:g} s): the socket would give up before WAIT answers"
            )

    def _sentinels(self) -> list[tuple[str, int]]:
        return [(urlsplit(u).hostname or "", urlsplit(u).port or 26379) for u in self.location]  # type: ignore[union-attr]

    def _options(self, retry: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        options = {**self.default_options, **self.options}
        options.setdefault("retry", retry)
        sentinel_kwargs = {
            "socket_timeout": options["socket_timeout"],
            "socket_connect_timeout": options["socket_connect_timeout"],
            **_sentinel_url_kwargs(self.location[0]),  # type: ignore[index]
            **self.sentinel_kwargs,
        }
        return options, sentinel_kwargs

    def make_client(self) -> Any:
        options, sentinel_kwargs = self._options(redis.retry.Retry(NoBackoff(), 0))
        sentinel = redis.sentinel.Sentinel(self._sentinels(), sentinel_kwargs=sentinel_kwargs)
        return sentinel.master_for(self.service_name, **options)

    def make_async_client(self) -> Any:
        options, sentinel_kwargs = self._options(redis.asyncio.retry.Retry(NoBackoff(), 0))
        sentinel = redis.asyncio.sentinel.Sentinel(
            self._sentinels(), sentinel_kwargs=sentinel_kwargs
        )
        client = sentinel.master_for(
            self.service_name, connection_pool_class=wire.AsyncSentinelPool, **options
        )
        if self._master is not None:  # a loop that starts after a failover: there at once
            wire.moved_async_pool(client, self._master)
        return client

    @property
    def socket_timeout(self) -> float:
        return float({**self.default_options, **self.options}["socket_timeout"])

    def op_acquire(
        self,
        name: str,
        token: str,
        ttl_ms: int,
        meta: str,
        kind: Kind,
        waiter: str | None = None,
        wait_ms: int = -1,
    ) -> Op[Attempt]:
        op = super().op_acquire(name, token, ttl_ms, meta, kind, waiter, wait_ms)
        if not self.min_replicas:
            return op
        wait = ("WAIT", self.min_replicas, round(self.min_replicas_timeout * 1000))
        release = self.op_release(name, token, kind)

        def parse(replies: list[Any]) -> Any:
            return _Replicated(op.parse(replies[0]), int(replies[1]), release)

        return Op(name, [op.request, wait], parse)

    def op_acquire_all(
        self, names: Sequence[str], token: str, ttl_ms: int, meta: str, waiter: str = ""
    ) -> Op[TakenAll]:
        # As op_acquire: a set is confirmed by min_replicas, or every name is handed back.
        op = super().op_acquire_all(names, token, ttl_ms, meta, waiter)
        if not self.min_replicas:
            return op
        wait = ("WAIT", self.min_replicas, round(self.min_replicas_timeout * 1000))
        release = self.op_release_all(names, token)

        def parse(replies: list[Any]) -> Any:
            return _Replicated(op.parse(replies[0]), int(replies[1]), release)

        return Op(op.name, [op.request, wait], parse)

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
        # As op_acquire: a permit, read or write is confirmed by min_replicas, or handed back.
        op = super().op_lease_acquire(
            name, token, ttl_ms, meta, mode, limit, fair, waiter, wait_ms, reader
        )
        if not self.min_replicas:
            return op
        wait = ("WAIT", self.min_replicas, round(self.min_replicas_timeout * 1000))
        release = self.op_lease_release(name, token, mode)

        def parse(replies: list[Any]) -> Any:
            return _Replicated(op.parse(replies[0]), int(replies[1]), release)

        return Op(name, [op.request, wait], parse)

    def _look_for_master(self) -> threading.Event | None:
        """Keep the looker running while the backend is used (every operation, a renewal
        included, calls this): a thread of the backend's that asks the sentinels where the
        master is once a second, and moves each thread's connection to another address there
        before its next command. A connection outlives a failover: after a planned one
        (SENTINEL FAILOVER) the old master takes writes until it is demoted, seconds later,
        so renewals kept its copy of a hold alive while the promoted master's ran out, and
        another client took the name there (two holders); owned() said True. In a thread of
        its own: slow or paused sentinels never delay an operation, except the ones that
        meet a looker restarted after LOOKER_IDLE: they wait for its first look (up to the
        socket timeout), as their connections may point at a master demoted meanwhile.
        Returns that first look's event while it is pending, else None."""
        self._used = time.monotonic()
        looker = self._looker
        if (looker is None or not looker.is_alive()) and self._looking.acquire(False):
            try:  # (not waited for: a thread that is starting it is enough)
                looker = self._looker
                if looker is None or not looker.is_alive():
                    # A restart after an idle spell: the connections are as old as the last
                    # look, a failover may have happened since (the first start has fresh
                    # connections, made through the sentinels).
                    first = threading.Event() if self._looker_ran else None
                    self._looker_ran = True
                    looker = threading.Thread(
                        target=_look, args=(weakref.ref(self), first), daemon=True,
                        name=f"redlock-sentinel {self.alias}",
                    )  # fmt: skip
                    self._first_look = first
                    self._looker = looker
                    looker.start()
            finally:
                self._looking.release()
        return self._first_look

    def _stale(self, first: threading.Event | None) -> None:
        logger.warning(
            "redlock: %s: no look at the sentinels within %g s after an idle spell: the"
            " operation goes to the master found before it",
            self.describe(),
            self.socket_timeout,
        )
        if self._first_look is first:
            self._first_look = None  # said once; operations go on as before

    def _look_once(self, after_idle: bool = False) -> float:
        """Where is the master now? Connections elsewhere are moved (after an idle spell
        even if no look found one before). Returns the pause until the next look."""
        client = self._client
        if client is None:
            if not self._aclients:
                return MASTER_CHECK
            client = self.client  # asyncio's alone: the sentinels are asked through it
        pool = client.connection_pool
        try:
            master = wire.sentinel_master(pool)  # also closes its idle connections
        except Exception as exc:  # no sentinel answered: connections stay where they are
            logger.info("redlock: %s: where is the master? %s", self.describe(), exc)
            return MASTER_CHECK_FAILED
        if master != self._master:
            before, self._master = self._master, master
            if before is not None or after_idle:
                fast_path.moved_threads(pool, master)
                # Each event loop's pool too: asyncio's connections made before the switch
                # stayed on the old master (takes, releases, owned() answered there). Under
                # the lock a new loop's client is made under: it is listed, or sees _master.
                with self._setup:
                    aclients = [entry[0] for entry in self._aclients.values()]
                for aclient in aclients:
                    wire.moved_async_pool(aclient, master)
                moved(self)  # its holds renewed there now, not at their next period
        return MASTER_CHECK

    def close(self) -> None:
        self._looker = None  # it ends at its next look
        super().close()

    def execute(self, op: Op[T]) -> T:
        first = self._look_for_master()
        if first is not None and not first.wait(self.socket_timeout):
            self._stale(first)
        if fast_path.on_thread_connection(self.client):
            # Nothing checked out of the pool: no permit to wait for, nor to lose should an
            # interrupt land while one is taken or given back (it would be gone for good).
            return self._execute(op)
        if not self._gate.acquire(timeout=self.socket_timeout):
            raise BackendUnavailable(
                f"lock {op.name!r}: backend {self.alias!r}: all {self._limit} connections busy",
                timed_out=True,  # nothing sent: nothing to give back either
            )
        try:
            return self._execute(op)
        finally:
            self._gate.release()

    def _execute(self, op: Op[T]) -> T:
        result = super().execute(op)
        if isinstance(result, _Replicated):
            if self._enough(result):
                return result.attempt  # type: ignore[return-value]
            super().execute(result.release)
            raise self._too_few(op.name, result)
        return result

    async def aexecute(self, op: Op[T]) -> T:
        first = self._look_for_master()
        if first is not None:
            deadline = time.monotonic() + self.socket_timeout
            while not first.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # (a thread's event: polled, the loop runs on)
            if not first.is_set():
                self._stale(first)
        loop = asyncio.get_running_loop()
        gate = self._agates.get(loop)
        if gate is None:
            gate = self._agates[loop] = asyncio.Semaphore(self._limit)
        if gate.locked():  # as execute(): a permit waited for a socket timeout at most
            try:
                await asyncio.wait_for(gate.acquire(), self.socket_timeout)
            except TimeoutError:
                busy = f"all {self._limit} connections busy"
                raise BackendUnavailable(
                    f"lock {op.name!r}: backend {self.alias!r}: {busy}",
                    timed_out=True,  # nothing sent: nothing to give back either
                ) from None
        else:
            await gate.acquire()
        try:
            return await self._aexecute(op)
        finally:
            gate.release()

    async def _aexecute(self, op: Op[T]) -> T:
        result = await super().aexecute(op)
        if isinstance(result, _Replicated):
            if self._enough(result):
                return result.attempt  # type: ignore[return-value]
            await super().aexecute(result.release)
            raise self._too_few(op.name, result)
        return result

    def _enough(self, result: _Replicated) -> bool:
        return not result.attempt.acquired or result.replicas >= self.min_replicas

    def _too_few(self, name: str, result: _Replicated) -> QuorumNotReached:
        return quorum_failure(
            self.alias,
            name,
            QuorumNotReached(
                f"lock {name!r}: backend {self.alias!r}: only {result.replicas} of the"
                f" {self.min_replicas} replicas required confirmed the lock within"
                f" {self.min_replicas_timeout:g} s; it was released"
            ),
        )

    @classmethod
    def check_options(cls, alias: str, params: Mapping[str, Any]) -> None:
        options = params.get("OPTIONS") or {}
        allowed = sentinel_options(bool(options.get("ssl"))) | set(OWN_OPTIONS)
        where = f"the Sentinel backend ({', '.join(OWN_OPTIONS)}) or Sentinel.master_for"
        check_options(alias, options, allowed, where)
        if not isinstance(options.get("sentinel_kwargs") or {}, Mapping):
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['sentinel_kwargs'] must be a dict"
            )
        wait = options.get("min_replicas_timeout", 0.5)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait < 1e6:
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['min_replicas_timeout'] must be seconds"
                f" > 0, not {wait!r}"
            )


def _look(ref: weakref.ref[SentinelBackend], first: threading.Event | None = None) -> None:
    """The looker thread (see ``SentinelBackend._look_for_master``): ends when its backend is
    closed or collected, or after LOOKER_IDLE without an operation (the next one starts it)."""
    me = threading.current_thread()
    while True:
        backend = ref()
        if backend is None or backend._looker is not me:
            return
        if time.monotonic() - backend._used > LOOKER_IDLE:
            backend._looker = None
            return
        try:
            pause = backend._look_once(after_idle=first is not None)
        except Exception:  # a bug must not end the looks
            logger.exception("redlock: %s: looking for the master failed", backend.describe())
            pause = MASTER_CHECK_FAILED
        if first is not None:  # done, found or not (a failed look was logged)
            first.set()
            if backend._first_look is first:
                backend._first_look = None
            first = None
        del backend  # not kept alive by a sleeping looker
        time.sleep(pause)
