"""``manage.py redlock exec NAME [options] -- COMMAND [ARG ...]``: run a command while this
process holds a lock (or one of ``--limit`` permits), like ``flock(1)`` across hosts.

The command runs in its own process group with ``REDLOCK_NAME``, ``REDLOCK_FENCE`` and
``REDLOCK_BACKEND`` in its environment, as the child of exec's child (:data:`_PARENT`, the
group's leader). The hold is renewed by a :class:`~..leader.Keeper` while it runs. SIGINT,
SIGTERM and SIGHUP sent to ``exec`` go to the group. If ``exec`` dies, a guard process kills
the group (:data:`_GUARD`), and on Linux the command's parent gets SIGKILL from the kernel at
once, and the command after it (``PR_SET_PDEATHSIG``, set between fork and exec, in
``exec``'s main thread: the signal follows the forking thread). If ``exec`` stops running
without dying (SIGSTOP, a debugger) the guard and the command's parent both kill the group
before the hold could expire: ``exec`` tells them each renewal confirmed.

Exit status: the child's (128 + N when signal N ended it); :data:`EXIT_CONFLICT` (or
``--conflict-exit-code``) when the lock was not taken (held elsewhere, or as another kind),
nothing run; :data:`EXIT_UNAVAILABLE`
when the backend could not answer before the child ran, or when, while it ran, no renewal
was confirmed for so long that the hold may have expired (the backend did not answer, or
``exec`` itself was paused): the child was then stopped; :data:`EXIT_LOST` when the backend
answered that the hold was gone while the child ran (it was stopped); 2 bad usage, before
any Redis call; 126/127 the command could not be run (not executable / not found).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..exceptions import (
    BackendRefused,
    BackendUnavailable,
    LockError,
    LockNotOwned,
    MissingPermission,
    QuorumNotReached,
)
from ..handler import locks
from ..incidents import recorder
from ..leader import Keeper, hold_start
from ..locking import BaseLock, lock, semaphore

EXIT_CONFLICT = 75  # EX_TEMPFAIL: cron wrappers read it as "try again later"
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE
EXIT_LOST = 76  # the hold was lost while the child ran; the child was stopped
EXIT_USAGE = 2
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
# Unanswered renewals are given up on at least this long (or this share of the TTL) plus
# --grace before the hold could expire: covers POLL, the kill and a late scheduler.
SAFETY = 0.2
SAFETY_SHARE = 0.1
POLL = 0.02  # seconds between looks at the child's end
# The shortest hold exec can cover: a renewal every third of it, with the safety margin and
# the kill inside it (a shorter one would start the command only to kill it at once).
MIN_TTL = 1.0
# How long exec gives back a take that got no answer before it exits 69 (see _take).
GIVE_BACK = 1.0


class UsageError(ValueError):
    """Bad usage: exit 2, before any Redis call."""


@dataclass
class Options:
    name: str
    command: list[str]
    backend: str
    ttl: float | None
    wait: float
    limit: int | None
    fair: bool
    grace: float
    conflict_exit_code: int


def check(options: dict[str, Any]) -> tuple[Options, BaseLock]:
    """The options, and the lock object they describe; :class:`UsageError` without a Redis call."""
    command = list(options.get("command") or [])
    if not command:
        raise UsageError("no command: `redlock exec NAME [options] -- COMMAND [ARG ...]`")
    alias = options["backend"]
    if alias not in locks.settings:
        raise UsageError(f"unknown backend {alias!r}; known: {', '.join(locks.settings)}")
    opts = Options(
        name=options["name"], command=command, backend=alias, ttl=options["ttl"],
        wait=options["wait"], limit=options["limit"], fair=options["fair"],
        grace=options["grace"], conflict_exit_code=options["conflict_exit_code"],
    )  # fmt: skip
    for flag, value in (("--wait", opts.wait), ("--grace", opts.grace), ("--ttl", opts.ttl)):
        if value is not None and not math.isfinite(value):  # nan compares False to all
            raise UsageError(f"{flag} is a finite number of seconds, not {value}")
    if opts.wait < 0:
        raise UsageError(f"--wait is seconds >= 0, not {opts.wait:g}")
    if opts.grace < 0:
        raise UsageError(f"--grace is seconds >= 0, not {opts.grace:g}")
    if opts.limit is not None and opts.limit < 1:
        raise UsageError(f"--limit is a number of permits >= 1, not {opts.limit}")
    if not 0 <= opts.conflict_exit_code <= 255:
        raise UsageError(f"--conflict-exit-code is 0 to 255, not {opts.conflict_exit_code}")
    try:
        held: BaseLock
        if opts.limit is None:
            held = lock(opts.name, using=alias, ttl=opts.ttl, fair=opts.fair, auto_renew=False)
        else:
            held = semaphore(
                opts.name, opts.limit, using=alias, ttl=opts.ttl, fair=opts.fair, auto_renew=False
            )
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise UsageError(str(exc)) from None
    if float(held.lock_ttl) < MIN_TTL:  # the backend's TTL too, when --ttl is not given
        raise UsageError(
            f"--ttl is at least {MIN_TTL:g} s for exec (a renewal every third of it, a safety"
            f" margin of {SAFETY:g} s before it ends), not {float(held.lock_ttl):g}"
        )
    return opts, held


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N for signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _pdeathsig() -> Callable[[int], int] | None:
    """libc's prctl, looked up before the fork (nothing is loaded between fork and exec)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


