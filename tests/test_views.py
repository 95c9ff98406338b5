"""@lock_view on sync, async and class-based views, through Django's WSGI and ASGI clients."""

from __future__ import annotations

import asyncio

import pytest
from django.test import AsyncClient, Client

from django_redlock import lock, lock_view

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
