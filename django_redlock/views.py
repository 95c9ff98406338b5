"""``@lock_view``: a view that answers 409 (with Retry-After) instead of running twice at once."""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

from django.http import HttpRequest, HttpResponse

from .exceptions import BackendUnavailable, LockError
from .handler import DEFAULT_LOCK_ALIAS
from .locking import Lock
from .validation import check_name, check_optional_seconds

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger("django_redlock")


def lock_view(
    name: str,
    *,
    timeout: float = 0,
    status: int = 409,
    ttl: float | None = None,
    using: str = DEFAULT_LOCK_ALIAS,
) -> Callable[[F], F]:
    """Run the view under a lock; when it is busy, answer ``status`` without running it.

    ``name`` is a ``str.format`` template over ``request`` and the view's URL kwargs, e.g.
    ``"checkout:{request.user.pk}"``. Works on sync and async function views, and on
    class-based views through ``method_decorator(lock_view(...), name="dispatch")``. A Redis
    that does not answer gives 503.
    """
    check_name(name)
    timeout = check_optional_seconds(timeout, "timeout", allow_zero=True) or 0.0
    if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
        raise ValueError(f"status must be an HTTP error status (400-599), not {status!r}")
    Lock(name, ttl=ttl, using=using)  # the other arguments are checked now, not per request

    def make(request: HttpRequest, kwargs: dict[str, Any]) -> Lock:
        return Lock(name.format(request=request, **kwargs), ttl=ttl, using=using)

    def busy(seconds_left: float | None) -> HttpResponse:
        response = HttpResponse("This is being done already; try again shortly.", status=status)
        response["Retry-After"] = str(max(1, math.ceil(seconds_left or 1)))
        return response

    def unavailable() -> HttpResponse:
        return HttpResponse("The lock service is unavailable.", status=503)

    def decorate(view: F) -> F:
        if inspect.iscoroutinefunction(view):

            @functools.wraps(view)
            async def async_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                held = make(request, kwargs)
                try:
                    if not await held.aacquire(timeout=timeout):
                        return busy(await held.attl())
                except BackendUnavailable:
                    return unavailable()
                try:
                    return await view(request, *args, **kwargs)
                finally:
                    try:
                        await held.arelease()
                    except LockError as exc:  # it runs out at its TTL; the answer stands
                        logger.warning("redlock: %s", exc)

            return cast(F, async_view)

        @functools.wraps(view)
        def sync_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            # The thread driver explicitly: a sync view may run where a loop is running.
            held = make(request, kwargs)
            try:
                if not held._drive(held._acquire(True, timeout)):
                    return busy(held._drive(held._ttl()))
            except BackendUnavailable:
                return unavailable()
            try:
                return view(request, *args, **kwargs)
            finally:
                try:
                    held._drive(held._release())
                except LockError as exc:  # it runs out at its TTL; the answer stands
                    logger.warning("redlock: %s", exc)

        return cast(F, sync_view)

    return decorate
