"""The "Held locks" admin page through Django's test client."""

from __future__ import annotations

import html
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.test import Client

from django_redlock import LockLost, lock, locks

from ..conftest import Child
from ..support.factories import UserFactory

pytestmark = pytest.mark.django_db
URL = "/admin/django_redlock/heldlock/"
RELEASE = "/admin/django_redlock/heldlock/release/"


def client_for(*perms: str, superuser: bool = False) -> Client:
    user = UserFactory(perms=list(perms), is_superuser=superuser)
    client = Client()
    client.force_login(user)
    return client


def ident(alias: str, name: str) -> str:
    return json.dumps([alias, name])


def form_values(page: str, field: str = "lock") -> list[str]:
    """What a page's form posts as ``field`` (the rows' checkboxes, the hidden inputs)."""
    return [html.unescape(v) for v in re.findall(rf'name="{field}" value="([^"]*)"', page)]


def test_lists_locks_across_backends_with_their_details() -> None:
    with lock("admin:r", using="redis"), lock("admin:l", using="local", reentrant=True) as inner:
        inner.acquire()
        page = client_for(superuser=True).get(URL).content.decode().replace("<wbr>", "")
    assert "admin:r" in page and "admin:l" in page
    row = re.search(
        r'admin:l</td>\s*<td>local</td>\s*<td class="kind">reentrant</td>.*?</tr>', page, re.S
    )
    assert row is not None and "<td>2</td>" in row.group(0)  # hold count
    # The holder, in the words the example shop uses too: who, then where; all of it on hover.
    holder = re.search(r'<td class="holder" title="([^"]*)">(.*?)</td>', row.group(0), re.S)
    assert holder is not None
    assert holder.group(2) == (
        f'MainThread<br><span class="quiet">pid {os.getpid()} on {socket.gethostname()}</span>'
    )
    assert holder.group(1) == f"thread MainThread, pid {os.getpid()}, host {socket.gethostname()}"
    # A fence is one number, on one line (it was cut into groups of six digits).
    fence = re.search(r'<td class="fence">(.*?)</td>', row.group(0))
    assert fence is not None and re.fullmatch(r"\d{16}", fence.group(1)), row.group(0)


def test_index_has_the_entry() -> None:
    assert "Held locks" in client_for(superuser=True).get("/admin/").content.decode()


def test_search_and_filters() -> None:
    client = client_for(superuser=True)
    with lock("report:1", using="redis"), lock("invoice:1", using="redis"), \
            lock("invoice:2", using="local", fair=True):  # fmt: skip
        page = client.get(URL, {"q": "invoice"}).content.decode()
        assert "invoice:1" in page and "invoice:2" in page and "report:1" not in page
        page = client.get(URL, {"q": "*:1"}).content.decode()
        assert "invoice:1" in page and "report:1" in page and "invoice:2" not in page
        page = client.get(URL, {"backend": "local"}).content.decode()
        assert "invoice:2" in page and "invoice:1" not in page
        page = client.get(URL, {"kind": "fair"}).content.decode()
        assert "invoice:2" in page and "report:1" not in page


def test_sorted_by_ttl() -> None:
    with lock("short", using="redis", ttl=5), lock("long", using="redis", ttl=50):
        page = client_for(superuser=True).get(URL, {"o": "-ttl"}).content.decode()
    assert page.index(">long<") < page.index(">short<")


def test_names_are_escaped() -> None:
    evil = "<script>alert(1)</script>"
    with lock(evil, using="redis"):
        page = client_for(superuser=True).get(URL).content.decode()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert evil not in page


def test_a_down_backend_is_a_banner_and_the_others_still_list() -> None:
    with lock("still-here", using="redis"):
        page = client_for(superuser=True).get(URL).content.decode()
    assert "Backend “down” is unavailable" in page
    assert "still-here" in page


