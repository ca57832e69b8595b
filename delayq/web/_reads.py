"""What the pages show, read through delayq's public operations only (as ``delayq stats``, ``ls``, ``show``,
``cron ls`` and ``topics`` read it): no statement of its own.

Optional fields that a newer ``QueueStats`` or ``Message`` may carry (``completed``, ``cancelled``, ``result``)
are shown when present (``getattr``), so the pages need no change when they arrive.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from delayq.browse import (
    SearchCursor,
    State,
    StoredMessage,
    WorkerInfo,
    arrival_marks,
    database_now,
    list_messages,
    list_workers,
    queue_names,
    search_messages,
)
from delayq.cron import schedule_views
from delayq.errors import SerializationMismatchError
from delayq.humanize import human, shorten
from delayq.messages import FlowState, Message, QueueStats
from delayq.queue import DelayedQueue, check_key, check_prefix
from delayq.schema import Tables, make_tables
from delayq.serializers import BytesSerializer, JsonSerializer, Serializer, TextSerializer
from delayq.topics.names import check_topic_stored, dead_letter_topic
from delayq.topics.views import (
    GroupSummary,
    PartitionLag,
    SubscriberBeat,
    TopicSummary,
    group_lag,
    list_groups,
    list_subscribers,
    list_topics,
)

PAGE = 50
"""Messages per page of a listing."""
PAYLOAD_SHOWN = 160
"""Characters of a payload (as JSON) a listing shows; the message's page shows it whole."""
OPTIONAL_COUNTS = ("completed", "cancelled")
"""Counts a ``QueueStats`` may carry beyond today's; shown where present."""


@dataclass(frozen=True)
class Where:
    """Where delayq's tables are, and the engine that reaches them."""

    engine: sa.Engine
    prefix: str
    schema: str | None

    @property
    def tables(self) -> Tables:
        return make_tables(self.prefix, self.schema)

    def queue(self, name: str) -> DelayedQueue:
        """The queue as an operator acts on it: payloads are not decoded, any serializer's rows qualify."""
        return DelayedQueue(
            self.engine, name, table_prefix=self.prefix, schema=self.schema, serializer=BytesSerializer()
        )


@dataclass(frozen=True)
class QueueView:
    """One queue's line of the overview."""

    name: str
    stats: QueueStats
    flow: FlowState
    marks: tuple[int, int | None, int] | None = None
    """``browse.arrival_marks`` of the queue (count, highest id, count at or below the last read's highest id)."""

    def as_dict(self) -> dict[str, Any]:
        s, f = self.stats, self.flow
        extra = {n: getattr(s, n) for n in OPTIONAL_COUNTS if getattr(s, n, None) is not None}
        age = None if s.oldest_due_age is None else s.oldest_due_age.total_seconds()
        return {
            "queue": self.name,
            "ready": s.ready,
            "scheduled": s.scheduled,
            "in_flight": s.in_flight,
            "expired_locks": s.expired_locks,
            "dead": s.dead,
            **extra,
            "oldest_due_s": age,
            "oldest_due": "-" if s.oldest_due_age is None else human(s.oldest_due_age),
            "paused": f.paused,
            "limits": limits_text(f),
        }


def limits_text(f: FlowState) -> str:
    """A queue's limits in a few words, as ``delayq stats`` shows them ("-" for none)."""
    return f.describe_limits() or "-"


def overview(where: Where, below: Mapping[str, int] | None = None) -> tuple[dt.datetime, list[QueueView]]:
    """The database's now and every queue's counts and flow settings (two reads a queue, one connection);
    with ``below`` (per queue, the highest id of the last read), its arrival marks too (a third read)."""
    with where.engine.connect() as conn:
        now = database_now(conn)
        views = []
        for name in queue_names(conn, where.tables):
            q = where.queue(name)
            marks = None if below is None else arrival_marks(conn, where.tables, name, below.get(name, 0))
            views.append(QueueView(name, q.stats(using=conn), q.flow(using=conn), marks))
        conn.rollback()
    return now, views


def one_queue(where: Where, name: str) -> QueueView:
    """One queue's counts and flow settings (a queue the database knows nothing of shows zeros)."""
    with where.engine.connect() as conn:
        q = where.queue(name)
        view = QueueView(name, q.stats(using=conn), q.flow(using=conn))
        conn.rollback()
    return view


