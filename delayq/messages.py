"""The values delayq hands back: offer outcomes, messages, deliveries, statistics."""

from __future__ import annotations

import datetime as dt
import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from delayq.errors import DeliveryCancelledError
from delayq.history import AttemptRecord
from delayq.humanize import human
from delayq.tags import decode_tags

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from delayq.transactions import Using


class OfferOutcome(enum.Enum):
    """What an offer did: created a message, replaced one, or left an existing one alone."""

    CREATED = "created"
    UPDATED = "updated"
    IGNORED = "ignored"


class CancelOutcome(enum.Enum):
    """What ``DelayedQueue.cancel_job`` did: true when it cancelled a message (``if queue.cancel_job(key):``).

    ``QUEUED``: a message no handler was running (not locked, or its lock expired) was deleted.
    ``RUNNING``: a message whose handler runs (its lock unexpired) was deleted and recorded as cancelled; its
    worker is told (PostgreSQL: at once, by NOTIFY; elsewhere: at its next heartbeat), and the handler's later
    ack, retry or dead letter change nothing.
    ``NOT_FOUND``: there was no message under the key (never offered, or finished already).
    """

    QUEUED = "queued"
    RUNNING = "running"
    NOT_FOUND = "not_found"

    def __bool__(self) -> bool:
        return self is not CancelOutcome.NOT_FOUND


@dataclass(frozen=True, slots=True)
class Message:
    """A message as stored, read with ``DelayedQueue.get``."""

    key: str
    payload: Any
    scheduled_at: dt.datetime
    """When it is next due; while a consumer holds it, when that lock expires."""
    scheduled_at_initially: dt.datetime
    """The due time the producer asked for."""
    created_at: dt.datetime
    """When it was offered, or last replaced by ``offer(update=True)``."""
    attempts: int
    """Deliveries so far."""
    last_error: str | None
    locked: bool
    """Whether a consumer's lock is set on it (the lock may have expired)."""
    attempt_history: tuple[AttemptRecord, ...] = ()
    """Its failed attempts, oldest first (bounded: see ``delayq.history``)."""
    state: str = "ready"
    """``ready`` (due), ``scheduled`` (not yet due), ``running`` (held under an unexpired lock), or once
    finished and kept: ``completed``, ``cancelled``, ``dead`` (docs/lifecycle.md)."""
    result: Any = None
    """What its handler returned (``completed``, with ``keep_results``); None otherwise."""
    duration: dt.timedelta | None = None
    """How long its handler ran (``completed`` by a worker, or acked with ``duration=``); None otherwise."""
    finished_at: dt.datetime | None = None
    """When it completed, was cancelled or dead-lettered (database time); None while live."""

    @property
    def finished(self) -> bool:
        """Whether it completed, was cancelled or dead-lettered (kept: no longer live)."""
        return self.finished_at is not None

    tags: tuple[str, ...] = ()
    """The tags its offer gave it, sorted (``delayq.tags``)."""
    priority: int | None = None
    """Its priority (``offer(priority=)``, 0 unless set; higher is claimed first); once kept (``completed``,
    ``cancelled``, ``dead``), as it was when it finished: None in a row kept before delayq_0013 (not recorded)."""
    group: str | None = None
    """Its group (``offer(group=)``), None when it has none (or in a row kept before delayq_0013)."""
    worker: str | None = None
    """Once kept: the registry id of the worker whose ack or dead letter finished it (``delayq workers``,
    ``browse.WorkerInfo.id``); None for an outcome recorded outside a worker, a cancel, or while live."""


@dataclass(frozen=True, slots=True)
class DeadMessage:
    """A message that exhausted its attempts or was dead-lettered by its consumer."""

    id: int
    key: str
    payload: Any
    scheduled_at_initially: dt.datetime
    created_at: dt.datetime
    attempts: int
    last_error: str | None
    failed_at: dt.datetime
    """When it was moved to the dead letters."""
    attempt_history: tuple[AttemptRecord, ...] = ()
    """Its failed attempts, oldest first, the one that dead-lettered it last (bounded)."""
    tags: tuple[str, ...] = ()
    """The tags its offer gave it, sorted (``delayq.tags``)."""
    priority: int | None = None
    """Its priority when it was dead-lettered (None: not recorded, before delayq_0013)."""
    group: str | None = None
    """Its group when it was dead-lettered (None: it had none, or not recorded)."""
    worker: str | None = None
    """The registry id of the worker that dead-lettered it; None outside a worker."""


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Counts of one queue's messages by state, read in one statement."""

    ready: int
    """Due and not held by a consumer."""
    scheduled: int
    """Not yet due."""
    in_flight: int
    """Held by a consumer whose lock has not expired."""
    expired_locks: int
    """Held by a consumer whose lock expired: due for redelivery."""
    dead: int
    """In the dead-letter table."""
    oldest_due_age: dt.timedelta | None
    """How long the oldest due message (ready or with an expired lock) has waited; None when none."""
    completed: int = 0
    """Kept as completed (``retention``, ``unique_for``) and not yet pruned."""
    cancelled: int = 0
    """Kept as cancelled and not yet pruned."""


