"""``delayq top``: a live view of every queue and topic (the ``delayq[top]`` extra, rich).

Each refresh reads, per queue, ``stats()`` and how many messages arrived and left since the last
refresh (by id: rows above the last highest id arrived; rows at or below it that are gone left, acked,
cancelled or dead-lettered), the most recent failures with the end of their traceback, and the worker
registry (one line: workers running, slots in use, gone); per topic and consumer group (``list_topics``,
``list_groups``), the lag, deliveries in flight, live subscribers, and the rates of publishing and of the
group's progress (from the heads and the lag between two refreshes). All reads; nothing is written.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import sqlalchemy as sa
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from delayq.browse import WorkerInfo, database_now, list_workers, queue_names
from delayq.clock import to_ms
from delayq.history import parse
from delayq.humanize import human
from delayq.messages import QueueStats
from delayq.queue import DelayedQueue, _views, claimed_at
from delayq.schema import DEFAULT_PREFIX, make_tables
from delayq.serializers import BytesSerializer
from delayq.topics.views import GroupSummary, groups_by_topic, list_topics

__all__ = ["Failure", "QueueRow", "Snapshot", "Top", "TopicRow", "render"]

RECENT_FAILURES = 5
TRACEBACK_LINES = 4


@dataclass(frozen=True)
class QueueRow:
    """One queue's line: its counts, and its flow since the previous refresh (per second)."""

    name: str
    stats: QueueStats
    arrived_per_s: float | None
    left_per_s: float | None
    longest_run: dt.timedelta | None = None
    """How long the longest-running in-flight message has been held (since its claim); None when none is."""
    paused: bool = False
    """Paused (``DelayedQueue.pause``): workers start none of its messages."""


@dataclass(frozen=True)
class TopicRow:
    """One consumer group of a topic (``group`` None: a topic no group reads), and its rates since the
    previous refresh (per second): messages published, and messages the group got done with."""

    topic: str
    group: str | None
    partitions: int
    published: int
    lag: int
    in_flight: int
    subscribers: int
    published_per_s: float | None
    done_per_s: float | None


@dataclass(frozen=True)
class Failure:
    """A recent failure: a message awaiting its retry, or a dead letter."""

    queue: str
    key: str
    dead: bool
    attempt: int
    at: dt.datetime
    message: str
    traceback_tail: list[str]


@dataclass(frozen=True)
class Snapshot:
    """What one refresh read."""

    taken_at: dt.datetime
    queues: list[QueueRow]
    failures: list[Failure] = field(default_factory=list)
    topics: list[TopicRow] = field(default_factory=list)
    """Shown unless the view is narrowed to some queues (``only``)."""
    workers: list[WorkerInfo] = field(default_factory=list)
    """The worker registry's rows (``delayq.browse.list_workers``)."""


