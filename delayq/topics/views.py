"""Operator views of topics: what ``delayq topics ls``, ``delayq topics lag`` and ``delayq topics groups ls`` show."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from delayq.clock import Clock, from_ms, to_ms
from delayq.dialects import dialect_for
from delayq.schema import DEFAULT_PREFIX, TopicTables, make_tables
from delayq.topics.names import DLQ_SUFFIX
from delayq.topics.statements import PENDING


@dataclass(frozen=True)
class TopicSummary:
    """A topic: its partitions, the sum of their head offsets and how many messages the log still holds
    (for a dead-letter topic, whose letters an operator may requeue or purge, a count of its rows)."""

    topic: str
    partitions: int
    published: int
    retained: int


@dataclass(frozen=True)
class PartitionLag:
    """One partition as one consumer group sees it."""

    partition: int
    head: int
    watermark: int
    lag: int
    pending: int
    holder: str | None
    epoch: int
    lease_expires_at: dt.datetime | None
    lease_acquired_at: dt.datetime | None = None
    lease_age: dt.timedelta | None = None
    """How long the holder has held the lease (since it took it), on the database's clock; None when free."""


@dataclass(frozen=True)
class GroupSummary:
    """A consumer group of a topic: the partitions it has watermarks of, its lag over them, its deliveries
    in flight, and its live subscribers (those not deregistered; a Spark query's group has none)."""

    group: str
    partitions: int
    lag: int
    pending: int
    subscribers: int


def _in_flight(conn: sa.Connection, t: TopicTables, topic: str, group: str | None) -> dict[tuple[str, int], int]:
    """Deliveries in flight per (group, partition) of ``topic`` (of ``group`` alone when given): the pending
    rows above the watermark, plus the offsets of the in-flight range that have no row (counted by offsets;
    docs/topics.md, "Delivery state")."""
    return {(g, p): n for (_, g, p), n in _in_flight_of(conn, t, topic, group).items()}


def _in_flight_of(
    conn: sa.Connection, t: TopicTables, topic: str | None, group: str | None
) -> dict[tuple[str, str, int], int]:
    """``_in_flight`` per (topic, group, partition), of every topic when ``topic`` is None."""
    off, dl = t.offsets, t.deliveries
    same = sa.and_(
        dl.c.consumer_group == off.c.consumer_group, dl.c.topic == off.c.topic, dl.c.partition == off.c.partition
    )
    above = dl.c.message_offset > off.c.acked_offset
    only = (
        *(() if topic is None else (off.c.topic == topic,)),
        *(() if group is None else (off.c.consumer_group == group,)),
    )
    counts = (
        sa.select(
            off.c.topic,
            off.c.consumer_group,
            off.c.partition,
            sa.func.sum(sa.case((sa.and_(above, dl.c.status == PENDING), 1), else_=0)).label("pending_rows"),
            sa.func.sum(sa.case((sa.and_(above, dl.c.message_offset <= off.c.delivered_offset), 1), else_=0)).label(
                "range_rows"
            ),
        )
        .select_from(off.join(dl, same))
        .where(*only)
        .group_by(off.c.topic, off.c.consumer_group, off.c.partition)
    )
    ranges = sa.select(
        off.c.topic, off.c.consumer_group, off.c.partition, off.c.acked_offset, off.c.delivered_offset
    ).where(off.c.delivered_offset > off.c.acked_offset, *only)
    found: dict[tuple[str, str, int], int] = {}
    rows = {(r.topic, r.consumer_group, int(r.partition)): r for r in conn.execute(counts)}
    for k, r in rows.items():
        found[k] = int(r.pending_rows or 0)
    for r in conn.execute(ranges):
        k = (r.topic, r.consumer_group, int(r.partition))
        marked = rows.get(k)
        in_range = int(r.delivered_offset) - int(r.acked_offset) - (int(marked.range_rows or 0) if marked else 0)
        found[k] = found.get(k, 0) + max(0, in_range)
    return found


def list_groups(
    engine: Engine, topic: str, *, table_prefix: str = DEFAULT_PREFIX, schema: str | None = None
) -> list[GroupSummary]:
    """Every consumer group reading ``topic``, by name (three reads)."""
    return groups_by_topic(engine, topic, table_prefix=table_prefix, schema=schema).get(topic, [])


def groups_by_topic(
    engine: Engine, topic: str | None = None, *, table_prefix: str = DEFAULT_PREFIX, schema: str | None = None
) -> dict[str, list[GroupSummary]]:
    """The consumer groups of every topic (of ``topic`` alone when given), by topic and name: three reads
    whatever the number of topics (``delayq top``)."""
    t = make_tables(table_prefix, schema).topics
    off, heads, sub = t.offsets, t.heads, t.subscribers
    progress = (
        sa.select(
            off.c.topic,
            off.c.consumer_group,
            sa.func.count().label("partitions"),
            sa.func.sum(heads.c.head - off.c.acked_offset).label("lag"),
        )
        .select_from(off.join(heads, sa.and_(heads.c.topic == off.c.topic, heads.c.partition == off.c.partition)))
        .where(*(() if topic is None else (off.c.topic == topic,)))
        .group_by(off.c.topic, off.c.consumer_group)
        .order_by(off.c.topic, off.c.consumer_group)
    )
    members = (
        sa.select(sub.c.topic, sub.c.consumer_group, sa.func.count().label("n"))
        .where(sub.c.deregistered_at.is_(None), *(() if topic is None else (sub.c.topic == topic,)))
        .group_by(sub.c.topic, sub.c.consumer_group)
    )
    with engine.connect() as conn:
        found = conn.execute(progress).all()
        in_flight: dict[tuple[str, str], int] = {}
        for (name, g, _), n in _in_flight_of(conn, t, topic, None).items():
            in_flight[name, g] = in_flight.get((name, g), 0) + n
        live = {(r.topic, r.consumer_group): int(r.n) for r in conn.execute(members)}
    groups: dict[str, list[GroupSummary]] = {}
    for r in found:
        key = (r.topic, r.consumer_group)
        lag, flying = int(r.lag or 0), in_flight.get(key, 0)
        summary = GroupSummary(r.consumer_group, int(r.partitions), lag, flying, live.get(key, 0))
        groups.setdefault(r.topic, []).append(summary)
    return groups


