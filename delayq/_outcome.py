"""The one decision of what follows a delivery: ack it, retry it after a delay, or bury it (dead letter).

``decide`` is pure (no database, no clock, no logging): the queue and topic consumers of both
workers, the claim-time delivery caps of queues and topics, and ``Subscription.nack`` all ask it,
so they cannot disagree. Its table:

==========================  =====================================  ===============================
what ended the attempt      attempts left (``attempts < max``)     attempts used up
==========================  =====================================  ===============================
nothing (returned)          ``Ack``                                ``Ack``
``DeadLetter(reason)``      ``Bury(reason)``                       ``Bury(reason)``
``Retry(after, reason)``    ``RetryAfter(after or policy delay)``  ``Bury(reason)``
``TimedOut`` / exception    ``RetryAfter(policy delay)``           ``Bury("Type: text")``
``Unfinished`` (no outcome) ``RetryAfter(0)`` (deliver it)         ``Bury("delivered N times ...")``
==========================  =====================================  ===============================

"Used up" is ``policy.gives_up_after(attempts)`` with a policy, else ``attempts >= max_attempts``
(None: never).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from delayq._steering import DeadLetter, Retry
from delayq.humanize import human
from delayq.retry import RetryPolicy

_NO_DELAY = dt.timedelta(0)


@dataclass(frozen=True, slots=True)
class Ack:
    """The attempt succeeded: delete (queue) or ack (topic) the message."""


@dataclass(frozen=True, slots=True)
class RetryAfter:
    """Deliver the message again after ``delay``, recording ``error`` (``requested``: a ``Retry``)."""

    delay: dt.timedelta
    error: str
    requested: bool = False


@dataclass(frozen=True, slots=True)
class Bury:
    """Move the message to the dead letters (queue) or the dead-letter topic, with ``reason``."""

    reason: str


Outcome = Ack | RetryAfter | Bury

ACK = Ack()


class TimedOut(Exception):
    """An asyncio handler cancelled at its ``Handler.timeout``: a failed attempt."""

    def __init__(self, timeout: dt.timedelta) -> None:
        super().__init__(f"cancelled at its timeout of {human(timeout)}")
        self.timeout = timeout


class Unfinished(Exception):
    """A claim found a message delivered ``attempts`` times that never reached an outcome (its consumer died)."""

    def __init__(self, attempts: int) -> None:
        super().__init__(f"delivered {attempts} times without an outcome")


def describe_error(error: BaseException) -> str:
    """The ``last_error`` text of a failed attempt: ``Type: message`` (only the text for our own markers)."""
    if isinstance(error, (Unfinished, DeadLetter)):
        return str(error)
    if isinstance(error, Retry):
        return error.reason or "retry requested"
    return f"{type(error).__name__}: {error}"


def used_up(attempts: int, policy: RetryPolicy | None, max_attempts: int | None) -> bool:
    """Whether ``attempts`` deliveries exhaust the message: the policy's rule, else the bare cap."""
    if policy is not None:
        return policy.gives_up_after(attempts)
    return max_attempts is not None and attempts >= max_attempts


def decide(
    error: BaseException | None,
    attempts: int,
    policy: RetryPolicy | None = None,
    max_attempts: int | None = None,
) -> Outcome:
    """What follows a delivery that ended with ``error`` (None: returned) after ``attempts`` deliveries.

    ``policy`` (a handler's) gives the delays and the cap; without one, ``max_attempts`` is the cap
    (None: no cap) and a retry is due at once unless a ``Retry`` names its delay.
    """
    return ACK if error is None else after_failure(error, attempts, policy, max_attempts)


def after_failure(
    error: BaseException,
    attempts: int,
    policy: RetryPolicy | None = None,
    max_attempts: int | None = None,
) -> RetryAfter | Bury:
    """``decide`` for an attempt that ended with ``error``: never an ``Ack``."""
    if isinstance(error, DeadLetter):
        return Bury(error.reason)
    reason = describe_error(error)
    if used_up(attempts, policy, max_attempts):
        return Bury(reason)
    if isinstance(error, Retry) and error.after is not None:
        return RetryAfter(error.after, reason, requested=True)
    delay = _NO_DELAY if policy is None or isinstance(error, Unfinished) else policy.delay(attempts)
    return RetryAfter(delay, reason, requested=isinstance(error, Retry))
