"""Write the intersphinx inventories of the projects these docs link to, from the names
listed in this folder's ``<project>.txt`` files, so that ``make docs`` needs no network.

    python docs/_inventories/make.py          # writes django.inv, celery.inv, redis.inv

Each line of a ``.txt`` file is ``domain:role  name  uri`` (the uri relative to the project's
documentation root, as in its real inventory). ``python.inv`` is not made here: it is the
inventory of Python 3.11's own documentation, as Debian's python3.11-doc package ships it.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: project -> (the name its docs give themselves, the version linked to)
PROJECTS = {
    "django": ("Django", "5.2"),
    "celery": ("Celery", "stable"),
    "redis": ("redis-py", "stable"),
}


def entries(source: Path) -> list[tuple[str, str, str]]:
    found = []
    for number, line in enumerate(source.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3 or ":" not in parts[0]:
            raise SystemExit(f"{source}:{number}: expected 'domain:role name uri', got {line!r}")
        found.append((parts[1], parts[0], parts[2]))
    return sorted(found)


def inventory(project: str) -> bytes:
    """Sphinx's inventory format, version 2: a header, then zlib-compressed lines of
    ``name domain:role priority uri dispname`` ("$" in the uri stands for the name,
    "-" for a display name equal to the name)."""
    title, version = PROJECTS[project]
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {title}\n"
        f"# Version: {version}\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    lines = [f"{name} {role} 1 {uri} -\n" for name, role, uri in entries(HERE / f"{project}.txt")]
    return header.encode() + zlib.compress("".join(lines).encode(), 9)


def main() -> int:
    for project in PROJECTS:
        (HERE / f"{project}.inv").write_bytes(inventory(project))
    return 0


if __name__ == "__main__":
    sys.exit(main())
