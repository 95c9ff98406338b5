"""Which ``OPTIONS`` keys a backend can pass on to redis-py, read from redis-py's own signatures.

A key redis-py does not take fails deep inside it (a ``TypeError`` when the first connection
is made, which is when the app loads its scripts: every ``manage.py`` command, ``migrate``
included) or, on a cluster, is silently dropped. So unknown keys are refused at startup,
naming the alias and the key, with a hint when the key looks like a django-redis cache option.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Collection, Iterable, Mapping
from functools import cache
from typing import Any

import redis
import redis.cluster
import redis.connection
import redis.sentinel
from django.core.exceptions import ImproperlyConfigured

#: Keys of a django-redis cache's OPTIONS (``CACHES[...]['OPTIONS']``), which people copy over.
DJANGO_REDIS_KEYS = {
    "CLIENT_CLASS", "CLIENT_KWARGS", "CONNECTION_POOL_CLASS", "CONNECTION_POOL_KWARGS",
    "CONNECTION_POOL_CLASS_KWARGS", "CONNECTION_FACTORY", "REDIS_CLIENT_CLASS",
    "REDIS_CLIENT_KWARGS", "SERIALIZER", "COMPRESSOR", "PARSER_CLASS", "PASSWORD",
    "USERNAME", "DB", "SOCKET_TIMEOUT", "SOCKET_CONNECT_TIMEOUT", "IGNORE_EXCEPTIONS",
    "LOG_IGNORED_EXCEPTIONS", "CLOSE_CONNECTION", "SENTINELS", "SENTINEL_KWARGS",
    "MAX_ENTRIES", "CULL_FREQUENCY",
}  # fmt: skip
#: Options whose value this app reads itself (timeouts, the pool's size).
SECONDS = ("socket_timeout", "socket_connect_timeout")


def parameters(*functions: Callable[..., Any]) -> set[str]:
    """The keyword parameters of ``functions`` (not self, *args or **kwargs)."""
    names: set[str] = set()
    for function in functions:
        for name, parameter in inspect.signature(function).parameters.items():
            if name != "self" and parameter.kind not in (
                inspect.Parameter.VAR_POSITIONAL,
                inspect.Parameter.VAR_KEYWORD,
            ):
                names.add(name)
    return names


@cache
def connection_options(scheme: str) -> frozenset[str]:
    """What a connection of redis-py takes for a URL scheme: ``from_url`` picks the class
    (``rediss://``: SSLConnection, ``unix://``: UnixDomainSocketConnection)."""
    conn = redis.connection
    classes: list[Callable[..., Any]] = [conn.AbstractConnection.__init__]
    if scheme == "unix":
        classes.append(conn.UnixDomainSocketConnection.__init__)
    else:
        classes.append(conn.Connection.__init__)
        if scheme == "rediss":
            classes.append(conn.SSLConnection.__init__)
    return frozenset(parameters(*classes))


@cache
def pool_options(scheme: str) -> frozenset[str]:
    """What ``redis.BlockingConnectionPool.from_url(url, **OPTIONS)`` (RedisBackend, each
    Redlock node) passes on without a TypeError: the pool's arguments and the connection's."""
    pools = parameters(redis.ConnectionPool.__init__, redis.BlockingConnectionPool.__init__) - {
        "connection_kwargs"
    }
    return frozenset(pools | connection_options(scheme))


@cache
def sentinel_options(ssl: bool) -> frozenset[str]:
    """What ``Sentinel.master_for(service, **OPTIONS)`` takes: its own arguments, the
    SentinelConnectionPool's (a plain ConnectionPool: no ``timeout``) and the connection's
    (with ``ssl=True``, an SSL connection's)."""
    own = parameters(redis.sentinel.Sentinel.master_for) - {"service_name"}
    pool = parameters(redis.ConnectionPool.__init__) - {"connection_kwargs"}
    pool |= {"ssl", "is_master", "check_connection"}  # popped by SentinelConnectionPool
    return frozenset(own | pool | connection_options("rediss" if ssl else "redis"))


@cache
def cluster_options() -> frozenset[str]:
    """What ``RedisCluster.from_url(url, **OPTIONS)`` uses (it silently drops the rest)."""
    cluster = redis.cluster
    allowed = set(cluster.REDIS_ALLOWED_KEYS) - set(cluster.KWARGS_DISABLED_KEYS)
    return frozenset(parameters(cluster.RedisCluster.__init__) | allowed)


def check_options(
    alias: str, options: Mapping[Any, Any], allowed: Collection[str], where: str = ""
) -> None:
    """ImproperlyConfigured naming the alias and the first key redis-py would not take."""
    for key in options:
        if not isinstance(key, str):
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS'] has the key {key!r}: keys are str"
            )
        if key not in allowed:
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS'][{key!r}] is not an option of"
                f" {where or 'this backend'}{_hint(key, allowed)}"
            )
    for key in SECONDS:
        value = options.get(key)
        if value is not None and not _positive(value):
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS'][{key!r}] must be a number of seconds"
                f" > 0, not {value!r}"
            )
    db = options.get("db")
    if db is not None and (isinstance(db, bool) or not isinstance(db, int) or db < 0):
        raise ImproperlyConfigured(
            f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['db'] must be a Redis database number (an"
            f" int >= 0), not {db!r}"
        )
    size = options.get("max_connections")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ImproperlyConfigured(
            f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['max_connections'] must be an int >= 1,"
            f" not {size!r}"
        )


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < 1e9


def _hint(key: str, allowed: Iterable[str]) -> str:
    allowed = sorted(allowed)
    if key == "ssl" or key.startswith("ssl_"):
        return ": TLS is chosen by the URL: use a rediss:// LOCATION for it and its ssl_ options"
    if key == "unix_socket_path":
        return ": a Unix socket is chosen by the URL: use a unix:///path/to/redis.sock LOCATION"
    if key.lower() in allowed and key != key.lower():
        return (
            f": did you mean {key.lower()!r}? DJANGO_REDLOCK OPTIONS are redis-py keyword"
            " arguments (lowercase), not a django-redis cache's OPTIONS"
        )
    if key in DJANGO_REDIS_KEYS or key.isupper():
        extra = (
            " (put the pool's keyword arguments, such as 'max_connections', directly in OPTIONS)"
            if key.startswith("CONNECTION_POOL")
            else ""
        )
        return (
            f": it looks like a django-redis cache option. DJANGO_REDLOCK OPTIONS are redis-py"
            f" keyword arguments, such as 'socket_timeout' or 'max_connections'{extra}; or use"
            " DjangoRedisBackend with 'CACHE' to lock on the cache's own connection"
        )
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        return f": did you mean {close[0]!r}?"
    return " (see the keyword arguments of redis.Redis and redis.connection.Connection)"
