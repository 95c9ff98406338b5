"""Redis Sentinel: the master is found through the sentinels, and found again after a failover.

LOCATION: the sentinels' URLs. OPTIONS: ``service_name`` (required), ``min_replicas`` and
``min_replicas_timeout`` (seconds), ``sentinel_kwargs``, plus connection options.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import select
import threading
import time
import weakref
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.exceptions
import redis.sentinel
from django.core.exceptions import ImproperlyConfigured
from redis.backoff import NoBackoff

from .. import acl, fast_path, wire
from ..exceptions import BackendUnavailable, QuorumNotReached, quorum_failure
from ..forks import after_fork_in_child
from ..identity import write_seq
from ..options import check_options, sentinel_options
from .base import Attempt, Kind, Op, Order, Renewal, moved
from .redis import RedisBackend, TakenAll

T = TypeVar("T")
logger = logging.getLogger("django_redlock")
MASTER_CHECK = 1.0  # seconds between looks at where the sentinels say the master is
# ... after a look that found no master: as often, for redis-py says "no master" also when
# the sentinels answered that it is down (every unplanned failover, until the promotion), and
# a look 5 s later left takes on the old master for seconds after the switch.
MASTER_CHECK_FAILED = 1.0
LOOKER_IDLE = 60.0  # the looker ends after this long without an operation
# After a sentinel announced a switch, a look that names the old master is answered with the
# new one until a look names the new one, for this long at most: the other sentinels learn of
# the switch from the leader's hello messages (every 2 s), and the leader's SENTINEL MASTERS
# names the old master until every replica follows the new one: they would send us back.
SWITCH_TRUSTED = 30.0
LISTEN_POLL = 1.0  # how often a listener checks that its backend is still used
HEARD_WAIT = 0.25  # how long an operation waits for an announcement already here to apply
# How long the master a sentinel named stays usable when no sentinel answers (and only with
# min_replicas, see _Heard.bounded): a look period and one look's slack.
FOUND_TRUSTED = 2 * MASTER_CHECK
OWN_OPTIONS = ("service_name", "min_replicas", "min_replicas_timeout", "sentinel_kwargs")
GATE_POLL = 0.05  # a caller waiting for a permit looks again this often (a wake-up lost)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Switch(NamedTuple):
    old: tuple[str, int]
    new: tuple[str, int]
    until: float  # monotonic
    # The highest config-epoch a sentinel's answer reported before the switch was heard
    # (None: no answer yet): an answer naming ``old`` at a higher one, no failover under
    # way, comes from a later failover, and ends the correction (see ``_Heard.current``).
    epoch: int | None = None


class _Heard:
    """The last switch a sentinel announced: until it is old, an answer naming the old
    master is stale (that sentinel has not heard yet), and the new master is used instead.
    Shared by the backend and its (sync and asyncio) Sentinel clients; one attribute,
    replaced whole. Also the master a sentinel named last (``found``), for when none
    answers in time (see ``_Sentinel.discover_master``), while that cannot be stale
    (``bounded``)."""

    switch: _Switch | None = None
    epoch: int | None = None  # the highest config-epoch a sentinel's answer reported
    found: tuple[str, int] | None = None
    found_at: float = float("-inf")  # monotonic: when a sentinel last named ``found``
    budget: float = 2.0  # the socket timeout: how long a look asks the sentinels in all
    listening: _Listening | None = None  # the backend's listeners (for ``bounded``)
    replicated: bool = False  # min_replicas >= 1: every take is confirmed by replicas

    def __init__(self) -> None:
        # Set in the looker's thread while it looks: it asks every sentinel, however long,
        # and learns the truth (no answer is "no master", not the master found last).
        self.looking = threading.local()

    def bounded(self) -> bool:
        """Whether this look asks for one socket timeout at most, then uses ``found`` if no
        sentinel answers. Nothing short of a sentinel's answer proves ``found`` is not
        stale: cut off from the sentinels, the listeners stay subscribed and hear nothing,
        and after a failover the old master, back empty on its address (a master, a new
        run_id) or not demoted yet (same run_id, ROLE master for seconds), grants a take
        (two holders). So only with min_replicas: a take there is
        granted only once replicas confirm it, and a master failed over (its replicas follow
        the new one) or back empty has none (QuorumNotReached, released). And then only
        while a sentinel named it within FOUND_TRUSTED and the listeners were subscribed
        throughout since: never after an idle spell (the listeners ended) nor a lost one."""
        if not self.replicated or self.found is None or getattr(self.looking, "on", False):
            return False
        listening, found_at = self.listening, self.found_at
        since = None if listening is None else listening.since
        return (
            since is not None and since <= found_at and time.monotonic() - found_at < FOUND_TRUSTED
        )

    def known(self) -> tuple[str, int] | None:
        """Where the master is as far as known, when no sentinel answers: the announced
        one, else the one a sentinel named last (its answer corrected by an announcement)."""
        promoted = self.promoted()
        if promoted is not None:
            return promoted
        found = self.found
        return None if found is None else self.current(found)

    def promoted(self) -> tuple[str, int] | None:
        """The announced master while the announcement is trusted, else None: what to use
        when the sentinels name no master (after an unplanned failover's promotion, SENTINEL
        MASTERS names the old master, flagged down, until the failover ends)."""
        switch = self.switch
        if switch is not None and time.monotonic() < switch.until:
            return switch.new
        return None

    def current(
        self, address: Any, asked: bool = False, epoch: int | None = None,
        failing_over: bool = False,
    ) -> Any:  # fmt: skip
        """``address``, or the announced master if it names the old one. ``asked``: it is a
        sentinel's answer (its config-``epoch``; ``failing_over``: a failover under way),
        which ends the correction when it names the new master, or when it names the old
        one and cannot be older than the switch: it names it at a config-epoch higher than
        any answer before the switch, no failover under way. Every failover raises the
        epoch, so that is a later failover that made the old master the master again
        (unheard: the listeners were cut off); correcting it sent connections to a master
        no sentinel names (two holders if it came back empty). A sentinel that has not
        heard of the switch answers at an epoch no higher; the switch's own leader, until
        the failover ends, with the failover under way: both still corrected."""
        switch = self.switch
        if switch is None:
            return address
        named = (str(address[0]), int(address[1]))
        if named == switch.old and time.monotonic() < switch.until:
            if not (asked and not failing_over and _later(switch, epoch)):
                return switch.new
            if self.switch is switch:
                self.switch = None  # a later failover: the switch is history
            return address
        if asked and named == switch.new and self.switch is switch:
            self.switch = None  # the sentinels asked know: no need to correct them any more
        return address


def _later(switch: _Switch, epoch: int | None) -> bool:
    """Whether an answer at config-``epoch`` is newer than anything known before ``switch``."""
    return epoch is not None and switch.epoch is not None and epoch > switch.epoch


# What a sentinel that does not answer raises (redis-py asks the next one then).
_SILENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
_REFUSED = (*_SILENT, redis.exceptions.ResponseError)
_NotFound = redis.sentinel.MasterNotFoundError
_AsyncNotFound = redis.asyncio.sentinel.MasterNotFoundError


class _Sentinel(redis.sentinel.Sentinel):
    """redis-py's Sentinel client, its answer corrected by an announced switch (see _Heard):
    connections ask it where the master is when they connect (a new thread's first one too).

    The sentinels are asked one after another, as redis-py does (the rules: ``_Look``).
    With min_replicas, for one socket timeout in all once a master was found: each paused
    sentinel cost a new thread a whole socket timeout, and when none answered it was
    refused though the master, found a moment before, was healthy. Then, when no sentinel
    answers, the master found last is used (see ``_Heard.bounded`` for why only then)."""

    heard = _Heard()

    def discover_master(self, service_name: str) -> Any:
        look = _Look(self, service_name)
        for sentinel in look.sentinels():
            try:
                masters = sentinel.sentinel_masters()
            except _REFUSED as exc:
                look.refused(sentinel, exc)
                continue
            found = look.answered(sentinel, masters)
            if found is not None:
                return found
        return look.end(_NotFound)


class _AsyncSentinel(redis.asyncio.sentinel.Sentinel):
    heard = _Heard()

    async def discover_master(self, service_name: str) -> Any:  # as _Sentinel's
        look = _Look(self, service_name)
        for sentinel in look.sentinels():
            try:
                masters = await sentinel.sentinel_masters()
            except _REFUSED as exc:
                look.refused(sentinel, exc)
                continue
            found = look.answered(sentinel, masters)
            if found is not None:
                return found
        return look.end(_AsyncNotFound)


class _Look:
    """One look at the sentinels for a connection (the sync and asyncio clients' drivers
    ask; the rules are here): which to ask, for how long, and what to use when none names
    a master up."""

    def __init__(self, manager: Any, service_name: str) -> None:
        self.manager, self.service_name, self.heard = manager, service_name, manager.heard
        self.errors: list[str] = []
        self.refusal = False  # a sentinel answered with an error: no news of the master
        # what the sentinels that answered named, not up: (address, config-epoch, failing over)
        self.down: list[tuple[Any, int | None, bool]] = []
        self.bounded = self.heard.bounded()

    def sentinels(self) -> Iterator[Any]:
        heard = self.heard
        deadline = time.monotonic() + heard.budget if self.bounded else None
        for sentinel in list(self.manager.sentinels):
            if deadline is not None and time.monotonic() >= deadline:
                self.errors.append(f"{sentinel}: not asked, {heard.budget:g} s spent")
                return
            yield sentinel

    def refused(self, sentinel: Any, exc: Exception) -> None:
        self.refusal = self.refusal or not isinstance(exc, _SILENT)
        self.errors.append(f"{sentinel} - {exc!r}")

    def answered(self, sentinel: Any, masters: Any) -> Any:
        """The master's address if this sentinel names one up (then the look ends)."""
        state = masters.get(self.service_name) or {}
        epoch, failing_over = _epoch(state), "failover_in_progress" in (state.get("flags") or ())
        heard = self.heard
        if epoch is not None and (heard.epoch is None or epoch > heard.epoch):
            heard.epoch = epoch
        found = _master_in(self.manager, masters, self.service_name, sentinel)
        if found is not None:
            return _found(heard, found, epoch, failing_over)
        self.down.append((_address(state.get("ip"), state.get("port")), epoch, failing_over))
        return None

    def end(self, error: type[Exception]) -> Any:
        """No sentinel named a master up. One answered, naming the old master of the switch
        announced (flagged down: an unplanned failover, until its end): its new master,
        unless an answer comes from a later failover (see ``_Heard.current``).
        None answered: the master found last, only while ``bounded`` (see
        ``_Heard.bounded``), and never the switch announced alone: it may be SWITCH_TRUSTED
        old, and a later switch and that master back empty go unheard by listeners cut off
        from the sentinels (two holders). Anything else: no master."""
        heard, known = self.heard, None
        if self.down:
            switch = heard.switch
            if switch is not None and all(
                named == switch.old and (failing_over or not _later(switch, epoch))
                for named, epoch, failing_over in self.down
            ):
                known = heard.promoted()
        elif not self.refusal and self.bounded:
            known = heard.known()
        if known is not None:
            return known
        detail = f" : {', '.join(self.errors)}" if self.errors else ""
        raise error(f"No master found for {self.service_name!r}{detail}")


def _address(host: Any, port: Any) -> tuple[str, int] | None:
    try:
        return (_text(host), int(port))
    except (TypeError, ValueError):
        return None


def _master_in(manager: Any, masters: Any, service_name: str, sentinel: Any) -> Any:
    """The master's address in one sentinel's SENTINEL MASTERS, if it names one up (that
    sentinel is asked first from then on, as redis-py does), else None."""
    state = masters.get(service_name)
    if not state or not manager.check_master_state(state, service_name):
        return None
    sentinels = manager.sentinels
    with contextlib.suppress(ValueError):  # another thread's swap came first
        at = sentinels.index(sentinel)
        sentinels[0], sentinels[at] = sentinel, sentinels[0]
    forced = getattr(manager, "_force_master_ip", None)  # redis-py's force_master_ip
    return (forced if forced is not None else state["ip"], state["port"])


def _epoch(state: Mapping[str, Any]) -> int | None:
    try:
        return int(state["config-epoch"])
    except (KeyError, TypeError, ValueError):
        return None


def _found(heard: _Heard, address: Any, epoch: int | None, failing_over: bool) -> Any:
    found = heard.current(address, True, epoch, failing_over)
    heard.found, heard.found_at = (str(found[0]), int(found[1])), time.monotonic()
    return found


class _Listening:
    """The listeners' sockets (see ``_listen``), and the lock each holds from reading an
    announcement until it is applied: what an operation checks first (``unheard``). Each
    thread polls with a poller of its own (one poll object refuses concurrent calls), made
    again when the sockets change."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._entries: dict[object, tuple[Any, threading.Lock]] = {}
        # (the locks, the sockets): replaced whole, so a reader sees one or the other
        self._state: tuple[tuple[threading.Lock, ...], tuple[Any, ...]] = ((), ())
        self._local = threading.local()
        # monotonic: since when a listener has been subscribed with none lost (None: none)
        self.since: float | None = None

    def put(self, key: object, sock: Any, handling: threading.Lock) -> None:
        with self._mutex:
            if self._entries.get(key, (None,))[0] is not sock:
                if key in self._entries:
                    self.since = None  # its socket was made again: something was lost
                self._entries[key] = (sock, handling)
                self._publish()
            if self.since is None:
                self.since = time.monotonic()

    def drop(self, key: object) -> None:
        """Before its socket is closed: a closed descriptor may be reused by another."""
        with self._mutex:
            if self._entries.pop(key, None) is not None:
                self._publish()
            # a switch may go unheard from now on: what was found before is not trusted
            self.since = time.monotonic() if self._entries else None

    def _publish(self) -> None:
        entries = list(self._entries.values())
        self._state = (tuple(lock for _, lock in entries), tuple(sock for sock, _ in entries))

    def unheard(self) -> bool:
        """Whether an announcement is here and not applied yet: on a socket, or being
        applied. A closed socket: not waited for."""
        state = self._state
        handlings, socks = state
        if not socks:
            return False
        for handling in handlings:
            if handling.locked():
                return True
        try:
            if not hasattr(select, "poll"):
                return bool(select.select(list(socks), [], [], 0)[0])
            local = self._local
            if getattr(local, "state", None) is not state:
                poller = select.poll()
                for sock in socks:
                    poller.register(sock, select.POLLIN)
                local.poller, local.state = poller, state
            return bool(local.poller.poll(0))
        except (OSError, ValueError, TypeError):  # closed meanwhile by its listener
            return False


class _Replicated(NamedTuple):
    attempt: Attempt | TakenAll  # the take's own reply: whether it took is .acquired
    replicas: int
    release: Op[Any]


def _sentinel_url_kwargs(url: str) -> dict[str, Any]:
    """How to reach the sentinels, from the first one's URL: their own user and password
    (``redis://user:password@host:26379``) and TLS (``rediss://...?ssl_ca_certs=...``).
    ``sentinel_kwargs`` overrides any of it; the master's are in OPTIONS."""
    kwargs = redis.connection.parse_url(url)
    for key in ("host", "port", "db", "path"):
        kwargs.pop(key, None)
    if issubclass(kwargs.pop("connection_class", redis.Connection), redis.SSLConnection):
        kwargs["ssl"] = True
    return kwargs


def _close_sentinels(client: Any) -> None:
    """The sentinels' clients of a closed backend's ``client`` (one per sentinel, a pool
    each: the looks' SENTINEL MASTERS and new connections' questions) are disconnected: now,
    not when the garbage collector gets to their cycles (each closed backend left one
    connection per sentinel)."""
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        with contextlib.suppress(Exception):
            sentinel.connection_pool.disconnect()


class _Ticket:
    """An operation's claim on a permit of a ``_Gate`` (weakly referenced there)."""

    __slots__ = ("__weakref__",)


class _Gate:
    """The ``max_connections`` permits of the pool's path (a tracer, a retry option), safe
    from asynchronous exceptions (a soft time limit, a signal handler's). A permit is a
    ticket's place in ``taken``: added under ``_mutex`` in the step that finds one free, and
    given back by a discard that needs nothing taken first, so an exception at any line
    leaves no permit without its ticket. ``_mutex`` is a plain lock held by ``with`` around
    a few calls (no wait inside): released whatever lands there. threading.Semaphore did
    neither: an exception after its ``_value -= 1`` and before the caller's ``try:`` lost
    the permit for good ("all N connections busy" on a healthy master from then on), and
    one at the entry of its Condition's ``__exit__`` (a Python call) left that lock held
    (every later call hung). ``taken`` holds its tickets weakly: a give-back skipped all the
    same (the ``finally`` cut at its first line) comes back once the ticket's frame is gone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken: weakref.WeakSet[_Ticket] = weakref.WeakSet()
        self._mutex = threading.Lock()
        self._waiting: collections.deque[threading.Lock] = collections.deque()

    def take(self, ticket: _Ticket, timeout: float) -> bool:
        """Whether ``ticket`` got a permit within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        wake = threading.Lock()  # released by a give-back
        wake.acquire()
        try:
            while True:
                with self._mutex:
                    if len(self.taken) < self.limit:
                        self.taken.add(ticket)
                        return True
                    if wake not in self._waiting:
                        self._waiting.append(wake)
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                wake.acquire(timeout=min(left, GATE_POLL))
        finally:  # (skipped: a give-back wakes it for nothing, the others look again soon)
            with self._mutex:
                if wake in self._waiting:
                    self._waiting.remove(wake)

    def give_back(self, ticket: _Ticket) -> None:
        """``ticket``'s permit, if it has one, is free again, and a waiter woken."""
        self.taken.discard(ticket)  # first: the permit
        with self._mutex:
            wake = self._waiting.popleft() if self._waiting else None
        if wake is not None:
            with contextlib.suppress(RuntimeError):  # woken already (queued again since)
                wake.release()


class _AsyncGate:
    """A loop's ``max_connections`` permits for its ``aexecute`` calls, safe from asynchronous
    exceptions and cancellation as :class:`_Gate` is: a permit is a ticket's place in
    ``taken``, added in the step that finds one free (no await between), inside the
    operation's ``try:``, and given back by a discard that needs nothing taken first.
    asyncio.Semaphore was not: its ``release()`` hands the permit to a waiter, which then runs
    Python (its ``_waiters.remove``) before the caller's ``try:``, and a soft time limit
    landing there lost the permit for good (every later operation on that loop "all N
    connections busy" on a healthy master). One loop's: no lock needed. A give-back hands the
    permit to the first waiter (recorded on its ticket, then woken); a waiter also looks again
    every GATE_POLL should a hand-over be lost.

    A give-back skipped all the same (the ``finally`` cut at its first line) comes back once
    the task that took it is done, or the ticket's frame is gone: a coroutine's traceback
    kept in a cycle (a task's exception) held it until the garbage collector ran."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # ticket -> the task that took it (weakly: a task's ticket is freed with its frame)
        self.taken: weakref.WeakKeyDictionary[_Ticket, asyncio.Task[Any] | None] = (
            weakref.WeakKeyDictionary()
        )
        self._waiting: collections.deque[_AsyncWaiter] = collections.deque()

    def _free(self) -> bool:
        """Whether a permit is free, those of tasks that are done given back first."""
        if len(self.taken) < self.limit:
            return True
        for ticket, task in list(self.taken.items()):
            if task is not None and task.done():
                self.taken.pop(ticket, None)
        return len(self.taken) < self.limit

    async def take(self, ticket: _Ticket, timeout: float) -> bool:
        """Whether ``ticket`` got a permit within ``timeout`` seconds: at once when one is free
        and nobody waits, else handed over by a give-back in turn (first come, first served,
        as asyncio.Semaphore: a caller that took a free permit ahead of the waiters let one
        task doing operations back to back keep it, and the others failed at their socket
        timeout on a healthy master)."""
        task = asyncio.current_task()
        if not self._waiting and self._free():
            self.taken[ticket] = task
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        waiter = _AsyncWaiter(ticket, task)
        self._waiting.append(waiter)
        try:
            while True:
                if ticket in self.taken:
                    return True  # handed over (recorded on the ticket by the give-back)
                if self._free():  # a hand-over lost to an interrupt: found by the poll
                    self.taken[ticket] = task
                    return True
                left = deadline - loop.time()
                if left <= 0:
                    return False
                wake = waiter.wake = loop.create_future()
                poll = loop.call_later(min(left, GATE_POLL), _woken, wake)
                try:
                    await wake
                finally:
                    poll.cancel()
        finally:  # (a permit handed over meanwhile is on the ticket: aexecute gives it back)
            if waiter in self._waiting:
                self._waiting.remove(waiter)

    def give_back(self, ticket: _Ticket) -> None:
        """``ticket``'s permit, if it has one, is free again, and handed to the first waiter."""
        self.taken.pop(ticket, None)  # first: the permit
        self.hand_over()

    def hand_over(self) -> None:
        """Free permits to the waiters in turn: each recorded on the waiter's ticket (its
        task's, so one whose task ended gives it back) before the waiter is woken."""
        while self._waiting and self._free():
            waiter = self._waiting.popleft()
            if waiter.task is not None and waiter.task.done():
                continue  # gone without its finally
            self.taken[waiter.ticket] = waiter.task
            if waiter.wake is not None:
                _woken(waiter.wake)


class _AsyncWaiter:
    """A task waiting at an :class:`_AsyncGate`: its ticket, its task and its wake-up."""

    __slots__ = ("task", "ticket", "wake")

    def __init__(self, ticket: _Ticket, task: asyncio.Task[Any] | None) -> None:
        self.ticket, self.task = ticket, task
        self.wake: asyncio.Future[None] | None = None


def _woken(wake: asyncio.Future[None]) -> None:
    if not wake.done():
        wake.set_result(None)


class SentinelBackend(RedisBackend):
    """Locks on the master of a Sentinel-monitored service.

    With ``min_replicas``, an acquire also waits (``WAIT``, in the same round trip) until that
    many replicas have the lock, and fails, releasing it, if they do not in time. That narrows
    the failover gap without closing it: a failover may still promote a replica that had not
    acknowledged yet, or one that acknowledged and then restarted empty (fence what matters).
    """

    location_is_list = True
    acl_commands = {**acl.COMMANDS, **acl.SENTINEL_COMMANDS}
    # A reconnect asks the sentinels first (for a socket timeout at most, then the master
    # found before is used): under one deadline for the op, the master was never asked.
    op_deadline = False

    @classmethod
    def check_params(cls, alias: str, params: Mapping[str, Any]) -> None:
        super().check_params(alias, params)
        options = params.get("OPTIONS") or {}
        if not isinstance(options.get("service_name"), str) or not options["service_name"]:
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['service_name'] must name the service"
            )
        replicas = options.get("min_replicas", 0)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['min_replicas'] must be an int >= 0"
            )

    def __init__(self, alias: str, params: Any) -> None:
        super().__init__(alias, params)
        own = {key: self.options.pop(key) for key in OWN_OPTIONS if key in self.options}
        # Sentinel pools refuse a caller past max_connections instead of making it wait, as
        # the other backends' blocking pools do: these gates make it wait.
        self._limit = int(self.options.pop("max_connections", 100))
        self._gate = _Gate(self._limit)
        self._agates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AsyncGate] = (
            weakref.WeakKeyDictionary()
        )
        self.service_name: str = own["service_name"]
        self.min_replicas = int(own.get("min_replicas", 0))
        self.min_replicas_timeout = float(own.get("min_replicas_timeout", 0.5))
        self.sentinel_kwargs = dict(own.get("sentinel_kwargs") or {})
        self._master: tuple[str, int] | None = None  # where the last look found the master
        self._looker: threading.Thread | None = None  # see _look_for_master
        self._looking = threading.Lock()
        self._moving = threading.Lock()  # a look's move and an announced switch's, one at a time
        self._wake = threading.Event()  # set: the looker looks now
        self._heard = _Heard()
        self._heard.budget = self.socket_timeout
        self._heard.replicated = self.min_replicas > 0
        self._listening = self._heard.listening = _Listening()
        _backends.add(self)
        self._used = 0.0  # when an operation last ran (monotonic)
        self._looker_ran = False
        self._first_look: threading.Event | None = None  # set by a restarted looker's 1st look
        if self.min_replicas and self.min_replicas_timeout >= self.socket_timeout:
            # WAIT's reply comes after min_replicas_timeout: a socket that gives up first
            # turns every slow replica into "unavailable" instead of QuorumNotReached.
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['min_replicas_timeout']"
                f" ({self.min_replicas_timeout:g} s) must be shorter than socket_timeout"
                f" ({self.socket_timeout:g} s): the socket would give up before WAIT answers"
            )

    def _sentinels(self) -> list[tuple[str, int]]:
        return [(urlsplit(u).hostname or "", urlsplit(u).port or 26379) for u in self.location]  # type: ignore[union-attr]

    def _options(self, retry: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        options = {**self.default_options, **self.options}
        options.setdefault("retry", retry)
        sentinel_kwargs = {
            "socket_timeout": options["socket_timeout"],
            "socket_connect_timeout": options["socket_connect_timeout"],
            **_sentinel_url_kwargs(self.location[0]),  # type: ignore[index]
            **self.sentinel_kwargs,
        }
        # redis-py below 8 gives the sentinel clients its default retries with a backoff of
        # up to 10 s: a silent sentinel then cost 4 socket timeouts and the sleeps between.
        sentinel_kwargs.setdefault("retry", retry)
        return options, sentinel_kwargs

    def make_client(self) -> Any:
        options, sentinel_kwargs = self._options(redis.retry.Retry(NoBackoff(), 0))
        sentinel = _Sentinel(self._sentinels(), sentinel_kwargs=sentinel_kwargs)
        sentinel.heard = self._heard
        options.setdefault("connection_pool_class", wire.SentinelPool)
        client = sentinel.master_for(self.service_name, **options)
        if self._master is not None:  # made after a failover: its connections go there
            wire.moved_sync_pool(client.connection_pool, self._master)
        return client

    def make_async_client(self) -> Any:
        options, sentinel_kwargs = self._options(redis.asyncio.retry.Retry(NoBackoff(), 0))
        sentinel = _AsyncSentinel(self._sentinels(), sentinel_kwargs=sentinel_kwargs)
        sentinel.heard = self._heard
        client = sentinel.master_for(
            self.service_name, connection_pool_class=wire.AsyncSentinelPool, **options
        )
        if self._master is not None:  # a loop that starts after a failover: there at once
            wire.moved_async_pool(client, self._master)
        return client

    @property
    def socket_timeout(self) -> float:
        return float({**self.default_options, **self.options}["socket_timeout"])

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
        op = super().op_acquire(name, token, ttl_ms, meta, kind, waiter, wait_ms, order)
        if not self.min_replicas:
            return op
        wait = ("WAIT", self.min_replicas, round(self.min_replicas_timeout * 1000))
        # The hand-back of a take too few replicas confirmed: an ordered re-entry's puts the
        # owner's count back to its levels, as a later write.
        undo = None if order is None else (write_seq(), order[1])
        release = self.op_release(name, token, kind, undo)

        def parse(replies: list[Any]) -> Any:
            return _Replicated(op.parse(replies[0]), int(replies[1]), release)

        return Op(name, [op.request, wait], parse)

    def op_acquire_all(
        self, names: Sequence[str], token: str, ttl_ms: int, meta: str, waiter: str = ""
    ) -> Op[TakenAll]:
        # As op_acquire: a set is confirmed by min_replicas, or every name is handed back.
        op = super().op_acquire_all(names, token, ttl_ms, meta, waiter)
        if not self.min_replicas:
            return op
        wait = ("WAIT", self.min_replicas, round(self.min_replicas_timeout * 1000))
        release = self.op_release_all(names, token)

        def parse(replies: list[Any]) -> Any:
            return _Replicated(op.parse(replies[0]), int(replies[1]), release)

        return Op(op.name, [op.request, wait], parse)

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
        # As op_acquire: a permit, read or write is confirmed by min_replicas, or handed back.
        op = super().op_lease_acquire(
            name, token, ttl_ms, meta, mode, limit, fair, waiter, wait_ms, reader
        )
        if not self.min_replicas:
            return op
        wait = ("WAIT", self.min_replicas, round(self.min_replicas_timeout * 1000))
        release = self.op_lease_release(name, token, mode)

        def parse(replies: list[Any]) -> Any:
            return _Replicated(op.parse(replies[0]), int(replies[1]), release)

        return Op(name, [op.request, wait], parse)

    def _look_for_master(self) -> threading.Event | None:
        """Keep the looker running while the backend is used (every operation, a renewal
        included, calls this): a thread of the backend's that asks the sentinels where the
        master is once a second, and moves each thread's connection to another address there
        before its next command. A connection outlives a failover: after a planned one
        (SENTINEL FAILOVER) the old master takes writes until it is demoted, seconds later,
        so renewals kept its copy of a hold alive while the promoted master's ran out, and
        another client took the name there (two holders); owned() said True. In a thread of
        its own: slow or paused sentinels never delay an operation, except the ones that
        meet a looker restarted after LOOKER_IDLE: they wait for its first look (up to the
        socket timeout), as their connections may point at a master demoted meanwhile.
        The looker starts a listener per sentinel (``_listen``), which moves the connections
        as soon as a sentinel announces a switch. Returns that first look's event while it
        is pending, else None."""
        self._used = time.monotonic()
        looker = self._looker
        if (looker is None or not looker.is_alive()) and self._looking.acquire(False):
            try:  # (not waited for: a thread that is starting it is enough)
                looker = self._looker
                if looker is None or not looker.is_alive():
                    # A restart after an idle spell: the connections are as old as the last
                    # look, a failover may have happened since (the first start has fresh
                    # connections, made through the sentinels).
                    first = threading.Event() if self._looker_ran else None
                    self._looker_ran = True
                    looker = threading.Thread(
                        target=_look, args=(weakref.ref(self), first), daemon=True,
                        name=f"redlock-sentinel {self.alias}",
                    )  # fmt: skip
                    self._first_look = first
                    self._looker = looker
                    looker.start()
            finally:
                self._looking.release()
        return self._first_look

    def _stale(self, first: threading.Event | None) -> None:
        logger.warning(
            "redlock: %s: no look at the sentinels within %g s after an idle spell: the"
            " operation goes to the master found before it",
            self.describe(),
            self.socket_timeout,
        )
        if self._first_look is first:
            self._first_look = None  # said once; operations go on as before

    def _look_once(self, after_idle: bool = False) -> float:
        """Where is the master now? Connections elsewhere are moved (after an idle spell
        even if no look found one before). Returns the pause until the next look."""
        client = self._client
        if client is None:
            if not self._aclients:
                return MASTER_CHECK
            client = self.client  # asyncio's alone: the sentinels are asked through it
        pool = client.connection_pool
        self._heard.looking.on = True
        try:
            master = wire.sentinel_master(pool)  # also closes its idle connections
        except Exception as exc:  # no sentinel answered: connections stay where they are
            logger.info("redlock: %s: where is the master? %s", self.describe(), exc)
            return MASTER_CHECK_FAILED
        finally:
            self._heard.looking.on = False
            if self._client is not client:  # closed during the look: reconnected, closed now
                _close_sentinels(client)
        self._move(pool, master, after_idle)
        return MASTER_CHECK

    def _move(self, pool: Any, master: tuple[str, int], force: bool) -> None:
        """The master is at ``master``: connections elsewhere move there before their next
        command (the first look's answer moves nothing unless ``force``: they are new)."""
        with self._moving:
            # (a look's answer that came before a switch was announced, moved after it,
            # must not send them back)
            master = self._heard.current(master)
            if master == self._master:
                return
            before, self._master = self._master, master
            if before is None and not force:
                return
            fast_path.moved_threads(pool, master)
            # The pool's connections (a tracer's or a retry's path) at their next checkout:
            # set before an operation waiting for this announcement goes on (HEARD_WAIT).
            wire.moved_sync_pool(pool, master)
            # Each event loop's pool too: asyncio's connections made before the switch
            # stayed on the old master (takes, releases, owned() answered there). Under
            # the lock a new loop's client is made under: it is listed, or sees _master.
            with self._setup:
                aclients = [entry[0] for entry in self._aclients.values()]
            for aclient in aclients:
                wire.moved_async_pool(aclient, master)
            hub = self._hub  # its waiters' subscriptions too: a release there is heard
            if hub is not None:
                hub.moved()
        moved(self)  # its holds renewed there now, not at their next period

    def _heard_switch(self, channel: Any, message: Any) -> None:
        """A sentinel announced a switch: connections move now, not at the next look (up to
        a second later, while the old master still grants takes a failover loses). Heard:
        ``+promoted-slave slave <ip>:<port> <ip> <port> @ <name> <old ip> <old port>`` (the
        failover's leader, once the replica took the master's role: from then on the
        failover goes on to its end, and SENTINEL GET-MASTER-ADDR-BY-NAME names it, while
        SENTINEL MASTERS, which redis-py asks, names the old one until the end, seconds
        later), and ``+switch-master <name> <old ip> <old port> <ip> <port>`` (each sentinel,
        at the end, or when it hears of it)."""
        fields = _text(message).split()
        if _text(channel) == "+promoted-slave" and len(fields) == 8:
            service, old, new = fields[5], fields[6:8], fields[2:4]
        elif _text(channel) == "+switch-master" and len(fields) == 5:
            service, old, new = fields[0], fields[1:3], fields[3:5]
        else:
            return
        if service != self.service_name or not old[1].isdigit() or not new[1].isdigit():
            return
        master = (new[0], int(new[1]))
        until = time.monotonic() + SWITCH_TRUSTED
        heard = self._heard
        heard.switch = _Switch((old[0], int(old[1])), master, until, heard.epoch)
        client = self._client
        if client is None:
            if not self._aclients:
                return
            client = self.client
        logger.info(
            "redlock: %s: a sentinel announced the master at %s:%d", self.describe(), *master
        )
        self._move(client.connection_pool, master, force=True)
        self._wake.set()  # a look now, to end the correction once the sentinels agree

    def close(self) -> None:
        self._looker = None  # it ends at its next look, its listeners within LISTEN_POLL
        self._wake.set()
        client = self._client
        super().close()
        _close_sentinels(client)

    def _unheard(self) -> bool:
        """Whether a sentinel's announcement is here and not applied yet. (Sent before the
        reply to any question asked after the switch, it is here before that reply: a take
        that follows the answer is sent where the announcement says.)"""
        return self._listening.unheard()

    def renew_many(self, renewals: Sequence[Renewal], shard: Hashable = None) -> list[bool | None]:
        # Never behind callers at the max_connections gate (on the pool's path: a tracer, a
        # retry option): busy callers won its permits while the renewals waited a socket
        # timeout per try, and a hold expired on a healthy master while its owner held it.
        # The pool has no limit of its own: a renewal takes a connection outside the gate's
        # (one at a time: the backend's renewals are one worker's), as Cluster's (see _own).
        return self._run(self.op_renew(renewals), gated=False)

    def execute(self, op: Op[T]) -> T:
        return self._run(op, gated=True)

    def _run(self, op: Op[T], gated: bool) -> T:
        first = self._look_for_master()
        if first is not None and not first.wait(self.socket_timeout):
            self._stale(first)
        if self._unheard():
            deadline = time.monotonic() + HEARD_WAIT
            while self._unheard() and time.monotonic() < deadline:
                time.sleep(0.001)
        if not gated or fast_path.on_thread_connection(self.client):
            return self._execute(op)  # nothing checked out of the pool: no permit to wait for
        gate, ticket = self._gate, _Ticket()
        try:  # entered before the permit is taken: no line between them (see _Gate)
            if not gate.take(ticket, self.socket_timeout):
                busy = f"all {self._limit} connections busy"
                raise BackendUnavailable(
                    f"lock {op.name!r}: backend {self.alias!r}: {busy}",
                    timed_out=True,  # nothing sent: nothing to give back either
                )
            return self._execute(op)
        finally:
            gate.give_back(ticket)

    def _execute(self, op: Op[T]) -> T:
        result = super().execute(op)
        if isinstance(result, _Replicated):
            if self._enough(result):
                return result.attempt  # type: ignore[return-value]
            super().execute(result.release)
            raise self._too_few(op.name, result)
        return result

    async def aexecute(self, op: Op[T]) -> T:
        first = self._look_for_master()
        if first is not None:
            deadline = time.monotonic() + self.socket_timeout
            while not first.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # (a thread's event: polled, the loop runs on)
            if not first.is_set():
                self._stale(first)
        if self._unheard():
            deadline = time.monotonic() + HEARD_WAIT
            while self._unheard() and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
        loop = asyncio.get_running_loop()
        gate = self._agates.get(loop)
        if gate is None:
            gate = self._agates[loop] = _AsyncGate(self._limit)
        ticket = _Ticket()
        try:  # entered before the permit is taken: no line between them (see _AsyncGate)
            if not await gate.take(ticket, self.socket_timeout):  # as execute()'s
                busy = f"all {self._limit} connections busy"
                raise BackendUnavailable(
                    f"lock {op.name!r}: backend {self.alias!r}: {busy}",
                    timed_out=True,  # nothing sent: nothing to give back either
                )
            return await self._aexecute(op)
        finally:
            gate.give_back(ticket)

    async def _aexecute(self, op: Op[T]) -> T:
        result = await super().aexecute(op)
        if isinstance(result, _Replicated):
            if self._enough(result):
                return result.attempt  # type: ignore[return-value]
            await super().aexecute(result.release)
            raise self._too_few(op.name, result)
        return result

    def _enough(self, result: _Replicated) -> bool:
        return not result.attempt.acquired or result.replicas >= self.min_replicas

    def _too_few(self, name: str, result: _Replicated) -> QuorumNotReached:
        # A reentrant grant's count above 1 was a re-entry: its undo takes back that level
        # only, and the hold it nested in stays (said so: "released" misled).
        count = getattr(result.attempt, "count_or_wait", 1)
        undone = (
            "this re-entry was undone (the hold it nested in stays, as before)"
            if isinstance(count, int) and count > 1
            else "it was released"
        )
        return quorum_failure(
            self.alias,
            name,
            QuorumNotReached(
                f"lock {name!r}: backend {self.alias!r}: only {result.replicas} of the"
                f" {self.min_replicas} replicas required confirmed the lock within"
                f" {self.min_replicas_timeout:g} s; {undone}"
            ),
        )

    @classmethod
    def check_options(cls, alias: str, params: Mapping[str, Any]) -> None:
        options = params.get("OPTIONS") or {}
        allowed = sentinel_options(bool(options.get("ssl"))) | set(OWN_OPTIONS)
        where = f"the Sentinel backend ({', '.join(OWN_OPTIONS)}) or Sentinel.master_for"
        check_options(alias, options, allowed, where)
        if not isinstance(options.get("sentinel_kwargs") or {}, Mapping):
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['sentinel_kwargs'] must be a dict"
            )
        wait = options.get("min_replicas_timeout", 0.5)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait < 1e6:
            raise ImproperlyConfigured(
                f"DJANGO_REDLOCK[{alias!r}]['OPTIONS']['min_replicas_timeout'] must be seconds"
                f" > 0, not {wait!r}"
            )


