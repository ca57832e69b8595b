"""Where topic features meet (issue 29): dead letters, garbage collection and republished ids, groups that
go and come back, names too long for a dead letter of a dead letter, dropping a group, and requeues
beside Spark groups. Every test runs on every backend and checks a history: each message published is
acked or dead-lettered exactly once per group, none lost."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, make_async_engine, make_engine
from faults import FaultProxy, hold_row_lock

from delayq import InvalidInputError, ManualClock, OfferOutcome
from delayq.aio import AsyncSubscription, AsyncTopic
from delayq.schema import MAX_LOG_ID_LENGTH, make_tables
from delayq.serializers import JsonSerializer, TextSerializer
from delayq.topics import (
    Subscription,
    Topic,
    TopicDeadLetter,
    TopicDelivery,
    dead_letter_topic,
    group_lag,
    list_topics,
)

SECOND = dt.timedelta(seconds=1)


@pytest.fixture
def topic_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_topic(engine: sa.Engine, topic_name: str, clock: ManualClock) -> Callable[..., Topic]:
    def make(partitions: int = 1, name: str | None = None) -> Topic:
        topic = Topic(engine, name or topic_name, clock=clock)
        topic.create(partitions)
        return topic

    return make


@pytest.fixture
def make_sub(engine: sa.Engine, topic_name: str, clock: ManualClock) -> Callable[..., Subscription]:
    def make(group: str = "g", name: str = "s1", **kwargs: Any) -> Subscription:
        kwargs.setdefault("lease_duration", 30 * SECOND)
        kwargs.setdefault("visibility_timeout", 60 * SECOND)
        sub = Subscription(engine, kwargs.pop("topic", topic_name), group, name, clock=clock, **kwargs)
        sub.rebalance()
        return sub

    return make


def rows(engine: sa.Engine, table: str, topic: str, group: str | None = None) -> int:
    t = getattr(make_tables().topics, table)
    where = [t.c.topic == topic]
    if group is not None:
        where.append(t.c.consumer_group == group)
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(t).where(*where)).scalar_one())


def dead_ids(engine: sa.Engine, topic: str) -> list[str]:
    log = make_tables().topics.log
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(log.c.message_id)
                .where(log.c.topic == dead_letter_topic(topic))
                .order_by(log.c.message_offset)
            ).scalars()
        )


def give_up(how: str, sub: Subscription, clock: ManualClock, d: TopicDelivery) -> None:
    """Make ``sub``'s group give up on ``d`` (its only attempt): by ``fail``, by a nack of its last
    attempt, or by a poll that finds it timed out after its last attempt."""
    if how == "fail":
        assert d.fail("bad order")
    elif how == "nack":
        assert d.nack(error="bad order")
    else:
        clock.advance(120 * SECOND)  # past the visibility timeout
        assert sub.poll(10) == []  # the poll dead-letters it


# -- row 1: a republished id's dead letter lands -----------------------------------------------------------
@pytest.mark.parametrize("how", ["fail", "nack", "timeout"])
def test_a_republished_id_failed_again_is_dead_lettered_again(
    make_topic: Callable[..., Topic],
    make_sub: Callable[..., Subscription],
    clock: ManualClock,
    engine: sa.Engine,
    how: str,
) -> None:
    topic = make_topic(1)
    sub = make_sub("billing", max_attempts=1)
    history: dict[int, list[str]] = {}  # original offset -> what became of it for billing

    for round_ in range(3):
        assert topic.publish("k", "order-1", {"round": round_}) is OfferOutcome.CREATED
        [d] = sub.poll(10)
        assert d.payload == {"round": round_}
        give_up(how, sub, clock, d)
        history.setdefault(d.offset, []).append("dead")
        sub.advance_watermarks()
        assert topic.collect_garbage() == 1  # so the id can be published again

    dead = topic.dead_letters(group="billing")
    assert sorted(dl.original_offset for dl in dead) == sorted(history)  # each failure landed once
    assert all(v == ["dead"] for v in history.values())
    assert {dl.message_id for dl in dead} == {"order-1"}
    assert sorted(dl.payload["round"] for dl in dead) == [0, 1, 2]
    assert len(set(dead_ids(engine, topic.name))) == 3
    assert len(topic.dead_letters(group="billing", message_id="order-1")) == 3
    # Each is requeued on its own, under an id of its own, and delivered to billing again.
    assert topic.requeue_dead(group="billing", message_id="order-1") == 3
    sub.advance_watermarks()
    again = sub.poll(10)
    assert sorted(d.payload["round"] for d in again) == [0, 1, 2]
    assert len({d.message_id for d in again}) == 3


def test_a_dead_letter_of_a_long_id_republished_fits_its_column(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], clock: ManualClock, engine: sa.Engine
) -> None:
    topic = make_topic(1)
    group, mid = "g" * 100, "m" * 200
    sub = make_sub(group, max_attempts=1)
    for _ in range(2):
        assert topic.publish("k", mid, 1) is OfferOutcome.CREATED
        [d] = sub.poll(10)
        assert d.fail("no")
        sub.advance_watermarks()
        topic.collect_garbage()
    ids = dead_ids(engine, topic.name)
    assert len(set(ids)) == 2 and all(len(i) <= MAX_LOG_ID_LENGTH for i in ids)
    assert len(topic.dead_letters(group=group, message_id=mid)) == 2


def test_a_group_dropped_and_created_again_that_gives_up_again_finds_its_dead_letter_there(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine
) -> None:
    topic = make_topic(1)
    topic.publish("k", "order-1", 1)
    for incarnation in range(3):  # the message stays in the log: each incarnation gets it from the start
        sub = make_sub("billing", name=f"s{incarnation}", max_attempts=1)
        [d] = sub.poll(10)
        assert (d.offset, d.attempts) == (1, 1)
        assert d.fail(f"incarnation {incarnation}")
        assert sub.advance_watermarks() == {0: 1}
        sub.close()
        assert topic.drop_group("billing")
    assert dead_ids(engine, topic.name) == ["billing:order-1", "billing:order-1~dead-1"]  # the third found them
    assert [dl.message_id for dl in topic.dead_letters(message_id="order-1")] == ["order-1", "order-1"]


# -- row 8: a group created again starts clean -------------------------------------------------------------
def _delete_offsets(engine: sa.Engine, topic: str, group: str) -> None:
    off = make_tables().topics.offsets
    with engine.begin() as conn:
        conn.execute(sa.delete(off).where(off.c.topic == topic, off.c.consumer_group == group))


@pytest.mark.parametrize("how", ["offsets deleted", "drop_group"])
def test_a_group_created_again_inherits_no_delivery_state(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine, how: str
) -> None:
    topic = make_topic(1)
    topic.publish_many([("k", f"m{i}", i) for i in range(4)])
    old = make_sub("g", max_attempts=3)
    got = old.poll(10)
    assert [d.payload for d in got] == [0, 1, 2, 3]
    assert got[1].ack() and got[2].nack(dt.timedelta(hours=1), "later")  # acked and waiting above the watermark
    old.close()
    if how == "drop_group":
        assert topic.drop_group("g")
    else:
        _delete_offsets(engine, topic.name, "g")

    new = make_sub("g", name="s2", max_attempts=3)  # the group again, from the oldest retained message
    again = new.poll(10)
    assert [(d.payload, d.attempts) for d in again] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert new.ack_many(again) == [True] * 4
    assert new.advance_watermarks() == {0: 4}


# -- row 9: names that do not fit, and a poll never wedged on one message -----------------------------------
def test_a_dead_letter_of_a_dead_letter_with_long_names_fits(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], clock: ManualClock, engine: sa.Engine
) -> None:
    topic = make_topic(1)
    first, second = "a" * 60, "b" * 60  # 60 + 60 > 99: g2:g1:id would not fit the id column
    mid = "m" * 200
    topic.publish("k", mid, "x")
    sub = make_sub(first, max_attempts=1)
    [d] = sub.poll(10)
    assert d.fail("first")
    dlq = dead_letter_topic(topic.name)
    audit = make_sub(second, topic=dlq, max_attempts=1)
    [dd] = audit.poll(10)
    assert dd.message_id == f"{first}:{mid}"
    assert dd.fail("second")  # was: DataError (PostgreSQL, MariaDB), or an id longer than its column (SQLite)
    ids = dead_ids(engine, dlq)
    assert len(ids) == 1 and len(ids[0]) <= MAX_LOG_ID_LENGTH and ids[0].startswith(f"{second}:")
    [letter] = Topic(engine, dlq, clock=clock).dead_letters()
    assert (letter.group, letter.original_topic, letter.original_offset) == (second, dlq, dd.offset)


def test_a_poll_that_dead_letters_a_message_with_a_long_id_is_not_wedged(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], clock: ManualClock, engine: sa.Engine
) -> None:
    topic = make_topic(1)
    first, second = "a" * 60, "b" * 60
    topic.publish_many([("k", "m" * 200, "x"), ("k", "short", "y")])
    sub = make_sub(first, max_attempts=1)
    assert all(d.fail("first") for d in sub.poll(10))
    audit = make_sub(second, topic=dead_letter_topic(topic.name), max_attempts=1)
    assert len(audit.poll(10)) == 2
    clock.advance(120 * SECOND)  # both time out after their last attempt: the next poll dead-letters them
    for _ in range(3):
        assert audit.poll(10) == []  # was: DataError on every poll of the partition
    assert audit.advance_watermarks() == {0: 2}
    assert len(Topic(engine, dead_letter_topic(topic.name), clock=clock).dead_letters(group=second)) == 2


def test_fail_on_a_topic_with_no_room_for_a_dead_letter_topic_is_refused_up_front(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine
) -> None:
    base = f"t-{uuid.uuid4().hex[:12]}".ljust(96, "x")
    topic = make_topic(1, name=base)
    topic.publish("k", "m", 1)
    sub = make_sub("g", max_attempts=1, topic=base)
    [d] = sub.poll(10)
    assert d.fail("no")
    dlq = dead_letter_topic(base)  # 100 characters: its own dead-letter topic would not fit
    with pytest.raises(InvalidInputError, match="max_attempts=None"):
        Subscription(engine, dlq, "audit", "a1")
    audit = make_sub("audit", topic=dlq, max_attempts=None)
    [dd] = audit.poll(10)
    with pytest.raises(InvalidInputError, match="no dead-letter topic"):
        dd.fail("no")
    assert rows(engine, "heads", dead_letter_topic(dlq)) == 0  # was: a head row on SQLite
    assert dd.ack()  # nothing was written: the delivery is still there to ack
    assert audit.advance_watermarks() == {0: 1}


def test_a_dead_letter_topic_of_a_dead_letter_topic_is_created_whole(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine
) -> None:
    topic = make_topic(3)
    topic.publish("k", "m", 1)
    sub = make_sub("g", max_attempts=1)
    assert all(d.fail("no") for d in sub.poll(10))
    dlq = dead_letter_topic(topic.name)
    audit = make_sub("audit", topic=dlq, max_attempts=None)  # does not create {dlq}_dlq when joining
    assert rows(engine, "heads", dead_letter_topic(dlq)) == 0
    [dd] = audit.poll(10)
    assert dd.fail("no")
    summary = {t.topic: t for t in list_topics(engine)}
    assert summary[dead_letter_topic(dlq)].partitions == 3  # a topic, not a lone head row
    assert rows(engine, "heads", dead_letter_topic(dlq)) == 3


# -- also: dropping a group ---------------------------------------------------------------------------------
def test_drop_group_removes_its_rows_and_lets_garbage_collection_move_on(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine
) -> None:
    topic = make_topic(2)
    topic.publish_many([(f"k{i}", f"m{i}", i) for i in range(6)])
    fast, slow = make_sub("fast"), make_sub("slow")
    assert all(fast.ack_many(fast.poll(10)))
    fast.advance_watermarks()
    held = slow.poll(2)
    assert topic.collect_garbage() == 0  # slow holds collection back
    with pytest.raises(InvalidInputError, match="live subscribers"):
        topic.drop_group("slow")  # it holds partitions
    assert topic.drop_group("slow", force=True)
    for table in ("offsets", "leases", "deliveries", "subscribers"):
        assert rows(engine, table, topic.name, "slow") == 0
    assert group_lag(engine, topic.name, "slow") == []
    assert topic.collect_garbage() == 6
    assert not topic.drop_group("slow")  # gone already
    # Its subscriber, still running, changes nothing and gets nothing.
    assert [d.ack() for d in held] == [False] * len(held)
    assert slow.poll(10) == []
    assert rows(engine, "deliveries", topic.name, "slow") == 0
    with pytest.raises(InvalidInputError):
        topic.drop_group("no spaces")


def test_drop_group_refuses_a_group_whose_partitions_a_live_subscriber_holds(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], clock: ManualClock, engine: sa.Engine
) -> None:
    """Dropping a group under running subscribers would leave them holding nothing, silently, until restarted:
    refused (nothing written) while a lease is live, done once they closed or their leases expired (a
    subscriber frozen or killed), or with ``force``. (It dropped the group under them.)"""
    topic = make_topic(2)
    topic.publish_many([(f"k{i}", f"m{i}", i) for i in range(4)])
    one, two = make_sub("g", name="s1"), make_sub("g", name="s2")
    assert len(one.rebalance()) == 1 and len(two.rebalance()) == 1
    got = {"s1": one.poll(10), "s2": two.poll(10)}
    assert sorted(d.payload for ds in got.values() for d in ds) == [0, 1, 2, 3]
    before = {table: rows(engine, table, topic.name, "g") for table in ("offsets", "leases", "deliveries")}
    live = r"'g' of topic .* has live subscribers \(s1 holds partition 0; s2 holds partition 1\)"
    with pytest.raises(InvalidInputError, match=live):
        topic.drop_group("g")
    assert {table: rows(engine, table, topic.name, "g") for table in before} == before  # nothing written
    assert all(one.ack_many(got["s1"]))  # s1 goes on, then leaves
    one.close()
    with pytest.raises(InvalidInputError, match=r"\(s2 holds partition 1\)"):
        topic.drop_group("g")
    clock.advance(31 * SECOND)  # s2 froze: its lease (30 s) expired
    assert topic.drop_group("g")
    assert got["s2"] and [d.ack() for d in got["s2"]] == [False] * len(got["s2"])  # s2 woke up: fenced out
    for table in ("offsets", "leases", "deliveries", "subscribers"):
        assert rows(engine, table, topic.name, "g") == 0
    # force: dropped under a live subscriber, which then holds nothing until it joins again.
    live = make_sub("h", name="s3")
    [first, *_] = live.poll(10)
    assert topic.drop_group("h", force=True)
    assert not first.ack() and live.poll(10) == []


def test_a_dropped_groups_dead_letters_stay_until_it_reads_the_topic_again(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription]
) -> None:
    topic = make_topic(1)
    topic.publish_many([("k", "m0", 0), ("k", "m1", 1)])
    billing, search = make_sub("billing", max_attempts=1), make_sub("search", name="s2")
    [first, second] = billing.poll(10)
    assert first.fail("no") and second.ack()
    assert all(search.ack_many(search.poll(10)))
    billing.close()
    assert topic.drop_group("billing")
    assert topic.requeue_dead(everything=True) == 0  # nobody to requeue it to: it stays
    assert [dl.message_id for dl in topic.dead_letters()] == ["m0"]
    again = make_sub("billing", name="s3", start="latest", max_attempts=1)
    assert again.poll(10) == []
    assert topic.requeue_dead(group="billing", message_id="m0") == 1
    [back] = again.poll(10)
    assert (back.payload, back.attempts) == (0, 1) and back.ack()
    assert search.poll(10) == [] and search.advance_watermarks() == {0: 3}  # acked for search: not delivered


def test_dead_letters_carry_their_original_topic(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription]
) -> None:
    topic = make_topic(1)
    topic.publish("k", "m", 1)
    sub = make_sub("g", max_attempts=1)
    [d] = sub.poll(10)
    assert d.fail("no")
    [letter] = topic.dead_letters()
    assert isinstance(letter, TopicDeadLetter)
    assert letter.original_topic == topic.name and letter.as_dict()["original_topic"] == topic.name


# -- also: requeues beside a Spark group ---------------------------------------------------------------------
def test_a_requeue_leaves_no_state_for_a_spark_group(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine
) -> None:
    topic = make_topic(1)
    topic.publish_many([("k", f"m{i}", i) for i in range(3)])
    t = make_tables().topics
    with engine.begin() as conn:  # a Spark streaming query's group: watermarks only, moved by its commits
        conn.execute(
            sa.insert(t.offsets).values(
                consumer_group="spark", topic=topic.name, partition=0, acked_offset=3, updated_at=0
            )
        )
    sub = make_sub("billing", max_attempts=1)
    [first, *rest] = sub.poll(10)
    assert first.fail("no") and all(sub.ack_many(rest))
    assert topic.requeue_dead(everything=True) == 1
    assert rows(engine, "deliveries", topic.name, "spark") == 0  # was: an acked state nobody ever forgets
    [again] = sub.poll(10)
    assert again.ack()
    assert sub.advance_watermarks() == {0: 4}


def test_a_spark_groups_commit_forgets_the_states_its_watermark_passes(
    make_topic: Callable[..., Topic], backend: Backend, engine: sa.Engine
) -> None:
    pytest.importorskip("pyspark")
    from delayq.spark.options import SourceOptions
    from delayq.spark.stream import TopicStreamReader

    topic = make_topic(1)
    topic.publish_many([("k", f"m{i}", i) for i in range(3)])
    t = make_tables().topics
    with engine.begin() as conn:  # acked states of the group, as a requeue of an earlier version left them
        conn.execute(
            sa.insert(t.deliveries),
            [
                {"consumer_group": "spark", "topic": topic.name, "partition": 0, "message_offset": o}
                | {"status": 1, "invisible_until": 0, "attempts": 0}
                for o in (2, 3)
            ],
        )
    reader = TopicStreamReader(SourceOptions.parse({"url": backend.url, "topic": topic.name, "group": "spark"}))
    try:
        reader.commit({"0": 2})
        assert rows(engine, "deliveries", topic.name, "spark") == 1  # above the watermark: kept
        reader.commit({"0": 3})
        assert rows(engine, "deliveries", topic.name, "spark") == 0
    finally:
        reader.stop()


def test_a_dropped_spark_group_is_created_again_by_its_querys_next_commit_and_a_collected_range_fails_loudly(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], backend: Backend, engine: sa.Engine
) -> None:
    """A Spark query's group has no leases, so nothing refuses its drop; what the query had not read may then
    be collected: its read of that range fails (``CollectedError``), never skips it, and its next commit
    creates the group's watermarks again, so collection waits for it from there."""
    pytest.importorskip("pyspark")
    from pyspark.sql.datasource import InputPartition

    from delayq.spark.options import SourceOptions
    from delayq.spark.stream import CollectedError, TopicStreamReader

    topic = make_topic(1)
    topic.publish_many([("k", f"m{i}", i) for i in range(4)])
    fast = make_sub("fast")
    assert all(fast.ack_many(fast.poll(10))) and fast.advance_watermarks() == {0: 4}
    reader = TopicStreamReader(SourceOptions.parse({"url": backend.url, "topic": topic.name, "group": "spark"}))
    try:
        reader.commit({"0": 2})
        assert topic.collect_garbage() == 2  # spark read up to 2
        assert topic.drop_group("spark")  # the query still runs: nothing says so
        assert topic.collect_garbage() == 2
        with pytest.raises(CollectedError, match=r"offsets 3\.\.4 of partition 0"):
            list(reader.read(InputPartition((0, 2, 4))))
        topic.publish("k", "m4", 4)
        assert all(fast.ack_many(fast.poll(10))) and fast.advance_watermarks() == {0: 5}
        reader.commit({"0": 4})
        assert rows(engine, "offsets", topic.name, "spark") == 1
        assert topic.collect_garbage() == 0  # offset 5 waits for spark again
    finally:
        reader.stop()


