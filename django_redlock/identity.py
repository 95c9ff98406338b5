"""Who holds a lock: the random hold token, and the holder metadata shown to operators."""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
from contextvars import ContextVar

HOST = socket.gethostname()

# Set by the Celery integration while a task body runs, so holders name their task.
current_task: ContextVar[tuple[str, str] | None] = ContextVar("redlock_task", default=None)


def new_token() -> str:
    """128 random bits, URL-safe, never containing the ``|`` the lock value uses."""
    return secrets.token_urlsafe(16)


def holder_meta() -> str:
    meta: dict[str, object] = {
        "h": HOST,
        "p": os.getpid(),
        "t": threading.current_thread().name,
    }
    task = current_task.get()
    if task is not None:
        meta["k"], meta["n"] = task
    return json.dumps(meta, separators=(",", ":"))
