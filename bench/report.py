"""bench/README.md from the results: the table, the targets met or missed, the plot, and the
machine and versions.

``python -m bench.report`` remakes bench/README.md from bench/results.json alone (no
measuring), as a full `make bench` run does after writing that file; the suite checks that
the two agree (tests/docs/test_docs.py).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

from bench.analysis import analysis
from bench.figures import figures
from bench.harness import (
    CONTENDED_ROUNDS,
    CPU_BLOCK,
    CPU_CYCLES,
    CPU_ROUNDS,
    HERE,
    PAIRED_ROUNDS,
    PAIRED_TURN,
    ROUNDS,
    SECONDS,
)


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def lock_all_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The ``lock_all`` scenario's row, once it has run (bench/scenarios/lock_all.py)."""
    figures = results.get("lock_all")
    if not figures:
        return []
    parts = [f"{size}: lock_all {v['rates']['lock_all']:,.0f}/s, {v['round_trips']['lock_all']:.0f} round trips; "
             f"one by one {v['rates']['one by one']:,.0f}/s, {v['round_trips']['one by one']:.0f} round trips "
             f"({v['ratio']:.2f} ×)" for size, v in figures.items()]  # fmt: skip
    trips = max(v["round_trips"]["lock_all"] for v in figures.values())
    return [("lock_all of 2 and of 10 names vs one by one, single node", "cycles/s; round trips per cycle",
             "<br>".join(parts), f"2 round trips whatever the size: {trips:.0f} {verdict(trips == 2)}")]  # fmt: skip


def paired_text(uncontended: dict[str, Any]) -> str:
    """The uncontended ratios of neighbouring short turns, once a run has measured them."""
    pairs = uncontended.get("paired")
    if not pairs:
        return ""
    return (f"; report: paired {PAIRED_TURN:g} s turns, median of {PAIRED_ROUNDS}: "
            f"{pairs['redis-py Lock']:.2f} × redis-py, {pairs['raw SET NX PX + EVALSHA']:.2f} × raw")  # fmt: skip


