"""Topics' contract on every backend: publishing, consumer groups, leases, watermarks, dead letters."""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend

from delayq import InvalidInputError, InvalidKeyError, ManualClock, OfferOutcome
from delayq.schema import make_tables
from delayq.topics import LeaseLostError, Subscription, Topic, dead_letter_topic, group_lag, list_topics, partition_for

SECOND = dt.timedelta(seconds=1)


@pytest.fixture
def topic_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_topic(engine: sa.Engine, topic_name: str, clock: ManualClock) -> Callable[..., Topic]:
    def make(partitions: int = 1, **kwargs: Any) -> Topic:
        topic = Topic(kwargs.pop("engine", engine), kwargs.pop("name", topic_name), clock=clock, **kwargs)
        topic.create(partitions)
        return topic

    return make


@pytest.fixture
def make_sub(engine: sa.Engine, topic_name: str, clock: ManualClock) -> Callable[..., Subscription]:
    def make(name: str = "s1", group: str = "g", **kwargs: Any) -> Subscription:
        kwargs.setdefault("lease_duration", 30 * SECOND)
        kwargs.setdefault("visibility_timeout", 60 * SECOND)
        return Subscription(
            kwargs.pop("engine", engine), kwargs.pop("topic", topic_name), group, name, clock=clock, **kwargs
        )

    return make


