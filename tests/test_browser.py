"""The admin in a real headless Chromium (Debian's), driven by Playwright for Python.

Screenshots land in test-artifacts/ (docs/admin-held-locks.png is one of them).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from django_redlock import locks

from .conftest import ROOT, Child
from .factories import UserFactory

ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
    return path


@pytest.fixture
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; the ORM calls the live server
    # fixture and the test make here are ordinary synchronous ones.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS
        )
        yield instance
        instance.close()
    os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@pytest.mark.django_db(transaction=True)
def test_force_release_through_the_admin_in_a_browser(
    live_server: Any, browser: Any, child: Callable[..., Child]
) -> None:
    UserFactory(username="ops", is_superuser=True)
    holder = child("hold", "--name", "nightly:<export>", "--ttl", "1.5")
    holder.expect("ACQUIRED")
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 700})
    # default, redis and cache share one server in these settings: look at one of them.
    page.goto(
        f"{live_server.url}/admin/login/?next=/admin/django_redlock/heldlock/%3Fbackend%3Dredis"
    )
    page.fill("#id_username", "ops")
    page.fill("#id_password", "secret")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    row = page.locator("tr.redlock-row", has_text="nightly:<export>")
    assert row.count() == 1  # the name shows as text, escaped, not as markup
    assert "redis" in row.inner_text()
    page.screenshot(path=str(ARTIFACTS / "admin-held-locks.png"), full_page=True)
    row.get_by_role("button", name="Force-release").click()
    page.wait_for_selector("#release-list")
    assert "nightly:<export>" in page.inner_text("#release-list")
    page.screenshot(path=str(ARTIFACTS / "admin-release-confirmation.png"))
    page.click("#confirm-release")
    page.wait_for_selector("ul.messagelist")
    assert "Force-released 1 of 1 locks." in page.inner_text("ul.messagelist")
    assert page.locator("tr.redlock-row", has_text="nightly:<export>").count() == 0
    assert not locks["redis"].is_locked("nightly:<export>")
    assert "released by someone else" in holder.expect("LOST")  # the holder finds out
    page.screenshot(path=str(ARTIFACTS / "admin-after-release.png"))
    assert Path(ARTIFACTS / "admin-held-locks.png").stat().st_size > 10_000