def list_topics(engine: Engine, *, table_prefix: str = DEFAULT_PREFIX, schema: str | None = None) -> list[TopicSummary]:
    """Every topic, by name (two reads; a third counts the rows of dead-letter topics)."""
    t = make_tables(table_prefix, schema).topics
    heads = (
        sa.select(
            t.heads.c.topic,
            sa.func.sum(t.heads.c.head).label("published"),
            sa.func.sum(t.heads.c.head - t.heads.c.collected).label("retained"),
        )
        .group_by(t.heads.c.topic)
        .subquery()
    )
    query = (
        sa.select(t.topics.c.topic, t.topics.c.partitions, heads.c.published, heads.c.retained)
        .select_from(t.topics.outerjoin(heads, heads.c.topic == t.topics.c.topic))
        .order_by(t.topics.c.topic)
    )
    with engine.connect() as conn:
        found = [
            TopicSummary(r.topic, int(r.partitions), int(r.published or 0), int(r.retained or 0))
            for r in conn.execute(query)
        ]
        # Requeue and purge delete a dead-letter topic's rows below its head: count what is left.
        names = {s.topic for s in found}
        dead = [s.topic for s in found if s.topic.endswith(DLQ_SUFFIX) and s.topic[: -len(DLQ_SUFFIX)] in names]
        if dead:
            log = t.log
            rows = conn.execute(
                sa.select(log.c.topic, sa.func.count().label("n")).where(log.c.topic.in_(dead)).group_by(log.c.topic)
            )
            counts = {r.topic: int(r.n) for r in rows}
            found = [
                TopicSummary(s.topic, s.partitions, s.published, counts.get(s.topic, 0)) if s.topic in dead else s
                for s in found
            ]
        return found


def group_lag(
    engine: Engine,
    topic: str,
    group: str,
    *,
    table_prefix: str = DEFAULT_PREFIX,
    schema: str | None = None,
    clock: Clock | None = None,
) -> list[PartitionLag]:
    """Per partition of ``topic`` for ``group``: head, watermark, lag, deliveries not done, and the lease.

    ``lag`` is head minus watermark (messages not yet passed by the watermark, including those
    acked out of order); ``pending`` counts delivered messages not acked or dead-lettered;
    ``lease_age`` is now minus when the holder took the lease, now on the database's clock (or
    ``clock``, as the subscribers' own).
    """
    t = make_tables(table_prefix, schema).topics
    off, heads, le = t.offsets, t.heads, t.leases
    query = (
        sa.select(
            off.c.partition,
            heads.c.head,
            off.c.acked_offset,
            le.c.holder,
            le.c.epoch,
            le.c.acquired_at,
            le.c.expires_at,
        )
        .select_from(
            off.join(heads, sa.and_(heads.c.topic == off.c.topic, heads.c.partition == off.c.partition)).outerjoin(
                le,
                sa.and_(
                    le.c.consumer_group == off.c.consumer_group,
                    le.c.topic == off.c.topic,
                    le.c.partition == off.c.partition,
                ),
            )
        )
        .where(off.c.consumer_group == group, off.c.topic == topic)
        .order_by(off.c.partition)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
        in_flight = _in_flight(conn, t, topic, group)
        if clock is not None:
            now = to_ms(clock.now())
        else:
            now = int(conn.execute(sa.select(dialect_for(engine).now_ms())).scalar_one())
    return [
        PartitionLag(
            int(r.partition),
            int(r.head),
            int(r.acked_offset),
            int(r.head) - int(r.acked_offset),
            in_flight.get((group, int(r.partition)), 0),
            r.holder,
            int(r.epoch or 0),
            from_ms(int(r.expires_at)) if r.holder is not None else None,
            from_ms(int(r.acquired_at)) if r.holder is not None else None,
            dt.timedelta(milliseconds=max(0, now - int(r.acquired_at))) if r.holder is not None else None,
        )
        for r in rows
    ]


@dataclass(frozen=True)
class SubscriberBeat:
    """A subscriber of a consumer group as its heartbeats show it."""

    group: str
    subscriber: str
    heartbeat_at: dt.datetime
    """Its last heartbeat, on the database's clock (or its injected one)."""
    deregistered_at: dt.datetime | None
    """When it left (closed its subscription); None while it is a member."""


def list_subscribers(
    engine: Engine, topic: str, *, table_prefix: str = DEFAULT_PREFIX, schema: str | None = None
) -> list[SubscriberBeat]:
    """The subscribers of ``topic``'s consumer groups with their last heartbeat, by group and name (one read)."""
    sub = make_tables(table_prefix, schema).topics.subscribers
    query = (
        sa.select(sub.c.consumer_group, sub.c.subscriber, sub.c.heartbeat_at, sub.c.deregistered_at)
        .where(sub.c.topic == topic)
        .order_by(sub.c.consumer_group, sub.c.subscriber)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [
        SubscriberBeat(
            r.consumer_group,
            r.subscriber,
            from_ms(int(r.heartbeat_at)),
            None if r.deregistered_at is None else from_ms(int(r.deregistered_at)),
        )
        for r in rows
    ]
