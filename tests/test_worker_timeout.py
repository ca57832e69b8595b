"""``Handler.timeout``: a thread handler running past it is reported (a WARNING, the ``overdue`` event, the
slot counted as stuck) and never killed: its message stays held while it runs, on every backend.

The manual clock stands for the handler's run time: a test moves it past the timeout by hand.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import threading
import uuid
from collections import Counter

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from conftest import Backend
from rich.console import Console
from test_topics_worker import topic_handler, wait_until

from delayq import DelayedQueue, Delivery, Handler, InvalidInputError, ManualClock, Subscription, Topic, Worker, observe
from delayq.browse import list_messages
from delayq.cli import main
from delayq.top import Top, render
from delayq.topics import group_lag

SECOND = dt.timedelta(seconds=1)
FAST = {"poll_interval": dt.timedelta(milliseconds=20), "shutdown_timeout": 10 * SECOND}


class Events(observe.Observer):
    reads_database = False

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: Counter[tuple[str, str]] = Counter()

    def counted(self, event: observe.Event, queue: str, n: int) -> None:
        with self.lock:
            self.seen[event, queue] += n


@pytest.fixture
def events() -> Events:
    found = Events()
    observe.add(found)
    yield found
    observe.remove(found)


def overdue_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "past its timeout" in r.getMessage()]


def test_a_queue_handler_past_its_timeout_is_reported_once_and_keeps_its_message(
    engine: sa.Engine, queue_name: str, clock: ManualClock, events: Events, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "delayq.worker")
    go_on, runs = threading.Event(), Counter[str]()

    class Slow(Handler):
        queue = queue_name
        visibility_timeout = 60 * SECOND  # the clock moves by less than half of it at a time
        timeout = 30 * SECOND

        def handle(self, delivery: Delivery, conn: sa.Connection | None = None) -> None:
            runs[delivery.key] += 1
            go_on.wait(30)

    worker = Worker(engine, [Slow], clock=clock, concurrency=2, **FAST)
    other = DelayedQueue(engine, queue_name, clock=clock)
    other.offer("job", 1)
    worker.start()
    try:
        wait_until(lambda: runs["job"] == 1, "the handler to start")
        assert worker.health().stuck == 0
        clock.advance(31 * SECOND)  # past the timeout
        # (the health count moves before the event is emitted: wait for both)
        wait_until(
            lambda: worker.health().stuck == 1 and events.seen["overdue", queue_name] >= 1,
            "the handler to be found overdue",
        )
        assert events.seen["overdue", queue_name] == 1
        assert len(overdue_lines(caplog)) == 1 and "'job'" in overdue_lines(caplog)[0]
        wait_until(lambda: other.get("job").scheduled_at > clock.now(), "the lock to be extended")  # type: ignore[union-attr]
        assert other.try_poll() is None  # still held: the thread lives
        clock.advance(31 * SECOND)
        wait_until(lambda: other.get("job").scheduled_at > clock.now(), "the lock to be extended")  # type: ignore[union-attr]
        assert events.seen["overdue", queue_name] == 1  # reported once
        go_on.set()
        wait_until(lambda: other.get("job") is None, "the late handler's ack")
        assert worker.health().stuck == 0
    finally:
        go_on.set()
        assert worker.stop()
    assert runs == {"job": 1}


def test_a_topic_handler_past_its_timeout_is_reported_once_and_keeps_its_message(
    engine: sa.Engine, clock: ManualClock, events: Events, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "delayq.worker")
    topic_name = f"t-{uuid.uuid4().hex[:12]}"
    topic = Topic(engine, topic_name, clock=clock)
    topic.create(1)
    go_on, runs = threading.Event(), Counter[str]()

    def body(d: object, _: object) -> None:
        runs[d.message_id] += 1  # type: ignore[attr-defined]
        go_on.wait(30)

    # Leases outlast the clock's moves (a rebalance renews them in real time, a third of it apart).
    handler = topic_handler(
        topic_name, body, timeout=30 * SECOND, visibility_timeout=60 * SECOND, lease_duration=300 * SECOND
    )
    worker = Worker(engine, [handler], clock=clock, concurrency=2, **FAST)
    topic.publish("k", "m1", 1)
    worker.start()
    try:
        wait_until(lambda: runs["m1"] == 1, "the handler to start")
        clock.advance(31 * SECOND)
        # (the health count moves before the event is emitted: wait for both)
        wait_until(
            lambda: worker.health().stuck == 1 and events.seen["overdue", topic_name] >= 1,
            "the handler to be found overdue",
        )
        assert events.seen["overdue", topic_name] == 1
        assert len(overdue_lines(caplog)) == 1 and "'m1'" in overdue_lines(caplog)[0]
        other = Subscription(engine, topic_name, "g", "other", clock=clock)
        other.rebalance()
        assert other.poll(10) == []  # the partition and the delivery stay with the running handler
        go_on.set()
        wait_until(lambda: worker.health().held == 0, "the late handler's ack")
        assert worker.health().stuck == 0
        other.close()
    finally:
        go_on.set()
        assert worker.stop()
    assert runs == {"m1": 1}
    assert [p.pending for p in group_lag(engine, topic_name, "g")] == [0]


@pytest.mark.parametrize("timeout", [dt.timedelta(0), -SECOND, 30])
def test_a_bad_timeout_is_refused_when_the_worker_is_made(timeout: object) -> None:
    class Bad(Handler):
        queue = "q"

    Bad.timeout = timeout  # type: ignore[assignment]
    with pytest.raises(InvalidInputError, match=r"Bad.timeout must be a positive timedelta or None"):
        Worker(sa.create_engine("sqlite://"), [Bad])


# -- how long each in-flight message has run: `delayq ls`, `delayq show`, `delayq top` -------------------
def test_ls_and_top_show_how_long_each_in_flight_message_has_run(backend: Backend, queue_name: str) -> None:
    clock = ManualClock(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    q = DelayedQueue(backend.engine, queue_name, clock=clock, visibility_timeout=dt.timedelta(hours=1))
    q.offer_many([("early", 1, None), ("late", 2, None), ("waiting", 3, None)])
    assert q.try_poll() is not None  # "early", claimed at 00:00
    clock.advance(dt.timedelta(minutes=2))
    assert q.try_poll() is not None  # "late", claimed at 00:02
    clock.advance(dt.timedelta(minutes=3))
    with backend.engine.connect() as conn:
        found = {m.key: m for m in list_messages(conn, q.tables, queue_name, state=None, now=clock.now())}
    assert {k: m.running_for(clock.now()) for k, m in found.items()} == {
        "early": dt.timedelta(minutes=5),
        "late": dt.timedelta(minutes=3),
        "waiting": None,
    }
    assert found["early"].as_dict()["claimed_at"] == "2030-01-01T00:00:00+00:00"
    # The commands read the database's clock: a claim on it has run for about no time at all.
    real = DelayedQueue(backend.engine, f"{queue_name}-real")
    real.offer("now", 1)
    assert real.try_poll() is not None
    listed = CliRunner().invoke(main, ["--url", backend.url, "ls", real.name, "--json"], catch_exceptions=False)
    assert listed.exit_code == 0, listed.output
    (row,) = json.loads(listed.output)
    assert row["state"] == "in-flight" and row["claimed_at"] is not None
    table = CliRunner().invoke(main, ["--url", backend.url, "ls", real.name], catch_exceptions=False).output
    assert "RUNNING" in table.splitlines()[0], table
    (snap_row,) = Top(backend.engine, only=[real.name]).snapshot().queues
    assert snap_row.longest_run is not None and snap_row.longest_run < dt.timedelta(minutes=1)
    out = Console(file=io.StringIO(), width=200, record=True)
    out.print(render(Top(backend.engine, only=[real.name]).snapshot()))
    assert "longest run" in out.export_text()
