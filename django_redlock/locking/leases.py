"""What semaphores and read-write locks share: holds that are leases (lua/_permits.lua).

Each hold is a lease with its own token, fence and expiry on the server's clock, in a sorted
set at the name's key; many leases may hold one name at once. The hold mechanics (waiting,
renewing, losing, releasing) are :class:`~.base.BaseLock`'s; this only builds the ops.
"""

from __future__ import annotations

from typing import Any

from ..backends.base import Attempt, LeaseRenewal, LockInfo, Op, Renewal
from .base import BaseLock
from .holds import settled, unsettled
from .steps import Steps


class LeaseLock(BaseLock):
    """A hold that is one lease among several on a name (a permit, a read, the write)."""

    #: The lease's mode letter in the scripts: "s" permit, "r" read, "w" write.
    mode = "s"
    #: What the backend must offer (in check_leases' message).
    offered_as = "semaphores"

    def _settle_reads(self, owner: str, marks: bool = True) -> Steps[None]:
        """For the read-write lock's leases (``rwlock``): before the owner's next operation
        on the name, if a reply was lost, its read count on the server may be one too many
        (an acquire that went through although it raised, a release that did not): release
        the extra holds, the last one freeing the read, so an orphan read is neither
        re-entered and kept alive by the owner's later reads nor held against its write as an
        upgrade. What settle.lua does for a reentrant lock's hash, with the lease scripts
        (the read's token is its owner's; only the owner changes its count). A server count
        below the belief (the read expired) is left alone, as settle.lua does. Always in
        read mode, whoever runs it: a write's own (mode "w") release would take a read lease
        for a count of one and delete it whole. ``marks``: a read of the owner's may still be
        on the wire (the one interrupted or unanswered), and this settle may overtake it: the
        count is read as the owner's older reads are refused (``op_mark_reads``), so that
        read takes nothing when it lands."""
        count = unsettled(self.backend, self.name, owner)
        if count is None:
            return
        if marks:
            held = yield self.backend.op_mark_reads(self.name, owner)
        else:
            held = yield self._op_hold_count(owner)
        for _ in range(held - count):
            yield self.backend.op_lease_release(self.name, owner, "r")
        settled(self.backend, self.name, owner, count)

    def _check_backend(self) -> None:
        self.backend.check_leases(self.offered_as)

    def _op_acquire(
        self, token: str, ttl_ms: int, meta: str, waiter: str | None, wait_ms: int
    ) -> Op[Attempt]:
        return self.backend.op_lease_acquire(
            self.name, token, ttl_ms, meta, self.mode, waiter=waiter, wait_ms=wait_ms
        )

    def _op_release(self, token: str) -> Op[int]:
        return self.backend.op_lease_release(self.name, token, self.mode)

    def _op_hand_back(self, token: str, kept: bool = False) -> Op[int]:
        return self.backend.op_lease_hand_back(self.name, token, self.mode, kept)

    def _op_extend(self, token: str, ttl_ms: int) -> Op[bool]:
        return self.backend.op_lease_extend(self.name, token, ttl_ms)

    def _renewal(self, token: str, ttl_ms: int) -> Renewal:
        # A lease's: Cluster declares its details hash too (review wdc3, 4).
        return tuple.__new__(LeaseRenewal, (self.name, token, ttl_ms))

    def _op_leave(self, waiter: str) -> Op[None]:
        return self.backend.op_lease_leave(self.name, waiter)

    def _op_inspect(self) -> Op[LockInfo | None]:
        return self.backend.op_leases(self.name)

    def _op_with_info(self, parse: Any) -> Op[Any]:
        op = self._op_inspect()
        return Op(op.name, op.request, lambda reply: parse(op.parse(reply)))

    def _op_hold_count(self, token: str) -> Op[int]:
        def count(info: LockInfo | None) -> int:
            lease = _lease_of(info, token)
            return 0 if lease is None else lease.hold_count

        return self._op_with_info(count)

    def _op_fence_of(self, token: str) -> Op[int | None]:
        def fence(info: LockInfo | None) -> int | None:
            lease = _lease_of(info, token)
            return None if lease is None else lease.fence or 0

        return self._op_with_info(fence)

    def _op_pttl(self) -> Op[int | None]:
        """This owner's lease's ms left if it holds one, else until the first lease ends.
        None when it believes it holds one that is gone (expired): another lease's time is
        not its own."""
        hold = self._holds.get(self._owner())

        def pttl(info: LockInfo | None) -> int | None:
            if info is None:
                return None
            mine = _lease_of(info, hold.token) if hold else None
            if hold and mine is None:
                return None
            leases = [mine] if mine else info.holders
            return round(min(lease.ttl or 0.0 for lease in leases) * 1000)

        return self._op_with_info(pttl)

    def _op_locked(self) -> Op[bool]:
        return self._op_with_info(self._busy)

    def _busy(self, info: LockInfo | None) -> bool:
        """Whether a try of this kind would be refused now, as far as the leases say."""
        raise NotImplementedError

    def _holders(self) -> Any:
        info = yield self._op_inspect()
        return [] if info is None else list(info.holders)

    def holders(self) -> list[LockInfo]:
        """Every live lease of the name: token, fence, TTL, holder (host, pid, thread or
        Celery task), acquired at, and kind ("permit", "read", "write")."""
        return self._drive(self._holders())

    async def aholders(self) -> list[LockInfo]:
        return await self._adrive(self._holders())


def _lease_of(info: LockInfo | None, token: str) -> LockInfo | None:
    if info is None:
        return None
    return next((lease for lease in info.holders if lease.token == token), None)
