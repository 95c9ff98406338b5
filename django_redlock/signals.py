"""Signals sent with ``sender`` = the lock's class (or the backend's) and ``lock`` = the lock,
and those of ``@single_instance``."""

from django.dispatch import Signal

lock_acquired = Signal()  # lock, fence
lock_released = Signal()  # lock
lock_lost = Signal()  # lock, reason
acquire_timed_out = Signal()  # lock, timeout: a blocking acquire gave up
quorum_not_reached = Signal()  # backend (alias), name, error: too few nodes or replicas

# ``@single_instance`` (Celery and Django Tasks alike), sent with ``sender`` = the task:
#: A duplicate was skipped: key, task_id, holder_task_id, using, redelivered (True: the task's
#: own message delivered again while it runs).
duplicate_skipped = Signal()
#: A call was not queued, its key being queued or running: key, task_id (the id its caller
#: chose, if any), holder_task_id, using.
duplicate_not_queued = Signal()