def _foreground() -> bool:
    """Whether exec runs in its terminal's foreground (then so must its child's group)."""
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def _preexec(
    prctl: Callable[..., int] | None, parent: int, foreground: bool, guard: int | None
) -> Callable[[], None]:
    def setup() -> None:
        os.setpgid(0, 0)  # its own group: exec signals the group, the terminal does not
        if guard is not None:  # the guard kills this group from now on if exec dies
            # Best effort: a guard already gone (EPIPE) leaves the parent-death signal.
            signal.signal(signal.SIGPIPE, signal.SIG_IGN)
            with contextlib.suppress(OSError):
                os.write(guard, b"%d\n" % os.getpid())
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        if foreground:  # as a shell does, in the child too: it may read before exec's turn
            signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            os.tcsetpgrp(0, os.getpid())
            signal.signal(signal.SIGTTOU, signal.SIG_DFL)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # exec died before the prctl: nothing would kill us
                os.kill(os.getpid(), signal.SIGKILL)

    return setup


def _take(opts: Options, held: BaseLock, what: str, say: Callable[[str], None]) -> int | None:
    """Take the lock: None once it is ours, else the exit status (said why)."""
    try:
        taken = held.acquire(timeout=opts.wait) if opts.wait > 0 else held.acquire(blocking=False)
    except (BackendUnavailable, QuorumNotReached) as exc:  # no answer: nothing run
        _give_back_unanswered(held)
        say(f"could not take {what}: {exc}")
        return EXIT_UNAVAILABLE
    except (BackendRefused, MissingPermission) as exc:  # refused (not run): nothing run
        say(f"could not take {what}: {exc}")
        return EXIT_UNAVAILABLE
    except LockError as exc:  # held as another kind: a conflict, nothing run
        say(f"{exc}: {' '.join(opts.command)} not run")
        return opts.conflict_exit_code
    if not taken:
        waited = f" within {opts.wait:g} s" if opts.wait else ""
        say(f"{what} is held elsewhere{waited}: {' '.join(opts.command)} not run")
        return opts.conflict_exit_code
    return None


def _give_back_unanswered(held: BaseLock) -> None:
    """A take that got no answer may have been granted, and exec exits: nobody would release
    that hold before its TTL. The lock tries again with the same token (so it finds that
    hold) and the hold found is released; for :data:`GIVE_BACK` seconds at most (a backend
    that still does not answer: the hold, if any, runs out at its TTL)."""

    def give_back() -> None:
        with contextlib.suppress(LockError):
            if held.acquire(blocking=False):
                held.release()

    thread = threading.Thread(target=give_back, name="redlock-exec-give-back", daemon=True)
    thread.start()
    thread.join(GIVE_BACK)


