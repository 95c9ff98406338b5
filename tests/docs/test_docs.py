"""The documentation site (docs/): it builds with no warning and no network, its reference
covers every public name, setting, signal, check, command and metric, every code block runs
(or, for shell blocks, names commands, options and extras that exist), the figures it quotes
name their bench scenario, and its tutorial renders in a real browser."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import get_commands
from django.test import override_settings
from sphinx.util.inventory import InventoryFile

from bench.figures import figures
from django_redlock import lock
from django_redlock.backends.redis import RedisBackend
from django_redlock.backends.redlock import RedlockBackend
from django_redlock.backends.sentinel import SentinelBackend
from django_redlock.checks import KNOWN_SETTINGS, check_unknown_settings
from django_redlock.handler import LockHandler
from django_redlock.management.commands.redlock import Command as RedlockCommand
from django_redlock.testing import RedisServer

from ..admin.test_browser import browser  # noqa: F401  (the fixture: Debian's chromium)
from ..conftest import ROOT
from ..support.docs_runner import project_settings, run_group
from ..support.readme import DOCS, README, Block, apply_settings, blocks, github_anchors, pages

PAGES = pages()
ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.lang == "python"]
SHELL = [b for b in ALL if b.lang == "sh"]
DOC_PAGES = [p for p in PAGES if p != README]


def _group(page: Path) -> str:
    """The tutorial is one story (part 2 uses part 1's settings); every other page stands
    alone. The README is tests/docs/test_readme.py's."""
    relative = page.relative_to(DOCS)
    return "tutorial" if relative.parts[0] == "tutorial" else str(relative)


GROUPS: dict[str, list[Block]] = {}
for _block in PYTHON:
    if _block.path != README:
        GROUPS.setdefault(_group(_block.path), []).append(_block)
RUNNABLE_GROUPS = sorted(g for g, bs in GROUPS.items() if any(not b.needs for b in bs))


# -- the build --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The site, built afresh as `make docs` builds it (every warning an error)."""
    out = tmp_path_factory.mktemp("docs") / "html"
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-E", "-n", "-W", "--keep-going", "-q",
         "-b", "html", str(DOCS), str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    yield out


def test_the_docs_build_with_no_warning(built: Path) -> None:
    assert (built / "index.html").exists()
    for page in DOC_PAGES:  # every page is part of the site (-W: none outside a toctree)
        html = page.relative_to(DOCS).with_suffix(".html")
        assert (built / html).exists(), html


def test_the_build_needs_no_network() -> None:
    """Every intersphinx inventory is a file in the repository (CI has no network)."""
    read = (
        "import json, runpy; conf = runpy.run_path('docs/conf.py');"
        " print(json.dumps(conf['intersphinx_mapping']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", read], capture_output=True, text=True, cwd=ROOT, timeout=120,
        check=True, env={k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
    )  # fmt: skip
    mapping = json.loads(done.stdout.splitlines()[-1])
    assert set(mapping) == {"python", "django", "celery", "redis"}
    for name, (url, inventory) in mapping.items():
        assert url.startswith("https://"), name
        assert Path(inventory).is_file(), f"{name}: {inventory} is not a local file"


def _inventory(path: Path) -> dict[str, dict[str, Any]]:
    with path.open("rb") as f:
        loaded = InventoryFile.load(f, "https://example.invalid/", lambda base, uri: base + uri)
    data = getattr(loaded, "data", loaded)  # Sphinx 8.2+: an _Inventory with .data
    return {kind: dict(items) for kind, items in data.items()}


def test_the_shipped_inventories_are_what_their_name_lists_make() -> None:
    """docs/_inventories/<project>.txt is the source; the .inv files are made from it by
    make.py (rerun it after editing a list)."""
    source = DOCS / "_inventories" / "make.py"
    spec = {"__name__": "inventories", "__file__": str(source)}
    exec(compile(source.read_text(), str(source), "exec"), spec)
    for project in spec["PROJECTS"]:
        shipped = (DOCS / "_inventories" / f"{project}.inv").read_bytes()
        assert shipped == spec["inventory"](project), f"rerun {source.relative_to(ROOT)}"
    python = _inventory(DOCS / "_inventories" / "python.inv")
    assert "contextvars.ContextVar" in python["py:class"]


# -- the reference ----------------------------------------------------------------------------

#: SPEC.md's public names, and the parts of the app a user configures or calls.
PUBLIC = {
    "py": [
        *(f"django_redlock.{n}" for n in (
            "locks", "lock", "semaphore", "read_write_lock", "single_instance", "lock_view",
            "LockError", "LockNotAcquired", "LockNotOwned", "LockLost", "QuorumNotReached",
            "BackendUnavailable", "StaleFence", "Lock", "Semaphore", "ReadWriteLock",
            "DEFAULT_LOCK_ALIAS", "lock_all", "MultiLock", "leader", "current_leader",
            "run_as_leader", "Term", "LeaderInfo")),
        *(f"django_redlock.Term.{n}" for n in ("fence", "lost", "reason", "check")),
        *(f"django_redlock.Lock.{n}" for n in (
            "acquire", "release", "extend", "owned", "locked", "ttl", "fence", "token", "adopt",
            "hold_count", "lost", "atomic", "aacquire", "arelease", "aextend", "aowned",
            "alocked", "attl")),
        "django_redlock.Semaphore.available", "django_redlock.Semaphore.holders",
        "django_redlock.ReadWriteLock.read", "django_redlock.ReadWriteLock.write",
        *(f"django_redlock.signals.{n}" for n in (
            "lock_acquired", "lock_released", "lock_lost", "acquire_timed_out",
            "quorum_not_reached")),
        *(f"django_redlock.contrib.celery.{n}" for n in (
            "single_instance", "SingleInstanceTask", "AlreadyQueued", "lock_key", "release_lock",
            "skipped", "duplicate_skipped")),
        *(f"django_redlock.contrib.beat.{n}" for n in (
            "LockedScheduler", "LockedDatabaseScheduler", "LeaderMixin", "leader")),
        "django_redlock.compat.RedisPyLock", "django_redlock.compat.Redis",
        *(f"django_redlock.testing.{n}" for n in (
            "RedisServer", "find_redis_server", "bundled_redis_server", "redis_server_version")),
        *(f"django_redlock.backends.{m}" for m in (
            "redis.RedisBackend", "django_redis.DjangoRedisBackend", "sentinel.SentinelBackend",
            "cluster.RedisClusterBackend", "redlock.RedlockBackend", "locmem.LocMemBackend",
            "base.LockInfo", "base.Released")),
    ],
}  # fmt: skip


def _check_ids() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "django_redlock").rglob("*.py"):
        found |= set(re.findall(r'"(django_redlock\.[EW]\d{3})"', path.read_text()))
    return found


