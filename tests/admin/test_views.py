"""@lock_view on sync, async and class-based views, through Django's WSGI and ASGI clients."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, RequestFactory, override_settings
from django.utils.decorators import method_decorator

from django_redlock import lock, lock_view, locks
from django_redlock.testing import RedisServer
from django_redlock.validation import fit_name

pytestmark = pytest.mark.django_db


def test_free_lock_runs_the_view() -> None:
    response = Client().get("/checkout/5/")
    assert response.status_code == 200 and response.content == b"checked out 5"
    assert not lock("checkout:5").locked()  # released after the view


def test_busy_lock_answers_409_with_retry_after() -> None:
    with lock("checkout:5", ttl=7):
        response = Client().get("/checkout/5/")
        assert response.status_code == 409
        assert 1 <= int(response["Retry-After"]) <= 7
        assert Client().get("/checkout/6/").status_code == 200  # another user is free


def test_async_view_through_asgi() -> None:
    client = AsyncClient()
    assert asyncio.run(client.get("/checkout-async/5/")).status_code == 200
    with lock("checkout:5", ttl=30):
        response = asyncio.run(client.get("/checkout-async/5/"))
    assert response.status_code == 423 and 1 <= int(response["Retry-After"]) <= 30


def test_class_based_view() -> None:
    assert Client().get("/report/").content == b"report"
    with lock("report:GET"):
        assert Client().get("/report/").status_code == 409


def test_redis_down_answers_503() -> None:
    response = Client().get("/checkout-down/?cart=1")
    assert response.status_code == 503
    response = asyncio.run(AsyncClient().get("/checkout-down-async/3/"))
    assert response.status_code == 503 and response.content != b"ran"


def test_bad_lock_view_arguments() -> None:
    with pytest.raises(ValueError, match="status"):
        lock_view("x", status=200)
    with pytest.raises(ValueError, match="timeout"):
        lock_view("x", timeout=-1)
    with pytest.raises(ValueError, match="unknown lock backend"):
        lock_view("x", using="nope")


@pytest.mark.parametrize(
    ("path", "value"),
    [("x" * 2000, "x" * 2000), ("é" * 1000, "é" * 1000), ("%F0%9F%94%92" * 300, "🔒" * 300)],
)
def test_any_url_value_makes_a_lock_name(path: str, value: str) -> None:
    response = Client().get(f"/long/{path}/")
    assert response.status_code == 200  # not a 500 for a name over 1024 bytes
    assert response.content == str(len(value)).encode()
    with lock(fit_name(f"long:{value}"), ttl=10):  # the view's lock: long names are hashed
        assert Client().get(f"/long/{path}/").status_code == 409
    assert Client().get("/long/short/").status_code == 200


@pytest.mark.parametrize("path", ["a%00b", "%00", "x" * 1500 + "%00"])
def test_a_url_value_holding_a_nul_is_a_bad_request(path: str) -> None:
    """It passed the name check, took the lock, and a fenced view then failed in PostgreSQL
    (text cannot hold NUL): a 500. No lock name may hold a NUL: a 400, before any Redis call."""
    before = locks["default"].round_trips
    response = Client().get(f"/long/{path}/")
    assert response.status_code == 400
    assert locks["default"].round_trips == before


def test_template_is_checked_against_the_view_at_decoration() -> None:
    def view(request: HttpRequest, user_id: int) -> HttpResponse:
        return HttpResponse("ran")

    lock_view("u:{user_id}:{request.user.pk}")(view)  # fine
    with pytest.raises(ValueError, match=r"'order_id'.*view\(request.*user_id"):
        lock_view("o:{order_id}")(view)
    with pytest.raises(ValueError, match="names"):
        lock_view("o:{0}")

    def named_otherwise(req: HttpRequest) -> HttpResponse:
        return HttpResponse("ran")

    with pytest.raises(ValueError, match="'req'"):  # the request is `request` in a template
        lock_view("o:{req.path}")(named_otherwise)


def test_view_over_kwargs_is_checked_per_request() -> None:
    assert Client().get("/order/3/").content == b"ran"
    with lock("order:3"):
        assert Client().get("/order/3/").status_code == 409
    with pytest.raises(ValueError, match=r"'order_id'.*user_id"):
        Client().get("/order-without-id/3/")


def test_limit_lets_n_requests_in() -> None:
    """@lock_view(..., limit=2): two requests per name at once; the third gets 409."""
    from django.test import RequestFactory

    from django_redlock import semaphore

    @lock_view("exports:{kind}", limit=2, ttl=9)
    def export(request: HttpRequest, kind: str) -> HttpResponse:
        return HttpResponse(f"free {semaphore(f'exports:{kind}', 2).available()}")

    request = RequestFactory().get("/")
    assert export(request, kind="csv").content == b"free 1"
    with semaphore("exports:csv", 2):
        assert export(request, kind="csv").content == b"free 0"
        with semaphore("exports:csv", 2):
            response = export(request, kind="csv")
            assert response.status_code == 409 and 1 <= int(response["Retry-After"]) <= 30
    with pytest.raises(TypeError, match="limit"):
        lock_view("x", limit=True)
    with pytest.raises(ValueError, match="limit"):
        lock_view("x", limit=0)


def _concurrent_statuses(path: str) -> list[int]:
    async def scenario() -> list[int]:
        client = AsyncClient()
        responses = await asyncio.gather(*(client.get(path) for _ in range(3)))
        return sorted(r.status_code for r in responses)

    return asyncio.run(scenario())


@pytest.mark.parametrize("path", ["/slow-async/", "/slow-async-as-view/"])
def test_an_async_class_based_view_runs_under_its_lock(path: str) -> None:
    """``method_decorator(lock_view(...), name="dispatch")`` on an async view: View.dispatch
    is sync and returns the handler's coroutine, awaited while the lock is held. And
    ``lock_view`` over ``AsyncView.as_view()`` (marked the asyncio way)."""
    from tests.support.urls import SLOW_INSIDE

    SLOW_INSIDE.peak = 0
    assert _concurrent_statuses(path) == [200, 409, 409]
    assert SLOW_INSIDE.peak == 1
    assert not lock("slow:GET").locked()
    with lock("slow:GET", ttl=5):  # busy: the 409, not a 500 from awaiting a response
        response = asyncio.run(AsyncClient().get(path))
    assert response.status_code == 409 and 1 <= int(response["Retry-After"]) <= 5


def test_an_async_class_based_view_on_a_real_server(live_server: Any) -> None:
    """The same through a real server (threads; an event loop per request)."""
    from tests.support.urls import SLOW_INSIDE

    SLOW_INSIDE.peak = 0

    def get(_: int) -> int:
        try:
            with urllib.request.urlopen(f"{live_server.url}/slow-async/", timeout=10) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    with ThreadPoolExecutor(3) as pool:
        statuses = sorted(pool.map(get, range(3)))
    assert statuses == [200, 409, 409] and SLOW_INSIDE.peak == 1


def test_redlock_without_a_majority_answers_503(redis_server: RedisServer) -> None:
    """Redlock raises QuorumNotReached (not BackendUnavailable) with most nodes down."""
    nodes = [
        f"redis://127.0.0.1:{redis_server.port}/0",
        "redis://127.0.0.1:9/0",
        "redis://127.0.0.1:9/1",
    ]
    quorum = {
        "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
        "LOCATION": nodes,
        "OPTIONS": {"socket_connect_timeout": 0.3},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "quorum": quorum}):

        @lock_view("quorum:{request.method}", using="quorum")
        def sync_view(request: HttpRequest) -> HttpResponse:
            return HttpResponse("ran")

        @lock_view("quorum:{request.method}", using="quorum")
        async def async_view(request: HttpRequest) -> HttpResponse:
            return HttpResponse("ran")

        request = RequestFactory().get("/")
        assert sync_view(request).status_code == 503
        assert asyncio.run(async_view(request)).status_code == 503


def test_a_missing_query_parameter_answers_400() -> None:
    """``{request.GET[cart]}`` with no ``cart``: the client's to fix (not a 500)."""
    response = Client().get("/checkout-down/")
    assert response.status_code == 400 and b"cart" in response.content


