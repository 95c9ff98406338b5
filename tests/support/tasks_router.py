"""django-tasks-db's queue on the "tasks" database (see settings.py), the rest on "default"."""

from __future__ import annotations

from typing import Any

APP = "django_tasks_database"  # django-tasks-db's app label


class TasksRouter:
    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return "tasks" if model._meta.app_label == APP else None

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "tasks" if model._meta.app_label == APP else None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        if db == "tasks" or app_label == APP:  # the tasks database holds the queue alone
            return db == "tasks" and app_label == APP
        return None
