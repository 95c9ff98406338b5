"""``@lock_view``: a view that answers 409 (with Retry-After) instead of running twice at once."""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

from asgiref.sync import sync_to_async
from django.core.exceptions import BadRequest
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest

from .exceptions import (
    BackendUnavailable,
    LockError,
    LockNotAcquired,
    QuorumNotReached,
    StaleFence,
)
from .fencing import (
    database_of,
    drop_abandoned,
    fenced_transaction,
    log_after_exit,
    refuse_manual_commit,
)
from .handler import DEFAULT_LOCK_ALIAS
from .locking import BaseLock, Lock, Semaphore, finisher
from .locking.steps import drive
from .locking.templates import (
    is_async_callable,
    refuse_generator,
    refuse_generator_result,
    template_fields,
)
from .validation import check_limit, check_name, check_optional_seconds, fit_name

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger("django_redlock")


def lock_view(
    name: str,
    *,
    timeout: float = 0,
    status: int = 409,
    ttl: float | None = None,
    using: str = DEFAULT_LOCK_ALIAS,
    limit: int | None = None,
    atomic: bool | str | None = None,
) -> Callable[[F], F]:
    """Run the view under a lock; when it is busy, answer ``status`` without running it.

    ``limit=N``: at most N requests per name at once (a semaphore); ``status`` when all N
    permits are taken.

    ``atomic=True`` (or a ``DATABASES`` alias): the view runs in the lock's fenced transaction
    (see ``lock(..., atomic=)``), committed before the lock is released; under
    ``ATOMIC_REQUESTS`` it is a savepoint of the request's transaction. A stale hold
    (``StaleFence``), or a lock row another transaction kept locked past the lock's TTL,
    answers ``status`` like a busy lock, the view not run. An ``on_commit`` callback that
    fails after the commit is logged: the view's response stands. A ``StreamingHttpResponse``
    is produced after the commit and the release: write in the view, stream only what it
    committed. Sync views only; generator functions are refused (TypeError).

    ``name`` is a ``str.format`` template over ``request`` and the view's URL kwargs, e.g.
    ``"checkout:{request.user.pk}"``, checked against the view's parameters when it is
    decorated (a view taking ``**kwargs``: per request). A name over 200 bytes (a long URL
    value) is shortened to its start and a hash (:func:`~.validation.fit_name`), so any URL
    works (one whose value holds a NUL, which no lock name may, is answered 400); a
    parameter, header or cookie the template reads that the request lacks: 400.
    Works on sync and async views (any async callable: locking/templates.py's rule), and on
    class-based views, async ones too, through ``method_decorator(lock_view(...),
    name="dispatch")``. A Redis that does not answer (Redlock: no majority) gives 503. Any
    ``StreamingHttpResponse`` is produced after the release: the lock covers the view only.
    """
    return _ViewGuard(name, timeout, status, ttl, using, limit, atomic).decorate