def _look(ref: weakref.ref[SentinelBackend], first: threading.Event | None = None) -> None:
    """The looker thread (see ``SentinelBackend._look_for_master``): ends when its backend is
    closed or collected, or after LOOKER_IDLE without an operation (the next one starts it)."""
    me = threading.current_thread()
    backend = ref()
    if backend is None:
        return
    kwargs = backend._options(redis.retry.Retry(NoBackoff(), 0))[1]
    for host, port in backend._sentinels():
        threading.Thread(
            target=_listen, args=(ref, me, host, port, kwargs), daemon=True,
            name=f"redlock-sentinel {backend.alias} {host}:{port}",
        ).start()  # fmt: skip
    del backend
    while True:
        backend = ref()
        if backend is None or backend._looker is not me:
            return
        if time.monotonic() - backend._used > LOOKER_IDLE:
            backend._looker = None
            return
        wake = backend._wake  # (a new one in a forked child)
        wake.clear()  # before the look: a switch heard during it is looked at again
        try:
            pause = backend._look_once(after_idle=first is not None)
        except Exception:  # a bug must not end the looks
            logger.exception("redlock: %s: looking for the master failed", backend.describe())
            pause = MASTER_CHECK_FAILED
        if first is not None:  # done, found or not (a failed look was logged)
            first.set()
            if backend._first_look is first:
                backend._first_look = None
            first = None
        del backend  # not kept alive by a sleeping looker
        wake.wait(pause)