def test_waiting_for_an_async_class_based_views_lock_does_not_stall_the_loop() -> None:
    """``timeout=1`` on a busy lock: the wait is the asyncio one (before, the thread driver
    waited in the event loop's own thread, and nothing else ran for the whole second)."""
    from tests.support.urls import SlowAsyncView

    view = method_decorator(lock_view("stall:{request.method}", timeout=1), name="dispatch")(
        type("Waiting", (SlowAsyncView,), {})
    ).as_view()

    async def scenario() -> tuple[int, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        response = await view(RequestFactory().get("/"))
        ticker.cancel()
        return response.status_code, ticks

    with lock("stall:GET", ttl=5):
        status, ticks = asyncio.run(scenario())
    assert status == 409 and ticks >= 10


def test_an_async_views_release_cancelled_by_a_disconnect_is_finished_all_the_same(
    redis_factory: Callable[..., RedisServer], name: str
) -> None:
    """The client leaves (Django's ASGI handler cancels the view's task) while the lock's
    release waits for the pool's only connection, busy with a command to a paused server.
    The release is finished by a task of its own, as ``async with`` does: the next request
    is not refused until the lock's TTL."""
    server = redis_factory()
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": server.url,
        "OPTIONS": {"max_connections": 1, "socket_timeout": 3},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "one": config}):

        async def scenario() -> float:
            entered, leave = asyncio.Event(), asyncio.Event()

            @lock_view(name, using="one", ttl=20)
            async def view(request: HttpRequest) -> HttpResponse:
                entered.set()
                await leave.wait()
                return HttpResponse("done")

            task = asyncio.create_task(view(RequestFactory().get("/")))
            await entered.wait()
            server.pause()
            busy = asyncio.create_task(lock(f"{name}:other", using="one").alocked())
            await asyncio.sleep(0.2)  # it has the only connection, waiting for an answer
            leave.set()  # the view returns: its release waits for the connection
            await asyncio.sleep(0.2)
            task.cancel()  # the client left
            with contextlib.suppress(asyncio.CancelledError):
                await task
            server.resume()
            with contextlib.suppress(Exception):
                await busy
            started = time.monotonic()
            assert await lock(name, using="one").aacquire(timeout=15)
            return time.monotonic() - started

        waited = asyncio.run(scenario())
        locks["one"].close()
    assert waited < 2, f"the next request waited {waited:.1f} s for the lock"
