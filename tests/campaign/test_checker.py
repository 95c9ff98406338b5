"""The judge judged: small made-up histories, each with one known fault (or none)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from .checker import check
from .nemesis import DATA_LOSS, Fault
from .resource import Write

T0 = 1_000_000.0


class History:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.writes: list[Write] = []
        self.faults: list[Fault] = []
        self.last = -1
        self.last_x = -1

    def ev(self, t: float, c: str, e: str, **fields: Any) -> None:
        self.events.append({"t": T0 + t, "c": c, "e": e, **fields})

    def hold(
        self, c: str, h: int, start: float, got: float, fence: int, end: float, role: str = "x"
    ) -> None:
        """A clean hold: acquire, begin and end writes, release, direct checks. A permit's
        writes carry an expiry a TTL after the acquire."""
        self.ev(start, c, "acq", h=h, mode="block", timeout=2.0, role=role)
        self.ev(got, c, "acq_ok", h=h, fence=fence)
        self.ev(got, c, "check", h=h, when="acquired", found=True, t0=T0 + got, t1=T0 + got)
        expiry = round((T0 + got + 1.0) * 1000) if role == "s" else -1
        self.write(got, c, h, fence, "begin", role, expiry)
        self.write(end, c, h, fence, "end", role, expiry)
        self.ev(end, c, "rel_ok", h=h, attempt=0)
        self.ev(end, c, "check", h=h, when="released", found=False, t0=T0 + end, t1=T0 + end)

    def write(
        self,
        t: float,
        c: str,
        h: int,
        fence: int,
        phase: str,
        role: str = "x",
        expiry: int = -1,
        ok: bool | None = None,
    ) -> None:
        """A write judged as resource.py does, unless ``ok`` says what a faulty resource
        (or a fence granted twice) let through."""
        if ok is None:
            if role == "s":
                ok = 0 <= (T0 + t) * 1000 < expiry
            else:
                ok = fence > self.last_x if role == "r" else fence >= self.last
        self.writes.append(Write(len(self.writes), c, h, fence, phase, ok, self.last, T0 + t,
                                 role, expiry))  # fmt: skip
        if ok and role != "s":
            self.last = max(self.last, fence)
        if ok and role == "x":
            self.last_x = max(self.last_x, fence)
        self.ev(t, c, "write", h=h, phase=phase, fence=fence, ok=ok, last=self.last)

    def fault(self, kind: str, target: Any, start: float, end: float, client: str = "") -> None:
        self.faults.append(
            Fault(kind, target, start, end - start, started=T0 + start, healed=T0 + end,
                  client=client)
        )  # fmt: skip

    def judge(
        self,
        nodes: int = 1,
        kind: str = "plain",
        limit: int = 1,
        killed: dict[str, float] | None = None,
        roundtrips: dict[str, Any] | None = None,
    ) -> set[str]:
        # The resource's log is in its own time order, whatever order the holds were made up.
        ordered = sorted(self.writes, key=lambda w: w.t)
        writes = [dataclasses.replace(w, seq=i) for i, w in enumerate(ordered)]
        report = check(
            backend="redlock" if nodes > 1 else "redis", kind=kind, seed=0, seconds=30,
            ttl=1.0, nodes=nodes, started=T0, stopping=T0 + 30,
            events=sorted(self.events, key=lambda e: e["t"]), writes=writes,
            faults=self.faults, data_loss=DATA_LOSS, leftover={}, harness_errors=[],
            waiter_lease=0.0, limit=limit, socket_timeout=0.3, killed_at_stop=killed,
            roundtrips=roundtrips,
        )  # fmt: skip
        self.report = report
        return {v.prop for v in report.violations}

    def stall(self, c: str, start: float, end: float, idle: float | None = None) -> None:
        """The stall probe of ``c``'s process woke at ``end``, ``end - start`` s late, of
        which ``idle`` (all of it unless said) the process was not running."""
        late = end - start
        self.ev(end, c, "stall", s=T0 + start, late=late, idle=late if idle is None else idle)


def test_a_clean_history_passes() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 1, 1.1)
    h.hold("c2", 1, 1.05, 1.11, 2, 1.2)
    assert h.judge() == set()


def test_a_paused_holder_rejected_by_fencing_is_no_violation() -> None:
    h = History()
    h.fault("client_pause", 0, 1.05, 3.0, client="c1")
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    h.ev(1.01, "c1", "acq_ok", h=1, fence=1)
    h.write(1.02, "c1", 1, 1, "begin")
    h.hold("c2", 1, 2.2, 2.3, 2, 2.4)  # c1's TTL ran out while it was paused
    h.ev(3.1, "c1", "lost", h=1, reason="expired", fence=1)
    h.ev(3.1, "c1", "check", h=1, when="lost", found=False, t0=T0 + 3.1, t1=T0 + 3.1)
    h.write(3.2, "c1", 1, 1, "end")  # rejected: fence 2 came first
    assert not h.writes[-1].accepted
    assert h.judge() == set()


def test_one_fence_granted_twice() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 7, 1.1)
    h.hold("c2", 1, 1.05, 1.11, 7, 1.2)
    assert "fence-granted-twice" in h.judge()


def test_a_fence_behind_one_granted_earlier() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 5, 1.1)
    h.hold("c2", 1, 1.2, 1.21, 1, 1.3)  # e.g. the counter restarted at zero
    assert h.judge() == {"fence-behind"}


def test_a_fence_granted_just_before_a_logged_clock_step_is_of_the_epoch_before() -> None:
    """clock_restore's heal (the clock back, the server restarted empty) is logged once done:
    a hold granted 30 ms before that line got its fence from the clock ahead, and a hold after
    the step a smaller one (seed 403). Within the step's slack a hold leads no epoch; a hold
    clearly before the step still leads its own."""
    h = History()
    h.fault("clock_restore", (0,), 0.5, 1.25)
    h.hold("c1", 1, 1.20, 1.21, 5_000, 1.22)  # the clock 2 s ahead
    h.hold("c2", 1, 1.26, 1.27, 3_000, 1.3)  # back, the counter gone
    assert h.judge(kind="database") == set()
    h.hold("c1", 2, 1.4, 1.41, 2_000, 1.5)  # behind the one before it, in one epoch
    assert h.judge(kind="database") == {"fence-behind"}


def test_a_restart_after_a_clock_step_back_starts_a_fence_epoch() -> None:
    """The counter written while the clock ran ahead carries its fences past the step back;
    a later restart that empties the server loses it, and the clock's fences are below them
    (seed 1606: server_down 0.16 s after such a hold). The documented case: the clock went
    back and the counter was lost. Without the step, a restart is no excuse."""
    h = History()
    h.fault("clock_forward", (0,), 0.5, 1.0)
    h.hold("c1", 1, 1.20, 1.21, 5_000, 1.22)  # the counter still ahead of the clock
    h.fault("server_down", (0,), 1.3, 1.8)
    h.hold("c2", 1, 1.9, 1.91, 3_000, 1.95)  # the counter gone: the clock's fence
    assert h.judge(kind="database") == set()
    h = History()
    h.fault("server_down", (0,), 1.3, 1.8)
    h.hold("c1", 1, 1.20, 1.21, 5_000, 1.22)
    h.hold("c2", 1, 1.9, 1.91, 3_000, 1.95)
    assert h.judge(kind="database") == {"fence-behind"}


def test_interleaved_sections_accepted_by_the_resource() -> None:
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    h.ev(1.01, "c1", "acq_ok", h=1, fence=3)
    h.ev(1.0, "c2", "acq", h=1, mode="try", timeout=None)
    h.ev(1.01, "c2", "acq_ok", h=1, fence=3)
    h.write(1.02, "c1", 1, 3, "begin")
    h.write(1.03, "c2", 1, 3, "begin")
    h.write(1.04, "c1", 1, 3, "end")
    assert {"overlap-accepted", "fence-granted-twice"} <= h.judge()


def test_reported_lost_while_still_held() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 1, 1.5)
    h.ev(1.2, "c1", "lost", h=1, reason="renewals failed", fence=1)
    h.ev(1.21, "c1", "check", h=1, when="lost", found=True, t0=T0 + 1.2, t1=T0 + 1.21)
    assert h.judge() == {"lost-but-held"}


def test_held_without_the_servers_knowing_it() -> None:
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    h.ev(1.01, "c1", "acq_ok", h=1, fence=1)
    h.ev(1.02, "c1", "check", h=1, when="acquired", found=False, t0=T0 + 1.01, t1=T0 + 1.02)
    assert h.judge() == {"phantom-hold"}
    h.fault("server_restart", (0,), 1.015, 1.015)  # data lost in between: excused
    assert h.judge() == set()


def test_a_waiter_that_slept_through_a_free_lock() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 1, 1.1)
    h.ev(1.05, "c2", "acq", h=1, mode="block", timeout=3.0)
    h.ev(4.05, "c2", "acq_no", h=1)  # free from 1.1 on, and it never got it
    assert h.judge() == {"waiter-starved"}
    h.fault("black_hole", (0,), 2.0, 2.5)  # not quiet time: not judged
    assert h.judge() == set()


def test_granted_while_a_majority_was_down() -> None:
    h = History()
    h.fault("majority_pause", (0, 1, 2), 1.0, 3.0)
    h.hold("c1", 1, 1.5, 1.6, 1, 1.7)
    assert "granted-without-majority" in h.judge(nodes=5)


def test_release_that_called_a_live_hold_lost() -> None:
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    h.ev(1.01, "c1", "acq_ok", h=1, fence=1)
    h.ev(1.1, "c1", "check", h=1, when="releasing", found=True, t0=T0 + 1.1, t1=T0 + 1.1,
         nodes="11100", left=900)  # fmt: skip
    h.ev(1.15, "c1", "rel_err", h=1, err="LockLost", attempt=0)
    assert h.judge(nodes=5) == {"release-reported-lost"}


def test_release_that_hid_a_loss() -> None:
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    h.ev(1.01, "c1", "acq_ok", h=1, fence=1)
    h.ev(1.1, "c1", "check", h=1, when="releasing", found=False, t0=T0 + 1.1, t1=T0 + 1.1,
         nodes="0", left=-1)  # fmt: skip
    h.ev(1.15, "c1", "rel_ok", h=1, attempt=0)
    assert h.judge() == {"release-hid-loss"}


def test_errors_for_seconds_with_every_server_up() -> None:
    h = History()
    for i in range(4):
        h.ev(1.0 + i, "c1", "acq", h=i, mode="try", timeout=None)
        h.ev(1.01 + i, "c1", "acq_err", h=i, err="QuorumNotReached", msg="")
    assert h.judge(nodes=5) == {"quiet-outage", "unavailable-on-healthy"}
    h.fault("majority_pause", (0, 1, 2), 0.5, 3.5)  # an outage with a cause
    assert h.judge(nodes=5) == set()


def test_owned_answered_false_while_held() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 1, 1.5)
    h.ev(1.2, "c1", "ask", h=1, q="owned", answer=False)
    h.ev(1.21, "c1", "check", h=1, when="owned_false", found=True, t0=T0 + 1.2, t1=T0 + 1.21)
    assert h.judge() == {"false-but-held"}


# -- semaphores: at most `limit` permits at once -----------------------------------------------


def test_permits_up_to_the_limit_overlap_freely() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 10, 1.3, role="s")
    h.hold("c2", 1, 1.05, 1.06, 11, 1.2, role="s")
    h.hold("c3", 1, 1.25, 1.26, 12, 1.4, role="s")  # c2 released: two at once again
    assert h.judge(kind="semaphore", limit=2) == set()


def test_one_permit_more_than_the_limit() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 10, 1.3, role="s")
    h.hold("c2", 1, 1.05, 1.06, 11, 1.3, role="s")
    h.hold("c3", 1, 1.1, 1.11, 12, 1.3, role="s")  # three sections at once, each accepted
    assert h.judge(kind="semaphore", limit=2) == {"overlap-accepted"}
    assert h.judge(kind="semaphore", limit=3) == set()


def test_the_servers_seen_holding_more_permits_than_the_limit() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 10, 1.3, role="s")
    h.ev(1.1, "c1", "check", h=1, when="releasing", found=True, t0=T0 + 1.1, t1=T0 + 1.1,
         nodes="1", left=900, leases="sss")  # fmt: skip
    assert h.judge(kind="semaphore", limit=2) == {"over-limit-held"}
    assert h.judge(kind="semaphore", limit=3) == set()


def test_a_paused_permit_holder_rejected_after_its_expiry_is_no_violation() -> None:
    h = History()
    h.fault("client_pause", 0, 1.05, 3.0, client="c1")
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None, role="s")
    h.ev(1.01, "c1", "acq_ok", h=1, fence=10)
    expiry = round((T0 + 2.01) * 1000)
    h.write(1.02, "c1", 1, 10, "begin", "s", expiry)
    h.hold("c2", 1, 2.2, 2.3, 11, 3.5, role="s")
    h.hold("c3", 1, 2.2, 2.3, 12, 3.5, role="s")  # c1's permit ran out while it was paused
    h.write(3.2, "c1", 1, 10, "end", "s", expiry)  # its expiry is past: rejected
    assert not h.writes[-1].accepted
    assert h.judge(kind="semaphore", limit=2) == set()


def test_a_permit_write_accepted_after_its_expiry() -> None:
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None, role="s")
    h.ev(1.01, "c1", "acq_ok", h=1, fence=10)
    h.write(3.2, "c1", 1, 10, "end", "s", round((T0 + 2.01) * 1000), ok=True)
    assert h.judge(kind="semaphore", limit=2) == {"stale-fence-accepted"}


def test_a_permit_waiter_starved_while_one_was_free() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 10, 4.5, role="s")  # one of two permits taken throughout
    h.ev(1.05, "c2", "acq", h=1, mode="block", timeout=3.0, role="s")
    h.ev(4.05, "c2", "acq_no", h=1)
    assert h.judge(kind="semaphore", limit=2) == {"waiter-starved"}
    h.hold("c3", 1, 1.02, 1.03, 11, 4.5, role="s")  # both taken: waiting is right
    assert h.judge(kind="semaphore", limit=2) == set()


# -- read-write locks: readers share, a writer is alone -----------------------------------------


def test_readers_overlap_each_other_not_a_writer() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 10, 1.3, role="r")
    h.hold("c2", 1, 1.05, 1.06, 11, 1.2, role="r")
    h.hold("c3", 1, 1.35, 1.36, 12, 1.5, role="x")
    h.hold("c1", 2, 1.55, 1.56, 13, 1.7, role="r")
    assert h.judge(kind="write") == set()


def test_a_read_accepted_inside_a_write() -> None:
    h = History()
    for c, role, fence in (("c1", "x", 10), ("c2", "r", 11)):
        h.ev(1.0, c, "acq", h=1, mode="try", timeout=None, role=role)
        h.ev(1.01, c, "acq_ok", h=1, fence=fence)
    h.write(1.02, "c1", 1, 10, "begin")
    h.write(1.03, "c2", 1, 11, "begin", "r")
    h.write(1.04, "c1", 1, 10, "end", ok=True)  # a resource that did not fence
    assert h.judge(kind="write") == {"overlap-accepted", "stale-fence-accepted"}


def test_a_write_accepted_inside_a_read() -> None:
    h = History()
    for c, role in (("c1", "r"), ("c2", "x")):
        h.ev(1.0, c, "acq", h=1, mode="try", timeout=None, role=role)
        h.ev(1.01, c, "acq_ok", h=1, fence=10)  # one fence for both
    h.write(1.02, "c1", 1, 10, "begin", "r")
    h.write(1.03, "c2", 1, 10, "begin")
    h.write(1.04, "c1", 1, 10, "end", "r", ok=True)
    assert {"overlap-accepted", "fence-granted-twice"} <= h.judge(kind="write")


def test_a_read_behind_a_later_writer_rejected_is_no_violation() -> None:
    h = History()
    h.fault("client_pause", 0, 1.05, 3.0, client="c1")
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None, role="r")
    h.ev(1.01, "c1", "acq_ok", h=1, fence=10)
    h.write(1.02, "c1", 1, 10, "begin", "r")
    h.hold("c2", 1, 2.2, 2.3, 11, 2.4)  # c1's read ran out while it was paused
    h.write(3.2, "c1", 1, 10, "end", "r")  # rejected: a writer came after it
    assert not h.writes[-1].accepted
    assert h.judge(kind="write") == set()


def test_the_servers_seen_holding_a_write_beside_a_read() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 10, 1.3, role="x")
    h.ev(1.1, "c1", "check", h=1, when="releasing", found=True, t0=T0 + 1.1, t1=T0 + 1.1,
         nodes="1", left=900, leases="rw")  # fmt: skip
    assert h.judge(kind="write") == {"writer-not-alone"}


def test_a_reader_behind_a_waiting_writer_is_not_starved() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 10, 1.2, role="r")
    h.ev(1.1, "c2", "acq", h=1, mode="block", timeout=3.0, role="x")  # waits (c3 reads)
    h.hold("c3", 1, 1.0, 1.02, 11, 4.0, role="r")
    h.ev(1.15, "c4", "acq", h=1, mode="block", timeout=2.5, role="r")
    h.ev(3.65, "c4", "acq_no", h=1)  # behind the waiting writer: right
    h.ev(4.1, "c2", "acq_no", h=1)
    assert h.judge(kind="write") == set()


# -- time (issue #43) --------------------------------------------------------------------------


def test_backend_unavailable_later_than_one_and_a_half_socket_timeouts() -> None:
    h = History()
    h.fault("server_pause", (0,), 1.0, 3.0)
    h.ev(1.5, "c1", "acq", h=1, mode="block", timeout=2.0)
    h.ev(2.1, "c1", "acq_err", h=1, err="BackendUnavailable", msg="")  # 0.6 s: two timeouts
    assert h.judge() == {"error-latency"}
    h.events[-1]["t"] = T0 + 1.8  # one socket timeout: fine
    assert h.judge() == set()


def test_backend_unavailable_timed_from_the_fault_not_the_call() -> None:
    h = History()
    h.hold("c1", 1, 0.5, 0.51, 1, 0.6)
    h.ev(1.0, "c1", "check", h=2, when="releasing", found=True, t0=T0 + 1.0, t1=T0 + 1.0)
    h.fault("black_hole", (0,), 1.2, 2.0)
    h.ev(1.9, "c1", "rel_err", h=2, err="BackendUnavailable", msg="", attempt=0, since=T0 + 1.0)
    assert h.judge() == {"error-latency"}  # 0.7 s after the server went silent
    h.events[-1]["t"] = T0 + 1.45
    assert h.judge() == set()


def test_a_waiter_asleep_when_the_server_went_silent_is_not_judged() -> None:
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="block", timeout=3.0)
    h.fault("server_pause", (0,), 1.5, 3.0)  # it learns of it at its next try
    h.ev(2.5, "c1", "acq_err", h=1, err="BackendUnavailable", msg="")
    assert h.judge() == set()


def test_a_call_that_never_returned() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 1, 1.1)
    h.ev(2.0, "c1", "acq", h=2, mode="block", timeout=1.0)
    assert h.judge(killed={"c1": T0 + 9.0}) == {"call-hung"}
    assert h.judge(killed={"c1": T0 + 3.0}) == set()  # within its timeout and slack


def test_a_free_lock_not_handed_to_its_waiter() -> None:
    h = History()
    h.ev(1.0, "c2", "acq", h=1, mode="block", timeout=3.0)
    h.hold("c1", 1, 0.9, 0.95, 1, 1.5)
    h.ev(2.4, "c2", "acq_ok", h=1, fence=2)  # 0.9 s after the release
    assert h.judge() == {"handoff-slow"}
    h.events[-1]["t"] = T0 + 1.7
    assert h.judge() == set()


def test_a_hold_lost_on_a_server_that_answered_throughout() -> None:
    h = History()
    h.hold("c1", 1, 5.0, 5.01, 1, 6.5)
    h.ev(6.0, "c1", "lost", h=1, reason="expired", fence=1)
    h.ev(6.0, "c1", "check", h=1, when="lost", found=False, t0=T0 + 6.0, t1=T0 + 6.0)
    assert h.judge() == {"lost-on-healthy"}
    h.fault("server_pause", (0,), 5.5, 5.9)  # a server that stopped answering: excused
    assert h.judge() == set()


def test_one_redlock_node_faulted_costs_no_hold() -> None:
    h = History()
    h.hold("c1", 1, 5.0, 5.01, 1, 6.5)
    h.ev(6.0, "c1", "lost", h=1, reason="expired", fence=1)
    h.ev(6.0, "c1", "check", h=1, when="lost", found=False, t0=T0 + 6.0, t1=T0 + 6.0)
    h.fault("server_pause", (3,), 5.5, 5.9)
    assert "lost-on-healthy" in h.judge(nodes=5)
    h.fault("server_pause", (1,), 5.2, 5.4)  # two nodes: a quorum's tolerance used up
    assert "lost-on-healthy" not in h.judge(nodes=5)


def test_more_than_one_script_call_per_node_per_operation() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 1, 1.1)
    assert h.judge(nodes=5, roundtrips={"ops": 40, "calls": [80] * 5}) == set()
    found = h.judge(nodes=5, roundtrips={"ops": 40, "calls": [80, 120, 80, 80, 120]})
    assert found == {"round-trips"}


# -- the Sentinel kind's judge (sentinel.check) -------------------------------------------------


def _sentinel(events: list[tuple[float, str, str, dict[str, Any]]], faults: list[Any]) -> list[str]:
    from .sentinel import check as sentinel_check

    history = [{"t": T0 + t, "c": c, "e": e, **fields} for t, c, e, fields in events]
    report = sentinel_check(1, 20.0, history, {}, faults, stopping=T0 + 20.0, started=T0)
    return sorted(v.prop for v in report.violations)


def _move(kind: str, a: float, b: float) -> Any:
    from .sentinel import Fault as Move

    return Move(kind, T0 + a - 0.1, T0 + a, T0 + b, T0 + b)


def _held(c: str, h: int, start: float, got: float, fence: int) -> list[Any]:
    return [(start, c, "acq", {"h": h, "name": "a"}), (got, c, "acq_ok", {"h": h, "fence": fence})]


def test_sentinel_a_hold_confirmed_before_a_failover_named_in_time_must_survive_it() -> None:
    lost = [*_held("c1", 1, 0.0, 0.01, 10), (2.5, "c1", "lost", {"h": 1})]
    assert _sentinel(lost, [_move("failover", 1.0, 1.9)]) == ["lost-on-healthy"]
    assert _sentinel(lost, [_move("master_pause", 1.0, 1.3)]) == ["lost-on-healthy"]
    assert _sentinel(lost, []) == ["lost-on-healthy"]
    # The docs' windows: named too late for what the TTL left, a take within the failover
    # (it may be on the old master), a long pause.
    assert _sentinel(lost, [_move("failover", 1.0, 2.4)]) == []
    within = [*_held("c1", 1, 1.5, 1.6, 10), (2.5, "c1", "lost", {"h": 1})]
    assert _sentinel(within, [_move("failover", 1.0, 1.9)]) == []
    assert _sentinel(lost, [_move("master_pause", 0.5, 2.4)]) == []


def test_sentinel_takes_failing_one_after_the_other_in_quiet_time() -> None:
    def failed(c: str, h: int, t: float) -> list[Any]:
        err = {"h": h, "err": "BackendUnavailable", "msg": "no master"}
        return [(t, c, "acq", {"h": h, "name": "a"}), (t + 0.5, c, "acq_err", err)]

    faults = [_move("failover", 1.0, 1.9)]
    assert _sentinel(failed("c1", 1, 5.0) + failed("c1", 2, 5.6), faults) == ["take-unavailable"]
    assert _sentinel(failed("c1", 1, 5.0), faults) == []  # once: counted
    assert _sentinel(failed("c1", 1, 2.5) + failed("c1", 2, 3.0), faults) == []  # within 2 s
    between = failed("c1", 1, 5.0) + _held("c1", 2, 5.55, 5.56, 10) + failed("c1", 3, 5.6)
    assert _sentinel(between, faults) == []


def test_sentinel_a_later_hold_with_a_fence_not_above_is_behind() -> None:
    events = [*_held("c1", 1, 0.0, 0.01, 10), *_held("c2", 1, 0.5, 0.6, 9)]
    assert _sentinel(events, []) == ["fence-behind"]
    assert _sentinel([*_held("c1", 1, 0.0, 0.01, 10), *_held("c2", 1, 0.5, 0.6, 11)], []) == []


def test_sentinel_a_waiter_not_woken_while_the_name_was_free_is_starved() -> None:
    holder = [*_held("c1", 1, 4.0, 4.01, 10), (5.2, "c1", "rel", {"h": 1})]
    waiter = [(5.0, "c2", "acq", {"h": 1, "name": "a", "blocking": True}),
              (6.5, "c2", "acq_no", {"h": 1})]  # fmt: skip
    faults = [_move("failover", 1.0, 1.9)]
    assert _sentinel(holder + waiter, faults) == ["waiter-starved"]
    other = [*_held("c3", 1, 5.1, 5.3, 11), (6.6, "c3", "rel", {"h": 1})]
    assert _sentinel(holder + waiter + other, faults) == []  # someone else was woken
    assert _sentinel(holder + waiter, [_move("failover", 1.0, 3.5)]) == []  # not quiet yet


# -- scheduling stalls (stall.py): a timing bound judges the code, not the machine -------------


def test_a_stall_of_the_caller_s_process_overlapping_the_call_excuses_exactly_its_length() -> None:
    h = History()
    h.fault("server_pause", (0,), 1.0, 3.0)
    h.ev(1.5, "c1", "acq", h=1, mode="block", timeout=2.0)
    h.ev(2.2, "c1", "acq_err", h=1, err="BackendUnavailable", msg="")  # 0.7 s: bound 0.55
    assert h.judge() == {"error-latency"}
    h.stall("c1", 1.6, 1.8)  # 0.2 s not running: 0.5 s of its own
    assert h.judge() == set()
    stalls = h.report.stats["stalls"]
    assert (stalls.adjusted, stalls.excused) == (1, 1)
    assert "1 timing judgements adjusted for them, 1 of which pass only so" in h.report.summary()
    h.events.pop()
    h.stall("c1", 1.6, 1.7)  # 0.1 s: 0.6 s of its own, still over
    assert h.judge() == {"error-latency"}
    message = h.report.histories[0]
    assert "0.600 s after its call began" in message and "0.700 s less 0.100 s" in message
    h.events.pop()
    h.stall("c1", 1.3, 1.7)  # half before the call began: only its 0.2 s within counts
    assert h.judge() == set()
    h.events.pop()
    h.stall("c1", 1.3, 1.6)  # 0.1 s within
    assert h.judge() == {"error-latency"}


def test_a_stall_excuses_nothing_of_another_process_or_of_the_process_s_own_cpu() -> None:
    h = History()
    h.fault("server_pause", (0,), 1.0, 3.0)
    h.ev(1.5, "c1", "acq", h=1, mode="block", timeout=2.0)
    h.ev(2.2, "c1", "acq_err", h=1, err="BackendUnavailable", msg="")
    h.stall("c2", 1.6, 1.9)  # another client's
    h.stall("harness", 1.6, 1.9)  # the harness's: a socket timeout is the caller's own clock
    assert h.judge() == {"error-latency"}
    h.stall("c1", 1.6, 1.9, idle=0.0)  # late while its own code ran (the GIL held in C)
    assert h.judge() == {"error-latency"}
    h.events.pop()
    h.stall("c1", 1.6, 1.9, idle=0.1)  # a third of it not running: 0.1 s excused, not 0.3
    assert h.judge() == {"error-latency"}
    assert "0.700 s less 0.100 s" in h.report.histories[0]


def test_a_stall_never_excuses_a_safety_property() -> None:
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 5, 1.5)
    h.hold("c2", 1, 1.2, 1.21, 5, 1.6)  # the same fence granted twice
    h.ev(2.0, "c1", "lost", h=2)
    for c in ("c1", "c2"):
        h.stall(c, 0.5, 2.5)
    assert h.judge() >= {"fence-granted-twice"}
    # A hold lost on a server that answered throughout: a stall (not a pause) is no excuse.
    h = History()
    h.hold("c1", 1, 1.0, 1.01, 1, 3.0)
    h.ev(2.0, "c1", "lost", h=1)
    h.ev(2.0, "c1", "check", h=1, when="lost", found=False, t0=T0 + 2.0, t1=T0 + 2.0)
    assert h.judge() == {"lost-on-healthy"}
    h.stall("c1", 1.2, 1.9)
    assert h.judge() == {"lost-on-healthy"}


def test_a_hand_off_is_judged_less_the_least_stalled_waiter_s_stall() -> None:
    h = History()
    h.ev(1.0, "c2", "acq", h=1, mode="block", timeout=3.0)
    h.hold("c1", 1, 0.9, 0.95, 1, 1.5)
    h.ev(2.4, "c2", "acq_ok", h=1, fence=2)  # 0.9 s after the release
    h.stall("c2", 1.6, 2.0)  # the waiter not running for 0.4 s of it: 0.5 s of its own
    assert h.judge() == set()
    h.stall("harness", 1.6, 1.7)  # the harness less: the waiter's stall still says it
    assert h.judge() == set()
    h.events = [e for e in h.events if e["e"] != "stall"]
    h.stall("c1", 1.6, 2.0)  # the releaser's stall after its release: no excuse
    assert h.judge() == {"handoff-slow"}


def test_the_clogged_window_s_rate_is_over_its_un_stalled_time() -> None:
    from .nemesis import Fault as NodeFault
    from .stall import Stalls
    from .throughput import FLOOR, describe, judge, plan

    phase = plan(20.0, 5, random.Random(1))
    assert phase is not None
    healthy, clogged = phase.windows[0], phase.windows[1]
    clog = NodeFault("clog", (phase.node,), clogged.at, 2.0, started=T0 + clogged.at,
                     healed=T0 + clogged.until)  # fmt: skip
    events = [{"t": T0 + healthy.at + i / 50, "c": f"c{i % 2}", "e": "acq_ok"} for i in range(100)]
    events += [{"t": T0 + clogged.at + i / 10, "c": f"c{i % 2}", "e": "acq_ok"} for i in range(20)]
    events += [{"t": T0, "c": c, "e": "acq"} for c in ("c0", "c1")]
    rates = judge(phase, events, T0, [clog])
    assert rates is not None and not rates["ok"]  # 10 against 50 holds/s: 0.2 x
    # Both clients and the harness not running for 0.8 s of the clogged window's 2 s (the
    # same 0.8 s: counted once).
    stall = [{"t": T0 + clogged.at + 1.1, "c": c, "e": "stall", "s": T0 + clogged.at + 0.3,
              "late": 0.8, "idle": 0.8} for c in ("c0", "c1", "harness")]  # fmt: skip
    stalls = Stalls(events + stall)
    rates = judge(phase, events, T0, [clog], stalls)
    assert rates is not None and rates["clogged_seconds"] == pytest.approx(1.2)
    assert rates["ratio"] == pytest.approx(20 / 1.2 / 50) and rates["ratio"] >= FLOOR
    assert rates["ok"] and rates["raw_ratio"] == pytest.approx(0.2)
    assert stalls.excused == 1
    # Stalled for more than half of itself: left out, and not judged without it.
    stall[-1].update(s=T0 + clogged.at + 0.1, late=1.1, idle=1.1, t=T0 + clogged.at + 1.2)
    rates = judge(phase, events, T0, [clog], Stalls(events + stall))
    assert rates is not None and rates["skipped"] and not rates["judged"] and rates["ok"]
    assert "NOT JUDGED" in describe(rates)


def test_sentinel_a_waiter_s_stall_is_no_time_it_had_to_take_a_free_name() -> None:
    holder = [*_held("c1", 1, 4.0, 4.01, 10), (5.2, "c1", "rel", {"h": 1})]
    waiter = [(5.0, "c2", "acq", {"h": 1, "name": "a", "blocking": True}),
              (6.5, "c2", "acq_no", {"h": 1})]  # fmt: skip
    faults = [_move("failover", 1.0, 1.9)]
    # Free from 5.2 s to 6.5 s: not running for 0.9 s of it leaves 0.4 s, under the 0.5 s.
    stall = (6.1, "c2", "stall", {"s": T0 + 5.2, "late": 0.9, "idle": 0.9})
    assert _sentinel(holder + waiter + [stall], faults) == []
    short = (6.0, "c2", "stall", {"s": T0 + 5.7, "late": 0.3, "idle": 0.3})  # 1.0 s left
    assert _sentinel(holder + waiter + [short], faults) == ["waiter-starved"]
    held = (5.2, "c2", "stall", {"s": T0 + 5.0, "late": 0.2, "idle": 0.2})  # while it was held
    assert _sentinel(holder + waiter + [held, short], faults) == ["waiter-starved"]


def test_a_redlock_hold_on_a_bare_majority_has_no_node_to_spare() -> None:
    # Seed 1805 (redlock/plain): a hold granted by nodes 1-3 (0 and 4 refused: still holding
    # the last holder's key, or skipped by their breaker), lost when node 3 restarted empty.
    h = History()
    h.hold("c1", 1, 5.0, 5.01, 1, 6.5)
    h.events[2]["nodes"] = "01110"
    h.ev(6.0, "c1", "lost", h=1, reason="expired", fence=1)
    h.ev(6.0, "c1", "check", h=1, when="lost", found=False, t0=T0 + 6.0, t1=T0 + 6.0)
    h.fault("server_restart", (3,), 5.9, 5.9)
    assert h.judge(nodes=5) == set()
    h.events[2]["nodes"] = "11110"  # a node to spare: its loss is still a finding
    assert h.judge(nodes=5) == {"lost-on-healthy"}
    assert "placed on nodes [0, 1, 2, 3]" in h.report.histories[0]
    h.events[2]["nodes"] = "?1110"  # a node that did not answer the check may hold it
    assert h.judge(nodes=5) == {"lost-on-healthy"}
    h.events[2]["nodes"] = "01111"  # the faulted node not among them: nothing to excuse
    h.faults[-1] = dataclasses.replace(h.faults[-1], target=(0,))
    assert h.judge(nodes=5) == {"lost-on-healthy"}


def test_a_redlock_waiter_s_error_is_timed_from_its_call_only_if_no_quorum_answered_then() -> None:
    # Seed 1805 (redlock/plain): one node busy from before a blocking acquire to its error,
    # which came 0.55 s after the call, 0.2 s after a PING that too few nodes answered: the
    # other silence began within the wait, and no fault in the history says when.
    h = History()
    h.fault("busy", (3,), 1.0, 3.0)
    # What denied the quorum besides (1805: a node losing replies, one restarted and guarding):
    # neither silent, so not what error-latency times from; without them the error is
    # unavailable-on-healthy.
    h.fault("lose_replies", (2,), 1.0, 3.0)
    h.fault("server_restart", (4,), 0.0, 0.1)
    h.ev(1.5, "c1", "acq", h=1, mode="block", timeout=3.0)
    h.ev(2.2, "c1", "acq_err", h=1, err="BackendUnavailable", msg="")
    assert h.judge(nodes=5) == set()
    h.fault("server_pause", (0, 1), 1.2, 3.0)  # a quorum denied from before the call
    assert h.judge(nodes=5) == {"error-latency"}
    h.faults[-1] = dataclasses.replace(h.faults[-1], target=(0,))  # two of five: not yet
    assert h.judge(nodes=5) == set()


def test_an_unknown_outcome_on_servers_that_answered_is_a_finding_a_blocked_loop_no_excuse() -> (
    None
):
    # Reports rio 6 and wai 4: an asyncio client's loop blocked by sync code while its call
    # was in flight; every reply came, yet the call raised as if the servers were silent.
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    h.ev(1.0, "c1", "loop_block", call="acquire", t0=T0 + 1.002, t1=T0 + 1.5)
    h.ev(1.5, "c1", "acq_err", h=1, err="QuorumNotReached", msg="")
    assert h.judge(nodes=5) == {"unavailable-on-healthy"}
    h.fault("server_pause", (0, 1), 0.5, 2.0)  # two of five: a quorum answered all along
    assert h.judge(nodes=5) == {"unavailable-on-healthy"}
    h.fault("lose_replies", (2,), 1.2, 1.4)  # a majority faulted: it may not have answered
    assert h.judge(nodes=5) == set()
    h = History()  # a release on Redlock: a majority of its hold's nodes must be left
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    h.ev(1.01, "c1", "acq_ok", h=1, fence=1)
    h.ev(1.2, "c1", "rel_err", h=1, err="QuorumNotReached", msg="", attempt=0, since=T0 + 1.2)
    assert h.judge(nodes=5) == {"unavailable-on-healthy"}
    h.fault("clog", (0,), 0.5, 1.5)  # where it was placed not checked: maybe a bare majority
    assert h.judge(nodes=5) == set()
    h.ev(1.02, "c1", "check", h=1, when="acquired", found=True, t0=T0 + 1.02, t1=T0 + 1.02,
         nodes="11111")  # fmt: skip
    assert h.judge(nodes=5) == {"unavailable-on-healthy"}
    h.events[-1]["nodes"] = "11100"
    assert h.judge(nodes=5) == set()
    h = History()  # single Redis, no loop block: an error 0.6 s in may be a starved server
    h.ev(1.0, "c1", "acq", h=1, mode="block", timeout=2.0)
    h.ev(1.6, "c1", "acq_err", h=1, err="BackendUnavailable", msg="")
    assert h.judge() == set()  # (seed 2204: a PING unanswered in 0.3 s at make test's load)
    h.events[-1]["t"] = T0 + 1.05  # given up on sooner than any server could be that late
    assert h.judge() == {"unavailable-on-healthy"}
    h.fault("reset", (0,), 0.6, 0.7)  # healed 0.3 s before the call: its connection cut
    assert h.judge() == set()
    h.faults[-1] = dataclasses.replace(h.faults[-1], started=T0 + 0.1, healed=T0 + 0.2)
    assert h.judge() == {"unavailable-on-healthy"}  # long healed
    h.events[-1]["msg"] = "Timeout connecting to server"  # a first connect on a loaded host
    assert h.judge() == set()
    h.ev(1.01, "c1", "loop_block", call="acquire", t0=T0 + 1.01, t1=T0 + 1.04)
    assert h.judge() == {"unavailable-on-healthy"}  # beside a blocked loop: its busyness
    h.events.pop()
    h.events[-1]["msg"] = "Connection reset by peer"
    assert h.judge() == {"unavailable-on-healthy"}
    h.stall("c1", 1.02, 1.04)  # the stall probe: its process did not run
    assert h.judge() == set()
    h.events.pop()
    h.stall("harness", 1.02, 1.04)  # the proxies, carrying its replies, did not run
    assert h.judge() == set()
    h.events.pop()
    h.fault("client_pause", 1, 1.01, 1.3, client="c1")
    assert h.judge() == set()
    h.faults.pop()
    h.ev(1.03, "c1", "intr", h=1, where="", how="signal")
    assert h.judge() == set()


def test_a_blocked_loop_is_discounted_from_time_bounds_like_a_stall() -> None:
    h = History()
    h.fault("server_pause", (0,), 1.0, 3.0)
    h.ev(1.5, "c1", "acq", h=1, mode="block", timeout=2.0)
    h.ev(2.4, "c1", "acq_err", h=1, err="BackendUnavailable", msg="")
    assert h.judge() == {"error-latency"}  # 0.9 s: three socket timeouts
    h.ev(1.6, "c1", "loop_block", call="acquire", t0=T0 + 1.6, t1=T0 + 2.2)
    assert h.judge() == set()  # 0.3 s of it the loop could run


def test_a_hold_lost_while_its_release_s_loop_was_blocked_is_excused_as_a_pause() -> None:
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    h.ev(1.01, "c1", "acq_ok", h=1, fence=1)
    h.ev(1.2, "c1", "check", h=1, when="releasing", found=True, t0=T0 + 1.2, t1=T0 + 1.2)
    h.ev(3.3, "c1", "lost", h=1, reason="expired", fence=1)
    h.ev(3.3, "c1", "rel_err", h=1, err="LockLost", msg="", attempt=0, since=T0 + 1.2)
    assert h.judge() == {"lost-on-healthy"}
    h.ev(3.2, "c1", "loop_block", call="release", t0=T0 + 1.21, t1=T0 + 3.2)
    assert h.judge() == set()


def test_a_hold_granted_while_its_loop_was_blocked_may_be_gone_when_acquire_returns() -> None:
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    h.ev(2.1, "c1", "acq_ok", h=1, fence=1)
    h.ev(2.1, "c1", "check", h=1, when="acquired", found=False, t0=T0 + 2.1, t1=T0 + 2.11)
    h.ev(2.2, "c1", "lost", h=1, reason="expired", fence=1)
    assert h.judge() == {"phantom-hold", "lost-on-healthy"}
    h.ev(2.09, "c1", "loop_block", call="acquire", t0=T0 + 1.002, t1=T0 + 2.09)
    assert h.judge() == set()


# -- the Celery kind's judge (celery_kind.check) -----------------------------------------------

_CallSpec = tuple[str, str, float, "tuple[float, float] | None", float, dict[str, Any]]
RAN: dict[str, Any] = {"ret": "ran"}
COALESCED: dict[str, Any] = {"ret": {"redlock": "duplicate_skipped", "coalesced": True}}


def _coalesce_key(spec: list[_CallSpec]) -> list[str]:
    """The judge's findings on one coalesce key's calls: (task id, tag, start, the body's
    begin and end or None, end, outcome); ids starting with "f" are follow-ups (the library
    queued them), the others the producer's."""
    from .celery_kind import check as celery_check

    events: list[dict[str, Any]] = []
    sent: dict[str, Any] = {}
    for i, tag, pre, run, post, outcome in spec:
        kw = {"key": "e8", "tag": tag, "seconds": 0.05}
        events.append({"t": T0 + pre, "pid": 1, "e": "pre", "id": i, "name": "campaign.coalesce",
                       "kw": kw, "jolt": None})  # fmt: skip
        if run is not None:
            events.append({"t": T0 + run[0], "pid": 1, "e": "run", "id": i, "key": "e8"})
            events.append({"t": T0 + run[1], "pid": 1, "e": "done", "id": i, "key": "e8"})
        events.append({"t": T0 + post, "pid": 1, "e": "post", "id": i, **outcome})
        if not i.startswith("f"):
            sent[i] = {"name": "coalesce", "key": "e8", "tag": tag, "t": T0 + pre}
    report = celery_check(1903, 22.5, events, sent, set())
    return sorted(v.prop for v in report.violations)


