"""``manage.py redlock``: output and exit codes."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_redlock import lock, locks

pytestmark = pytest.mark.django_db(transaction=True)


def run(*args: str) -> tuple[str, int]:
    out, err = StringIO(), StringIO()
    try:
        call_command("redlock", *args, stdout=out, stderr=err)
        code = 0
    except CommandError as exc:
        return str(exc), exc.returncode
    except SystemExit as exc:
        code = int(exc.code or 0)
    return out.getvalue() + err.getvalue(), code


def test_list_as_a_table_and_as_json() -> None:
    with lock("cmd:a", using="redis", ttl=20), lock("cmd:b", using="local", reentrant=True):
        text, code = run("list", "--backend", "redis")
        assert code == 0 and "cmd:a" in text and "BACKEND" in text and "cmd:b" not in text
        text, code = run("list", "--match", "cmd:*", "--json", "--backend", "local")
        data = json.loads(text)
        assert code == 0 and [row["name"] for row in data["locks"]] == ["cmd:b"]
        assert data["locks"][0]["kind"] == "reentrant"
        assert data["locks"][0]["longest_wait"] is None  # nobody waits


def test_list_with_a_backend_down_says_so_and_exits_3() -> None:
    text, code = run("list")
    assert code == 3 and "backend 'down' is unavailable" in text


def test_release() -> None:
    held = lock("cmd:r", using="redis", auto_renew=False)
    held.acquire()
    text, code = run("release", "cmd:r", "--backend", "redis")
    assert code == 0 and "released" in text
    assert not held.locked()
    text, code = run("release", "cmd:r", "--backend", "redis")
    assert code == 1 and "not held" in text
    text, code = run("release", "x", "--backend", "nope")
    assert code == 2 and "unknown backend" in text


def test_purge_needs_yes() -> None:
    for i in range(3):
        lock(f"purge:{i}", using="redis").acquire()
    text, code = run("purge", "--match", "purge:*", "--backend", "redis")
    assert code == 1 and "--yes" in text
    assert locks["redis"].is_locked("purge:0")
    text, code = run("purge", "--match", "purge:*", "--backend", "redis", "--yes")
    assert code == 0 and "released 3 locks" in text
    assert not any(locks["redis"].is_locked(f"purge:{i}") for i in range(3))
    text, code = run("purge", "--match", "purge:*", "--backend", "redis", "--yes")
    assert code == 1 and "no held lock matches" in text


def test_prune_incidents() -> None:
    text, code = run("prune-incidents")
    assert code == 0 and "deleted 0 lock incidents" in text


class Stdin(io.StringIO):
    """A piped stdin (not a tty), that can do something when it is read."""

    def __init__(self, text: str, on_read: Callable[[], None] | None = None) -> None:
        super().__init__(text)
        self.on_read = on_read

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        if self.on_read is not None:
            self.on_read()
        return super().readline(size)


def test_purge_takes_a_piped_y(monkeypatch: pytest.MonkeyPatch) -> None:
    """`echo y | manage.py redlock purge --match 'x*'` confirms; an empty stdin does not."""
    for i in range(2):
        lock(f"piped:{i}", using="redis").acquire()
    monkeypatch.setattr("sys.stdin", Stdin(""))
    text, code = run("purge", "--match", "piped:*", "--backend", "redis")
    assert code == 1 and "not confirmed" in text and locks["redis"].is_locked("piped:0")
    monkeypatch.setattr("sys.stdin", Stdin("n\n"))
    text, code = run("purge", "--match", "piped:*", "--backend", "redis")
    assert code == 1 and locks["redis"].is_locked("piped:0")
    monkeypatch.setattr("sys.stdin", Stdin("y\n"))
    text, code = run("purge", "--match", "piped:*", "--backend", "redis")
    assert code == 0 and "released 2 locks" in text
    assert not locks["redis"].is_locked("piped:0")


def test_purge_leaves_a_lock_that_changed_hands_since_the_listing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = lock("handed:1", using="redis", auto_renew=False)
    first.acquire()
    lock("handed:2", using="redis").acquire()
    second = lock("handed:1", using="redis", auto_renew=False)

    def hand_over() -> None:  # while the operator reads the list
        first.release()
        assert second.acquire(blocking=False)

    monkeypatch.setattr("sys.stdin", Stdin("y\n", hand_over))
    text, code = run("purge", "--match", "handed:*", "--backend", "redis")
    assert code == 0 and "released 1 lock" in text
    assert "'handed:1' on 'redis' changed hands since it was listed; not released" in text
    assert second.owned() and not locks["redis"].is_locked("handed:2")
    second.release()


@pytest.mark.parametrize("alias", ["redis", "local"])
def test_release_with_a_fence(alias: str) -> None:
    held = lock("fenced", using=alias, reentrant=True, auto_renew=False)
    held.acquire()
    text, code = run("release", "fenced", "--backend", alias, "--fence", str(held.fence + 1))
    assert code == 1 and "held by another hold" in text and held.owned()
    text, code = run("release", "fenced", "--backend", alias, "--fence", "-3")
    assert code != 0 and held.owned()
    text, code = run("release", "fenced", "--backend", alias, "--fence", str(held.fence))
    assert code == 0 and not held.locked()


def test_list_of_a_down_backend_never_says_no_held_locks() -> None:
    text, code = run("list", "--backend", "down")
    assert code == 3 and "no held locks" not in text
    assert "did not answer" in text


def test_every_subcommand_documents_its_options_and_exit_codes() -> None:
    from django_redlock.management.commands.redlock import Command

    parser = Command().create_parser("manage.py", "redlock")
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    actions = {"list", "release", "purge", "prune-incidents", "prune-fences", "top", "exec"}
    assert set(sub.choices) == actions
    for name, subparser in sub.choices.items():
        own = "the command's own" if name == "exec" else "0"
        assert f"exit codes: {own}" in subparser.format_help(), name
        for action in subparser._actions:
            assert action.help, (name, action.dest)


def test_list_and_release_semaphores_and_read_write_locks() -> None:
    from django_redlock import read_write_lock, semaphore

    sems = [semaphore("cmd:sem", 3, using="redis", auto_renew=False) for _ in range(2)]
    for s in sems:
        s.acquire()
    writer = read_write_lock("cmd:rw", using="redis", auto_renew=False).write()
    writer.acquire()
    text, code = run("list", "--backend", "redis", "--match", "cmd:*")
    assert code == 0 and text.count("semaphore permit 2/3") == 2 and "read-write write" in text
    text, code = run("list", "--backend", "redis", "--match", "cmd:sem", "--json")
    rows = json.loads(text)["locks"]
    assert sorted(r["fence"] for r in rows) == sorted(s.fence for s in sems)
    assert {r["limit"] for r in rows} == {3}
    text, code = run("release", "cmd:sem", "--backend", "redis", "--fence", str(sems[0].fence))
    # (Not owned(): that would declare the hold lost, an incident in the database.)
    assert code == 0 and held_tokens("cmd:sem") == {sems[1].token}
    text, code = run("release", "cmd:rw", "--backend", "redis")
    assert code == 0 and not writer.locked()
    text, code = run("purge", "--backend", "redis", "--match", "cmd:*", "--yes")
    assert code == 0 and "released 1 lock" in text and held_tokens("cmd:sem") == set()


def held_tokens(name: str) -> set[str | None]:
    info = locks["redis"].inspect(name)
    return set() if info is None else {h.token for h in info.holders}


@pytest.mark.parametrize(
    "args",
    [
        ("release", ""),
        ("release", "x" * 1025),
        ("release", "a\x00b"),
        ("release", "bad\udcffname"),  # a non-UTF-8 argument, as Python decodes argv
        ("list", "--match", "bad\udcff*"),
        ("purge", "--match", "bad\udcff*", "--yes"),
        ("top", "--once", "--match", "bad\udcff*"),
        ("top", "--interval", "nan"),
        ("top", "--interval", "inf"),
    ],
)
def test_bad_input_is_bad_usage_before_any_redis_call(args: tuple[str, ...]) -> None:
    """`release ''` or a name over 1024 bytes went to Redis and exited 1 ("not held"); a
    non-UTF-8 name or glob, or `top --interval nan`, ended in a traceback."""
    before = locks["redis"].round_trips
    text, code = run(*args, "--backend", "redis")
    assert code == 2, text
    assert locks["redis"].round_trips == before


def test_a_non_utf8_argument_in_a_real_shell_is_exit_2_not_a_traceback() -> None:
    import os
    import subprocess
    import sys

    from ..conftest import ROOT

    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.support.settings"}
    for args in ([b"list", b"--match", b"bad\xff*"], [b"release", b"bad\xff"]):
        result = subprocess.run(
            [sys.executable.encode(), b"-m", b"django", b"redlock", *args, b"--backend", b"local"],
            cwd=ROOT, env=env, capture_output=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert b"Traceback" not in result.stderr and b"not valid text" in result.stderr


EVIL = "evil\x1b[2K\r\x1b[1Aforged-row\u202e\n"  # erase the row, draw another, turn text around


@pytest.mark.parametrize("alias", ["redis", "local"])
def test_control_characters_in_names_are_escaped_on_the_terminal(alias: str) -> None:
    """A name built from a URL could erase its own row and print a forged one."""
    holder = lock(EVIL, using=alias, auto_renew=False)
    assert holder.acquire()
    escaped = r"evil\x1b[2K\r\x1b[1Aforged-row\u202e\n"
    outputs = [run("list", "--backend", alias)[0], run("top", "--once", "--backend", alias)[0]]
    outputs.append(run("purge", "--match", "evil*", "--backend", alias, "--yes")[0])
    for text in outputs:
        assert escaped in text, text
        assert not any(c in text for c in "\x1b\r\u202e"), repr(text)
    assert not holder.locked()  # purge released it: its name is the lock's, not the escape


# Each action with its required arguments: Django's common options go after these.
ACTION_ARGS = {
    "list": [], "release": ["n"], "purge": ["--match", "x*"], "prune-incidents": [],
    "prune-fences": ["--older-than", "30d"], "top": ["--once"], "exec": ["n"],
}  # fmt: skip


@pytest.mark.parametrize("action", sorted(ACTION_ARGS))
def test_django_common_options_after_every_action(action: str) -> None:
    """`redlock list --settings=...` as with every Django command, not only before it."""
    from django_redlock.management.commands.redlock import Command

    parser = Command().create_parser("manage.py", "redlock")
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(ACTION_ARGS)  # a new action is tested here too
    common = ["--settings", "tests.support.settings", "--pythonpath", "/tmp", "--traceback",
              "-v", "2", "--no-color", "--skip-checks"]  # fmt: skip
    command = ["--", "true", "--settings", "child's"] if action == "exec" else []
    options = parser.parse_args([action, *ACTION_ARGS[action], *common, *command])
    assert options.action == action
    assert options.settings == "tests.support.settings" and options.pythonpath == "/tmp"
    assert options.verbosity == 2
    assert options.traceback and options.no_color and options.skip_checks
    # Before the action they still work, and the action's own value wins when both are given.
    options = parser.parse_args(["-v", "0", action, *ACTION_ARGS[action], *command])
    assert options.verbosity == 0 and options.settings is None
    options = parser.parse_args(["-v", "0", action, *ACTION_ARGS[action], "-v", "3", *command])
    assert options.verbosity == 3
    if action == "exec":
        assert options.command == ["true", "--settings", "child's"]


def test_common_options_after_the_action_from_a_shell(redis_server: Any) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "REDLOCK_TEST_REDIS": redis_server.url}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "-m", "django", "redlock", "list", "--backend", "redis",
         "--settings=tests.support.exec_settings", "-v", "0", "--traceback"],
        cwd=root, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and "no held locks" in done.stdout, done.stderr


def test_a_redlock_release_waits_for_a_silent_node_or_says_it_was_not_reached(
    redis_factory: Callable[..., Any],
) -> None:
    """The release owed to a node that did not answer lives in the command's process, which
    exited at once: "released", exit 0, and the node kept the hold for its TTL (review
    rio2, 2). The command waits a bounded time for it, else names the node, exit 3."""
    import threading

    from django.conf import settings
    from django.test import override_settings

    servers = [redis_factory() for _ in range(3)]
    for server in servers:  # past the nodes' first 2 s: one fence on every node (rio2, 4)
        server.client().set("redlock:node", "0")
    config = {
        "BACKEND": "django_redlock.backends.redlock.RedlockBackend",
        "LOCATION": [server.url for server in servers],
        "OPTIONS": {"socket_timeout": 0.1, "socket_connect_timeout": 0.1},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "q": config}):
        key = locks["q"].key("stuck")
        for resume_after in (0.5, None):  # back within the wait; silent throughout
            held = lock("stuck", using="q", ttl=3600, auto_renew=False)
            assert held.acquire(blocking=False) and held.fence is not None
            servers[2].pause()
            if resume_after is not None:
                threading.Timer(resume_after, servers[2].resume).start()
            try:
                text, code = run("release", "stuck", "--backend", "q", "--fence", str(held.fence))
            finally:
                servers[2].resume()
            if resume_after is not None:
                assert code == 0 and "released" in text, text
                assert servers[2].client().get(key) is None  # written before the exit
            else:
                assert code == 3 and "node 2" in text and "not reached" in text, text
                locks["q"].force_release("stuck")
