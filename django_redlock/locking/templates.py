"""Lock names as ``str.format`` templates over a function's arguments (decorators)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import string
from collections.abc import Callable

from ..validation import check_name


def template_fields(template: str) -> list[str]:
    """Every replacement field of a ``str.format`` template, with those nested in a format
    spec (``{user_id:>{width}}`` names ``user_id`` and ``width``). ValueError for a
    template ``str.format`` cannot parse."""
    fields = []
    for _, field, spec, _ in string.Formatter().parse(template):
        if field is not None:
            fields.append(field)
            if spec and "{" in spec:  # str.format nests one level: the spec's own fields
                fields += [f for _, f, _, _ in string.Formatter().parse(spec) if f is not None]
    return fields


def name_template(
    template: str, signature: inspect.Signature, where: str
) -> Callable[[tuple, dict], str]:
    """Check a ``{arg}`` template against a signature; return the name builder.

    Fields name parameters; a function with ``**kwargs`` also lends its keyword arguments by
    name (``{user_id}`` over ``def f(**kwargs)``), so those are checked at call time.
    """
    params = signature.parameters
    extra = next((p.name for p in params.values() if p.kind is p.VAR_KEYWORD), None)
    for field in template_fields(template):
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise ValueError(f"lock name template {template!r}: use argument names, not {{}}")
        if root == extra:  # its keywords are lent by name; the dict itself is not a value
            raise ValueError(
                f"lock name template {template!r} uses {root!r}, the **{root} of {where}"
                f"{signature}: name one of its keyword arguments instead ({{user_id}})"
            )
        if root not in params and extra is None:
            raise ValueError(
                f"lock name template {template!r} uses {root!r}, which is not an argument"
                f" of {where}{signature}"
            )

    def build(args: tuple, kwargs: dict) -> str:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        if extra is not None:
            values = {**values.pop(extra, {}), **values}
        try:
            return check_name(template.format(**values))
        except (KeyError, AttributeError, IndexError) as exc:
            raise ValueError(
                f"lock name template {template!r} failed for this call of {where}: {exc!r}"
            ) from exc

    return build


def callable_name(func: object) -> str:
    """A name for any callable: a function's ``__qualname__``, else ``partial(<its func>)``,
    else its class's (a callable object); never an AttributeError."""
    name = getattr(func, "__qualname__", None)
    if isinstance(name, str):
        return name
    if isinstance(func, functools.partial):
        return f"partial({callable_name(func.func)})"
    return type(func).__qualname__


def _underlying(func: object) -> object:
    """What a call of ``func`` runs: through ``functools.wraps`` wrappers (``__wrapped__``:
    ``@contextmanager`` too), partials, static and class methods, and a callable object's
    ``__call__``. A few steps at most: a wrapper may point back to itself."""
    for _ in range(16):
        try:
            inner = inspect.unwrap(func)  # type: ignore[arg-type]
        except ValueError:  # a wrapper loop (a mock's endless __wrapped__)
            return func
        if isinstance(inner, functools.partial):
            inner = inner.func
        elif isinstance(inner, (staticmethod, classmethod)):
            inner = inner.__func__
        elif callable(inner) and not isinstance(inner, type) and not inspect.isroutine(inner):
            inner = type(inner).__call__
        if inner is func:
            return func
        func = inner
    return func


def refuse_generator(func: Callable[..., object], decorator: str) -> None:
    """A generator function's body runs when its result is iterated, after the call returned:
    a lock (and a fenced transaction) around the call would cover none of it. TypeError,
    also for one behind a decorator (``functools.wraps``, ``@contextmanager``), a partial, a
    static method or a callable object's ``__call__``. Calls that return a generator all the
    same are refused when they do: :func:`refuse_generator_result`."""
    target = _underlying(func)
    if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
        kind = "async generator" if inspect.isasyncgenfunction(target) else "generator"
        raise TypeError(
            f"{decorator} cannot protect the {kind} function"
            f" {callable_name(func)!r}: its body runs when the result is"
            " iterated, after the call returned and the lock was released. Lock inside it"
            " (`with lock(...):` around the work), or return a list."
        )


# -- async callables -----------------------------------------------------------------------------
# The rule every decorator here keeps (@lock, @semaphore, @lock_all, lock_view,
# @single_instance): a body must run while the lock is held. An async callable's body runs
# when its result is awaited, after a sync wrapper's call returned (and released). So each
# decorator asks :func:`is_async_callable` (not inspect.iscoroutinefunction alone) and wraps
# an async callable in an async wrapper that awaits it under the lock (or, @single_instance,
# refuses it); and a sync wrapper whose call returns an awaitable anyway (a sync function
# returning a coroutine) refuses it, closed unstarted, inside the lock's block, as it refuses
# a generator: :func:`refuse_generator_result`.

_ASYNCIO_MARKER = getattr(asyncio.coroutines, "_is_coroutine", None)


def _marked_async(obj: object) -> bool:
    """A coroutine function, or marked as one: inspect's own mark (3.12+), or asyncio's,
    which asgiref's ``markcoroutinefunction`` sets before 3.12 (``sync_to_async(f)``,
    Django's async ``View.as_view()``)."""
    if inspect.iscoroutinefunction(obj):
        return True
    return _ASYNCIO_MARKER is not None and getattr(obj, "_is_coroutine", None) is _ASYNCIO_MARKER


def is_async_callable(func: object) -> bool:
    """Whether calling ``func`` gives an awaitable to run its body: a coroutine function, a
    callable marked as one (asyncio's or asgiref's marker), an object with an ``async def
    __call__``, and a partial, bound method, static or class method of any of these. A
    ``functools.wraps`` wrapper is judged by itself, not by what it wraps: a sync wrapper's
    call does not await."""
    obj = func
    for _ in range(16):  # a few steps at most: a partial of a partial of an object...
        if _marked_async(obj):
            return True
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, (staticmethod, classmethod)) or inspect.ismethod(obj):
            obj = obj.__func__
        elif inspect.isroutine(obj) or isinstance(obj, type) or not callable(obj):
            return False
        else:  # a callable object: its class's __call__
            obj = type(obj).__call__
    return False


def refuse_generator_result(result: object, func: object, decorator: str) -> None:
    """Raise TypeError (inside the lock's block: it rolls back and releases) if a call
    returned a generator or async generator, or an awaitable (a coroutine), closed unstarted:
    its body would run after the release, outside the transaction. The decoration-time check
    cannot see every callable."""
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise TypeError(
            f"{decorator}: {callable_name(func)!r} returned an awaitable"
            f" ({type(result).__name__}): its body would run when awaited, after the lock"
            " was released; refused, nothing of it ran. Decorate the async function itself"
            " (async def), or lock inside it (`async with lock(...)`)."
        )
    if inspect.isgenerator(result) or inspect.isasyncgen(result):
        kind = "an async generator" if inspect.isasyncgen(result) else "a generator"
        if inspect.isgenerator(result):
            result.close()
        raise TypeError(
            f"{decorator}: {callable_name(func)!r} returned {kind}: its body would run when"
            " iterated, after the lock was released (and outside its transaction); refused,"
            " nothing of it ran. Lock inside it, or return a list."
        )
