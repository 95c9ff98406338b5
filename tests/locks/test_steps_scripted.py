"""The step generators (the sans-IO core of every lock operation) run by a scripted driver.

Each lock operation is a generator that yields steps (a backend ``Op``, a watch, a sleep) and
gets their replies; :func:`~django_redlock.locking.steps.drive` and ``adrive`` run them on a
socket. Here :func:`scripted` runs them on a script instead: each step gets the reply (the
raw reply Redis sends, read by the op's own ``parse``) or the exception the script says, as
the drivers throw a step's error in. The ops are the real ones of a Redis backend (built
without connecting: the alias ``down`` points where nobody listens, and no test here
executes one), so every yield of an operation can be failed in turn:

- a lost reply (``BackendUnavailable``) leaves the hold unsure (the next try uses the same
  token, or a reentrant owner settles its count first), never held falsely, never lost;
- a cancellation (``CancelledError``, ``KeyboardInterrupt``, ``GeneratorExit``) hands back
  what may have been granted and records nothing;
- a re-entry nests with the hold's fence, and one with another fence is a lost hold;
- a hold is declared lost only on an answer that the token holds nothing, and once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from django_redlock import Lock, locks
from django_redlock.backends.base import Op
from django_redlock.exceptions import BackendUnavailable, LockError, LockLost, LockNotOwned
from django_redlock.locking.steps import Steps, Unwatch, Watch
from django_redlock.signals import lock_acquired, lock_lost

ALIAS = "down"  # a Redis backend nobody listens to: its ops are built, never sent

#: What answers a step: the raw reply, or an exception to throw into the steps.
Answer = Callable[[int, Any], Any]


class Waiter:
    """What a watch hands the steps: they clear ``baton`` after each try."""

    baton = False


class Watching:
    """A watch's context, left by ``Unwatch``."""

    left = False

    def __exit__(self, *exc: object) -> None:
        self.left = True


def script_of(step: Any) -> str:
    """Which operation a step is: the Lua script's name, a command, or the step's type."""
    if isinstance(step, Op):
        request = step.request
        return request.script.name if hasattr(request, "script") else str(request[0])
    return type(step).__name__


def scripted(steps: Steps[Any], answer: Answer) -> tuple[Any, list[Any]]:
    """Run ``steps`` to the end as the drivers do, with ``answer(i, step)`` as the reply to
    the i-th step: an ``Op``'s raw reply goes through its ``parse``; an exception raised by
    ``answer`` is thrown into the steps (whatever its type, as the drivers do). Returns the
    outcome and the steps seen; what the steps raise comes out.

    A ``GeneratorExit`` (the driver's coroutine being closed) is what ``adrive`` makes of
    it: thrown in as a cancellation, the clean-up run to its end, its outcome dropped, the
    exit raised (a generator's clean-up could not yield under a close)."""
    seen: list[Any] = []
    reply: Any = None
    error: BaseException | None = None
    closing = False
    while True:
        try:
            step = steps.send(reply) if error is None else steps.throw(error)
        except StopIteration as done:
            if closing:
                raise GeneratorExit from None
            return done.value, seen
        except BaseException:
            if closing:
                raise GeneratorExit from None
            raise
        seen.append(step)
        reply = error = None
        try:
            raw = answer(len(seen) - 1, step)
            if isinstance(step, Op):
                reply = step.parse(raw)
            elif isinstance(step, Watch):
                reply = (Watching(), Waiter())
            elif isinstance(step, Unwatch):
                step.handle[0].__exit__(None, None, None)
                reply = None
            else:
                reply = raw
        except GeneratorExit:
            closing, error = True, asyncio.CancelledError()
        except BaseException as exc:
            error = exc


def server(*, busy_first: int = 0, fence: int = 7, count: int = 1) -> Answer:
    """Real reply shapes: acquire.lua's ``[0, ms]`` (busy) ``busy_first`` times, then
    ``[1, fence, count]``; release.lua's hold count left (0: freed); leave/settle answered;
    a sleep not woken (the deadline or the hint ends it)."""
    tries = [0]

    def answer(i: int, step: Any) -> Any:
        name = script_of(step)
        if name == "acquire":
            tries[0] += 1
            return [0, 50] if tries[0] <= busy_first else [1, fence, count]
        if name == "release":
            return 0
        if name in ("settle", "extend"):
            return 1
        if name == "leave":
            return None
        return False  # Sleep: not woken

    return answer


