"""Celery tasks of the fenced-transaction tests (tests/fenced/test_fenced_celery.py): a ticket sale
in the task lock's fenced transaction, on the tests' PostgreSQL."""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task
from django.db import transaction

from django_redlock import locks, single_instance
from django_redlock.contrib.celery import SingleInstanceTask

from .fenced_child import sell_one


def _redis() -> Any:
    return locks["default"].client  # type: ignore[attr-defined]


@shared_task(bind=True, base=SingleInstanceTask)
@single_instance(key="fenced-sale:{ticket}", ttl=5, on_duplicate="raise", atomic="postgres")
def fenced_sale(
    self: Any, ticket: int, buyer: str, pause: bool = False, fail: bool = False
) -> bool:
    """Sell a seat; with ``pause``, say so in Redis once the stock is read, and wait for a
    go-ahead before writing; with ``fail``, raise once sold."""

    def wait() -> None:
        _redis().rpush(f"fenced-sale:{buyer}:read", 1)
        assert _redis().blpop(f"fenced-sale:{buyer}:go", 30), "no go-ahead"

    sold = sell_one("postgres", ticket, buyer, after_read=wait if pause else None)
    if fail:
        raise RuntimeError(f"the task failed after selling: {sold}")
    return sold


@shared_task(bind=True, base=SingleInstanceTask, autoretry_for=(ConnectionError,),
             max_retries=2, default_retry_delay=0)  # fmt: skip
@single_instance(key="fenced-mail:{ticket}", ttl=5, on_duplicate="raise", atomic="postgres")
def fenced_sale_with_mail(self: Any, ticket: int, buyer: str) -> bool:
    """Sell a seat, and mail the buyer once committed: the mail server is down (the callback
    raises ConnectionError, which autoretry_for retries)."""
    sold = sell_one("postgres", ticket, buyer)
    transaction.on_commit(_mail_server_down, using="postgres")
    return sold


def _mail_server_down() -> None:
    raise ConnectionError("the mail server is down")


@shared_task(bind=True, base=SingleInstanceTask, autoretry_for=(Exception,), max_retries=2,
             default_retry_delay=0, soft_time_limit=1)  # fmt: skip
@single_instance(key="fenced-slow:{ticket}", ttl=5, on_duplicate="raise", atomic="postgres")
def fenced_sale_slow_commit(self: Any, ticket: int, buyer: str) -> bool:
    """Sell a seat, then commit close to the soft time limit (the test's proxy holds the
    COMMIT's reply back: the limit fires while the reply is late)."""
    sold = sell_one("postgres", ticket, buyer)
    time.sleep(0.5)
    return sold
