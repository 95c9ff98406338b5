"""The "at most 2 exports at once" demo: five exports asked for, two run at a time."""

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from .exports import LIMIT, export_report, running_exports


@require_POST
def exports(request: HttpRequest) -> HttpResponse:
    sent = [export_report.delay(3.0) for _ in range(5)]
    messages.info(
        request,
        f"{len(sent)} exports sent; at most {LIMIT} run at once (the others retry),"
        f" {running_exports()} running now. See them in the admin's Held locks.",
    )
    return redirect("home")