def _lost_hold_episode(lost: str | None, next_began: float) -> list[str]:
    """Seed 1903's episode: a run, two duplicates coalesced during it, its follow-up, a
    duplicate run directly once the key was free, then two more follow-ups: the first
    queued by the run before the direct one (its note), the second by the direct run's end
    (the note still there: the first had cleared the follow-up mark), begun at
    ``next_began``; ``lost``: how the first of the two ended (``None``: it ran; else the
    exception its release raised, at 4.10)."""
    ended = RAN if lost is None else {"exc": lost, "msg": "", "module": "x"}
    return _coalesce_key([
        ("first", "first", 1.6, (1.65, 1.97), 1.98, RAN),
        ("dup0", "dup0", 1.7, None, 1.75, COALESCED),
        ("fa", "dup0", 1.98, (1.99, 2.04), 2.1, RAN),
        ("dup1", "dup1", 2.0, None, 2.02, COALESCED),
        ("dup2", "dup2", 2.3, (2.31, 2.36), 3.5, RAN),
        ("fb", "dup1", 2.6, (3.9, 3.95), 4.1, ended),
        ("fc", "dup1", 3.96, (next_began, next_began + 0.05), next_began + 0.1, RAN),
    ])  # fmt: skip


def test_celery_a_second_trailing_run_is_excused_only_by_the_first_one_s_lost_hold() -> None:
    # Found by seed 1903: the first follow-up's hold ran out (latency) after its body and
    # before it dropped its claimed note; the second took the free key, found the claim and
    # ran the call again (LockLost at the first one's release, after the second began).
    assert _lost_hold_episode("LockLost", 3.99) == []
    # A trailing run that kept its hold, or whose release came before the next one began
    # (its note was dropped by then): one trailing run too many.
    assert _lost_hold_episode(None, 3.99) == ["coalesce-extra-run"]
    assert _lost_hold_episode("LockLost", 4.2) == ["coalesce-extra-run"]
    assert _lost_hold_episode("SoftTimeLimitExceeded", 3.99) == ["coalesce-extra-run"]


