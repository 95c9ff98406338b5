"""The bench harness runs as `make bench` runs it (``python bench/run.py``), one scenario at a
time with ``BENCH_ONLY``: the fenced-purchases scenario, briefly, on its own PostgreSQL and
Redis. No figure of speed is asserted (those are the bench's); what must hold whatever the
machine's load: no lost update, no buyer of ours waiting on a row, the fence's statements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from ..conftest import ROOT


def bench_only(scenario: str, **knobs: str) -> dict[str, Any]:
    """The figures ``BENCH_ONLY=scenario python bench/run.py`` prints (it writes no file)."""
    env = {**os.environ, "BENCH_ONLY": scenario, **knobs}
    done = subprocess.run(
        [sys.executable, "bench/run.py"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=400, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    printed = "\n".join(line for line in done.stdout.splitlines() if not line.startswith("bench:"))
    return json.loads(printed)


@pytest.mark.timeout(450)
def test_fenced_purchases_scenario_runs_alone_and_reports() -> None:
    from bench.report import report

    # 3 buyers a turn, not 8: each is a process importing Django; 3 contend as 8 do (one
    # holds, the others wait), which is all the assertions below need.
    results = bench_only(
        "fenced", BENCH_CONTENDED_ROUNDS="1", BENCH_FENCED_SECONDS="0.5", BENCH_ROUNDS="1",
        BENCH_SECONDS="0.05", BENCH_FENCED_BUYERS="3",
    )  # fmt: skip
    assert list(results) == ["fenced"]
    fenced = results["fenced"]
    ours, theirs = fenced["lock(atomic=True)"], fenced["select_for_update"]
    assert ours["purchases"] > 0 and theirs["purchases"] > 0
    assert ours["samples"] > 0 and theirs["samples"] > 0
    assert fenced["lost_updates"] == 0
    # Ours wait in Redis: no session ever waits on a row, and at most the holder is in a
    # transaction.
    assert ours["lock_waits_peak"] == 0
    assert ours["in_transaction_peak"] <= 1
    assert fenced["cost"]["statements_per_block"] == 1
    assert fenced["cost"]["statements_first_block"] == 2

    # The report's row, from the committed figures of the other scenarios and these.
    committed = json.loads((ROOT / "bench" / "results.json").read_text())
    text = report({**committed, **results}, {"machine": "test"}, 1.0)
    row = next(line for line in text.splitlines() if line.startswith("| fenced purchases"))
    assert "fence ≤ 2 statements: 2 **met**" in row
    assert "lost updates 0" in row


@pytest.mark.timeout(120)
def test_redis_cpu_scenario_measures_each_command_inside_a_script() -> None:
    """The cost model's figures come from the bench's own server: each probe script's usec
    per call, and each command's inside a script (its probe less the empty script's)."""
    from bench.calibration import BASE, PROBES
    from bench.report import calibration_rows

    results = bench_only("redis cpu", BENCH_CPU_ROUNDS="1", BENCH_CPU_BLOCK="20",
                         BENCH_CPU_CYCLES="50")  # fmt: skip
    calibration = results["redis_cpu"]["calibration"]
    assert set(calibration["usec_per_call"]) == set(PROBES)
    assert all(usec > 0 for usec in calibration["usec_per_call"].values())
    commands = {name for name in PROBES if not name.startswith("empty")}
    assert set(calibration["usec_in_script"]) == commands
    for name in commands:
        expected = calibration["usec_per_call"][name] - calibration["usec_per_call"][BASE]
        assert calibration["usec_in_script"][name] == pytest.approx(expected)
    row, model_row = calibration_rows(results["redis_cpu"])
    assert "inside a script: SET PX" in row[2]
    # The model's prediction of a cycle's two scripts, from the probes alone, beside what
    # the scripts measure: the probes' sum, each part named.
    model, per_call = calibration["model"], calibration["usec_per_call"]
    assert model["cycle"] == pytest.approx(
        model["acquire shape"] + model["release shape"] + model["calls"]
        + model["lock key made and dropped"]
    )  # fmt: skip
    assert (
        model["acquire shape"]
        == per_call["empty script, 5 keys and 5 arguments (acquire.lua's shape)"]
    )
    assert f"model {model['cycle']:.1f}" in model_row[2]
    assert "acquire.lua" in model_row[2] and "release.lua" in model_row[2]


def test_paired_turns_give_the_subject_s_ratio_over_each_other_case() -> None:
    """The uncontended scenario's paired ratios (bench/harness.py): one per other case, the
    subject's rate over it; and the report's row quotes them once a run has them."""
    import math

    from bench.harness import paired
    from bench.report import paired_text

    calls = {"a": 0, "b": 0, "c": 0}

    def case(name: str) -> Any:
        def work() -> None:
            calls[name] += 1

        return work

    ratios = paired({name: case(name) for name in calls}, "a", turn=0.005, rounds=3)
    assert set(ratios) == {"b", "c"}
    assert all(math.isfinite(r) and r > 0 for r in ratios.values())
    assert all(count > 0 for count in calls.values())
    assert paired_text({}) == ""
    text = paired_text({"paired": {"redis-py Lock": 0.9, "raw SET NX PX + EVALSHA": 0.8}})
    assert "0.90 \u00d7 redis-py, 0.80 \u00d7 raw" in text