def keys_for(partitions: int, count: int) -> list[str]:
    """One partition key for each of the first ``count`` partitions."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < count:
        found.setdefault(partition_for(f"k{i}", partitions), f"k{i}")
        i += 1
    return [found[p] for p in sorted(found)[:count]]


def test_publish_is_idempotent_on_topic_key_and_id(make_topic: Callable[..., Topic]) -> None:
    topic = make_topic(4)
    assert topic.publish("a", "1", {"n": 1}) is OfferOutcome.CREATED
    assert topic.publish("a", "1", {"n": 2}) is OfferOutcome.IGNORED
    assert topic.publish("b", "1", {"n": 3}) is OfferOutcome.CREATED
    outcomes = topic.publish_many([("a", "1", 0), ("a", "2", 0), ("a", "2", 0), ("c", "9", 0)])
    assert outcomes == [OfferOutcome.IGNORED, OfferOutcome.CREATED, OfferOutcome.IGNORED, OfferOutcome.CREATED]
    heads = {p.partition: p.head for p in topic.heads()}
    assert sum(heads.values()) == 4
    assert heads[partition_for("a", 4)] >= 2


def test_publish_many_over_many_partitions_sets_every_head(make_topic: Callable[..., Topic], engine: sa.Engine) -> None:
    # More partitions than one statement of the shared head update takes, and sizes between its slots.
    topic = make_topic(700)
    items = [(f"k{i}", f"m{i}", i) for i in range(1500)]
    assert set(topic.publish_many(items[:1000])) == {OfferOutcome.CREATED}
    outcomes = topic.publish_many(items[900:1500] + items[:3])
    assert outcomes == [OfferOutcome.IGNORED] * 100 + [OfferOutcome.CREATED] * 500 + [OfferOutcome.IGNORED] * 3
    counts: dict[int, int] = {}
    for k, _, _ in items:
        counts[partition_for(k, 700)] = counts.get(partition_for(k, 700), 0) + 1
    assert {h.partition: h.head for h in topic.heads() if h.head} == counts


def test_offsets_are_gap_free_per_partition(make_topic: Callable[..., Topic], engine: sa.Engine) -> None:
    topic = make_topic(3)
    topic.publish_many([(f"k{i % 5}", str(i), i) for i in range(30)])
    topic.publish_many([(f"k{i % 5}", str(i), i) for i in range(40)])  # 30 again, 10 new
    log = make_tables().topics.log
    with engine.connect() as conn:
        rows = conn.execute(sa.select(log.c.partition, log.c.message_offset).where(log.c.topic == topic.name)).all()
    by_partition: dict[int, list[int]] = {}
    for p, o in rows:
        by_partition.setdefault(p, []).append(o)
    assert sum(len(v) for v in by_partition.values()) == 40
    for offsets in by_partition.values():
        assert sorted(offsets) == list(range(1, len(offsets) + 1))


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("", "1", 0), InvalidKeyError),
        (("k", "", 0), InvalidKeyError),
        (("k" * 201, "1", 0), InvalidKeyError),
        (("k\x00", "1", 0), InvalidKeyError),
        ((3, "1", 0), InvalidKeyError),
    ],
)
def test_a_bad_partition_key_or_id_is_refused(make_topic: Callable[..., Topic], args: Any, error: type) -> None:
    topic = make_topic(2)
    with pytest.raises(error):
        topic.publish(*args)
    assert all(p.head == 0 for p in topic.heads())


@pytest.mark.parametrize("name", ["", "has space", "slash/", "x" * 101, "é"])
def test_bad_topic_and_group_names_are_refused(engine: sa.Engine, name: str) -> None:
    with pytest.raises(InvalidInputError):
        Topic(engine, name)
    with pytest.raises(InvalidInputError):
        Subscription(engine, "fine", name, "s")


def test_an_unknown_topic_and_another_partition_count_are_refused(
    make_topic: Callable[..., Topic], engine: sa.Engine
) -> None:
    with pytest.raises(InvalidInputError, match="does not exist"):
        Topic(engine, f"missing-{uuid.uuid4().hex[:8]}").publish("k", "1", 0)
    topic = make_topic(2)
    assert topic.create(2) == 2
    with pytest.raises(InvalidInputError, match="2 partitions"):
        topic.create(3)


def test_the_seeds_non_blocking_nack(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], clock: ManualClock
) -> None:
    topic = make_topic(1)
    topic.publish_many([("repo", str(i), i) for i in range(1, 6)])
    sub = make_sub()
    assert sub.rebalance() == {0: 1}
    got = {d.offset: d for d in sub.poll(10)}
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert got[3].nack(30 * SECOND, "busy")
    for o in (1, 2, 4, 5):
        assert got[o].ack()
    assert sub.advance_watermarks() == {0: 2}
    assert sub.poll(10) == []  # 3 waits out its delay; nothing else is due
    clock.advance(31 * SECOND)
    [again] = sub.poll(10)
    assert (again.offset, again.attempts, again.payload) == (3, 2, 3)
    assert again.ack()
    assert sub.advance_watermarks() == {0: 5}
    assert sub.watermarks() == {0: 5}


def test_later_messages_keep_flowing_past_a_nack(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription]
) -> None:
    topic = make_topic(1)
    topic.publish_many([("k", str(i), i) for i in range(3)])
    sub = make_sub()
    sub.rebalance()
    first = sub.poll(1)
    assert [d.offset for d in first] == [1]
    assert first[0].nack(dt.timedelta(hours=1))
    assert [d.offset for d in sub.poll(10)] == [2, 3]


def test_strict_serialization_delivers_one_at_a_time_in_order(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription]
) -> None:
    topic = make_topic(1)
    topic.publish_many([("k", str(i), i) for i in range(4)])
    sub = make_sub(strict=True)
    sub.rebalance()
    seen = []
    for _ in range(4):
        [d] = sub.poll(10)
        assert sub.poll(10) == []  # nothing else while it is in flight
        seen.append(d.offset)
        assert d.ack()
    assert seen == [1, 2, 3, 4]
    assert sub.poll(10) == []


def test_strict_order_with_concurrent_subscribers(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], backend: Backend
) -> None:
    partitions = 4
    topic = make_topic(partitions)
    keys = keys_for(partitions, partitions)
    per_key = 15
    topic.publish_many([(k, f"{k}-{i}", [k, i]) for i in range(per_key) for k in keys])
    subs = [make_sub(f"s{i}", strict=True) for i in range(3)]
    for s in subs:
        s.join()
    history: list[tuple[str, int, int, str]] = []
    lock = threading.Lock()
    done = threading.Event()
    errors: list[BaseException] = []

    def consume(sub: Subscription) -> None:
        try:
            for _ in range(2000):
                if done.is_set():
                    return
                sub.rebalance()
                for d in sub.poll(5):
                    with lock:
                        history.append((d.partition_key, d.payload[1], d.offset, sub.name))
                        if len(history) >= per_key * partitions:
                            done.set()
                    assert d.ack()
        except BaseException as exc:
            errors.append(exc)
            done.set()

    threads = [threading.Thread(target=consume, args=(s,)) for s in subs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert len(history) == per_key * partitions
    for k in keys:
        assert [i for key, i, _, _ in history if key == k] == list(range(per_key))


def test_a_publisher_committing_late_is_still_delivered(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], backend: Backend, engine: sa.Engine
) -> None:
    if backend.name == "sqlite":
        pytest.skip("SQLite has one writer: a publisher's open transaction stops every other write")
    partitions = 2
    topic = make_topic(partitions)
    slow_key, other_key = keys_for(partitions, 2)
    sub = make_sub()
    sub.rebalance()
    with engine.connect() as held:
        with held.begin():
            assert topic.publish(slow_key, "late", "late", using=held) is OfferOutcome.CREATED
            # Another publisher of the same partition waits for it; one of another partition does not.
            behind = threading.Thread(target=topic.publish, args=(slow_key, "behind", "behind"))
            behind.start()
            topic.publish(other_key, "other", "other")
            got = sub.poll(10)
            assert [d.payload for d in got] == ["other"]
            assert all(d.ack() for d in got)
            sub.advance_watermarks()
            slow = partition_for(slow_key, partitions)
            assert sub.watermarks()[slow] == 0
            assert behind.is_alive()
        behind.join(timeout=30)
    assert not behind.is_alive()
    got = sub.poll(10)
    assert [(d.payload, d.offset) for d in got] == [("late", 1), ("behind", 2)]
    assert all(d.ack() for d in got)
    assert sub.advance_watermarks()[slow] == 2


def test_a_subscriber_whose_lease_was_stolen_can_change_nothing(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], clock: ManualClock, engine: sa.Engine
) -> None:
    topic = make_topic(1)
    topic.publish_many([("k", str(i), i) for i in range(3)])
    old, new = make_sub("old"), make_sub("new")
    assert old.rebalance() == {0: 1}
    a, b, c = old.poll(10)
    assert new.rebalance() == {}  # held, and old's heartbeat is fresh
    clock.advance(31 * SECOND)  # old stops renewing: its lease and heartbeat expire
    assert new.rebalance() == {0: 2}
    assert not a.ack()
    assert not b.nack()
    assert c.extend(SECOND) is None
    assert not c.fail("x")
    calls: list[str] = []

    def handler(conn: sa.Connection) -> str:
        calls.append("ran")  # its writes roll back with the fenced ack
        return "done"

    with pytest.raises(LeaseLostError):
        old.handle_exactly_once(a, handler)
    assert calls == ["ran"]
    assert old.advance_watermarks() == {}
    assert old.held == {}
    # The new holder gets them after their visibility timeout, and its acks count.
    clock.advance(61 * SECOND)
    new.rebalance()
    got = new.poll(10)
    assert [d.offset for d in got] == [1, 2, 3]
    assert all(d.ack() for d in got)
    assert new.advance_watermarks() == {0: 3}


@pytest.mark.parametrize("steal", ["committed", "rolled back"])
def test_an_ack_waiting_on_a_steal_in_progress_acks_only_if_the_steal_rolls_back(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], backend: Backend, steal: str
) -> None:
    if backend.name == "sqlite":
        pytest.skip("SQLite has no row locks: one writer at a time")
    topic = make_topic(1)
    topic.publish_many([("k", str(i), i) for i in range(3)])
    sub = make_sub("old")
    assert sub.rebalance() == {0: 1}
    got = sub.poll(10)  # a run at attempt 1: on PostgreSQL acked by one statement, its fence inside
    leases = make_tables().topics.leases
    thief = sa.create_engine(backend.url, poolclass=sa.NullPool)
    try:
        with thief.connect() as conn:
            mine = sa.and_(leases.c.topic == topic.name, leases.c.consumer_group == "g", leases.c.partition == 0)
            conn.execute(sa.update(leases).where(mine).values(holder="new", epoch=leases.c.epoch + 1))
            results: list[list[bool]] = []
            acking = threading.Thread(target=lambda: results.append(sub.ack_many(got)))
            acking.start()
            acking.join(0.5)
            assert acking.is_alive()  # it waits for the steal's row lock
            if steal == "committed":
                conn.commit()
            else:
                conn.rollback()
            acking.join(10)
    finally:
        thief.dispose()
    assert results == ([[False] * 3] if steal == "committed" else [[True] * 3])
    watermark = {lag.partition: lag.watermark for lag in group_lag(backend.engine, topic.name, "g")}
    assert watermark == ({0: 0} if steal == "committed" else {0: 3})


def test_exactly_once_commits_the_handlers_writes_with_the_ack(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine
) -> None:
    topic = make_topic(1)
    topic.publish("k", "1", "x")
    sub = make_sub()
    sub.rebalance()
    [d] = sub.poll()
    heads = make_tables().topics.heads
    marker = f"{topic.name}-effect"

    runs: list[int] = []

    def handler(conn: sa.Connection) -> int:
        runs.append(len(runs))
        conn.execute(sa.insert(heads).values(topic=marker, partition=len(runs), head=7, collected=0))
        return 7

    assert sub.handle_exactly_once(d, handler) == 7
    with pytest.raises(LeaseLostError):  # acked already: the second run's writes roll back
        sub.handle_exactly_once(d, lambda conn: handler(conn))
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).where(heads.c.topic == marker)).scalar_one() == 1
        conn.execute(sa.delete(heads).where(heads.c.topic == marker))
        conn.commit()


def _settle(subs: list[Subscription]) -> dict[str, set[int]]:
    for _ in range(3):
        for s in subs:
            s.rebalance()
    return {s.name: set(s.held) for s in subs}


def test_fair_share_with_3_then_4_then_2_subscribers(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription]
) -> None:
    make_topic(12)
    subs = [make_sub(f"s{i}") for i in range(4)]
    for s in subs:
        s.join()
    subs[3].close()  # joined, then left: not live
    for count, live in ((3, subs[:3]), (4, subs), (2, subs[:2])):
        for s in subs:
            if s not in live:
                s.close()
        held = _settle(live)
        share = -(-12 // count)
        assert all(len(h) <= share for h in held.values()), held
        assert set().union(*held.values()) == set(range(12)), held
        assert sum(len(h) for h in held.values()) == 12


def test_graceful_shutdown_hands_partitions_over_at_once(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription]
) -> None:
    make_topic(6)
    a, b = make_sub("a"), make_sub("b")
    a.join()
    b.join()
    _settle([a, b])
    assert len(a.held) == len(b.held) == 3
    a.close()
    assert len(b.rebalance()) == 6  # no clock moved: released leases are free at once


def test_two_groups_read_the_log_independently(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], clock: ManualClock
) -> None:
    topic = make_topic(1)
    topic.publish_many([("k", str(i), i) for i in range(3)])
    one, two = make_sub(group="one", max_attempts=1), make_sub(group="two")
    one.rebalance()
    two.rebalance()
    first = one.poll(10)
    assert first[0].nack(error="boom")  # its last attempt: to the dead letters
    assert all(d.ack() for d in first[1:])
    got = two.poll(10)
    assert [(d.offset, d.attempts) for d in got] == [(1, 1), (2, 1), (3, 1)]
    assert all(d.ack() for d in got)
    assert one.advance_watermarks() == {0: 3}
    assert two.advance_watermarks() == {0: 3}
    dead = Topic(topic.ctx.engine, dead_letter_topic(topic.name), clock=clock)
    assert sum(p.head for p in dead.heads()) == 1


def test_dead_letter_after_max_attempts_is_atomic_with_the_removal(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], clock: ManualClock, engine: sa.Engine
) -> None:
    topic = make_topic(1)
    topic.publish_many([("k", "crashes", "c"), ("k", "fails", "f"), ("k", "fine", "ok")])
    sub = make_sub(max_attempts=2)
    sub.rebalance()
    crash, fail, fine = sub.poll(10)
    assert fine.ack()
    assert fail.nack(error="first")
    [fail] = [d for d in sub.poll(10) if d.offset == 2]
    assert fail.attempts == 2
    assert fail.nack(error="second")  # the last attempt: moved
    clock.advance(61 * SECOND)  # crash's subscriber died: it comes back
    [crash] = sub.poll(10)
    assert crash.attempts == 2
    clock.advance(61 * SECOND)  # and died again: the next poll moves it
    assert sub.poll(10) == []
    assert sub.advance_watermarks() == {0: 3}
    readers = make_sub("dlq-reader", group="audit", topic=dead_letter_topic(topic.name), max_attempts=None)
    readers.rebalance()
    dead = {d.dead_letter.original_offset: d for d in readers.poll(10) if d.dead_letter}
    assert sorted(dead) == [1, 2]
    assert dead[2].message_id == "g:fails"
    assert dead[2].payload == "f"
    assert dead[2].dead_letter is not None
    assert (dead[2].dead_letter.failure_count, dead[2].dead_letter.last_error) == (2, "second")
    assert dead[1].dead_letter is not None
    assert dead[1].dead_letter.original_topic == topic.name
    assert dead[1].dead_letter.failed_group == "g"
    assert "2 times" in (dead[1].dead_letter.last_error or "")


def test_garbage_collection_deletes_only_below_the_lowest_watermark(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine
) -> None:
    topic = make_topic(1)
    topic.publish_many([("k", str(i), i) for i in range(5)])
    fast, slow = make_sub(group="fast"), make_sub(group="slow")
    fast.rebalance()
    slow.rebalance()
    assert all(d.ack() for d in fast.poll(10))
    assert all(d.ack() for d in slow.poll(2))
    fast.advance_watermarks()
    slow.advance_watermarks()
    assert topic.collect_garbage() == 2
    assert topic.collect_garbage() == 0
    assert [p.collected for p in topic.heads()] == [2]
    late = make_sub(group="late", start="earliest")
    late.rebalance()
    assert [d.offset for d in late.poll(10)] == [3, 4, 5]
    latest = make_sub(group="latest", start="latest")
    latest.rebalance()
    assert latest.poll(10) == []
    topic.publish("k", "new", "new")
    assert [d.payload for d in latest.poll(10)] == ["new"]


def test_on_the_databases_clock(engine: sa.Engine, topic_name: str) -> None:
    topic = Topic(engine, topic_name)
    topic.create(2)
    topic.publish_many([("a", "1", 1), ("a", "2", 2), ("b", "3", 3)])
    sub = Subscription(engine, topic_name, "g", "s", max_attempts=1)
    assert len(sub.rebalance()) == 2
    got = sorted(sub.poll(10), key=lambda d: d.payload)
    assert [d.payload for d in got] == [1, 2, 3]
    assert got[0].published_at <= got[0].invisible_until
    assert got[0].extend(dt.timedelta(minutes=10)) is not None
    assert got[0].ack()
    assert got[1].nack(error="x")  # its last attempt: dead-lettered
    assert got[2].ack()
    assert sum(sub.advance_watermarks().values()) == 3
    sub.close()
    assert sum(p.head for p in Topic(engine, dead_letter_topic(topic_name)).heads()) == 1


def test_concurrent_publishers_get_gap_free_offsets_and_one_created_per_id(
    make_topic: Callable[..., Topic], engine: sa.Engine
) -> None:
    topic = make_topic(2)
    outcomes: list[OfferOutcome] = []
    lock = threading.Lock()
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def publish(n: int) -> None:
        try:
            start.wait(timeout=10)
            for i in range(10):
                got = topic.publish_many([("same", "dup", n), ("same", f"{n}-{i}", i), ("other", f"{n}-{i}", i)])
                with lock:
                    outcomes.append(got[0])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert outcomes.count(OfferOutcome.CREATED) == 1
    log = make_tables().topics.log
    with engine.connect() as conn:
        rows = conn.execute(sa.select(log.c.partition, log.c.message_offset).where(log.c.topic == topic.name)).all()
    assert len(rows) == 81
    for p in {p for p, _ in rows}:
        offsets = sorted(o for q, o in rows if q == p)
        assert offsets == list(range(1, len(offsets) + 1))


def test_ack_many_and_the_operator_views(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine
) -> None:
    topic = make_topic(2)
    a, b = keys_for(2, 2)
    topic.publish_many([(a, "1", 1), (a, "2", 2), (b, "3", 3)])
    sub = make_sub()
    sub.rebalance()
    got = sorted(sub.poll(10), key=lambda d: d.payload)
    assert sub.ack_many([got[1], got[2]]) == [True, True]
    assert sub.ack_many([got[1]]) == [False]
    sub.advance_watermarks()
    lag = {p.partition: p for p in group_lag(engine, topic.name, "g")}
    pa = partition_for(a, 2)
    assert (lag[pa].head, lag[pa].watermark, lag[pa].lag, lag[pa].pending) == (2, 0, 2, 1)
    assert lag[pa].holder == "s1"
    assert lag[1 - pa].lag == 0
    [summary] = [s for s in list_topics(engine) if s.topic == topic.name]
    assert (summary.partitions, summary.published, summary.retained) == (2, 3, 3)


def test_ack_many_acks_each_delivery_by_its_attempt_once(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], clock: ManualClock
) -> None:
    topic = make_topic(3)
    keys = keys_for(3, 3)
    topic.publish_many([(k, f"{k}-{i}", i) for i in range(4) for k in keys])
    sub = make_sub(visibility_timeout=SECOND)
    sub.rebalance()
    first = sub.poll(12)
    assert len(first) == 12
    clock.advance(2 * SECOND)  # all visible again: a second attempt of each
    second = {(d.partition, d.offset): d for d in sub.poll(12)}
    old = first[0]
    again = second[old.partition, old.offset]
    assert again.attempts == old.attempts + 1
    others = [d for d in second.values() if d is not again]
    # The first attempt is fenced out by the count, the second acked once, listed twice.
    assert sub.ack_many([old, again, again, *others]) == [False, True, False] + [True] * len(others)
    assert sub.ack_many([again]) == [False]
    assert sub.poll(12) == []
    assert set(sub.advance_watermarks().values()) == {4}


def test_a_poll_queued_behind_a_watermark_advance_never_takes_the_acked_messages_again(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine
) -> None:
    # A worker's maintenance thread advances the watermarks while its fetch loop polls: the poll's
    # exclusive fence waits for the advance's lease lock, and must then see the watermark it committed
    # (the advance forgot the states below it: read as of the fence's start, they looked never delivered).
    topic = make_topic(1)
    topic.publish_many([("k", f"m{i}", i) for i in range(5)])
    sub = make_sub()
    sub.rebalance()
    first = sub.poll(2)
    assert all(sub.ack(d) for d in first)
    second: list[Any] = []
    with engine.connect() as conn:
        with conn.begin():
            assert sub.advance_watermarks(using=conn) == {0: 2}  # holds the lease row until the commit
            poller = threading.Thread(target=lambda: second.extend(sub.poll(10)))
            poller.start()
            poller.join(0.5)  # the poll's fence waits for the lock meanwhile
        poller.join(30)
    assert [d.message_id for d in first] == ["m0", "m1"]
    assert [d.message_id for d in second] == ["m2", "m3", "m4"]


def test_a_rebalance_releases_idle_partitions_before_busy_ones(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription]
) -> None:
    make_topic(4)
    a, b = make_sub("a"), make_sub("b")
    assert sorted(a.rebalance()) == [0, 1, 2, 3]
    b.join()
    assert sorted(a.rebalance(busy={3, 2})) == [2, 3]  # 0 and 1 go, not the highest: those are busy
    assert sorted(b.rebalance()) == [0, 1]


def test_a_dead_letter_topic_can_be_subscribed_to(engine: sa.Engine, clock: ManualClock) -> None:
    long = "x" * 96
    Topic(engine, long, clock=clock).create(1)
    Subscription(engine, long + "_dlq", "g", "s", max_attempts=None, clock=clock).rebalance()
    with pytest.raises(InvalidInputError, match="max_attempts=None"):
        Subscription(engine, long + "_dlq", "g", "s", clock=clock)


def test_concurrent_rebalances_converge_to_disjoint_fair_shares(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription]
) -> None:
    make_topic(12)
    subs = [make_sub(f"s{i}") for i in range(4)]
    for s in subs:
        s.join()
    start = threading.Barrier(len(subs))
    errors: list[BaseException] = []

    def churn(sub: Subscription) -> None:
        try:
            start.wait(timeout=10)
            for _ in range(5):
                sub.rebalance()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(s,)) for s in subs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    held = _settle(subs)
    assert all(len(h) == 3 for h in held.values()), held
    assert set().union(*held.values()) == set(range(12))


def test_a_requeued_dead_letter_is_delivered_again_to_its_group_only(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine
) -> None:
    topic = make_topic(2)
    topic.publish_many([("k", "1", "one"), ("k", "2", "two")])
    billing, search = make_sub("b", group="billing", max_attempts=1), make_sub("s", group="search")
    billing.rebalance()
    search.rebalance()
    first, second = billing.poll(10)
    assert first.nack(error="boom") and second.ack()  # its last attempt: dead-lettered
    assert all(d.ack() for d in search.poll(10))
    assert search.advance_watermarks() == billing.advance_watermarks()  # both passed 1 and 2
    [dead] = topic.dead_letters()
    assert (dead.group, dead.message_id, dead.payload, dead.last_error) == ("billing", "1", "one", "boom")
    assert topic.dead_letters(group="search") == []

    assert topic.requeue_dead(group="search", everything=True) == 0
    assert topic.requeue_dead(group="billing", message_id="1") == 1
    assert topic.dead_letters() == []
    assert topic.requeue_dead(everything=True) == 0  # nothing left: a retried requeue adds nothing
    [again] = billing.poll(10)
    assert (again.message_id, again.payload, again.attempts, again.offset) == (f"1~requeue-{dead.offset}", "one", 1, 3)
    assert again.ack()
    assert search.poll(10) == []  # marked done for the other group: it is not delivered there
    part = partition_for("k", 2)
    assert billing.advance_watermarks()[part] == 3
    assert search.advance_watermarks()[part] == 3
    lag = {p.partition: p for p in group_lag(engine, topic.name, "search")}
    assert (lag[part].lag, lag[part].pending) == (0, 0)


def test_requeue_and_purge_select_by_group_key_and_id(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription]
) -> None:
    topic = make_topic(3)
    a, b = keys_for(3, 2)
    topic.publish_many([(a, "x", 1), (a, "y", 2), (b, "x", 3)])
    one, two = make_sub("1", group="one", max_attempts=1), make_sub("2", group="two", max_attempts=1)
    for sub in (one, two):
        sub.rebalance()
        assert all(d.fail("no") for d in sub.poll(10))
    assert len(topic.dead_letters()) == 6
    assert len(topic.dead_letters(limit=2)) == 2
    assert {(d.group, d.partition_key) for d in topic.dead_letters(message_id="x")} == {
        (g, k) for g in ("one", "two") for k in (a, b)
    }
    assert [d.message_id for d in topic.dead_letters(group="one", key=a)] == ["x", "y"]
    with pytest.raises(InvalidInputError, match="everything=True"):
        topic.purge_dead(group="one")
    with pytest.raises(InvalidInputError, match="everything=True"):
        topic.requeue_dead(key=a, everything=True)
    assert topic.purge_dead(group="two", key=a, message_id="y") == 1
    assert topic.requeue_dead(message_id="x", key=b) == 2  # both groups' dead letters of (b, x)
    got = {sub.group: sorted((d.partition_key, d.payload) for d in sub.poll(10)) for sub in (one, two)}
    assert got == {"one": [(b, 3)], "two": [(b, 3)]}  # one message each: the other group's copy is done
    assert topic.purge_dead(everything=True) == 3
    assert topic.dead_letters() == []


def test_a_bad_subscriber_name_is_refused(engine: sa.Engine, topic_name: str) -> None:
    for name in ("", "x" * 201, "a\x00b", 7):
        with pytest.raises(InvalidInputError, match="subscriber name"):
            Subscription(engine, topic_name, "g", name)  # type: ignore[arg-type]


def test_a_publish_in_an_orm_session_commits_and_rolls_back_with_the_business_row(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine
) -> None:
    from sqlalchemy.orm import Session

    topic = make_topic(1)
    orders = sa.Table(f"orders_{uuid.uuid4().hex[:8]}", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    orders.create(engine)
    try:
        with Session(engine) as session:
            session.execute(sa.insert(orders).values(id=1))
            assert topic.publish("order-1", "placed", {"id": 1}, using=session) is OfferOutcome.CREATED
            session.commit()
        with Session(engine) as session:
            session.execute(sa.insert(orders).values(id=2))
            assert topic.publish("order-2", "placed", {"id": 2}, using=session) is OfferOutcome.CREATED
            session.rollback()
        with engine.connect() as conn:
            assert conn.execute(sa.select(orders.c.id)).scalars().all() == [1]
        assert [p.head for p in topic.heads()] == [1]  # the rolled back offset is given out again: no gap
        assert topic.publish("order-3", "placed", {"id": 3}) is OfferOutcome.CREATED
        sub = make_sub()
        sub.rebalance()
        assert [(d.offset, d.payload) for d in sub.poll(10)] == [(1, {"id": 1}), (2, {"id": 3})]
    finally:
        orders.drop(engine)


def _rows(engine: sa.Engine, topic: str) -> list[tuple[int, int, int]]:
    """The group's delivery-state rows of ``topic``: (offset, status, attempts)."""
    dl = make_tables().topics.deliveries
    query = sa.select(dl.c.message_offset, dl.c.status, dl.c.attempts).where(dl.c.topic == topic)
    with engine.connect() as conn:
        return sorted((int(o), int(s), int(a)) for o, s, a in conn.execute(query))


