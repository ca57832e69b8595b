"""Bounds on delayq's own transactions and calls (issue 29, rows 2, 13, 14): a consumer frozen, or behind a
network gone silent, in the middle of one of delayq's transactions keeps its rows locked only for the
server's idle bound, and its own thread waits only for the call bound (docs/workers.md, "Bounds").

Each test goes through the TCP fault proxy and makes the connections of one party go silent for good
(``stall_existing``) right after a chosen statement of that party reached the server: the server then sees
a transaction that sits idle holding its row locks, as it would for a process frozen by SIGSTOP or a GC
pause, and the party's thread waits for a reply that never comes. Another party, on a direct connection,
must get every message, once, within the bounds.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import START, Backend, _backend, make_async_engine, make_engine
from faults import FaultProxy
from test_worker import wait_until
from test_worker_contract import Driver

from delayq import DelayedQueue, Delivery, Handler, ManualClock, RetryPolicy, Worker
from delayq.dialects import bounds, dialect_for
from delayq.topics import Subscription, Topic, dead_letter_topic

SERVERS = ["postgresql", "mysql"]
IDLE_S = 1.0
"""The idle bound in these tests (MariaDB counts whole seconds)."""
CALL_S = 4.0
"""The call bound in these tests: longer than the idle bound, so the server has ended the frozen
transaction before the frozen party's call fails and it retries."""
DEADLINE = 20.0
"""How long a test waits for the other party to get everything (a bounded poll, not a timing claim)."""


@pytest.fixture(autouse=True)
def short_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounds, "IDLE_TIMEOUT_S", IDLE_S)
    monkeypatch.setattr(bounds, "CALL_TIMEOUT_S", CALL_S)


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest, backend_urls: dict[str, str]) -> Iterator[tuple[Backend, FaultProxy]]:
    b = _backend(request.param, backend_urls)
    with FaultProxy.for_url(b.url) as proxy:
        yield b, proxy


def through(proxy: FaultProxy, b: Backend, **kwargs: Any) -> sa.Engine:
    """An engine whose connections go through the proxy. (A connection being opened just as the network
    goes silent waits for its connect timeout, which ``delayq worker`` sets too.)"""
    return make_engine(proxy.url_for(b.url) + "?connect_timeout=5", **kwargs)


