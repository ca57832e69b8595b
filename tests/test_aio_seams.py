"""Where asyncio meets retries and cancellation: a poll never drops what it committed, a cancelled
claim is never left locked, and misuse of the sync and async APIs gets an error naming the right class."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import START, Backend, _backend, make_async_engine, make_engine
from faults import FaultProxy

from delayq import Handler, ManualClock, Subscription, Topic
from delayq.aio import AsyncSubscription
from delayq.topics import TopicDelivery
from delayq.topics.names import partition_for
from delayq.transactions import TransientRetry

NO_RETRY = TransientRetry(attempts=1)
"""The sync runner's retries spent at once: a killed connection fails the partition's transaction."""


# -- helpers -------------------------------------------------------------------------------------
def server_ids(engine: sa.Engine, name: str) -> None:
    """Remember each new connection's server-side id in its pool record's ``info`` (``Connection.info``)."""
    query = "SELECT pg_backend_pid()" if name == "postgresql" else "SELECT CONNECTION_ID()"

    @sa.event.listens_for(engine, "connect")
    def remember(dbapi_conn: Any, record: Any) -> None:
        # psycopg: in autocommit, as SQLAlchemy's docs write connect handlers (a query that began a
        # transaction would leave the new connection in it, and psycopg then refuses to switch autocommit).
        pg = name == "postgresql"
        autocommit = pg and dbapi_conn.autocommit
        if pg:
            dbapi_conn.autocommit = True
        cursor = dbapi_conn.cursor()
        cursor.execute(query)
        record.info["server_id"] = int(cursor.fetchone()[0])
        cursor.close()
        if pg:
            dbapi_conn.autocommit = autocommit


def kill(admin: sa.Engine, name: str, server_id: int) -> None:
    """End a server session from another connection: ``pg_terminate_backend`` / MariaDB ``KILL``."""
    with admin.connect() as conn:
        if name == "postgresql":
            conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": server_id})
        else:
            conn.exec_driver_sql(f"KILL {int(server_id)}")
        conn.commit()


def at_second_partition(engine: sa.Engine, act: Callable[[sa.Connection], None]) -> None:
    """Call ``act(conn)`` once, just before the second range move of ``engine``'s polls (the UPDATE of
    ``topic_offsets`` that sets ``delivered_offset``): inside the transaction of the second partition a poll
    visits, after the first partition's committed. The subscriptions of these tests poll one partition per
    transaction (``one_partition_per_batch``); a poll's batch of partitions is otherwise one transaction."""
    seen = 0

    @sa.event.listens_for(engine, "before_cursor_execute")
    def before(conn: sa.Connection, cursor: Any, statement: str, *_: Any) -> None:
        nonlocal seen
        # (an UPDATE that sets it; on PostgreSQL the log read's WITH holds it: one statement reads and moves)
        if "topic_offsets SET delivered_offset" in statement:
            seen += 1
            if seen == 2:
                act(conn)


def one_partition_per_batch(sub: Subscription | AsyncSubscription) -> None:
    """Poll one partition per transaction (a batch of one), as these tests' faults need."""
    (sub.sync if isinstance(sub, AsyncSubscription) else sub)._batch_limit = 1


def two_partition_topic(engine: sa.Engine, per_partition: int = 3) -> tuple[str, list[str]]:
    """A 2-partition topic with ``per_partition`` messages in each; its name and the message ids."""
    name = f"seam-{uuid.uuid4().hex[:12]}"
    Topic(engine, name).create(2)
    keys = {partition_for(f"k{i}", 2): f"k{i}" for i in range(50)}
    items = [(keys[p], f"{p}-{i}", {"p": p, "i": i}) for p in (0, 1) for i in range(per_partition)]
    Topic(engine, name).publish_many(items)
    return name, [mid for _, mid, _ in items]


