"""The admin in a real headless Chromium (Debian's), driven by Playwright for Python.

Screenshots land in test-artifacts/ (docs/admin-held-locks.png is one of them).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from django_redlock import lock, locks, semaphore
from django_redlock.testing import PostgresServer, free_port

from ..conftest import ROOT, Child
from ..support.demo_run import Demo
from ..support.factories import UserFactory

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
    _fits_the_page(page)  # with a column for the backend: the test settings have five
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


# The held locks' table and its column headers' widths: [right edge, the content's right edge,
# the scrolling box's scroll width and width], {header: width}.
TABLE_JS = """() => {
  const table = document.getElementById("result_list").getBoundingClientRect();
  const box = document.getElementById("redlock-results");
  const widths = Object.fromEntries([...document.querySelectorAll("#result_list thead th")]
    .map((th, i) => [th.innerText.replace(/\\s+/g, " ") || i, th.getBoundingClientRect().width]));
  return [table.right, document.getElementById("content-main").getBoundingClientRect().right,
          box.scrollWidth, box.clientWidth, widths];
}"""


def _fits_the_page(page: Any) -> None:
    """The held locks' table fits a 1280 px window: inside the page's content (its buttons
    too), nothing to scroll sideways, within the table or the page."""
    right, content, scroll_width, width, widths = page.evaluate(TABLE_JS)
    assert right <= content and scroll_width <= width, str(widths)
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280


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


# Each card of the home page: [left, top, width, bottom], in CSS pixels.
CARDS_JS = """() => Object.fromEntries(["shop", "live-locks", "live-handoffs", "live-experiment"]
  .map(id => { const r = document.getElementById(id).getBoundingClientRect();
               return [id, [r.left, r.top, r.width, r.bottom]]; }))"""
# The oversell experiment's ways: their text, and where each stands (side by side).
WAYS_JS = """() => [...document.querySelectorAll("[data-panel=experiment] .way")].map(way => ({
  way: way.dataset.way, label: way.querySelector(".label").innerText,
  sold: way.querySelector(".sold").innerText, explain: way.querySelector(".explain").innerText,
  top: way.getBoundingClientRect().top, left: way.getBoundingClientRect().left}))"""
# The hand-offs' rows: the text of each cell, whether it is a skipped duplicate, the fence's
# hover text.
HANDOFFS_JS = """() => [...document.querySelectorAll("tr.handoff")].map(row => ({
  cells: [...row.cells].map(cell => cell.innerText.trim()),
  skipped: row.classList.contains("skipped"), title: row.cells[2].title}))"""
# The text of each cell of the rows matched, row by row.
CELLS_JS = """rows => rows.map(row => [...row.cells].map(cell => cell.innerText.trim()))"""
# (innerText drops the cell's line break while the row is re-laid out: "MainThreadpid 1 on vm")
HOLDER = re.compile(r"(task \w+ [0-9a-f]{8}|[\w ._-]+)\n?pid \d+ on \S+")


def _cards_fit_together(cards: dict[str, list[float]]) -> None:
    """The panels, one under the other beside the shop, as wide as their column, 1rem apart:
    no empty band between two."""
    panels = [cards[card] for card in ("live-locks", "live-handoffs", "live-experiment")]
    for upper, lower in itertools.pairwise(panels):
        assert 0 < lower[1] - upper[3] <= 17, cards
        assert (lower[0], lower[2]) == (upper[0], upper[2]), cards
    assert cards["shop"][0] + cards["shop"][2] < panels[0][0] and cards["shop"][1] == panels[0][1]


@pytest.mark.timeout(300)
def test_the_demo_home_page_and_admin_in_a_browser(browser: Any, tmp_path: Path) -> None:
    """`make demo` in Chromium at 1280 px, on PostgreSQL (DATABASE_URL): the live panel shows
    locks at work, in the words the admin uses, and the oversell experiment's three ways side
    by side; the admin lists the locks in a table that fits, names wrapping only between their
    parts. Screenshots for docs/.

    Then, on the same demo (one start instead of two): a child that exits (here: the dev
    server, killed) stops the rest of the demo, which says so and exits non-zero (it used to
    exit 0). (test_demo.py's test stops its demo with Ctrl-C.)"""
    ARTIFACTS.mkdir(exist_ok=True)
    database = PostgresServer().start()  # (test_demo.py runs the demo on its SQLite)
    database_url = f"postgres://{database.user}@{database.host}:{database.port}/postgres"
    demo = Demo(free_port(), tmp_path, DATABASE_URL=database_url)
    try:
        redis_url = demo.wait_ready()
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        # Before anything ran (the beat's lock only): no empty band between the panels.
        page.goto(f"{demo.base}/")
        page.wait_for_selector("[data-panel=handoffs] tr.handoff")
        quiet = page.evaluate(CARDS_JS)
        _cards_fit_together(quiet)
        icon = page.request.get(f"{demo.base}/favicon.ico")
        assert icon.status == 200 and icon.headers["content-type"].startswith("image/")
        assert page.locator("link[rel=icon]").get_attribute("href") == "/favicon.ico"
        # What the buttons do, said on the page.
        buy_help = page.inner_text("#buy-help")
        assert "buyer:127.0.0.1" in buy_help and "409" in buy_help and "tickets" in buy_help
        page.click("#buy")
        page.click("#restock")
        assert page.inner_text("#restock") == "Reset the stock to 100"
        assert page.inner_text("#message") == "The stock is back to 100 tickets."
        assert page.inner_text("[data-live=left]") == "100"
        page.goto(f"{demo.base}/experiment/")
        page.click("button.primary")
        page.wait_for_selector("#results")
        page.goto(f"{demo.base}/")
        page.click("#buy")
        page.click("#exports")
        page.click("#desk")
        page.click("#sync")
        # The live panel, refreshed every second: the desk's fair lock held by a clerk task
        # with the others waiting, both permits of the exports' semaphore and the nightly sync
        # held by one task (all at once: the rows of one refresh)...
        rows = page.wait_for_function(
            """() => {
                 const rows = [...document.querySelectorAll("tr.lock-row")].map(row =>
                   [...row.cells].map(cell => cell.innerText.trim()));
                 return rows.some(r => r[0].startsWith("desk") && /^[12]$/.test(r[4]))
                   && rows.some(r => r[0].startsWith("nightly-sync"))
                   && rows.filter(r => r[0].startsWith("exports")).length === 2 && rows;
               }""",
            timeout=30_000,
        ).json_value()
        # ... and its duplicate, skipped, among the hand-offs.
        page.wait_for_selector("tr.handoff.skipped", timeout=30_000)
        held = {r[0].split("\n")[0]: r for r in rows}
        assert re.fullmatch(r"task desk_shift [0-9a-f]{8}\npid \d+ on \S+", held["desk"][1]), held
        assert held["nightly-sync"][1].startswith("task nightly_sync "), held
        # A semaphore: each permit's holder, its fence, and how many of the limit are held.
        exports = [r for r in rows if r[0].startswith("exports")]
        for name, holder, ttl, fence, _waiters in exports:
            assert name == "exports\nsemaphore, 2 of 2 permits held", exports
            assert re.fullmatch(r"task export_report [0-9a-f]{8}\npid \d+ on \S+", holder), exports
            assert re.fullmatch(r"\d{16}", fence) and ttl.endswith(" s"), exports
        assert len({r[1] for r in exports}) == 2 and len({r[3] for r in exports}) == 2
        # The oversell experiment, three ways side by side: on PostgreSQL, a lock released
        # before the commit oversells as no lock does; atomic=True sells the 50 seats.
        ways = page.evaluate(WAYS_JS)
        assert [w["way"] for w in ways] == ["none", "released", "atomic"], ways
        assert len({w["top"] for w in ways}) == 1 and ways[0]["left"] < ways[1]["left"], ways
        for way in ways[:2]:
            sold = re.fullmatch(r"(\d+) sold of 50, (\d+) oversold", way["sold"])
            assert sold is not None and int(sold[1]) > 50 and int(sold[2]) == int(sold[1]) - 50
        assert ways[2]["sold"] == "50 sold of 50, 0 oversold", ways
        assert "atomic=True" in ways[2]["label"] and ways[2]["explain"], ways
        assert "PostgreSQL" in page.inner_text("#live-experiment h2")
        # The hand-offs: the duplicate that was skipped, and whole fences, newest on top, so
        # that each lock's fence visibly goes up.
        handoffs = page.evaluate(HANDOFFS_JS)  # the rows of one refresh
        skipped = [h["cells"] for h in handoffs if h["skipped"]]
        assert [r[0] for r in skipped] == ["nightly-sync"] and "skipped" in skipped[0][2]
        assert skipped[0][1].startswith("task nightly_sync "), skipped
        taken = [h for h in handoffs if not h["skipped"]]
        assert all(re.fullmatch(r"\d{16}", h["cells"][2]) for h in taken), handoffs
        assert all(h["cells"][2] == h["title"] for h in taken)  # the fence, whole
        fences = [int(h["cells"][2]) for h in taken]
        assert fences == sorted(fences, reverse=True) and len(set(fences)) == len(fences)
        # A purchase is a hand-off too (bought again now: on a loaded machine the clerks' turns
        # can push the first one out of the list's last few).
        page.click("#buy")
        page.wait_for_function(
            """() => [...document.querySelectorAll("tr.handoff")].some(
                 row => row.cells[0].innerText.trim() === "buyer:127.0.0.1")""",
            timeout=30_000,
        )
        with page.expect_request(lambda r: r.url.endswith("/live.json"), timeout=2500):
            pass  # the page polls on its own
        page.wait_for_timeout(600)  # a second clerk has the desk: a hand-off in the list
        page.screenshot(path=str(ARTIFACTS / "demo-home.png"), full_page=True)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280
        # Busy, the cards keep their places and widths (the hand-offs' used to grow).
        busy = page.evaluate(CARDS_JS)
        _cards_fit_together(busy)
        for card in busy:  # (relative to the shop's card: a scroll bar may centre the page anew)
            assert busy[card][2] == quiet[card][2], (card, quiet, busy)
            place = (busy[card][0] - busy["shop"][0], quiet[card][0] - quiet["shop"][0])
            assert place[0] == place[1], (card, quiet, busy)
        # The handles of the rows shown now, in one call: the list refreshes itself, and a row
        # released between two calls (nth(4) of a locator) was waited for 30 s, then failed.
        home_names = page.locator("#live-locks td .name").element_handles()
        for name, wraps in page.evaluate(WRAPS_JS, home_names):
            assert wraps == [], (name, wraps)
        beat_on_home = page.evaluate(
            CELLS_JS, page.locator("tr.lock-row", has_text="celery-beat").element_handles()
        )[0][1]
        assert HOLDER.fullmatch(beat_on_home), beat_on_home

        # The admin, with a long name held in the demo's Redis (next to the clerks' locks) and
        # two permits of a semaphore of 3.
        demo_locks = {
            "BACKEND": "django_redlock.backends.redis.RedisBackend",
            "LOCATION": redis_url.rsplit("/", 1)[0] + "/3",
            "KEY_PREFIX": "shop",
        }
        long_name = "report:customer-4711:2026-11:monthly-invoice-export:eu-west-1.archive"
        # Playwright's sync API runs an event loop here: a one-try acquire is the sync one
        # that works in it.
        with override_settings(DJANGO_REDLOCK={"default": demo_locks}):
            held_lock = lock(long_name, ttl=60)
            assert held_lock.acquire(blocking=False)
            permits = [semaphore("report-slots", 3, ttl=60) for _ in range(2)]
            assert all(permit.acquire(blocking=False) for permit in permits)
            page.goto(f"{demo.base}/admin/login/?next=/admin/django_redlock/heldlock/")
            page.fill("#id_username", "demo")
            page.fill("#id_password", "demo-password")
            page.click("input[type=submit]")
            page.wait_for_selector("#result_list")
            assert page.locator("tr.redlock-row", has_text=long_name).count() == 1
            page.screenshot(path=str(ARTIFACTS / "demo-admin.png"), full_page=True)
            _fits_the_page(page)
            cells = page.locator("#result_list td.name").element_handles()
            found = dict(page.evaluate(WRAPS_JS, cells))
            fences = page.locator("#result_list td.fence").element_handles()
            fence_wraps = page.evaluate(WRAPS_JS, fences)
            # "Held" counts the rows listed: the semaphore's permits are two.
            listed = page.locator("tr.redlock-row").count()
            assert page.inner_text("#redlock-health tr[data-backend=default] td.held") == str(
                listed
            )
            slots = page.locator("tr.redlock-row", has_text="report-slots")
            assert slots.count() == 2
            assert slots.first.locator("td.kind").inner_text() == "semaphore, 2 of 3 permits held"
            beat_in_admin = page.locator("tr.redlock-row", has_text="celery-beat")
            beat_in_admin = beat_in_admin.locator("td.holder").inner_text()
            for permit in permits:
                permit.release()
            held_lock.release()
        assert found[long_name], "the long name fits one line: it tests no wrapping"
        for name, wraps in found.items():
            for wrap in wraps:  # only after a separator, never inside a word
                assert wrap[0] in SEPARATORS, (name, wraps)
        for fence, wraps in fence_wraps:  # whole, on one line
            assert re.fullmatch(r"\d{16}", fence) and wraps == [], (fence, wraps)
        # The holder in the same words as on the home page (its pid and host as they were;
        # line breaks aside: innerText may drop one while a row is re-laid out, see above).
        same = [re.sub(r"\s+", "", text) for text in (beat_in_admin, beat_on_home)]
        assert same[0] == same[1], (beat_in_admin, beat_on_home)

        # The dev server dies: the demo stops the rest, says why, and exits 1.
        children = Path(f"/proc/{demo.process.pid}/task/{demo.process.pid}/children")
        for pid in map(int, children.read_text().split()):
            if "runserver" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        demo.process.wait(90)
    finally:
        output = demo.stop()  # (nothing left to stop, unless an assertion above failed)
        database.stop()
    assert '"GET /live.json' not in output  # polled every second: not logged
    assert demo.process.returncode == 1, output[-3000:]
    assert "demo: the web server (manage.py runserver) exited (-9); stopping the rest" in output
    assert "-m celery" not in output  # each process by its name


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
