"""The worker under faults: row locks held elsewhere, exhausted pools, poisoned queues, shutdowns that
time out, missing tables. Real databases, real threads and processes; time moved by a ManualClock
where it matters, every wait bounded."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import REPO_ROOT, Backend, count_rows
from faults import hold_row_lock
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from test_worker import handler_for, wait_until
from test_worker_contract import Driver, Running
from test_worker_processes import markers_of, start_worker

from delayq import (
    DelayedQueue,
    Delivery,
    JsonSerializer,
    ManualClock,
    Retry,
    RetryPolicy,
    TextSerializer,
    Worker,
)
from delayq.cli import worker_engine

SECOND = dt.timedelta(seconds=1)
FAST = dt.timedelta(milliseconds=20)
SERVERS = pytest.mark.parametrize("backend", ["postgresql", "mysql"], indirect=True)
"""For faults SQLite cannot have: a row lock held by another transaction."""


@pytest.fixture(params=["threads", "asyncio"])
def driver(request: pytest.FixtureRequest, backend: Backend) -> Iterator[Driver]:
    """The worker's driver, as in the contract tests: a fault that hits a worker hits both."""
    d = Driver(request.param, backend)
    try:
        yield d
    finally:
        d.close()


@contextlib.contextmanager
def row_locked(backend: Backend, queue: DelayedQueue, key: str) -> Iterator[None]:
    """Hold a row lock on a message from another connection (``SELECT … FOR UPDATE``), as an operator might."""
    m = queue.tables.messages
    with backend.engine.connect() as conn:
        msg_id = conn.execute(sa.select(m.c.id).where(m.c.queue == queue.name, m.c.key == key)).scalar_one()
    with hold_row_lock(backend.url, m.name, "id = :id", {"id": msg_id}) as rows:
        assert len(rows) == 1
        yield


@contextlib.contextmanager
def running(worker: Running | Worker) -> Iterator[Running | Worker]:
    worker.start()
    try:
        yield worker
    finally:
        assert worker.stop()


