"""A small shop that sells the last tickets without overselling them."""

import logging
import os
from importlib.util import find_spec
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_db(number: int) -> str:
    """REDIS_URL's server, database ``number``: the cache, the broker, the results and the
    locks each get a database of their own (locks in the cache's would show W001)."""
    parts = urlsplit(REDIS_URL)
    if parts.scheme == "unix":  # unix:///path/redis.sock?db=0
        query = "&".join(q for q in parts.query.split("&") if q and not q.startswith("db="))
        return parts._replace(query=f"{query}&db={number}".lstrip("&")).geturl()
    return parts._replace(path=f"/{number}").geturl()


SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "demo-only-not-secret")
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_redlock",
    "shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "shop.middleware.name_the_thread",
]
ROOT_URLCONF = "shop.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "shop.beat.beat_leader",
            ]
        },
    }
]
WSGI_APPLICATION = "shop.wsgi.application"


def database_from_url(url: str) -> dict[str, Any]:
    """A DATABASES entry from ``postgres://USER:PASSWORD@HOST:PORT/NAME?OPTION=VALUE`` (the
    query's options go to psycopg, e.g. ``sslmode=require``), or ``sqlite:///PATH`` (relative;
    ``sqlite:////tmp/shop.db``: absolute). Without dj-database-url: the demo needs no more."""
    parts = urlsplit(url)
    if parts.scheme in ("postgres", "postgresql"):
        host = parts.netloc.rpartition("@")[2]  # as written: hostname would lowercase it
        host = host.rsplit(":", 1)[0] if parts.port else host
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parts.path.lstrip("/")),
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": unquote(host).strip("[]"),  # %2Frun%2Fpostgresql: a socket's folder
            "PORT": str(parts.port or ""),
            "OPTIONS": dict(parse_qsl(parts.query)),
        }
    if parts.scheme == "sqlite" and len(parts.path) > 1:  # sqlite:////abs/path, sqlite:///rel
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": unquote(parts.path[1:])}
    raise ValueError(
        f"DATABASE_URL must be postgres://USER:PASSWORD@HOST:PORT/NAME or sqlite:///PATH,"
        f" not {url!r}"
    )


# The shop's database: SQLite (`make demo`: under .demo/), or DATABASE_URL's.
DATABASES = {
    "default": database_from_url(os.environ["DATABASE_URL"])
    if os.environ.get("DATABASE_URL")
    else {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_DB", str(BASE_DIR / "db.sqlite3")),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"  # (Django's default is America/Chicago)
STATIC_URL = "static/"

CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": redis_db(0),
        "OPTIONS": {"SOCKET_TIMEOUT": 2.0, "SOCKET_CONNECT_TIMEOUT": 2.0},
    }
}
CELERY_BROKER_URL = redis_db(1)
CELERY_RESULT_BACKEND = redis_db(2)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# `make demo` runs two beats: one sends, the other takes over within the TTL if it dies.
CELERY_BEAT_SCHEDULER = "django_redlock.contrib.beat.LockedScheduler"
CELERY_BEAT_SCHEDULE = {
    "heartbeat": {"task": "shop.tasks.heartbeat", "schedule": 10.0},
}
DJANGO_REDLOCK_BEAT = {"using": "default", "ttl": 10}

DJANGO_REDLOCK = {
    "default": {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": redis_db(3),  # not the cache's database: its clear() would free them
        "KEY_PREFIX": "shop",
        "TTL": 30.0,
    },
}


def not_the_live_poll(record: logging.LogRecord) -> bool:
    """runserver's request log without the home page's poll of /live.json (once a second per
    open tab), unless it failed."""
    return record.levelno >= logging.WARNING or '"GET /live.json' not in record.getMessage()


LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "not_the_live_poll": {
            "()": "django.utils.log.CallbackFilter",
            "callback": not_the_live_poll,
        },
    },
    "formatters": {
        "shop": {"format": "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"},
        "server": {
            "()": "django.utils.log.ServerFormatter",
            "format": "[{server_time}] {message}",
            "style": "{",
        },
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "shop"},
        "server": {
            "class": "logging.StreamHandler",
            "formatter": "server",
            "filters": ["not_the_live_poll"],
        },
    },
    "loggers": {
        # Not propagated: the Celery worker's root handler would print every line a second time.
        "django_redlock": {"handlers": ["console"], "level": "INFO", "propagate": False},
        "django.server": {"handlers": ["server"], "level": "INFO", "propagate": False},
    },
}

# Django's Tasks framework (django.tasks, or the django-tasks backport before Django 6.0) with
# django-tasks-db's queue in the database: `make demo` runs its db_worker (see shop/jobs.py).
TASKS_DEMO = bool(
    find_spec("django_tasks_db") and (find_spec("django.tasks") or find_spec("django_tasks"))
)
if TASKS_DEMO:
    INSTALLED_APPS.append("django_tasks_db")
    TASKS = {
        "default": {
            "BACKEND": "django_redlock.contrib.tasks.DedupeQueuedBackend",
            "WRAPS": "django_tasks_db.DatabaseBackend",
        }
    }
