"""The worker contract, once for both drivers of the one runtime core: threads (``Worker``) and asyncio
tasks (``AsyncWorker``), on every backend.

Each test is written once against ``Driver``: it makes a worker of the driver's kind over the backend,
and wraps a test's sync handler body in the driver's handler (an ``async def handle`` that runs the body
in a thread, or, for a transactional handler, on the transaction's sync connection). The asyncio worker
runs on an event loop of its own thread, so a test reads the same whichever driver runs: it starts,
waits for what it expects (never for a time), stops. The manual clock moves locks, leases and due times.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from _history import History, Runs, overlap, started
from conftest import Backend, count_rows, make_async_engine
from test_topics_worker import holders, keys_for
from test_worker import wait_until
from test_worker_shutdown import locked_beyond

from delayq import (
    DeadLetter,
    DelayedQueue,
    Delivery,
    Handler,
    ManualClock,
    RetryPolicy,
    Schedule,
    Topic,
    TopicDelivery,
    TopicHandler,
    Worker,
    WorkerHealth,
    observe,
)
from delayq.aio import AsyncHandler, AsyncWorker
from delayq.schema import make_tables
from delayq.topics import group_lag

SECOND = dt.timedelta(seconds=1)
FAST = {"poll_interval": dt.timedelta(milliseconds=20), "listen": False}
QUICK_STOP = {**FAST, "shutdown_timeout": dt.timedelta(milliseconds=200)}
T = TypeVar("T")
Body = Callable[[Any, Any], None]


class Running:
    """A worker of either driver behind one sync surface."""

    def __init__(self, driver: Driver, worker: Worker | AsyncWorker) -> None:
        self.driver = driver
        self.worker = worker

    @property
    def name(self) -> str:
        return self.worker.name

    @property
    def handled(self) -> int:
        return self.worker.handled

    def health(self) -> WorkerHealth:
        return self.worker.health()

    def start(self) -> None:
        if isinstance(self.worker, AsyncWorker):
            worker = self.worker

            async def start() -> None:
                worker.start()

            self.driver.call(start())
        else:
            self.worker.start()

    def stop(self, timeout: float | None = None) -> bool:
        if isinstance(self.worker, AsyncWorker):
            return self.driver.call(self.worker.stop(timeout))
        return self.worker.stop(timeout)

    def run_once(self) -> int:
        if isinstance(self.worker, AsyncWorker):
            return self.driver.call(self.worker.run_once())
        return self.worker.run_once()


class Driver:
    """Threads or asyncio: makes workers and handlers of its kind over a backend."""

    def __init__(self, kind: str, backend: Backend) -> None:
        self.kind = kind
        self.backend = backend
        self.loop: asyncio.AbstractEventLoop | None = None
        self.async_engine: Any = None
        self._thread: threading.Thread | None = None
        if kind == "asyncio":
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
            self._thread.start()
            self.async_engine = make_async_engine(backend.url)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop is None:
            return
        self.call(self.async_engine.dispose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self.loop.close()

    def worker(self, handlers: list[Any], **options: Any) -> Running:
        if self.kind == "asyncio":
            return Running(self, AsyncWorker(self.async_engine, handlers, **options))
        return Running(self, Worker(self.backend.engine, handlers, **options))

    def queue_handler(self, queue_name: str, body: Body, **attrs: Any) -> Handler:
        """A queue handler running ``body(delivery, conn)`` (the sync ``Delivery``; ``conn`` when transactional)."""
        if self.kind == "asyncio":

            async def handle_async(self: Any, d: Any, conn: Any = None) -> None:
                if conn is None:
                    await asyncio.to_thread(body, d.delivery, None)
                else:
                    await conn.run_sync(lambda c: body(d.delivery, c))

            cls = type("ContractAsyncHandler", (AsyncHandler,), {"queue": queue_name, "handle": handle_async, **attrs})
            return cls()  # type: ignore[no-any-return]

        def handle(self: Any, d: Delivery, conn: Any = None) -> None:
            body(d, conn)

        return type("ContractHandler", (Handler,), {"queue": queue_name, "handle": handle, **attrs})()  # type: ignore[no-any-return]

    def topic_handler(self, topic: str, body: Body, **attrs: Any) -> TopicHandler:
        attrs.setdefault("lease_duration", 3 * SECOND)  # a rebalance every second of real time
        attrs.setdefault("visibility_timeout", 30 * SECOND)
        if self.kind == "asyncio":

            async def handle_async(self: Any, d: TopicDelivery, conn: Any = None) -> None:
                if conn is None:
                    await asyncio.to_thread(body, d, None)
                else:
                    await conn.run_sync(lambda c: body(d, c))

            handle: Any = handle_async
        else:

            def handle(self: Any, d: TopicDelivery, conn: Any = None) -> None:
                body(d, conn)

        cls = type("ContractTopicHandler", (TopicHandler,), {"topic": topic, "group": "g", "handle": handle, **attrs})
        return cls()  # type: ignore[no-any-return]


@pytest.fixture(params=["threads", "asyncio"])
def driver(request: pytest.FixtureRequest, backend: Backend) -> Iterator[Driver]:
    d = Driver(request.param, backend)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def topic_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


# -- queue handlers: the one outcome decision ------------------------------------------------------------
def test_queue_handlers_ack_retry_and_dead_letter_per_the_policy(
    driver: Driver, queue_name: str, clock: ManualClock
) -> None:
    seen: list[tuple[str, int]] = []

    def body(d: Delivery, _: object) -> None:
        seen.append((d.key, d.attempts))
        if d.key == "flaky" and d.attempts == 1:
            raise ValueError("once")
        if d.key == "bad":
            raise DeadLetter("no such order")
        if d.key == "broken":
            raise RuntimeError("always")

    handler = driver.queue_handler(queue_name, body, retry=RetryPolicy.fixed(dt.timedelta(0), max_attempts=2))
    worker = driver.worker([handler], clock=clock, **FAST)
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock)
    for key in ("ok", "flaky", "bad", "broken"):
        q.offer(key, {"k": key})
    assert worker.run_once() == 6  # ok, flaky twice, bad, broken twice
    assert sorted(seen) == sorted([("ok", 1), ("flaky", 1), ("flaky", 2), ("bad", 1), ("broken", 1), ("broken", 2)])
    stats = q.stats()
    assert (stats.ready, stats.scheduled, stats.in_flight) == (0, 0, 0)
    dead = {d.key: (d.attempts, d.last_error) for d in q.dead_letters()}
    assert dead == {"bad": (1, "no such order"), "broken": (2, "RuntimeError: always")}
    assert worker.handled == 6


# -- topic handlers: exactly once, the fenced ack in the handler's transaction ------------------------------
@pytest.fixture
def effects(backend: Backend) -> Iterator[sa.Table]:
    metadata = sa.MetaData()
    table = sa.Table(
        f"contract_effects_{uuid.uuid4().hex[:8]}",
        metadata,
        sa.Column("message_id", sa.String(100)),
        sa.Column("attempt", sa.Integer),
    )
    metadata.create_all(backend.engine)
    yield table
    metadata.drop_all(backend.engine)


def test_a_transactional_topic_handler_writes_its_effect_once_per_group(
    driver: Driver, topic_name: str, clock: ManualClock, effects: sa.Table
) -> None:
    engine = driver.backend.engine
    topic = Topic(engine, topic_name, clock=clock)
    topic.create(2)
    leases = make_tables().topics.leases
    lock = threading.Lock()
    delivered: set[str] = set()
    stolen: list[str] = []

    def body(d: TopicDelivery, conn: sa.Connection | None) -> None:
        assert conn is not None
        conn.execute(effects.insert().values(message_id=d.message_id, attempt=d.attempts))
        with lock:
            delivered.add(d.message_id)
        if d.attempts == 1 and int(d.message_id[1:]) % 5 == 0:
            with lock:
                stolen.append(d.message_id)
            steal = (
                leases.update()
                .where(leases.c.consumer_group == "g", leases.c.topic == topic_name, leases.c.partition == d.partition)
                .values(holder="thief", epoch=leases.c.epoch + 1, expires_at=0)
            )
            if driver.backend.name == "sqlite" or driver.kind == "asyncio":
                # Play the thief in this transaction: SQLite has one writer at a time, and on the event loop a
                # blocking call from another connection would wait on the lease row another task's transaction
                # holds, with the loop itself blocked (the thread worker's test steals from another connection).
                conn.execute(steal)
            else:  # another subscriber takes the partition (and lets it go at once)
                with engine.begin() as other:
                    other.execute(steal)

    handler = driver.topic_handler(topic_name, body, transactional=True, retry=RetryPolicy.fixed(dt.timedelta(0)))
    worker = driver.worker([handler], clock=clock, concurrency=2, **FAST)
    ids = [f"m{i}" for i in range(20)]
    topic.publish_many([(f"key{i % 4}", m, i) for i, m in enumerate(ids)])
    worker.start()
    try:
        wait_until(lambda: delivered == set(ids) and worker.health().held == 0, "the first pass")
        clock.advance(31 * SECOND)  # the deliveries whose writes rolled back come again
        wait_until(lambda: count(engine, effects) == 20, "every message's effect")
    finally:
        assert worker.stop()
    with engine.connect() as conn:
        rows = conn.execute(sa.select(effects.c.message_id, sa.func.count()).group_by(effects.c.message_id)).all()
    assert dict(rows) == dict.fromkeys(ids, 1)
    assert sorted(stolen) == ["m0", "m10", "m15", "m5"]


def count(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


# -- schedules -------------------------------------------------------------------------------------------
def test_a_worker_keeps_the_schedules_declared_on_its_handlers(
    driver: Driver, queue_name: str, clock: ManualClock
) -> None:
    seen: list[Any] = []
    schedules = (Schedule.periodic("tick", dt.timedelta(minutes=1), payload={"tick": True}),)
    handler = driver.queue_handler(queue_name, lambda d, _: seen.append(d.payload), schedules=schedules)
    workers = [driver.worker([handler], clock=clock, **FAST) for _ in range(2)]
    assert [w.run_once() for w in workers] == [0, 0]  # both install; nothing is due yet
    clock.advance(dt.timedelta(minutes=1))
    assert sum(w.run_once() for w in workers) == 1  # one run, however many workers declare it
    clock.advance(dt.timedelta(minutes=1))
    assert sum(w.run_once() for w in workers) == 1
    assert seen == [{"tick": True}] * 2


def test_a_running_worker_installs_its_schedules_in_the_background(
    driver: Driver, queue_name: str, clock: ManualClock
) -> None:
    seen: list[Any] = []
    schedules = (Schedule.periodic("tick", dt.timedelta(minutes=1), payload={"tick": True}),)
    handler = driver.queue_handler(queue_name, lambda d, _: seen.append(d.payload), schedules=schedules)
    worker = driver.worker([handler], clock=clock, **FAST)
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock)
    worker.start()
    try:
        wait_until(lambda: q.stats().scheduled > 0, "the schedule's runs to be installed")
        clock.advance(dt.timedelta(minutes=1))
        wait_until(lambda: seen == [{"tick": True}], "the first run")
    finally:
        assert worker.stop()


# -- shutdown: what still runs is never released while it runs -------------------------------------------
def test_a_queue_handler_running_past_the_shutdown_timeout_keeps_its_lock_until_it_returns(
    driver: Driver, queue_name: str, clock: ManualClock
) -> None:
    runs = Runs()
    go_on = threading.Event()

    def body(d: Delivery, _: object) -> None:
        run = runs.begin("worker", d.key)
        go_on.wait(30)
        run[3] = time.monotonic()

    handler = driver.queue_handler(queue_name, body, visibility_timeout=2 * SECOND)
    worker = driver.worker([handler], clock=clock, concurrency=2, **QUICK_STOP)
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock)
    other = DelayedQueue(driver.backend.engine, queue_name, clock=clock)  # another consumer of the queue
    q.offer("job", 1)
    worker.start()
    try:
        wait_until(lambda: bool(runs.of("job")), "the handler to start")
        assert worker.stop()  # the shutdown timeout passes while the handler runs
        assert worker.health().held == 1  # kept
        assert other.try_poll() is None  # not released
        for _ in range(3):  # the lock would have expired three times over: the heartbeat goes on
            clock.advance(5 * SECOND)
            wait_until(lambda: locked_beyond(q, "job", clock.now()), "the lock to be extended")
            assert other.try_poll() is None
        go_on.set()
        wait_until(lambda: q.get("job") is None, "the late handler's ack")
        wait_until(lambda: worker.health().held == 0, "the kept job to end")
    finally:
        go_on.set()
        worker.stop()
    runs.check_no_overlap()
    assert [r[0] for r in runs.of("job")] == ["worker"]
    assert q.dead_letters() == []


@pytest.mark.parametrize("max_attempts", [1, 2])
def test_a_topic_handler_running_past_the_shutdown_timeout_keeps_its_partition_until_it_returns(
    driver: Driver, topic_name: str, clock: ManualClock, max_attempts: int
) -> None:
    engine = driver.backend.engine
    topic = Topic(engine, topic_name, clock=clock)
    topic.create(2)
    keys = keys_for(2)
    runs = Runs()
    go_on = threading.Event()

    def body(holder: str) -> Body:
        def handle(d: TopicDelivery, _: object) -> None:
            run = runs.begin(holder, d.message_id)
            if d.message_id == "slow":
                go_on.wait(30)
            run[3] = time.monotonic()

        return handle

    def worker(holder: str) -> Running:
        handler = driver.topic_handler(topic_name, body(holder), retry=RetryPolicy(max_attempts=max_attempts))
        return driver.worker([handler], clock=clock, concurrency=2, **QUICK_STOP)

    a, b = worker("a"), worker("b")
    a.start()
    try:
        wait_until(lambda: holders(engine, topic_name) == {a.name: 2}, "the first worker to hold both partitions")
        topic.publish(keys[0], "slow", 1)
        wait_until(lambda: bool(runs.of("slow")), "the slow handler to start")
        assert a.stop()  # the shutdown timeout passes while the handler runs
        b.start()
        topic.publish(keys[1], "other", 2)
        wait_until(lambda: bool(runs.of("other")), "the second worker to take the idle partition")
        assert [r[0] for r in runs.of("slow")] == ["a"]  # nobody else got it while its handler ran
        assert holders(engine, topic_name) == {a.name: 1, b.name: 1}  # the running handler's partition is kept
        go_on.set()
        # The handler returns: its ack is recorded, then the stopped worker leaves the group.
        wait_until(lambda: holders(engine, topic_name) == {b.name: 2}, "the kept partition to move over")
        topic.publish(keys[0], "later", 3)
        wait_until(lambda: bool(runs.of("later")), "the partition's later message")
        wait_until(lambda: a.health().held == 0 and b.health().held == 0, "the last outcomes")
    finally:
        go_on.set()
        a.stop()
        assert b.stop()
    runs.check_no_overlap()
    assert [(r[0], r[1]) for r in sorted(runs.runs, key=lambda r: r[2])] == [
        ("a", "slow"),
        ("b", "other"),
        ("b", "later"),
    ]
    assert topic.dead_letters() == []
    assert sum(p.head - p.watermark for p in group_lag(engine, topic_name, "g")) == 0  # the slow one acked


# -- per-job timeout: a thread is reported and kept, a task is cancelled; never two runs at once -----------
class Overdue(observe.Observer):
    reads_database = False

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def counted(self, event: observe.Event, queue: str, n: int) -> None:
        if event == "overdue":
            self.seen[queue] += n


@pytest.fixture
def overdue() -> Iterator[Overdue]:
    found = Overdue()
    observe.add(found)
    yield found
    observe.remove(found)


def test_a_handler_past_its_timeout_is_never_run_twice_at_once(
    driver: Driver, queue_name: str, clock: ManualClock, overdue: Overdue
) -> None:
    """The core finds a job past ``Handler.timeout`` once. A thread cannot be stopped: it is reported, its
    message stays held (extended) and is acked when it returns. A task is cancelled: a failed attempt
    (``TimedOut``), retried per the policy only once the task has ended."""
    runs = Runs()
    go_on = threading.Event()
    attrs = {
        "timeout": 30 * SECOND,
        "visibility_timeout": 5 * 60 * SECOND,  # the clock's jump past the timeout stays inside it
        "retry": RetryPolicy.fixed(dt.timedelta(0), max_attempts=3),
    }
    handler: Handler
    if driver.kind == "asyncio":

        async def handle(self: Any, d: Any, conn: Any = None) -> None:
            run = runs.begin(f"attempt {d.attempts}", d.key)
            try:
                if d.attempts == 1:
                    await asyncio.Event().wait()  # hangs until its timeout cancels it
            finally:
                run[3] = time.monotonic()

        handler = type("Slow", (AsyncHandler,), {"queue": queue_name, "handle": handle, **attrs})()

    else:

        def body(d: Delivery, _: object) -> None:
            run = runs.begin(f"attempt {d.attempts}", d.key)
            go_on.wait(30)
            run[3] = time.monotonic()

        handler = driver.queue_handler(queue_name, body, **attrs)
    worker = driver.worker([handler], clock=clock, concurrency=2, **FAST)
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock)
    q.offer("job", 1)
    worker.start()
    try:
        wait_until(lambda: bool(runs.of("job")), "the handler to start")
        clock.advance(31 * SECOND)  # past the timeout
        wait_until(lambda: overdue.seen[queue_name] == 1, "the handler to be found overdue")
        if driver.kind == "asyncio":
            wait_until(lambda: q.get("job") is None, "the retry's ack")
            assert [r[0] for r in runs.of("job")] == ["attempt 1", "attempt 2"]
        else:
            assert worker.health().stuck == 1
            assert q.try_poll() is None  # still held: the thread lives
            go_on.set()
            wait_until(lambda: q.get("job") is None, "the late handler's ack")
            assert [r[0] for r in runs.of("job")] == ["attempt 1"]
        assert worker.health().stuck == 0
    finally:
        go_on.set()
        assert worker.stop()
    runs.check_no_overlap()
    assert overdue.seen[queue_name] == 1  # found once
    assert q.dead_letters() == []


# -- queue handlers: the policy within the concurrency limit; exactly-once effects when locks are lost -----
def test_queue_handlers_follow_the_policy_within_the_concurrency_limit(
    driver: Driver, queue_name: str, clock: ManualClock
) -> None:
    other = queue_name + "-b"
    seen: Counter[tuple[str, int]] = Counter()
    running, most = 0, 0
    lock = threading.Lock()
    history = DelayedQueue(driver.backend.engine, queue_name, clock=clock)

    def body(d: Delivery, _: object) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            seen[d.key, d.attempts] += 1
        try:
            if d.key == "a0" and d.attempts == 1:
                raise ValueError("first attempt fails")
            if d.key == "a0":
                assert [h.error_type for h in history.attempt_history("a0")] == ["ValueError"]
            if d.key == "b0":
                raise DeadLetter("no such customer")
        finally:
            with lock:
                running -= 1

    policy = RetryPolicy.fixed(dt.timedelta(0))
    handlers = [driver.queue_handler(queue_name, body, retry=policy), driver.queue_handler(other, body, retry=policy)]
    worker = driver.worker(handlers, clock=clock, concurrency=3)
    qa, qb = history, DelayedQueue(driver.backend.engine, other, clock=clock)
    qa.offer_many([(f"a{i}", i, None) for i in range(7)])
    qb.offer_many([(f"b{i}", i, None) for i in range(7)])
    assert worker.run_once() == 15  # 14 and a second attempt of a0
    assert qa.stats().ready + qb.stats().ready == 0
    [dead] = qb.dead_letters()
    assert (dead.key, dead.last_error) == ("b0", "no such customer")
    assert most <= 3
    assert seen == Counter({**{(f"a{i}", 1): 1 for i in range(7)}, ("a0", 2): 1, **{(f"b{i}", 1): 1 for i in range(7)}})


@pytest.fixture
def keyed_effects(backend: Backend) -> Iterator[sa.Table]:
    metadata = sa.MetaData()
    table = sa.Table(
        f"contract_keyed_{uuid.uuid4().hex[:8]}",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(50), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
    )
    metadata.create_all(backend.engine)
    yield table
    metadata.drop_all(backend.engine)


def test_transactional_queue_handlers_write_exactly_once_when_locks_are_lost(
    driver: Driver, queue_name: str, clock: ManualClock, keyed_effects: sa.Table
) -> None:
    """Four workers; one message in five loses its lock mid-handler (another worker takes it): the
    handler's writes commit with its ack, so each key's effect is written once."""
    backend, effects = driver.backend, keyed_effects
    engine = backend.engine
    m = DelayedQueue(engine, queue_name).tables.messages
    lost: Counter[str] = Counter()

    def loses_its_lock(d: Delivery) -> bool:
        return d.attempts == 1 and int(d.key[1:]) % 5 == 0

    def current_token(msg_id: int) -> str | None:
        with engine.connect() as c:
            return c.execute(sa.select(m.c.lock_token).where(m.c.id == msg_id)).scalar()

    def expire_and_wait(d: Delivery) -> None:  # expire the lock; wait until another worker has claimed it
        with engine.begin() as c:
            c.execute(m.update().where(m.c.id == d.id).values(scheduled_at=0))
        wait_until(lambda: current_token(d.id) != d.lock_token, "another worker to take the message")

    handler: Handler
    attrs = {"transactional": True, "visibility_timeout": 30 * SECOND, "retry": RetryPolicy.fixed(dt.timedelta(0))}
    steal = m.update().values(lock_token="another-consumer")  # SQLite, one writer at a time: play the other consumer
    if driver.kind == "asyncio":

        async def handle(self: Any, ad: Any, conn: Any = None) -> None:
            d = ad.delivery
            await conn.execute(effects.insert().values(key=d.key, attempt=d.attempts))
            if loses_its_lock(d):
                lost[d.key] += 1
                if backend.name == "sqlite":
                    await conn.execute(steal.where(m.c.id == d.id))
                else:
                    await asyncio.to_thread(expire_and_wait, d)  # the loop goes on: the other workers claim

        handler = type("Writes", (AsyncHandler,), {"queue": queue_name, "handle": handle, **attrs})()
    else:

        def body(d: Delivery, conn: sa.Connection) -> None:
            conn.execute(effects.insert().values(key=d.key, attempt=d.attempts))
            if loses_its_lock(d):
                lost[d.key] += 1
                if backend.name == "sqlite":
                    conn.execute(steal.where(m.c.id == d.id))
                else:
                    expire_and_wait(d)

        handler = driver.queue_handler(queue_name, body, **attrs)
    workers = [driver.worker([handler], clock=clock, concurrency=2, **FAST) for _ in range(4)]
    q = DelayedQueue(engine, queue_name, clock=clock)
    keys = [f"m{i}" for i in range(100)]
    q.offer_many([(k, 1, None) for k in keys])
    for w in workers:
        w.start()
    try:
        if backend.name == "sqlite":  # the stolen locks expire with time
            wait_until(lambda: q.stats().in_flight + q.stats().ready == len(lost), "the first pass")
            clock.advance(31 * SECOND)
        wait_until(lambda: count_rows(engine, queue_name) == 0, "every message to be handled")
    finally:
        for w in workers:
            assert w.stop()
    with engine.connect() as conn:
        rows = conn.execute(sa.select(effects.c.key, sa.func.count()).group_by(effects.c.key)).all()
    assert dict(rows) == dict.fromkeys(keys, 1)
    assert len(lost) == 20


# -- flow control: a limited queue under the worker -------------------------------------------------------
@pytest.mark.parametrize("limit", ["concurrency", "group"])
def test_a_limited_queue_drains_with_its_limit_held(driver: Driver, queue_name: str, limit: str) -> None:
    """Eight slots on a queue limited to two running (a concurrency limit, or one group of two): the
    handlers, each recording its start and end, never overlap more than two, and the queue drains. The
    poll interval is an hour: slots refill as the acks commit (an ack of a limited queue wakes the fetch
    loop; a claim before it still counts the handled messages as running), not at a poll."""
    q = DelayedQueue(driver.backend.engine, queue_name)
    items = [(f"k{i:02}", i, None) for i in range(24)]
    if limit == "concurrency":
        q.set_concurrency_limit(2)
        q.offer_many(items)
    else:
        q.set_group_concurrency(2)
        q.offer_many(items, group="g")
    history = History()

    def body(d: Delivery, _: object) -> None:
        history.record("start", d.key)
        time.sleep(0.001)  # (a little work, so that handlers could overlap)
        history.record("end", d.key)

    worker = driver.worker(
        [driver.queue_handler(queue_name, body)], concurrency=8, poll_interval=dt.timedelta(hours=1), listen=False
    )
    worker.start()
    try:
        wait_until(lambda: q.stats().ready + q.stats().in_flight == 0, "the queue to drain", 120)
    finally:
        assert worker.stop()
    assert started(history.records) == [k for k, _, _ in items]
    assert overlap(history.records) <= 2


def test_an_ack_wakes_the_fetch_only_for_a_queue_whose_claims_count_held_messages(
    backend: Backend, clock: ManualClock
) -> None:
    """``Core.flush_acks`` says whether an ack committed for a queue under a concurrency limit or with groups
    (the drivers then wake their fetch loop); a plain or rate-limited queue's acks wake nothing."""
    names = {kind: f"q-{kind}-{uuid.uuid4().hex[:8]}" for kind in ("plain", "concurrency", "group", "rate")}
    setup = {name: DelayedQueue(backend.engine, name, clock=clock) for name in names.values()}
    setup[names["concurrency"]].set_concurrency_limit(5)
    setup[names["group"]].set_group_concurrency(2)
    setup[names["rate"]].set_rate_limit(100, dt.timedelta(seconds=1))
    for kind, name in names.items():
        setup[name].offer("k", 1, group="g" if kind == "group" else None)
    clock.advance(SECOND)  # (the rate limit's bucket fills)
    for kind, name in names.items():
        worker = Worker(backend.engine, [noop_handler(name)], clock=clock, poll_interval=SECOND)
        core = worker._core
        assert core.flush_acks() is False  # nothing to ack
        source = core.queue_sources[name]
        claimed = source.claim(1, lambda s, j: None, backoff=lambda n: 1.0)
        assert claimed is not None and len(claimed) == 1, kind
        [job] = claimed
        core.jobs.finish(job, True)
        assert core.flush_acks() is (kind in ("concurrency", "group")), kind
        assert setup[name].stats().in_flight == 0


def noop_handler(queue_name: str) -> Handler:
    return type("Noop", (Handler,), {"queue": queue_name, "handle": lambda self, d, conn=None: None})()  # type: ignore[no-any-return]


@pytest.mark.parametrize("poll", [0.05, 1.0, 30.0])
def test_a_workers_queues_read_their_flow_state_at_least_once_per_poll_interval(
    driver: Driver, queue_name: str, poll: float
) -> None:
    """A pause counts within one poll interval whatever it is: the worker's own queues keep their flow state
    for ``min(1 s, poll_interval)``."""
    handler = driver.queue_handler(queue_name, lambda d, c: None)
    running = driver.worker([handler], poll_interval=dt.timedelta(seconds=poll), listen=False)
    [source] = running.worker._core.queue_sources.values()
    assert source.queue._flow_refresh_s == min(1.0, poll)
