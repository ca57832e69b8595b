"""Batch reads of the ``delayq`` data source: a queue's messages or dead letters, a topic's log.

A plan must stay right for every query Spark runs with it: PySpark 4.2 and 4.3 keep the first read plan of
a DataFrame (its input partitions and the reader, with the filters pushed to it) and reuse it for every
later query on that DataFrame that pushes no filter of its own. So the input partitions hold nothing that
ages: a queue's id ranges are open at both ends (the first has no lower bound, the last no upper one),
a topic's are sets of its partitions, read up to the heads committed when the task starts, and ``state``
is computed from the database's clock when each task reads. On those versions the reader also pushes no
filter (``DelayqReader``): Spark evaluates every filter itself, and a reused plan reads every row.

Where a planner keeps each query's pushdown to itself (``pushdown_supported``), ``PushdownReader`` turns
the filters it can into SQL (``Pushed``, plain tuples, so the reader stays picklable) and returns the
others for Spark to evaluate; planning counts the matching rows and each task reads its slice with the
same filters. ``partitions()`` shows the plan: each partition carries its bounds and its planned count.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from pyspark.sql import types as T
from pyspark.sql.datasource import (
    DataSourceReader,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
    StringStartsWith,
)

from delayq.dialects import dialect_for
from delayq.errors import InvalidInputError, SchemaMissingError
from delayq.queue import _views
from delayq.spark.options import JSON_TEXT, SourceOptions, reaching
from delayq.tags import LIKE_ESCAPE, tag_pattern
from delayq.topics import _scans
from delayq.topics.statements import TopicStatements, statements_for

KEPT_STATES = _views.KEPT_STATES
_KEPT_NAMES = {code: name for name, code in KEPT_STATES.items()}
STATES = ("ready", "scheduled", "in_flight")
"""A live message's state when the read was planned: due (``ready``, which includes expired locks), due
later (``scheduled``), or held by a consumer whose lock has not expired (``in_flight``)."""


def _stored() -> list[T.StructField]:
    """The fields every stored message's row begins with: its identity and payload (new objects each call)."""
    return [
        T.StructField("id", T.LongType(), False),
        T.StructField("queue", T.StringType(), False),
        T.StructField("key", T.StringType(), False),
        T.StructField("payload", T.BinaryType(), False),
        T.StructField("payload_type", T.StringType(), False),
        T.StructField("payload_json", T.StringType(), True, {JSON_TEXT: True}),
    ]


MESSAGE_SCHEMA = T.StructType(
    [
        *_stored(),
        T.StructField("state", T.StringType(), False),
        T.StructField("scheduled_at", T.TimestampType(), False),
        T.StructField("scheduled_at_initially", T.TimestampType(), False),
        T.StructField("created_at", T.TimestampType(), False),
        T.StructField("attempts", T.IntegerType(), False),
        T.StructField("last_error", T.StringType(), True),
    ]
)
DEAD_LETTER_SCHEMA = T.StructType(
    [
        *_stored(),
        T.StructField("scheduled_at_initially", T.TimestampType(), False),
        T.StructField("created_at", T.TimestampType(), False),
        T.StructField("attempts", T.IntegerType(), False),
        T.StructField("last_error", T.StringType(), True),
        T.StructField("failed_at", T.TimestampType(), False),
    ]
)
FINISHED_SCHEMA = T.StructType(
    [
        *_stored(),
        T.StructField("state", T.StringType(), False),
        T.StructField("scheduled_at_initially", T.TimestampType(), False),
        T.StructField("created_at", T.TimestampType(), False),
        T.StructField("attempts", T.IntegerType(), False),
        T.StructField("last_error", T.StringType(), True),
        T.StructField("finished_at", T.TimestampType(), False),
        T.StructField("duration_ms", T.LongType(), True),
        T.StructField("result", T.BinaryType(), True),
        T.StructField("result_type", T.StringType(), True),
        T.StructField("result_json", T.StringType(), True, {JSON_TEXT: True}),
    ]
)
"""A queue's kept finished messages (option ``finished``): ``state`` is ``completed`` or ``cancelled``."""
LOG_SCHEMA = T.StructType(
    [
        T.StructField("topic", T.StringType(), False),
        T.StructField("partition", T.IntegerType(), False),
        T.StructField("offset", T.LongType(), False),
        T.StructField("partition_key", T.StringType(), False),
        T.StructField("message_id", T.StringType(), False),
        T.StructField("payload", T.BinaryType(), False),
        T.StructField("payload_type", T.StringType(), False),
        T.StructField("payload_json", T.StringType(), True, {JSON_TEXT: True}),
        T.StructField("published_at", T.TimestampType(), False),
    ]
)