def _metric_names() -> set[str]:
    source = (ROOT / "django_redlock" / "observe.py").read_text()
    made = re.findall(r'(Counter|Histogram|Gauge)\(\s*"(redlock_\w+)"', source)
    return {name + "_total" if kind == "Counter" else name for kind, name in made}


def _subcommands() -> dict[str, Any]:
    parser = RedlockCommand().create_parser("manage.py", "redlock")
    action = next(a for a in parser._actions if a.dest == "action")
    return dict(action.choices)  # type: ignore[arg-type]


def test_the_reference_covers_every_public_name(built: Path) -> None:
    """Checked against the site's own inventory: what the reference documents, by name, so
    a new setting, check, metric, command or public function without a reference entry
    fails here."""
    ours = _inventory(built / "objects.inv")
    python = {name for kind, items in ours.items() if kind.startswith("py:") for name in items}
    assert [n for n in PUBLIC["py"] if n not in python] == []
    assert set(KNOWN_SETTINGS) <= set(ours["std:setting"])
    assert _check_ids() and _check_ids() == set(ours["std:check"])
    assert _metric_names() and _metric_names() == set(ours["std:metric"])
    assert {f"redlock {a}" for a in _subcommands()} == set(ours["std:djadmin"])


def test_every_name_the_package_exports_and_every_signal_is_in_the_reference(
    built: Path,
) -> None:
    """``django_redlock.__all__`` and every Signal in ``signals.py`` (documented where users
    import it from: the package, ``signals`` or ``contrib.celery``), so a new export or
    signal without a reference entry fails here, not when a reader looks for it."""
    from django.dispatch import Signal

    import django_redlock
    from django_redlock import signals

    ours = _inventory(built / "objects.inv")
    python = {name for kind, items in ours.items() if kind.startswith("py:") for name in items}
    exported = [f"django_redlock.{n}" for n in django_redlock.__all__]
    assert [n for n in exported if n not in python] == []
    sent = [n for n, value in vars(signals).items() if isinstance(value, Signal)]
    assert sent
    homes = ("django_redlock.signals.", "django_redlock.contrib.celery.")
    assert [n for n in sent if not any(home + n in python for home in homes)] == []