def test_rows_only_for_what_needs_them(
    make_topic: Callable[..., Topic], make_sub: Callable[..., Subscription], engine: sa.Engine, clock: ManualClock
) -> None:
    # docs/topics.md, "Delivery state": delivered and acked in order writes no row; a nack, an ack out of
    # order and a range whose deadline passed do, and the watermark passes and deletes them.
    topic = make_topic(1)
    topic.publish_many([("k", f"m{i}", i) for i in range(1, 7)])
    sub = make_sub(max_attempts=3)
    sub.rebalance()
    first = sub.poll(2)
    assert [(d.offset, d.attempts) for d in first] == [(1, 1), (2, 1)]
    assert sub.ack_many(first) == [True, True]
    assert _rows(engine, topic.name) == [] and sub.watermarks() == {0: 2}  # in order: the watermark moved
    three, four, five, _six = sub.poll(10)
    assert _rows(engine, topic.name) == []
    assert three.nack(10 * SECOND, "later")  # non-blocking: a row of its own
    assert five.ack() and not five.ack()  # out of order: a row, acked once
    assert _rows(engine, topic.name) == [(3, 0, 1), (5, 1, 1)]
    assert sub.poll(10) == []  # 3 is not due, 4 and 6 are in flight
    clock.advance(61 * SECOND)  # 3 is due again, the range's deadline (4, 6) passed: attempts count
    again = sub.poll(10)
    assert [(d.offset, d.attempts) for d in again] == [(3, 2), (4, 2), (6, 2)]
    assert not four.ack()  # delivered again since: fenced by its attempt count
    assert sub.ack_many(again) == [True, True, True]
    assert sub.advance_watermarks() == {0: 6}
    assert _rows(engine, topic.name) == []  # passed by the watermark, deleted
    topic.publish("k", "m7", 7)
    (seven,) = sub.poll(10)
    for attempt in (1, 2):
        clock.advance(61 * SECOND)  # its subscriber "died": the range expires, then its row
        (seven,) = sub.poll(10)
        assert seven.attempts == attempt + 1
    clock.advance(61 * SECOND)
    assert sub.poll(10) == []  # delivered max_attempts times: dead-lettered by the poll
    assert [d.message_id for d in topic.dead_letters()] == ["m7"]
    assert sub.advance_watermarks() == {0: 7}
