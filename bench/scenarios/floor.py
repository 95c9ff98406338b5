"""Where an uncontended cycle's time goes: the raw loop, our two scripts alone (the cycle's
own keys and arguments, through the backend), the whole ``with lock()`` cycle, and the Lock
object's own work with the round trips answered in-process (metrics on and off, and without
the watchdog hand-over). Wall and client CPU per cycle, the cases taking turns."""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.harness import RELEASE_LUA, ROUNDS

TURN = 400  # cycles per turn


def _per_cycle(work: Callable[[], Any], cycles: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(cycles):
        work()
    return ((time.perf_counter() - wall) / cycles * 1e6, (time.process_time() - cpu) / cycles * 1e6)


def floor(results: dict[str, Any]) -> None:
    from django.test import override_settings

    from django_redlock import lock, locks, observe
    from django_redlock.backends.base import Kind
    from django_redlock.identity import new_token

    backend = locks["default"]
    client = backend.client  # type: ignore[attr-defined]
    sha = client.script_load(RELEASE_LUA)
    kind, meta = Kind(), lock("f:meta")._meta()

    def raw() -> None:
        token = secrets.token_urlsafe(16)
        client.set("f:raw", token, nx=True, px=30000)
        client.evalsha(sha, 1, "f:raw", token)

    def scripts() -> None:
        token = new_token()
        backend.execute(backend.op_acquire("f:scripts", token, 30000, meta, kind))
        backend.execute(backend.op_release("f:scripts", token, kind))

    def cycle() -> None:
        with lock("f:cycle"):
            pass

    def answered(op: Any) -> Any:  # what the server answers a free lock's acquire, a release
        return op.parse([1, 1, 1] if op.request.script.name == "acquire" else 0)

    def in_process(renew: bool) -> Callable[[], None]:
        def work() -> None:
            backend.execute = answered  # type: ignore[method-assign]
            try:
                with lock("f:object", auto_renew=renew):
                    pass
            finally:
                del backend.execute

        return work

    cases = {"raw SET NX PX + EVALSHA": raw, "our two scripts": scripts, "with lock()": cycle,
             "Lock object, I/O answered in-process": in_process(True),
             "  the same, auto_renew=False": in_process(False)}  # fmt: skip
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for work in cases.values():
        _per_cycle(work, 200)  # warm up
    for _ in range(ROUNDS * 4):
        for name, work in cases.items():
            samples[name].append(_per_cycle(work, TURN))
    with override_settings(DJANGO_REDLOCK_METRICS=False, DJANGO_REDLOCK_TRACING=False):
        observe.configure()
        off = in_process(True)
        _per_cycle(off, 200)
        samples["  the same, metrics and spans off"] = [
            _per_cycle(off, TURN) for _ in range(ROUNDS * 4)
        ]
    observe.configure()
    results["floor"] = {
        name: {
            "wall_us": statistics.median(w for w, _ in values),
            "cpu_us": statistics.median(c for _, c in values),
        }
        for name, values in samples.items()
    }
