"""``manage.py redlock exec NAME -- COMMAND``: real ``exec`` processes on the suite's Redis,
running tests/support/exec_child.py; and its bad usage and exit codes in this process."""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.management import call_command
from django.core.management.base import CommandError

from django_redlock import lock, locks, semaphore
from django_redlock.management import exec_action
from django_redlock.models import LockIncident
from django_redlock.testing import RedisServer

from ..support.proxy import LossyProxy

ROOT = Path(__file__).resolve().parents[2]
CHILD = str(ROOT / "tests" / "support" / "exec_child.py")
_runs = itertools.count()


class Exec:
    """One ``python -m django redlock exec ...`` process."""

    def __init__(self, url: str, *args: str, group: bool = False) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "DJANGO_SETTINGS_MODULE": "tests.support.exec_settings",
            "REDLOCK_TEST_REDIS": url,
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "django", "redlock", "exec", *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=group,  # a group of its own (its id exec's pid), as a job's
        )  # fmt: skip

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        _, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, err


@pytest.fixture
def execs(redis_server: RedisServer) -> Iterator[Callable[..., Exec]]:
    started: list[Exec] = []

    def start(*args: str, group: bool = False) -> Exec:
        started.append(Exec(redis_server.url, *args, group=group))
        return started[-1]

    yield start
    for each in started:
        if each.process.poll() is None:
            each.process.kill()
        each.process.communicate()


@pytest.fixture
def prefix() -> str:
    return f"exec-test-{next(_runs)}"


def child(redis_server: RedisServer, action: str, prefix: str, *args: str) -> list[str]:
    return ["--", sys.executable, CHILD, action, redis_server.url, prefix, *args]