def check_history(delivered: Counter[str], published: list[str]) -> None:
    """Every published message delivered exactly once (the clock never moved: no visibility timeout passed)."""
    assert sorted(delivered) == sorted(published), f"lost: {sorted(set(published) - set(delivered))}"
    assert set(delivered.values()) == {1}, f"delivered twice: {[m for m, n in delivered.items() if n > 1]}"


@pytest.fixture
def server(request: pytest.FixtureRequest, backend_urls: dict[str, str]) -> Backend:
    """Each backend with a server (conftest's ``pytest_generate_tests``: asyncpg's too, for the async API)."""
    return _backend(request.param, backend_urls)


# -- issue 29 row 4: a poll never drops what earlier partitions committed --------------------------
def test_a_sync_poll_returns_the_first_partitions_deliveries_when_the_second_partitions_connection_is_killed(
    server: Backend,
) -> None:
    name, published = two_partition_topic(server.engine)
    victim = make_engine(server.url)
    server_ids(victim, server.name)
    at_second_partition(victim, lambda conn: kill(server.engine, server.name, conn.info["server_id"]))
    clock = ManualClock(START)
    sub = Subscription(victim, name, "g", "s1", clock=clock, transient_retry=NO_RETRY)
    one_partition_per_batch(sub)
    delivered: Counter[str] = Counter()
    errors = 0
    try:
        sub.rebalance()
        for _ in range(6):
            try:
                got = sub.poll(10)
            except sa.exc.OperationalError:  # the killed partition's transaction, when nothing came before it
                errors += 1
                continue
            delivered.update(d.message_id for d in got)
            assert all(sub.ack(d) for d in got)
        check_history(delivered, published)
        assert errors == 0  # the killed partition came second: the poll returned the first one's deliveries
    finally:
        victim.dispose()


def test_an_async_poll_retries_only_the_partition_whose_connection_was_killed(server: Backend) -> None:
    name, published = two_partition_topic(server.engine)

    async def main() -> Counter[str]:
        engine = make_async_engine(server.url)
        server_ids(engine.sync_engine, server.name)
        at_second_partition(engine.sync_engine, lambda conn: kill(server.engine, server.name, conn.info["server_id"]))
        sub = AsyncSubscription(engine, name, "g", "s1", clock=ManualClock(START))
        one_partition_per_batch(sub)
        delivered: Counter[str] = Counter()
        try:
            await sub.rebalance()
            first = await sub.poll(10)
            assert len(first) == 6  # both partitions in the one poll: the killed one retried alone
            for _ in range(3):
                got = first or await sub.poll(10)
                first = []
                delivered.update(d.message_id for d in got)
                assert await sub.ack_many(got) == [True] * len(got)
        finally:
            await engine.dispose()
        return delivered

    check_history(asyncio.run(main()), published)


def test_a_poll_cancelled_in_its_second_partition_hands_both_partitions_to_the_next_poll(backend: Backend) -> None:
    name, published = two_partition_topic(backend.engine)

    async def main() -> Counter[str]:
        engine = make_async_engine(backend.url)
        polling: list[asyncio.Task[list[TopicDelivery]]] = []
        at_second_partition(engine.sync_engine, lambda _: polling[0].cancel())
        sub = AsyncSubscription(engine, name, "g", "s1", clock=ManualClock(START))
        one_partition_per_batch(sub)
        delivered: Counter[str] = Counter()
        try:
            await sub.rebalance()
            polling.append(asyncio.create_task(sub.poll(10)))
            await asyncio.wait(polling)
            assert polling[0].cancelled()
            for _ in range(4):
                got = await sub.poll(10)
                delivered.update(d.message_id for d in got)
                assert await sub.ack_many(got) == [True] * len(got)
        finally:
            await engine.dispose()
        return delivered

    check_history(asyncio.run(main()), published)


