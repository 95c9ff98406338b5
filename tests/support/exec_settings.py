"""Settings of the `manage.py redlock exec` processes and leader candidates the tests start:
the suite's settings on the suite's Redis ($REDLOCK_TEST_REDIS), no incident database."""

import os

from tests.support.settings import *  # noqa: F403
from tests.support.settings import redlock_settings

globals().update(redlock_settings(os.environ["REDLOCK_TEST_REDIS"]))
DJANGO_REDLOCK_INCIDENTS = {"KINDS": []}
# The suite's aliases share one Redis database on purpose: not the point here.
SILENCED_SYSTEM_CHECKS = ["django_redlock.W001", "django_redlock.W004"]
# tests/support/urls.py names "down" (nobody listens there): here an alias that needs no server, so
# that these processes print no startup warning about it.
DJANGO_REDLOCK["down"] = {"BACKEND": "django_redlock.backends.locmem.LocMemBackend"}  # noqa: F405