def _listen(
    ref: weakref.ref[SentinelBackend], looker: threading.Thread, host: str, port: int,
    kwargs: dict[str, Any],
) -> None:  # fmt: skip
    """A listener thread of ``looker``'s, one per sentinel: hears the sentinel announce a
    switch (see ``SentinelBackend._heard_switch``) and moves the connections at once. It
    ends with its looker. Nothing waits for it but an operation that finds an announcement
    already here (``SentinelBackend._unheard``), for HEARD_WAIT at most: a sentinel that is
    paused, gone or not one (no announcement ever comes) only leaves the periodic looks to
    find the switch; a connection that fails is made again a second later."""
    pubsub: Any = None
    said = False  # a failure logged: not again until it works
    kwargs = {"retry": redis.retry.Retry(NoBackoff(), 0), **kwargs}
    me = object()  # this listener's entry in the backend's _listening
    handling = threading.Lock()  # held from reading an announcement until it is applied
    try:
        while True:
            backend = ref()
            if backend is None or backend._looker is not looker:
                return
            describe, listening = backend.describe(), backend._listening
            del backend
            try:
                if pubsub is None:
                    pubsub = redis.Redis(host=host, port=port, **kwargs).pubsub()
                    pubsub.subscribe(*acl.SENTINEL_CHANNELS)
                sock = wire.socket_of(pubsub.connection)
                if sock is None:
                    raise redis.ConnectionError("not connected")
                listening.put(me, sock, handling)
                if not _readable(sock, LISTEN_POLL):
                    continue
                with handling:
                    while True:
                        message = pubsub.get_message(timeout=0)
                        if message is None:
                            break
                        if message.get("type") == "subscribe":
                            said = False
                        elif message.get("type") == "message":
                            _heard(ref, message)
            except Exception as exc:  # gone, refused (an ACL without the channels), reset
                listening.drop(me)
                if not said:  # a refusal is the setup's: a warning (a sentinel down: news)
                    said = True
                    logger.log(
                        logging.WARNING if isinstance(exc, redis.ResponseError) else logging.INFO,
                        "redlock: %s: not listening to the sentinel at %s:%d (%s): a switch"
                        " is found by the looks at the sentinels, once a second",
                        describe, host, port, exc,
                    )  # fmt: skip
                if pubsub is not None:
                    pubsub.close()
                pubsub = None
                time.sleep(LISTEN_POLL)
    finally:
        backend = ref()
        if backend is not None:
            backend._listening.drop(me)
        if pubsub is not None:
            pubsub.close()


