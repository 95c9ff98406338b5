"""Leader election when something raises at an awkward line: after the take, while leaving."""

from __future__ import annotations

import asyncio
import inspect
import linecache
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import LockError, current_leader, leader, locks, run_as_leader
from django_redlock.leader import _terms
from django_redlock.testing import RedisServer


@pytest.fixture
def paused_alias(redis_factory: Callable[..., RedisServer]) -> Iterator[RedisServer]:
    server = redis_factory()
    config = {"BACKEND": "django_redlock.backends.redis.RedisBackend", "LOCATION": server.url}
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "paused": config}):
        yield server
        server.resume()
        locks["paused"].close()


class RaiseOnLeading(logging.Filter):
    """Raises at the "leading" log line, as a Ctrl-C landing there (or a broken filter) does."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def filter(self, record: logging.LogRecord) -> bool:
        if "leading" in record.getMessage():
            raise self.error
        return True


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("a logging filter")])
def test_an_exception_after_the_take_resigns_before_it_propagates(
    name: str, error: BaseException
) -> None:
    """The campaign raised after its keeper started: the caller was told it did not lead
    while the keeper renewed the hold for the life of the process (nobody else could lead)."""
    log = logging.getLogger("django_redlock")
    level = log.level
    log.setLevel(logging.INFO)
    raising = RaiseOnLeading(error)
    log.addFilter(raising)
    campaign = leader(name, using="redis", ttl=30)
    try:
        with pytest.raises(type(error)), campaign:
            pytest.fail("the block ran")
    finally:
        log.removeFilter(raising)
        log.setLevel(level)
    assert current_leader(name, using="redis") is None  # handed back, not renewed on
    assert campaign not in _terms
    with leader(name, using="redis", timeout=1) as term:  # the next candidate, at once
        assert not term.lost.is_set()
    with campaign as term:  # and this object campaigns again ("leading already" before)
        assert not term.lost.is_set()


def test_a_cancellation_during_an_unanswered_resignation_goes_on(
    paused_alias: RedisServer, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The resignation's BackendUnavailable replaced the cancellation: the task ended with
    it, never cancelled."""

    async def main() -> tuple[asyncio.Task[None], BaseException]:
        left = asyncio.Event()

        async def body() -> None:
            async with leader(name, using="paused", ttl=30):
                paused_alias.pause()  # the resignation gets no answer
                left.set()

        task = asyncio.ensure_future(body())
        await left.wait()
        await asyncio.sleep(0.2)  # the resignation is under way
        task.cancel()
        try:
            await task
        except BaseException as exc:  # what the task ended with
            return task, exc
        pytest.fail("the task ended normally")

    with caplog.at_level(logging.WARNING, logger="django_redlock"):
        task, ended = asyncio.run(main())
    assert isinstance(ended, asyncio.CancelledError), repr(ended)
    assert task.cancelled()
    if sys.version_info >= (3, 11):
        assert task.cancelling() == 1
    assert "resigning" in caplog.text and "unavailable" in caplog.text, caplog.text
    paused_alias.resume()


def test_a_resignation_interrupted_at_its_start_still_ends_the_term(name: str) -> None:
    """An interrupt (Ctrl-C) on entering the term's end: the hold was released (the next
    candidate led at once) while ``term.lost`` stayed unset, so a worker watching it went on
    beside the new leader until the old keeper's next renewal was refused."""
    campaign = leader(name, using="redis", ttl=30)
    term = campaign.campaign()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_name == "_end_term":
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            campaign.resign()
    finally:
        sys.settrace(None)
    assert term.lost.is_set() and current_leader(name, using="redis") is None
    with leader(name, using="redis", timeout=1) as new:
        assert not new.lost.is_set()


def test_an_exception_on_the_campaign_s_last_line_resigns(name: str) -> None:
    """An exception (a tracer's; a signal cannot land there on CPython 3.11) on ``_lead``'s
    ``return term``: the caller was told it did not lead while the keeper renewed on."""
    campaign = leader(name, using="redis", ttl=30)

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_name != "_lead":
            return None
        if event == "line" and "return term" in linecache.getline(
            frame.f_code.co_filename, frame.f_lineno
        ):
            sys.settrace(None)
            raise KeyboardInterrupt
        return tracer

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            campaign.campaign()
    finally:
        sys.settrace(None)
    assert current_leader(name, using="redis") is None and campaign not in _terms


def raise_at(function: str, line: str) -> Callable[..., Any]:
    """A tracer that raises KeyboardInterrupt once ``function`` is about to run ``line``."""

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_name != function:
            return None
        if event == "line" and line in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            sys.settrace(None)
            raise KeyboardInterrupt
        return tracer

    return tracer


