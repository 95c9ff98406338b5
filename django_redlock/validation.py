"""Argument checks that run before any Redis call, so bad input never looks like an outage."""

from __future__ import annotations

import math
from typing import Any

MAX_NAME_BYTES = 1024


def check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"lock name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("lock name must not be empty")
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise ValueError(f"lock name is {size} bytes long; the limit is {MAX_NAME_BYTES} bytes")
    return name


def check_seconds(value: Any, what: str, *, allow_zero: bool = False) -> float:
    """A finite number of seconds: > 0, or >= 0 with ``allow_zero``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be {bound} seconds, got {value}")
    return value


def check_optional_seconds(value: Any, what: str, *, allow_zero: bool = False) -> float | None:
    return None if value is None else check_seconds(value, what, allow_zero=allow_zero)


def to_ms(seconds: float) -> int:
    """Milliseconds for Redis, never 0 (PX 0 is an error)."""
    return max(1, round(seconds * 1000))
