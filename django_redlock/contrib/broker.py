"""Asking a Celery broker whether a queued message can still run.

A queue marker names a task whose message was published; the marker must not outlive the
message. A worker that discards a message (revoked, expired) says so, but a purge
(``celery purge``, ``app.control.purge()``), a deleted queue or a broker that lost its data
tells nobody. So a ``.delay()`` that meets a marker may ask the broker.

What each broker can answer:

* **Redis** (kombu's ``redis`` transport, ``ack_emulation`` on, its default): a message is in
  its queue's lists (one per priority step) or, once a worker took it, in the ``unacked``
  hash until acknowledged (prefetched, waiting for its ETA, running with ``acks_late``). One
  read-only Lua call on the broker looks in both: :func:`message_queued` answers True or
  False. Unknown (None) when the queues hold more than ``most`` messages (not read: a purged
  queue is short), or the broker cannot answer.
* **Any other broker** (RabbitMQ, SQS, ...): unknown (None). AMQP has no way to look at a
  queued message without taking it (``basic.get`` would redeliver it elsewhere, out of
  order), and a queue's message count leaves out the messages workers hold.

A message a worker took but has not yet noted (between kombu's ``BRPOP`` and its ``unacked``
write) or acknowledged early and not yet started is in neither place for a moment: the
caller looks twice, a pause apart (see ``SingleInstanceTask.message_gone``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from functools import cache
from importlib import resources
from typing import Any

logger = logging.getLogger("django_redlock")


class PublishWatch:
    """A Celery producer, passed on, that notes when the broker took one task's message.

    "Sent" is learnt from the publish itself, not from ``apply_async`` returning: after the
    broker's publish, Celery still runs ``after_task_publish`` receivers and builds the
    result, and an exception there (a signal handler's, a receiver's) would otherwise pass a
    message that is queued for one never sent.

    ``entered`` is set before the producer is called: an exception out of the publish once
    entered (an interrupt inside kombu's publish or on any later line of this one) leaves it
    UNKNOWN whether the broker took the message, never "not sent": the caller asks the
    broker by id (:func:`message_queued`), and without a "no" keeps it as sent. Only an
    exception known to come before the hand-over (kombu's encoding) clears ``entered``."""

    def __init__(
        self, producer: Any, task_id: str, on_sent: Callable[[], object] | None = None
    ) -> None:
        self._producer = producer
        self._task_id = task_id
        self._on_sent = on_sent
        self.entered = False
        self.published = False

    def publish(self, body: Any, *args: Any, **kwargs: Any) -> Any:
        ours = _message_id(body, kwargs.get("headers")) == self._task_id
        self.entered = self.entered or ours  # from here on, taken or not is unknown
        try:
            sent = self._producer.publish(body, *args, **kwargs)
        except _BEFORE_HAND_OVER:
            if ours:
                self.entered = False  # encoding failed: nothing reached the broker
            raise
        if ours:
            self.published = True
            if self._on_sent is not None:
                self._on_sent()
        return sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)


def _before_hand_over() -> tuple[type[BaseException], ...]:
    try:
        from kombu.exceptions import ContentDisallowed, EncodeError
    except ImportError:  # pragma: no cover - kombu comes with Celery
        return ()
    return (EncodeError, ContentDisallowed)


#: Raised by kombu's publish before anything is sent (the body could not be encoded).
_BEFORE_HAND_OVER = _before_hand_over()


def _message_id(body: Any, headers: Any) -> Any:
    if isinstance(headers, dict) and "id" in headers:  # task protocol 2
        return headers["id"]
    return body.get("id") if isinstance(body, dict) else None  # protocol 1


@contextlib.contextmanager
def watched_publish(app: Any, task_id: str, options: dict[str, Any]) -> Iterator[PublishWatch]:
    """The producer ``options`` name (or ``connection``'s, or one from the app's pool, as
    ``send_task`` would take), watched for ``task_id``'s message; ``options`` then carry it
    as their ``producer``."""
    producer = options.pop("producer", None)
    connection = options.pop("connection", None)
    if connection:  # as send_task does: the connection's producer, over any given
        producer = app.amqp.Producer(connection, auto_declare=False)
    with app.producer_or_acquire(producer) as taken:
        watch = PublishWatch(taken, task_id)
        options["producer"] = watch
        yield watch


#: Read at most this many messages (the queue's lists and the unacked hash together).
MOST_MESSAGES = 1000


@cache
def _source() -> str:
    return resources.files(__package__).joinpath("message_queued.lua").read_text()


def queue_lists(channel: Any, queue: str) -> list[str]:
    """The Redis lists kombu keeps ``queue``'s messages in: one per priority step (the step
    0 list is the queue's own name), with the transport's ``global_keyprefix``."""
    prefix = getattr(channel, "global_keyprefix", "") or ""
    names = []
    for step in getattr(channel, "priority_steps", None) or [0]:
        name = f"{queue}{channel.sep}{step}" if step else queue
        if name not in names:
            names.append(name)
    return [prefix + name for name in names]


def message_queued(app: Any, queue: str, task_id: str, most: int | None = None) -> bool | None:
    """Whether ``task_id``'s message is in ``queue`` or held unacknowledged by a worker on
    ``app``'s broker: True, False, or None when that cannot be told (not a Redis broker,
    more than ``most`` messages to read (default :data:`MOST_MESSAGES`), an error). Never
    raises: the caller then obeys the marker."""
    most = MOST_MESSAGES if most is None else most
    try:
        import redis

        with app.connection_or_acquire() as connection:
            if connection.transport.driver_type != "redis":
                return None
            channel = connection.default_channel
            if not getattr(channel, "ack_emulation", True):
                return None  # no unacked hash: a taken message is nowhere to be seen
            client = redis.Redis(connection_pool=channel.pool)
            prefix = getattr(channel, "global_keyprefix", "") or ""
            keys = [*queue_lists(channel, queue), prefix + channel.unacked_key]
            found = client.eval(_source(), len(keys), *keys, json.dumps(task_id), int(most))
    except Exception as exc:  # an answer we cannot have: unknown, never "gone"
        logger.info("redlock: could not look for task %s in the broker: %s", task_id, exc)
        return None
    if found == -1:
        return None
    return bool(found)


__all__ = ["MOST_MESSAGES", "message_queued", "queue_lists"]
