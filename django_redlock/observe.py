"""Metrics and traces of every lock: Prometheus when ``prometheus_client`` is installed,
OpenTelemetry spans when ``opentelemetry-api`` is.

The lock core calls the hooks below at a few moments (an acquire starts and ends, a hold
starts and ends, a hold is lost, a renewal batch is settled, a round trip gets no answer).
Each hook is a module attribute that :func:`configure` sets once, at startup and when the
settings change: with metrics and tracing off (or not installed) they are functions that do
nothing, so a lock never looks a setting up and pays one empty call per moment. No hook
ever talks to Redis.

Settings::

    DJANGO_REDLOCK_METRICS = True        # False: no metrics
    DJANGO_REDLOCK_TRACING = True        # False: no spans
    DJANGO_REDLOCK_LOCK_GROUPS = {       # optional: a "group" label (and span attribute)
        "invoice:{id}": "invoice",       #   templates or globs -> a small set of groups;
        "report:*": "report",            #   names that match none are "other"
    }
    DJANGO_REDLOCK_TRACE_NAMES = False   # True: lock names on spans (they may carry ids)

Labels are the backend alias, the lock kind and the outcome, never a lock name: names are
unbounded (``invoice:{id}``), and a label per name would grow the time series without end.
"""

from __future__ import annotations

import os
import re
import threading
import time
import weakref
from bisect import bisect_left
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from .forks import after_fork_in_child
from .version import __version__

ACQUIRED, BUSY, TIMEOUT, ERROR = "acquired", "busy", "timeout", "error"
RENEWED, LOST = "renewed", "lost"
#: Lock waits: an uncontended acquire is one round trip (about half a millisecond), a
#: contended one waits for a hand-off or a holder's work, up to a minute and more.
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0, 60.0)  # fmt: skip
#: Critical sections: a millisecond to an hour-long Celery task.
HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
                3600.0)  # fmt: skip
OTHER_GROUP = "other"


# -- the hooks: do-nothing until configure() binds them ------------------------------------


def _nothing(*args: Any) -> None:
    return None


#: ``acquire_started(lock) -> span or None``: an acquire begins.
acquire_started: Any = _nothing
#: ``acquire_ended(lock, started, outcome, fence, span)``: it ended (``started``: monotonic).
acquire_ended: Any = _nothing
#: ``hold_started(lock, hold)``: a new hold (not a re-entry) was recorded.
hold_started: Any = _nothing
#: ``acquired(lock, started, fence, span, hold)``: ``acquire_ended`` (acquired) and
#: ``hold_started`` of a new hold, in one call (every uncontended acquire makes it).
acquired: Any = _nothing
#: ``hold_ended(lock, hold)``: the lock object let go of a hold (released or lost).
hold_ended: Any = _nothing
#: ``hold_unsure(lock, hold)``: the release of a hold got no answer: the lock object no
#: longer counts it (it ends at its TTL at the latest, or a retried release ends it).
hold_unsure: Any = _nothing
#: ``lost(lock)``: a hold was declared lost.
lost: Any = _nothing
#: ``renewed(backend, count, results)``: a renewal batch of ``count`` holds was settled.
renewed: Any = _nothing
#: ``backend_error(backend)``: a round trip got no answer (unavailable, no quorum).
backend_error: Any = _nothing

HOOKS = ("acquire_started", "acquire_ended", "hold_started", "acquired", "hold_ended",
         "hold_unsure", "lost", "renewed", "backend_error")  # fmt: skip


# -- settings --------------------------------------------------------------------------------


def _bool_setting(settings: Any, name: str, default: bool) -> bool:
    value = getattr(settings, name, default)
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"{name} must be True or False, not {value!r}")
    return value


