from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import path

from django_redlock import lock


def locked_sync(request: HttpRequest) -> HttpResponse:
    with lock("view:sync", using="local", reentrant=True) as held:
        return HttpResponse(f"held {held.hold_count()}")


async def locked_async(request: HttpRequest) -> HttpResponse:
    async with lock("view:async", using="redis", reentrant=True) as held:
        return HttpResponse(f"held {await held.hold_count()}")


urlpatterns = [
    path("admin/", admin.site.urls),
    path("locked-sync/", locked_sync),
    path("locked-async/", locked_async),
]
