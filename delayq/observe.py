"""Observers: what logging, metrics and tracing learn of each delivery and of the queue's events.

The worker wraps every handler call in ``handling(delivery)``; the queue reports its events
(``offered``, ``acked``, ``retried``, ``dead_lettered``, ``lock_lost``; the worker ``overdue``) through ``count``. Each
installed ``Observer`` hears of them. ``delivery_log`` is installed from the start: it logs on the
``delayq.delivery`` logger, every record with structured fields (``delayq_event``, ``delayq_queue``,
``delayq_key``, ``delayq_id``, ``delayq_attempt``, ``delayq_duration``; a failure's also ``delayq_error_type``
and ``delayq_error``) that JSON log formatters pick up. A failure is one record, with its traceback; a
handler that raised ``Retry`` or ``DeadLetter`` asked for that outcome: one INFO record, without a traceback.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, ExitStack
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Literal

from delayq._steering import DeadLetter, Retry
from delayq.errors import DeliveryCancelledError

if TYPE_CHECKING:
    from delayq.messages import Delivery
    from delayq.topics.delivery import TopicDelivery

__all__ = [
    "DeliveryLog",
    "Event",
    "Observer",
    "Outcome",
    "TopicEvent",
    "add",
    "count",
    "count_topic",
    "delivery_log",
    "handling",
    "offering",
    "outcome",
    "remove",
]

Outcome = Literal["success", "failure", "retry", "dead_letter", "cancelled"]
"""How a handler call ended: returned, raised, asked for a retry or a dead letter, or stopped (raised) after its
message was cancelled or its lock lost (``Delivery.cancelled``)."""


def outcome(error: BaseException | None, delivery: Delivery | None = None) -> Outcome:
    """The outcome of a handler call that returned (``error`` None) or raised ``error``; with the ``delivery``, a
    handler that raised once its work was cancelled (``Delivery.cancelled``) is ``cancelled``."""
    if error is None:
        return "success"
    if isinstance(error, DeliveryCancelledError) or (
        delivery is not None and delivery._cancelled is not None and delivery._cancelled.is_set()
    ):
        return "cancelled"
    if isinstance(error, Retry):
        return "retry"
    if isinstance(error, DeadLetter):
        return "dead_letter"
    return "failure"


Event = Literal["offered", "acked", "retried", "dead_lettered", "lock_lost", "overdue"]
"""A queue event that observers count."""


TopicEvent = Literal["published", "delivered", "acked", "nacked", "dead", "lease_lost", "rebalanced", "collected"]
"""A topic event that observers count: per topic and consumer group ("" for the topic's own: published,
collected). ``rebalanced`` counts the rebalances that changed what a subscriber holds."""


class Observer:
    """Hears of deliveries and queue events; every method does nothing unless overridden.

    Methods run on the worker's threads, inline: keep them fast, and never raise.
    """

    #: Whether ``started`` or ``finished`` may read the database through delayq's sync core (the
    #: delivery's ``headers`` or ``attempt_history``, say): the asyncio worker then calls both inside a
    #: greenlet. True unless an observer says otherwise; delayq's own log and metrics do not.
    reads_database: ClassVar[bool] = True

    def started(self, delivery: Delivery) -> object:
        """A handler is about to run ``delivery``; what it returns comes back to ``finished``."""
        return None

    def finished(self, delivery: Delivery, state: object, error: BaseException | None, duration: float) -> None:
        """The handler returned (``error`` None) or raised ``error``, after ``duration`` seconds."""

    def counted(self, event: Event, queue: str, n: int) -> None:
        """``n`` messages of ``queue`` had ``event``."""

    def publishing(self, queue: str, n: int, headers: dict[str, str]) -> AbstractContextManager[None] | None:
        """An offer of ``n`` messages to ``queue`` is about to run: add to ``headers`` what should travel
        with them, and return a context manager to run around the offer (or None)."""
        return None

    def topic_counted(self, event: TopicEvent, topic: str, group: str, n: int) -> None:
        """``n`` messages of ``topic`` had ``event`` in consumer group ``group``."""

    def topic_publishing(self, topic: str, n: int, headers: dict[str, str]) -> AbstractContextManager[None] | None:
        """A publish of ``n`` messages to ``topic`` is about to run (as ``publishing``)."""
        return None

    def topic_started(self, delivery: TopicDelivery, group: str, headers: dict[str, str]) -> object:
        """A topic handler is about to run ``delivery`` for ``group`` (``headers``: what its publish added,
        read only while an observer overrides ``topic_publishing``); the result comes back to ``topic_finished``."""
        return None

    def topic_running(self, state: object) -> AbstractContextManager[None] | None:
        """A context manager to run around the topic handler's call, in its thread or task (what
        ``topic_started`` returned is ``state``), or None."""
        return None

    def topic_finished(
        self, delivery: TopicDelivery, group: str, state: object, error: BaseException | None, duration: float
    ) -> None:
        """The topic handler returned (``error`` None) or raised ``error``; ``duration`` seconds from the poll
        to its outcome recorded."""


_observers: tuple[Observer, ...] = ()
_publishers: tuple[Observer, ...] = ()  # those that override ``publishing``: offers skip the rest
_topic_publishers: tuple[Observer, ...] = ()  # those that override ``topic_publishing``
_topic_handlers: tuple[Observer, ...] = ()  # those that override ``topic_started`` or ``topic_finished``


def add(observer: Observer) -> None:
    """Install ``observer`` (once; adding it again changes nothing)."""
    if observer not in _observers:
        _install((*_observers, observer))


def remove(observer: Observer) -> None:
    """Uninstall ``observer``."""
    _install(tuple(o for o in _observers if o is not observer))


def _install(observers: tuple[Observer, ...]) -> None:
    global _observers, _publishers, _topic_publishers, _topic_handlers
    _observers = observers
    _publishers = tuple(o for o in observers if type(o).publishing is not Observer.publishing)
    _topic_publishers = tuple(o for o in observers if type(o).topic_publishing is not Observer.topic_publishing)
    _topic_handlers = tuple(
        o
        for o in observers
        if type(o).topic_started is not Observer.topic_started or type(o).topic_finished is not Observer.topic_finished
    )


def count(event: Event, queue: str, n: int = 1) -> None:
    """Tell every observer that ``n`` messages of ``queue`` had ``event`` (nothing when ``n`` is 0)."""
    if n:
        for o in _observers:
            o.counted(event, queue, n)


def count_topic(event: TopicEvent, topic: str, group: str, n: int = 1) -> None:
    """Tell every observer that ``n`` messages of ``topic`` had ``event`` in ``group`` (nothing when 0)."""
    if n:
        for o in _observers:
            o.topic_counted(event, topic, group, n)


def traces_topics() -> bool:
    """Whether an observer carries context from a publish to its handlers (``topic_publishing``)."""
    return bool(_topic_publishers)


def topic_handlers() -> tuple[Observer, ...]:
    """The observers that hear of topic handler calls (``topic_started``, ``topic_finished``)."""
    return _topic_handlers


class publishing_topic:
    """Wrap one publish: observers may add headers (None when none did) and run around it."""

    __slots__ = ("_n", "_stack", "_topic")

    def __init__(self, topic: str, n: int) -> None:
        self._topic, self._n = topic, n
        self._stack: ExitStack | None = None

    def __enter__(self) -> dict[str, str] | None:
        if not _topic_publishers:
            return None
        headers: dict[str, str] = {}
        stack = self._stack = ExitStack()
        for o in _topic_publishers:
            around = o.topic_publishing(self._topic, self._n, headers)
            if around is not None:
                stack.enter_context(around)
        return headers or None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> bool:
        return False if self._stack is None else bool(self._stack.__exit__(kind, error, tb))


class offering:  # a class in a function's name: ``with offering(queue, n) as headers:``
    """Wrap one offer: observers may add headers (None when none did) and run around it."""

    __slots__ = ("_n", "_queue", "_stack")

    def __init__(self, queue: str, n: int) -> None:
        self._queue, self._n = queue, n
        self._stack: ExitStack | None = None

    def __enter__(self) -> dict[str, str] | None:
        if not _publishers:
            return None
        headers: dict[str, str] = {}
        stack = self._stack = ExitStack()
        for o in _publishers:
            around = o.publishing(self._queue, self._n, headers)
            if around is not None:
                stack.enter_context(around)
        return headers or None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> bool:
        return False if self._stack is None else bool(self._stack.__exit__(kind, error, tb))


class handling:  # a class in a function's name: ``with handling(delivery):``
    """Wrap one handler call: observers hear of its start, then of its end with the outcome and duration."""

    __slots__ = ("_delivery", "_observers", "_start", "_states")

    def __init__(self, delivery: Delivery) -> None:
        self._delivery = delivery
        self._observers = _observers

    @property
    def reads_database(self) -> bool:
        """Whether one of the observers may read the database on entry (see ``Observer.reads_database``)."""
        return any(o.reads_database for o in self._observers)

    def __enter__(self) -> None:
        self._states = [o.started(self._delivery) for o in self._observers]
        self._start = time.perf_counter()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        duration = time.perf_counter() - self._start
        for o, state in zip(reversed(self._observers), reversed(self._states), strict=True):
            o.finished(self._delivery, state, error, duration)
        return False


class DeliveryLog(Observer):
    """Logs each delivery's start, success and failure (with its traceback) on ``delayq.delivery``.

    The level of each is an attribute: ``delayq.observe.delivery_log.success_level = logging.DEBUG``.
    Defaults: start DEBUG, success INFO, failure WARNING, and INFO without a traceback for a handler
    that raised ``Retry`` or ``DeadLetter`` (``requested_level``): it asked for that, nothing failed.
    """

    reads_database = False

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        start_level: int = logging.DEBUG,
        success_level: int = logging.INFO,
        failure_level: int = logging.WARNING,
        requested_level: int = logging.INFO,
    ) -> None:
        self.logger = logger or logging.getLogger("delayq.delivery")
        self.start_level = start_level
        self.success_level = success_level
        self.failure_level = failure_level
        self.requested_level = requested_level

    def started(self, delivery: Delivery) -> object:
        if self.logger.isEnabledFor(self.start_level):
            self.logger.log(
                self.start_level,
                "%s: attempt %d started",
                delivery.label,
                delivery.attempts,
                extra=_fields("start", delivery, None),
            )
        return None

    def finished(self, delivery: Delivery, state: object, error: BaseException | None, duration: float) -> None:
        if error is None:
            if self.logger.isEnabledFor(self.success_level):
                self.logger.log(
                    self.success_level,
                    "%s: attempt %d succeeded in %.3fs",
                    delivery.label,
                    delivery.attempts,
                    duration,
                    extra=_fields("success", delivery, duration),
                )
            return
        ended = outcome(error, delivery)
        if ended == "cancelled":
            if self.logger.isEnabledFor(self.requested_level):
                self.logger.log(
                    self.requested_level,
                    "%s: attempt %d stopped in %.3fs: the message was cancelled, or its lock lost",
                    delivery.label,
                    delivery.attempts,
                    duration,
                    extra=_fields(ended, delivery, duration, error),
                )
        elif ended != "failure":
            if self.logger.isEnabledFor(self.requested_level):
                self.logger.log(
                    self.requested_level,
                    "%s: attempt %d asked for %s in %.3fs: %s",
                    delivery.label,
                    delivery.attempts,
                    "a retry" if ended == "retry" else "the dead letters",
                    duration,
                    error,
                    extra=_fields(ended, delivery, duration, error),
                )
        elif self.logger.isEnabledFor(self.failure_level):
            self.logger.log(
                self.failure_level,
                "%s: attempt %d failed in %.3fs: %s: %s",
                delivery.label,
                delivery.attempts,
                duration,
                type(error).__name__,
                error,
                exc_info=(type(error), error, error.__traceback__),
                extra=_fields("failure", delivery, duration, error),
            )


def _fields(
    event: str, delivery: Delivery, duration: float | None, error: BaseException | None = None
) -> dict[str, object]:
    hidden = delivery._queue.engine.hide_parameters
    fields: dict[str, object] = {
        "delayq_event": event,
        "delayq_queue": delivery.queue,
        "delayq_key": None if hidden else delivery.key,
        "delayq_id": delivery.id,
        "delayq_attempt": delivery.attempts,
    }
    if duration is not None:
        fields["delayq_duration"] = duration
    if error is not None:
        fields["delayq_error_type"] = type(error).__name__
        fields["delayq_error"] = str(error)
    return fields


delivery_log = DeliveryLog()
"""The delivery log installed by default; set its levels, or ``remove(delivery_log)`` to silence it."""
add(delivery_log)
