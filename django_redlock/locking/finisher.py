"""The finisher: one long-lived thread per process that runs the clean-ups a finalizer hands
over.

The rule: a finalizer (a coroutine closed by the garbage collector, ``__del__``,
``weakref.finalize``) runs at whatever allocation triggered the collection, in any thread,
possibly one holding a lock it cannot take twice (a pool's, an import lock, threading's own
inside ``Thread.start()``). So it does no I/O, starts no thread and takes no lock: it only
:func:`hand` s its clean-up over (``SimpleQueue.put``, safe there), and the finisher runs it
soon after. The thread itself is started from an ordinary context (:func:`ensure_started`,
as an async operation begins), never from a finalizer; a forked child starts afresh.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from .. import forks
from ..waiters import start_thread

logger = logging.getLogger("django_redlock")
T = TypeVar("T")

#: How long the interpreter's exit waits for the clean-ups still queued (each round trip is
#: bounded by its socket timeout; what is left runs out at its TTL, or its waiter's lease).
EXIT_WAIT = 2.0


class _Finisher:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self.mutex = threading.Lock()
        self.running = False  # set before the thread starts, cleared as it ends
        self.thread: threading.Thread | None = None


_finisher = [_Finisher()]  # (a list: a forked child swaps in its own)


def ensure_started() -> None:
    """Start the finisher unless it runs. Call it from an ordinary context only (never a
    finalizer). No thread to be had is not an error here: the jobs wait in the queue for a
    later start (a waiter's place lapses meanwhile with its lease, a hold at its TTL)."""
    finisher = _finisher[0]
    if finisher.running:  # (the common case: one attribute read)
        return
    with finisher.mutex:
        if finisher.running:
            return
        thread = threading.Thread(
            target=_run, args=(finisher,), name="redlock-finisher", daemon=True
        )
        finisher.running, finisher.thread = True, thread
        try:
            start_thread(thread)
        except RuntimeError as exc:  # "can't start new thread" (an interrupt is raised)
            finisher.running = False
            logger.debug("redlock: no finisher thread: %s", exc)
        except BaseException:
            finisher.running = thread.is_alive()
            raise


#: Where a loop that takes no attributes (uvloop's) keeps its finishing tasks: for good, as
#: every loop's did before (a closed loop's pending one is then never collected).
_kept_anywhere: set[asyncio.Task[Any]] = set()


def finishing_task(
    loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, T], then: Callable[[], object]
) -> asyncio.Task[T]:
    """A task of ``loop`` running ``coroutine`` (the finish of an interrupted release), kept
    until it is done: the event loop keeps only weak references to tasks. Kept by its own
    loop, not the module: a module-level set kept a task its loop was closed with, that
    loop and the lock for good, and the release never ran (review asy 6).

    Should the task never end (its loop closed with it pending, then collected), ``then`` is
    handed over here: as its coroutine is closed, or, when it never took its first step (a
    close then runs none of its code), as the task itself is collected (review asy3 1). A
    task that ends runs neither: its done-callbacks see to it."""
    # Until the task's first step: what its collection has to close (then let go, so that no
    # finalizer keeps a started coroutine, and through it its loop, from the collector).
    unstarted: list[Coroutine[Any, Any, Any]] = []

    async def run() -> T:
        unstarted.clear()
        try:
            return await coroutine
        except GeneratorExit:
            hand(then)
            raise

    def collected() -> None:  # a finalizer: no I/O, only a hand-over
        if unstarted:
            for each in unstarted:
                each.close()  # (never started: runs nothing of them; no "never awaited")
            unstarted.clear()
            hand(then)

    runner = run()
    unstarted += [runner, coroutine]
    task = loop.create_task(runner)
    gone = weakref.finalize(task, collected)
    kept: set[asyncio.Task[Any]] | None = getattr(loop, "django_redlock_finishing", None)
    if kept is None:
        kept = set()
        try:
            loop.django_redlock_finishing = kept  # type: ignore[attr-defined]
        except AttributeError:
            kept = _kept_anywhere
    kept.add(task)
    task.add_done_callback(kept.discard)
    task.add_done_callback(lambda _: gone.detach())
    return task