def test_pages_by_scan_cursor() -> None:
    held = [lock(f"many:{i:03}", using="redis") for i in range(250)]
    for each in held:
        each.acquire()
    client = client_for(superuser=True)
    seen: set[str] = set()
    url, pages = URL + "?backend=redis&q=many", 0
    while url:
        page = client.get(url).content.decode().replace("<wbr>", "")  # break opportunities
        names = re.findall(r'<td class="name">(many:\d+)</td>', page)
        assert len(names) < 250
        seen.update(names)
        pages += 1
        found = re.search(r'href="([^"]+)" id="next-page"', page)
        url = URL + found.group(1).replace("&amp;", "&") if found else ""
    assert pages >= 2 and seen == {f"many:{i:03}" for i in range(250)}
    for each in held:
        each.release()


def test_permissions() -> None:
    anonymous = Client().get(URL)
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]
    assert client_for().get(URL).status_code == 403  # staff without permission
    with lock("perm", using="redis"):
        viewer = client_for("view_heldlock")
        page = viewer.get(URL)
        assert page.status_code == 200 and b"perm" in page.content
        assert b"Force-release" not in page.content
        assert viewer.post(RELEASE, {"single": ident("redis", "perm")}).status_code == 403
        releaser = client_for("view_heldlock", "force_release")
        assert b"Force-release" in releaser.get(URL).content
    assert client_for("force_release").get(URL).status_code == 403  # view is needed to see


def test_force_release_of_another_process_s_lock(child: Callable[..., Child]) -> None:
    holder = child("hold", "--name", "stuck:job", "--ttl", "0.9")
    holder.expect("ACQUIRED")
    client = client_for("view_heldlock", "force_release")
    confirm = client.post(RELEASE, {"lock": [ident("redis", "stuck:job")]})
    assert confirm.status_code == 200 and b"Force-release these locks?" in confirm.content
    assert locks["redis"].is_locked("stuck:job")  # nothing happens before the confirmation
    done = client.post(RELEASE, {"lock": form_values(confirm.content.decode()), "confirm": "yes"})
    assert done.status_code == 302
    assert not locks["redis"].is_locked("stuck:job")
    assert "released by someone else" in holder.expect("LOST")  # at its next renewal
    entry = LogEntry.objects.get()
    assert entry.action_flag == DELETION and entry.object_repr == "stuck:job (redis)"
    page = client.get(URL).content.decode()
    assert "stuck:job" not in page and "Force-released 1 of 1 locks." in page


def test_release_needs_post_and_csrf() -> None:
    with lock("csrf", using="redis"):
        client = Client(enforce_csrf_checks=True)
        client.force_login(UserFactory(is_superuser=True))
        response = client.post(RELEASE, {"single": ident("redis", "csrf"), "confirm": "yes"})
        assert response.status_code == 403
        assert locks["redis"].is_locked("csrf")
        assert client.get(RELEASE).status_code == 302  # GET does nothing


def test_incident_admin_is_read_only() -> None:
    from ..support.factories import LockIncidentFactory

    LockIncidentFactory(name="invoice:9", kind="lost")
    client = client_for(superuser=True)
    page = client.get("/admin/django_redlock/lockincident/").content.decode()
    assert "invoice:9" in page and "hold lost" in page
    assert client.get("/admin/django_redlock/lockincident/add/").status_code == 403


HANDOVERS = [("redis", {}), ("redis", {"reentrant": True}), ("local", {"reentrant": True}),
             ("cache", {"fair": True}), ("local", {})]  # fmt: skip


