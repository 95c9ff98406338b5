"""The randomized fault campaign (see tests/campaign/README.md): clients take a lock and write
to a fenced resource while a seeded nemesis kills, pauses and restarts clients and servers
and loses replies; the checker then judges the whole history.

``make test`` runs every backend and kind with a fixed seed, 60 s of faults shared by the main
harness's kinds (7.5 s each, Redlock 15 s) and 6 s each for the Cluster, Celery and Sentinel
kinds (about 130 s in all);
``make soak SECONDS=600 SEED=123`` shares SECONDS among them with one seed (environment:
CAMPAIGN_SECONDS, CAMPAIGN_SEED, and optionally CAMPAIGN_BACKEND / CAMPAIGN_KIND).
"""

from __future__ import annotations

import os

import pytest

from .celery_kind import run_celery
from .cluster import run_cluster
from .harness import run_campaign
from .longttl import run_longttl
from .sentinel import run_sentinel

#: (backend, kind, seed, share of the time): Redlock offers plain locks only, and gets the
#: most time: its faults need a hold to meet them on the right nodes. "semaphore": permits
#: of a semaphore (limit 2, four clients); "write": a read-write lock, writers and readers;
#: "database": fenced transactions (atomic=) on a PostgreSQL (database.py).
COMBINATIONS = [
    ("redis", "plain", 11, 1.0),
    ("redis", "reentrant", 12, 1.0),
    ("redis", "fair", 13, 1.0),
    ("redis", "semaphore", 14, 1.0),
    ("redis", "write", 15, 1.0),
    ("redis", "database", 29, 1.0),  # its plan steps the clock (a snapshot restore)
    ("redlock", "plain", 21, 2.0),
    # Kinds of their own (scenario.py), on top of the share of the others: 6 s in `make test`
    # (their processes start once the run began counting), 0.6 of a share under `make soak`.
    ("cluster", "cluster", 23, 0.6),  # cluster.py: master pauses, failovers (replicas)
    ("celery", "celery", 24, 0.6),  # celery_kind.py: workers, soft time limits, coalesce
    ("sentinel", "sentinel", 26, 0.6),  # sentinel.py: failovers, master pauses and kills
]
OWN_KINDS = ("cluster", "celery", "sentinel", "long-ttl")
#: Under `make soak` (CAMPAIGN_SECONDS given) or when CAMPAIGN_KIND names them: not in `make
#: test`'s budget. "long-ttl" (longttl.py): Redlock holds of 20 s, single-node pauses.
SOAK = [("redlock", "long-ttl", 25, 0.6)]
#: Run only when CAMPAIGN_KIND names their kind (not in `make test`).
ON_REQUEST = [("redlock", "database", 22, 2.0)]
#: 7.5 s for each of the main harness's kinds (the floor below), 15 s for Redlock's (its
#: throughput phase needs 15): 8 and 16 s before the Sentinel kind, which costs about 15 s
#: with its start and stop. With the Cluster, Celery and Sentinel kinds, `make test`'s
#: campaign takes about 130 s.
DEFAULT_SECONDS = 60.0
SEED = os.environ.get("CAMPAIGN_SEED")
ONLY_BACKEND = os.environ.get("CAMPAIGN_BACKEND")
ONLY_KIND = os.environ.get("CAMPAIGN_KIND")
CASES = [
    (backend, kind, int(SEED) if SEED else seed, share)
    for backend, kind, seed, share in COMBINATIONS
    + (ON_REQUEST if ONLY_KIND else [])
    + (SOAK if ONLY_KIND or os.environ.get("CAMPAIGN_SECONDS") else [])
    if backend == (ONLY_BACKEND or backend) and kind == (ONLY_KIND or kind)
]
TOTAL = float(os.environ.get("CAMPAIGN_SECONDS") or DEFAULT_SECONDS)
SHARES = (
    sum(share for _, kind, _, share in CASES if kind not in OWN_KINDS)
    or sum(share for *_, share in CASES)
    or 1.0
)
#: Each case runs at least this long: shorter, a loaded machine's clients barely start (a run
#: of 3.75 s per case saw no client at all), and a run that did nothing is a failure below;
#: under 7.5 s the nemesis fits no storm (WARMUP + 2 s + CALM): at 7.5 a storm of 2 s.
MIN_SECONDS = 7.5
#: Moves left out of `make test`'s fixed seeds (not of a run with CAMPAIGN_SEED) while what
#: they find is open ("move:kind": in one kind only). "tracer" was, for its renewal
#: starvation (fixed), then for seed 2011's `error-latency` (150 s: the traced client's
#: acquires under a black hole raised `BackendUnavailable` 0.61-0.65 s after the call,
#: socket timeout 0.2): a caller queued for a pooled connection got a closed one as its
#: holder's command timed out, and reconnected with a whole socket timeout of its own; fixed
#: in session 21 (fast_path.CallPool: within what is left of the call's). README "Seeds
#: with the asyncio and tracer moves".
#: "retry" was, until session 24's fix of what it found with the wire move: a sync try's
#: request that landed after its object's retry was granted and released, held by nobody to
#: its TTL (seed 2404; README "Moves of reports asy3 and wai2"). None now.
FIXED_SEEDS_MOVES_OFF: frozenset[str] = frozenset()
#: The Cluster, Celery and Sentinel kinds start their clients before their clock runs, and
#: plan a fault within their first 6 s.
MIN_OWN_SECONDS = 6.0


@pytest.mark.timeout(TOTAL + 120)
@pytest.mark.parametrize(
    ("backend", "kind", "seed", "seconds"),
    [
        (
            backend,
            kind,
            seed,
            max(MIN_OWN_SECONDS if kind in OWN_KINDS else MIN_SECONDS, TOTAL * share / SHARES),
        )
        for backend, kind, seed, share in CASES
    ],
)
def test_campaign(backend: str, kind: str, seed: int, seconds: float) -> None:
    if kind == "cluster":
        report = run_cluster(seed, seconds)
    elif kind == "celery":
        report = run_celery(seed, seconds)
        from celery import current_app  # the suite's shared tasks still publish where they did

        assert current_app.main != "campaign-producer"
    elif kind == "sentinel":
        report = run_sentinel(seed, seconds)
    elif kind == "long-ttl":
        report = run_longttl(seed, seconds)
    else:
        report = run_campaign(
            backend, kind, seed, seconds, frozenset() if SEED else FIXED_SEEDS_MOVES_OFF
        )
    print("\n" + report.summary())
    assert report.ok, report.details()
    # A run that did nothing proves nothing: clients ran, held and wrote, and faults came.
    s = report.stats
    wrote = s["database"]["committed"] if kind == "database" else s["writes"]
    assert s["clients"] and s["acq_ok"] and wrote, report.summary()
    assert sum(report.faults.values()), report.summary()
