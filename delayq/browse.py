"""Read-only views for operators: which queues exist, and their messages by state, whatever their serializer.

The states are those ``DelayedQueue.stats()`` counts: a held message whose lock has expired is
``expired-lock`` (due for redelivery), not ``in-flight``.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from delayq.clock import from_ms, to_ms
from delayq.errors import InvalidInputError
from delayq.history import AttemptRecord, parse
from delayq.queue import _views, _workers, claimed_at
from delayq.schema import Tables
from delayq.tags import decode_tags, tag_pattern


class State(enum.Enum):
    """Where a message stands: live (the first four), or kept after it left the queue (dead letters, completed
    and cancelled messages). ``STATE_NAMES`` are their values: what ``delayq ls --state`` and the dashboard take."""

    READY = "ready"
    SCHEDULED = "scheduled"
    IN_FLIGHT = "in-flight"
    """Held by a consumer whose lock has not expired."""
    EXPIRED_LOCK = "expired-lock"
    """Held by a consumer whose lock expired: due for redelivery."""
    DEAD = "dead"
    COMPLETED = "completed"
    """Kept after its handler succeeded (``retention``, ``unique_for``), until pruned."""
    CANCELLED = "cancelled"
    """Kept after it was cancelled, until pruned."""

    @property
    def kept(self) -> bool:
        """Whether it is a state of a message that left the queue (dead, completed, cancelled)."""
        return self in (State.DEAD, State.COMPLETED, State.CANCELLED)

    @classmethod
    def named(cls, name: str) -> State:
        """The state of ``STATE_NAMES`` called ``name``; ``InvalidInputError`` (one line) for any other."""
        try:
            return cls(name)
        except ValueError:
            shown = name if len(name) <= 40 else name[:40] + "..."
            raise InvalidInputError(f"no such state {shown!r}: choose among {', '.join(STATE_NAMES)}") from None


STATE_NAMES = tuple(s.value for s in State)
"""Every state a listing takes, by name: the CLI's ``--state`` choices and the dashboard's ``state=``."""


@dataclass(frozen=True)
class StoredMessage:
    """A message or dead letter as stored, its payload shown as the serializer tag allows."""

    queue: str
    key: str
    state: State
    payload_type: str
    payload: Any
    scheduled_at: dt.datetime | None
    attempts: int
    last_error: str | None
    failed_at: dt.datetime | None = None
    """When a dead letter was moved to the dead letters (None for live messages)."""
    attempt_history: tuple[AttemptRecord, ...] = field(default=())
    claimed_at: dt.datetime | None = None
    """When its current holder claimed it (a held message; None when not held, or locked by an older delayq)."""
    id: int | None = None
    """Its row's id (what the next page of ``list_messages`` starts after)."""
    finished_at: dt.datetime | None = None
    """When a kept message completed or was cancelled (None for others)."""
    duration: dt.timedelta | None = None
    """How long a completed message's handler ran, when known."""
    result: Any = None
    """A completed message's result, shown as its serializer tag allows (None when none was kept)."""

    @property
    def cursor(self) -> tuple[int, int, str]:
        """What ``list_messages(after=…)`` takes for the page after this message: (position in ms, id, key),
        the position being its due time (a dead letter's failure time, a kept message's finish time)."""
        at = self.failed_at if self.state is State.DEAD else self.finished_at if self.state.kept else self.scheduled_at
        return 0 if at is None else to_ms(at), self.id or 0, self.key

    tags: tuple[str, ...] = ()
    """The tags its offer gave it (``delayq.tags``)."""
    priority: int | None = None
    """Its priority (``offer(priority=)``, 0 unless set); a dead letter's or a kept message's as it was when it
    finished (None: not recorded, in a row kept before delayq_0013)."""
    group: str | None = None
    """Its group (``offer(group=)``), None when it has none (or not recorded, as ``priority``)."""
    worker: str | None = None
    """A dead letter's or a kept message's worker: the registry id (``WorkerInfo.id``) of the worker whose ack or
    dead letter finished it; None for one finished outside a worker or cancelled, and for a live message (an
    in-flight one's worker is in the registry's heartbeat: ``WorkerInfo.running``)."""

    def running_for(self, now: dt.datetime) -> dt.timedelta | None:
        """How long an in-flight message's handler has run (since its claim); None for any other state."""
        if self.state is not State.IN_FLIGHT or self.claimed_at is None:
            return None
        return max(now - self.claimed_at, dt.timedelta(0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "key": self.key,
            "state": self.state.value,
            "payload_type": self.payload_type,
            "payload": self.payload,
            "scheduled_at": None if self.scheduled_at is None else self.scheduled_at.isoformat(),
            "attempts": self.attempts,
            "last_error": self.last_error,
            "failed_at": None if self.failed_at is None else self.failed_at.isoformat(),
            "attempt_history": [r.to_json() for r in self.attempt_history],
            "claimed_at": None if self.claimed_at is None else self.claimed_at.isoformat(),
            "finished_at": None if self.finished_at is None else self.finished_at.isoformat(),
            "duration": None if self.duration is None else self.duration.total_seconds(),
            "result": self.result,
            "tags": list(self.tags),
            "priority": self.priority,
            "group": self.group,
            "worker": self.worker,
        }


def show_payload(payload_type: str, data: bytes) -> Any:
    """JSON and text payloads as values; anything else as hex."""
    raw = bytes(data)
    try:
        if payload_type == "json":
            return json.loads(raw)
        if payload_type == "text":
            return raw.decode()
    except (ValueError, UnicodeDecodeError):
        pass
    return raw.hex()


def queue_names(conn: sa.Connection, tables: Tables) -> list[str]:
    """Every queue the database knows of: with live messages, dead letters, kept finished messages or an
    installed cron schedule, or paused, or with a limit set (concurrency, rate, group concurrency).

    Queues are not registered anywhere: a queue whose messages were all acked, with no dead letters, no
    schedule and no pause or limit, leaves no trace, and reads as a queue never used (name it to see its zeros).
    """
    return _views.queue_names(conn, tables)


def keys_under(conn: sa.Connection, tables: Tables, queue: str, key_prefix: str) -> list[str]:
    """The keys of a queue's live messages that start with ``key_prefix`` (byte for byte), in key order."""
    return _views.keys_under(conn, tables, queue, key_prefix)


def list_messages(
    conn: sa.Connection,
    tables: Tables,
    queue: str,
    *,
    state: State | None,
    now: dt.datetime,
    key_prefix: str | None = None,
    key: str | None = None,
    limit: int = 100,
    after: tuple[int, int, str] | None = None,
    by_key: bool = False,
    tag: str | None = None,
) -> list[StoredMessage]:
    """A queue's messages in ``state`` (None: every live one); with ``tag``, only those carrying it.

    Live messages go by due time, dead letters by failure time, completed and cancelled ones by finish time
    (then by id). Under a ``key_prefix``, dead letters and kept messages go by key, and so do live ones with
    ``by_key``: a range of the (queue, key) index, so that a page under a prefix is cheap on a big queue.
    Paged by keyset: ``after`` is the ``cursor`` of the last message of the page before (never an OFFSET,
    so a page deep in a big queue costs what the first does)."""
    dead = state is State.DEAD
    kept = state is not None and state.kept
    rows = _views.list_rows(
        conn,
        tables,
        queue,
        dead=dead,
        state=None if state is None or dead else state.value,
        now_ms=to_ms(now),
        key_prefix=key_prefix,
        key=key,
        limit=limit,
        after=after,
        key_order=by_key or (kept and bool(key_prefix)),
        tag_pattern=None if tag is None else tag_pattern(tag),
    )
    return [
        StoredMessage(
            queue=queue,
            key=r.key,
            state=state if state is not None and kept else _state(r.scheduled_at, r.lock_token, now),
            payload_type=r.payload_type,
            payload=show_payload(r.payload_type, r.payload),
            scheduled_at=None if r.scheduled_at is None else from_ms(r.scheduled_at),
            attempts=r.attempts,
            last_error=r.last_error,
            failed_at=None if r.failed_at is None else from_ms(r.failed_at),
            attempt_history=parse(r.attempt_history),
            claimed_at=claimed_at(r.lock_token),
            id=int(r.id),
            finished_at=None if r.finished_at is None else from_ms(r.finished_at),
            duration=None if r.duration_ms is None else dt.timedelta(milliseconds=r.duration_ms),
            result=None if r.result is None else show_payload(r.result_type or "", r.result),
            tags=decode_tags(r.tags),
            priority=None if r.priority is None else int(r.priority),
            group=r.group_key,
            worker=r.worker,
        )
        for r in rows
    ]


SearchCursor = tuple[str, tuple[int, int, str]]
"""Where a search's next page starts: the queue of the last message of the page before, and its ``cursor``."""


def search_messages(
    conn: sa.Connection,
    tables: Tables,
    *,
    state: State | None,
    now: dt.datetime,
    key_prefix: str | None = None,
    tag: str | None = None,
    limit: int = 100,
    after: SearchCursor | None = None,
) -> list[StoredMessage]:
    """The messages of every queue in ``state`` (None: every live one) whose key starts with ``key_prefix``
    and that carry ``tag``: queue by queue in the database's order of names, each as ``list_messages`` lists it
    (under a prefix, by key). Paged by keyset: ``after`` is ``(m.queue, m.cursor)`` of the last message of the
    page before.

    Per queue visited, one probe of an index for its name (the next queue with rows in the state's table: never
    a scan of the rows) and one ``list_messages``, a range of one of its indexes, until the page is full. A
    ``tag`` is a filter over the rows read (no index serves it): a rare tag reads many."""
    table = "messages" if state is None or not state.kept else "dead_letters" if state is State.DEAD else "finished"
    found: list[StoredMessage] = []
    name = _views.next_queue(conn, tables, table, after=None if after is None else after[0], inclusive=True)
    while name is not None:
        found += list_messages(
            conn,
            tables,
            name,
            state=state,
            now=now,
            key_prefix=key_prefix,
            limit=limit - len(found),
            after=after[1] if after is not None and name == after[0] else None,
            by_key=bool(key_prefix),
            tag=tag,
        )
        if len(found) >= limit:
            break
        name = _views.next_queue(conn, tables, table, after=name)
    return found


def _state(scheduled_at: int, lock_token: str | None, now: dt.datetime) -> State:
    due = scheduled_at <= to_ms(now)
    if lock_token is not None:
        return State.EXPIRED_LOCK if due else State.IN_FLIGHT
    return State.READY if due else State.SCHEDULED


def arrival_marks(conn: sa.Connection, tables: Tables, queue: str, below: int) -> tuple[int, int | None, int]:
    """A queue's live messages: how many, the highest id, and how many have an id at or below ``below``.

    Two reads make a throughput (as ``delayq top`` and the dashboard show it): with ``below`` the first
    read's highest id, the rows above it arrived since, and the first read's count minus the rows still at or
    below it left (done, cancelled or dead-lettered). One statement; it reads every live message of the queue.
    """
    return _views.flow(conn, tables, queue, below)


GONE_AFTER = dt.timedelta(seconds=60)
"""A worker whose last heartbeat is older than this, and that did not stop cleanly, is gone (crashed, killed,
frozen or cut off): its row stays for an hour, then a running worker deletes it. Workers beat every 10 s."""


@dataclass(frozen=True)
class RunningJob:
    """A delivery whose handler a worker was running at its last heartbeat (``WorkerInfo.running``)."""

    queue: str
    """Its queue; for a topic handler's delivery, the topic and consumer group as ``topic/group``."""
    key: str
    """The message's key (a topic message's id)."""
    attempt: int
    """Which delivery of the message this is (1 for the first)."""
    running_for: dt.timedelta
    """How long its handler has run: at the heartbeat, plus the time since for a running worker."""
    topic: bool = False
    """Whether it is a topic handler's delivery."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "key": self.key,
            "attempt": self.attempt,
            "running_seconds": self.running_for.total_seconds(),
            "topic": self.topic,
        }


@dataclass(frozen=True)
class WorkerInfo:
    """A worker (``Worker`` or ``AsyncWorker``) as its row in the worker registry says, at ``now``."""

    id: str
    name: str
    """Its name (``host:pid:random``): what its topic handlers' subscriber names and its log lines carry."""
    host: str
    pid: int
    driver: str
    """"threads" (``Worker``) or "asyncio" (``AsyncWorker``)."""
    queues: tuple[str, ...]
    topics: tuple[str, ...]
    """Its topic handlers, as ``topic/group``."""
    slots: int
    """Its concurrency."""
    slots_in_use: int
    """Slots taken at its last heartbeat."""
    handled: int
    """Deliveries it finished, as of its last heartbeat."""
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    stopped_at: dt.datetime | None
    now: dt.datetime
    """The database's clock when the row was read."""
    running: tuple[RunningJob, ...] = ()
    """What its handlers were running at its last heartbeat, the longest-running first (a heartbeat writes at
    most 16 KB of them: ``slots_in_use`` counts them all); none once it stopped."""

    @property
    def state(self) -> str:
        """ "running", "stopped" (a clean stop) or "gone" (no heartbeat for ``GONE_AFTER``)."""
        if self.stopped_at is not None:
            return "stopped"
        return "gone" if self.now - self.heartbeat_at > GONE_AFTER else "running"

    @property
    def since(self) -> dt.timedelta:
        """How long it has run (until its stop, or its last heartbeat when gone)."""
        end = self.now if self.state == "running" else self.heartbeat_at
        return max(end - self.started_at, dt.timedelta(0))

    @property
    def last_heartbeat(self) -> dt.timedelta:
        """How long ago its last heartbeat was."""
        return max(self.now - self.heartbeat_at, dt.timedelta(0))

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "host": self.host,
            "pid": self.pid,
            "driver": self.driver,
            "queues": list(self.queues),
            "topics": list(self.topics),
            "slots": self.slots,
            "slots_in_use": self.slots_in_use,
            "handled": self.handled,
            "state": self.state,
            "started_at": self.started_at.isoformat(),
            "heartbeat_at": self.heartbeat_at.isoformat(),
            "stopped_at": None if self.stopped_at is None else self.stopped_at.isoformat(),
            "since_seconds": self.since.total_seconds(),
            "heartbeat_seconds": self.last_heartbeat.total_seconds(),
            "running": [r.as_dict() for r in self.running],
        }


