"""An interrupt right after a grant, before the Lock recorded it (a soft time limit landing
as the reply arrived), then the same object's retry at once: the late-write tests' move."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest


def cut_after_the_grant(
    monkeypatch: pytest.MonkeyPatch, mine: Any, on_cut: Callable[[str], None]
) -> None:
    """``mine``'s next grant is cut before its record: ``on_cut(token)`` runs (hold the
    hand-back's release on the wire, say), then RuntimeError is raised; once only."""
    record = type(mine)._record

    def interrupted(
        self: Any, owner: str, actor: str, token: str, *args: Any, **kwargs: Any
    ) -> Any:
        if self is mine:
            monkeypatch.setattr(type(mine), "_record", record)
            on_cut(token)
            raise RuntimeError("soft time limit")  # the grant is not recorded
        return record(self, owner, actor, token, *args, **kwargs)

    monkeypatch.setattr(type(mine), "_record", interrupted)


def cut_then_retry(mine: Any, driver: str) -> bool:
    """A one-off try the cut interrupts, then the retry at once (``driver``: sync or async);
    the retry's outcome."""
    if driver == "sync":
        with pytest.raises(RuntimeError):
            mine.acquire(blocking=False)
        return bool(mine.acquire(blocking=False))

    async def both() -> bool:
        with pytest.raises(RuntimeError):
            await mine.aacquire(blocking=False)
        return bool(await mine.aacquire(blocking=False))

    return asyncio.run(both())
