"""Two ``celery beat`` processes run in ``make demo``: which one leads, for every page."""

from typing import Any

from django.http import HttpRequest

from django_redlock import LockError
from django_redlock.contrib.beat import leader


def beat_leader(request: HttpRequest) -> dict[str, Any]:
    """Context processor: ``beat_leader`` (host, pid, fence) or None; ``beat_unknown`` when
    Redis did not answer."""
    try:
        return {"beat_leader": leader(), "beat_unknown": False}
    except LockError:
        return {"beat_leader": None, "beat_unknown": True}
