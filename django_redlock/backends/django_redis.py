"""Locks on the connection of a ``django-redis`` cache (``"CACHE": "<alias>"``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from .redis import RedisBackend


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

    def close(self) -> None:
        # The pool is the cache's; only our pub/sub hub is ours to close.
        if self._hub is not None:
            self._hub.close()
            self._hub = None
        self._client = None