@dataclass(frozen=True, slots=True)
class FlowState:
    """A queue's flow settings as stored (``DelayedQueue.flow``)."""

    paused: bool = False
    """Claims take nothing (offers are still stored)."""
    priorities: bool = False
    """Some offer set a priority: claims take the highest priority first, one level at a time."""
    concurrency: int | None = None
    """At most this many of its messages held under an unexpired lock at once, across all claimers; None: no limit."""
    rate: int | None = None
    """At most this many claims per ``rate_period`` across all claimers (a token bucket); None: no limit."""
    rate_period: dt.timedelta | None = None
    """The period of ``rate``."""
    grouped: bool = False
    """Some offer named a group: at most ``group_concurrency`` of one group's messages held at once."""
    group_concurrency: int = 1
    """How many messages of one group may be held at once (with 1, a group's messages run in due order)."""

    @property
    def limited(self) -> bool:
        """Whether claims must lock the flow row: a concurrency or rate limit is set, or groups were offered."""
        return self.concurrency is not None or self.rate is not None or self.grouped

    def describe_limits(self) -> str:
        """Its limits in a few words, as ``delayq stats`` and the dashboard show them (``concurrency 5, rate
        10/1.0s, group concurrency 1``); empty when none is set. Group concurrency shows once groups were offered
        or it is not the default 1."""
        parts = []
        if self.concurrency is not None:
            parts.append(f"concurrency {self.concurrency}")
        if self.rate is not None and self.rate_period is not None:
            parts.append(f"rate {self.rate}/{human(self.rate_period)}")
        if self.grouped or self.group_concurrency != 1:
            parts.append(f"group concurrency {self.group_concurrency}")
        return ", ".join(parts)


_CANCEL_FLAGS = threading.Lock()
"""Taken to make a delivery's ``cancelled`` event (made on first use: most deliveries never need one)."""


class _Owner(Protocol):
    """What a ``Delivery`` asks of the queue that made it (``delayq.queue.DelayedQueue``, which builds on
    this module)."""

    @property
    def name(self) -> str: ...
    @property
    def engine(self) -> Engine: ...
    def headers(self, key: str, *, using: Using = None) -> dict[str, str]: ...
    def attempt_history(self, key: str, *, using: Using = None) -> tuple[AttemptRecord, ...]: ...
    def ack_many(self, deliveries: Sequence[Delivery], *, skip_locked: bool = False, using: Using = None) -> int: ...
    def _retry(
        self, d: Delivery, delay: dt.timedelta, error: str | None, using: Using, exception: BaseException | None = None
    ) -> bool: ...
    def _extend(self, d: Delivery, by: dt.timedelta, using: Using) -> bool: ...
    def _dead_letter(
        self, d: Delivery, error: str | None, using: Using, exception: BaseException | None = None
    ) -> bool: ...