def test_every_how_to_view_keyed_on_the_user_lets_only_users_in() -> None:
    """A view keyed on ``request.user`` refuses anonymous visitors with a ValueError (a 500):
    every how-to that shows one puts ``@login_required`` above it."""
    found = 0
    for page in sorted((DOCS / "howto").glob("*.md")):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            for decorators in re.findall(r"((?:^@.*\n)+)(?:async )?def ", block, re.M):
                if "@lock_view(" in decorators and "request.user" in decorators:
                    found += 1
                    first = decorators.index("@lock_view(")
                    assert "@login_required" in decorators[:first], (page.name, decorators)
    assert found >= 2


def _headings(html: str) -> list[str]:
    """The text of a built page's headings (h1-h4), tags and the permalink sign removed."""
    found = re.findall(r"<h[1-4][^>]*>(.*?)</h[1-4]>", html, re.S)
    return [re.sub(r"<[^>]+>|¶", "", h).strip() for h in found]


def test_every_reference_name_is_a_heading_a_reader_sees(built: Path) -> None:
    """Each metric, check id, subcommand and setting is shown under a heading of its own
    (a directive's target alone is invisible), and the backends' reference shows each
    backend's options with their defaults."""

    def heads(page: str) -> list[str]:
        return _headings((built / "ref" / page).read_text())

    metrics, checks, commands = heads("metrics.html"), heads("checks.html"), heads("commands.html")
    assert [m for m in _metric_names() if m not in metrics] == []
    assert [c for c in _check_ids() if c not in checks] == []
    assert [a for a in _subcommands() if f"redlock {a}" not in commands] == []
    assert [s for s in KNOWN_SETTINGS if s not in heads("settings.html")] == []
    backends = (built / "ref" / "backends.html").read_text()
    # The defaults as the backends have them (constructed: nothing connects until used).
    redlock = RedlockBackend("docs", {"LOCATION": ["redis://127.0.0.1:1/0"]})
    sentinel = SentinelBackend(
        "docs", {"LOCATION": ["redis://127.0.0.1:2"], "OPTIONS": {"service_name": "m"}}
    )
    defaults = {"restart_guard": f"{redlock.restart_guard:g}",
                "min_replicas": f"{sentinel.min_replicas:g}",
                "min_replicas_timeout": f"{sentinel.min_replicas_timeout:g}",
                "service_name": "required",
                "socket_timeout": str(RedisBackend.default_options["socket_timeout"])}  # fmt: skip
    assert defaults["restart_guard"] == "0" and defaults["min_replicas_timeout"] == "0.5"
    code = r"<code[^>]*><span class=\"pre\">"
    for option, default in defaults.items():
        cell = rf"<td><p>{code}{option}</span></code></p></td>\s*<td><p>(?:{code})?([^<]+)"
        row = re.search(cell, backends)
        assert row and row[1].startswith(default), option
    for cls in ("redlock.RedlockBackend", "locmem.LocMemBackend"):  # not empty entries
        entry = backends.split(f'id="django_redlock.backends.{cls}"', 1)[1].split("</dl>", 1)[0]
        assert len(re.sub(r"<[^>]+>", "", entry).split()) > 20, cls


