"""Settings for the test suite. Redis URLs are filled in by conftest once servers run."""

import os
import tempfile
from importlib.util import find_spec

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_redlock",
]
STATIC_URL = "/static/"
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.support.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    # The fenced transactions' PostgreSQL: conftest starts one when a collected test uses this
    # alias, and fills in its port; processes the tests start get port and name from these.
    "postgres": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("REDLOCK_TEST_PG_NAME", "redlock"),
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": os.environ.get("REDLOCK_TEST_PG_PORT", "9"),  # nobody listens there
    },
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING_CONFIG = None


def redlock_settings(url: str) -> dict[str, object]:
    return {
        "DJANGO_REDLOCK": {
            "default": {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": url},
            "redis": {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": url},
            "cache": {
                "BACKEND": "django_redlock.backends.django_redis.DjangoRedisBackend",
                "CACHE": "default",
            },
            "local": {"BACKEND": "django_redlock.backends.locmem.LocMemBackend"},
            "down": {  # nobody listens there
                "BACKEND": "django_redlock.backends.redis.RedisBackend",
                "LOCATION": "redis://127.0.0.1:9/0",
                "OPTIONS": {"socket_connect_timeout": 0.5},
            },
        },
        "CACHES": {
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": url,
                "OPTIONS": {"SOCKET_TIMEOUT": 2, "SOCKET_CONNECT_TIMEOUT": 2},
            }
        },
    }


# Until the suite's own servers run (conftest), every alias points at a port nobody uses.
globals().update(redlock_settings("redis://127.0.0.1:9/0"))


# Django's Tasks framework (tests/tasks/test_tasks.py): django-tasks-db's queue lives in a SQLite
# file of its own (the "tasks" database), shared with the db_worker processes the tests start.
if find_spec("django_tasks_db"):
    # One file per test process: under pytest-xdist each worker (PYTEST_XDIST_WORKER, which the
    # db_workers it starts inherit with this variable) has its own.
    _WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
    TASKS_DB = os.environ.setdefault(
        f"REDLOCK_TASKS_DB{_WORKER}",
        os.path.join(tempfile.gettempdir(), f"redlock-tasks-{os.getpid()}{_WORKER}.sqlite3"),
    )
    INSTALLED_APPS.append("django_tasks_db")
    DATABASES["tasks"] = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": TASKS_DB,
        "TEST": {"NAME": TASKS_DB, "DEPENDENCIES": []},
        "OPTIONS": {"timeout": 30},  # the workers and the tests take turns writing
    }
    DATABASE_ROUTERS = ["tests.support.tasks_router.TasksRouter"]
    _TASKS = "django.tasks" if find_spec("django.tasks") else "django_tasks"
    TASKS = {
        "default": {
            "BACKEND": "django_redlock.contrib.tasks.DedupeQueuedBackend",
            "WRAPS": "django_tasks_db.DatabaseBackend",
        },
        "immediate": {"BACKEND": f"{_TASKS}.backends.immediate.ImmediateBackend"},
        "plain": {"BACKEND": "django_tasks_db.DatabaseBackend"},
    }
