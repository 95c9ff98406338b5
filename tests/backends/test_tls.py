"""TLS: ``rediss://`` with a CA bundle the test makes (``openssl``), with a client certificate
(the server asks for one) and without (the sentinel does not), on one Redis, django-redis,
Sentinel and Redlock's nodes; each as a Redis user with only the README's ACL rule."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import BackendUnavailable, acl, lock, locks
from django_redlock.backends.redis import RedisBackend
from django_redlock.backends.sentinel import SentinelBackend
from django_redlock.testing import RedisServer, SentinelServer, TLSFiles, make_tls_files

from .test_acl import ADMIN, SECRET, aliases, exercise

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(tls: TLSFiles) -> Iterator[RedisServer]:
    """TLS only, a client certificate required, a password on the default user, and the
    user 'locks' with only the rule."""
    started = RedisServer(password=ADMIN, tls=tls, tls_auth_clients=True).start()
    started.add_user("locks", SECRET, *acl.rule(RedisBackend("x", {})).split())
    yield started
    started.stop()


@pytest.fixture(scope="module")
def sentinel(server: RedisServer) -> Iterator[SentinelServer]:
    """A sentinel over TLS that asks its clients for no certificate, with a user of its own."""
    started = SentinelServer(server, password=ADMIN, tls_auth_clients=False).start()
    started.add_user("sentinel-locks", SECRET, *acl.SENTINEL_OWN_RULES)
    yield started
    started.stop()


def test_one_redis_over_tls_with_a_client_certificate(server: RedisServer) -> None:
    url = server.url_for("locks", SECRET, 1)
    assert url.startswith("rediss://") and "ssl_certfile=" in url
    with aliases(tls={"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": url}):
        assert locks["tls"].check_permissions() is None
        exercise("tls")


def test_tls_options_in_options_instead_of_the_url(server: RedisServer, tls: TLSFiles) -> None:
    url = server.url_for("locks", SECRET, 1).split("?")[0]
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": url,
              "OPTIONS": tls.client_options()}  # fmt: skip
    with aliases(tls=config), lock("in-options", using="tls", timeout=1) as held:
        assert held.owned()


def test_no_client_certificate_is_backend_unavailable_at_once(server: RedisServer) -> None:
    url = server.url_for("locks", SECRET, 1, client_cert=False)
    with aliases(tls={"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": url}):
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as caught:  # the handshake, or the first read
            lock("x", using="tls").acquire(timeout=5)
        assert time.monotonic() - started < 3
        assert SECRET not in str(caught.value)


def test_an_untrusted_server_certificate_is_backend_unavailable(
    server: RedisServer, tls: TLSFiles
) -> None:
    # The client's own certificate as the CA bundle: not the CA that signed the server's.
    url = server.url_for("locks", SECRET, 1).replace(
        f"ssl_ca_certs={tls.ca}", f"ssl_ca_certs={tls.client_cert}"
    )
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": url}
    with aliases(tls=config), pytest.raises(BackendUnavailable, match="certificate verify failed"):
        lock("x", using="tls").acquire(blocking=False)


def test_django_redis_over_tls(server: RedisServer) -> None:
    cache = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": server.url_for("locks", SECRET, 2),
    }
    config = {"BACKEND": "django_redlock.backends.django_redis.DjangoRedisBackend",
              "CACHE": "tls"}  # fmt: skip
    with override_settings(CACHES={**settings.CACHES, "tls": cache}), aliases(tls=config):
        exercise("tls")  # asyncio too: its own connections, with the cache's TLS options


def test_redlock_nodes_over_tls(server: RedisServer) -> None:
    urls = [server.url_for("locks", SECRET, db) for db in (3, 4, 5)]
    config = {"BACKEND": "django_redlock.backends.redlock.RedlockBackend", "LOCATION": urls,
              "OPTIONS": {"socket_timeout": 2, "socket_connect_timeout": 2}}  # fmt: skip
    with aliases(tls=config):
        exercise("tls", kinds=False)


def test_sentinel_over_tls(server: RedisServer, sentinel: SentinelServer, tls: TLSFiles) -> None:
    params = {"LOCATION": ["redis://h"], "OPTIONS": {"service_name": "m"}}
    rule = acl.rule(SentinelBackend("x", params))
    server.add_user("locks", SECRET, *rule.split())
    where = sentinel.url_for("sentinel-locks", SECRET, client_cert=False).replace("/0?", "?")
    assert where.startswith("rediss://") and "ssl_certfile" not in where
    master: dict[str, Any] = {"ssl": True, **tls.client_options()}
    config = {"BACKEND": "django_redlock.backends.sentinel.SentinelBackend", "LOCATION": [where],
              "OPTIONS": {"service_name": "mymaster", "username": "locks", "password": SECRET,
                          "db": 6, **master}}  # fmt: skip
    with aliases(tls=config):
        assert locks["tls"].check_permissions() is None
        exercise("tls")


def test_the_tls_files_are_what_openssl_made(tls: TLSFiles) -> None:
    for path in (tls.ca, tls.server_cert, tls.server_key, tls.client_cert, tls.client_key):
        assert Path(path).read_text().startswith("-----BEGIN")
