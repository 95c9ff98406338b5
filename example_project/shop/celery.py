import os
from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_prerun

from django_redlock.identity import current_task

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


# Every lock a task takes names the task as its holder (a @single_instance task's own lock
# does already), so the clerks at the desk show as tasks, on the home page and in the admin.
@task_prerun.connect
def _holder_is_the_task(task_id: str, task: Any, **kwargs: Any) -> None:
    current_task.set((task_id, task.name))


@task_postrun.connect
def _holder_is_the_thread(**kwargs: Any) -> None:
    current_task.set(None)
