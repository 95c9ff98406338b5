"""Distributed locks on Redis for Django and Celery."""

from .exceptions import (
    BackendUnavailable,
    LockError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    QuorumNotReached,
)
from .handler import DEFAULT_LOCK_ALIAS, locks
from .locking import Lock, lock

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_LOCK_ALIAS",
    "BackendUnavailable",
    "Lock",
    "LockError",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "QuorumNotReached",
    "lock",
    "locks",
]
