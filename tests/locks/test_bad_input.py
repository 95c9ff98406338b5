"""Bad input gets a clear TypeError/ValueError before any Redis call, even with Redis down."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_redlock import BackendUnavailable, lock, lock_all, lock_view, locks
from django_redlock.handler import LockHandler
from django_redlock.testing import free_port

from ..conftest import ROOT


@pytest.fixture(params=["down-redis", "local"])
def down(request: pytest.FixtureRequest) -> Iterator[str]:
    """A Redis alias whose server is not running, and locmem for the same checks."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    aliases = {
        **settings.DJANGO_REDLOCK,
        "down-redis": {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": url},
    }
    with override_settings(DJANGO_REDLOCK=aliases):
        yield str(request.param)


BAD_LOCKS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"name": ""}, ValueError, "empty"),
    ({"name": 42}, TypeError, "str"),
    ({"name": None}, TypeError, "str"),
    ({"name": b"bytes"}, TypeError, "str"),
    ({"name": "é" * 513}, ValueError, "1024 bytes"),
    ({"name": "bad\udc80surrogate"}, ValueError, "not valid text"),
    ({"name": "a\x00b"}, ValueError, "NUL character"),  # a fenced block's row cannot hold it
    ({"ttl": 30 * 24 * 3600 + 1}, ValueError, "at most 2592000"),
    ({"ttl": 1e15}, ValueError, "at most"),  # ms would overflow Redis: never reaches it
    ({"blocking": False, "timeout": 0.2}, ValueError, "blocking=False"),
    ({"ttl": 0}, ValueError, "ttl must be > 0"),
    ({"ttl": -1}, ValueError, "ttl must be > 0"),
    ({"ttl": math.nan}, ValueError, "finite"),
    ({"ttl": math.inf}, ValueError, "finite"),
    ({"ttl": "30"}, TypeError, "number"),
    ({"ttl": True}, TypeError, "number"),
    ({"timeout": -1}, ValueError, "timeout must be >= 0"),
    ({"timeout": math.nan}, ValueError, "finite"),
    ({"max_hold": 0}, ValueError, "max_hold"),
    ({"blocking": "yes"}, TypeError, "blocking"),
    ({"auto_renew": 1}, TypeError, "auto_renew"),
    ({"using": "nope"}, ValueError, "unknown lock backend 'nope'"),
    ({"using": None}, TypeError, "alias"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_LOCKS)
