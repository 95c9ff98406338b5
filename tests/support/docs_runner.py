"""Run a page's Python blocks as a reader would (tests/docs/test_docs.py, test_readme.py).

The blocks of a group (a README section, a docs page, or the whole tutorial) run in order:

* a block captioned with a file (``shop/models.py``) is that file of the reader's project:
  it is written into a temporary project folder, and imported once the settings apply (a
  file shown again, as the reader edits it, is rewritten and reloaded in its turn);
* settings blocks are applied, all of them, before any code runs (with ``...`` for the list
  the project had); a package with a ``models.py`` is installed as an app; Redis URLs of
  127.0.0.1 point at the suite's server, and Celery runs tasks eagerly in this process
  (``CELERY_TASK_ALWAYS_EAGER``: the real-worker path is test_celery.py's and
  test_newcomer.py's);
* the tables of the models of the project's apps are created;
* the other blocks run in one namespace, as in ``manage.py shell``, where the names of the
  reader's own code (``charge``, ``invoice``, ...) are placeholders.

Whatever a group changes in this process (modules, apps, Celery's current app, signal
receivers) is undone afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from django.apps import apps
from django.conf import settings
from django.db import connection
from django.dispatch import Signal
from django.test import override_settings

from django_redlock import lock
from django_redlock.testing import RedisServer

from .readme import Block, apply_settings


def _placeholder(*args: Any, **kwargs: Any) -> None:
    """A function of the reader's own (``charge(...)``, ``sync()``): the docs call it."""


#: Names the docs' code uses for the reader's own code and data.
PLACEHOLDERS = {"charge": _placeholder, "invoice": object(), "sync": _placeholder,
                "export": _placeholder, "debit": _placeholder, "show": _placeholder,
                "rebuild": _placeholder, "catalog": object()}  # fmt: skip

LOCMEM = "django.core.cache.backends.locmem.LocMemCache"  # a new project's CACHES


def on_server(server: RedisServer, block: Block) -> str:
    return block.source.replace("redis://127.0.0.1:6379", f"redis://127.0.0.1:{server.port}")


def project_settings() -> dict[str, Any]:
    return {key: getattr(settings, key) for key in dir(settings) if key.isupper()}


def _module_of(caption: str) -> str:
    return caption.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


@contextlib.contextmanager
def _signals_restored() -> Iterator[None]:
    """Receivers a page connects (``@receiver(lock_lost)``) are disconnected afterwards."""
    import celery.signals

    from django_redlock import signals
    from django_redlock.contrib import celery as ours

    found = [s for m in (signals, ours) for s in vars(m).values() if isinstance(s, Signal)]
    theirs = [s for s in vars(celery.signals).values() if hasattr(s, "receivers")]
    saved = [(s, list(s.receivers or [])) for s in [*found, *theirs]]
    try:
        yield
    finally:
        for signal, receivers in saved:
            signal.receivers = receivers
            if hasattr(signal, "sender_receivers_cache"):
                signal.sender_receivers_cache.clear()


@contextlib.contextmanager
def _project(files: list[Block], folder: Path) -> Iterator[list[str]]:
    """The reader's project files on disk and importable; the packages they make."""
    for block in files:
        assert block.caption is not None
        path = folder / block.caption
        path.parent.mkdir(parents=True, exist_ok=True)
        for package in path.relative_to(folder).parents:
            if str(package) != ".":
                (folder / package / "__init__.py").touch()
        path.write_text(block.source)
    packages = sorted({Path(b.caption or "").parts[0] for b in files})
    sys.path.insert(0, str(folder))
    try:
        yield packages
    finally:
        sys.path.remove(str(folder))
        for name in list(sys.modules):
            if name.split(".")[0] in packages:
                del sys.modules[name]
        for label in packages:
            apps.all_models.pop(label, None)


def run_group(blocks: list[Block], server: RedisServer, folder: Path) -> dict[str, Any]:
    """Run a group's blocks (see the module's docstring); the shell's namespace at the end."""
    from celery import _state as celery_state

    runnable = [b for b in blocks if b.lang == "python" and not b.needs]
    shown = [b for b in runnable if b.caption and not b.is_settings]
    # A file shown again (the reader edits it) is rewritten and reloaded when its turn comes.
    files = list({b.caption: b for b in reversed(shown)}.values())[::-1]  # first versions
    captions = [b.caption for b in files]
    project = project_settings()
    applied: dict[str, Any] = dict(project)
    for block in (b for b in runnable if b.is_settings):
        applied.update(apply_settings(on_server(server, block), applied))
    # A package with models is one of the reader's apps: installed, as in their project.
    reader_apps = [c.split("/")[0] for c in captions if c and c.endswith("/models.py")]
    applied["INSTALLED_APPS"] = [
        *applied["INSTALLED_APPS"],
        *(a for a in reader_apps if a not in applied["INSTALLED_APPS"]),
    ]
    applied |= {"CELERY_TASK_ALWAYS_EAGER": True, "CELERY_TASK_EAGER_PROPAGATES": True}
    changed = {k: v for k, v in applied.items() if v != project.get(k)}
    previous_app = celery_state.get_current_app()
    # A module name of its own, so that two pages' tasks (sync_customer) are two tasks.
    module = "docs_" + re.sub(r"\W+", "_", f"{blocks[0].page} {blocks[0].section}").lower()
    namespace: dict[str, Any] = {"__name__": module, **PLACEHOLDERS}
    made: list[Any] = []
    with _signals_restored(), _project(files, folder) as packages:
        try:
            with override_settings(**changed):
                for block in files:
                    importlib.import_module(_module_of(block.caption or ""))
                for label in packages:
                    if apps.is_installed(label):
                        made += apps.get_app_config(label).get_models()
                with connection.schema_editor() as editor:
                    for model in made:
                        editor.create_model(model)
                for block in runnable:
                    if block.caption and block not in files and not block.is_settings:
                        (folder / block.caption).write_text(block.source)
                        importlib.reload(sys.modules[_module_of(block.caption)])
                    if block.caption or block.is_settings:
                        continue
                    exec(compile(on_server(server, block), str(block), "exec"), namespace)
                    for name in re.findall(r'lock\("([^"{]+)"', block.source):  # none left held
                        assert not lock(name).locked(), f"{block} left {name!r} held"
        finally:
            celery_state._set_current_app(previous_app)  # first: later files need their app
            _drop_tables(made)
    return namespace


def _drop_tables(models: list[Any]) -> None:
    """Drop the reader's tables. The in-memory database is shared by every thread's connection,
    and a background writer (the incident recorder, after the page's lost lock) may hold a
    table lock for a moment: SQLite then refuses at once ("database table is locked") instead
    of waiting, so the drop waits for the writer and tries again."""
    from django.db import OperationalError

    from django_redlock.incidents import recorder

    deadline = time.monotonic() + 30
    for model in reversed(models):
        while True:
            recorder.flush(5)
            try:
                with connection.schema_editor() as editor:
                    editor.delete_model(model)
                break
            except OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