def _readable(sock: Any, timeout: float) -> bool:
    """Whether ``sock`` has something to read (or was closed) within ``timeout`` seconds.
    poll(), not select(): a process with a thousand files open has descriptors select()
    refuses."""
    if not hasattr(select, "poll"):
        return bool(select.select([sock], [], [], timeout)[0])
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def _heard(ref: weakref.ref[SentinelBackend], message: dict[str, Any]) -> None:
    backend = ref()
    if backend is not None:
        try:
            backend._heard_switch(message["channel"], message["data"])
        except Exception:  # a bug must not end the listening
            logger.exception("redlock: %s: a switch announced", backend.describe())


_backends: weakref.WeakSet[SentinelBackend] = weakref.WeakSet()


@after_fork_in_child
def _after_fork_in_child() -> None:
    """A backend's locks may have been held by another thread of the parent at the fork:
    held for good in the child, whose operations would then never start a looker."""
    for backend in list(_backends):
        backend._looking = threading.Lock()
        backend._moving = threading.Lock()
        backend._wake = threading.Event()
        # the parent's listeners' (the sockets are shared; none listens here)
        backend._listening = backend._heard.listening = _Listening()
        # Permits taken by the parent's threads mid-operation never come back here.
        backend._gate = _Gate(backend._limit)
