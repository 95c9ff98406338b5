"""Redis Cluster: every key of one lock shares the hash tag ``{name}``, so one slot holds them
and the same scripts run unchanged. Locks of different names spread over the slots.

Waiters use classic pub/sub, which a cluster forwards to every node (sharded pub/sub, Redis
7+, would keep the traffic on one shard; classic works on every version). Async operations
run the sync cluster client in a worker thread (see ``aexecute``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import redis.cluster

from ..options import check_options, cluster_options
from ..scripts import Call, script
from .base import Op, Renewal
from .redis import RedisBackend, _renewed

T = TypeVar("T")


class RedisClusterBackend(RedisBackend):
    """LOCATION: the URL of any node of the cluster; the rest are discovered."""

    wakes_one = False  # PUBLISH counts the receivers of one node only
    publishes_releases = True  # waiters listen on the release channel

    def _cluster_options(self) -> dict[str, Any]:
        return {**self.default_options, **self.options}

    def make_client(self) -> Any:
        return redis.cluster.RedisCluster.from_url(str(self.location), **self._cluster_options())

    @property
    def socket_timeout(self) -> float:
        return float(self._cluster_options()["socket_timeout"])

    def op_renew(self, renewals: Sequence[Renewal]) -> Op[list[bool | None]]:
        # A batch spans slots: one extend per lock, pipelined (routed to each lock's node).
        extend = script("extend")
        calls = [Call(extend, [self.key(r.name)], [r.token, r.ttl_ms]) for r in renewals]
        return Op(renewals[0].name if renewals else "", calls, _renewed)

    def page(self, match: str, cursor: str | None, size: int) -> tuple[list[Any], str | None]:
        # A cluster scans node by node: use the plain walk (BaseLockBackend's).
        return super(RedisBackend, self).page(match, cursor, size)

    async def aexecute(self, op: Op[T]) -> T:
        # redis.asyncio's cluster client (redis-py 8.1) breaks when many tasks set up
        # connections at once ('NoneType' object has no attribute 'writelines', seen with
        # 50 contending tasks); the sync client, run in a worker thread, does not.
        return await asyncio.to_thread(self.execute, op)

    @classmethod
    def check_options(cls, alias: str, params: Mapping[str, Any]) -> None:
        # RedisCluster silently drops what it does not know: a typo would just be ignored.
        where = "redis-py's RedisCluster"
        check_options(alias, params.get("OPTIONS") or {}, cluster_options(), where)