class _Interrupted(BaseException):
    """A signal while the lock was being taken (a BaseException, as KeyboardInterrupt: the
    take gives back whatever it may have been granted)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run(opts: Options, held: BaseLock, say: Callable[[str], None]) -> int:
    """Take the lock, run the child under it, release; the exit status. ``say`` writes a
    line to stderr."""
    what = f"{opts.name!r} on {opts.backend!r}"
    taking = True  # until the lock is ours: a signal ends the take (nothing is left held)
    pending: list[int] = []  # signals that came before the child existed
    child: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, frame: object) -> None:
        nonlocal taking
        if taking:  # once: a second signal does not cut short the give-back and its say
            taking = False
            raise _Interrupted(signum)
        if child is None:
            pending.append(signum)
        elif child.returncode is None:  # its group id is not reused while it is unreaped
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signum)
                os.killpg(child.pid, signal.SIGCONT)  # a stopped group would not act on it

    # The backend gave startup no answer a moment ago: a take would wait a socket timeout
    # more, and the promise is 69 within one (nothing taken, nothing run).
    unanswered = locks[opts.backend].unanswered_at_startup()
    if unanswered is not None:
        say(f"could not take {what}: {unanswered}")
        return EXIT_UNAVAILABLE
    previous: dict[int, Any] = {}
    try:
        # Inside the try, from the install on: a signal that comes at once is an
        # _Interrupted handled below, and each handler replaced is put back.
        try:
            for forwarded in FORWARDED:
                previous[forwarded] = signal.getsignal(forwarded)
                signal.signal(forwarded, on_signal)
            before = time.monotonic()  # the hold counts from before its take was sent
            refused = _take(opts, held, what, say)
            taking = False
        except _Interrupted as exc:
            if held.token is not None:  # taken just before the signal: give it back
                with contextlib.suppress(LockError):
                    held.release()
            say(f"interrupted (signal {exc.signum}) while taking {what}: nothing run")
            return 128 + exc.signum
        if refused is not None:
            return refused
        # Give up on unanswered renewals the grace plus a safety margin (polling, the kill,
        # the last renewal's delivery) before an unrenewed hold could expire.
        ttl = float(held.lock_ttl)
        safety = max(SAFETY, ttl * SAFETY_SHARE)
        margin = min(opts.grace + safety, ttl * 2 / 3)
        grace = max(0.0, margin - safety)  # SIGTERM to SIGKILL, within the margin
        guard: subprocess.Popen[bytes] | None = None
        # The guard's deadline: when exec itself would have sent SIGKILL had it run.
        deadlines = _Deadlines(safety)
        try:
            keeper = Keeper(
                held, margin=margin, since=hold_start(held, before), on_confirmed=deadlines.tell
            )
        except BaseException as exc:
            with contextlib.suppress(LockError):
                held.release()
            if isinstance(exc, LockNotOwned):  # expired before it was confirmed: not run
                say(f"{what} was taken and lost at once: {exc}: {' '.join(opts.command)} not run")
                return opts.conflict_exit_code
            if isinstance(exc, LockError):
                say(f"could not confirm the hold of {what}: {exc}")
                return EXIT_UNAVAILABLE
            raise
        try:
            keeper.start()
            env = {
                **os.environ,
                "REDLOCK_NAME": opts.name,
                "REDLOCK_FENCE": "" if held.fence is None else str(held.fence),
                "REDLOCK_BACKEND": opts.backend,
            }
            if pending:
                return _release(held, keeper, say, 128 + pending[0])
            # In a terminal's foreground, the child's group takes the terminal while it runs (it
            # may read it; Ctrl-C reaches it directly), and gives it back to exec's at the end.
            foreground = _foreground()
            if foreground:
                previous[signal.SIGTTOU] = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            # The guard first: once the child has its group, there is no moment without one.
            guard = _guard()
            guard_fd = None if guard is None or guard.stdin is None else guard.stdin.fileno()
            deadlines.attach(guard_fd, keeper.confirmed_until)
            # exec's child is the parent of the command (see _PARENT), told the deadlines too.
            told, tell = os.pipe()
            deadlines.attach(tell, keeper.confirmed_until, own=True)  # closed by _dismiss
            try:
                child = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _PARENT, str(told),
                     f"{deadlines.deadline():.6f}", *opts.command],
                    env=env, pass_fds=(told,),
                    preexec_fn=_preexec(_pdeathsig(), os.getpid(), foreground, guard_fd),
                )  # fmt: skip
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                say(f"could not run {opts.command[0]!r}: {exc}")
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                return _release(held, keeper, say, code)
            finally:
                os.close(told)
            for signum in pending:  # came while it was being started
                on_signal(signum, None)

            running = child

            def tend_guard() -> None:
                """A guard that died (the OOM killer, an operator's kill) is replaced at once:
                without one, exec stopped later (SIGSTOP) would leave the command running on
                past the hold."""
                nonlocal guard
                if guard is None or guard.poll() is None:
                    return
                # Told the group and deadline in its arguments: exec stopped right after the
                # start leaves a guard that knows them all the same.
                new = _guard(running.pid, deadlines.deadline())
                if new is None or new.stdin is None:
                    return
                old, guard = guard, new
                deadlines.attach(new.stdin.fileno(), keeper.confirmed_until)
                if old.stdin is not None:
                    with contextlib.suppress(OSError):
                        old.stdin.close()
                say("the guard process was gone: a new one watches the command")

            try:
                return _supervise(opts, held, keeper, child, say, grace, tend_guard)
            finally:
                if foreground:
                    with contextlib.suppress(OSError):
                        os.tcsetpgrp(0, os.getpgrp())
        except BaseException:
            # Anything unforeseen: no child left running, no hold left renewed.
            if child is not None and child.returncode is None:
                _terminate(child, 0)
            keeper.stop()
            with contextlib.suppress(LockError):
                held.release()
            raise
        finally:
            _dismiss(guard, deadlines)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        recorder.flush(5)


# The guard, a process of its own, started before the command: the command writes its
# process group's id to the guard's stdin (a line of digits, between its setpgid and its exec),
# and exec each deadline ("D <monotonic seconds>": the hold is confirmed until then, less the
# safety margin). SIGKILL to that group once exec's end of that stdin closes without a "done"
# (exec was killed), so that what the command started dies with it too (the kernel's
# parent-death signal reaches the command alone); and once a deadline passes with no later
# one (exec stopped running: SIGSTOP, a debugger; it would have stopped the command by then),
# so that the command never runs on after the hold could expire. CLOCK_MONOTONIC is one clock
# for every process of the host. It runs in a session of its own, so that what is sent to
# exec's group (kill -9 -PGID, timeout -s KILL, a supervisor's killasgroup, SIGSTOP, a
# terminal's signals) does not reach it, and ignores SIGINT, SIGHUP and SIGTERM besides: it
# ends by itself once exec's end of the pipe closes.
_GUARD = """import os, select, signal, sys, time
for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
    signal.signal(signum, signal.SIG_IGN)
fd, said, group, deadline, due = sys.stdin.fileno(), b"", None, None, False
if len(sys.argv) == 3:  # a replacement: the group and its deadline known from the start
    group, deadline = int(sys.argv[1]), float(sys.argv[2])
def kill():
    if group is not None:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not select.select([fd], [], [], wait)[0]:
        due, deadline = True, None
        kill()
        continue
    chunk = os.read(fd, 4096)
    if not chunk:
        break
    said += chunk
    *lines, said = said.split(b"\\n")
    for line in lines:
        if line.isdigit():
            group = int(line)
            if due:
                kill()
        elif line.startswith(b"D "):
            at = float(line[2:])
            deadline = at if deadline is None else max(deadline, at)
if said != b"done":
    kill()
"""


# The command's parent: exec's child, leader of the command's process group (exec's preexec
# made it so), started as ``_PARENT FD DEADLINE COMMAND...``. It runs the command with the
# parent-death signal (Linux) set to SIGKILL, and SIGKILLs its group (itself included) once the
# deadline (monotonic) passes with no later one read from FD ("D <seconds>" lines from exec,
# as the guard's), or once FD closes (exec died). So a command runs on past the hold's end
# only if exec, the guard and this process all stop, the last without dying: exec stopped
# (SIGSTOP) and the guard killed left nobody to stop it. It ignores SIGINT, SIGTERM and
# SIGHUP (exec forwards them to the group: they are the command's), and ends as the command
# did: its status, or its signal. Isolated (-I -S): no module of the working directory.
_PARENT = """import os, select, signal, subprocess, sys, time
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
for signum in FORWARDED:
    signal.signal(signum, signal.SIG_IGN)
fd, deadline, command = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
prctl = None
if sys.platform.startswith("linux"):
    try:
        import ctypes, ctypes.util
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError, ImportError):
        prctl = None
