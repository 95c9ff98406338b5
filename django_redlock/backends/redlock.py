"""The Redlock quorum over N independent Redis masters (LOCATION: a list of URLs).

Every operation goes to all N nodes at once (the sync path writes every request, then reads
every reply, so latency is the slowest node's, not the sum). A lock is acquired only when a
majority (N//2 + 1) granted it and its validity, ``ttl - elapsed - drift``, is still positive.
On failure it is released on all nodes, since a lost reply may have set the key.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from redis.exceptions import NoScriptError, ResponseError

from .. import acl
from ..exceptions import (
    BackendUnavailable,
    LockError,
    MissingPermission,
    QuorumNotReached,
    quorum_failure,
)
from ..options import check_options, pool_options
from ..scripts import Call
from ..waiting import CompositeHub
from .base import (
    Attempt,
    BadCursor,
    BaseLockBackend,
    Kind,
    LockInfo,
    Op,
    Released,
    Renewal,
    parse_cursor,
)
from .redis import UNAVAILABLE, RedisBackend, text

T = TypeVar("T")
Replies = list[Any]  # per node: the parsed reply, or the exception it raised
Steps = Generator[list[Op[Any] | None], Replies, T]

DRIFT_FACTOR = 0.01  # clock drift allowance: ttl x 1 % + 2 ms (the Redlock paper's)
DRIFT_MS = 2
#: A node that just failed is skipped (it answers "unavailable" at once) for this long, then
#: tried again: a dead or paused node then costs nothing, not a timeout per operation. Its
#: vote is simply missing, which is always safe; what it holds expires at its TTL. Nodes are
#: skipped only while the others can still make a quorum (else all are probed), and never
#: for a release, which goes to every node.
BREAKER_SECONDS = 1.0
#: At most this many SCAN round trips per page of held locks (the admin's, ``redlock list``).
PAGE_SCANS = 12


class _EveryNode(list):
    """Ops for every node, which the breaker must not skip (releases)."""


class _Skipped(BackendUnavailable):
    """A node the breaker skipped: no I/O was done."""


class _Quorum:
    """A request for :meth:`RedlockBackend.execute`: steps that fan ops out to every node."""

    def __init__(self, steps: Steps[Any]) -> None:
        self.steps = steps


class RedlockBackend(BaseLockBackend):
    location_is_list = True
    #: Node connections time out far below any TTL: a dead node costs this, not more.
    node_options: dict[str, Any] = {"socket_timeout": 0.1, "socket_connect_timeout": 0.1}

    def __init__(self, alias: str, params: Any) -> None:
        super().__init__(alias, params)
        options = {**self.node_options, **self.options}
        self.restart_guard = float(options.pop("restart_guard", 0) or 0)
        self.nodes = [
            RedisBackend(
                f"{alias}[{i}]",
                {
                    "LOCATION": url,
                    "OPTIONS": options,
                    "KEY_PREFIX": params.get("KEY_PREFIX", "redlock"),
                },
            )
            for i, url in enumerate(self.location)  # type: ignore[arg-type]
        ]
        for node in self.nodes:  # our waiters listen on the nodes' release channels
            node.publishes_releases = True
        self.quorum = len(self.nodes) // 2 + 1
        self._hub: CompositeHub | None = None
        self._failed_at: dict[int, float] = {}  # node index -> when it last failed

    @classmethod
    def check_params(cls, alias: str, params: Any) -> None:
        super().check_params(alias, params)
        guard = (params.get("OPTIONS") or {}).get("restart_guard", 0)
        if isinstance(guard, bool) or not isinstance(guard, (int, float)) or guard < 0:
            from django.core.exceptions import ImproperlyConfigured

            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['restart_guard'] must be seconds >= 0"
            )

    def check_kind(self, kind: Kind) -> None:
        if kind.reentrant or kind.fair:
            raise NotImplementedError(
                f"backend {self.alias!r} (Redlock) offers plain locks only: a hold count or a"
                " queue kept on N independent nodes drifts apart when a node misses an update,"
                " and no majority can then say what the count or the order is"
            )

    def check_leases(self, what: str) -> None:
        raise NotImplementedError(
            f"backend {self.alias!r} (Redlock) has no {what}: a quorum of independent"
            " counters is not a safe semaphore. Each node would count its own permits; a node"
            " that misses a release or restarts empty lets a majority grant more than the"
            " limit (or a writer beside readers). Use a single-master backend (Redis,"
            " django-redis, Sentinel, Cluster) for them"
        )

    @property
    def hub(self) -> CompositeHub:
        if self._hub is None:
            self._hub = CompositeHub([node.hub for node in self.nodes], self.node_timeout)
        return self._hub

    @property
    def node_timeout(self) -> float:
        return float(self.nodes[0].client_options(None)["socket_timeout"])

    def _drift_ms(self, ttl_ms: int) -> float:
        return ttl_ms * DRIFT_FACTOR + DRIFT_MS

    # -- fan-out -----------------------------------------------------------------------------

    def execute(self, op: Op[T]) -> T:
        self.round_trips += 1
        steps = op.request.steps
        replies: Replies | None = None
        while True:
            try:
                ops = steps.send(replies)
            except StopIteration as done:
                return op.parse(done.value)
            replies = self._note(self._fan_out(ops))

    async def aexecute(self, op: Op[T]) -> T:
        self.round_trips += 1
        steps = op.request.steps
        replies: Replies | None = None
        while True:
            try:
                ops = steps.send(replies)
            except StopIteration as done:
                return op.parse(done.value)
            replies = list(
                await asyncio.gather(
                    *(
                        _aexecute(node, node_op)
                        for node, node_op in zip(self.nodes, ops, strict=True)
                    ),
                    return_exceptions=True,
                )
            )

    def _fan_out(self, ops: list[Op[Any] | None]) -> Replies:
        """Send every node its op, then read every reply: one round trip, in parallel.

        All reads share one deadline (a node timeout once the requests are out), and nodes that
        need a new connection connect in parallel, so dead or paused nodes cost one connect
        plus one read timeout at most, however many there are.
        """
        taken: list[Any] = []
        broken = self._broken()
        if isinstance(ops, _EveryNode):
            # A release goes to every node; a broken one is not waited for: its reply is
            # taken if it is there at once, else it counts as unanswered.
            skipping, hasty = set(), broken
        else:  # skipped only while the others can still make a quorum
            skipping = broken if len(self.nodes) - len(broken) >= self.quorum else set()
            hasty = set()
        for i, (node, node_op) in enumerate(zip(self.nodes, ops, strict=True)):
            if node_op is None:
                taken.append(None)
                continue
            skipped = self._skipped(i, node, node_op) if i in skipping else None
            if skipped is not None:
                taken.append(skipped)
                continue
            node.round_trips += 1
            try:
                taken.append(node.client.connection_pool.get_connection())
            except UNAVAILABLE as exc:
                taken.append(_unavailable(node, node_op, exc))
        idle = [i for i, c in enumerate(taken) if _idle(c)]
        for i, error in zip(idle, self._connect_all([taken[i] for i in idle]), strict=True):
            if error is not None:  # do not let sending try (and wait) again
                node, node_op = self.nodes[i], ops[i]
                node.client.connection_pool.release(taken[i])
                taken[i] = _unavailable(node, node_op, error)  # type: ignore[arg-type]
        sent: list[Any] = []
        for node, node_op, connection in zip(self.nodes, ops, taken, strict=True):
            if node_op is None or isinstance(connection, BaseException):
                sent.append(connection)
                continue
            commands = _commands(node_op.request)
            try:
                connection.send_packed_command(connection.pack_commands(commands))
                sent.append((connection, len(commands)))
            except UNAVAILABLE as exc:
                self._drop(node, connection)
                sent.append(_unavailable(node, node_op, exc))
        # The replies' deadline starts once every request is out (connecting had its own).
        deadline = time.monotonic() + self.node_timeout
        replies: Replies = []
        for i, (node, node_op, outcome) in enumerate(zip(self.nodes, ops, sent, strict=True)):
            if node_op is None or isinstance(outcome, BaseException):
                replies.append(outcome)
                continue
            connection, count = outcome
            try:
                wait = 0.0 if i in hasty else max(0.0, deadline - time.monotonic())
                if not connection.can_read(timeout=wait):
                    raise TimeoutError(f"no answer within {self.node_timeout:g} s")
                raw = [_read(connection) for _ in range(count)]
            except (*UNAVAILABLE, TimeoutError) as exc:
                self._drop(node, connection)
                replies.append(_unavailable(node, node_op, exc))
                continue
            node.client.connection_pool.release(connection)
            refused = acl.first_refused(raw)
            if refused is not None:  # this node's user may not: say what it lacks
                replies.append(node._refused(node_op.name, refused))
                continue
            if any(isinstance(r, NoScriptError) for r in raw):
                # This node forgot the scripts: teach it and ask again, on its own.
                replies.append(_quietly(node, node_op))
                continue
            try:
                single = not isinstance(node_op.request, list)
                replies.append(node_op.parse(raw[0] if single else raw))
            except Exception as exc:
                replies.append(exc)
        return replies

    def _broken(self) -> set[int]:
        """The nodes whose breaker is on: they failed less than BREAKER_SECONDS ago."""
        now = time.monotonic()
        return {i for i, at in self._failed_at.items() if now - at < BREAKER_SECONDS}

    def _skipped(self, i: int, node: RedisBackend, op: Op[Any]) -> _Skipped | None:
        failed = self._failed_at.get(i)
        if failed is not None and time.monotonic() - failed < BREAKER_SECONDS:
            return _Skipped(
                f"lock {op.name!r}: node {node.alias!r} is skipped: it failed"
                f" {time.monotonic() - failed:.2f} s ago"
            )
        return None

    def _note(self, replies: Replies) -> Replies:
        """Remember which nodes failed (the breaker), and which answered again."""
        now = time.monotonic()
        for i, reply in enumerate(replies):
            if isinstance(reply, _Skipped):
                continue  # probed again once the breaker's time is up
            if isinstance(reply, BackendUnavailable):
                self._failed_at[i] = now
            elif reply is not None:
                self._failed_at.pop(i, None)
        return replies

    def _connect_all(self, connections: list[Any]) -> list[BaseException | None]:
        """(Re)connect several nodes at once: paused nodes cost one connect timeout in all."""
        errors: list[BaseException | None] = [None] * len(connections)

        def connect(i: int) -> None:
            try:
                connections[i].connect()
            except UNAVAILABLE as exc:
                errors[i] = exc

        if len(connections) == 1:
            connect(0)
            return errors
        threads = [threading.Thread(target=connect, args=(i,)) for i in range(len(connections))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return errors

    def _drop(self, node: RedisBackend, connection: Any) -> None:
        connection.disconnect()  # a reply may still be on its way: never reuse it
        node.client.connection_pool.release(connection)

    def _each(self, build: Any) -> list[Op[Any] | None]:
        return [build(node) for node in self.nodes]

    def _everywhere(self, build: Any) -> list[Op[Any] | None]:
        """Like :meth:`_each`, never skipped by the breaker."""
        return _EveryNode(build(node) for node in self.nodes)

    def _decide(self, name: str, replies: Replies, yes: int, doing: str) -> bool:
        """True when ``yes`` nodes make a quorum, False when even every unanswered node
        could not make one; else nobody can tell: QuorumNotReached."""
        unknown = len(self.nodes) - self._answered(replies)
        if yes >= self.quorum:
            return True
        if yes + unknown < self.quorum:
            return False
        raise self._unreachable(name, replies, doing)

    def _answered(self, replies: Replies) -> int:
        return sum(1 for reply in replies if not isinstance(reply, BaseException))

    def _unreachable(self, name: str, replies: Replies, doing: str) -> LockError:
        refused = next((r for r in replies if isinstance(r, MissingPermission)), None)
        if refused is not None:  # no quorum because a node's user may not: say what it lacks
            return refused
        errors = "; ".join(str(r) for r in replies if isinstance(r, BaseException))
        return quorum_failure(
            self.alias,
            name,
            QuorumNotReached(
                f"lock {name!r}: backend {self.alias!r} could not {doing}: only"
                f" {self._answered(replies)} of {len(self.nodes)} nodes answered, {self.quorum}"
                f" needed ({errors})"
            ),
        )

    # -- ops ---------------------------------------------------------------------------------

    def op_acquire(
        self,
        name: str,
        token: str,
        ttl_ms: int,
        meta: str,
        kind: Kind,
        waiter: str | None = None,
        wait_ms: int = -1,
    ) -> Op[Attempt]:
        return Op(name, _Quorum(self._acquire(name, token, ttl_ms, meta)))

    def _acquire(self, name: str, token: str, ttl_ms: int, meta: str) -> Steps[Attempt]:
        started = time.monotonic()
        replies = yield self._each(lambda n: self._node_acquire(n, name, token, ttl_ms, meta))
        elapsed_ms = (time.monotonic() - started) * 1000
        granted = [(i, r) for i, r in enumerate(replies) if isinstance(r, Attempt) and r.acquired]
        validity = ttl_ms - elapsed_ms - self._drift_ms(ttl_ms)
        if len(granted) >= self.quorum and validity > 0:
            fence = max(r.fence or 0 for _, r in granted)
            behind = {i for i, r in granted if (r.fence or 0) < fence}
            if not behind:
                return Attempt(True, fence, 1)
            # Lift the lagging counters, so every later majority sees at least this fence.
            lifted = yield [
                n.op_raise_fence(name, fence) if i in behind else None
                for i, n in enumerate(self.nodes)
            ]
            at_fence = len(granted) - len(behind) + sum(1 for i in behind if lifted[i] is True)
            if at_fence >= self.quorum:
                return Attempt(True, fence, 1)
        # Not ours: undo everywhere, including nodes that did not answer (a lost reply may
        # have set the key there).
        yield self._everywhere(lambda n: n.op_release(name, token, Kind()))
        if self._answered(replies) < self.quorum:
            raise self._unreachable(name, replies, "acquire")
        return Attempt(False, None, self._wait_hint(replies, bool(granted)))

    def _node_acquire(
        self, node: RedisBackend, name: str, token: str, ttl_ms: int, meta: str
    ) -> Op[Attempt]:
        op = node.op_acquire(name, token, ttl_ms, meta, Kind())
        if not self.restart_guard:
            return op
        call = op.request
        keys = [*call.keys, f"{node.key_prefix}node"]
        args = [*call.args, round(self.restart_guard * 1000)]
        return Op(name, Call(call.script, keys, args), op.parse)

    def _wait_hint(self, replies: Replies, split: bool) -> int:
        """When a majority may be free: when enough holds run out; soon if votes split."""
        if split:  # others raced us for the same nodes: back off a random moment
            return random.randint(5, 50)
        left = sorted(r.count_or_wait for r in replies if isinstance(r, Attempt) and not r.acquired)
        free = len(self.nodes) - len(left)
        needed = self.quorum - free
        if needed <= 0:
            return 0
        hint = left[needed - 1] if needed <= len(left) else -1
        return hint if hint >= 0 else -1

    def op_release(self, name: str, token: str, kind: Kind) -> Op[int]:
        def steps() -> Steps[int]:
            # Deleted wherever our token still is; but the hold was ours only if a majority
            # still had it (else it was lost, and someone else may hold the majority now).
            replies = yield self._everywhere(lambda n: n.op_release(name, token, kind))
            released = sum(1 for r in replies if isinstance(r, int) and r >= 0)
            return 0 if self._decide(name, replies, released, "release") else -1

        return Op(name, _Quorum(steps()))

    def op_extend(self, name: str, token: str, ttl_ms: int) -> Op[bool]:
        def steps() -> Steps[bool]:
            (extended,), replies = yield from self._renew([Renewal(name, token, ttl_ms)])
            if extended is None:
                raise self._unreachable(name, replies, "extend")
            return extended

        return Op(name, _Quorum(steps()))

    def op_renew(self, renewals: Sequence[Renewal]) -> Op[list[bool | None]]:
        def steps() -> Steps[list[bool | None]]:
            return (yield from self._renew(renewals))[0]

        return Op(renewals[0].name if renewals else "", _Quorum(steps()))

    def _renew(self, renewals: Sequence[Renewal]) -> Steps[tuple[list[bool | None], Replies]]:
        """Per hold: True when a majority extended it within its new validity, False when
        no majority can hold it any more, None when too few nodes answered to tell."""
        started = time.monotonic()
        replies = yield self._each(lambda n: n.op_renew(renewals))
        elapsed_ms = (time.monotonic() - started) * 1000
        unknown = len(self.nodes) - self._answered(replies)
        results: list[bool | None] = []
        for i, renewal in enumerate(renewals):
            votes = sum(1 for r in replies if isinstance(r, list) and r[i])
            valid = renewal.ttl_ms - elapsed_ms - self._drift_ms(renewal.ttl_ms) > 0
            if votes >= self.quorum and valid:
                results.append(True)
            elif votes + unknown < self.quorum:
                results.append(False)
            else:  # a majority may still have it (or had it, too slowly to count on it)
                results.append(None)
        return results, replies

    def op_hold_count(self, name: str, token: str) -> Op[int]:
        def steps() -> Steps[int]:
            replies = yield self._each(lambda n: n.op_hold_count(name, token))
            return int(self._decide(name, replies, sum(1 for r in replies if r == 1), "check"))

        return Op(name, _Quorum(steps()))

    def op_locked(self, name: str) -> Op[bool]:
        def steps() -> Steps[bool]:
            # Held when one token is on a majority (split votes hold nothing).
            replies = yield self._each(lambda n: Op(name, ("GET", n.key(name)), _token_of))
            tokens = [r for r in replies if isinstance(r, str)]
            most = max((tokens.count(t) for t in set(tokens)), default=0)
            return self._decide(name, replies, most, "check")

        return Op(name, _Quorum(steps()))

    def op_pttl(self, name: str) -> Op[int | None]:
        return Op(name, _Quorum(self._validity(name)))

    def _validity(self, name: str) -> Steps[int | None]:
        """What is left of the majority's hold: the quorum-th longest PTTL, less drift."""
        replies = yield self._each(lambda n: n.op_pttl(name))
        pttls = sorted((r for r in replies if isinstance(r, int)), reverse=True)
        if not self._decide(name, replies, len(pttls), "check"):
            return None
        left = pttls[self.quorum - 1]
        return max(0, round(left - self._drift_ms(left)))

    def op_inspect(self, name: str) -> Op[LockInfo | None]:
        def steps() -> Steps[LockInfo | None]:
            replies = yield self._each(lambda n: n.op_inspect(name))
            return self._agreed(replies)[0]

        return Op(name, _Quorum(steps()))

    def op_force_release(
        self, name: str, token: str | None = None, fence: int | None = None
    ) -> Op[Released]:
        def steps() -> Steps[Released]:
            expected = token
            if expected is None and fence is not None:
                # Each node's hold carries that node's own fence: find the majority's hold,
                # compare its fence, then release by its token (the same on every node).
                inspected = yield self._each(lambda n: n.op_inspect(name))
                if self._answered(inspected) < self.quorum:
                    raise self._unreachable(name, inspected, "inspect")
                info = self._agreed(inspected)[0]
                if info is None:
                    return Released.NOT_HELD
                if info.fence != fence or info.token is None:
                    return Released.CHANGED
                expected = info.token
            replies = yield self._everywhere(lambda n: n.op_force_release(name, expected))
            if any(r is Released.RELEASED for r in replies):
                return Released.RELEASED  # wherever the hold was left, it is gone now
            if any(r is Released.CHANGED for r in replies):
                return Released.CHANGED
            if self._answered(replies) < self.quorum:
                raise self._unreachable(name, replies, "force-release")
            return Released.NOT_HELD

        return Op(name, _Quorum(steps()))

    def op_leave(self, name: str, waiter: str) -> Op[None]:
        raise NotImplementedError("Redlock locks are never fair: nobody queues")

    def iter_locks(self, match: str = "*") -> Iterator[LockInfo]:
        # Page by page: a SCAN per node and one fan-out per page, not a round trip per lock.
        cursor: str | None = None
        while True:
            found, cursor = self.page(match, cursor, 500)
            yield from found
            if cursor is None:
                return

    def prepare(self) -> None:
        for node in self.nodes:
            node.prepare()
        if self.restart_guard:
            self.mark_nodes()

    def mark_nodes(self) -> None:
        """Set up the restart guard's markers (done when the app is ready).

        No node marked: a new deployment, so every node is marked as trusted long since. Some
        marked: the unmarked ones lost their data, and are distrusted from now on for
        ``restart_guard`` seconds (their first acquire would start that anyway).
        """
        marks: list[Any] = []
        for node in self.nodes:
            try:
                marks.append(node.client.get(f"{node.key_prefix}node"))
            except (*UNAVAILABLE, ResponseError):  # a refusal: told by the node's check
                marks.append(None)
        if any(mark is not None for mark in marks):
            return
        for node in self.nodes:
            try:
                node.client.set(f"{node.key_prefix}node", 0, nx=True)
            except (*UNAVAILABLE, ResponseError):
                continue

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self._hub = None

    # -- queue markers (Celery dedupe) -------------------------------------------------------

    def op_mark_queued(self, name: str, task_id: str, ttl_ms: int) -> Op[str | None]:
        """Note ``task_id`` on every node where no task is noted yet.

        ``task_id`` is the queued one (None) when a majority noted it. Another task is (its id)
        when a majority has it noted: ours is then taken back where it was noted. With no
        majority either way (a race of three or more, or nodes down), None all the same: a
        duplicate enqueued is excluded by the lock when it runs, while answering with another
        id would drop this call if that task is never enqueued. Fewer than a quorum of
        answers: QuorumNotReached, with ours taken back.
        """

        def steps() -> Steps[str | None]:
            replies = yield self._each(lambda n: n.op_mark_queued(name, task_id, ttl_ms))
            ours = [reply is None for reply in replies]  # errors come back as exceptions
            if self._answered(replies) < self.quorum:
                yield self._each(lambda n: n.op_clear_queued(name, task_id))
                raise self._unreachable(name, replies, "note a queued task")
            if sum(ours) >= self.quorum:
                return None
            votes = Counter(r for r in replies if isinstance(r, str) and r != task_id)
            other, count = votes.most_common(1)[0] if votes else (None, 0)
            if count < self.quorum:
                return None
            yield [
                node.op_clear_queued(name, task_id) if mine else None
                for node, mine in zip(self.nodes, ours, strict=True)
            ]
            return other

        return Op(name, _Quorum(steps()))

    def op_clear_queued(self, name: str, task_id: str) -> Op[bool]:
        """Remove ``task_id``'s marker wherever it is; True if any node had it. Fewer than a
        quorum of answers: QuorumNotReached (the markers left expire at their TTL)."""

        def steps() -> Steps[bool]:
            replies = yield self._each(lambda n: n.op_clear_queued(name, task_id))
            if self._answered(replies) < self.quorum:
                raise self._unreachable(name, replies, "clear a queued task's marker")
            return any(reply is True for reply in replies)

        return Op(name, _Quorum(steps()))

    # -- operators' views: pages of held locks, the majority's hold --------------------------

    def page(self, match: str, cursor: str | None, size: int) -> tuple[list[LockInfo], str | None]:
        """A page by ``SCAN``, node after node, like the single-node backends' (never a round
        trip per held lock). The cursor is ``node index:scan cursor:nodes scanned`` (the
        last a bitmask of the nodes scanned to the end).

        A majority hold is on a majority of nodes, so it is on one of any ``N - quorum + 1``
        nodes: scanning that many (skipping nodes that do not answer) finds every lock. The
        names found are inspected on every node in one fan-out (one pipelined request per
        node), and a lock is listed unless a node scanned before has it: once in all.
        """
        index, position, scanned = self._page_cursor(cursor)
        pattern = f"{self.key_prefix}{{{match}}}"
        needed = len(self.nodes) - self.quorum + 1
        found: list[LockInfo] = []
        pending: list[tuple[int, str]] = []  # (node it was found on, name), to inspect
        seen: set[str] = set()
        count, scans = size, 0
        while index < len(self.nodes) and scanned.bit_count() < needed:
            node = self.nodes[index]
            scans += 1
            try:
                with node._io(match):
                    position, keys = node.client.scan(position, match=pattern, count=count)
            except BackendUnavailable:
                index, position = index + 1, 0  # its majority holds are on the other nodes
            else:
                for key in keys:
                    name = self.name_from_key(text(key))
                    if name is not None and name not in seen:
                        seen.add(name)
                        pending.append((index, name))
                if position == 0:
                    index, scanned = index + 1, scanned | 1 << index
            done = (index >= len(self.nodes) or scanned.bit_count() >= needed
                    or scans >= PAGE_SCANS)  # fmt: skip
            if pending and (done or len(pending) >= size - len(found)):
                found += self._listed(match, pending, scanned)
                pending = []
            if done or len(found) >= size:
                break
            count = min(count * 2, 10_000)  # few matches so far: look further per round trip
        more = index < len(self.nodes) and scanned.bit_count() < needed
        return found, (f"{index}:{position}:{scanned}" if more else None)

    def _page_cursor(self, cursor: str | None) -> tuple[int, int, int]:
        """``page``'s cursor; BadCursor for one it did not make (a URL is anyone's)."""
        if not cursor:
            return 0, 0, 0
        parts = cursor.split(":") if isinstance(cursor, str) else []
        if len(parts) != 3:
            raise BadCursor(f"bad page cursor {cursor!r}")
        return (
            parse_cursor(parts[0], len(self.nodes)),
            parse_cursor(parts[1]),
            parse_cursor(parts[2], 2 ** len(self.nodes)),
        )

    def _listed(self, match: str, pending: list[tuple[int, str]], scanned: int) -> list[LockInfo]:
        """Inspect ``pending`` on every node in one fan-out; keep the majority holds that no
        node scanned before the one they were found on has (that node listed them)."""

        def steps() -> Steps[Replies]:
            requests = [[n.op_inspect(name).request for _, name in pending] for n in self.nodes]
            return (yield [Op(match, request, list) for request in requests])

        replies: Replies = self.execute(Op(match, _Quorum(steps())))
        if self._answered(replies) < self.quorum:
            raise self._unreachable(match, replies, "list the locks")
        listed = []
        for j, (at, name) in enumerate(pending):
            per_node: Replies = []
            for node, reply in zip(self.nodes, replies, strict=True):
                if isinstance(reply, list) and not isinstance(reply[j], BaseException):
                    per_node.append(node._info(name, reply[j]))
                else:
                    per_node.append(reply if isinstance(reply, BaseException) else None)
            earlier = [i for i in range(at) if scanned & 1 << i]  # skipped nodes did not list
            if any(isinstance(per_node[i], LockInfo) for i in earlier):
                continue  # listed from that node's scan
            info = self._agreed(per_node)[0]
            if info is not None:
                listed.append(info)
        return listed

    def _agreed(self, replies: Replies) -> tuple[LockInfo | None, list[int]]:
        """The hold a majority of nodes agree on (one token), and the nodes that have it. Its
        TTL is the majority's validity; its fence the largest of theirs (each node keeps its
        own counter, and the acquirer got the largest)."""
        by_token: dict[str | None, list[int]] = {}
        for i, reply in enumerate(replies):
            if isinstance(reply, LockInfo):
                by_token.setdefault(reply.token, []).append(i)
        holders = max(by_token.values(), key=len, default=[])
        if len(holders) < self.quorum:
            return None, []
        infos: list[LockInfo] = [replies[i] for i in holders]
        ttls = sorted((i.ttl for i in infos if i.ttl is not None), reverse=True)
        fences = [i.fence for i in infos if i.fence is not None]
        info = infos[0]
        info.backend = self.alias
        info.ttl = ttls[self.quorum - 1] if len(ttls) >= self.quorum else None
        info.fence = max(fences) if fences else None
        return info, holders

    @classmethod
    def check_options(cls, alias: str, params: Mapping[str, Any]) -> None:
        # Every node gets every option: each must suit every node's URL scheme.
        schemes = {urlsplit(str(url)).scheme for url in params.get("LOCATION") or []}
        allowed = set.intersection(*(set(pool_options(scheme)) for scheme in schemes))
        where = "the Redlock backend (restart_guard) or redis-py's pool and connection"
        check_options(alias, params.get("OPTIONS") or {}, allowed | {"restart_guard"}, where)


