"""celery-once's API on django-redlock: switch with one import.

    from django_redlock.compat.celery_once import QueueOnce, AlreadyQueued  # was: celery_once

    @app.task(base=QueueOnce, once={"graceful": True, "keys": ["user_id"]})
    def sync(user_id, full=False): ...

What stays: ``delay()`` of a call that is queued or running raises :class:`AlreadyQueued`
("Expires in N seconds", ``.countdown``), or with ``graceful`` returns an ``EagerResult`` of
None; ``once={"keys", "timeout", "unlock_before_run"}`` on the task and ``once={"graceful",
"timeout"}`` per call; ``get_key()`` in the ``qo_<task>_<k>-<v>`` form; ``once_backend`` with
``raise_or_lock(key, timeout)`` and ``clear_lock(key)``; ``default_timeout`` from
``app.conf.ONCE["settings"]["default_timeout"]`` (an hour by default).

What is ours (:mod:`django_redlock.contrib.celery` underneath): the key lives on the
``DJANGO_REDLOCK`` backend ``ONCE["settings"]["using"]`` (default ``"default"``;
``ONCE["backend"]`` and its ``url`` are accepted and never connected to); while queued it
is a queue marker (``timeout``) that goes with its message (a failed publish, a revoke,
``expires=``); while running it is a lock renewed by the watchdog, freed on every outcome
and at its TTL if the worker dies; two runs of one key never overlap; ``self.retry()`` is
never a duplicate. ``unlock_before_run``: a call may be queued while one runs, and it runs
once that one ended (one running plus one queued), never beside it.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from contextvars import ContextVar
from typing import Any

from celery import Task, states
from celery.result import EagerResult
from celery.utils import uuid as uuid_text

from ..contrib.celery import SingleInstanceTask, run_task
from ..contrib.single import AlreadyQueued as BaseAlreadyQueued
from ..contrib.single import SingleInstance, task_id_of
from ..handler import locks
from ..validation import to_ms
from .markers import clear_key, seconds_left, take

DEFAULT_TIMEOUT = 60 * 60

#: The ``once=`` options of the apply_async() call in progress (read by the engine's hooks).
_call_once: ContextVar[dict[str, Any] | None] = ContextVar("redlock_once_call", default=None)


def _once_options() -> dict[str, Any]:
    return _call_once.get() or {}


class AlreadyQueued(BaseAlreadyQueued):
    """The call is queued or running already; ``countdown``: seconds until its key frees
    itself at the latest."""

    def __init__(self, countdown: float, task_id: str = "") -> None:
        self.countdown = countdown
        self.message = f"Expires in {countdown} seconds"
        super().__init__(self.message, task_id)
        self.args = (countdown, task_id)  # the constructor's: rebuilt as cls(*args)

    def __str__(self) -> str:
        return self.message


# -- celery-once's key: qo_<task name>_<arg>-<value>_..., arguments sorted by name ----------


def _force_string(value: Any) -> Any:
    if isinstance(value, dict):
        items = sorted(((_force_string(k), _force_string(v)) for k, v in value.items()),
                       key=lambda kv: kv[0])  # fmt: skip
        return (
            "{" + ", ".join(str(dict([kv])).strip("{}") for kv in OrderedDict(items).items()) + "}"
        )
    if isinstance(value, list):
        return [_force_string(v) for v in value]
    return value


def queue_once_key(name: str, call_args: dict[str, Any], restrict_to: list[str] | None) -> str:
    if restrict_to is not None:
        call_args = {key: call_args[key] for key in restrict_to}
    parts = ["qo", name] + [f"{k}-{_force_string(v)}" for k, v in sorted(call_args.items())]
    return "_".join(parts)


class OnceBackend:
    """``task.once_backend``: celery-once's backend interface over queue markers."""

    def __init__(self, using: str) -> None:
        self.using = using

    def raise_or_lock(self, key: str, timeout: float, task_id: str | None = None) -> None:
        """Take ``key`` for ``timeout`` seconds, or raise AlreadyQueued (the seconds left)."""
        backend = locks[self.using]
        running = backend.inspect(key)
        if running is not None:
            raise AlreadyQueued(float(running.ttl or 0.0), str(task_id_of(running.holder) or ""))
        task_id = task_id or uuid_text()
        found = take(self.using, key, task_id, to_ms(timeout))
        if found is not None and found != task_id:
            raise AlreadyQueued(seconds_left(self.using, key), found)

    def clear_lock(self, key: str) -> None:
        """Free ``key`` whoever has it (its marker; a running task's hold)."""
        clear_key(self.using, key, "once_backend.clear_lock()")


