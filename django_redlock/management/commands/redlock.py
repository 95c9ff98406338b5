"""``manage.py redlock list|release|purge|prune-incidents``: the admin's page, from a shell.

Exit codes scripts can trust: 0 done, 1 nothing to do (no such lock, nothing matched,
purge not confirmed), 2 bad usage, 3 a backend did not answer.
"""

from __future__ import annotations

import json
import sys
from argparse import ArgumentParser, ArgumentTypeError
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...backends.base import LockInfo, Released
from ...exceptions import LockError
from ...handler import locks
from ...incidents import prune, recorder

NOTHING, UNAVAILABLE = 1, 3
EXIT_CODES = {
    "list": "0 listed (every backend answered); 2 an unknown --backend; 3 a backend did not"
    " answer (it is named, and the others are still listed)",
    "release": "0 released; 1 not held, or held by another hold than --fence; 2 an unknown"
    " --backend; 3 the backend did not answer",
    "purge": "0 released what was listed (a lock that changed hands since is left alone, and"
    " named); 1 nothing matched, or not confirmed; 2 an unknown --backend; 3 a backend did"
    " not answer",
    "prune-incidents": "0 done",
}


class Command(BaseCommand):
    help = (
        "List, release and purge held locks; prune lock incidents. Exit codes: 0 done, 1"
        " nothing to do (no such lock, nothing matched, purge not confirmed), 2 bad usage,"
        " 3 a backend did not answer. `manage.py redlock ACTION --help` for each action."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

        def action(name: str, summary: str) -> ArgumentParser:
            return sub.add_parser(
                name, help=summary, description=summary, epilog=f"exit codes: {EXIT_CODES[name]}"
            )

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

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"].replace("-", "_")
        getattr(self, f"do_{action}")(options)

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
        found, failed = self._collect(options["backend"], options["match"])
        if options["json"]:
            rows = [
                {"name": i.name, "backend": i.backend, "kind": i.kind, "holder": i.holder,
                 "acquired_at": i.acquired_at.isoformat() if i.acquired_at else None,
                 "ttl": i.ttl, "hold_count": i.hold_count, "waiters": i.waiters,
                 "fence": i.fence, "limit": i.limit}
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
        name, fence = options["name"], options["fence"]
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

    def do_purge(self, options: dict[str, Any]) -> None:
        found, failed = self._collect(options["backend"], options["match"])
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

    def do_prune_incidents(self, options: dict[str, Any]) -> None:
        self.stdout.write(f"deleted {prune()} lock incidents")


def _table(found: list[LockInfo]) -> str:
    if not found:
        return "no held locks"
    header = ("BACKEND", "NAME", "KIND", "TTL", "HOLDS", "WAITERS", "FENCE", "HOLDER")
    rows = [
        (i.backend, i.name, i.kind, "" if i.ttl is None else f"{i.ttl:.1f}s", str(i.hold_count),
         str(i.waiters), "" if i.fence is None else str(i.fence), _holder(i))
        for i in found
    ]  # fmt: skip
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])  # fmt: skip


def _fence(value: str) -> int:
    if not (value.isascii() and value.isdigit()) or len(value) > 20:
        raise ArgumentTypeError(f"a fencing token is a number >= 0, not {value!r}")
    return int(value)


def _holder(info: LockInfo) -> str:
    h = info.holder
    task = f" task {h['k']}" if h.get("k") else ""
    return f"{h.get('h', '?')}:{h.get('p', '?')}{task}"
