"""Integrations with task frameworks: ``@single_instance`` (its core :mod:`.single`, its
adapters :mod:`.celery` and :mod:`.tasks`) and the locked beat scheduler (:mod:`.beat`).

This package wires the adapters into the core, which imports neither (they import it):
Python runs this file before any module of the package, so the core always has them.
Django Tasks' adapter is imported now (it imports no framework). Celery's is imported only
once Celery is: a Celery task exists only then, and a process without Celery never pays for
importing it (as Django Tasks' adapter looks only at the Tasks frameworks imported).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .single import SingleInstance, register_adapter
from .tasks import TasksAdapter


class _OnceCeleryIsImported:
    """Celery's adapter, asked only once Celery is imported (see the module docstring)."""

    def check_decorated(self, func: Any) -> None:
        if "celery" in sys.modules:
            from .celery import CeleryAdapter

            CeleryAdapter().check_decorated(func)

    def runner(self, config: SingleInstance, args: tuple) -> Callable[[tuple, dict], Any] | None:
        if "celery" not in sys.modules:
            return None
        from .celery import CeleryAdapter

        return CeleryAdapter().runner(config, args)


register_adapter(TasksAdapter())
register_adapter(_OnceCeleryIsImported())
