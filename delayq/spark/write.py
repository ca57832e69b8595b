"""Batch and streaming writes of the ``delayq`` data source: rows become offers (a queue) or publishes (a topic).

The DataFrame's columns, checked on the driver before any task runs:

- a queue: ``key`` (string, required); ``at`` (a ``TIMESTAMP``, optional: due now when absent; a
  ``TIMESTAMP_NTZ`` has no time zone and is refused); ``payload`` (any JSON-able column) or, without one,
  ``payload_json`` (JSON text, as a read returns it: stored as the value it encodes), or every other column
  packed as one JSON object by name. A ``payload`` column that is a read's ``payload_json`` renamed (Spark
  keeps the column's metadata, ``delayq.json``) is JSON text too.
- a topic: ``key`` (the partition key, string), ``id`` (the message id, string); the payload as for a queue.

Each task offers (publishes) its rows in chunks of ``chunk_size``, one transaction each. Keys (message
ids) deduplicate, so a task retried after a failure, a speculative duplicate, or a micro-batch that Spark
replays after a restart creates nothing twice: a replayed chunk's rows come back ``IGNORED`` (with
``update=true``, ``IGNORED`` or ``UPDATED`` when the row changed). Each task's counts travel to the driver
in its commit message; the job's (micro-batch's) sum is logged at INFO by the ``delayq.spark`` logger on
the driver's Python worker: with ``spark.sql.pyspark.worker.logging.enabled=true`` the line is in
``spark.tvf.python_worker_logs()``. (``offer_dataframe`` returns the counts instead.)
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pyspark.sql import types as T
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from delayq.errors import InvalidInputError, InvalidKeyError, InvalidTimeError
from delayq.messages import OfferOutcome
from delayq.queue import DelayedQueue
from delayq.spark.options import JSON_TEXT, SourceOptions
from delayq.topics.topic import Topic

Item = TypeVar("Item")
log = logging.getLogger("delayq.spark")
log.setLevel(logging.INFO)  # the counts of every write are its report (Spark's Python worker logs keep them)


@dataclass
class WriteCounts(WriterCommitMessage):
    """One task's (or, summed, one job's) outcomes."""

    created: int = 0
    updated: int = 0
    ignored: int = 0

    def add(self, outcomes: list[OfferOutcome]) -> None:
        self.created += outcomes.count(OfferOutcome.CREATED)
        self.updated += outcomes.count(OfferOutcome.UPDATED)
        self.ignored += outcomes.count(OfferOutcome.IGNORED)


@dataclass(frozen=True)
class Layout:
    """Which columns hold what: the key, the id (topics), the due time (queues), the payload."""

    key: str
    id: str | None
    at: str | None
    payload: str | None  # one column, or None: every other column, packed as an object
    packed: tuple[str, ...]
    json_text: bool = False  # the payload column holds JSON text (``payload_json``): stored decoded


def layout_for(opts: SourceOptions, schema: T.StructType) -> Layout:
    """Check the DataFrame's columns for this target; raise before anything is written."""
    fields = {f.name: f.dataType for f in schema.fields}
    if "key" not in fields:
        raise InvalidInputError(f"writing to {opts.what} needs a string column 'key' (it has: {', '.join(fields)})")
    if not isinstance(fields["key"], T.StringType):
        raise InvalidKeyError(f"column 'key' is {fields['key'].simpleString()}, not a string")
    reserved = ["key"]
    message_id = at = None
    if opts.topic is not None:
        if not isinstance(fields.get("id"), T.StringType):
            raise InvalidInputError(f"publishing to {opts.what} needs a string column 'id' (the message id)")
        message_id = "id"
        reserved.append("id")
    elif "at" in fields:
        kind = fields["at"]
        if isinstance(kind, T.TimestampNTZType):
            raise InvalidTimeError(
                "column 'at' is TIMESTAMP_NTZ, a wall-clock time with no time zone: convert it to a TIMESTAMP "
                "(an instant) with to_utc_timestamp or make_timestamp(…, timezone)"
            )
        if not isinstance(kind, T.TimestampType):
            raise InvalidTimeError(f"column 'at' is {kind.simpleString()}, not a timestamp")
        at = "at"
        reserved.append("at")
    payload = "payload" if "payload" in fields else "payload_json" if "payload_json" in fields else None
    json_text = payload is not None and is_json_text(schema[payload])
    if payload == "payload_json" and not json_text:
        raise InvalidInputError(f"column 'payload_json' is {fields[payload].simpleString()}, not JSON text (a string)")
    packed = () if payload else tuple(name for name in fields if name not in reserved)
    if payload is None and not packed:
        raise InvalidInputError("no payload: add a column 'payload', or columns to pack as the payload")
    for name in [payload] if payload else packed:
        if isinstance(fields[name], T.BinaryType):
            raise InvalidInputError(f"payload column {name!r} is binary, which JSON cannot hold: encode it first")
    return Layout("key", message_id, at, payload, packed, json_text)


