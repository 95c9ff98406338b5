"""The admin: "Held locks" (live, from every backend) and "Lock incidents" (a table)."""

from __future__ import annotations

import json
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

from .backends.base import LockInfo
from .exceptions import LockError
from .handler import locks
from .incidents import recorder
from .models import HeldLock, LockIncident

PAGE_SIZE = 100
KINDS = ("plain", "reentrant", "fair")
ORDERS = {
    "name": lambda row: row.info.name,
    "ttl": lambda row: row.info.ttl if row.info.ttl is not None else float("inf"),
    "age": lambda row: -(row.info.acquired_at.timestamp() if row.info.acquired_at else 0),
}


@dataclass
class Row:
    info: LockInfo

    @property
    def ident(self) -> str:
        return json.dumps([self.info.backend, self.info.name])

    @property
    def holder(self) -> str:
        h = self.info.holder
        where = f"{h.get('h', '?')} pid {h.get('p', '?')} {h.get('t', '')}".strip()
        if h.get("k"):
            return f"Celery task {h['k']} ({h.get('n', '')}) on {where}"
        return where


def _pattern(search: str) -> str:
    search = search.strip()
    if not search:
        return "*"
    return search if any(c in search for c in "*?[") else f"{search}*"


def _selected(request: HttpRequest) -> list[tuple[str, str]]:
    values = [request.POST["single"]] if "single" in request.POST else request.POST.getlist("lock")
    chosen = []
    for value in values:
        try:
            alias, name = json.loads(value)
        except (ValueError, TypeError):
            continue
        if isinstance(alias, str) and isinstance(name, str) and alias in locks.settings:
            chosen.append((alias, name))
    return chosen


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
        try:
            cursors = json.loads(request.GET.get("cursor") or "{}")
        except ValueError:
            cursors = {}
        rows: list[Row] = []
        banners: list[tuple[str, str]] = []
        following: dict[str, str | None] = {}
        for alias in locks:
            if only_backend and alias != only_backend:
                continue
            if alias in cursors and cursors[alias] is None:
                following[alias] = None  # this backend's pages are done
                continue
            try:
                found, following[alias] = locks[alias].page(
                    _pattern(search), cursors.get(alias), PAGE_SIZE
                )
            except LockError as exc:
                banners.append((alias, str(exc)))
                continue
            rows += [Row(info) for info in found if not kind or kind in info.kind.split()]
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
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/django_redlock/heldlock/change_list.html", context)

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
            context = {
                **self.admin_site.each_context(request),
                "opts": self.opts,
                "title": "Force-release these locks?",
                "rows": [Row(self._info(alias, name)) for alias, name in chosen],
            }
            return TemplateResponse(
                request, "admin/django_redlock/heldlock/release_confirmation.html", context
            )
        released = 0
        content_type = ContentType.objects.get_for_model(HeldLock, for_concrete_model=False)
        for alias, name in chosen:
            try:
                if not locks[alias].force_release(name):
                    continue
            except LockError as exc:
                messages.error(request, f"{name} on {alias}: {exc}")
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

    def _info(self, alias: str, name: str) -> LockInfo:
        try:
            info = locks[alias].inspect(name)
        except LockError:
            info = None
        return info or LockInfo(name, alias, "?", None, None)


@admin.register(LockIncident)
class LockIncidentAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("created_at", "kind", "name", "backend", "user", "detail")
    list_filter = ("kind", "backend", "created_at")
    search_fields = ("name", "detail")
    date_hierarchy = "created_at"
