"""The streaming read of a topic (``spark.readStream.format("delayq").option("topic", …)``).

The stream's offset is ``{"partition": last offset read}`` for every partition of the topic. A micro-batch
ends at each partition's *committed head* (or below it, under ``maxRowsPerTrigger``): every offset at or
below a committed head is committed and never changes (publishers take offsets in commit order under the
head row's lock), so a micro-batch never skips a publisher that commits late, and re-reading a batch's
range after a restart returns the same rows. Each topic partition with new rows is one input partition.

Spark writes a batch's offsets to the checkpoint before running it, and a restarted query re-runs the last
batch that did not commit: with an idempotent sink (a delayq queue keyed by something of the message, a
topic keyed by its id) every message lands exactly once. The log must still hold what a query has not
read: with the ``group`` option, each commit moves that group's watermarks to the committed offsets, and
garbage collection never deletes above a watermark. Rows found missing (collected) fail the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from delayq.dialects import dialect_for
from delayq.engines import create_engine
from delayq.errors import DelayqError
from delayq.spark.options import SourceOptions
from delayq.spark.read import LOG_SCHEMA, arrow_batches, fetch, log_query, read_heads, stored_names
from delayq.topics import _scans
from delayq.topics.names import DLQ_SUFFIX
from delayq.topics.statements import TopicStatements, statements_for

Offsets = dict[str, int]
_OFFSET = stored_names(LOG_SCHEMA).index("offset")  # in a row of log_query


class CollectedError(DelayqError):
    """Rows a streaming query had not read were garbage-collected from the log."""


def plan_limit(start: Offsets, heads: Offsets, max_rows: int, rows: Offsets | None = None) -> Offsets:
    """End offsets taking at most ``max_rows`` rows, shared fairly between the partitions with rows.

    ``rows``: how many rows each partition holds after its start, when that is not head minus start (a
    dead-letter topic has gaps); the ends are then counts, for ``ends_after`` to turn into offsets. The
    partitions are served in turn, from one that moves with the offsets read so far, so a limit below
    the number of busy partitions reaches each of them in later batches rather than the same few."""
    avail = {p: heads[p] - start.get(p, 0) for p in heads} if rows is None else dict(rows)
    taken = dict.fromkeys(heads, 0)
    left = max_rows
    order = sorted(heads, key=int)
    turn = sum(start.values()) % len(order) if order else 0
    waiting = [p for p in order[turn:] + order[:turn] if avail.get(p, 0) > 0]
    while left > 0 and waiting:
        share = max(1, left // len(waiting))
        still = []
        for p in waiting:
            take = min(share, avail[p] - taken[p], left)
            taken[p] += take
            left -= take
            if taken[p] < avail[p]:
                still.append(p)
            if left == 0:
                break
        waiting = still
    if rows is not None:
        return taken
    return {p: start.get(p, 0) + taken[p] for p in heads}


def ends_after(conn: sa.Connection, opts: SourceOptions, start: Offsets, heads: Offsets, max_rows: int) -> Offsets:
    """``plan_limit`` where offsets have gaps: the rows each partition holds after its start are counted,
    and a partition that takes ``k`` of them ends at the offset of its ``k``-th."""
    assert opts.topic is not None
    stmts = _statements(conn, opts)
    busy = {int(p): (start.get(p, 0), heads[p]) for p in heads if heads[p] > start.get(p, 0)}
    counted = _scans.rows_per_partition(conn, stmts, opts.topic, busy)
    rows = {str(p): n for p, n in counted.items()}
    taken = plan_limit(start, heads, max_rows, {p: rows.get(p, 0) for p in heads})
    end = {p: start.get(p, 0) for p in heads}
    for p, k in taken.items():
        if k == 0:
            continue
        if k == rows[p]:
            end[p] = heads[p]  # (past any gap at the end)
            continue
        end[p] = _scans.kth_offset(conn, stmts, opts.topic, int(p), start.get(p, 0), k)
    return end


def _statements(bind: sa.Engine | sa.Connection, opts: SourceOptions) -> TopicStatements:
    return statements_for(dialect_for(bind.engine), opts.table_prefix, opts.schema, False)


class TopicStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of a topic's log; see the module's docstring."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._engine: sa.Engine | None = None
        self._target: Offsets | None = None  # Trigger.AvailableNow: the heads when the query started
        # Requeue and purge delete a dead-letter topic's rows: its offsets have gaps.
        self._gaps = opts.topic is not None and opts.topic.endswith(DLQ_SUFFIX)
        self._committed: Offsets | None = None  # the group's watermarks as this reader last moved them

    def __getstate__(self) -> dict[str, Any]:  # the engine stays on the driver
        return {"opts": self.opts, "_engine": None, "_target": self._target, "_gaps": self._gaps, "_committed": None}

    def _conn(self) -> sa.Connection:
        if self._engine is None:
            self._engine = create_engine(self.opts.url, pool_size=1, max_overflow=0, pool_pre_ping=True)
        return self._engine.connect()

    def _heads(self) -> tuple[Offsets, Offsets]:
        with self._conn() as conn:
            heads = read_heads(conn, self.opts)
        return {str(p): h for p, (h, _) in heads.items()}, {str(p): c for p, (_, c) in heads.items()}

    def initialOffset(self) -> Offsets:
        """Where a new query starts; with ``group``, the group's rows are made there first (if it has none),
        in the transaction that holds the topic row shared (as a join does), so collection keeps what it will read."""
        if self.opts.group is None:
            heads, collected = self._heads()
            return heads if self.opts.starting_offsets == "latest" else collected
        with self._conn() as conn, conn.begin():
            stmts = self._stmts(conn)
            g = {"group": self.opts.group, "topic_name": self.opts.topic}
            conn.execute(stmts.lock_topic_shared, g).all()  # ordered with garbage collection, as a join is
            locked = conn.execute(stmts.heads_of_topic, g).all()
            conn.execute(stmts.forget_orphan_states, g)  # a group created again inherits no states
            start = {
                str(h.partition): int(h.head if self.opts.starting_offsets == "latest" else h.collected) for h in locked
            }
            now = int(conn.execute(stmts.now).scalar_one())
            conn.execute(
                stmts.create_offset, [{**g, "part": int(p), "acked": v, "now_v": now} for p, v in start.items()]
            )
            if self.opts.starting_offsets == "group":
                assert self.opts.topic is not None
                acked = _scans.group_offsets(conn, stmts, self.opts.group, self.opts.topic)
                start |= {str(p): v for p, v in acked.items() if str(p) in start}
        return start

    def _stmts(self, conn: sa.Connection) -> TopicStatements:
        return _statements(conn, self.opts)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_rows_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_rows_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._heads()[0]

    def latestOffset(self, start: Offsets, limit: ReadLimit) -> Offsets:
        """The next batch's end. Spark runs one batch at a time and asks for the next only once the last
        one is in the sink and in the checkpoint's commits: ``start`` is committed, so with ``group`` the
        watermarks move to it here (Spark's own ``commit`` comes only with the batch after, which for a
        stream that has caught up is never: its lag would show the last batch forever)."""
        if self.opts.group is not None:
            self.commit(start)
        heads = self._target if self._target is not None else self._heads()[0]
        if not isinstance(limit, ReadMaxRows):
            return {p: max(heads[p], start.get(p, 0)) for p in heads}
        if not self._gaps:
            return plan_limit(start, heads, limit.max_rows)
        with self._conn() as conn:  # a dead-letter topic: rows, not offsets, count
            return ends_after(conn, self.opts, start, heads, limit.max_rows)

    def reportLatestOffset(self) -> Offsets | None:
        return self._heads()[0]

    def partitions(self, start: Offsets, end: Offsets) -> Sequence[InputPartition]:
        return [
            InputPartition((int(p), start.get(p, 0), end[p])) for p in sorted(end, key=int) if end[p] > start.get(p, 0)
        ]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        part, after, upto = partition.value
        assert self.opts.topic is not None
        engine = self.opts.engine()
        try:
            query = log_query(_statements(engine, self.opts), self.opts.topic, part, after, upto)
            with engine.connect() as conn, fetch(conn, query) as chunks:
                yield from arrow_batches(self._contiguous(conn, chunks, part, after, upto), LOG_SCHEMA)
        finally:
            engine.dispose()

    def _contiguous(
        self, conn: sa.Connection, chunks: Iterable[Sequence[Sequence[Any]]], part: int, after: int, upto: int
    ) -> Iterator[Sequence[Sequence[Any]]]:
        """The rows, checked for offsets of ``(after, upto]`` that are missing: collected ones fail the read.

        Offsets ascend strictly (the primary key, in order), so a chunk whose first and last offsets are
        the next expected ones holds every offset in between. A gap above the partition's collected offset
        is a dead letter requeued or purged (topics.md: readers step over them), and is stepped over; one
        at or below it was garbage-collected before the query read it."""
        expected, missing = after + 1, None
        for rows in chunks:
            if (rows[0][_OFFSET], rows[-1][_OFFSET]) != (expected, expected + len(rows) - 1) and missing is None:
                missing = next(expected + i for i, r in enumerate(rows) if r[_OFFSET] != expected + i)
            expected = rows[-1][_OFFSET] + 1
            yield rows
        if missing is None and expected != upto + 1:
            missing = expected
        if missing is None:
            return
        assert self.opts.topic is not None
        if missing <= _scans.collected(conn, _statements(conn, self.opts), self.opts.topic, part):
            raise CollectedError(self._collected_message(missing, upto, part))

    def _collected_message(self, missing: int, upto: int, part: int) -> str:
        where = f"offsets {missing}..{upto} of partition {part} of topic {self.opts.topic!r}"
        if self.opts.group is None:
            return (
                f"{where} were garbage-collected before this query read them: give the query a consumer group "
                "(option 'group') so that collection waits for it"
            )
        return (
            f"{where} were garbage-collected before this query read them: group {self.opts.group!r}'s "
            "watermarks were past them (moved by another consumer of the group, or the group deleted); this "
            "checkpoint cannot resume: start the query on a new checkpoint (startingOffsets=group resumes "
            "where the group is)"
        )

    def commit(self, end: Offsets) -> None:
        """With ``group``: move its watermarks up to ``end`` (never down), creating its rows at first."""
        if self.opts.group is None or end == self._committed:  # (asked again each trigger while idle)
            return
        with self._conn() as conn, conn.begin():
            stmts = self._stmts(conn)
            now = int(conn.execute(stmts.now).scalar_one())
            key = {"group": self.opts.group, "topic_name": self.opts.topic}
            conn.execute(
                stmts.create_offset, [{**key, "part": int(p), "acked": v, "now_v": now} for p, v in end.items()]
            )
            assert self.opts.topic is not None
            ends = {int(p): upto for p, upto in end.items()}
            _scans.raise_offsets(conn, stmts, self.opts.group, self.opts.topic, ends, now)
            # Delivery states behind the watermarks are never read again (a requeue's, say): forget them.
            conn.execute(stmts.forget_passed_states, key)
        self._committed = dict(end)

    def stop(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
