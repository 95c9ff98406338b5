"""``manage.py redlock list|release|purge|prune-incidents|prune-fences|top``: the admin's
page, from a shell; ``redlock exec NAME -- COMMAND``: a command run under a lock.

Exit codes scripts can trust: 0 done, 1 nothing to do (no such lock, nothing matched,
purge not confirmed), 2 bad usage, 3 a backend did not answer; ``exec`` has its own (see
:mod:`..exec_action`).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from argparse import SUPPRESS, ArgumentParser, ArgumentTypeError, Namespace
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS

from ...backends.base import LockInfo, Released
from ...display import multi_text
from ...exceptions import LockError, LockNotAcquired
from ...fence_table import prune_fences
from ...fencing import check_database
from ...handler import locks
from ...health import Health, contention_order, ping, summarise
from ...incidents import prune, recorder
from ...validation import check_glob, check_name
from .. import exec_action

NOTHING, UNAVAILABLE = 1, 3
#: Seconds a release or purge waits, before it exits, for a write owed to a node that did
#: not answer (a Redlock node paused or down): a few node timeouts.
OWED_WAIT = 3.0
EXIT_CODES = {
    "list": "0 listed (every backend answered); 2 an unknown --backend; 3 a backend did not"
    " answer (it is named, and the others are still listed)",
    "release": "0 released; 1 not held, or held by another hold than --fence; 2 an unknown"
    " --backend, or a name no lock can have; 3 the backend did not answer",
    "purge": "0 released what was listed (a lock that changed hands since is left alone, and"
    " named); 1 nothing matched, or not confirmed; 2 an unknown --backend; 3 a backend did"
    " not answer",
    "prune-incidents": "0 done",
    "prune-fences": "0 done; 1 busy, nothing deleted (a floor stayed locked: run it again"
    " later); 2 bad usage (an age without its unit, an unknown --database)",
    "top": "0 done (Ctrl-C, or --once); 2 an unknown --backend; 3 (--once) a backend did not"
    " answer",
    "exec": f"the command's own (128 + N when signal N ended it); {exec_action.EXIT_CONFLICT}"
    f" the lock was not taken (held elsewhere, or as another kind), nothing run (or"
    f" --conflict-exit-code);"
    f" {exec_action.EXIT_UNAVAILABLE} the backend could not answer (before the command ran,"
    f" or for so long while it ran that the hold may have expired: the command was stopped);"
    f" {exec_action.EXIT_LOST} the hold was lost while the command ran (it was stopped:"
    f" SIGTERM to its process group, SIGKILL after --grace); 2 bad usage; 126 or 127 the"
    f" command could not be run",
}


class Command(BaseCommand):
    help = (
        "List, release and purge held locks; prune lock incidents. Exit codes: 0 done, 1"
        " nothing to do (no such lock, nothing matched, purge not confirmed), 2 bad usage,"
        " 3 a backend did not answer. `manage.py redlock ACTION --help` for each action."
    )

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> ArgumentParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parse = parser.parse_args

        def parse_args(args: Sequence[str] | None = None, namespace: Any = None) -> Namespace:
            # `exec NAME [options] -- COMMAND ...`: everything after the first `--` is the
            # command's (argparse's own `--` handling differs across Python versions).
            given = list(sys.argv[2:] if args is None else args)
            before, command = exec_action.parse_command(given)
            options = parse(before, namespace)
            if options.action != "exec":
                return parse(given, namespace) if command else options
            options.command = command
            return options

        parser.parse_args = parse_args
        return parser

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

        def action(name: str, summary: str, **kwargs: Any) -> ArgumentParser:
            parser = sub.add_parser(
                name, help=summary, description=summary,
                epilog=f"exit codes: {EXIT_CODES[name]}", **kwargs,
            )  # fmt: skip
            return parser

        listing = action("list", "List held locks across the backends (SCAN-paged).")
        listing.add_argument(
            "--backend", metavar="ALIAS", help="only this DJANGO_REDLOCK alias (default: all)"
        )
        listing.add_argument(
            "--match", default="*", metavar="GLOB", help="a glob over lock names (default: *)"
        )
        listing.add_argument(
            "--json", action="store_true", help="one JSON document: {locks, unavailable}"
        )
        release = action(
            "release", "Force-release one lock, whoever holds it (or only the hold --fence names)."
        )
        release.add_argument("name", metavar="NAME", help="the lock's name")
        release.add_argument(
            "--backend", default="default", metavar="ALIAS",
            help="the DJANGO_REDLOCK alias (default: default)",
        )  # fmt: skip
        release.add_argument(
            "--fence", type=_fence, metavar="N",
            help="release only if the current hold has this fencing token (as `list` shows it)",
        )  # fmt: skip
        purge = action(
            "purge",
            "Force-release every lock matching a glob, after a confirmation: `y` at the prompt,"
            " `y` piped on stdin, or --yes. Only the holds listed are released.",
        )
        purge.add_argument(
            "--match", required=True, metavar="GLOB", help="a glob over lock names (required)"
        )
        purge.add_argument(
            "--backend", metavar="ALIAS", help="only this DJANGO_REDLOCK alias (default: all)"
        )
        purge.add_argument("--yes", action="store_true", help="do not ask for a confirmation")
        action("prune-incidents", "Delete lock incidents older than KEEP_DAYS, or beyond MAX_ROWS.")
        fences = action(
            "prune-fences",
            "Delete the fence rows of locks whose last fenced transaction (atomic=) is older than"
            " AGE. Safe: a hold older than the rows deleted is still refused (each backend keeps"
            " the largest fence deleted as a floor), and newer holds' fences are above it.",
        )
        fences.add_argument(
            "--older-than", required=True, type=_age, metavar="AGE",
            help="e.g. 30d, 12h, 90m, 3600s: longer than any lock is held",
        )  # fmt: skip
        fences.add_argument(
            "--database", default=DEFAULT_DB_ALIAS, metavar="ALIAS",
            help="the DATABASES alias the fenced transactions use (default: default)",
        )  # fmt: skip
        top = action(
            "top",
            "A live view of the most contended locks and their holders, refreshed every second"
            " like `top`, from Redis alone (no database): for servers the admin cannot reach.",
        )
        top.add_argument(
            "--backend", metavar="ALIAS", help="only this DJANGO_REDLOCK alias (default: all)"
        )
        top.add_argument(
            "--match", default="*", metavar="GLOB", help="a glob over lock names (default: *)"
        )
        top.add_argument("--once", action="store_true", help="print one view and exit")
        top.add_argument(
            "--interval", type=float, default=1.0, metavar="SECONDS",
            help="seconds between refreshes (default: 1)",
        )  # fmt: skip
        top.add_argument(
            "--limit", type=int, default=20, metavar="N", help="locks shown (default: 20)"
        )
        top.add_argument(
            "--max-locks", type=int, default=10_000, metavar="N",
            help="held locks read per backend per refresh, SCAN-paged (default: 10,000): bounds"
            " what one refresh costs Redis",
        )  # fmt: skip

        run = action(
            "exec",
            "Run COMMAND while holding the lock NAME (or one of --limit permits), from any"
            " host: one runs, the others exit 75 without running it. The command gets"
            " REDLOCK_NAME, REDLOCK_FENCE and REDLOCK_BACKEND; the hold is renewed while it"
            " runs; SIGINT, SIGTERM and SIGHUP are forwarded to it; if the hold is lost it is"
            " stopped (SIGTERM to its process group, SIGKILL after --grace); it is killed"
            " (its process group) if exec itself is.",
            usage="%(prog)s NAME [options] -- COMMAND [ARG ...]",
        )
        run.add_argument("name", metavar="NAME", help="the lock's name")
        run.add_argument(
            "--backend", default="default", metavar="ALIAS",
            help="the DJANGO_REDLOCK alias (default: default)",
        )  # fmt: skip
        run.add_argument(
            "--ttl", type=float, metavar="SECONDS",
            help="the hold's TTL, at least 1, renewed every third of it (default: the"
            " backend's TTL)",
        )  # fmt: skip
        run.add_argument(
            "--wait", type=float, default=0.0, metavar="SECONDS",
            help="wait up to SECONDS for the lock (default: 0, one try)",
        )  # fmt: skip
        run.add_argument(
            "--limit", type=int, metavar="N",
            help="take one of N permits (a semaphore): at most N commands at once",
        )  # fmt: skip
        run.add_argument(
            "--fair", action="store_true", help="waiters take it in arrival order (FIFO)"
        )
        run.add_argument(
            "--grace", type=float, default=10.0, metavar="SECONDS",
            help="after a loss, seconds between SIGTERM and SIGKILL (default: 10; with no"
            " answer from the backend, it and a safety margin fit in two thirds of the TTL)",
        )  # fmt: skip
        run.add_argument(
            "--conflict-exit-code", type=int, default=exec_action.EXIT_CONFLICT, metavar="N",
            help="exit status when the lock is held elsewhere (default: 75, EX_TEMPFAIL)",
        )  # fmt: skip
        for each in sub.choices.values():  # after each action's own options in its --help
            _common_options(each)

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"].replace("-", "_")
        getattr(self, f"do_{action}")(options)

    def do_exec(self, options: dict[str, Any]) -> None:
        try:
            opts, held = exec_action.check(options)
        except exec_action.UsageError as exc:
            raise CommandError(str(exc), returncode=exec_action.EXIT_USAGE) from None

        def say(message: str) -> None:
            self.stderr.write(f"redlock exec: {message}")
            self.stderr.flush()

        code = exec_action.run(opts, held, say)
        if code:
            sys.exit(code)

    def _aliases(self, only: str | None) -> list[str]:
        if only and only not in locks.settings:
            raise CommandError(f"unknown backend {only!r}; known: {', '.join(locks)}", returncode=2)
        return [only] if only else list(locks)

    def _collect(self, only: str | None, match: str) -> tuple[list[LockInfo], list[str]]:
        found: list[LockInfo] = []
        failed: list[str] = []
        for alias in self._aliases(only):
            try:
                # A semaphore or read-write lock: a row per lease (purge frees each).
                found += [row for info in locks[alias].iter_locks(match) for row in info.rows()]
            except LockError as exc:
                failed.append(alias)
                self.stderr.write(f"backend {alias!r} is unavailable: {exc}")
        return found, failed

    def do_list(self, options: dict[str, Any]) -> None:
        found, failed = self._collect(options["backend"], _checked(check_glob, options["match"]))
        if options["json"]:
            rows = [
                {"name": i.name, "backend": i.backend, "kind": i.kind, "holder": i.holder,
                 "acquired_at": i.acquired_at.isoformat() if i.acquired_at else None,
                 "ttl": i.ttl, "hold_count": i.hold_count, "waiters": i.waiters,
                 "longest_wait": i.longest_wait, "fence": i.fence, "limit": i.limit}
                for i in found
            ]  # fmt: skip
            self.stdout.write(json.dumps({"locks": rows, "unavailable": failed}, indent=2))
        elif found or not failed:
            self.stdout.write(_table(found))
        if failed and not options["json"]:
            # Never "no held locks" for a backend that did not say so.
            down = ", ".join(map(repr, failed))
            self.stdout.write(f"not listed: backend {down} did not answer")
        if failed:
            sys.exit(UNAVAILABLE)

    def do_release(self, options: dict[str, Any]) -> None:
        alias = self._aliases(options["backend"])[0]
        name, fence = _checked(check_name, options["name"]), options["fence"]
        try:
            released = locks[alias].force_release(name, fence=fence)
        except LockError as exc:
            raise CommandError(str(exc), returncode=UNAVAILABLE) from exc
        if released is Released.CHANGED:
            raise CommandError(
                f"{name!r} on {alias!r} is held by another hold than fence {fence}; not released",
                returncode=NOTHING,
            )
        if not released:
            raise CommandError(f"{name!r} is not held on {alias!r}", returncode=NOTHING)
        recorder.record("force_release", name, alias, "by manage.py redlock release")
        recorder.flush()
        self.stdout.write(f"released {name!r} on {alias!r}")
        self._unreached([alias])

    def _unreached(self, aliases: Sequence[str]) -> None:
        """A write owed to a node that did not answer is lost when this process exits: wait
        a bounded time for it, else name the node (it keeps the hold to its TTL), exit 3."""
        unreached = [(a, locks[a].unreached(OWED_WAIT)) for a in dict.fromkeys(aliases)]
        for alias, nodes in unreached:
            for node in nodes:
                self.stderr.write(
                    f"{node} of {alias!r} was not reached: it keeps what was released there"
                    " until its TTL"
                )
        if any(nodes for _, nodes in unreached):
            sys.exit(UNAVAILABLE)

    def do_purge(self, options: dict[str, Any]) -> None:
        found, failed = self._collect(options["backend"], _checked(check_glob, options["match"]))
        if not found:
            self.stdout.write(
                "no held lock matches" + (" on the backends that answered" * bool(failed))
            )
            sys.exit(UNAVAILABLE if failed else NOTHING)
        self.stdout.write(_table(found))
        if not options["yes"]:
            self._confirm(f"Force-release these {len(found)} locks? [y/N] ")
        released = 0
        for info in found:
            # Release the hold that was listed, not whichever holds the name by now.
            token = info.token
            fence = info.fence if token is None else None
            try:
                outcome = locks[info.backend].force_release(info.name, token, fence)
            except LockError as exc:
                failed.append(info.backend)
                self.stderr.write(f"{info.name!r} on {info.backend!r}: {exc}")
                continue
            if outcome is Released.CHANGED:
                self.stderr.write(
                    f"{info.name!r} on {info.backend!r} changed hands since it was listed;"
                    " not released"
                )
            elif outcome:
                released += 1
                recorder.record("force_release", info.name, info.backend, "by redlock purge")
        recorder.flush()
        self.stdout.write(f"released {released} lock{'s' if released != 1 else ''}")
        self._unreached([info.backend for info in found])
        if failed:
            sys.exit(UNAVAILABLE)

    def _confirm(self, prompt: str) -> None:
        """A `y` typed at the prompt, or piped in (``echo y | manage.py redlock purge``);
        an empty stdin (cron, CI) is no confirmation."""
        stdin = sys.stdin
        if stdin is not None and stdin.isatty():
            answer = input(prompt)
        else:
            self.stdout.write(prompt, ending="")
            try:
                answer = stdin.readline() if stdin is not None else ""
            except (OSError, ValueError):  # closed, or not readable (pytest's capture)
                answer = ""
            self.stdout.write("")
            if not answer:
                raise CommandError(
                    "not confirmed: stdin is empty; pipe `y` or pass --yes", returncode=NOTHING
                )
        if answer.strip().lower() not in ("y", "yes"):
            raise CommandError("not confirmed", returncode=NOTHING)

    def do_top(self, options: dict[str, Any]) -> None:
        _checked(check_glob, options["match"])
        if not math.isfinite(options["interval"]):  # sleep(nan) raises, sleep(inf) never ends
            raise CommandError(
                f"--interval must be a finite number of seconds, not {options['interval']}",
                returncode=2,
            )
        aliases = self._aliases(options["backend"])
        if options["once"]:
            frame, healths = top_frame(aliases, options)
            self.stdout.write(frame)
            if not all(h.up for h in healths):
                sys.exit(UNAVAILABLE)
            return
        interval = max(float(options["interval"]), 0.1)
        try:
            while True:
                frame, _ = top_frame(aliases, options)
                # Home and clear, then the frame: the terminal shows one view, like top.
                self.stdout.write("\x1b[H\x1b[2J" + frame)
                self.stdout.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            self.stdout.write("")

    def do_prune_incidents(self, options: dict[str, Any]) -> None:
        self.stdout.write(f"deleted {prune()} lock incidents")

    def do_prune_fences(self, options: dict[str, Any]) -> None:
        try:
            using = check_database(options["database"])
        except ValueError as exc:
            raise CommandError(str(exc), returncode=2) from None
        try:
            deleted = prune_fences(using, options["older_than"])
        except LockNotAcquired as exc:  # a floor stayed locked: nothing deleted
            raise CommandError(str(exc), returncode=NOTHING) from None
        rows = "row" if deleted == 1 else "rows"
        self.stdout.write(f"deleted {deleted} fence {rows} from database {using!r}")


def _checked(check: Callable[[Any], str], value: Any) -> str:
    """``value`` through a validation check; its complaint as bad usage (exit 2), before any
    Redis call."""
    try:
        return check(value)
    except (TypeError, ValueError) as exc:
        raise CommandError(str(exc), returncode=2) from None


def _printable(text: str) -> str:
    """A cell as the terminal may show it: control characters (an escape sequence in a lock
    name built from a URL could erase its row and draw another) written as Python escapes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _common_options(parser: ArgumentParser) -> None:
    """Django's common options after the action too (``redlock list --settings=...``), as
    every Django command takes them; given there, they override those before the action."""
    parser.add_argument(
        "-v",
        "--verbosity",
        type=int,
        choices=[0, 1, 2, 3],
        default=SUPPRESS,
        help="verbosity level; 0=minimal, 1=normal, 2=verbose, 3=very verbose",
    )
    parser.add_argument("--settings", default=SUPPRESS, help="a settings module's Python path")
    parser.add_argument("--pythonpath", default=SUPPRESS, help="a directory for the Python path")
    parser.add_argument(
        "--traceback",
        action="store_true",
        default=SUPPRESS,
        help="a full stack trace on CommandError",
    )
    parser.add_argument(
        "--no-color", action="store_true", default=SUPPRESS, help="no colors in the output"
    )
    parser.add_argument(
        "--force-color", action="store_true", default=SUPPRESS, help="colors in the output"
    )
    parser.add_argument("--skip-checks", action="store_true", default=SUPPRESS,
                        help="skip the system checks")  # fmt: skip


