"""Locks on the connection of a ``django-redis`` cache (``"CACHE": "<alias>"``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio
from django.core.exceptions import ImproperlyConfigured
from redis.backoff import NoBackoff

from .redis import RedisBackend

# What an asyncio connection can take over from the cache's synchronous pool.
SHARED_KWARGS = {
    "host", "port", "path", "db", "username", "password", "client_name",
    "socket_timeout", "socket_connect_timeout", "credential_provider",
}  # fmt: skip


class DjangoRedisBackend(RedisBackend):
    """Shares the pool (and so the timeouts) of a django-redis cache."""

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

        return get_redis_connection(self.params.get("CACHE", "default"))

    def make_async_client(self) -> Any:
        # django-redis has no asyncio client: connect to the same server the same way.
        pool = self.client.connection_pool
        kwargs = {k: v for k, v in pool.connection_kwargs.items() if k in SHARED_KWARGS}
        kwargs.update((k, v) for k, v in pool.connection_kwargs.items() if k.startswith("ssl"))
        if issubclass(pool.connection_class, redis.UnixDomainSocketConnection):
            connection_class: type = redis.asyncio.UnixDomainSocketConnection
        elif issubclass(pool.connection_class, redis.SSLConnection):
            connection_class = redis.asyncio.SSLConnection
        else:
            connection_class = redis.asyncio.Connection
        async_pool = redis.asyncio.BlockingConnectionPool(
            connection_class=connection_class,
            retry=redis.asyncio.retry.Retry(NoBackoff(), 0),
            max_connections=pool.max_connections,
            timeout=kwargs.get("socket_timeout") or 20,
            **kwargs,
        )
        return redis.asyncio.Redis(connection_pool=async_pool)

    def close(self) -> None:
        self._client = None  # the pool is the cache's, not ours to close
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
