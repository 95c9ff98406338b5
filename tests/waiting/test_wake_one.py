"""A release wakes one waiter, in its process's inbox: no herd, and nobody left asleep.

On a single Redis (and Sentinel, django-redis), a plain lock's waiters register as they try; a
release wakes only the earliest, through the one inbox channel its process subscribed to once.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from django_redlock import lock, locks
from django_redlock.testing import RedisServer

from ..conftest import Child


def _waiters(name: str) -> int:
    info = locks["redis"].inspect(name)
    return 0 if info is None else info.waiters


def _wait_for_waiters(name: str, count: int) -> None:
    deadline = time.monotonic() + 10
    while _waiters(name) != count:
        assert time.monotonic() < deadline, f"never {count} waiters: {_waiters(name)}"
        time.sleep(0.005)


def _calls(server: RedisServer, command: str) -> int:
    stats = server.client().info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0))


def test_a_release_wakes_one_waiting_process_the_earliest(
    redis_server: RedisServer, child: Callable[..., Child], name: str
) -> None:
    holder = lock(name, using="redis")
    holder.acquire()
    waiters = []
    for tag in range(4):
        tagged = ["--order", f"{name}:order", "--tag", str(tag), "--hold", "0.05"]
        waiter = child("queue", "--name", name, *tagged)
        waiter.expect("WAITING")
        _wait_for_waiters(name, tag + 1)  # registered, in this order
        waiters.append(waiter)
    before = _calls(redis_server, "evalsha")
    holder.release()
    for waiter in waiters:
        waiter.expect("DONE")
    scripts = _calls(redis_server, "evalsha") - before
    # Each release wakes one process, which takes the lock: 4 acquires + 4 releases + ours.
    # Waking every process at each release would cost 4 + 3 + 2 + 1 tries instead of 4.
    assert scripts <= 9 + 1, scripts
    order = [int(tag) for tag in redis_server.client().lrange(f"{name}:order", 0, -1)]
    assert order == [0, 1, 2, 3]  # no barging here: the earliest registered goes first
    assert not redis_server.client().exists(locks["redis"].waiting_key(name))


def test_a_killed_waiting_process_does_not_stall_the_next(
    redis_server: RedisServer, child: Callable[..., Child], name: str
) -> None:
    holder = lock(name, using="redis", ttl=30)  # asleep on its TTL, the next would wait 30 s
    holder.acquire()
    doomed = child("queue", "--name", name, "--order", f"{name}:order", "--tag", "0")
    doomed.expect("WAITING")
    _wait_for_waiters(name, 1)
    survivor = child("queue", "--name", name, "--order", f"{name}:order", "--tag", "1")
    survivor.expect("WAITING")
    _wait_for_waiters(name, 2)
    channels = len(redis_server.client().pubsub_channels())
    doomed.process.send_signal(signal.SIGKILL)
    doomed.process.wait(5)
    # Until the server has read the dead connection's end, a publish to its inbox counts it as
    # a receiver: a release then, in that instant, is a wake-up lost to the dead (the next
    # waiter sleeps to its deadline). The server drops it within ms on a quiet machine.
    deadline = time.monotonic() + 10
    while len(redis_server.client().pubsub_channels()) >= channels:
        assert time.monotonic() < deadline, "the server never dropped the killed subscriber"
        time.sleep(0.005)
    released = time.monotonic()
    holder.release()  # its wake-up finds no one in the dead process's inbox: the next is woken
    survivor.expect("DONE")
    assert time.monotonic() - released < 2.0
    assert redis_server.client().lrange(f"{name}:order", 0, -1) == [b"1"]
    assert _waiters(name) == 0


def test_a_fair_queue_s_dead_head_is_skipped_at_the_release(name: str) -> None:
    """A fair queue's head whose process died (nobody subscribed to its inbox: PUBLISH counts
    0) is dropped at the release and the next head woken at once, not at the dead head's
    deadline. (The dead head is written as a killed process leaves it: in the queue, its
    deadline ahead.)"""
    import threading

    backend = locks["redis"]
    client = backend.client
    holder = lock(name, using="redis", ttl=30, fair=True)
    assert holder.acquire(blocking=False)
    dead = "deadprocess.1"  # no process with this id subscribes: its inbox has nobody
    client.rpush(backend.queue_key(name), dead)
    now_ms = int(time.time() * 1000)
    client.zadd(backend.deadlines_key(name), {dead: now_ms + 20_000})
    got: list[float] = []
    waiter = lock(name, using="redis", ttl=30, fair=True)
    thread = threading.Thread(
        target=lambda: waiter.acquire(timeout=4) and got.append(time.monotonic())
    )
    thread.start()
    deadline = time.monotonic() + 5
    while client.llen(backend.queue_key(name)) < 2:
        assert time.monotonic() < deadline, "the waiter never queued"
        time.sleep(0.005)
    time.sleep(0.05)  # asleep
    released = time.monotonic()
    holder.release()
    thread.join(10)
    assert got and got[0] - released < 1.0, got and got[0] - released
    waiter.release()
    assert dead.encode() not in client.lrange(backend.queue_key(name), 0, -1)


def test_a_plain_waiter_that_gives_up_leaves_no_registration(
    redis_server: RedisServer, name: str
) -> None:
    holder = lock(name, using="redis")
    holder.acquire()
    assert not lock(name, using="redis").acquire(timeout=0.3)
    assert not redis_server.client().exists(locks["redis"].waiting_key(name))
    holder.release()


def test_a_process_subscribes_once_however_often_it_waits(
    redis_server: RedisServer, child: Callable[..., Child], name: str
) -> None:
    subscribed = _calls(redis_server, "subscribe")
    unsubscribed = _calls(redis_server, "unsubscribe")
    start = f"{name}:start"
    rounds = ["--rounds", "30", "--hold", "0.002"]
    contenders = [
        child("contend", "--name", name, "--start", start, *rounds, *fair)
        for fair in ([], [], ["--fair"], ["--fair"])
    ]
    redis_server.client().set(start, 1)
    for contender in contenders:
        contender.expect("WORST")
    # Each process waited many times (30 rounds among 4), on its one inbox channel.
    assert _calls(redis_server, "subscribe") - subscribed <= len(contenders)
    assert _calls(redis_server, "unsubscribe") - unsubscribed == 0


def test_a_lock_nobody_waits_for_costs_no_wake_up_work(redis_server: RedisServer) -> None:
    """Taking and freeing a lock nobody waited for: no PUBLISH (nobody listens on the release
    channel here: waiters are woken in their inbox), no look at the waiters' set, no TYPE."""
    client = redis_server.client()
    for kind in ({}, {"reentrant": True}):
        with lock("quiet", using="redis", **kind):  # fence counter and scripts in place
            pass
        client.config_resetstat()
        for _ in range(3):
            with lock("quiet", using="redis", **kind):
                pass
        for command in ("publish", "zrange", "type", "zrem"):
            assert _calls(redis_server, command) == 0, (kind, command)
        assert _calls(redis_server, "evalsha") == 6