@dataclass(frozen=True)
class Page:
    """A page of a listing, and the cursor of the next (None on the last)."""

    now: dt.datetime
    messages: list[StoredMessage]
    next_after: str | None
    next_queue: str | None = None
    """A search's: the queue the next page starts in (with ``next_after``)."""


def encode_cursor(m: StoredMessage) -> str:
    """A message's cursor in a URL: ``due.id.key``."""
    due, ident, key = m.cursor
    return f"{due}.{ident}.{key}"


CURSOR_INT = 2**63 - 1
"""The largest number a cursor's time or id may hold (a BIGINT on every backend)."""


def decode_cursor(text: str | None) -> tuple[int, int, str] | None:
    """A cursor from a URL; None when absent. ``ValueError`` when it is not one: numbers outside a BIGINT's
    range, or a key no message can have, never reach the database."""
    if not text:
        return None
    due, ident, key = text.split(".", 2)
    numbers = int(due), int(ident)
    if not all(-CURSOR_INT <= n <= CURSOR_INT for n in numbers):
        raise ValueError("cursor out of range")
    return numbers[0], numbers[1], check_key(key)


def messages_page(
    where: Where,
    queue: str,
    *,
    state: State | None,
    key_prefix: str | None,
    after: tuple[int, int, str] | None,
    tag: str | None = None,
) -> Page:
    """A page of a queue's messages (or dead letters, with ``State.DEAD``), keyset-paginated; with ``tag``,
    only those carrying it. ``InvalidKeyError`` for a prefix no key can start with (a NUL, say)."""
    key_prefix = check_prefix(key_prefix) if key_prefix else None
    with where.engine.connect() as conn:
        now = database_now(conn)
        found = list_messages(
            conn,
            where.tables,
            queue,
            state=state,
            now=now,
            key_prefix=key_prefix or None,
            limit=PAGE + 1,
            after=after,
            by_key=bool(key_prefix),  # (under a prefix, by key: a range of the (queue, key) index)
            tag=tag or None,
        )
        conn.rollback()
    more = len(found) > PAGE
    found = found[:PAGE]
    return Page(now, found, encode_cursor(found[-1]) if more and found else None)


def search_page(
    where: Where,
    *,
    state: State | None,
    key_prefix: str | None,
    tag: str | None,
    after: SearchCursor | None,
) -> Page:
    """A page of every queue's messages in ``state`` under ``key_prefix`` carrying ``tag``
    (``browse.search_messages``), keyset-paginated. ``InvalidKeyError`` for a prefix no key can start with."""
    key_prefix = check_prefix(key_prefix) if key_prefix else None
    with where.engine.connect() as conn:
        now = database_now(conn)
        found = search_messages(
            conn,
            where.tables,
            state=state,
            now=now,
            key_prefix=key_prefix,
            tag=tag or None,
            limit=PAGE + 1,
            after=after,
        )
        conn.rollback()
    last = found[PAGE - 1] if len(found) > PAGE else None
    return Page(now, found[:PAGE], None if last is None else encode_cursor(last), None if last is None else last.queue)


def short_payload(value: object) -> str:
    """A payload as a listing shows it: JSON, cut at ``PAYLOAD_SHOWN`` characters."""
    shown = shorten(value, PAYLOAD_SHOWN)
    return shown if isinstance(shown, str) and shown.endswith("characters)") else json.dumps(value, default=str)


def pretty(value: object) -> str:
    """A payload whole, pretty-printed."""
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