def list_workers(conn: sa.Connection, tables: Tables) -> list[WorkerInfo]:
    """The workers in the worker registry (running, stopped and gone ones from the last hour), oldest first.

    One statement (two when the registry is empty). See docs/operations.md "Workers"."""
    rows, now_ms = _workers.rows(conn, tables)
    now = from_ms(now_ms)
    return [
        WorkerInfo(
            running=_running(r.running, now_ms - int(r.heartbeat_at), r.stopped_at is None),
            id=r.id,
            name=r.name,
            host=r.host,
            pid=int(r.pid),
            driver=r.driver,
            queues=tuple(json.loads(r.queues)),
            topics=tuple(json.loads(r.topics)),
            slots=int(r.slots),
            slots_in_use=int(r.slots_in_use),
            handled=int(r.handled),
            started_at=from_ms(r.started_at),
            heartbeat_at=from_ms(r.heartbeat_at),
            stopped_at=None if r.stopped_at is None else from_ms(r.stopped_at),
            now=now,
        )
        for r in rows
    ]


def _running(text: str | None, since_beat_ms: int, live: bool) -> tuple[RunningJob, ...]:
    """A registry row's ``running`` JSON (see ``delayq.runtime._registry``); a running worker's run times go on
    from its heartbeat (``since_beat_ms`` ago), a gone one's stay as of its last heartbeat."""
    if not text:
        return ()
    if not live or since_beat_ms > GONE_AFTER.total_seconds() * 1000:
        since_beat_ms = 0
    return tuple(
        RunningJob(
            queue=str(r.get("queue") or r.get("topic") or ""),
            key=str(r["key"]),
            attempt=int(r["attempt"]),
            running_for=dt.timedelta(milliseconds=int(r["ms"]) + max(since_beat_ms, 0)),
            topic="topic" in r,
        )
        for r in json.loads(text)
    )


