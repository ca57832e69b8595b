"""The queue's statements that read or write a message's attempt history, headers and tags (any backend).

Built once per table set and clock mode, through ``Statements.memo``: ``stmts.memo(statements).get``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from delayq.dialects import Statements


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
    set_tags: sa.Update


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
        dead.c.tags,
        dead.c.priority,
        dead.c.group_key,
        dead.c.worker,
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
            m.c.tags,
            m.c.priority,
            m.c.group_key,
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
            m.c.tags,
            m.c.priority,
            m.c.group_key,
            now.label("now"),
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
            tags=_str("tags", sa.Text),
            priority=sa.bindparam("priority", type_=sa.SmallInteger),
            group_key=_str("group"),
        ),
        history_of=sa.select(m.c.attempt_history).where(by_key),
        headers_of=sa.select(m.c.headers).where(by_key),
        set_headers=sa.update(m)
        .where(m.c.queue == _str("queue_name"), m.c.key.in_(sa.bindparam("keys", expanding=True)))
        .values(headers=_str("headers", sa.Text)),
        set_tags=sa.update(m)
        .where(m.c.queue == _str("queue_name"), m.c.key.in_(sa.bindparam("keys", expanding=True)))
        .values(tags=_str("tags", sa.Text)),
    )


def _str(name: str, type_: type[sa.types.TypeEngine[Any]] = sa.String) -> Any:
    return sa.bindparam(name, type_=type_)
