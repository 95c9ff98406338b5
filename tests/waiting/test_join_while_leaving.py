"""A waiter that joins a hub while the channel's last waiter in this process leaves.

The leave takes the channel's group out under the hub's mutex and sends its UNSUBSCRIBE
after; a waiter joining in between saw nobody there and subscribed, and the late UNSUBSCRIBE
then took the subscription off the server (and the new waiter's confirmation): the new
waiter heard no release and slept to its deadline or the holder's TTL. The leave is held at
two points (a tracer in its thread: no thread switch left to chance): before the hub's
unsubscribe, and while redis-py sends it. The joiner must hear the next message at once.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
from redis import Redis
from redis.client import PubSub

from django_redlock import locks
from django_redlock.waiters import ReleaseHub, Waiter
from django_redlock.waiting import PubSubHub, ShardedPubSubHub

PAUSES = ("before-unsubscribe", "sending-unsubscribe")


def _pause_at(where: str) -> set[Any]:
    if where == "before-unsubscribe":
        return {PubSubHub._unsubscribe.__code__, ShardedPubSubHub._unsubscribe.__code__}
    return {PubSub.unsubscribe.__code__, PubSub.sunsubscribe.__code__}


def _race(
    hub: ReleaseHub,
    target: str,
    joiner: str,
    where: str,
    watch: Callable[[str], Any],
    publish: Callable[[str], None],
    subscribers: Callable[[], int],
) -> None:
    """Waiter "a" leaves ``target``'s subscription (held at ``where``) while waiter "b" joins
    it (as ``joiner``: a channel, or its id); then "b" must still be subscribed, and woken by
    ``publish("b")``."""
    codes = _pause_at(where)
    paused, resume, ready, done = (threading.Event() for _ in range(4))
    sent = threading.Event()  # b's own SUBSCRIBE went out (a hub that lets b send it)
    woken: list[bool] = []
    waiters: list[Waiter] = []

    def hold(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code in codes:
            args = (*frame.f_locals.get("args", ()), frame.f_locals.get("channel"))
            if target in args or target.encode() in args:
                paused.set()
                resume.wait(10)
        return None

    def leave() -> None:
        with watch("a"):
            sys.settrace(hold)
        sys.settrace(None)

    subscribes = {PubSub.subscribe.__code__, PubSub.ssubscribe.__code__}

    def tell(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code in subscribes:
            return lambda f, e, a: sent.set() if e == "return" else None
        return None

    def join() -> None:
        sys.settrace(tell)
        with watch("b") as waiter:
            sys.settrace(None)
            waiters.append(waiter)
            ready.set()
            done.wait(10)
            woken.append(waiter.wait(3))

    leaving = threading.Thread(target=leave)
    leaving.start()
    assert paused.wait(10), "the leave never reached its unsubscribe"
    joining = threading.Thread(target=join)
    joining.start()
    deadline = time.monotonic() + 10
    while not hub._waiters.get(joiner):  # b registered
        assert time.monotonic() < deadline
        time.sleep(0.001)
    sent.wait(0.5)  # b's SUBSCRIBE on the wire first, if b sends one
    resume.set()
    leaving.join(10)
    assert ready.wait(10)
    assert not waiters[0].unconfirmed, "b's subscription was never confirmed"
    assert subscribers() == 1, "b's channel is not subscribed on the server"
    done.set()
    time.sleep(0.05)  # b sleeps
    began = time.monotonic()
    publish("b")
    joining.join(10)
    assert woken == [True], "b never heard the message"
    assert time.monotonic() - began < 1.0


@pytest.mark.parametrize("where", PAUSES)
def test_a_waiter_joining_while_the_last_one_leaves_hears_the_release(
    redis_server: Any, name: str, where: str
) -> None:
    hub = locks["default"].hub
    channel = f"{name}:released"
    client = redis_server.client()
    _race(
        hub,
        channel,
        channel,
        where,
        lambda tag: hub.watch(channel),
        lambda tag: client.publish(channel, "released"),
        lambda: int(dict(client.pubsub_numsub(channel))[channel.encode()]),
    )


@pytest.mark.usefixtures("_cluster_alias")
@pytest.mark.parametrize("by_id", [False, True], ids=["release-channel", "inbox"])
@pytest.mark.parametrize("where", PAUSES)
def test_a_cluster_waiter_joining_while_the_last_one_leaves_hears_the_release(
    name: str, where: str, by_id: bool
) -> None:
    """The same on a Redis 7 Cluster's sharded pub/sub: the lock's release channel, and the
    per-lock inbox its waiters by id share (counted per lock)."""
    backend = locks["cluster"]
    hub = backend.hub
    if not isinstance(hub, ShardedPubSubHub):
        pytest.skip("classic pub/sub on Redis 6: test_a_waiter_joining_... covers it")
    channel = backend.channel(name)
    target = hub._inbox_of(name) if by_id else channel
    node = backend.client.get_node_from_key(target)  # type: ignore[attr-defined]
    client = Redis(host=node.host, port=node.port)

    def watch(tag: str) -> Any:
        return hub.watch(f"{name}:{tag}", by_id=True, lock=name) if by_id else hub.watch(channel)

    def publish(tag: str) -> None:
        client.execute_command("SPUBLISH", target, f"{name}:{tag}" if by_id else "released")

    def subscribers() -> int:
        reply = client.execute_command("PUBSUB", "SHARDNUMSUB", target)
        return int(reply[1])

    joiner = f"{name}:b" if by_id else channel
    _race(hub, target, joiner, where, watch, publish, subscribers)
    client.close()


@pytest.mark.usefixtures("_cluster_alias")
def test_a_cluster_waiter_joining_right_after_the_last_one_left_is_no_slot_move(
    cluster_nodes: list[Any], name: str
) -> None:
    """The reply to a leave's SUNSUBSCRIBE, read once a waiter had subscribed the channel
    again, was taken for the server dropping it (its slot moved): every such join read the
    cluster's slot map again and woke every waiter of the process to try."""
    from .test_sharded import versions_known

    hub = versions_known(locks["cluster"]).hub
    if not isinstance(hub, ShardedPubSubHub):
        pytest.skip("sharded pub/sub: Redis 7+")
    channel = locks["cluster"].channel(name)

    def slot_reads() -> int:
        return sum(
            int(node.client().info("commandstats").get("cmdstat_cluster|slots", {}).get("calls", 0))
            for node in cluster_nodes
        )

    before = slot_reads()
    for _ in range(20):
        with hub.watch(channel):
            pass
        with hub.watch(channel) as waiter:
            assert not waiter.unconfirmed
    time.sleep(0.3)  # the last replies read
    assert slot_reads() - before == 0