def test_a_poll_timed_out_by_wait_for_while_its_second_partition_waits_on_the_network_loses_nothing(
    server: Backend,
) -> None:
    name, published = two_partition_topic(server.engine)

    async def main(proxy: FaultProxy) -> Counter[str]:
        engine = make_async_engine(proxy.url_for(server.url))
        at_second_partition(engine.sync_engine, lambda _: proxy.black_hole(1.0))  # the reply held 1 s
        sub = AsyncSubscription(engine, name, "g", "s1", clock=ManualClock(START))
        one_partition_per_batch(sub)
        delivered: Counter[str] = Counter()
        try:
            await sub.rebalance()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sub.poll(10), 0.2)
            for _ in range(4):
                got = await sub.poll(10)
                delivered.update(d.message_id for d in got)
                assert await sub.ack_many(got) == [True] * len(got)
        finally:
            await engine.dispose()
        return delivered

    with FaultProxy.for_url(server.url) as proxy:
        check_history(asyncio.run(main(proxy)), published)


def test_a_poll_in_the_callers_transaction_raises_and_the_callers_rollback_undoes_it(backend: Backend) -> None:
    name, published = two_partition_topic(backend.engine)
    engine = make_engine(backend.url)

    def fail(_: sa.Connection) -> None:
        raise RuntimeError("the second partition failed")

    at_second_partition(engine, fail)
    sub = Subscription(engine, name, "g", "s1", clock=ManualClock(START))
    one_partition_per_batch(sub)
    try:
        sub.rebalance()
        with engine.connect() as conn:
            with pytest.raises(RuntimeError, match="second partition"):
                sub.poll(10, using=conn)  # the caller owns the transaction: no partial result, the error
            conn.rollback()
        got = sub.poll(10)
        assert sorted(d.message_id for d in got) == sorted(published)
    finally:
        engine.dispose()


# -- issue 29 row 5: a claim cancelled (or failed) while its COMMIT reply is in flight is given back -
COMMIT = {
    "postgresql": b"Q\x00\x00\x00\x0bCOMMIT\x00",
    "mysql": b"\x03COMMIT",
    "asyncpg": b"Q\x00\x00\x00\x0cCOMMIT;\x00",
}
"""The COMMIT as each driver sends it (a bare "COMMIT" also matches "READ COMMITTED"); asyncpg's its own."""


def commit_of(server: Backend) -> bytes:
    """``COMMIT`` for the server's driver (asyncpg's where the backend's URL names it)."""
    return COMMIT["asyncpg" if sa.make_url(server.url).get_driver_name() == "asyncpg" else server.name]


async def until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """A bounded poll: fail (not hang) when ``condition`` stays false; asserts nothing about timing."""
    deadline = asyncio.get_running_loop().time() + limit
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        await asyncio.sleep(0.01)


def at_first_claim(engine: sa.Engine, arm: Callable[[], None]) -> None:
    """Call ``arm()`` when ``engine`` first sends a claim's statement (before that claim's COMMIT)."""
    armed = False

    @sa.event.listens_for(engine, "before_cursor_execute")
    def before(conn: sa.Connection, cursor: Any, statement: str, *_: Any) -> None:
        nonlocal armed
        if not armed and "SKIP LOCKED" in statement and "delayq_messages" in statement:
            armed = True
            arm()


