"""Settings of the ``celery beat`` processes the beat tests start
(``tests/celery/test_beat.py``)."""

import os

from tests.support.worker_settings import *  # noqa: F403
from tests.support.worker_settings import INSTALLED_APPS

DJANGO_REDLOCK_BEAT = {
    "using": "default",
    "ttl": float(os.environ.get("BEAT_TTL", "2")),
    "name": os.environ.get("BEAT_LOCK", "celery-beat"),
}
if os.environ.get("BEAT_DB"):  # django-celery-beat's tables in a file every beat shares
    INSTALLED_APPS = [*INSTALLED_APPS, "django_celery_beat"]
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ["BEAT_DB"],
            "OPTIONS": {"timeout": 20},
        }
    }
