"""The admin: "Held locks" (live, from every backend) and "Lock incidents" (a table)."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import mark_safe

from .backends.base import LockInfo, Released, glob_escape
from .backends.cursors import BadCursor
from .display import holder_parts, holder_text, holder_title, holds
from .exceptions import LockError
from .handler import locks
from .health import Health, lost_recently, ping, summarise
from .incidents import recorder
from .models import HeldLock, LockIncident
from .validation import check_name, check_text

PAGE_SIZE = 100
KINDS = ("plain", "reentrant", "fair", "semaphore", "read-write")
ORDERS = {
    "name": lambda row: row.info.name,
    "ttl": lambda row: row.info.ttl if row.info.ttl is not None else float("inf"),
    "age": lambda row: -(row.info.acquired_at.timestamp() if row.info.acquired_at else 0),
}


@dataclass
class Row:
    info: LockInfo
    note: str = ""  # on the confirmation page: why this row will not be released
    lost: int = 0  # holds of this lock lost in the last hour (lock incidents)
    kind: str = ""  # in words ("semaphore, 2 of 3 permits held"); else the info's kind

    def __post_init__(self) -> None:
        self.kind = self.kind or self.info.kind

    @property
    def ident(self) -> str:
        """The row as a form value: the lock, and the hold of it that was shown (a plain
        hold's token, else its fence), so that a release leaves a lock that changed hands
        since alone. The fence travels as a string: exact, however large."""
        info = self.info
        fence = None if info.token or info.fence is None else str(info.fence)
        return json.dumps([info.backend, info.name, info.token or None, fence])

    @property
    def name_breaks(self) -> str:
        """The name, escaped, with a line-break opportunity after each separator (``:``,
        ``/``, ``.``, ...): a long name wraps between its parts, never inside one."""
        parts = re.split(r"(?<=[:/._\-@|=,])", self.info.name)
        return mark_safe("<wbr>".join(escape(part) for part in parts))

    @property
    def holder(self) -> str:
        return holder_text(self.info.holder)

    @property
    def holder_parts(self) -> tuple[str, str]:
        return holder_parts(self.info.holder)

    @property
    def holder_title(self) -> str:
        return holder_title(self.info.holder)


def _pattern(search: str) -> str:
    search = search.strip()
    if not search:
        return "*"
    # A glob as typed; else a prefix, every character of it literal (a '\\' too).
    return search if any(c in search for c in "*?[") else f"{glob_escape(search)}*"


@dataclass(frozen=True)
class Choice:
    """A lock picked for release, and what its hold was when it was shown (None, None: the
    form did not say)."""

    alias: str
    name: str
    token: str | None
    fence: int | None

    @property
    def expected(self) -> bool:
        return self.token is not None or self.fence is not None

    def matches(self, info: LockInfo) -> bool:
        if self.token is not None:
            return info.token == self.token
        return info.fence is not None and info.fence == self.fence


def _choice(value: str) -> Choice | None:
    """A row's form value (``Row.ident``); None for anything else."""
    try:
        loaded = json.loads(value)
    except (ValueError, RecursionError):
        return None
    if not isinstance(loaded, list) or len(loaded) not in (2, 4):
        return None
    alias, name, token, fence = [*loaded, None, None][:4]
    if not (isinstance(alias, str) and isinstance(name, str) and alias in locks.settings):
        return None
    try:  # a crafted form: a name no lock may have, a token that is not text
        check_name(name)
        if token is not None:
            check_text(token, "token")
    except (TypeError, ValueError):
        return None
    if not (token is None or (isinstance(token, str) and token)):
        return None
    if not (
        fence is None
        or (isinstance(fence, str) and fence.isascii() and fence.isdigit() and len(fence) <= 20)
    ):
        return None
    return Choice(alias, name, token, None if fence is None else int(fence))


def _selected(request: HttpRequest) -> list[Choice]:
    values = [request.POST["single"]] if "single" in request.POST else request.POST.getlist("lock")
    return [choice for choice in map(_choice, values) if choice is not None]


def _cursors(raw: str) -> dict[str, str | None] | None:
    """The "next page" cursors, one per alias, as the page made them; None for anything else
    (a URL is anyone's to edit)."""
    if len(raw) > 10_000:
        return None
    try:
        cursors = json.loads(raw or "{}")
    except (ValueError, RecursionError):
        return None
    if not isinstance(cursors, dict) or not all(
        isinstance(value, str) or value is None for value in cursors.values()
    ):
        return None
    return cursors


class ReadOnly:
    """Nothing here is added, changed or deleted through the admin's forms."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(HeldLock)
class HeldLockAdmin(ReadOnly, admin.ModelAdmin):
    """Rows come from the backends (``SCAN``-paged), not from a table."""

    def has_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_redlock.force_release"))

    def get_urls(self) -> list[URLPattern]:
        names = f"{self.opts.app_label}_{self.opts.model_name}"
        view = self.admin_site.admin_view
        return [
            path("", view(self.changelist_view), name=f"{names}_changelist"),
            path("release/", view(self.release_view), name=f"{names}_release"),
        ]

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        search = request.GET.get("q", "")
        only_backend = request.GET.get("backend", "")
        kind = request.GET.get("kind", "")
        order = request.GET.get("o", "")
        cursors = _cursors(request.GET.get("cursor", ""))
        # One PING per backend: a backend that is down is a banner, and is not paged.
        health = {alias: ping(locks[alias]) for alias in locks}
        page = None
        if cursors is not None:
            with contextlib.suppress(BadCursor):  # a backend refused its cursor
                page = self._page(search, only_backend, kind, cursors, health)
        if page is None:  # a crafted or stale link: the first page, never a 500
            messages.warning(request, "That page link is not valid: here is the first page.")
            cursors = {}
            page = self._page(search, only_backend, kind, cursors, health)
        rows, banners, following = page
        # Two queries, whatever the number of locks: lost holds per backend, and per row.
        for (alias, _), count in lost_recently().items():
            if alias in health:
                health[alias].lost = count
        lost = lost_recently((row.info.backend, row.info.name) for row in rows)
        for row in rows:
            row.lost = lost.get((row.info.backend, row.info.name), 0)
        if order.lstrip("-") in ORDERS:
            rows.sort(key=ORDERS[order.lstrip("-")], reverse=order.startswith("-"))
        query = {k: v for k, v in request.GET.items() if k != "cursor"}
        next_url = None
        if any(value is not None for value in following.values()):
            next_url = "?" + urlencode({**query, "cursor": json.dumps(following)})
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Held locks",
            "rows": rows,
            "banners": banners,
            "health": list(health.values()),
            "backends": list(locks),
            "kinds": KINDS,
            "orders": [
                ("name", "name"),
                ("ttl", "TTL left"),
                ("-ttl", "TTL left, most first"),
                ("age", "oldest first"),
                ("-age", "newest first"),
            ],
            "search": search,
            "only_backend": only_backend,
            "kind": kind,
            "order": order,
            "next_url": next_url,
            "first_url": "?" + urlencode(query) if cursors else None,
            "can_release": self.has_release_permission(request),
            "today": timezone.localdate(),  # a hold's date is shown when it is not today's
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/django_redlock/heldlock/change_list.html", context)

    def _page(
        self,
        search: str,
        only_backend: str,
        kind: str,
        cursors: dict[str, str | None],
        health: dict[str, Health],
    ) -> tuple[list[Row], list[tuple[str, str]], dict[str, str | None]]:
        """One page of every backend (BadCursor: a cursor that backend did not make); the
        health lines count what each backend's page holds."""
        rows: list[Row] = []
        banners: list[tuple[str, str]] = []
        following: dict[str, str | None] = {}
        for alias in locks:
            if only_backend and alias != only_backend:
                continue
            if alias in cursors and cursors[alias] is None:
                following[alias] = None  # this backend's pages are done
                continue
            if not health[alias].up:
                banners.append((alias, health[alias].detail))
                continue
            try:
                found, following[alias] = locks[alias].page(
                    _pattern(search), cursors.get(alias), PAGE_SIZE
                )
            except LockError as exc:
                banners.append((alias, str(exc)))
                health[alias].up, health[alias].detail = False, str(exc)
                following[alias] = cursors.get(alias) or ""  # the next page asks again
                continue
            summarise(health[alias], found).more = following[alias] is not None
            # A semaphore or read-write lock: a row per lease, each released on its own.
            rows += [
                Row(row, kind=words)
                for info in found
                for row, words in holds(info)
                if not kind or kind in row.kind.split()
            ]
        return rows, banners, following

    def release_view(self, request: HttpRequest) -> HttpResponse:
        changelist = reverse("admin:django_redlock_heldlock_changelist")
        if request.method != "POST":
            return HttpResponseRedirect(changelist)
        if not self.has_release_permission(request):
            raise PermissionDenied
        chosen = _selected(request)
        if not chosen:
            messages.warning(request, "No locks were selected.")
            return HttpResponseRedirect(changelist)
        if request.POST.get("confirm") != "yes":
            rows = [self._confirming(choice) for choice in chosen]
            context = {
                **self.admin_site.each_context(request),
                "opts": self.opts,
                "title": "Force-release these locks?",
                "rows": rows,
                "releasable": [row for row in rows if not row.note],
            }
            return TemplateResponse(
                request, "admin/django_redlock/heldlock/release_confirmation.html", context
            )
        released = 0
        content_type = ContentType.objects.get_for_model(HeldLock, for_concrete_model=False)
        for choice in chosen:
            alias, name = choice.alias, choice.name
            if not choice.expected:  # "yes" to a hold nobody was shown: not a confirmation
                messages.warning(request, f"“{name}” on {alias} was not confirmed; not released.")
                continue
            try:
                outcome = locks[alias].force_release(name, choice.token, choice.fence)
            except LockError as exc:
                messages.error(request, f"“{name}” on {alias}: {exc}")
                continue
            if outcome is Released.CHANGED:
                messages.warning(
                    request, f"“{name}” on {alias} changed hands since you looked; not released."
                )
            if not outcome:
                continue
            released += 1
            LogEntry.objects.create(
                user_id=request.user.pk,
                content_type_id=content_type.pk,
                object_id=f"{alias}:{name}",
                object_repr=f"{name} ({alias})"[:200],
                action_flag=DELETION,
                change_message="Force-released the lock.",
            )
            recorder.record("force_release", name, alias, f"by {request.user}", user=request.user)
        messages.success(request, f"Force-released {released} of {len(chosen)} locks.")
        return HttpResponseRedirect(changelist)

    def _confirming(self, choice: Choice) -> Row:
        """A row of the confirmation page: the hold as it is now, which is what "yes"
        releases; noted (and not offered) when it is gone or is not the one listed."""
        try:
            info = locks[choice.alias].inspect(choice.name)
        except LockError as exc:
            return Row(LockInfo(choice.name, choice.alias, "?", None, None), f"unavailable: {exc}")
        kind = ""
        if info is not None and info.holders:  # a lease: the one listed, if still there
            info, kind = next(((r, k) for r, k in holds(info) if choice.matches(r)), (None, ""))
        if info is None:
            return Row(LockInfo(choice.name, choice.alias, "?", None, None), "no longer held")
        if choice.expected and not choice.matches(info):
            return Row(info, "changed hands since you looked; it will not be released")
        return Row(info, kind=kind)


@admin.register(LockIncident)
class LockIncidentAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("created_at", "kind", "name", "backend", "user", "detail")
    list_filter = ("kind", "backend", "created_at")
    search_fields = ("name", "detail")
    date_hierarchy = "created_at"