def test_bad_lock_arguments(
    down: str, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    arguments = {"name": "ok", "using": down, **kwargs}
    with pytest.raises(error, match=message):
        lock(arguments.pop("name"), **arguments)


def test_a_unknown_alias_is_also_improperly_configured() -> None:
    with pytest.raises(ImproperlyConfigured, match="nope"):
        locks["nope"]


BAD_CALLS: list[tuple[Callable[[Any], Any], type[Exception], str]] = [
    (lambda lk: lk.acquire(timeout=-0.5), ValueError, "timeout"),
    (lambda lk: lk.acquire(timeout=math.inf), ValueError, "finite"),
    (lambda lk: lk.acquire(blocking=None), TypeError, "blocking"),
    (lambda lk: lk.acquire(blocking=False, timeout=3), ValueError, "blocking=False"),
    (lambda lk: lk.extend(ttl=0), ValueError, "ttl"),
    (lambda lk: lk.extend(ttl="10"), TypeError, "ttl"),
    (lambda lk: lk.extend(ttl=1e15), ValueError, "at most"),
]


@pytest.mark.parametrize(("call", "error", "message"), BAD_CALLS)
def test_bad_call_arguments(
    down: str, call: Callable[[Any], Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        call(lock("ok", using=down))


def test_the_down_backend_really_is_down() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    aliases = {"d": {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": url}}
    with override_settings(DJANGO_REDLOCK=aliases), pytest.raises(BackendUnavailable):
        lock("ok", using="d").acquire()


def test_bad_templates(down: str) -> None:
    with pytest.raises(ValueError, match="argument names"):
        lock("report:{}", using=down)(lambda user_id: None)
    templated = lock("report:{user.pk}", using=down)(lambda user: None)
    with pytest.raises(ValueError, match="template"):
        templated(user=object())


REDIS = "django_redlock.backends.redis.RedisBackend"
REDLOCK = "django_redlock.backends.redlock.RedlockBackend"
BAD_SETTINGS: list[tuple[Any, str]] = [
    (
        {"default": {"BACKEND": "no.such.Backend"}},
        r"\['default'\]\['BACKEND'\].*could not be imported",
    ),
    (
        {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}},
        "not a lock backend",
    ),
    ({"default": {"LOCATION": "redis://x"}}, r"\['BACKEND'\] is missing"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "http://x:6379"}}, r"\['q'\]\['LOCATION'\].*scheme"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://:6379"}}, r"\['LOCATION'\].*no host"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h:99999"}}, r"\['LOCATION'\].*port"),
    ({"q": {"BACKEND": REDIS, "LOCATION": []}}, r"\['LOCATION'\].*URL string"),
    # A database part redis-py would read as 0 without a word, or fail on inside.
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h/3x"}}, r"\['q'\]\['LOCATION'\].*database"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h/abc"}}, r"\['LOCATION'\].*database"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h/1/2"}}, r"\['LOCATION'\].*database"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h/?db=abc"}}, r"\['LOCATION'\].*database"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "unix:///s?db=-1"}}, r"\['LOCATION'\].*database"),
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "OPTIONS": {"db": "abc"}}},
        r"\['q'\]\['OPTIONS'\]\['db'\] must be a Redis database number",
    ),
    (
        {"q": {"BACKEND": REDLOCK, "LOCATION": ["redis://a/0", "redis://b/x"]}},
        r"\['q'\]\['LOCATION'\].*'redis://b/x'.*database",
    ),
    ({"q": {"BACKEND": REDIS}}, r"\['LOCATION'\].*URL string"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "TTL": 0}}, r"\['q'\]\['TTL'\].*> 0"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "TTL": math.nan}}, r"\['TTL'\].*finite"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "TTL": "5"}}, r"\['TTL'\].*number"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "TTL": 1e15}}, r"\['TTL'\].*<= 2592000"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "KEY_PREFIX": 1}}, r"\['KEY_PREFIX'\]"),
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "KEY_PREFIX": ""}},
        r"\['q'\]\['KEY_PREFIX'\] must not be empty.*provably",
    ),
    (
        {"q": {"BACKEND": "django_redlock.backends.locmem.LocMemBackend", "KEY_PREFIX": " "}},
        r"\['q'\]\['KEY_PREFIX'\] must not be empty",
    ),
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "KEY_PREFIX": "app*"}},
        r"\['q'\]\['KEY_PREFIX'\] 'app\*' must not contain",
    ),
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "KEY_PREFIX": "a[bc]"}},
        r"\['KEY_PREFIX'\] 'a\[bc\]' must not contain",
    ),
    # Braces: alias 'app:{x''s lock 'y' would be alias 'app''s lock 'x:{y' (one key), listed and
    # purged through either; '}' would move the hash tag.
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "KEY_PREFIX": "app:{x"}},
        r"\['q'\]\['KEY_PREFIX'\] 'app:\{x' must not contain",
    ),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "KEY_PREFIX": "a}"}}, r"'a\}' must not"),
    ({"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "OPTIONS": []}}, r"\['OPTIONS'\]"),
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "TIMEOUT": 3}},
        r"\['q'\].*unknown key.*TIMEOUT",
    ),
    (
        {"q": {"BACKEND": "django_redlock.backends.django_redis.DjangoRedisBackend", "CACHE": "x"}},
        r"\['q'\]\['CACHE'\].*not in CACHES",
    ),
    ({"q": "redis://h"}, r"\['q'\] must be a dict"),
    # OPTIONS: what redis-py would refuse deep inside (a TypeError) or silently drop.
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "OPTIONS": {"CLIENT_CLASS": "x.Y"}}},
        r"\['q'\]\['OPTIONS'\]\['CLIENT_CLASS'\] is not an option.*django-redis",
    ),
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "OPTIONS": {"SOCKET_TIMEOUT": 2}}},
        r"\['OPTIONS'\]\['SOCKET_TIMEOUT'\].*did you mean 'socket_timeout'",
    ),
    (
        {
            "q": {
                "BACKEND": REDIS,
                "LOCATION": "redis://h",
                "OPTIONS": {"CONNECTION_POOL_KWARGS": {"max_connections": 5}},
            }
        },
        r"\['CONNECTION_POOL_KWARGS'\].*django-redis.*directly in OPTIONS",
    ),
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "OPTIONS": {"socket_timout": 2}}},
        r"\['q'\]\['OPTIONS'\]\['socket_timout'\].*did you mean 'socket_timeout'",
    ),
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "OPTIONS": {"ssl_ca_certs": "/ca"}}},
        r"\['ssl_ca_certs'\].*rediss://",
    ),
    (
        {
            "q": {
                "BACKEND": REDIS,
                "LOCATION": "unix:///tmp/r.sock",
                "OPTIONS": {"socket_keepalive": True},
            }
        },
        r"\['socket_keepalive'\] is not an option of redis-py's pool and unix://",
    ),
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "OPTIONS": {"socket_timeout": "2"}}},
        r"\['socket_timeout'\] must be a number of seconds",
    ),
    (
        {"q": {"BACKEND": REDIS, "LOCATION": "redis://h", "OPTIONS": {"max_connections": 0}}},
        r"\['max_connections'\] must be an int >= 1",
    ),
    (
        {
            "q": {
                "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
                "LOCATION": ["redis://a", "redis://b", "redis://c"],
                "OPTIONS": {"restart_guard": 5, "socket_timeot": 0.1},
            }
        },
        r"\['q'\]\['OPTIONS'\]\['socket_timeot'\].*did you mean 'socket_timeout'",
    ),
    (
        {
            "q": {
                "BACKEND": "django_redlock.backends.sentinel.SentinelBackend",
                "LOCATION": ["redis://s:26379"],
                "OPTIONS": {"service_name": "m", "timeout": 3},
            }
        },
        r"\['q'\]\['OPTIONS'\]\['timeout'\] is not an option of the Sentinel backend",
    ),
    (
        {
            "q": {
                "BACKEND": "django_redlock.backends.cluster.RedisClusterBackend",
                "LOCATION": "redis://c:7000",
                "OPTIONS": {"read_from_replica": True},
            }
        },
        r"\['read_from_replica'\].*did you mean 'read_from_replicas'",
    ),
    (
        {
            "q": {
                "BACKEND": "django_redlock.backends.django_redis.DjangoRedisBackend",
                "OPTIONS": {"socket_timeout": 1},
            }
        },
        r"\['q'\]\['OPTIONS'\]\['socket_timeout'\] is ignored.*CACHES\['default'\]",
    ),
    (["redis://h"], "DJANGO_REDLOCK must be a dict"),
]


