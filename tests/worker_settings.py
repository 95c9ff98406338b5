"""Settings of the Celery worker the tests start: the suite's settings on the suite's Redis."""

import os

from tests.settings import *  # noqa: F403
from tests.settings import redlock_settings

globals().update(redlock_settings(os.environ["REDLOCK_TEST_REDIS"]))