@dataclass(frozen=True)
class MessageView:
    """One key of a queue: its live message, what was kept of it once finished (completed, cancelled) and its
    dead letters; ``shown`` is the one ``get(key, include_dead=True)`` answers, and ``message`` that answer (its
    timings, priority and group) where its payload is of a built-in serializer's."""

    now: dt.datetime
    live: StoredMessage | None
    message: Message | None
    dead: list[StoredMessage] = field(default_factory=list)
    kept: list[StoredMessage] = field(default_factory=list)
    """Its kept completed and cancelled records, the latest first."""
    worker: WorkerInfo | None = None
    """The worker whose last heartbeat says it runs the shown message (an in-flight one), where one does; for a
    kept one, the registry's row of the worker that finished it, while the registry keeps it (an hour)."""

    @property
    def shown(self) -> StoredMessage | None:
        """The live message; else the latest kept record or dead letter (the dead letter when as new)."""
        if self.live is not None:
            return self.live
        return max(self.kept[:1] + self.dead[:1], key=lambda m: (_finished_at(m), m.state is State.DEAD), default=None)

    @property
    def finished(self) -> bool:
        """Whether the shown record is a kept one (completed, cancelled, dead)."""
        return self.live is None and self.shown is not None

    @property
    def priority(self) -> int | None:
        """The shown message's priority (as ``get`` reads it, else as listed); a kept one's as it finished, None
        when its row does not record it (kept before delayq_0013)."""
        return getattr(self.message if self.message is not None else self.shown, "priority", None)

    @property
    def group(self) -> str | None:
        """The shown message's group; None when it has none (or its kept row does not record it)."""
        return getattr(self.message if self.message is not None else self.shown, "group", None)

    @property
    def worker_id(self) -> str | None:
        """A kept message's worker: the registry id of the worker whose ack or dead letter finished it; None
        for a live one, a cancelled one and one finished outside a worker."""
        shown = self.shown
        return shown.worker if self.finished and shown is not None else None

    @property
    def others(self) -> int:
        """How many more records the key has (kept ones and dead letters) beside the shown one."""
        return len(self.kept) + len(self.dead) - (0 if self.live is not None or self.shown is None else 1)

    @property
    def result(self) -> object:
        """The shown message's result, where the queue kept one: as ``get`` decodes it, else as stored."""
        found = getattr(self.message, "result", None)
        shown = self.shown
        return found if found is not None or shown is None else shown.result


def _finished_at(m: StoredMessage) -> dt.datetime:
    """When a kept record finished (a dead letter: when it failed)."""
    at = m.failed_at if m.state is State.DEAD else m.finished_at
    return dt.datetime.min.replace(tzinfo=dt.UTC) if at is None else at


SERIALIZERS: dict[str, type[Serializer]] = {s.type_tag: s for s in (JsonSerializer, TextSerializer, BytesSerializer)}
"""The built-in serializers by tag: ``get`` decodes a payload with the one that wrote it."""


KEPT_SHOWN = 20
"""Kept records (of each kept state) and dead letters of one key that its page reads."""


def message(where: Where, queue: str, key: str) -> MessageView:
    """Everything about one key of a queue (as ``delayq show``): its live message, else what was kept of it
    (completed, cancelled, dead), with ``get(key, include_dead=True)``'s view of it where its payload is of a
    built-in serializer's (timings, priority and group, the result); for an in-flight message, the worker
    running it; for a kept one, the worker that finished it (while the registry has its row).
    ``InvalidKeyError`` for a key no message can have."""
    check_key(key)
    with where.engine.connect() as conn:
        now = database_now(conn)

        def listed(state: State | None, limit: int = KEPT_SHOWN) -> list[StoredMessage]:
            return list_messages(conn, where.tables, queue, state=state, now=now, key=key, limit=limit)

        live = listed(None, 1)
        kept = sorted(listed(State.COMPLETED) + listed(State.CANCELLED), key=_finished_at, reverse=True)
        view = MessageView(now, live[0] if live else None, None, listed(State.DEAD)[::-1], kept)
        shown = view.shown
        serializer = None if shown is None else SERIALIZERS.get(shown.payload_type)
        got = None
        if serializer is not None:
            q = DelayedQueue(
                where.engine, queue, table_prefix=where.prefix, schema=where.schema, serializer=serializer()
            )
            try:
                got = _same(q.get(key, include_dead=True, using=conn), view)
            except SerializationMismatchError:  # (replaced meanwhile by a payload of another serializer)
                got = None
        worker = None
        if shown is not None and shown.state is State.IN_FLIGHT:
            worker = next((w for w in list_workers(conn, where.tables) if _runs(w, queue, shown)), None)
        elif view.worker_id is not None:
            worker = next((w for w in list_workers(conn, where.tables) if w.id == view.worker_id), None)
        conn.rollback()
    return dataclasses.replace(view, message=got, worker=worker)


