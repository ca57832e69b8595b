"""The worker registry's statements (``{prefix}workers``): a worker's own row, and the reads of everyone's.

A worker inserts its row when it starts, updates it on its heartbeat, marks it stopped on a clean stop
(``delayq.runtime._registry`` decides when) and deletes rows whose heartbeat is long gone, a bounded batch
at a time. Times are the database's (or the injected clock's, bound as ``:now``). Each statement is one
autocommitted round trip on a connection of the caller's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from delayq.dialects import Statements, dialect_for
from delayq.schema import Tables


def _stmts(conn: Connection, tables: Tables, manual_clock: bool) -> Statements:
    return dialect_for(conn.engine).statements(tables, manual_clock)


def _bp(name: str, type_: Any = sa.BigInteger) -> Any:
    return sa.bindparam(name, type_=type_)


def _insert(stmts: Statements) -> sa.Insert:
    w, now = stmts.tables.workers, stmts.now
    return sa.insert(w).values(
        id=_bp("worker_id", sa.String),
        name=_bp("name", sa.String),
        host=_bp("host", sa.String),
        pid=_bp("pid", sa.Integer),
        driver=_bp("driver", sa.String),
        queues=_bp("queues", sa.Text),
        topics=_bp("topics", sa.Text),
        slots=_bp("slots", sa.Integer),
        slots_in_use=_bp("slots_in_use", sa.Integer),
        handled=_bp("handled"),
        started_at=now,
        heartbeat_at=now,
    )


def _beat(stmts: Statements) -> sa.Update:
    w = stmts.tables.workers
    return (
        sa.update(w)
        .where(w.c.id == _bp("worker_id", sa.String), w.c.stopped_at.is_(None))
        .values(heartbeat_at=stmts.now, slots_in_use=_bp("slots_in_use", sa.Integer), handled=_bp("handled"))
    )


def _stop(stmts: Statements) -> sa.Update:
    w = stmts.tables.workers
    return (
        sa.update(w)
        .where(w.c.id == _bp("worker_id", sa.String))
        .values(heartbeat_at=stmts.now, stopped_at=stmts.now, slots_in_use=0, handled=_bp("handled"))
    )


def _forgotten(stmts: Statements) -> sa.Select[Any]:
    w = stmts.tables.workers
    return (
        sa.select(w.c.id)
        .where(w.c.heartbeat_at < stmts.now - _bp("forget_ms"))
        .order_by(w.c.heartbeat_at)
        .limit(_bp("limit", sa.Integer))
    )


def _forget(stmts: Statements) -> sa.Delete:
    w = stmts.tables.workers
    return sa.delete(w).where(
        w.c.id.in_(sa.bindparam("ids", expanding=True)), w.c.heartbeat_at < stmts.now - _bp("forget_ms")
    )


def _listing(stmts: Statements) -> sa.Select[Any]:
    w = stmts.tables.workers
    return sa.select(*w.c, stmts.now.label("now")).order_by(w.c.started_at, w.c.id)


def insert(conn: Connection, tables: Tables, row: Mapping[str, Any], now: int | None) -> None:
    """Insert a worker's row (``row`` binds ``_insert``'s parameters); ``now``: the injected clock's, or None."""
    params = {**row} if now is None else {**row, "now": now}
    conn.execute(_stmts(conn, tables, now is not None).memo(_insert), params)


def beat(conn: Connection, tables: Tables, worker_id: str, in_use: int, handled: int, now: int | None) -> bool:
    """A worker's heartbeat; False when its row is not there (its insert failed, or it was deleted as long gone
    while the worker froze) or is marked stopped."""
    params: dict[str, Any] = {"worker_id": worker_id, "slots_in_use": in_use, "handled": handled}
    if now is not None:
        params["now"] = now
    return conn.execute(_stmts(conn, tables, now is not None).memo(_beat), params).rowcount > 0


def stop(conn: Connection, tables: Tables, worker_id: str, handled: int, now: int | None) -> None:
    """Mark a worker stopped (a clean stop)."""
    params: dict[str, Any] = {"worker_id": worker_id, "handled": handled}
    if now is not None:
        params["now"] = now
    conn.execute(_stmts(conn, tables, now is not None).memo(_stop), params)


def forget(conn: Connection, tables: Tables, forget_ms: int, limit: int, now: int | None) -> int:
    """Delete up to ``limit`` rows whose heartbeat is older than ``forget_ms``; how many went."""
    stmts = _stmts(conn, tables, now is not None)
    params: dict[str, Any] = {"forget_ms": forget_ms, "limit": limit}
    if now is not None:
        params["now"] = now
    ids = list(conn.execute(stmts.memo(_forgotten), params).scalars())
    if not ids:
        return 0
    return int(conn.execute(stmts.memo(_forget), {**params, "ids": ids}).rowcount)


def rows(conn: Connection, tables: Tables) -> tuple[Sequence[Row[Any]], int]:
    """Every worker's row, oldest first, and the database's clock (epoch ms), in one statement when there are rows."""
    stmts = _stmts(conn, tables, False)
    found = conn.execute(stmts.memo(_listing)).all()
    now = int(found[0].now) if found else int(conn.execute(stmts.now_select).scalar_one())
    return found, now
