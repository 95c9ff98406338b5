"""``manage.py redlock list|release|purge|prune-incidents``: the admin's page, from a shell.

Exit codes scripts can trust: 0 done, 1 nothing to do (no such lock, nothing matched,
purge not confirmed), 2 bad usage, 3 a backend did not answer.
"""

from __future__ import annotations

import json
import sys
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...backends.base import LockInfo
from ...exceptions import LockError
from ...handler import locks
from ...incidents import prune, recorder

NOTHING, UNAVAILABLE = 1, 3


class Command(BaseCommand):
    help = "List, release and purge held locks; prune lock incidents."

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        listing = sub.add_parser("list", help="held locks across the backends")
        listing.add_argument("--backend", help="only this DJANGO_REDLOCK alias")
        listing.add_argument("--match", default="*", help="a glob over lock names")
        listing.add_argument("--json", action="store_true", help="one JSON document")
        release = sub.add_parser("release", help="force-release one lock")
        release.add_argument("name")
        release.add_argument("--backend", default="default")
        purge = sub.add_parser("purge", help="force-release every lock matching a glob")
        purge.add_argument("--match", required=True)
        purge.add_argument("--backend", help="only this DJANGO_REDLOCK alias")
        purge.add_argument("--yes", action="store_true", help="do not ask")
        sub.add_parser("prune-incidents", help="delete old lock incidents")

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
                found += list(locks[alias].iter_locks(match))
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
                 "fence": i.fence}
                for i in found
            ]  # fmt: skip
            self.stdout.write(json.dumps({"locks": rows, "unavailable": failed}, indent=2))
        else:
            self.stdout.write(_table(found))
        if failed:
            sys.exit(UNAVAILABLE)

    def do_release(self, options: dict[str, Any]) -> None:
        alias = self._aliases(options["backend"])[0]
        try:
            released = locks[alias].force_release(options["name"])
        except LockError as exc:
            raise CommandError(str(exc), returncode=UNAVAILABLE) from exc
        if not released:
            raise CommandError(f"{options['name']!r} is not held on {alias!r}", returncode=NOTHING)
        recorder.record("force_release", options["name"], alias, "by manage.py redlock release")
        recorder.flush()
        self.stdout.write(f"released {options['name']!r} on {alias!r}")

    def do_purge(self, options: dict[str, Any]) -> None:
        found, failed = self._collect(options["backend"], options["match"])
        if not found:
            self.stdout.write("no held lock matches")
            sys.exit(UNAVAILABLE if failed else NOTHING)
        self.stdout.write(_table(found))
        if not options["yes"]:
            if not sys.stdin.isatty():
                raise CommandError("not confirmed: pass --yes", returncode=NOTHING)
            if input(f"Force-release these {len(found)} locks? [y/N] ").strip().lower() != "y":
                raise CommandError("not confirmed", returncode=NOTHING)
        released = 0
        for info in found:
            try:
                if locks[info.backend].force_release(info.name):
                    released += 1
                    recorder.record("force_release", info.name, info.backend, "by redlock purge")
            except LockError as exc:
                failed.append(info.backend)
                self.stderr.write(f"{info.name!r} on {info.backend!r}: {exc}")
        recorder.flush()
        self.stdout.write(f"released {released} lock{'s' if released != 1 else ''}")
        if failed:
            sys.exit(UNAVAILABLE)

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


def _holder(info: LockInfo) -> str:
    h = info.holder
    task = f" task {h['k']}" if h.get("k") else ""
    return f"{h.get('h', '?')}:{h.get('p', '?')}{task}"
