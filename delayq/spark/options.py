"""The ``delayq`` data source's options, parsed and checked in one place, on the driver, before any work.

Every option is a string (Spark passes them so); names are case-insensitive.

- ``url`` (required): the database URL, which every executor opens itself; an in-memory SQLite database is
  refused (executors could not share it).
- ``queue`` or ``topic`` (exactly one): what is read or written.
- ``dead`` (``false``): with ``queue``, read its dead letters instead of its live messages.
- ``finished`` (``false``): with ``queue``, read the messages kept after they finished instead (``completed``
  or ``cancelled``, with their results and durations: ``DelayedQueue(retention=)``, ``unique_for``).
- ``tag`` (none): with ``queue``, a batch read of only the messages (or dead letters) carrying this tag
  (``offer(tags=)``); the database filters them (``tags LIKE '%,tag,%'``, no index).
- ``group``: with ``topic``, a consumer group whose watermarks follow a streaming query's committed offsets,
  so ``delayq topics lag`` shows the query's lag and garbage collection keeps what it has not read. Use a
  group of its own: no ``Subscription`` may read it.
- ``table_prefix`` (``delayq_``), ``schema`` (none): where delayq's tables are.
- ``update`` (``false``): a queue write replaces messages whose keys exist (``offer(update=True)``).
- ``priority`` (``0``): a queue write's messages' priority, from -1000 to 1000 (``offer_many(priority=)``).
- ``chunk_size`` (500): rows per ``offer_many`` / ``publish_many`` transaction when writing (a task's
  transactions share one connection).
- ``partitions`` (the session's default parallelism, at least 1): input partitions of a queue's batch read.
- ``maxRowsPerTrigger`` (none): a streaming read's limit per micro-batch.
- ``startingOffsets`` (``earliest``): where a new streaming query (no checkpoint) starts: ``earliest`` (the
  oldest retained message), ``latest`` (only what is published from now on), or ``group`` (the ``group``'s
  watermarks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import sqlalchemy as sa

from delayq.dialects import dialect_class
from delayq.engines import create_engine, driver_url
from delayq.errors import DelayqError, InvalidInputError, UnsupportedDatabaseError
from delayq.queue import check_priority, check_queue_name
from delayq.schema import DEFAULT_PREFIX, Tables, check_prefix, make_tables
from delayq.tags import check_tag
from delayq.topics.names import check_group, check_topic_stored

KNOWN = {
    "url",
    "queue",
    "topic",
    "dead",
    "finished",
    "tag",
    "group",
    "table_prefix",
    "schema",
    "update",
    "priority",
    "chunk_size",
    "partitions",
    "maxrowspertrigger",
    "startingoffsets",
    "path",  # Spark adds it for load(path) / save(path); refused below when set
    "checkpointlocation",  # Spark's own, passed along to streaming sinks
    "queryname",
}


def check_url(url: str) -> None:
    """Refuse URLs executors cannot use: bad syntax, unsupported backends, in-memory SQLite. A scheme that names
    no driver (``postgres://``) means delayq's, as the executors' engines take it (``delayq.engines.driver_url``)."""
    try:
        parsed = driver_url(sa.engine.make_url(url))
    except sa.exc.ArgumentError as exc:
        raise UnsupportedDatabaseError(f"bad database URL {url!r}: {exc}") from None
    dialect_class(parsed.get_backend_name()).check_shared_url(parsed)


JSON_TEXT = "delayq.json"
"""Metadata key of the ``payload_json`` columns reads return: their values are JSON text, which a write of the
column (renamed or not) stores as the value it encodes."""


class UnreachableDatabaseError(DelayqError):
    """The database at a source's URL did not answer (refused, unknown host, bad credentials, timed out)."""


@contextlib.contextmanager
def reaching(url: str) -> Iterator[None]:
    """Turn a driver's failure to connect into one line (Spark prints an error's whole traceback)."""
    try:
        yield
    except sa.exc.DBAPIError as exc:
        if not exc.connection_invalidated and exc.statement is not None:
            raise
        cause = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else type(exc.orig).__name__
        shown = sa.engine.make_url(url).render_as_string(hide_password=True)
        raise UnreachableDatabaseError(f"cannot reach the database at {shown}: {cause}") from None


def _bool(options: Mapping[str, str], name: str) -> bool:
    value = str(options.get(name, "false")).strip().lower()
    if value not in ("true", "false"):
        raise InvalidInputError(f"option {name!r} must be true or false, got {value!r}")
    return value == "true"


def _priority(options: Mapping[str, str]) -> int:
    text = str(options.get("priority", "0")).strip()
    try:
        value = int(text)
    except ValueError:
        raise InvalidInputError(f"option 'priority' must be an integer from -1000 to 1000, got {text!r}") from None
    try:
        return check_priority(value)
    except InvalidInputError as exc:
        raise InvalidInputError(f"option {exc}") from None


def _int(options: Mapping[str, str], name: str, default: int | None) -> int | None:
    if name not in options or options[name] is None:
        return default
    try:
        value = int(str(options[name]))
    except ValueError:
        raise InvalidInputError(f"option {name!r} must be a positive integer, got {options[name]!r}") from None
    if value < 1:
        raise InvalidInputError(f"option {name!r} must be a positive integer, got {value}")
    return value


@dataclass(frozen=True)
class SourceOptions:
    """What one ``spark.read/readStream/write/writeStream.format("delayq")`` call asked for, checked."""

    url: str
    queue: str | None = None
    topic: str | None = None
    dead: bool = False
    finished: bool = False
    tag: str | None = None
    group: str | None = None
    table_prefix: str = DEFAULT_PREFIX
    schema: str | None = None
    update: bool = False
    priority: int = 0
    chunk_size: int = 500
    partitions: int | None = None
    max_rows_per_trigger: int | None = None
    starting_offsets: str = "earliest"

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        """Check every option (see the module's docstring); ``InvalidInputError`` names the bad one."""
        given = {str(k).lower(): v for k, v in options.items()}
        unknown = sorted(set(given) - KNOWN)
        if unknown:
            raise InvalidInputError(f"unknown option(s) {', '.join(unknown)} for format delayq")
        if given.get("path"):
            raise InvalidInputError("format delayq takes no path: use .option('queue', …) or .option('topic', …)")
        url = given.get("url")
        if not url:
            raise InvalidInputError("format delayq needs the database URL: .option('url', 'postgresql+psycopg://…')")
        check_url(url)
        queue, topic = given.get("queue"), given.get("topic")
        if (queue is None) == (topic is None):
            raise InvalidInputError("format delayq needs exactly one of the options 'queue' and 'topic'")
        if queue is not None:
            check_queue_name(queue)
        if topic is not None:
            check_topic_stored(topic)
        group = given.get("group")
        if group is not None:
            if topic is None:
                raise InvalidInputError("option 'group' applies to a topic only")
            check_group(group)
        prefix = given.get("table_prefix") or DEFAULT_PREFIX
        check_prefix(prefix)
        starting = str(given.get("startingoffsets", "earliest")).lower()
        if starting not in ("earliest", "latest", "group"):
            raise InvalidInputError(f"option 'startingOffsets' is earliest, latest or group, got {starting!r}")
        if starting == "group" and group is None:
            raise InvalidInputError("startingOffsets=group needs the option 'group'")
        dead = _bool(given, "dead")
        if dead and queue is None:
            raise InvalidInputError(
                "option 'dead' applies to a queue (a topic's dead letters are the topic {topic}_dlq)"
            )
        finished = _bool(given, "finished")
        if finished and (queue is None or dead):
            raise InvalidInputError("option 'finished' applies to a queue, without 'dead'")
        tag = given.get("tag")
        if tag is not None:
            if queue is None:
                raise InvalidInputError("option 'tag' applies to a queue only")
            try:
                check_tag(tag)
            except InvalidInputError as exc:
                raise InvalidInputError(f"option {exc}") from None
        return cls(
            url=url,
            queue=queue,
            topic=topic,
            dead=dead,
            finished=finished,
            tag=tag,
            group=group,
            table_prefix=prefix,
            schema=given.get("schema") or None,
            update=_bool(given, "update"),
            priority=_priority(given),
            chunk_size=_int(given, "chunk_size", 500) or 500,
            partitions=_int(given, "partitions", None),
            max_rows_per_trigger=_int(given, "maxrowspertrigger", None),
            starting_offsets=starting,
        )

    def engine(self) -> sa.Engine:
        """A new engine on ``url`` for one task, which disposes it at the end.

        Its pool keeps one connection, so a write's chunks share it: one connect per task, not per chunk
        (about 8 ms on PostgreSQL), and PostgreSQL keeps the statements psycopg prepared on it.
        """
        return create_engine(self.url, pool_size=1)

    @property
    def what(self) -> str:
        return f"queue {self.queue!r}" if self.queue is not None else f"topic {self.topic!r}"

    def tables(self) -> Tables:
        return make_tables(self.table_prefix, self.schema)