Pushed = tuple[str, str, Any]
"""A filter the database evaluates: (column, op, value), op one of eq, in, prefix, gt, ge, lt, le; times
in epoch ms."""

_TIMES = {"scheduled_at", "scheduled_at_initially", "created_at", "failed_at", "published_at", "finished_at"}
_COLUMN = {"offset": "message_offset"}  # the DataFrame's name -> the table's


def schema_for(opts: SourceOptions) -> T.StructType:
    if opts.topic is not None:
        return LOG_SCHEMA
    if opts.finished:
        return FINISHED_SCHEMA
    return DEAD_LETTER_SCHEMA if opts.dead else MESSAGE_SCHEMA


_NAMES = {"queue", "key", "topic", "partition_key", "message_id"}  # compared byte for byte on every backend
_NUMBERS = {"id", "attempts", "partition", "offset", "duration_ms"}


def translate(f: Any, columns: set[str]) -> Pushed | None:
    """The SQL form of a Spark ``Filter``, or None when it stays with Spark.

    Only what the database evaluates exactly as Spark does is pushed: names (binary collations) by
    equality and prefix, numbers and times by comparison, ``state``. Other text (``last_error``,
    ``payload_type``) follows the database's collation, and ``payload_json`` is computed: Spark keeps those.
    """
    if len(f.attribute) != 1 or f.attribute[0] not in columns:
        return None
    name = f.attribute[0]
    if name == "state" and isinstance(f, EqualTo | In):
        values = f.value if isinstance(f, In) else (f.value,)
        return (name, "in", [str(v) for v in values])
    if name in _TIMES:
        return _time_filter(f, name)
    values = f.value if isinstance(f, In) else (getattr(f, "value", None),)
    expected: type = str if name in _NAMES else int
    if not all(isinstance(v, expected) and not isinstance(v, bool) for v in values):
        return None
    if name in _NAMES and isinstance(f, StringStartsWith):
        return (name, "prefix", f.value)
    if (name in _NAMES or name in _NUMBERS) and isinstance(f, EqualTo):
        return (name, "eq", f.value)
    if (name in _NAMES or name in _NUMBERS) and isinstance(f, In):
        return (name, "in", list(f.value))
    if name not in _NUMBERS:
        return None
    for kind, op in ((GreaterThan, "gt"), (GreaterThanOrEqual, "ge"), (LessThan, "lt"), (LessThanOrEqual, "le")):
        if isinstance(f, kind):
            return (name, op, f.value)
    return None


