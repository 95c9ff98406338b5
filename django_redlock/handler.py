"""``locks``: the backends named in ``DJANGO_REDLOCK``, built lazily like ``caches``."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.connection import BaseConnectionHandler
from django.utils.module_loading import import_string

from .acl import mask
from .backends.base import BaseLockBackend
from .exceptions import InvalidLockBackendError

DEFAULT_LOCK_ALIAS = "default"
DEFAULT_SETTINGS: dict[str, dict[str, Any]] = {
    DEFAULT_LOCK_ALIAS: {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": "redis://127.0.0.1:6379/0",
    }
}
KNOWN_KEYS = {"BACKEND", "LOCATION", "OPTIONS", "KEY_PREFIX", "TTL", "CACHE"}


def backend_class(alias: str, config: Any) -> type[BaseLockBackend]:
    if not isinstance(config, Mapping):
        raise ImproperlyConfigured(
            f"DJANGO_REDLOCK[{alias!r}] must be a dict, not {mask(repr(config))}"
        )
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        raise ImproperlyConfigured(
            f"DJANGO_REDLOCK[{alias!r}] has unknown key(s) {', '.join(map(repr, unknown))};"
            f" known keys are {', '.join(sorted(KNOWN_KEYS))}"
        )
    path = config.get("BACKEND")
    if not isinstance(path, str) or not path:
        raise ImproperlyConfigured(f"DJANGO_REDLOCK[{alias!r}]['BACKEND'] is missing")
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"DJANGO_REDLOCK[{alias!r}]['BACKEND'] {path!r} could not be imported: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, BaseLockBackend)):
        raise ImproperlyConfigured(
            f"DJANGO_REDLOCK[{alias!r}]['BACKEND'] {path!r} is not a lock backend class"
        )
    return cls


class LockHandler(BaseConnectionHandler):
    settings_name = "DJANGO_REDLOCK"
    exception_class = InvalidLockBackendError

    def __init__(self, settings: Any = None) -> None:
        super().__init__(settings)
        # One backend per alias per process (not per thread like caches): the backends'
        # pools are thread-safe, and the renewer and pub/sub reader are per process.
        self._connections = SimpleNamespace()
        self._create = threading.Lock()

    def configure_settings(self, settings: Any) -> dict[str, dict[str, Any]]:
        if settings is None:
            settings = getattr(django_settings, self.settings_name, None)
        if settings is None:
            settings = DEFAULT_SETTINGS
        if not isinstance(settings, Mapping):
            raise ImproperlyConfigured(f"DJANGO_REDLOCK must be a dict, not {mask(repr(settings))}")
        for alias, config in settings.items():
            backend_class(alias, config).check_params(alias, config)
        return {alias: dict(config) for alias, config in settings.items()}

    def __getitem__(self, alias: str) -> BaseLockBackend:
        try:
            return getattr(self._connections, alias)
        except (AttributeError, TypeError):
            if not isinstance(alias, str):
                raise TypeError(f"lock backend alias must be a str, not {alias!r}") from None
            if alias not in self.settings:
                raise self.exception_class(
                    f"unknown lock backend {alias!r}; DJANGO_REDLOCK defines"
                    f" {', '.join(map(repr, self.settings))}"
                ) from None
        with self._create:
            if not hasattr(self._connections, alias):
                setattr(self._connections, alias, self.create_connection(alias))
        return getattr(self._connections, alias)

    def create_connection(self, alias: str) -> BaseLockBackend:
        config = self.settings[alias]
        return backend_class(alias, config)(alias, config)

    def reset(self) -> None:
        """Close every backend and re-read the settings (used when tests change them)."""
        self.close_all()
        self._connections = SimpleNamespace()
        self.__dict__.pop("settings", None)
        self._settings = None


locks = LockHandler()


@receiver(setting_changed)
def _settings_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in (LockHandler.settings_name, "CACHES"):
        locks.reset()