def group_matcher(groups: Any) -> re.Pattern[str] | None:
    """One regex over every pattern of ``DJANGO_REDLOCK_LOCK_GROUPS``; its match's
    ``lastgroup`` says which (``g<index>``). A ``{field}`` or ``*`` matches any text."""
    if groups is None:
        return None
    name = "DJANGO_REDLOCK_LOCK_GROUPS"
    if not isinstance(groups, Mapping) or not groups:
        raise ImproperlyConfigured(f"{name} must be a non-empty dict of pattern -> group")
    parts = []
    for index, (pattern, group) in enumerate(groups.items()):
        if not isinstance(pattern, str) or not pattern:
            raise ImproperlyConfigured(f"{name} has a pattern {pattern!r}: a non-empty str")
        if not isinstance(group, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", group):
            raise ImproperlyConfigured(
                f"{name}[{pattern!r}] is {group!r}: a group is 1-64 letters, digits or _.:-"
            )
        pieces = re.split(r"(\{[^{}]*\}|\*)", pattern)
        body = "".join(".*" if p == "*" or p.startswith("{") else re.escape(p) for p in pieces)
        parts.append(f"(?P<g{index}>{body})")
    return re.compile(f"^(?:{'|'.join(parts)})$", re.S)


class Config:
    def __init__(self, settings: Any) -> None:
        self.metrics = _bool_setting(settings, "DJANGO_REDLOCK_METRICS", True)
        self.tracing = _bool_setting(settings, "DJANGO_REDLOCK_TRACING", True)
        self.trace_names = _bool_setting(settings, "DJANGO_REDLOCK_TRACE_NAMES", False)
        groups = getattr(settings, "DJANGO_REDLOCK_LOCK_GROUPS", None)
        self.matcher = group_matcher(groups)
        self.groups = list(groups.values()) if groups else []

    def group_of(self, name: str) -> str:
        if self.matcher is None:
            return ""
        found = self.matcher.match(name)
        if found is None or found.lastgroup is None:
            return OTHER_GROUP
        return self.groups[int(found.lastgroup[1:])]


# -- Prometheus ------------------------------------------------------------------------------


class Metrics:
    """The metrics, registered once per process in prometheus_client's default registry, as
    one collector: a scrape first applies the events the hooks queued (see :class:`Events`),
    then reports the metrics."""

    def __init__(self, grouped: bool) -> None:
        import prometheus_client
        from prometheus_client import REGISTRY

        def unregistered(kind: Any) -> Any:
            return lambda *args, **kwargs: kind(*args, registry=None, **kwargs)

        Counter = unregistered(prometheus_client.Counter)
        Gauge = unregistered(prometheus_client.Gauge)
        Histogram = unregistered(prometheus_client.Histogram)
        self.grouped = grouped
        extra = ["group"] if grouped else []
        self.acquisitions = Counter(
            "redlock_acquisitions", "Lock acquisitions by outcome: acquired, busy (a one-off"
            " try found it held), timeout (gave up waiting), error (no answer).",
            ["backend", "kind", "outcome", *extra],
        )  # fmt: skip
        self.wait = Histogram(
            "redlock_wait_seconds", "How long acquisitions that were willing to wait waited"
            " (acquired or timed out), from the call to the outcome.",
            ["backend", "kind", *extra], buckets=WAIT_BUCKETS,
        )  # fmt: skip
        self.hold = Histogram(
            "redlock_hold_seconds", "How long holds were held, from acquired to released or lost.",
            ["backend", "kind", *extra], buckets=HOLD_BUCKETS,
        )  # fmt: skip
        self.lost = Counter(
            "redlock_lost", "Holds lost: the backend answered that the hold's token no longer"
            " held the lock (expired, force-released).", ["backend", *extra],
        )  # fmt: skip
        self.renewals = Counter(
            "redlock_renewals", "Watchdog renewals by outcome: renewed, lost, error (no answer).",
            ["backend", "outcome"],
        )  # fmt: skip
        self.backend_errors = Counter(
            "redlock_backend_errors", "Lock round trips that got no answer (BackendUnavailable,"
            " QuorumNotReached).", ["backend"],
        )  # fmt: skip
        # livesum: in multiprocess mode, the sum over the live processes.
        self.held = Gauge(
            "redlock_held", "Holds this process holds now.", ["backend"],
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.collectors = [self.acquisitions, self.wait, self.hold, self.lost, self.renewals,
                           self.backend_errors, self.held]  # fmt: skip
        REGISTRY.register(self)

    def describe(self) -> list[Any]:
        return [family for metric in self.collectors for family in metric.describe()]

    def collect(self) -> list[Any]:
        # Holds whose Lock object was collected end here too: in a quiet process no hook may
        # come for a long time, and the gauge says what this process holds now.
        settle_abandoned()
        events.apply()
        return [family for metric in self.collectors for family in metric.collect()]

    def unregister(self) -> None:
        from prometheus_client import REGISTRY

        REGISTRY.unregister(self)


class Family:
    """The metric children of one (backend, kind, group), looked up once: ``labels()`` on
    every acquire would cost more than the counting."""

    __slots__ = ("acquired", "backend", "busy", "error", "group", "held", "hold", "kind",
                 "lost", "on_acquired", "on_busy", "on_ended", "on_error", "on_held", "on_lost",
                 "on_taken", "on_timeout", "timeout", "wait")  # fmt: skip
    # prometheus_client's children, or None each when metrics are off (spans only)
    acquired: Any
    busy: Any
    timeout: Any
    error: Any
    wait: Any
    hold: Any
    lost: Any
    held: Any
    on_acquired: Any
    on_busy: Any
    on_timeout: Any
    on_error: Any
    on_held: Any
    on_ended: Any
    on_lost: Any
    on_taken: Any

    def __init__(self, metrics: Metrics | None, backend: str, kind: str, group: str) -> None:
        self.backend, self.kind, self.group = backend, kind, group
        if metrics is None:
            self.acquired = self.busy = self.timeout = self.error = None
            self.wait = self.hold = self.lost = self.held = None
            return
        extra = [group] if metrics.grouped else []
        outcome = metrics.acquisitions
        self.acquired = outcome.labels(backend, kind, ACQUIRED, *extra)
        self.busy = outcome.labels(backend, kind, BUSY, *extra)
        self.timeout = outcome.labels(backend, kind, TIMEOUT, *extra)
        self.error = outcome.labels(backend, kind, ERROR, *extra)
        self.wait = metrics.wait.labels(backend, kind, *extra)
        self.hold = metrics.hold.labels(backend, kind, *extra)
        self.lost = metrics.lost.labels(backend, *extra)
        self.held = metrics.held.labels(backend)
        # Bound once: the hooks queue these, and Events.apply groups what they queued.
        self.on_acquired, self.on_busy = self._acquired, self._busy
        self.on_timeout, self.on_error = self._timed_out, self._failed
        self.on_held, self.on_ended, self.on_lost = self._held, self._ended, self._lost
        self.on_taken = self._taken

    # What events do to the metrics, a batch of one kind at a time: a counter moves once
    # per batch; a histogram takes the batch at once (observe_all).

    def _acquired(self, waits: list[float]) -> None:
        self.acquired.inc(len(waits))
        observe_all(self.wait, waits)

    def _taken(self, waits: list[float]) -> None:  # acquired, and a new hold
        self._acquired(waits)
        self.held.inc(len(waits))

    def _busy(self, values: list[Any]) -> None:
        self.busy.inc(len(values))

    def _timed_out(self, waits: list[float]) -> None:
        self.timeout.inc(len(waits))
        observe_all(self.wait, waits)

    def _failed(self, values: list[Any]) -> None:
        self.error.inc(len(values))

    def _held(self, values: list[Any]) -> None:
        self.held.inc(len(values))

    def _ended(self, durations: list[float]) -> None:
        self.held.dec(len(durations))
        observe_all(self.hold, durations)

    def _lost(self, values: list[Any]) -> None:
        self.lost.inc(len(values))


def observe_all(histogram: Any, values: list[float]) -> None:
    """``histogram.observe(v)`` for each of ``values``, each bucket and the sum moved once:
    one observe walks the buckets and takes a lock per move, which cost more than the rest
    of a hold's metrics (prometheus_client's own attributes; without them, one by one)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(values) < 2:
        for value in values:
            histogram.observe(value)
        return
    counts: dict[int, int] = {}
    for value in values:  # observe's bucket: the first bound >= value (the last is +Inf)
        index = bisect_left(bounds, value)
        counts[index] = counts.get(index, 0) + 1
    total.inc(sum(values))
    for index, count in counts.items():
        buckets[index].inc(count)


class Events:
    """What the hooks count, queued: a deque's append is atomic and costs a fraction of a
    metric update (which takes a lock per counter and bucket), so the lock pays for the append
    and the scrape for the counting. In prometheus_client's multiprocess mode each process
    writes its own files, and a scrape reads them from elsewhere: events apply at once."""

    LIMIT = 10_000  # applied by the hook that queues this many (nobody scraping)

    def __init__(self) -> None:
        self.queue: deque[tuple[Any, Any]] = deque()
        self.deferred = True
        # One applier at a time: two scrapes sharing the queue could apply a hold's end
        # before its start (the gauge at -1 for a moment).
        self.applying = threading.Lock()

    def __call__(self, action: Any, value: Any) -> None:
        if self.deferred:
            self.queue.append((action, value))
            if len(self.queue) > self.LIMIT:
                self.apply()
        else:
            action([value])

    def apply(self) -> None:
        with self.applying:
            self._apply()

    def _apply(self) -> None:
        queue = self.queue
        batches: dict[Any, list[Any]] = {}
        while queue:
            try:
                action, value = queue.popleft()  # threads applying at once share the work
            except IndexError:
                break
            batch = batches.get(action)
            if batch is None:
                batches[action] = [value]
            else:
                batch.append(value)
        for action, values in batches.items():
            action(values)


events = Events()


class Held:
    """What a hold carries for observing it (``Hold.observed``)."""

    __slots__ = ("__weakref__", "ended", "family", "pid", "span", "started")

    def __init__(self, family: Family, span: Any, started: float | None = None) -> None:
        self.family, self.span = family, span
        self.started = time.monotonic() if started is None else started
        self.pid = _pid[0]
        self.ended = False

    def __del__(self) -> None:
        # A Lock object collected while it held (never released): the hold runs out at its
        # TTL. Counted as ended by the next hook, not here: a collection may run while this
        # thread holds a metric's lock.
        # Half built (an interrupt in __init__): never counted as held, nothing to end.
        if not getattr(self, "ended", True) and self.pid == _pid[0]:
            _abandoned.append((self, time.monotonic()))


def _end_acquire_span(span: Any, outcome: str, waited: float, fence: int | None) -> None:
    span.set_attribute("redlock.outcome", outcome)
    span.set_attribute("redlock.waited_ms", round(waited * 1000, 3))
    if fence is not None:
        span.set_attribute("redlock.fence", fence)
    if outcome is ERROR:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, "the backend did not answer"))
    span.end()


_abandoned: deque[tuple[Held, float]] = deque()
_pid = [os.getpid()]  # this process's (reset after a fork): os.getpid() per hold costs
_ending = threading.Lock()  # one ender per Held: a scrape and a hook may settle at once


def _end(held: Held, now: float, how: str) -> None:
    """Count ``held`` as ended at ``now`` (monotonic), once whoever calls it."""
    with _ending:
        if held.ended:
            return
        held.ended = True
    seconds = now - held.started
    if held.family.held is not None:
        events(held.family.on_ended, seconds)
    if held.span is not None:
        held.span.set_attribute("redlock.held_ms", round(seconds * 1000, 3))
        if how != "released or lost":
            held.span.set_attribute("redlock.ended", how)
        held.span.end()


def settle_abandoned() -> None:
    """End the holds whose Lock object was collected while holding (queued by ``__del__``,
    which must not count: it may run while its thread holds a metric's lock)."""
    while _abandoned:
        try:
            held, at = _abandoned.popleft()
        except IndexError:
            return
        _end(held, at, "abandoned: its Lock object was collected while held")


class Observer:
    """The hooks with metrics, spans or both on."""

    def __init__(self, config: Config, metrics: Metrics | None, tracing: bool) -> None:
        self.config, self.metrics, self.tracing = config, metrics, tracing
        self.tracer: Any = None  # the provider's tracer, once the application has one
        self._trace: Any = None
        self._no_provider: tuple[type, ...] = ()
        self._provider_by_env = False
        if tracing:
            from opentelemetry import trace

            self._trace = trace
            self._no_provider = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
            self._provider_by_env = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
        self._families: dict[tuple[Any, ...], Family] = {}
        self._mutex = threading.Lock()
        self._renewals: dict[str, tuple[Any, Any, Any]] = {}
        # lock object -> the span context of the hold it ended last (with spans on)
        self._ended_spans: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def family(self, lock: Any) -> Family:
        # Keyed by what a kind's label is made of, so a lock of a known kind costs a dict
        # lookup; the label itself (lock.kind_label()) is computed once per key.
        name = lock.name if self.config.matcher is not None else ""
        key = (lock.using, type(lock), lock.noun, lock.reentrant, lock.queued, name)
        family = self._families.get(key)
        if family is None:
            group = self.config.group_of(lock.name)
            family = Family(self.metrics, lock.using, lock.kind_label(), group)
            with self._mutex:
                if len(self._families) > 10_000:  # grouped: one key per name; keep it bounded
                    self._families.clear()
                self._families[key] = family
        return family

    def attributes(self, lock: Any, family: Family) -> dict[str, Any]:
        attributes: dict[str, Any] = {"redlock.backend": family.backend,
                                      "redlock.kind": family.kind}  # fmt: skip
        if family.group:
            attributes["redlock.group"] = family.group
        if self.config.trace_names:
            attributes["redlock.name"] = lock.name
        return attributes

    # -- hooks -------------------------------------------------------------------------------

    def _live_tracer(self) -> Any:
        """The tracer of the application's provider; None while it has none. Without one,
        opentelemetry-api hands out do-nothing spans that still cost microseconds each: a
        library that only depends on the API would pay them on every acquire."""
        if getattr(self._trace, "_TRACER_PROVIDER", ...) is None and not self._provider_by_env:
            # None set yet (opentelemetry-api's global, read where get_tracer_provider() would
            # also consult the environment each time: a few us on every acquire).
            return None
        provider = self._trace.get_tracer_provider()
        if isinstance(provider, self._no_provider):
            return None
        self.tracer = provider.get_tracer("django_redlock", __version__)
        return self.tracer

    def acquire_started(self, lock: Any) -> Any:
        tracer = self.tracer
        if tracer is None:
            if not self.tracing or (
                # No provider set yet: _live_tracer()'s first test, without its call.
                getattr(self._trace, "_TRACER_PROVIDER", ...) is None and not self._provider_by_env
            ):
                return None
            if (tracer := self._live_tracer()) is None:
                return None
        return tracer.start_span(
            "redlock.acquire", attributes=self.attributes(lock, self.family(lock))
        )

    def acquire_ended(
        self, lock: Any, started: float, outcome: str, fence: int | None, span: Any
    ) -> None:
        waited = time.monotonic() - started
        if self.metrics is not None:
            family = self.family(lock)
            if outcome is ACQUIRED:
                events(family.on_acquired, waited)
            elif outcome is BUSY:
                events(family.on_busy, None)
            elif outcome is TIMEOUT:
                events(family.on_timeout, waited)
            else:
                events(family.on_error, None)
        if span is not None:
            _end_acquire_span(span, outcome, waited, fence)

    def hold_started(self, lock: Any, hold: Any) -> None:
        if _abandoned:
            self._settle_abandoned()
        family = self.family(lock)
        if self.metrics is not None:
            events(family.on_held, None)
        hold.observed = Held(family, self._hold_span(lock, family, hold))

    def acquired(self, lock: Any, started: float, fence: int | None, span: Any, hold: Any) -> None:
        # acquire_ended(ACQUIRED) then hold_started: one family, one clock reading, one event.
        if _abandoned:
            self._settle_abandoned()
        now = time.monotonic()
        family = self.family(lock)
        if self.metrics is not None:
            events(family.on_taken, now - started)
        if span is not None:
            _end_acquire_span(span, ACQUIRED, now - started, fence)
        # No tracer (the common case): no span, and no call to say so.
        span = None if self.tracer is None else self._hold_span(lock, family, hold)
        hold.observed = Held(family, span, now)

    def _hold_span(self, lock: Any, family: Family, hold: Any) -> Any:
        if self.tracer is None:
            return None
        attributes = self.attributes(lock, family)
        if hold.fence is not None:
            attributes["redlock.fence"] = hold.fence
        return self.tracer.start_span("redlock.hold", attributes=attributes)

    def hold_ended(self, lock: Any, hold: Any) -> None:
        held = getattr(hold, "observed", None)
        if held is not None and not held.ended:
            _end(held, time.monotonic(), "released or lost")
            if held.span is not None:
                # A loss is declared right after the hold ends (lost() below): its span
                # goes under this one.
                self._ended_spans[lock] = held.span.get_span_context()
        if _abandoned:
            self._settle_abandoned()

    def hold_unsure(self, lock: Any, hold: Any) -> None:
        # Not a hold this process holds any more: nobody renews it, nothing counts it, and
        # its owner's next operation releases it again if need be. Ended now for the gauge
        # and the span; the histogram counts it from acquired to the unanswered release.
        held = getattr(hold, "observed", None)
        if held is not None and not held.ended:
            _end(held, time.monotonic(), "release unanswered: gone at its TTL at the latest")
        if _abandoned:
            self._settle_abandoned()

    def _settle_abandoned(self) -> None:
        settle_abandoned()

    def lost(self, lock: Any) -> None:
        family = self.family(lock)
        if family.lost is not None:
            events(family.on_lost, None)
        context = self._ended_spans.pop(lock, None)
        if context is not None and self.tracer is not None:
            # A short span under the hold's: the trace shows the critical section was cut.
            from opentelemetry.trace import (
                NonRecordingSpan,
                Status,
                StatusCode,
                set_span_in_context,
            )

            attributes = self.attributes(lock, family)
            attributes["redlock.lost"] = str(lock.lost or "")
            span = self.tracer.start_span(
                "redlock.lost",
                context=set_span_in_context(NonRecordingSpan(context)),
                attributes=attributes,
            )
            span.set_status(Status(StatusCode.ERROR, attributes["redlock.lost"]))
            span.end()

    def renewed(self, backend: Any, count: int, results: Sequence[bool | None] | Exception) -> None:
        if self.metrics is None:
            return
        children = self._renewals.get(backend.alias)
        if children is None:
            renewals = self.metrics.renewals
            children = self._renewals[backend.alias] = (
                renewals.labels(backend.alias, RENEWED),
                renewals.labels(backend.alias, LOST),
                renewals.labels(backend.alias, ERROR),
            )
        ok, gone, unknown = children
        if isinstance(results, Exception):
            unknown.inc(count)
            return
        renewed = results.count(True)
        if renewed:
            ok.inc(renewed)
        if renewed != len(results):
            missing = results.count(None)
            if missing:
                unknown.inc(missing)
            if len(results) - renewed - missing:
                gone.inc(len(results) - renewed - missing)

    def backend_error(self, backend: Any) -> None:
        if self.metrics is not None:
            self.metrics.backend_errors.labels(backend.alias).inc()


# -- configuring -----------------------------------------------------------------------------

_metrics: Metrics | None = None
_observer: Observer | None = None


def multiprocess() -> bool:
    """prometheus_client's multiprocess mode (it reads the variable when it is imported)."""
    from prometheus_client import values

    return "MultiProcessValue" in getattr(values.ValueClass, "__qualname__", "")


def installed(module: str) -> bool:
    import importlib.util

    try:  # find_spec("a.b") imports "a", and raises when "a" is missing
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def configure(settings: Any = None) -> Observer | None:
    """Bind the hooks as the settings say (called when the app is ready, and when tests
    change the settings); returns the observer, None when everything is off."""
    global _metrics, _observer
    if settings is None:
        from django.conf import settings as django_settings

        settings = django_settings
    config = Config(settings)
    metrics = None
    if config.metrics and installed("prometheus_client"):
        grouped = config.matcher is not None
        if _metrics is not None and _metrics.grouped != grouped:
            _metrics.unregister()  # another label set: the old series cannot stay
            _metrics = None
        if _metrics is None:
            _metrics = Metrics(grouped)
        metrics = _metrics
        events.apply()  # what the old hooks queued, before the new ones run
        events.deferred = not multiprocess()
    tracing = config.tracing and installed("opentelemetry.trace")
    observer = Observer(config, metrics, tracing) if metrics or tracing else None
    for hook in HOOKS:
        globals()[hook] = getattr(observer, hook) if observer else _nothing
    _observer = observer
    return observer


def _forget_after_fork() -> None:
    # The child holds none of its parent's holds: its gauge starts at zero (in multiprocess
    # mode the child writes its own file, which starts at zero anyway).
    global _ending
    _abandoned.clear()
    events.queue.clear()  # the parent's events: the parent counts them
    events.applying = threading.Lock()  # a parent's thread may have held them at the fork
    _ending = threading.Lock()
    _pid[0] = os.getpid()
    if _metrics is not None:
        _metrics.held.clear()
    if _observer is not None:
        _observer._families.clear()
        _observer._renewals.clear()
        _observer._mutex = threading.Lock()


after_fork_in_child(_forget_after_fork)


SETTINGS = ("DJANGO_REDLOCK_METRICS", "DJANGO_REDLOCK_TRACING", "DJANGO_REDLOCK_LOCK_GROUPS",
            "DJANGO_REDLOCK_TRACE_NAMES")  # fmt: skip


def _settings_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in SETTINGS:
        configure()


def connect() -> None:
    """Called when the app is ready: bind the hooks, and rebind them when settings change."""
    from django.core.signals import setting_changed

    configure()
    setting_changed.connect(_settings_changed, dispatch_uid="redlock-observe-settings")