def test_the_metrics_reference_lists_every_kind_label_a_lock_reports() -> None:
    """Each kind of lock taken once (a semaphore, fair or not, both holds of a read-write
    lock): the `kind` values the acquisitions were counted under are those ref/metrics lists."""
    from prometheus_client import REGISTRY

    from django_redlock import observe, read_write_lock, semaphore

    assert observe.configure() is not None  # prometheus_client is installed for the tests

    def kinds() -> set[str]:
        return {
            s.labels["kind"]
            for metric in REGISTRY.collect()
            if metric.name == "redlock_acquisitions"
            for s in metric.samples
            if s.labels.get("backend") == "local"
        }

    before = kinds()
    for taken in (
        lock("docs:kind", using="local"),
        lock("docs:kind", using="local", reentrant=True),
        lock("docs:kind", using="local", fair=True),
        lock("docs:kind", using="local", fair=True, reentrant=True),
        semaphore("docs:sem", 2, using="local"),
        semaphore("docs:sem", 2, using="local", fair=True),
        read_write_lock("docs:rw", using="local").read(),
        read_write_lock("docs:rw", using="local").write(),
    ):
        with taken:
            pass
    reported = kinds() | before
    assert {"plain", "limit 2", "fair limit 2", "read lock", "write lock"} <= reported
    text = re.sub(r"\s+", " ", (DOCS / "ref" / "metrics.md").read_text())
    assert "The `kind` label" in text, "ref/metrics.md lists the kind label's values"
    section = text.split("The `kind` label", 1)[1].split("`outcome`")[0]
    listed = set(re.findall(r"`([^`]+)`", section))
    for kind in reported:
        assert re.sub(r"\d+", "N", kind) in listed, kind


def test_a_signature_written_by_hand_is_the_function_s() -> None:
    """ref/api.md writes `single_instance`'s signature out (it is imported lazily): every
    parameter, with its default, as the function has it."""
    import inspect

    from django_redlock.contrib.single import single_instance

    text = (DOCS / "ref" / "api.md").read_text()
    written = re.search(r"\{py:function\} single_instance\((.*)\)", text)
    assert written
    parts: list[str] = []
    for parameter in inspect.signature(single_instance).parameters.values():
        if parameter.kind is parameter.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        parts.append(f"{parameter.name}={parameter.default!r}")
    assert written[1].replace('"', "'") == ", ".join(parts)


def test_the_reference_says_what_locks_gives_each_thread() -> None:
    """One backend per alias per process, shared by its threads, as ref/api.md says."""
    import threading

    from django_redlock import locks

    seen = []
    worker = threading.Thread(target=lambda: seen.append(locks["local"]))
    worker.start()
    worker.join()
    assert seen == [locks["local"]] and seen[0] is locks["local"]
    text = re.sub(r"\s+", " ", (DOCS / "ref" / "api.md").read_text())
    assert "one per alias per process, shared by its threads" in text
    assert "one per thread of each process" not in text


@pytest.mark.django_db  # the incidents app records the failure
def test_the_signals_reference_names_quorum_not_reached_s_sender() -> None:
    """Every backend announces a quorum failure through one function; its sender is the
    exception class, as ref/signals.md says (it said the backend's class)."""
    from django_redlock import QuorumNotReached
    from django_redlock.exceptions import quorum_failure
    from django_redlock.signals import quorum_not_reached

    senders: list[Any] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        senders.append(sender)

    quorum_not_reached.connect(receiver)
    try:
        quorum_failure("quorum", "docs:name", QuorumNotReached("2 of 5 answered"))
    finally:
        quorum_not_reached.disconnect(receiver)
    assert senders == [QuorumNotReached]
    text = re.sub(r"\s+", " ", (DOCS / "ref" / "signals.md").read_text())
    assert "`sender=QuorumNotReached` (the exception class)" in text
    assert "the backend's, for `quorum_not_reached`" not in text


def test_the_api_reference_shows_only_public_names(built: Path) -> None:
    html = (built / "ref" / "api.html").read_text()
    ids = set(re.findall(r'id="(django_redlock\.(?:Lock|Semaphore)\.\w+)"', html))
    names = ("noun", "mode", "offered_as", "exclusive", "queued", "database")
    internal = {f"django_redlock.{c}.{n}" for c in ("Lock", "Semaphore") for n in names}
    assert ids and ids & internal == set()
    assert "django_redlock.Semaphore.atomic" not in ids  # it always raises: not offered
    assert "django_redlock.Lock.atomic" in ids


