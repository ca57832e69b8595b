"""Read-only views for operators: which queues exist, and their messages by state, whatever their serializer.

The states are those ``DelayedQueue.stats()`` counts: a held message whose lock has expired is
``expired-lock`` (due for redelivery), not ``in-flight``.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from delayq.clock import from_ms, to_ms
from delayq.history import AttemptRecord, parse
from delayq.queue import _views, claimed_at
from delayq.schema import Tables
from delayq.tags import decode_tags, tag_pattern


class State(enum.Enum):
    """Where a live message stands (dead letters live in their own table)."""

    READY = "ready"
    SCHEDULED = "scheduled"
    IN_FLIGHT = "in-flight"
    """Held by a consumer whose lock has not expired."""
    EXPIRED_LOCK = "expired-lock"
    """Held by a consumer whose lock expired: due for redelivery."""
    DEAD = "dead"


@dataclass(frozen=True)
class StoredMessage:
    """A message or dead letter as stored, its payload shown as the serializer tag allows."""

    queue: str
    key: str
    state: State
    payload_type: str
    payload: Any
    scheduled_at: dt.datetime | None
    attempts: int
    last_error: str | None
    failed_at: dt.datetime | None = None
    """When a dead letter was moved to the dead letters (None for live messages)."""
    attempt_history: tuple[AttemptRecord, ...] = field(default=())
    claimed_at: dt.datetime | None = None
    """When its current holder claimed it (a held message; None when not held, or locked by an older delayq)."""
    tags: tuple[str, ...] = ()
    """The tags its offer gave it (``delayq.tags``)."""

    def running_for(self, now: dt.datetime) -> dt.timedelta | None:
        """How long an in-flight message's handler has run (since its claim); None for any other state."""
        if self.state is not State.IN_FLIGHT or self.claimed_at is None:
            return None
        return max(now - self.claimed_at, dt.timedelta(0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "key": self.key,
            "state": self.state.value,
            "payload_type": self.payload_type,
            "payload": self.payload,
            "scheduled_at": None if self.scheduled_at is None else self.scheduled_at.isoformat(),
            "attempts": self.attempts,
            "last_error": self.last_error,
            "failed_at": None if self.failed_at is None else self.failed_at.isoformat(),
            "attempt_history": [r.to_json() for r in self.attempt_history],
            "claimed_at": None if self.claimed_at is None else self.claimed_at.isoformat(),
            "tags": list(self.tags),
        }


def show_payload(payload_type: str, data: bytes) -> Any:
    """JSON and text payloads as values; anything else as hex."""
    raw = bytes(data)
    try:
        if payload_type == "json":
            return json.loads(raw)
        if payload_type == "text":
            return raw.decode()
    except (ValueError, UnicodeDecodeError):
        pass
    return raw.hex()


def queue_names(conn: sa.Connection, tables: Tables) -> list[str]:
    """Every queue the database knows of: with live messages, dead letters or an installed cron schedule.

    Queues are not registered anywhere: a queue whose messages were all acked, with no dead letters
    and no schedule, leaves no trace, and reads as a queue never used (name it to see its zeros).
    """
    return _views.queue_names(conn, tables)


def keys_under(conn: sa.Connection, tables: Tables, queue: str, key_prefix: str) -> list[str]:
    """The keys of a queue's live messages that start with ``key_prefix`` (byte for byte), in key order."""
    return _views.keys_under(conn, tables, queue, key_prefix)


def list_messages(
    conn: sa.Connection,
    tables: Tables,
    queue: str,
    *,
    state: State | None,
    now: dt.datetime,
    key_prefix: str | None = None,
    key: str | None = None,
    limit: int = 100,
    tag: str | None = None,
) -> list[StoredMessage]:
    """A queue's messages (or dead letters, with ``State.DEAD``), by due time; with ``tag``, those carrying it."""
    dead = state is State.DEAD
    rows = _views.list_rows(
        conn,
        tables,
        queue,
        dead=dead,
        state=None if state is None or dead else state.value,
        now_ms=to_ms(now),
        key_prefix=key_prefix,
        key=key,
        limit=limit,
        tag_pattern=None if tag is None else tag_pattern(tag),
    )
    return [
        StoredMessage(
            queue=queue,
            key=r.key,
            state=State.DEAD if dead else _state(r.scheduled_at, r.lock_token, now),
            payload_type=r.payload_type,
            payload=show_payload(r.payload_type, r.payload),
            scheduled_at=None if r.scheduled_at is None else from_ms(r.scheduled_at),
            attempts=r.attempts,
            last_error=r.last_error,
            failed_at=None if r.failed_at is None else from_ms(r.failed_at),
            attempt_history=parse(r.attempt_history),
            claimed_at=claimed_at(r.lock_token),
            tags=decode_tags(r.tags),
        )
        for r in rows
    ]


def _state(scheduled_at: int, lock_token: str | None, now: dt.datetime) -> State:
    due = scheduled_at <= to_ms(now)
    if lock_token is not None:
        return State.EXPIRED_LOCK if due else State.IN_FLIGHT
    return State.READY if due else State.SCHEDULED


def database_now(conn: sa.Connection) -> dt.datetime:
    """The database's clock, which decides what is due (as ``stats()`` reads it)."""
    return from_ms(_views.database_now_ms(conn))
