"""What callers pass to a queue, checked before anything is sent: keys, prefixes, queue names, due times."""

from __future__ import annotations

import datetime as dt

from delayq.clock import duration_ms, require_aware, to_ms
from delayq.errors import InvalidInputError, InvalidKeyError, InvalidQueueError
from delayq.schema import MAX_KEY_LENGTH, MAX_QUEUE_LENGTH

At = dt.datetime | dt.timedelta | None
"""A due time: an aware datetime, a timedelta from now, or None for now."""


def _due(at: At) -> tuple[int | None, int | None]:
    """(absolute epoch ms, None) for a datetime; (None, ms from now) for a timedelta or None."""
    if at is None:
        return None, 0
    if isinstance(at, dt.timedelta):
        return None, duration_ms(at, "at")
    return to_ms(require_aware(at, "at")), None


def check_key(key: object) -> str:
    """Return a valid message key or raise ``InvalidKeyError``."""
    return check_text(key, "key", MAX_KEY_LENGTH, InvalidKeyError)


def check_prefix(prefix: object) -> str:
    """Return a valid, non-empty key prefix or raise ``InvalidKeyError``."""
    return check_text(prefix, "key prefix", MAX_KEY_LENGTH, InvalidKeyError)


def check_queue_name(name: object) -> str:
    """Return a valid queue name or raise ``InvalidQueueError``."""
    return check_text(name, "queue name", MAX_QUEUE_LENGTH, InvalidQueueError)


def check_text(value: object, what: str, limit: int, error: type[InvalidInputError]) -> str:
    """Return ``value`` if it is text a column of ``limit`` characters stores on every backend, else raise ``error``."""
    if not isinstance(value, str):
        raise error(f"{what} must be a str, got {type(value).__name__}")
    if not value:
        raise error(f"{what} must not be empty")
    if len(value) > limit:
        raise error(f"{what} is {len(value)} characters long; at most {limit} fit: {value[:40]!r}...")
    if "\x00" in value:
        raise error(f"{what} must not contain NUL characters (PostgreSQL cannot store them)")
    if not value.isascii():  # (ASCII text, the usual key, holds no surrogate: no need to encode it)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise error(f"{what} is not valid text: it contains a lone surrogate") from None
    return value
