"""A Redis Cluster one test file's tests share (the tests that pause a master or move a slot
each made one, about 2 s apiece under load): made at its first use, handed to each test
settled, made afresh after a test that left it otherwise, stopped at the file's end (the
file's module-scoped fixture calls :meth:`QuietCluster.stop`)."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator

from django_redlock.testing import RedisServer

# A node timeout long enough that nobody marks a paused master failed.
QUIET_ARGS = ("--cluster-enabled", "yes", "--cluster-node-timeout", "30000")


class QuietCluster:
    def __init__(self, make: Callable[[], list[RedisServer]]) -> None:
        self._make = make
        self._nodes: list[RedisServer] | None = None
        self.made = 0  # how many were made: a test left the last one unsettled if more than 1

    @contextlib.contextmanager
    def use(self) -> Iterator[list[RedisServer]]:
        """The cluster, for a test that looks up the owners of the slots it uses (slots
        move) and whose names are its own."""
        if self._nodes is None:
            self._nodes = self._make()
            self.made += 1
        try:
            yield self._nodes
        finally:
            if not settled(self._nodes):
                self.stop()

    def stop(self) -> None:
        nodes, self._nodes = self._nodes, None
        for node in nodes or ():
            node.kill()
            node.stop()


def settled(nodes: list[RedisServer]) -> bool:
    """Whether a shared cluster is as the next test needs it, after a test that may have
    failed half way: every node resumed and answering, a slot move left open called off,
    and every node naming the same owner of each slot, its state ok."""
    try:
        for node in nodes:
            node.resume()
        for node in nodes:
            lines = node.client().execute_command("CLUSTER", "NODES").decode().splitlines()
            mine = next(line for line in lines if "myself" in line)
            for open_move in re.findall(r"\[(\d+)-[<>]-", mine):  # [slot->-id], [slot-<-id]
                node.client().execute_command("CLUSTER", "SETSLOT", int(open_move), "STABLE")
        deadline = time.monotonic() + 10
        while True:
            views = {_owners(node) for node in nodes}
            ok = all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO")
                     for n in nodes)  # fmt: skip
            if len(views) == 1 and ok:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
    except Exception:  # (a node gone: a cluster made afresh for the next test)
        return False


def _owners(node: RedisServer) -> tuple[tuple[int, int, int], ...]:
    """(first slot, last slot, master's port) of each range, as ``node`` says (the replies'
    other fields differ between versions: Redis 7 adds a map to each node)."""
    slots = node.client().execute_command("CLUSTER", "SLOTS")
    return tuple(sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in slots))
