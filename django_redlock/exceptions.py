"""The exceptions every public call may raise; all derive from :class:`LockError`.

An exception with fields of its own has its constructor's arguments as ``args`` (the message
first, then each field) and its message alone as ``str()``: Celery's JSON result backend
stores an exception's ``args`` alone and rebuilds it as ``cls(*args)`` (pickle does the
same), so a task that raises one hands its caller every field.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class LockError(Exception):
    """Base class of every error this app raises about a lock."""


class LockNotAcquired(LockError):
    """The lock could not be acquired within the allowed time."""


class LockNotOwned(LockError):
    """The caller does not hold the lock it tried to release or extend."""


class LockLost(LockNotOwned):
    """A hold ended without its owner releasing it (expired, or force-released)."""


class StaleFence(LockLost):
    """A fenced transaction found a later hold's fence recorded for its lock: this hold is
    outdated (lost in Redis, whether or not its holder noticed). Raised before the body ran;
    nothing of the transaction was committed, so taking the lock again and retrying is safe."""

    def __init__(self, message: str, fence: int | None = None, recorded: int | None = None):
        super().__init__(message, fence, recorded)  # args: see the module's docstring
        self.fence, self.recorded = fence, recorded

    def __str__(self) -> str:
        return str(self.args[0])


class CommitOutcomeUnknown(LockError):
    """A fenced transaction's COMMIT did not answer (its reply lost, or the wait for it
    interrupted), and the database could not prove afterwards whether it committed: it may
    have, or not. Not safe to retry blindly (the work may be applied twice); check what the
    block wrote first. The exception out of the COMMIT is its ``__cause__``."""


class QuorumNotReached(LockError):
    """Too few Redlock nodes answered to decide either way."""


class BackendUnavailable(LockError):
    """The lock's Redis did not answer within the socket timeout, or could not be reached.

    ``timed_out``: no answer came in time (the server may still run what it was sent), as
    opposed to a connection refused or cut.
    """

    def __init__(self, message: str = "", timed_out: bool = False) -> None:
        super().__init__(message, timed_out)  # args: see the module's docstring
        self.timed_out = timed_out

    def __str__(self) -> str:
        return str(self.args[0])


class BackendRefused(LockError):
    """The lock's Redis answered with a refusal about itself, not about the lock: out of
    memory (``OOM``), writes stopped after a failed snapshot (``MISCONF``), or an error reply
    no other exception names. ``code`` is the reply's first word (``"OOM"``), and the message
    says what the server said. Refusals that last only for now (``BUSY``, ``NOREPLICAS``,
    ``LOADING``, ...) are :class:`BackendUnavailable` instead. The call may or may not have
    taken effect (a script refused halfway): an acquire's hold, if any, runs out at its TTL.
    """

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message, code)  # args: see the module's docstring
        self.code = code

    def __str__(self) -> str:
        return str(self.args[0])


class MissingPermission(LockError):
    """The backend's Redis user may not do what an operation needs (an ACL refused it).

    Nothing was done: the operation can be tried again once the user has the permission.
    ``needs`` is what to add to the user's ACL (``"+time"``, ``"~redlock:*"``), ``rule``
    everything the backend needs (``ACL SETUSER <user> <rule>``).
    """

    def __init__(self, message: str, needs: str = "", rule: str = "") -> None:
        super().__init__(message, needs, rule)  # args: see the module's docstring
        self.needs = needs
        self.rule = rule

    def __str__(self) -> str:
        return str(self.args[0])


class InvalidLockBackendError(ImproperlyConfigured, ValueError):
    """A ``DJANGO_REDLOCK`` alias that is unknown or wrongly configured."""


def quorum_failure(alias: str, name: str, error: QuorumNotReached) -> QuorumNotReached:
    """Announce a quorum failure (``quorum_not_reached`` signal), then hand the error back."""
    from .signals import quorum_not_reached

    quorum_not_reached.send_robust(sender=QuorumNotReached, backend=alias, name=name, error=error)
    return error