def is_json_text(field: T.StructField) -> bool:
    """A string column of JSON text: named ``payload_json``, or marked so by a read (renamed since)."""
    return isinstance(field.dataType, T.StringType) and (
        field.name == "payload_json" or bool((field.metadata or {}).get(JSON_TEXT))
    )


def write_rows(opts: SourceOptions, layout: Layout, batches: Iterator[Any]) -> WriteCounts:
    """On an executor: offer or publish the task's rows, chunk by chunk; its counts."""
    counts = WriteCounts()
    engine = opts.engine()
    try:
        if opts.queue is not None:
            queue = DelayedQueue(engine, opts.queue, table_prefix=opts.table_prefix, schema=opts.schema, notify=True)
            for chunk in _chunks(_offer_items(layout, batches), opts.chunk_size):
                counts.add(queue.offer_many(chunk, update=opts.update, priority=opts.priority))
        else:
            assert opts.topic is not None
            topic = Topic(engine, opts.topic, table_prefix=opts.table_prefix, schema=opts.schema)
            for chunk in _chunks(_publish_items(layout, batches), opts.chunk_size):
                counts.add(topic.publish_many(chunk))
    finally:
        engine.dispose()
    return counts


def _chunks(items: Iterator[Item], size: int) -> Iterator[list[Item]]:
    chunk: list[Item] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# The Arrow batches are read a column at a time (one ``to_pylist`` each), not as a dictionary per row.
def _column(batch: Any, name: str) -> list[Any]:
    return list(batch.column(name).to_pylist())


def _payloads(layout: Layout, batch: Any) -> list[Any]:
    if layout.payload is not None and layout.json_text:
        return [decoded_json(v) for v in _column(batch, layout.payload)]
    if layout.payload is not None:
        return [_jsonable(v) for v in _column(batch, layout.payload)]
    columns = [_column(batch, name) for name in layout.packed]
    return [
        {name: _jsonable(v) for name, v in zip(layout.packed, values, strict=True)}
        for values in zip(*columns, strict=True)
    ]


def decoded_json(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidInputError(f"a payload_json value is not JSON: {text[:40]!r}") from None


def _offer_items(layout: Layout, batches: Iterator[Any]) -> Iterator[tuple[str, Any, Any]]:
    for batch in batches:
        keys, payloads = _column(batch, layout.key), _payloads(layout, batch)
        if layout.at is None:
            yield from ((key, payload, None) for key, payload in zip(keys, payloads, strict=True))
            continue
        for key, payload, at in zip(keys, payloads, _column(batch, layout.at), strict=True):
            if at is None:
                raise InvalidTimeError(f"column 'at' is null for key {key!r}")
            if at.tzinfo is None:  # Arrow timestamps without a zone are UTC
                at = at.replace(tzinfo=dt.UTC)
            yield key, payload, at


def _publish_items(layout: Layout, batches: Iterator[Any]) -> Iterator[tuple[str, str, Any]]:
    assert layout.id is not None
    for batch in batches:
        yield from zip(_column(batch, layout.key), _column(batch, layout.id), _payloads(layout, batch), strict=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        if value and all(isinstance(v, tuple) and len(v) == 2 for v in value):  # an Arrow map: (key, value) pairs
            return {str(k): _jsonable(v) for k, v in value}
        return [_jsonable(v) for v in value]
    if isinstance(value, dt.date | dt.datetime):
        return value.isoformat()
    if hasattr(value, "as_tuple"):  # decimal.Decimal
        return str(value)
    return value


def _total(messages: list[WriterCommitMessage | None]) -> WriteCounts:
    total = WriteCounts()
    for m in messages:
        if isinstance(m, WriteCounts):
            total.created += m.created
            total.updated += m.updated
            total.ignored += m.ignored
    return total


class DelayqWriter(DataSourceArrowWriter):
    """A batch write (``df.write.format("delayq")``)."""

    def __init__(self, opts: SourceOptions, schema: T.StructType) -> None:
        self.opts, self.layout = opts, layout_for(opts, schema)

    def write(self, iterator: Iterator[Any]) -> WriteCounts:
        return write_rows(self.opts, self.layout, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        c = _total(messages)
        log.info(
            "delayq: wrote to %s: created %d, updated %d, ignored %d", self.opts.what, c.created, c.updated, c.ignored
        )


class DelayqStreamWriter(DataSourceStreamArrowWriter):
    """A streaming write (``writeStream.format("delayq")``); each micro-batch as a batch write, idempotent
    because keys (ids) deduplicate: a micro-batch replayed after a failure creates nothing twice."""

    def __init__(self, opts: SourceOptions, schema: T.StructType) -> None:
        self.opts, self.layout = opts, layout_for(opts, schema)

    def write(self, iterator: Iterator[Any]) -> WriteCounts:
        return write_rows(self.opts, self.layout, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        c = _total(messages)
        log.info(
            "delayq: micro-batch %d to %s: created %d, updated %d, ignored %d",
            batchId,
            self.opts.what,
            c.created,
            c.updated,
            c.ignored,
        )
