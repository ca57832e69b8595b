"""The queue's reads for operators, over every queue of one table set: what ``browse``, ``top`` and
``cron ls`` show. Nothing here writes.

Each statement is built once per table set and shape (``Statements.memo``); every value, the time
included, is a bind parameter. The callers get rows and make their own values of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from delayq.dialects import Statements, dialect_for
from delayq.dialects.base import prefix_bounds
from delayq.queue import _lifecycle
from delayq.queue._checks import check_key, check_prefix, check_queue_name
from delayq.schema import Tables, make_tables

STATES = ("ready", "scheduled", "in-flight", "expired-lock")
"""The states of a live message ``list_rows`` filters by (``browse.State``'s values but ``dead``)."""


def _stmts(conn: Connection, tables: Tables) -> Statements:
    return dialect_for(conn.engine).statements(tables, manual_clock=False)


def _ms(name: str) -> Any:
    return sa.bindparam(name, type_=sa.BigInteger)


def _names() -> Any:
    return sa.bindparam("names", expanding=True)


def database_now_ms(conn: Connection) -> int:
    """The database's clock (what decides what is due), as epoch milliseconds."""
    return int(conn.execute(_stmts(conn, make_tables()).now_select).scalar_one())


def _queue_names(stmts: Statements) -> sa.CompoundSelect[Any]:
    t = stmts.tables
    m, dead, schedules, fin, flow = t.messages, t.dead_letters, t.schedules, t.finished, t.flow
    set_by_hand = (flow.c.concurrency, flow.c.rate, flow.c.group_concurrency)  # (NULL: not set, or set back)
    return sa.union(
        sa.select(m.c.queue).distinct(),
        sa.select(dead.c.queue).distinct(),
        sa.select(schedules.c.queue).distinct(),
        sa.select(fin.c.queue).distinct(),
        sa.select(flow.c.queue).where(sa.or_(flow.c.paused != 0, *(c.is_not(None) for c in set_by_hand))),
    )


def queue_names(conn: Connection, tables: Tables) -> list[str]:
    """Every queue with live messages, dead letters, kept finished messages or an installed cron schedule, or
    that is paused or has a limit set (concurrency, rate, group concurrency), sorted."""
    return sorted(conn.execute(_stmts(conn, tables).memo(_queue_names)).scalars())


def _next_queue(stmts: Statements, table: str, bound: str) -> sa.Select[Any]:
    t = getattr(stmts.tables, table)
    stmt = sa.select(t.c.queue).order_by(t.c.queue).limit(1)
    name = sa.bindparam("queue_name", type_=sa.String)
    return {"first": stmt, "from": stmt.where(t.c.queue >= name), "after": stmt.where(t.c.queue > name)}[bound]


def next_queue(
    conn: Connection, tables: Tables, table: str, *, after: str | None, inclusive: bool = False
) -> str | None:
    """The first queue, in the database's order of names, with rows in ``table`` ("messages", "dead_letters" or
    "finished") after ``after`` (or from it, ``inclusive``; None: the first of all): one probe of an index that
    starts with ``queue``, whatever the number of rows. None when there is none."""
    bound = "first" if after is None else "from" if inclusive else "after"
    stmt = _stmts(conn, tables).memo(_next_queue, table, bound)
    found = conn.execute(stmt, {"queue_name": after}).scalar()
    return None if found is None else str(found)


def _keys_under(stmts: Statements) -> sa.Select[Any]:
    m = stmts.tables.messages
    return (
        sa.select(m.c.key).where(m.c.queue == sa.bindparam("queue_name"), stmts.starts_with(m.c.key)).order_by(m.c.key)
    )


def keys_under(conn: Connection, tables: Tables, queue: str, key_prefix: str) -> list[str]:
    """The keys of a queue's live messages that start with ``key_prefix`` (byte for byte), in key order."""
    params = {"queue_name": queue, **prefix_bounds(key_prefix)}
    return list(conn.execute(_stmts(conn, tables).memo(_keys_under), params).scalars())


def _rows(
    stmts: Statements,
    dead: bool,
    state: str | None,
    by_prefix: bool,
    by_key: bool,
    paged: bool = False,
    key_order: bool = False,
    by_tag: bool = False,
) -> sa.Select[Any]:
    """The listing's statement over the live messages (or, with ``dead``, the dead letters). ``paged``
    continues after a cursor; ``by_tag``: only the rows whose tags match ``:tag_pattern``."""
    if dead:
        t = stmts.tables.dead_letters
        stmt = sa.select(
            t.c.id,
            t.c.key,
            t.c.payload_type,
            t.c.payload,
            t.c.attempts,
            t.c.last_error,
            t.c.attempt_history,
            t.c.failed_at,
            sa.null().label("scheduled_at"),
            sa.null().label("lock_token"),
            t.c.tags,
            *_not_finished(),
            *_origin(t),
        )
        position = t.c.failed_at
    else:
        t = stmts.tables.messages
        stmt = sa.select(
            t.c.id,
            t.c.key,
            t.c.payload_type,
            t.c.payload,
            t.c.attempts,
            t.c.last_error,
            t.c.attempt_history,
            sa.null().label("failed_at"),
            t.c.scheduled_at,
            t.c.lock_token,
            t.c.tags,
            *_not_finished(),
            t.c.priority,
            t.c.group_key,
            sa.null().label("worker"),
        )
        due, locked = t.c.scheduled_at <= _ms("at"), t.c.lock_token.is_not(None)
        where = {
            "ready": sa.and_(due, ~locked),
            "scheduled": sa.and_(~due, ~locked),
            "in-flight": sa.and_(~due, locked),
            "expired-lock": sa.and_(due, locked),
        }
        if state is not None:
            stmt = stmt.where(where[state])
        position = t.c.scheduled_at
    stmt = _paged(stmt, t.c.key if key_order else position, t.c.id, key_order, paged)
    return _filtered(stmts, stmt.where(t.c.queue == sa.bindparam("queue_name")), t, by_prefix, by_key, by_tag)


def _paged(
    stmt: sa.Select[Any], first: sa.ColumnElement[Any], ident: sa.ColumnElement[int], by_key: bool, paged: bool
) -> sa.Select[Any]:
    """``stmt`` in (``first``, id) order, after the cursor's (``after_key`` or ``after_at``, ``after_id``) when
    ``paged``: ``first >= :after`` bounds the index range the listing reads (see ``list_rows``), the rest filters
    within it. Never an OFFSET: a page deep in a big queue costs what the first does."""
    stmt = stmt.order_by(first, ident).limit(sa.bindparam("limit", type_=sa.Integer))
    if not paged:
        return stmt
    after = sa.bindparam("after_key", type_=sa.String) if by_key else _ms("after_at")
    return stmt.where(first >= after, sa.or_(first > after, ident > _ms("after_id")))


def _filtered(
    stmts: Statements, stmt: sa.Select[Any], t: sa.Table, by_prefix: bool, by_key: bool, by_tag: bool
) -> sa.Select[Any]:
    if by_prefix:
        stmt = stmt.where(stmts.starts_with(t.c.key))
    if by_key:
        stmt = stmt.where(t.c.key == sa.bindparam("msg_key"))
    if by_tag:  # (``delayq.tags.tag_pattern``: ``_`` escaped with ``!``)
        stmt = stmt.where(t.c.tags.like(sa.bindparam("tag_pattern", type_=sa.String), escape="!"))
    return stmt


KEPT_STATES = {name: code for code, name in _lifecycle.STATE_NAMES.items()}
"""The states of a message kept after it finished (``finished.state`` by name), which ``list_rows`` reads too."""


def _not_finished() -> tuple[sa.ColumnElement[Any], ...]:
    no = sa.null()
    return (no.label("finished_at"), no.label("duration_ms"), no.label("result"), no.label("result_type"))


def _origin(t: sa.Table) -> tuple[sa.ColumnElement[Any], ...]:
    """A kept row's priority, group and worker (dead letters and finished rows; NULL in rows kept before
    delayq_0013)."""
    return (t.c.priority, t.c.group_key, t.c.worker)


def _kept_rows(
    stmts: Statements,
    kept: int,
    by_prefix: bool,
    by_key: bool,
    paged: bool,
    by_tag: bool = False,
    key_order: bool = False,
) -> sa.Select[Any]:
    """The listing of a queue's kept finished messages in one state."""
    f = stmts.tables.finished
    no = sa.null()
    stmt = sa.select(
        f.c.id,
        f.c.key,
        f.c.payload_type,
        f.c.payload,
        f.c.attempts,
        f.c.last_error,
        f.c.attempt_history,
        no.label("failed_at"),
        no.label("scheduled_at"),
        no.label("lock_token"),
        f.c.tags,
        f.c.finished_at,
        f.c.duration_ms,
        f.c.result,
        f.c.result_type,
        *_origin(f),
    ).where(f.c.queue == sa.bindparam("queue_name"), f.c.state == kept)
    stmt = _paged(stmt, f.c.key if key_order else f.c.finished_at, f.c.id, key_order, paged)
    return _filtered(stmts, stmt, f, by_prefix, by_key, by_tag)


def list_rows(
    conn: Connection,
    tables: Tables,
    queue: str,
    *,
    dead: bool,
    state: str | None,
    now_ms: int,
    key_prefix: str | None,
    key: str | None,
    limit: int,
    after: tuple[int, int, str] | None = None,
    key_order: bool = False,
    tag_pattern: str | None = None,
) -> Sequence[Row[Any]]:
    """A queue's messages in ``state`` (one of ``STATES``, or None for all) at ``now_ms``; with ``dead``, its
    dead letters; with a state of ``KEPT_STATES``, its kept finished messages in it. Columns: id, key,
    payload_type, payload, attempts, last_error, attempt_history, failed_at, scheduled_at, lock_token, tags,
    finished_at, duration_ms, result, result_type, priority, group_key, worker (NULL where they do not apply: a
    live message's worker is in the registry's heartbeat, not its row). With ``tag_pattern``
    (``delayq.tags.tag_pattern``): only those carrying the tag.

    Each listing is in (position, id) order, a range of an index of the queue's: live messages by due time
    (the (queue, scheduled_at, id) index), dead letters by failure time ((queue, failed_at)), kept ones by
    finish time ((queue, state, finished_at, id)); with ``key_order``, each by (key, id) instead (the
    (queue, key) indexes: under a key prefix, a page costs its rows, not a walk past every row outside it).
    ``after`` pages by keyset, never by OFFSET: the rows after the one whose (position, id, key) it is.
    A queue name, key or prefix no row can have is an ``InvalidInputError`` before anything is sent."""
    check_queue_name(queue)
    if key is not None:
        check_key(key)
    if key_prefix:
        check_prefix(key_prefix)
    kept = KEPT_STATES.get(state or "")
    if kept is None and state is not None and state not in STATES:
        raise ValueError(f"no such state: {state!r}")
    params: dict[str, Any] = {"queue_name": queue, "limit": limit, "at": now_ms, "msg_key": key}
    if after is not None:
        params.update(after_at=after[0], after_id=after[1], after_key=after[2])
    if key_prefix:
        params.update(prefix_bounds(key_prefix))
    if tag_pattern is not None:
        params["tag_pattern"] = tag_pattern
    filters = (bool(key_prefix), key is not None, after is not None)
    if kept is not None:
        stmt = _stmts(conn, tables).memo(_kept_rows, kept, *filters, tag_pattern is not None, key_order)
    else:
        shape = (dead, None if dead else state, *filters, key_order, tag_pattern is not None)
        stmt = _stmts(conn, tables).memo(_rows, *shape)
    return conn.execute(stmt, params).all()


def _flow(stmts: Statements) -> sa.Select[Any]:
    m = stmts.tables.messages
    below = _ms("below")
    return sa.select(
        sa.func.count().label("n"),
        sa.func.max(m.c.id).label("top"),
        sa.func.coalesce(sa.func.sum(sa.case((m.c.id <= below, 1), else_=0)), 0).label("old"),
    ).where(m.c.queue == sa.bindparam("queue_name"))


def flow(conn: Connection, tables: Tables, queue: str, below: int) -> tuple[int, int | None, int]:
    """A queue's live messages: how many, the highest id, and how many have an id at or below ``below``."""
    r = conn.execute(_stmts(conn, tables).memo(_flow), {"queue_name": queue, "below": below}).one()
    return int(r.n), None if r.top is None else int(r.top), int(r.old)


def _oldest_tokens(stmts: Statements) -> sa.Select[Any]:
    m = stmts.tables.messages
    return (
        sa.select(m.c.queue, sa.func.min(m.c.lock_token).label("token"))
        .where(
            m.c.queue.in_(_names()),
            m.c.lock_token.like("________-____-7%"),  # (tokens of an older delayq tell no time)
            m.c.scheduled_at > _ms("at"),
        )
        .group_by(m.c.queue)
    )


def oldest_tokens(conn: Connection, tables: Tables, names: Sequence[str], now_ms: int) -> dict[str, str]:
    """Per queue of ``names``, the smallest lock token of a claim unexpired at ``now_ms`` among the tokens
    that tell their claim's time (``_tokens.new_token``: the smallest is the oldest claim)."""
    if not names:
        return {}
    rows = conn.execute(_stmts(conn, tables).memo(_oldest_tokens), {"names": list(names), "at": now_ms})
    return {r.queue: r.token for r in rows}


def _recent_failures(stmts: Statements, dead: bool) -> sa.Select[Any]:
    m, gone = stmts.tables.messages, stmts.tables.dead_letters
    limit = sa.bindparam("limit", type_=sa.Integer)
    if dead:
        return (
            sa.select(gone.c.queue, gone.c.key, gone.c.attempt_history, gone.c.last_error)
            .where(gone.c.queue.in_(_names()))
            .order_by(gone.c.failed_at.desc(), gone.c.id.desc())
            .limit(limit)
        )
    return (
        sa.select(m.c.queue, m.c.key, m.c.attempt_history, m.c.last_error)
        .where(m.c.queue.in_(_names()), m.c.last_error.is_not(None), m.c.lock_token.is_(None))
        .order_by(m.c.scheduled_at.desc())
        .limit(limit)
    )


def recent_failures(
    conn: Connection, tables: Tables, names: Sequence[str], *, dead: bool, limit: int
) -> Sequence[Row[Any]]:
    """The latest failures in queues ``names``: messages awaiting a retry (latest due first) or, with ``dead``,
    dead letters (latest first). Columns: queue, key, attempt_history, last_error."""
    if not names:
        return []
    params = {"names": list(names), "limit": limit}
    return conn.execute(_stmts(conn, tables).memo(_recent_failures, dead), params).all()


def _rows_under(stmts: Statements, by_queue: bool) -> sa.Select[Any]:
    m = stmts.tables.messages
    stmt = sa.select(m.c.queue, m.c.key, m.c.scheduled_at, m.c.lock_token, m.c.attempts).where(
        stmts.starts_with(m.c.key)
    )
    return stmt.where(m.c.queue == sa.bindparam("queue_name")) if by_queue else stmt


def rows_under(conn: Connection, tables: Tables, bounds: dict[str, str], queue: str | None) -> Sequence[Row[Any]]:
    """The live messages (of ``queue``, or of every queue) whose key lies in ``bounds`` (``prefix_lo`` /
    ``prefix_hi``, as ``prefix_bounds`` makes them). Columns: queue, key, scheduled_at, lock_token, attempts."""
    params = {**bounds, "queue_name": queue}
    return conn.execute(_stmts(conn, tables).memo(_rows_under, queue is not None), params).all()


def _dead_count(stmts: Statements) -> sa.Select[Any]:
    dead = stmts.tables.dead_letters
    return sa.select(sa.func.count()).where(
        dead.c.queue == sa.bindparam("queue_name"), dead.c.key == sa.bindparam("msg_key")
    )


def dead_count(conn: Connection, tables: Tables, queue: str, key: str) -> int:
    """How many dead letters ``queue`` holds under ``key``."""
    return int(conn.execute(_stmts(conn, tables).memo(_dead_count), {"queue_name": queue, "msg_key": key}).scalar_one())


# -- the Spark data source's reads of a queue's messages or dead letters, by id -----------------------
def _scanned(tables: Tables, dead: bool, finished: bool = False) -> sa.Table:
    return tables.finished if finished else tables.dead_letters if dead else tables.messages


def _scan_where(
    t: sa.Table, queue: str | None, where: Sequence[sa.ColumnElement[bool]], low: int | None, high: int | None
) -> list[sa.ColumnElement[bool]]:
    return [
        *([] if queue is None else [t.c.queue == queue]),
        *([] if low is None else [t.c.id >= low]),
        *([] if high is None else [t.c.id <= high]),
        *where,
    ]


def scan_span(
    conn: Connection,
    tables: Tables,
    *,
    dead: bool,
    queue: str | None,
    where: Sequence[sa.ColumnElement[bool]] = (),
    low: int | None = None,
    high: int | None = None,
    finished: bool = False,
) -> tuple[int | None, int | None, int]:
    """The lowest and highest id and the count of the rows (of ``queue``, or all; ids ``low..high``) that
    match ``where`` (conditions over the table's columns: the data source's pushed filters); of the live
    messages, the dead letters (``dead``) or the kept finished messages (``finished``)."""
    t = _scanned(tables, dead, finished)
    query = sa.select(sa.func.min(t.c.id), sa.func.max(t.c.id), sa.func.count()).where(
        *_scan_where(t, queue, where, low, high)
    )
    first, last, rows = conn.execute(query).one()
    return first, last, int(rows)


def scan_rows(
    tables: Tables,
    *,
    dead: bool,
    queue: str | None,
    names: Sequence[str] | None = None,
    where: Sequence[sa.ColumnElement[bool]] = (),
    low: int | None = None,
    high: int | None = None,
    finished: bool = False,
) -> sa.Select[Any]:
    """The query of the columns ``names`` (None: all) of those rows, by id, for the caller to stream."""
    t = _scanned(tables, dead, finished)
    columns = [t] if names is None else [t.c[n] for n in names]
    return sa.select(*columns).where(*_scan_where(t, queue, where, low, high)).order_by(t.c.id)


def _flow_row(stmts: Statements) -> sa.Select[Any]:
    flow = stmts.tables.flow
    return sa.select(flow.c.queue).where(flow.c.queue == sa.bindparam("queue_name", type_=sa.String))


def has_flow_row(conn: Connection, tables: Tables, queue: str) -> bool:
    """Whether ``queue`` has a row in ``{prefix}queue_flow`` (its flow was ever set)."""
    return conn.execute(_stmts(conn, tables).memo(_flow_row), {"queue_name": queue}).first() is not None
