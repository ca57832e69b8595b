"""delayq's tables as SQLAlchemy metadata.

``make_tables(prefix, schema)`` builds (once per prefix and schema) the live-message table, the
dead-letter table and the cron schedules' records; ``metadata`` holds the default ``delayq_*``
tables. The Alembic migrations build exactly this schema, and a test holds them to it. Keys, ids and
names are ``name_type`` columns: compared byte for byte on every backend, trailing spaces included.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from delayq.dialects.types import TABLE_OPTIONS, BigId, Payload, key_type, name_type
from delayq.errors import InvalidInputError

MAX_KEY_LENGTH = 200
MAX_QUEUE_LENGTH = 100
MAX_SCHEDULE_NAME_LENGTH = 150
DEFAULT_PREFIX = "delayq_"


@dataclass(frozen=True, eq=False)
class Tables:
    """The tables of one delayq installation (one prefix in one schema)."""

    metadata: sa.MetaData
    messages: sa.Table
    dead_letters: sa.Table
    schedules: sa.Table
    topics: TopicTables
    flow: sa.Table
    """One row per queue whose flow was ever set: paused, or offered a priority (``delayq.queue._flow``)."""
    finished: sa.Table
    """Messages kept after they finished: completed (retention, ``unique_for``) or cancelled (``delayq.queue``)."""
    chores: sa.Table
    """One row per background chore (the pruner): which process holds it until when, so one runs at a time."""
    workers: sa.Table
    """One row per worker (``Worker``, ``AsyncWorker``) that ran lately: its heartbeat (``delayq.runtime``)."""
    audit: sa.Table
    """One row per operator's action from the dashboard or the CLI: who, what, where, when (``delayq.queue._audit``)."""
    queue_history: sa.Table
    """Per queue and minute: deliveries processed, failed, dead-lettered, as workers count them (``delayq.runtime``)."""


@dataclass(frozen=True, eq=False)
class TopicTables:
    """The tables of topics (``delayq.topics``); see docs/topics.md for each one."""

    topics: sa.Table
    heads: sa.Table
    log: sa.Table
    deliveries: sa.Table
    leases: sa.Table
    offsets: sa.Table
    subscribers: sa.Table


def _message_columns() -> list[sa.Column[Any]]:
    """The columns a live message and a dead letter share (new objects for each table)."""
    return [
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("queue", name_type(MAX_QUEUE_LENGTH), nullable=False),
        sa.Column("key", key_type(MAX_KEY_LENGTH), nullable=False),
        sa.Column("payload", Payload, nullable=False),
        sa.Column("payload_type", sa.String(100), nullable=False),
    ]


def _origin_columns() -> list[sa.Column[Any]]:
    """What a kept row (dead letter, finished message) keeps of where it came from (delayq_0013): the live row's
    priority and group, and the registry id (``{prefix}workers.id``) of the worker that recorded its outcome;
    NULL in rows kept before, and ``worker`` NULL for an outcome recorded outside a worker (new objects for each
    table)."""
    return [
        sa.Column("priority", sa.SmallInteger, nullable=True),
        sa.Column("group_key", name_type(MAX_KEY_LENGTH), nullable=True),
        sa.Column("worker", sa.String(36), nullable=True),
    ]


MAX_PREFIX_LENGTH = 63 - len("dead_letters_queue_key_ix")
"""The longest table prefix: its longest derived name (an index) must fit in 63 characters."""


def check_prefix(prefix: object) -> None:
    """Raise ``InvalidInputError`` for a table prefix delayq cannot build names from."""
    if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prefix):
        raise InvalidInputError(f"table prefix must be letters, digits and underscores, got {prefix!r}")
    if len(prefix) > MAX_PREFIX_LENGTH:
        raise InvalidInputError(
            f"table prefix is {len(prefix)} characters long; at most {MAX_PREFIX_LENGTH} fit in the database's names"
        )