# -- faults -------------------------------------------------------------------------------------------------
COMMIT = {"postgresql": b"Q\x00\x00\x00\x0bCOMMIT\x00", "mysql": b"\x03COMMIT"}


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_a_republished_ids_dead_letter_whose_commit_reply_was_lost_lands_once(
    server: str, backend_urls: dict[str, str]
) -> None:
    from conftest import _backend

    url = backend_urls[server]
    _backend(server, backend_urls)  # migrated
    name = f"f-{uuid.uuid4().hex[:12]}"
    with FaultProxy.for_url(url) as proxy:
        direct, through = make_engine(url), make_engine(proxy.url_for(url))
        try:
            topic = Topic(direct, name)
            topic.create(1)
            sub = Subscription(through, name, "billing", "s1", max_attempts=1)
            sub.rebalance()
            for round_ in range(2):
                assert topic.publish("k", "order-1", round_) is OfferOutcome.CREATED
                [d] = sub.poll(10)
                proxy.cut_after(COMMIT[server])
                d.fail("bad order")  # committed; the retry after the lost reply finds it dead already
                assert proxy.stats.cuts == round_ + 1
                sub.advance_watermarks()
                assert topic.collect_garbage() == 1
            dead = topic.dead_letters(group="billing")
            assert sorted((dl.original_offset, dl.payload) for dl in dead) == [(1, 0), (2, 1)]  # each once
            assert sub.poll(10) == [] and sub.watermarks() == {0: 2}
        finally:
            through.dispose()
            direct.dispose()


