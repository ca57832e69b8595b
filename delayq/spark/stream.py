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
from delayq.errors import DelayqError
from delayq.spark.options import SourceOptions
from delayq.spark.read import LOG_SCHEMA, arrow_batches, fetch, log_query, read_heads, stored_names
from delayq.topics.statements import statements_for

Offsets = dict[str, int]
_OFFSET = stored_names(LOG_SCHEMA).index("offset")  # in a row of log_query


class CollectedError(DelayqError):
    """Rows a streaming query had not read were garbage-collected from the log."""


def plan_limit(start: Offsets, heads: Offsets, max_rows: int) -> Offsets:
    """End offsets taking at most ``max_rows`` rows, shared fairly between the partitions with rows."""
    end = dict(start)
    left = max_rows
    waiting = sorted(p for p in heads if heads[p] > start.get(p, 0))
    while left > 0 and waiting:
        share = max(1, left // len(waiting))
        still = []
        for p in waiting:
            take = min(share, heads[p] - end[p], left)
            end[p] += take
            left -= take
            if end[p] < heads[p]:
                still.append(p)
            if left == 0:
                break
        waiting = still
    return end


class TopicStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of a topic's log; see the module's docstring."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._engine: sa.Engine | None = None
        self._target: Offsets | None = None  # Trigger.AvailableNow: the heads when the query started

    def __getstate__(self) -> dict[str, Any]:  # the engine stays on the driver
        return {"opts": self.opts, "_engine": None, "_target": self._target}

    def _conn(self) -> sa.Connection:
        if self._engine is None:
            self._engine = sa.create_engine(self.opts.url, pool_size=1, max_overflow=0, pool_pre_ping=True)
        return self._engine.connect()

    def _heads(self) -> tuple[Offsets, Offsets]:
        with self._conn() as conn:
            heads = read_heads(conn, self.opts)
        return {str(p): h for p, (h, _) in heads.items()}, {str(p): c for p, (_, c) in heads.items()}

    def initialOffset(self) -> Offsets:
        heads, collected = self._heads()
        if self.opts.starting_offsets == "latest":
            return heads
        if self.opts.starting_offsets == "group":
            with self._conn() as conn:
                off = self.opts.tables().topics.offsets
                rows = conn.execute(
                    sa.select(off.c.partition, off.c.acked_offset).where(
                        off.c.consumer_group == self.opts.group, off.c.topic == self.opts.topic
                    )
                )
                marks = {str(r.partition): int(r.acked_offset) for r in rows}
            return {p: marks.get(p, collected[p]) for p in heads}
        return collected

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_rows_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_rows_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._heads()[0]

    def latestOffset(self, start: Offsets, limit: ReadLimit) -> Offsets:
        heads = self._target if self._target is not None else self._heads()[0]
        if isinstance(limit, ReadMaxRows):
            return plan_limit(start, heads, limit.max_rows)
        return {p: max(heads[p], start.get(p, 0)) for p in heads}

    def reportLatestOffset(self) -> Offsets | None:
        return self._heads()[0]

    def partitions(self, start: Offsets, end: Offsets) -> Sequence[InputPartition]:
        return [
            InputPartition((int(p), start.get(p, 0), end[p])) for p in sorted(end, key=int) if end[p] > start.get(p, 0)
        ]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        part, after, upto = partition.value
        assert self.opts.topic is not None
        query = log_query(self.opts.tables().topics.log, self.opts.topic, part, after, upto)
        engine = self.opts.engine()
        try:
            with engine.connect() as conn, fetch(conn, query) as chunks:
                yield from arrow_batches(self._contiguous(chunks, part, after, upto), LOG_SCHEMA)
        finally:
            engine.dispose()

    def _contiguous(
        self, chunks: Iterable[Sequence[Sequence[Any]]], part: int, after: int, upto: int
    ) -> Iterator[Sequence[Sequence[Any]]]:
        """The rows, checked to be every offset in ``(after, upto]``: a gap means they were collected.

        Offsets ascend strictly (the primary key, in order), so a chunk whose first and last offsets are
        the next expected ones holds every offset in between."""
        expected = after + 1
        for rows in chunks:
            offsets = (rows[0][_OFFSET], rows[-1][_OFFSET])
            if offsets != (expected, expected + len(rows) - 1):
                expected = next(expected + i for i, r in enumerate(rows) if r[_OFFSET] != expected + i)
                break
            expected += len(rows)
            yield rows
        if expected != upto + 1:
            raise CollectedError(
                f"offsets {expected}..{upto} of partition {part} of topic {self.opts.topic!r} were "
                "garbage-collected before this query read them: give the query a consumer group "
                "(option 'group') so that collection waits for it"
            )

    def commit(self, end: Offsets) -> None:
        """With ``group``: move its watermarks up to ``end`` (never down), creating its rows at first."""
        if self.opts.group is None:
            return
        with self._conn() as conn, conn.begin():
            dialect = dialect_for(conn.engine)
            stmts = statements_for(dialect, self.opts.table_prefix, self.opts.schema, False)
            now = int(conn.execute(stmts.now).scalar_one())
            key = {"group": self.opts.group, "topic_name": self.opts.topic}
            conn.execute(stmts.create_offset, [{**key, "part": int(p), "acked": 0, "now_v": now} for p in end])
            off = self.opts.tables().topics.offsets
            for p, upto in end.items():
                conn.execute(
                    sa.update(off)
                    .where(
                        off.c.consumer_group == self.opts.group,
                        off.c.topic == self.opts.topic,
                        off.c.partition == int(p),
                        off.c.acked_offset < upto,
                    )
                    .values(acked_offset=upto, updated_at=now)
                )
            # Delivery states behind the watermarks are never read again (a requeue's, say): forget them.
            conn.execute(stmts.forget_passed_states, key)

    def stop(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