def failing(at: int, error: Callable[[], BaseException], then: Answer) -> Answer:
    """``then``'s answers, but the ``at``-th step gets ``error`` instead of its reply."""

    def answer(i: int, step: Any) -> Any:
        if i == at:
            raise error()
        return then(i, step)

    return answer


def recording(answer: Answer) -> tuple[Answer, list[Any]]:
    """``answer``, and the list of the steps it answered (or failed)."""
    steps: list[Any] = []

    def record(i: int, step: Any) -> Any:
        steps.append(step)
        return answer(i, step)

    return record, steps


def lost_reply() -> BaseException:
    return BackendUnavailable("scripted: the reply never came")


@pytest.fixture
def sent() -> Iterator[dict[str, list[Any]]]:
    """The ``lock_lost`` and ``lock_acquired`` signals sent meanwhile."""
    got: dict[str, list[Any]] = {"lost": [], "acquired": []}

    def on_lost(sender: Any, lock: Any, reason: str, **_: Any) -> None:
        got["lost"].append(reason)

    def on_acquired(sender: Any, lock: Any, fence: Any, **_: Any) -> None:
        got["acquired"].append(fence)

    lock_lost.connect(on_lost)
    lock_acquired.connect(on_acquired)
    try:
        yield got
    finally:
        lock_lost.disconnect(on_lost)
        lock_acquired.disconnect(on_acquired)


def plain(name: str) -> Lock:
    """A lock (not renewed: no watchdog talks to the backend); fair if its name says so (a
    fair waiter queues with an id, and leaves the queue when it gives up)."""
    return Lock(f"scripted:{name}", using=ALIAS, auto_renew=False, ttl=10, fair="fair" in name)


def reentrant(name: str) -> Lock:
    return Lock(f"scripted:{name}", using=ALIAS, auto_renew=False, ttl=10, reentrant=True,
                fair="fair" in name)  # fmt: skip


def tokens(seen: list[Any]) -> list[str]:
    """The tokens the acquire ops carried (acquire.lua's first argument)."""
    return [step.request.args[0] for step in seen if script_of(step) == "acquire"]


def count_steps(make: Callable[[], Steps[Any]], answer: Answer) -> int:
    return len(scripted(make(), answer)[1])


# The operations failed at every yield: (label, how many tries are busy, blocking, timeout).
ACQUIRES = [
    ("one try", 0, False, None),
    ("waits", 2, True, 30.0),
    ("fair, waits in the queue", 2, True, 30.0),
]


def test_the_scripted_driver_runs_an_acquire_with_no_socket(sent: dict[str, list[Any]]) -> None:
    lk = plain("happy")
    before = locks[ALIAS].round_trips
    ok, seen = scripted(lk.acquire_steps(True, 30.0), server(busy_first=2))
    assert ok is True and lk.token is not None and lk.fence == 7
    assert [script_of(s) for s in seen] == [
        "acquire", "Watch", "acquire", "Sleep", "acquire", "Unwatch",
    ]  # fmt: skip
    assert len(set(tokens(seen))) == 1 and sent["acquired"] == [7]
    _, seen = scripted(lk.release_steps(), server())
    assert [script_of(s) for s in seen] == ["release"] and lk.token is None
    assert locks[ALIAS].round_trips == before  # nothing went to a socket


@pytest.mark.parametrize(("label", "busy", "blocking", "timeout"), ACQUIRES)
def test_a_lost_reply_at_any_yield_leaves_the_plain_hold_unsure(
    label: str, busy: int, blocking: bool, timeout: float | None, sent: dict[str, list[Any]]
) -> None:
    happy = server(busy_first=busy)
    total = count_steps(lambda: plain(f"count:{label}").acquire_steps(blocking, timeout), happy)
    for at in range(total):  # a try's reply, a watch, a sleep, leaving: each fails in turn
        lk = plain(f"lost:{label}:{at}")
        answer, tried = recording(failing(at, lost_reply, server(busy_first=busy)))
        with pytest.raises(LockError):
            scripted(lk.acquire_steps(blocking, timeout), answer)
        # Never reported held, never lost: unknown.
        assert lk.token is None and lk.fence is None and lk.lost is None
        # Unsure: the next try carries the lost try's token, and finds the hold if it was
        # taken (acquire.lua answers a token that holds it already as a hold).
        ok, seen = scripted(lk.acquire_steps(False, None), server(fence=8))
        assert ok and tokens(seen)[0] == tokens(tried)[0] == lk.token and lk.fence == 8
    assert sent["lost"] == []