# -- asyncio ------------------------------------------------------------------------------------------------
def test_async_a_republished_id_is_dead_lettered_again_and_a_dropped_group_starts_anew(backend: Backend) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"

    async def main() -> None:
        engine = make_async_engine(backend.url)
        try:
            topic = AsyncTopic(engine, name)
            await topic.create(1)
            sub = AsyncSubscription(engine, name, "billing", "s1", max_attempts=1)
            await sub.rebalance()
            for round_ in range(2):
                assert await topic.publish("k", "order-1", round_) is OfferOutcome.CREATED
                [d] = await sub.poll(10)
                assert await sub.fail(d, "bad order")
                await sub.advance_watermarks()
                assert await topic.collect_garbage() == 1
            dead = await topic.dead_letters(group="billing", message_id="order-1")
            assert sorted((dl.original_offset, dl.payload, dl.original_topic) for dl in dead) == [
                (1, 0, name),
                (2, 1, name),
            ]
            assert await topic.publish("k", "order-2", 2) is OfferOutcome.CREATED
            [held] = await sub.poll(10)
            with pytest.raises(InvalidInputError, match="s1 holds partition 0"):
                await topic.drop_group("billing")
            assert await topic.drop_group("billing", force=True)
            assert not await sub.ack(held)  # its subscriber is fenced out
            again = AsyncSubscription(engine, name, "billing", "s2")
            await again.rebalance()
            [fresh] = await again.poll(10)
            assert (fresh.message_id, fresh.attempts) == ("order-2", 1)
            assert await again.ack(fresh)
        finally:
            await engine.dispose()

    asyncio.run(main())


