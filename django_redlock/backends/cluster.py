"""Redis Cluster: every key of one lock shares the hash tag ``{name}``, so one slot holds them
and the same scripts run unchanged. Locks of different names spread over the slots.

Waiters use sharded pub/sub on Redis 7+ (``SPUBLISH`` from the scripts, ``SSUBSCRIBE`` on the
node that owns the lock's slot): a release's wake-up stays on that shard instead of being
broadcast over the cluster bus to every node, as classic ``PUBLISH`` is. When a node runs Redis
6.x (found once per backend, at its first wait, from the nodes' ``HELLO``) they use classic
pub/sub; a waiter's id says which, and a release wakes it that way. Async operations
run the sync cluster client in worker threads, a pool per master (see ``aexecute``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis.cluster
import redis.exceptions
import redis.retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from .. import acl, wire
from ..exceptions import BackendUnavailable, LockError
from ..forks import after_fork_in_child
from ..identity import process_id
from ..options import check_options, cluster_options
from ..scripts import Call, script
from ..waiting import PubSubHub, ShardedPubSubHub
from .base import Attempt, Kind, LeaseRenewal, Op, Order, Renewal
from .redis import UNAVAILABLE, RedisBackend, renewed, text

T = TypeVar("T")
logger = logging.getLogger("django_redlock")
MIGRATION_PAUSE = 0.02  # seconds between tries while a slot is being migrated
MIGRATION_WAIT_MS = 100  # a take refused by a longer migration: its caller tries again then
REDIRECTIONS = 4  # MOVED, ASK, TRYAGAIN answers redis-py follows per command (see make_client)
ASYNC_THREADS = 32  # worker threads per master for asyncio calls (max_connections if fewer)
# How long a process's first wait waits for the nodes' versions (asked as the client is
# made, one socket timeout at most): past it, classic pub/sub for the backend's life.
PROBE_GRACE = 0.1
ASKED_MAX = 10_000  # locks remembered as asked elsewhere (an ASK) before the notes are reset
# How long the client's COMMAND waits for redis-py's default node before every other master
# is asked too (see _Cluster.command).
COMMAND_HEDGE = 0.1

# The parent's clients and hubs in a forked child (see forget_after_fork): kept, never
# collected.
_inherited: list[Any] = []


class RedisClusterBackend(RedisBackend):
    """LOCATION: the URL of any node of the cluster, or a list of several (seeds: the first
    that answers is asked for the rest, which are then discovered)."""

    acl_commands = {**acl.COMMANDS, **acl.CLUSTER_COMMANDS}

    #: Every waiter registers by its id, and a release wakes the earliest live one: with
    #: ``SPUBLISH`` (Redis 7+), which counts the receivers on the slot's node, where the
    #: lock's sharded listeners subscribe. A classic listener (a process that uses classic
    #: pub/sub) is reached by ``PUBLISH``, which counts one node's receivers of the many it
    #: reaches: counted 0, it is woken all the same and leaves the set (its try, if it
    #: fails, registers it again), and the next waiter is woken too (lua/_wake.lua).
    wakes_one = True

    #: Whether this process listens with sharded pub/sub (Redis 7+ on every node, all of
    #: them heard): None until the first wait decides (see ``sharded``).
    _sharded: bool | None = None
    #: The client's probe of the nodes' versions (see ``make_client``): (the client, done,
    #: its verdict once done).
    _probe: tuple[Any, threading.Event, list[bool]] | None = None

    #: Always the real channel: a cluster script's keys must share the lock's slot ('' is a
    #: key of slot 0). The scripts announce nothing on it (lua/_hold.lua's announces): every
    #: waiter is woken by its id, where it listens.
    publishes_releases = True

    #: Also the cluster's own "no answer": down (CLUSTERDOWN, during a failover), a slot no
    #: node serves, TRYAGAIN, redirects that never settled (a slot migration's TTL), and
    #: redis-py's cluster errors (no node reachable to read the slots from, the slots not
    #: all served), which are no RedisError.
    unavailable_errors = (
        *UNAVAILABLE,
        ClusterDownError,
        SlotNotCoveredError,
        TryAgainError,
        ClusterError,
        # Its base: redis-py 8.2's RedisClusterUnreachableError (a command that failed to
        # connect after a refresh that reached no node), "Cluster cannot be connected".
        RedisClusterException,
    )

    @classmethod
    def _check_location(cls, location: Any, bad: Any) -> None:
        if not isinstance(location, (list, tuple)):
            super()._check_location(location, bad)
            return
        if not location:
            raise bad("LOCATION", "must be a Redis URL or a non-empty list of them, not []")
        for url in location:
            super()._check_location(url, bad)
        first = urlsplit(location[0])
        for url in location[1:]:
            parts = urlsplit(url)
            if (parts.scheme, parts.username, parts.password, parts.query) != (
                first.scheme, first.username, first.password, first.query
            ):  # fmt: skip
                raise bad(
                    "LOCATION",
                    f"has {url!r}: every seed URL must have the first's scheme, user, password"
                    " and options (the connections to every node use the first's)",
                )

    @property
    def seed_urls(self) -> list[str]:
        """LOCATION's URLs: the nodes the slots are read from at first."""
        location = self.location
        return [str(location)] if isinstance(location, str) else [str(u) for u in location]  # type: ignore[union-attr]

    def _cluster_options(self) -> dict[str, Any]:
        return {**self.default_options, **self.options}

    def make_client(self) -> Any:
        options = self._cluster_options()
        if "retry" not in options and "cluster_error_retry_attempts" not in options:
            # redis-py's cluster client retries a command that failed or timed out (up to 10
            # times, re-reading the slots and backing off between): a paused master kept a
            # caller 22 s with a 2 s socket timeout. One try, as on one Redis: "unavailable"
            # comes within the socket timeout. Redirects (MOVED, ASK) are followed all the
            # same: redis-py does not count them as retries; a refused connection is tried
            # once more (execute()).
            options["retry"] = redis.retry.Retry(NoBackoff(), 0)
        if options.get("max_connections") and "connection_pool_class" not in options:
            # redis-py's node pools refuse a caller past max_connections ("Too many
            # connections"): a burst on a healthy cluster failed. Blocking ones make it wait
            # for a connection, as long as the socket timeout (then: unavailable, not sent,
            # and no outage: redis-py re-read the slots after each such wait).
            options["connection_pool_class"] = wire.WaitingPool
            options.setdefault("timeout", options["socket_timeout"])
        urls = self.seed_urls
        if len(urls) > 1:
            # Seeds: the slots are read from the first that answers (the URLs' own options,
            # user and password are the first's). One URL alone was a single point of
            # failure for every process started while that node was gone.
            seeds = [redis.cluster.ClusterNode(*_host_port(url)) for url in urls]
            options["startup_nodes"] = [*seeds, *options.get("startup_nodes", ())]
        try:  # reads the slots from a node: the first call's round trip
            client = _Cluster.from_url(urls[0], **options)
        except self.unavailable_errors as exc:
            raise self._unavailable("(connecting)", exc) from exc
        # redis-py follows up to RedisClusterRequestTTL redirections per command (16), and
        # a TRYAGAIN (a slot being migrated) is one: its 16 tries, sleeping 0.05 s for the
        # last 8, took 0.4 s, whatever the caller's timeout. A few cover any chain of MOVED
        # and ASK; execute() tries a migration again itself, within the caller's deadline.
        client.RedisClusterRequestTTL = REDIRECTIONS
        self._start_probe(client)
        self._last_client = client
        return client

    def _start_probe(self, client: Any) -> None:
        """Ask the nodes' versions in a thread of its own, as the client is made: the first
        wait (``sharded``) waited for it on the caller's thread (on asyncio: the loop) for a
        whole socket timeout while a master was paused."""
        done, timeout = threading.Event(), self.socket_timeout
        verdict: list[bool] = []
        self._probe = (client, done, verdict)

        def probe() -> None:
            try:
                verdict.append(_has_sharded_pubsub(client, timeout))
            finally:
                done.set()

        threading.Thread(
            target=probe, daemon=True, name=f"redlock-cluster-versions {self.alias}"
        ).start()

    def _unavailable(self, name: str, exc: Exception) -> BackendUnavailable:
        error = super()._unavailable(name, exc)
        # redis-py raises a command's timeout as "unreachable" while the slots cannot be
        # read from any node: the command was sent, and the server may still run it.
        cause = exc.__cause__ if isinstance(exc, RedisClusterException) else None
        if isinstance(cause, (TimeoutError, RedisTimeoutError)):
            return BackendUnavailable(str(error), timed_out=True)
        return error

    @property
    def sharded(self) -> bool:
        """Whether this process's waiters listen with sharded pub/sub: every node of the
        cluster told it runs Redis 7 or later. Decided at the first wait, for the backend's
        life (a waiter's id and the hub it listens on must agree), from the probe started
        with the client (``_start_probe``), waited for PROBE_GRACE at most: a probe not
        done by then (a node paused), or a node that did not answer it, means classic
        pub/sub, which works on every version (a 6.x node refuses SSUBSCRIBE and its
        scripts cannot wake a sharded waiter). A release wakes a waiter whichever way either
        process listens (lua/_wake.lua), so processes that decided differently still wake
        each other's waiters."""
        if self._sharded is None:
            client = self.client
            probe = self._probe
            done = probe is not None and probe[0] is client and probe[1].wait(PROBE_GRACE)
            with self._setup:
                if self._sharded is None:
                    self._sharded = bool(done and probe is not None and probe[2] == [True])
        return bool(self._sharded)

    def new_waiter_id(self) -> str:
        # '!': listens on its process's classic inbox (lua/_wake.lua's publish).
        waiter_id = super().new_waiter_id()
        return waiter_id if self.sharded else f"!{waiter_id}"

    def _lease_keys(self, name: str) -> list[str]:
        keys = super()._lease_keys(name)
        # Never '' here, even when waiters are woken by id: '' is a key of slot 0, and every
        # key of a script must share the lock's slot.
        keys[2] = self.channel(name)
        return keys

    def inbox_for(self, name: str) -> str:
        # Whichever way this process listens: a shard channel must hash to the script's
        # slot, so the inbox carries the lock's hash tag, and its last '*' tells the scripts
        # they run on a cluster (lua/_wake.lua's publish: each waiter is woken the way it
        # listens). It stays under KEY_PREFIX, so a Redis user limited to '&<prefix>*' may
        # use it.
        return f"{self.key(name)}:inbox*"

    @property
    def hub(self) -> PubSubHub:
        if self._hub is None:
            with self._setup:
                if self._hub is None:
                    # Its connections are the backend's own (see _own), never the node
                    # pools': one kept there while anyone waits was one fewer for callers,
                    # and a (re-)subscribe queued behind them.
                    client = self.client
                    if self.sharded:
                        self._hub = self._adopt(ShardedPubSubHub(
                            _OwnNodes(self, client),
                            self.socket_timeout,
                            lambda name: f"{self.inbox_for(name)}{process_id()}",
                            self._refusal,
                        ))  # fmt: skip
                    else:
                        self._hub = self._adopt(PubSubHub(
                            lambda: self._classic_pubsub(client), self.socket_timeout,
                            self.inbox_prefix, self._refusal,
                        ))  # fmt: skip
        return self._hub

    @property
    def socket_timeout(self) -> float:
        return float(self._cluster_options()["socket_timeout"])

    # -- the backend's own connections: renewals and pub/sub ---------------------------------
    # Outside the node pools (blocking ones with max_connections): the renewals took their
    # connection there, queued behind callers' commands for a socket timeout per try, and a
    # hold expired on a healthy master (a second holder took it). Per master: the renewals
    # use one connection (two while the renewer also sends holds of no known master there),
    # and the waiters' sharded pub/sub one while anyone waits there (classic: one in all).

    _own_pools: tuple[Any, dict[str, Any]] | None = None  # (the client, node name: Redis)

    def _own(self, client: Any, node: Any) -> Any:
        """A ``redis.Redis`` on ``node`` (of ``client``) whose pool is the backend's own: made
        like the node pool (the same connection class and options), with no limit and no
        waiting. No I/O; under a lock of its own only (called under the hub's mutex)."""
        own = self._own_pools
        if own is None or own[0] is not client:
            with _OWN_LOCK:
                own = self._own_pools
                if own is None or own[0] is not client:
                    own = self._own_pools = (client, {})
        redis_node = own[1].get(node.name)
        if redis_node is None:
            pool = client.get_redis_connection(node).connection_pool
            mine = redis.Redis(connection_pool=redis.ConnectionPool(
                connection_class=pool.connection_class, **pool.connection_kwargs
            ))  # fmt: skip
            with _OWN_LOCK:
                redis_node = own[1].setdefault(node.name, mine)
            if redis_node is mine:
                _prune_own(client, own[1], node.name)
        return redis_node

    def _classic_pubsub(self, client: Any) -> Any:
        """The classic waiters' pub/sub: on the node of their inbox's slot, as redis-py's
        cluster pub/sub picks it (any node hears a classic PUBLISH)."""
        inbox = f"{self.inbox_prefix}{process_id()}"
        return self._own(client, client.get_node_from_key(inbox)).pubsub()

    # -- the watchdog: a shard is a backend ---------------------------------------------------
    # Each master's holds are renewed on their own (renewer.py asks renewal_shard, and gives
    # each master's batches a worker of their own), each batch straight on its master's
    # connection in one pipelined try bounded by the socket timeout: never through the
    # cluster pipeline, whose per-command retry loop re-sent each timed-out renewal to a
    # paused master on its own (seven socket timeouts per try), while the holds of the
    # healthy masters, in the same batch, expired behind it. A worker sends only to its own
    # master: a hold found elsewhere (its slot moved: a MOVED, an ASK, the slots read again)
    # gets no answer there, renewal_epoch changes, and the renewer moves it to the batches of
    # the master it is on now, renewed at once by that master's worker. A master's worker
    # never waits for another master (it did: a moved hold was followed there, and a paused
    # new owner held up the old owner's holds for a socket timeout per try), nor makes the
    # client (see _renewal_client).

    _epoch = 0  # renewal_epoch: changed whenever a hold is found off its shard
    #: The client last made, kept past close() for the watchdog (see ``_renewal_client``).
    _last_client: Any = None
    _asked: dict[str, tuple[str, int]] | None = None  # name: where an ASK sent its keys
    # A note outlives what it described (a hold released, its slot moved back and moving
    # again: the key still on the source), so a 0 after ASKING is a loss only for a hold
    # doubted since (here: (name, token): sure). The first such 0 is no answer: the note is
    # dropped, the hold doubted and renewed on its slot's owner next, which answers, or sends
    # it on with an ASK (sure then: keys move one way during a migration, so a key gone from
    # the source at that ASK and from the target after it is gone). The notes stay per name:
    # a semaphore's permits share one key.
    _doubted: dict[tuple[str, str], bool] | None = None

    @property
    def renewal_epoch(self) -> int:  # type: ignore[override]
        return self._epoch

    def _moved(self) -> None:
        self._epoch += 1  # a race loses an increment at worst: any change is noticed

    def _renewal_client(self) -> Any:
        """The client a master's worker renews through, never one it makes: making one asks
        other nodes (the slots of a seed, COMMAND of a master), and after a close() every
        master's worker made it again, one behind the other, so with a master paused no
        renewal was sent to any master (the healthy masters' holds expired while reported
        held). The backend's client, or the one it had before a close(): its slot map and
        the backend's own connection to the worker's master are all a renewal needs. None
        only before any client was made."""
        client = self._client
        return self._last_client if client is None else client

    def renewal_shard(self, name: str) -> Hashable:
        client = self._renewal_client()  # a closed backend's holds keep their masters
        if client is None:
            return None
        asked = (self._asked or {}).get(name)
        if asked is not None:
            return f"{asked[0]}:{asked[1]}"  # redis-py's node name
        try:
            return str(client.get_node_from_key(self.key(name)).name)  # the slot cache only
        except Exception:  # a slot not known yet: renewed with the other unknowns
            return None

    def _renewal_node(self, client: Any, name: str) -> tuple[Any, bool]:
        """Where ``name``'s hold is renewed (its slot's master, or the node an ASK named:
        then each script after ASKING), and whether after ASKING. Raises
        SlotNotCoveredError for a slot nobody serves."""
        asked = (self._asked or {}).get(name)
        if asked is not None:
            return wire.node_at(client, *asked), True
        return client.get_node_from_key(self.key(name)), False

    def renew_many(self, renewals: Sequence[Renewal], shard: Hashable = None) -> list[bool | None]:
        """Each lock's renew.lua on the master its slot is on: True or False as answered,
        None where no answer came (that master paused, down or refusing for now: tried again
        soon; unknown is not lost). With ``shard`` (a master's name), only that master's
        holds are sent; the others get None (the renewer moves them). Without it, each
        master at once, a thread each, and a MOVED or ASK is followed once. Raises
        BackendUnavailable (or BackendRefused) only when no lock got an answer."""
        client = self.client if shard is None else self._renewal_client()
        results: list[bool | None] = [None] * len(renewals)
        if client is None:  # no client yet (never here: a shard is named by one)
            self._moved()  # the renewer moves them to the holds of no known master
            return results
        groups: dict[str, tuple[Any, list[int], list[bool]]] = {}
        for i, renewal in enumerate(renewals):
            try:
                node, asking = self._renewal_node(client, renewal.name)
            except SlotNotCoveredError:
                continue  # no answer for it; the next try finds the slot, once it is served
            if shard is not None and node.name != shard:
                self._moved()  # not on this master any more: the renewer moves it
                continue
            group = groups.setdefault(node.name, (node, [], []))
            group[1].append(i)
            group[2].append(asking)
        if shard is None and groups:
            self._moved()  # holds of no known shard: the renewer may place them now
        failures: list[LockError] = []

        def renew_on(node: Any, indices: list[int], asking: list[bool]) -> None:
            try:
                self._renew_on(
                    client, node, renewals, indices, asking, results, follow=shard is None
                )
            except LockError as exc:
                failures.append(exc)
            except Exception:  # a bug: logged as the watchdog's, its holds no answer
                logger.exception("redlock: renewing on %s (%s) failed", self.describe(), node.name)

        parts = list(groups.values())
        threads = [threading.Thread(target=renew_on, args=part, daemon=True) for part in parts[1:]]
        for thread in threads:
            thread.start()
        if parts:
            renew_on(*parts[0])
        for thread in threads:
            thread.join()
        if failures and all(result is None for result in results):
            raise failures[0]
        return results

    def _renew_on(
        self,
        client: Any,
        node: Any,
        renewals: Sequence[Renewal],
        indices: list[int],
        asking: list[bool],
        results: list[Any],
        follow: bool,
    ) -> None:
        """Renew ``renewals[indices]`` on ``node`` (results filled in place). A lock whose
        slot moved (MOVED, ASK) is noted where it is now, and followed there once if
        ``follow``. Raises the error of a try that got no answer at all."""
        name = renewals[indices[0]].name
        try:
            replies = self._send_renewals(client, node, renewals, indices, asking)
        except self.unavailable_errors as exc:
            # Paused, down, or failed over: ask the cluster where the slots are now (the
            # failed node last), so the next try goes to a new master if there is one. An
            # ASK's note for it is dropped: its slot's master (as now read) decides again.
            asked = self._asked
            if asked:
                for each in [n for n, at in list(asked.items()) if at == (node.host, node.port)]:
                    asked.pop(each, None)
            try:
                wire.refresh_slots(client, failed=node.name)
            except Exception as failed:
                logger.info("redlock: the cluster's slots could not be read again: %s", failed)
            else:
                self._moved()
            raise self._unavailable(name, exc) from exc
        redirected: dict[str, tuple[Any, list[int], list[bool]]] = {}
        refusal: LockError | None = None
        for i, ask, reply in zip(indices, asking, replies, strict=True):
            if isinstance(reply, list):
                results[i] = self._answered(renewals[i], bool(reply[0]), ask)
            elif isinstance(reply, (MovedError, AskError)):
                target = self._redirected(client, reply, node, renewals[i])
                if target is not None:
                    group = redirected.setdefault(target.name, (target, [], []))
                    group[1].append(i)
                    group[2].append(isinstance(reply, AskError))
            elif isinstance(reply, ResponseError):  # BUSY, OOM, ...: no answer for it
                refusal = refusal or self.server_error(renewals[i].name, reply)
            else:
                results[i] = bool(reply)
        for target, followed, asks in redirected.values() if follow else ():
            try:
                again = self._send_renewals(client, target, renewals, followed, asks)
            except (*self.unavailable_errors, LockError):
                continue  # no answer for those: tried again soon
            for i, reply in zip(followed, again, strict=True):
                if isinstance(reply, list):
                    results[i] = bool(reply[0])
        if refusal is not None and all(results[i] is None for i in indices):
            raise refusal

    def _answered(self, renewal: Renewal, renewed: bool, asking: bool) -> bool | None:
        """A renewal's answer; None (no answer) for a 0 after ASKING of a hold not doubted
        since its note (see ``_doubted``): it is doubted now, and renewed on its slot's
        owner next."""
        doubted, hold = self._doubted, (renewal.name, renewal.token)
        if not asking or renewed:
            if doubted and renewed:
                doubted.pop(hold, None)  # (not asking: its owner's 0 is a loss as ever)
            return renewed
        if doubted and doubted.get(hold):
            doubted.pop(hold, None)
            return False
        doubted = self._doubted if self._doubted is not None else {}
        if len(doubted) >= ASKED_MAX:
            doubted.clear()  # ended holds' doubts; a live one is doubted again
        doubted[hold] = False
        self._doubted = doubted
        if self._asked:
            self._asked.pop(renewal.name, None)  # the slot's owner decides again
        self._moved()
        return None

    def _redirected(self, client: Any, reply: AskError, node: Any, renewal: Renewal) -> Any:
        """The node a MOVED or ASK names, noted for ``renewal``'s hold (a MOVED updates the
        slot cache, an ASK is remembered for that hold until a MOVED comes for it), or None
        if it cannot be: that lock gets no answer this time."""
        name = renewal.name
        reply.host = reply.host or node.host  # a node that does not know its own address
        try:
            if isinstance(reply, MovedError):
                wire.follow_moved(client, reply)
                if self._asked:
                    self._asked.pop(name, None)
                target = client.get_node_from_key(self.key(name))
            else:
                # A slot being moved, the key already on the importing node, which may own
                # no slot yet (a new node: in no CLUSTER SLOTS reply, unknown to redis-py).
                target = wire.node_at(client, reply.host, reply.port)
                asked = self._asked if self._asked is not None else {}
                if len(asked) >= ASKED_MAX:
                    asked.clear()  # released holds' notes; a live one is told again
                asked[name] = (target.host, target.port)
                self._asked = asked
                doubted, hold = self._doubted, (name, renewal.token)
                if doubted and hold in doubted:
                    doubted[hold] = True  # an ASK since its doubt: the target's 0 is a loss
        except Exception as exc:  # the slot cache in flux (a refresh): tried again soon
            logger.info("redlock: a redirect of %r could not be followed: %s", name, exc)
            return None
        self._moved()
        return target

    def _send_renewals(
        self,
        client: Any,
        node: Any,
        renewals: Sequence[Renewal],
        indices: list[int],
        asking: list[bool],
    ) -> list[Any]:
        """One pipelined try on ``node``'s own connection (a key on a slot being imported:
        its script after ASKING): the replies of the scripts, errors as values."""
        renew = script("renew")
        # A lease's details hash declared too: undeclared, a slot moved key by key ran half the
        # script (the leases renewed, the writer's mark left to expire: review wdc3, 4).
        requests = [
            ("EVALSHA", renew.sha, len(keys), *keys, renewals[i].token, renewals[i].ttl_ms)
            for i in indices
            for keys in [self._renewed_keys(renewals[i])]
        ]
        redis_node = self._own(client, node)  # never queued behind callers
        self.round_trips += 1
        replies = _pipelined(redis_node, requests, asking)
        if any(isinstance(r, NoScriptError) for r in replies):
            try:
                redis_node.script_load(renew.source)  # a restarted or new master
            except ResponseError as exc:  # BUSY, ...: the refusal table's
                raise self.server_error(renewals[indices[0]].name, exc) from exc
            self.round_trips += 1
            replies = _pipelined(redis_node, requests, asking)
        return replies

    def op_release(self, name: str, token: str, kind: Kind, order: Order | None = None) -> Op[int]:
        if self._asked:  # a lock's one hold ends: its note must not outlive it
            self._asked.pop(name, None)
        if self._doubted:
            self._doubted.pop((name, token), None)
        return super().op_release(name, token, kind, order)

    def op_renew(self, renewals: Sequence[Renewal]) -> Op[list[bool | None]]:
        # A batch spans slots: one renew.lua per lock (never shortens, as a whole batch's),
        # pipelined (routed to each lock's node); each replies a list of one.
        renew = script("renew")
        calls = [Call(renew, self._renewed_keys(r), [r.token, r.ttl_ms]) for r in renewals]
        return Op(renewals[0].name if renewals else "", calls, _renewed_each)

    def _renewed_keys(self, renewal: Renewal) -> list[str]:
        """Every key ``renewal``'s hold lives by: a lease's details hash too (not a plain
        lock's: a key that never exists would make every renewal during a slot's move a
        TRYAGAIN)."""
        if isinstance(renewal, LeaseRenewal):
            return [self.key(renewal.name), self.details_key(renewal.name)]
        return [self.key(renewal.name)]

    def op_lease_extend(self, name: str, token: str, ttl_ms: int) -> Op[bool]:
        # Both keys declared, as in its renewals (see _send_renewals).
        keys = [self.key(name), self.details_key(name)]
        return Op(name, Call(script("extend"), keys, [token, ttl_ms]), bool)

    def page(self, match: str, cursor: str | None, size: int) -> tuple[list[Any], str | None]:
        # A cluster scans node by node: use the plain walk (BaseLockBackend's).
        return super(RedisBackend, self).page(match, cursor, size)

    def execute(self, op: Op[T]) -> T:
        # A slot being migrated (resharding) answers TRYAGAIN to every script that names a
        # key the source no longer has or never had (a queue, a fence moved first): nothing
        # ran. redis-py gives up after REDIRECTIONS tries (about 0.1 s, "TTL exhausted"); a
        # migration is not an outage: tried again until one socket timeout has passed, or
        # the caller's deadline (a waiter's timeout: it tries again later, within it).
        give_up = time.monotonic() + self.socket_timeout
        if op.deadline is not None:
            give_up = min(give_up, op.deadline)
        while True:
            try:
                return self._execute(op)
            except BackendUnavailable as exc:
                if not _migrating(exc.__cause__):
                    raise
                now = time.monotonic()
                if now >= give_up:
                    if isinstance(op.parse, _Take):  # not taken (nothing ran): the caller
                        return op.parse.not_yet  # type: ignore[return-value]  # waits on
                    raise
            time.sleep(min(MIGRATION_PAUSE, max(give_up - now, 0.0)))

    # A take that a migration longer than the socket timeout refused is "not taken, try again
    # in a moment": a waiter keeps waiting within its own timeout, a one-off try says False.
    def op_acquire(
        self,
        name: str,
        token: str,
        ttl_ms: int,
        meta: str,
        kind: Kind,
        waiter: str | None = None,
        wait_ms: int = -1,
        order: Order | None = None,
    ) -> Op[Attempt]:
        op = super().op_acquire(name, token, ttl_ms, meta, kind, waiter, wait_ms, order)
        return Op(op.name, op.request, _Take(op.parse))

    def op_lease_acquire(
        self,
        name: str,
        token: str,
        ttl_ms: int,
        meta: str,
        mode: str,
        limit: int = 0,
        fair: bool = False,
        waiter: str | None = None,
        wait_ms: int = -1,
        reader: str = "",
    ) -> Op[Attempt]:
        op = super().op_lease_acquire(
            name, token, ttl_ms, meta, mode, limit, fair, waiter, wait_ms, reader
        )
        return Op(op.name, op.request, _Take(op.parse))

    def _execute(self, op: Op[T]) -> T:
        try:
            return self._execute_refused_once(op)
        except AttributeError as exc:
            # redis-py (up to 8.2) follows an ASK to a node it does not know as None: a new
            # node a slot is being moved to serves no slot yet. Nothing ran (the ASK says
            # the source did not; the target was never reached): learn the node, try again.
            if not self._learn_asked(op.name):
                raise self._unavailable(op.name, exc) from exc
        try:
            return self._execute_refused_once(op)
        except AttributeError as exc:  # the node forgotten again (the slots read meanwhile)
            raise self._unavailable(op.name, exc) from exc

    def _learn_asked(self, name: str) -> bool:
        """Whether ``name``'s slot's master answers ASK for its key (an ``EXISTS``, which runs
        nothing), naming a node now known to the client."""
        client, key = self.client, self.key(name)
        try:
            node = client.get_node_from_key(key)
            client.get_redis_connection(node).execute_command("EXISTS", key)
        except AskError as ask:
            try:
                wire.node_at(client, ask.host or node.host, ask.port)
            except Exception:  # unreachable as far as known; the caller says unavailable
                return False
            return True
        except Exception:  # no ASK: the caller says unavailable
            return False
        return False

    def _execute_refused_once(self, op: Op[T]) -> T:
        try:
            return super().execute(op)
        except BackendUnavailable as exc:
            if not wire.refused_at_connect(exc.__cause__):
                raise
        # A master gone after a failover: nothing was sent (the connection never opened), so
        # one more try is safe, once the slots are read again (redis-py 8.2 no longer does it
        # on the refusal itself).
        refresh_errors: tuple[type[Exception], ...] = (
            *self.unavailable_errors,
            RedisClusterException,
        )
        try:
            wire.refresh_slots(self.client)
        except refresh_errors as exc:
            # RedisClusterException: no node answered the slots query.
            raise self._unavailable(op.name, exc) from exc
        return super().execute(op)

    # -- asyncio: the sync client in worker threads ---------------------------------------
    # redis.asyncio's cluster client (redis-py 8.1) breaks when many tasks set up connections
    # at once ('NoneType' object has no attribute 'writelines', seen with 50 contending
    # tasks); the sync client, run in a worker thread, does not. The threads are the
    # backend's, a pool per master (as the watchdog's workers): on the loop's default
    # executor (min(32, cpus + 4) threads) the calls to one paused master filled every
    # thread, and a healthy master's call waited behind them for socket timeouts.

    _executors: tuple[int, dict[Hashable, ThreadPoolExecutor]] = (0, {})
    _unfinished: dict[str, list[Future[Any]]] | None = None  # name: cancelled calls' threads

    def _executor(self, name: str) -> ThreadPoolExecutor:
        pid, executors = self._executors
        if pid != os.getpid():  # a forked child: the parent's threads are not here (nor will
            executors = {}  # its unfinished calls ever finish here)
            self._executors, self._unfinished = (os.getpid(), executors), None
        shard = self.renewal_shard(name)  # the slot cache only: no I/O
        executor = executors.get(shard)
        if executor is None:
            with self._setup:
                executor = executors.get(shard)
                if executor is None:
                    # No more than the master's max_connections (a caller past it waits;
                    # the waiters' pub/sub and the renewals are outside it: see _own).
                    limit = int(self._cluster_options().get("max_connections") or 0)
                    size = limit or ASYNC_THREADS
                    executor = executors[shard] = ThreadPoolExecutor(
                        min(size, ASYNC_THREADS), f"redlock-cluster {self.alias} {shard}"
                    )
                    self._prune_executors(executors, shard)
        return executor

    def _prune_executors(self, executors: dict[Hashable, ThreadPoolExecutor], new: Any) -> None:
        """A master new to this process (a failover, a node replaced under another address):
        the pools of nodes no longer masters are shut down, their threads ending once their
        calls have (kept, they grew by a pool per node replaced over the process's life).
        From the slot cache only: no I/O."""
        client = self._client
        if client is None:
            return
        try:
            masters = {str(node.name) for node in client.get_primaries()}
        except Exception:  # the slot map being read again: pruned next time
            return
        for shard in [s for s in executors if s is not None and s != new and s not in masters]:
            executors.pop(shard).shutdown(wait=False)

    def execute_by(self, op: Op[T], deadline: float | None) -> T:
        return self.execute(op)  # (redis-py's cluster client: no thread connection to bound)

    async def aexecute_by(self, op: Op[T], deadline: float | None) -> T:
        # Not cut short by the deadline: a cancelled call's thread runs on (see
        # _after_unfinished), its own socket timeout bounds it.
        return await self.aexecute(op)

    async def aexecute(self, op: Op[T]) -> T:
        executor = self._executor(op.name)
        if self._unfinished:
            await self._after_unfinished(op.name)
        context = contextvars.copy_context()  # as asyncio.to_thread: the caller's context
        try:
            future = executor.submit(context.run, self.execute, op)
        except RuntimeError:  # shut down by a close() meanwhile: the backend's next threads
            future = self._executor(op.name).submit(context.run, self.execute, op)
        waited = asyncio.wrap_future(future)
        try:
            await asyncio.wait([waited], timeout=self.socket_timeout)
            if not waited.done() and future.cancel():
                # Queued a socket timeout behind the master's busy threads (a paused master):
                # unavailable within the socket timeout, as a thread's call. Never started:
                # cancelled, nothing was or will be sent.
                raise BackendUnavailable(
                    f"lock {op.name!r}: backend {self.alias!r}: not sent: every thread for"
                    f" its master was busy for {self.socket_timeout:g} s",
                    timed_out=True,
                )
            return await waited
        except asyncio.CancelledError:
            # Not stopped if it had started (a thread cannot be): its command may still be
            # sent after this. What this task sends next for the name (the hand-back of a
            # take cancelled in flight) waits for it, never overtakes it: a release landing
            # first left the take's hold to nobody for its TTL.
            if not future.cancel() and not future.done():
                self._note_unfinished(op.name, future)
            raise

    def _note_unfinished(self, name: str, future: Future[Any]) -> None:
        with self._setup:
            unfinished = self._unfinished if self._unfinished is not None else {}
            unfinished.setdefault(name, []).append(future)
            self._unfinished = unfinished

        def done(_: Future[Any]) -> None:
            with self._setup:
                left = [f for f in unfinished.get(name, ()) if not f.done()]
                if left:
                    unfinished[name] = left
                else:
                    unfinished.pop(name, None)

        future.add_done_callback(done)

    async def _after_unfinished(self, name: str) -> None:
        """Wait for the threads of cancelled calls of ``name`` still running (each ends
        within its socket timeout); their outcome is not this call's."""
        pending = [f for f in (self._unfinished or {}).get(name, ()) if not f.done()]
        if pending:
            await asyncio.wait([asyncio.wrap_future(f) for f in pending])

    def forget_after_fork(self) -> None:
        """The child makes a client of its own. redis-py's cluster client keeps locks that a
        thread holds during network I/O (its slot map's, while reading the slots: the
        watchdog after a try with no answer, a waiter's hub after a failover); one held by a
        parent thread at the fork stays held in the child, whose first slot refresh then
        waited forever. The hub holds the client too: made again. Whether the cluster
        shards pub/sub is kept (the nodes did not change at the fork)."""
        super().forget_after_fork()
        # Never closed nor collected here: their close() takes those locks.
        _inherited.extend(
            each
            for each in (self._client, self._last_client, self._hub, self._own_pools)
            if each is not None
        )
        self._client = None
        self._last_client = None
        self._hub = None
        self._own_pools = None

    def close(self) -> None:
        super().close()  # _last_client kept: the watchdog renews the holds left through it
        self._sharded = None
        own, self._own_pools = self._own_pools, None
        for redis_node in own[1].values() if own is not None else ():
            with contextlib.suppress(Exception):
                redis_node.connection_pool.disconnect()
        pid, executors = self._executors
        # Its pid kept: a close() is no fork, the threads of cancelled calls still run and
        # the next call of their name (a hand-back) must still wait for them.
        self._executors = (pid, {})
        if pid == os.getpid():
            for executor in executors.values():
                executor.shutdown(wait=False)  # its threads end once their call has

    @classmethod
    def check_options(cls, alias: str, params: Mapping[str, Any]) -> None:
        # RedisCluster silently drops what it does not know: a typo would just be ignored.
        where = "redis-py's RedisCluster"
        check_options(alias, params.get("OPTIONS") or {}, cluster_options(), where)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "localhost", parts.port or 6379


