import asyncio
import threading

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View

from django_redlock import lock, lock_view


def locked_sync(request: HttpRequest) -> HttpResponse:
    with lock("view:sync", using="local", reentrant=True) as held:
        return HttpResponse(f"held {held.hold_count()}")


async def locked_async(request: HttpRequest) -> HttpResponse:
    async with lock("view:async", using="redis", reentrant=True) as held:
        return HttpResponse(f"held {await held.ahold_count()}")


@lock_view("checkout:{user_id}", ttl=20)
def checkout(request: HttpRequest, user_id: int) -> HttpResponse:
    return HttpResponse(f"checked out {user_id}")


@lock_view("checkout:{user_id}", ttl=20, status=423)
async def checkout_async(request: HttpRequest, user_id: int) -> HttpResponse:
    return HttpResponse(f"checked out {user_id} (async)")


@lock_view("checkout:{request.GET[cart]}", using="down")
def checkout_down(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ran")


@lock_view("checkout:{user_id}", using="down")
async def checkout_down_async(request: HttpRequest, user_id: int) -> HttpResponse:
    return HttpResponse("ran")


@lock_view("long:{value}")
def long_value(request: HttpRequest, value: str) -> HttpResponse:
    return HttpResponse(f"{len(value)}")


@lock_view("order:{order_id}")
def any_kwargs(request: HttpRequest, **kwargs: object) -> HttpResponse:
    return HttpResponse("ran")


@method_decorator(lock_view("report:{request.method}"), name="dispatch")
class ReportView(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("report")


class Inside:
    """How many bodies of a view run at once (``peak``), across threads and loops."""

    def __init__(self) -> None:
        self.mutex, self.now, self.peak = threading.Lock(), 0, 0

    def __enter__(self) -> None:
        with self.mutex:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def __exit__(self, *exc: object) -> None:
        with self.mutex:
            self.now -= 1


SLOW_INSIDE = Inside()


class SlowAsyncView(View):
    """An async class-based view (``as_view()`` carries asgiref's coroutine marker)."""

    async def get(self, request: HttpRequest) -> HttpResponse:
        with SLOW_INSIDE:
            await asyncio.sleep(0.4)
        return HttpResponse("slow")


@method_decorator(lock_view("slow:{request.method}", ttl=20), name="dispatch")
class LockedSlowAsyncView(SlowAsyncView):
    """Decorated the way docs/topics/views.md shows class-based views."""


urlpatterns = [
    path("admin/", admin.site.urls),
    path("locked-sync/", locked_sync),
    path("locked-async/", locked_async),
    path("checkout/<int:user_id>/", checkout),
    path("checkout-async/<int:user_id>/", checkout_async),
    path("checkout-down/", checkout_down),
    path("checkout-down-async/<int:user_id>/", checkout_down_async),
    path("report/", ReportView.as_view()),
    path("slow-async/", LockedSlowAsyncView.as_view()),
    path("slow-async-as-view/", lock_view("slow:{request.method}")(SlowAsyncView.as_view())),
    path("long/<str:value>/", long_value),
    path("order/<int:order_id>/", any_kwargs),
    path("order-without-id/<int:user_id>/", any_kwargs),
]