def _lock_waiters(conn: sa.Connection, backend: str, topic: str, holder: int) -> int:
    """How many statements wait for a row lock of the holder (PostgreSQL: its backend's pid) or, on
    MariaDB, lock the leases of ``topic`` (seen from a connection of its own)."""
    if backend == "postgresql":
        query = "SELECT count(*) FROM pg_stat_activity WHERE %(holder)s = ANY(pg_blocking_pids(pid))"
        return int(conn.exec_driver_sql(query, {"holder": holder}).scalar_one())
    query = "SELECT count(*) FROM information_schema.processlist WHERE command = 'Query' AND info LIKE %s"
    return int(conn.exec_driver_sql(query, (f"%FROM delayq_topic_leases%{topic}%FOR UPDATE%",)).scalar_one())


def test_drop_group_takes_a_groups_rows_in_the_order_its_polls_do(backend: Backend, engine: sa.Engine) -> None:
    """A poll holds its lease row, then writes the group's watermark and states: a drop that waits for the
    lease row holds none of those meanwhile, so the poll finishes and the drop follows (no deadlock)."""
    if backend.name == "sqlite":
        pytest.skip("SQLite has no row locks: one writer at a time")
    name = f"t-{uuid.uuid4().hex[:12]}"
    topic = Topic(engine, name)
    topic.create(1)
    topic.publish("k", "m", 1)
    sub = Subscription(engine, name, "g", "s1")
    sub.rebalance()
    [d] = sub.poll(10)
    t = make_tables().topics
    results: list[bool] = []
    holder = make_engine(backend.url)
    watcher = make_engine(backend.url)
    try:
        with holder.connect() as conn:
            if backend.name == "mysql":
                conn.exec_driver_sql("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            pid = 0
            if backend.name == "postgresql":
                pid = int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
                # Its writes below must not wait for the drop (they would, for its deadlock detector's second,
                # were the drop holding the group's watermark: a drop that lost the deadlock is retried).
                conn.exec_driver_sql("SET LOCAL lock_timeout = '300ms'")
            conn.execute(  # as a poll's fence
                sa.select(t.leases.c.epoch)
                .where(t.leases.c.consumer_group == "g", t.leases.c.topic == name, t.leases.c.partition == 0)
                .with_for_update()
            ).one()
            dropping = threading.Thread(target=lambda: results.append(topic.drop_group("g", force=True)))
            dropping.start()
            with watcher.connect() as w:
                deadline = time.monotonic() + 30
                while _lock_waiters(w, backend.name, name, pid) == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)
                    w.rollback()
                assert _lock_waiters(w, backend.name, name, pid) >= 1  # the drop waits for the lease row
            # As the poll goes on: its watermark and states, which the waiting drop must not hold.
            off, dl = t.offsets, t.deliveries
            conn.execute(sa.update(off).where(off.c.consumer_group == "g", off.c.topic == name).values(acked_offset=1))
            conn.execute(sa.update(dl).where(dl.c.consumer_group == "g", dl.c.topic == name).values(status=1))
            conn.commit()
        dropping.join(30)
        assert results == [True]
    finally:
        holder.dispose()
        watcher.dispose()
    assert not d.ack()
    for table in ("offsets", "leases", "deliveries", "subscribers"):
        assert rows(engine, table, name, "g") == 0


