"""Locks on the connection of a ``django-redis`` cache (``"CACHE": "<alias>"``)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio
from django.core.exceptions import ImproperlyConfigured
from redis.backoff import NoBackoff

from .. import fast_path, wire
from .redis import AsyncPool, RedisBackend

# What an asyncio connection can take over from the cache's synchronous pool.
SHARED_KWARGS = {
    "host", "port", "path", "db", "username", "password", "client_name",
    "socket_timeout", "socket_connect_timeout", "credential_provider",
}  # fmt: skip
# ... and what a pool of the locks' own takes over (not the cache pool's own wiring).
OWN_POOL_KWARGS = SHARED_KWARGS | {
    "parser_class", "protocol", "socket_keepalive", "socket_keepalive_options",
}  # fmt: skip


class DjangoRedisBackend(RedisBackend):
    """Shares the pool (and so the timeouts) of a django-redis cache.

    Unless its connections have no socket timeout (django-redis sets one only when told, and
    redis-py before 8 has none): a lock operation must never wait forever, so the locks then
    have a pool of their own, to the same server the same way, with the default timeouts.
    """

    _owns_pool = False

    needs_location = False

    @classmethod
    def check_params(cls, alias: str, params: Mapping[str, Any]) -> None:
        super().check_params(alias, params)
        from django.conf import settings

        cache = params.get("CACHE", "default")
        caches = getattr(settings, "CACHES", {})
        if cache not in caches:
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['CACHE'] names {cache!r}, which is not in CACHES"
            )
        backend = caches[cache].get("BACKEND", "")
        if not backend.startswith("django_redis."):
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['CACHE'] names {cache!r}, whose BACKEND {backend!r}"
                " is not a django-redis cache"
            )

    def make_client(self) -> Any:
        from django_redis import get_redis_connection

        cache = self.params.get("CACHE", "default")
        client = get_redis_connection(cache)
        pool = client.connection_pool
        if socket_timeout_of(pool) is not None:
            return client
        if type(pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool):
            # A Sentinel pool, or a project's own: not one to rebuild from its kwargs.
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{self.alias!r}] locks on CACHES[{cache!r}], whose connections"
                " have no socket timeout: a lock operation would wait forever for a Redis that"
                f" stopped answering. Set SOCKET_TIMEOUT in CACHES[{cache!r}]['OPTIONS']"
            )
        options = self.client_options(redis.retry.Retry(NoBackoff(), 0))
        for key, value in pool.connection_kwargs.items():
            if (key in OWN_POOL_KWARGS or key.startswith("ssl")) and value is not None:
                options[key] = value
        options["timeout"] = options["socket_timeout"]
        # As RedisBackend's: what an interrupted checkout or give-back held is found again.
        own = wire.WaitingPool(connection_class=pool.connection_class, **options)
        self._owns_pool = True
        return redis.Redis(connection_pool=own)

    @property
    def socket_timeout(self) -> float:
        return float(socket_timeout_of(self.client.connection_pool) or 2.0)

    def make_async_client(self) -> Any:
        # django-redis has no asyncio client: connect to the same server the same way.
        pool = self.client.connection_pool
        kwargs = {k: v for k, v in pool.connection_kwargs.items() if k in SHARED_KWARGS}
        kwargs.update((k, v) for k, v in pool.connection_kwargs.items() if k.startswith("ssl"))
        kwargs["socket_timeout"] = self.socket_timeout  # the sync connections' own
        if issubclass(pool.connection_class, redis.UnixDomainSocketConnection):
            connection_class: type = redis.asyncio.UnixDomainSocketConnection
        elif issubclass(pool.connection_class, redis.SSLConnection):
            connection_class = redis.asyncio.SSLConnection
        else:
            connection_class = redis.asyncio.Connection
        async_pool = AsyncPool(  # (a closed idle connection is checked for)
            connection_class=connection_class,
            retry=redis.asyncio.retry.Retry(NoBackoff(), 0),
            max_connections=pool.max_connections,
            timeout=kwargs["socket_timeout"],
            **kwargs,
        )
        return redis.asyncio.Redis(connection_pool=async_pool)

    def close(self) -> None:
        if not self._owns_pool:
            if self._client is not None:  # the threads' lock connections are ours
                fast_path.disconnect_threads(self._client.connection_pool, pool_lives_on=True)
            self._client = None  # the pool is the cache's, not ours to close
        self._owns_pool = False
        super().close()

    @classmethod
    def check_options(cls, alias: str, params: Mapping[str, Any]) -> None:
        # The cache's pool is used as it is: OPTIONS here would be silently ignored.
        if params.get("OPTIONS"):
            key = next(iter(params["OPTIONS"]))
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS'][{key!r}] is ignored by"
                " DjangoRedisBackend, which locks on the connection pool of"
                f" CACHES[{params.get('CACHE', 'default')!r}]: set connection options in that"
                " cache's OPTIONS, or use a RedisBackend with a LOCATION"
            )


def socket_timeout_of(pool: Any) -> float | None:
    """The socket timeout of a pool's connections: the one it was given, else their class's
    default (none before redis-py 8, 5 s since)."""
    kwargs = pool.connection_kwargs
    if "socket_timeout" in kwargs:
        return kwargs["socket_timeout"]
    for klass in pool.connection_class.__mro__:
        init = vars(klass).get("__init__")
        param = inspect.signature(init).parameters.get("socket_timeout") if init else None
        if param is not None and param.default is not inspect.Parameter.empty:
            return param.default
    return None