HISTORY_SPAN = dt.timedelta(hours=24)
"""How far back the queue history goes: the workers delete older minutes."""


@dataclass(frozen=True)
class HistoryPoint:
    """One minute of a queue's history (or of every queue's, summed): the deliveries the workers finished."""

    minute: dt.datetime
    """The minute's start (database time)."""
    processed: int
    """Handled and acked."""
    failed: int
    """Failed attempts recorded for a retry (a handler's exception, ``Retry``, a timeout)."""
    dead_lettered: int
    """Moved to the dead letters (attempts used up, ``DeadLetter``, undecodable)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "minute": self.minute.isoformat(),
            "processed": self.processed,
            "failed": self.failed,
            "dead_lettered": self.dead_lettered,
        }


@dataclass(frozen=True)
class QueueHistory:
    """A queue's (or every queue's) outcomes per minute from ``start`` to ``now``: minutes without any are left
    out (``dense()`` fills them in)."""

    queue: str | None
    start: dt.datetime
    """The first minute of the span."""
    now: dt.datetime
    points: tuple[HistoryPoint, ...]

    def dense(self) -> list[HistoryPoint]:
        """Every minute from ``start`` to ``now``'s, zeros where nothing was counted."""
        found = {p.minute: p for p in self.points}
        minutes = int((self.now - self.start).total_seconds() // 60) + 1
        at = [self.start + dt.timedelta(minutes=i) for i in range(max(minutes, 0))]
        return [found.get(m) or HistoryPoint(m, 0, 0, 0) for m in at]

    def totals(self) -> tuple[int, int, int]:
        """Processed, failed and dead-lettered over the span."""
        return (
            sum(p.processed for p in self.points),
            sum(p.failed for p in self.points),
            sum(p.dead_lettered for p in self.points),
        )

    def as_dict(self) -> dict[str, Any]:
        """As ``delayq history --json`` and the dashboard's ``/history.json`` give it (minutes with counts only)."""
        processed, failed, dead = self.totals()
        return {
            "queue": self.queue,
            "start": self.start.isoformat(),
            "now": self.now.isoformat(),
            "points": [p.as_dict() for p in self.points],
            "totals": {"processed": processed, "failed": failed, "dead_lettered": dead},
        }


def queue_history(
    conn: sa.Connection,
    tables: Tables,
    queue: str | None = None,
    *,
    span: dt.timedelta = HISTORY_SPAN,
    now: dt.datetime | None = None,
) -> QueueHistory:
    """What the workers processed, failed and dead-lettered per minute over the last ``span`` (at most a day),
    for ``queue`` or summed over every queue (None), up to ``now`` (the database's clock by default).

    The workers count outcomes as they record them and add the counts to the minute's row with their registry
    heartbeat (every 10 s, and at a clean stop), so the last minute fills in as they beat. One statement (two
    without ``now``). See docs/operations.md "History"."""
    if not dt.timedelta(minutes=1) <= span <= HISTORY_SPAN:
        raise InvalidInputError(f"a history's span is from 1 minute to {HISTORY_SPAN}, not {span}")
    now_ms = _views.database_now_ms(conn) if now is None else to_ms(now)
    last = now_ms - now_ms % _workers.MINUTE_MS
    start_ms = last - (int(span.total_seconds() * 1000) // _workers.MINUTE_MS - 1) * _workers.MINUTE_MS
    rows = _workers.history(conn, tables, queue, start_ms)
    points = tuple(
        HistoryPoint(from_ms(int(r.minute)), int(r.processed), int(r.failed), int(r.dead_lettered))
        for r in rows
        if int(r.minute) <= last
    )
    return QueueHistory(queue, from_ms(start_ms), from_ms(now_ms), points)


def database_now(conn: sa.Connection) -> dt.datetime:
    """The database's clock, which decides what is due (as ``stats()`` reads it)."""
    return from_ms(_views.database_now_ms(conn))


def has_flow_settings(conn: sa.Connection, tables: Tables, queue: str) -> bool:
    """Whether ``queue``'s flow was ever set: paused or resumed, limited, or offered a priority or a group."""
    return _views.has_flow_row(conn, tables, queue)
