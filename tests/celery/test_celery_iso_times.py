"""``dedupe_queued`` with an ETA or ``expires=`` given as an ISO-8601 string, a form Celery
accepts and sends on as is (its retries send them so): the queue marker reads it as Celery
does. A real Redis broker, no worker."""

from __future__ import annotations

import datetime
import time
from typing import Any

from celery import shared_task

from django_redlock import single_instance
from django_redlock.contrib.celery import SingleInstanceTask
from tests.support import celery_tasks

from .test_celery import NOBODY, broker

__all__ = ["broker"]  # a fixture, imported to be used here


def _in(seconds: float) -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)


def test_a_string_expires_ends_the_queue_marker_with_the_message(broker: None) -> None:
    # The marker lasted dedupe_ttl (1 h): a call after the expiry joined a message that can
    # never run, and was lost.
    task = celery_tasks.deduped
    assert task.queue_marker_ttl({"expires": _in(1).isoformat()}) <= 1.0
    first = task.apply_async(("exp-str",), queue=NOBODY, expires=_in(1).isoformat())
    assert task.apply_async(("exp-str",), queue=NOBODY).id == first.id
    time.sleep(1.5)  # it cannot run any more: its marker went with it
    assert task.apply_async(("exp-str",), queue=NOBODY).id != first.id


@shared_task(bind=True, base=SingleInstanceTask, name="tests.celery.iso_times.eta_short")
@single_instance(key="eta-str:{name}", ttl=5, dedupe_queued=True, dedupe_ttl=1)
def eta_short(self: Any, name: str) -> str:
    return name


def test_a_string_eta_holds_the_queue_marker_past_dedupe_ttl(broker: None) -> None:
    # The marker lasted dedupe_ttl only: the key was queued again while the first message
    # still waited for its ETA (two runs).
    assert eta_short.queue_marker_ttl({"eta": _in(30).isoformat()}) > 29.0
    eta = _in(30).isoformat()
    first = eta_short.apply_async(("s",), queue=NOBODY, eta=eta)
    time.sleep(1.5)  # past dedupe_ttl, well before the ETA
    assert eta_short.apply_async(("s",), queue=NOBODY, eta=eta).id == first.id
