"""The topic reads of the Spark data source: a topic's heads, its log by offsets, a group's watermarks
(``delayq.spark.read`` and ``delayq.spark.stream`` reach the topic tables only through these).

The fixed shapes are built once per table set (``TopicStatements.memo``); those whose shape depends on
the partitions asked for are built per call. ``where`` arguments are the data source's pushed filters,
already turned into conditions over the log's columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from delayq.topics.statements import TopicStatements


def _s(name: str) -> Any:
    return sa.bindparam(name, type_=sa.String)


def _i(name: str) -> Any:
    return sa.bindparam(name, type_=sa.BigInteger)


def _partition_count(stmts: TopicStatements) -> sa.Select[Any]:
    t = stmts.tables.topics
    return sa.select(t.c.partitions).where(t.c.topic == _s("topic_name"))


def _heads(stmts: TopicStatements) -> sa.Select[Any]:
    h = stmts.tables.heads
    return sa.select(h.c.partition, h.c.head, h.c.collected).where(h.c.topic == _s("topic_name"))


def heads(conn: Connection, stmts: TopicStatements, topic: str) -> dict[int, tuple[int, int]] | None:
    """Each partition's committed head and collected offset; None when the topic does not exist."""
    params = {"topic_name": topic}
    if conn.execute(stmts.memo(_partition_count), params).scalar() is None:
        return None
    return {int(r.partition): (int(r.head), int(r.collected)) for r in conn.execute(stmts.memo(_heads), params)}


def _collected(stmts: TopicStatements) -> sa.Select[Any]:
    h = stmts.tables.heads
    return sa.select(h.c.collected).where(h.c.topic == _s("topic_name"), h.c.partition == _i("part"))


def collected(conn: Connection, stmts: TopicStatements, topic: str, partition: int) -> int:
    """The offset a partition's log is collected up to."""
    return int(conn.execute(stmts.memo(_collected), {"topic_name": topic, "part": partition}).scalar_one())


def rows_per_partition(
    conn: Connection, stmts: TopicStatements, topic: str, ranges: Mapping[int, tuple[int, int] | None]
) -> dict[int, int]:
    """How many log rows each partition holds (offsets in ``(after, upto]`` where a range is given, else
    all): rows, not offsets, since a dead-letter topic's log has gaps."""
    log = stmts.tables.log
    if not ranges:
        return {}
    each = [
        sa.and_(log.c.partition == int(p))
        if r is None
        else sa.and_(log.c.partition == int(p), log.c.message_offset > r[0], log.c.message_offset <= r[1])
        for p, r in ranges.items()
    ]
    counted = conn.execute(
        sa.select(log.c.partition, sa.func.count()).where(log.c.topic == topic, sa.or_(*each)).group_by(log.c.partition)
    )
    return {int(p): int(n) for p, n in counted}


def kth_offset(conn: Connection, stmts: TopicStatements, topic: str, partition: int, after: int, k: int) -> int:
    """The offset of the ``k``-th row (from 1) of a partition's log above ``after``."""
    log = stmts.tables.log
    query = (
        sa.select(log.c.message_offset)
        .where(log.c.topic == topic, log.c.partition == partition, log.c.message_offset > after)
        .order_by(log.c.message_offset)
        .limit(1)
        .offset(k - 1)
    )
    return int(conn.execute(query).scalar_one())


def log_rows(
    stmts: TopicStatements,
    names: Sequence[str],
    topic: str,
    partition: int,
    after: int,
    upto: int,
    where: Sequence[sa.ColumnElement[bool]] = (),
) -> sa.Select[Any]:
    """The query of a partition's log columns ``names`` at offsets in ``(after, upto]``, oldest first
    (for the caller to stream)."""
    log = stmts.tables.log
    return (
        sa.select(*(log.c[n] for n in names))
        .where(
            log.c.topic == topic,
            log.c.partition == partition,
            log.c.message_offset > after,
            log.c.message_offset <= upto,
            *where,
        )
        .order_by(log.c.message_offset)
    )


def _group_offsets(stmts: TopicStatements) -> sa.Select[Any]:
    off = stmts.tables.offsets
    return sa.select(off.c.partition, off.c.acked_offset).where(
        off.c.consumer_group == _s("group"), off.c.topic == _s("topic_name")
    )


def group_offsets(conn: Connection, stmts: TopicStatements, group: str, topic: str) -> dict[int, int]:
    """A consumer group's watermark (acked offset) per partition of ``topic``."""
    rows = conn.execute(stmts.memo(_group_offsets), {"group": group, "topic_name": topic})
    return {int(r.partition): int(r.acked_offset) for r in rows}


def _raise_offset(stmts: TopicStatements) -> sa.Update:
    off = stmts.tables.offsets
    upto = _i("upto")
    return (
        sa.update(off)
        .where(
            off.c.consumer_group == _s("group"),
            off.c.topic == _s("topic_name"),
            off.c.partition == _i("part"),
            off.c.acked_offset < upto,
        )
        .values(acked_offset=upto, updated_at=_i("now_v"))
    )


def raise_offsets(
    conn: Connection, stmts: TopicStatements, group: str, topic: str, ends: Mapping[int, int], now: int
) -> None:
    """Move the group's watermarks of ``topic`` up to ``ends`` (partition → offset), never down."""
    key = {"group": group, "topic_name": topic, "now_v": now}
    for p, upto in ends.items():
        conn.execute(stmts.memo(_raise_offset), {**key, "part": int(p), "upto": upto})
