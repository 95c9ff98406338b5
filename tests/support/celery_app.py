"""The Celery app of the tests: a real worker runs it as a subprocess (no eager mode)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.support.worker_settings")

app = Celery(
    "tests",
    include=[
        "tests.support.celery_tasks",
        "tests.support.celery_compat_tasks",
        "tests.support.fenced_tasks",
    ],
)


def forget_backend() -> None:
    """Celery makes the app's result backend at its first use and keeps it: an eager apply in
    this process before configure() (tests/interrupts/) would leave every later test of the
    process with the disabled one ("No result backend is configured")."""
    app._backend_cache = None
    vars(app._local).pop("backend", None)


def configure(redis_url: str) -> None:
    base = redis_url.rsplit("/", 1)[0]
    forget_backend()
    app.conf.update(
        broker_url=f"{base}/1",
        result_backend=f"{base}/2",
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # The migration shims' settings, as their users write them (the backend and URL are
        # accepted and never connected to: the keys live on DJANGO_REDLOCK["default"]).
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": f"{base}/3", "default_timeout": 60 * 60, "using": "default"},
        },
        singleton_key_prefix="lock_prefix:",
        singleton_backend_url=f"{base}/3",
    )
    if os.environ.get("REDLOCK_TEST_REDELIVER"):
        # acks_late with a 2-second visibility timeout, swept every second: a task running
        # longer has its message delivered again while it runs.
        app.conf.update(
            task_acks_late=True,
            broker_transport_options={
                "visibility_timeout": 2,
                "unacked_restore_interval": 1,
                "unacked_restore_throttle": 1,
            },
        )
    if os.environ.get("REDLOCK_TEST_NO_RESULTS"):  # no result backend: no state is stored
        app.conf.result_backend = None
    if os.environ.get("REDLOCK_TEST_ACKS_LATE"):  # a running task keeps its prefetch slot
        app.conf.task_acks_late = True
    if os.environ.get("REDLOCK_TEST_MAX_TASKS_PER_CHILD"):  # a child exits after N tasks
        app.conf.worker_max_tasks_per_child = int(os.environ["REDLOCK_TEST_MAX_TASKS_PER_CHILD"])
    if os.environ.get("REDLOCK_TEST_SLOW_REVOKE"):
        # A result backend slow to store REVOKED (a database one under load): Celery's
        # Request.terminate stops the run, then stores REVOKED, then sends task_revoked.
        import time

        from celery.backends.base import Backend

        real = Backend.mark_as_revoked
        pause = float(os.environ["REDLOCK_TEST_SLOW_REVOKE"])

        def slow(self: Backend, *args: object, **kwargs: object) -> object:
            time.sleep(pause)
            return real(self, *args, **kwargs)

        Backend.mark_as_revoked = slow  # type: ignore[method-assign]


if "REDLOCK_TEST_REDIS" in os.environ:  # the worker process
    import django

    django.setup()
    configure(os.environ["REDLOCK_TEST_REDIS"])