def test_celery_a_duplicate_noted_after_the_follow_up_started_owes_a_run_of_its_own() -> None:
    # Found by seed 1903 (13.176 s): the follow-up claimed dup0's note; dup1 and dup2 noted
    # theirs (found it held) after that claim but ended 4 ms and 0.1 ms before its body
    # began: the one more run after it is theirs, as the docs say.
    def episode(dup1: float, dup2: float) -> list[str]:
        return _coalesce_key([
            ("first", "first", 0.0, (0.001, 0.374), 0.381, RAN),
            ("dup0", "dup0", 0.149, None, 0.151, COALESCED),
            ("fa", "dup0", 0.38, (0.395, 0.446), 0.455, RAN),
            ("dup1", "dup1", dup1 - 0.006, None, dup1, COALESCED),
            ("dup2", "dup2", dup2 - 0.003, None, dup2, COALESCED),
            ("fb", "dup2", 0.451, (0.453, 0.503), 0.505, RAN),
        ])  # fmt: skip

    assert episode(0.391, 0.3949) == []
    # Noted before the follow-up started: its claim took them, and a second run is extra.
    assert episode(0.30, 0.31) == ["coalesce-extra-run"]


def test_a_take_whose_reply_a_blocked_loop_read_late_counts_from_its_grant() -> None:
    # Seed 2303 (redis reentrant, 18.75 s): c5 released while c3 waited; c7's one-off first
    # try was granted 1.3 ms later (its fence, the server's clock in us), but c7's loop was
    # blocked until 0.8 s on, and logged acq_ok then: the lock was taken, not held by nobody.
    h = History()
    h.ev(1.0, "c3", "acq", h=1, mode="block", timeout=3.0)
    h.hold("c5", 1, 0.9, 0.95, 1, 1.5)
    h.ev(1.499, "c7", "acq", h=1, mode="block", timeout=0.5)
    h.ev(1.502, "c7", "loop_block", call="acquire", t0=T0 + 1.502, t1=T0 + 2.3)
    h.ev(2.3, "c7", "acq_ok", h=1, fence=round((T0 + 1.5013) * 1e6))
    h.ev(2.35, "c7", "rel_ok", h=1, attempt=0)
    h.ev(2.36, "c3", "acq_ok", h=1, fence=round((T0 + 2.355) * 1e6))
    assert h.judge() == set()
    # Granted as the reply came (the fence says so): nobody took it for 0.8 s.
    h.events[[e["e"] for e in h.events].index("acq_ok", 3)]["fence"] = round((T0 + 2.299) * 1e6)
    assert h.judge() == {"handoff-slow"}