def _has_sharded_pubsub(client: Any, timeout: float) -> bool:
    """Redis 7 or later (SSUBSCRIBE, SPUBLISH) on every node that answers its ``HELLO``
    (which every user may send, unlike INFO) within ``timeout``, all asked at once: during a
    rolling upgrade from 6.x, a 6.x node would refuse SSUBSCRIBE. A node that does not
    answer (paused) may be a 6.x one: classic pub/sub then, which works everywhere."""
    versions: list[int] = []

    def ask(node: Any) -> None:
        try:
            hello = client.get_redis_connection(node).execute_command("HELLO")
            version = hello.get("version", hello.get(b"version"))
            versions.append(int(text(version).split(".")[0]))
        except Exception as exc:
            logger.info("redlock: the Redis version of %s is unknown (%s)", node.name, exc)

    try:
        nodes = list(client.get_nodes())
    except Exception as exc:
        logger.info("redlock: Redis versions unknown (%s): classic pub/sub", exc)
        return False
    threads = [threading.Thread(target=ask, args=(node,), daemon=True) for node in nodes]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    answered = list(versions)
    if len(answered) < len(nodes):
        logger.info("redlock: %d of %d nodes told their version", len(answered), len(nodes))
    return bool(nodes) and len(answered) == len(nodes) and min(answered) >= 7


