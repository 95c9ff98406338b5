"""The randomized fault campaign (see tests/campaign/README.md): clients take a lock and write
to a fenced resource while a seeded nemesis kills, pauses and restarts clients and servers
and loses replies; the checker then judges the whole history.

``make test`` runs each backend and kind once for a few seconds with a fixed seed;
``make soak SECONDS=600 SEED=123`` runs them as long as asked with one seed (environment:
CAMPAIGN_SECONDS, CAMPAIGN_SEED, and optionally CAMPAIGN_BACKEND / CAMPAIGN_KIND).
"""

from __future__ import annotations

import os

import pytest

from .harness import run_campaign

#: (backend, kind, seed): Redlock offers plain locks only.
COMBINATIONS = [("redis", "plain", 11), ("redis", "reentrant", 12), ("redis", "fair", 13),
                ("redlock", "plain", 14)]  # fmt: skip
SEED = os.environ.get("CAMPAIGN_SEED")


def _cases() -> list[tuple[str, str, int]]:
    only_backend = os.environ.get("CAMPAIGN_BACKEND")
    only_kind = os.environ.get("CAMPAIGN_KIND")
    return [
        (backend, kind, int(SEED) if SEED else seed)
        for backend, kind, seed in COMBINATIONS
        if backend == (only_backend or backend) and kind == (only_kind or kind)
    ]


CASES = _cases()
#: Seconds of campaign in all, shared by the cases: about 12 s each in ``make test``.
SECONDS = float(os.environ.get("CAMPAIGN_SECONDS") or 12 * len(COMBINATIONS)) / max(1, len(CASES))


@pytest.mark.timeout(SECONDS + 90)
@pytest.mark.parametrize(("backend", "kind", "seed"), CASES)
def test_campaign(backend: str, kind: str, seed: int) -> None:
    report = run_campaign(backend, kind, seed, SECONDS)
    print("\n" + report.summary())
    assert report.ok, report.details()
