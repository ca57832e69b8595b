"""The statements of topics, built once per engine, table set and clock mode.

Every statement is a SQLAlchemy Core construct with named bind parameters. "Now" is read once per
transaction, by the first statement (``now`` is the database's clock expression, or the bind
parameter ``:now`` on an injected clock), and bound as a number after that. The upsert comes from
the dialect (``Dialect.topic_upsert``); a read under a row lock is a write where the dialect has no
row locks (``Dialect.row_locks``, see ``_locking``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from delayq.dialects import Dialect
from delayq.dialects.base import Memo
from delayq.schema import TopicTables, make_tables
from delayq.topics import _backends
from delayq.topics._status import ACKED as ACKED
from delayq.topics._status import DEAD as DEAD
from delayq.topics._status import PENDING as PENDING

S = TypeVar("S")


def _bp(name: str, type_: Any = sa.BigInteger) -> Any:
    return sa.bindparam(name, type_=type_)


def _s(name: str) -> Any:
    return sa.bindparam(name, type_=sa.String)


def _locking(
    dialect: Dialect,
    touch: sa.Column[Any],
    where: sa.ColumnElement[bool],
    columns: Sequence[sa.ColumnElement[Any]],
    *,
    read: bool = False,
    order_by: sa.Column[Any] | None = None,
) -> sa.Select[Any] | sa.Update:
    """``columns`` of the rows ``where``, read under their lock: ``SELECT … FOR UPDATE`` (``FOR SHARE``
    with ``read``), in ``order_by`` order.

    Without row locks (SQLite) it is an ``UPDATE`` setting ``touch`` to itself ``RETURNING`` them: a write,
    so it takes the one writer lock before it reads. A plain read would see the database as it was
    before the lock, in a caller's transaction that pysqlite begins at its first write.
    """
    table = touch.table
    if dialect.row_locks:
        query = sa.select(*columns).where(where).with_for_update(read=read)
        return query if order_by is None else query.order_by(order_by)
    return sa.update(table).where(where).values({touch.name: touch}).returning(*columns)


class TopicStatements(Memo):
    """The statements over one set of topic tables."""

    def __init__(self, dialect: Dialect, t: TopicTables, now: sa.ColumnElement[int]) -> None:
        topic, group, part = _s("topic_name"), _s("group"), _bp("part", sa.Integer)
        log, heads, dl, le, off, sub = t.log, t.heads, t.deliveries, t.leases, t.offsets, t.subscribers
        self.tables = t
        self.kind = type(dialect)  # the class, not the object: no cycle between a dialect and its statements
        super().__init__()
        self.now = sa.select(now.label("now"))
        self.now_expr = now

        # -- topics and publishing --------------------------------------------------------------
        self.create_topic = dialect.topic_upsert(t.topics, ["topic"], None).values(
            topic=topic, partitions=_bp("partition_count", sa.Integer), created_at=_bp("now_v")
        )
        self.partitions = sa.select(t.topics.c.partitions).where(t.topics.c.topic == topic)
        self.create_head = dialect.topic_upsert(heads, ["topic", "partition"], None).values(
            topic=topic, partition=part, head=0, collected=0
        )
        head_key = sa.and_(heads.c.topic == topic, heads.c.partition == part)
        # (The heads a batch moved are set by ``_backends.set_heads``: one statement.)
        # Locked in ascending partition order (PostgreSQL locks the rows as the sort emits them; InnoDB
        # as it walks the primary key), as every publisher does: two batches cannot deadlock.
        self.lock_heads = _locking(
            dialect,
            heads.c.head,
            sa.and_(heads.c.topic == topic, heads.c.partition.in_(sa.bindparam("parts", expanding=True))),
            [heads.c.partition, heads.c.head, now.label("now")],
            order_by=heads.c.partition,
        )
        # The shared shape of ``_backends.existing_ids`` (PostgreSQL looks the ids up otherwise).
        self.existing_ids = sa.select(log.c.partition_key, log.c.message_id).where(
            log.c.topic == topic,
            sa.tuple_(log.c.partition_key, log.c.message_id).in_(sa.bindparam("pairs", expanding=True)),
        )
        self.insert_log = sa.insert(log)
        self.heads_of_topic = (
            sa.select(heads.c.partition, heads.c.head, heads.c.collected)
            .where(heads.c.topic == topic)
            .order_by(heads.c.partition)
        )

        # -- groups ------------------------------------------------------------------------------
        self.group_partitions = sa.select(sa.func.count()).where(off.c.consumer_group == group, off.c.topic == topic)
        # The topic's row, locked: shared by a group being created, exclusive by a collection of the log
        # (after its head row). Publishers never lock it, so a new group does not wait for them.
        this_topic = t.topics.c.topic == topic
        self.lock_topic_shared = _locking(
            dialect, t.topics.c.partitions, this_topic, [t.topics.c.partitions], read=True
        )
        self.lock_topic = _locking(dialect, t.topics.c.partitions, this_topic, [t.topics.c.partitions])
        self.create_lease = dialect.topic_upsert(le, ["consumer_group", "topic", "partition"], None).values(
            consumer_group=group, topic=topic, partition=part, holder=None, epoch=0, acquired_at=0, expires_at=0
        )
        self.create_offset = dialect.topic_upsert(off, ["consumer_group", "topic", "partition"], None).values(
            consumer_group=group, topic=topic, partition=part, acked_offset=_bp("acked"), updated_at=_bp("now_v")
        )

        # -- membership ----------------------------------------------------------------------------
        self.heartbeat = dialect.topic_upsert(
            sub,
            ["consumer_group", "topic", "subscriber"],
            {
                "heartbeat_at": _bp("now_v"),
                "deregistered_at": None,
            },
        ).values(consumer_group=group, topic=topic, subscriber=_s("me"), heartbeat_at=_bp("now_v"))
        self.live_subscribers = sa.select(sa.func.count()).where(
            sub.c.consumer_group == group,
            sub.c.topic == topic,
            sub.c.deregistered_at.is_(None),
            sub.c.heartbeat_at > _bp("live_after"),
        )
        self.deregister = (
            sa.update(sub)
            .where(sub.c.consumer_group == group, sub.c.topic == topic, sub.c.subscriber == _s("me"))
            .values(deregistered_at=_bp("now_v"))
        )
        group_leases = sa.and_(le.c.consumer_group == group, le.c.topic == topic)
        mine = sa.and_(group_leases, le.c.holder == _s("me"))
        # Read after ``renew``, whose UPDATE locked exactly these rows: a locking SELECT would, on
        # MariaDB, scan the group's rows by primary key and wait for any row another transaction locked.
        self.my_leases = sa.select(le.c.partition, le.c.epoch).where(mine).order_by(le.c.partition)
        self.renew = sa.update(le).where(mine).values(expires_at=_bp("until"))
        parts_in = le.c.partition.in_(sa.bindparam("parts", expanding=True))
        self.release = sa.update(le).where(mine, parts_in).values(holder=None, expires_at=0)
        self.release_all = sa.update(le).where(mine).values(holder=None, expires_at=0)
        free = sa.or_(le.c.holder.is_(None), le.c.expires_at <= _bp("now_v"))
        self.free_leases = (
            sa.select(le.c.partition)
            .where(group_leases, free)
            .order_by(le.c.partition)
            .limit(_bp("limit", sa.Integer))
            .with_for_update(skip_locked=True)
        )
        self.take = (
            sa.update(le)
            .where(group_leases, parts_in, free)
            .values(holder=_s("me"), epoch=le.c.epoch + 1, acquired_at=_bp("now_v"), expires_at=_bp("until"))
        )
        self.taken = sa.select(le.c.partition, le.c.epoch).where(mine, parts_in)
        lease_key = sa.and_(group_leases, le.c.partition == part)
        held = sa.and_(lease_key, le.c.holder == _s("me"), le.c.epoch == _bp("lease_epoch"))
        # Fencing: a holder's write runs after one of these found its lease (holder and epoch) and
        # locked the row, so a steal (an UPDATE of that row) waits for it, and every write after a
        # steal finds the epoch changed.
        # The watermark is read by a statement of its own after the exclusive fence, never by the fence:
        # under READ COMMITTED a statement that waited for the lease lock still reads other rows as of
        # its start, so a fence queued behind another exclusive holder's watermark advance would read
        # the old watermark (and take the offsets the advance forgot for never delivered).
        off_key = sa.and_(off.c.consumer_group == group, off.c.topic == topic, off.c.partition == part)
        self.watermark = sa.select(off.c.acked_offset).where(off_key)
        self.hold_exclusive = sa.select(now.label("now")).where(held).with_for_update()
        self.hold_shared = sa.select(now.label("now")).where(held).with_for_update(read=True)

        # -- consuming -------------------------------------------------------------------------------
        self.group_offsets = (
            sa.select(off.c.partition, off.c.acked_offset)
            .where(off.c.consumer_group == group, off.c.topic == topic)
            .order_by(off.c.partition)
        )
        self.set_watermark = sa.update(off).where(off_key).values(acked_offset=_bp("acked"), updated_at=_bp("now_v"))
        # The group's state and the head of each partition: of the whole group (``group_progress``, for a
        # subscriber holding many partitions), or of the partitions ``:parts`` (``with_work``); and now.
        self.group_progress = (
            sa.select(
                off.c.partition,
                off.c.acked_offset,
                off.c.delivered_offset,
                off.c.range_until,
                off.c.marked_upto,
                heads.c.head,
                now.label("now"),
            )
            .select_from(off.join(heads, sa.and_(heads.c.topic == off.c.topic, heads.c.partition == off.c.partition)))
            .where(off.c.consumer_group == group, off.c.topic == topic)
        )
        self.with_work = self.group_progress.where(dialect.any_of(off.c.partition, "parts"))
        # -- the in-flight range (docs/topics.md, "Delivery state") ----------------------------------------
        # The fences of several partitions at once (a poll's exclusive, an ack's shared), in ascending order.
        mine_in = sa.and_(mine, dialect.any_of(le.c.partition, "parts"))
        fences = sa.select(le.c.partition, le.c.epoch, now.label("now")).where(mine_in).order_by(le.c.partition)
        self.fence_many_shared = fences.with_for_update(read=True)
        # A poll's: the fences and their offsets rows, both locked by one statement. A locking read returns
        # the latest committed version of each row it locks (PostgreSQL reads a row again that changed while
        # it waited for its lock; InnoDB's locking reads read the latest version), so the watermark it reads
        # is the one the last holder committed (see Fencing); and a requeue's raise of marked_upto commits
        # with its log row, so a poll that reads the log after this sees both or neither.
        same_offsets = sa.and_(
            off.c.consumer_group == le.c.consumer_group, off.c.topic == le.c.topic, off.c.partition == le.c.partition
        )
        self.fence_many = (
            sa.select(
                le.c.partition,
                le.c.epoch,
                now.label("now"),
                off.c.acked_offset,
                off.c.delivered_offset,
                off.c.range_until,
                off.c.marked_upto,
            )
            .select_from(le.join(off, same_offsets))
            .where(mine_in)
            .order_by(le.c.partition)
            .with_for_update()
        )
        offset = _bp("offset")
        # A delivery of the range about to get a row: only while it is in the range (else: lost), raising
        # marked_upto (this locks the offsets row until the transaction ends).
        self.mark = (
            sa.update(off)
            .where(off_key, off.c.acked_offset < offset, off.c.delivered_offset >= offset)
            .values(marked_upto=dialect.greatest(off.c.marked_upto, offset))
        )
        # The same for several deliveries of a partition at once: all of them in the range, or none marked.
        self.mark_span = (
            sa.update(off)
            .where(off_key, off.c.acked_offset < _bp("low"), off.c.delivered_offset >= offset)
            .values(marked_upto=dialect.greatest(off.c.marked_upto, offset))
        )
        self.raise_mark = sa.update(off).where(off_key).values(marked_upto=dialect.greatest(off.c.marked_upto, offset))
        self.materialize = dialect.topic_upsert(
            dl, ["consumer_group", "topic", "partition", "message_offset"], None
        ).values(
            consumer_group=group,
            topic=topic,
            partition=part,
            message_offset=offset,
            status=PENDING,
            invisible_until=_bp("until"),
            attempts=1,
        )
        self.set_range = sa.update(off).where(off_key).values(delivered_offset=_bp("sent"), range_until=_bp("until"))
        # An ack in order of one partition (MySQL/MariaDB; the others ack several partitions in one statement).
        self.ack_in_order = (
            sa.update(off)
            .where(
                off_key,
                off.c.acked_offset == _bp("after"),
                off.c.delivered_offset >= _bp("upto"),
                off.c.marked_upto <= _bp("after"),
            )
            .values(acked_offset=_bp("upto"), updated_at=_bp("now_v"))
        )
        log_part = sa.and_(log.c.topic == topic, log.c.partition == part)
        self.offsets_between = (
            sa.select(log.c.message_offset)
            .where(log_part, log.c.message_offset > _bp("after"), log.c.message_offset <= _bp("upto"))
            .order_by(log.c.message_offset)
        )
        self.offsets_after = (
            sa.select(log.c.message_offset)
            .where(log_part, log.c.message_offset > _bp("after"))
            .order_by(log.c.message_offset)
            .limit(_bp("limit", sa.Integer))
        )
        dl_part = sa.and_(dl.c.consumer_group == group, dl.c.topic == topic, dl.c.partition == part)
        self.states = sa.select(dl.c.message_offset, dl.c.status, dl.c.invisible_until, dl.c.attempts).where(
            dl_part, dl.c.message_offset > _bp("after"), dl.c.message_offset <= _bp("upto")
        )
        self.forget_states = sa.delete(dl).where(dl_part, dl.c.message_offset <= _bp("upto"))
        # A group's states of partitions it has no watermark of: left by a group whose topic_offsets rows
        # were deleted; ``join`` deletes them before it creates the group's rows again.
        self.forget_orphan_states = sa.delete(dl).where(
            dl.c.consumer_group == group,
            dl.c.topic == topic,
            dl.c.partition.not_in(
                sa.select(off.c.partition).where(off.c.consumer_group == group, off.c.topic == topic)
            ),
        )
        # The group's states at or below its watermark of their partition, of every partition at once
        # (a Spark query's commit, which moves the watermarks of many partitions).
        passed = (
            sa.select(off.c.acked_offset)
            .where(
                off.c.consumer_group == dl.c.consumer_group,
                off.c.topic == dl.c.topic,
                off.c.partition == dl.c.partition,
            )
            .scalar_subquery()
        )
        self.forget_passed_states = sa.delete(dl).where(
            dl.c.consumer_group == group, dl.c.topic == topic, dl.c.message_offset <= passed
        )
        self.messages = sa.select(
            log.c.message_offset,
            log.c.partition_key,
            log.c.message_id,
            log.c.payload,
            log.c.payload_type,
            log.c.published_at,
            log.c.original_topic,
            log.c.original_offset,
            log.c.failed_group,
            log.c.failed_at,
            log.c.failure_count,
            log.c.last_error,
        ).where(log_part, log.c.message_offset.in_(sa.bindparam("offsets", expanding=True)))
        self.insert_state = sa.insert(dl)
        offs_in = dl.c.message_offset.in_(sa.bindparam("offsets", expanding=True))
        self.redeliver = (
            sa.update(dl)
            .where(dl_part, offs_in, dl.c.status == PENDING)
            .values(attempts=dl.c.attempts + 1, invisible_until=_bp("until"))
        )
        this = sa.and_(
            dl_part,
            dl.c.message_offset == _bp("offset"),
            dl.c.status == PENDING,
            dl.c.attempts == _bp("attempt_no", sa.Integer),
        )
        self.ack = sa.update(dl).where(this).values(status=ACKED)
        # The shared shape of ``_backends.ack``: several deliveries of a partition, each by its
        # (offset, attempt count); MySQL/MariaDB (no UPDATE … RETURNING) and PostgreSQL ack otherwise.
        self.ack_pairs = (
            sa.update(dl)
            .where(
                dl_part,
                dl.c.status == PENDING,
                sa.tuple_(dl.c.message_offset, dl.c.attempts).in_(sa.bindparam("pairs", expanding=True)),
            )
            .values(status=ACKED)
            .returning(dl.c.message_offset, dl.c.attempts)
        )
        self.nack = sa.update(dl).where(this).values(invisible_until=_bp("until"), last_error=_bp("error", sa.Text))
        # Given back unprocessed (a stopping worker's unstarted message): visible again, the attempt not counted.
        self.give_back = sa.update(dl).where(this).values(invisible_until=_bp("until"), attempts=dl.c.attempts - 1)
        self.extend = (
            sa.update(dl).where(this).values(invisible_until=dialect.greatest(dl.c.invisible_until, _bp("until")))
        )
        self.visible_until = sa.select(dl.c.invisible_until).where(dl_part, dl.c.message_offset == _bp("offset"))
        self.bury = sa.update(dl).where(this).values(status=DEAD, last_error=_bp("error", sa.Text))

        # -- garbage collection ------------------------------------------------------------------------
        lowest = (
            sa.select(off.c.partition, sa.func.min(off.c.acked_offset).label("low"))
            .where(off.c.topic == topic)
            .group_by(off.c.partition)
            .subquery()
        )
        self.collectable = (
            sa.select(heads.c.partition, lowest.c.low)
            .select_from(heads.join(lowest, lowest.c.partition == heads.c.partition))
            .where(heads.c.topic == topic, lowest.c.low > heads.c.collected)
        )
        self.lock_collected = _locking(dialect, heads.c.collected, head_key, [heads.c.collected])
        self.lowest_watermark = sa.select(sa.func.min(off.c.acked_offset)).where(
            off.c.topic == topic, off.c.partition == part
        )
        self.collect = sa.delete(log).where(log_part, log.c.message_offset <= _bp("upto"))
        self.set_collected = sa.update(heads).where(head_key).values(collected=_bp("upto"))

        # -- dead letters (an operator's requeue and purge) ----------------------------------------------
        parts: Any = sa.bindparam("parts", expanding=True)
        # The groups reading partitions of a topic (by the (topic, partition) index of topic_offsets), and
        # whether each subscribes (has a lease row; a Spark query's group has watermarks only).
        self.readers = (
            sa.select(off.c.consumer_group, off.c.partition, le.c.consumer_group.is_not(None).label("subscribed"))
            .select_from(
                off.outerjoin(
                    le,
                    sa.and_(
                        le.c.consumer_group == off.c.consumer_group,
                        le.c.topic == off.c.topic,
                        le.c.partition == off.c.partition,
                    ),
                )
            )
            .where(off.c.topic == topic, off.c.partition.in_(parts))
        )
        # A group's dead letter of a message, whatever its id (``dead_letters.bury``, when both ids are taken).
        self.dead_letter_of = sa.select(log.c.message_offset).where(
            log_part,
            log.c.failed_group == group,
            log.c.original_topic == _s("original_topic"),
            log.c.original_offset == _bp("original_offset"),
        )
        # Their leases, locked as a poll's fence locks one: the polls of these partitions wait for the
        # removal of dead letters, and see it whole.
        self.lock_readers = (
            sa.select(le.c.partition)
            .where(
                le.c.consumer_group.in_(sa.bindparam("groups", expanding=True)),
                le.c.topic == topic,
                le.c.partition.in_(parts),
            )
            .order_by(le.c.consumer_group, le.c.partition)
            .with_for_update()
        )
        # -- dropping a group (``Topic.drop_group``): leases first, as its polls lock them --------------
        self.lock_group_leases = (
            sa.select(le.c.partition, le.c.holder, le.c.epoch, le.c.acquired_at, le.c.expires_at)
            .where(group_leases)
            .order_by(le.c.partition)
            .with_for_update()
        )
        self.drop_leases = sa.delete(le).where(group_leases)
        self.drop_offsets = sa.delete(off).where(off.c.consumer_group == group, off.c.topic == topic)
        self.drop_states = sa.delete(dl).where(dl.c.consumer_group == group, dl.c.topic == topic)
        self.drop_subscribers = sa.delete(sub).where(sub.c.consumer_group == group, sub.c.topic == topic)
        self.remove = sa.delete(log).where(log_part, log.c.message_offset.in_(sa.bindparam("offsets", expanding=True)))

    # The operations whose shape differs per backend (``delayq.topics._backends``).
    def existing_ids_of(self, conn: Connection, topic: str, pairs: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
        """See ``_backends.existing_ids``."""
        return _backends.existing_ids(conn, self, topic, pairs)

    def set_heads(self, conn: Connection, topic: str, heads: Mapping[int, int]) -> None:
        """See ``_backends.set_heads``."""
        _backends.set_heads(conn, self, topic, heads)

    def read_ranges(
        self, conn: Connection, key: Mapping[str, Any], ranges: Sequence[tuple[int, int, int]], dead: bool
    ) -> list[Any]:
        """See ``_backends.read_ranges``."""
        return _backends.read_ranges(conn, self, key, ranges, dead)

    def insert_log_rows(
        self,
        conn: Connection,
        topic: str,
        payload_type: str,
        now: int,
        rows: Sequence[tuple[int, int, str, str, bytes, Mapping[str, Any] | None]],
    ) -> None:
        """See ``_backends.insert_log_rows``."""
        _backends.insert_log_rows(conn, self, topic, payload_type, now, rows)

    def read_and_move_ranges(
        self, conn: Connection, key: Mapping[str, Any], ranges: Sequence[tuple[int, int, int]], dead: bool, until: int
    ) -> list[Any]:
        """See ``_backends.read_and_move_ranges``."""
        return _backends.read_and_move_ranges(conn, self, key, ranges, dead, until)

    def set_ranges(self, conn: Connection, key: Mapping[str, Any], sent: Mapping[int, int], until: int) -> None:
        """See ``_backends.set_ranges``."""
        _backends.set_ranges(conn, self, key, sent, until)

    def ack_runs(
        self, conn: Connection, key: Mapping[str, Any], runs: Mapping[int, tuple[int, int]], now: int
    ) -> set[int]:
        """See ``_backends.ack_runs``."""
        return _backends.ack_runs(conn, self, key, runs, now)

    def ack_runs_fenced(
        self, conn: Connection, key: Mapping[str, Any], runs: Mapping[int, tuple[int, int, int]]
    ) -> set[int]:
        """See ``_backends.ack_runs_fenced``."""
        return _backends.ack_runs_fenced(conn, self, key, runs)

    def publish_one(
        self,
        conn: Connection,
        topic: str,
        item: tuple[int, str, str, bytes],
        payload_type: str,
        wake: tuple[str, str] | None = None,
    ) -> bool:
        """See ``_backends.publish_one``."""
        return _backends.publish_one(conn, self, topic, item, payload_type, wake)

    def ack_each(
        self, conn: Connection, key: Mapping[str, Any], pairs: Sequence[tuple[int, int]]
    ) -> set[tuple[int, int]]:
        """See ``_backends.ack``."""
        return _backends.ack(conn, self, key, pairs)


def statements_for(dialect: Dialect, prefix: str, schema: str | None, manual_clock: bool) -> TopicStatements:
    """The statements for this engine's dialect, made once per table set and clock mode (they go with it)."""

    def build() -> TopicStatements:
        now = _bp("now") if manual_clock else dialect.now_ms()
        return TopicStatements(dialect, make_tables(prefix, schema).topics, now)

    return dialect.cached(("topics", prefix, schema, manual_clock), build)
