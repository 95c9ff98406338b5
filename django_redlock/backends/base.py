"""What every lock backend shares: settings, key layout, and the operations a Lock calls."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, ClassVar, NamedTuple

from django.core.exceptions import ImproperlyConfigured

from ..waiting import Waiter

DEFAULT_TTL = 30.0
DEFAULT_KEY_PREFIX = "redlock"


class Attempt(NamedTuple):
    """The outcome of one try to acquire."""

    acquired: bool
    fence: int | None = None
    pttl_ms: int = -2  # when not acquired: what is left of the blocking hold (-2: none)


class Renewal(NamedTuple):
    name: str
    token: str
    ttl_ms: int


@dataclass
class LockInfo:
    """A held lock as operators see it."""

    name: str
    backend: str
    kind: str
    fence: int | None
    ttl: float | None
    acquired_at: datetime | None = None
    holder: dict[str, Any] = field(default_factory=dict)
    hold_count: int = 1
    waiters: int = 0


def parse_plain_value(name: str, alias: str, value: str, pttl_ms: int) -> LockInfo:
    """Read the ``token|fence|acquired-ms|holder-json`` value the acquire script writes."""
    parts = value.split("|", 3)
    fence = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    acquired_at = None
    if len(parts) > 2 and parts[2].isdigit():
        acquired_at = datetime.fromtimestamp(int(parts[2]) / 1000, tz=timezone.utc)
    holder: dict[str, Any] = {}
    if len(parts) > 3:
        try:
            loaded = json.loads(parts[3])
        except ValueError:
            loaded = None
        if isinstance(loaded, dict):
            holder = loaded
    ttl = pttl_ms / 1000 if pttl_ms >= 0 else None
    return LockInfo(name, alias, "plain", fence, ttl, acquired_at, holder)


class BaseLockBackend:
    """A small base, like Django's ``BaseCache``: settings and key layout here, I/O below."""

    #: Whether LOCATION is a list of URLs (Redlock, Sentinel) instead of one URL.
    location_is_list: ClassVar[bool] = False
    #: Whether the backend needs a LOCATION at all.
    needs_location: ClassVar[bool] = True

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        self.alias = alias
        self.params = dict(params)
        self.location = params.get("LOCATION")
        self.options: dict[str, Any] = dict(params.get("OPTIONS") or {})
        prefix = params.get("KEY_PREFIX", DEFAULT_KEY_PREFIX)
        self.key_prefix = f"{prefix}:" if prefix else ""
        self.default_ttl = float(params.get("TTL", DEFAULT_TTL))
        self.round_trips = 0  # network round trips made, for tests and benchmarks

    # -- settings ----------------------------------------------------------------------------

    @classmethod
    def check_params(cls, alias: str, params: Mapping[str, Any]) -> None:
        """Raise ImproperlyConfigured naming the alias and key of the first bad setting."""

        def bad(key: str, why: str) -> ImproperlyConfigured:
            return ImproperlyConfigured(f"DJANGO_REDLOCK[{alias!r}][{key!r}] {why}")

        ttl = params.get("TTL", DEFAULT_TTL)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
            raise bad("TTL", f"must be a number of seconds, not {ttl!r}")
        if not math.isfinite(ttl) or ttl <= 0:
            raise bad("TTL", f"must be a finite number of seconds > 0, not {ttl!r}")
        prefix = params.get("KEY_PREFIX", DEFAULT_KEY_PREFIX)
        if not isinstance(prefix, str):
            raise bad("KEY_PREFIX", f"must be a str, not {prefix!r}")
        options = params.get("OPTIONS", {})
        if not isinstance(options, Mapping):
            raise bad("OPTIONS", f"must be a dict, not {type(options).__name__}")
        if cls.needs_location:
            cls._check_location(params.get("LOCATION"), bad)

    @classmethod
    def _check_location(cls, location: Any, bad: Any) -> None:
        from urllib.parse import urlsplit

        urls = location if cls.location_is_list else [location]
        if cls.location_is_list and (not isinstance(location, (list, tuple)) or not location):
            raise bad("LOCATION", f"must be a non-empty list of Redis URLs, not {location!r}")
        for url in urls:
            if not isinstance(url, str) or not url:
                raise bad("LOCATION", f"must be a Redis URL string, not {url!r}")
            parts = urlsplit(url)
            if parts.scheme not in ("redis", "rediss", "unix"):
                raise bad(
                    "LOCATION", f"has {url!r}: the scheme must be redis://, rediss:// or unix://"
                )
            if parts.scheme != "unix" and not parts.hostname:
                raise bad("LOCATION", f"has {url!r}: it names no host")
            try:
                parts.port  # noqa: B018 - raises ValueError for a bad port
            except ValueError:
                raise bad("LOCATION", f"has {url!r}: the port is not a number 0-65535") from None

    # -- key layout --------------------------------------------------------------------------
    # Every key of one lock shares the hash tag {name}, so a cluster keeps them in one slot.

    def key(self, name: str) -> str:
        return f"{self.key_prefix}{{{name}}}"

    def fence_key(self, name: str) -> str:
        return f"{self.key(name)}:fence"

    def channel(self, name: str) -> str:
        return f"{self.key(name)}:released"

    def name_from_key(self, key: str) -> str | None:
        head = f"{self.key_prefix}{{"
        if key.startswith(head) and key.endswith("}"):
            return key[len(head) : -1]
        return None

    # -- operations: each is one round trip unless it says otherwise -----------------------

    def try_acquire(self, name: str, token: str, ttl_ms: int, meta: str) -> Attempt:
        raise NotImplementedError

    def release(self, name: str, token: str) -> bool:
        raise NotImplementedError

    def extend(self, name: str, token: str, ttl_ms: int) -> bool:
        raise NotImplementedError

    def renew_many(self, renewals: Sequence[Renewal]) -> list[bool | Exception]:
        """Extend many holds in as few round trips as possible."""
        raise NotImplementedError

    def is_locked(self, name: str) -> bool:
        raise NotImplementedError

    def holds(self, name: str, token: str) -> bool:
        raise NotImplementedError

    def pttl(self, name: str) -> int | None:
        raise NotImplementedError

    def inspect(self, name: str) -> LockInfo | None:
        raise NotImplementedError

    def force_release(self, name: str) -> bool:
        raise NotImplementedError

    def iter_locks(self, match: str = "*") -> Iterator[LockInfo]:
        raise NotImplementedError

    def watch(self, name: str) -> AbstractContextManager[Waiter]:
        """Register a waiter for the release of ``name``; see :mod:`django_redlock.waiting`."""
        raise NotImplementedError

    # -- lifecycle ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """Called when the app is ready: warm up what can be warmed (never required)."""

    def close(self) -> None:
        """Release connections and threads."""

    def describe(self) -> str:
        return f"{self.alias!r} ({type(self).__name__})"
