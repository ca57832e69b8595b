"""The Worker running TopicHandlers (beside queue handlers), on every backend, driven by the manual clock.

Waits are bounded (``wait_until`` fails rather than hangs) and assert nothing about timing. The
manual clock never moves unless a test moves it, so leases and visibility timeouts expire only
when a test says so; the workers' rebalances still run every third of ``lease_duration`` in real
time, which is why the test handlers use a short one.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, count_rows

from delayq import (
    DelayedQueue,
    Delivery,
    Handler,
    InvalidInputError,
    ManualClock,
    RetryPolicy,
    Subscription,
    Topic,
    TopicDelivery,
    TopicHandler,
    Worker,
)
from delayq.topics import dead_letter_topic, group_lag, partition_for

SECOND = dt.timedelta(seconds=1)
FAST = {"poll_interval": dt.timedelta(milliseconds=20), "shutdown_timeout": 10 * SECOND}
Body = Callable[[TopicDelivery, "sa.Connection | None"], None]


def wait_until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """Poll a condition; fail (not hang) if it stays false. Bounds a wait, asserts nothing about timing."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.01)


def topic_handler(topic: str, body: Body, group: str = "g", **attrs: Any) -> TopicHandler:
    attrs.setdefault("lease_duration", 3 * SECOND)  # a rebalance every second of real time
    attrs.setdefault("visibility_timeout", 30 * SECOND)
    cls = type(
        "Consumer",
        (TopicHandler,),
        {"topic": topic, "group": group, "handle": lambda self, d, conn=None: body(d, conn), **attrs},
    )
    return cls()  # type: ignore[no-any-return]