def _nobody(h: History, c: str, hold: int, at: float, found: bool, **fields: Any) -> None:
    h.ev(at, c, "check", h=hold, when="nobody", found=found, t0=T0 + at, t1=T0 + at,
         nodes="1" if found else "0", after=T0 + at - 0.5, prefix=f"{c}h{hold}.",
         **fields)  # fmt: skip


def test_a_let_go_hold_whose_name_its_token_still_holds_is_held_by_nobody() -> None:
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="block", timeout=2.0)
    h.ev(1.2, "c1", "intr", h=1, where="client", how="cancel")
    _nobody(h, "c1", 1, 1.8, True, how="cut", cut=T0 + 1.2)
    assert h.judge() == {"held-by-nobody"}
    h.events[-1]["found"] = False
    assert h.judge() == set()
    # A loop torn down under the call: the finisher's to clean up, judged the same.
    h.events[-1].update(found=True, how="teardown", teardown="close")
    assert h.judge() == {"held-by-nobody"}
    # Servers that did not answer meanwhile: the clean-up lapses at its TTL.
    h.fault("server_pause", (0,), 1.3, 1.5)
    assert h.judge() == set()


def test_an_unknown_outcome_s_grant_is_the_next_try_s_to_find_not_judged() -> None:
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    h.ev(1.3, "c1", "acq_err", h=1, err="BackendUnavailable", msg="Timeout reading")
    _nobody(h, "c1", 1, 2.0, True, how="unknown", unknowns=1, last_try=T0 + 1.0)
    assert h.judge() == set()
    # Retried at once and refused, after the held-back first request went through: the
    # same object's next try must find its own grant (backends.md).
    h.events[-1].update(how="refused", last_try=T0 + 1.6, wire_t0=T0 + 1.0, wire_t1=T0 + 1.5,
                        wire_up=True, wire_call="acquire", wire_s=0.5)  # fmt: skip
    assert h.judge() == {"held-by-nobody"}
    # Refused before the request went through: the next try after it would find it.
    h.events[-1].update(last_try=T0 + 1.4)
    assert h.judge() == set()


