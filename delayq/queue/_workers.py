"""The worker registry's statements (``{prefix}workers``): a worker's own row, and the reads of everyone's; and
the queue history's (``{prefix}queue_history``), which the workers write with their heartbeats.

A worker inserts its row when it starts, updates it on its heartbeat (what its handlers run now included),
marks it stopped on a clean stop (``delayq.runtime._registry`` decides when) and deletes rows whose heartbeat
is long gone, a bounded batch at a time. With the same beat it adds its outcome counts to the minute's history
row of each queue (one upsert, ``Dialect.adding_upsert``: many workers add up), and now and then deletes history
older than a day, a bounded batch at a time. Times are the database's (or the injected clock's, bound as
``:now``). Each statement is one round trip on a connection of the caller's.
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
        .values(
            heartbeat_at=stmts.now,
            slots_in_use=_bp("slots_in_use", sa.Integer),
            handled=_bp("handled"),
            running=_bp("running", sa.Text),
        )
    )


def _stop(stmts: Statements) -> sa.Update:
    w = stmts.tables.workers
    return (
        sa.update(w)
        .where(w.c.id == _bp("worker_id", sa.String))
        .values(heartbeat_at=stmts.now, stopped_at=stmts.now, slots_in_use=0, handled=_bp("handled"), running=None)
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


MINUTE_MS = 60_000
COUNTS = ("processed", "failed", "dead_lettered")
"""The queue history's counts, in the order a worker's tally keeps them."""


def _expired_history(stmts: Statements) -> sa.Select[Any]:
    h = stmts.tables.queue_history
    return (
        sa.select(h.c.queue, h.c.minute)
        .where(h.c.minute < stmts.now - _bp("keep_ms"))
        .order_by(h.c.minute)
        .limit(_bp("limit", sa.Integer))
    )


def _delete_history(stmts: Statements) -> sa.Delete:
    h = stmts.tables.queue_history
    return sa.delete(h).where(sa.tuple_(h.c.queue, h.c.minute).in_(sa.bindparam("keys", expanding=True)))


def _history_of(stmts: Statements) -> sa.Select[Any]:
    h = stmts.tables.queue_history
    return (
        sa.select(h.c.minute, *(h.c[c] for c in COUNTS))
        .where(h.c.queue == _bp("queue", sa.String), h.c.minute >= _bp("since"))
        .order_by(h.c.minute)
    )


def _history_of_all(stmts: Statements) -> sa.Select[Any]:
    h = stmts.tables.queue_history
    return (
        sa.select(h.c.minute, *(sa.func.sum(h.c[c]).label(c) for c in COUNTS))
        .where(h.c.minute >= _bp("since"))
        .group_by(h.c.minute)
        .order_by(h.c.minute)
    )


def _listing(stmts: Statements) -> sa.Select[Any]:
    w = stmts.tables.workers
    return sa.select(*w.c, stmts.now.label("now")).order_by(w.c.started_at, w.c.id)


def insert(conn: Connection, tables: Tables, row: Mapping[str, Any], now: int | None) -> None:
    """Insert a worker's row (``row`` binds ``_insert``'s parameters); ``now``: the injected clock's, or None."""
    params = {**row} if now is None else {**row, "now": now}
    conn.execute(_stmts(conn, tables, now is not None).memo(_insert), params)


def beat(
    conn: Connection,
    tables: Tables,
    worker_id: str,
    in_use: int,
    handled: int,
    now: int | None,
    running: str | None = None,
) -> bool:
    """A worker's heartbeat (``running``: what its handlers run, as JSON); False when its row is not there (its
    insert failed, or it was deleted as long gone while the worker froze) or is marked stopped."""
    params: dict[str, Any] = {"worker_id": worker_id, "slots_in_use": in_use, "handled": handled, "running": running}
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


def add_history(conn: Connection, tables: Tables, counts: Mapping[str, Sequence[int]], now: int | None) -> None:
    """Add each queue's ``counts`` (processed, failed, dead-lettered) to its row of the current minute, creating
    it: one statement, its rows in queue order (two workers lock shared rows in the same order)."""
    dialect = dialect_for(conn.engine)
    stmts = dialect.statements(tables, now is not None)
    minute = stmts.now - stmts.now % MINUTE_MS
    rows = [{"queue": q, "minute": minute, **dict(zip(COUNTS, counts[q], strict=True))} for q in sorted(counts)]
    upsert = dialect.adding_upsert(tables.queue_history, ["queue", "minute"], COUNTS)
    conn.execute(upsert.values(rows), {} if now is None else {"now": now})


def prune_history(conn: Connection, tables: Tables, keep_ms: int, limit: int, now: int | None) -> int:
    """Delete up to ``limit`` history rows of minutes older than ``keep_ms``, oldest first; how many went."""
    stmts = _stmts(conn, tables, now is not None)
    params: dict[str, Any] = {"keep_ms": keep_ms, "limit": limit}
    if now is not None:
        params["now"] = now
    keys = [tuple(r) for r in conn.execute(stmts.memo(_expired_history), params)]
    if not keys:
        return 0
    return int(conn.execute(stmts.memo(_delete_history), {"keys": keys}).rowcount)


def history(conn: Connection, tables: Tables, queue: str | None, since_ms: int) -> Sequence[Row[Any]]:
    """Per minute from ``since_ms`` on, oldest first: (minute, processed, failed, dead_lettered) of ``queue``,
    or summed over every queue when None. Minutes without a row are not there."""
    stmts = _stmts(conn, tables, False)
    if queue is None:
        return conn.execute(stmts.memo(_history_of_all), {"since": since_ms}).all()
    return conn.execute(stmts.memo(_history_of), {"queue": queue, "since": since_ms}).all()


def rows(conn: Connection, tables: Tables) -> tuple[Sequence[Row[Any]], int]:
    """Every worker's row, oldest first, and the database's clock (epoch ms), in one statement when there are rows."""
    stmts = _stmts(conn, tables, False)
    found = conn.execute(stmts.memo(_listing)).all()
    now = int(found[0].now) if found else int(conn.execute(stmts.now_select).scalar_one())
    return found, now
