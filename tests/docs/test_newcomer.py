"""The newcomer's path: what a new user meets first, tried as a new user would."""

from __future__ import annotations

import asyncio
import html
import os
import re
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis as redis_py
from django.contrib.auth.models import AnonymousUser
from django.core import checks
from django.core.management import call_command
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory, override_settings

from django_redlock import lock, lock_view
from django_redlock.testing import RedisServer, free_port

from ..conftest import ROOT
from ..support.readme import as_settings_py, newcomer_settings


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


# --- The distribution, and a brand-new project installed from its wheel --------------------


@dataclass
class Dist:
    wheel: Path
    sdist: Path
    log: str


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """``python -m build``, once per session: the sdist, and the wheel built from the sdist
    (so a file missing from the sdist is missing from the wheel too)."""
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = built.stdout + built.stderr
    assert built.returncode == 0, log
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return Dist(wheel, sdist, log)


def test_the_sdist_and_wheel_build_cleanly(dist: Dist) -> None:
    # setuptools' walls of warnings (lua/ and templates/ seen as namespace packages)
    assert "absent from the `packages` configuration" not in dist.log, dist.log
    assert "WARNING" not in dist.log.replace("warning: build_py: byte-compiling", ""), dist.log
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(dist.wheel), str(dist.sdist)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with zipfile.ZipFile(dist.wheel) as wheel:
        inside = set(wheel.namelist())
    package = ROOT / "django_redlock"
    needed = [
        *package.glob("lua/*.lua"), *package.glob("templates/**/*.html"),
        *package.glob("migrations/*.py"), package / "py.typed",
    ]  # fmt: skip
    assert len(needed) > 15
    missing = [str(p.relative_to(ROOT)) for p in needed if str(p.relative_to(ROOT)) not in inside]
    assert missing == []
    assert all(name.startswith("django_redlock") for name in inside), inside
    with tarfile.open(dist.sdist) as sdist:
        names = sdist.getnames()
    assert not [n for n in names if "/tests/" in n or "__pycache__" in n]
    assert any(n.endswith("/django_redlock/lua/acquire.lua") for n in names)


def test_the_readme_installs_the_wheel_that_is_built(dist: Dist) -> None:
    """The Install section names the wheel file: it must be the one `python -m build` makes
    (a version bump that forgets the README fails here)."""
    install = (ROOT / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert f"/dist/{dist.wheel.name}[celery]" in install
    assert "pip install django-redlock" in install  # and says why that does not work yet


NEWCOMER_APP = {
    "__init__.py": "",
    "tasks.py": """
import time

import redis
from celery import shared_task
from django.conf import settings

from django_redlock import single_instance


@shared_task(bind=True)
@single_instance(key="sync:{customer_id}", ttl=60, on_duplicate="skip")
def sync_customer(self, customer_id):
    redis.Redis.from_url(settings.RUNS_URL).rpush("runs", self.request.id)
    time.sleep(2)
    return "synced"
""",
    "views.py": """
import time

from django.contrib.auth.decorators import login_required
from django.http import HttpResponse

from django_redlock import lock_view


@lock_view("order:{order_id}", timeout=0)
def pay(request, order_id):
    time.sleep(1.5)
    return HttpResponse(f"paid {order_id}")


@lock_view("checkout:{request.user.pk}", timeout=0)  # without @login_required: the mistake
def checkout(request):
    return HttpResponse("checked out")
""",
}
CELERY_PY = """
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")
app = Celery("mysite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""
URLS_PY = """
from django.contrib import admin
from django.urls import path

from shop import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("pay/<int:order_id>/", views.pay),
    path("checkout/", views.checkout),
]
"""
LOCK_SCRIPT = """
import django_redlock
from django_redlock import lock, locks
print("FROM", django_redlock.__file__)
with lock("invoice:42", timeout=5) as held:
    print("FENCE", held.fence, locks["default"].inspect("invoice:42") is not None)