def test_every_install_command_is_the_install_page_s() -> None:
    """There is no release on PyPI: every pip install of this app names a checkout or a
    wheel, as the install page says, never the bare package name."""
    for page in PAGES:
        for line in page.read_text().splitlines():
            if "no release on PyPI" in line:  # the sentence that says the bare name fails
                continue
            for target in re.findall(r"pip install (\"?[^\s\"`]+)", line):
                if "redlock" in target:
                    assert "/" in target, f"{page.name}: {line.strip()}"


#: Django's options every action takes too: named once, above the actions.
COMMON_OPTIONS = ("-v", "--verbosity", "--settings", "--pythonpath", "--traceback", "--no-color",
                  "--force-color", "--skip-checks")  # fmt: skip


def test_the_command_reference_names_every_option() -> None:
    text = (DOCS / "ref" / "commands.md").read_text()
    intro = text.split("{djadmin}", 1)[0]
    assert all(option in intro for option in COMMON_OPTIONS)
    for name, parser in _subcommands().items():
        section = text.split(f"{{djadmin}} redlock {name}", 1)[1].split("{djadmin}", 1)[0]
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help", *COMMON_OPTIONS):
                    assert option in section, f"redlock {name} {option}"


# -- the code blocks --------------------------------------------------------------------------


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_every_python_block_compiles(block: Block) -> None:
    compile(block.source, str(block), "exec")


def test_no_block_is_kept_from_running() -> None:
    """A marker (``<!-- docs-test: needs ... -->``) keeps a block of a feature not merged yet
    from running; every feature the docs show is merged, so none is left."""
    assert [str(b) for b in ALL if b.needs] == []