me = os.getpid()
def setup():
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    if prctl is not None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != me:  # this process died before the prctl
            os.kill(os.getpid(), signal.SIGKILL)
def kill():
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(137)
try:
    child = subprocess.Popen(command, preexec_fn=setup)
except (OSError, ValueError, subprocess.SubprocessError) as exc:
    sys.stderr.write(f"redlock exec: could not run {command[0]!r}: {exc}\\n")
    sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)
try:
    ended = os.pidfd_open(child.pid)
except (AttributeError, OSError):
    ended = None  # looked at every 50 ms
said = b""
while child.poll() is None:
    wait = deadline - time.monotonic()
    if wait <= 0:
        kill()
    watched = [fd] if ended is None else [fd, ended]
    ready = select.select(watched, [], [], wait if ended is not None else min(wait, 0.05))[0]
    if fd in ready:
        chunk = os.read(fd, 4096)
        if not chunk:  # exec died
            kill()
        said += chunk
        *lines, said = said.split(b"\\n")
        for line in lines:
            if line.startswith(b"D "):
                deadline = max(deadline, float(line[2:]))
code = child.returncode
if code < 0:  # end as the command did, without a core file of this process
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        signal.signal(-code, signal.SIG_DFL)
    except (OSError, ValueError):  # SIGKILL's cannot be set (nor needs to be)
        pass
    os.kill(os.getpid(), -code)
    os._exit(128 - code)
