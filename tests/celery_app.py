"""The Celery app of the tests: a real worker runs it as a subprocess (no eager mode)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.worker_settings")

app = Celery("tests", include=["tests.celery_tasks"])


def configure(redis_url: str) -> None:
    base = redis_url.rsplit("/", 1)[0]
    app.conf.update(
        broker_url=f"{base}/1",
        result_backend=f"{base}/2",
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )


if "REDLOCK_TEST_REDIS" in os.environ:  # the worker process
    import django

    django.setup()
    configure(os.environ["REDLOCK_TEST_REDIS"])