@pytest.mark.parametrize("block", [b for b in PYTHON if b.is_settings], ids=str)
def test_every_settings_block_is_valid(block: Block) -> None:
    applied = apply_settings(block.source, project_settings())
    # The reader's own apps ("shop") exist in their project: the code test makes them.
    applied.pop("INSTALLED_APPS", None)
    if "DJANGO_REDLOCK" in applied:  # valid backends and keys: what startup checks
        with override_settings(CACHES=applied.get("CACHES", project_settings()["CACHES"])):
            assert LockHandler(applied["DJANGO_REDLOCK"]).settings
    with override_settings(**applied):
        assert check_unknown_settings() == []  # every setting name is one the app reads


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("group", RUNNABLE_GROUPS)
def test_every_code_block_runs(group: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """A page's blocks run in order, as a reader runs them (tests/support/docs_runner.py)."""
    shell = run_group(GROUPS[group], redis_server, tmp_path)
    if group == "tutorial":  # what the tutorial says happens, happens
        assert len(shell["tickets"]) == 5  # 8 buyers, 5 tickets, never more sold
        assert shell["skipped"](shell["duplicate"])["redlock"] == "duplicate_skipped"
        assert shell["refund"].owned() is False and shell["refund"].lost


# -- the shell blocks -------------------------------------------------------------------------


def _extras() -> set[str]:
    text = (ROOT / "setup.cfg").read_text().split("[options.extras_require]", 1)[1]
    return set(re.findall(r"^(\w+) =", text.split("\n[", 1)[0], re.M))


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def _check_redlock(args: list[str], synopsis: bool) -> None:
    commands = _subcommands()
    assert args and args[0] in commands, f"no redlock action {args[:1]}"
    parser = commands[args[0]]
    if args[0] == "exec" and "--" in args:  # the command run under the lock is its own
        args = args[: args.index("--")]
    if synopsis:  # "list [--backend ALIAS] ...": every option named exists
        known = {o for a in parser._actions for o in a.option_strings}
        named = [w.strip("[]") for w in args[1:] if w.strip("[]").startswith("--")]
        assert set(named) <= known, f"redlock {args[0]}: {set(named) - known}"
    else:
        parser.parse_args(args[1:])  # SystemExit on anything it does not take


def _check_command(words: list[str], synopsis: bool) -> None:
    if words[0] == "sudo":
        words = words[1:]
    head = words[0]
    if head in (".", "cd", "export", "echo", "redis-server"):
        return
    if head == "make":
        assert words[1] in _make_targets(), f"no make target {words[1]}"
    elif head == "pip" or words[:3] == ["python", "-m", "pip"]:
        for word in words:
            for extras in re.findall(r"\[([\w,]+)\]", word):
                assert set(extras.split(",")) <= _extras(), word
    elif words[:3] == ["python", "-m", "build"] or words[:3] == ["python", "-m", "venv"]:
        return
    elif head == "apt-get":
        assert words[1] == "install" and set(words[2:]) <= {"redis-server", "chromium", "tmux"}
    elif head == "django-admin":
        assert words[1] == "startproject"
    elif words[:2] == ["python", "manage.py"]:
        if words[2] == "redlock":
            _check_redlock(words[3:], synopsis)
        else:
            assert words[2] in get_commands(), f"no manage.py command {words[2]}"
    elif head == "celery":
        assert words[1] == "-A" and words[3] in ("worker", "beat"), words
        if "--scheduler" in words:
            path = words[words.index("--scheduler") + 1]
            module, _, name = path.rpartition(".")
            assert hasattr(__import__(module, fromlist=[name]), name), path
    else:
        raise AssertionError(f"a command these tests do not know how to check: {words}")


@pytest.mark.parametrize("block", SHELL, ids=str)
def test_every_shell_command_exists(block: Block) -> None:
    """Shell blocks are not run (they install, start servers, ...), but every command,
    make target, pip extra, manage.py command, option and scheduler they name exists."""
    for line in block.source.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        synopsis = "[" in line.split("#")[0] and "redlock" in line
        for part in re.split(r"\s(?:\|\||&&|\|)\s", line):
            words = shlex.split(part, comments=True)
            if words and not words[0].startswith(("REDIS_SERVER=", "CAMPAIGN_")):
                _check_command(words, synopsis)


def test_every_promql_query_names_metrics_that_exist() -> None:
    queries = [b for b in ALL if b.lang == "promql"]
    assert queries
    series = _metric_names() | {f"{m}_bucket" for m in _metric_names()}
    for block in queries:
        assert set(re.findall(r"\bredlock_\w+", block.source)) <= series, block


# -- what the docs quote, and where they link -------------------------------------------------


def _bench_scenarios() -> set[str]:
    table = (ROOT / "bench" / "README.md").read_text()
    return {row.split("|")[1].strip() for row in table.splitlines() if row.startswith("| ")}


def test_every_quoted_figure_names_its_bench_scenario() -> None:
    """A figure from `make bench` says "(bench: <scenario>)", with the scenario as the first
    column of bench/README.md's table names it."""
    scenarios = _bench_scenarios()
    cited = []
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text())
        for scenario in re.findall(_CITED, text):
            cited.append(scenario)
            assert scenario in scenarios, f"{page.name}: no bench scenario {scenario!r}"
    assert len(cited) >= 15
    assert {f.scenario for f in figures().values()} <= scenarios


_CITED = r"\(bench: ((?:[^()]|\([^()]*\))+)\)"
_ROLE = r"\{bench\}`([^`]+)`"
#: Numbers a paragraph that quotes the bench may type: the scenarios' own parameters (8
#: processes, 10 ms holds, 100,000 locks, the ideal 100 a second), redis-py's 0.1 s poll, the
#: 2-core machine, a target. Any other number there must be a {bench} role.
_PARAMETERS = {"0.1", "2", "3", "5", "8", "10", "100", "200", "10,000", "100,000", "0.97"}


