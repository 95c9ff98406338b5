"""Signals sent with ``sender`` = the lock's class (or the backend's) and ``lock`` = the lock."""

from django.dispatch import Signal

lock_acquired = Signal()  # lock, fence
lock_released = Signal()  # lock
lock_lost = Signal()  # lock, reason
acquire_timed_out = Signal()  # lock, timeout: a blocking acquire gave up
quorum_not_reached = Signal()  # backend (alias), name, error: too few nodes or replicas
