"""Attempt history: per failed attempt of a message, what was raised, where, and when; and headers.

Stored as JSON text in the ``attempt_history`` column of messages and dead letters, newest last.
It stays small whatever happens: at most ``MAX_ENTRIES`` attempts are kept (the oldest go first),
each message cut at ``MAX_MESSAGE`` characters and each traceback at ``MAX_TRACEBACK`` (its end kept:
that is where it was raised). A message that fails forever cannot grow its row without bound.

A message's *headers* (what an offer stored beside the payload: the trace context, when
``delayq.tracing`` is on) are a JSON object in the ``headers`` column. Both columns travel with the
message to the dead letters and back.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from delayq.clock import from_ms

if TYPE_CHECKING:
    from delayq.dialects.base import Statements

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


@dataclass(frozen=True, eq=False)
class HistoryStatements:
    """The statements that read or write the attempt history and the headers (any backend)."""

    select_held: sa.Select[Any]
    retry: sa.Update
    get: sa.Select[Any]
    dead_latest: sa.Select[Any]
    dead_letters: sa.Select[Any]
    restore_requeued: sa.Update
    history_of: sa.Select[Any]
    headers_of: sa.Select[Any]
    set_headers: sa.Update


def statements(stmts: Statements) -> HistoryStatements:
    """Build the history statements over ``stmts``' tables and clock (made once, via ``stmts.memo``)."""
    m, dead, now = stmts.tables.messages, stmts.tables.dead_letters, stmts.now
    held = sa.and_(m.c.id == sa.bindparam("msg_id", type_=sa.BigInteger), m.c.lock_token == _str("token"))
    by_key = sa.and_(m.c.queue == _str("queue_name"), m.c.key == _str("msg_key"))
    dead_cols = (
        dead.c.id,
        dead.c.key,
        dead.c.payload,
        dead.c.payload_type,
        dead.c.scheduled_at_initially,
        dead.c.created_at,
        dead.c.attempts,
        dead.c.last_error,
        dead.c.attempt_history,
        dead.c.headers,
        dead.c.failed_at,
    )
    return HistoryStatements(
        select_held=sa.select(
            m.c.queue,
            m.c.key,
            m.c.payload,
            m.c.payload_type,
            m.c.scheduled_at_initially,
            m.c.created_at,
            m.c.attempts,
            m.c.attempt_history,
            m.c.headers,
            now.label("now"),
        )
        .where(held)
        .with_for_update(),
        retry=sa.update(m)
        .where(held)
        .values(
            scheduled_at=now + sa.bindparam("delay", type_=sa.BigInteger),
            lock_token=None,
            last_error=sa.bindparam("error", type_=sa.Text),
            attempt_history=sa.bindparam("history", type_=sa.Text),
        ),
        get=sa.select(
            m.c.key,
            m.c.payload,
            m.c.payload_type,
            m.c.scheduled_at,
            m.c.scheduled_at_initially,
            m.c.created_at,
            m.c.attempts,
            m.c.last_error,
            m.c.lock_token,
            m.c.attempt_history,
        ).where(by_key),
        dead_latest=sa.select(*dead_cols)
        .where(dead.c.queue == _str("queue_name"), dead.c.key == _str("msg_key"))
        .order_by(dead.c.id.desc())
        .limit(1)
        .with_for_update(),
        dead_letters=sa.select(*dead_cols)
        .where(dead.c.queue == _str("queue_name"), dead.c.id > sa.bindparam("after_id", type_=sa.BigInteger))
        .order_by(dead.c.id)
        .limit(sa.bindparam("limit", type_=sa.Integer)),
        restore_requeued=sa.update(m)
        .where(by_key)
        .values(
            last_error=sa.bindparam("error", type_=sa.Text),
            attempt_history=_str("history", sa.Text),
            headers=_str("headers", sa.Text),
        ),
        history_of=sa.select(m.c.attempt_history).where(by_key),
        headers_of=sa.select(m.c.headers).where(by_key),
        set_headers=sa.update(m)
        .where(m.c.queue == _str("queue_name"), m.c.key.in_(sa.bindparam("keys", expanding=True)))
        .values(headers=_str("headers", sa.Text)),
    )


def _str(name: str, type_: type[sa.types.TypeEngine[Any]] = sa.String) -> Any:
    return sa.bindparam(name, type_=type_)
