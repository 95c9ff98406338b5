"""One Redis: a hand-back's release written and never answered (its connection closed when
the socket timeout ran out) may still run at any later time: TCP delivers what was written
before the close (a retransmission, a slow network, a proxy). Nothing may be granted again
under a token such a write could delete."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from django_redlock import lock, locks
from django_redlock.testing import RedisServer
from tests.support.grant_cut import cut_after_the_grant, cut_then_retry
from tests.support.proxy import LossyProxy
from tests.support.warm import warm_up


@pytest.fixture
def proxied(redis_factory: Callable[..., RedisServer]) -> Iterator[tuple[LossyProxy, Any]]:
    server = redis_factory()
    proxy = LossyProxy(server.port)
    config = {
        "BACKEND": "django_redlock.backends.redis.RedisBackend",
        "LOCATION": f"redis://127.0.0.1:{proxy.port}/0",
        "OPTIONS": {"socket_timeout": 0.3},
    }
    with override_settings(DJANGO_REDLOCK={**settings.DJANGO_REDLOCK, "late": config}):
        yield proxy, server
        locks["late"].close()
    proxy.let_go()
    proxy.close()


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_hand_back_release_delayed_past_its_closed_connection_never_deletes_the_retry_s_grant(
    proxied: tuple[LossyProxy, Any], name: str, driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt after the grant: the hand-back's release is held on the wire, its socket
    timeout runs out and its connection is closed; the retry must not be granted the token
    that release deletes once it lands (two holders)."""
    proxy, server = proxied
    warm_up("late", name)  # a connection, the scripts loaded
    mine = lock(name, using="late", ttl=30, auto_renew=False)
    # the hand-back's release: late on the wire
    cut_after_the_grant(monkeypatch, mine, lambda token: proxy.delay_from(token.encode()))
    got = cut_then_retry(mine, driver)
    assert proxy.delayed.is_set(), "the release was held"
    proxy.let_go()  # the late write lands
    other = lock(name, using="late", ttl=30, auto_renew=False)
    key = locks["late"].key(name)
    if got:
        value = server.client().get(key) or b"-"
        assert value.split(b"|")[0] == mine.token.encode(), f"the late write deleted it: {value!r}"
        assert not other.acquire(blocking=False), "two holders at once"
        mine.release()
    else:  # refused by the old grant: it expires (nobody renews it)
        server.client().delete(key)


@pytest.mark.parametrize("fair", [False, True])
def test_a_hand_back_finished_by_a_task_never_releases_the_same_object_s_retry(
    redis_server: RedisServer, name: str, fair: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain aacquire() granted as its task is cancelled hands the grant back; cancelled
    again in that hand-back, a task of its own finishes it. The caller catches the
    cancellation and tries again on the same object at once: before, the retry took the
    hold again under the kept token and the task's release then deleted it (the object
    reported held, another owner took the name: two holders)."""
    backend = locks["default"]
    sent = backend.aexecute
    calls = 0

    async def cut(op: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        task = asyncio.current_task()
        assert task is not None
        if calls == 1:  # the try: granted, its task cancelled as the reply comes in
            reply = await sent(op, *args, **kwargs)
            task.cancel()
            await asyncio.sleep(0)
            return reply
        if calls == 2:  # the hand-back: cancelled again before it is sent
            task.cancel()
            await asyncio.sleep(0)
        return await sent(op, *args, **kwargs)

    monkeypatch.setattr(backend, "aexecute", cut)

    async def main() -> tuple[bool, bool, bool]:
        mine = lock(name, ttl=20, fair=fair)
        try:
            await mine.aacquire(blocking=False)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            while task.cancelling():
                task.uncancel()
        retried = await mine.aacquire(blocking=False)  # the retry, on the same object
        await asyncio.sleep(0.5)  # the finishing task ran meanwhile
        other = await lock(name, ttl=20).aacquire(blocking=False)
        held = mine.token is not None
        if held:
            await mine.arelease()
        return retried, held, other

    retried, held, other = asyncio.run(main())
    assert not (retried and held and other), "two holders at once"
    assert not held or not other


def test_a_hand_back_release_cut_by_a_second_interrupt_gives_its_token_up(
    proxied: tuple[LossyProxy, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt after the grant starts the hand-back; its release is held on the wire and a
    second interrupt (a SIGALRM handler's exception) ends the wait for its reply. Before, the
    token stayed kept, the retry was granted it again, and the late release deleted that
    grant (review rl, 4)."""
    proxy, server = proxied
    warm_up("late", name)  # a connection, the scripts loaded
    mine = lock(name, using="late", ttl=30, auto_renew=False)
    record = type(mine)._record

    def interrupted(
        self: Any, owner: str, actor: str, token: str, *args: Any, **kwargs: Any
    ) -> Any:
        if self is mine:
            monkeypatch.setattr(type(mine), "_record", record)
            proxy.delay_from(token.encode())  # the hand-back's release: late on the wire
            signal.setitimer(signal.ITIMER_REAL, 0.1)  # the second one, as its reply is read
            raise RuntimeError("soft time limit")
        return record(self, owner, actor, token, *args, **kwargs)

    def alarm(signum: int, frame: Any) -> None:
        raise RuntimeError("a second soft time limit")

    previous = signal.signal(signal.SIGALRM, alarm)
    monkeypatch.setattr(type(mine), "_record", interrupted)
    try:
        with pytest.raises(RuntimeError):
            mine.acquire(blocking=False)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert proxy.delayed.is_set(), "the release was held"
    assert mine._unsure_token is None, "a token a late release may delete is kept"
    got = mine.acquire(blocking=False)
    proxy.let_go()  # the late release lands
    other = lock(name, using="late", ttl=30, auto_renew=False)
    if got:
        assert not other.acquire(blocking=False), "two holders at once"
        mine.release()
    else:
        server.client().delete(locks["late"].key(name))