def keys_for(partitions: int) -> list[str]:
    """One partition key per partition, in partition order."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < partitions:
        found.setdefault(partition_for(f"k{i}", partitions), f"k{i}")
        i += 1
    return [found[p] for p in range(partitions)]


def holders(engine: sa.Engine, topic: str, group: str = "g") -> Counter[str | None]:
    """How many partitions each subscriber of the group holds."""
    return Counter(p.holder for p in group_lag(engine, topic, group))


@pytest.fixture
def topic_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_topic(engine: sa.Engine, topic_name: str, clock: ManualClock) -> Callable[[int], Topic]:
    def make(partitions: int) -> Topic:
        topic = Topic(engine, topic_name, clock=clock)
        topic.create(partitions)
        return topic

    return make


def test_a_worker_runs_a_queue_handler_and_a_topic_handler_together(
    engine: sa.Engine, queue_name: str, topic_name: str, clock: ManualClock, make_topic: Callable[[int], Topic]
) -> None:
    topic = make_topic(4)
    lock = threading.Lock()
    seen: Counter[str] = Counter()

    def record(name: str) -> None:
        with lock:
            seen[name] += 1

    class Jobs(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery, conn: sa.Connection | None = None) -> None:
            record(delivery.key)

    events = topic_handler(topic_name, lambda d, _: record(d.message_id))
    worker = Worker(engine, [Jobs, events], clock=clock, concurrency=3, **FAST)
    worker.queues[0].offer_many([(f"q{i}", i, None) for i in range(10)])
    topic.publish_many([(f"key{i % 3}", f"t{i}", i) for i in range(10)])
    worker.start()
    try:
        wait_until(lambda: worker.handled >= 20, "both handlers' messages")
        health = worker.health()
        assert set(health.loops) >= {"fetch", "heartbeat", "topics"} and health.healthy
    finally:
        assert worker.stop()
    assert seen == Counter([f"q{i}" for i in range(10)] + [f"t{i}" for i in range(10)])
    assert count_rows(engine, queue_name) == 0
    lag = group_lag(engine, topic_name, "g")
    assert [(p.watermark, p.holder) for p in lag] == [(p.head, None) for p in lag]  # advanced, and left


def test_strict_serialization_keeps_each_partitions_order_with_concurrency(
    engine: sa.Engine, topic_name: str, clock: ManualClock, make_topic: Callable[[int], Topic]
) -> None:
    topic = make_topic(4)
    keys = keys_for(4)
    lock = threading.Lock()
    order: dict[str, list[int]] = {k: [] for k in keys}
    running: Counter[int] = Counter()
    overlaps: list[int] = []

    def body(d: TopicDelivery, _: object) -> None:
        with lock:
            running[d.partition] += 1
            if running[d.partition] > 1:
                overlaps.append(d.partition)
            order[d.partition_key].append(d.payload)
        with lock:
            running[d.partition] -= 1

    worker = Worker(engine, [topic_handler(topic_name, body, strict=True)], clock=clock, concurrency=4, **FAST)
    topic.publish_many([(k, f"{k}-{i}", i) for i in range(10) for k in keys])
    worker.start()
    try:
        wait_until(lambda: worker.handled >= 40, "every message")
    finally:
        assert worker.stop()
    assert overlaps == []
    assert order == {k: list(range(10)) for k in keys}


def test_a_failing_message_is_nacked_then_dead_lettered_while_later_ones_flow(
    engine: sa.Engine, topic_name: str, clock: ManualClock, make_topic: Callable[[int], Topic]
) -> None:
    topic = make_topic(1)
    lock = threading.Lock()
    handled: list[str] = []
    failures: list[dt.datetime] = []

    def body(d: TopicDelivery, _: object) -> None:
        if d.payload == "bad":
            with lock:
                failures.append(clock.now())
            raise ValueError(f"boom {d.attempts}")
        with lock:
            handled.append(d.message_id)

    policy = RetryPolicy.fixed(10 * SECOND, max_attempts=3)
    worker = Worker(engine, [topic_handler(topic_name, body, retry=policy)], clock=clock, **FAST)
    topic.publish_many([("k", "m1", "ok"), ("k", "bad", "bad"), ("k", "m3", "ok")])
    worker.start()
    try:
        wait_until(lambda: worker.handled == 3, "the first pass")  # (outcomes recorded: m1, bad, m3)
        for attempt in (2, 3):
            topic.publish("k", f"after-{attempt}", "ok")  # flows past the failed one, which waits its delay
            wait_until(lambda n=2 * attempt: worker.handled == n, "a later message")
            assert len(failures) == attempt - 1
            clock.advance(10 * SECOND)
            wait_until(lambda n=2 * attempt + 1: worker.handled == n, f"attempt {attempt}")
    finally:
        assert worker.stop()
    assert failures == [failures[0], failures[0] + 10 * SECOND, failures[0] + 20 * SECOND]
    assert handled == ["m1", "m3", "after-2", "after-3"]
    [lag] = group_lag(engine, topic_name, "g")
    assert (lag.head, lag.watermark, lag.pending) == (5, 5, 0)  # the dead one is out of the group's way

    dlq = Subscription(engine, dead_letter_topic(topic_name), "inspect", "me", clock=clock)
    dlq.rebalance()
    [dead] = dlq.poll()
    assert dead.payload == "bad" and dead.dead_letter is not None
    info = dead.dead_letter
    assert (info.original_topic, info.original_offset, info.failed_group) == (topic_name, 2, "g")
    assert (info.failure_count, info.last_error) == (3, "ValueError: boom 3")
    dlq.close()


# (exactly-once topic handlers, under both drivers: tests/test_worker_contract.py)


class History:
    """Every handling, by which worker: a Jepsen-style record to find duplicates and losses."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.handled: list[tuple[int, str, int]] = []  # (worker, message id, partition)

    def body(self, worker: int) -> Body:
        def handle(d: TopicDelivery, _: object) -> None:
            with self.lock:
                self.handled.append((worker, d.message_id, d.partition))

        return handle

    def ids(self) -> Counter[str]:
        with self.lock:
            return Counter(m for _, m, _ in self.handled)


def two_workers(engine: sa.Engine, topic_name: str, clock: ManualClock, history: History) -> list[Worker]:
    """Two workers (threads of this process) in one group, started, once they split the partitions."""
    workers = [
        Worker(engine, [topic_handler(topic_name, history.body(i))], clock=clock, concurrency=2, **FAST)
        for i in range(2)
    ]
    for w in workers:
        w.start()
    wait_until(lambda: holders(engine, topic_name) == {w.name: 3 for w in workers}, "the partitions to be split")
    return workers