def test_a_republished_ids_dead_letter_that_cannot_be_appended_leaves_the_delivery_as_it_was(
    backend: Backend, engine: sa.Engine
) -> None:
    """Both or neither: in the caller's transaction, the dead-letter topic's head row locked by another
    transaction past the lock timeout fails the whole ``fail``, and a rollback leaves the delivery to ack."""
    if backend.name == "sqlite":
        pytest.skip("SQLite has no row locks: one writer at a time")
    name = f"t-{uuid.uuid4().hex[:12]}"
    topic = Topic(engine, name)
    topic.create(1)
    sub = Subscription(engine, name, "billing", "s1", max_attempts=1)
    sub.rebalance()
    assert topic.publish("k", "order-1", 0) is OfferOutcome.CREATED
    [d] = sub.poll(10)
    assert d.fail("first")
    sub.advance_watermarks()
    assert topic.collect_garbage() == 1
    assert topic.publish("k", "order-1", 1) is OfferOutcome.CREATED
    [d] = sub.poll(10)
    part = "`partition`" if backend.name == "mysql" else "partition"
    caller = make_engine(backend.url)  # its own pool: the session's lock timeout goes with it
    where, params = f"topic = :t AND {part} = 0", {"t": dead_letter_topic(name)}
    try:
        with hold_row_lock(backend.url, "delayq_topic_heads", where, params), caller.connect() as conn:
            if backend.name == "postgresql":
                conn.exec_driver_sql("SET LOCAL lock_timeout = '300ms'")
            else:
                conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 1")
            with pytest.raises(sa.exc.OperationalError):
                sub.fail(d, "second", using=conn)
            conn.rollback()
    finally:
        caller.dispose()
    assert [dl.original_offset for dl in topic.dead_letters()] == [1]  # the second is not there ...
    assert d.ack()  # ... and the delivery was never marked dead
    assert sub.advance_watermarks() == {0: 2}