def test_the_two_once_open_held_by_nobody_cases_are_judged() -> None:
    # Review wai2 3 (fixed): the acquire's request held back, its call cut, the request
    # through after the cut (granted after its own hand-back).
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="block", timeout=2.0)
    h.ev(1.3, "c1", "intr", h=1, where="client", how="cancel")
    _nobody(h, "c1", 1, 2.5, True, how="cut", cut=T0 + 1.3, wire_up=True, wire_call="acquire",
            wire_t0=T0 + 1.1, wire_t1=T0 + 2.0, wire_s=0.9)  # fmt: skip
    assert h.judge() == {"held-by-nobody"}
    h.events[-1].update(wire_up=False)  # its reply held back: the hand-back's to release
    assert h.judge() == {"held-by-nobody"}
    # Review asy3 2 (fixed): two unknown outcomes in a row (the retry's token replaced the
    # kept one), then refused.
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    _nobody(h, "c1", 1, 2.5, True, how="refused", unknowns=2, last_try=T0 + 1.9)
    assert h.judge() == {"held-by-nobody"}
    h.events[-1].update(unknowns=1)
    assert h.judge() == {"held-by-nobody"}


def test_a_call_held_back_on_the_client_s_wire_is_no_server_s_silence() -> None:
    h = History()
    h.ev(1.0, "c1", "acq", h=1, mode="try", timeout=None)
    h.ev(1.04, "c1", "acq_err", h=1, err="BackendUnavailable", msg="Timeout reading")
    assert h.judge() == {"unavailable-on-healthy"}
    h.ev(1.01, "c1", "wire", h=1, call="acquire", up=True, node=0, t0=T0 + 1.01,
         t1=T0 + 2.0, cut=False)  # fmt: skip
    assert h.judge() == set()