def test_two_workers_split_the_partitions_and_handle_every_message_once(
    engine: sa.Engine, topic_name: str, clock: ManualClock, make_topic: Callable[[int], Topic]
) -> None:
    topic = make_topic(6)
    history = History()
    workers = two_workers(engine, topic_name, clock, history)
    ids = [f"m{i}" for i in range(60)]
    try:
        topic.publish_many([(f"key{i % 12}", m, i) for i, m in enumerate(ids)])
        wait_until(lambda: set(history.ids()) == set(ids), "every message")
        wait_until(lambda: all(w.health().held == 0 for w in workers), "the last outcomes")
        held_by = {p.partition: p.holder for p in group_lag(engine, topic_name, "g")}
    finally:
        for w in workers:
            assert w.stop()
    assert history.ids() == Counter(ids)  # none lost, none twice
    names = [w.name for w in workers]
    assert all(held_by[p] == names[w] for w, _, p in history.handled)  # each by its partition's holder
    assert {w for w, _, _ in history.handled} == {0, 1}


def test_a_graceful_stop_hands_the_partitions_over_at_once(
    engine: sa.Engine, topic_name: str, clock: ManualClock, make_topic: Callable[[int], Topic]
) -> None:
    topic = make_topic(6)
    history = History()
    a, b = two_workers(engine, topic_name, clock, history)
    keys = keys_for(6)
    try:
        topic.publish_many([(keys[i % 6], f"m{i}", i) for i in range(30)])
        wait_until(lambda: len(history.ids()) == 30, "the first messages")
        assert a.stop()
        assert not a.health().running
        # The clock has not moved: no lease expired. The stopped worker released its partitions.
        wait_until(lambda: holders(engine, topic_name) == {b.name: 6}, "the other worker to take every partition")
        topic.publish_many([(keys[i % 6], f"m{i}", i) for i in range(30, 60)])
        wait_until(lambda: len(history.ids()) == 60, "the later messages")
        wait_until(lambda: b.health().held == 0, "the last outcomes")
    finally:
        a.stop()
        assert b.stop()
    assert history.ids() == Counter(f"m{i}" for i in range(60))
    assert {w for w, m, _ in history.handled if int(m[1:]) >= 30} == {1}