class _Cluster(redis.cluster.RedisCluster):
    """redis-py's cluster client, whose COMMAND any master may answer."""

    def command(self, **kwargs: Any) -> Any:
        """COMMAND (the commands' key positions), which redis-py asks as the client is made
        (its CommandsParser): of its default node, the master of slot 0, so while that
        master was paused no client could be made (a process started or forked then took
        no lock, a closed backend's client was never made again). Every master answers it
        alike: the default node first, and after COMMAND_HEDGE (or its failure) the other
        masters too; the first answer is taken, within one socket timeout in all."""
        default = self.get_default_node()  # from the slots just read: no I/O
        order = [default] if default is not None else []
        order += [node for node in self.get_primaries() if node not in order]
        if not order:
            return super().command(**kwargs)
        connection = self.get_redis_connection(order[0]).connection_pool.connection_kwargs
        timeout = float(connection.get("socket_timeout") or 2.0)
        return _first_answer(
            [self.get_redis_connection(node) for node in order], ("COMMAND",), kwargs, timeout
        )


def _first_answer(
    clients: list[Any], command: tuple[Any, ...], kwargs: dict[str, Any], timeout: float
) -> Any:
    """The first answer to ``command``: asked of ``clients[0]``, and of the others too once
    it failed or COMMAND_HEDGE passed without its answer; each in a thread of its own (one
    still waiting for a paused node is left to its socket timeout). Raises the first error
    if every one failed, a timeout if none answered within ``timeout``."""
    done = threading.Condition()
    answers: list[Any] = []
    errors: list[BaseException] = []

    def ask(client: Any) -> None:
        try:
            answer = client.execute_command(*command, **kwargs)
        except Exception as exc:  # raised to the caller if every client fails
            with done:
                errors.append(exc)
                done.notify_all()
        else:
            with done:
                answers.append(answer)
                done.notify_all()

    def start(each: Any) -> None:
        threading.Thread(target=ask, args=(each,), daemon=True, name="redlock-cluster-ask").start()

    deadline = time.monotonic() + timeout
    start(clients[0])
    with done:
        done.wait_for(lambda: answers or errors, min(COMMAND_HEDGE, timeout))
        if not answers:
            for each in clients[1:]:
                start(each)
            done.wait_for(
                lambda: answers or len(errors) == len(clients),
                max(deadline - time.monotonic(), 0.0),
            )
        if answers:
            return answers[0]
        if len(errors) == len(clients):
            raise errors[0]
    raise RedisTimeoutError(f"no master answered {command[0]} within {timeout:g} s")


