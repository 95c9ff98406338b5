"""Globs over lock names (`redlock list/purge/top --match`, the admin's search, the compat
shims' prefixes) select the same names on every backend, whatever characters the names hold:
the key encoding's own (``}`` and ``~`` in front, braces), glob characters, non-ASCII."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from django_redlock import lock, locks
from django_redlock.backends import markers
from django_redlock.backends.base import BaseLockBackend, glob_escape, glob_match

from ..conftest import BACKEND_ALIASES

pytestmark = pytest.mark.django_db(transaction=True)

NAMES = [
    "}job", "}", "~report", "~", "~~x", "{a}", "a}b", "a{b", "a}:f", "a", "star*", "q?",
    "br[a]", "back\\slash", "é?", "plain",
]  # fmt: skip
STARTS = {"}job", "}", "~report", "~", "~~x"}  # the names key() puts a '~' in front of
#: Each glob and the names it selects (worked out by hand: Redis's glob syntax, by character).
GLOBS: list[tuple[str, set[str]]] = [
    ("*", set(NAMES)),
    ("~*", {"~report", "~", "~~x"}),
    ("}*", {"}job", "}"}),
    ("}job", {"}job"}),
    ("~report", {"~report"}),
    ("\\~report", {"~report"}),
    ("?", {"}", "~", "a"}),
    ("??", {"q?", "é?"}),  # é is one character, two bytes
    ("*}*", {"}job", "}", "{a}", "a}b", "a}:f"}),
    ("*~*", {"~report", "~", "~~x"}),
    ("a}*", {"a}b", "a}:f"}),
    ("a}:f", {"a}:f"}),  # not the fence key of 'a' ({a}:f)
    ("{*", {"{a}"}),
    ("[}~]*", STARTS),
    ("[^}~]*", set(NAMES) - STARTS),
    (
        "?[^~]*",
        {
            "}job",
            "~report",
            "{a}",
            "a}b",
            "a{b",
            "a}:f",
            "star*",
            "q?",
            "br[a]",
            "back\\slash",
            "é?",
            "plain",
        },
    ),
    ("star\\*", {"star*"}),
    ("q\\?", {"q?"}),
    ("br\\[a\\]", {"br[a]"}),
    ("br[[]a[\\]]", {"br[a]"}),
    ("br[[]a[]]", set()),  # '[]' matches nothing (as in Redis): a ']' in a class is quoted
    ("back\\\\slash", {"back\\slash"}),
    ("é*", {"é?"}),
    ("nothing*", set()),
]


@pytest.fixture(params=[*BACKEND_ALIASES, "quorum"])
def backend(request: pytest.FixtureRequest, redis_server: Any) -> Iterator[str]:
    """Every backend, and Redlock (three nodes: databases 12-14 of the suite's server)."""
    if request.param != "quorum":
        if request.param in ("cluster", "sentinel", "acl"):
            request.getfixturevalue(f"_{request.param}_alias")
        yield str(request.param)
        return
    urls = [redis_server.url_for(None, redis_server.password, db=db) for db in (12, 13, 14)]
    config = {"BACKEND": "django_redlock.backends.redlock.RedlockBackend", "LOCATION": urls}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "quorum": config}):
        yield "quorum"
        for db in (12, 13, 14):
            redis_server.client(db=db).flushdb()


@pytest.fixture
def held(backend: str) -> Iterator[str]:
    holds = [lock(name, using=backend, ttl=30, auto_renew=False) for name in NAMES]
    for hold in holds:
        assert hold.acquire()
    yield backend
    for hold in holds:
        if hold.locked():
            hold.release()


def test_the_rule_matches_the_hand_worked_answers() -> None:
    for glob, names in GLOBS:
        assert {n for n in NAMES if glob_match(glob, n)} == names, glob
    for name in NAMES:  # an escaped name matches itself alone; an escaped prefix, its names
        assert {n for n in NAMES if glob_match(glob_escape(name), n)} == {name}
        starts = {n for n in NAMES if n.startswith(name[:2])}
        assert {n for n in NAMES if glob_match(glob_escape(name[:2]) + "*", n)} == starts


def test_every_backend_lists_exactly_the_names_a_glob_matches(held: str) -> None:
    backend = locks[held]
    ours = set(NAMES)  # the session's shared servers may hold other tests' names meanwhile
    for glob, names in GLOBS:
        assert {info.name for info in backend.iter_locks(glob)} & ours == names, glob
        paged: list[str] = []
        cursor: str | None = None
        while True:
            found, cursor = backend.page(glob, cursor, 3)
            paged += [info.name for info in found if info.name in ours]
            if cursor is None:
                break
        assert sorted(paged) == sorted(names), glob


def test_queue_markers_are_found_by_the_same_rule(backend: str) -> None:
    keeper: BaseLockBackend = locks[backend]
    try:
        markers.of(keeper)
    except NotImplementedError:
        pytest.skip(f"{backend} keeps no queue markers")
    for name in NAMES:
        assert markers.mark(keeper, name, f"task-{name}", 30_000) is None
    ours = set(NAMES)  # the session's Cluster and Sentinel keep other tests' (Celery's) markers
    for glob, names in GLOBS:
        found = set(markers.names(keeper, glob))
        assert found & ours == names, glob
        assert all(glob_match(glob, other) for other in found - ours), (glob, found - ours)


