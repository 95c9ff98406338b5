"""The admin's changelist page with 100,000 held locks."""

from __future__ import annotations

import secrets
import statistics
import time
from typing import Any


def admin_listing(results: dict[str, Any]) -> None:
    from django.contrib import admin
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import RequestFactory

    from django_redlock import locks
    from django_redlock.admin import HeldLockAdmin
    from django_redlock.backends.base import Kind, Op
    from django_redlock.models import HeldLock

    call_command("migrate", verbosity=0)  # the page reads lost holds from the incidents
    backend = locks["default"]
    for start in range(0, 100_000, 5000):  # 100k held locks, 5,000 per pipelined round trip
        ops = [backend.op_acquire(f"admin:{i}", secrets.token_urlsafe(16), 300_000, "bench", Kind())
               for i in range(start, start + 5000)]  # fmt: skip
        backend.execute(Op("admin", [op.request for op in ops], list))
    model_admin = HeldLockAdmin(HeldLock, admin.site)
    user = User(username="bench", is_superuser=True, is_staff=True, is_active=True)
    times = []
    for _ in range(5):
        request = RequestFactory().get("/admin/django_redlock/heldlock/", {"backend": "default"})
        request.user = user
        started = time.perf_counter()
        response = model_admin.changelist_view(request)
        response.render()
        times.append(time.perf_counter() - started)
    rows = response.content.count(b'class="redlock-row"')
    backend.client.flushdb()  # type: ignore[attr-defined]
    results["admin"] = {"page_seconds": statistics.median(times), "rows_on_page": rows}
