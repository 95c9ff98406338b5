"""The Lock: plain (one holder), reentrant (one owner, counted) or fair (first come, first
served), on any backend. The hold mechanics are :class:`~.base.BaseLock`'s."""

from __future__ import annotations

from typing import Any

from ..backends.base import Attempt, Kind, LockInfo, Op, Order
from ..fencing import database_of
from ..handler import DEFAULT_LOCK_ALIAS
from ..identity import write_seq
from ..validation import check_bool
from .base import BaseLock
from .holds import believed, refence_of

#: The four kinds, made once (every Lock names one).
_KINDS = {(r, f): Kind(r, f) for r in (False, True) for f in (False, True)}


class Lock(BaseLock):
    """A named lock on one backend; not acquired until :meth:`acquire` or ``with``.

    A plain Lock object is the holder: whoever has the object may release it, so it can be
    handed to another thread. A reentrant lock is held by an owner, the current thread or
    asyncio task, which may take it again and must release it as often. A fair lock hands
    itself to its waiters in arrival order. Every new hold gets a fencing token strictly
    greater than any earlier one for the same name.
    """

    def __init__(
        self,
        name: str,
        *,
        ttl: float | None = None,
        using: str = DEFAULT_LOCK_ALIAS,
        timeout: float | None = None,
        blocking: bool = True,
        auto_renew: bool = True,
        max_hold: float | None = None,
        reentrant: bool = False,
        fair: bool = False,
        token_prefix: str | None = None,
        atomic: bool | str | None = None,
    ) -> None:
        self.database = None if atomic is None else database_of(atomic)
        kind = _KINDS.get((reentrant, fair)) if type(reentrant) is type(fair) is bool else None
        if kind is None:  # not two bools: the checks say which
            kind = Kind(check_bool(reentrant, "reentrant"), check_bool(fair, "fair"))
        self.kind = kind
        self.reentrant, self.queued = self.kind
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
        self.backend.check_kind(self.kind)

    def kind_label(self) -> str:
        return self.kind.label

    def _init_kwargs(self) -> dict[str, Any]:
        kind = self.kind
        return {**super()._init_kwargs(), "reentrant": kind.reentrant, "fair": kind.fair,
                "atomic": self.database}  # fmt: skip

    #: A reentrant release sets the owner's count to its levels (:meth:`_order`): it settles
    #: a count left unsure in its own round trip.
    _release_settles = True

    def _order(self, owner: str, levels: int | None = None) -> Order | None:
        """A reentrant owner's write: its number, and the levels the owner holds (``levels``,
        else as this process counts them now), which the server's count is set to (plus one
        for an acquire). None for a plain lock."""
        if not self.kind.reentrant:
            return None
        return write_seq(), believed(self.backend, self.name, owner) if levels is None else levels

    def _op_acquire(
        self, token: str, ttl_ms: int, meta: str, waiter: str | None, wait_ms: int
    ) -> Op[Attempt]:
        # A reentrant hold's token is its owner (a plain lock's order: None, without a call).
        order = self._order(token) if self.kind.reentrant else None
        return self.backend.op_acquire(
            self.name, token, ttl_ms, meta, self.kind, waiter, wait_ms, order
        )

    def _op_release(self, token: str) -> Op[int]:
        if not self.kind.reentrant:  # a plain lock: no ordered write
            return self.backend.op_release(self.name, token, self.kind)
        order = self._order(token)
        hold = self._holds.get(token)  # a reentrant hold's token is its owner
        if order is not None and hold is not None and hold.fence:
            fence, unanswered = refence_of(self.backend, self.name, token)
            if not unanswered:  # else the server's fence may be one this process never heard
                # The hold the levels are in: one under another fence was made by a late write.
                order = (*order, max(hold.fence, fence))
        return self.backend.op_release(self.name, token, self.kind, order)

    def _op_hand_back(self, token: str, kept: bool = False) -> Op[int]:
        if self.kind.reentrant:  # (handed back by a settle: _give_back)
            return self._op_release(token)
        return self.backend.op_hand_back(self.name, token, self.kind, kept)

    def _op_drop(self, token: str) -> Op[int]:
        return self.backend.op_release(self.name, token, self.kind, self._order(token, 0))

    def _op_extend(self, token: str, ttl_ms: int) -> Op[bool]:
        return self.backend.op_extend(self.name, token, ttl_ms)

    def _op_hold_count(self, token: str) -> Op[int]:
        return self.backend.op_hold_count(self.name, token)

    def _op_locked(self) -> Op[bool]:
        return self.backend.op_locked(self.name)

    def _op_pttl(self) -> Op[int | None]:
        return self.backend.op_pttl(self.name)

    def _op_inspect(self) -> Op[LockInfo | None]:
        return self.backend.op_inspect(self.name)


def lock(
    name: str,
    *,
    ttl: float | None = None,
    using: str = DEFAULT_LOCK_ALIAS,
    timeout: float | None = None,
    blocking: bool = True,
    auto_renew: bool = True,
    max_hold: float | None = None,
    reentrant: bool = False,
    fair: bool = False,
    token_prefix: str | None = None,
    atomic: bool | str | None = None,
) -> Lock:
    """A :class:`Lock` on backend ``using``; use with ``with``, ``async with``, as a
    decorator, or by hand. ``token_prefix`` starts every hold token (the rest is random), so
    another process that knows it can find and release the hold (Celery does, on revoke).

    ``atomic=True`` (or a ``DATABASES`` alias): ``with`` and the decorator run the body in a
    fenced transaction (:meth:`Lock.atomic`), committed before the release. ``timeout`` then
    bounds the wait in Redis and, again, the wait for the lock's database row (without it,
    the row wait is bounded by ``ttl``): never the body or its commit."""
    return Lock(
        name,
        ttl=ttl,
        using=using,
        timeout=timeout,
        blocking=blocking,
        auto_renew=auto_renew,
        max_hold=max_hold,
        reentrant=reentrant,
        fair=fair,
        token_prefix=token_prefix,
        atomic=atomic,
    )