def _commands(request: Any) -> list[tuple[Any, ...]]:
    """The wire commands of a node op: one script call, a pipeline of them, or a command."""
    calls = request if isinstance(request, list) else [request]
    return [
        ("EVALSHA", c.script.sha, len(c.keys), *c.keys, *c.args)
        if isinstance(c, Call)
        else tuple(c)
        for c in calls
    ]


def _token_of(value: Any) -> str | None:
    """The token of a plain hold's value ('token|fence|...'), None when the key is gone."""
    if value is None:
        return None
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return text.split("|", 1)[0]


def _idle(connection: Any) -> bool:
    return (
        connection is not None
        and not isinstance(connection, BaseException)
        and (getattr(connection, "_sock", None) is None)
    )


def _read(connection: Any) -> Any:
    """One reply; an error reply comes back as a value, like a pipeline's."""
    from redis.exceptions import ResponseError

    try:
        return connection.read_response()
    except ResponseError as exc:
        return exc


async def _aexecute(node: RedisBackend, op: Op[Any] | None) -> Any:
    return None if op is None else await node.aexecute(op)


async def _settled(call: Any) -> Any:
    if isinstance(call, BaseException):
        return call
    return await call


def _unavailable(node: RedisBackend, op: Op[Any], exc: object) -> BackendUnavailable:
    return BackendUnavailable(f"lock {op.name!r}: node {node.alias!r} is unavailable: {exc}")


def _quietly(node: RedisBackend, op: Op[Any]) -> Any:
    try:
        return node.execute(op)
    except Exception as exc:
        return exc
