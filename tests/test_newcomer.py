"""The newcomer's path: what a new user meets first, tried as a new user would."""

from __future__ import annotations

from io import StringIO

from django.core import checks
from django.core.management import call_command
from django.test import override_settings


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
