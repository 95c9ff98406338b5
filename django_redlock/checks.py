"""System checks (``manage.py check``, and at the start of ``runserver``, ``migrate``, ...)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

from django.conf import settings
from django.core.checks import CheckMessage, Warning

#: A Redis database: ("tcp", host, port, db) or ("unix", path, "", db).
Endpoint = tuple[str, str, Any, int]

SHARED_DB = "django_redlock.W001"
UNKNOWN_SETTING = "django_redlock.W002"
MISSING_PERMISSION = "django_redlock.W003"
SHARED_NAMESPACE = "django_redlock.W004"

#: Every setting this app reads. Anything else named DJANGO_REDLOCK... is a misspelling that
#: Django would silently ignore.
KNOWN_SETTINGS = (
    "DJANGO_REDLOCK",
    "DJANGO_REDLOCK_BEAT",
    "DJANGO_REDLOCK_INCIDENTS",
    "DJANGO_REDLOCK_LOCK_GROUPS",
    "DJANGO_REDLOCK_METRICS",
    "DJANGO_REDLOCK_TRACE_NAMES",
    "DJANGO_REDLOCK_TRACING",
)


def check_unknown_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn about settings named like ours that this app does not read (``DJANGO_REDLOCKS``,
    ``DJANGO_REDLOCK_INCIDENT``, ...): Django ignores unknown settings without a word."""
    found: list[CheckMessage] = []
    for name in sorted(dir(settings)):
        if not name.startswith("DJANGO_REDLOCK") or name in KNOWN_SETTINGS:
            continue
        close = difflib.get_close_matches(name, KNOWN_SETTINGS, n=1, cutoff=0.6)
        found.append(
            Warning(
                f"The setting {name} is not one django-redlock reads, so it has no effect.",
                hint=(f"Did you mean {close[0]}? " if close else "")
                + f"django-redlock reads {', '.join(KNOWN_SETTINGS)}.",
                obj=name,
                id=UNKNOWN_SETTING,
            )
        )
    return found