sys.exit(code)
"""


class _Deadlines:
    """Tells the guard and the command's parent each deadline (from the keeper's renewal
    thread), until finished."""

    def __init__(self, safety: float) -> None:
        self.safety = safety
        self._mutex = threading.Lock()
        self._fd: int | None = None  # the guard's (replaced with it)
        self._parent: int | None = None  # the command's parent's (ours: closed at finish)
        self._until = 0.0
        self._done = False

    def tell(self, until: float) -> None:
        with self._mutex:
            self._until = max(self._until, until)
            self._send()

    def attach(self, fd: int | None, until: float, own: bool = False) -> None:
        """The guard's fd (``own``: the command's parent's, which this object closes)."""
        if fd is not None:  # a reader that stopped reading never blocks a renewal's thread
            with contextlib.suppress(OSError):
                os.set_blocking(fd, False)
        with self._mutex:
            if own:
                self._parent = fd
            else:
                self._fd = fd
            self._until = max(self._until, until)
            self._send()

    def deadline(self) -> float:
        """The last deadline told (the guard's kill time)."""
        with self._mutex:
            return self._until - self.safety

    def _send(self) -> None:
        if self._done:
            return
        for fd in (self._fd, self._parent):
            if fd is not None:
                with contextlib.suppress(OSError):  # gone: the others (and the kernel) stay
                    os.write(fd, b"D %.6f\n" % (self._until - self.safety))

    def finish(self) -> None:
        """Say "done": the guard leaves the group alone; no deadline is sent after it. The
        command's parent is gone by then (or killed with its group): its fd is closed."""
        with self._mutex:
            if self._fd is not None and not self._done:
                with contextlib.suppress(OSError):
                    os.write(self._fd, b"done")
            self._done = True
            if self._parent is not None:
                with contextlib.suppress(OSError):
                    os.close(self._parent)
                self._parent = None


