"""Signals sent with ``sender`` = the lock's class and ``lock`` = the lock object."""

from django.dispatch import Signal

lock_acquired = Signal()  # lock, fence
lock_released = Signal()  # lock
lock_lost = Signal()  # lock, reason
