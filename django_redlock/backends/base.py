"""What every lock backend shares: settings, key layout, and the operations a Lock runs.

An operation is an :class:`Op`: what to send for one round trip and how to read the reply.
Backends build ops (``op_*``) and execute them, synchronously (:meth:`execute`) or on the
running event loop (:meth:`aexecute`), so the sync and asyncio APIs share every operation.

Not here: the queue markers of the task dedupe (:mod:`.markers`, which backends implement
beside this contract) and page cursors (:mod:`.cursors`).
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import re
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from django.core.exceptions import ImproperlyConfigured

from .. import identity
from ..acl import mask
from ..exceptions import BackendUnavailable, LockError, LockLost
from ..validation import MAX_TTL, check_glob
from ..waiters import ReleaseHub
from .cursors import BadCursor as BadCursor  # (it lived here: still importable from here)
from .cursors import parse_cursor

DEFAULT_TTL = 30.0
#: How far above the client's wall clock a re-fence puts a hold's fence (us): the fences a
#: lost counter handed out came from a server clock at most real time then (see
#: :func:`refence_least`); the margin covers a client clock a little behind the server's.
REFENCE_MARGIN_US = 1_000_000
_close_hooks: list[Callable[[BaseLockBackend], None]] = []


def on_close(hook: Callable[[BaseLockBackend], None]) -> None:
    """Run ``hook(backend)`` at the end of every backend's ``close()``. For what above this
    layer keeps per backend (the renewer registers its ``retire``): this module imports none
    of it. Hooks run in the order registered; a hook's exception propagates from close()."""
    if hook not in _close_hooks:
        _close_hooks.append(hook)


_moved_hooks: list[Callable[[BaseLockBackend], None]] = []


def on_moved(hook: Callable[[BaseLockBackend], None]) -> None:
    """Run ``hook(backend)`` when a backend's server moved under its open connections (a
    Sentinel failover, see :func:`moved`): the renewer registers its ``renew_now``."""
    if hook not in _moved_hooks:
        _moved_hooks.append(hook)


def moved(backend: BaseLockBackend) -> None:
    """``backend``'s connections now go to another server (a Sentinel's new master): its
    holds are renewed there at once (what a renewal sent before may have reached the old
    one only)."""
    for hook in _moved_hooks:
        hook(backend)


#: Redis's Lua numbers are exact below 2**53 (fence_table.FENCE_LIMIT).
LUA_EXACT = 2**53
DEFAULT_KEY_PREFIX = "redlock"
# Glob characters (keys are found by SCAN MATCH) and braces (a key's hash tag is the first
# {...}: a prefix 'a:{b' would put alias a:{b's lock 'x' at the key of another alias's lock
# 'b:{x', listed and purged through it).
PREFIX_FORBIDDEN = "*?[]\\{}"
GLOB_SPECIAL = "*?[]\\"
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


def _same(reply: Any) -> Any:
    return reply


@dataclass(eq=False, slots=True)  # not frozen: every lock operation makes two or more
class Op(Generic[T_co]):
    """One round trip: ``request`` is backend-specific, ``parse`` turns the reply into T.
    Never changed once made (not frozen only because that costs every operation)."""

    name: str  # the lock concerned, for error messages
    request: Any
    parse: Callable[[Any], T_co] = _same
    # When the caller gives up (monotonic), if it has a timeout: a backend that tries again
    # on its own (a Cluster's slot being migrated) stops by then. The first try is always made.
    deadline: float | None = None
    # A bounded try given up on (``aexecute_by``'s deadline) while its command may still be
    # answered: given the command's future, which then runs on to its own socket timeout,
    # instead of being cut (see BaseLock._late_take). None: cut.
    late: Callable[[Any], None] | None = None


def by_deadline(deadline: float | None, op: Op[T]) -> Op[T]:
    """``op``, given up by ``deadline`` (see :attr:`Op.deadline`; None: as it is)."""
    return op if deadline is None else replace(op, deadline=deadline)


class Kind(NamedTuple):
    reentrant: bool = False
    fair: bool = False

    @property
    def label(self) -> str:
        words = [w for w, on in (("fair", self.fair), ("reentrant", self.reentrant)) if on]
        return " ".join(words) or "plain"


