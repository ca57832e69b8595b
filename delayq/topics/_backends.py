"""The topic operations whose shape differs per backend, chosen by the dialect's capabilities.

The shared shapes are one statement each. Where lists bind as arrays (PostgreSQL, ``Dialect.arrays``) a
list of pairs travels as two arrays and ``unnest`` turns them into rows: one statement text whatever
the list's length, and a small plan. Where an UPDATE cannot return rows (MySQL/MariaDB,
``Dialect.update_returning``) an ack locks the rows first, then updates them by offset.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from delayq.dialects import Dialect
from delayq.dialects.base import claim_limit
from delayq.schema import TopicTables
from delayq.topics._status import ACKED, PENDING

S = TypeVar("S")


class _Stmts(Protocol):
    """What these operations use of ``delayq.topics.statements.TopicStatements`` (which builds on this module)."""

    @property
    def kind(self) -> type[Dialect]: ...
    @property
    def tables(self) -> TopicTables: ...
    @property
    def existing_ids(self) -> sa.Executable: ...
    @property
    def ack_pairs(self) -> sa.Executable: ...
    @property
    def ack_in_order(self) -> sa.Executable: ...
    @property
    def insert_log(self) -> sa.Insert: ...
    @property
    def now_expr(self) -> sa.ColumnElement[int]: ...

    def memo(self, build: Callable[..., S], *args: Any) -> S: ...


HEAD_SLOTS = 512
"""Partitions per statement of ``set_heads``'s shared shape (two parameters each)."""

FEW_HEADS = 8
"""Up to this many heads, ``set_heads`` takes the shared CASE where lists bind as arrays too."""


