"""The database resource's judge judged: made-up committed histories, each with one known
fault (or none), and the client events that go with them."""

from __future__ import annotations

from typing import Any

from .checker import check
from .database import History, Row, judge

T0 = 1_000_000.0


class Made:
    """Committed transactions, in commit order, and what their clients logged."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.events: list[dict[str, Any]] = []
        self.counter = 0

    def ev(self, t: float, c: str, e: str, **fields: Any) -> None:
        self.events.append({"t": T0 + t, "c": c, "e": e, **fields})

    def commit(self, c: str, h: int, fence: int, t: float, seen: int | None = None) -> None:
        """A hold granted ``fence`` whose block read ``seen`` (default: the counter), wrote it
        plus one and committed at ``t``; its client was told so."""
        seen = self.counter if seen is None else seen
        self.ev(t - 0.2, c, "acq", h=h, mode="block", timeout=2.0, role="x")
        self.ev(t - 0.1, c, "acq_ok", h=h, fence=fence)
        self.ev(t - 0.1, c, "db_begin", h=h, fence=fence, form="held")
        self.rows.append(Row(len(self.rows) + 1, c, h, fence, seen, seen + 1, "held", T0 + t))
        self.counter = seen + 1
        self.ev(t, c, "db_ok", h=h, fence=fence, seen=seen)

    def history(self) -> History:
        return History(list(self.rows), self.counter)

    def props(self) -> list[str]:
        found, _ = judge(self.history(), self.events)
        return sorted(prop for prop, *_ in found)


def clean() -> Made:
    made = Made()
    made.commit("c1", 1, 100, 1.0)
    made.commit("c2", 1, 200, 2.0)
    made.commit("c1", 2, 300, 3.0)
    return made


def test_a_clean_history_passes() -> None:
    made = clean()
    made.ev(3.5, "c2", "acq_ok", h=2, fence=250)  # a stale hold, refused: nothing committed
    made.ev(3.6, "c2", "db_stale", h=2, fence=250, recorded=300)
    made.ev(3.7, "c3", "db_abort", h=1, fence=400)
    found, stats = judge(made.history(), made.events)
    assert found == []
    assert (stats["committed"], stats["counter"], stats["stale"], stats["aborted"]) == (3, 3, 1, 1)


def test_commit_order_is_the_chain_of_values_not_the_row_ids() -> None:
    """Row ids come from the insert, not the commit: the values read say the commit order."""
    made = clean()
    made.rows[1], made.rows[2] = made.rows[2], made.rows[1]
    assert made.props() == []


def test_a_lost_update() -> None:
    made = clean()
    made.commit("c3", 1, 400, 4.0, seen=2)  # read what c1/h2 read: its write is lost
    assert made.props() == ["counter-mismatch", "lost-update"]


def test_a_stale_holder_committed_after_a_later_one() -> None:
    made = clean()
    made.commit("c2", 2, 250, 4.0)  # below 300, committed after it
    assert made.props() == ["fence-order"]


def test_the_counter_disagrees_with_the_history() -> None:
    made = clean()
    made.counter = 4  # a write without its history row
    assert made.props() == ["counter-mismatch"]


def test_a_commit_the_client_was_told_of_is_missing() -> None:
    made = clean()
    made.ev(5.0, "c3", "db_ok", h=1, fence=500, seen=3)
    assert made.props() == ["commit-lost"]


def test_a_refused_block_committed_anyway() -> None:
    made = clean()
    made.ev(3.5, "c1", "db_stale", h=2, fence=300, recorded=350)  # c1/h2's row is there
    assert made.props() == ["refused-but-committed"]


def test_a_serialization_failure_that_committed_anyway() -> None:
    made = clean()
    made.ev(3.5, "c1", "db_serial", h=2, fence=300, msg="could not serialize access")
    assert made.props() == ["refused-but-committed"]


def test_a_block_that_raised_an_on_commit_callback_s_error() -> None:
    """It committed (its row is there): raising told its caller it did not."""
    made = clean()
    made.ev(3.5, "c1", "db_raised_after_commit", h=2, fence=300, msg="mail server down")
    assert made.props() == ["raised-after-commit"]


def test_prunes_and_isolation_levels_are_counted() -> None:
    made = clean()
    made.ev(0.5, "c1", "db_client", level="repeatable read")
    made.ev(0.6, "c2", "db_client", level="serializable")
    made.ev(1.5, "c1", "db_prune", n=1, age=0.1)
    made.ev(2.5, "c2", "db_prune", n=0, age=0.3)
    found, stats = judge(made.history(), made.events)
    assert found == [] and (stats["prunes"], stats["pruned"]) == (2, 1)
    assert stats["levels"] == {"repeatable read": 1, "serializable": 1}


def test_a_row_with_another_fence_than_granted() -> None:
    made = clean()
    made.ev(3.5, "c2", "acq_ok", h=1, fence=150)  # granted 150, its row says 200
    assert made.props() == ["fence-not-granted"]


def test_the_campaign_check_reports_the_database() -> None:
    """Through the campaign's checker: the violation fails the run, the figures are shown."""
    made = clean()
    made.commit("c3", 1, 400, 4.0, seen=2)
    common: dict[str, Any] = {
        "backend": "redis", "kind": "database", "seed": 1, "seconds": 10.0, "ttl": 1.0,
        "nodes": 1, "started": T0, "stopping": T0 + 10, "writes": [], "faults": [],
        "data_loss": set(), "leftover": {}, "harness_errors": [], "waiter_lease": 0.0,
    }  # fmt: skip
    report = check(events=made.events, database=made.history(), **common)
    assert not report.ok
    assert {v.prop for v in report.violations} == {"lost-update", "counter-mismatch"}
    assert "database: 4 fenced transactions committed (counter 3" in report.summary()
    assert " 0 re-fenced, " in report.summary()  # a clock step, or a writer it did not know
    assert "VIOLATION lost-update" in report.details()
    assert check(events=clean().events, database=clean().history(), **common).ok


def test_a_hold_whose_re_fence_reply_was_lost_is_found_by_its_token(redis_server: Any) -> None:
    """A held-form block that raised BackendUnavailable (or QuorumNotReached, or a time limit)
    may have had its re-fence run in Redis, its reply lost: the hold's fence there is then
    one the client was not told. Its direct checks match the hold by its token alone (seed
    409 reported a release-hid-loss for a hold that was there, under its new fence); a fence
    the client knows must still match, on a single server."""
    from django_redlock import BackendUnavailable, LockNotAcquired, QuorumNotReached, StaleFence

    from .client import Inspector
    from .database import fence_unknown
    from .interrupts import TimeLimit

    assert fence_unknown(BackendUnavailable("lost")) and fence_unknown(QuorumNotReached("q"))
    assert fence_unknown(TimeLimit())
    assert not fence_unknown(StaleFence("stale", 2, 3)) and not fence_unknown(LockNotAcquired("w"))
    assert not fence_unknown(ValueError("the body's"))
    inspector = Inspector({"direct_urls": [redis_server.url], "name": "fenced", "kind": "database"})
    redis_server.client().set("redlock:{fenced}", "c1h3.x|1002|0|meta", px=5000)  # re-fenced
    assert inspector.holds("c1h3.", 1002, False)[0] is True
    assert inspector.holds("c1h3.", 1001, False)[0] is False  # the fence granted: not this
    assert inspector.holds("c1h3.", None, False)[0] is True  # unknown: the token says
    assert inspector.holds("c1h4.", None, False)[0] is False