@pytest.mark.parametrize("entry", ["campaign", "__aenter__"])
def test_an_exception_on_the_entry_s_return_line_resigns(name: str, entry: str) -> None:
    """An exception (a tracer's) on the entry's ``return self._lead(since)``, the lock taken
    and confirmed: outside the guard that resigns, the caller was told it did not lead while
    the lock stayed held (nobody led, nobody else could, for a TTL)."""
    campaign = leader(name, using="redis", ttl=30)

    async def enter() -> None:
        await campaign.__aenter__()

    sys.settrace(raise_at(entry, "return self._lead("))
    try:
        with pytest.raises(KeyboardInterrupt):
            if entry == "campaign":
                campaign.campaign()
            else:
                asyncio.run(enter())
    finally:
        sys.settrace(None)
    assert current_leader(name, using="redis") is None and campaign not in _terms
    with leader(name, using="redis", timeout=1) as term:  # the next candidate, at once
        assert not term.lost.is_set()


@pytest.mark.parametrize(
    ("function", "line"),
    [
        ("_end_term", 'keeper.end("resigned", unknown=False)'),
        ("end", "if threading.Event.is_set(self.lost)"),
        ("end", "self.reason, self.unknown = reason, unknown"),
        ("end", "self.lost.set()"),
    ],
)
def test_a_resignation_interrupted_while_ending_the_term_still_ends_it(
    name: str, function: str, line: str
) -> None:
    """An interrupt (Ctrl-C) after the term's keeper was let go of (``_end_term``'s last
    line, or inside ``Keeper.end`` before ``lost`` was set): the resignation released the
    hold (the next candidate led at once) while ``term.lost`` stayed unset for a renewal
    period, the old leader's worker running on beside the new one."""
    campaign = leader(name, using="redis", ttl=30)
    term = campaign.campaign()
    sys.settrace(raise_at(function, line))
    try:
        with pytest.raises(KeyboardInterrupt):
            campaign.resign()
    finally:
        sys.settrace(None)
    assert term.lost.is_set() and "resigned" in term.reason, term
    assert current_leader(name, using="redis") is None and campaign not in _terms
    with leader(name, using="redis", timeout=1) as new:
        assert not new.lost.is_set()


def raise_on_return_of(function: str, into: str) -> Callable[..., Any]:
    """A tracer raising KeyboardInterrupt as ``function`` returns its value to ``into`` (where
    a real Ctrl-C lands: the call's signal check in the caller's frame)."""

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_name != function or frame.f_back.f_code.co_name != into:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "return" and arg is not None:
                sys.settrace(None)
                raise KeyboardInterrupt
            return local

        return local

    return tracer


def after_the_take(frame: Any, event: str, arg: Any) -> Any:
    """A tracer raising KeyboardInterrupt on the entry's first line after its take returned."""
    if frame.f_code.co_name not in ("campaign", "__aenter__") or frame.f_code.co_filename != (
        sys.modules[leader.__module__].__file__
    ):
        return None
    lines = inspect.getsourcelines(frame.f_code)[0]
    taken = frame.f_code.co_firstlineno + next(i for i, t in enumerate(lines) if "acquire(" in t)
    if event == "line" and frame.f_lineno > taken + 1:  # past the take and its refusal
        sys.settrace(None)
        raise KeyboardInterrupt
    return after_the_take


@pytest.mark.parametrize("spot", ["__enter__", "campaign", "__aenter__", "run_as_leader"])
def test_an_exception_between_the_take_and_the_block_resigns(name: str, spot: str) -> None:
    """An exception (a Ctrl-C) after the grant, before the caller owns the term: as
    campaign() returns to ``__enter__`` (``with`` never runs its exit) or to
    run_as_leader() (before its target), or on campaign()'s line after the take. The caller
    was told it did not lead while the keeper renewed the hold on (a hidden leader), or the
    hold blocked the name for a TTL."""
    campaign = leader(name, using="redis", ttl=30)
    tracer = (
        after_the_take
        if spot in ("campaign", "__aenter__")
        else raise_on_return_of("campaign", spot)
    )

    async def enter() -> None:
        async with campaign:
            pytest.fail("the block ran")

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            if spot == "__enter__":
                with campaign:
                    pytest.fail("the block ran")
            elif spot == "campaign":
                campaign.campaign()
            elif spot == "__aenter__":
                asyncio.run(enter())
            else:
                run_as_leader(name, lambda term: pytest.fail("the target ran"), using="redis")
    finally:
        sys.settrace(None)
    assert current_leader(name, using="redis") is None and campaign not in _terms
    with leader(name, using="redis", timeout=1) as term:  # the next candidate, at once
        assert not term.lost.is_set()


def test_entering_while_leading_already_leaves_the_term_alone(name: str) -> None:
    """``with`` on an object leading already is LockError, and its term goes on."""
    campaign = leader(name, using="redis", ttl=30)
    with campaign as term:
        with pytest.raises(LockError, match="leading already"):
            campaign.__enter__()
        assert not term.lost.is_set() and current_leader(name, using="redis") is not None
