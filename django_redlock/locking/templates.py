"""Lock names as ``str.format`` templates over a function's arguments (decorators)."""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable

from ..validation import check_name


def name_template(
    template: str, signature: inspect.Signature, where: str
) -> Callable[[tuple, dict], str]:
    """Check a ``{arg}`` template against a signature; return the name builder.

    Fields name parameters; a function with ``**kwargs`` also lends its keyword arguments by
    name (``{user_id}`` over ``def f(**kwargs)``), so those are checked at call time.
    """
    params = signature.parameters
    extra = next((p.name for p in params.values() if p.kind is p.VAR_KEYWORD), None)
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise ValueError(f"lock name template {template!r}: use argument names, not {{}}")
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


def refuse_generator(func: Callable[..., object], decorator: str) -> None:
    """A generator function's body runs when its result is iterated, after the call returned:
    a lock (and a fenced transaction) around the call would cover none of it. TypeError."""
    if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
        kind = "async generator" if inspect.isasyncgenfunction(func) else "generator"
        raise TypeError(
            f"{decorator} cannot protect the {kind} function"
            f" {getattr(func, '__qualname__', func)!r}: its body runs when the result is"
            " iterated, after the call returned and the lock was released. Lock inside it"
            " (`with lock(...):` around the work), or return a list."
        )
