"""The Semaphore: at most ``limit`` holders of a name at once, each with its own permit.

A permit is a lease (see :mod:`.leases`): its own token, fence and expiry on the server's
clock. A holder that dies frees its permit at its TTL, never later; the watchdog renews
permits with the locks, in the same batches. A release wakes one waiter per permit freed.
"""

from __future__ import annotations

from typing import Any

from ..backends.base import Attempt, LockInfo, Op
from ..handler import DEFAULT_LOCK_ALIAS
from ..validation import check_bool, check_limit
from .leases import LeaseLock


class Semaphore(LeaseLock):
    """At most ``limit`` holders of ``name`` at once; not acquired until :meth:`acquire`.

    Like a plain :class:`~.lock.Lock`, the object is the holder of its permit (one at a
    time; take several permits with several objects). ``fair=True`` hands permits to the
    waiters in arrival order. Changing the limit of a name in use: each grant obeys the limit
    of the object asking, and holders keep their permits (a lower limit takes effect as
    permits are released, a higher one at once).
    """

    noun = "semaphore"
    mode = "s"
    offered_as = "semaphores"
    exclusive = False  # a thread may hold several permits (through several objects)

    def __init__(
        self,
        name: str,
        limit: int,
        *,
        ttl: float | None = None,
        using: str = DEFAULT_LOCK_ALIAS,
        timeout: float | None = None,
        blocking: bool = True,
        auto_renew: bool = True,
        max_hold: float | None = None,
        fair: bool = False,
        token_prefix: str | None = None,
    ) -> None:
        self.limit = check_limit(limit)
        self.queued = check_bool(fair, "fair")
        super().__init__(
            name,
            ttl=ttl,
            using=using,
            timeout=timeout,
            blocking=blocking,
            auto_renew=auto_renew,
            max_hold=max_hold,
            token_prefix=token_prefix,
        )
        self._check_backend()

    def kind_label(self) -> str:
        return f"{'fair ' if self.queued else ''}limit {self.limit}"

    def _init_kwargs(self) -> dict[str, Any]:
        return {**super()._init_kwargs(), "limit": self.limit, "fair": self.queued}

    def _op_acquire(
        self, token: str, ttl_ms: int, meta: str, waiter: str | None, wait_ms: int
    ) -> Op[Attempt]:
        return self.backend.op_lease_acquire(
            self.name, token, ttl_ms, meta, "s", self.limit, self.queued, waiter, wait_ms
        )

    def _busy(self, info: LockInfo | None) -> bool:
        return self._free(info) == 0

    def _free(self, info: LockInfo | None) -> int:
        return max(0, self.limit - (0 if info is None else len(info.holders)))

    def _available(self) -> Any:
        return self._free((yield self._op_inspect()))

    def available(self) -> int:
        """Permits free now (under this object's limit)."""
        return self._drive(self._available())

    async def aavailable(self) -> int:
        return await self._adrive(self._available())

    def locked(self) -> bool:
        """Whether every permit is taken (an acquire now would wait)."""
        return super().locked()


def semaphore(
    name: str,
    limit: int,
    *,
    ttl: float | None = None,
    using: str = DEFAULT_LOCK_ALIAS,
    timeout: float | None = None,
    blocking: bool = True,
    auto_renew: bool = True,
    max_hold: float | None = None,
    fair: bool = False,
    token_prefix: str | None = None,
) -> Semaphore:
    """A :class:`Semaphore` of ``limit`` permits on backend ``using``: ``with``, ``async
    with``, a decorator (the name a template over the arguments), or by hand."""
    return Semaphore(
        name,
        limit,
        ttl=ttl,
        using=using,
        timeout=timeout,
        blocking=blocking,
        auto_renew=auto_renew,
        max_hold=max_hold,
        fair=fair,
        token_prefix=token_prefix,
    )