print("FREE", not lock("invoice:42").locked())
"""
TASK_SCRIPT = """
from shop.tasks import sync_customer
first, second = sync_customer.delay(7), sync_customer.delay(customer_id=7)
print("RESULTS", sorted(map(str, (first.get(timeout=60), second.get(timeout=60)))))
"""


@pytest.mark.timeout(600)
def test_a_new_project_from_the_wheel_with_a_real_worker(
    dist: Dist, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A new user: a fresh virtualenv, the built wheel (not this checkout), startproject,
    the README's settings pasted in, then a lock, views and a Celery task on a real worker."""
    venv = tmp_path / "venv"
    # Without a pip of its own (ensurepip: 6 s on a loaded machine): the suite's pip installs
    # into it (`pip --python`), the same wheel and dependencies as the venv's own pip would.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)  # fmt: skip
    bin_ = venv / "bin"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV")}  # fmt: skip
    env |= {"PATH": f"{bin_}:{env['PATH']}", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PYTHONUNBUFFERED": "1"}  # fmt: skip

    def run(*args: str, cwd: Path = tmp_path, timeout: float = 120) -> str:
        done = subprocess.run(
            args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    run(sys.executable, "-m", "pip", "--python", str(bin_ / "python"), "install", "--quiet",
        f"{dist.wheel}[celery]", timeout=480)  # fmt: skip
    run(str(bin_ / "django-admin"), "startproject", "mysite")
    site = tmp_path / "mysite"
    (site / "shop").mkdir()
    for filename, text in NEWCOMER_APP.items():
        (site / "shop" / filename).write_text(text)
    (site / "mysite" / "celery.py").write_text(CELERY_PY)
    (site / "mysite" / "__init__.py").write_text("from .celery import app as celery_app\n")
    (site / "mysite" / "urls.py").write_text(URLS_PY)
    server = f"redis://127.0.0.1:{redis_server.port}"
    blocks = newcomer_settings()
    assert [b.section for b in blocks] == ["Install", "Settings", "Settings"]
    pasted = "".join(as_settings_py(b.source) for b in blocks)
    settings_py = site / "mysite" / "settings.py"
    settings_py.write_text(
        settings_py.read_text()
        + "\n# From the README\n"
        + pasted.replace("redis://127.0.0.1:6379", server)
        + '\nINSTALLED_APPS += ["shop"]\n'
        + f'CELERY_BROKER_URL = "{server}/5"\nCELERY_RESULT_BACKEND = "{server}/6"\n'
        + f'RUNS_URL = "{server}/7"\n'
    )
    manage = (str(bin_ / "python"), "manage.py")
    run(*manage, "migrate", "--noinput", cwd=site)
    checked = run(*manage, "check", cwd=site)  # README: the "cache" alias, and only it, warns
    assert "DJANGO_REDLOCK['cache']: (django_redlock.W001)" in checked
    assert "1 issue" in checked, checked

    # A lock, from the installed wheel.
    out = run(*manage, "shell", "-c", LOCK_SCRIPT, cwd=site)
    assert str(venv) in out.split("FROM", 1)[1].split()[0], out  # not this checkout
    assert re.search(r"FENCE \d{16} True", out) and "FREE True" in out, out

    # Views on the dev server: one payment per order at a time; anonymous users refused.
    port = free_port()
    web = subprocess.Popen(
        [*manage, "runserver", f"127.0.0.1:{port}", "--noreload"],
        cwd=site, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    worker = subprocess.Popen(
        [str(bin_ / "celery"), "-A", "mysite", "worker", "-P", "threads", "-c", "2",
         "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
        cwd=site, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for(base)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_get, f"{base}/pay/1/")
            time.sleep(0.5)
            second = pool.submit(_get, f"{base}/pay/1/")
            other = pool.submit(_get, f"{base}/pay/2/")
            answers = [first.result(), second.result(), other.result()]
        assert answers[0][:2] == (200, "paid 1")
        assert answers[1][0] == 409 and int(answers[1][2]["Retry-After"]) >= 1
        assert answers[2][:2] == (200, "paid 2")
        status, body, _ = _get(f"{base}/checkout/")
        assert status == 500 and "every anonymous visitor would share" in html.unescape(body)

        # A Celery task sent twice at once runs once, on a real worker.
        assert worker.stdout is not None
        for line in worker.stdout:
            if "ready." in line:
                break
        out = run(*manage, "shell", "-c", TASK_SCRIPT, cwd=site, timeout=120)
        # One ran; the duplicate's result is the documented skip sentinel, naming the holder.
        assert "RESULTS ['synced', \"{'redlock': 'duplicate_skipped', 'key': 'sync:7'," in out, out
        runs = redis_py.Redis.from_url(f"{server}/7")
        assert runs.llen("runs") == 1
    finally:
        for process in (web, worker):
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        redis_py.Redis.from_url(f"{server}/7").flushdb()


def _get(url: str) -> tuple[int, str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(), error.headers


def _wait_for(url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/admin/login/", timeout=5).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"runserver never answered at {url}"
            time.sleep(0.2)


def test_admin_names_break_only_after_separators_and_stay_escaped() -> None:
    from django_redlock.admin import Row
    from django_redlock.backends.base import LockInfo

    info = LockInfo(name="report:<b>&x/2026-11.csv", backend="redis", kind="plain",
                    fence=1, ttl=1.0)  # fmt: skip
    assert Row(info).name_breaks == "report:<wbr>&lt;b&gt;&amp;x/<wbr>2026-<wbr>11.<wbr>csv"


@pytest.mark.django_db(transaction=True)
def test_lock_view_on_request_user_in_an_async_view() -> None:
    """request.user is lazy (a session and a user query): read in the event loop it raised
    SynchronousOnlyOperation. The async view loads it the async way first."""
    from django.contrib.auth.middleware import AuthenticationMiddleware
    from django.contrib.sessions.middleware import SessionMiddleware

    from ..support.factories import UserFactory

    user = UserFactory(username="async-user")

    @lock_view("checkout:{request.user.pk}", timeout=0)
    async def checkout(request: HttpRequest) -> HttpResponse:
        return HttpResponse(f"checked out {request.user.pk}")

    def request_of(logged_in: bool) -> HttpRequest:
        request = RequestFactory().get("/checkout/")
        SessionMiddleware(lambda r: HttpResponse()).process_request(request)
        if logged_in:
            request.session["_auth_user_id"] = str(user.pk)
            request.session["_auth_user_backend"] = "django.contrib.auth.backends.ModelBackend"
            request.session["_auth_user_hash"] = user.get_session_auth_hash()
        AuthenticationMiddleware(lambda r: HttpResponse()).process_request(request)
        return request

    assert asyncio.run(checkout(request_of(True))).content == f"checked out {user.pk}".encode()
    with lock(f"checkout:{user.pk}"):
        assert asyncio.run(checkout(request_of(True))).status_code == 409
    with pytest.raises(ValueError, match="anonymous"):
        asyncio.run(checkout(request_of(False)))