def test_the_topic_loops_survive_database_errors(
    backend: Backend, topic_name: str, clock: ManualClock, make_topic: Callable[[int], Topic]
) -> None:
    topic = make_topic(2)
    engine = backend.make_engine()  # the worker's: its topic statements fail while the database is "down"
    down = threading.Event()
    failed: Counter[str] = Counter()  # by thread: the fetch loop's polls, the topics loop's upkeep

    @sa.event.listens_for(engine, "before_cursor_execute")
    def flaky(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if down.is_set() and "topic" in statement:
            failed[threading.current_thread().name] += 1
            raise sa.exc.OperationalError(statement, {}, RuntimeError("injected"))

    history = History()
    worker = Worker(engine, [topic_handler(topic_name, history.body(0))], clock=clock, **FAST)
    topic.publish_many([(f"key{i % 4}", f"m{i}", i) for i in range(5)])
    worker.start()
    try:
        wait_until(lambda: len(history.ids()) == 5, "the first messages")
        down.set()
        topic.publish_many([(f"key{i % 4}", f"m{i}", i) for i in range(5, 10)])
        wait_until(lambda: failed["delayq-worker"] >= 2 and failed["delayq-topics"] >= 2, "errors in both loops")
        down.clear()
        wait_until(lambda: len(history.ids()) == 10, "the later messages, once the database is back")
        assert worker.health().healthy
    finally:
        down.clear()
        assert worker.stop()
        engine.dispose()
    assert history.ids() == Counter(f"m{i}" for i in range(10))


def test_run_once_handles_topic_messages_and_leaves_the_group(
    engine: sa.Engine, topic_name: str, clock: ManualClock, make_topic: Callable[[int], Topic]
) -> None:
    topic = make_topic(3)
    history = History()
    worker = Worker(engine, [topic_handler(topic_name, history.body(0))], clock=clock)
    topic.publish_many([(f"key{i}", f"m{i}", i) for i in range(9)])
    assert worker.run_once() == 9
    assert worker.run_once() == 0
    assert history.ids() == Counter(f"m{i}" for i in range(9))
    assert holders(engine, topic_name) == {None: 3}


def test_topic_handlers_are_checked_when_the_worker_is_made() -> None:
    engine = sa.create_engine("sqlite://")

    class NoGroup(TopicHandler):
        topic = "orders"

    with pytest.raises(InvalidInputError, match="`group`"):
        Worker(engine, [NoGroup])
    twice = [topic_handler("orders", lambda d, c: None), topic_handler("orders", lambda d, c: None)]
    with pytest.raises(InvalidInputError, match="two handlers for topic 'orders' in group 'g'"):
        Worker(engine, twice)
    with pytest.raises(InvalidInputError, match="group"):
        Worker(engine, [topic_handler("orders", lambda d, c: None, group="bad group")])
    a, b = (Worker(engine, [topic_handler("orders", lambda d, c: None)]) for _ in range(2))
    assert a.name != b.name  # each worker is a subscriber of its own


def test_the_async_worker_refuses_sync_transactional_topic_handlers_only() -> None:
    """(It runs a plain ``def`` topic handler on a thread: tests/test_aio_worker.py.)"""
    from sqlalchemy.ext.asyncio import create_async_engine

    from delayq.aio import AsyncWorker

    engine = create_async_engine("sqlite+aiosqlite://")
    with pytest.raises(InvalidInputError, match=r"use delayq\.Worker"):
        AsyncWorker(engine, [type(topic_handler("orders", lambda d, c: None, transactional=True))])
    AsyncWorker(engine, [type(topic_handler("orders", lambda d, c: None))])


def test_a_queue_of_the_same_name_is_not_confused_with_a_topic(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    Topic(engine, queue_name, clock=clock).create(1)
    Topic(engine, queue_name, clock=clock).publish("k", "t1", "topic")
    DelayedQueue(engine, queue_name, clock=clock).offer("q1", "queue")
    seen: list[Any] = []

    class Jobs(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery, conn: sa.Connection | None = None) -> None:
            seen.append(delivery.payload)

    worker = Worker(engine, [Jobs, topic_handler(queue_name, lambda d, _: seen.append(d.payload))], clock=clock)
    assert worker.run_once() == 2
    assert sorted(seen) == ["queue", "topic"]


def test_a_topic_message_whose_handler_dies_every_time_is_dead_lettered_as_a_queue_message_is(
    engine: sa.Engine, topic_name: str, clock: ManualClock, make_topic: Callable[[int], Topic]
) -> None:
    # One decision for both sources: the claim-time cap buries with the same reason (topics said "without an ack").
    topic, vt, calls = make_topic(1), 10 * SECOND, Counter[str]()
    policy = RetryPolicy(max_attempts=2)
    topic.publish("k", "job", 1)
    queue = DelayedQueue(engine, topic_name, visibility_timeout=vt, clock=clock, max_deliveries=2)
    queue.offer("job", 1)
    dying = Subscription(engine, topic_name, "g", "dies", visibility_timeout=vt, max_attempts=2, clock=clock)
    dying.rebalance()
    for attempt in (1, 2):  # two deliveries whose consumer "dies": no outcome, the lock and visibility run out
        [d] = dying.poll()
        q = queue.try_poll()
        assert d.attempts == attempt and q is not None and q.attempts == attempt
        clock.advance(vt + SECOND)
    clock.advance(dt.timedelta(minutes=5))  # the dead subscriber's lease runs out too
    worker = Worker(
        engine,
        [topic_handler(topic_name, lambda d, _: calls.update([d.message_id]), retry=policy, visibility_timeout=vt)],
        clock=clock,
        **FAST,
    )
    assert worker.run_once() == 0
    assert queue.try_poll() is None
    assert calls == {}
    [dead_job] = queue.dead_letters()
    dlq = Subscription(engine, dead_letter_topic(topic_name), "inspect", "me", clock=clock)
    dlq.rebalance()
    [dead] = dlq.poll()
    dlq.close()
    assert dead.dead_letter is not None
    assert dead.dead_letter.last_error == dead_job.last_error == "delivered 2 times without an outcome"
