"""celery-singleton's API on django-redlock: switch with one import.

    from django_redlock.compat.celery_singleton import Singleton   # was: from celery_singleton

    @app.task(base=Singleton, unique_on=["user_id"], raise_on_duplicate=True)
    def sync(user_id, full=False): ...

What stays: a ``delay()`` of a call that is queued or running returns the existing
``AsyncResult`` (or raises :class:`DuplicateTaskError` with ``raise_on_duplicate``); the key
is ``singleton_key_prefix`` + an md5 of the task name and its arguments (``unique_on``
picks them); the methods, ``clear_locks(app)``, ``Config(app)`` and the ``singleton_*``
settings.

What is ours (:mod:`django_redlock.contrib.celery` underneath): the key lives on a
``DJANGO_REDLOCK`` backend (``app.conf.singleton_using``, default ``"default"``;
``singleton_backend_url`` is accepted and never connected to); while queued it is a queue
marker that expires (``lock_expiry``, else an hour) and goes with its message (a failed
publish, a revoke, ``expires=``); while running it is a lock renewed by the watchdog, freed
on every outcome and at its TTL if the worker dies; two runs of one key never overlap (a
second is skipped); ``self.retry()`` is never a duplicate.
"""

from __future__ import annotations

import inspect
import json
from hashlib import md5
from importlib import import_module
from typing import Any

from ..contrib.celery import SingleInstanceTask, run_task
from ..contrib.single import AlreadyQueued, SingleInstance
from ..validation import to_ms
from .markers import clear_key, clear_prefix, existing_task_id, take

DEFAULT_PREFIX = "SINGLETONLOCK_"
DEFAULT_EXPIRY = 3600.0  # a queued call's marker without lock_expiry: an hour, not for ever


class DuplicateTaskError(AlreadyQueued):
    """Raised by ``delay()`` with ``raise_on_duplicate``: ``task_id`` is the existing task."""

    def __init__(self, message: str, task_id: str) -> None:
        super().__init__(message, task_id)


def _import(path_or_class: Any) -> Any:
    if isinstance(path_or_class, str):
        module, _, name = path_or_class.rpartition(".")
        return getattr(import_module(module), name)
    return path_or_class


class Config:
    """The ``singleton_*`` settings of a Celery app."""

    def __init__(self, app: Any) -> None:
        self.app = app

    @property
    def key_prefix(self) -> str:
        return str(self.app.conf.get("singleton_key_prefix", DEFAULT_PREFIX))

    @property
    def raise_on_duplicate(self) -> bool | None:
        return self.app.conf.get("singleton_raise_on_duplicate")

    @property
    def lock_expiry(self) -> float | None:
        return self.app.conf.get("singleton_lock_expiry")

    @property
    def json_encoder_class(self) -> Any:
        return _import(self.app.conf.get("singleton_json_encoder_class"))

    @property
    def backend_url(self) -> str | None:
        """Accepted for compatibility; the locks live on ``using``'s backend."""
        return self.app.conf.get("singleton_backend_url")

    @property
    def using(self) -> str:
        """The ``DJANGO_REDLOCK`` alias the locks live on."""
        return str(self.app.conf.get("singleton_using", "default"))


def generate_lock(
    task_name: str, task_args: Any = None, task_kwargs: Any = None,
    key_prefix: str = DEFAULT_PREFIX, json_encoder_class: Any = None,
) -> str:  # fmt: skip
    """celery-singleton's key: the prefix and an md5 of the name and the JSON arguments."""
    args = json.dumps(list(task_args or []), sort_keys=True, cls=json_encoder_class)
    kwargs = json.dumps(dict(task_kwargs or {}), sort_keys=True, cls=json_encoder_class)
    return key_prefix + md5((task_name + args + kwargs).encode()).hexdigest()


def clear_locks(app: Any) -> None:
    """Remove every singleton key of ``app``'s prefix: queue markers and held locks (an
    operator's action: a running task keeps running, it only no longer excludes others)."""
    config = Config(app)
    clear_prefix(config.using, config.key_prefix)