@pytest.mark.parametrize(("alias", "kind"), HANDOVERS)
def test_a_lock_that_changed_hands_before_yes_is_not_released(
    alias: str, kind: dict[str, bool]
) -> None:
    """ "Yes" releases the hold that the confirmation page showed, not its successor."""
    client = client_for("view_heldlock", "force_release")
    first = lock("moved:1", using=alias, auto_renew=False, **kind)
    first.acquire()
    listed = form_values(client.get(URL, {"backend": alias, "q": "moved:1"}).content.decode())
    confirmed = form_values(client.post(RELEASE, {"lock": listed}).content.decode())
    assert len(confirmed) == 1
    first.release()
    second = lock("moved:1", using=alias, auto_renew=False, **kind)
    assert second.acquire(blocking=False)
    done = client.post(RELEASE, {"lock": confirmed, "confirm": "yes"}, follow=True)
    page = html.unescape(done.content.decode())
    assert second.owned()
    assert f"“moved:1” on {alias} changed hands since you looked; not released." in page
    assert "Force-released 0 of 1 locks." in page
    assert not LogEntry.objects.exists()
    second.release()


def test_the_confirmation_page_says_a_listed_lock_changed_hands() -> None:
    client = client_for("view_heldlock", "force_release")
    first = lock("moved:2", using="redis", auto_renew=False)
    first.acquire()
    listed = form_values(client.get(URL, {"backend": "redis", "q": "moved:2"}).content.decode())
    first.release()
    second = lock("moved:2", using="redis", auto_renew=False)
    assert second.acquire(blocking=False)
    confirm = client.post(RELEASE, {"lock": listed}).content.decode()
    assert "changed hands since you looked; it will not be released" in confirm
    assert form_values(confirm) == [] and 'id="confirm-release"' not in confirm
    second.release()


def test_yes_without_what_was_shown_releases_nothing() -> None:
    """A crafted "yes" that names a lock but no hold of it is not a confirmation."""
    with lock("crafted", using="redis") as held:
        client = client_for("view_heldlock", "force_release")
        done = client.post(RELEASE, {"lock": [ident("redis", "crafted")], "confirm": "yes"})
        assert done.status_code == 302 and held.owned()
        bad = json.dumps(["redis", "crafted", None, "1e3"])
        client.post(RELEASE, {"lock": [bad], "confirm": "yes"})
        assert held.owned()


BAD_CURSORS = [
    "not json", "[1, 2]", '"text"', "3", "null", '{"redis": 5}', '{"redis": {"a": 1}}',
    '{"redis": ["1"]}', '{"redis": "-1"}', '{"redis": "abc"}', '{"redis": "1e3"}',
    '{"redis": "18446744073709551616"}', '{"redis": "' + "9" * 5000 + '"}', '{"local": "-5"}',
    '{"local": "x"}', "[" * 5000, '{"redis": "\u0661"}',
]  # fmt: skip


@pytest.mark.parametrize("cursor", BAD_CURSORS)
def test_a_crafted_cursor_gives_the_first_page(cursor: str) -> None:
    with lock("paged:r", using="redis"), lock("paged:l", using="local"):
        response = client_for(superuser=True).get(URL, {"cursor": cursor, "q": "paged"})
    assert response.status_code == 200
    page = response.content.decode()
    assert "paged:r" in page and "paged:l" in page
    assert "That page link is not valid: here is the first page." in page