def _guard(group: int | None = None, deadline: float = 0.0) -> subprocess.Popen[bytes] | None:
    known = [] if group is None else [str(group), f"{deadline:.6f}"]
    try:
        return subprocess.Popen(
            [sys.executable, "-S", "-c", _GUARD, *known],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of reach of what is sent to exec's group
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # the command still dies with exec (Linux)
        return None


def _dismiss(guard: subprocess.Popen[bytes] | None, deadlines: _Deadlines) -> None:
    deadlines.finish()  # first: no deadline written after "done", nor to a closed fd
    if guard is None or guard.stdin is None:
        return
    with contextlib.suppress(OSError):
        guard.stdin.close()
    try:
        guard.wait(5)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait()


def _supervise(
    opts: Options,
    held: BaseLock,
    keeper: Keeper,
    child: subprocess.Popen[bytes],
    say: Callable[[str], None],
    grace: float,
    tend_guard: Callable[[], None] = lambda: None,
) -> int:
    said_stopped = False
    while True:
        if _stopped(child.pid):  # Ctrl-Z: the shell waits for exec, which would renew on
            if not said_stopped:
                said_stopped = True
                say(
                    "the command was stopped (Ctrl-Z?): job control is not supported while"
                    " holding the lock; it goes on (SIGCONT)"
                )
            _killpg(child.pid, signal.SIGCONT)
        returncode = child.poll()
        tend_guard()
        if returncode is not None:
            if _end_leftovers(child.pid, grace, keeper, say):
                break  # the hold ended while they were being stopped
            return _release(held, keeper, say, exit_status(returncode))
        if keeper.lost.wait(POLL):  # the child's end is seen within POLL, a loss at once
            break
    # The hold is gone (or may be): the child must not go on without it.
    why = "may have expired" if keeper.unknown else "was lost"
    say(
        f"the hold of {opts.name!r} on {opts.backend!r} {why} ({keeper.reason}): SIGTERM to"
        f" the command's process group, SIGKILL after {grace:g} s"
    )
    _terminate(child, grace)
    keeper.stop()
    if keeper.unknown:
        # Our hold may still be there: let it go if the backend answers (else it expires).
        # The backend's answer that it is gone (it expired while this process was paused,
        # say) is a loss; only no answer stays unknown.
        try:
            held.release()
        except LockNotOwned as exc:
            say(f"the backend says the hold of {held.name!r} is gone: {exc}")
            return EXIT_LOST
        except LockError:
            pass
        return EXIT_UNAVAILABLE
    return EXIT_LOST


def _group_runs(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # only members this process cannot signal are left
        return False
    return True


def _end_leftovers(pgid: int, grace: float, keeper: Keeper, say: Callable[[str], None]) -> bool:
    """The command ended; what it left running in its group (``cmd &``) must not run on
    once the hold is released: SIGTERM, SIGKILL after ``grace``, still under the hold.
    Whether the hold ended meanwhile (the caller then handles it as a loss)."""
    if not _group_runs(pgid):
        return False
    say(
        f"the command left processes running in its group: SIGTERM to them, SIGKILL after"
        f" {grace:g} s, before the release"
    )
    _killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _group_runs(pgid) and time.monotonic() < deadline:
        if keeper.lost.wait(POLL):
            break
    _killpg(pgid, signal.SIGKILL)
    return keeper.lost.is_set()


def _terminate(child: subprocess.Popen[bytes], grace: float) -> None:
    _killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=grace)
    # The group too: what the child started may outlive it.
    _killpg(child.pid, signal.SIGKILL)
    child.wait()


def _stopped(pid: int) -> bool:
    """Whether the child stopped since last asked (WSTOPPED only: it is never reaped here,
    Popen's poll sees its end)."""
    try:
        return os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOHANG) is not None
    except ChildProcessError:  # reaped already
        return False


def _killpg(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _release(held: BaseLock, keeper: Keeper, say: Callable[[str], None], code: int) -> int:
    keeper.stop()
    if keeper.lost.is_set() and not keeper.unknown:
        say(f"the hold of {held.name!r} was lost before the command ended: {keeper.reason}")
        return EXIT_LOST
    try:
        held.release()
    except LockNotOwned as exc:  # gone before the child ended: it ran part of the time unheld
        say(f"the hold of {held.name!r} was lost before the command ended: {exc}")
        return EXIT_LOST
    except LockError as exc:  # no answer: the hold runs out at its TTL
        say(f"could not release {held.name!r} (it expires at its TTL): {exc}")
    return code


def parse_command(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[..., "--", *command]`` -> the arguments before ``--`` and the command after it."""
    if "--" not in args:
        return list(args), []
    at = list(args).index("--")
    return list(args[:at]), list(args[at + 1 :])