@dataclass(slots=True, eq=False)
class Delivery:
    """A message a consumer holds under a lock until it acks, retries, or the lock expires.

    Every method is a compare-and-swap on the lock token: once the lock has expired and
    another consumer took the message, or a producer replaced it, they change nothing and
    return False.
    """

    id: int
    key: str
    payload: Any
    attempts: int
    """Deliveries so far, this one included."""
    scheduled_at: dt.datetime
    """When the message was due for this delivery."""
    scheduled_at_initially: dt.datetime
    created_at: dt.datetime
    locked_until: dt.datetime
    """When the lock expires unless extended."""
    lock_token: str
    _queue: _Owner = field(repr=False)
    _history: tuple[AttemptRecord, ...] | None = field(default=None, repr=False)
    _result: Any = field(default=None, repr=False)
    """What the handler returned, kept by the ack of a queue with a history (``ack(result=)``)."""
    _duration_ms: int | None = field(default=None, repr=False)
    """How long the handler ran, in milliseconds (``ack(duration=)``)."""
    _tags: str | None = field(default=None, repr=False)
    _cancelled: threading.Event | None = field(default=None, repr=False)
    priority: int = 0
    """The message's priority (``offer(priority=)``; higher is claimed first); read with the claim."""
    group: str | None = None
    """The message's group (``offer(group=)``), None when it has none; read with the claim."""
    _worker_id: str | None = field(default=None, repr=False)
    """The registry id of the worker whose claim this is (None outside a worker): the kept row of its outcome
    records it."""

    @property
    def tags(self) -> tuple[str, ...]:
        """The tags its offer gave the message, sorted (``delayq.tags``); read with the claim."""
        return decode_tags(self._tags)

    @property
    def cancelled(self) -> threading.Event:
        """Set once this delivery's work no longer counts: the message was cancelled (``DelayedQueue.cancel``),
        replaced, or its lock was lost (expired and taken); a worker sets it when it learns so.

        A thread handler checks it between steps (``is_set()``, ``wait(timeout)``) or calls
        ``raise_if_cancelled()``; whatever it does after, its ack, retry or dead letter change nothing (each is
        fenced by the lock token). An asyncio handler's task is cancelled instead.
        """
        found = self._cancelled
        if found is None:
            with _CANCEL_FLAGS:
                found = self._cancelled
                if found is None:
                    found = self._cancelled = threading.Event()
        return found

    def raise_if_cancelled(self) -> None:
        """Raise ``DeliveryCancelledError`` when ``cancelled`` is set: the handler stops, and nothing is recorded."""
        if self._cancelled is not None and self._cancelled.is_set():
            raise DeliveryCancelledError(f"{self.label}: cancelled, or its lock was lost; its work no longer counts")

    def _cancel(self) -> None:
        """Set ``cancelled`` (the worker, when it learns the lock is gone)."""
        self.cancelled.set()

    @property
    def redelivered(self) -> bool:
        """True when an earlier delivery of this message was not acked."""
        return self.attempts > 1

    @property
    def queue(self) -> str:
        return self._queue.name

    @property
    def headers(self) -> dict[str, str]:
        """What the offer stored with the message (the trace context, with tracing on); read from the database."""
        return self._queue.headers(self.key)

    @property
    def attempt_history(self) -> tuple[AttemptRecord, ...]:
        """The message's earlier failed attempts, oldest first (read from the database on first use)."""
        if self._history is None:
            self._history = self._queue.attempt_history(self.key)
        return self._history

    @property
    def label(self) -> str:
        """``queue 'key'`` for logs; ``queue #id`` when the engine hides parameters (``hide_parameters``)."""
        if self._queue.engine.hide_parameters:
            return f"{self.queue} #{self.id}"
        return f"{self.queue} {self.key!r}"

    def ack(self, *, result: Any = None, duration: dt.timedelta | None = None, using: Using = None) -> bool:
        """Delete the message (or keep it as completed: ``DelayedQueue(retention=)``, ``unique_for``);
        True when this delivery still held the lock.

        ``result`` (what the handler returned) and ``duration`` (how long it ran) are kept with a
        completed message; a worker passes both.
        """
        self._finished_with(result, duration)
        return self._queue.ack_many([self], using=using) == 1

    def _finished_with(self, result: Any, duration: dt.timedelta | None) -> None:
        """Note the handler's result and run time for the ack (``ack_many`` of several deliveries)."""
        self._result = result
        if duration is not None:
            self._duration_ms = max(0, round(duration.total_seconds() * 1000))

    def retry(
        self,
        delay: dt.timedelta = dt.timedelta(0),
        error: str | None = None,
        *,
        using: Using = None,
        exception: BaseException | None = None,
    ) -> bool:
        """Release the message for another attempt after ``delay``, recording ``error``.

        The attempt history gets ``exception``'s type and traceback (by default the exception
        being handled, when called in an ``except`` block).
        """
        return self._queue._retry(self, delay, error, using, exception)

    def extend(self, by: dt.timedelta, *, using: Using = None) -> bool:
        """Push the lock's expiry to ``by`` from now (a heartbeat for long work)."""
        return self._queue._extend(self, by, using)

    def dead_letter(
        self, error: str | None = None, *, using: Using = None, exception: BaseException | None = None
    ) -> bool:
        """Move the message to the dead letters, recording ``error`` (and ``exception``, as ``retry``)."""
        return self._queue._dead_letter(self, error, using, exception)