def _bench_paragraphs(page: Path) -> Iterator[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for paragraph in re.split(r"\n\s*\n|\n(?=\s*[*-] )", text):
        flat = re.sub(r"\s+", " ", paragraph)
        if "(bench:" in flat:
            yield flat


def test_every_figure_a_page_quotes_is_the_last_bench_run_s() -> None:
    """A paragraph that cites the bench types no figure: each is a ``{bench}`name``` role,
    which the build fills from bench/results.json (or, in the README, a generated span:
    tests/docs/test_readme.py), and each role's figure comes from a scenario the paragraph cites.
    So a figure cannot drift from the last run, and a missed target says so."""
    found = figures()
    typed, elsewhere, quoted = [], [], 0
    for page in PAGES:
        for flat in _bench_paragraphs(page):
            cited = set(re.findall(_CITED, flat))
            for name in re.findall(_ROLE, flat):
                quoted += 1
                assert name in found, f"{page.name}: no bench figure {name!r}"
                if found[name].scenario not in cited:
                    elsewhere.append(f"{page.name}: {name} is from {found[name].scenario!r}")
            rest = re.sub(_ROLE, "", flat)
            rest = re.sub(r"<!-- bench: [\w.-]+ -->.*?<!-- /bench -->", "", rest)
            rest = re.sub(_CITED, "", rest)
            rest = re.sub(r"`[^`]*`|\]\([^)]*\)", "", rest)  # code, and links' targets
            numbers = set(re.findall(r"(?<![\w.])\d[\d,.]*\d|(?<![\w.])\d", rest))
            if numbers - _PARAMETERS:
                typed.append(f"{page.name}: {sorted(numbers - _PARAMETERS)} in {flat[:70]!r}")
    assert typed == [] and elsewhere == []
    assert quoted >= 40


def test_the_figures_are_what_results_json_says() -> None:
    """A figure is a formatting of bench/results.json's value, and a missed target shows as
    missed: change a result and the quoted text changes with it."""
    results = json.loads((ROOT / "bench" / "results.json").read_text())
    now = figures(results)
    assert now["contended.ours.handoff_p50"].value == (
        f"{results['contended_zero']['ours']['handoff_p50_ms']:.2f} ms"
    )
    times = "\N{MULTIPLICATION SIGN}"
    results["redis_cpu"]["cpu_ratio"] = 1.1
    assert figures(results)["redis_cpu.ratio"].plain() == f"1.10 {times}"
    results["redis_cpu"]["cpu_ratio"] = 1.7
    assert figures(results)["redis_cpu.ratio"].plain() == (
        f"1.70 {times} (target \N{LESS-THAN OR EQUAL TO} 1.3 {times}: missed)"
    )
    rates = results["semaphore"]["rates"]
    rates["ours"] = rates["sorted-set recipe"] * 0.997
    # 0.997, not "1.00, missed": rounding never hides a verdict
    assert figures(results)["semaphore.vs_recipe"].value == f"0.997 {times}"
    assert any(f.missed for f in now.values()), "the last run missed targets: they must show"


def test_the_built_pages_show_the_figures_and_the_missed_targets(built: Path) -> None:
    found = figures()
    html = (built / "topics" / "performance.html").read_text()
    assert found["contended.ours.handoff_p50"].value in html
    assert found["fenced.vs_select_for_update"].missed
    assert 'class="bench-missed"' in html and ">missed</strong>" in html
    alternatives = (built / "topics" / "alternatives.html").read_text()
    assert found["fenced.vs_select_for_update"].value in alternatives


def test_the_bench_report_is_made_from_results_json() -> None:
    """bench/README.md (table and prose) is `python -m bench.report`'s output: neither can
    say what the results do not."""
    from bench.report import report

    results = json.loads((ROOT / "bench" / "results.json").read_text())
    made = report(results, results["run"]["environment"], results["run"]["seconds"])
    assert (ROOT / "bench" / "README.md").read_text() == made, "run: python -m bench.report"


#: The README's sections before it shrank (GitHub's anchors of its headings), and those of
#: docs/choosing-a-backend.md: each is still an anchor in the site.
OLD_ANCHORS = [
    "quick-start",
    "install",
    "settings",
    "using-locks",
    "reentrant-locks",
    "fair-locks",
    "semaphores-at-most-n-at-once",
    "read-write-locks-many-readers-or-one-writer",
    "which-one",
    "asyncio",
    "redis-pys-lock-api-django_redlockcompat",
    "celery-single_instance",
    "what-a-duplicate-leaves-in-the-result-backend",
    "retries-and-redelivered-messages",
    "helpers",
    "celery-beat-with-standbys",
    "views-lock_view",
    "admin-management-command-incidents",
    "held-locks-in-the-django-admin",
    "managepy-redlock",
    "lock-incidents",
    "the-watchdog-and-losing-a-lock",
    "exceptions-signals-logging",
    "observing-locks",
    "metrics",
    "traces",
    "lock-health-in-the-admin",
    "managepy-redlock-top",
    "how-it-works-and-why-each-step-is-there",
    "performance",
    "testing-your-project",
    "development",
    "choosing-a-backend",
    "the-rule-a-lock-makes-work-efficient-a-fencing-token-makes-it-correct",
    "at-a-glance",
    "single-redis-redisbackend-djangoredisbackend",
    "sentinel-sentinelbackend",
    "cluster-redisclusterbackend",
    "redlock-redlockbackend",
    "in-process-locmembackend",
    "valkey",
]


def test_every_moved_section_keeps_its_anchor(built: Path) -> None:
    """In the README still, or in the site (a link to README.md#fair-locks finds the
    section on the docs page with the same anchor)."""
    ids: set[str] = github_anchors(README)
    for html in built.rglob("*.html"):
        ids |= set(re.findall(r'\sid="([^"]+)"', html.read_text()))
    assert [a for a in OLD_ANCHORS if a not in ids] == []


def _extension() -> Any:
    """docs/_ext/redlock_docs.py, as Sphinx loads it."""
    spec = importlib.util.spec_from_file_location("redlock_docs", DOCS / "_ext" / "redlock_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_build_s_link_check_finds_a_missing_page_or_anchor(tmp_path: Path) -> None:
    """`make docs` (and the build above) fails on these: a Markdown link's #anchor that is no
    heading MyST lets through, so the built pages are what is checked."""
    (tmp_path / "a.html").write_text(
        '<h1 id="top">A</h1><a href="b.html#there">ok</a> <a href="b.html#gone">anchor</a>'
        ' <a href="c.html">page</a> <a href="#top">ok</a> <img src="d.png">'
        ' <a href="https://example.invalid/x">another site: not checked</a>'
        ' <script src="_static/x.js?v=1"></script>'
    )
    (tmp_path / "b.html").write_text('<p id="there">B</p>')
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "x.js").write_text("")
    assert _extension().broken_links(tmp_path) == ["a.html: b.html#gone", "a.html: c.html",
                                                   "a.html: d.png"]  # fmt: skip


def test_the_build_s_spelling_pass_finds_a_misspelling(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("The lock is released once teh holder has recieved its answer.\n")
    found = _extension().misspellings([str(page)])
    assert [line.split(": ", 1)[1] for line in found] == [
        "teh ==> the", "recieved ==> received"
    ]  # fmt: skip
    assert _extension().misspellings() == []  # the site's own text


# -- the tutorial in a browser ----------------------------------------------------------------


def test_the_tutorial_renders_in_a_browser(built: Path, browser: Any) -> None:  # noqa: F811
    """Debian's chromium opens the built tutorial from disk: its title, the navigation to
    the other parts and guides, and a highlighted code block."""
    from ..admin.test_browser import ARTIFACTS

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto((built / "tutorial" / "part2.html").as_uri())
    assert page.title().startswith("Part 2: a ticket sale that never oversells")
    assert page.locator("h1").inner_text().startswith("Part 2: a ticket sale")
    navigation = page.locator(".sidebar-tree")
    assert navigation.is_visible()
    for text in ("Tutorial", "Part 1: install, and a first lock", "Topic guides", "Reference"):
        assert navigation.get_by_text(text, exact=True).count() >= 1, text
    code = page.locator("div.highlight-python pre").first
    assert code.is_visible() and "from django.db import models" in code.inner_text()
    assert code.locator("span.kn").count() > 0  # highlighted: keywords are marked up
    caption = page.locator(".code-block-caption").first
    assert caption.inner_text().strip().startswith("shop/models.py")
    page.get_by_role(
        "link", name="Part 3: a Celery task that never runs twice at once"
    ).first.click()
    page.wait_for_url("**/tutorial/part3.html")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "docs-tutorial.png"))
