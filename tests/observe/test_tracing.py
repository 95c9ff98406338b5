"""OpenTelemetry spans: ``redlock.acquire`` (the wait) and ``redlock.hold`` (the critical
section), children of the caller's span, seen through the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import StatusCode

from django_redlock import BackendUnavailable, LockLost, lock, locks, observe

_exporter = InMemorySpanExporter()


class Gate(Sampler):
    """Records spans only during these tests: the provider stays for the whole session (a
    process has one), and the rest of the suite must not pile spans up in memory."""

    open = False

    def should_sample(
        self, parent: Any, trace_id: int, name: str, kind: Any = None, attributes: Any = None,
        *args: Any, **kwargs: Any,
    ) -> SamplingResult:  # fmt: skip
        if not Gate.open:
            return SamplingResult(Decision.DROP)
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)  # the span's attributes

    def get_description(self) -> str:
        return "open only in tests/observe/test_tracing.py"


class NoTracing:
    """The settings, with tracing off: what the rest of the suite runs with."""

    def __getattr__(self, name: str) -> Any:
        from django.conf import settings

        return False if name == "DJANGO_REDLOCK_TRACING" else getattr(settings, name)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider(sampler=Gate())
        provider.add_span_processor(SimpleSpanProcessor(_exporter))
        trace.set_tracer_provider(provider)
    observe.configure()
    _exporter.clear()
    Gate.open = True
    yield _exporter
    Gate.open = False
    _exporter.clear()
    observe.configure(NoTracing())


def named(exporter: InMemorySpanExporter, name: str) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_a_with_block_gives_an_acquire_and_a_hold_span_under_the_caller(
    spans: InMemorySpanExporter,
) -> None:
    tracer = trace.get_tracer("tests")
    with (
        tracer.start_as_current_span("checkout") as parent,
        lock("trace:invoice:42", using="redis") as held,
    ):
        fence = held.fence
        inside = [s.name for s in spans.get_finished_spans()]
    assert inside == ["redlock.acquire"]  # the hold span is open during the block
    (acquire,) = named(spans, "redlock.acquire")
    (hold,) = named(spans, "redlock.hold")
    for span in (acquire, hold):
        assert span.parent is not None and span.parent.span_id == parent.get_span_context().span_id
        assert span.context.trace_id == parent.get_span_context().trace_id
        assert span.attributes["redlock.backend"] == "redis"
        assert span.attributes["redlock.kind"] == "plain"
        assert "redlock.name" not in span.attributes  # names only when allowed
    assert acquire.attributes["redlock.outcome"] == "acquired"
    assert acquire.attributes["redlock.fence"] == fence == hold.attributes["redlock.fence"]
    assert 0 <= acquire.attributes["redlock.waited_ms"] < 2000
    assert acquire.end_time <= hold.start_time + 1_000_000  # the hold follows the wait
    assert hold.end_time >= hold.start_time and hold.attributes["redlock.held_ms"] >= 0


def test_a_timeout_and_an_error_are_the_acquire_span_s_outcome(
    spans: InMemorySpanExporter,
) -> None:
    with lock("trace:busy", using="redis"):
        assert not lock("trace:busy", using="redis").acquire(timeout=0.1)
        assert not lock("trace:busy", using="redis").acquire(blocking=False)
    with pytest.raises(BackendUnavailable):
        lock("trace:down", using="down").acquire()
    outcomes = [s.attributes["redlock.outcome"] for s in named(spans, "redlock.acquire")]
    assert outcomes == ["acquired", "timeout", "busy", "error"]
    timed_out, error = named(spans, "redlock.acquire")[1], named(spans, "redlock.acquire")[3]
    assert timed_out.attributes["redlock.waited_ms"] >= 100
    assert error.status.status_code is StatusCode.ERROR
    assert len(named(spans, "redlock.hold")) == 1  # only the hold that was taken


def test_names_and_groups_on_spans_when_allowed(spans: InMemorySpanExporter) -> None:
    with (
        override_settings(
            DJANGO_REDLOCK_TRACE_NAMES=True, DJANGO_REDLOCK_LOCK_GROUPS={"invoice:{id}": "invoice"}
        ),
        lock("invoice:7", using="local", reentrant=True),
    ):
        pass
    for span in spans.get_finished_spans():
        assert span.attributes["redlock.name"] == "invoice:7"
        assert span.attributes["redlock.group"] == "invoice"
        assert span.attributes["redlock.kind"] == "reentrant"


def test_asyncio_spans_follow_the_task_s_context(spans: InMemorySpanExporter) -> None:
    tracer = trace.get_tracer("tests")

    async def main() -> Any:
        with tracer.start_as_current_span("job") as parent:
            async with lock("trace:async", using="redis"):
                await asyncio.sleep(0.01)
        return parent

    parent = asyncio.run(main())
    (hold,) = named(spans, "redlock.hold")
    assert hold.parent.span_id == parent.get_span_context().span_id
    assert hold.attributes["redlock.held_ms"] >= 10


def test_tracing_off(spans: InMemorySpanExporter) -> None:
    with override_settings(DJANGO_REDLOCK_TRACING=False), lock("trace:off", using="redis"):
        pass
    assert spans.get_finished_spans() == ()


def test_a_lost_hold_gets_a_lost_span_under_its_hold_span(spans: InMemorySpanExporter) -> None:
    held = lock("trace:lost", using="redis", auto_renew=False)
    held.acquire()
    assert locks["redis"].force_release("trace:lost")
    with pytest.raises(LockLost):
        held.release()
    (hold,) = named(spans, "redlock.hold")
    (lost,) = named(spans, "redlock.lost")
    assert lost.parent is not None and lost.parent.span_id == hold.context.span_id
    assert "released by someone else" in lost.attributes["redlock.lost"]
    assert lost.status.status_code is StatusCode.ERROR
    with lock("trace:fine", using="redis"):
        pass
    assert len(named(spans, "redlock.lost")) == 1  # a release is no loss


def test_a_project_without_opentelemetry_starts() -> None:
    """find_spec("opentelemetry.trace") raises when the parent package is missing: the app
    must start anyway, with tracing off (a newcomer's fresh project failed on this)."""
    assert observe.installed("no_such_package_here.trace") is False
    assert observe.installed("opentelemetry.trace") is True
