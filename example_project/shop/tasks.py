"""The shop's background jobs: one at a time per key, whatever the number of workers."""

import time

from celery import shared_task

from django_redlock import lock, single_instance

from . import stock


@shared_task(bind=True)
@single_instance(key="nightly-sync", ttl=30, on_duplicate="skip")
def nightly_sync(self, seconds: float = 5.0) -> str:
    """A long job that must never run twice at once (say, syncing with the supplier)."""
    stock.redis().rpush(stock.SYNC_RUNS_KEY, self.request.id)
    time.sleep(seconds)
    return "synced"


@shared_task(bind=True, max_retries=5)
@single_instance(key="receipt:{order_id}", ttl=30, on_duplicate="retry", countdown=2)
def send_receipt(self, order_id: int) -> str:
    return f"receipt {order_id} sent"


@shared_task
def desk_shift(clerk: int, seconds: float = 2.5) -> int | None:
    """Clerks take turns at the one desk, in the order they came (a fair lock)."""
    with lock("desk", fair=True, ttl=10, timeout=30) as held:
        time.sleep(seconds)
        return held.fence


@shared_task
def heartbeat() -> str:
    """Sent by whichever beat leads, every 10 s: once, however many beats run."""
    stock.redis().rpush("shop:heartbeats", time.time())
    return "beat"


from .exports import export_report  # noqa: E402, F401  (Celery finds the shop's tasks here)
