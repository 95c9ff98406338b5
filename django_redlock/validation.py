"""Argument checks that run before any Redis call, so bad input never looks like an outage."""

from __future__ import annotations

import hashlib
import math
from typing import Any

MAX_NAME_BYTES = 1024
#: The longest TTL (and ``max_hold``) accepted: 30 days. Longer is an immortal lock in all
#: but name, and past about 292 million years its milliseconds overflow Redis.
MAX_TTL = 30 * 24 * 3600.0


def check_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {value!r}")
    return value


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: Redis would store mojibake
        raise ValueError(f"{what} is not valid text: {exc.reason} at index {exc.start}") from None


def check_text(text: Any, what: str) -> str:
    """A str that Redis can store as it is (UTF-8: no lone surrogate, as a non-UTF-8
    command-line argument or a crafted JSON string gives)."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, not {type(text).__name__}")
    _utf8(text, what)
    return text


def check_glob(glob: Any) -> str:
    """A glob over lock names (``--match``, ``iter_locks``, ``page``): text Redis can take."""
    return check_text(glob, "the glob")


#: Names checked already: a lock is usually made for each use (``with lock(name)``), over a
#: few names. Only str is ever kept (a str subclass could hash or compare its own way).
_checked_names: set[str] = set()


def check_name(name: Any) -> str:
    if type(name) is str and name in _checked_names:
        return name
    _check_name(name)
    if type(name) is str:
        if len(_checked_names) >= 4096:  # names built from data: keep it bounded
            _checked_names.clear()
        _checked_names.add(name)
    return name


def _check_name(name: Any) -> None:
    if not isinstance(name, str):
        raise TypeError(f"lock name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("lock name must not be empty")
    if "\0" in name:  # a fenced block's row could not store it (PostgreSQL text refuses NUL)
        raise ValueError(
            f"lock name must not contain a NUL character (at index {name.index(chr(0))})"
        )
    size = len(_utf8(name, "lock name"))
    if size > MAX_NAME_BYTES:
        raise ValueError(f"lock name is {size} bytes long; the limit is {MAX_NAME_BYTES} bytes")


def fit_name(name: str, keep: int = 200) -> str:
    """A name built from data (a URL, task arguments): kept if short, else its first
    ``keep`` characters and a SHA-256 of the whole, so any input gives a valid, stable name."""
    raw = _utf8(name, "lock name")
    if len(raw) <= keep or "\0" in name:  # (a NUL is refused wherever it is)
        return check_name(name)
    return check_name(f"{name[: keep // 4]}~sha256:{hashlib.sha256(raw).hexdigest()}")


def check_seconds(
    value: Any, what: str, *, allow_zero: bool = False, most: float | None = None
) -> float:
    """A finite number of seconds: > 0, or >= 0 with ``allow_zero``; at most ``most``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be {bound} seconds, got {value}")
    if most is not None and value > most:
        raise ValueError(f"{what} must be at most {most:.0f} seconds (30 days), got {value:g}")
    return value


def check_optional_seconds(
    value: Any, what: str, *, allow_zero: bool = False, most: float | None = None
) -> float | None:
    return None if value is None else check_seconds(value, what, allow_zero=allow_zero, most=most)


def check_ttl(value: Any, what: str = "ttl") -> float | None:
    """A lock TTL: > 0 and at most :data:`MAX_TTL`; None for the backend's default."""
    return check_optional_seconds(value, what, most=MAX_TTL)


def to_ms(seconds: float) -> int:
    """Milliseconds for Redis, never 0 (PX 0 is an error)."""
    return max(1, round(seconds * 1000))


def check_limit(value: Any) -> int:
    """A semaphore's limit: an int >= 1 (not a bool, not a float)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"limit must be an int >= 1, not {value!r}")
    if value < 1:
        raise ValueError(f"limit must be an int >= 1, not {value!r}")
    return value