def check_shared_cache_db(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn when lock keys live in the database of a django-redis cache: the cache's
    ``cache.clear()`` is a FLUSHDB, which frees every held lock at once and resets the
    fencing counters (so a fence can be handed out twice)."""
    from .backends.django_redis import DjangoRedisBackend
    from .backends.redis import RedisBackend
    from .backends.redlock import RedlockBackend
    from .backends.sentinel import SentinelBackend
    from .handler import backend_class, locks

    caches = _django_redis_caches()
    found: list[CheckMessage] = []
    for alias, config in locks.settings.items():
        cls = backend_class(alias, config)
        if issubclass(cls, DjangoRedisBackend):
            cache = str(config.get("CACHE", "default"))
            found.append(_warning(alias, cache, "locks on that cache's own connection"))
            continue
        if issubclass(cls, SentinelBackend) or not issubclass(cls, (RedisBackend, RedlockBackend)):
            continue  # Sentinel's LOCATION names sentinels, not the database
        location = config.get("LOCATION")
        urls = location if isinstance(location, (list, tuple)) else [location]
        ours = {endpoint for endpoint in map(_endpoint, urls) if endpoint is not None}
        for cache, theirs in caches.items():
            if ours & theirs:
                found.append(_warning(alias, cache, "has its LOCATION on the same database"))
    return found


def _warning(alias: str, cache: str, how: str) -> Warning:
    return Warning(
        f"DJANGO_REDLOCK[{alias!r}] keeps its locks in the Redis database of the django-redis"
        f" cache {cache!r} ({how}): that cache's clear() (FLUSHDB) frees every held lock at"
        " once, without their holders knowing until their next renewal, and resets the"
        " fencing counters, so a fencing token can be handed out twice.",
        hint="Give the locks a database of their own: a RedisBackend whose LOCATION names"
        " another db, e.g. 'redis://HOST:6379/1' while the cache uses /0. If that cache is"
        f" never cleared, silence this with SILENCED_SYSTEM_CHECKS = [{SHARED_DB!r}].",
        obj=f"DJANGO_REDLOCK[{alias!r}]",
        id=SHARED_DB,
    )


def _django_redis_caches() -> dict[str, set[Endpoint]]:
    """The databases of each django-redis cache (LOCATION: a URL, a comma-separated string
    of them, or a list: a primary and its replicas)."""
    found: dict[str, set[Endpoint]] = {}
    caches = getattr(settings, "CACHES", {})
    for alias, config in caches.items() if isinstance(caches, Mapping) else ():
        if not isinstance(config, Mapping):
            continue
        if not str(config.get("BACKEND", "")).startswith("django_redis."):
            continue
        location = config.get("LOCATION", "")
        urls: Iterable[Any] = (
            location if isinstance(location, (list, tuple)) else str(location).split(",")
        )
        options = config.get("OPTIONS")
        db = options.get("DB") if isinstance(options, Mapping) else None
        found[alias] = {e for e in (_endpoint(url, db) for url in urls) if e is not None}
    return found


def _endpoint(url: Any, db: Any = None) -> Endpoint | None:
    """Where a Redis URL points: scheme-neutral (redis:// and rediss:// alike), localhost
    as 127.0.0.1, the db from the path, ``?db=`` or ``db`` (django-redis's OPTIONS['DB'])."""
    if not isinstance(url, str) or not url.strip():
        return None
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    query = parse_qs(parts.query)
    number: Any = query.get("db", [None])[0]
    if parts.scheme == "unix":
        where: tuple[str, str, Any] = ("unix", parts.path, "")
    else:
        host = (parts.hostname or "").lower()
        where = ("tcp", "127.0.0.1" if host in ("localhost", "::1") else host, port or 6379)
        path = parts.path.strip("/")
        number = path if path else number
    if number is None:
        number = db if db is not None else 0
    try:
        return (*where, int(number))
    except (TypeError, ValueError):
        return None


def check_permissions(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn when a backend's Redis user lacks a permission the app needs (an ACL), as found
    when the app got ready (each server was asked once, without running anything; Redis 7+).
    No server is asked here: a check must not reach out to whatever a setting names."""
    from .backends.redis import RedisBackend
    from .handler import locks

    found: list[CheckMessage] = []
    for backend in locks.all(initialized_only=True):
        for each in getattr(backend, "nodes", None) or [backend]:  # Redlock: every node
            missing = each.missing_permission if isinstance(each, RedisBackend) else None
            if missing is not None:
                found.append(
                    Warning(
                        f"{missing} Until then, every operation that needs it fails with"
                        " MissingPermission.",
                        obj=f"DJANGO_REDLOCK[{backend.alias!r}]",
                        id=MISSING_PERMISSION,
                    )
                )
    return found


def check_shared_namespace(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Warn when two aliases keep their locks under the same keys: a Redis database they
    share (a LOCATION of each, or a django-redis cache's) and the same KEY_PREFIX. A name
    taken through either is then one lock in Redis, but a fenced block records its fence in
    the row of its own alias: fenced transactions through the two are not ordered."""
    from .backends.base import DEFAULT_KEY_PREFIX
    from .backends.django_redis import DjangoRedisBackend
    from .backends.redis import RedisBackend
    from .backends.redlock import RedlockBackend
    from .backends.sentinel import SentinelBackend
    from .handler import backend_class, locks

    caches = _django_redis_caches()
    spaces: list[tuple[str, str, set[Endpoint]]] = []
    for alias, config in locks.settings.items():
        cls = backend_class(alias, config)
        if issubclass(cls, DjangoRedisBackend):
            where = caches.get(str(config.get("CACHE", "default")), set())
        elif issubclass(cls, (RedisBackend, RedlockBackend)) and not issubclass(
            cls,
            SentinelBackend,  # its LOCATION names sentinels, not the database
        ):
            location = config.get("LOCATION")
            urls = location if isinstance(location, (list, tuple)) else [location]
            where = {endpoint for endpoint in map(_endpoint, urls) if endpoint is not None}
        else:
            continue
        spaces.append((alias, str(config.get("KEY_PREFIX", DEFAULT_KEY_PREFIX)), where))
    found: list[CheckMessage] = []
    for index, (alias, prefix, where) in enumerate(spaces):
        for first, their_prefix, theirs in spaces[:index]:
            if prefix != their_prefix or not where & theirs:
                continue
            found.append(
                Warning(
                    f"DJANGO_REDLOCK[{first!r}] and DJANGO_REDLOCK[{alias!r}] keep their locks"
                    f" under the same keys (the same Redis database, KEY_PREFIX {prefix!r}): a"
                    " lock name taken through either is one lock, but fenced blocks (atomic=)"
                    " record its fence in a database row per alias, so fenced transactions"
                    " through the two aliases are not ordered against each other (a stale"
                    " holder through one can commit after a newer holder through the other).",
                    hint=f"Give DJANGO_REDLOCK[{alias!r}] a KEY_PREFIX (or a Redis database) of"
                    " its own, or use one alias for both. If no lock is taken through both,"
                    f" silence this with SILENCED_SYSTEM_CHECKS = [{SHARED_NAMESPACE!r}].",
                    obj=f"DJANGO_REDLOCK[{alias!r}]",
                    id=SHARED_NAMESPACE,
                )
            )
    return found