def _time_filter(f: Filter, name: str) -> Pushed | None:
    """A time range in epoch ms, exact for the database's millisecond times (Spark's are microseconds)."""
    value = getattr(f, "value", None)
    if not isinstance(value, dt.datetime) or value.tzinfo is None:
        return None
    delta = value - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    us = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    floor, ceil = us // 1000, -(-us // 1000)
    if isinstance(f, GreaterThan):
        return (name, "gt", floor)  # ms * 1000 > us  <=>  ms > floor(us / 1000)
    if isinstance(f, GreaterThanOrEqual):
        return (name, "ge", ceil)
    if isinstance(f, LessThan):
        return (name, "lt", ceil)
    if isinstance(f, LessThanOrEqual):
        return (name, "le", floor)
    if isinstance(f, EqualTo) and us % 1000 == 0:
        return (name, "eq", us // 1000)
    return None


def _like_prefix(prefix: str) -> str:
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _same_name(col: sa.ColumnElement[Any], value: str) -> sa.ColumnElement[bool]:
    """``col = value``, exactly: MariaDB's binary collations pad with spaces ('a' = 'a '), LIKE does not."""
    return sa.and_(col == value, col.like(_like_prefix(value)[:-1], escape="\\"))


def condition(table: sa.Table, pushed: Pushed, now: int | None) -> sa.ColumnElement[bool]:
    """The WHERE clause of one pushed filter (``now`` is the plan's time, for ``state``)."""
    name, op, value = pushed
    if name == "state" and "finished_at" in table.c:  # a kept message's state is stored
        return table.c.state.in_([KEPT_STATES[v] for v in value if v in KEPT_STATES]) if value else sa.false()
    if name == "state":
        assert now is not None
        due, locked = table.c.scheduled_at <= now, table.c.lock_token.is_not(None)
        each = {"ready": due, "scheduled": sa.and_(~due, ~locked), "in_flight": sa.and_(~due, locked)}
        return sa.or_(sa.false(), *[each[v] for v in value if v in each])
    col: sa.ColumnElement[Any] = table.c[_COLUMN.get(name, name)]
    if name in _NAMES and op in ("eq", "in"):
        return sa.or_(sa.false(), *[_same_name(col, v) for v in (value if op == "in" else [value]) if v is not None])
    if op == "eq":
        equal: sa.ColumnElement[bool] = col == value
        return equal
    if op == "in":
        return col.in_(value) if value else sa.false()
    if op == "prefix":  # LIKE can use an index; SQLite's LIKE ignores ASCII case, substr() is exact
        return sa.and_(col.like(_like_prefix(value), escape="\\"), sa.func.substr(col, 1, len(value)) == value)
    compared: dict[str, sa.ColumnElement[bool]] = {
        "gt": col > value,
        "ge": col >= value,
        "lt": col < value,
        "le": col <= value,
    }
    return compared[op]


@dataclass(frozen=True)
class QueueSlice:
    """One input partition of a queue read: ids ``low..high`` (None: unbounded on that side) and how many
    rows of it matched when the read was planned (later queries on the same plan may find more)."""

    low: int | None
    high: int | None
    rows: int


@dataclass(frozen=True)
class LogSlice:
    """One input partition of a topic read: topic partitions, each read up to the head committed when the
    task starts, and how many rows they held when the read was planned."""

    partitions: tuple[int, ...]
    rows: int


class DelayqPartition(InputPartition):
    """An input partition: the slice and the filters every task of the read applies."""

    def __init__(self, part: QueueSlice | LogSlice, pushed: tuple[Pushed, ...]) -> None:
        super().__init__(part)
        self.pushed = pushed


def pushdown_supported(version: str) -> bool:
    """Whether this PySpark's planner keeps each query's pushed filters to that query.

    4.2 and 4.3 store the read plan made while pushing a query's filters on the DataFrame's relation and
    reuse it for a later query on the same DataFrame that pushes no filter: that query would read the
    earlier query's rows only. No released version is known to scope it (pyproject.toml allows <4.4)."""
    del version
    return False


class DelayqReader(DataSourceReader):
    """A batch read that pushes no filter: Spark evaluates them all (see the module's docstring)."""

    def __init__(self, opts: SourceOptions, schema: T.StructType) -> None:
        self.opts = opts
        self.columns = {f.name for f in schema_for(opts).fields}
        self.pushed: list[Pushed] = []

    def partitions(self) -> Sequence[InputPartition]:
        engine = self.opts.engine()
        try:
            with engine.connect() as conn:
                now = _views.database_now_ms(conn)
                if self.opts.topic is not None:
                    return self._log_partitions(conn)
                return self._queue_partitions(conn, now)
        finally:
            engine.dispose()

    def _queue_partitions(self, conn: sa.Connection, now: int) -> list[InputPartition]:
        t, tables, dead, queue = self._table(), self.opts.tables(), self.opts.dead, self.opts.queue
        where = [condition(t, p, now) for p in self.pushed] + self._tagged(t)
        pushed = tuple(self.pushed)
        finished = self.opts.finished
        low, high, rows = _views.scan_span(conn, tables, dead=dead, queue=queue, where=where, finished=finished)
        if not rows or low is None or high is None:
            return [DelayqPartition(QueueSlice(None, None, 0), pushed)]  # (rows offered later are read too)
        slices = max(1, min(self.opts.partitions or 4, rows))
        step = max(1, -(-(high - low + 1) // slices))
        bounds = [(start, min(high, start + step - 1)) for start in range(low, high + 1, step)]
        # Each slice's own count (a query per slice, at most ``partitions``): the plan shows what each reads.
        per = [
            _views.scan_span(conn, tables, dead=dead, queue=queue, where=where, low=lo, high=hi, finished=finished)[2]
            for lo, hi in bounds
        ]
        kept = [(lo, hi, n) for (lo, hi), n in zip(bounds, per, strict=True) if n]
        # Open at both ends: ids below the first or above the last, there by the time a task runs, are read.
        edges = [lo for lo, _, _ in kept[1:]]
        return [
            DelayqPartition(QueueSlice(None if i == 0 else lo, None if i == len(kept) - 1 else edges[i] - 1, n), pushed)
            for i, (lo, _, n) in enumerate(kept)
        ]

    def _log_partitions(self, conn: sa.Connection) -> list[InputPartition]:
        assert self.opts.topic is not None
        heads = read_heads(conn, self.opts)
        parts = sorted(heads)
        for name, op, value in self.pushed:  # a filter on the partition drops whole partitions from the plan
            if name == "partition":
                keep = {value} if op == "eq" else set(value) if op == "in" else None
                if keep is not None:
                    parts = [p for p in parts if p in keep]
        pushed = tuple(self.pushed)
        if not parts:
            return [DelayqPartition(LogSlice((), 0), pushed)]
        # rows, not head minus collected: a dead-letter topic has gaps
        rows = _scans.rows_per_partition(
            conn, _topic_statements(conn, self.opts), self.opts.topic, dict.fromkeys(parts)
        )
        slices = max(1, min(self.opts.partitions or 4, len(parts)))
        groups = [tuple(parts[i::slices]) for i in range(slices)]
        return [DelayqPartition(LogSlice(g, sum(rows.get(p, 0) for p in g)), pushed) for g in groups if g]

    def _tagged(self, t: sa.Table) -> list[sa.ColumnElement[bool]]:
        """The ``tag`` option's condition on a queue's table (none without it)."""
        if self.opts.tag is None:
            return []
        return [t.c.tags.like(tag_pattern(self.opts.tag), escape=LIKE_ESCAPE)]

    def _table(self) -> sa.Table:
        tables = self.opts.tables()
        if self.opts.topic is not None:
            return tables.topics.log
        if self.opts.finished:
            return tables.finished
        return tables.dead_letters if self.opts.dead else tables.messages

    def read(self, partition: InputPartition) -> Iterator[Any]:
        """Arrow record batches of the slice's rows, as of the database's clock and heads now."""
        assert isinstance(partition, DelayqPartition)
        t = self._table()
        part = partition.value
        schema = schema_for(self.opts)
        engine = self.opts.engine()
        try:
            with engine.connect() as conn:
                now = _views.database_now_ms(conn)
                filters = [condition(t, p, now) for p in partition.pushed]
                if isinstance(part, QueueSlice):
                    filters += self._tagged(t)
                    query = _views.scan_rows(
                        self.opts.tables(),
                        dead=self.opts.dead,
                        queue=self.opts.queue,
                        names=stored_column_names(schema),
                        where=filters,
                        low=part.low,
                        high=part.high,
                        finished=self.opts.finished,
                    )
                    with fetch(conn, query) as chunks:
                        yield from arrow_batches(chunks, schema, now)
                    return
                assert self.opts.topic is not None
                if not part.partitions:
                    return
                heads = read_heads(conn, self.opts)
                for p in part.partitions:
                    head, collected = heads[p]
                    query = log_query(_topic_statements(conn, self.opts), self.opts.topic, p, collected, head, filters)
                    with fetch(conn, query) as chunks:
                        yield from arrow_batches(chunks, schema)
        finally:
            engine.dispose()


class PushdownReader(DelayqReader):
    """A batch read that turns the filters it can into SQL (only where ``pushdown_supported``)."""

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        self.pushed = []  # this query's filters only
        for f in filters:
            sql = translate(f, self.columns)
            if sql is None:
                yield f
            else:
                self.pushed.append(sql)


def read_heads(conn: sa.Connection, opts: SourceOptions) -> dict[int, tuple[int, int]]:
    """Each partition's committed head and collected offset; ``InvalidInputError`` for an unknown topic.

    A plain read sees committed heads only, and every offset at or below a committed head is committed
    (publishers insert the rows and move the head in one transaction, under the head row's lock): the
    offsets up to it are complete and never change, so reading up to it never skips a late commit.
    """
    assert opts.topic is not None
    found = _scans.heads(conn, _topic_statements(conn, opts), opts.topic)
    if found is None:
        raise InvalidInputError(f"topic {opts.topic!r} does not exist: create it first (Topic.create(partitions=N))")
    return found


def _topic_statements(bind: sa.Engine | sa.Connection, opts: SourceOptions) -> TopicStatements:
    return statements_for(dialect_for(bind.engine), opts.table_prefix, opts.schema, False)


def check_tables(opts: SourceOptions) -> None:
    """Fail on the driver, before any task, when the database does not answer (one line), or delayq's
    tables or the topic are missing."""
    engine = opts.engine()
    try:
        tables = opts.tables()
        needed = tables.topics.log if opts.topic is not None else tables.messages
        with reaching(opts.url):
            found = sa.inspect(engine).has_table(needed.name, schema=opts.schema)
        if not found:
            raise SchemaMissingError(f"table {needed.name} is missing at {engine.url!r}: run `delayq migrate`")
        if opts.topic is not None:
            with engine.connect() as conn:
                read_heads(conn, opts)
    finally:
        engine.dispose()


ARROW_BATCH = 4096
"""Rows per fetch from the database and per Arrow record batch."""

_MS_RANGE = (-62_135_596_800_000, 253_402_300_799_999)  # Python's datetime.min and max, in epoch ms


def stored_names(schema: T.StructType) -> list[str]:
    """What a read of ``schema`` selects: its columns but the computed ``payload_json`` and ``state``, and
    ``lock_token`` for ``state``."""
    fields = schema.fieldNames()
    if "finished_at" in fields:  # a kept message: its state is stored (as a number)
        return [n for n in fields if n not in ("payload_json", "result_json")]
    names = [n for n in fields if n not in ("payload_json", "state")]
    return [*names, "lock_token"] if "state" in fields else names


def stored_column_names(schema: T.StructType) -> list[str]:
    """The table's columns behind ``schema``, in ``stored_names``' order."""
    return [_COLUMN.get(n, n) for n in stored_names(schema)]


def log_query(
    stmts: TopicStatements,
    topic: str,
    partition: int,
    after: int,
    upto: int,
    where: Sequence[sa.ColumnElement[bool]] = (),
) -> sa.Select[Any]:
    """A topic partition's rows with offsets in ``(after, upto]``, oldest first, as ``LOG_SCHEMA`` stores them."""
    return _scans.log_rows(stmts, stored_column_names(LOG_SCHEMA), topic, partition, after, upto, where)


@contextlib.contextmanager
def fetch(conn: sa.Connection, query: sa.Select[Any]) -> Iterator[Iterator[Sequence[Sequence[Any]]]]:
    """The query's rows, streamed from the database in lists of ``ARROW_BATCH`` plain rows (no mappings).

    The result is closed on leaving, before the connection is: a MySQL connection whose streamed result
    still has unread rows (a failed or abandoned read) refuses every command, the rollback included."""
    with conn.execution_options(yield_per=ARROW_BATCH).execute(query) as result:
        yield result.partitions()


def arrow_batches(
    chunks: Iterable[Sequence[Sequence[Any]]], schema: T.StructType, now: int | None = None
) -> Iterator[Any]:
    """Lists of rows (``stored_column_names(schema)``) as Arrow record batches of ``schema``, which Spark takes
    several times faster than tuples. Each column is converted once, as a whole (``zip(*rows)``, then one
    Arrow array of its type); ``payload_json`` and ``state`` (as of ``now``) are computed from other columns.
    Times are the database's epoch milliseconds; one that Python's datetime cannot hold reads as its earliest
    or latest, as with ``delayq.clock.from_ms``, rather than failing the read."""
    import pyarrow as pa  # type: ignore[import-untyped]  # (PySpark's Python data sources need it)
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    arrow = {
        "long": pa.int64(),
        "integer": pa.int32(),
        "string": pa.string(),
        "binary": pa.binary(),
        "timestamp": pa.timestamp("us", tz="UTC"),
    }
    target = pa.schema([pa.field(f.name, arrow[f.dataType.typeName()], f.nullable) for f in schema.fields])
    names = stored_names(schema)

    def array(values: Sequence[Any], kind: Any) -> Any:
        if not pa.types.is_timestamp(kind):
            return pa.array(values, kind)
        ms = pc.min_element_wise(pc.max_element_wise(pa.array(values, pa.int64()), _MS_RANGE[0]), _MS_RANGE[1])
        return ms.cast(pa.timestamp("ms", tz="UTC")).cast(kind)

    for rows in chunks:
        columns: dict[str, Sequence[Any]] = dict(zip(names, zip(*rows, strict=True), strict=True))
        payloads, kinds = columns["payload"], columns["payload_type"]
        columns["payload_json"] = [
            str(p, "utf-8") if k == "json" else None for p, k in zip(payloads, kinds, strict=True)
        ]
        if "finished_at" in columns:  # a kept message's state, by name, and its result as JSON text
            columns["state"] = [_KEPT_NAMES.get(code, str(code)) for code in columns["state"]]
            columns["result_json"] = [
                str(r, "utf-8") if r is not None and k == "json" else None
                for r, k in zip(columns["result"], columns["result_type"], strict=True)
            ]
        elif "lock_token" in columns:  # the state
            assert now is not None
            columns["state"] = [
                "ready" if due <= now else "scheduled" if lock is None else "in_flight"
                for due, lock in zip(columns["scheduled_at"], columns["lock_token"], strict=True)
            ]
        yield pa.RecordBatch.from_arrays([array(columns[f.name], f.type) for f in target], schema=target)