def existing_ids(conn: Connection, stmts: _Stmts, topic: str, pairs: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
    """The ``(partition_key, message_id)`` of ``pairs`` that ``topic``'s log holds, in one read.

    The shared shape: ``(partition_key, message_id) IN ((…), (…))``.
    """
    if stmts.kind.arrays:
        # `(partition_key, message_id) IN (500 pairs)` costs 80-90 ms of planning (500 OR-ed index
        # conditions); a join to `unnest` of two arrays plans in well under 1 ms, and its LATERAL probe
        # with LIMIT 1 keeps it a nested loop over the unique index, where a plain join on stale
        # statistics hashes every log row of the topic.
        params = {"topic_name": topic, "keys": [k for k, _ in pairs], "ids": [m for _, m in pairs]}
        return {(r.partition_key, r.message_id) for r in conn.execute(stmts.memo(_existing_ids_unnest), params)}
    rows = conn.execute(stmts.existing_ids, {"topic_name": topic, "pairs": list(pairs)})
    return {(r.partition_key, r.message_id) for r in rows}


def insert_log_rows(
    conn: Connection,
    stmts: _Stmts,
    topic: str,
    payload_type: str,
    now: int,
    rows: Sequence[tuple[int, int, str, str, bytes, Mapping[str, Any] | None]],
) -> None:
    """Insert log rows, each (partition, offset, partition key, message id, payload, its other columns or None).

    The shared shape: one executemany of the INSERT (SQLAlchemy sends it as multi-row VALUES). PostgreSQL,
    rows without other columns: ``INSERT … SELECT :topic, … FROM unnest(:parts, :offsets, :keys, :ids,
    :payloads)``, five arrays whatever the batch (a tenth of the client's work per row).
    """
    if stmts.kind.arrays and all(r[5] is None for r in rows):
        columns = list(zip(*(r[:5] for r in rows), strict=True))
        params = {"topic_name": topic, "ptype": payload_type, "now_v": now}
        params.update(zip(("parts", "offsets", "keys", "ids", "payloads"), map(list, columns), strict=True))
        conn.execute(stmts.memo(_insert_log_unnest), params)
        return
    named = ("partition", "message_offset", "partition_key", "message_id", "payload")
    values = [
        {"topic": topic, "payload_type": payload_type, "published_at": now, **dict(zip(named, r[:5], strict=True))}
        | dict(r[5] or {})
        for r in rows
    ]
    conn.execute(stmts.insert_log, values)


def _insert_log_unnest(stmts: _Stmts) -> sa.Insert:
    log = stmts.tables.log
    appended = stmts.kind.unnest(
        "appended",
        ("parts", sa.Integer()),
        ("offsets", sa.BigInteger()),
        ("keys", sa.String()),
        ("ids", sa.String()),
        ("payloads", sa.LargeBinary()),
    )
    row = sa.select(
        sa.bindparam("topic_name", type_=sa.String),
        appended.c.parts,
        appended.c.offsets,
        appended.c["keys"],
        appended.c.ids,
        appended.c.payloads,
        sa.bindparam("ptype", type_=sa.String),
        sa.bindparam("now_v", type_=sa.BigInteger),
    )
    names = ["topic", "partition", "message_offset", "partition_key", "message_id", "payload", "payload_type"]
    return sa.insert(log).from_select([*names, "published_at"], row)


def set_heads(conn: Connection, stmts: _Stmts, topic: str, heads: Mapping[int, int]) -> None:
    """Set the head of each partition of ``heads`` (partition -> new head), in one statement.

    The shared shape: ``UPDATE … SET head = CASE partition WHEN :p0 THEN :h0 … END WHERE partition
    IN (:p0, …)``, one round trip instead of one per partition. Its text depends on the number of
    slots only, rounded up to a power of two (the last pair repeated), so few statements are
    compiled and cached; a batch over more than ``HEAD_SLOTS`` partitions takes several.
    """
    if stmts.kind.arrays and len(heads) > FEW_HEADS:
        # More than a few heads by UPDATE … FROM unnest of two arrays, one statement text whatever their
        # number (a generic plan of it, on statistics taken while the table was small, reads the topic's
        # every head row: cheap for a batch, ten times the cost of a single publish's one-row update, so a
        # few heads, a single publish or a dead letter, take the shared CASE, whose IN list probes the key).
        arrays = {"topic_name": topic, "parts": list(heads), "new_heads": list(heads.values())}
        conn.execute(stmts.memo(_set_heads_unnest), arrays)
        return
    items = sorted(heads.items())
    for start in range(0, len(items), HEAD_SLOTS):
        chunk = items[start : start + HEAD_SLOTS]
        slots = 1 << (len(chunk) - 1).bit_length()
        chunk += [chunk[-1]] * (slots - len(chunk))
        params: dict[str, Any] = {"topic_name": topic}
        for i, (partition, head) in enumerate(chunk):
            params[f"p{i}"], params[f"h{i}"] = partition, head
        conn.execute(stmts.memo(set_heads_case, slots), params)


def ack(
    conn: Connection, stmts: _Stmts, key: Mapping[str, Any], pairs: Sequence[tuple[int, int]]
) -> set[tuple[int, int]]:
    """Mark acked the pending deliveries ``pairs`` (offset, attempt count) of one partition (``key``); the
    pairs it marked.

    The shared shape: one ``UPDATE … WHERE status = 0 AND (message_offset, attempts) IN (…)
    RETURNING message_offset, attempts``.
    """
    if stmts.kind.arrays:
        # The pairs as two arrays (see ``existing_ids``): one statement text, a small plan.
        params = {**key, "offsets": [o for o, _ in pairs], "attempt_nos": [a for _, a in pairs]}
        return {(int(r.message_offset), int(r.attempts)) for r in conn.execute(stmts.memo(_ack_unnest), params)}
    if not stmts.kind.update_returning:
        # No UPDATE … RETURNING: lock the pending deliveries among the pairs (by primary key, this
        # transaction keeps them until it ends), then mark those acked by offset.
        locked = conn.execute(stmts.memo(_ackable), {**key, "pairs": list(pairs)}).all()
        if locked:
            conn.execute(stmts.memo(_ack_offsets), {**key, "offsets": [r.message_offset for r in locked]})
        return {(int(r.message_offset), int(r.attempts)) for r in locked}
    rows = conn.execute(stmts.ack_pairs, {**key, "pairs": list(pairs)})
    return {(int(r.message_offset), int(r.attempts)) for r in rows}


RANGE_SLOTS = 64
"""Partitions per statement of ``read_ranges``, ``set_ranges`` and ``ack_runs`` (a poll's batch is at most this)."""


def _slots(n: int) -> int:
    """``n`` rounded up to a power of two: a handful of statement texts serve every batch."""
    return 1 << (n - 1).bit_length()


def _padded(items: Sequence[S]) -> list[S]:
    """``items`` padded to a power of two by repeating the last (the same condition twice changes nothing)."""
    return [*items, *[items[-1]] * (_slots(len(items)) - len(items))]


def read_ranges(
    conn: Connection, stmts: _Stmts, key: Mapping[str, Any], ranges: Sequence[tuple[int, int, int]], dead: bool
) -> list[Any]:
    """The log rows (with payloads) of ``ranges``, each ``(partition, after, upto)``: offsets in ``(after,
    upto]``, by partition and offset, in one read per ``RANGE_SLOTS`` ranges; with ``dead`` (a dead-letter
    topic) their failure columns too.

    The shared shape: a ``UNION ALL`` of one primary-key range scan per partition (an ``OR`` of the ranges
    lets PostgreSQL scan every partition's offsets between the lowest and the highest bound).
    """
    if stmts.kind.arrays:
        # Three arrays joined LATERAL to the range scan: one statement text whatever the batch.
        params = {"topic_name": key["topic_name"], **_range_arrays(ranges)}
        return list(conn.execute(stmts.memo(_read_ranges_unnest, dead), params).all())
    out: list[Any] = []
    for start in range(0, len(ranges), RANGE_SLOTS):
        chunk = list(ranges[start : start + RANGE_SLOTS])
        slots = _slots(len(chunk))
        chunk += [(-1, 0, 0)] * (slots - len(chunk))  # padding: there is no partition -1
        bound: dict[str, Any] = {"topic_name": key["topic_name"]}
        for i, (p, after, upto) in enumerate(chunk):
            bound[f"p{i}"], bound[f"a{i}"], bound[f"b{i}"] = p, after, upto
        out += conn.execute(stmts.memo(_read_ranges, slots, dead), bound).all()
    return out


def read_and_move_ranges(
    conn: Connection,
    stmts: _Stmts,
    key: Mapping[str, Any],
    ranges: Sequence[tuple[int, int, int]],
    dead: bool,
    until: int,
) -> list[Any]:
    """``read_ranges`` and ``set_ranges`` of what it read, in one statement (only where ``writable_cte``): each
    partition's delivered offset moves to the last offset read, its range deadline to ``until``.

        WITH read AS (<read_ranges' unnest LATERAL read>),
             moved AS (UPDATE topic_offsets SET delivered_offset = last.top, range_until = :until
                       FROM (SELECT partition, max(message_offset) AS top FROM read GROUP BY partition) AS last
                       WHERE <the group's> AND partition = last.partition)
        SELECT * FROM read ORDER BY partition, message_offset
    """
    params = {**key, **_range_arrays(ranges), "until": until}
    return list(conn.execute(stmts.memo(_read_and_move_ranges, dead), params).all())


def _range_arrays(ranges: Sequence[tuple[int, int, int]]) -> dict[str, Any]:
    """``ranges`` as the arrays ``_read_ranges_unnest`` binds, and the widest range's width."""
    return {
        "parts": [p for p, _, _ in ranges],
        "afters": [a for _, a, _ in ranges],
        "uptos": [b for _, _, b in ranges],
        "width": max(b - a for _, a, b in ranges),
    }


def _read_and_move_ranges(stmts: _Stmts, dead: bool) -> sa.Select[Any]:
    off = stmts.tables.offsets
    read = _read_ranges_unnest(stmts, dead).order_by(None).cte("read")
    last = (
        sa.select(read.c.partition, sa.func.max(read.c.message_offset).label("top"))
        .group_by(read.c.partition)
        .subquery("last")
    )
    parts = sa.bindparam("parts", type_=sa.ARRAY(sa.Integer))
    moved = (
        sa.update(off)
        # (the ANY: the offsets rows by primary key, not the group's every row joined to the few moved)
        .where(_group_offsets(stmts), off.c.partition == sa.any_(parts), off.c.partition == last.c.partition)
        .values(delivered_offset=last.c.top, range_until=sa.bindparam("until", type_=sa.BigInteger))
        .cte("moved")
    )
    return sa.select(read).add_cte(moved).order_by(read.c.partition, read.c.message_offset)


def set_ranges(conn: Connection, stmts: _Stmts, key: Mapping[str, Any], sent: Mapping[int, int], until: int) -> None:
    """Set each partition's delivered offset (``sent``: partition -> offset) and the range deadline ``until``.

    The shared shape: ``UPDATE … SET delivered_offset = CASE partition WHEN :p0 THEN :d0 … END, range_until
    = :until WHERE … AND partition IN (:p0, …)``; PostgreSQL past a few partitions: ``FROM unnest`` of two
    arrays.
    """
    if stmts.kind.arrays and len(sent) > FEW_HEADS:
        params = {**key, "parts": list(sent), "sent_offsets": list(sent.values()), "until": until}
        conn.execute(stmts.memo(_set_ranges_unnest), params)
        return
    items = sorted(sent.items())
    for start in range(0, len(items), RANGE_SLOTS):
        chunk = _padded(items[start : start + RANGE_SLOTS])
        params = {"group": key["group"], "topic_name": key["topic_name"], "until": until}
        for i, (p, d) in enumerate(chunk):
            params[f"p{i}"], params[f"d{i}"] = p, d
        conn.execute(stmts.memo(_set_ranges_case, len(chunk)), params)


def ack_runs(
    conn: Connection, stmts: _Stmts, key: Mapping[str, Any], runs: Mapping[int, tuple[int, int]], now: int
) -> set[int]:
    """Ack in order: move the watermark of each partition of ``runs`` (partition -> (after, upto)) from
    ``after`` to ``upto`` where every offset between is in its range at attempt 1 (the watermark is
    ``after``, the delivered offset at least ``upto``, no row above the watermark); the partitions moved.

    The shared shape: one ``UPDATE … SET acked_offset = CASE partition … END WHERE … AND ((partition = :p0
    AND acked_offset = :a0 AND delivered_offset >= :u0 AND marked_upto <= :a0) OR …) RETURNING partition``.
    MySQL/MariaDB (no UPDATE … RETURNING): one UPDATE per partition, its row count.
    """
    g = {"group": key["group"], "topic_name": key["topic_name"], "now_v": now}
    if not stmts.kind.update_returning:
        return {
            p
            for p, (after, upto) in sorted(runs.items())
            if conn.execute(stmts.ack_in_order, {**g, "part": p, "after": after, "upto": upto}).rowcount == 1
        }
    items = sorted(runs.items())
    moved: set[int] = set()
    for start in range(0, len(items), RANGE_SLOTS):
        chunk = _padded(items[start : start + RANGE_SLOTS])
        params = dict(g)
        for i, (p, (after, upto)) in enumerate(chunk):
            params[f"p{i}"], params[f"a{i}"], params[f"u{i}"] = p, after, upto
        moved.update(int(r.partition) for r in conn.execute(stmts.memo(_ack_runs_case, len(chunk)), params))
    return moved


def ack_runs_fenced(
    conn: Connection, stmts: _Stmts, key: Mapping[str, Any], runs: Mapping[int, tuple[int, int, int]]
) -> set[int]:
    """``ack_runs`` with its fence, in one statement (only where ``fence_in_update``): ``runs`` is partition ->
    (epoch, after, upto); the partitions moved. ``key`` holds the group, topic, ``me`` and, on an injected
    clock, ``now``.

        UPDATE topic_offsets SET acked_offset = CASE partition … END, updated_at = <now>
        WHERE <the group's> AND (<ack_runs' conditions>)
          AND partition = ANY((SELECT array_agg(partition) FROM (SELECT partition FROM topic_leases
                               WHERE <the group's> AND holder = :me AND (partition, epoch) IN (…)
                               ORDER BY partition FOR SHARE) AS fenced))
        RETURNING partition

    The sub-select runs once, before the UPDATE locks any row, so the fences are taken first and in order, as
    a poll's are; a lease stolen meanwhile (an UPDATE of its row) is waited for and then not matched.
    """
    items = sorted(runs.items())
    moved: set[int] = set()
    for start in range(0, len(items), RANGE_SLOTS):
        chunk = _padded(items[start : start + RANGE_SLOTS])
        params = dict(key)
        for i, (p, (epoch, after, upto)) in enumerate(chunk):
            params[f"p{i}"], params[f"e{i}"], params[f"a{i}"], params[f"u{i}"] = p, epoch, after, upto
        moved.update(int(r.partition) for r in conn.execute(stmts.memo(_ack_runs_fenced, len(chunk)), params))
    return moved


def _ack_runs_fenced(stmts: _Stmts, slots: int) -> sa.Update:
    le = stmts.tables.leases
    parts = [sa.bindparam(f"p{i}", type_=sa.Integer) for i in range(slots)]
    epochs = [sa.bindparam(f"e{i}", type_=sa.BigInteger) for i in range(slots)]
    fences = (
        sa.select(le.c.partition)
        .where(
            le.c.consumer_group == sa.bindparam("group", type_=sa.String),
            le.c.topic == sa.bindparam("topic_name", type_=sa.String),
            le.c.holder == sa.bindparam("me", type_=sa.String),
            sa.or_(*(sa.and_(le.c.partition == p, le.c.epoch == e) for p, e in zip(parts, epochs, strict=True))),
        )
        .order_by(le.c.partition)
        .with_for_update(read=True)
        .subquery("fenced")
    )
    # (cast: ``= ANY((SELECT …))`` compares with one array; ``= ANY(SELECT …)`` would compare with each row)
    fenced = sa.cast(sa.select(sa.func.array_agg(fences.c.partition)).scalar_subquery(), sa.ARRAY(sa.Integer))
    off = stmts.tables.offsets
    return _ack_runs_case(stmts, slots).where(off.c.partition == sa.any_(fenced)).values(updated_at=stmts.now_expr)


def _log_columns(stmts: _Stmts, dead: bool) -> list[sa.ColumnElement[Any]]:
    log = stmts.tables.log
    names = ("partition", "message_offset", "partition_key", "message_id", "payload", "payload_type", "published_at")
    failure = ("original_topic", "original_offset", "failed_group", "failed_at", "failure_count", "last_error")
    return [log.c[n] for n in (*names, *(failure if dead else ()))]


def _read_ranges(stmts: _Stmts, slots: int, dead: bool) -> sa.CompoundSelect[Any]:
    log = stmts.tables.log
    each = [
        sa.select(*_log_columns(stmts, dead)).where(
            log.c.topic == sa.bindparam("topic_name", type_=sa.String),
            log.c.partition == sa.bindparam(f"p{i}", type_=sa.Integer),
            log.c.message_offset > sa.bindparam(f"a{i}", type_=sa.BigInteger),
            log.c.message_offset <= sa.bindparam(f"b{i}", type_=sa.BigInteger),
        )
        for i in range(slots)
    ]
    union = sa.union_all(*each)
    return union.order_by(union.selected_columns.partition, union.selected_columns.message_offset)


def _read_ranges_unnest(stmts: _Stmts, dead: bool) -> sa.Select[Any]:
    log = stmts.tables.log
    asked = stmts.kind.unnest("asked", ("parts", sa.Integer()), ("afters", sa.BigInteger()), ("uptos", sa.BigInteger()))
    found = (
        sa.select(*_log_columns(stmts, dead))
        .where(
            log.c.topic == sa.bindparam("topic_name", type_=sa.String),
            log.c.partition == asked.c.parts,
            log.c.message_offset > asked.c.afters,
            log.c.message_offset <= asked.c.uptos,
        )
        # A LIMIT (the widest range: it cuts nothing) keeps the LATERAL a loop of primary-key range scans,
        # one per partition, whatever the statistics: without one PostgreSQL may flatten it into a join that
        # reads every log row of the topic (a table analyzed while small: a hash join over all of them).
        .order_by(log.c.message_offset)
        .limit(sa.bindparam("width", type_=sa.Integer))
        .lateral("found")
    )
    return (
        sa.select(*(found.c[c.name] for c in _log_columns(stmts, dead)))
        .select_from(asked.join(found, sa.true()))
        .order_by(found.c.partition, found.c.message_offset)
    )


def _group_offsets(stmts: _Stmts) -> sa.ColumnElement[bool]:
    off = stmts.tables.offsets
    return sa.and_(
        off.c.consumer_group == sa.bindparam("group", type_=sa.String),
        off.c.topic == sa.bindparam("topic_name", type_=sa.String),
    )


def _set_ranges_case(stmts: _Stmts, slots: int) -> sa.Update:
    off = stmts.tables.offsets
    parts = [sa.bindparam(f"p{i}", type_=sa.Integer) for i in range(slots)]
    sent = sa.case(
        *((p, sa.bindparam(f"d{i}", type_=sa.BigInteger)) for i, p in enumerate(parts)), value=off.c.partition
    )
    return (
        sa.update(off)
        .where(_group_offsets(stmts), off.c.partition.in_(parts))
        .values(delivered_offset=sent, range_until=sa.bindparam("until", type_=sa.BigInteger))
    )


def _ack_runs_case(stmts: _Stmts, slots: int) -> sa.Update:
    off = stmts.tables.offsets
    parts = [sa.bindparam(f"p{i}", type_=sa.Integer) for i in range(slots)]
    afters = [sa.bindparam(f"a{i}", type_=sa.BigInteger) for i in range(slots)]
    uptos = [sa.bindparam(f"u{i}", type_=sa.BigInteger) for i in range(slots)]
    each = [
        sa.and_(
            off.c.partition == p,
            off.c.acked_offset == a,
            off.c.delivered_offset >= u,
            off.c.marked_upto <= a,
        )
        for p, a, u in zip(parts, afters, uptos, strict=True)
    ]
    return (
        sa.update(off)
        .where(_group_offsets(stmts), sa.or_(*each))
        .values(
            acked_offset=sa.case(*zip(parts, uptos, strict=True), value=off.c.partition),
            updated_at=sa.bindparam("now_v", type_=sa.BigInteger),
        )
        .returning(off.c.partition)
    )


def _set_ranges_unnest(stmts: _Stmts) -> sa.Update:
    off = stmts.tables.offsets
    new = stmts.kind.unnest("moved", ("parts", sa.Integer()), ("sent_offsets", sa.BigInteger()))
    return (
        sa.update(off)
        .where(_group_offsets(stmts), off.c.partition == new.c.parts)
        .values(delivered_offset=new.c.sent_offsets, range_until=sa.bindparam("until", type_=sa.BigInteger))
    )


def publish_one(
    conn: Connection,
    stmts: _Stmts,
    topic: str,
    item: tuple[int, str, str, bytes],
    payload_type: str,
    wake: tuple[str, str] | None = None,
) -> bool:
    """Publish one message in one statement, on its own (autocommitted: the head row stays locked for the
    statement only); whether it was created (False: its id is in the log). Where ``writable_cte``:

        WITH moved AS (UPDATE topic_heads SET head = head + 1 WHERE topic = :t AND partition = :p
                        AND NOT EXISTS (SELECT 1 FROM topic_log WHERE topic = :t AND partition_key = :k
                                        AND message_id = :m)
                       RETURNING head, <now>)
        INSERT INTO topic_log (…) SELECT :t, :p, moved.head, :k, :m, … FROM moved RETURNING message_offset

    The head and the row commit together, so offsets stay gap-free and in commit order. The lookup reads
    the statement's snapshot: the same id published at the same moment by another transaction fails the
    unique constraint (``IntegrityError``), and the caller publishes it again the general way.

    ``wake``: (channel, payload) of a notification the same statement sends when it created the row
    (``SELECT …, pg_notify(:channel, :wake) FROM (the INSERT … RETURNING)``): delivered at its commit.
    """
    partition, key, mid, payload = item
    params = {"topic_name": topic, "part": partition, "key": key, "mid": mid, "payload": payload, "ptype": payload_type}
    if not stmts.kind.writable_cte:
        # The same in two statements of the caller's transaction (``Topic.publish``'s own): the head moved
        # unless the id is in the log, then the row at that head (the row this transaction just locked).
        if conn.execute(stmts.memo(_move_head_unless_there), params).rowcount != 1:
            return False
        conn.execute(stmts.memo(_insert_at_head), params)
        return True
    if wake is None:
        return conn.execute(stmts.memo(_publish_one), params).first() is not None
    channel, wake_payload = wake
    return conn.execute(stmts.memo(_publish_one_waking, channel), {**params, "wake": wake_payload}).first() is not None


def _move_head_unless_there(stmts: _Stmts) -> sa.Update:
    heads, log = stmts.tables.heads, stmts.tables.log
    topic = sa.bindparam("topic_name", type_=sa.String)
    key, mid = sa.bindparam("key", type_=sa.String), sa.bindparam("mid", type_=sa.String)
    there = sa.exists().where(log.c.topic == topic, log.c.partition_key == key, log.c.message_id == mid)
    return (
        sa.update(heads)
        .where(heads.c.topic == topic, heads.c.partition == sa.bindparam("part", type_=sa.Integer), ~there)
        .values(head=heads.c.head + 1)
    )


def _insert_at_head(stmts: _Stmts) -> sa.Insert:
    heads, log = stmts.tables.heads, stmts.tables.log
    topic = sa.bindparam("topic_name", type_=sa.String)
    part = sa.bindparam("part", type_=sa.Integer)
    row = sa.select(
        heads.c.topic,
        heads.c.partition,
        heads.c.head,
        sa.bindparam("key", type_=sa.String),
        sa.bindparam("mid", type_=sa.String),
        sa.bindparam("payload", type_=sa.LargeBinary),
        sa.bindparam("ptype", type_=sa.String),
        stmts.now_expr,
    ).where(heads.c.topic == topic, heads.c.partition == part)
    names = ["topic", "partition", "message_offset", "partition_key", "message_id", "payload", "payload_type"]
    return sa.insert(log).from_select([*names, "published_at"], row)


def _publish_one_waking(stmts: _Stmts, channel: str) -> sa.Select[Any]:
    inserted = _publish_one(stmts).cte("inserted")
    return sa.select(inserted.c.message_offset, sa.func.pg_notify(channel, sa.bindparam("wake", type_=sa.String)))


def _publish_one(stmts: _Stmts) -> sa.Insert:
    heads, log = stmts.tables.heads, stmts.tables.log
    topic = sa.bindparam("topic_name", type_=sa.String)
    part = sa.bindparam("part", type_=sa.Integer)
    key, mid = sa.bindparam("key", type_=sa.String), sa.bindparam("mid", type_=sa.String)
    there = sa.exists().where(log.c.topic == topic, log.c.partition_key == key, log.c.message_id == mid)
    moved = (
        sa.update(heads)
        .where(heads.c.topic == topic, heads.c.partition == part, ~there)
        .values(head=heads.c.head + 1)
        .returning(heads.c.head, stmts.now_expr.label("now"))
        .cte("moved")
    )
    row = sa.select(
        topic,
        part,
        moved.c.head,
        key,
        mid,
        sa.bindparam("payload", type_=sa.LargeBinary),
        sa.bindparam("ptype", type_=sa.String),
        moved.c.now,
    )
    names = ["topic", "partition", "message_offset", "partition_key", "message_id", "payload", "payload_type"]
    return sa.insert(log).from_select([*names, "published_at"], row).returning(log.c.message_offset)


def set_heads_case(stmts: _Stmts, slots: int) -> sa.Update:
    """UPDATE the head of partition ``:p{i}`` of ``:topic_name`` to ``:h{i}``, for ``i`` below ``slots``."""
    heads = stmts.tables.heads
    parts = [sa.bindparam(f"p{i}", type_=sa.Integer) for i in range(slots)]
    new = sa.case(
        *((p, sa.bindparam(f"h{i}", type_=sa.BigInteger)) for i, p in enumerate(parts)), value=heads.c.partition
    )
    return (
        sa.update(heads)
        .where(heads.c.topic == sa.bindparam("topic_name", type_=sa.String), heads.c.partition.in_(parts))
        .values(head=new)
    )


# -- lists as arrays (PostgreSQL) ---------------------------------------------------------------------------
def _existing_ids_unnest(stmts: _Stmts) -> sa.Select[Any]:
    log = stmts.tables.log
    asked = stmts.kind.unnest("asked", ("keys", sa.String()), ("ids", sa.String()))
    found = (
        sa.select(sa.literal_column("1").label("found"))
        .where(
            log.c.topic == sa.bindparam("topic_name", type_=sa.String),
            log.c.partition_key == asked.c["keys"],
            log.c.message_id == asked.c.ids,
        )
        .limit(claim_limit(1))
        .lateral("found")
    )
    return sa.select(asked.c["keys"].label("partition_key"), asked.c.ids.label("message_id")).select_from(
        asked.join(found, sa.true())
    )


def _set_heads_unnest(stmts: _Stmts) -> sa.Update:
    heads = stmts.tables.heads
    new = stmts.kind.unnest("moved", ("parts", sa.Integer()), ("new_heads", sa.BigInteger()))
    return (
        sa.update(heads)
        .where(
            heads.c.topic == sa.bindparam("topic_name", type_=sa.String),
            heads.c.partition == new.c.parts,
        )
        .values(head=new.c.new_heads)
    )


def _ack_unnest(stmts: _Stmts) -> sa.Update:
    dl = stmts.tables.deliveries
    acked = stmts.kind.unnest("acked", ("offsets", sa.BigInteger()), ("attempt_nos", sa.Integer()))
    return (
        sa.update(dl)
        .where(
            dl.c.consumer_group == sa.bindparam("group", type_=sa.String),
            dl.c.topic == sa.bindparam("topic_name", type_=sa.String),
            dl.c.partition == sa.bindparam("part", type_=sa.Integer),
            dl.c.message_offset == acked.c.offsets,
            dl.c.attempts == acked.c.attempt_nos,
            dl.c.status == PENDING,
        )
        .values(status=ACKED)
        .returning(dl.c.message_offset, dl.c.attempts)
    )


# -- no UPDATE … RETURNING (MySQL/MariaDB) --------------------------------------------------------------------
def _pending_of_partition(stmts: _Stmts) -> sa.ColumnElement[bool]:
    dl = stmts.tables.deliveries
    return sa.and_(
        dl.c.consumer_group == sa.bindparam("group", type_=sa.String),
        dl.c.topic == sa.bindparam("topic_name", type_=sa.String),
        dl.c.partition == sa.bindparam("part", type_=sa.Integer),
        dl.c.status == PENDING,
    )


def _ackable(stmts: _Stmts) -> sa.Select[Any]:
    """The offsets of ``:pairs`` (offset, attempt count) pending in partition ``:part`` of the group, locked."""
    dl = stmts.tables.deliveries
    pairs = sa.tuple_(dl.c.message_offset, dl.c.attempts).in_(sa.bindparam("pairs", expanding=True))
    return sa.select(dl.c.message_offset, dl.c.attempts).where(_pending_of_partition(stmts), pairs).with_for_update()


def _ack_offsets(stmts: _Stmts) -> sa.Update:
    """Mark acked the pending deliveries ``:offsets`` of partition ``:part`` of the group."""
    dl = stmts.tables.deliveries
    offsets = dl.c.message_offset.in_(sa.bindparam("offsets", expanding=True))
    return sa.update(dl).where(_pending_of_partition(stmts), offsets).values(status=ACKED)