def wait_for(predicate: Callable[[], Any], timeout: float = 60, what: str = "it") -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.02)
    return value


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_one_runs_the_other_exits_75_and_a_waiter_runs_after(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    client = redis_server.client()
    name = f"{prefix}-job"
    first = execs(name, *child(redis_server, "run", prefix, "gate"))  # runs until "go"
    wait_for(lambda: client.llen(f"{prefix}:peaks"), what="first child")
    second = execs(name, *child(redis_server, "run", prefix, "0"))
    other = execs(name, "--conflict-exit-code", "9", *child(redis_server, "run", prefix, "0"))
    code, err = second.finish()
    assert code == 75 and "held elsewhere" in err, err
    assert other.finish()[0] == 9
    waiter = execs(name, "--wait", "120", *child(redis_server, "run", prefix, "0"))
    client.set(f"{prefix}:go", 1)
    code, err = first.finish()
    assert code == 0 and "redlock exec" not in err, err
    assert waiter.finish()[0] == 0
    assert [int(p) for p in client.lrange(f"{prefix}:peaks", 0, -1)] == [1, 1]
    fences = [int(f) for f in client.lrange(f"{prefix}:fences", 0, -1)]
    assert fences[0] < fences[1]  # strictly increasing, in the order the children ran
    assert client.lrange(f"{prefix}:env", 0, -1) == [f"{name} default".encode()] * 2
    assert not locks["redis"].is_locked(name)  # released at the child's end


def test_limit_2_with_five_runs_at_most_two_at_once(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    client = redis_server.client()
    name = f"{prefix}-report"
    args = (name, "--limit", "2", "--wait", "120", *child(redis_server, "run", prefix, "gate"))
    five = [execs(*args) for _ in range(5)]
    wait_for(lambda: client.llen(f"{prefix}:peaks") >= 2, timeout=120, what="two children")
    time.sleep(0.5)  # the other three are waiting (or still starting): none runs
    assert sorted(int(p) for p in client.lrange(f"{prefix}:peaks", 0, -1)) == [1, 2]
    client.set(f"{prefix}:go", 1)
    assert [each.finish()[0] for each in five] == [0] * 5
    peaks = [int(p) for p in client.lrange(f"{prefix}:peaks", 0, -1)]
    assert len(peaks) == 5 and max(peaks) == 2, peaks
    fences = [int(f) for f in client.lrange(f"{prefix}:fences", 0, -1)]
    assert len(set(fences)) == 5


@pytest.mark.parametrize("how", ["force_release", "flushdb"])
def test_a_loss_terminates_the_child_and_exits_76(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str, how: str
) -> None:
    client = redis_server.client()
    name = f"{prefix}-lost"
    # --ttl 3: renewed every second; --grace 1: the trapping child exits at its SIGTERM.
    running = execs(name, "--ttl", "3", "--grace", "1", *child(redis_server, "trap", prefix))
    pid, group = map(int, wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split())
    # Its own process group, led by its parent (exec's child)
    assert group != os.getpgid(0) and group != os.getpgid(running.process.pid)
    assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == group
    started = time.monotonic()
    if how == "force_release":
        assert locks["redis"].force_release(name)
    else:
        client.flushdb()
    code, err = running.finish()
    # Noticed within a renewal period (1 s), the child gone at its SIGTERM (a loaded
    # machine's seconds on top).
    assert time.monotonic() - started < 6, err
    assert code == exec_action.EXIT_LOST == 76 and "was lost" in err, err
    assert not alive(pid)


def test_exec_sigkilled_takes_its_child_along_and_what_the_child_started(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    client = redis_server.client()
    direct = execs(f"{prefix}-k", *child(redis_server, "trap", prefix))
    # A shell that starts the trapping child in the background: a grandchild of exec.
    trap = " ".join(map(shlex.quote, child(redis_server, "trap", prefix)[1:]))
    shell = execs(f"{prefix}-k2", "--", "sh", "-c", f"{trap} & wait")
    pids = [int(wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split()[0])
            for _ in range(2)]  # fmt: skip
    direct.process.kill()
    shell.process.kill()
    for each in (direct, shell):
        each.process.wait()
    gone = time.monotonic()
    for pid in pids:
        wait_for(lambda: not alive(pid), timeout=1, what="child's end")  # noqa: B023
    assert time.monotonic() - gone < 1


def _paused_past_the_lease(running: Exec, client: Any, name: str, pid: int) -> None:
    """SIGSTOP ``exec`` past its 2 s lease: its command (``pid``) must end before the hold
    could expire."""
    running.process.send_signal(signal.SIGSTOP)
    try:
        paused = time.monotonic()
        time.sleep(0.05)  # a renewal on its way lands: the hold's end is known from now on
        expires = time.monotonic() + client.pttl(f"redlock:{{{name}}}") / 1000
        wait_for(lambda: not alive(pid), timeout=4, what="child's end")
        assert time.monotonic() < expires, time.monotonic() - paused
        time.sleep(max(0.0, paused + 2.5 - time.monotonic()))  # past the lease
    finally:
        running.process.send_signal(signal.SIGCONT)


def test_exec_paused_past_its_lease_does_not_leave_its_child_running_unheld(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    """``exec`` SIGSTOPped (a debugger, an operator, a frozen process): its child, in a
    group of its own, ran on after the hold expired, beside the next host's. The guard
    kills it before the hold could expire (it knows each confirmed renewal's deadline)."""
    client = redis_server.client()
    name = f"{prefix}-paused"
    running = execs(name, "--ttl", "2", "--grace", "0", *child(redis_server, "trap", prefix))
    pid = int(wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split()[0])
    _paused_past_the_lease(running, client, name, pid)
    code, err = running.finish()
    assert code == exec_action.EXIT_LOST, err  # woken: the hold had gone, the child with it


def test_a_guard_killed_before_exec_is_paused_is_replaced(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    """The guard killed (the OOM killer, an operator), then exec SIGSTOPped past its lease:
    nothing stopped the command, which ran on beside the next host's. exec replaces a guard
    that died, and the new one stops the command before the hold could expire."""
    client = redis_server.client()
    name = f"{prefix}-guard-gone"
    running = execs(name, "--ttl", "2", "--grace", "0", *child(redis_server, "trap", prefix))
    pid, group = map(int, wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split())
    children = Path(f"/proc/{running.process.pid}/task/{running.process.pid}/children")
    (guard,) = [int(p) for p in children.read_text().split() if int(p) not in (pid, group)]
    os.kill(guard, signal.SIGKILL)
    wait_for(
        lambda: any(int(p) not in (pid, group, guard) for p in children.read_text().split()),
        timeout=2, what="a new guard",
    )  # fmt: skip
    try:
        _paused_past_the_lease(running, client, name, pid)
    finally:
        kill_all([pid])
    code, err = running.finish()
    assert code == exec_action.EXIT_LOST and "a new one watches the command" in err, err


def test_exec_stopped_then_its_guard_killed_does_not_run_two_commands_at_once(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    """exec SIGSTOPped, then its guard SIGKILLed: only exec replaced a dead guard, and a
    stopped exec could not, so the command ran on past the hold's end, beside the next
    exec's. The command's parent (exec's child, in the command's group) watches the hold's
    deadline too, and its death takes the command along (the parent-death signal)."""
    client = redis_server.client()
    name = f"{prefix}-stopped-unguarded"
    first = execs(name, "--ttl", "2", "--grace", "0", *child(redis_server, "trap", prefix))
    pid, group = map(int, wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split())
    children = Path(f"/proc/{first.process.pid}/task/{first.process.pid}/children")
    (guard,) = [int(p) for p in children.read_text().split() if int(p) not in (pid, group)]
    first.process.send_signal(signal.SIGSTOP)
    os.kill(guard, signal.SIGKILL)
    try:
        # The next run's command says whether the first one still runs when it starts.
        check = (
            "import sys\n"
            "try:\n"
            f"    state = open('/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]\n"
            "except OSError:\n"
            "    state = 'gone'\n"
            "sys.exit(0 if state in ('gone', 'Z') else 3)\n"
        )
        second = execs(name, "--wait", "30", "--", sys.executable, "-c", check)
        code, err = second.finish(60)
        assert code == 0, f"the first command ran on beside the second: {err}"
    finally:
        first.process.send_signal(signal.SIGCONT)
        kill_all([pid])
    code, err = first.finish()
    assert code in (exec_action.EXIT_LOST, 128 + signal.SIGKILL), (code, err)


def grandchild(redis_server: RedisServer, action: str, prefix: str) -> list[str]:
    """A shell that starts the child in the background (a grandchild of exec, in the
    command's group, that the parent-death signal does not reach) and waits for it."""
    started = " ".join(map(shlex.quote, child(redis_server, action, prefix)[1:]))
    return ["--", "sh", "-c", f"trap '' TERM; {started} & wait"]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_exec_sigkilled_with_its_whole_group_takes_what_the_child_started(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    """``kill -9 -PGID``, ``timeout -s KILL``, a supervisor's killasgroup: the guard shared
    exec's group and died with it, the grandchild ran on unheld beside the next run's."""
    client = redis_server.client()
    running = execs(f"{prefix}-kg", *grandchild(redis_server, "trap", prefix), group=True)
    pid = int(wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split()[0])
    try:
        os.killpg(running.process.pid, signal.SIGKILL)
        running.process.wait()
        wait_for(lambda: not alive(pid), timeout=1, what="grandchild's end")
    finally:
        kill_all([pid])


def test_exec_sigtermed_with_its_group_then_sigkilled_takes_what_the_child_started(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    """SIGTERM to the job's group (a graceful stop) killed the guard (it ignored SIGINT and
    SIGHUP only) while exec waited for a command slow to stop; exec then SIGKILLed (the OOM
    killer): nothing was left to end the command's group."""
    client = redis_server.client()
    running = execs(f"{prefix}-tg", *grandchild(redis_server, "stubborn", prefix), group=True)
    pid = int(wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split()[0])
    try:
        os.killpg(running.process.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert alive(pid)  # it ignores SIGTERM: exec waits out the grace
        running.process.kill()
        running.process.wait()
        wait_for(lambda: not alive(pid), timeout=1, what="grandchild's end")
    finally:
        kill_all([pid])


def test_exec_stopped_with_its_group_does_not_leave_its_child_running_unheld(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    """SIGSTOP to exec's group (``kill -STOP %1``) stopped the guard too: the command, in
    a group of its own, ran on past the hold's end."""
    client = redis_server.client()
    name = f"{prefix}-sg"
    running = execs(name, "--ttl", "2", "--grace", "0", *child(redis_server, "trap", prefix),
                    group=True)  # fmt: skip
    pid = int(wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split()[0])
    os.killpg(running.process.pid, signal.SIGSTOP)
    try:
        paused = time.monotonic()
        time.sleep(0.05)  # a renewal on its way lands: the hold's end is known from now on
        expires = time.monotonic() + client.pttl(f"redlock:{{{name}}}") / 1000
        wait_for(lambda: not alive(pid), timeout=4, what="child's end")
        assert time.monotonic() < expires
        time.sleep(max(0.0, paused + 2.5 - time.monotonic()))  # past the lease
    finally:
        os.killpg(running.process.pid, signal.SIGCONT)
        kill_all([pid])
    code, err = running.finish()
    assert code == exec_action.EXIT_LOST, err


def test_what_the_command_left_in_its_group_does_not_run_on_unheld(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    """A command that exits leaving a process of its group behind (``cmd &``): that
    process ran on after exec released the lock. It gets SIGTERM before the release."""
    client = redis_server.client()
    # The command starts the trap in its group, waits for it to say its pid, exits 3.
    script = (
        "import subprocess, sys, time, redis\n"
        f"subprocess.Popen({child(redis_server, 'trap', prefix)[1:]!r})\n"
        f"r = redis.Redis.from_url({redis_server.url!r})\n"
        f"while not r.llen({prefix + ':pids'!r}):\n"
        "    time.sleep(0.02)\n"
        "sys.exit(3)\n"
    )
    running = execs(f"{prefix}-left", "--grace", "5", "--", sys.executable, "-c", script)
    code = running.process.wait(60)  # not its output's end: the trap holds exec's stderr
    pid = int(client.lindex(f"{prefix}:pids", 0).split()[0])
    try:
        assert code == 3  # the command's own status
        assert not alive(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert "left" in running.finish()[1]


def test_signals_are_forwarded_and_the_child_status_passed_through(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    client = redis_server.client()
    sent = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    running = {
        signum: execs(f"{prefix}-{signum}", *child(redis_server, "trap", f"{prefix}-{signum}"))
        for signum in sent
    }  # at once: each starts in its own time
    for signum, each in running.items():
        wait_for(lambda: client.llen(f"{prefix}-{signum}:pids"), what="child")  # noqa: B023
        each.process.send_signal(signum)
    for signum, each in running.items():
        assert each.finish() == (40 + signum, "")  # the trapping child's exit status
        assert not locks["redis"].is_locked(f"{prefix}-{signum}")


def test_a_signal_while_waiting_ends_the_wait_and_leaves_nothing_held(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    name = f"{prefix}-waiting"
    with lock(name, using="redis", ttl=30):
        waiting = execs(name, "--wait", "120", *child(redis_server, "run", prefix, "0"))
        info = lambda: locks["redis"].inspect(name)  # noqa: E731
        wait_for(lambda: info() is not None and info().waiters, what="a waiter")  # type: ignore[union-attr]
        waiting.process.send_signal(signal.SIGTERM)
        code, err = waiting.finish()
        assert code == 128 + signal.SIGTERM and "interrupted" in err, err
    assert not locks["redis"].is_locked(name)  # nothing taken by the interrupted wait
    assert redis_server.client().llen(f"{prefix}:peaks") == 0  # nothing run


def test_exit_status_and_a_signal_death_pass_through(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    three = execs(f"{prefix}-a", "--", "sh", "-c", "exit 3")
    killed = execs(f"{prefix}-b", "--", "sh", "-c", "kill -KILL $$")
    missing = execs(f"{prefix}-c", "--", "/nonexistent/command")
    assert three.finish()[0] == 3
    assert killed.finish()[0] == 128 + signal.SIGKILL
    code, err = missing.finish()
    assert code == 127 and "could not run" in err


def test_a_cron_loop_on_three_hosts_never_runs_two_at_once(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    """Each "host" starts `exec` again as soon as the last one ended, for 8 s."""
    client = redis_server.client()
    name = f"{prefix}-cron"
    ends = time.monotonic() + 8
    codes: list[int] = []

    def host() -> None:
        while time.monotonic() < ends:
            code, err = execs(name, *child(redis_server, "run", prefix, "0.3")).finish()
            codes.append(code)
            assert code in (0, 75), err

    hosts = [threading.Thread(target=host) for _ in range(3)]
    for each in hosts:
        each.start()
    for each in hosts:
        each.join()
    peaks = [int(p) for p in client.lrange(f"{prefix}:peaks", 0, -1)]
    assert peaks and max(peaks) == 1, peaks
    assert codes.count(0) == len(peaks) and set(codes) <= {0, 75}
    fences = [int(f) for f in client.lrange(f"{prefix}:fences", 0, -1)]
    assert fences == sorted(fences) and len(set(fences)) == len(fences)


@pytest.mark.skipif(shutil.which("script") is None, reason="script(1) makes the terminal")
def test_in_a_terminal_the_command_can_read_it(redis_server: RedisServer, prefix: str) -> None:
    """In its own process group, the child would be stopped (SIGTTIN) by reading its
    terminal; exec hands it the terminal's foreground while it runs."""
    command = (f"{shlex.quote(sys.executable)} -m django redlock exec {prefix}-tty --"
               " sh -c 'read x; echo got $x; exit 4'")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "DJANGO_SETTINGS_MODULE": "tests.support.exec_settings",
           "REDLOCK_TEST_REDIS": redis_server.url}  # fmt: skip
    done = subprocess.run(
        ["script", "-qec", command, "/dev/null"], input="hello\n", env=env, cwd=ROOT,
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 4 and "got hello" in done.stdout, done.stdout + done.stderr


# -- in this process: bad usage, no answer, the incident ------------------------------------------


def run(*args: str) -> tuple[int, str]:
    """``redlock exec ...`` in this process: its exit status and stderr."""
    from io import StringIO

    err = StringIO()
    try:
        call_command("redlock", "exec", *args, stderr=err)
    except CommandError as exc:
        return exc.returncode, str(exc)
    except SystemExit as exc:
        return int(exc.code or 0), err.getvalue()
    return 0, err.getvalue()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["n", "--backend", "down"], "no command"),
        (["n", "--backend", "down", "--"], "no command"),
        (["n", "--backend", "nope", "--", "true"], "unknown backend 'nope'"),
        (["n", "--backend", "down", "--limit", "0", "--", "true"], "--limit"),
        (["n", "--backend", "down", "--wait", "-1", "--", "true"], "--wait"),
        (["n", "--backend", "down", "--grace", "-1", "--", "true"], "--grace"),
        (["n", "--backend", "down", "--ttl", "0", "--", "true"], "ttl"),
        (["n", "--backend", "down", "--grace", "nan", "--", "true"], "--grace is a finite"),
        (["n", "--backend", "down", "--grace", "inf", "--", "true"], "--grace is a finite"),
        (["n", "--backend", "down", "--wait", "nan", "--", "true"], "--wait is a finite"),
        (["n", "--backend", "down", "--wait", "inf", "--", "true"], "--wait is a finite"),
        (["n", "--backend", "down", "--ttl", "nan", "--", "true"], "--ttl is a finite"),
        (["n", "--backend", "down", "--ttl", "inf", "--", "true"], "--ttl is a finite"),
        # Below exec's safety margin: the command would be started only to be killed.
        (["n", "--backend", "down", "--ttl", "0.1", "--", "true"], "--ttl is at least 1 s"),
        (["n", "--backend", "down", "--ttl", "0.99", "--", "true"], "--ttl is at least 1 s"),
        (["n", "--backend", "down", "--conflict-exit-code", "256", "--", "true"], "0 to 255"),
        (["", "--backend", "down", "--", "true"], "name"),
    ],
)
def test_bad_usage_exits_2_before_any_redis_call(args: list[str], says: str) -> None:
    # On the "down" alias: a Redis call would be exit 69, not 2.
    code, text = run(*args)
    assert code == 2 and says in text, text


def test_a_backend_that_cannot_answer_exits_69_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code, err = run("n", "--backend", "down", "--", "touch", str(marker))
    assert code == exec_action.EXIT_UNAVAILABLE == 69 and "could not take" in err, err
    assert not marker.exists()


@pytest.mark.django_db(transaction=True)
def test_a_loss_is_a_lock_incident_and_said_on_stderr(tmp_path: Path) -> None:
    name = f"exec-incident-{next(_runs)}"
    started = tmp_path / "started"
    releaser = threading.Thread(
        target=lambda: (
            wait_for(started.exists, what="child"),
            locks["redis"].force_release(name),
        )
    )
    releaser.start()
    command = f"touch {started}; exec sleep 30"
    code, err = run(name, "--backend", "redis", "--ttl", "3", "--grace", "1", "--", "sh", "-c",
                    command)  # fmt: skip
    releaser.join()
    assert code == 76 and "SIGTERM to the command's process group" in err, err
    incident = LockIncident.objects.get(name=name)
    assert incident.kind == "lost" and incident.backend == "redis"


@pytest.mark.parametrize("kind", [[], ["--fair"], ["--limit", "2"], ["--limit", "2", "--fair"]])
def test_each_kind_runs_the_command_and_releases(kind: list[str], tmp_path: Path) -> None:
    name = f"exec-kind-{next(_runs)}"
    out = tmp_path / "env"
    code, err = run(name, "--backend", "redis", "--ttl", "5", *kind, "--", "sh", "-c",
                    f"echo $REDLOCK_NAME $REDLOCK_BACKEND $REDLOCK_FENCE > {out}")  # fmt: skip
    assert code == 0, err
    got_name, backend, fence = out.read_text().split()
    assert (got_name, backend) == (name, "redis") and int(fence) > 0
    assert not locks["redis"].is_locked(name)


def test_a_command_that_cannot_be_started_leaves_nothing_held_or_renewed() -> None:
    name = f"exec-unstartable-{next(_runs)}"
    code, err = run(name, "--backend", "redis", "--", "echo\0oops")  # Popen: ValueError
    assert code == 126 and "could not run" in err, err
    assert not locks["redis"].is_locked(name)
    assert not [t for t in threading.enumerate() if t.name.startswith("redlock-keeper")]


def test_a_lock_held_in_this_process_is_a_conflict() -> None:
    with lock("exec-held", using="redis"):
        code, err = run("exec-held", "--backend", "redis", "--", "true")
    assert code == 75 and "held elsewhere" in err


def test_a_name_held_as_another_kind_is_a_conflict() -> None:
    with semaphore("exec-kind-clash", 3, using="redis"):
        code, err = run("exec-kind-clash", "--backend", "redis", "--", "true")
    assert code == 75 and "another kind" in err and "true not run" in err, err


def test_the_guard_exists_before_the_command_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No moment when the command runs (and may start others in its group) unguarded: an
    exec killed then would leave them running."""
    started = tmp_path / "started"
    seen: list[bool] = []
    real = exec_action._guard

    def slow_guard(*args: Any) -> Any:
        time.sleep(0.5)  # had the command started, it would have touched the file by now
        seen.append(started.exists())
        return real(*args)

    monkeypatch.setattr(exec_action, "_guard", slow_guard)
    code, err = run(f"exec-guard-{next(_runs)}", "--backend", "redis", "--", "touch",
                    str(started))  # fmt: skip
    assert code == 0 and seen == [False] and started.exists(), (err, seen)


def test_no_answer_with_grace_0_stops_the_child_before_the_hold_could_expire(
    redis_factory: Callable[..., RedisServer], prefix: str
) -> None:
    """--grace 0 still leaves a safety margin before the hold could run out: for polling,
    the kill and the scheduler."""
    server = redis_factory()
    name = f"{prefix}-grace0"
    running = Exec(server.url, name, "--backend", "default", "--ttl", "2", "--grace", "0",
                   *child(server, "trap", prefix))  # fmt: skip
    client = redis.Redis.from_url(server.url)
    pid = int(wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split()[0])
    ttl = client.pttl(f"redlock:{{{name}}}") / 1000
    server.pause()
    try:
        expires = time.monotonic() + ttl
        while alive(pid) and time.monotonic() < expires + 1:
            time.sleep(0.005)
        assert time.monotonic() < expires - 0.1, ttl  # a margin left, not the hold's end
        code, err = running.finish()
    finally:
        server.resume()
    assert code == 69 and "may have expired" in err, err


def test_a_paused_redis_gives_69_within_one_socket_timeout(
    redis_factory: Callable[..., RedisServer], prefix: str
) -> None:
    """exec against a Redis that does not answer (SIGSTOP) waited for the startup's script
    load of each alias (three here, one server), one socket timeout each, then for the
    take: 8 s for a promise of BackendUnavailable (69) within one socket timeout (2 s). The
    aliases are prepared at once, and a backend that did not answer them is not asked
    again."""
    server = redis_factory()
    name = f"{prefix}-unanswered"

    def timed() -> tuple[float, int, str]:
        started = time.monotonic()
        code, err = Exec(server.url, name, "--", "true").finish()
        return time.monotonic() - started, code, err

    baseline, code, err = timed()  # Django's startup, on this machine now
    assert code == 0, err
    server.pause()
    try:
        took, code, err = timed()
    finally:
        server.resume()
    assert code == 69 and "could not take" in err, err
    assert took - baseline < 2 + 1.5, (took, baseline)  # 8 s before


def test_a_pause_of_exec_longer_than_the_ttl_is_a_loss_76(
    redis_server: RedisServer, prefix: str
) -> None:
    """Paused (SIGSTOP) past its TTL, exec finds on waking that the hold is gone: the
    backend answered all along, so that is a loss (76), not "no answer" (69)."""
    running = Exec(redis_server.url, f"{prefix}-stopped", "--ttl", "1", "--grace", "0.2",
                   *child(redis_server, "trap", prefix))  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    pid = int(wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split()[0])
    running.process.send_signal(signal.SIGSTOP)
    time.sleep(2)  # the hold expires meanwhile
    running.process.send_signal(signal.SIGCONT)
    code, err = running.finish(30)
    assert code == 76 and "paused" in err, err
    assert not alive(pid)


def test_a_pause_of_exec_past_its_give_up_point_is_69_and_says_it_was_paused(
    redis_server: RedisServer, prefix: str
) -> None:
    """Paused (SIGSTOP) for less than its TTL, but past the point where it gives up on
    unconfirmed renewals, with Redis answering all along: exec cannot tell that the hold
    lasted, so it stops the child and exits 69 (documented: the hold not kept confirmed),
    its stderr saying it was paused, not that the backend did not answer; and it releases."""
    name = f"{prefix}-short-pause"
    # --ttl 4 --grace 2: gives up 1.6 s after the last confirmed renewal (a renewal every
    # 0.8 s), the guard kills 3.6 s after it: a pause of 1.8 s lands between the two.
    running = Exec(redis_server.url, name, "--ttl", "4", "--grace", "2",
                   *child(redis_server, "trap", prefix))  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    pid = int(wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split()[0])
    running.process.send_signal(signal.SIGSTOP)
    time.sleep(1.8)
    running.process.send_signal(signal.SIGCONT)
    code, err = running.finish(30)
    assert code == 69 and "paused" in err and "may have expired" in err, err
    assert not alive(pid) and not client.exists(f"redlock:{{{name}}}")


def test_no_answer_while_the_child_runs_stops_it_before_the_hold_could_expire(
    redis_factory: Callable[..., RedisServer], prefix: str
) -> None:
    """A Redis that stops answering (SIGSTOP) is not a loss, but the hold may run out
    unrenewed: the child is stopped before it could, and exec says 69."""
    server = redis_factory()
    running = Exec(server.url, f"{prefix}-paused", "--backend", "default", "--ttl", "3", "--grace",
                   "1", *child(server, "trap", prefix))  # fmt: skip
    client = redis.Redis.from_url(server.url)
    pid = int(wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split()[0])
    server.pause()
    try:
        paused = time.monotonic()
        # The hold was confirmed at most 1 s before the pause: it could expire 3 s after that.
        wait_for(lambda: not alive(pid), timeout=3.5, what="child's end")
        assert time.monotonic() - paused < 3
        code, err = running.finish()  # after its renewal's and release's socket timeouts
    finally:
        server.resume()
    assert code == 69 and "may have expired" in err, err


@pytest.mark.parametrize("kind", [[], ["--limit", "1"]])
def test_a_lost_reply_to_the_take_gives_the_hold_back_before_exiting_69(
    redis_server: RedisServer, prefix: str, kind: list[str]
) -> None:
    """The take's reply lost, Redis healthy: exec exited 69 and left the hold the server had
    granted it for its whole TTL, so every other exec of the name was refused (75) while no
    command ran anywhere."""
    name = f"{prefix}-lost-take"
    proxy = LossyProxy(redis_server.port)
    try:
        proxy.mute_from(f"{{{name}}}".encode())
        code, err = Exec(proxy.url, name, "--ttl", "30", *kind, "--", "true").finish()
    finally:
        proxy.close()
    assert proxy.muted.is_set() and code == 69 and "could not take" in err, err
    code, err = Exec(redis_server.url, name, "--ttl", "30", *kind, "--", "true").finish()
    assert code == 0, err  # 75 before: "held elsewhere"


@pytest.fixture
def sigterm_ignored() -> Iterator[None]:
    """This process's SIGTERM handler a no-op, should exec's not be installed when one comes."""
    previous = signal.signal(signal.SIGTERM, lambda *args: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exec_options(name: str, backend: str = "redis") -> dict[str, Any]:
    return {
        "name": name, "command": ["true"], "backend": backend, "ttl": 20.0, "wait": 0.0,
        "limit": None, "fair": False, "grace": 0.5, "conflict_exit_code": 75,
    }  # fmt: skip


def test_a_signal_as_soon_as_exec_s_handlers_are_installed_ends_it_with_its_status(
    sigterm_ignored: None,
) -> None:
    """A SIGTERM between the handlers' install and the take's ``try``: the handler's
    _Interrupted left run(), and the command died with a traceback (exit 1), not 143."""
    name = f"exec-early-signal-{next(_runs)}"
    opts, held = exec_action.check(exec_options(name))
    ours = signal.getsignal(signal.SIGTERM)
    sent: list[int] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != exec_action.__file__:
            return None
        if event == "line" and not sent and signal.getsignal(signal.SIGTERM) is not ours:
            sent.append(frame.f_lineno)  # the first line run once exec's handler is in
            os.kill(os.getpid(), signal.SIGTERM)
        return tracer

    said: list[str] = []
    sys.settrace(tracer)
    try:
        code = exec_action.run(opts, held, said.append)
    finally:
        sys.settrace(None)
    assert sent and code == 143 and "interrupted (signal 15)" in said[-1], (sent, said)
    assert not locks["redis"].is_locked(name)


@pytest.mark.parametrize("outcome", ["held elsewhere", "another kind", "unavailable"])
def test_a_signal_while_exec_says_why_nothing_ran_ends_it_with_its_status(
    sigterm_ignored: None, outcome: str
) -> None:
    """A SIGTERM while exec said why nothing ran (75, 69): in the take's error branches
    (another kind, no answer) its handler still raised _Interrupted, which left run() (a
    traceback, exit 1); after a refusal it was put off, and the status was 75."""
    name = f"exec-say-signal-{next(_runs)}"
    opts, held = exec_action.check(
        exec_options(name, "down" if outcome == "unavailable" else "redis")
    )
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if len(said) == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    holding: Any = {
        "held elsewhere": lock(name, using="redis"),
        "another kind": semaphore(name, 2, using="redis"),
        "unavailable": contextlib.nullcontext(),
    }[outcome]
    with holding:
        code = exec_action.run(opts, held, say)
    assert code == 143 and "interrupted (signal 15)" in said[-1], said
    assert len(said) == 2, said


def test_a_stopped_command_is_resumed_and_told_job_control_is_not_supported(
    redis_server: RedisServer, execs: Callable[..., Exec], prefix: str
) -> None:
    """Ctrl-Z (SIGTSTP to the command's group, the terminal's foreground): the command
    stopped while exec renewed its hold on and the shell, waiting for exec, hung."""
    client = redis_server.client()
    name = f"{prefix}-tstp"
    running = execs(name, "--ttl", "3", "--grace", "1", *child(redis_server, "trap", prefix))
    pid, group = map(int, wait_for(lambda: client.lpop(f"{prefix}:pids"), what="child").split())
    os.killpg(group, signal.SIGTSTP)
    try:
        time.sleep(1)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state != "T", state
    finally:
        os.killpg(group, signal.SIGCONT)
    running.process.terminate()
    _, err = running.finish()
    assert "job control is not supported" in err and not alive(pid), err
