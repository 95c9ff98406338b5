"""At most 2 exports at once, however many are asked for and however many workers run them:
``@single_instance(limit=2)`` takes a permit of a semaphore of 2 for each run. The others
retry until a permit frees (a crashed worker's permit frees at its TTL)."""

import time

from celery import shared_task

from django_redlock import semaphore, single_instance

from . import stock

EXPORTS = "exports"  # the semaphore's name: the task's key
LIMIT = 2


@shared_task(bind=True, max_retries=None)
@single_instance(key=EXPORTS, ttl=30, limit=LIMIT, on_duplicate="retry", countdown=1)
def export_report(self, seconds: float = 3.0) -> str:
    """A heavy export (say, a CSV of every order): two at once at most, to spare the database."""
    running = semaphore(EXPORTS, LIMIT).holders()
    stock.redis().rpush("shop:exports:runs", f"{self.request.id} with {len(running)} running")
    time.sleep(seconds)
    return "exported"


def running_exports() -> int:
    return LIMIT - semaphore(EXPORTS, LIMIT).available()
