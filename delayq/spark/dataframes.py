"""Functions over DataFrames: offer a DataFrame's rows as messages from the executors (returning the counts),
read a queue back as a DataFrame. (The ``delayq`` data source does both through ``spark.read``/``write``.)

Spark's JDBC writer is not used: it cannot skip duplicate keys and needs a driver jar. Each partition
builds its own engine from the URL (engines are not shipped to executors), offers its rows in chunks
with ``offer_many``, and disposes the engine.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from delayq.clock import duration_ms, from_ms
from delayq.engines import create_engine
from delayq.errors import InvalidInputError, InvalidKeyError, InvalidTimeError
from delayq.messages import OfferOutcome
from delayq.queue import DelayedQueue, _views, check_queue_name
from delayq.schema import DEFAULT_PREFIX, MAX_KEY_LENGTH, make_tables
from delayq.spark.options import JSON_TEXT, check_url, reaching
from delayq.spark.write import decoded_json, is_json_text

_KEY, _PAYLOAD, _DUE_US = "__delayq_key", "__delayq_payload", "__delayq_due_us"


@dataclass(frozen=True)
class OfferCounts:
    """How many rows an ``offer_dataframe`` created, updated, and left alone."""

    created: int = 0
    updated: int = 0
    ignored: int = 0

    def __add__(self, other: OfferCounts) -> OfferCounts:
        return OfferCounts(self.created + other.created, self.updated + other.updated, self.ignored + other.ignored)

    @property
    def total(self) -> int:
        return self.created + self.updated + self.ignored


def offer_dataframe(
    df: DataFrame,
    url: str,
    queue: str,
    *,
    key: str,
    payload: str | Sequence[str],
    at: str | dt.timedelta | None = None,
    update: bool = False,
    chunk_size: int = 500,
    table_prefix: str = DEFAULT_PREFIX,
    _after_chunk: Callable[[int, int, int], None] | None = None,
) -> OfferCounts:
    """Offer every row of ``df`` as a message of ``queue``, from the executors.

    Args:
        key: the column holding each message's key (a non-null string of at most 200 characters).
        payload: one column (its value is the payload; a struct becomes an object; JSON text when the
            column is a read's ``payload_json``, by name or renamed), or several columns (packed as one
            JSON object by column name). Dates and timestamps become ISO 8601 strings,
            decimals strings.
        at: a ``TimestampType`` column with each message's due time (an instant, whatever the session time
            zone), a fixed ``timedelta`` from now, or None for now. ``TIMESTAMP_NTZ`` has no time zone and is
            refused.
        update: replace messages whose keys exist (``offer(update=True)``).
        chunk_size: rows per ``offer_many`` call.

    Everything is checked before anything is written (columns, types, null or over-long keys, null due
    times, the URL), at the cost of one pass over the data.

    Returns the counts summed over the partitions' *successful* task attempts. A task that fails half-way
    and is retried (or runs twice under speculative execution) finds the rows its first attempt wrote: the
    keys deduplicate, so each key is still one message, and those rows count as ``ignored`` (with
    ``update=True``: ``ignored`` or ``updated``). So ``created`` can be lower than the number of messages
    the call created, and ``total`` always equals the number of rows.
    """
    check_queue_name(queue)
    check_url(url)
    if chunk_size < 1:
        raise InvalidInputError("chunk_size must be positive")
    payload_columns = [payload] if isinstance(payload, str) else list(payload)
    if not payload_columns:
        raise InvalidInputError("payload names no column")
    wanted = [key, *payload_columns, *([at] if isinstance(at, str) else [])]
    fields = {f.name: f for f in df.schema.fields}
    missing = [c for c in wanted if c not in fields]
    if missing:
        raise InvalidInputError(
            f"no column {', '.join(map(repr, missing))} in the DataFrame (it has: {', '.join(fields)})"
        )
    if not isinstance(fields[key].dataType, T.StringType):
        raise InvalidKeyError(f"key column {key!r} is {fields[key].dataType.simpleString()}, not a string")
    for name in payload_columns:
        if isinstance(fields[name].dataType, T.BinaryType):
            raise InvalidInputError(f"payload column {name!r} is binary, which JSON cannot hold: encode it first")

    due: Column
    if isinstance(at, str):
        due_type = fields[at].dataType
        if isinstance(due_type, T.TimestampNTZType):
            raise InvalidTimeError(
                f"due column {at!r} is TIMESTAMP_NTZ, a wall-clock time with no time zone: "
                "convert it to a TIMESTAMP (an instant) with to_utc_timestamp or a time zone"
            )
        if not isinstance(due_type, T.TimestampType):
            raise InvalidTimeError(f"due column {at!r} is {due_type.simpleString()}, not a timestamp")
        due = F.unix_micros(F.col(at))
    else:
        due = F.lit(None).cast("long")
    delay_ms = duration_ms(at, "at") if isinstance(at, dt.timedelta) else 0

    packed = F.col(payload_columns[0]) if isinstance(payload, str) else F.struct(*payload_columns)
    rows = df.select(F.col(key).alias(_KEY), packed.alias(_PAYLOAD), due.alias(_DUE_US))
    bad = F.col(_KEY).isNull() | (F.length(_KEY) == 0) | (F.length(_KEY) > MAX_KEY_LENGTH)
    if isinstance(at, str):
        bad = bad | F.col(_DUE_US).isNull()
    offending = rows.where(bad).select(_KEY, _DUE_US).limit(1).collect()
    if offending:
        found = offending[0][_KEY]
        if found is None or not found or len(found) > MAX_KEY_LENGTH:
            raise InvalidKeyError(
                f"column {key!r} holds a null, empty or over-long key ({str(found)[:40]!r}): keys "
                f"are non-empty strings of at most {MAX_KEY_LENGTH} characters"
            )
        raise InvalidTimeError(f"column {at!r} is null for key {found!r}")

    json_text = isinstance(payload, str) and is_json_text(fields[payload])
    settings = (url, queue, table_prefix, update, chunk_size, delay_ms, json_text, _after_chunk)
    totals = rows.rdd.mapPartitions(lambda part: _offer_partition(part, *settings)).collect()
    return sum(totals, OfferCounts())


def _offer_partition(
    rows: Iterable[Any],
    url: str,
    queue_name: str,
    table_prefix: str,
    update: bool,
    chunk_size: int,
    delay_ms: int,
    json_text: bool,
    after_chunk: Callable[[int, int, int], None] | None,
) -> Iterator[OfferCounts]:
    """On an executor: offer one partition's rows in chunks; yield its counts."""
    engine = create_engine(url, pool_size=1)  # one connection, reused by every chunk of the partition
    context = TaskContext.get()
    where = (context.partitionId(), context.attemptNumber()) if context else (0, 0)
    try:
        queue = DelayedQueue(engine, queue_name, table_prefix=table_prefix, notify=False)
        counts = OfferCounts()
        chunk: list[tuple[str, Any, Any]] = []
        done = 0

        def flush() -> None:
            nonlocal counts, done
            outcomes = queue.offer_many(chunk, update=update)
            counts = counts + OfferCounts(
                outcomes.count(OfferOutcome.CREATED),
                outcomes.count(OfferOutcome.UPDATED),
                outcomes.count(OfferOutcome.IGNORED),
            )
            chunk.clear()
            done += 1
            if after_chunk is not None:
                after_chunk(*where, done)

        for row in rows:
            due_us = row[2]
            at = dt.timedelta(milliseconds=delay_ms) if due_us is None else from_ms(due_us // 1000)
            chunk.append((row[0], decoded_json(row[1]) if json_text else _jsonable(row[1]), at))
            if len(chunk) >= chunk_size:
                flush()
        if chunk:
            flush()
        yield counts
    finally:
        engine.dispose()


def _jsonable(value: Any) -> Any:
    if isinstance(value, T.Row):
        return {k: _jsonable(v) for k, v in value.asDict(recursive=False).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dt.date | dt.datetime):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    return value


MESSAGE_SCHEMA = T.StructType(
    [
        T.StructField("id", T.LongType(), False),
        T.StructField("queue", T.StringType(), False),
        T.StructField("key", T.StringType(), False),
        T.StructField("payload", T.BinaryType(), False),
        T.StructField("payload_type", T.StringType(), False),
        T.StructField("payload_json", T.StringType(), True, {JSON_TEXT: True}),
        T.StructField("scheduled_at", T.TimestampType(), True),
        T.StructField("scheduled_at_initially", T.TimestampType(), False),
        T.StructField("created_at", T.TimestampType(), False),
        T.StructField("attempts", T.IntegerType(), False),
        T.StructField("last_error", T.StringType(), True),
        T.StructField("locked", T.BooleanType(), True),
        T.StructField("failed_at", T.TimestampType(), True),
    ]
)


def read_messages(
    spark: SparkSession,
    url: str,
    queue: str | None = None,
    *,
    dead: bool = False,
    table_prefix: str = DEFAULT_PREFIX,
    partitions: int | None = None,
) -> DataFrame:
    """Live messages (or, with ``dead=True``, dead letters) as a DataFrame, read in parallel by id ranges.

    Columns: id, queue, key, payload (binary), payload_type, payload_json (the payload as JSON text when the
    queue stores JSON), scheduled_at, scheduled_at_initially, created_at (timestamps), attempts, last_error,
    locked, failed_at (dead letters).
    """
    check_url(url)
    if queue is not None:
        check_queue_name(queue)
    engine = create_engine(url)
    try:
        with reaching(url), engine.connect() as conn:
            low, high, _ = _views.scan_span(conn, make_tables(table_prefix), dead=dead, queue=queue)
    finally:
        engine.dispose()
    if low is None or high is None:
        return spark.createDataFrame([], MESSAGE_SCHEMA)
    slices = partitions or spark.sparkContext.defaultParallelism
    step = max(1, (high - low + slices) // slices)
    ranges = [(start, min(high, start + step - 1)) for start in range(low, high + 1, step)]
    settings = (url, queue, table_prefix, dead)
    rdd = spark.sparkContext.parallelize(ranges, len(ranges)).flatMap(lambda r: _read_range(r, *settings))
    return spark.createDataFrame(rdd, MESSAGE_SCHEMA)


def _read_range(
    bounds: tuple[int, int], url: str, queue: str | None, table_prefix: str, dead: bool
) -> Iterator[tuple[Any, ...]]:
    query = _views.scan_rows(make_tables(table_prefix), dead=dead, queue=queue, low=bounds[0], high=bounds[1])
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            for r in conn.execute(query).mappings():
                payload = bytes(r["payload"])
                yield (
                    r["id"],
                    r["queue"],
                    r["key"],
                    payload,
                    r["payload_type"],
                    json.dumps(json.loads(payload)) if r["payload_type"] == "json" else None,
                    None if dead else from_ms(r["scheduled_at"]),
                    from_ms(r["scheduled_at_initially"]),
                    from_ms(r["created_at"]),
                    r["attempts"],
                    r["last_error"],
                    None if dead else r["lock_token"] is not None,
                    from_ms(r["failed_at"]) if dead else None,
                )
    finally:
        engine.dispose()
