"""Every lock kind over one shared core: ``base`` (taking, waiting, renewing, releasing a
hold), ``steps`` (the sync and asyncio drivers), and one module per kind."""

from .base import WAITER_LEASE, BaseLock
from .lock import Lock, lock
from .multi import MultiLock, lock_all
from .rwlock import ReadLock, ReadWriteLock, WriteLock, read_write_lock
from .semaphore import Semaphore, semaphore
from .templates import name_template

__all__ = [
    "WAITER_LEASE",
    "BaseLock",
    "Lock",
    "MultiLock",
    "ReadLock",
    "ReadWriteLock",
    "Semaphore",
    "WriteLock",
    "lock",
    "lock_all",
    "name_template",
    "read_write_lock",
    "semaphore",
]
