"""A backend's first calls, made before a test's faults: its connections open and its
scripts loaded. Tests with short socket timeouts (0.3 s) through the Python proxies may
see a first connect and handshake run past that timeout on a loaded machine; that is the
promise kept (``BackendUnavailable`` within the socket timeout), not what those tests are
about, so the warm-up tries again."""

from __future__ import annotations

from django_redlock import lock
from django_redlock.exceptions import BackendUnavailable


def warm_up(using: str, name: str, *, rounds: int = 1, tries: int = 5) -> None:
    """``rounds`` acquire+release cycles of ``{name}:warm{n}`` on ``using``, each tried up
    to ``tries`` times while the backend is unavailable."""
    for n in range(rounds):
        warm = lock(f"{name}:warm{n}", using=using, ttl=5, auto_renew=False)
        for attempt in range(tries):
            try:
                assert warm.acquire(blocking=False), "the warm-up lock is free"
            except BackendUnavailable:
                if attempt == tries - 1:
                    raise
                continue
            warm.release()
            break
