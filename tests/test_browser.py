"""The admin in a real headless Chromium (Debian's), driven by Playwright for Python.

Screenshots land in test-artifacts/ (docs/admin-held-locks.png is one of them).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from django_redlock import lock, locks
from django_redlock.testing import free_port

from .conftest import ROOT, Child
from .demo_run import Demo
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
    page = browser.new_page(viewport={"width": 1280, "height": 700})
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


SEPARATORS = ":/._-@|=,"
# Where the text of each element wraps: the character before and after each line break.
WRAPS_JS = """cells => cells.map(cell => {
  const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT), wraps = [];
  let top = null, before = null;
  while (walker.nextNode()) {
    const node = walker.currentNode;
    for (let i = 0; i < node.length; i++) {
      const range = document.createRange(); range.setStart(node, i); range.setEnd(node, i + 1);
      const rect = range.getClientRects()[0];
      if (!rect) continue;
      if (top !== null && rect.top > top + 2) wraps.push(before + node.data[i]);
      top = rect.top; before = node.data[i];
    }
  }
  return [cell.textContent, wraps];
})"""


def test_the_demo_home_page_and_admin_in_a_browser(browser: Any, tmp_path: Path) -> None:
    """`make demo` in Chromium at 1280 px: the live panel shows locks at work, and the admin
    lists them with names that wrap only between their parts. Screenshots for docs/."""
    ARTIFACTS.mkdir(exist_ok=True)
    demo = Demo(free_port(), tmp_path)
    try:
        redis_url = demo.wait_ready()
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(f"{demo.base}/experiment/")
        page.click("button.primary")
        page.wait_for_selector("#results")
        page.goto(f"{demo.base}/")
        page.click("#buy")
        page.click("#desk")
        page.click("#sync")
        # The live panel, refreshed every second: the desk's fair lock held by a clerk task
        # with the others waiting, and the nightly sync held by its one task (both at once:
        # the worker's threads may start them a refresh apart).
        page.wait_for_function(
            """() => {
                 const rows = [...document.querySelectorAll("tr.lock-row")].map(r => r.innerText);
                 return rows.some(t => t.startsWith("desk") && /\\s[12]\\s*$/.test(t))
                   && rows.some(t => t.startsWith("nightly-sync"));
               }""",
            timeout=20_000,
        )
        rows = page.locator("tr.lock-row")
        text = rows.all_inner_texts()
        assert any(t.startswith("desk") and "task desk_shift" in t for t in text), text
        assert any(t.startswith("nightly-sync") and "task nightly_sync" in t for t in text), text
        chart = page.inner_text("[data-panel=experiment]")
        assert "with django-redlock" in chart and "50 sold, 0 oversold" in chart
        assert "oversold" in chart.split("with django-redlock")[0]  # without a lock
        handoffs = page.locator("[data-panel=handoffs] tr").all_inner_texts()
        assert any(h.startswith("desk") for h in handoffs), handoffs
        with page.expect_request(lambda r: r.url.endswith("/live.json"), timeout=2500):
            pass  # the page polls on its own
        page.wait_for_timeout(600)  # a second clerk has the desk: a hand-off in the list
        page.screenshot(path=str(ARTIFACTS / "demo-home.png"), full_page=True)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280
        home_names = page.locator("#live-locks td.name").all()
        for name, wraps in page.evaluate(WRAPS_JS, [n.element_handle() for n in home_names]):
            assert wraps == [], (name, wraps)

        # The admin, with a long name held in the demo's Redis (next to the clerks' locks).
        demo_locks = {
            "BACKEND": "django_redlock.backends.redis.RedisBackend",
            "LOCATION": redis_url.rsplit("/", 1)[0] + "/3",
            "KEY_PREFIX": "shop",
        }
        long_name = "report:customer-4711:2026-11:monthly-invoice-export:eu-west-1.archive"
        # Playwright's sync API runs an event loop here: a one-try acquire is the sync one
        # that works in it.
        with override_settings(DJANGO_REDLOCK={"default": demo_locks}):
            held = lock(long_name, ttl=60)
            assert held.acquire(blocking=False)
            page.goto(f"{demo.base}/admin/login/?next=/admin/django_redlock/heldlock/")
            page.fill("#id_username", "demo")
            page.fill("#id_password", "demo-password")
            page.click("input[type=submit]")
            page.wait_for_selector("#result_list")
            assert page.locator("tr.redlock-row", has_text=long_name).count() == 1
            page.screenshot(path=str(ARTIFACTS / "demo-admin.png"), full_page=True)
            # The table fits 1280 px: no sideways scrolling.
            assert page.evaluate("document.documentElement.scrollWidth") <= 1280
            cells = page.locator("#result_list td.name").all()
            found = dict(page.evaluate(WRAPS_JS, [c.element_handle() for c in cells]))
            held.release()
        assert found[long_name], "the long name fits one line: it tests no wrapping"
        for name, wraps in found.items():
            for wrap in wraps:  # only after a separator, never inside a word
                assert wrap[0] in SEPARATORS, (name, wraps)
    finally:
        demo.stop()


@pytest.mark.django_db(transaction=True)
def test_the_lock_health_summary_in_a_browser(live_server: Any, browser: Any) -> None:
    """A held lock with 2 waiters shows 2 and how long they waited; "down" shows as down."""
    UserFactory(username="ops", is_superuser=True)
    holder = lock("invoice:export", using="redis")
    assert holder.acquire(blocking=False)  # (Playwright runs an event loop in this thread)

    def wait() -> None:
        with lock("invoice:export", using="redis", timeout=30):
            pass

    waiters = [threading.Thread(target=wait) for _ in range(2)]
    for thread in waiters:
        thread.start()
    try:
        deadline = time.monotonic() + 10
        while (info := locks["redis"].inspect("invoice:export")) is None or info.waiters < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(1.2)  # so the longest wait reads over a second
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{live_server.url}/admin/login/?next=/admin/django_redlock/heldlock/")
        page.fill("#id_username", "ops")
        page.fill("#id_password", "secret")
        page.click("input[type=submit]")
        page.wait_for_selector("#redlock-health")
        down = page.locator("#redlock-health tr[data-backend=down]")
        assert down.locator("td.status").inner_text().startswith("down")
        redis_line = page.locator("#redlock-health tr[data-backend=redis]")
        assert redis_line.locator("td.status").inner_text() == "up"
        assert redis_line.locator("td.latency").inner_text().endswith(" ms")
        assert redis_line.locator("td.waiting").inner_text() == "2"
        row = page.locator("tr.redlock-row", has_text="invoice:export").filter(has_text="redis")
        assert row.first.locator("td.waiters").inner_text() == "2"
        longest = row.first.locator("td.longest").inner_text()
        assert longest.endswith(" s") and float(longest[:-2]) >= 1.0
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "admin-lock-health.png"), full_page=True)
    finally:
        holder.release()
        for thread in waiters:
            thread.join()