def test_a_retry_that_finds_its_first_try_s_grant_is_judged_from_that_try() -> None:
    # Seed 14, semaphore: c4's try got no answer (its grant made), another client was
    # granted a later fence, and c4's immediate retry on the same object found its own
    # grant, with its fence: not behind, the acquire began at the first try.
    h = History()
    h.ev(1.0, "c4", "acq", h=2, mode="block", timeout=1.0)
    h.ev(1.3, "c4", "acq_err", h=2, err="BackendUnavailable", msg="Timeout reading")
    h.hold("c2", 1, 1.1, 1.15, 20, 1.2, role="s")
    h.ev(1.31, "c4", "acq", h=3, mode="block", timeout=1.0, retry_of=2)
    h.ev(1.35, "c4", "acq_ok", h=3, fence=10)
    assert h.judge(kind="semaphore", limit=2) == set()
    h.events[-2].pop("retry_of")  # another object's try: it began after fence 20's grant
    assert h.judge(kind="semaphore", limit=2) == {"fence-behind"}


def test_a_request_held_back_past_its_error_may_take_a_released_lock() -> None:
    # Seed 2401: c13's acquire raised BackendUnavailable, its request still held back on its
    # wire; let through just after c12's release, it took the lock for its TTL (an unknown
    # outcome's grant, documented), and the waiter c7 timed out behind it: no hand-off owed.
    h = History()
    h.ev(0.5, "c7", "acq", h=1, mode="block", timeout=2.0)
    h.ev(0.8, "c13", "acq", h=1, mode="block", timeout=4.0)
    h.ev(0.81, "c13", "wire", h=1, call="acquire", up=True, node=0, t0=T0 + 0.81,
         t1=T0 + 1.52, cut=False)  # fmt: skip
    h.ev(1.1, "c13", "acq_err", h=1, err="BackendUnavailable", msg="Timeout reading")
    h.hold("c12", 1, 1.3, 1.35, 1, 1.5)
    h.ev(2.5, "c7", "acq_no", h=1)
    assert "handoff-slow" not in h.judge()
    h.events = [e for e in h.events if e["e"] != "wire"]
    assert "handoff-slow" in h.judge()