#: A reentrant owner's ordered write: its number (``identity.write_seq``) and the levels the
#: owner holds before it (an acquire) or once it is done (a release), which the server sets its
#: count to. The server refuses a write older than one it applied (lua/_hold.lua's
#: ``order_stale``): a request that ran late, after the owner's next, changes nothing. A
#: release may add the fence of the hold its levels are in: a hold of the owner's under another
#: fence is one a late write made after that hold was lost (release.lua).
Order = tuple[int, int] | tuple[int, int, int]


def stale_write(name: str, alias: str) -> BackendUnavailable:
    """A reentrant owner's write that the server refused as older than one it applied (read
    only when two of the owner's writes were in flight at once): its outcome is the later
    write's, unknown here, so the owner's next operation settles its count."""
    return BackendUnavailable(
        f"lock {name!r} on backend {alias!r}: this request ran after a later one of its owner"
        " and did nothing; the owner's count is settled at its next operation"
    )


def nest_gone(name: str, alias: str) -> LockLost:
    """A reentrant owner's re-entry that found no hold of the owner's (acquire.lua's -4): the
    hold it was to nest in is gone, and nothing was taken."""
    return LockLost(
        f"lock {name!r} on backend {alias!r} was lost before this re-entry: it expired or was"
        " released by someone else"
    )


class Attempt(NamedTuple):
    """The outcome of one try to acquire."""

    acquired: bool
    fence: int | None = None
    # Held: the hold count. Not held: ms until something may change (-1: wait for a message).
    count_or_wait: int = -1
    #: Held: the token of the exclusive hold given a fence just before this one (None: not
    #: known), which a fenced block compares with the token recorded in its lock's row.
    prior: str | None = None


class Renewal(NamedTuple):
    name: str
    token: str
    ttl_ms: int


class LeaseRenewal(Renewal):
    """A lease's renewal (a permit, a read, the write): its details hash lives by it too, and a
    backend that routes by key (Cluster) declares that hash in the renewal's script."""

    __slots__ = ()


@dataclass
class LockInfo:
    """A held lock as operators see it."""

    name: str
    backend: str
    kind: str
    fence: int | None
    ttl: float | None
    acquired_at: datetime | None = None
    holder: dict[str, Any] = field(default_factory=dict)
    hold_count: int = 1
    waiters: int = 0
    token: str | None = None  # a plain hold's token: what an operator's release compares
    limit: int | None = None  # a semaphore's limit (at its last grant)
    # A semaphore's or read-write lock's holds, one per lease (kind "permit", "read" or
    # "write"), each with its own token, fence and TTL.
    holders: list[LockInfo] = field(default_factory=list)
    #: Seconds the longest-waiting registered plain waiter has waited (None: no such waiter,
    #: or the backend cannot tell: fair queues keep no arrival times, LocMem no plain waiters)
    longest_wait: float | None = None

    def rows(self) -> list[LockInfo]:
        """What operators list, one row per hold: a lock's own, or each lease of a semaphore
        ("semaphore permit 2/3": permits used/limit) or read-write lock ("read-write read")."""
        if not self.holders:
            return [self]
        used = f" {len(self.holders)}/{self.limit}" if self.limit else ""
        return [
            replace(
                lease,
                kind=f"{self.kind} {lease.kind}{used}",
                waiters=self.waiters,
                limit=self.limit,
            )
            for lease in self.holders
        ]


def refence_least(client_us: int | None = None) -> int:
    """The least fence a re-fence gives: this client's wall clock in us (``client_us``, or
    read now) plus :data:`REFENCE_MARGIN_US`, below Lua's exact range.

    The recorded fence says nothing of fences handed out but never recorded (a holder whose
    key expired while it paused; one counted up from the recorded fence), and the counter
    that knew them is gone. Such a fence came from a server's clock that was at most real
    time then, or from a recorded fence plus a few: real time now plus the margin is above
    it. Not above one handed out while a server's clock ran ahead of real time (or while the
    client's clock is behind by more than the margin)."""
    now = time.time_ns() // 1000 if client_us is None else client_us
    return min(now + REFENCE_MARGIN_US, LUA_EXACT - 1)


