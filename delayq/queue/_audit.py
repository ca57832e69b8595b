"""The audit's statements (``{prefix}audit``, delayq_0011): an operator's action recorded, and the keyset reads.

One row per action taken from the dashboard or the command line (``delayq.audit`` is the public face):
``at`` is the database's time (or the injected clock's, bound as ``:now``), the same on every backend. The
reads go newest first by id; a page ends at an id, and the next starts below it (the primary key serves an
unfiltered page, the (queue, id) and (actor, id) indexes a page of one queue or one actor).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from delayq.dialects import Statements, dialect_for
from delayq.schema import Tables

MAX_ACTOR_LENGTH = 200
MAX_ACTION_LENGTH = 50
MAX_SOURCE_LENGTH = 10


def _stmts(conn: Connection, tables: Tables, manual_clock: bool) -> Statements:
    return dialect_for(conn.engine).statements(tables, manual_clock)


def _bp(name: str, type_: Any) -> Any:
    return sa.bindparam(name, type_=type_)


def _insert(stmts: Statements) -> sa.Insert:
    a = stmts.tables.audit
    return sa.insert(a).values(
        at=stmts.now,
        source=_bp("source", sa.String),
        actor=_bp("actor", sa.String),
        action=_bp("action", sa.String),
        queue=_bp("queue", sa.String),
        filter=_bp("filter", sa.Text),
        count=_bp("count", sa.BigInteger),
    )


def _page(stmts: Statements, queue: bool, action: bool, actor: bool, before: bool) -> sa.Select[Any]:
    a = stmts.tables.audit
    wanted = [
        column == _bp(column.name, sa.String)
        for column, given in ((a.c.queue, queue), (a.c.action, action), (a.c.actor, actor))
        if given
    ]
    if before:
        wanted.append(a.c.id < _bp("before", sa.BigInteger))
    return sa.select(*a.c).where(*wanted).order_by(a.c.id.desc()).limit(_bp("limit", sa.Integer))


def insert(
    conn: Connection,
    tables: Tables,
    *,
    source: str,
    actor: str,
    action: str,
    queue: str | None,
    filter: Mapping[str, Any] | None,
    count: int | None,
    now: int | None,
) -> None:
    """Record one action (checked by the caller); ``now``: the injected clock's epoch ms, or None (the database's)."""
    params: dict[str, Any] = {
        "source": source,
        "actor": actor,
        "action": action,
        "queue": queue,
        "filter": json.dumps(dict(filter), sort_keys=True, default=str) if filter else None,
        "count": count,
    }
    if now is not None:
        params["now"] = now
    conn.execute(_stmts(conn, tables, now is not None).memo(_insert), params)


def page(
    conn: Connection,
    tables: Tables,
    *,
    queue: str | None,
    action: str | None,
    actor: str | None,
    before: int | None,
    limit: int,
) -> Sequence[Row[Any]]:
    """Up to ``limit`` rows, newest first, below the id ``before`` (None: from the newest), matching the given."""
    given = {"queue": queue, "action": action, "actor": actor, "before": before}
    stmt = _stmts(conn, tables, False).memo(_page, *(v is not None for v in given.values()))
    params = {k: v for k, v in given.items() if v is not None}
    return conn.execute(stmt, {**params, "limit": limit}).all()