@functools.cache
def make_tables(prefix: str = DEFAULT_PREFIX, schema: str | None = None) -> Tables:
    """The tables named ``{prefix}messages``, ``{prefix}dead_letters`` and ``{prefix}schedules`` in ``schema``.

    ``prefix`` is letters, digits and underscores, at most ``MAX_PREFIX_LENGTH`` long, so that every
    name delayq makes from it fits PostgreSQL's 63-character identifiers (and MySQL's 64).
    """
    check_prefix(prefix)
    md = sa.MetaData(schema=schema)
    messages = sa.Table(
        f"{prefix}messages",
        md,
        *_message_columns(),
        sa.Column("scheduled_at", sa.BigInteger, nullable=False),
        sa.Column("scheduled_at_initially", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("lock_token", sa.String(36), nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("attempt_history", sa.Text, nullable=True),
        sa.Column("headers", sa.Text, nullable=True),
        sa.Column("priority", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("group_key", name_type(MAX_KEY_LENGTH), nullable=True),
        sa.Column("tags", sa.Text, nullable=True),
        sa.Column("unique_for_ms", sa.BigInteger, nullable=True),
        sa.UniqueConstraint("queue", "key", name=f"{prefix}messages_queue_key_uq"),
        sa.Index(f"{prefix}messages_due_ix", "queue", "scheduled_at", "id"),
        # Partial where the backend can (PostgreSQL, SQLite): only messages with a priority other than 0, so the
        # offers and claims of queues without priorities maintain no entry in it (MySQL/MariaDB: every message).
        sa.Index(
            f"{prefix}messages_priority_ix",
            "queue",
            "priority",
            "scheduled_at",
            "id",
            postgresql_where=sa.text("priority <> 0"),
            sqlite_where=sa.text("priority <> 0"),
        ),
        sa.Index(f"{prefix}messages_lock_ix", "lock_token"),
        **TABLE_OPTIONS,
    )
    dead_letters = sa.Table(
        f"{prefix}dead_letters",
        md,
        *_message_columns(),
        sa.Column("scheduled_at_initially", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("attempt_history", sa.Text, nullable=True),
        sa.Column("headers", sa.Text, nullable=True),
        sa.Column("failed_at", sa.BigInteger, nullable=False),
        sa.Column("tags", sa.Text, nullable=True),
        sa.Column("expires_at", sa.BigInteger, nullable=True),
        *_origin_columns(),
        sa.Index(f"{prefix}dead_letters_queue_key_ix", "queue", "key"),
        sa.Index(f"{prefix}dead_letters_expires_ix", "expires_at"),
        sa.Index(f"{prefix}dead_letters_failed_ix", "queue", "failed_at"),
        **TABLE_OPTIONS,
    )
    # One row per installed cron schedule (delayq.cron): what it is, and who refreshed it when (database time).
    schedules = sa.Table(
        f"{prefix}schedules",
        md,
        sa.Column("queue", name_type(MAX_QUEUE_LENGTH), primary_key=True),
        sa.Column("name", name_type(MAX_SCHEDULE_NAME_LENGTH), primary_key=True),
        sa.Column("definition", sa.Text, nullable=False),
        sa.Column("config_hash", sa.String(32), nullable=False),
        sa.Column("installed_at", sa.BigInteger, nullable=False),
        sa.Column("refreshed_at", sa.BigInteger, nullable=False),
        sa.Column("refreshed_by", sa.String(200), nullable=False),
        sa.Column("installed_until", sa.BigInteger, nullable=True),
        **TABLE_OPTIONS,
    )
    # One row per queue whose flow was ever set: paused or not, whether it was ever offered a priority (its
    # claims then take one priority level at a time), its concurrency limit, its rate limit (``rate`` claims per
    # ``rate_period_ms``) and that limit's token bucket (``tokens`` as of ``tokens_at``, database time), whether
    # it was offered groups (``grouped``) and how many of one group may run at once (``group_concurrency``, 1).
    # Claimers cache it (``DelayedQueue(flow_refresh=)``); a limited queue's claims lock it.
    flow = sa.Table(
        f"{prefix}queue_flow",
        md,
        sa.Column("queue", name_type(MAX_QUEUE_LENGTH), primary_key=True),
        sa.Column("paused", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("priorities", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("concurrency", sa.Integer, nullable=True),
        sa.Column("rate", sa.Integer, nullable=True),
        sa.Column("rate_period_ms", sa.BigInteger, nullable=True),
        sa.Column("tokens", sa.Double(), nullable=True),
        sa.Column("tokens_at", sa.BigInteger, nullable=True),
        sa.Column("grouped", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("group_concurrency", sa.Integer, nullable=True),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
        **TABLE_OPTIONS,
    )
    # Messages kept after they finished (delayq_0007): ``state`` 1 completed (acked while the queue keeps a
    # history, or offered with ``unique_for``), 2 cancelled (while a handler ran it, or while the queue keeps a
    # history); the handler's result when the queue keeps results; deleted by the pruner once ``expires_at`` passed.
    finished = sa.Table(
        f"{prefix}finished",
        md,
        *_message_columns(),
        sa.Column("state", sa.SmallInteger, nullable=False),
        sa.Column("scheduled_at_initially", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("attempt_history", sa.Text, nullable=True),
        sa.Column("headers", sa.Text, nullable=True),
        sa.Column("tags", sa.Text, nullable=True),
        sa.Column("finished_at", sa.BigInteger, nullable=False),
        sa.Column("duration_ms", sa.BigInteger, nullable=True),
        sa.Column("result", Payload, nullable=True),
        sa.Column("result_type", sa.String(100), nullable=True),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        *_origin_columns(),
        sa.Index(f"{prefix}finished_queue_key_ix", "queue", "key", "finished_at"),
        sa.Index(f"{prefix}finished_state_ix", "queue", "state", "finished_at", "id"),
        sa.Index(f"{prefix}finished_expires_ix", "expires_at"),
        **TABLE_OPTIONS,
    )
    # One row per background chore shared by all workers (the pruner of kept rows): the process holding it and
    # until when (database time); a worker runs the chore only while its row is its own.
    chores = sa.Table(
        f"{prefix}chores",
        md,
        sa.Column("name", name_type(MAX_QUEUE_LENGTH), primary_key=True),
        sa.Column("holder", sa.String(200), nullable=True),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        sa.Column("done_at", sa.BigInteger, nullable=True),
        **TABLE_OPTIONS,
    )
    # One row per worker (delayq_0010): where it runs, what it serves, its slots and how many are in use as of
    # its last heartbeat (database time); ``stopped_at`` set by a clean stop. Each worker deletes the rows whose
    # heartbeat is long gone (``delayq.runtime._registry``).
    workers = sa.Table(
        f"{prefix}workers",
        md,
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("driver", sa.String(20), nullable=False),
        sa.Column("queues", sa.Text, nullable=False),
        sa.Column("topics", sa.Text, nullable=False),
        sa.Column("slots", sa.Integer, nullable=False),
        sa.Column("slots_in_use", sa.Integer, nullable=False),
        sa.Column("handled", sa.BigInteger, nullable=False),
        sa.Column("started_at", sa.BigInteger, nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger, nullable=False),
        sa.Column("stopped_at", sa.BigInteger, nullable=True),
        sa.Column("running", sa.Text, nullable=True),  # (delayq_0012) JSON: what its handlers run, at its heartbeat
        sa.Index(f"{prefix}workers_heartbeat_ix", "heartbeat_at"),
        **TABLE_OPTIONS,
    )
    # Per queue and minute (delayq_0012; the minute's start, database time): deliveries the workers processed,
    # failed (to be retried) and dead-lettered. Each worker adds its counts with its heartbeat; rows older than a
    # day are deleted by the running workers (``delayq.runtime._registry``).
    queue_history = sa.Table(
        f"{prefix}queue_history",
        md,
        sa.Column("queue", name_type(MAX_QUEUE_LENGTH), primary_key=True),
        sa.Column("minute", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("processed", sa.BigInteger, nullable=False),
        sa.Column("failed", sa.BigInteger, nullable=False),
        sa.Column("dead_lettered", sa.BigInteger, nullable=False),
        sa.Index(f"{prefix}queue_history_minute_ix", "minute"),
        **TABLE_OPTIONS,
    )
    # One row per operator's action (delayq_0011): who (``actor``) from where (``source``: web, cli) did what to
    # which queue under which filter (a JSON object), how many messages it affected, when (database time).
    audit = sa.Table(
        f"{prefix}audit",
        md,
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("at", sa.BigInteger, nullable=False),
        sa.Column("source", sa.String(10), nullable=False),
        sa.Column("actor", name_type(200), nullable=False),
        sa.Column("action", name_type(50), nullable=False),
        sa.Column("queue", name_type(MAX_QUEUE_LENGTH), nullable=True),
        sa.Column("filter", sa.Text, nullable=True),
        sa.Column("count", sa.BigInteger, nullable=True),
        sa.Index(f"{prefix}audit_queue_ix", "queue", "id"),
        sa.Index(f"{prefix}audit_actor_ix", "actor", "id"),
        **TABLE_OPTIONS,
    )
    return Tables(
        md,
        messages,
        dead_letters,
        schedules,
        make_topic_tables(prefix, md),
        flow,
        finished,
        chores,
        workers,
        audit,
        queue_history,
    )


MAX_TOPIC_LENGTH = 100
MAX_GROUP_LENGTH = 100
MAX_SUBSCRIBER_LENGTH = 200
MAX_MESSAGE_ID_LENGTH = 200
MAX_LOG_ID_LENGTH = MAX_GROUP_LENGTH + 1 + MAX_MESSAGE_ID_LENGTH
"""A dead letter's id is ``{group}:{id}``: each group's dead letter of one message is a row of its own."""


def make_topic_tables(prefix: str, md: sa.MetaData) -> TopicTables:
    """The topic tables, ``{prefix}topic*``, in ``md`` (``make_tables`` adds them to every table set)."""

    def group_topic_partition() -> list[sa.Column[Any]]:
        return [
            sa.Column("consumer_group", name_type(MAX_GROUP_LENGTH), primary_key=True),
            sa.Column("topic", name_type(MAX_TOPIC_LENGTH), primary_key=True),
            sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
        ]

    # One row per topic: its partition count, fixed when it was created.
    topics = sa.Table(
        f"{prefix}topics",
        md,
        sa.Column("topic", name_type(MAX_TOPIC_LENGTH), primary_key=True),
        sa.Column("partitions", sa.Integer, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        **TABLE_OPTIONS,
    )
    # One row per partition: the last offset given out (publishers lock it: offsets follow commit
    # order) and the offset up to which the log was collected.
    heads = sa.Table(
        f"{prefix}topic_heads",
        md,
        sa.Column("topic", name_type(MAX_TOPIC_LENGTH), primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("head", sa.BigInteger, nullable=False),
        sa.Column("collected", sa.BigInteger, nullable=False),
        **TABLE_OPTIONS,
    )
    # The immutable log, shared by every consumer group. Dead letters are rows of the topic
    # ``{topic}_dlq`` with the failure columns set.
    log = sa.Table(
        f"{prefix}topic_log",
        md,
        sa.Column("topic", name_type(MAX_TOPIC_LENGTH), primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("message_offset", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("partition_key", name_type(MAX_KEY_LENGTH), nullable=False),
        sa.Column("message_id", name_type(MAX_LOG_ID_LENGTH), nullable=False),
        sa.Column("payload", Payload, nullable=False),
        sa.Column("payload_type", sa.String(100), nullable=False),
        sa.Column("published_at", sa.BigInteger, nullable=False),
        sa.Column("original_topic", name_type(MAX_TOPIC_LENGTH), nullable=True),
        sa.Column("original_offset", sa.BigInteger, nullable=True),
        sa.Column("failed_group", name_type(MAX_GROUP_LENGTH), nullable=True),
        sa.Column("failed_at", sa.BigInteger, nullable=True),
        sa.Column("failure_count", sa.Integer, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("headers", sa.Text, nullable=True),  # (delayq_0009) a JSON object: the publish's trace context
        sa.UniqueConstraint("topic", "partition_key", "message_id", name=f"{prefix}topic_log_id_uq"),
        **TABLE_OPTIONS,
    )
    # Per group, the messages above its watermark that were delivered: status 0 pending (in flight
    # or waiting out a nack), 1 acked, 2 dead-lettered. Deleted once the watermark passes them.
    deliveries = sa.Table(
        f"{prefix}topic_deliveries",
        md,
        *group_topic_partition(),
        sa.Column("message_offset", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("status", sa.SmallInteger, nullable=False),
        sa.Column("invisible_until", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        **TABLE_OPTIONS,
    )
    # Per group and partition: who holds it, until when, and the fencing epoch (raised on every acquisition).
    leases = sa.Table(
        f"{prefix}topic_leases",
        md,
        *group_topic_partition(),
        sa.Column("holder", name_type(MAX_SUBSCRIBER_LENGTH), nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("acquired_at", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        sa.Index(f"{prefix}topic_leases_holder_ix", "holder"),
        **TABLE_OPTIONS,
    )
    # Per group and partition: the watermark (every offset at or below it is done for the group).
    offsets = sa.Table(
        f"{prefix}topic_offsets",
        md,
        *group_topic_partition(),
        sa.Column("acked_offset", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
        # The in-flight range (acked_offset, delivered_offset] and its deadline, and the highest offset with a
        # topic_deliveries row (docs/topics.md, "Delivery state"; delayq_0008).
        sa.Column("delivered_offset", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("range_until", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("marked_upto", sa.BigInteger, nullable=False, server_default="0"),
        sa.Index(f"{prefix}topic_offsets_topic_ix", "topic", "partition"),
        **TABLE_OPTIONS,
    )
    # Per group: its subscribers' heartbeats (the live ones share the partitions).
    subscribers = sa.Table(
        f"{prefix}topic_subscribers",
        md,
        sa.Column("consumer_group", name_type(MAX_GROUP_LENGTH), primary_key=True),
        sa.Column("topic", name_type(MAX_TOPIC_LENGTH), primary_key=True),
        sa.Column("subscriber", name_type(MAX_SUBSCRIBER_LENGTH), primary_key=True),
        sa.Column("heartbeat_at", sa.BigInteger, nullable=False),
        sa.Column("deregistered_at", sa.BigInteger, nullable=True),
        **TABLE_OPTIONS,
    )
    return TopicTables(topics, heads, log, deliveries, leases, offsets, subscribers)


_default = make_tables()
metadata = _default.metadata
messages = _default.messages
dead_letters = _default.dead_letters
