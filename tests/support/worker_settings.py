"""Settings of the Celery worker the tests start: the suite's settings on the suite's Redis."""

import os

from tests.support.settings import *  # noqa: F403
from tests.support.settings import redlock_settings

globals().update(redlock_settings(os.environ["REDLOCK_TEST_REDIS"]))

# A test that waits out a killed worker's holds gives its worker a shorter default TTL than
# the backend's 30 s (the alias's "TTL" key, as a project would set it).
if "REDLOCK_TEST_DEFAULT_TTL" in os.environ:
    DJANGO_REDLOCK["default"]["TTL"] = float(os.environ["REDLOCK_TEST_DEFAULT_TTL"])  # noqa: F405
