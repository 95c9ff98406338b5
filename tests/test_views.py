"""@lock_view on sync, async and class-based views, through Django's WSGI and ASGI clients."""

from __future__ import annotations

import asyncio

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client

from django_redlock import lock, lock_view, locks
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