def _table(found: list[LockInfo]) -> str:
    if not found:
        return "no held locks"
    header = ("BACKEND", "NAME", "KIND", "TTL", "HOLDS", "WAITERS", "FENCE", "HOLDER")
    rows = [
        (i.backend, i.name, i.kind, "" if i.ttl is None else f"{i.ttl:.1f}s", str(i.hold_count),
         str(i.waiters), "" if i.fence is None else str(i.fence), _holder(i))
        for i in found
    ]  # fmt: skip
    return _columns(header, rows)


def _age(value: str) -> timedelta:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", value.strip())
    if not match:
        raise ArgumentTypeError(f"an age is a number and a unit (s, m, h, d), not {value!r}")
    unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[match[2]]
    return timedelta(**{unit: float(match[1])})


def _fence(value: str) -> int:
    if not (value.isascii() and value.isdigit()) or len(value) > 20:
        raise ArgumentTypeError(f"a fencing token is a number >= 0, not {value!r}")
    return int(value)


def _holder(info: LockInfo) -> str:
    if info.holders:  # a semaphore's permits or a read-write lock's readers: one row, the first
        more = f" +{len(info.holders) - 1} more" if len(info.holders) > 1 else ""
        return _holder(info.holders[0]) + more
    h = info.holder
    task = f" task {h['k']}" if h.get("k") else ""
    group = multi_text(h)
    return f"{h.get('h', '?')}:{h.get('p', '?')}{task}{f' ({group})' if group else ''}"