# -- name globs ------------------------------------------------------------------------------
# `redlock list/purge/top --match`, the admin's search and the compat shims' prefixes select
# names by a glob: Redis's glob syntax (`*`, `?`, `[abc]`, `[a-z]`, `[^abc]`, `\` quotes the
# next character), read over the name's characters. The one rule turning it into keys:
# `key_pattern` gives SCAN MATCH a pattern that every matching name's key matches (a
# superset: `?` and a class become `*`, since Redis matches bytes and a character may be
# several; a leading literal `}` or `~` gets key()'s `~`), then `glob_match` keeps exactly
# the names that match. LocMem uses `glob_match` alone.


def glob_escape(text: str) -> str:
    """A glob matching exactly ``text``."""
    return "".join(f"\\{c}" if c in GLOB_SPECIAL else c for c in text)


def _glob_class(glob: str, i: int) -> tuple[str, int]:
    """The class whose '[' is at ``glob[i]``: its regex, and the index of its ']' (the
    glob's length if unclosed: it runs to the end). As Redis's stringmatchlen() reads it:
    '^' first negates, '\\' quotes, 'a-z' is a range (ends in either order), '[]' matches
    nothing."""
    i += 1
    negate = glob[i : i + 1] == "^"
    i += negate
    items: list[str] = []
    while i < len(glob) and glob[i] != "]":
        if glob[i] == "\\" and i + 1 < len(glob):
            items.append(re.escape(glob[i + 1]))
            i += 2
        elif i + 2 < len(glob) and glob[i + 1] == "-":
            low, high = sorted((glob[i], glob[i + 2]))
            items.append(f"{re.escape(low)}-{re.escape(high)}")
            i += 3
        else:
            items.append(re.escape(glob[i]))
            i += 1
    body = "".join(items)
    if negate:
        return (f"[^{body}]" if body else "(?s:.)"), i
    return (f"[{body}]" if body else "(?!)"), i


def _glob_parts(glob: str) -> list[str | None]:
    """The glob as regex pieces, one per element (None for a `*`)."""
    parts: list[str | None] = []
    i = 0
    while i < len(glob):
        c = glob[i]
        if c == "*":
            parts.append(None)
        elif c == "?":
            parts.append(".")
        elif c == "[":
            part, i = _glob_class(glob, i)
            parts.append(part)
        else:
            i += c == "\\" and i + 1 < len(glob)  # a quoted character
            parts.append(re.escape(glob[i]))
        i += 1
    return parts


def _glob_regex(glob: str) -> re.Pattern[str]:
    check_glob(glob)  # TypeError/ValueError before any Redis call (key_pattern compiles it)
    return _compiled(glob)


@functools.lru_cache(maxsize=256)
def _compiled(glob: str) -> re.Pattern[str]:
    return re.compile("".join(".*" if p is None else p for p in _glob_parts(glob)), re.DOTALL)


def glob_match(glob: str, name: str) -> bool:
    """Whether lock ``name`` matches the name glob ``glob`` (the rule above)."""
    return _glob_regex(glob).fullmatch(name) is not None


def _tag_pattern(glob: str) -> str:
    """A SCAN MATCH pattern over a key's hash tag that the tag of every name matching
    ``glob`` matches (see key(): names starting with '}' or '~' have a '~' in front)."""
    pieces: list[str] = []
    i = 0
    while i < len(glob):
        c = glob[i]
        if c in "*?[":
            if c == "[":
                i = _glob_class(glob, i)[1]
            if not pieces or pieces[-1] != "*":
                pieces.append("*")  # a character, or any run of them: one '*' covers both
        else:
            first = i == 0
            i += c == "\\" and i + 1 < len(glob)  # a quoted character
            if first and glob[i] in "}~":
                pieces.append("~")
            pieces.append(glob_escape(glob[i]))
        i += 1
    return "".join(pieces)


