"""TopicHandler: the base class of a topic's consumers, run by the ``Worker`` beside queue handlers."""

from __future__ import annotations

import datetime as dt
from typing import ClassVar, Literal

from sqlalchemy.engine import Connection

from delayq.handler import Handler
from delayq.topics.delivery import TopicDelivery


class TopicHandler(Handler):
    """Consumes one topic as a subscriber of a consumer group. Subclass it, set ``topic`` and ``group``,
    implement ``handle``, and give it to a ``Worker`` (with queue handlers or alone).

    The worker owns one ``Subscription`` per topic handler: it rebalances (heartbeat, lease renewal,
    its fair share of the partitions) every third of ``lease_duration``, polls only as many messages
    as it has free slots, runs ``handle`` on its pool, extends the visibility of a handler still
    running, advances the watermarks every few seconds, and on shutdown leaves the group (its
    partitions move to the others at once).

    Class attributes (with their defaults):

    - ``topic``: the topic's name (required; create it first with ``Topic.create``).
    - ``group``: the consumer group (required). Workers running the same handler share the partitions.
    - ``serializer``: how payloads are decoded; ``JsonSerializer()``. A message that does not decode
      goes to the dead-letter topic.
    - ``strict``: one message of a partition in flight at a time, in offset order (the next only once
      this one is acked or dead-lettered). False: a partition's messages are delivered in order but may
      run together, and a failed one is retried later while the next ones flow.
    - ``retry``: the ``RetryPolicy``: the delay before a failed message is delivered again, and
      ``max_attempts`` deliveries before it goes to the dead-letter topic ``{topic}_dlq``.
      10 attempts, 10 s doubling to 1 h.
    - ``visibility_timeout``: how long a delivered message stays invisible to the group; the worker
      extends it while ``handle`` runs. 5 minutes.
    - ``lease_duration``: how long a dead worker's partitions wait before others take them. 30 s.
    - ``start``: where a new group starts: ``"earliest"`` (the oldest retained message) or ``"latest"``.
    - ``collect_garbage``: the worker deletes the topic's messages every group is done with, in bounded
      batches, one worker per partition at a time (see docs/operations.md). True.
    - ``keep_for``: with ``collect_garbage``, messages younger than this stay in the log even once every
      group is done with them (for replays and inspection). 0.
    - ``transactional``: exactly-once database effects: ``handle(delivery, conn)`` runs inside the
      transaction that acks the message (``Subscription.handle_exactly_once``); when the lease or
      the delivery was lost meanwhile, its writes roll back. False.

    ``handle`` returning normally acks the message. Raising ``Retry(after=...)`` nacks it (another
    attempt after ``after``, or the policy's delay); ``DeadLetter(reason)`` moves it to the
    dead-letter topic at once; any other exception is a failed attempt, nacked with the policy's
    delay and dead-lettered when attempts run out. A lost lease (another subscriber took the
    partition) is logged and the delivery dropped: the partition's new holder gets the message.
    """

    topic: ClassVar[str]
    group: ClassVar[str]
    strict: ClassVar[bool] = False
    lease_duration: ClassVar[dt.timedelta] = dt.timedelta(seconds=30)
    start: ClassVar[Literal["earliest", "latest"]] = "earliest"
    collect_garbage: ClassVar[bool] = True
    keep_for: ClassVar[dt.timedelta] = dt.timedelta(0)

    def handle(  # type: ignore[override]
        self, delivery: TopicDelivery, conn: Connection | None = None
    ) -> None:
        """Process one delivery; ``conn`` is given to transactional handlers."""
        raise NotImplementedError(f"{type(self).__name__}.handle")

    def subscriber_name(self, worker: str) -> str:
        """This handler's subscriber name in its group, given its worker's name (``Worker.name``,
        ``host:pid:random``, unique per worker). Defaults to the worker's name. Override it to name
        subscribers yourself; two live subscribers of one group must never share a name."""
        return worker

    def __repr__(self) -> str:
        return f"{type(self).__name__}(topic={getattr(self, 'topic', None)!r}, group={getattr(self, 'group', None)!r})"