def calibration_rows(redis_cpu: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """What a script and each command inside one cost Redis (bench/calibration.py), once a
    run has measured it."""
    calibration = redis_cpu.get("calibration")
    if not calibration:
        return []
    per_call, inside = calibration["usec_per_call"], calibration["usec_in_script"]
    scripts = "; ".join(f"{name} {usec:.2f}" for name, usec in per_call.items()
                        if name.startswith("empty"))  # fmt: skip
    commands = "; ".join(f"{name} {usec:.2f}" for name, usec in inside.items())
    rows = [("Redis's cost of a script and of each command inside one",
             "INFO commandstats µs per EVALSHA call, each probe alone; a command: its probe less the empty script's",
             f"{scripts}<br>inside a script: {commands}", "report (the cost model below)")]  # fmt: skip
    model, measured = calibration.get("model"), redis_cpu.get("usec_per_call", {})
    if model and "acquire.lua" in measured:
        scripts_us = measured["acquire.lua"] + measured["release.lua"]
        rows.append(("the cost model against our two scripts, uncontended cycle",
                     "µs: the probes' sum (shapes + calls + the lock's key made and dropped); measured",
                     f"model {model['cycle']:.1f} (shapes {model['acquire shape']:.1f} + {model['release shape']:.1f}, "
                     f"calls {model['calls']:.1f}, key {model['lock key made and dropped']:.1f}); "
                     f"measured {scripts_us:.1f} (acquire.lua {measured['acquire.lua']:.1f}, release.lua {measured['release.lua']:.1f}): "
                     f"{scripts_us - model['cycle']:+.1f} is the Lua between the calls",
                     "report"))  # fmt: skip
    return rows


def report(results: dict[str, Any], environment: dict[str, str], took: float) -> str:
    u = results["uncontended"]
    rc = results["redis_cpu"]
    rcc, rcs, rcu = rc["cpu_us_per_cycle"], rc["commandstats_us_per_cycle"], rc["usec_per_call"]
    r = u["rates"]
    ours = r["ours"]
    q = results["quorum"]
    z, h = results["contended_zero"], results["contended_10ms"]
    w, a, m = results["watchdog"], results["asyncio"], results["memory"]
    ad, c, o = results["admin"], results["celery"], results["observability"]
    sm, sc = results["semaphore"], results["semaphore_10ms"]
    fp = results["fenced"]
    fs, fl, fc = fp["select_for_update"], fp["lock(atomic=True)"], fp["cost"]
    fence_statements = max(fc["statements_per_block"], fc["statements_first_block"])
    sr = sm["rates"]
    rows = [
        ("uncontended acquire+release, single node", "cycles/s",
         f"ours {ours:,.0f}; raw {r['raw SET NX PX + EVALSHA']:,.0f}; redis-py {r['redis-py Lock']:,.0f}; "
         f"python-redis-lock {r['python-redis-lock']:,.0f}",
         f"≥ 0.95 × raw: {ours / r['raw SET NX PX + EVALSHA']:.2f} × {verdict(ours >= 0.95 * r['raw SET NX PX + EVALSHA'])}; "
         f"≥ 1.0 × redis-py: {ours / r['redis-py Lock']:.2f} × {verdict(ours >= r['redis-py Lock'])}; "
         f"≥ 1.0 × python-redis-lock: {ours / r['python-redis-lock']:.2f} × {verdict(ours >= r['python-redis-lock'])}; "
         f"2 round trips: {u['round_trips']:.2f} {verdict(abs(u['round_trips'] - 2) < 1e-9)}"
         + paired_text(u)),
        ("uncontended cycle, where the time goes", "µs per cycle, wall / client CPU, the cases taking turns",
         "; ".join(f"{name.strip()} {v['wall_us']:.0f} / {v['cpu_us']:.0f}" for name, v in results["floor"].items()),
         "report (see below)"),
        ("uncontended cycle with metrics on (and spans)", "cycles/s, the modes taking turns",
         f"off {o['rates']['off']:,.0f}; metrics {o['rates']['metrics']:,.0f}; metrics + spans {o['rates']['metrics + spans']:,.0f}",
         f"metrics ≥ 0.97 × off: {o['metrics_ratio']:.3f} × {verdict(o['metrics_ratio'] >= 0.97)}; "
         f"report: metrics + spans (SDK, recording, no exporter) {o['spans_ratio']:.3f} ×"),
        ("uncontended, Redlock N=5", "cycles/s",
         f"ours {q['ours Redlock N=5']:,.0f}; pottery {q['pottery Redlock N=5']:,.0f}; ours single {q['ours single node']:,.0f}"
         + (f"; raw sockets N=5 {q['raw N=5']:,.0f}, single {q['raw single node']:,.0f}" if "raw N=5" in q else ""),
         f"≥ 5 × pottery: {q['ours Redlock N=5'] / q['pottery Redlock N=5']:.1f} × {verdict(q['ours Redlock N=5'] >= 5 * q['pottery Redlock N=5'])}; "
         f"≥ 0.5 × single: {q['ours Redlock N=5'] / q['ours single node']:.2f} × {verdict(q['ours Redlock N=5'] >= 0.5 * q['ours single node'])}"),
        ("Redis CPU per uncontended acquire+release, single node",
         "INFO cpu (user + sys) µs/cycle; INFO commandstats µs/cycle; µs per script call",
         f"CPU: ours {rcc['ours']:.1f}, raw {rcc['raw']:.1f} (turn ratios p10/p50/p90 "
         + "/".join(f"{x:.2f}" for x in rc["cpu_ratio_of_turns_p10_p50_p90"]) + "); "
         f"commandstats: ours {rcs['ours']:.1f}, raw {rcs['raw']:.1f} ({rc['commandstats_ratio']:.1f} ×); "
         f"acquire.lua {rcu['acquire.lua']:.1f}, release.lua {rcu['release.lua']:.1f}, "
         f"raw SET NX PX {rcu['raw SET NX PX']:.1f}, raw compare-and-delete {rcu['raw compare-and-delete']:.1f}",
         f"≤ 1.3 × raw (INFO cpu, {rc['cycles']:,} cycles each): {rc['cpu_ratio']:.2f} × {verdict(rc['cpu_ratio'] <= 1.3)}"),
        *calibration_rows(rc),
        ("contended, 8 processes, zero-length hold", "acq/s; hand-off p50/p99; worst wait; commands/acq; Redis CPU/acq",
         "<br>".join(f"{lib}: {s['per_second']:,.0f}/s; {s['handoff_p50_ms']:.2f}/{s['handoff_p99_ms']:.2f} ms; "
                     f"worst {s['worst_wait_ms']:.0f} ms (p99 {s['wait_p99_ms']:.0f} ms); "
                     f"{s['commands_per_acquisition']:.1f} cmds; {s['redis_cpu_us_per_acquisition']:.0f} µs"
                     for lib, s in z.items()),
         f"hand-off p50 < 1 ms: {z['ours']['handoff_p50_ms']:.2f} ms {verdict(z['ours']['handoff_p50_ms'] < 1)}, "
         f"fair {z['ours-fair']['handoff_p50_ms']:.2f} ms {verdict(z['ours-fair']['handoff_p50_ms'] < 1)}; "
         f"commands ≤ 5: {z['ours']['commands_per_acquisition']:.1f} {verdict(z['ours']['commands_per_acquisition'] <= 5)}, "
         f"fair {z['ours-fair']['commands_per_acquisition']:.1f} {verdict(z['ours-fair']['commands_per_acquisition'] <= 5)}; "
         f"fair worst wait ≤ 2 × FIFO ideal ({z['ours-fair']['fifo_ideal_ms']:.0f} ms): {z['ours-fair']['worst_wait_ms']:.0f} ms "
         f"{verdict(z['ours-fair']['worst_wait_ms'] <= 2 * z['ours-fair']['fifo_ideal_ms'])}"),
        ("contended, 8 processes, 10 ms hold", "acq/s vs the 100/s ideal",
         "<br>".join(f"{lib}: {s['per_second']:.1f}/s ({s['per_second'] / 100:.2f} × ideal), worst wait {s['worst_wait_ms']:.0f} ms"
                     for lib, s in h.items()),
         f"≥ 0.95 × ideal: {h['ours']['per_second'] / 100:.2f} × {verdict(h['ours']['per_second'] >= 95)}, "
         f"fair {h['ours-fair']['per_second'] / 100:.2f} × {verdict(h['ours-fair']['per_second'] >= 95)}"),
        ("watchdog, 10,000 held locks, ttl 3 s", "round trips; renewer CPU",
         f"{w['round_trips_per_second']:.1f} round trips/s = {w['round_trips_per_100_locks_per_period']:.3f} per 100 locks per period; "
         f"CPU {w['renewer_cpu_percent']:.1f} % of a core; still held {w['sampled_still_held']}",
         f"≤ 1 per 100 locks per period {verdict(w['round_trips_per_100_locks_per_period'] <= 1)}; "
         f"CPU < 5 % {verdict(w['renewer_cpu_percent'] < 5)}"),
        ("asyncio, 200 tasks on one lock", "acq/s; p99 wait",
         "<br>".join(f"{lib}: {s['per_second']:,.0f}/s; p99 {s['p99_wait_ms']:.0f} ms" for lib, s in a.items()),
         f"report: ours {a['ours']['per_second'] / a['redis-py asyncio Lock']['per_second']:.1f} × redis-py's rate"),
        ("memory per held lock in Redis", "MEMORY USAGE of all its keys",
         f"plain {m['plain']} B; reentrant {m['reentrant']} B; fair (one waiter) {m['fair']} B",
         f"plain ≤ 200 B {verdict(m['plain'] <= 200)}"),
        ("admin listing, 100,000 held locks", "one changelist page",
         f"{ad['page_seconds'] * 1000:.0f} ms for {ad['rows_on_page']} rows",
         f"< 1 s {verdict(ad['page_seconds'] < 1)}"),
        ("semaphore (limit 3) acquire+release, uncontended", "cycles/s; round trips",
         f"ours {sr['ours']:,.0f}; hand-rolled sorted-set recipe {sr['sorted-set recipe']:,.0f} "
         f"(no crash safety, no fencing, client clocks)",
         f"≥ 1.0 × recipe: {figures(results)['semaphore.vs_recipe'].value} {verdict(sr['ours'] >= sr['sorted-set recipe'])}; "
         f"2 round trips: {sm['round_trips']:.2f} {verdict(abs(sm['round_trips'] - 2) < 1e-9)}"),
        ("semaphore (limit 3) cycle in Redis", "INFO cpu µs/cycle; commandstats µs/cycle; µs per script call",
         f"CPU: ours {sm['redis_cost']['cpu_us_per_cycle']['ours']:.1f}, recipe {sm['redis_cost']['cpu_us_per_cycle']['sorted-set recipe']:.1f} "
         f"({sm['redis_cost']['cpu_ratio']:.2f} ×); commandstats: ours {sm['redis_cost']['commandstats_us_per_cycle']['ours']:.1f}, "
         f"recipe {sm['redis_cost']['commandstats_us_per_cycle']['sorted-set recipe']:.1f}; "
         f"permit_acquire.lua {sm['usec_per_call']['permit_acquire.lua']:.1f}, permit_release.lua {sm['usec_per_call']['permit_release.lua']:.1f}",
         "report"),
        ("semaphore memory in Redis", "MEMORY USAGE",
         f"one permit held {sm['memory']['ours_one_permit']} B (leases, details, fence counter); "
         f"+{sm['memory']['ours_per_permit']:.0f} B per more permit; recipe with 3 {sm['memory']['recipe_three_permits']} B",
         "report"),
        ("semaphore of 3, 8 processes, 10 ms hold", "acq/s vs the 300/s ideal; wake-up p50/p99",
         "<br>".join(f"{lib}: {v['per_second']:.0f}/s ({v['per_second'] / 300:.2f} × ideal); wake-up "
                     f"{v['wake_p50_ms']:.2f}/{v['wake_p99_ms']:.2f} ms; {v['commands_per_acquisition']:.1f} cmds/acq"
                     for lib, v in sc.items()),
         "report"),
        ("Celery `@single_instance` overhead", "extra round trips; µs per task",
         f"{c['round_trips']:.1f} round trips; {c['overhead_us']:.0f} µs per task (`task.apply`)",
         f"≤ 2 round trips {verdict(c['round_trips'] <= 2)}"),
        ("fenced purchases on PostgreSQL, 8 processes",
         "purchases/s; connections waiting in a transaction, peak/mean (on the row's lock); buyers' CPU per purchase; fence check per block",
         "<br>".join(f"{mode}: {v['per_second']:,.0f}/s; {v['waiting_in_transaction_peak']:.0f}/{v['waiting_in_transaction_mean']:.1f} "
                     f"waiting in a transaction ({v['lock_waits_peak']:.0f}/{v['lock_waits_mean']:.1f} on the row's lock); "
                     f"buyers' CPU {v['buyer_cpu_us_per_purchase']:,.0f} µs per purchase"
                     for mode, v in (("select_for_update", fs), ("lock(atomic=True)", fl)))
         + f"<br>fence check: {fc['statements_per_block']} statement ({fc['statements_first_block']} on a name's first block), "
         f"{fc['fence_us_per_block']:.0f} µs per block; an empty fenced block {fc['empty_fenced_block_us_over_plain']:.0f} µs "
         f"over an empty plain transaction; lost updates {fp['lost_updates']}",
         f"≥ 1.0 × select_for_update: {fp['ratio']:.2f} × {verdict(fp['ratio'] >= 1)}; "
         f"fence ≤ 2 statements: {fence_statements} {verdict(fence_statements <= 2)}"),
    ]  # fmt: skip
    rows += lock_all_rows(results)
    table = "\n".join(f"| {a} | {b} | {c_} | {d} |" for a, b, c_, d in rows)
    env = "\n".join(f"- {k}: {v}" for k, v in environment.items())
    return f"""# Benchmarks

Generated by `make bench` ({took:.0f} s). Every library ran on the same redis-server(s) in the
same run, the libraries taking turns ({ROUNDS} rounds of {SECONDS:g} s for the in-process
scenarios, {CONTENDED_ROUNDS} rounds of 2.5 s with 8 processes for the contended ones); figures are medians.
Absolute numbers on a shared 2-core machine are noise: read the ratios.

| scenario | measure | result | target |
|---|---|---|---|
{table}

![hand-off latency and worst waits](results.png)

How each figure is taken (one module per scenario in `bench/scenarios/`, `bench/contender.py`):

- *raw* is the floor: `SET NX PX` + a compare-and-delete `EVALSHA`, on our backend's own client.
- Uncontended, *paired*: ours and the anchors take turns of {PAIRED_TURN:g} s ({PAIRED_ROUNDS}
  rounds, the order reversed every other round); each ratio is the median of the ratios of
  neighbouring turns, which share the machine's load where rates taken seconds apart do not.
- Round trips are counted by the backend; *commands per acquisition* are the commands each
  contending process sent (counted in redis-py's connection), divided by its acquisitions.
- Redis CPU: `INFO cpu` (`used_cpu_user` + `used_cpu_sys` of the redis-server) around turns of
  {CPU_BLOCK} cycles, ours and raw (or the recipe) taking turns, {CPU_ROUNDS} turns each, summed:
  everything Redis does for a cycle, reading and replying included. `INFO commandstats` usec
  of the commands the client sends itself (a script's own calls are inside its `EVALSHA`, a
  MULTI's inside its `EXEC`): the time inside the commands, less noisy. Each script's usec per
  call comes from {CPU_CYCLES:,} calls of it alone. Contended: `INFO cpu` over each run, divided
  by its acquisitions.
- A script's and a command's cost (`bench/calibration.py`): probe scripts (empty, with 0, 1
  and 5 keys and as many arguments; one command each with 1 key and 1 argument) run alone,
  {CPU_CYCLES:,} calls each after `CONFIG RESETSTAT`, taking turns over 3 rounds; the median
  `EVALSHA` usec per call. A command's cost inside a script is its probe's less the empty
  script's of the same shape.
- Hand-off latency: from one holder's release call to the next holder's acquisition,
  across processes (one monotonic clock). *FIFO ideal* worst wait: 7 hand-off cycles.
- Worst wait: the longest wait of any acquisition but each process's first (which includes
  its start-up: connections, scripts, subscriptions). The processes start together and
  finish together, so none exits (and takes CPU) while others still contend.
- redis-py's `Lock` polls every 0.1 s while it waits, python-redis-lock waits on `BLPOP`,
  pottery polls with random sleeps; we wait on pub/sub, one waiter woken per release.
- Memory: `MEMORY USAGE` of the lock's keys (the lock, its fence counter, and a fair lock's
  queue and deadlines), with this machine's host name and thread name in the holder field
  (about a byte per character of each).
- Every other scenario runs as `make bench` installs the app (its `test` extra): with
  `prometheus_client` and `opentelemetry-api`, so with metrics on (the default) and no tracer
  provider (no spans).
- Metrics overhead: the uncontended cycle in one process with everything off, with
  Prometheus metrics on, and with metrics and OpenTelemetry spans on (the SDK's tracer
  provider, recording, exporting nowhere), in turns of 0.25 s; the ratio is the median of
  each turn's rate over the neighbouring "off" turn's.
- Admin: one rendered changelist page (`SCAN` page + one pipelined inspect) with 100,000
  held locks in the backend.
- Fenced purchases (`bench/fenced_buyer.py`): a throwaway PostgreSQL {fp["postgresql"]} (fsync
  off), one ticket row, and per purchase the ORM's read, `stock -= 1`, `save()` and a new
  `Sale` row; 8 processes buy for {fp["seconds"]:g} s, the two ways taking turns
  ({CONTENDED_ROUNDS} rounds). `select_for_update`: `Ticket.objects.select_for_update().get()`
  in `transaction.atomic()`, the others wait on the row inside their transactions. Ours:
  `with lock("ticket:1", atomic=True)` and a plain `get()`; the others wait in Redis, with no
  transaction open. *Waiting in a transaction*: `pg_stat_activity` sampled every 5 ms, the
  sessions `active` on a `Lock` wait or `idle in transaction` (the holder between its
  statements counts, so ours shows at most 1); peak and mean per turn. *Lost updates*: sales
  made minus the stock's fall (0: every purchase sold one seat once). Fence statements:
  `CaptureQueriesContext` around a fenced block, less a plain `transaction.atomic()`'s. Its
  time: the same lock around `transaction.atomic()` and as a fenced block, with one `SELECT
  1` in the body (the check alone), and empty (the check, and the BEGIN and COMMIT an empty
  plain block never sends): {4 * ROUNDS} pairs of neighbouring turns of {SECONDS / 4:g} s,
  which goes first alternating, and the median of each pair's difference (the machine's
  load drifts over seconds; a difference of medians taken apart carried that drift). *Buyers'
  CPU*: `time.process_time()` of each buyer over its buying, summed, per purchase (a waiting
  buyer uses none; PostgreSQL's and Redis's CPU are not in it).

{analysis(results)}
## Machine and versions

{env}
"""


def without_samples(results: dict[str, Any]) -> dict[str, Any]:
    """The figures, without the raw hand-off samples (the plot has them)."""
    if isinstance(results, dict):
        return {k: without_samples(v) for k, v in results.items() if k != "handoffs_ms"}
    return results


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    zero = results["contended_zero"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for lib, summary in zero.items():
        values = sorted(summary["handoffs_ms"])
        if values:
            left.plot(values, [i / len(values) for i in range(len(values))], label=lib)
    left.set_xscale("log")
    left.set_xlabel("hand-off latency, ms (log)")
    left.set_ylabel("share of hand-offs")
    left.set_title("8 processes, zero-length hold: hand-off latency (CDF)")
    left.legend()
    libs = list(zero)
    right.bar(libs, [zero[lib]["worst_wait_ms"] for lib in libs])
    right.axhline(zero["ours-fair"]["fifo_ideal_ms"], color="gray", linestyle="--",
                  label="FIFO ideal")  # fmt: skip
    right.set_ylabel("worst wait, ms")
    right.set_title("worst wait of one acquisition (starvation)")
    right.legend()
    plt.setp(right.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(HERE / "results.png", dpi=110)


def environment(server: Any) -> dict[str, str]:
    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "?"

    info = server.client().info()
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "redis-server": f"{info['redis_version']} ({info.get('mem_allocator', '?')} allocator)",
        **{p: version(p) for p in ("django-redlock", "redis", "hiredis", "Django", "celery",
                                   "python-redis-lock", "pottery", "psycopg")},
    }  # fmt: skip


def write_report() -> str:
    """bench/README.md made from bench/results.json; returns the text written."""
    results = json.loads((HERE / "results.json").read_text())
    text = report(results, results["run"]["environment"], results["run"]["seconds"])
    (HERE / "README.md").write_text(text)
    return text


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.exit("run it as: python -m bench.report")
    write_report()
