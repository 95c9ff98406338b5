from __future__ import annotations

from django.apps import AppConfig


class DjangoRedlockConfig(AppConfig):
    name = "django_redlock"
    verbose_name = "Locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core import checks

        from .checks import (
            check_permissions,
            check_shared_cache_db,
            check_shared_namespace,
            check_unknown_settings,
        )
        from .handler import locks

        checks.register(check_shared_cache_db, checks.Tags.caches)
        checks.register(check_shared_namespace, checks.Tags.caches)
        checks.register(check_unknown_settings)
        checks.register(check_permissions, checks.Tags.caches)

        # A wrong DJANGO_REDLOCK fails here, at startup, naming the alias and the key.
        locks.settings  # noqa: B018
        from .backends.base import prepare_each

        # Teach the servers our scripts now; a server that is down is only a warning, so
        # `migrate` and friends never need Redis. All at once: a startup whose servers do
        # not answer waits one socket timeout, not one per alias.
        prepare_each([locks[alias] for alias in locks])
        from . import incidents, observe
        from .contrib.single import duplicate_skipped  # Celery's and Django Tasks' duplicates

        incidents.connect()
        from django.core.signals import request_finished

        from .fencing import drop_all_abandoned

        # A fenced block abandoned by its ``with`` (an exception entering its exit) is rolled
        # back and its lock released at the end of the request, not when the thread's next
        # fenced block opens.
        request_finished.connect(drop_all_abandoned, dispatch_uid="redlock-fenced-abandoned")
        duplicate_skipped.connect(
            incidents.on_duplicate, dispatch_uid="redlock-incidents-duplicate"
        )
        observe.connect()  # metrics and spans, as the settings say
