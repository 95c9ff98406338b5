"""Every lock kind over one shared core: ``base`` (taking, waiting, renewing, releasing a
hold), ``steps`` (the sync and asyncio drivers), and one module per kind."""

from .base import WAITER_LEASE, BaseLock
from .lock import Lock, lock
from .templates import name_template

__all__ = ["WAITER_LEASE", "BaseLock", "Lock", "lock", "name_template"]