class _ViewGuard:
    """One ``@lock_view(...)``'s arguments, checked, and what it does per request: build the
    request's lock from the template, take it (the thread driver in a sync view, which may
    run where an event loop is running), run the view (in the fenced transaction with
    ``atomic=``), release. Busy: ``status`` with Retry-After, the view not run; no answer
    from the backend: 503. A release that fails is logged: the hold runs out at its TTL and
    the view's response stands."""

    def __init__(
        self,
        name: str,
        timeout: float,
        status: int,
        ttl: float | None,
        using: str,
        limit: int | None,
        atomic: bool | str | None,
    ) -> None:
        """Every argument checked here, at decoration (ValueError, TypeError)."""
        check_name(name)
        self.name, self.roots = name, _roots(name)
        self.per_visitor = _per_visitor_fields(name)
        self.uses_user = any(field.startswith("request.user") for field in self.per_visitor)
        self.timeout = check_optional_seconds(timeout, "timeout", allow_zero=True) or 0.0
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(f"status must be an HTTP error status (400-599), not {status!r}")
        self.status = status
        self.limit = check_limit(limit) if limit is not None else None
        self.database = database_of(atomic)
        if self.database is not None and self.limit is not None:
            raise ValueError("atomic= does not combine with limit: N requests would hold at once")
        self.ttl, self.using = ttl, using
        self.build(name)  # the lock's own arguments are checked now, not per request

    def build(self, lock_name: str) -> BaseLock:
        if self.limit is None:
            return Lock(lock_name, ttl=self.ttl, using=self.using, atomic=self.database)
        return Semaphore(lock_name, self.limit, ttl=self.ttl, using=self.using)

    def make(self, view: Any, request: HttpRequest, kwargs: dict[str, Any]) -> BaseLock:
        """The lock of this request: the template filled from ``request`` and the URL
        kwargs (ValueError naming what is missing; a parameter, header or cookie the
        client did not send: 400), fitted to a key's length."""
        name = self.name
        try:
            text = name.format(request=request, **kwargs)
        except (KeyError, AttributeError, IndexError) as exc:
            missing = [root for root in self.roots if root != "request" and root not in kwargs]
            if missing:
                raise ValueError(
                    f"lock_view template {name!r} uses {missing[0]!r}, which this request's URL"
                    f" does not give to {_where(view)} (URL kwargs: {', '.join(kwargs) or 'none'})"
                ) from None
            if isinstance(exc, KeyError) and any(
                field.startswith(_CLIENT_SENT) for field in _fields(name)
            ):  # the request lacks what the client was to send: theirs to fix, not a 500
                raise _NotInRequest(f"this request gives no {exc} for the lock's name") from None
            raise ValueError(
                f"lock_view template {name!r} failed for this request to {_where(view)}: {exc!r}"
            ) from exc
        if self.per_visitor:
            _check_visitor(name, self.per_visitor, request, view, text)
        try:
            fitted = fit_name(text)
        except ValueError as exc:  # a URL value no name may hold (a NUL): the request's fault
            raise BadRequest(f"lock_view: {exc}") from None
        return self.build(fitted)

    def request_lock(
        self, view: Any, request: HttpRequest, kwargs: dict[str, Any]
    ) -> BaseLock | HttpResponse:
        """:meth:`make`'s lock, or a 400 when the request lacks a parameter, header or
        cookie that the template reads (``{request.GET[cart]}`` with no ``cart``)."""
        try:
            return self.make(view, request, kwargs)
        except _NotInRequest as exc:
            return HttpResponseBadRequest(str(exc).capitalize())

    def busy(self, seconds_left: float | None) -> HttpResponse:
        text = "This is being done already; try again shortly."
        response = HttpResponse(text, status=self.status)
        response["Retry-After"] = str(max(1, math.ceil(seconds_left or 1)))
        return response

    @staticmethod
    def unavailable() -> HttpResponse:
        return HttpResponse("The lock service is unavailable.", status=503)

    def decorate(self, view: F) -> F:
        refuse_generator(view, "@lock_view(...)")
        _check_roots(self.name, self.roots, view)
        if _is_async_view(view):  # the rule: locking/templates.py, "async callables"
            self.build(self.name).check_async()  # atomic=: Django's transactions are sync

            @functools.wraps(view)
            async def async_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                return await self.run_async(view, request, args, kwargs)

            return cast(F, async_view)

        @functools.wraps(view)
        def sync_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return self.run_sync(view, request, args, kwargs)

        return cast(F, sync_view)

    async def run_async(
        self, view: Any, request: HttpRequest, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if self.uses_user:  # request.user is loaded lazily, by a query: not in a loop
            await _load_user(request)
        held = self.request_lock(view, request, kwargs)
        if isinstance(held, HttpResponse):
            return held
        try:
            if not await held.aacquire(timeout=self.timeout):
                return self.busy(await held.attl())
        except (BackendUnavailable, QuorumNotReached):  # Redlock: no majority answered
            return self.unavailable()
        closed = False
        try:
            result = view(request, *args, **kwargs)  # dispatch() returns the handler's coroutine
            return await result if inspect.isawaitable(result) else result
        except GeneratorExit:
            # Closed (a loop torn down, the task collected): nothing can be awaited, and this
            # may be a finalizer: the finisher thread releases the hold (review asy, 2).
            closed = finisher.must_hand_over()
            if closed:
                held.release_closed()
            raise
        finally:
            if not closed:
                await self._arelease(held)

    async def _arelease(self, held: BaseLock) -> None:
        try:
            await finisher.arelease_exiting(held)  # as async with: cancelled, closed
        except LockError as exc:  # it runs out at its TTL; the answer stands
            logger.warning("redlock: %s", exc)

    def run_sync(
        self, view: Any, request: HttpRequest, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        # The thread driver explicitly: a sync view may run where a loop is running.
        held = self.request_lock(view, request, kwargs)
        if isinstance(held, HttpResponse):
            return held
        if self.database is not None:  # autocommit off: refused before the lock is taken
            drop_abandoned(self.database)  # (not a block's leftover transaction)
            refuse_manual_commit(self.database, held.describe())
        try:
            if not drive(held.backend, held.acquire_steps(True, self.timeout)):
                return self.busy(drive(held.backend, held.ttl_steps()))
        except (BackendUnavailable, QuorumNotReached):  # Redlock: no majority answered
            return self.unavailable()
        try:
            if self.database is None:
                return self.run_view(view, request, args, kwargs)
            ran, result, block = False, None, fenced_transaction(held)  # held.atomic()
            try:
                # A ``with`` statement of its own (not an ExitStack's): its frame tells when
                # its block is left (fencing.drop_abandoned), and an exception right after
                # the block opened still exits it. Commits (or rolls back) before the release.
                with block:
                    ran = True
                    result = self.run_view(view, request, args, kwargs)
            except (StaleFence, LockNotAcquired) as exc:
                if ran:
                    raise
                logger.warning("redlock: %s", exc)  # the view did not run (its row stayed locked)
                return self.busy(None)
            except Exception as exc:
                # A signal handler's exception once the block committed (CPython may run it
                # on the ``with`` line, after the exit returned): the view's answer stands.
                if not block.committed.done:
                    raise
                log_after_exit(held.describe(), exc)
            return result
        finally:
            try:
                drive(held.backend, held.release_steps())
            except Exception as exc:  # it runs out at its TTL; the answer stands
                logger.warning("redlock: %s", exc)

    @staticmethod
    def run_view(
        view: Any, request: HttpRequest, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        result = view(request, *args, **kwargs)
        refuse_generator_result(result, view, "@lock_view(...)")  # before the release
        return result


#: Template fields the client fills (a missing one answers 400), unlike URL kwargs.
_CLIENT_SENT = ("request.GET", "request.POST", "request.COOKIES", "request.headers", "request.META")


class _NotInRequest(Exception):
    """The request lacks a parameter, header or cookie the template reads."""


def _fields(template: str) -> list[str]:
    return [field for field in template_fields(template) if field]


def _is_async_view(view: Any) -> bool:
    """An async callable (:func:`~.locking.templates.is_async_callable`), or a bound method
    of an async class-based view: ``method_decorator(..., name="dispatch")`` hands over
    ``View.dispatch``, which is sync and returns the async handler's coroutine (the lock
    must be held while it is awaited)."""
    if is_async_callable(view):
        return True
    while isinstance(view, functools.partial):
        view = view.func
    instance = getattr(view, "__self__", None)
    try:
        return getattr(instance, "view_is_async", False) is True
    except Exception:  # Django's mixed-handlers ImproperlyConfigured: its own error later
        return False


def _roots(template: str) -> list[str]:
    """The names a template's fields start from (``request`` of ``{request.user.pk}``)."""
    roots = []
    for field in template_fields(template):  # those nested in a format spec too
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise ValueError(
                f"lock_view template {template!r}: use names (request or URL kwargs), not {{}}"
            )
        roots.append(root)
    return roots


async def _load_user(request: Any) -> None:
    """Load ``request.user`` the async way, so that the template can read it in the event
    loop (a lazy user read there raises SynchronousOnlyOperation): ``request.auser()`` on
    Django 5+, else the lazy object evaluated once in a thread."""
    auser = getattr(request, "auser", None)
    if auser is not None:
        request.user = await auser()
    elif hasattr(request, "user"):
        await sync_to_async(lambda: getattr(request.user, "pk", None))()


def _per_visitor_fields(template: str) -> list[str]:
    """The fields that tell one visitor from another: ``request.user...`` and
    ``request.session.session_key``."""
    fields = [field for field in template_fields(template) if field]
    return [f for f in fields if f.startswith("request.user") or f == "request.session.session_key"]


def _check_visitor(template: str, fields: list[str], request: Any, view: Any, text: str) -> None:
    """A per-visitor name must not be one lock shared by every anonymous visitor (or every
    visitor without a session yet): ``checkout:{request.user.pk}`` is ``checkout:None`` for
    all of them, so one anonymous checkout would turn all the others away."""
    for field in fields:
        if field.startswith("request.user"):
            user = getattr(request, "user", None)
            if user is not None and getattr(user, "is_anonymous", False):
                raise ValueError(
                    f"lock_view template {template!r} of {_where(view)} uses {{{field}}}, but"
                    f" this request's user is anonymous: every anonymous visitor would share the"
                    f" one lock {text!r}. Put @login_required above @lock_view, or key anonymous"
                    " visitors by their session ({request.session.session_key}) or address"
                    " ({request.META[REMOTE_ADDR]})."
                )
        elif getattr(getattr(request, "session", None), "session_key", None) is None:
            raise ValueError(
                f"lock_view template {template!r} of {_where(view)} uses {{{field}}}, but this"
                f" request has no session yet: every visitor without one would share the one"
                f" lock {text!r}. Save the session before this view (request.session.save()),"
                " or key visitors by address ({request.META[REMOTE_ADDR]})."
            )


def _check_roots(template: str, roots: list[str], view: Any) -> None:
    """Each root must be ``request`` or a parameter the URL can pass by name. A view taking
    ``**kwargs`` (or with no signature to read) is checked per request instead."""
    try:
        signature = inspect.signature(view)
    except (TypeError, ValueError):
        return
    params = list(signature.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    # The first parameter gets the request positionally (after `self`, for a method), so only
    # the name `request` reaches it in a template.
    first = next((i for i, p in enumerate(params) if p.name != "self"), 0)
    named = {
        p.name for p in params[first + 1 :] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    for root in roots:
        if root != "request" and root not in named:
            raise ValueError(
                f"lock_view template {template!r} uses {root!r}, which is neither request nor a"
                f" URL parameter of {_where(view)}{signature}"
            )


def _where(view: Any) -> str:
    return str(getattr(view, "__qualname__", None) or type(view).__qualname__)