def in_collection() -> bool:
    """Whether this thread is in a garbage collection: a finalizer that runs now may be at
    any allocation, and hands its work over. Only the collecting thread's: another thread,
    running while a collection's finalizer lets the GIL go, awaits as ever (an async
    generator's ``aclose()`` on its running loop returned before its release; review asy4
    6). The collector runs finalizers, and its callbacks, in the thread that collects."""
    return _collecting_thread[0] == threading.get_ident()


def must_hand_over() -> bool:
    """Whether a coroutine closed now (GeneratorExit) hands its clean-up over instead of
    awaiting it: inside a collection (a finalizer), or with no loop running (closed after its
    loop). An async generator's ``aclose()`` on its running loop awaits as ever."""
    if in_collection():
        return True
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # (a close is rare: the raise costs nothing that matters)
        return True
    return False


#: The thread whose collection is under way (gc.callbacks: a "start", then a "stop"; one
#: collection at a time in the process: another thread's allocation does not start one).
_collecting_thread: list[int | None] = [None]


def _collecting(phase: str, info: dict[str, int]) -> None:
    # No lock, no I/O: one list store (this runs inside the collection).
    _collecting_thread[0] = threading.get_ident() if phase == "start" else None


gc.callbacks.append(_collecting)


class Exiting(Protocol):
    """A lock a block holds (``Lock``, ``lock_all``'s ``MultiLock``)."""

    async def arelease(self) -> None: ...
    def finish_release_later(self) -> None: ...
    def release_closed(self) -> None: ...


async def arelease_exiting(held: Exiting) -> None:
    """``held.arelease()`` as a block's exit (``async with``, ``lock_all``, an async
    ``lock_view``). Cancelled inside (a second cancellation, say, in a pooled connection's
    wait), it is finished by a task of its own. Closed inside (its loop torn down as it
    waited), the driver's hand-over leaves the hold "releasing", sent or not: the finisher
    sends it once more after it (review asy3 1; one copy for all three, review asy4 5)."""
    try:
        await held.arelease()
    except asyncio.CancelledError:
        held.finish_release_later()
        raise
    except GeneratorExit:
        if must_hand_over():
            held.release_closed()
        raise


def hand(job: Callable[[], object]) -> None:
    """Run ``job`` on the finisher thread, soon. Safe from a finalizer: one ``put``, no lock
    taken, no thread started. Errors of the job are logged (debug) and dropped."""
    _finisher[0].jobs.put(job)


def on_finisher() -> bool:
    """Whether this thread is the finisher (running a closed coroutine's clean-up)."""
    return threading.current_thread() is _finisher[0].thread


def wait_finished(timeout: float) -> bool:
    """Whether every job handed over before this call ran within ``timeout`` seconds. Not
    from a finalizer, nor from a job."""
    finisher = _finisher[0]
    if not finisher.running:
        return finisher.jobs.empty()
    done = threading.Event()
    finisher.jobs.put(done.set)
    return done.wait(timeout)


def _run(finisher: _Finisher) -> None:
    try:
        while True:
            job = finisher.jobs.get()
            try:
                job()
            except Exception as exc:
                logger.debug("redlock: a clean-up handed to the finisher failed: %s", exc)
    finally:
        finisher.running = False


@atexit.register
def _at_exit() -> None:
    # Jobs already handed over get a short while (the finisher is a daemon thread).
    wait_finished(EXIT_WAIT)


@forks.after_fork_in_child
def _forget_finisher() -> None:
    # The parent's jobs are the parent's (its holds, its waiters), and its thread is not
    # the child's: the child starts its own on its first async operation.
    _finisher[0] = _Finisher()