@pytest.mark.parametrize("alias", ["redis", "local"])
def test_semaphores_and_read_write_locks_are_listed_per_holder(alias: str) -> None:
    from django_redlock import read_write_lock, semaphore

    sems = [semaphore("admin:sem", 3, using=alias, auto_renew=False) for _ in range(2)]
    for s in sems:
        s.acquire()
    reader = read_write_lock("admin:rw", using=alias, auto_renew=False).read()
    reader.acquire()
    client = client_for("view_heldlock", "force_release")

    def tokens(name: str) -> set[str | None]:
        info = locks[alias].inspect(name)
        return set() if info is None else {h.token for h in info.holders}

    page = client.get(URL, {"backend": alias, "q": "admin:"}).content.decode().replace("<wbr>", "")
    assert page.count("semaphore, 2 of 3 permits held") == 2 and "read-write, read" in page
    # "Held" counts what the table lists: each permit (two), and the reader.
    health = re.search(rf'data-backend="{alias}">.*?</tr>', page, re.S)
    assert health is not None and '<td class="held">3</td>' in health.group(0)
    assert page.count('class="redlock-row"') == 3
    assert str(sems[0].fence) in page and str(sems[1].fence) in page
    only = client.get(URL, {"backend": alias, "kind": "semaphore"}).content.decode()
    assert "admin:sem" in only and "admin:rw" not in only
    # Release one permit: the other holder keeps its own.
    listed = [v for v in form_values(page) if sems[0].token in v]
    confirmed = form_values(client.post(RELEASE, {"lock": listed}).content.decode())
    assert len(confirmed) == 1
    done = client.post(RELEASE, {"lock": confirmed, "confirm": "yes"}, follow=True)
    assert "Force-released 1 of 1 locks." in html.unescape(done.content.decode())
    # (Not owned(): that would declare the hold lost, an incident in the database.)
    assert tokens("admin:sem") == {sems[1].token} and tokens("admin:rw") == {reader.token}
    # And all of them: every row selected.
    page = client.get(URL, {"backend": alias, "q": "admin:"}).content.decode()
    confirmed = form_values(client.post(RELEASE, {"lock": form_values(page)}).content.decode())
    client.post(RELEASE, {"lock": confirmed, "confirm": "yes"})
    assert tokens("admin:sem") == set() and tokens("admin:rw") == set()