_OWN_LOCK = threading.Lock()  # the backends' own pools (see _own): never held during I/O


@after_fork_in_child
def _new_own_lock() -> None:
    global _OWN_LOCK  # a parent thread may have held it at the fork
    _OWN_LOCK = threading.Lock()


def _prune_own(client: Any, pools: dict[str, Any], new: str) -> None:
    """The idle connections of nodes no longer masters are closed and their pools forgotten
    (one in use ends with its user). From the slot cache only: no I/O (but redis-py's lock
    on it, held while the slots are read)."""
    try:
        masters = {str(node.name) for node in client.get_primaries()}
    except Exception:  # the slot map being read again: pruned next time
        return
    with _OWN_LOCK:
        gone = [pools.pop(n) for n in list(pools) if n != new and n not in masters]
    for redis_node in gone:
        with contextlib.suppress(Exception):
            redis_node.connection_pool.disconnect(inuse_connections=False)


class _OwnNodes:
    """The cluster client as the sharded waiters' hub uses it, each node's connection the
    backend's own (see ``RedisClusterBackend._own``)."""

    def __init__(self, backend: RedisClusterBackend, client: Any) -> None:
        self._backend, self._client = backend, client

    @property
    def nodes_manager(self) -> Any:
        return self._client.nodes_manager

    def get_node_from_key(self, key: str) -> Any:
        return self._client.get_node_from_key(key)

    def get_redis_connection(self, node: Any) -> Any:
        return self._backend._own(self._client, node)