class Singleton(SingleInstanceTask):
    """celery-singleton's task base (options as task arguments or class attributes)."""

    abstract = True
    unique_on: str | list[str] | None = None
    raise_on_duplicate: bool | None = None
    lock_expiry: float | None = None
    _singleton_config: Config | None = None
    _redlock_configs: dict[tuple[Any, ...], SingleInstance] | None = None

    @property
    def singleton_config(self) -> Config:
        if self._singleton_config is None or self._singleton_config.app is not self._get_app():
            self._singleton_config = Config(self._get_app())
        return self._singleton_config

    @property
    def _raise_on_duplicate(self) -> bool:
        if self.raise_on_duplicate is not None:
            return bool(self.raise_on_duplicate)
        return bool(self.singleton_config.raise_on_duplicate or False)

    def _expiry(self) -> float | None:
        if self.lock_expiry is not None:
            return float(self.lock_expiry)
        expiry = self.singleton_config.lock_expiry
        return float(expiry) if expiry is not None else None

    # -- the engine's hooks ------------------------------------------------------------------

    def single_instance_config(self) -> SingleInstance:
        config = self.singleton_config
        expiry = self._expiry()
        dedupe: Any = "raise" if self._raise_on_duplicate else True
        cache_key = (config.using, expiry, dedupe)
        if self._redlock_configs is None:
            self._redlock_configs = {}
        found = self._redlock_configs.get(cache_key)
        if found is None:
            found = self._redlock_configs[cache_key] = SingleInstance(
                self.run, None, None, "skip", config.using, 10.0, dedupe,
                expiry or DEFAULT_EXPIRY,
            )  # fmt: skip
        return found

    def single_instance_key(self, args: tuple, kwargs: dict) -> str:
        return self.generate_lock(self.name, list(args), dict(kwargs))

    def queue_marker_ttl(self, options: dict[str, Any]) -> float:
        # lock_expiry is the whole wait, as in celery-singleton (never past expires=).
        ttl = super().queue_marker_ttl(options)
        expiry = self._expiry()
        return ttl if expiry is None else min(ttl, expiry)

    def deduplicated(
        self, key: str, task_id: str, args: Any, kwargs: Any, promised: str | None,
        options: dict[str, Any],
    ) -> Any:  # fmt: skip
        if promised is not None and promised != task_id and not self._raise_on_duplicate:
            return self.publish_duplicate(task_id, args, kwargs, promised, options)
        return self.on_duplicate(task_id)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request.called_directly:  # task(...) in-process: a plain call, as before
            return super().__call__(*args, **kwargs)
        key = self.single_instance_key(args, kwargs)
        call = super().__call__
        return run_task(self.single_instance_config(), self, self.name, key, args, kwargs,
                        lambda: call(*args, **kwargs))  # fmt: skip

    # -- celery-singleton's methods ----------------------------------------------------------

    def generate_lock(self, task_name: str, task_args: Any = None, task_kwargs: Any = None) -> str:
        unique_on = self.unique_on
        task_args, task_kwargs = list(task_args or []), dict(task_kwargs or {})
        if unique_on is not None:
            names = [unique_on] if isinstance(unique_on, str) else list(unique_on)
            if not any(names):
                task_kwargs = {}
            else:
                bound = inspect.signature(self.run).bind(*task_args, **task_kwargs)
                bound.apply_defaults()
                task_kwargs = {name: bound.arguments[name] for name in names}
            task_args = []
        config = self.singleton_config
        return generate_lock(task_name, task_args, task_kwargs, key_prefix=config.key_prefix,
                             json_encoder_class=config.json_encoder_class)  # fmt: skip

    def aquire_lock(self, lock: str, task_id: str) -> bool:
        """Note ``task_id`` under ``lock`` unless a task is noted there (celery-singleton's
        spelling); whether it was noted."""
        ttl = self._expiry() or DEFAULT_EXPIRY
        return take(self.singleton_config.using, lock, task_id, to_ms(ttl)) is None

    def get_existing_task_id(self, lock: str) -> str | None:
        """The task queued or running under ``lock``, if any."""
        return existing_task_id(self.singleton_config.using, lock)

    def unlock(self, lock: str) -> None:
        """Free ``lock`` whoever holds it: its queue marker, and a running task's hold."""
        clear_key(self.singleton_config.using, lock, f"{self.name}.unlock()")

    def release_lock(self, task_args: Any = None, task_kwargs: Any = None) -> None:  # type: ignore[override]
        self.unlock(self.generate_lock(self.name, task_args, task_kwargs))

    def on_duplicate(self, existing_task_id: str) -> Any:
        if self._raise_on_duplicate:
            raise DuplicateTaskError(
                f"Attempted to queue a duplicate of task ID {existing_task_id}",
                task_id=existing_task_id,
            )
        return self.AsyncResult(existing_task_id)


__all__ = ["Config", "DuplicateTaskError", "Singleton", "clear_locks", "generate_lock"]
