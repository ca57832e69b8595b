"""Handler: the base class of consumers, and the two exceptions a handler raises to steer its message."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy.engine import Connection

from delayq._steering import DeadLetter as DeadLetter
from delayq._steering import Retry as Retry
from delayq.messages import Delivery
from delayq.queue._lifecycle import DEFAULT_RESULT_LIMIT
from delayq.retry import RetryPolicy
from delayq.serializers import JsonSerializer, Serializer

if TYPE_CHECKING:
    from delayq.cron import Schedule


class Handler:
    """Consumes one queue. Subclass it, set ``queue``, and implement ``handle``.

    Class attributes (with their defaults):

    - ``queue``: the queue's name (required).
    - ``serializer``: how payloads are decoded; ``JsonSerializer()``.
    - ``retry``: the ``RetryPolicy`` for failures; 10 attempts, 10 s doubling to 1 h.
    - ``visibility_timeout``: how long a delivery stays locked; the worker extends the lock
      of a handler still running. 5 minutes.
    - ``transactional``: when True, ``handle(delivery, conn)`` runs inside the transaction
      that also deletes the message, so its database writes happen exactly once. False.
    - ``timeout``: how long a handler should take. A thread handler cannot be stopped, so one that
      runs past it is reported, not killed: a WARNING on ``delayq.worker``, the ``overdue`` event
      (the ``delayq_overdue`` metric) and ``WorkerHealth.stuck``; its message stays held (its lock
      extended) while its thread lives. Bound the handler's own waits (driver, HTTP timeouts).
      None: never reported.
    - ``schedules``: recurring messages into this queue (``Schedule.cron(...)``,
      ``Schedule.daily(...)``, ``Schedule.periodic(...)``), kept installed by every worker that runs
      this handler; see docs/cron.md. None.
    - ``retention``, ``keep_results``, ``result_limit``, ``dead_letter_retention``: how the worker's queue
      keeps finished messages (see ``DelayedQueue``; docs/lifecycle.md): 0 (acked messages are deleted),
      True, 64 KiB, None (dead letters kept until requeued or purged).

    ``handle`` returning normally acks the message; what it returns is the message's result (kept with
    ``retention`` and ``keep_results``), and how long it ran its duration. Raising ``Retry(after=...)`` schedules
    another attempt (it counts toward ``retry.max_attempts``); ``DeadLetter(reason)`` gives up at
    once; any other exception is a failed attempt, retried per ``retry`` and dead-lettered when
    attempts run out. ``retry.max_attempts`` also caps deliveries that end without any outcome
    (the worker died mid-handler): the claim that would exceed it dead-letters the message.
    """

    queue: ClassVar[str]
    serializer: ClassVar[Serializer] = JsonSerializer()
    retry: ClassVar[RetryPolicy] = RetryPolicy()
    visibility_timeout: ClassVar[dt.timedelta] = dt.timedelta(minutes=5)
    transactional: ClassVar[bool] = False
    timeout: ClassVar[dt.timedelta | None] = None
    schedules: ClassVar[Sequence[Schedule]] = ()
    retention: ClassVar[dt.timedelta] = dt.timedelta(0)
    keep_results: ClassVar[bool] = True
    result_limit: ClassVar[int] = DEFAULT_RESULT_LIMIT
    dead_letter_retention: ClassVar[dt.timedelta | None] = None

    def handle(self, delivery: Delivery, conn: Connection | None = None) -> Any:
        """Process one delivery; ``conn`` is given to transactional handlers. What it returns is the result."""
        raise NotImplementedError(f"{type(self).__name__}.handle")

    def _lifecycle_options(self) -> dict[str, Any]:
        """The ``DelayedQueue`` arguments of its lifecycle attributes (the worker's queue takes them)."""
        return {
            "retention": self.retention,
            "keep_results": self.keep_results,
            "result_limit": self.result_limit,
            "dead_letter_retention": self.dead_letter_retention,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(queue={getattr(self, 'queue', None)!r})"