def stall_after(
    engine: sa.Engine, proxy: FaultProxy, matches: Callable[[str], bool], thread: str | None = None
) -> threading.Event:
    """Make the proxy's connections go silent for good right after the first statement ``matches`` accepts
    ran on ``engine`` (in a thread named ``thread``, or one whose name starts with it); the event is set then."""
    stalled = threading.Event()

    def after(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if stalled.is_set() or not matches(statement):
            return
        if thread is not None and not threading.current_thread().name.startswith(thread):
            return
        proxy.stall_existing()
        stalled.set()

    sa.event.listen(engine, "after_cursor_execute", after)
    return stalled


def in_thread(name: str, fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn`` in a daemon thread; the list gets its result or exception."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except Exception as exc:
            outcome.append(exc)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, outcome


def test_a_batch_claim_behind_a_silent_network_frees_its_rows_and_its_thread(
    server: tuple[Backend, FaultProxy], queue_name: str
) -> None:
    """Row 14: the claim ran, its COMMIT never arrives. The server ends the claim's transaction after the
    idle bound (MariaDB kept it up to wait_timeout, 8 h), so another consumer gets every message, once;
    the frozen consumer's call fails after the call bound and its retry claims afresh (nothing: all taken)."""
    b, proxy = server
    frozen_engine = through(proxy, b)
    stalled = stall_after(frozen_engine, proxy, lambda s: "UPDATE" in s and "lock_token" in s, "frozen")
    frozen, other = DelayedQueue(frozen_engine, queue_name), DelayedQueue(b.engine, queue_name)
    keys = [f"k{i}" for i in range(5)]
    other.offer_many([(k, k, None) for k in keys])
    try:
        consumer, outcome = in_thread("frozen", lambda: [d.key for d in frozen.try_poll_many(5)])
        assert stalled.wait(10)
        got: list[str] = []
        deadline = time.monotonic() + DEADLINE
        while len(got) < len(keys) and time.monotonic() < deadline:
            for d in other.try_poll_many(5):
                got.append(d.key)
                assert d.ack()
            time.sleep(0.05)
        assert sorted(got) == keys, "the claimed messages did not continue elsewhere"
        consumer.join(DEADLINE)
        assert not consumer.is_alive(), "the frozen consumer's thread still waits for its COMMIT"
    finally:
        frozen_engine.dispose()
    assert outcome == [[]]  # its transaction was ended by the server: nothing claimed twice


def exclusive_fence(statement: str) -> bool:
    """A poll's fence: its lease row, locked FOR UPDATE (not a steal's SKIP LOCKED, not the shared one)."""
    return "topic_leases" in statement and "FOR UPDATE" in statement and "SKIP LOCKED" not in statement


def test_a_subscriber_frozen_in_its_fence_gives_its_partition_up_within_the_lease_and_the_bound(
    server: tuple[Backend, FaultProxy],
) -> None:
    """Row 2: a subscriber whose poll took its partition's exclusive fence goes silent. Its transaction ends
    on the server after the idle bound, so once the lease has run out (the injected clock moves it) another
    subscriber steals the partition and gets every message, once; the frozen subscriber's thread returns."""
    b, proxy = server
    topic_name = f"ib-{uuid.uuid4().hex[:12]}"
    clock = ManualClock(START)
    lease = dt.timedelta(seconds=2)
    frozen_engine = through(proxy, b)
    topic = Topic(b.engine, topic_name, clock=clock)
    topic.create(1)
    frozen = Subscription(frozen_engine, topic_name, "g", "frozen", clock=clock, lease_duration=lease)
    other = Subscription(b.engine, topic_name, "g", "other", clock=clock, lease_duration=lease)
    ids = [f"m{i}" for i in range(5)]
    got: Counter[str] = Counter()
    try:
        frozen.join()
        assert frozen.rebalance() == {0: 1}
        topic.publish_many([("k", m, i) for i, m in enumerate(ids)])
        stalled = stall_after(frozen_engine, proxy, exclusive_fence, "frozen")
        poller, _ = in_thread("frozen", lambda: frozen.poll(10))
        assert stalled.wait(10)
        clock.advance(lease * 2)  # the frozen subscriber's lease and heartbeat run out
        deadline = time.monotonic() + DEADLINE
        while len(got) < len(ids) and time.monotonic() < deadline:
            other.rebalance()
            for d in other.poll(10):
                got[d.message_id] += 1
                assert other.ack(d)
            time.sleep(0.05)
        assert sorted(got) == ids, "the partition did not continue elsewhere"
        poller.join(DEADLINE)
        assert not poller.is_alive(), "the frozen subscriber's thread still waits"
    finally:
        frozen_engine.dispose()
    assert set(got.values()) == {1}, got


@pytest.mark.parametrize("operation", ["requeue_dead", "purge_dead"])
def test_requeue_and_purge_of_dead_letters_wait_for_a_frozen_fence_only_for_the_bound(
    server: tuple[Backend, FaultProxy], operation: str
) -> None:
    """Row 2: ``requeue_dead`` / ``purge_dead`` lock the leases of the groups reading ``{topic}_dlq`` as a
    poll's fence does. A subscriber of the dead-letter topic frozen in its fence held them up for as long as
    its connection seemed alive; now for the idle bound. The requeued message then reaches its group once."""
    b, proxy = server
    topic_name = f"ib-{uuid.uuid4().hex[:12]}"
    clock = ManualClock(START)
    frozen_engine = through(proxy, b)
    topic = Topic(b.engine, topic_name, clock=clock)
    topic.create(1)
    sub = Subscription(b.engine, topic_name, "g", "sub", clock=clock)
    auditor = Subscription(frozen_engine, dead_letter_topic(topic_name), "audit", "frozen", clock=clock)
    try:
        sub.join()
        auditor.join()
        assert auditor.rebalance() == {0: 1} and sub.rebalance() == {0: 1}
        topic.publish("k", "m", 1)
        [first] = sub.poll(1)
        assert sub.fail(first, "gave up")  # a dead letter in the dead-letter topic's partition 0
        stalled = stall_after(frozen_engine, proxy, exclusive_fence, "frozen")
        poller, _ = in_thread("frozen", lambda: auditor.poll(10))
        assert stalled.wait(10)
        worker, done = in_thread("operator", lambda: getattr(topic, operation)(everything=True))
        worker.join(DEADLINE)
        assert done == [1], f"{operation} still waits for the frozen fence"
        poller.join(DEADLINE)
        assert not poller.is_alive(), "the frozen subscriber's thread still waits"
    finally:
        frozen_engine.dispose()
    again = [d.message_id for d in sub.poll(10)]
    assert again == (["m~requeue-1"] if operation == "requeue_dead" else []), again


@pytest.mark.parametrize("kind", ["threads", "asyncio"])
def test_a_transactional_handler_whose_commit_goes_silent_is_delivered_again(
    server: tuple[Backend, FaultProxy], queue_name: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Row 13: a transactional handler acked (its DELETE holds the message's row lock) and its COMMIT went
    into a silent connection. The server ends the handler's transaction once idle for the visibility
    timeout, the worker's thread gives the COMMIT up after the call bound (the stall timeout), and the
    message is delivered again and committed once, by another worker. The listener's test notification
    (PostgreSQL) does not keep a thread waiting either."""
    import delayq.dialects.postgresql as pg

    monkeypatch.setattr(pg, "LISTEN_PING_AFTER", 0.5)
    monkeypatch.setattr(pg, "LISTEN_PING_TIMEOUT", 1.0)
    b, proxy = server
    effects = sa.Table(
        f"ib_effects_{uuid.uuid4().hex[:10]}", sa.MetaData(), sa.Column("msg_key", sa.String(50), primary_key=True)
    )
    effects.create(b.engine)
    handled: list[tuple[str, str]] = []

    attrs: dict[str, Any] = {
        "transactional": True,
        "visibility_timeout": dt.timedelta(seconds=2),
        "retry": RetryPolicy.fixed(dt.timedelta(0)),
    }

    def write(delivery: Delivery, conn: Any) -> None:
        handled.append((delivery.key, threading.current_thread().name))
        conn.execute(sa.insert(effects).values(msg_key=delivery.key))

    class Write(Handler):
        queue = queue_name
        transactional = attrs["transactional"]
        visibility_timeout = attrs["visibility_timeout"]
        retry = attrs["retry"]

        def handle(self, delivery: Delivery, conn: Any = None) -> None:
            write(delivery, conn)

    frozen_engine = through(proxy, b, pool_size=8, max_overflow=2)
    options: dict[str, Any] = {
        "poll_interval": dt.timedelta(seconds=0.2),
        "stall_timeout": dt.timedelta(seconds=CALL_S),
    }
    frozen_driver = Driver(kind, Backend(b.name, proxy.url_for(b.url), frozen_engine))
    is_ack = lambda s: s.lstrip().upper().startswith("DELETE") and "lock_token" in s  # noqa: E731
    if kind == "asyncio":  # the handler's transaction is the AsyncEngine's, on the loop's thread
        frozen_driver.call(frozen_driver.async_engine.dispose())
        frozen_driver.async_engine = make_async_engine(proxy.url_for(b.url), pool_size=8, max_overflow=2)
        stalled = stall_after(frozen_driver.async_engine.sync_engine, proxy, is_ack)
        frozen = frozen_driver.worker([frozen_driver.queue_handler(queue_name, write, **attrs)], **options)
    else:
        stalled = stall_after(frozen_engine, proxy, is_ack, "delayq-handler")
        frozen = frozen_driver.worker([Write], **options)
    other = Worker(b.engine, [Write], **options)
    try:
        DelayedQueue(b.engine, queue_name).offer("job", 1)
        frozen.start()
        assert stalled.wait(10)
        other.start()
        wait_until(lambda: DelayedQueue(b.engine, queue_name).get("job") is None, "the job done again", DEADLINE)
        assert frozen.stop(DEADLINE), "the frozen worker still waits (for its handler's COMMIT?)"
        other.stop(DEADLINE)
        wait_until(
            lambda: not any(t.name == "delayq-listen-ping" and t.is_alive() for t in threading.enumerate()),
            "no listener's test notification left waiting",
            DEADLINE,
        )
        with b.engine.connect() as conn:
            assert list(conn.execute(sa.select(effects.c.msg_key)).scalars()) == ["job"]  # committed once
    finally:
        frozen.stop(1)
        other.stop(1)
        proxy.cut_all()  # (whatever still holds a lock on the table lets go)
        frozen_driver.close()
        frozen_engine.dispose()
        effects.drop(b.engine)
    assert len(handled) >= 2  # the frozen attempt, then the one that committed


def test_the_listeners_test_notification_gives_up_on_a_silent_connection(
    backend_urls: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row 13, the listener: its test notification goes through a pooled connection that went silent; the
    ``delayq-listen-ping`` thread gives up after the listener's patience instead of waiting for ever."""
    import delayq.dialects.postgresql as pg

    monkeypatch.setattr(pg, "LISTEN_PING_TIMEOUT", 1.0)
    b = _backend("postgresql", backend_urls)
    with FaultProxy.for_url(b.url) as proxy:
        engine = make_engine(proxy.url_for(b.url), pool_size=1, max_overflow=0)
        try:
            with engine.connect() as conn:  # the pool's one connection, about to go silent
                conn.execute(sa.text("SELECT 1"))
            proxy.stall_existing()
            dropped = bounds.dropped()
            ping = pg.PostgresDialect._ping(engine, "delayq-ib-probe", None)
            ping.join(DEADLINE)
            assert not ping.is_alive(), "the test notification still waits on a silent connection"
            assert bounds.dropped() > dropped
        finally:
            engine.dispose()


def test_sqlite_is_unaffected(backend_urls: dict[str, str], queue_name: str) -> None:
    """SQLite has no server to end a transaction: its transactions begin as before, and claims work."""
    b = _backend("sqlite", backend_urls)
    dialect = dialect_for(b.engine)
    for mode in ("read", "statement", "scan", "writes", "transaction", "ordered"):
        assert dialect.owned_start(mode, False, IDLE_S) == dialect.owned_start(mode, False, None)  # type: ignore[arg-type]
    queue = DelayedQueue(b.engine, queue_name)
    queue.offer_many([(f"k{i}", i, None) for i in range(3)])
    got = queue.try_poll_many(3)
    assert sorted(d.key for d in got) == ["k0", "k1", "k2"]
    assert queue.ack_many(got) == 3


def test_mariadb_leaves_the_applications_sessions_as_they_were(backend_urls: dict[str, str], queue_name: str) -> None:
    """MariaDB's idle bound is a session variable: delayq sets it once per pooled connection for its own
    transactions, and the application's next checkout of that connection finds its own value again."""
    b = _backend("mysql", backend_urls)
    if not b.engine.dialect.is_mariadb:  # type: ignore[attr-defined]
        pytest.skip("MySQL has no idle_transaction_timeout")
    engine = b.make_engine(pool_size=1, max_overflow=0)
    sets: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "@delayq_idle_transaction_timeout = COALESCE" in statement:
            sets.append(statement)

    sa.event.listen(engine, "after_cursor_execute", record)
    queue = DelayedQueue(engine, queue_name)
    current = sa.text("SELECT @@session.idle_transaction_timeout")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SET SESSION idle_transaction_timeout = 7")
        queue.try_poll_many(5)
        queue.try_poll_many(5)
        assert len(sets) == 1  # set once, kept for delayq's next transaction on the connection
        with engine.connect() as conn:
            assert conn.scalar(current) == 7  # the application's own value
        queue.try_poll_many(5)
        assert len(sets) == 2
        with queue.transaction() as conn:  # a handler's transaction: bounded by the visibility timeout
            assert conn.scalar(current) == 300
        with engine.connect() as conn:
            assert conn.scalar(current) == 7
    finally:
        engine.dispose()
