"""The shop's background jobs: one at a time per key, whatever the number of workers."""

import time

from celery import shared_task

from django_redlock import single_instance

from . import stock


@shared_task(bind=True)
@single_instance(key="nightly-sync", ttl=30, on_duplicate="skip")
def nightly_sync(self, seconds: float = 5.0) -> str:
    """A long job that must never run twice at once (say, syncing with the supplier)."""
    stock.redis().rpush("shop:sync:runs", self.request.id)
    time.sleep(seconds)
    return "synced"


@shared_task(bind=True, max_retries=5)
@single_instance(key="receipt:{order_id}", ttl=30, on_duplicate="retry", countdown=2)
def send_receipt(self, order_id: int) -> str:
    return f"receipt {order_id} sent"


from .exports import export_report  # noqa: E402, F401  (Celery finds the shop's tasks here)
