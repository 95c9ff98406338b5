"""The "at most 2 exports at once" demo: five exports asked for, two run at a time."""

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_POST

from . import stock
from .exports import LIMIT, export_report, running_exports


@require_POST
def exports(request: HttpRequest) -> HttpResponse:
    sent = [export_report.delay(3.0) for _ in range(5)]
    message = (
        f"{len(sent)} exports sent; at most {LIMIT} run at once (the others retry),"
        f" {running_exports()} running now. See them in the admin's Held locks."
    )
    return render(request, "shop/home.html", {"left": stock.left(), "message": message})