class Gate:
    """Handlers that block until the test opens their gate, recording their calls."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.started: set[str] = set()
        self.open: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def __call__(self, d: Delivery, _: object) -> None:
        with self._lock:
            self.calls[d.key] += 1
            self.started.add(d.key)
            gate = self.open.setdefault(d.key, threading.Event())
        gate.wait(60)

    def release(self, key: str) -> None:
        with self._lock:
            self.open.setdefault(key, threading.Event()).set()

    def release_all(self, keys: list[str]) -> None:
        for key in keys:
            self.release(key)


def expiry(q: DelayedQueue, key: str) -> dt.datetime | None:
    msg = q.get(key)
    return None if msg is None else msg.scheduled_at


# -- 1. the heartbeat -----------------------------------------------------------------------------------
@SERVERS
def test_a_row_lock_on_one_message_does_not_stop_the_heartbeat_of_the_others(
    driver: Driver, queue_name: str, clock: ManualClock
) -> None:
    backend, vt, gate = driver.backend, 10 * SECOND, Gate()
    worker = driver.worker(
        [driver.queue_handler(queue_name, gate, visibility_timeout=vt)],
        clock=clock,
        concurrency=2,
        poll_interval=FAST,
    )
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock, visibility_timeout=vt)  # the test's own
    other = DelayedQueue(backend.engine, queue_name, clock=clock, visibility_timeout=vt)
    q.offer_many([("a", 1, None), ("b", 2, None)])
    try:
        with running(worker):
            wait_until(lambda: gate.started == {"a", "b"}, "both handlers to start")
            with row_locked(backend, q, "a"):
                for _ in range(4):  # 2.4 visibility timeouts with "a" locked by someone else
                    clock.advance(vt * 0.6)
                    wait_until(lambda: expiry(q, "b") == clock.now() + vt, "b's lock to be extended", limit=5)
                    assert other.try_poll() is None
            wait_until(lambda: expiry(q, "a") == clock.now() + vt, "a's lock to be extended once free", limit=5)
            assert other.try_poll() is None
            gate.release_all(["a", "b"])
            wait_until(lambda: count_rows(backend.engine, queue_name) == 0, "both acks")
    finally:
        gate.release_all(["a", "b"])
    assert gate.calls == {"a": 1, "b": 1}


def test_a_lost_lock_is_logged_once(
    driver: Driver, queue_name: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    engine, vt, gate = driver.backend.engine, 10 * SECOND, Gate()

    def body(d: Delivery, conn: object) -> None:
        gate(d, conn)
        raise ValueError("fails after its lock was lost")  # the retry finds the lock gone: said once

    worker = driver.worker(
        [driver.queue_handler(queue_name, body, visibility_timeout=vt)], clock=clock, poll_interval=FAST
    )
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock, visibility_timeout=vt)  # the test's own
    m = q.tables.messages
    q.offer("a", 1)
    caplog.set_level(logging.WARNING, "delayq.worker")
    try:
        with running(worker):
            wait_until(lambda: gate.started == {"a"}, "the handler to start")
            with engine.begin() as conn:  # another consumer took it
                thief_until = int((clock.now() + dt.timedelta(hours=1)).timestamp() * 1000)
                conn.execute(
                    sa.update(m).where(m.c.queue == queue_name).values(lock_token="thief", scheduled_at=thief_until)
                )
            for _ in range(4):
                clock.advance(vt * 0.6)
                time.sleep(0.2)  # a few heartbeats
            wait_until(lambda: "lock lost" in caplog.text, "the warning")
            gate.release("a")
            wait_until(lambda: worker.health().held == 0, "the handler to finish")
    finally:
        gate.release("a")
    assert caplog.text.count("lock lost") == 1
    assert q.get("a") is not None  # the thief's: not acked by us


# -- 2. transactional handlers and the ORM ----------------------------------------------------------------
class Base(DeclarativeBase):
    pass


class Tally(Base):
    __tablename__ = "delayq_test_tally"
    name: Mapped[str] = mapped_column(sa.String(100), primary_key=True)
    value: Mapped[int]


def test_an_orm_session_bound_to_the_handlers_connection_commits_with_the_ack(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    Base.metadata.create_all(engine)
    with Session(engine) as s, s.begin():
        s.add(Tally(name=queue_name, value=0))

    def body(d: Delivery, conn: sa.Connection) -> None:
        with Session(bind=conn) as session:
            tally = session.get(Tally, queue_name)
            assert tally is not None
            tally.value += 1
            session.flush()

    worker = Worker(engine, [handler_for(queue_name, body, transactional=True)], clock=clock)
    worker.queues[0].offer("job", 1)
    assert worker.run_once() == 1
    with Session(engine) as s:
        tally = s.get(Tally, queue_name)
        assert tally is not None and tally.value == 1
    assert count_rows(engine, queue_name) == 0


# -- 3. the delivery cap and Retry ------------------------------------------------------------------------
def test_a_message_whose_handler_dies_every_time_ends_in_the_dead_letters(
    driver: Driver, queue_name: str, clock: ManualClock
) -> None:
    vt, calls = 10 * SECOND, Counter[str]()
    handler = driver.queue_handler(
        queue_name, lambda d, _: calls.update([d.key]), retry=RetryPolicy(max_attempts=3), visibility_timeout=vt
    )
    worker = driver.worker([handler], clock=clock)
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock, visibility_timeout=vt)
    q.offer("job", 1)
    for attempt in range(1, 4):  # three deliveries whose consumer "dies": never acked, the lock runs out
        d = q.try_poll()
        assert d is not None and d.attempts == attempt
        clock.advance(vt + SECOND)
    assert worker.run_once() == 0
    assert calls == {}
    [dead] = q.dead_letters()
    assert (dead.key, dead.last_error) == ("job", "delivered 3 times without an outcome")


def test_a_requested_retry_counts_as_an_attempt(engine: sa.Engine, queue_name: str, clock: ManualClock) -> None:
    def body(d: Delivery, _: object) -> None:
        raise Retry(after=5 * SECOND, reason="not ready")

    worker = Worker(engine, [handler_for(queue_name, body, retry=RetryPolicy(max_attempts=3))], clock=clock)
    q = worker.queues[0]
    q.offer("job", 1)
    for _ in range(3):
        assert worker.run_once() == 1
        clock.advance(5 * SECOND)
    assert worker.run_once() == 0
    assert q.get("job") is None
    [dead] = q.dead_letters()
    assert (dead.key, dead.attempts, dead.last_error) == ("job", 3, "not ready")


# -- 4. one queue's trouble is its own --------------------------------------------------------------------
class BrokenSerializer(JsonSerializer):
    """A custom serializer with a bug: reading any payload raises something no one expects."""

    def loads(self, data: bytes) -> Any:
        raise RuntimeError("bug in a custom serializer")


def test_a_poisoned_or_failing_queue_does_not_stop_the_others(
    driver: Driver, queue_name: str, clock: ManualClock
) -> None:
    engine = driver.backend.engine
    names = {x: f"{queue_name}-{x}" for x in "abc"}
    handled: Counter[str] = Counter()
    lock = threading.Lock()

    def body(d: Delivery, _: object) -> None:
        with lock:
            handled[f"{d.queue}/{d.key}"] += 1

    handlers = [  # the failing queue first: it is asked first
        driver.queue_handler(names["c"], body, serializer=BrokenSerializer()),
        driver.queue_handler(names["a"], body),
        driver.queue_handler(names["b"], body),
    ]
    worker = driver.worker(handlers, clock=clock, poll_interval=FAST)
    DelayedQueue(engine, names["a"], clock=clock, serializer=TextSerializer()).offer("undecodable", "not json")
    for x in "abc":
        DelayedQueue(engine, names[x], clock=clock).offer_many([(f"m{i}", i, None) for i in range(3)])
    with running(worker):
        wait_until(lambda: len(handled) == 6, "the good messages of a and b")
        assert worker.health().healthy
    assert set(handled) == {f"{names[x]}/m{i}" for x in "ab" for i in range(3)}
    [dead] = DelayedQueue(engine, names["a"], serializer=TextSerializer()).dead_letters()
    assert dead.key == "undecodable"


# -- 5. every loop survives anything ----------------------------------------------------------------------
def test_an_exhausted_pool_slows_the_worker_down_but_does_not_stop_it(backend: Backend, queue_name: str) -> None:
    engine = backend.make_engine(pool_size=1, max_overflow=0, pool_timeout=0.1)
    handled: Counter[str] = Counter()
    lock = threading.Lock()

    def body(d: Delivery, conn: sa.Connection) -> None:
        conn.execute(sa.select(1))
        time.sleep(0.3)  # holding the only connection longer than pool_timeout: the others' checkouts time out
        with lock:
            handled[d.key] += 1

    worker = Worker(
        engine,
        [
            handler_for(
                queue_name,
                body,
                transactional=True,
                visibility_timeout=SECOND,
                retry=RetryPolicy.fixed(dt.timedelta(0), max_attempts=1000),
            )
        ],
        concurrency=3,
        poll_interval=FAST,
    )
    keys = [f"m{i}" for i in range(6)]
    try:
        with running(worker):
            DelayedQueue(backend.engine, queue_name).offer_many([(k, 1, None) for k in keys])
            wait_until(lambda: count_rows(backend.engine, queue_name) == 0, "every message", limit=60)
            assert worker.health().healthy
    finally:
        engine.dispose()
    assert set(handled) == set(keys)


def test_delayq_worker_sizes_its_pool_for_its_concurrency(backend: Backend) -> None:
    engine = worker_engine(backend.url, 8)
    try:
        assert isinstance(engine.pool, sa.pool.QueuePool)
        assert engine.pool.size() == 11  # 8 handlers, the fetch loop, the heartbeat, the listener
    finally:
        engine.dispose()


# -- 6. graceful shutdown ---------------------------------------------------------------------------------
def test_messages_handled_during_the_shutdown_wait_are_acked_then(
    driver: Driver, queue_name: str, clock: ManualClock
) -> None:
    engine, vt, gate = driver.backend.engine, 10 * SECOND, Gate()
    worker = driver.worker(
        [driver.queue_handler(queue_name, gate, visibility_timeout=vt)],
        clock=clock,
        concurrency=2,
        poll_interval=FAST,
        shutdown_timeout=dt.timedelta(seconds=30),
    )
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock, visibility_timeout=vt)  # the test's own
    other = DelayedQueue(engine, queue_name, clock=clock, visibility_timeout=vt)
    q.offer_many([("fast", 1, None), ("slow", 2, None)])
    worker.start()
    stopper = threading.Thread(target=worker.stop)
    try:
        wait_until(lambda: gate.started == {"fast", "slow"}, "both handlers to start")
        stopper.start()
        assert worker.worker._stopping.wait(5)
        gate.release("fast")
        wait_until(lambda: q.get("fast") is None, "the ack of the handler that finished", limit=5)
        clock.advance(vt * 1.5)  # the running one keeps its lock meanwhile
        wait_until(lambda: expiry(q, "slow") == clock.now() + vt, "the heartbeat during the shutdown", limit=5)
        assert other.try_poll() is None
        gate.release("slow")
        stopper.join(30)
        assert not stopper.is_alive()
    finally:
        gate.release_all(["fast", "slow"])
        assert worker.stop()
    assert gate.calls == {"fast": 1, "slow": 1}
    assert count_rows(engine, queue_name) == 0


@pytest.mark.parametrize("kind", ["threads", "asyncio"])
def test_sigterm_past_the_shutdown_timeout_exits_without_releasing_the_running_handlers_message(
    backend: Backend,
    queue_name: str,
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    kind: str,
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("job", 1)
    worker = start_worker(
        backend, queue_name, tmp_path, seconds=60, concurrency=2, visibility=30.0, shutdown_timeout=2.0, driver=kind
    )
    processes.append(worker)
    wait_until(lambda: bool(markers_of(tmp_path, "started")), "the handler to start")
    worker.send_signal(signal.SIGTERM)
    try:
        output = worker.communicate(timeout=15)[0].decode()  # 2 s of grace, not the handler's 60 s
    except subprocess.TimeoutExpired:
        pytest.fail("the worker did not exit after its shutdown timeout")
    assert worker.returncode == 0, output
    assert markers_of(tmp_path, "done") == {}
    m = q.tables.messages
    with backend.engine.connect() as conn:
        left = conn.execute(sa.select(m.c.attempts, m.c.lock_token).where(m.c.queue == queue_name)).all()
    if kind == "threads":
        # Not released while the handler ran: still locked (until its visibility timeout), the attempt counted.
        assert [(attempts, token is not None) for attempts, token in left] == [(1, True)], output
        assert q.stats().in_flight == 1
    else:
        # The coroutine is cancelled as the worker exits: only once it ran no more is the message given
        # back, at once and its attempt not counted (a cancelled handler neither failed nor finished).
        assert "released 1 message(s) (its handler was cancelled)" in output
        assert [(attempts, token is not None) for attempts, token in left] == [(0, False)], output
        assert q.stats().ready == 1


# -- 7. fair slots ----------------------------------------------------------------------------------------
def test_a_small_queue_is_not_starved_behind_a_big_one(engine: sa.Engine, queue_name: str, clock: ManualClock) -> None:
    order: list[str] = []
    lock = threading.Lock()

    def body(d: Delivery, _: object) -> None:
        with lock:
            order.append(d.queue)

    big, small = f"{queue_name}-big", f"{queue_name}-small"
    worker = Worker(engine, [handler_for(big, body), handler_for(small, body)], clock=clock, concurrency=2)
    DelayedQueue(engine, big, clock=clock).offer_many([(f"m{i}", i, None) for i in range(300)])
    DelayedQueue(engine, small, clock=clock).offer_many([(f"m{i}", i, None) for i in range(5)])
    assert worker.run_once() == 305
    last_small = max(i for i, name in enumerate(order) if name == small)
    assert last_small < 30, f"the small queue's last message ran {last_small}th of 305"


# -- 8. acks, missing tables ------------------------------------------------------------------------------
@SERVERS
def test_an_ack_skips_a_row_locked_elsewhere_and_acks_it_later(
    driver: Driver, queue_name: str, clock: ManualClock
) -> None:
    backend, vt, gate = driver.backend, 10 * SECOND, Gate()
    worker = driver.worker(
        [driver.queue_handler(queue_name, gate, visibility_timeout=vt)], clock=clock, poll_interval=FAST
    )
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock, visibility_timeout=vt)  # the test's own
    q.offer("x", 1)
    try:
        with running(worker):
            wait_until(lambda: gate.started == {"x"}, "the handler to start")
            with row_locked(backend, q, "x"):
                gate.release("x")
                q.offer("y", 2)  # the worker goes on meanwhile: its ack did not wait on x's row lock
                gate.release("y")
                wait_until(lambda: q.get("y") is None, "y to be handled and acked", limit=5)
                assert q.get("x") is not None
            wait_until(lambda: q.get("x") is None, "x's ack once its row is free", limit=5)
    finally:
        gate.release_all(["x", "y"])
    assert gate.calls == {"x": 1, "y": 1}


def test_a_failed_ack_is_tried_again_while_the_lock_holds(
    backend: Backend, queue_name: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    vt, gate = 10 * SECOND, Gate()
    engine = backend.make_engine(pool_size=2, max_overflow=0, pool_timeout=0.1)
    worker = Worker(engine, [handler_for(queue_name, gate, visibility_timeout=vt)], clock=clock, poll_interval=FAST)
    q = DelayedQueue(backend.engine, queue_name, clock=clock, visibility_timeout=vt)
    q.offer("x", 1)
    caplog.set_level(logging.WARNING, "delayq.worker")
    hog: list[sa.Connection] = []
    try:
        with running(worker):
            wait_until(lambda: gate.started == {"x"}, "the handler to start")

            def take_the_pool() -> bool:  # the worker's next statements time out waiting for a connection
                with contextlib.suppress(sa.exc.TimeoutError):
                    hog.append(engine.connect())
                return len(hog) == 2

            wait_until(take_the_pool, "the whole pool", limit=5)
            gate.release("x")
            wait_until(lambda: "could not ack" in caplog.text, "a failed ack")
            for conn in hog:
                conn.close()
            wait_until(lambda: q.get("x") is None, "the ack, tried again", limit=5)
            clock.advance(vt * 2)
            assert q.try_poll() is None
    finally:
        gate.release("x")
        for conn in hog:
            conn.close()
        engine.dispose()
    assert gate.calls == {"x": 1}


def test_delayq_worker_without_the_tables_exits_with_the_migrate_hint(backend: Backend, queue_name: str) -> None:
    env = {
        **os.environ,
        "DELAYQ_URL": backend.url,
        "DELAYQ_TEST_QUEUE": queue_name,
        "PYTHONPATH": str(REPO_ROOT / "tests"),
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "delayq.cli", "--prefix", "nosuch_", "worker", "worker_app:handlers"],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the worker kept running without its tables")
    assert done.returncode == 2
    assert b"delayq migrate" in done.stderr


# -- 9. health --------------------------------------------------------------------------------------------
def test_health_reports_running_loops_fetches_and_held_deliveries(
    backend: Backend, queue_name: str, clock: ManualClock
) -> None:
    gate = Gate()
    worker = Worker(backend.engine, [handler_for(queue_name, gate)], clock=clock, poll_interval=FAST)
    before = worker.health()
    assert (before.running, before.healthy, before.seconds_since_fetch, before.held) == (False, False, None, 0)
    worker.queues[0].offer("job", 1)
    try:
        with running(worker):
            wait_until(lambda: gate.started == {"job"}, "the handler to start")
            health = worker.health()
            assert health.healthy and health.held == 1
            loops = {"fetch", "heartbeat", "ack"} | ({"listen"} if backend.name == "postgresql" else set())
            assert set(health.loops) == loops
            assert health.seconds_since_fetch is not None and health.seconds_since_fetch < 30
            gate.release("job")
            wait_until(lambda: worker.health().held == 0, "the ack")
    finally:
        gate.release("job")
    after = worker.health()
    assert not after.running and not after.healthy and not any(after.loops.values())


def test_a_stop_right_after_the_start_stops_the_worker(driver: Driver, queue_name: str, clock: ManualClock) -> None:
    worker = driver.worker([driver.queue_handler(queue_name, lambda d, _: None)], clock=clock)
    worker.start()
    assert worker.stop(10)
    assert not worker.health().running
