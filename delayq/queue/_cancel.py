"""Cancel one message: a queued one is deleted; a running one is also recorded as cancelled and its worker told.

The fast path is today's one statement: ``DELETE … WHERE queue, key AND NOT running`` (running: locked, the lock
unexpired). When it deletes nothing, one transaction reads the message ``FOR UPDATE``; a running message is
copied into ``finished`` with state ``CANCELLED`` and deleted, and on PostgreSQL a NOTIFY on the cancel channel
(``{messages}_cancel``, payload the message's id) tells the worker holding it when the transaction commits.
Elsewhere that worker learns it at its next heartbeat, which finds the lock gone (or at the ack of a handler that
returned first), and tells the cancel from a lost lock by the cancelled record (``cancelled_records``). Its
handler's later ack, retry or dead letter change nothing: each is a compare-and-swap on the lock token of a row
that no longer exists.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from delayq.clock import to_ms
from delayq.dialects import Statements
from delayq.queue._lifecycle import CANCELLED, COMPLETED
from delayq.queue._tokens import claimed_at

FINISHED_COMPLETED = COMPLETED
"""``finished.state`` of a completed message (``delayq.queue._lifecycle``)."""
FINISHED_CANCELLED = CANCELLED
"""``finished.state`` of a cancelled message."""

DEFAULT_CANCELLED_RETENTION = dt.timedelta(days=7)
"""How long a cancelled message's ``finished`` row is kept (its ``expires_at``) when neither ``cancel_job``'s
``keep_for`` nor the queue's ``retention`` says otherwise."""


@dataclass(frozen=True, eq=False)
class CancelStatements:
    """The statements of the cancel's slow path (any backend; the NOTIFY is PostgreSQL's)."""

    lock_by_key: sa.Select[Any]
    insert_finished: sa.Insert
    delete_id: sa.Delete
    notify: sa.Executable | None


def statements(stmts: Statements) -> CancelStatements:
    """Build them over ``stmts``' tables and clock (made once, via ``stmts.memo``)."""
    m, finished = stmts.tables.messages, stmts.tables.finished
    lock_by_key = (
        sa.select(
            m.c.id,
            m.c.queue,
            m.c.key,
            m.c.payload,
            m.c.payload_type,
            m.c.scheduled_at,
            m.c.scheduled_at_initially,
            m.c.created_at,
            m.c.attempts,
            m.c.last_error,
            m.c.attempt_history,
            m.c.headers,
            m.c.tags,
            m.c.priority,
            m.c.group_key,
            m.c.lock_token,
            stmts.now.label("now"),
        )
        .where(
            m.c.queue == sa.bindparam("queue_name", type_=sa.String),
            m.c.key == sa.bindparam("msg_key", type_=sa.String),
        )
        .with_for_update()
    )
    insert_finished = sa.insert(finished).values(
        {c.name: sa.bindparam(c.name, type_=c.type) for c in finished.c if c is not finished.c.id}
    )
    return CancelStatements(
        lock_by_key=lock_by_key,
        insert_finished=insert_finished,
        delete_id=sa.delete(m).where(m.c.id == sa.bindparam("msg_id", type_=sa.BigInteger)),
        notify=stmts.kind.notify_cancel_statement(stmts.tables),
    )


def running(row: Any) -> bool:
    """Whether a message read with its ``lock_token``, ``scheduled_at`` and ``now`` is running: locked, the lock
    unexpired (a cancel records it and tells its worker; an expired lock's message is queued again)."""
    return row.lock_token is not None and int(row.scheduled_at) > int(row.now)


def cancelled_row(row: Any, keep_ms: int) -> dict[str, Any]:
    """The ``finished`` row recording ``row`` (read by ``lock_by_key``'s columns) as cancelled now, kept ``keep_ms``;
    a running one with how long it had run since its claim."""
    claimed = claimed_at(row.lock_token) if running(row) else None
    took = None if claimed is None else max(0, int(row.now) - to_ms(claimed))
    return finished_row(row, FINISHED_CANCELLED, keep_ms, took)


def finished_row(row: Any, state: int, keep_ms: int, duration_ms: int | None) -> dict[str, Any]:
    """The ``finished`` row of a message read by ``lock_by_key``, finished now (its ``now``) in ``state``."""
    now = int(row.now)
    return {
        "queue": row.queue,
        "key": row.key,
        "payload": row.payload,
        "payload_type": row.payload_type,
        "state": state,
        "scheduled_at_initially": row.scheduled_at_initially,
        "created_at": row.created_at,
        "attempts": row.attempts,
        "last_error": row.last_error,
        "attempt_history": row.attempt_history,
        "headers": row.headers,
        "tags": row.tags,
        "finished_at": now,
        "duration_ms": duration_ms,
        "result": None,
        "result_type": None,
        "expires_at": now + keep_ms,
        "priority": row.priority,
        "group_key": row.group_key,
        "worker": None,  # (the canceller is not the worker that ran it)
    }


def cancelled_records(stmts: Statements) -> sa.Select[Any]:
    """The cancelled records of some keys of one queue (``:queue_name``, ``:keys``): each one's key, creation time
    and attempts, which name a message and its attempt (made once, via ``stmts.memo``; the (queue, key) index)."""
    f = stmts.tables.finished
    return sa.select(f.c.key, f.c.created_at, f.c.attempts).where(
        f.c.queue == sa.bindparam("queue_name", type_=sa.String),
        f.c.key.in_(sa.bindparam("keys", expanding=True)),
        f.c.state == FINISHED_CANCELLED,
    )
