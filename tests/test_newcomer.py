"""The newcomer's path: what a new user meets first, tried as a new user would."""

from __future__ import annotations

from io import StringIO
from types import SimpleNamespace
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.core import checks
from django.core.management import call_command
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory, override_settings

from django_redlock import lock, lock_view


def _w002(**settings: object) -> list[checks.CheckMessage]:
    with override_settings(**settings):
        return [m for m in checks.run_checks() if m.id == "django_redlock.W002"]


def test_a_misspelt_setting_is_a_warning_naming_the_right_one() -> None:
    found = _w002(DJANGO_REDLOCKS={"default": {}}, DJANGO_REDLOCK_INCIDENT={"KEEP_DAYS": 1})
    assert [m.obj for m in found] == ["DJANGO_REDLOCKS", "DJANGO_REDLOCK_INCIDENT"]
    assert "Did you mean DJANGO_REDLOCK?" in str(found[0].hint)
    assert "Did you mean DJANGO_REDLOCK_INCIDENTS?" in str(found[1].hint)
    assert "no effect" in found[0].msg


def test_known_settings_are_not_warned_about() -> None:
    known = {"DJANGO_REDLOCK_INCIDENTS": {}, "DJANGO_REDLOCK_METRICS": False,
             "DJANGO_REDLOCK_BEAT": {"using": "default", "ttl": 30}}  # fmt: skip
    assert _w002(**known) == []


def test_manage_py_check_shows_the_misspelt_setting() -> None:
    err = StringIO()
    with override_settings(DJANGO_REDLOCK_METRIC=False):
        call_command("check", stderr=err, stdout=StringIO())
    assert "DJANGO_REDLOCK_METRIC: (django_redlock.W002)" in err.getvalue()
    assert "Did you mean DJANGO_REDLOCK_METRICS?" in err.getvalue()


def _user_view() -> Any:
    @lock_view("checkout:{request.user.pk}", timeout=0)
    def checkout(request: HttpRequest) -> HttpResponse:
        return HttpResponse(f"checked out {request.user.pk}")

    return checkout


def test_lock_view_on_request_user_refuses_anonymous_users_clearly() -> None:
    request = RequestFactory().get("/checkout/")
    request.user = AnonymousUser()
    with pytest.raises(ValueError) as caught:
        _user_view()(request)
    message = str(caught.value)
    assert "{request.user.pk}" in message and "anonymous" in message
    assert "'checkout:None'" in message  # the one lock they would all share
    assert "@login_required" in message and "{request.session.session_key}" in message


def test_lock_view_on_request_user_still_serves_users() -> None:
    request = RequestFactory().get("/checkout/")
    request.user = SimpleNamespace(pk=7, is_anonymous=False)
    assert _user_view()(request).content == b"checked out 7"


def test_lock_view_on_the_session_key_needs_a_session() -> None:
    @lock_view("cart:{request.session.session_key}", timeout=0)
    def cart(request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")

    request = RequestFactory().get("/cart/")
    request.session = SimpleNamespace(session_key=None)
    with pytest.raises(ValueError, match=r"no session yet.*'cart:None'"):
        cart(request)
    request.session = SimpleNamespace(session_key="abc")
    assert cart(request).content == b"ok"
    with lock("cart:abc"):
        assert cart(request).status_code == 409  # one visitor's lock, by session