def _waiting(name: str, count: int, alias: str = "redis") -> list[threading.Thread]:
    """``count`` threads waiting for ``name`` (each takes it in turn when it is freed)."""

    def wait() -> None:
        with lock(name, using=alias, timeout=10):
            pass

    threads = [threading.Thread(target=wait) for _ in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while (info := locks[alias].inspect(name)) is None or info.waiters < count:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return threads


def test_waiters_their_longest_wait_and_lost_holds_per_lock() -> None:
    from django_redlock.incidents import recorder

    lost = lock("contended:1", using="redis", auto_renew=False)
    lost.acquire()
    assert locks["redis"].force_release("contended:1")
    with pytest.raises(LockLost):
        lost.release()
    recorder.flush()
    holder = lock("contended:1", using="redis")
    holder.acquire()
    threads = _waiting("contended:1", 2)
    time.sleep(0.3)
    page = client_for(superuser=True).get(URL, {"backend": "redis"}).content.decode()
    page = page.replace("<wbr>", "")  # names break only after separators
    holder.release()
    for thread in threads:
        thread.join()
    row = re.search(r"contended:1</td>.*?</tr>", page, re.S)
    assert row is not None
    assert '<td class="waiters">2</td>' in row.group(0)
    wait = re.search(r'<td class="longest">([\d.]+) s</td>', row.group(0))
    assert wait is not None and 0.3 <= float(wait.group(1)) < 10
    assert '<td class="lost">1</td>' in row.group(0)  # from the lock incidents
    health = re.search(r'data-backend="redis">.*?</tr>', page, re.S)
    assert health is not None
    assert re.search(r'<td class="status"[^>]*>up', health.group(0))
    assert re.search(r'<td class="latency">[\d.]+ ms</td>', health.group(0))
    assert '<td class="held">1</td>' in health.group(0)
    assert '<td class="waiting">2</td>' in health.group(0)
    assert '<td class="lost">1</td>' in health.group(0)
    other = re.search(r'data-backend="default">.*?</tr>', page, re.S)  # not listed
    assert other is not None and '<td class="held"></td>' in other.group(0)


def test_the_health_summary_names_a_backend_that_is_down() -> None:
    page = client_for(superuser=True).get(URL).content.decode()
    down = re.search(r'class="redlock-health-row down" data-backend="down">.*?</tr>', page, re.S)
    assert down is not None and "Connection refused" in down.group(0)
    assert 'class="redlock-health-row up" data-backend="local"' in page
    assert "Backend “down” is unavailable" in page


def test_the_page_stays_a_scan_page_with_the_summary(
    django_assert_max_num_queries: Any,
) -> None:
    held = [lock(f"scan:{i:03}", using="redis") for i in range(300)]
    for each in held:
        each.acquire()
    client = client_for(superuser=True)
    with django_assert_max_num_queries(4):  # session, user, 2 for lost holds: not per lock
        page = client.get(URL, {"backend": "redis"}).content.decode()
    health = re.search(r'data-backend="redis">.*?</tr>', page, re.S)
    assert health is not None
    rows = page.count('class="redlock-row"')
    more = "+" if 'id="next-page"' in page else ""
    assert 0 < rows < 300  # a page's worth, counted from the page, not every lock
    assert f'<td class="held">{rows}{more}</td>' in health.group(0)
    for each in held:
        each.release()


def test_a_celery_task_holder_is_named_by_its_task() -> None:
    """A hold taken in a Celery task: the task's name and the start of its id, the whole id
    on hover (and on the confirmation page)."""
    from django_redlock.identity import current_task

    task_id = "2c256f78-d022-4f69-a4ea-9bbf0b9482c1"
    marker = current_task.set((task_id, "shop.tasks.nightly_sync"))
    try:
        held = lock("admin:task", using="redis")
        held.acquire()
    finally:
        current_task.reset(marker)
    try:
        client = client_for(superuser=True)
        page = client.get(URL, {"backend": "redis", "q": "admin:task"}).content.decode()
        confirm = client.post(RELEASE, {"lock": form_values(page)}).content.decode()
    finally:
        held.release()
    holder = re.search(r'<td class="holder" title="([^"]*)">(.*?)<br>', page)
    assert holder is not None and holder.group(2) == "task nightly_sync 2c256f78"
    assert holder.group(1).startswith(
        f"task {task_id} (shop.tasks.nightly_sync), thread MainThread, pid "
    )
    assert f'held by <span class="holder" title="task {task_id}' in confirm
    assert f"task nightly_sync 2c256f78 · pid {os.getpid()} on" in confirm


def test_holders_in_words() -> None:
    from django_redlock.display import holder_parts, holder_text, holder_title

    task = {"h": "web-1", "p": 9101, "t": "Thread-3", "k": "2c256f78-d022", "n": "shop.sync"}
    assert holder_text(task) == "task sync 2c256f78 · pid 9101 on web-1"
    assert holder_parts({"h": "web-1", "p": 7, "t": "MainThread"}) == (
        "MainThread",
        "pid 7 on web-1",
    )
    assert (
        holder_title(task)
        == "task 2c256f78-d022 (shop.sync), thread Thread-3, pid 9101, host web-1"
    )
    # A hold that records nothing (another client's): said so, never "? · pid ?".
    assert holder_text({}) == "unknown holder" == holder_title({})
    assert holder_text({"p": 5}) == "pid 5"


@pytest.mark.parametrize(
    "value",
    [
        ["redis", "\udc80", "t", None],  # JSON may carry a lone surrogate: not text for Redis
        ["redis", "crafted", "\udc80", None],
        ["local", "\udc80", "t", None],
        ["redis", "a\x00b", "t", None],
        ["redis", "", "t", None],
        ["redis", "x" * 2000, "t", None],
        ["redis", "crafted", None, "99999999999999999999"],
    ],
)
@pytest.mark.parametrize("confirm", ["yes", ""])
def test_a_crafted_release_post_is_never_a_500(value: list[Any], confirm: str) -> None:
    """With the permission and a CSRF token, a crafted form value gave a 500."""
    client = Client(raise_request_exception=False)
    client.force_login(UserFactory(is_superuser=True))
    with lock("crafted", using="redis") as held:
        response = client.post(RELEASE, {"single": json.dumps(value), "confirm": confirm})
        assert response.status_code in (200, 302), response.status_code
        assert held.locked()
