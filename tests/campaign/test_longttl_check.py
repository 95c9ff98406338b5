"""The long-TTL kind's judge (longttl.check) on small made-up histories."""

from __future__ import annotations

from typing import Any

from .longttl import check

T0 = 1_000_000.0


def _events(*rows: tuple[float, str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"t": T0 + t, "c": "c1", "e": e, **fields} for t, e, fields in rows]


def _release_error(acquired: float, since: float) -> list[dict[str, Any]]:
    msg = "could not release: only 2 of the 4 nodes that answered still had the hold"
    return _events(
        (acquired - 0.01, "acq", {"h": 1}),
        (acquired, "acq_ok", {"h": 1}),
        (since + 0.2, "rel_err", {"h": 1, "err": "QuorumNotReached", "msg": msg,
                                  "since": T0 + since}),
    )  # fmt: skip


def _pauses(*rows: tuple[int, float, float]) -> list[tuple[int, float, float]]:
    return [(node, T0 + began, T0 + ended) for node, began, ended in rows]


def test_a_release_error_of_a_hold_taken_beside_two_unavailable_nodes_is_not_judged() -> None:
    # Node 1's pause ended 0.7 s before the acquire (still skipped by its breaker), node 2 was
    # paused at it: the hold went to nodes 0, 3 and 4; node 0's pause then made its release
    # undecidable. Only node 0 was paused from 0.5 s before the release.
    pauses = _pauses((1, 0.0, 1.0), (2, 1.5, 2.0), (0, 2.4, 3.0))
    report = check(1, 5.0, _release_error(acquired=1.7, since=2.6), pauses)
    assert report.violations == []


def test_a_release_error_with_one_node_unavailable_all_along_is_judged() -> None:
    # Every node but node 0 was up from a breaker period before the acquire to the release.
    pauses = _pauses((1, 0.0, 0.5), (0, 2.4, 3.0))
    report = check(1, 5.0, _release_error(acquired=1.7, since=2.6), pauses)
    assert [v.prop for v in report.violations] == ["error-one-node-down"]
    assert "at its acquire, or 1 s before: none" in report.violations[0].message
