"""A job's life after its handler: the settings that keep finished messages, and the statements that keep,
read and count them (any backend).

With ``retention`` (or for a message offered with ``unique_for``) the ack moves the message into the
finished table as ``completed`` instead of deleting it: the held rows are read under a row lock (fenced by
their lock tokens, as the plain ack), inserted with their result and duration, and deleted, in one
transaction. See docs/lifecycle.md.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from delayq.clock import duration_ms
from delayq.dialects import Dialect, Statements
from delayq.errors import InvalidInputError
from delayq.humanize import exact

COMPLETED = 1
"""``finished.state`` of a message whose handler succeeded."""
CANCELLED = 2
"""``finished.state`` of a message cancelled while it ran (or while its queue keeps a history)."""
STATE_NAMES = {COMPLETED: "completed", CANCELLED: "cancelled"}

DEFAULT_RESULT_LIMIT = 64 * 1024
"""The largest result kept, in bytes once serialized (``DelayedQueue(result_limit=)``)."""


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """A queue's settings for finished messages, validated (``settings``); times in milliseconds."""

    retention_ms: int = 0
    keep_results: bool = True
    result_limit: int = DEFAULT_RESULT_LIMIT
    unique_for_ms: int | None = None
    dead_letter_retention_ms: int | None = None

    @property
    def keeps(self) -> bool:
        """Whether every ack keeps its message (retention on)."""
        return self.retention_ms > 0


def _period(value: dt.timedelta | None, name: str, *, zero: bool) -> int | None:
    if value is None:
        return None
    ms = duration_ms(value, name)
    if ms < 0 or (ms == 0 and not zero):
        raise InvalidInputError(f"{name} must be {'zero or ' if zero else ''}positive, got {exact(value)}")
    return ms


def settings(
    retention: dt.timedelta,
    keep_results: bool,
    result_limit: int,
    unique_for: dt.timedelta | None,
    dead_letter_retention: dt.timedelta | None,
) -> Lifecycle:
    """The one validation of ``DelayedQueue``'s lifecycle arguments (documented there)."""
    if not isinstance(keep_results, bool):
        raise InvalidInputError(f"keep_results must be True or False, got {keep_results!r}")
    if isinstance(result_limit, bool) or not isinstance(result_limit, int) or result_limit < 0:
        raise InvalidInputError(f"result_limit must be a whole number of bytes, zero or more, got {result_limit!r}")
    return Lifecycle(
        retention_ms=_period(retention, "retention", zero=True) or 0,
        keep_results=keep_results,
        result_limit=result_limit,
        unique_for_ms=check_unique_for(unique_for),
        dead_letter_retention_ms=_period(dead_letter_retention, "dead_letter_retention", zero=True),
    )


def check_unique_for(unique_for: dt.timedelta | None) -> int | None:
    """``unique_for`` in milliseconds (None: none); a positive period or ``InvalidInputError``."""
    return _period(unique_for, "unique_for", zero=False)


@dataclass(frozen=True, eq=False)
class LifecycleStatements:
    """The statements over the finished table and the moves into it (built once, via ``Statements.memo``)."""

    held: sa.Select[Any]
    held_skipping: sa.Select[Any]
    insert_finished: sa.Insert
    delete_ids: sa.Delete
    latest_finished: sa.Select[Any]
    dead_latest: sa.Select[Any]
    completed_since: sa.Select[Any]
    set_unique_for: sa.Update
    drop_offered: sa.Delete
    counts: sa.Select[Any]
    notify: sa.Executable | None


def statements(stmts: Statements, d: Dialect) -> LifecycleStatements:
    """Build the lifecycle statements over ``stmts``' tables and clock."""
    m, fin, dead, now = stmts.tables.messages, stmts.tables.finished, stmts.tables.dead_letters, stmts.now
    queue, key = sa.bindparam("queue_name", type_=sa.String), sa.bindparam("msg_key", type_=sa.String)
    keys: sa.BindParameter[Any] = sa.bindparam("keys", expanding=True)
    kept_columns = (
        m.c.id,
        m.c.queue,
        m.c.key,
        m.c.payload,
        m.c.payload_type,
        m.c.scheduled_at_initially,
        m.c.created_at,
        m.c.attempts,
        m.c.last_error,
        m.c.attempt_history,
        m.c.headers,
        m.c.tags,
        m.c.priority,
        m.c.group_key,
        m.c.unique_for_ms,
        now.label("now"),
    )
    held = sa.select(*kept_columns).where(d.held_in(m.c.id, m.c.lock_token))
    return LifecycleStatements(
        held=held.with_for_update(),
        held_skipping=held.with_for_update(skip_locked=True),
        insert_finished=sa.insert(fin).values(
            {c.name: sa.bindparam(c.name, type_=c.type) for c in fin.c if c is not fin.c.id}
        ),
        delete_ids=sa.delete(m).where(d.id_in(m.c.id)),
        latest_finished=sa.select(fin)
        .where(fin.c.queue == queue, fin.c.key == key)
        .order_by(fin.c.finished_at.desc(), fin.c.id.desc())
        .limit(1),
        dead_latest=sa.select(dead).where(dead.c.queue == queue, dead.c.key == key).order_by(dead.c.id.desc()).limit(1),
        # The keys completed within the offer's ``unique_for``: finished_at > now - unique_for.
        completed_since=sa.select(fin.c.key)
        .distinct()
        .where(
            fin.c.queue == queue,
            fin.c.key.in_(keys),
            fin.c.state == COMPLETED,
            fin.c.finished_at > now - sa.bindparam("unique_ms", type_=sa.BigInteger),
        ),
        set_unique_for=sa.update(m)
        .where(m.c.queue == queue, m.c.key.in_(keys))
        .values(unique_for_ms=sa.bindparam("unique_ms", type_=sa.BigInteger)),
        drop_offered=sa.delete(m).where(m.c.queue == queue, m.c.key.in_(keys)),
        counts=sa.select(fin.c.state, sa.func.count().label("n")).where(fin.c.queue == queue).group_by(fin.c.state),
        notify=d.notify_channel(fin.name),
    )


def lifecycle_sql(stmts: Statements, dialect: Dialect) -> LifecycleStatements:
    """``statements`` made once per set of queue statements (one set per engine, as ``dialect``)."""
    return stmts.memo(statements, dialect)
