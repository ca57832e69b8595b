"""A topic's garbage collection in bounded batches, one collector per partition at a time (the worker's).

Each partition is collected in transactions of its own, each deleting at most ``batch`` messages: those
at or below the lowest watermark of the topic's groups (what every group is done with) and, with
``keep_for``, published at least that long ago. A partition no group reads is kept whole; a message a
group still needs is never deleted, whatever its age.

Who collects is decided by the database, not by an election: a collector locks the partition's head
row and the topic's row with ``SKIP LOCKED``, so of several collectors (workers of any number of
processes) one takes a partition and the others pass it by; one that finds it locked by a publisher
passes it by too, and comes back at its next round. It never waits for a row lock. Offsets are
gap-free, so an offset range of ``batch`` holds at most ``batch`` messages. On SQLite (one writer at a
time) the transactions take turns.
"""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from delayq.dialects import Dialect
from delayq.errors import InvalidInputError
from delayq.humanize import exact
from delayq.schema import TopicTables
from delayq.topics._context import TopicContext

BATCH = 1000
"""Messages deleted per transaction at most, by default."""


@dataclass(frozen=True)
class Collected:
    """What one collection did: messages deleted, and partitions passed by (another collector or a
    publisher held them; collected at a later round)."""

    deleted: int = 0
    skipped: int = 0

    def __add__(self, other: Collected) -> Collected:
        return Collected(self.deleted + other.deleted, self.skipped + other.skipped)


class _Statements:
    """The collector's own statements (the lowest watermark and the delete are the topic's)."""

    def __init__(self, dialect: Dialect, t: TopicTables) -> None:
        heads, log = t.heads, t.log
        topic, part = sa.bindparam("topic_name", type_=sa.String), sa.bindparam("part", type_=sa.Integer)
        head_key = sa.and_(heads.c.topic == topic, heads.c.partition == part)
        topic_key = t.topics.c.topic == topic
        self.claim_head: Any
        self.claim_topic: Any
        if dialect.row_locks:
            self.claim_head = sa.select(heads.c.collected).where(head_key).with_for_update(skip_locked=True)
            self.claim_topic = sa.select(t.topics.c.partitions).where(topic_key).with_for_update(skip_locked=True)
        else:  # the one writer lock, taken by a write (see ``statements._locking``)
            self.claim_head = (
                sa.update(heads).where(head_key).values(collected=heads.c.collected).returning(heads.c.collected)
            )
            self.claim_topic = sa.select(t.topics.c.partitions).where(topic_key)
        # The first offset in the range that is too young to go (keep_for).
        self.first_young = sa.select(sa.func.min(log.c.message_offset)).where(
            log.c.topic == topic,
            log.c.partition == part,
            log.c.message_offset > sa.bindparam("above", type_=sa.BigInteger),
            log.c.message_offset <= sa.bindparam("upto", type_=sa.BigInteger),
            log.c.published_at > sa.bindparam("cutoff", type_=sa.BigInteger),
        )


def _statements(ctx: TopicContext, dialect: Dialect) -> _Statements:
    return dialect.cached(("topic_gc", ctx.prefix, ctx.schema), lambda: _Statements(dialect, ctx.tables.topics))


def check_retention(keep_for: dt.timedelta, batch: int) -> None:
    """Refuse a negative ``keep_for`` or a ``batch`` below 1 (``InvalidInputError``, one line)."""
    if not isinstance(keep_for, dt.timedelta) or keep_for < dt.timedelta(0):
        shown = exact(keep_for) if isinstance(keep_for, dt.timedelta) else repr(keep_for)
        raise InvalidInputError(f"keep_for must be a timedelta of 0 or more, got {shown}")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InvalidInputError(f"batch must be a positive int, got {batch!r}")


def collect(
    ctx: TopicContext,
    topic: str,
    *,
    keep_for: dt.timedelta = dt.timedelta(0),
    batch: int = BATCH,
    max_batches: int | None = None,
) -> Collected:
    """Collect ``topic``'s log: every collectable partition, ``batch`` messages per transaction, until none
    is left or ``max_batches`` transactions ran (None: no bound). Never waits for a row lock. ``topic`` is
    any topic in the database (a dead-letter topic's name may be longer than ``Topic`` accepts)."""
    check_retention(keep_for, batch)

    def find(conn: Connection, dialect: Dialect) -> list[int]:
        rows = conn.execute(ctx.stmts(dialect).collectable, {"topic_name": topic})
        return sorted(int(r.partition) for r in rows)

    total, runs = Collected(), 0
    pending = ctx.runner.run(None, find, "read")
    while pending and (max_batches is None or runs < max_batches):
        more = []
        for partition in pending:
            if max_batches is not None and runs >= max_batches:
                break
            runs += 1
            one = functools.partial(_batch, ctx=ctx, topic=topic, partition=partition, keep_for=keep_for, batch=batch)
            done, full = ctx.runner.run(None, one, "transaction")
            total += done
            if full:  # a whole batch went: there may be more
                more.append(partition)
        pending = more
    return total


def _batch(
    conn: Connection,
    dialect: Dialect,
    *,
    ctx: TopicContext,
    topic: str,
    partition: int,
    keep_for: dt.timedelta,
    batch: int,
) -> tuple[Collected, bool]:
    """One transaction over one partition: (what it did, whether it deleted a whole batch)."""
    own, stmts = _statements(ctx, dialect), ctx.stmts(dialect)
    key = {"topic_name": topic, "part": partition}
    collected = conn.execute(own.claim_head, key).scalar()
    if collected is None or conn.execute(own.claim_topic, key).first() is None:
        return Collected(skipped=1), False  # another collector or a publisher holds it (or it is gone)
    low = conn.execute(stmts.lowest_watermark, key).scalar()
    if low is None or low <= collected:
        return Collected(), False
    upto = min(int(low), int(collected) + batch)
    if keep_for:
        cutoff = ctx.now(conn, stmts) - to_ms_delta(keep_for)
        young = conn.execute(own.first_young, {**key, "above": collected, "upto": upto, "cutoff": cutoff}).scalar()
        if young is not None:
            upto = int(young) - 1
    if upto <= collected:
        return Collected(), False
    deleted = int(conn.execute(stmts.collect, {**key, "upto": upto}).rowcount)
    conn.execute(stmts.set_collected, {**key, "upto": upto})
    return Collected(deleted=deleted), upto - int(collected) == batch


def to_ms_delta(delta: dt.timedelta) -> int:
    """A duration in whole milliseconds."""
    return delta // dt.timedelta(milliseconds=1)