def run(*args: str) -> tuple[str, int]:
    out, err = StringIO(), StringIO()
    try:
        call_command("redlock", *args, stdout=out, stderr=err)
    except CommandError as exc:
        return str(exc), exc.returncode
    except SystemExit as exc:
        return out.getvalue() + err.getvalue(), int(exc.code or 0)
    return out.getvalue() + err.getvalue(), 0


def test_purge_releases_only_what_its_glob_matches(held: str) -> None:
    """`purge --match '~*'` force-released '}job' (its key is ...{~}job}), and `list --match
    '}job'` said "no held locks" while it was held."""
    text, code = run("list", "--backend", held, "--match", "}job")
    assert code == 0 and "}job" in text, text
    text, code = run("purge", "--backend", held, "--match", "~*", "--yes")
    assert code == 0 and "released 3 locks" in text, text
    backend = locks[held]
    assert {n for n in NAMES if backend.is_locked(n)} == set(NAMES) - {"~report", "~", "~~x"}


def test_the_admin_search_finds_names_the_key_encoding_marks(held: str) -> None:
    from django.test import Client

    from ..support.factories import UserFactory

    client = Client()
    client.force_login(UserFactory(is_superuser=True))
    url = "/admin/django_redlock/heldlock/"
    for search, names in [("~rep", {"~report"}), ("}", {"}job", "}"}), ("back\\", {"back\\slash"}),
                          ("br[a]", set()), ("br[[]*", {"br[a]"})]:  # fmt: skip
        page = client.get(url, {"backend": held, "q": search}).content.decode()
        values = re.findall(r'name="lock" value="([^"]*)"', page)
        shown = {json.loads(html.unescape(value))[1] for value in values}
        assert shown == names, (search, shown)


@pytest.mark.parametrize("prefix", ["job]", "job\\", "[job]:", "j*b?", "}job:", "~job:"])
def test_celery_singleton_clear_locks_takes_its_prefix_literally(backend: str, prefix: str) -> None:
    """clear_locks() quoted ']' as '[]]' (a class that matches nothing, in Redis) and left
    '\\' unquoted: it cleared nothing."""
    from types import SimpleNamespace

    from django_redlock.compat.celery_singleton import clear_locks

    keeper = locks[backend]
    try:
        markers.of(keeper)
    except NotImplementedError:
        pytest.skip(f"{backend} keeps no queue markers")
    app = SimpleNamespace(conf={"singleton_key_prefix": prefix, "singleton_using": backend})
    held = lock(f"{prefix}held", using=backend, auto_renew=False)
    other = lock("jobx", using=backend, auto_renew=False)
    assert held.acquire() and other.acquire()
    assert markers.mark(keeper, f"{prefix}queued", "t1", 30_000) is None
    clear_locks(app)
    assert not keeper.is_locked(f"{prefix}held")
    assert markers.read(keeper, f"{prefix}queued") is None
    assert keeper.is_locked("jobx")
    other.release()


def test_a_glob_that_is_not_text_is_refused_before_any_redis_call(backend: str) -> None:
    keeper = locks[backend]
    for call in (
        lambda: list(keeper.iter_locks("bad\udcff*")),
        lambda: keeper.page("bad\udcff*", None, 10),
        lambda: markers.names(keeper, "bad\udcff*"),
    ):
        try:
            with pytest.raises(ValueError, match="the glob is not valid text"):
                call()
        except NotImplementedError:  # no queue markers
            pass
    with pytest.raises(TypeError, match="the glob must be a str"):
        list(keeper.iter_locks(b"x*"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="the glob must be a str"):
        keeper.page(["x*"], None, 10)  # type: ignore[arg-type]


def test_the_rule_reads_globs_as_redis_does_and_its_pattern_misses_no_key(
    redis_server: Any,
) -> None:
    """Random globs and names over the characters that matter: for ASCII names and globs
    (where a character is a byte) glob_match agrees with Redis's own SCAN MATCH, and every
    matching name's key matches key_pattern (names with 'é' included)."""
    import random

    client = redis_server.client(db=11)
    keys = BaseLockBackend("globs", {"KEY_PREFIX": "p"})
    rnd = random.Random(48)
    alphabet = "ab}~-^[]\\*?{é"
    names = sorted({"".join(rnd.choices(alphabet, k=rnd.randint(1, 4))) for _ in range(300)})
    try:
        for name in names:
            client.set("N" + name, 1)
            client.set(keys.key(name), 1)
        for _ in range(500):
            glob = "".join(rnd.choices(alphabet, k=rnd.randint(0, 7)))
            ascii_names = {n for n in names if n.isascii()}
            redis_says = {k.decode()[1:] for k in client.scan_iter(match="N" + glob, count=10_000)}
            ours = {n for n in names if glob_match(glob, n)}
            if glob.isascii():  # (Redis reads a non-ASCII range by signed bytes)
                assert redis_says & ascii_names == ours & ascii_names, glob
            found = {
                k.decode() for k in client.scan_iter(match=keys.key_pattern(glob), count=10_000)
            }
            assert {keys.key(n) for n in ours} <= found, glob
    finally:
        client.flushdb()
