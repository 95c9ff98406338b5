"""The Celery app of the ``celery beat`` processes the beat tests start: one entry, sent every
``BEAT_INTERVAL`` seconds to the queue ``BEAT_QUEUE``, which no worker reads (the tests count
the messages there: each one is a send)."""

import os

import django
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.support.celery_beat_settings")
django.setup()

if os.environ.get("BEAT_SLOW_ONE_OFF_SAVE"):  # a slow database write of a one-off's row
    import time

    from django_celery_beat.models import PeriodicTask

    _save = PeriodicTask.save

    def _slow_save(self: PeriodicTask, *args: object, **kwargs: object) -> None:
        if self.one_off:
            time.sleep(float(os.environ["BEAT_SLOW_ONE_OFF_SAVE"]))
        _save(self, *args, **kwargs)  # type: ignore[arg-type]

    PeriodicTask.save = _slow_save  # type: ignore[method-assign]

app = Celery("beat-tests")
_base = os.environ["REDLOCK_TEST_REDIS"].rsplit("/", 1)[0]
app.conf.update(
    broker_url=f"{_base}/1",
    broker_connection_retry_on_startup=True,
    beat_max_loop_interval=1,
    beat_schedule={
        "tick": {
            "task": "tests.beat.tick",
            "schedule": float(os.environ.get("BEAT_INTERVAL", "1")),
            "options": {"queue": os.environ.get("BEAT_QUEUE", "beat")},
        }
    },
)
