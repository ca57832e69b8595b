"""Attempt history: per failed attempt of a message, what was raised, where, and when; and headers.

Stored as JSON text in the ``attempt_history`` column of messages and dead letters, newest last.
It stays small whatever happens: at most ``MAX_ENTRIES`` attempts are kept (the oldest go first),
each message cut at ``MAX_MESSAGE`` characters and each traceback at ``MAX_TRACEBACK`` (its end kept:
that is where it was raised). A message that fails forever cannot grow its row without bound.

A message's *headers* (what an offer stored beside the payload: the trace context, when
``delayq.tracing`` is on) are a JSON object in the ``headers`` column. Both columns travel with the
message to the dead letters and back. The statements that read and write them are the queue's
(``delayq/queue/_history.py``).
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import traceback
from dataclasses import dataclass
from typing import Any

from delayq.clock import from_ms

__all__ = ["MAX_ENTRIES", "MAX_MESSAGE", "MAX_TRACEBACK", "AttemptRecord", "Failure"]

MAX_ENTRIES = 10
"""Failed attempts kept per message; older ones are dropped."""
MAX_MESSAGE = 2_000
"""Characters kept of an error's message."""
MAX_TRACEBACK = 6_000
"""Characters kept of a traceback (its last ones)."""


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One failed attempt of a message."""

    attempt: int
    """Which delivery it was (1 for the first)."""
    error_type: str | None
    """The exception's class name; None when the outcome was recorded without an exception."""
    message: str
    """The error as recorded (``last_error`` of that attempt)."""
    traceback: str | None
    """Where it was raised (the traceback's last ``MAX_TRACEBACK`` characters); None without an exception."""
    at: dt.datetime
    """When the failure was recorded, by the database's clock (or the queue's injected clock)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``at`` as ISO 8601)."""
        return {
            "attempt": self.attempt,
            "error_type": self.error_type,
            "message": self.message,
            "traceback": self.traceback,
            "at": self.at.isoformat(),
        }


@dataclass(frozen=True, slots=True)
class Failure:
    """A failure about to be recorded: everything but the time, which the database gives."""

    error_type: str | None
    message: str
    traceback: str | None

    @classmethod
    def capture(cls, error: str | None, exception: BaseException | None = None) -> Failure:
        """The failure for ``error``, with the type and traceback of ``exception``.

        Without ``exception``, the one being handled (when called in an ``except`` block) is used.
        """
        exc = exception if exception is not None else sys.exc_info()[1]
        if exc is None:
            return cls(None, _cut(error or "", MAX_MESSAGE), None)
        text = "".join(traceback.format_exception(exc))
        if len(text) > MAX_TRACEBACK:
            text = "…" + text[-(MAX_TRACEBACK - 1) :]
        message = error if error is not None else f"{type(exc).__name__}: {exc}"
        return cls(type(exc).__name__, _cut(message, MAX_MESSAGE), text)

    def appended_to(self, stored: str | None, attempt: int, now_ms: int) -> str:
        """The stored history ``stored`` with this failure of delivery ``attempt`` at ``now_ms`` added last."""
        attempts = _load(stored)
        attempts.append(
            {"attempt": attempt, "type": self.error_type, "message": self.message, "tb": self.traceback, "at": now_ms}
        )
        return _dump(attempts[-MAX_ENTRIES:])


def dump_headers(headers: dict[str, str]) -> str:
    """Headers as stored in the ``headers`` column."""
    return _dump({str(k): str(v) for k, v in headers.items()})


def load_headers(stored: str | None) -> dict[str, str]:
    """The headers stored in a ``headers`` column (empty when none or unreadable)."""
    try:
        found = json.loads(stored) if stored else None
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def _dump(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def parse(stored: str | None) -> tuple[AttemptRecord, ...]:
    """The records of a stored history, oldest first; entries that cannot be read are skipped."""
    records = []
    for e in _load(stored):
        try:
            records.append(
                AttemptRecord(
                    attempt=int(e["attempt"]),
                    error_type=None if e.get("type") is None else str(e["type"]),
                    message=str(e.get("message") or ""),
                    traceback=None if e.get("tb") is None else str(e["tb"]),
                    at=from_ms(int(e["at"])),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue
    return tuple(records)


def _load(stored: str | None) -> list[dict[str, Any]]:
    if not stored:
        return []
    try:
        found = json.loads(stored)
    except ValueError:
        return []
    return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