def _same(got: Message | None, view: MessageView) -> Message | None:
    """``get``'s answer when it is the shown record (the live message, or the same kept record): a message that
    finished meanwhile, or a key with more kept records than its page reads, shows the listing's record alone."""
    shown = view.shown
    if got is None or shown is None or not got.finished:
        return got if view.live is not None else None
    return got if (got.state, got.finished_at) == (shown.state.value, _finished_at(shown)) else None


def _runs(w: WorkerInfo, queue: str, m: StoredMessage) -> bool:
    """Whether ``w``'s last heartbeat says it runs this delivery of ``m`` (a worker of an older delayq says nothing)."""
    return w.state == "running" and any(
        not r.topic and r.queue == queue and r.key == m.key and r.attempt == m.attempts
        for r in getattr(w, "running", ())
    )


def cron(where: Where) -> list[dict[str, Any]]:
    """Every installed cron schedule, as ``delayq cron ls`` shows it."""
    with where.engine.connect() as conn:
        views = schedule_views(where.engine, conn, where.tables)
        conn.rollback()
    return views


def topics(where: Where) -> list[TopicSummary]:
    """Every topic (dead-letter topics included), as ``delayq topics ls`` shows them."""
    return list_topics(where.engine, table_prefix=where.prefix, schema=where.schema)


@dataclass(frozen=True)
class GroupView:
    """A consumer group of a topic, with its partitions as it sees them."""

    summary: GroupSummary
    partitions: list[PartitionLag]


@dataclass(frozen=True)
class TopicView:
    """A topic: its summary, its dead-letter topic's, its groups and its subscribers' heartbeats."""

    summary: TopicSummary | None
    dead_letters: TopicSummary | None
    groups: list[GroupView]
    subscribers: list[SubscriberBeat]


def topic(where: Where, name: str) -> TopicView:
    """One topic, as ``delayq topics ls``, ``groups ls`` and ``lag`` show it, with its subscribers.
    ``InvalidInputError`` for a name no topic can have."""
    check_topic_stored(name)
    kw: dict[str, Any] = {"table_prefix": where.prefix, "schema": where.schema}
    every = {t.topic: t for t in list_topics(where.engine, **kw)}
    groups = [GroupView(g, group_lag(where.engine, name, g.group, **kw)) for g in list_groups(where.engine, name, **kw)]
    beats = list_subscribers(where.engine, name, **kw)
    return TopicView(every.get(name), every.get(dead_letter_topic(name)), groups, beats)


def workers(where: Where) -> list[WorkerInfo]:
    """The worker registry (``browse.list_workers``): running workers first, then stopped and gone ones."""
    with where.engine.connect() as conn:
        found = list_workers(conn, where.tables)
    order = {"running": 0, "gone": 1, "stopped": 2}
    return sorted(found, key=lambda w: order[w.state])


def worker_row(w: WorkerInfo) -> dict[str, Any]:
    """A worker as the workers page shows it (and its JSON panel sends it)."""
    return {
        "id": w.id,
        "host": w.host,
        "pid": w.pid,
        "state": w.state,
        "serves": ", ".join([*w.queues, *w.topics]) or "-",
        "slots": f"{w.slots_in_use}/{w.slots}",
        "handled": w.handled,
        "since": f"{w.started_at:%Y-%m-%d %H:%M:%S}",
        "running_for": human(w.since),
        "heartbeat": f"{human(w.last_heartbeat)} ago",
        "driver": w.driver,
        "running_now": len(w.running) if w.state == "running" else 0,
    }


def running_rows(found: list[WorkerInfo]) -> list[dict[str, Any]]:
    """What the running workers' handlers run, as of their last heartbeats, the longest-running first: the workers
    page's drill-down (as Sidekiq's Busy page shows it). A gone worker's are not shown: they may have ended."""
    rows = [
        {
            "worker_id": w.id,
            "worker": f"{w.host}:{w.pid}",
            "queue": r.queue,
            "key": r.key,
            "attempt": r.attempt,
            "running_for": human(r.running_for),
            "running_seconds": r.running_for.total_seconds(),
            "topic": r.topic,
        }
        for w in found
        if w.state == "running"
        for r in w.running
    ]
    return sorted(rows, key=lambda r: -float(r["running_seconds"]))
