"""The figures the docs and the README quote, by name, from the last full `make bench` run.

One source: ``bench/results.json``, which ``bench/run.py`` writes at the end of a full run.
The docs quote a figure with the Sphinx role ``{bench}`name``` (docs/_ext/redlock_docs.py);
the README with an inline generated span ``<!-- bench: name -->...<!-- /bench -->``, which
``python -m bench.figures`` rewrites (tests/docs/test_readme.py fails while one differs). A figure
with a target it missed says so wherever it is quoted: ``0.78 x (target >= 0.95 x:
missed)`` (with a times sign).

Each figure names the row of bench/README.md's table it comes from (``scenario``), so a page
can cite it as "(bench: <scenario>)".
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
README = HERE.parent / "README.md"
SPAN = re.compile(r"<!-- bench: ([\w.-]+) -->(.*?)<!-- /bench -->")


@dataclass(frozen=True)
class Figure:
    name: str
    value: str  # as quoted: "0.49 ms"
    scenario: str  # the first column of bench/README.md's table
    target: str | None = None  # "< 1 ms", when the figure has one
    met: bool | None = None

    @property
    def missed(self) -> bool:
        return self.met is False

    def markdown(self) -> str:
        """As the README quotes it (a missed target in bold, as the report's table has it)."""
        return f"{self.value} (target {self.target}: **missed**)" if self.missed else self.value

    def plain(self) -> str:
        return f"{self.value} (target {self.target}: missed)" if self.missed else self.value


def load(path: Path = RESULTS) -> dict[str, Any]:
    return json.loads(path.read_text())


def _ratio(x: float, threshold: float, met: bool, digits: int = 2) -> str:
    """A ratio to ``digits`` places, or one more when rounding would hide the verdict
    (0.997 shown as 1.00 against a target of 1.0)."""
    text = f"{x:.{digits}f}"
    if (float(text) >= threshold) != met:
        text = f"{x:.{digits + 1}f}"
    return f"{text} ×"


def figures(results: dict[str, Any] | None = None) -> dict[str, Figure]:
    """Every quotable figure of a run, by name."""
    r = load() if results is None else results
    out: dict[str, Figure] = {}

    def add(name: str, value: str, scenario: str, target: str | None = None,
            met: bool | None = None) -> None:  # fmt: skip
        out[name] = Figure(name, value, scenario, target, met)

    s = "uncontended acquire+release, single node"
    u = r["uncontended"]["rates"]
    ours, raw = u["ours"], u["raw SET NX PX + EVALSHA"]
    add("uncontended.ours", f"{ours:,.0f}", s)
    add("uncontended.raw", f"{raw:,.0f}", s)
    add("uncontended.redis_py", f"{u['redis-py Lock']:,.0f}", s)
    add("uncontended.python_redis_lock", f"{u['python-redis-lock']:,.0f}", s)
    for name, anchor, threshold in (("raw", raw, 0.95), ("redis_py", u["redis-py Lock"], 1.0),
                                    ("python_redis_lock", u["python-redis-lock"], 1.0)):  # fmt: skip
        met = ours >= threshold * anchor
        add(f"uncontended.vs_{name}", _ratio(ours / anchor, threshold, met), s,
            f"≥ {threshold:g} ×", met)  # fmt: skip
    trips = r["uncontended"]["round_trips"]
    add("uncontended.round_trips", f"{trips:g}", s, "2", abs(trips - 2) < 1e-9)

    s = "uncontended cycle, where the time goes"
    f = r["floor"]
    add("floor.lock_object_us", f"{f['Lock object, I/O answered in-process']['wall_us']:.0f} µs", s)
    add("floor.scripts_us", f"{f['our two scripts']['wall_us']:.0f} µs", s)
    add("floor.raw_us", f"{f['raw SET NX PX + EVALSHA']['wall_us']:.0f} µs", s)

    s = "uncontended cycle with metrics on (and spans)"
    o = r["observability"]
    add("metrics.ratio", _ratio(o["metrics_ratio"], 0.97, o["metrics_ratio"] >= 0.97, 3), s,
        "≥ 0.97 ×", o["metrics_ratio"] >= 0.97)  # fmt: skip
    add("metrics.spans_ratio", f"{o['spans_ratio']:.2f} ×", s)

    s = "uncontended, Redlock N=5"
    q = r["quorum"]
    n5, pottery, single = q["ours Redlock N=5"], q["pottery Redlock N=5"], q["ours single node"]
    add("redlock.ours", f"{n5:,.0f}", s)
    add("redlock.pottery", f"{pottery:,.0f}", s)
    add("redlock.single", f"{single:,.0f}", s)
    add("redlock.vs_pottery", f"{n5 / pottery:.1f} ×", s, "≥ 5 ×", n5 >= 5 * pottery)
    add("redlock.vs_single", f"{n5 / single:.2f} ×", s, "≥ 0.5 ×", n5 >= 0.5 * single)
    raw5, raw1 = q.get("raw N=5"), q.get("raw single node")  # anchors of later full runs
    if raw5 and raw1:
        add("redlock.raw_n5", f"{raw5:,.0f}", s)
        add("redlock.raw_single", f"{raw1:,.0f}", s)
        add("redlock.vs_raw_n5", f"{n5 / raw5:.2f} ×", s)
        add("redlock.raw_ceiling", f"{raw5 / raw1:.2f} ×", s)
    else:
        for name in ("raw_n5", "raw_single", "vs_raw_n5", "raw_ceiling"):
            add(f"redlock.{name}", "(not measured in that run)", s)

    s = "Redis CPU per uncontended acquire+release, single node"
    c = r["redis_cpu"]
    add("redis_cpu.ratio", f"{c['cpu_ratio']:.2f} ×", s, "≤ 1.3 ×", c["cpu_ratio"] <= 1.3)
    cs = c["commandstats_us_per_cycle"]
    add("redis_cpu.commandstats_extra_us", f"{cs['ours'] - cs['raw']:.0f} µs", s)

    s = "contended, 8 processes, zero-length hold"
    z = r["contended_zero"]
    for lib, key in (("ours", "ours"), ("fair", "ours-fair"), ("redis_py", "redis-py"),
                     ("python_redis_lock", "python-redis-lock"), ("pottery", "pottery")):  # fmt: skip
        v = z[key]
        ours_ = lib in ("ours", "fair")
        p50 = v["handoff_p50_ms"]
        add(f"contended.{lib}.handoff_p50", f"{p50:.2f} ms", s,
            *(("< 1 ms", p50 < 1) if ours_ else (None, None)))  # fmt: skip
        add(f"contended.{lib}.handoff_p99", f"{v['handoff_p99_ms']:.2f} ms", s)
        worst, ideal = v["worst_wait_ms"], v["fifo_ideal_ms"]
        if lib == "fair":
            add("contended.fair.worst_wait", f"{worst:.0f} ms", s,
                f"≤ 2 × the FIFO ideal, {2 * ideal:.0f} ms", worst <= 2 * ideal)  # fmt: skip
        else:
            add(f"contended.{lib}.worst_wait", f"{worst:,.0f} ms", s)
        add(f"contended.{lib}.wait_p99", f"{v['wait_p99_ms']:.0f} ms", s)
        add(f"contended.{lib}.rate", f"{v['per_second']:,.0f}", s)
        cmds = v["commands_per_acquisition"]
        add(f"contended.{lib}.commands", f"{cmds:.1f}", s,
            *(("≤ 5", cmds <= 5) if ours_ else (None, None)))  # fmt: skip

    s = "contended, 8 processes, 10 ms hold"
    for lib, key in (("ours", "ours"), ("fair", "ours-fair"), ("redis_py", "redis-py"),
                     ("python_redis_lock", "python-redis-lock")):  # fmt: skip
        rate = r["contended_10ms"][key]["per_second"]
        ours_ = lib in ("ours", "fair")
        add(f"hold10.{lib}.ideal", f"{rate / 100:.2f} ×", s,
            *(("≥ 0.95 ×", rate >= 95) if ours_ else (None, None)))  # fmt: skip
        add(f"hold10.{lib}.worst_wait", f"{r['contended_10ms'][key]['worst_wait_ms']:,.0f} ms", s)

    s = "watchdog, 10,000 held locks, ttl 3 s"
    w = r["watchdog"]
    per = w["round_trips_per_100_locks_per_period"]
    add("watchdog.round_trips", f"{per:.1f}", s, "≤ 1", per <= 1)
    cpu = w["renewer_cpu_percent"]
    add("watchdog.cpu", f"{cpu:.1f} %", s, "< 5 %", cpu < 5)

    s = "asyncio, 200 tasks on one lock"
    a = r["asyncio"]
    add("asyncio.ours", f"{a['ours']['per_second']:,.0f}", s)
    add("asyncio.redis_py", f"{a['redis-py asyncio Lock']['per_second']:,.0f}", s)
    add("asyncio.ratio", f"{a['ours']['per_second'] / a['redis-py asyncio Lock']['per_second']:.1f} ×", s)  # fmt: skip

    s = "memory per held lock in Redis"
    m = r["memory"]
    add("memory.plain", f"{m['plain']} B", s, "≤ 200 B", m["plain"] <= 200)
    add("memory.reentrant", f"{m['reentrant']} B", s)
    add("memory.fair", f"{m['fair']} B", s)

    s = "admin listing, 100,000 held locks"
    page = r["admin"]["page_seconds"]
    add("admin.page", f"{page * 1000:.0f} ms", s, "< 1 s", page < 1)

    s = "semaphore (limit 3) acquire+release, uncontended"
    sr = r["semaphore"]["rates"]
    sem, recipe = sr["ours"], sr["sorted-set recipe"]
    add("semaphore.ours", f"{sem:,.0f}", s)
    add("semaphore.recipe", f"{recipe:,.0f}", s)
    add("semaphore.vs_recipe", _ratio(sem / recipe, 1.0, sem >= recipe), s, "≥ 1.0 ×", sem >= recipe)  # fmt: skip
    sem_trips = r["semaphore"]["round_trips"]
    add("semaphore.round_trips", f"{sem_trips:g}", s, "2", abs(sem_trips - 2) < 1e-9)

    s = "semaphore of 3, 8 processes, 10 ms hold"
    sc = r["semaphore_10ms"]
    add("semaphore10.ours.ideal", f"{sc['ours-semaphore']['per_second'] / 300:.2f} ×", s)
    add("semaphore10.ours.commands", f"{sc['ours-semaphore']['commands_per_acquisition']:.1f}", s)
    add("semaphore10.recipe.commands",
        f"{sc['sorted-set-semaphore']['commands_per_acquisition']:.0f}", s)  # fmt: skip

    s = "Celery `@single_instance` overhead"
    ct = r["celery"]["round_trips"]
    add("celery.round_trips", f"{ct:g}", s, "≤ 2", ct <= 2)
    add("celery.overhead_us", f"{r['celery']['overhead_us']:.0f} µs", s)

    s = "fenced purchases on PostgreSQL, 8 processes"
    fp = r["fenced"]
    add("fenced.vs_select_for_update", _ratio(fp["ratio"], 1.0, fp["ratio"] >= 1), s,
        "≥ 1.0 ×", fp["ratio"] >= 1)  # fmt: skip
    add("fenced.select_for_update.rate", f"{fp['select_for_update']['per_second']:,.0f}", s)
    add("fenced.ours.rate", f"{fp['lock(atomic=True)']['per_second']:,.0f}", s)
    add("fenced.select_for_update.waiting_peak",
        f"{fp['select_for_update']['waiting_in_transaction_peak']:.0f}", s)  # fmt: skip
    add("fenced.ours.waiting_peak", f"{fp['lock(atomic=True)']['waiting_in_transaction_peak']:.0f}", s)  # fmt: skip
    statements = max(fp["cost"]["statements_per_block"], fp["cost"]["statements_first_block"])
    add("fenced.statements", f"{fp['cost']['statements_per_block']}", s, "≤ 2", statements <= 2)
    add("fenced.fence_us", f"{fp['cost']['fence_us_per_block']:.0f} µs", s)
    add("fenced.lost_updates", f"{fp['lost_updates']}", s)
    return out


def render_spans(text: str, found: dict[str, Figure] | None = None) -> str:
    """``text`` with every ``<!-- bench: name -->...<!-- /bench -->`` span's content made the
    figure's current value."""
    found = figures() if found is None else found

    def one(match: re.Match[str]) -> str:
        name = match[1]
        if name not in found:
            raise KeyError(f"no bench figure {name!r} (bench/figures.py)")
        return f"<!-- bench: {name} -->{found[name].markdown()}<!-- /bench -->"

    return SPAN.sub(one, text)


def main(argv: list[str]) -> int:
    """``python -m bench.figures``: rewrite the README's figures from bench/results.json;
    ``--check``: exit 1 (naming them) when one differs; ``--list``: every figure."""
    if "--list" in argv:
        for figure in figures().values():
            print(f"{figure.name}: {figure.plain()}  [{figure.scenario}]")
        return 0
    text = README.read_text()
    new = render_spans(text)
    if "--check" in argv:
        old = dict(SPAN.findall(text))
        stale = {k: v for k, v in SPAN.findall(new) if old.get(k) != v}
        for name, value in stale.items():
            print(f"README.md: {name} is {value!r} in bench/results.json, not {old.get(name)!r}")
        return 1 if stale else 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