@pytest.mark.parametrize(("label", "busy", "blocking", "timeout"), ACQUIRES)
def test_a_lost_reply_at_any_yield_makes_a_reentrant_owner_settle_first(
    label: str, busy: int, blocking: bool, timeout: float | None, sent: dict[str, list[Any]]
) -> None:
    total = count_steps(lambda: reentrant(f"n:{label}").acquire_steps(blocking, timeout),
                        server(busy_first=busy))  # fmt: skip
    lk = reentrant(f"settle:{label}")
    for at in range(total):
        with pytest.raises(LockError):
            scripted(lk.acquire_steps(blocking, timeout),
                     failing(at, lost_reply, server(busy_first=busy)))  # fmt: skip
        assert lk.token is None and lk.lost is None
        # The server's count may be one off: the next operation sets it to what we know (0)
        # before it tries, so a retry never counts twice.
        ok, seen = scripted(lk.acquire_steps(False, None), server())
        assert ok and [script_of(s) for s in seen] == ["settle", "acquire"]
        assert seen[0].request.args[1] == 0
        scripted(lk.release_steps(), server())
        assert lk.token is None
    assert sent["lost"] == []


CANCELS: list[Callable[[], BaseException]] = [
    asyncio.CancelledError,
    KeyboardInterrupt,
    GeneratorExit,
]


@pytest.mark.parametrize("cancel", CANCELS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("label", "busy", "blocking", "timeout"), ACQUIRES)
def test_a_cancellation_at_any_yield_of_an_acquire_records_nothing_and_hands_back(
    label: str,
    busy: int,
    blocking: bool,
    timeout: float | None,
    cancel: Callable[[], BaseException],
    sent: dict[str, list[Any]],
) -> None:
    total = count_steps(lambda: plain(f"n:{label}").acquire_steps(blocking, timeout),
                        server(busy_first=busy))  # fmt: skip
    sent["acquired"].clear()
    for at in range(total):
        lk = plain(f"cancel:{label}:{at}")
        answer, answers = recording(failing(at, cancel, server(busy_first=busy)))
        with pytest.raises(cancel):
            scripted(lk.acquire_steps(blocking, timeout), answer)
        assert lk.token is None and lk.fence is None and lk.lost is None
        names = [script_of(s) for s in answers]
        if script_of(answers[at]) == "acquire":  # a reply was on its way: handed back
            assert names[-1] in ("release", "Unwatch")
            assert "release" in names[at + 1 :]
            back = next(s for s in answers[at + 1 :] if script_of(s) == "release")
            assert back.request.args[0] == tokens(answers)[0]  # the try's own token
        # A watch begun (its reply given) is always left.
        begun = names.count("Watch") - (names[at] == "Watch")
        assert begun == names.count("Unwatch")
        if begun and "fair" in label and names[at] != "Unwatch":
            # A queued waiter without the grant leaves the queue, then stops watching (one
            # cancelled while leaving the watch had the grant: the hand-back frees it).
            assert names.index("leave") < names.index("Unwatch")
        # Nothing half-recorded: a fresh token next (the hand-back was answered), and the
        # next acquire is a plain new hold.
        ok, seen = scripted(lk.acquire_steps(False, None), server(fence=9))
        assert ok and lk.fence == 9 and tokens(seen)[0] not in tokens(answers)
    assert sent["lost"] == [] and sent["acquired"] == [9] * total


@pytest.mark.parametrize("cancel", [*CANCELS, lost_reply], ids=lambda c: c.__name__)
def test_a_lost_reply_or_cancellation_of_a_release_keeps_it_for_a_retry_never_lost(
    cancel: Callable[[], BaseException], sent: dict[str, list[Any]]
) -> None:
    lk = plain("release")
    assert scripted(lk.acquire_steps(False, None), server())[0]
    token = lk.token
    with pytest.raises(BackendUnavailable if cancel is lost_reply else cancel):
        scripted(lk.release_steps(), failing(0, cancel, server()))
    # Unknown: not counted as held, and not lost; the retry finishes it, a token gone then
    # being no loss (our own release freed it).
    assert lk.token is None or lk.token == token
    _, seen = scripted(lk.acquire_steps(False, None), lambda i, s: -1 if i == 0 else [1, 8, 1])
    assert script_of(seen[0]) == "release" and seen[0].request.args[0] == token
    assert lk.fence == 8 and sent["lost"] == []


