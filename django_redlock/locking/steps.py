"""Operations as generators of steps, and the two drivers that run them.

Each lock operation (acquire, release, ...) is written once, as a generator that yields the
steps it needs: a backend :class:`~..backends.base.Op` (one round trip), or watching a
channel and sleeping on it. :func:`drive` runs the steps in a thread, :func:`adrive` on the
running event loop, so ``lk.acquire()`` and ``await lk.aacquire()`` share every line.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, NamedTuple, TypeVar

from .. import observe
from ..backends.base import BaseLockBackend, Op
from ..exceptions import BackendUnavailable, QuorumNotReached
from ..waiters import AsyncWaiter, Waiter, unheard
from . import finisher

T = TypeVar("T")
Steps = Generator[Any, Any, T]
#: What :func:`drive` runs to hand back what finished steps took, their outcome lost.
Undo = Callable[[], Steps[None]]


class Watch(NamedTuple):
    """Start watching for wake-ups: the reply is ``(context, waiter)``.

    ``leave``: a waiter with an id (``channel``) registers on the server with its tries; its
    leave is left to the hub from before the first of them (:meth:`~..waiters.ReleaseHub.
    abandon`), so a clean-up cut short at any line, by an interrupt, still leaves through
    the hub when a wake-up comes for it. A leave answered, or the hold taken, settles it.
    The driver stops watching should the steps end without :class:`Unwatch`."""

    channel: str  # the lock's release channel, or the waiter's id
    by_id: bool
    lock: str = ""  # the lock's name (hubs with an inbox per lock need it)
    leave: Op[Any] | None = None


class Sleep(NamedTuple):
    """Sleep until woken or ``seconds`` pass: the reply is whether it was woken. A server
    that goes silent meanwhile raises BackendUnavailable here (see ``_check_heard``).
    ``handle`` (what Watch replied): the watch moves to the backend's new hub, should the
    backend have closed the one it was on meanwhile (see :class:`_Watching`)."""

    waiter: Any
    seconds: float
    lock: str = ""  # the lock's name, for the error
    handle: Any = None


class Unwatch(NamedTuple):
    handle: Any  # what Watch replied


def leave_waiters(
    backend: BaseLockBackend, waiter: str, leave: Op[Any], unanswered: bool
) -> Steps[None]:
    """A registered waiter that stops waiting without the hold leaves the server's waiters
    (``leave``, one round trip), unless the last try got no answer in time
    (``unanswered``): the leave would keep the caller another socket timeout, and a slow or
    paused server could run it before that try, which registers the waiter again. A leave
    not sent, failed or interrupted is left to the hub (:meth:`~..waiters.ReleaseHub.abandon`):
    sent should a wake-up still come for the waiter. Errors are not raised (the caller
    raises its own); an interrupt is. Call it before the waiter stops watching."""
    if not unanswered:
        try:
            yield leave
        except Exception:
            pass  # abandoned, below
        except BaseException:
            backend.hub.abandon(waiter, functools.partial(backend.execute, leave))
            raise
        else:
            backend.hub.settle(waiter)  # left: no wake-up comes for it any more
            return
    backend.hub.abandon(waiter, functools.partial(backend.execute, leave))


def in_event_loop() -> bool:
    # Not get_running_loop(): raising and catching on every sync call costs time.
    return asyncio._get_running_loop() is not None


def drive(backend: BaseLockBackend, steps: Steps[T], undo: Undo | None = None) -> T:
    """Run ``steps`` to the end in this thread; errors of a step are thrown into them.

    So is an interrupt (KeyboardInterrupt from a signal handler, a time limit) that lands on
    a line of the driver between two steps, the steps being suspended: a reply they never got
    may have granted something, and only they know what to hand back. Never abandoned
    half-way, they never see a close (whose clean-up could not yield). What the steps raise
    comes out.

    One that lands once they are done (on the lines that return their outcome) cuts that
    outcome from the caller: ``undo`` gives the steps that hand back what they took (an
    acquire's hold: the caller, told of the interrupt, believes nothing held), run before
    the interrupt comes out. It also runs when the steps raised: it looks at what they
    recorded, not at how they ended."""
    try:
        watches: list[Any] = []  # entered and not yet left
        try:
            return _drive_all(backend, steps, watches)
        finally:
            if watches:
                _leave_watches(backend, watches)
    except BaseException:
        if undo is not None:
            undo_take(backend, undo)
        raise


# Backends a synchronous finish found not answering, by id -> until when (monotonic): see
# finish_now().
_unanswering: dict[int, float] = {}


def finish_now(backend: BaseLockBackend, finish: Callable[[], T]) -> T:
    """Run ``finish`` (the release of a cancelled finishing task, a closed coroutine's
    clean-up on the finisher) in this thread, unless a finish on ``backend`` found it not
    answering within the last socket timeout: then it is not sent (BackendUnavailable,
    nothing sent), its hold runs out at its TTL. Why: a loop's shutdown (or the finisher) runs
    these one after another, each blocking its thread up to a socket timeout; with Redis not
    answering, N cut releases would cost N timeouts (100 tasks at 2 s: 200 s), and the
    finisher's other backends would wait behind them. So they cost about one socket timeout."""
    key = id(backend)
    until = _unanswering.get(key)
    if until is not None:
        if time.monotonic() < until:
            raise BackendUnavailable(
                "not sent: the backend did not answer a finish just before (its hold runs"
                " out at its TTL)"
            )
        _unanswering.pop(key, None)
    try:
        return finish()
    except BackendUnavailable as exc:
        if exc.timed_out:  # a refused connection costs no wait: the next finish may work
            timeout = float(getattr(backend, "socket_timeout", None) or 2.0)
            _unanswering[key] = time.monotonic() + timeout
        raise


def undo_take(backend: BaseLockBackend, undo: Undo) -> None:
    """Run ``undo`` (see :func:`drive`). An error of the hand-back is not raised: the
    caller raises what interrupted it."""
    with contextlib.suppress(Exception):
        drive(backend, undo())


def _drive_all(backend: BaseLockBackend, steps: Steps[T], watches: list[Any]) -> T:
    # A second interrupt of a burst lands at the first point where CPython runs signal
    # handlers after the first: a call, a loop's back edge. So a handler only stores what
    # came (no call); the steps' state is looked at in the next round's try; and the inner
    # loop's back edge is inside the outer try: whatever lands there is thrown in as well.
    error: BaseException | None = None
    while True:  # again after an interrupt at the inner loop's back edge
        try:
            while True:  # again after an interrupt between two steps
                try:
                    if error is not None and (
                        inspect.getgeneratorstate(steps) != inspect.GEN_SUSPENDED
                    ):
                        break  # the steps' own outcome (they are done), or none started
                    return _drive(backend, steps, error, watches)
                except BaseException as exc:
                    error = exc
            break
        except BaseException as exc:
            error = exc
    assert error is not None  # (no call: a break comes only with one)
    raise error


def _leave_watches(backend: BaseLockBackend, watches: list[Any]) -> None:
    """Stop the watches the steps left open (an interrupt skipped their ``Unwatch``): a
    waiter left registered in the hub would take its wake-ups, and nobody would leave for
    it. Another interrupt meanwhile does not stop this (each leave is idempotent)."""
    for _ in range(100):
        try:
            while watches:
                channel, waiter = watches[-1]
                backend.hub.leave(channel, waiter)
                watches.pop()
            return
        except BaseException:
            continue


class _Watching:
    """A watch (the hub's context manager) that follows the backend's hub.

    ``backend.close()`` (``locks.close_all()``, a settings change) closes its hub, which
    wakes its waiters once and hears nothing more, while the backend stays in use with a
    new hub made on demand: a waiter left on the closed one would sleep to the hold's
    expiry. So after each sleep, a watch whose hub was replaced joins the new one (the
    waiter's leave goes with it) before the next try, and leaves the closed one; so does
    one whose hub closed during its set-up, before its first sleep (a closed hub confirms
    no subscription: it ends the pending ones, and refuses a join)."""

    def __init__(self, backend: BaseLockBackend, step: Watch, waiter: Any) -> None:
        self.backend, self.step, self.waiter = backend, step, waiter
        self.hub = backend.hub
        self.cm = self._open()
        self.entered = False  # (a watch never entered has nothing to leave)

    def _open(self) -> Any:
        step, backend = self.step, self.backend
        if step.leave is not None:  # from before its first try (see Watch)
            backend.hub.abandon(step.channel, functools.partial(backend.execute, step.leave))
        if isinstance(self.waiter, AsyncWaiter):
            return backend.hub.awatch(step.channel, step.by_id, step.lock, self.waiter)
        return backend.hub.watch(step.channel, step.by_id, step.lock, self.waiter)

    def moved(self) -> bool:
        """Whether the backend's hub is not this watch's any more (then it leaves the old
        one and opens a watch on the new one: enter it next)."""
        hub = self.backend.hub
        if hub is self.hub:
            return False
        if self.step.leave is not None:
            # Its leave goes to the new hub: left on the closed one, the leave below (the
            # wake-up the waiter holds, passed on) would run it, and the waiter lose its place.
            self.hub.settle(self.step.channel)
        if isinstance(self.waiter, AsyncWaiter):
            _exit_now(self.cm)  # (the closed hub's registry only: nothing to await)
        else:
            self.cm.__exit__(None, None, None)
        self.entered = False
        self.hub, self.cm = hub, self._open()
        return True

    def __enter__(self) -> Any:
        self.entered = True
        return self.cm.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.entered and self.cm.__exit__(*exc)

    async def __aenter__(self) -> Any:
        self.entered = True
        return await self.cm.__aenter__()

    async def __aexit__(self, *exc: Any) -> Any:
        return self.entered and await self.cm.__aexit__(*exc)


def _not_watching(backend: BaseLockBackend, step: Watch) -> None:
    """The watch failed (a refused subscription): nothing registered, no leave owed."""
    if step.leave is not None:
        backend.hub.settle(step.channel)


def _drive(
    backend: BaseLockBackend, steps: Steps[T], error: BaseException | None, watches: list[Any]
) -> T:
    reply: Any = None
    while True:
        try:
            step = steps.send(reply) if error is None else steps.throw(error)
        except StopIteration as done:
            # Not typing.cast(): a call of its own (done.value is Any to mypy anyway).
            return done.value
        reply = error = None
        try:
            if isinstance(step, Op):
                if watches:  # a waiter's try, place renewal or leave: see _tried_by
                    reply = backend.execute_by(step, _tried_by(backend))
                else:
                    reply = backend.execute(step)
            elif isinstance(step, Sleep):
                reply = step.waiter.wait(step.seconds)
                _check_heard(backend, step)
                if step.handle is not None and step.handle[0].moved():
                    step.handle[0].__enter__()
                    if step.waiter.unconfirmed:  # registered: a leave is owed (the hub's)
                        raise _unconfirmed(backend, step.handle[0].step)
            elif isinstance(step, Watch):
                waiter = Waiter()
                watches.append((step.channel, waiter))  # left by the driver, should it be cut
                watching = _Watching(backend, step, waiter)
                try:
                    reply = (watching, watching.__enter__(), step.channel)
                    while watching.moved():  # the hub closed during the set-up
                        reply = (watching, watching.__enter__(), step.channel)
                except Exception:
                    _not_watching(backend, step)
                    watches.remove((step.channel, waiter))
                    raise
                if reply[1].unconfirmed:
                    _unconfirmed_exit(backend, step, watching, watches)
                    raise _unconfirmed(backend, step)
            else:
                step.handle[0].__exit__(None, None, None)
                _left(watches, step.handle)
        except BaseException as exc:
            if isinstance(exc, (BackendUnavailable, QuorumNotReached)):
                observe.backend_error(backend)
            error = exc


def _tried_by(backend: BaseLockBackend) -> float | None:
    """When a command sent while waiting must be answered by: its hub's PING verdict. The
    rule is one socket timeout from the moment the server stopped, whatever step: a try
    sent after the stop, with a full socket timeout of its own, ended up to two after it,
    and the verdict reaches only a waiter asleep."""
    return backend.hub.heard_until()


def _left(watches: list[Any], handle: Any) -> None:
    with contextlib.suppress(ValueError):
        watches.remove((handle[2], handle[1]))


def _check_heard(backend: BaseLockBackend, step: Sleep) -> None:
    """A sleeping waiter whose server went silent (its hub's PING unanswered for a socket
    timeout, or a quorum's nodes too many for a majority) raises now, not at its next try,
    which would come only when the sleep ends. Raised into the steps at the ``Sleep``, as
    a try that got no answer in time (no leave is sent: the hub sends it on a wake-up)."""
    if unheard(step.waiter):
        raise BackendUnavailable(
            backend.hub.unheard_error(backend.alias, step.lock), timed_out=True
        )


def _unconfirmed_exit(
    backend: BaseLockBackend, step: Watch, watching: Any, watches: list[Any]
) -> None:
    """Nothing registered on the server yet: no leave is owed. The watch is left before
    the driver forgets it (an interrupt between them: the driver leaves it again)."""
    if step.leave is not None:
        backend.hub.settle(step.channel)
    watching.__exit__(None, None, None)
    watches.pop()


def _unconfirmed(backend: BaseLockBackend, step: Watch) -> BackendUnavailable:
    """A wait's set-up and its first try share one socket timeout: a server that did not
    confirm the subscription within it does not answer, and the try would wait another.
    Raised into the steps at the ``Watch`` (nothing registered on the server yet)."""
    message = backend.hub.unconfirmed_error(backend.alias, step.lock or step.channel)
    return BackendUnavailable(message, timed_out=True)


#: The steps each async driver is running. A task whose loop was torn down is garbage with
#: its coroutine, and the collector finalises garbage in no set order: steps finalised before
#: the coroutine would get GeneratorExit, their clean-up (it yields) could not run ("generator
#: ignored GeneratorExit"), and the waiter would stay in the queue. Reached from here, they
#: are not garbage: the coroutine's close finishes them (:func:`_finish_closed`).
_driven: set[Steps[Any]] = set()


async def adrive(backend: BaseLockBackend, steps: Steps[T], undo: Undo | None = None) -> T:
    """:func:`drive` on the running event loop. Closed instead (GeneratorExit), it hands
    its whole clean-up to the finisher thread (:func:`_finish_closed`)."""
    finisher.ensure_started()  # here, an ordinary context: a close may not start it
    watches: list[Any] = []  # entered and not yet left
    closed = False
    try:
        try:
            _driven.add(steps)  # (a set's add and discard take no lock: safe in a close)
            return await _adrive(backend, steps, watches)
        except GeneratorExit:
            closed = True  # (first: an interrupt before the hand-over loses it, to the TTL)
            # What to hand back is decided now (no I/O), not when the finisher gets to it:
            # the object may have taken the lock again by then (review asy, 1).
            planned = None if undo is None else undo()
            given = None if planned is None else functools.partial(_given, planned)
            finisher.hand(functools.partial(_finish_closed, backend, steps, watches, given))
            raise
        finally:
            _driven.discard(steps)
            if not closed:
                _leave_watches(backend, watches)
    except BaseException:
        if undo is not None and not closed:
            undo_take(backend, undo)  # synchronous: a cancelled task awaits nothing more
        raise


class _Cancels:
    """The running task's cancellations, to tell one that never reached the driver.

    redis-py sends each command under ``asyncio.wait_for``, which before Python 3.12 returns
    the inner result when a cancellation races it (so may any await under a step): the step
    then ends as if nothing happened, and the steps would go on (a waiter staying in line,
    taking the lock at the next release). A cancellation requested during a step still
    counts in the task's ``cancelling()`` (Python 3.11+), so one counted and not raised is
    thrown into the steps at that step, as if raised there: their clean-up runs (a hold
    granted in that moment handed back, the queue left). Python 3.10 counts nothing: there
    each command runs apart (:func:`_apart`), so that none is swallowed."""

    def __init__(self) -> None:
        task = asyncio.current_task()
        self.count: Callable[[], int] | None = getattr(task, "cancelling", None)
        self.seen = self.count() if self.count is not None else 0

    def lost(self, error: BaseException | None) -> BaseException | None:
        """What to throw into the steps after a step that raised ``error`` (None: replied):
        a CancelledError in its place if a cancellation came during it and was swallowed."""
        if self.count is None:
            return error
        now, seen = self.count(), self.seen
        self.seen = now  # (one that did reach the driver is counted too: not thrown twice)
        if now > seen and not isinstance(error, asyncio.CancelledError):
            return asyncio.CancelledError()
        return error


async def _apart(command: Awaitable[T]) -> T:
    """Await ``command`` in a task of its own (Python 3.10, see :class:`_Cancels`):
    asyncio.wait never drops the caller's cancellation, whatever the command's insides do
    with the one it is then given."""
    task = asyncio.ensure_future(command)
    try:
        await asyncio.wait({task})
    except asyncio.CancelledError:
        task.cancel()  # as aexecute_by's: redis-py drops the connection of a command cut short
        # Its end awaited: a reply read (its cancellation swallowed) is the server's before
        # the clean-up's commands, sent on other connections (a hand-back must follow the
        # grant it hands back). A later cancellation does not cut this: this one is raised.
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # (its error, if any, is the cancellation's now: retrieved)
        raise
    except BaseException:
        task.cancel()  # (closed: nothing can be awaited any more)
        raise
    return task.result()


async def _adrive(backend: BaseLockBackend, steps: Steps[T], watches: list[Any]) -> T:
    # As _drive_all: an interrupt on a line between two steps (the loop's head, _Cancels.lost)
    # is thrown into the suspended steps, which hand back what a reply they never got granted.
    # A burst of two is thrown in as well (see _drive_all: no call in a handler, the state
    # looked at in the next round's try, the inner loop's back edge inside the outer try).
    cancels = _Cancels()
    loop = asyncio.get_running_loop()  # this coroutine's: run elsewhere, it is being closed
    error: BaseException | None = None
    while True:  # again after an interrupt at the inner loop's back edge
        try:
            while True:  # again after an interrupt between two steps
                try:
                    if error is not None and (
                        inspect.getgeneratorstate(steps) != inspect.GEN_SUSPENDED
                    ):
                        break  # the steps' own outcome (they are done), or none started
                    return await _adrive_steps(backend, steps, error, watches, cancels, loop)
                except GeneratorExit:
                    raise  # closed: adrive hands the steps to the finisher
                except BaseException as exc:
                    error = exc
            break
        except GeneratorExit:
            raise
        except BaseException as exc:
            error = exc
    assert error is not None  # (no call: a break comes only with one)
    raise error


async def _adrive_steps(
    backend: BaseLockBackend,
    steps: Steps[T],
    error: BaseException | None,
    watches: list[Any],
    cancels: _Cancels,
    loop: asyncio.AbstractEventLoop,
) -> T:
    reply: Any = None
    while True:
        try:
            step = steps.send(reply) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value  # (not typing.cast(): a call of its own)
        reply = error = None
        try:
            if isinstance(step, Op):
                if watches:  # as in _drive
                    command = backend.aexecute_by(step, _tried_by(backend))
                else:
                    command = backend.aexecute(step)
                reply = await (command if cancels.count is not None else _apart(command))
            elif isinstance(step, Sleep):
                reply = await step.waiter.wait(step.seconds)
                _check_heard(backend, step)
                if step.handle is not None and step.handle[0].moved():  # as in _drive
                    await step.handle[0].__aenter__()
                    if step.waiter.unconfirmed:
                        raise _unconfirmed(backend, step.handle[0].step)
            elif isinstance(step, Watch):
                awaiter = AsyncWaiter()
                watches.append((step.channel, awaiter))  # as in _drive
                watching = _Watching(backend, step, awaiter)
                try:
                    reply = (watching, await watching.__aenter__(), step.channel)
                    while watching.moved():  # as in _drive
                        reply = (watching, await watching.__aenter__(), step.channel)
                except Exception:
                    _not_watching(backend, step)
                    watches.remove((step.channel, awaiter))
                    raise
                if reply[1].unconfirmed:
                    if step.leave is not None:
                        backend.hub.settle(step.channel)
                    await watching.__aexit__(None, None, None)
                    watches.pop()
                    raise _unconfirmed(backend, step)
            else:
                await step.handle[0].__aexit__(None, None, None)
                _left(watches, step.handle)
        except GeneratorExit:
            # This coroutine is being closed (a loop torn down with the task pending, the
            # task collected): nothing can be awaited any more, and throwing the exit into
            # the steps would make their clean-up await again ("ignored GeneratorExit").
            # adrive hands them to the finisher (_finish_closed).
            raise
        except BaseException as exc:
            if _not_running(loop):
                # A close all the same, outside its loop: a clean-up on its way up needed the
                # loop and replaced the GeneratorExit (redis-py's disconnect: "no running event
                # loop", or "Event loop is closed" when collected inside the next request's
                # loop). Thrown into the steps, their hand-back would await in vain (reviews
                # wai2 4, asy4 1: the grant was held by nobody to its TTL).
                raise GeneratorExit from exc
            if isinstance(exc, (BackendUnavailable, QuorumNotReached)):
                observe.backend_error(backend)
            error = exc
        error = cancels.lost(error)  # a swallowed cancellation: thrown in at this step


def _not_running(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is not the one running in this thread (none, or another)."""
    try:
        return asyncio.get_running_loop() is not loop
    except RuntimeError:
        return True


def _given(steps: Steps[None]) -> Steps[None]:
    return steps


def _finish_closed(
    backend: BaseLockBackend, steps: Steps[Any], watches: list[Any], undo: Undo | None
) -> None:
    """The clean-up of steps whose async driver was closed, on the finisher thread.

    Never inline at the close: the collector closes a coroutine at any allocation, in any
    thread, maybe one holding a lock the clean-up's I/O or thread starts need (a stall, or
    a deadlock). So :func:`adrive` only hands this over (:func:`.finisher.hand`); it runs
    soon after, on a thread that already exists, each round trip bounded by its socket
    timeout. Not done when ``close()`` returns (docs/topics/asyncio.md).

    The rule of every step generator holds here too: an interruption while a reply may be on
    its way is thrown into the steps (as a cancellation), which hand back what may have been
    granted, leave a queue and stop watching. Those steps run here with the sync backend,
    a sleep is skipped and an async watch is left without awaiting (leaving is synchronous
    underneath). Errors of the clean-up are thrown into the steps like any step's; what the
    steps raise at the end is dropped. Then the watches the steps left open are left, and
    ``undo`` (an acquire's hand-back) runs, as :func:`adrive` does on any other exception.
    """
    try:
        _finish_steps(backend, steps)
    finally:
        try:
            _leave_watches(backend, watches)
        finally:
            if undo is not None:
                with contextlib.suppress(Exception):  # (the caller raised what interrupted it)
                    finish_now(backend, functools.partial(drive, backend, undo()))


def _finish_steps(backend: BaseLockBackend, steps: Steps[Any]) -> None:
    # Thrown in as a cancellation: a GeneratorExit thrown into a generator that delegates
    # (``yield from``) closes the inner one first, whose clean-up could then not yield.
    error: BaseException | None = asyncio.CancelledError()
    reply: Any = None
    while True:
        try:
            step = steps.send(reply) if error is None else steps.throw(error)
        except BaseException:  # StopIteration, the exit itself, or the clean-up's error
            return
        reply, error = None, None
        try:
            if isinstance(step, Op):
                reply = finish_now(backend, functools.partial(backend.execute, step))
            elif isinstance(step, Sleep):
                reply = False
            elif isinstance(step, Watch):
                raise asyncio.CancelledError  # no new waiting once closed
            else:
                _exit_now(step.handle[0])
        except BaseException as exc:
            error = exc


def _exit_now(watching: Any) -> None:
    """Leave an async watch without an event loop: its exit does not await (it only leaves
    the in-process registry), so one ``send`` finishes it."""
    exiting = watching.__aexit__(None, None, None)
    try:
        exiting.send(None)
    except StopIteration:
        return
    exiting.close()
    raise RuntimeError("an async watch's exit awaited: it cannot be left once closed")