@pytest.mark.parametrize("cancel", ["run", "stall_timeout", "reply_cut"])
def test_a_claim_cancelled_while_its_commit_reply_is_in_flight_is_given_back_at_once(
    server: Backend, cancel: str
) -> None:
    from delayq import DelayedQueue
    from delayq.aio import AsyncDelivery, AsyncHandler, AsyncWorker

    queue_name = f"seam-{uuid.uuid4().hex[:12]}"
    direct = DelayedQueue(server.engine, queue_name)  # the database's clock: a 5 min visibility timeout
    direct.offer("m", {"n": 1})
    runs: Counter[tuple[str, int]] = Counter()

    class Record(AsyncHandler):
        queue = queue_name

        async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:
            runs[delivery.key, delivery.attempts] += 1

    # An idle worker's first claim on PostgreSQL is a claim of one, one autocommitted statement: its reply is
    # the COMMIT's. Elsewhere the claim is a transaction ended by COMMIT.
    last = b"SKIP LOCKED" if server.name == "postgresql" else commit_of(server)

    async def main(proxy: FaultProxy) -> None:
        engine = make_async_engine(proxy.url_for(server.url))
        if cancel == "reply_cut":  # not a cancellation: the claim fails after the server committed it
            at_first_claim(engine.sync_engine, lambda: proxy.cut_after(last))
        else:  # the server committed it, the worker waits for the reply meanwhile
            at_first_claim(engine.sync_engine, lambda: proxy.hold_reply_after(last, 2.0))
        stall = dt.timedelta(seconds=0.5 if cancel == "stall_timeout" else 60)
        worker = AsyncWorker(
            engine, [Record], poll_interval=dt.timedelta(milliseconds=20), listen=False, stall_timeout=stall
        )
        running = asyncio.create_task(worker.run())
        try:
            await until(lambda: proxy.stats.holding + proxy.stats.cuts > 0, "the claim's COMMIT reply held or cut")
            if cancel == "run":
                running.cancel()
                await asyncio.wait([running])
                message = direct.get("m")
                assert message is not None and not message.locked and message.attempts == 0
                assert not runs
                again = direct.try_poll()  # due at once: no visibility timeout to wait for
                assert again is not None and again.attempts == 1 and again.ack()
            else:  # the claim was given up (stall timeout) or failed: the worker claims it again, its first attempt
                await until(lambda: bool(runs), "the handler")
                assert await worker.stop()
                assert runs == {("m", 1): 1}
        finally:
            running.cancel()
            await asyncio.wait([running])
            await engine.dispose()

    with FaultProxy.for_url(server.url) as proxy:
        asyncio.run(main(proxy))


@pytest.mark.parametrize("limit", [1, 3])
def test_a_try_poll_timed_out_while_its_commit_reply_is_in_flight_gives_the_message_back(
    server: Backend, limit: int
) -> None:
    from delayq import DelayedQueue
    from delayq.aio import AsyncDelayedQueue

    queue_name = f"seam-{uuid.uuid4().hex[:12]}"
    direct = DelayedQueue(server.engine, queue_name)  # the database's clock: a 5 min visibility timeout
    direct.offer("m", {"n": 1})

    def given_back() -> bool:
        message = direct.get("m")
        assert message is not None
        return not message.locked and message.attempts == 0

    async def main(proxy: FaultProxy) -> None:
        engine = make_async_engine(proxy.url_for(server.url))
        # PostgreSQL claims one message in one autocommitted statement: its reply is the COMMIT's.
        last = b"SKIP LOCKED" if server.name == "postgresql" and limit == 1 else commit_of(server)
        at_first_claim(engine.sync_engine, lambda: proxy.hold_reply_after(last, 2.0))
        queue = AsyncDelayedQueue(engine, queue_name)
        try:
            await queue.next_due()  # connected: the claim goes out at once
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(queue.try_poll_many(limit), 0.5)
            assert proxy.stats.held == 1  # the claim committed, and its reply was held
            await until(lambda: proxy.stats.holding == 0, "the held reply delivered")
            await until(given_back, "the cancelled claim's message given back")
            again = await queue.try_poll()  # due at once: no visibility timeout to wait for
            assert again is not None and again.attempts == 1 and await again.ack()
        finally:
            await engine.dispose()

    with FaultProxy.for_url(server.url) as proxy:
        asyncio.run(main(proxy))