class _Take:
    """A take's reply parser, marked as a take (see ``execute``)."""

    not_yet = Attempt(False, None, MIGRATION_WAIT_MS)

    def __init__(self, parse: Any) -> None:
        self.parse = parse

    def __call__(self, reply: Any) -> Attempt:
        return self.parse(reply)


def _migrating(error: BaseException | None) -> bool:
    """Whether redis-py gave up on a slot under migration (nothing was run): TRYAGAIN, or
    its redirections ran out (raised only after MOVED, ASK or TRYAGAIN answers)."""
    return isinstance(error, TryAgainError) or (
        type(error) is ClusterError and "TTL exhausted" in str(error)
    )


def _pipelined(client: Any, requests: list[tuple[Any, ...]], asking: list[bool]) -> list[Any]:
    """``requests`` in one pipeline (no retry: the node's client has none), errors as values;
    each after ASKING where ``asking`` says (only the scripts' replies are returned)."""
    pipe = client.pipeline(transaction=False)
    for request, ask in zip(requests, asking, strict=True):
        if ask:
            pipe.execute_command("ASKING")
        pipe.execute_command(*request)
    try:
        replies = list(pipe.execute(raise_on_error=False))
    except AttributeError as exc:
        # redis-py 6: another thread's slot refresh closed this node's connections, the one
        # in use too (its socket None mid-send): no answer, as a dropped connection.
        raise redis.exceptions.ConnectionError(f"connection closed while in use: {exc}") from exc
    if not any(asking):
        return replies
    out, at = [], 0
    for ask in asking:
        at += ask  # skip ASKING's OK
        out.append(replies[at])
        at += 1
    return out


def _renewed_each(replies: list[Any]) -> list[bool | None]:
    """One renew.lua reply (a list of one) per lock, or the error that call raised."""
    return renewed([r[0] if isinstance(r, list) else r for r in replies])