class Top:
    """Reads snapshots of the queues of one delayq installation; remembers the last to compute rates."""

    def __init__(
        self, engine: sa.Engine, prefix: str = DEFAULT_PREFIX, schema: str | None = None, only: list[str] | None = None
    ) -> None:
        self.engine = engine
        self.prefix, self.schema = prefix, schema
        self.tables = make_tables(prefix, schema)
        self.only = only
        self._marks: dict[str, tuple[int, int, float]] = {}  # queue -> (highest id, rows up to it, monotonic)
        self._topic_marks: dict[tuple[str, str | None], tuple[int, int, float]] = {}  # -> (published, done, monotonic)

    def snapshot(self) -> Snapshot:
        rows: list[QueueRow] = []
        with self.engine.connect() as conn:
            now = database_now(conn)
            names = self.only or queue_names(conn, self.tables)
            longest = self._longest_runs(conn, names, now)
            for name in names:
                queue = DelayedQueue(
                    self.engine, name, table_prefix=self.prefix, schema=self.schema, serializer=BytesSerializer()
                )
                stats, paused = queue.stats(using=conn), queue.flow(using=conn).paused
                arrived, left = self._flow(conn, name)
                rows.append(QueueRow(name, stats, arrived, left, longest.get(name), paused))
            failures = self._failures(conn, names)
            workers = list_workers(conn, self.tables)
            conn.rollback()
        return Snapshot(now, rows, failures, [] if self.only else self._topics(), workers)

    def _topics(self) -> list[TopicRow]:
        found: list[TopicRow] = []
        clock = time.monotonic()
        of_topic = groups_by_topic(self.engine, table_prefix=self.prefix, schema=self.schema)
        for t in list_topics(self.engine, table_prefix=self.prefix, schema=self.schema):
            groups: list[GroupSummary | None] = [*of_topic.get(t.topic, [])]
            for g in groups or [None]:
                key = (t.topic, None if g is None else g.group)
                lag = 0 if g is None else g.lag
                done = t.published - lag
                mark = self._topic_marks.get(key)
                self._topic_marks[key] = (t.published, done, clock)
                rates: tuple[float | None, float | None] = (None, None)
                if mark is not None:
                    elapsed = max(clock - mark[2], 1e-3)
                    rates = (max(t.published - mark[0], 0) / elapsed, max(done - mark[1], 0) / elapsed)
                found.append(
                    TopicRow(
                        t.topic,
                        key[1],
                        t.partitions,
                        t.published,
                        lag,
                        0 if g is None else g.pending,
                        0 if g is None else g.subscribers,
                        *rates,
                    )
                )
        return found

    def _flow(self, conn: sa.Connection, name: str) -> tuple[float | None, float | None]:
        mark = self._marks.get(name)
        below = mark[0] if mark else 0
        n, highest, old = _views.flow(conn, self.tables, name, below)
        clock = time.monotonic()
        top = max(below, highest or 0)
        self._marks[name] = (top, n, clock)
        if mark is None:
            return None, None
        elapsed = max(clock - mark[2], 1e-3)
        arrived = n - old
        left = mark[1] - old
        return arrived / elapsed, max(left, 0) / elapsed

    def _longest_runs(self, conn: sa.Connection, names: list[str], now: dt.datetime) -> dict[str, dt.timedelta]:
        """Per queue, how long its oldest in-flight claim has run. Lock tokens start with their claim's time
        (``delayq.queue.new_token``) in fixed-width hex, so the smallest such token is the oldest claim."""
        found = {}
        for queue, token in _views.oldest_tokens(conn, self.tables, names, to_ms(now)).items():
            since = claimed_at(token)
            if since is not None:
                found[queue] = max(now - since, dt.timedelta(0))
        return found

    def _failures(self, conn: sa.Connection, names: list[str]) -> list[Failure]:
        found: list[Failure] = []
        for is_dead in (False, True):
            for r in _views.recent_failures(conn, self.tables, names, dead=is_dead, limit=RECENT_FAILURES):
                history = parse(r.attempt_history)
                if not history:
                    continue
                last = history[-1]
                tail = (last.traceback or "").rstrip().splitlines()[-TRACEBACK_LINES:]
                found.append(Failure(r.queue, r.key, is_dead, last.attempt, last.at, last.message, tail))
        found.sort(key=lambda f: f.at, reverse=True)
        return found[:RECENT_FAILURES]


def _rate(value: float | None) -> str:
    return "…" if value is None else f"{value:.1f}"