class QueueOnce(SingleInstanceTask):
    """celery-once's task base."""

    abstract = True
    once: dict[str, Any] = {"graceful": False, "unlock_before_run": False}
    _redlock_configs: dict[tuple[Any, ...], SingleInstance] | None = None

    @property
    def config(self) -> Any:
        return self._get_app().conf

    @property
    def once_config(self) -> dict[str, Any]:
        return self.config.get("ONCE") or {"settings": {}}

    @property
    def _settings(self) -> dict[str, Any]:
        return self.once_config.get("settings") or {}

    @property
    def once_backend(self) -> OnceBackend:
        return OnceBackend(str(self._settings.get("using", "default")))

    @property
    def default_timeout(self) -> float:
        return self._settings.get("default_timeout", DEFAULT_TIMEOUT)

    def unlock_before_run(self) -> bool:
        return bool(self.once.get("unlock_before_run", False))

    def _timeout(self) -> float:
        default = self.once.get("timeout", self.default_timeout)
        return float(_once_options().get("timeout", default))

    # -- the engine's hooks ------------------------------------------------------------------

    def single_instance_config(self) -> SingleInstance:
        using = self.once_backend.using
        # unlock_before_run: a call queued while one runs waits for it (coalesce: one more
        # run follows), instead of running beside it.
        on_duplicate = "coalesce" if self.unlock_before_run() else "skip"
        cache_key = (using, on_duplicate)
        if self._redlock_configs is None:
            self._redlock_configs = {}
        found = self._redlock_configs.get(cache_key)
        if found is None:
            found = self._redlock_configs[cache_key] = SingleInstance(
                self.run, None, None, on_duplicate, using, 10.0, True, float(self.default_timeout)
            )
        return found

    def single_instance_key(self, args: tuple, kwargs: dict) -> str:
        return self.get_key(args, kwargs)

    def dedupes_running(self) -> bool:
        return not self.unlock_before_run()

    def joins_queued_call(self) -> bool:
        return False  # celery-once refuses it (AlreadyQueued, or graceful None): not noted

    def queue_marker_ttl(self, options: dict[str, Any]) -> float:
        # celery-once's timeout is the whole wait (never past expires=).
        return min(super().queue_marker_ttl(options), self._timeout())

    def deduplicated(
        self, key: str, task_id: str, args: Any, kwargs: Any, promised: str | None,
        options: dict[str, Any],
    ) -> Any:  # fmt: skip
        graceful = _once_options().get("graceful", self.once.get("graceful", False))
        if graceful:
            if promised is not None and promised != task_id:
                return self.publish_duplicate(task_id, args, kwargs, promised, options)
            return EagerResult(None, None, states.REJECTED)
        raise AlreadyQueued(seconds_left(self.once_backend.using, key), task_id)

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        token = _call_once.set(dict(options.pop("once", None) or {}))
        try:
            return super().apply_async(args, kwargs, **options)
        finally:
            _call_once.reset(token)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request.called_directly:  # task(...) in-process: a plain call, as before
            return super().__call__(*args, **kwargs)
        key = self.get_key(args, kwargs)
        call = super().__call__
        return run_task(self.single_instance_config(), self, self.name, key, args, kwargs,
                        lambda: call(*args, **kwargs), lambda a, k: call(*a, **k))  # fmt: skip

    # -- celery-once's methods ---------------------------------------------------------------

    def _get_call_args(self, args: Any, kwargs: Any) -> dict[str, Any]:
        call_args = dict(inspect.signature(self.run).bind(*args, **kwargs).arguments)
        if isinstance(call_args.get("self"), Task):
            del call_args["self"]
        return call_args

    def get_key(self, args: Any = None, kwargs: Any = None) -> str:
        """celery-once's key of a call: ``qo_<task name>_<arg>-<value>...``."""
        call_args = self._get_call_args(args or (), kwargs or {})
        return queue_once_key(self.name, call_args, self.once.get("keys"))


__all__ = ["AlreadyQueued", "OnceBackend", "QueueOnce", "queue_once_key"]
