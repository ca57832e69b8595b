"""Clocks: where "now" comes from.

By default delayq asks the database for the time inside each statement, so application
servers with skewed clocks still agree. A ``ManualClock`` replaces that with a time the
caller moves by hand: tests, simulations and replays advance it instead of sleeping.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Protocol, runtime_checkable

from delayq.errors import InvalidTimeError
from delayq.humanize import exact

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
LATEST = dt.datetime(9000, 1, 1, tzinfo=dt.UTC)
"""Times delayq stores lie in [EPOCH, LATEST): every one of them converts back to a datetime."""
MAX_DURATION = dt.timedelta(days=100 * 365)
"""The longest duration delayq accepts (a relative due time, a timeout, a delay), either way: 100 years."""


@runtime_checkable
class Clock(Protocol):
    """A source of the current time, used instead of the database's clock."""

    def now(self) -> dt.datetime:
        """The current time, timezone-aware."""
        ...


class ManualClock:
    """A clock that moves only when told to. Thread-safe."""

    def __init__(self, start: dt.datetime) -> None:
        self._now = require_aware(start)
        self._lock = threading.Lock()

    def now(self) -> dt.datetime:
        with self._lock:
            return self._now

    def advance(self, by: dt.timedelta) -> dt.datetime:
        """Move the clock forward (or back, with a negative delta); returns the new time."""
        with self._lock:
            self._now += by
            return self._now

    def set(self, to: dt.datetime) -> None:
        """Jump to a given time."""
        aware = require_aware(to)
        with self._lock:
            self._now = aware

    def __repr__(self) -> str:
        return f"ManualClock({self.now().isoformat()})"


def require_aware(value: object, name: str = "time") -> dt.datetime:
    """Return ``value`` if it is a timezone-aware datetime; raise ``InvalidTimeError`` otherwise."""
    if not isinstance(value, dt.datetime):
        raise InvalidTimeError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.tzinfo.utcoffset(value) is None:
        raise InvalidTimeError(
            f"{name} {value.isoformat()} is naive: pass a timezone-aware datetime "
            "(e.g. datetime.now(timezone.utc)) or a timedelta from now"
        )
    return value


def to_ms(value: dt.datetime, name: str = "time") -> int:
    """Epoch milliseconds of an aware datetime in [1970, 9000); ``InvalidTimeError`` otherwise."""
    aware = require_aware(value, name)
    if not EPOCH <= aware < LATEST:
        raise InvalidTimeError(f"{name} {aware.isoformat()} is out of range: delayq stores times from 1970 to 9000")
    delta = aware - EPOCH
    return delta.days * 86_400_000 + delta.seconds * 1000 + delta.microseconds // 1000


_EARLIEST = dt.datetime.min.replace(tzinfo=dt.UTC)
_LAST = dt.datetime.max.replace(tzinfo=dt.UTC)


def from_ms(ms: int) -> dt.datetime:
    """An aware UTC datetime from epoch milliseconds.

    A time no datetime can hold (written by hand, or by a delayq that accepted any time) reads as
    the earliest or latest datetime instead of failing whatever reads it.
    """
    try:
        return EPOCH + dt.timedelta(milliseconds=ms)
    except OverflowError:
        return _EARLIEST if ms < 0 else _LAST


def duration_ms(value: dt.timedelta, name: str = "duration") -> int:
    """Whole milliseconds of a timedelta of at most 100 years either way; ``InvalidTimeError`` otherwise."""
    if not isinstance(value, dt.timedelta):
        raise InvalidTimeError(f"{name} must be a timedelta, got {type(value).__name__}")
    if abs(value) > MAX_DURATION:
        raise InvalidTimeError(f"{name} {exact(value)} is out of range: at most 100 years either way")
    return value.days * 86_400_000 + value.seconds * 1000 + value.microseconds // 1000
