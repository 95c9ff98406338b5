"""The asyncio driver of a campaign client (client.py): the same holds, awaited.

Half the clients (harness.py draws which, from the seed) run each hold in asyncio through
the public async API (``aacquire``, ``arelease``, ``aextend``, ``aowned``, ``alocked``),
logging the very events the sync path logs (client.py's docstring), with the same fenced
writes: the resource is a plain Redis, written with the sync client in the task (one
round trip on a loopback that no fault touches: the writes keep their order in the task,
and their fence is the hold's). So the checker judges them as it judges sync holds.

How a hold is run (drawn per hold):

* on the client's own loop, kept for its life (most holds);
* through asgiref: ``async_to_sync`` (a loop per call, as an async view under WSGI: shut down,
  and its pools closed, when the call ends), or the whole sync hold in ``sync_to_async``
  (asgiref's shared thread: a reentrant hold is that call's, so it is taken and released
  there). The main thread waits meanwhile: a signal then lands when the call is over
  (:func:`.interrupts.deferred`);
* while the nemesis' ``client_interrupt`` is on (its flag file): in an ``asyncio.run`` that
  ends 0.2 ms-0.3 s into the hold with its task still pending (the run's shutdown cancels
  it: the task's clean-up, and the library's own, run in a loop that is being shut down),
  or on a fresh loop closed 0.2 ms-0.3 s in without cancelling its task (the call is left
  pending for good, as a loop whose thread ended leaves it; not for holds of an owner, a
  reentrant hold or a read: nothing but their task could release them). The client then
  logs ``intr`` (``how`` ``loop-closed``) and releases the object from sync code, as
  ``interrupts.caught`` does. Neither runs the whole sync hold in asgiref's thread, which
  runs on whatever the loop: the release would delete what its acquire was granted there.

Interrupts: besides the signal (interrupts.py), a call armed while ``client_interrupt`` is on
gets ``task.cancel()`` at a random moment within it (:meth:`.Interrupts.cancels`), sometimes
several. A cancelled hold is cleaned up in its task as ``async with`` does: ``intr`` (``how``
``cancel``), then ``arelease()`` until the object holds no more (``intr_rel``).

Loop blocks (the ``loop_block`` move, :class:`LoopBlocks`): one call in five (acquire with its
wait, release) gets sync code run on the client's loop at a random moment within it, as
another task's sync ORM call or a full GC would: ``time.sleep`` of 0.2-1.5 s, and half the
time one or two more, each 0.2-5 ms after the last (a chatty sync loop: a try sent as the
first ends is in flight during the next). Each is logged as ``loop_block`` with its start
and end (``t0``, ``t1``): the loop's busyness is not counted against the server
(docs/topics/asyncio.md), so the checker's ``unavailable-on-healthy`` does not excuse it;
its time properties discount it.

Reentrant kind: one hold in four runs two tasks of the process on the one ``Lock`` object at
once (the second a hold number of its own, started 0-20 ms after the first): each task is an
owner of its own (docs/topics/lock-kinds.md), so the second must wait for the first, or be
refused; both write to the resource, so two holders are ``overlap-accepted`` there.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
import weakref
from collections.abc import Iterator
from typing import Any

from . import interrupts
from .moves import Moves

#: How often a call gets a loop block, and how long one lasts (s).
BLOCK_ODDS = 0.2
BLOCK = (0.2, 1.5)


class LoopBlocks:
    """The ``loop_block`` move: the loop blocked by sync code at a random moment of a call."""

    def __init__(self, ctx: Any) -> None:
        self.on = bool(ctx.config.get("loop_block"))
        self.log = ctx.log
        # A generator of its own: the holds' and the driver's draws stay what they were.
        self.rng = random.Random(int(ctx.config.get("seed") or 0) * 7919 + 5)

    @contextlib.contextmanager
    def within(self, call: str, horizon: float) -> Iterator[None]:
        """Around one awaited call, on its loop: ``horizon`` s, how long the call may last."""
        rng = self.rng
        if not self.on or rng.random() >= BLOCK_ODDS:
            yield
            return
        # Half early (its first round trip in flight), half anywhere in the call (a wait).
        at = rng.uniform(0.0002, 0.005) if rng.random() < 0.5 else rng.uniform(0.0002, horizon)
        lengths = [rng.uniform(*BLOCK)]
        if rng.random() < 0.5:
            lengths += [rng.uniform(*BLOCK) for _ in range(rng.randint(1, 2))]
        loop, handles = asyncio.get_running_loop(), []
        for length in lengths:
            handles.append(loop.call_later(at, self.block, call, length))
            at += length + rng.uniform(0.0002, 0.005)  # the loop runs a few ms between
        try:
            yield
        finally:
            for handle in handles:
                handle.cancel()

    def block(self, call: str, length: float) -> None:
        t0 = time.time()
        time.sleep(length)  # sync code on the loop: nothing else of it runs meanwhile
        self.log("loop_block", call=call, t0=t0, t1=time.time())


#: How often a hold on the client's own loop gets the ``teardown`` move.
TEAR_ODDS = 0.06


class TornDown(KeyboardInterrupt):
    """Raised by a callback on the client's loop (so that it leaves ``run_until_complete``
    at once, as a signal's exception does): the ``teardown`` move's moment within a call."""


class Teardowns:
    """The ``teardown`` move (unless ``CAMPAIGN_EXCLUDE=teardown``): the client's own loop
    torn down while a lock call of its hold is pending (report asy3 1, wai2 4), at a random
    moment within the acquire (its first round trip in flight, or its wait) or the release
    (``async with``'s, as ``__aexit__`` sends it): ``close``, ``run_until_complete()`` left
    with the task pending, then ``loop.close()``, the task left to the collector (the library
    hands its clean-up to its finisher thread); or ``shutdown``, as ``asyncio.run``'s end
    (every task cancelled and run out, async generators shut down, the loop closed). The
    client then goes on with a new loop, and does not touch the hold's object again: what
    its name holds afterwards is the library's (the ``nobody`` look, moves.py)."""

    def __init__(self, ctx: Any) -> None:
        self.on = bool(ctx.config.get("teardown"))
        self.rng = random.Random(int(ctx.config.get("seed") or 0) * 4243 + 1)  # its own
        self.plan: dict[str, Any] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the driver's (set by it)

    def draw(self, eligible: bool) -> dict[str, Any] | None:
        rng, self.plan = self.rng, None
        if self.on and eligible and rng.random() < TEAR_ODDS:
            self.plan = {
                "call": "acquire" if rng.random() < 0.6 else "release",
                "how": "close" if rng.random() < 0.5 else "shutdown",
                "early": rng.random() < 0.5,  # its first round trip in flight
                "share": rng.random(),
            }
        return self.plan

    @contextlib.contextmanager
    def within(self, call: str, horizon: float) -> Iterator[None]:
        plan = self.plan
        if plan is None or plan["call"] != call or plan.get("fired"):
            yield
            return
        at = 0.0002 + 0.005 * plan["share"] if plan["early"] else horizon * plan["share"]
        inside = [True]

        def fire() -> None:
            if inside[0]:  # only while the call is under way (not once it returned)
                plan["fired"] = time.time()
                raise TornDown("teardown")

        loop = asyncio.get_running_loop()
        if loop is not self.loop:  # only the client's own loop is torn down (on_loop's)
            yield
            return
        handle = loop.call_later(at, fire)
        try:
            yield
        finally:
            inside[0] = False
            handle.cancel()


class Driver:
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.tears = Teardowns(ctx)
        self.loop = asyncio.new_event_loop()
        #: Its own draws (which way a hold runs): the hold's own stay the client's.
        self.rng = random.Random(ctx.rng.random())
        self.blocks = LoopBlocks(ctx)
        self.last = 0  # the last hold number used (a twin takes one more)

    # -- how a hold is run -------------------------------------------------------------------

    def hold(self, lk: Any, hold: int, prefix: str, role: str) -> None:
        """Run one hold (two, with a twin: :attr:`last` says the last hold number used)."""
        ctx, rng = self.ctx, self.rng
        self.tears.plan = None  # a plan never outlives its hold (an interrupt may end it)
        twin = ctx.kind == "reentrant" and rng.random() < 0.25
        self.last = hold + 1 if twin else hold  # taken even if an interrupt cuts it short
        roll = rng.random()
        owned = ctx.kind == "reentrant" or role == "r"
        if ctx.armed.active() and roll < 0.12:
            self.run_ended(lk, hold, prefix, role, twin)
        elif ctx.armed.active() and roll < 0.24 and not owned:
            self.loop_closed(lk, hold, prefix, role)
        elif roll > 0.9:
            from asgiref.sync import async_to_sync

            with interrupts.deferred():
                async_to_sync(self.run)(lk, hold, prefix, role, twin)
        else:
            # Not for an owner's hold (a reentrant one, a read: a closed task's is not handed
            # over, docs/topics/asyncio.md), nor twins, nor on the whole sync path.
            self.tears.draw(not owned and not twin)
            try:
                self.on_loop(lk, hold, prefix, role, twin)
            finally:
                self.tears.plan = None

    def on_loop(self, lk: Any, hold: int, prefix: str, role: str, twin: bool) -> None:
        task = self.loop.create_task(
            self.run(lk, hold, prefix, role, twin, thread=not self.tears.plan)
        )
        torn = False
        try:
            while True:
                try:
                    self.loop.run_until_complete(task)
                    break
                except TornDown:
                    torn = True
                    break
                except RuntimeError:
                    if task.done():
                        raise  # the hold's own
                    # "Event loop stopped before Future completed": a stop an interrupted run
                    # left pending (an interrupt out of a loop block, say): run on.
        except BaseException:
            # A signal raised in the loop (in a task, or outside: then its task is pending):
            # as an interrupt ending `asyncio.run` would, every task still pending (a twin,
            # the library's own: a hand-back, a release finished aside) is cancelled and
            # finished, before the interrupt goes on to the client's loop.
            self.settle(cancel=True)
            raise
        if torn:
            # Only a weak reference kept: this frame must not keep the task from the
            # collector (the library's clean-up of a closed task starts at its collection).
            gone = weakref.ref(task)
            del task
            self.teardown(hold, gone)
            return
        self.settle(cancel=False)  # the library's own tasks, before the loop stops a while

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @loop.setter
    def loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = self.tears.loop = loop

    def teardown(self, hold: int, gone: weakref.ref[asyncio.Task[None]]) -> None:
        """The ``teardown`` move (:class:`Teardowns`): the loop torn down under the call.
        ``gone``: the hold's task, which nothing of the client's keeps any more."""
        plan, loop, log = self.tears.plan or {}, self.loop, self.ctx.log
        fired = plan.get("fired") or time.time()
        if plan.get("how") == "shutdown":  # as asyncio.run's end
            self.settle(cancel=True)
            for step in (loop.shutdown_asyncgens, loop.shutdown_default_executor):
                with contextlib.suppress(Exception):
                    loop.run_until_complete(step())
        else:  # the task left pending for good: the collector closes it, in a while
            log("intr", h=hold, where="teardown", how="loop-closed")
        loop.close()
        self.loop = asyncio.new_event_loop()  # the client goes on with a new one
        del loop
        gc.collect()  # now, rather than at some later allocation: the look is timed from here
        # Whether the collector could close it: a task still reachable (from the lock object,
        # say) is never closed while that lives, and its clean-up never handed over.
        log("teardown", h=hold, call=plan.get("call"), how=plan.get("how"), t0=fired,
            collected=gone() is None)  # fmt: skip
        if self.ctx.look is not None:
            self.ctx.look.update(how="teardown", cut=fired, teardown=plan.get("how"))

    def settle(self, cancel: bool) -> None:
        loop, deadline = self.loop, time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:  # a burst of signals may land anywhere in here: each step is retried
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                if not pending:
                    return
                if cancel:
                    for each in pending:
                        each.cancel()
                loop.run_until_complete(asyncio.wait(pending, timeout=0.5))
            except interrupts.RAISED:
                continue
            except RuntimeError:  # "Event loop stopped before Future completed": a stop
                continue  # an interrupted run left pending (seed 2012): the next step runs

    def run_ended(self, lk: Any, hold: int, prefix: str, role: str, twin: bool) -> None:
        """``asyncio.run`` whose main coroutine returns with the hold's task still pending."""
        delay = self.rng.choice((self.rng.uniform(0.0002, 0.005), self.rng.uniform(0.005, 0.3)))

        async def main() -> None:
            # Not in asgiref's thread (thread=False): the cancelled task releases the Lock
            # while that thread runs on (see loop_closed).
            hold_run = self.run(lk, hold, prefix, role, twin, thread=False)
            task = asyncio.get_running_loop().create_task(hold_run)
            await asyncio.wait([task], timeout=delay)

        asyncio.run(main())

    def loop_closed(self, lk: Any, hold: int, prefix: str, role: str) -> None:
        """A fresh loop closed under the call, its task not cancelled: left pending."""
        from django_redlock import LockError

        delay = self.rng.choice((self.rng.uniform(0.0002, 0.005), self.rng.uniform(0.005, 0.3)))
        loop = asyncio.new_event_loop()
        # Never the whole sync hold in asgiref's thread (thread=False): that thread is no call
        # left pending, it runs on, and the release below would delete the hold its acquire
        # was just granted there (phantom-hold, seed 2115: the client's misuse).
        task = loop.create_task(self.run(lk, hold, prefix, role, False, thread=False))
        try:
            loop.run_until_complete(asyncio.wait([task], timeout=delay))
        finally:
            done = task.done()
            loop.close()
        if not done:
            interrupts.caught(self.ctx.log, hold, lk, LockError, "loop-closed", "loop-closed")

    # -- one hold, in a task -------------------------------------------------------------------

    async def run(
        self, lk: Any, hold: int, prefix: str, role: str, twin: bool, thread: bool = True
    ) -> None:
        """``thread``: the hold may run whole in asgiref's thread (see :meth:`one`)."""
        if not twin:
            await self.task(lk, hold, prefix, role, thread)
            return
        loop = asyncio.get_running_loop()
        first = loop.create_task(self.task(lk, hold, prefix, role))
        await asyncio.sleep(self.rng.uniform(0, 0.02))  # the second while the first holds
        second = loop.create_task(self.task(lk, hold + 1, f"{self.ctx.cid}h{hold + 1}.", role))
        await asyncio.gather(first, second)

    async def task(self, lk: Any, hold: int, prefix: str, role: str, thread: bool = True) -> None:
        from django_redlock import LockError

        try:
            await self.one(lk, hold, prefix, role, thread)
        except asyncio.CancelledError:
            # As `async with` does: release in the task, however often cancelled meanwhile.
            place = interrupts.where()
            self.uncancel()
            self.ctx.log("intr", h=hold, where=place, how="cancel")
            if self.ctx.look is not None:
                self.ctx.look.update(how="cut", cut=time.time())
            for _ in range(6):
                try:
                    await lk.arelease()
                    self.ctx.log("intr_rel", h=hold, ok=True)
                except LockError as exc:
                    self.ctx.log("intr_rel", h=hold, ok=False, err=type(exc).__name__)
                    return
                except asyncio.CancelledError:
                    self.uncancel()
                    continue

    @staticmethod
    def uncancel() -> None:
        task = asyncio.current_task()
        while task is not None and task.cancelling():
            task.uncancel()

    async def one(self, lk: Any, hold: int, prefix: str, role: str, thread: bool = True) -> None:
        from django_redlock import LockError

        ctx = self.ctx
        rng, log, check, holds = ctx.rng, ctx.log, ctx.check, ctx.holds
        # Drawn whatever ``thread`` says: a seed's later draws stay what they were.
        threaded = self.rng.random() < 0.1
        if threaded and thread:  # the whole sync hold in asgiref's thread
            from asgiref.sync import sync_to_async

            from .client import sync_hold

            with interrupts.deferred():
                await sync_to_async(sync_hold)(ctx, lk, hold, prefix, role)
            return
        blocking = rng.random() < 0.8
        timeout = rng.choice([0.5, 1.0, 2.0, 3.0, 4.0]) if blocking else None
        moves = Moves(ctx, hold, prefix, role, timeout or 0.05, cut=self.canceller())
        if self.tears.plan is not None:
            moves.start_look()
        while True:  # an unknown outcome may be tried again at once (moves.py: retry)
            log("acq", h=hold, mode="block" if blocking else "try", timeout=timeout, role=role,
                **moves.tag(hold))  # fmt: skip
            horizon = timeout or 0.05
            try:
                with (
                    ctx.armed.cancels(horizon),
                    self.blocks.within("acquire", horizon),
                    self.tears.within("acquire", horizon),
                    moves.wired("acquire", hold),
                ):
                    got = await lk.aacquire(blocking=blocking, timeout=timeout)
            except LockError as exc:
                log("acq_err", h=hold, err=type(exc).__name__, msg=str(exc)[:300])
                if moves.retry(exc):
                    # The retry: a number of its own (past a twin's too).
                    hold = ctx.last = self.last = max(hold, self.last, ctx.last) + 1
                    continue
                await asyncio.sleep(rng.uniform(0.01, 0.1))
                return
            break
        if not got:
            log("acq_no", h=hold)
            moves.ended("refused")
            await asyncio.sleep(rng.uniform(0, 0.02))
            return
        fence = lk.fence
        holds[id(lk)] = (hold, prefix, fence)
        log("acq_ok", h=hold, fence=fence)
        check(hold, "acquired", prefix, fence)
        if fence is None:
            log("bad", h=hold, what="acquired, but fence is None")
            fence = -1
        # A teardown planned within the release: the hold is inside `async with` from here
        # (its release is __aexit__'s), so that a close anywhere on is the library's to clean
        # up, as the docs promise for `async with`; a plain acquire's hold is the caller's.
        exits = contextlib.AsyncExitStack()
        inside = self.tears.plan is not None
        if inside:
            exits.push_async_exit(lk.__aexit__)
        async with exits:
            try:
                with ctx.armed.cancels(0.3):
                    await self.body(lk, hold, prefix, fence, role)
            except LockError as exc:
                log("nest_err", h=hold, err=type(exc).__name__, msg=str(exc)[:300])
            check(hold, "releasing", prefix, fence)  # whether a loss at release can be right
            with (
                ctx.armed.cancels(0.01),
                self.blocks.within("release", 0.01),
                self.tears.within("release", 0.05),
                moves.wired("release"),
            ):
                released = await self.release(lk, hold, exits if inside else None)
            moves.ended("released" if released else "rel_err")
        if released:
            check(hold, "released", prefix, fence)
        await asyncio.sleep(rng.uniform(0, 0.03))

    async def body(self, lk: Any, hold: int, prefix: str, fence: int, role: str) -> None:
        """client.hold_body's steps, awaited."""
        ctx = self.ctx
        rng, log, ttl, cid = ctx.rng, ctx.log, ctx.ttl, ctx.cid
        reentrant = ctx.kind == "reentrant"

        def write(phase: str) -> None:
            until = ctx.expiry(prefix, fence) if role == "s" else None
            ok, last = ctx.resource.write(cid, hold, fence, phase, role, until)
            log("write", h=hold, phase=phase, fence=fence, ok=ok, last=last, role=role,
                expiry=until)  # fmt: skip

        write("begin")
        for _ in range(rng.randint(0, 3)):
            roll = rng.random()
            if roll < 0.04:
                await asyncio.sleep(rng.uniform(0.8 * ttl, 1.8 * ttl))  # the watchdog renews
            elif roll < 0.2:
                await asyncio.sleep(rng.uniform(0.02, 0.15))
            else:
                await asyncio.sleep(rng.uniform(0, 0.01))
            if (reentrant or role == "r") and rng.random() < 0.3:  # reads are reentrant
                again = await lk.aacquire(blocking=False)
                log("nest", h=hold, ok=again, fence=lk.fence)
                if again:
                    write("work")
                    await lk.arelease()
                    log("unnest", h=hold)
            write("work")
            if rng.random() < 0.2:
                await self.ask(lk, hold, prefix, fence, role)
            await self.extend(lk, hold)
        write("end")

    async def ask(self, lk: Any, hold: int, prefix: str, fence: int, role: str) -> None:
        """client.main's ask(), awaited: False must mean not held."""
        from django_redlock import LockError

        ctx = self.ctx
        question = "owned" if role in ("s", "r") else ctx.rng.choice(["owned", "locked"])
        t0 = time.time()
        try:
            answer = await getattr(lk, "a" + question)()
        except LockError as exc:
            ctx.log("ask", h=hold, q=question, err=type(exc).__name__, msg=str(exc)[:300],
                    since=t0)  # fmt: skip
            return
        ctx.log("ask", h=hold, q=question, answer=answer)
        if answer is False:
            ctx.check(hold, f"{question}_false", prefix, fence)

    async def extend(self, lk: Any, hold: int) -> None:
        """client.maybe_extend, awaited."""
        from django_redlock import LockError

        ctx = self.ctx
        if ctx.rng.random() >= 0.25:
            return
        new = ctx.ttl * ctx.rng.choice((0.6, 0.8, 1.0))
        t0 = time.time()
        try:
            await lk.aextend(new)
        except LockError as exc:
            ctx.log("ext_err", h=hold, ttl=new, err=type(exc).__name__, msg=str(exc)[:300],
                    since=t0)  # fmt: skip
            return
        ctx.log("ext", h=hold, ttl=new)

    def canceller(self) -> Any:
        """The wire move's cut of this task's call (from another thread): ``task.cancel()``."""
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def cut() -> None:
            with contextlib.suppress(RuntimeError):  # its loop closed by then
                if task is not None:
                    loop.call_soon_threadsafe(task.cancel)

        return cut

    async def release(
        self, lk: Any, hold: int, exits: contextlib.AsyncExitStack | None = None
    ) -> bool:
        """client.release, awaited: after an unknown outcome, once more half of the time.
        ``exits``: the hold is inside `async with` (a teardown's), released by its exit."""
        from django_redlock import LockError, LockLost

        ctx = self.ctx
        for attempt in range(2):
            t0 = time.time()
            try:
                if exits is not None and not attempt:
                    await exits.aclose()  # __aexit__(None, None, None): the release
                else:
                    await lk.arelease()
                ctx.log("rel_ok", h=hold, attempt=attempt, since=t0)
                return True
            except LockLost as exc:
                ctx.log("rel_err", h=hold, err=type(exc).__name__, msg=str(exc)[:300],
                        attempt=attempt, since=t0)  # fmt: skip
                return False
            except LockError as exc:
                ctx.log("rel_err", h=hold, err=type(exc).__name__, msg=str(exc)[:300],
                        attempt=attempt, since=t0)  # fmt: skip
                if ctx.rng.random() < 0.5:
                    return False
                await asyncio.sleep(0.05)
        return False