@pytest.mark.parametrize(("config", "message"), BAD_SETTINGS)
def test_bad_settings_are_improperly_configured(config: Any, message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message):
        LockHandler(config).settings  # noqa: B018


def test_default_settings_without_django_redlock() -> None:
    handler = LockHandler()
    with override_settings():
        del settings.DJANGO_REDLOCK
        assert handler.settings["default"]["LOCATION"] == "redis://127.0.0.1:6379/0"


def test_bad_settings_fail_at_startup() -> None:
    """The app refuses to start (django.setup) on a bad setting, naming alias and key."""
    code = (
        "import django; from django.conf import settings;"
        "settings.configure(INSTALLED_APPS=['django_redlock'],"
        " DJANGO_REDLOCK={'jobs': {'BACKEND': 'django_redlock.backends.redis.RedisBackend',"
        " 'LOCATION': 'redis://h', 'TTL': -5}});"
        "django.setup()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "DJANGO_REDLOCK['jobs']['TTL']" in result.stderr


def test_a_django_redis_option_fails_at_startup_not_inside_redis_py() -> None:
    """A copied django-redis key broke every manage.py command (migrate too) with a raw
    TypeError from redis-py; now startup names the alias and the key."""
    code = (
        "import django; from django.conf import settings;"
        "settings.configure(INSTALLED_APPS=['django_redlock'],"
        f" DJANGO_REDLOCK={{'jobs': {{'BACKEND': '{REDIS}', 'LOCATION': 'redis://127.0.0.1:9/0',"
        " 'OPTIONS': {'CLIENT_CLASS': 'django_redis.client.DefaultClient'}}});"
        "django.setup()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and "TypeError" not in result.stderr
    assert "DJANGO_REDLOCK['jobs']['OPTIONS']['CLIENT_CLASS']" in result.stderr


@pytest.mark.parametrize(
    ("backend", "where"),
    [(REDIS, "/16"), (REDLOCK, "/16"), (REDIS, "?db=16"), (REDIS, "OPTIONS"), (REDLOCK, "OPTIONS")],
)
def test_a_database_the_server_lacks_fails_manage_py_check(
    backend: str, where: str, redis_server: Any, tmp_path: Any
) -> None:
    """LOCATION /16 on a 16-database server: every manage.py command died with a bare
    ResponseError from AppConfig.ready(); now it names the alias and the key."""
    url = f"redis://127.0.0.1:{redis_server.port}" + ("" if where == "OPTIONS" else where)
    location = repr([url] * 3 if "Redlock" in backend else url)
    options = {"db": 16} if where == "OPTIONS" else {}
    (tmp_path / "db16_settings.py").write_text(
        "INSTALLED_APPS = ['django_redlock']\n"
        f"DJANGO_REDLOCK = {{'jobs': {{'BACKEND': {backend!r}, 'LOCATION': {location},"
        f" 'OPTIONS': {options!r}}}}}\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}",
           "DJANGO_SETTINGS_MODULE": "db16_settings"}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "django", "check"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "ResponseError" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("django.core.exceptions.ImproperlyConfigured: DJANGO_REDLOCK['jobs']")
    key = "['OPTIONS']['db']" if where == "OPTIONS" else "['LOCATION']"
    assert key in last and "DB index is out of range" in last


GOOD_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("redis", {"socket_timeout": 1, "socket_connect_timeout": 1, "max_connections": 5,
               "health_check_interval": 30, "client_name": "locks", "socket_keepalive": True,
               "retry_on_timeout": False, "timeout": 1}),
    ("rediss", {"ssl_cert_reqs": "none", "ssl_check_hostname": False}),
    ("unix", {"socket_timeout": 1, "max_connections": 3}),
]  # fmt: skip


@pytest.mark.parametrize(("scheme", "options"), GOOD_OPTIONS)
def test_good_options_pass_the_check_and_redis_py_takes_them(
    scheme: str, options: dict[str, Any]
) -> None:
    """What the check lets through, redis-py really takes (it builds the connection)."""
    import redis

    url = {"redis": "redis://127.0.0.1:9/0", "rediss": "rediss://127.0.0.1:9/0",
           "unix": "unix:///tmp/nobody.sock"}[scheme]  # fmt: skip
    config = {"q": {"BACKEND": REDIS, "LOCATION": url, "OPTIONS": options}}
    LockHandler(config).settings  # noqa: B018
    pool = redis.BlockingConnectionPool.from_url(url, **options)
    pool.make_connection()  # a TypeError here is what the check must catch


@pytest.mark.parametrize(
    "url",
    [
        "redis://h",
        "redis://h/",
        "redis://h/3",
        "redis://h/3/",
        "redis://h/?db=3",
        "unix:///tmp/r.sock?db=2",
        "rediss://h/%31",
    ],
)
def test_good_database_parts_pass(url: str) -> None:
    LockHandler({"q": {"BACKEND": REDIS, "LOCATION": url}}).settings  # noqa: B018


def test_startup_with_redis_down_only_warns() -> None:
    """`migrate` and friends must not need Redis: a down server is a warning at startup."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    code = (
        "import django, logging; logging.basicConfig(); from django.conf import settings;"
        "settings.configure(INSTALLED_APPS=['django_redlock'],"
        f" DJANGO_REDLOCK={{'default': {{'BACKEND': '{REDIS}', 'LOCATION': '{url}'}}}});"
        "django.setup(); print('started')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "started" in result.stdout
    assert "could not load the Lua scripts" in result.stderr


def test_templates_over_var_keyword_arguments(down: str) -> None:
    """A template may name what arrives through **kwargs; a call without it says so."""
    names: list[str] = []
    deco = lock("report:{user_id}", using="local")

    @deco
    def build(**kwargs: Any) -> None:
        names.append(kwargs["user_id"])

    build(user_id=7)
    assert names == [7]
    with pytest.raises(ValueError, match=r"report:\{user_id\}.*failed.*user_id"):
        build(other=1)


def test_templates_that_would_fail_every_call_fail_at_decoration(down: str) -> None:
    """A field nested in a format spec is checked like any other; ``{kwargs}`` over
    ``**kwargs`` names the dict itself, which no call lends by that name."""
    with pytest.raises(ValueError, match="'width'"):
        lock("report:{user_id:>{width}}", using=down)(lambda user_id: None)
    padded = lock("report:{user_id:>{width}}", using="local")(lambda user_id, width: user_id)
    assert padded(7, width=3) == 7  # and a nested field that is an argument works
    with pytest.raises(ValueError, match=r"\*\*kwargs"):
        lock("report:{kwargs}", using=down)(lambda a, **kwargs: None)
    with pytest.raises(ValueError, match=r"\*\*kwargs"):
        lock_all("a:{kwargs[x]}", using=down)(lambda **kwargs: None)
    with pytest.raises(ValueError, match="'width'"):
        lock_view("v:{request.path:>{width}}")(lambda request: None)


def test_long_names_from_data_are_hashed_stably() -> None:
    from django_redlock.validation import fit_name

    long = "x" * 5000
    assert fit_name(long) == fit_name(long) != fit_name(long + "y")
    assert len(fit_name(long).encode()) <= 200
    assert fit_name("short") == "short"
    with pytest.raises(ValueError, match="not valid text"):
        fit_name("\udc80" * 300)
    for nul in ("a\x00b", "x" * 5000 + "\x00"):  # hashed or not, a NUL is refused
        with pytest.raises(ValueError, match="NUL"):
            fit_name(nul)


def _shared_db_warnings(locks_config: dict[str, Any], caches: dict[str, Any]) -> list[str]:
    from django.core import checks

    with override_settings(DJANGO_REDLOCK=locks_config, CACHES=caches):
        found = checks.run_checks(tags=[checks.Tags.caches])
    return [str(m.obj) for m in found if m.id == "django_redlock.W001"]


CACHE = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://10.0.0.5:6379/0"}


def test_locks_in_a_django_redis_cache_s_database_are_a_warning() -> None:
    """cache.clear() is FLUSHDB: it would free every lock and reset the fences."""
    djr = "django_redlock.backends.django_redis.DjangoRedisBackend"
    assert _shared_db_warnings({"c": {"BACKEND": djr, "CACHE": "default"}},
                               {"default": CACHE}) == ["DJANGO_REDLOCK['c']"]  # fmt: skip
    same = [
        "redis://10.0.0.5:6379/0", "redis://10.0.0.5:6379", "rediss://10.0.0.5/0",
        "redis://10.0.0.5:6379?db=0",
    ]  # fmt: skip
    for url in same:
        config = {"r": {"BACKEND": REDIS, "LOCATION": url}}
        assert _shared_db_warnings(config, {"default": CACHE}) == ["DJANGO_REDLOCK['r']"], url
    other = ["redis://10.0.0.5:6379/1", "redis://10.0.0.6:6379/0", "redis://10.0.0.5:6380/0"]
    for url in other:
        config = {"r": {"BACKEND": REDIS, "LOCATION": url}}
        assert _shared_db_warnings(config, {"default": CACHE}) == [], url
    # A cache on /1 by django-redis's DB option, a replica list, localhost spelled two ways.
    caches = {
        "db1": {**CACHE, "LOCATION": "redis://10.0.0.5:6379", "OPTIONS": {"DB": 1}},
        "replicas": {**CACHE, "LOCATION": ["redis://10.0.0.7:6379/2", "redis://10.0.0.8/2"]},
        "local": {**CACHE, "LOCATION": "redis://localhost:6379/0"},
        "plain": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    }
    quorum = "django_redlock.backends.redlock.RedlockBackend"
    config = {
        "a": {"BACKEND": REDIS, "LOCATION": "redis://10.0.0.5:6379/1"},
        "b": {"BACKEND": quorum, "LOCATION": ["redis://10.0.0.8:6379/2", "redis://x/0",
                                               "redis://y/0"]},
        "c": {"BACKEND": REDIS, "LOCATION": "redis://127.0.0.1:6379/0"},
        "d": {"BACKEND": REDIS, "LOCATION": "redis://127.0.0.1:6379/3"},
    }  # fmt: skip
    assert sorted(_shared_db_warnings(config, caches)) == [
        "DJANGO_REDLOCK['a']", "DJANGO_REDLOCK['b']", "DJANGO_REDLOCK['c']",
    ]  # fmt: skip


def test_manage_py_check_shows_the_shared_database_warning() -> None:
    from io import StringIO

    from django.core.management import call_command

    config = {**settings.DJANGO_REDLOCK, "r": {"BACKEND": REDIS, "LOCATION": CACHE["LOCATION"]}}
    err = StringIO()
    with override_settings(DJANGO_REDLOCK=config, CACHES={"default": CACHE}):
        call_command("check", stderr=err, stdout=StringIO())
    text = err.getvalue()
    assert "DJANGO_REDLOCK['r']: (django_redlock.W001)" in text
    assert "FLUSHDB" in text and "redis://HOST:6379/1" in text


def _shared_namespace(locks_config: dict[str, Any], caches: dict[str, Any]) -> list[str]:
    from django.core import checks

    with override_settings(DJANGO_REDLOCK=locks_config, CACHES=caches):
        found = checks.run_checks(tags=[checks.Tags.caches])
    return [m.msg for m in found if m.id == "django_redlock.W004"]


def test_two_aliases_on_the_same_keys_are_a_warning() -> None:
    """One lock in Redis, two fence rows: fenced blocks through the two aliases would not be
    ordered against each other."""
    quorum = "django_redlock.backends.redlock.RedlockBackend"
    djr = "django_redlock.backends.django_redis.DjangoRedisBackend"
    config = {
        "a": {"BACKEND": REDIS, "LOCATION": "redis://10.0.0.5:6379/1"},
        "twin": {"BACKEND": REDIS, "LOCATION": "redis://10.0.0.5/1", "TTL": 5},
        "prefixed": {"BACKEND": REDIS, "LOCATION": "redis://10.0.0.5:6379/1",
                     "KEY_PREFIX": "other"},
        "db2": {"BACKEND": REDIS, "LOCATION": "redis://10.0.0.5:6379/2"},
        "quorum": {"BACKEND": quorum, "LOCATION": ["redis://10.0.0.7/0", "redis://10.0.0.8/0",
                                                   "redis://10.0.0.5:6379/2"]},
        "cache": {"BACKEND": djr, "CACHE": "default"},
        "local": {"BACKEND": "django_redlock.backends.locmem.LocMemBackend"},
    }  # fmt: skip
    found = _shared_namespace(config, {"default": {**CACHE, "LOCATION": "redis://10.0.0.8/0"}})
    assert len(found) == 3, found
    pairs = [("'a'", "'twin'"), ("'db2'", "'quorum'"), ("'quorum'", "'cache'")]
    for (first, second), msg in zip(pairs, found, strict=True):
        assert f"DJANGO_REDLOCK[{first}] and DJANGO_REDLOCK[{second}]" in msg, msg
        assert "fenced" in msg and "not ordered" in msg
    assert _shared_namespace({"a": config["a"], "prefixed": config["prefixed"]}, {}) == []
