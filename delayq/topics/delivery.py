"""What a subscriber gets from a poll, and what it can do with it."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Protocol

from delayq.errors import DelayqError
from delayq.transactions import Using


class LeaseLostError(DelayqError):
    """The subscriber no longer holds the partition's lease (it was stolen or released), or the
    message was delivered again since: the operation changed nothing."""


@dataclass(frozen=True)
class DeadLetterInfo:
    """Where a message of a dead-letter topic came from and why it failed."""

    original_topic: str
    original_offset: int
    failed_group: str
    failed_at: dt.datetime
    failure_count: int
    last_error: str | None


class _Owner(Protocol):
    """What a ``TopicDelivery`` asks of the subscription that polled it (``delayq.topics.subscription.Subscription``,
    which builds on this module)."""

    def ack(self, delivery: TopicDelivery, *, using: Using = None) -> bool: ...
    def nack(
        self, delivery: TopicDelivery, delay: dt.timedelta = ..., error: str | None = None, *, using: Using = None
    ) -> bool: ...
    def extend(self, delivery: TopicDelivery, by: dt.timedelta, *, using: Using = None) -> dt.datetime | None: ...
    def fail(self, delivery: TopicDelivery, error: str, *, using: Using = None) -> bool: ...


@dataclass(frozen=True, eq=False)
class TopicDelivery:
    """One delivery of a message to a subscriber of a consumer group.

    ``attempts`` counts this group's deliveries of the message (1 on the first); with the
    lease's ``epoch`` it fences every later operation: once the partition's lease moved on, or
    the message was delivered again, ``ack``/``nack``/``extend`` change nothing.
    """

    topic: str
    partition: int
    offset: int
    partition_key: str
    message_id: str
    payload: Any
    published_at: dt.datetime
    attempts: int
    invisible_until: dt.datetime
    epoch: int
    dead_letter: DeadLetterInfo | None = None
    _subscription: _Owner | None = field(default=None, repr=False)

    def ack(self, *, using: Using = None) -> bool:
        """Mark it done for the group; False when the lease or the delivery was lost (nothing changed)."""
        return self._sub().ack(self, using=using)

    def nack(self, delay: dt.timedelta = dt.timedelta(0), error: str | None = None, *, using: Using = None) -> bool:
        """Deliver it again after ``delay`` (later messages of the partition keep flowing), or move it to the
        dead-letter topic when this was its last attempt. False when the lease or the delivery was lost."""
        return self._sub().nack(self, delay, error, using=using)

    def extend(self, by: dt.timedelta, *, using: Using = None) -> dt.datetime | None:
        """Keep it invisible ``by`` from now (never shortening); the new expiry, or None when lost."""
        return self._sub().extend(self, by, using=using)

    def fail(self, error: str, *, using: Using = None) -> bool:
        """Move it to the dead-letter topic now; False when the lease or the delivery was lost."""
        return self._sub().fail(self, error, using=using)

    def _sub(self) -> _Owner:
        if self._subscription is None:
            raise RuntimeError("this delivery was not made by a Subscription")
        return self._subscription