def top_frame(aliases: list[str], options: dict[str, Any]) -> tuple[str, list[Health]]:
    """One view of ``redlock top``: each backend's health, then the most contended locks
    (most waiters, longest wait, oldest hold first)."""
    healths: list[Health] = []
    found: list[LockInfo] = []
    limit, max_locks = max(int(options["limit"]), 1), max(int(options["max_locks"]), 1)
    for alias in aliases:
        health = ping(locks[alias])
        healths.append(health)
        if not health.up:
            continue
        seen: list[LockInfo] = []
        cursor: str | None = None
        try:
            while len(seen) < max_locks:
                page, cursor = locks[alias].page(options["match"], cursor, 500)
                seen += page
                if cursor is None:
                    break
        except LockError as exc:
            health.up, health.detail = False, str(exc)
            continue
        summarise(health, seen).more = cursor is not None
        found += seen
    found.sort(key=contention_order)
    now = datetime.now(timezone.utc)
    title = f"redlock top - {now:%Y-%m-%d %H:%M:%S} UTC"
    if not options["once"]:
        title += f" - every {options['interval']:g} s (Ctrl-C quits)"
    health_rows = [
        (h.alias, h.status, "" if h.latency_ms is None else f"{h.latency_ms:.1f}ms",
         f"{h.held}{'+' if h.more else ''}" if h.counted else "",
         str(h.waiting) if h.counted else "",
         _seconds(h.longest_wait), h.detail[:60])
        for h in healths
    ]  # fmt: skip
    lock_rows = [
        (i.backend, i.name, i.kind, str(i.waiters), _seconds(i.longest_wait),
         _seconds((now - i.acquired_at).total_seconds() if i.acquired_at else None),
         _seconds(i.ttl), "" if i.fence is None else str(i.fence), _holder(i))
        for i in found[:limit]
    ]  # fmt: skip
    lock_header = ("BACKEND", "NAME", "KIND", "WAITERS", "LONGEST", "HELD FOR", "TTL", "FENCE",
                   "HOLDER")  # fmt: skip
    parts = [
        title,
        "",
        _columns(("BACKEND", "STATUS", "LATENCY", "HELD", "WAITING", "LONGEST", ""), health_rows),
        "",
        _columns(lock_header, lock_rows) if lock_rows else "no held locks",
    ]
    if len(found) > limit:
        parts.append(f"... and {len(found) - limit} more held locks")
    return "\n".join(parts) + "\n", healths


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}s"


def _columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    rows = [[_printable(cell) for cell in row] for row in rows]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])  # fmt: skip