# -- issue 29 row 12: misuse of the sync and async APIs names the class to use ------------------------
def test_a_delivery_of_an_async_subscription_refuses_its_own_blocking_methods(backend: Backend) -> None:
    from delayq.errors import WrongApiError

    name, published = two_partition_topic(backend.engine, per_partition=1)

    async def main() -> None:
        engine = make_async_engine(backend.url)
        sub = AsyncSubscription(engine, name, "g", "s1", clock=ManualClock(START))
        one_partition_per_batch(sub)
        try:
            await sub.rebalance()
            got = await sub.poll(10)
            assert sorted(d.message_id for d in got) == sorted(published)
            for call in (
                lambda d: d.ack(),
                lambda d: d.nack(),
                lambda d: d.fail("x"),
                lambda d: d.extend(dt.timedelta(seconds=1)),
            ):
                with pytest.raises(WrongApiError, match=r"`await sub\.ack\(delivery\)` \(or nack, extend, fail\)"):
                    call(got[0])
            assert await sub.ack_many(got) == [True, True]  # nothing was written by the refused calls
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_each_class_refuses_the_other_apis_engine_naming_its_twin(backend: Backend) -> None:
    from delayq import CronService, DelayedQueue, Worker
    from delayq.aio import AsyncDelayedQueue, AsyncHandler, AsyncTopic, AsyncWorker
    from delayq.errors import WrongApiError

    class Sync(Handler):
        queue = "q"

        def handle(self, delivery: Any, conn: Any = None) -> None:
            pass

    class Async(AsyncHandler):
        queue = "q"

    async def main() -> None:
        engine = make_async_engine(backend.url)
        try:
            for build, twin in (
                (lambda: DelayedQueue(engine, "q"), "delayq.aio.AsyncDelayedQueue"),
                (lambda: Topic(engine, "t"), "delayq.aio.AsyncTopic"),
                (lambda: Subscription(engine, "t", "g", "s"), "delayq.aio.AsyncSubscription"),
                (lambda: Worker(engine, [Sync]), "delayq.aio.AsyncWorker"),
                (lambda: CronService(AsyncDelayedQueue(engine, "q")), "delayq.DelayedQueue"),  # it runs a thread
                (lambda: AsyncDelayedQueue(backend.engine, "q"), "delayq.DelayedQueue"),
                (lambda: AsyncTopic(backend.engine, "t"), "delayq.Topic"),
                (lambda: AsyncSubscription(backend.engine, "t", "g", "s"), "delayq.Subscription"),
                (lambda: AsyncWorker(backend.engine, [Async]), "delayq.Worker"),
            ):
                with pytest.raises(WrongApiError) as refused:
                    build()
                assert twin + "(" in str(refused.value), str(refused.value)
                assert isinstance(refused.value, TypeError)  # what these errors were before
                wrong = {"delayq.aio.AsyncDelayedQueue(", "delayq.DelayedQueue("} - {twin + "("}  # the old messages
                assert not any(w in str(refused.value) for w in wrong), str(refused.value)
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_each_operation_refuses_the_other_apis_transaction_naming_its_twin(backend: Backend) -> None:
    from delayq.aio import AsyncTopic
    from delayq.errors import WrongApiError

    name, _ = two_partition_topic(backend.engine, per_partition=1)

    async def main() -> None:
        engine = make_async_engine(backend.url)
        try:
            async with engine.connect() as aconn:
                with pytest.raises(WrongApiError, match=r"delayq\.aio\.AsyncTopic"):
                    Topic(backend.engine, name).publish("k", "m", 1, using=aconn)
            with backend.engine.connect() as conn, pytest.raises(WrongApiError, match=r"delayq\.Topic\b"):
                await AsyncTopic(engine, name).publish("k", "m", 1, using=conn)  # type: ignore[arg-type]
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_the_sync_delivery_inside_an_async_delivery_refuses_to_block(backend: Backend) -> None:
    from delayq.aio import AsyncDelayedQueue
    from delayq.errors import WrongApiError

    async def main() -> None:
        engine = make_async_engine(backend.url)
        queue = AsyncDelayedQueue(engine, f"seam-{uuid.uuid4().hex[:12]}")
        try:
            await queue.offer("m", 1)
            got = await queue.try_poll()
            assert got is not None
            with pytest.raises(WrongApiError, match=r"await delivery\.ack\(\)"):
                got.delivery.ack()
            assert await got.ack()  # nothing was written by the refused call
        finally:
            await engine.dispose()

    asyncio.run(main())
