"""A job on Django's Tasks framework (``django.tasks`` on Django 6.0+, the ``django-tasks``
backport before), run by django-tasks-db's ``db_worker``: one stock count at a time, and a
count asked for while one is queued or running is that one."""

import time

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

from django_redlock import single_instance

from . import stock

COUNTS_KEY = "demo:counts"


@task()
@single_instance(key="stock-count", ttl=30, dedupe_queued=True)
def count_stock(seconds: float = 2.0) -> int:
    """Count the tickets left (say, for the supplier's report)."""
    time.sleep(seconds)
    left = stock.left()
    stock.redis().rpush(COUNTS_KEY, left)
    return left


def count_twice() -> None:
    """What ``make demo`` does at start: ask for a count twice; the second is the first."""
    first, second = count_stock.enqueue(), count_stock.enqueue()
    print(
        f"demo: django.tasks: a stock count enqueued twice is queued once (task result"
        f" {first.id}, {'the same' if second.id == first.id else 'ANOTHER: ' + str(second.id)});"
        " db_worker runs it",
        flush=True,
    )