class BaseLockBackend:
    """A small base, like Django's ``BaseCache``: settings and key layout here, I/O below."""

    #: Whether LOCATION is a list of URLs (Redlock, Sentinel) instead of one URL.
    location_is_list: ClassVar[bool] = False
    #: Whether the backend needs a LOCATION at all.
    needs_location: ClassVar[bool] = True
    #: Whether a release wakes only the earliest registered waiter of a plain lock (through
    #: the waiter's process inbox), instead of every waiter on the lock's release channel.
    #: It needs PUBLISH to count the receivers (to skip dead processes): not on a Cluster,
    #: where the count covers one node, and not across Redlock's independent nodes.
    wakes_one: ClassVar[bool] = False

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        self.alias = alias
        self.params = dict(params)
        self.location = params.get("LOCATION")
        self.options: dict[str, Any] = dict(params.get("OPTIONS") or {})
        prefix = params.get("KEY_PREFIX", DEFAULT_KEY_PREFIX)
        self.key_prefix = f"{prefix}:" if prefix else ""
        self.default_ttl = float(params.get("TTL", DEFAULT_TTL))
        self.round_trips = 0  # network round trips made, for tests and benchmarks

    # -- settings ----------------------------------------------------------------------------

    @classmethod
    def check_params(cls, alias: str, params: Mapping[str, Any]) -> None:
        """Raise ImproperlyConfigured naming the alias and key of the first bad setting."""

        def bad(key: str, why: str) -> ImproperlyConfigured:
            # A URL's password never shows (ImproperlyConfigured lands in logs and pages).
            return ImproperlyConfigured(f"DJANGO_REDLOCK[{alias!r}][{key!r}] {mask(why)}")

        ttl = params.get("TTL", DEFAULT_TTL)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
            raise bad("TTL", f"must be a number of seconds, not {ttl!r}")
        if not math.isfinite(ttl) or not 0 < ttl <= MAX_TTL:
            raise bad("TTL", f"must be a finite number of seconds > 0 and <= {MAX_TTL:.0f},"
                             f" not {ttl!r}")  # fmt: skip
        prefix = params.get("KEY_PREFIX", DEFAULT_KEY_PREFIX)
        if not isinstance(prefix, str):
            raise bad("KEY_PREFIX", f"must be a str, not {prefix!r}")
        if not prefix.strip():
            # The prefix is what makes a key provably ours: without one, the admin, `redlock
            # list` and `redlock purge` would take any key shaped like '{...}' for a lock.
            raise bad(
                "KEY_PREFIX",
                "must not be empty: the prefix is what makes a key provably this app's (the"
                " admin and `redlock purge` act only on keys under it); without one, other"
                " applications' keys shaped like '{...}' would be listed and deleted as locks",
            )
        if any(c in prefix for c in PREFIX_FORBIDDEN):
            # Keys are found by SCAN MATCH 'prefix{...}': a glob character in the prefix would
            # match other applications' keys too.
            raise bad("KEY_PREFIX", f"{prefix!r} must not contain any of"
                                    f" {' '.join(PREFIX_FORBIDDEN)}")  # fmt: skip
        options = params.get("OPTIONS", {})
        if not isinstance(options, Mapping):
            raise bad("OPTIONS", f"must be a dict, not {type(options).__name__}")
        if cls.needs_location:
            cls._check_location(params.get("LOCATION"), bad)
        cls.check_options(alias, params)

    @classmethod
    def _check_location(cls, location: Any, bad: Any) -> None:
        from urllib.parse import parse_qs, unquote, urlsplit

        urls = location if cls.location_is_list else [location]
        if cls.location_is_list and (not isinstance(location, (list, tuple)) or not location):
            raise bad("LOCATION", f"must be a non-empty list of Redis URLs, not {location!r}")
        for url in urls:
            if not isinstance(url, str) or not url:
                raise bad("LOCATION", f"must be a Redis URL string, not {url!r}")
            parts = urlsplit(url)
            if parts.scheme not in ("redis", "rediss", "unix"):
                raise bad(
                    "LOCATION", f"has {url!r}: the scheme must be redis://, rediss:// or unix://"
                )
            if parts.scheme != "unix" and not parts.hostname:
                raise bad("LOCATION", f"has {url!r}: it names no host")
            try:
                parts.port  # noqa: B018 - raises ValueError for a bad port
            except ValueError:
                raise bad("LOCATION", f"has {url!r}: the port is not a number 0-65535") from None
            # redis-py reads '/3x' or '/abc' as database 0 without a word, and '?db=abc' fails
            # inside it: the database part is a number or absent.
            path = "" if parts.scheme == "unix" else unquote(parts.path).strip("/")
            dbs = [path] if path else []
            dbs += parse_qs(parts.query).get("db", [])
            if not all(db.isascii() and db.isdigit() for db in dbs):
                raise bad(
                    "LOCATION",
                    f"has {url!r}: the database (the path, or ?db=) must be a number such as /0",
                )

    # -- key layout --------------------------------------------------------------------------
    # Every key of one lock shares the hash tag {name}, so a cluster keeps them in one slot.

    def key(self, name: str) -> str:
        # A name starting with "}" would make the tag empty (keys in different slots), so
        # such names, and names starting with "~", get a "~" in front: one-to-one.
        tag = f"~{name}" if name[:1] in ("}", "~") else name
        return f"{self.key_prefix}{{{tag}}}"

    def fence_key(self, name: str) -> str:
        return f"{self.key(name)}:f"  # short: one per name ever locked, and it never expires

    def queue_key(self, name: str) -> str:
        return f"{self.key(name)}:queue"

    def deadlines_key(self, name: str) -> str:
        return f"{self.key(name)}:deadlines"

    def waiting_key(self, name: str) -> str:
        """The plain lock's registered waiters (backends that :attr:`wakes_one`)."""
        return f"{self.key(name)}:waiting"

    def handed_back_key(self, name: str, token: str) -> str:
        """The marker a hand-back leaves for a ``token`` that holds nothing yet (a plain or
        fair one's: lua/release.lua; a reentrant owner's: its settle, lua/settle.lua): its
        try, if still on the wire, is then refused (lua/acquire.lua)."""
        return f"{self.key(name)}:b:{token}"

    def channel(self, name: str) -> str:
        """Where a release is announced to every waiter of a lock (backends that do not
        :attr:`wakes_one`)."""
        return f"{self.key(name)}:released"

    @property
    def inbox_prefix(self) -> str:
        """A process's inbox channel is this plus its process id: one channel per process
        carries the wake-ups of all its waiters, addressed by waiter id."""
        return f"{self.key_prefix}inbox:"

    def inbox_for(self, name: str) -> str:
        """The inbox prefix the scripts get for lock ``name``: :attr:`inbox_prefix`, except
        where inboxes are per lock (sharded pub/sub, see the Redis Cluster backend)."""
        return self.inbox_prefix

    def new_waiter_id(self) -> str:
        """A new waiter's id (see :func:`~django_redlock.identity.new_waiter_id`): the
        scripts wake it by its id; a backend may mark in it how the waiter listens."""
        return identity.new_waiter_id()

    def key_pattern(self, glob: str) -> str:
        """The SCAN MATCH pattern for the names matching ``glob``: every such name's key
        matches it, and some other names' may (keep the names :func:`glob_match` keeps)."""
        _glob_regex(glob)
        return f"{glob_escape(self.key_prefix)}{{{_tag_pattern(glob)}}}"

    def name_from_key(self, key: str) -> str | None:
        head = f"{self.key_prefix}{{"
        if key.startswith(head) and key.endswith("}"):
            tag = key[len(head) : -1]
            return tag[1:] if tag.startswith("~") else tag
        return None

    def matching_name(self, key: str, glob: str) -> str | None:
        """The lock name of a key SCAN found by :meth:`key_pattern`, if it matches ``glob``."""
        name = self.name_from_key(key)
        return name if name is not None and glob_match(glob, name) else None

    def check_kind(self, kind: Kind) -> None:
        """Raise NotImplementedError (before any I/O) for a lock kind this backend lacks."""

    # -- operations: each op is one round trip -----------------------------------------------

    def op_acquire(
        self,
        name: str,
        token: str,
        ttl_ms: int,
        meta: str,
        kind: Kind,
        waiter: str | None = None,
        wait_ms: int = -1,
        order: Order | None = None,
    ) -> Op[Attempt]:
        """Take the lock. With ``wait_ms >= 0`` the caller is a waiter (``waiter`` is its id):
        a fair lock queues it until ``wait_ms``; a plain lock on a backend that
        :attr:`wakes_one` registers it to be woken by the next release. ``order``: a
        reentrant owner's re-entry sets its count to the levels it holds + 1 (:data:`Order`)."""
        raise NotImplementedError

    def op_release(self, name: str, token: str, kind: Kind, order: Order | None = None) -> Op[int]:
        """Holds left after releasing one (0: freed); -1 when the token holds none.
        ``order``: a reentrant owner's release sets its count to the levels it holds once
        released (:data:`Order`), settling a count left unsure in the same round trip."""
        raise NotImplementedError

    def op_hand_back(self, name: str, token: str, kind: Kind, kept: bool = False) -> Op[int]:
        """:meth:`op_release` of a grant an interrupted try may have had (a plain or fair
        hold's). A hand-back may reach the server before the try it hands back (that try was
        delayed on the wire; the hand-back went on another connection): where that can be,
        finding nothing to release it also refuses the token's later tries. ``kept``: the
        token was kept from an unanswered try, whose request may land after any release of
        it: refused then even when this frees the hold (the release of such a hold too).
        Here: a release."""
        return self.op_release(name, token, kind)

    def op_extend(self, name: str, token: str, ttl_ms: int) -> Op[bool]:
        raise NotImplementedError

    def op_lease_extend(self, name: str, token: str, ttl_ms: int) -> Op[bool]:
        """:meth:`op_extend` of a lease (its details hash too: Cluster declares it)."""
        return self.op_extend(name, token, ttl_ms)

    def op_refence(
        self, name: str, token: str, recorded: int, client_us: int | None = None
    ) -> Op[int]:
        """Give ``token``'s hold of ``name`` a fence above ``recorded`` (a fence the database
        recorded) and raise the name's counter to it, only while the token still holds the
        lock (on a majority, for Redlock). The new fence; else -1 when another hold has the
        lock now, 0 when nobody does. Unknown (too few answers) raises, as every op does.

        The new fence is also at least :func:`refence_least` of ``client_us`` (this client's
        wall clock in us; None: read now): above every fence handed out but never recorded
        before the counter was lost, as long as the server's clock was then at most real time.

        Why it is safe: a hold still current has held the key since it was taken, so every
        hold that recorded a fence was taken before it (or while Redis lost it: the same as
        any lost hold), and the counter it raises makes every later hold's fence larger."""
        raise NotImplementedError

    def op_renew(self, renewals: Sequence[Renewal]) -> Op[list[bool | None]]:
        """Extend many holds in one round trip (the watchdog's batch): True extended, False
        not held any more, None unknown (too few Redlock nodes answered about it)."""
        raise NotImplementedError

    def op_leave(self, name: str, waiter: str) -> Op[None]:
        """Leave a fair lock's queue (gave up, cancelled)."""
        raise NotImplementedError

    def op_settle(
        self, name: str, owner: str, count: int, seq: int = 0, mark: bool = True
    ) -> Op[int]:
        """Set a reentrant owner's hold count (0: release all its holds), if it holds any.
        ``seq``: the write's number (:data:`Order`; 0: unordered). ``mark``: finding nothing
        held, refuse the owner's older writes still on the wire (see :meth:`op_hand_back`)."""
        raise NotImplementedError

    def op_hold_count(self, name: str, token: str) -> Op[int]:
        raise NotImplementedError

    def op_locked(self, name: str) -> Op[bool]:
        raise NotImplementedError

    def op_pttl(self, name: str) -> Op[int | None]:
        raise NotImplementedError

    def op_inspect(self, name: str) -> Op[LockInfo | None]:
        raise NotImplementedError

    def op_force_release(
        self, name: str, token: str | None = None, fence: int | None = None
    ) -> Op[Released]:
        """Delete the lock whoever holds it; with ``token`` (a plain hold's) or ``fence`` (a
        reentrant hold's), only if it is still that hold: what an operator was shown."""
        raise NotImplementedError

    def drift_ms(self, ttl_ms: int) -> float:
        """How much sooner than ``ttl_ms`` after its try was sent a hold may run out, by this
        process's clock: 0 on one server (it counts the TTL from the take, which is later);
        Redlock's allowance for its nodes' clocks."""
        return 0.0

    def token_reusable(self, token: str) -> bool:
        """Whether a plain hold's next try may use ``token`` again (the token of a try or a
        hand-back that got no answer, see ``Lock._next_token``): False once a write of it
        may still land late (RedlockBackend), when a retry granted it would be deleted."""
        return True

    def execute(self, op: Op[T]) -> T:
        raise NotImplementedError

    async def aexecute(self, op: Op[T]) -> T:
        raise NotImplementedError

    def execute_by(self, op: Op[T], deadline: float | None) -> T:
        """:meth:`execute`, answered by ``deadline`` (monotonic) at the latest where the
        backend can bound it (else as :meth:`execute`): a waiter's try, by its hub's PING
        verdict (``ReleaseHub.heard_until``)."""
        return self.execute(op)

    async def aexecute_by(self, op: Op[T], deadline: float | None) -> T:
        """:meth:`aexecute`, as :meth:`execute_by`."""
        return await self.aexecute(op)

    @property
    def hub(self) -> ReleaseHub:
        """Where waiters of this backend in this process are woken."""
        raise NotImplementedError

    # -- conveniences for operators and tests ------------------------------------------------

    def inspect(self, name: str) -> LockInfo | None:
        return self.execute(self.op_inspect(name))

    def force_release(
        self, name: str, token: str | None = None, fence: int | None = None
    ) -> Released:
        """Truthy only when the lock was released (see :class:`Released`)."""
        return self.execute(self.op_force_release(name, token, fence))

    def is_locked(self, name: str) -> bool:
        return self.execute(self.op_locked(name))

    def renew_many(self, renewals: Sequence[Renewal], shard: Hashable = None) -> list[bool | None]:
        """Renew each hold: True or False as answered, None where no answer came. ``shard``
        (a :meth:`renewal_shard` answer): send only to that part; a hold no longer there gets
        None, and :attr:`renewal_epoch` changes so that the watchdog moves it."""
        return self.execute(self.op_renew(renewals))

    #: Changes whenever :meth:`renewal_shard` may answer differently for a held lock (a
    #: Cluster's slot moved, a master failed over): the watchdog then asks again for each
    #: hold of a batch, and moves those whose part changed to that part's batches.
    renewal_epoch = 0

    def renewal_shard(self, name: str) -> Hashable:
        """The part of the backend that lock ``name``'s keys are on, as far as known
        without a round trip (None: the backend is one part). The watchdog renews each
        part's holds in batches of their own, on a worker of their own (renewer.py's "a
        shard is a backend"); a hold whose keys move later is moved to its new part's
        batches (see :attr:`renewal_epoch`)."""
        return None

    def iter_locks(self, match: str = "*") -> Iterator[LockInfo]:
        raise NotImplementedError

    def page(self, match: str, cursor: str | None, size: int) -> tuple[list[LockInfo], str | None]:
        """About ``size`` held locks whose names match the glob, from ``cursor`` on; and the
        cursor of the next page (None at the end). This default walks ``iter_locks``."""
        start = parse_cursor(cursor)  # BadCursor for a crafted one
        found = list(itertools.islice(self.iter_locks(match), start, start + size + 1))
        more = len(found) > size
        return found[:size], (str(start + size) if more else None)

    # -- lifecycle ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """Called when the app is ready: warm up what can be warmed (never required)."""

    def unanswered_at_startup(self) -> LockError | None:
        """What :meth:`prepare` got when the backend did not answer it, less than a socket
        timeout ago: ``redlock exec`` then exits at once, since a take would wait as long
        again. None when it answered (or long ago, or was never asked)."""
        return None

    def unreached(self, timeout: float) -> list[str]:
        """Waits up to ``timeout`` s for writes this process still owes to parts of the
        backend that did not answer (a Redlock node skipped as down): lost when the process
        exits. Returns those still owed then (none: every write was made)."""
        return []

    def close(self) -> None:
        """Release connections and threads (a subclass's close() ends with this one's):
        then every :func:`on_close` hook runs (the renewer's watchdog worker for this backend
        ends once it renews nothing here)."""
        for hook in tuple(_close_hooks):
            hook(self)

    def describe(self) -> str:
        return f"{self.alias!r} ({type(self).__name__})"

    @classmethod
    def check_options(cls, alias: str, params: Mapping[str, Any]) -> None:
        """Refuse OPTIONS the backend cannot use (after LOCATION was checked). This base
        takes any: LocMem ignores them, so settings swapped to it for tests still start."""

    # -- leases: semaphores and read-write locks ---------------------------------------------
    # Their own ops (lua/_permits.lua and permit_*.lua), beside the lock's: extend and the
    # watchdog's renew serve both. Backends without them say so in check_leases.

    def details_key(self, name: str) -> str:
        """Each lease's details, beside the leases (the name's own key, a sorted set)."""
        return f"{self.key(name)}:h"

    def writers_key(self, name: str) -> str:
        """A read-write lock's waiting writers, each with a lease on its place."""
        return f"{self.key(name)}:writers"

    def check_leases(self, what: str) -> None:
        """Raise NotImplementedError (before any I/O) if this backend has no ``what``
        (semaphores, read-write locks)."""

    def op_lease_acquire(
        self,
        name: str,
        token: str,
        ttl_ms: int,
        meta: str,
        mode: str,
        limit: int = 0,
        fair: bool = False,
        waiter: str | None = None,
        wait_ms: int = -1,
        reader: str = "",
    ) -> Op[Attempt]:
        """Take a lease: a permit (``mode`` "s", at most ``limit``), a read ("r") or the
        write ("w"; refused with a LockError if ``reader`` holds a read of it)."""
        raise NotImplementedError

    def op_lease_release(self, name: str, token: str, mode: str = "") -> Op[int]:
        """Holds left after releasing one (0: freed); -1 when the token holds none. ``mode``:
        the mode the token's lease was taken in, if the caller knows it ("" if not)."""
        raise NotImplementedError

    def op_lease_hand_back(self, name: str, token: str, mode: str, kept: bool = False) -> Op[int]:
        """:meth:`op_hand_back` for a lease (a permit's or a write's; a read's token is its
        owner's, taken again: released only). Here: a release."""
        return self.op_lease_release(name, token, mode)

    def op_mark_reads(self, name: str, owner: str) -> Op[int]:
        """A reader's settle: ``owner``'s live read count of read-write lock ``name`` (0:
        none), its reads sent before this refused from then on. A read's token is its owner's,
        taken again: where a try can land late (delayed on the wire, after the settle sent on
        another connection), only the owner's older reads are refused, so the count is final
        (lua/permit_mark.lua). Here: the count (nothing lands late)."""
        op = self.op_leases(name)

        def count(reply: Any) -> int:
            info = op.parse(reply)
            leases = [] if info is None else info.holders
            return next((lease.hold_count for lease in leases if lease.token == owner), 0)

        return Op(op.name, op.request, count)

    def op_lease_leave(self, name: str, waiter: str) -> Op[None]:
        raise NotImplementedError

    def op_leases(self, name: str) -> Op[LockInfo | None]:
        """The live leases (``holders``) of a semaphore or read-write lock."""
        raise NotImplementedError


class Released(enum.Enum):
    """What a force-release did. Truthy only when it released the lock, so ``if
    backend.force_release(name):`` reads as before."""

    RELEASED = 1
    NOT_HELD = 0
    CHANGED = -1  # held, but by another hold than the one expected: left alone

    def __bool__(self) -> bool:
        return self is Released.RELEASED

    @classmethod
    def of(cls, reply: Any) -> Released:
        """force_release.lua's reply: 1, 0 or -1."""
        return cls(int(reply))


def prepare_each(backends: Sequence[BaseLockBackend]) -> None:
    """:meth:`~BaseLockBackend.prepare` each, all at once (a thread each): a startup whose
    servers do not answer waits one socket timeout, not one per backend. The first error
    (in their order) is raised once all have ended."""
    if len(backends) < 2:
        for backend in backends:
            backend.prepare()
        return
    errors: list[BaseException | None] = [None] * len(backends)

    def prepare(i: int) -> None:
        try:
            backends[i].prepare()
        except BaseException as exc:  # raised in the caller's thread, below
            errors[i] = exc

    threads = [
        threading.Thread(target=prepare, args=(i,), name=f"redlock-prepare {b.alias}", daemon=True)
        for i, b in enumerate(backends)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
