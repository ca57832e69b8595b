"""Publishing and joining where they meet other writers, and names compared byte for byte, on every backend.

- Keys, ids and names that differ only by trailing spaces are different rows (MariaDB's
  ``utf8mb4_bin`` pads with spaces: ``'m1' = 'm1 '``; the NO PAD collation of delayq_0005 does not).
- Transactional publishes of one partition, each the first write of its caller's transaction,
  racing each other: every one gets its own offset, in commit order (on SQLite the head used to be
  read before the write lock).
- A new group joins while a publisher's transaction is open (it used to wait for it).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, make_async_engine

from delayq import DelayedQueue, ManualClock, OfferOutcome
from delayq.aio import AsyncSubscription, AsyncTopic
from delayq.schema import make_tables
from delayq.topics import Subscription, Topic, dead_letter_topic

SECOND = dt.timedelta(seconds=1)
DEADLINE = 15.0
"""Seconds a bounded wait gives a thread that should finish at once."""


@pytest.fixture
def topic_name() -> str:
    return f"p-{uuid.uuid4().hex[:12]}"


def _log(engine: sa.Engine, topic: str) -> list[tuple[int, int, str, str]]:
    log = make_tables().topics.log
    query = sa.select(log.c.partition, log.c.message_offset, log.c.partition_key, log.c.message_id).where(
        log.c.topic == topic
    )
    with engine.connect() as conn:
        return sorted((int(p), int(o), k, m) for p, o, k, m in conn.execute(query))


def _drain(sub: Subscription) -> list[tuple[int, str, str]]:
    """Everything the subscriber gets, acked as it comes: (offset, partition key, message id)."""
    got: list[tuple[int, str, str]] = []
    sub.rebalance()
    while batch := sub.poll(100):
        got += [(d.offset, d.partition_key, d.message_id) for d in batch]
        assert all(sub.ack_many(batch))
    return got


# -- names compared byte for byte (issue 29, row 7) ----------------------------------------------------
def test_queue_keys_and_names_that_differ_by_trailing_spaces_are_distinct(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    queue = DelayedQueue(engine, queue_name, clock=clock)
    spaced = DelayedQueue(engine, queue_name + " ", clock=clock)
    at = clock.now()
    assert queue.offer("job", "plain", at) is OfferOutcome.CREATED
    assert queue.offer("job ", "spaced", at) is OfferOutcome.CREATED
    assert queue.offer("job  ", "two spaces", at) is OfferOutcome.CREATED
    assert spaced.offer("job", "other queue", at) is OfferOutcome.CREATED
    assert queue.offer("job ", "again", at) is OfferOutcome.IGNORED
    assert queue.offer_many([("job", "x", at), ("job ", "y", at), ("job   ", "three", at)]) == [
        OfferOutcome.IGNORED,
        OfferOutcome.IGNORED,
        OfferOutcome.CREATED,
    ]
    got = {k: m.payload for k in ("job", "job ", "job  ", "job   ") if (m := queue.get(k)) is not None}
    assert got == {"job": "plain", "job ": "spaced", "job  ": "two spaces", "job   ": "three"}
    assert spaced.get("job") is not None and spaced.get("job ") is None
    assert queue.cancel("job ") is True and queue.get("job") is not None and queue.get("job  ") is not None
    assert queue.cancel_prefix("job  ") == 2  # "job  " and "job   ", not "job"
    assert [m.key for m in [queue.get("job")] if m is not None] == ["job"]
    polled = queue.try_poll()
    assert polled is not None and polled.key == "job"
    polled.ack()
    assert queue.try_poll() is None
    assert spaced.cancel_prefix("job") == 1


def test_topic_ids_and_partition_keys_that_differ_by_trailing_spaces_are_distinct(
    engine: sa.Engine, topic_name: str, clock: ManualClock
) -> None:
    topic = Topic(engine, topic_name, clock=clock)
    topic.create(1)
    assert topic.publish("k", "m1", 1) is OfferOutcome.CREATED
    assert topic.publish("k", "m1 ", 2) is OfferOutcome.CREATED
    assert topic.publish("k ", "m1", 3) is OfferOutcome.CREATED
    assert topic.publish("k", "m1 ", 4) is OfferOutcome.IGNORED
    assert topic.publish_many([("k", "m2", 5), ("k", "m2 ", 6), ("k", "m1", 7)]) == [
        OfferOutcome.CREATED,
        OfferOutcome.CREATED,
        OfferOutcome.IGNORED,
    ]
    sub = Subscription(engine, topic_name, "g", "s", clock=clock, max_attempts=1)
    sub.rebalance()
    deliveries = sub.poll(10)
    assert [(d.partition_key, d.message_id, d.payload) for d in deliveries] == [
        ("k", "m1", 1),
        ("k", "m1 ", 2),
        ("k ", "m1", 3),
        ("k", "m2", 5),
        ("k", "m2 ", 6),
    ]
    # Dead letters of "m1" and "m1 " (ids "g:m1" and "g:m1 "): both kept, each found by its own id.
    assert deliveries[0].fail("first") and deliveries[1].fail("second")
    assert sub.ack_many(deliveries[2:]) == [True, True, True]
    assert [(d.message_id, d.last_error) for d in topic.dead_letters(message_id="m1")] == [("m1", "first")]
    assert [(d.message_id, d.last_error) for d in topic.dead_letters(message_id="m1 ")] == [("m1 ", "second")]
    assert topic.requeue_dead(message_id="m1 ") == 1
    again = sub.poll(10)
    assert [(d.message_id, d.payload) for d in again] == [("m1 ~requeue-2", 2)]
    assert [d.message_id for d in topic.dead_letters()] == ["m1"]
    assert len(_log(engine, dead_letter_topic(topic_name))) == 1


def test_subscribers_whose_names_differ_by_trailing_spaces_share_the_partitions(
    engine: sa.Engine, topic_name: str, clock: ManualClock
) -> None:
    Topic(engine, topic_name, clock=clock).create(4)
    subs = [Subscription(engine, topic_name, "g", name, clock=clock) for name in ("s", "s ")]
    for _ in range(3):
        held = [set(s.rebalance()) for s in subs]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == {0, 1, 2, 3}, held
    assert [len(h) for h in held] == [2, 2]


# -- transactional publishes of one partition racing (issue 29, row 10) ------------------------------
def test_concurrent_transactional_publishes_of_a_partition_all_get_offsets_in_commit_order(
    backend: Backend, engine: sa.Engine, topic_name: str
) -> None:
    topic = Topic(engine, topic_name)
    topic.create(1)
    threads, each = 4, 25
    start = threading.Barrier(threads)
    errors: list[BaseException] = []
    committed: list[str] = []  # the ids, in commit order
    order = threading.Lock()

    def publish(n: int) -> None:
        try:
            start.wait(timeout=DEADLINE)
            for i in range(each):
                mid = f"{n}-{i}"
                with engine.connect() as conn:
                    # The publish is the first write of the caller's transaction (pysqlite begins there).
                    assert topic.publish("k", mid, {"n": n, "i": i}, using=conn) is OfferOutcome.CREATED
                    with order:
                        conn.commit()
                        committed.append(mid)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=publish, args=(n,)) for n in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in workers)
    assert not errors, errors[:3]
    log = _log(engine, topic_name)
    assert [o for _, o, _, _ in log] == list(range(1, threads * each + 1))  # no gap, no duplicate
    by_offset = [m for _, _, _, m in log]
    assert by_offset == committed  # offsets follow commit order
    assert sorted(by_offset) == sorted(f"{n}-{i}" for n in range(threads) for i in range(each))
    sub = Subscription(engine, topic_name, "g", "s", max_attempts=None)
    assert [m for _, _, m in _drain(sub)] == by_offset  # nothing lost, nothing twice
    sub.close()


def test_concurrent_transactional_publishes_of_a_partition_from_coroutines(backend: Backend, topic_name: str) -> None:
    tasks, each = 4, 15
    committed: list[str] = []

    async def main() -> None:
        engine = make_async_engine(backend.url)
        try:
            topic = AsyncTopic(engine, topic_name)
            await topic.create(1)
            turn = asyncio.Lock()

            async def publish(n: int) -> None:
                for i in range(each):
                    async with engine.connect() as conn:
                        assert await topic.publish("k", f"{n}-{i}", i, using=conn) is OfferOutcome.CREATED
                        async with turn:
                            await conn.commit()
                            committed.append(f"{n}-{i}")

            await asyncio.wait_for(asyncio.gather(*(publish(n) for n in range(tasks))), 120)
        finally:
            await engine.dispose()

    asyncio.run(main())
    sa_engine = backend.engine
    log = _log(sa_engine, topic_name)
    assert [o for _, o, _, _ in log] == list(range(1, tasks * each + 1))
    assert [m for _, _, _, m in log] == committed
    sub = Subscription(sa_engine, topic_name, "g", "s", max_attempts=None)
    assert [m for _, _, m in _drain(sub)] == committed
    sub.close()


# -- a new group joins while a publisher's transaction is open (issue 29, row 11) ---------------------
@pytest.mark.parametrize("target", ["topic", "dead letters"])
@pytest.mark.parametrize("start", ["earliest", "latest"])
def test_a_new_group_joins_while_a_publisher_transaction_is_open(
    backend: Backend, engine: sa.Engine, topic_name: str, target: str, start: Any
) -> None:
    if backend.name == "sqlite":
        pytest.skip("SQLite has one writer at a time: a join's writes wait for any open write transaction")
    topic = Topic(engine, topic_name)
    topic.create(2)
    topic.publish_many([("a", "before-1", 1), ("b", "before-2", 2)])
    Subscription(engine, topic_name, "old", "s").join()  # the dead-letter topic exists
    open_publisher = Topic(engine, topic_name if target == "topic" else dead_letter_topic(topic_name))
    sub = Subscription(engine, topic_name, f"new-{start}", "s", start=start, max_attempts=3)
    joined = threading.Event()
    errors: list[BaseException] = []

    def join() -> None:
        try:
            sub.join()
            joined.set()
        except BaseException as exc:
            errors.append(exc)

    with engine.connect() as conn:
        # Both partitions' heads locked by an outbox transaction that stays open.
        open_publisher.publish_many([("a", "during-1", 3), ("b", "during-2", 4)], using=conn)
        joiner = threading.Thread(target=join)
        joiner.start()
        try:
            assert joined.wait(DEADLINE) or errors, "the join waited for the publisher's transaction"
            assert not errors, errors
        finally:
            conn.commit()
            joiner.join(timeout=120)
    topic.publish("a", "after", 5)
    got = {m for _, _, m in _drain(sub)}
    during = {"during-1", "during-2"} if target == "topic" else set()
    # Committed after the group was made: a "latest" group gets them too; "earliest" gets everything.
    expected = {"after"} | during | ({"before-1", "before-2"} if start == "earliest" else set())
    assert got == expected
    sub.close()


def test_an_async_group_joins_while_a_publisher_transaction_is_open(
    backend: Backend, engine: sa.Engine, topic_name: str
) -> None:
    if backend.name == "sqlite":
        pytest.skip("SQLite has one writer at a time: a join's writes wait for any open write transaction")
    topic = Topic(engine, topic_name)
    topic.create(1)

    async def join() -> None:
        aengine = make_async_engine(backend.url)
        try:
            await asyncio.wait_for(AsyncSubscription(aengine, topic_name, "new", "s").join(), DEADLINE)
        finally:
            await aengine.dispose()

    with engine.connect() as conn:
        topic.publish("k", "during", 1, using=conn)
        try:
            asyncio.run(join())
        finally:
            conn.commit()
    assert [m for _, _, m in _drain(Subscription(engine, topic_name, "new", "s"))] == ["during"]


def test_a_join_in_the_callers_transaction_takes_effect_with_it(
    engine: sa.Engine, topic_name: str, clock: ManualClock
) -> None:
    topic = Topic(engine, topic_name, clock=clock)
    topic.create(2)
    topic.publish("a", "m", 1)
    sub = Subscription(engine, topic_name, "g", "s", clock=clock)
    with engine.connect() as conn:
        sub.join(using=conn)
        conn.rollback()
    assert "g" not in {r for r in _groups(engine, topic_name)}
    with engine.connect() as conn:
        sub.join(using=conn)
        conn.commit()
    assert _groups(engine, topic_name) == ["g", "g"]
    assert [m for _, _, m in _drain(sub)] == ["m"]


def _groups(engine: sa.Engine, topic: str) -> list[str]:
    off = make_tables().topics.offsets
    with engine.connect() as conn:
        return list(conn.execute(sa.select(off.c.consumer_group).where(off.c.topic == topic)).scalars())


def test_garbage_collection_waits_for_a_group_being_created_and_keeps_what_it_reads(
    engine: sa.Engine, topic_name: str
) -> None:
    # A group created from "earliest" starts at the collected offset: a collection running meanwhile
    # must either wait for its watermarks or be seen by it, never delete what it is about to read.
    topic = Topic(engine, topic_name)
    topic.create(1)
    topic.publish_many([("k", f"m{i}", i) for i in range(3)])
    old = Subscription(engine, topic_name, "old", "s", max_attempts=None)
    assert len(_drain(old)) == 3
    new = Subscription(engine, topic_name, "new", "s", max_attempts=None)
    collected: list[int] = []
    errors: list[BaseException] = []

    def collect() -> None:
        try:
            collected.append(topic.collect_garbage())
        except BaseException as exc:
            errors.append(exc)

    with engine.connect() as conn:
        new.join(using=conn)  # the group's rows, not committed yet
        collector = threading.Thread(target=collect)
        collector.start()
        try:
            collector.join(timeout=1.0)  # (it must still wait: the assertion cannot fail when it is right)
            assert collector.is_alive() and not collected, (collected, errors)
        finally:
            conn.commit()
            collector.join(timeout=120)
    assert not errors, errors
    assert collected == [0]  # the new group's watermark holds the log
    assert [m for _, _, m in _drain(new)] == ["m0", "m1", "m2"]
    old.close()
    new.close()


def test_a_spark_read_by_message_id_finds_that_id_only(engine: sa.Engine, backend: Backend, topic_name: str) -> None:
    # The filter is pushed to the database (names compare byte for byte there), so its collation decides.
    # (Spark versions whose planner reuses a read's pushdown get DelayqReader, which pushes nothing; the
    # pushdown reader is what the others get.)
    pytest.importorskip("pyspark")
    from pyspark.sql.datasource import EqualTo

    from delayq.spark.options import SourceOptions
    from delayq.spark.read import LOG_SCHEMA, PushdownReader

    topic = Topic(engine, topic_name)
    topic.create(1)
    topic.publish_many([("k", "m1", 1), ("k", "m1 ", 2), ("k ", "m1", 3)])
    reader = PushdownReader(SourceOptions.parse({"url": backend.url, "topic": topic_name}), LOG_SCHEMA)
    assert list(reader.pushFilters([EqualTo(("message_id",), "m1 ")])) == []  # pushed whole
    rows = [r for part in reader.partitions() for batch in reader.read(part) for r in batch.to_pylist()]
    assert [(r["partition_key"], r["message_id"]) for r in rows] == [("k", "m1 ")]


def test_a_publish_of_an_id_committed_while_it_waited_is_ignored_and_leaves_no_gap(
    backend: Backend, topic_name: str
) -> None:
    # A single publish of delayq's own looks the id up inside its head's UPDATE (PostgreSQL: one statement;
    # MariaDB: the UPDATE, then the INSERT at the head). A lookup that read from before its wait misses the
    # id the transaction it waited for committed: its INSERT fails the unique constraint, and it publishes
    # again the general way, which sees it (IGNORED), its head move undone with it.
    if backend.name == "sqlite":
        pytest.skip("SQLite has one writer: a publisher's open transaction stops every other write")
    engine = backend.engine
    topic = Topic(engine, topic_name)
    topic.create(1)
    outcomes: list[OfferOutcome] = []
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            outcomes.append(topic.publish("k", "x", 2))
        except BaseException as exc:
            errors.append(exc)

    with engine.connect() as conn:
        assert topic.publish("k", "x", 1, using=conn) is OfferOutcome.CREATED  # holds the partition's head
        waiting = threading.Thread(target=publish)
        waiting.start()
        try:
            waiting.join(timeout=1.0)  # (it must still wait: the assertion cannot fail when it is right)
            assert waiting.is_alive() and not outcomes, (outcomes, errors)
        finally:
            conn.commit()
            waiting.join(timeout=DEADLINE)
    assert not errors, errors
    assert outcomes == [OfferOutcome.IGNORED]
    assert topic.publish("k", "y", 3) is OfferOutcome.CREATED
    assert _log(engine, topic_name) == [(0, 1, "k", "x"), (0, 2, "k", "y")]