def test_an_undecodable_message_of_a_topic_with_no_room_for_dead_letters_does_not_wedge_its_polls(
    make_sub: Callable[..., Subscription], engine: sa.Engine, clock: ManualClock
) -> None:
    base = f"t-{uuid.uuid4().hex[:12]}".ljust(96, "x")
    Topic(engine, base, clock=clock).create(1)
    Topic(engine, base, clock=clock, serializer=JsonSerializer()).publish("k", "json", {"n": 1})
    Topic(engine, base, clock=clock, serializer=TextSerializer()).publish("k", "text", "two")
    sub = make_sub("g", topic=base, max_attempts=1, serializer=TextSerializer())
    [text] = sub.poll(10)  # the JSON one went to the dead letters (wrong kind), the text one came
    assert text.fail("no")
    dlq = dead_letter_topic(base)  # 100 characters: no dead-letter topic of its own
    audit = make_sub("audit", topic=dlq, max_attempts=None, serializer=TextSerializer())
    for _ in range(3):
        got = audit.poll(10)  # was: InvalidInputError (no room for a dead-letter topic) on every poll
        assert [d.payload for d in got] == (["two"] if _ == 0 else [])
        if got:
            assert got[0].ack()
        clock.advance(120 * SECOND)
    assert rows(engine, "heads", dead_letter_topic(dlq)) == 0
    assert [s.pending for s in group_lag(engine, dlq, "audit")] == [1]  # the JSON one, in flight, never lost


