"""RetryPolicy: how long to wait before the next attempt of a failed message, and when to give up."""

from __future__ import annotations

import datetime as dt
import math
import random
from dataclasses import dataclass

from delayq.errors import InvalidInputError


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, capped, for at most ``max_attempts`` deliveries.

    The delay after failed attempt ``n`` (1-based) is ``initial_delay * multiplier ** (n - 1)``,
    capped at ``max_delay``, then spread by up to ``jitter`` (a fraction) either way so that
    messages that failed together do not retry together. Defaults: 10 attempts, 10 seconds
    doubling to at most 1 hour, 10 % jitter. Subclass and override ``delay`` for other shapes.
    """

    max_attempts: int = 10
    initial_delay: dt.timedelta = dt.timedelta(seconds=10)
    multiplier: float = 2.0
    max_delay: dt.timedelta = dt.timedelta(hours=1)
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidInputError("max_attempts must be at least 1")
        if self.initial_delay < dt.timedelta(0) or self.max_delay < dt.timedelta(0):
            raise InvalidInputError("delays must not be negative")
        if self.multiplier < 1 or not 0 <= self.jitter < 1:
            raise InvalidInputError("multiplier must be >= 1 and jitter in [0, 1)")

    @classmethod
    def fixed(cls, delay: dt.timedelta, max_attempts: int = 10) -> RetryPolicy:
        """The same delay after every failure, no jitter."""
        return cls(max_attempts=max_attempts, initial_delay=delay, multiplier=1.0, max_delay=delay, jitter=0.0)

    def gives_up_after(self, attempts: int) -> bool:
        """True when a message that failed its ``attempts``-th delivery goes to the dead letters."""
        return attempts >= self.max_attempts

    def delay(self, attempts: int) -> dt.timedelta:
        """How long to wait after failed attempt number ``attempts``."""
        cap = self.max_delay.total_seconds()
        try:  # grows past any cap after enough attempts: compare before it overflows a timedelta
            grown = self.initial_delay.total_seconds() * self.multiplier ** max(0, attempts - 1)
        except OverflowError:
            grown = math.inf
        base = dt.timedelta(seconds=min(grown, cap))
        if self.jitter:
            base *= 1 + random.uniform(-self.jitter, self.jitter)
        return base