def test_a_reentry_nests_in_the_hold_and_keeps_its_fence(sent: dict[str, list[Any]]) -> None:
    lk = reentrant("nest")
    assert scripted(lk.acquire_steps(False, None), server(fence=5, count=1))[0]
    assert scripted(lk.acquire_steps(False, None), server(fence=5, count=2))[0]
    assert lk.fence == 5 and sent["acquired"] == [5]  # one hold, signalled once
    _, seen = scripted(lk.release_steps(), lambda i, s: 1)  # one level left
    assert lk.token is not None and [script_of(s) for s in seen] == ["release"]
    scripted(lk.release_steps(), server())
    assert lk.token is None and sent["lost"] == []


@pytest.mark.parametrize("retries", [0, 1, 2])
def test_a_nested_release_with_no_answer_counts_once_retried_or_not(
    retries: int, sent: dict[str, list[Any]]
) -> None:
    """Three objects of one owner nested; the inner release gets no answer, whether the
    server ran it or not (the client cannot tell). A retry only settles the count this
    process knows (2): sending the release again would count it twice. The ``retries``-th
    retry is answered (the ones before lose the settle's reply too)."""
    outer, middle, inner = (Lock("scripted:once", using=ALIAS, auto_renew=False, ttl=10,
                                 reentrant=True) for _ in range(3))  # fmt: skip
    for count, lk in enumerate((outer, middle, inner), 1):
        assert scripted(lk.acquire_steps(False, None), server(fence=5, count=count))[0]
    with pytest.raises(BackendUnavailable):
        scripted(inner.release_steps(), failing(0, lost_reply, server()))
    for attempt in range(retries):
        answer = server() if attempt == retries - 1 else failing(0, lost_reply, server())
        try:
            _, seen = scripted(inner.release_steps(), answer)
        except BackendUnavailable:
            seen = []
            assert attempt < retries - 1
        else:
            assert [(script_of(s), s.request.args[1]) for s in seen] == [("settle", 2)]
    if retries:
        with pytest.raises(LockNotOwned):
            scripted(inner.release_steps(), server())
    _, seen = scripted(middle.release_steps(), lambda i, s: 1)  # one level left
    # One call, retried or not: the release sets the count to the levels left (settling it).
    assert [(script_of(s), s.request.args[2].split("|")[1]) for s in seen] == [("release", "1")]
    assert outer.token is not None and outer.fence == 5
    _, seen = scripted(outer.release_steps(), server())
    assert [script_of(s) for s in seen] == ["release"] and outer.token is None
    assert sent["lost"] == []


@pytest.mark.parametrize("reply", [[1, 6, 2], [1, 5, 1]], ids=["new-fence", "count-of-one"])
def test_a_reentry_into_a_hold_that_is_gone_is_a_loss_declared_once(
    reply: list[int], sent: dict[str, list[Any]]
) -> None:
    lk = reentrant(f"gone:{reply}")
    assert scripted(lk.acquire_steps(False, None), server(fence=5))[0]
    with pytest.raises(LockLost):
        scripted(lk.acquire_steps(False, None), lambda i, s: reply if i == 0 else 0)
    assert lk.token is None and lk.lost is not None
    assert len(sent["lost"]) == 1
    # The fresh hold was handed back; the old one's level raises LockLost once released.
    with pytest.raises(LockLost):
        scripted(lk.release_steps(), server())
    assert len(sent["lost"]) == 1


@pytest.mark.parametrize(
    ("operation", "nothing"),
    [("owned", [b"none", 0, None]), ("extend", 0), ("release", -1)],
)
def test_a_hold_is_lost_only_on_an_answer_that_the_token_holds_nothing(
    operation: str, nothing: Any, sent: dict[str, list[Any]]
) -> None:
    lk = plain(f"rule:{operation}")
    assert scripted(lk.acquire_steps(False, None), server())[0]

    def steps() -> Steps[Any]:
        if operation == "owned":
            return lk._owned()
        if operation == "extend":
            return lk._extend(None)
        return lk.release_steps()

    if operation != "release":
        # No answer: unknown, so still held and not lost.
        with pytest.raises(BackendUnavailable):
            scripted(steps(), failing(0, lost_reply, server()))
        assert lk.token is not None and lk.lost is None and sent["lost"] == []
    # The answer that the token holds nothing: lost, declared once.
    try:
        result, _ = scripted(steps(), lambda i, s: nothing)
    except LockNotOwned:
        result = None
    assert result in (False, None)
    assert lk.token is None and lk.lost is not None and len(sent["lost"]) == 1
    # Asked again, nothing is declared twice.
    again = scripted(lk._owned(), server())[0]
    assert again is False and len(sent["lost"]) == 1
