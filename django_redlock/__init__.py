"""Distributed locks on Redis for Django and Celery."""

from .exceptions import (
    BackendRefused,
    BackendUnavailable,
    CommitOutcomeUnknown,
    LockError,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    MissingPermission,
    QuorumNotReached,
    StaleFence,
)
from .handler import DEFAULT_LOCK_ALIAS, locks
from .leader import LeaderInfo, Term, current_leader, leader, run_as_leader
from .locking import (
    Lock,
    MultiLock,
    ReadWriteLock,
    Semaphore,
    lock,
    lock_all,
    read_write_lock,
    semaphore,
)
from .version import __version__ as __version__
from .views import lock_view


def __getattr__(name: str) -> object:
    # For Celery and Django's Tasks framework alike; neither is imported until a call needs it.
    if name == "single_instance":
        from .contrib.single import single_instance

        return single_instance
    raise AttributeError(f"module 'django_redlock' has no attribute {name!r}")


__all__ = [
    "DEFAULT_LOCK_ALIAS",
    "BackendRefused",
    "BackendUnavailable",
    "CommitOutcomeUnknown",
    "LeaderInfo",
    "Lock",
    "LockError",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "MissingPermission",
    "MultiLock",
    "QuorumNotReached",
    "ReadWriteLock",
    "Semaphore",
    "StaleFence",
    "Term",
    "current_leader",
    "leader",
    "lock",
    "lock_all",
    "lock_view",
    "locks",
    "read_write_lock",
    "run_as_leader",
    "semaphore",
    "single_instance",
]
