"""The Redlock quorum over N independent Redis masters (LOCATION: a list of URLs).

Every operation goes to all N nodes at once and reads the replies as they come: it returns as
soon as they decide it, so a paused minority node costs nothing (see :mod:`.redlock_io`, and
:mod:`.redlock_health` for the breaker that then skips it). A lock is acquired only when a
majority (N//2 + 1) granted it and its validity, ``ttl - elapsed - drift``, is still positive.
On failure it is released on the nodes asked, since a lost reply may have set the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from redis.exceptions import ResponseError

from ..exceptions import (
    BackendUnavailable,
    LockError,
    MissingPermission,
    QuorumNotReached,
    quorum_failure,
)
from ..options import check_options, pool_options
from ..scripts import Call, run, script
from ..waiters import Owed
from .base import (
    REFENCE_MARGIN_US,
    Attempt,
    BaseLockBackend,
    Kind,
    LockInfo,
    Op,
    Order,
    Released,
    Renewal,
    prepare_each,
)
from .cursors import BadCursor, parse_cursor
from .redis import UNAVAILABLE, RedisBackend, prior_of, text
from .redlock_health import BREAKER_SECONDS, NodeHub, QuorumHub, start_probes
from .redlock_io import PENDING, Fan, NodeIO, Undo, answered

T = TypeVar("T")
Replies = list[Any]  # per node: the parsed reply, or the exception it raised
Steps = Generator[list[Op[Any] | None], Replies, T]

DRIFT_FACTOR = 0.01  # clock drift allowance: ttl x 1 % + 2 ms (the Redlock paper's)
DRIFT_MS = 2
#: At most this many SCAN round trips per page of held locks (the admin's, ``redlock list``).
PAGE_SCANS = 12
#: An acquire proposes a fence this far above its own clock (us): above every node's clock
#: and below every node's cap (its clock + twice this, redlock_acquire.lua) while the clocks
#: agree within it either way, so the nodes' fences agree (no lagging counter to raise).
FENCE_LEAD_US = 1_000_000
#: A node's fence is at most its clock + this + 1 ms: the cap on a proposal, and the least
#: fence of a node whose counter is gone, the time its data began + this, rounded up to the
#: ms (redlock_acquire.lua). A re-fence's least fence is lifted to stay above them.
FENCE_CAP_US = 2 * FENCE_LEAD_US
_ACQUIRE = script("redlock_acquire")
_RELEASE = script("release")
_MARK_NODE = script("mark_node")
__all__ = ["BREAKER_SECONDS", "RedlockBackend"]


class _Quorum:
    """A request for :meth:`RedlockBackend.execute`: steps that fan ops out to every node."""

    def __init__(self, steps: Steps[Any]) -> None:
        self.steps = steps


class RedlockBackend(BaseLockBackend):
    """The Redlock quorum: a lock is held when a majority of N independent masters (LOCATION,
    a list of URLs) granted it within its validity. OPTIONS: ``restart_guard`` (seconds a node
    that lost its data votes no; 0, off, by default) and redis-py's, for every node.
    """

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
        for i, node in enumerate(self.nodes):  # our waiters listen on the nodes' channels
            node.publishes_releases = True
            node.location_setting = f"DJANGO_REDLOCK[{alias!r}]['LOCATION'][{i}]"
        self.quorum = len(self.nodes) // 2 + 1
        self.io = NodeIO(self.nodes, self.quorum)
        self._hub: QuorumHub | None = None
        # Leaves owed by closed node hubs, per node, for the next ones (see _owe).
        self._owed: dict[int, Owed] = {}
        self._owing = threading.Lock()

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
    def hub(self) -> QuorumHub:
        if self._hub is None:
            health = self.io.health

            def probe_down() -> None:  # (a reader's thread: the probes run in their own)
                start_probes(health, self.nodes, self.io.debts.pay_before_up, now_too=True)

            hubs = [
                NodeHub(node, lambda i=i: health.is_down(i), probe_down)  # type: ignore[misc]
                for i, node in enumerate(self.nodes)
            ]
            with self._owing:
                for i, hub in enumerate(hubs):
                    hub.take_over(self._owed.pop(i, {}))
                self._hub = QuorumHub(hubs, self.node_timeout, self.io.usable)
            health.on_up(self._hub.node_up)
        return self._hub

    @property
    def node_timeout(self) -> float:
        return float(self.nodes[0].client_options(None)["socket_timeout"])

    def drift_ms(self, ttl_ms: int) -> float:
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
            replies = self.io.fan_out(ops if isinstance(ops, Fan) else Fan(ops))

    async def aexecute(self, op: Op[T]) -> T:
        self.round_trips += 1
        steps = op.request.steps
        replies: Replies | None = None
        while True:
            try:
                ops = steps.send(replies)
            except StopIteration as done:
                return op.parse(done.value)
            replies = await self.io.afan_out(ops if isinstance(ops, Fan) else Fan(ops))

    def _each(
        self,
        build: Any,
        decided: Callable[[Replies], bool] | None = None,
        complete: bool = False,
        owed: str = "",
    ) -> Fan:
        """An op for every node; see :class:`.redlock_io.Fan` for the rest."""
        return Fan([build(node) for node in self.nodes], decided, complete, owed=owed)

    def _majority_answered(self, replies: Replies) -> bool:
        return self._answered(replies) >= self.quorum

    def _deciding(self, yes: Callable[[Replies], int]) -> Callable[[Replies], bool]:
        """The replies decide once :meth:`_decide` would not raise: ``yes(replies)`` nodes make
        a quorum, or cannot even with every node yet to answer."""

        def decided(replies: Replies) -> bool:
            votes = yes(replies)
            unknown = sum(1 for r in replies if not answered(r))
            return votes >= self.quorum or votes + unknown < self.quorum

        return decided

    def _granting(self, replies: Replies) -> bool:
        """An acquire's replies decide once a majority granted, or cannot even with every
        node still to answer (a node not asked will not), and the outcome's kind is known
        too: taken (a majority answered) or unreachable (one cannot answer). A refusal
        beside a down node does not decide before a second node answered: that answer
        makes it "taken" (False), where deciding at once said "unreachable"."""
        votes, pending = _granted(replies), replies.count(PENDING)
        if votes >= self.quorum:
            return True
        if votes + pending >= self.quorum:
            return False
        answered = self._answered(replies)
        return answered >= self.quorum or answered + pending < self.quorum

    def _decide(
        self, name: str, replies: Replies, yes: int, doing: str, had: str = "agreed"
    ) -> bool:
        """True when ``yes`` nodes make a quorum, False when even every unanswered node
        could not make one; else nobody can tell: QuorumNotReached (``had``: what the
        ``yes`` nodes did, for its message)."""
        unknown = len(self.nodes) - self._answered(replies)
        if yes >= self.quorum:
            return True
        if yes + unknown < self.quorum:
            return False
        raise self._unreachable(name, replies, doing, (yes, had))

    def _nobody(self, name: str, replies: Replies, doing: str) -> None:
        """No hold has a quorum among the answers: None ("nobody holds it") only when the
        silent nodes could not make one either; else unknown (QuorumNotReached), never None
        for a lock held on a majority with one of its nodes silent."""
        self._decide(name, replies, _agreeing(replies), doing, "held it")

    def _answered(self, replies: Replies) -> int:
        return sum(1 for reply in replies if answered(reply))

    def _unreachable(
        self, name: str, replies: Replies, doing: str, votes: tuple[int, str] | None = None
    ) -> LockError:
        """QuorumNotReached saying what was missing. ``votes``: how many answering nodes
        did what (``had``): with a majority answering, too few of them did, and the silent
        ones could have made the majority."""
        refused = next((r for r in replies if isinstance(r, MissingPermission)), None)
        if refused is not None:  # no quorum because a node's user may not: say what it lacks
            return refused
        errors = "; ".join(str(r) for r in replies if isinstance(r, BaseException))
        count = self._answered(replies)
        missing = f"only {count} of {len(self.nodes)} nodes answered, {self.quorum} needed"
        if votes is not None and count >= self.quorum:
            yes, had = votes
            silent = [repr(self.nodes[i].alias) for i, r in enumerate(replies) if not answered(r)]
            who = f"node {silent[0]}" if len(silent) == 1 else f"nodes {', '.join(silent)}"
            missing = (
                f"only {yes} of the {count} nodes that answered {had}, {self.quorum} needed,"
                f" and {who} did not answer"
            )
        return quorum_failure(
            self.alias,
            name,
            QuorumNotReached(
                f"lock {name!r}: backend {self.alias!r} could not {doing}: {missing} ({errors})"
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
        order: Order | None = None,  # reentrant kinds only: refused here (check_kind)
    ) -> Op[Attempt]:
        return Op(name, _Quorum(self._acquire(name, token, ttl_ms, meta)))

    def _acquire(self, name: str, token: str, ttl_ms: int, meta: str) -> Steps[Attempt]:
        started = time.monotonic()
        proposal = time.time_ns() // 1000 + FENCE_LEAD_US
        # Decided once a majority granted, or the nodes asked can no longer make one: a
        # node whose vote is needed is waited for until it counts as slow (a quarter of the
        # node timeout, at most 50 ms), so a non-blocking acquire does not give up on a free
        # majority because one reply came a moment late. Not longer, once a majority
        # answered: contenders whose votes split beside a paused node would hold their
        # grants for its timeout, and split again (a split vote is retried). Nodes skipped
        # as down or slow are not asked. The nodes still silent once decided get a grace;
        # a late grant left there is undone behind it (see redlock_io).
        replies = yield Fan(
            [self._node_acquire(n, name, token, ttl_ms, meta, proposal) for n in self.nodes],
            self._granting,
            complete=True,  # a node skipped as down is asked when the others fall short
            enough=self._majority_answered,
            regrant=True,  # the token may be a try's whose answer was lost: its undos are void
        )
        elapsed_ms = (time.monotonic() - started) * 1000
        granted = [(i, r) for i, r in enumerate(replies) if isinstance(r, Attempt) and r.acquired]
        answers = replies  # as of the last round trip
        lost: tuple[int, str] | None = None  # a lift fell short: (nodes at the fence, what)
        validity = ttl_ms - elapsed_ms - self.drift_ms(ttl_ms)
        if len(granted) >= self.quorum and validity > 0:
            fence = max(r.fence or 0 for _, r in granted)
            behind = {i for i, r in granted if (r.fence or 0) < fence}
            prior = self._prior(r.prior for _, r in granted)
            if not behind:
                return Attempt(True, fence, 1, prior)
            # Lift the lagging counters, so every later majority sees at least this fence,
            # and their holds' fences: every node of the hold then shows the holder's.
            # Decided as the first trip: a lagging node silent once a quorum is at the fence
            # gets the grace, then is not waited for (its lift is written, its reply read
            # later: review rio4, 1).
            lifted = yield self._lift(name, fence, token, behind, len(granted) - len(behind))
            at_fence = len(granted) - len(behind) + sum(1 for i in behind if lifted[i] is True)
            elapsed_ms = (time.monotonic() - started) * 1000
            still_valid = ttl_ms - elapsed_ms - self.drift_ms(ttl_ms) > 0  # after 2 trips
            if at_fence >= self.quorum and still_valid:
                return Attempt(True, fence, 1, prior)
            # A lagging node that did not answer its lift counts as not answering: the
            # undo's wait and the QuorumNotReached below see this trip's answers, not the
            # first's (a lift short of a quorum is unknown, not "held": review rio4, 2).
            answers = [
                lifted[i] if i in behind and not answered(lifted[i]) else reply
                for i, reply in enumerate(replies)
            ]
            if at_fence < self.quorum:  # (raise_fence answers 1: only silence falls short)
                lost = (at_fence, "were at its fence")
        # Not ours: undo on every node that granted or did not answer (a lost reply may
        # have set the key there); not on one that refused: it holds nothing of this token
        # (the script grants "ours already" first, and this thread's earlier requests with
        # the token ran before it on that connection), so a refused acquire costs one
        # script call per node, and nothing is waited for when every node refused. A
        # straggler is not waited for: this thread's next request to it (the next try, with
        # this token) is written behind the undo. A node skipped as down is owed it: sent
        # before any later request to it (redlock_io.Debts).
        # Behind a holder of a majority the undo wakes nobody: whoever our key refused is
        # refused by that hold too, and woken by its release; a waiter woken by its own undo
        # (the node the hold missed) tried again at once, for the whole hold.
        # Too few nodes answered (QuorumNotReached below): the undo is not waited for at
        # all, the caller gets the error within one node timeout, not after a second one.
        # A holder whose refusals and the nodes that did not answer make a majority may
        # hold the lock (our grant is on a node its hold missed: a node restarted empty):
        # not a split vote, and our undo wakes nobody (it woke this waiter itself, which
        # then tried again at once, for the whole hold). Not known either: looked at again
        # within about a breaker period (two contenders beside a down node, each refused by
        # the other's grant, are not left waiting for a hold that was undone).
        held = self._held_by_one(answers)
        maybe = not held and self._held_by_one(answers, unknown=True)
        reachable = self._answered(answers) >= self.quorum and lost is None
        undo = Fan(
            [
                None
                if _refused(reply)
                else self._node_undo(
                    node, name, token, held or maybe, answered=isinstance(reply, Attempt)
                )
                for node, reply in zip(self.nodes, replies, strict=True)
            ],
            self._majority_answered if reachable else _at_once,  # (a refusal is an answer)
            owed="undo",
        )
        if any(op is not None for op in undo):
            yield undo
        if lost is not None:
            raise self._unreachable(name, answers, "acquire", lost)
        if self._answered(answers) < self.quorum:
            raise self._unreachable(name, answers, "acquire")
        hint = self._wait_hint(replies, bool(granted) and not (held or maybe))
        if maybe:
            again = round(random.uniform(0.5, 1.0) * BREAKER_SECONDS * 1000)
            hint = again if hint < 0 else min(hint, again)
        return Attempt(False, None, hint)

    def _lift(self, name: str, fence: int, token: str, behind: set[int], at: int) -> Fan:
        """The lift of the nodes ``behind`` to ``fence``, ``at`` nodes being there already:
        decided once a quorum is at the fence, or cannot be with every lift still to come."""

        def decided(replies: Replies) -> bool:
            lifted = at + sum(1 for r in replies if r is True)
            return lifted >= self.quorum or lifted + replies.count(PENDING) < self.quorum

        return Fan(
            [
                n.op_raise_fence(name, fence, token) if i in behind else None
                for i, n in enumerate(self.nodes)
            ],
            decided,
        )

    def _held_by_one(self, replies: Replies, unknown: bool = False) -> bool:
        """Whether one holder has a majority of the nodes (their refusals name it);
        ``unknown``: whether it may have, with the nodes that did not answer."""
        holders = Counter(
            r.prior for r in replies if isinstance(r, Attempt) and not r.acquired and r.prior
        )
        extra = sum(1 for r in replies if r is not None and not answered(r)) if unknown else 0
        return bool(holders) and holders.most_common(1)[0][1] + extra >= self.quorum

    def _node_undo(
        self, node: RedisBackend, name: str, token: str, quiet: bool, answered: bool = False
    ) -> Op[int]:
        """The release of our key on one node; ``quiet``: without waking the lock's waiters
        (release.lua publishes nowhere when the channel given is the lock's own key).
        ``answered``: the node answered our acquire (owed, the undo is a release the
        collector may send: see redlock_io.Debts)."""
        if not quiet:
            op = node.op_release(name, token, Kind())
            undo = Undo(op.name, op.request, op.parse)
        else:
            key = node.key(name)
            keys = [
                key,
                key,
                node.waiting_key(name),
                node.queue_key(name),
                node.deadlines_key(name),
            ]
            undo = Undo(name, Call(_RELEASE, keys, [token, node.inbox_for(name), "0"]), int)
        undo.answered = answered
        return undo

    def _prior(self, priors: Iterable[str | None]) -> str | None:
        """The hold given a fence before this one: the token a majority of the nodes name (a
        contender that took one node and lost the vote leaves its token there), else None."""
        counts = Counter(p for p in priors if p is not None)
        top = counts.most_common(1)
        return top[0][0] if top and top[0][1] >= self.quorum else None

    def _node_acquire(
        self, node: RedisBackend, name: str, token: str, ttl_ms: int, meta: str, proposal: int
    ) -> Op[Attempt]:
        # The node marker even without the guard: when the node's data began, which a
        # fence after a data loss must exceed (redlock_acquire.lua).
        keys = [node.key(name), node.fence_key(name), f"{node.key_prefix}node"]
        guard = str(round(self.restart_guard * 1000))
        args: list[Any] = [token, str(ttl_ms), meta, str(proposal), guard]  # text: packed as is
        return Op(name, Call(_ACQUIRE, keys, args), _attempt)

    def _wait_hint(self, replies: Replies, split: bool) -> int:
        """When a majority may be free: when enough holds run out; soon if votes split."""
        if split:  # others raced us for the same nodes: back off a random moment
            return random.randint(5, 50)
        left = sorted(r.count_or_wait for r in replies if isinstance(r, Attempt) and not r.acquired)
        free = sum(1 for r in replies if isinstance(r, Attempt) and r.acquired)  # not unknown
        needed = self.quorum - free
        if needed <= 0:
            return 0
        hint = left[needed - 1] if needed <= len(left) else -1
        return hint if hint >= 0 else -1

    def op_release(self, name: str, token: str, kind: Kind, order: Order | None = None) -> Op[int]:
        def steps() -> Steps[int]:
            # Deleted wherever our token still is; but the hold was ours only if a majority
            # still had it (else it was lost, and someone else may hold the majority now).
            # A node skipped as down is asked too when the others cannot decide; else it is
            # owed the release, sent when it answers again (redlock_io.Debts): a hold left
            # there would outlast the release by its TTL, and a few such nodes would refuse
            # the free lock to everyone.
            replies = yield self._each(
                lambda n: n.op_release(name, token, kind),
                self._deciding(_released),
                True,
                owed="release",
            )
            had = "still had the hold"
            return 0 if self._decide(name, replies, _released(replies), "release", had) else -1

        return Op(name, _Quorum(steps()))

    def op_extend(self, name: str, token: str, ttl_ms: int) -> Op[bool]:
        def each(node: RedisBackend) -> Op[list[bool]]:
            # Each node's extend (its TTL set exactly; a renewal's never shortens), decided
            # as a batch of one.
            op = node.op_extend(name, token, ttl_ms)
            return Op(op.name, op.request, lambda reply: [op.parse(reply)])

        def steps() -> Steps[bool]:
            renewals = [Renewal(name, token, ttl_ms)]
            (extended,), replies = yield from self._renew(renewals, each)
            if extended is None:
                raise self._unreachable(name, replies, "extend")
            return extended

        return Op(name, _Quorum(steps()))

    def op_refence(
        self, name: str, token: str, recorded: int, client_us: int | None = None
    ) -> Op[int]:
        # One reading of this client's clock for every node, moved on so that the nodes'
        # least fence (refence_least: the clock + REFENCE_MARGIN_US) is the clock + the cap
        # + 1 ms: above an unrecorded fence a node gave up to its clock + the cap + 1 ms.
        now = time.time_ns() // 1000 if client_us is None else client_us
        client = now + FENCE_CAP_US + 1000 - REFENCE_MARGIN_US

        def steps() -> Steps[int]:
            # Each node that still has the token re-fences its own hold above `recorded`; the
            # hold is current only on a majority, and its fence is then theirs (the largest),
            # as at the acquire. A node whose token is gone re-fences nothing.
            replies = yield self._each(
                lambda n: n.op_refence(name, token, recorded, client),
                self._deciding(_refenced),
                True,
            )
            if not self._decide(name, replies, _refenced(replies), "re-fence", "still had it"):
                taken = sum(1 for r in replies if r == -1) >= self.quorum
                return -1 if taken else 0
            fence = max(r for r in replies if isinstance(r, int))
            # Lift the lagging counters and holds, as the acquire does: every later majority
            # shares a node with this one, and then hands out more. Unanswered: a later hold
            # may get a fence below this one; the database refuses it and it re-fences in turn.
            behind = {i for i, r in enumerate(replies) if isinstance(r, int) and 0 < r < fence}
            yield self._lift(name, fence, token, behind, _refenced(replies) - len(behind))
            return fence

        return Op(name, _Quorum(steps()))

    def op_renew(self, renewals: Sequence[Renewal]) -> Op[list[bool | None]]:
        def steps() -> Steps[list[bool | None]]:
            return (yield from self._renew(renewals))[0]

        return Op(renewals[0].name if renewals else "", _Quorum(steps()))

    def _renew(
        self, renewals: Sequence[Renewal], each: Callable[[RedisBackend], Op[Any]] | None = None
    ) -> Steps[tuple[list[bool | None], Replies]]:
        """Per hold: True when a majority extended it within its new validity, False when
        no majority can hold it any more, None when too few nodes answered to tell.
        ``each``: a node's op (a list of one answer per hold); default: its renewal."""
        started = time.monotonic()

        def decided(replies: Replies) -> bool:
            unknown = sum(1 for r in replies if not answered(r))
            for i in range(len(renewals)):
                votes = sum(1 for r in replies if isinstance(r, list) and r[i])
                if self.quorum > votes >= self.quorum - unknown:
                    return False
            return True

        node_op = each or (lambda n: n.op_renew(renewals))
        replies = yield self._each(node_op, decided, True)
        elapsed_ms = (time.monotonic() - started) * 1000
        unknown = len(self.nodes) - self._answered(replies)
        results: list[bool | None] = []
        for i, renewal in enumerate(renewals):
            votes = sum(1 for r in replies if isinstance(r, list) and r[i])
            valid = renewal.ttl_ms - elapsed_ms - self.drift_ms(renewal.ttl_ms) > 0
            if votes >= self.quorum and valid:
                results.append(True)
            elif votes + unknown < self.quorum:
                results.append(False)
            else:  # a majority may still have it (or had it, too slowly to count on it)
                results.append(None)
        return results, replies

    def op_hold_count(self, name: str, token: str) -> Op[int]:
        def steps() -> Steps[int]:
            replies = yield self._each(
                lambda n: n.op_hold_count(name, token), self._deciding(_holding), True
            )
            return int(self._decide(name, replies, _holding(replies), "check", "had the hold"))

        return Op(name, _Quorum(steps()))

    def op_locked(self, name: str) -> Op[bool]:
        def steps() -> Steps[bool]:
            # Held when one token is on a majority (split votes hold nothing).
            replies = yield self._each(
                lambda n: Op(name, ("GET", n.key(name)), _token_of), self._deciding(_most), True
            )
            return self._decide(name, replies, _most(replies), "check", "had one holder")

        return Op(name, _Quorum(steps()))

    def op_pttl(self, name: str) -> Op[int | None]:
        return Op(name, _Quorum(self._validity(name)))

    def _validity(self, name: str) -> Steps[int | None]:
        """What is left of the majority's hold: among the nodes that hold one token (a
        majority: at most one token has one), the quorum-th longest PTTL, less the time since
        the requests were sent and drift, as the acquire's validity. None when no token has
        a majority (holds of different tokens make no hold)."""
        started = time.monotonic()  # each PTTL was read at its node after this
        replies = yield self._each(lambda n: n.op_inspect(name), self._deciding(_agreeing), True)
        if not self._decide(name, replies, _agreeing(replies), "check", "had one holder"):
            return None
        info = self._agreed(replies)[0]
        if info is None or info.ttl is None:  # (a hold without expiry: never written)
            return None
        left = info.ttl * 1000
        elapsed_ms = (time.monotonic() - started) * 1000
        return max(0, round(left - elapsed_ms - self.drift_ms(round(left))))

    def op_inspect(self, name: str) -> Op[LockInfo | None]:
        def steps() -> Steps[LockInfo | None]:
            started = time.monotonic()  # as _validity: the TTL shown is what is left now
            replies = yield self._each(lambda n: n.op_inspect(name), self._deciding(_agreeing))
            info = self._agreed(replies)[0]
            if info is None:
                self._nobody(name, replies, "inspect")
                return None
            if info.ttl is None:
                return info
            left = info.ttl * 1000
            elapsed_ms = (time.monotonic() - started) * 1000
            valid = max(0, round(left - elapsed_ms - self.drift_ms(round(left))))
            return dataclasses.replace(info, ttl=valid / 1000)

        return Op(name, _Quorum(steps()))

    def op_force_release(
        self, name: str, token: str | None = None, fence: int | None = None
    ) -> Op[Released]:
        def steps() -> Steps[Released]:
            expected = token
            if expected is None and fence is not None:
                # Find the majority's hold, check the fence names it, then release it by its
                # token (the same on every node).
                inspected = yield self._each(lambda n: n.op_inspect(name), complete=True)
                if self._answered(inspected) < self.quorum:
                    raise self._unreachable(name, inspected, "inspect")
                info, holders = self._agreed(inspected)
                if info is None:
                    self._nobody(name, inspected, "inspect")
                    return Released.NOT_HELD
                # Each node's copy carries the fence it granted or was lifted to: the holder's
                # on a majority, less where the lift did not reach. The fence shown names the
                # hold when an answering copy carries it; not when it is above them all with a
                # node silent: a grant that came too late to count (unlifted, from a counter or
                # clock ahead) may show above a later hold's fences, which would then go.
                fences = {inspected[i].fence for i in holders}
                if info.token is None or fence not in fences:
                    return Released.CHANGED
                expected = info.token
            # Owed to a node skipped as down, as a release is (the same compare-and-delete by
            # token): left there, the released hold would refuse the free lock for its TTL.
            # Not without a token: sent later, it would delete whatever holds the node then.
            owed = "release" if expected is not None else ""
            replies = yield self._each(
                lambda n: n.op_force_release(name, expected), None, True, owed=owed
            )
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
        prepare_each(self.nodes)
        if self.restart_guard:
            self.mark_nodes()

    def unanswered_at_startup(self) -> LockError | None:
        silent = [e for e in (n.unanswered_at_startup() for n in self.nodes) if e is not None]
        if len(self.nodes) - len(silent) >= self.quorum:
            return None
        return BackendUnavailable(
            f"backend {self.alias!r} (Redlock): {len(silent)} of {len(self.nodes)} nodes did"
            f" not answer at startup (a quorum is {self.quorum}): {silent[0]}",
            timed_out=any(getattr(e, "timed_out", False) for e in silent),
        )

    def mark_nodes(self) -> None:
        """Set up the restart guard's markers (done when the app is ready).

        Every node answered and none is marked: a new deployment, so every node is marked
        trusted, with the node's clock as when its data began (the marker is also the fence
        floor of a name whose counter is gone: writing 0 there let fences go backwards).
        Some marked, or a node did not answer (or refused): the deployment is not known to be
        new (the silent node may be the only one that kept its marker, and its data), so
        nothing is marked; the unmarked nodes are distrusted from their first acquire for
        ``restart_guard`` seconds.
        """
        for node in self.nodes:
            try:
                mark = node.client.get(f"{node.key_prefix}node")
            except (*UNAVAILABLE, ResponseError):  # a refusal: told by the node's check
                return
            if mark is not None:
                return
        for node in self.nodes:
            try:  # trusted, but the marker's time stays the node's data start: a fence floor
                run(node.client, Call(_MARK_NODE, [f"{node.key_prefix}node"], []))
            except (*UNAVAILABLE, ResponseError):
                continue

    def unreached(self, timeout: float) -> list[str]:
        # A one-shot process (manage.py redlock release) exits right after the reply: what
        # it owes a silent node is paid by the collector or the probe meanwhile, or named.
        deadline = time.monotonic() + timeout
        while (unpaid := self.io.debts.unpaid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return [f"node {i}" for i in unpaid]  # i: the index in LOCATION

    def _owe(self, node: int, owed: Owed) -> None:
        """Leaves a closed node hub owes: to that node's next hub (as RedisBackend._owe)."""
        with self._owing:
            quorum = self._hub
            if quorum is None:
                self._owed.setdefault(node, {}).update(owed)
                return
        quorum.hubs[node].take_over(owed)

    def token_reusable(self, token: str) -> bool:
        """False once a release or undo of ``token`` was written to a node whose reply will
        never be read: it may still run there at any later time (redlock_io ``Debts.burn``)."""
        return self.io.debts.reusable(token)

    def close(self) -> None:
        quorum, self._hub = self._hub, None  # detached first: as RedisBackend.close
        if quorum is not None:
            for i, hub in enumerate(quorum.hubs):
                hub.close()
                hub.hand_over(functools.partial(self._owe, i))
        self.io.close()
        for node in self.nodes:
            node.close()
        super().close()

    # -- queue markers (the task dedupe's: see .markers) -------------------------------------

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
            replies = yield self._each(
                lambda n: n.op_mark_queued(name, task_id, ttl_ms), complete=True
            )
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
            replies = yield self._each(lambda n: n.op_clear_queued(name, task_id), complete=True)
            if self._answered(replies) < self.quorum:
                raise self._unreachable(name, replies, "clear a queued task's marker")
            return any(reply is True for reply in replies)

        return Op(name, _Quorum(steps()))

    def op_swap_queued(self, name: str, expected: str, value: str, ttl_ms: int) -> Op[bool]:
        """Replace ``expected`` by ``value`` on every node that holds it; True when a majority
        did. Else the nodes that did are put back (a minority holding ``value`` would leave no
        majority for either). Fewer than a quorum of answers: QuorumNotReached."""

        def steps() -> Steps[bool]:
            replies = yield self._each(
                lambda n: n.op_swap_queued(name, expected, value, ttl_ms), complete=True
            )
            swapped = [reply is True for reply in replies]
            if sum(swapped) >= self.quorum:
                return True
            yield [
                node.op_swap_queued(name, value, expected, ttl_ms) if mine else None
                for node, mine in zip(self.nodes, swapped, strict=True)
            ]
            if self._answered(replies) < self.quorum:
                raise self._unreachable(name, replies, "replace a marker")
            return False

        return Op(name, _Quorum(steps()))

    def op_read_queued(self, name: str) -> Op[tuple[str, int] | None]:
        """The task id a majority of nodes have noted, with the least time left among them;
        None without such a majority. Fewer than a quorum of answers: QuorumNotReached."""

        def steps() -> Steps[tuple[str, int] | None]:
            replies = yield self._each(lambda n: n.op_read_queued(name), complete=True)
            if self._answered(replies) < self.quorum:
                raise self._unreachable(name, replies, "read a queued task's marker")
            found = [r for r in replies if isinstance(r, tuple)]
            votes = Counter(task_id for task_id, _ in found)
            task_id, count = votes.most_common(1)[0] if votes else (None, 0)
            if task_id is None or count < self.quorum:
                return None
            return task_id, min(ms for noted, ms in found if noted == task_id)

        return Op(name, _Quorum(steps()))

    def queued_names(self, match: str = "*") -> list[str]:
        """Every name with a marker on any node that answers (a clean-up's list)."""
        names: set[str] = set()
        for node in self.nodes:
            with contextlib.suppress(LockError):
                names.update(node.queued_names(match))
        return sorted(names)

    # -- operators' views: pages of held locks, the majority's hold --------------------------

    def page(self, match: str, cursor: str | None, size: int) -> tuple[list[LockInfo], str | None]:
        """A page by ``SCAN``, node after node, like the single-node backends' (never a round
        trip per held lock). The cursor is ``node index:scan cursor:nodes scanned`` (the
        last a bitmask of the nodes scanned to the end).

        A majority hold is on a majority of nodes, so it is on one of any ``N - quorum + 1``
        nodes: scanning that many (skipping nodes that do not answer) finds every lock. The
        names found are inspected on every node in one fan-out (one pipelined request per
        node), and a lock is listed unless a node scanned before has it: once in all. A node
        that stops answering before its scan began is skipped; one that stops halfway fails
        the page (BackendUnavailable), whose cursor asks it again.
        """
        index, position, scanned = self._page_cursor(cursor)
        pattern = self.key_pattern(match)
        needed = len(self.nodes) - self.quorum + 1
        found: list[LockInfo] = []
        pending: list[tuple[int, str]] = []  # (node it was found on, name), to inspect
        seen: set[str] = set()
        count, scans = size, 0
        while index < len(self.nodes) and scanned.bit_count() < needed:
            node = self.nodes[index]
            scans += 1
            try:
                with node.round_trip(match):
                    position, keys = node.client.scan(position, match=pattern, count=count)
            except BackendUnavailable as exc:
                if position != 0:
                    # Partly listed: which of its locks the pages showed is unknown, so the
                    # next node cannot leave them out. This page fails; its cursor asks again.
                    raise BackendUnavailable(
                        f"node {node.alias!r} stopped answering in the middle of its listing"
                        f" (ask for this page again): {exc}",
                        exc.timed_out,
                    ) from exc
                index = index + 1  # not started: its majority holds are on the other nodes
            else:
                for key in keys:
                    name = self.matching_name(text(key), match)
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
            return (yield Fan([Op(match, r, list) for r in requests], complete=True))

        replies: Replies = self.execute(Op(match, _Quorum(steps())))
        if self._answered(replies) < self.quorum:
            raise self._unreachable(match, replies, "list the locks")
        listed = []
        for j, (at, name) in enumerate(pending):
            per_node: Replies = []
            for node, reply in zip(self.nodes, replies, strict=True):
                if isinstance(reply, list) and not isinstance(reply[j], BaseException):
                    per_node.append(node.parse_info(name, reply[j]))
                else:
                    per_node.append(reply if isinstance(reply, BaseException) else None)
            earlier = [i for i in range(at) if scanned & 1 << i]  # skipped nodes did not list
            if any(isinstance(per_node[i], LockInfo) for i in earlier):
                continue  # listed from that node's scan
            info = self._agreed(per_node)[0]
            if info is not None:
                listed.append(info)
            else:  # left out only when surely free; else the page is unknown (raises)
                self._nobody(name, per_node, "list the locks")
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
        info = dataclasses.replace(  # a copy: the replies keep each node's own fence
            infos[0],
            backend=self.alias,
            ttl=ttls[self.quorum - 1] if len(ttls) >= self.quorum else None,
            fence=max(fences) if fences else None,
        )
        return info, holders

    @classmethod
    def check_options(cls, alias: str, params: Mapping[str, Any]) -> None:
        # Every node gets every option: each must suit every node's URL scheme.
        schemes = {urlsplit(str(url)).scheme for url in params.get("LOCATION") or []}
        allowed = set.intersection(*(set(pool_options(scheme)) for scheme in schemes))
        where = "the Redlock backend (restart_guard) or redis-py's pool and connection"
        check_options(alias, params.get("OPTIONS") or {}, allowed | {"restart_guard"}, where)


def _attempt(reply: Any) -> Attempt:
    """redlock_acquire.lua's reply. Refused: ``prior`` carries the digest of the holder's
    token (None: unknown), to count the nodes one holder has."""
    if int(reply[0]):
        return Attempt(True, int(reply[1]), int(reply[2]), prior_of(reply[3:4]))
    return Attempt(False, None, int(reply[1]), prior_of(reply[2:3]))


def _token_of(value: Any) -> str | None:
    """The token of a plain hold's value ('token|fence|...'), None when the key is gone."""
    if value is None:
        return None
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return text.split("|", 1)[0]


# The votes of each check, counted from the replies so far.


def _at_once(replies: Replies) -> bool:
    """Decided before any reply: the requests go out (or are owed), none is waited for."""
    return True


def _refused(reply: Any) -> bool:
    """A node's acquire that ran and refused: it holds nothing of the token, no undo."""
    return isinstance(reply, Attempt) and not reply.acquired


def _granted(replies: Replies) -> int:
    """Nodes that granted the hold."""
    return sum(1 for r in replies if isinstance(r, Attempt) and r.acquired)


def _released(replies: Replies) -> int:
    """Nodes where our token still was (the release deleted it)."""
    return sum(1 for r in replies if isinstance(r, int) and r >= 0)


def _refenced(replies: Replies) -> int:
    """Nodes where the token still was (their hold re-fenced)."""
    return sum(1 for r in replies if isinstance(r, int) and r > 0)


def _holding(replies: Replies) -> int:
    return sum(1 for r in replies if r == 1)


def _most(replies: Replies) -> int:
    """The most nodes that agree on one token (split votes hold nothing)."""
    tokens = [r for r in replies if isinstance(r, str)]
    return max((tokens.count(t) for t in set(tokens)), default=0)


def _agreeing(replies: Replies) -> int:
    tokens = [r.token for r in replies if isinstance(r, LockInfo)]
    return max((tokens.count(t) for t in set(tokens)), default=0)