def render(snap: Snapshot) -> RenderableType:
    """The view of one snapshot."""
    table = Table(expand=True, title=f"delayq top · {snap.taken_at:%Y-%m-%d %H:%M:%S} UTC", title_style="bold")
    for column, justify in (
        ("queue", "left"),
        ("ready", "right"),
        ("scheduled", "right"),
        ("in flight", "right"),
        ("longest run", "right"),
        ("expired locks", "right"),
        ("dead", "right"),
        ("oldest due", "right"),
        ("in/s", "right"),
        ("out/s", "right"),
    ):
        # the queue's name is what a reader looks for: never cut, the numbers' columns give way
        wide = max([len(q.name) + 7 * q.paused for q in snap.queues] + [5]) if column == "queue" else None
        table.add_column(column, justify=justify, no_wrap=column == "queue", min_width=wide)  # type: ignore[arg-type]
    for q in snap.queues:
        s = q.stats
        table.add_row(
            Text.assemble(q.name, (" paused", "bold yellow")) if q.paused else q.name,
            Text(str(s.ready), style="green" if s.ready else ""),
            str(s.scheduled),
            Text(str(s.in_flight), style="yellow" if s.in_flight else ""),
            "-" if q.longest_run is None else human(q.longest_run),
            Text(str(s.expired_locks), style="magenta" if s.expired_locks else ""),
            Text(str(s.dead), style="red" if s.dead else ""),
            "-" if s.oldest_due_age is None else human(s.oldest_due_age),
            _rate(q.arrived_per_s),
            _rate(q.left_per_s),
        )
    if not snap.queues:
        table.add_row("(no queues yet)", *[""] * 9)
    parts: list[RenderableType] = [table]
    if snap.topics:
        parts.append(_topics_table(snap.topics))
    if snap.workers:
        parts.append(workers_line(snap.workers))
    if snap.failures:
        lines: list[RenderableType] = []
        for f in snap.failures:
            ago = human(snap.taken_at - f.at) if snap.taken_at >= f.at else "just now"
            state = Text("dead", style="bold red") if f.dead else Text("retrying", style="yellow")
            lines.append(
                Text.assemble(state, f" {f.queue} {f.key!r} attempt {f.attempt}, {ago} ago: ", (f.message, "bold"))
            )
            lines += [Text(f"    {line}", style="dim") for line in f.traceback_tail]
        parts.append(Panel(Group(*lines), title="recent failures", border_style="red"))
    return Group(*parts)


def _topics_table(rows: list[TopicRow]) -> Table:
    table = Table(expand=True, title="topics", title_style="bold")
    for column in ("topic", "group", "partitions", "published", "lag", "in flight", "subscribers", "pub/s", "done/s"):
        wide = max([len(r.topic) for r in rows] + [5]) if column == "topic" else None
        left = column in ("topic", "group")
        table.add_column(column, justify="left" if left else "right", no_wrap=left, min_width=wide)
    for r in rows:
        table.add_row(
            r.topic,
            "-" if r.group is None else r.group,
            str(r.partitions),
            str(r.published),
            Text(str(r.lag), style="yellow" if r.lag else ""),
            str(r.in_flight),
            Text(str(r.subscribers), style="" if r.subscribers or r.group is None else "red"),
            _rate(r.published_per_s),
            _rate(r.done_per_s),
        )
    return table


def workers_line(workers: list[WorkerInfo]) -> Text:
    """One line on the workers: how many run, their slots in use, how many are gone."""
    running = [w for w in workers if w.state == "running"]
    gone = sum(w.state == "gone" for w in workers)
    used, slots = sum(w.slots_in_use for w in running), sum(w.slots for w in running)
    line = Text.assemble(("workers ", "bold"), f"{len(running)} running, {used}/{slots} slots in use")
    if gone:
        line.append(f", {gone} gone (no heartbeat for a minute)", style="bold red")
    return line


def run(
    top: Top,
    console: Console,
    interval: float = 1.0,
    times: int = 0,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Refresh every ``interval`` seconds until Ctrl-C (or ``times`` refreshes); live on a terminal."""
    shown = 0
    if console.is_terminal:
        with Live(render(top.snapshot()), console=console, refresh_per_second=4, screen=False) as live:
            while not times or shown + 1 < times:
                sleep(interval)
                live.update(render(top.snapshot()))
                shown += 1
        return
    while True:  # not a terminal: print each view in turn
        console.print(render(top.snapshot()))
        shown += 1
        if times and shown >= times:
            return
        sleep(interval)