def _waits_for_a_lock(url: str, backend: str, tag: str, pattern: str) -> None:
    """Poll (bounded) until a statement waits for a row lock: on PostgreSQL one of a session named ``tag``
    (its ``application_name``), on MariaDB one running whose text is LIKE ``pattern`` (its lock waits do not
    all show in ``innodb_trx``)."""
    params: Any
    if backend == "postgresql":
        query, params = (
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %(tag)s AND wait_event_type = 'Lock'",
            {"tag": tag},
        )
    else:
        query = "SELECT count(*) FROM information_schema.processlist WHERE command = 'Query' AND info LIKE %s"
        params = (pattern,)
    watcher = make_engine(url, poolclass=sa.pool.NullPool)
    try:
        with watcher.connect() as w:
            deadline = time.monotonic() + 30
            while int(w.exec_driver_sql(query, params).scalar_one()) == 0:
                assert time.monotonic() < deadline, f"nothing of {tag!r} waits for a lock"
                time.sleep(0.02)
                w.rollback()
    finally:
        watcher.dispose()


@pytest.mark.parametrize("op", ["rebalance", "close"])
def test_drop_group_beside_a_subscribers_rebalance_or_close_does_not_deadlock(
    backend: Backend, engine: sa.Engine, op: str
) -> None:
    """Every transaction of a group takes its lease rows before its subscriber row, as a drop does. With the
    subscriber's row held by another transaction (a slow heartbeat), a rebalance or close that waits for it,
    then a drop of the group, both finish, neither a deadlock's victim (retries off). (It failed with the
    rebalance's heartbeat before its leases: the drop held the leases and waited for the subscriber's row.)"""
    if backend.name == "sqlite":
        pytest.skip("SQLite has no row locks: one writer at a time")
    from delayq.transactions import TransientRetry

    once = TransientRetry(attempts=1)
    name = f"t-{uuid.uuid4().hex[:12]}"
    tags = {role: f"{role}-{name}" for role in ("sub", "drop")}
    pg = backend.name == "postgresql"
    engines = {role: make_engine(backend.url + (f"?application_name={t}" if pg else "")) for role, t in tags.items()}
    errors: list[BaseException] = []
    results: dict[str, Any] = {}

    def run(role: str, target: Callable[[], Any]) -> threading.Thread:
        def body() -> None:
            try:
                results[role] = target()
            except BaseException as exc:  # asserted below
                errors.append(exc)

        thread = threading.Thread(target=body)
        thread.start()
        return thread

    try:
        topic = Topic(engines["drop"], name, transient_retry=once)
        topic.create(2)
        topic.publish_many([(f"k{i}", f"m{i}", i) for i in range(4)])
        sub = Subscription(engines["sub"], name, "g", "s1", transient_retry=once)
        assert sorted(sub.rebalance()) == [0, 1]
        assert len(sub.poll(10)) == 4
        where, params = "consumer_group = 'g' AND topic = :t AND subscriber = 's1'", {"t": name}
        with hold_row_lock(backend.url, "delayq_topic_subscribers", where, params, timeout=30):
            first = run("sub", sub.rebalance if op == "rebalance" else sub.close)
            _waits_for_a_lock(backend.url, backend.name, tags["sub"], f"%delayq_topic_subscribers%{name}%")
            second = run("drop", lambda: topic.drop_group("g", force=True))
            _waits_for_a_lock(backend.url, backend.name, tags["drop"], f"%FROM delayq_topic_%{name}%")
        first.join(60)
        second.join(60)
    finally:
        for e in engines.values():
            e.dispose()
    assert errors == []
    assert results["drop"] is True and "sub" in results
    for table in ("offsets", "leases", "deliveries", "subscribers"):
        assert rows(engine, table, name, "g") == 0
