"""Settings of the Celery worker the tests start: the suite's settings on the suite's Redis."""

import os

from tests.support.settings import *  # noqa: F403
from tests.support.settings import redlock_settings

globals().update(redlock_settings(os.environ["REDLOCK_TEST_REDIS"]))
