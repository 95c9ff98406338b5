"""The Celery kind's worker app (celery_kind.py): ``celery -A tests.campaign.celery_worker
worker``, configured by the environment variable CAMPAIGN_CELERY (JSON).

Three ``@single_instance`` tasks: ``campaign.skip`` (``on_duplicate="skip"``),
``campaign.dedupe`` (the same with ``dedupe_queued``) and ``campaign.coalesce``. Every task
logs, one JSON line per event in a file of its process:
``pre`` (it starts), ``run`` / ``done`` (its body begins / ends), ``post`` (its outcome: the
return value, or the exception's type). A call may carry a *jolt*: Celery's
``SoftTimeLimitExceeded`` raised by a SIGALRM handler ``delay`` microseconds after the task
starts (so in the acquire, right after it, or in the body), once or as a burst (every
``every`` us, ``count`` times: more land while the first unwinds), as a soft time limit
firing at any line would. Only inside the task's call: the handler does nothing outside it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import django
from django.conf import settings

CONFIG = json.loads(os.environ["CAMPAIGN_CELERY"])
TTL = float(CONFIG["ttl"])

settings.configure(
    INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "django_redlock"],
    DATABASES={},
    DJANGO_REDLOCK_INCIDENTS={"KINDS": []},
    DJANGO_REDLOCK_METRICS=False,
    DJANGO_REDLOCK={"default": {
        "BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": CONFIG["lock_url"],
        "OPTIONS": {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}, "TTL": TTL}},
    USE_TZ=True,
)  # fmt: skip
django.setup()

from celery import Celery  # noqa: E402
from celery.exceptions import SoftTimeLimitExceeded  # noqa: E402
from celery.signals import task_postrun, task_prerun  # noqa: E402

from django_redlock import lock, single_instance  # noqa: E402
from django_redlock.contrib.celery import SingleInstanceTask  # noqa: E402

app = Celery("campaign", broker=CONFIG["broker_url"], backend=CONFIG["result_url"])
app.conf.update(
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_fds: dict[int, int] = {}
#: CAMPAIGN_BREAK=stranded | coalesce (self-tests, celery_kind.py): a broken worker.
BREAK = os.environ.get("CAMPAIGN_BREAK", "")
_leaked: list[Any] = []


def log(event: str, **fields: Any) -> None:
    pid = os.getpid()
    if pid not in _fds:
        path = os.path.join(CONFIG["dir"], f"w{pid}.jsonl")
        _fds[pid] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    record = {"t": time.time(), "pid": pid, "e": event, **fields}
    os.write(_fds[pid], (json.dumps(record, default=str) + "\n").encode())


class _Jolt:
    armed = False
    left = 0


def _on_alarm(signum: int, frame: Any) -> None:
    if not _Jolt.armed:
        return
    _Jolt.left -= 1
    if _Jolt.left <= 0:
        signal.setitimer(signal.ITIMER_REAL, 0)
    raise SoftTimeLimitExceeded("campaign jolt")


class Jolted(SingleInstanceTask):  # type: ignore[misc]
    """Arms the call's jolt around the task's own call (the single_instance wrapper and the
    body), and disarms it before Celery's tracer goes on. (SingleInstanceTask: for
    ``dedupe_queued``; the producer's send_task() sets no queue marker, the run still clears
    it: one round trip between the acquire and the body, which latency widens.)"""

    abstract = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        jolt = kwargs.pop("jolt", None)
        if jolt:
            signal.signal(signal.SIGALRM, _on_alarm)
            _Jolt.armed, _Jolt.left = True, int(jolt["count"])
            every = float(jolt["every"]) / 1e6 if jolt["count"] > 1 else 0.0
            signal.setitimer(signal.ITIMER_REAL, max(1e-6, float(jolt["delay"]) / 1e6), every)
        try:
            result = super().__call__(*args, **kwargs)
        except SoftTimeLimitExceeded:
            _Jolt.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            if BREAK == "stranded":  # self-test: a hold left renewed, as issue #41's was
                _leaked.append(lock(f"campaign-{self.name.rsplit('.', 1)[-1]}:{kwargs['key']}"))
                _leaked[-1].acquire(blocking=False)
            raise
        finally:
            _Jolt.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        # Self-test: the first duplicate of an episode queues one more run than the rule's.
        coalesced = isinstance(result, dict) and result.get("coalesced")
        if BREAK == "coalesce" and coalesced and kwargs.get("tag") == "dup0":
            self.apply_async(kwargs={**kwargs, "tag": "extra"}, queue="campaign", countdown=2.0)
        return result


def body(key: str, tag: str, seconds: float, task_id: str) -> str:
    log("run", key=key, tag=tag, id=task_id)
    time.sleep(seconds)
    log("done", key=key, tag=tag, id=task_id)
    return "ran"


@app.task(bind=True, base=Jolted, name="campaign.skip")
@single_instance(key="campaign-skip:{key}", ttl=TTL, on_duplicate="skip")
def skip(self: Any, key: str, tag: str, seconds: float) -> str:
    return body(key, tag, seconds, self.request.id)


@app.task(bind=True, base=Jolted, name="campaign.dedupe")
@single_instance(key="campaign-dedupe:{key}", ttl=TTL, dedupe_queued=True)
def dedupe(self: Any, key: str, tag: str, seconds: float) -> str:
    return body(key, tag, seconds, self.request.id)


@app.task(bind=True, base=Jolted, name="campaign.coalesce")
@single_instance(key="campaign-coalesce:{key}", ttl=TTL, on_duplicate="coalesce")
def coalesce(self: Any, key: str, tag: str, seconds: float) -> str:
    return body(key, tag, seconds, self.request.id)


@task_prerun.connect
def _pre(task_id: str = "", task: Any = None, args: Any = (), kwargs: Any = None,
         **_: Any) -> None:  # fmt: skip
    log("pre", id=task_id, name=getattr(task, "name", ""), args=list(args or ()),
        kw={k: v for k, v in (kwargs or {}).items() if k != "jolt"},
        jolt=(kwargs or {}).get("jolt"))  # fmt: skip


@task_postrun.connect
def _post(task_id: str = "", retval: Any = None, state: str = "", **_: Any) -> None:
    if isinstance(retval, BaseException):
        outcome = {"exc": type(retval).__name__, "msg": str(retval)[:300],
                   "module": type(retval).__module__}  # fmt: skip
    elif isinstance(retval, dict):
        outcome = {"ret": {k: v for k, v in retval.items() if isinstance(v, (str, bool, int))}}
    else:
        outcome = {"ret": retval}
    log("post", id=task_id, state=state, **outcome)
