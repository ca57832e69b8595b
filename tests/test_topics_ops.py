"""Operating topics: wake-ups on publish, the worker's garbage collection, metrics, spans, ``top``, on every backend.

The garbage collector's contract: what every group is done with goes, once (several collectors at once
never delete a row twice nor anything a group still needs), in bounded batches, never waiting for a
row lock; its loop survives a database that fails under it.
"""

from __future__ import annotations

import datetime as dt
import io
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend
from faults import hold_row_lock
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from delayq import (
    DeadLetter,
    ManualClock,
    OfferOutcome,
    RetryPolicy,
    Subscription,
    Topic,
    TopicDelivery,
    TopicHandler,
    Worker,
)
from delayq.dialects import dialect_for
from delayq.metrics import register, unregister
from delayq.runtime import _topic_gc
from delayq.runtime._core import backoff
from delayq.schema import make_tables
from delayq.top import Top, render
from delayq.topics import _gc, group_lag, partition_for

SECOND = dt.timedelta(seconds=1)


@pytest.fixture
def topic_name() -> str:
    return f"ops-{uuid.uuid4().hex[:12]}"


def wait_until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """Poll a condition; fail (not hang) if it stays false. Bounds a wait, asserts nothing about timing."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.01)


def handler(topic: str, body: Callable[[TopicDelivery], None], group: str = "g", **attrs: Any) -> TopicHandler:
    attrs.setdefault("lease_duration", 3 * SECOND)
    cls = type(
        "Consumer",
        (TopicHandler,),
        {"topic": topic, "group": group, "handle": lambda self, d, c=None: body(d), **attrs},
    )
    return cls()  # type: ignore[no-any-return]


def offsets_left(engine: sa.Engine, topic: str) -> dict[int, list[int]]:
    """Per partition, the offsets still in the log."""
    log = make_tables().topics.log
    with engine.connect() as conn:
        rows = conn.execute(sa.select(log.c.partition, log.c.message_offset).where(log.c.topic == topic)).all()
    found: dict[int, list[int]] = {}
    for p, o in sorted(rows):
        found.setdefault(int(p), []).append(int(o))
    return found


def read_up_to(engine: sa.Engine, topic: str, group: str, upto: int | None, clock: ManualClock) -> None:
    """Group ``group`` joins, acks every message at or below offset ``upto`` (None: all) and moves its
    watermarks; then leaves."""
    sub = Subscription(engine, topic, group, f"{group}-1", clock=clock)
    sub.rebalance()
    got = sub.poll(1000)
    sub.ack_many([d for d in got if upto is None or d.offset <= upto])
    sub.advance_watermarks()
    sub.close()


@pytest.fixture
def filled(engine: sa.Engine, topic_name: str, clock: ManualClock) -> Topic:
    """4 partitions of 6 messages; group a done with all of them, group b with offsets 1-4 of each."""
    topic = Topic(engine, topic_name, clock=clock)
    topic.create(4)
    keys = {}
    i = 0
    while len(keys) < 4:
        keys.setdefault(partition_for(f"k{i}", 4), f"k{i}")
        i += 1
    topic.publish_many([(keys[p], f"m{p}-{n}", n) for p in range(4) for n in range(6)])
    read_up_to(engine, topic_name, "a", None, clock)
    read_up_to(engine, topic_name, "b", 4, clock)
    return topic


# -- wake-ups --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["caller's transaction", "own statement"])
def test_a_publish_commit_notifies_the_workers_listener(postgres: Backend, topic_name: str, where: str) -> None:
    topic = Topic(postgres.engine, topic_name)
    topic.create(2)
    stop = threading.Event()
    heard: list[str] = []
    channel = make_tables().messages.name

    def listen() -> None:
        for payload in dialect_for(postgres.engine).listen(postgres.engine, channel, stop):
            heard.append(payload)
            if payload == f"topic:{topic_name}":
                return

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    try:
        n = 0
        while t.is_alive() and n < 100:  # LISTEN begins at some point: a notification before it is lost
            if where == "own statement":  # one message of delayq's own: one statement, its wake-up included
                assert topic.publish("k", f"m{n}", n) is OfferOutcome.CREATED
            else:
                with postgres.engine.begin() as conn:
                    topic.publish("k", f"m{n}", n, using=conn)
                    assert f"topic:{topic_name}" not in heard  # not before the commit
            t.join(0.2)
            n += 1
    finally:
        stop.set()
        t.join(5)
    assert f"topic:{topic_name}" in heard
    quiet = Topic(postgres.engine, topic_name, notify=False)
    assert quiet.notify is False


def test_a_worker_wakes_for_its_topics_and_queues_only(engine: sa.Engine, topic_name: str) -> None:
    Topic(engine, topic_name).create(1)
    worker = Worker(engine, [handler(topic_name, lambda d: None)])
    core = worker._core
    assert core.wakes(f"topic:{topic_name}") and not core.wakes(topic_name) and not core.wakes("topic:other")
    assert core.channel == make_tables().messages.name


# -- garbage collection ----------------------------------------------------------------------------------
def test_collection_deletes_what_every_group_is_done_with_in_bounded_batches(engine: sa.Engine, filled: Topic) -> None:
    first = _gc.collect(filled.ctx, filled.name, batch=3, max_batches=4)
    assert first.deleted == 12  # 4 transactions of at most 3
    rest = _gc.collect(filled.ctx, filled.name, batch=3)
    assert rest.deleted == 4  # b is done with 1-4 in each partition: 16 in all
    assert offsets_left(engine, filled.name) == {p: [5, 6] for p in range(4)}
    assert _gc.collect(filled.ctx, filled.name).deleted == 0
    assert [p.collected for p in filled.heads()] == [4] * 4


def test_keep_for_keeps_young_messages_whatever_the_groups_did(
    engine: sa.Engine, filled: Topic, clock: ManualClock
) -> None:
    assert _gc.collect(filled.ctx, filled.name, keep_for=dt.timedelta(hours=1)).deleted == 0
    clock.advance(dt.timedelta(hours=2))
    assert _gc.collect(filled.ctx, filled.name, keep_for=dt.timedelta(hours=1)).deleted == 16


def test_three_collectors_at_once_delete_each_row_once_and_nothing_a_group_needs(
    engine: sa.Engine, filled: Topic
) -> None:
    barrier = threading.Barrier(3)
    results: list[_gc.Collected] = []
    errors: list[BaseException] = []

    def collector() -> None:
        try:
            ctx = Topic(engine, filled.name).ctx  # each its own topic object, as separate workers have
            barrier.wait(10)
            results.append(_gc.collect(ctx, filled.name, batch=1))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=collector) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 3
    left = offsets_left(engine, filled.name)
    deleted = sum(r.deleted for r in results)
    if deleted < 16:  # a partition all three passed by at one moment (held by another): the next round takes it
        deleted += _gc.collect(filled.ctx, filled.name, batch=1).deleted
    assert deleted == 16  # each row once: the counts add up to exactly what went
    assert offsets_left(engine, filled.name) == {p: [5, 6] for p in range(4)}
    assert all(offsets[0] <= 5 for offsets in left.values())  # never past group b's watermark
    assert [p.collected for p in filled.heads()] == [4] * 4


def test_a_collector_passes_a_locked_partition_by_without_waiting(backend: Backend, filled: Topic) -> None:
    if backend.name == "sqlite":
        pytest.skip("no row locks: SQLite's writers take turns")
    heads = make_tables().topics.heads.name
    q = backend.engine.dialect.identifier_preparer.quote
    where = f"topic = :t AND {q('partition')} = 0"
    with hold_row_lock(backend.url, heads, where, {"t": filled.name}):
        done = _gc.collect(filled.ctx, filled.name)
        assert (done.deleted, done.skipped) == (12, 1)
        assert offsets_left(backend.engine, filled.name)[0] == [1, 2, 3, 4, 5, 6]
    assert _gc.collect(filled.ctx, filled.name).deleted == 4
    assert offsets_left(backend.engine, filled.name) == {p: [5, 6] for p in range(4)}


def test_the_workers_collector_survives_a_failing_database_and_a_held_lock(backend: Backend, filled: Topic) -> None:
    engine = backend.engine
    fail = {"left": 3}

    def flaky(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "DELETE FROM" in statement and "topic_log" in statement and fail["left"] > 0:
            fail["left"] -= 1
            raise sa.exc.OperationalError(statement, {}, Exception("injected: server went away"))

    worker = Worker(engine, [handler(filled.name, lambda d: None, group="a")], poll_interval=0.05 * SECOND)
    worker._core.topic_gc.interval = 0.05
    worker._core.topic_gc._backoff = lambda n: 0.05
    sa.event.listen(engine, "before_cursor_execute", flaky)
    try:
        worker.start()
        wait_until(lambda: fail["left"] == 0, "the injected failures")
        if backend.name != "sqlite":
            q = engine.dialect.identifier_preparer.quote
            where = f"topic = :t AND {q('partition')} = 0"
            with hold_row_lock(backend.url, make_tables().topics.heads.name, where, {"t": filled.name}):
                wait_until(lambda: sum(map(len, offsets_left(engine, filled.name).values())) <= 8 + 4, "the others")
                assert worker.health().loops["topics-gc"]
        wait_until(lambda: offsets_left(engine, filled.name) == {p: [5, 6] for p in range(4)}, "the collection")
        assert worker.health().loops["topics-gc"] and worker._core.topic_gc.deleted == 16
    finally:
        sa.event.remove(engine, "before_cursor_execute", flaky)
        assert worker.stop()


def test_a_handler_may_turn_collection_off(engine: sa.Engine, topic_name: str) -> None:
    Topic(engine, topic_name).create(1)
    off = Worker(engine, [handler(topic_name, lambda d: None, collect_garbage=False)])
    assert not off._core.topic_gc
    on = Worker(engine, [handler(topic_name, lambda d: None, keep_for=dt.timedelta(days=1))])
    assert on._core.topic_gc.keep_for == {topic_name: dt.timedelta(days=1)}
    assert _topic_gc.TopicCollector is not None and backoff(1) > 0


# -- metrics, spans, top ---------------------------------------------------------------------------------
def topic_samples(text: str, topic: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("topic") == topic and "le" not in s.labels:
                extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "topic")
                found[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return found


def failing_body(d: TopicDelivery) -> None:
    if d.message_id == "bad":
        raise RuntimeError("no luck")
    if d.message_id == "poison":
        raise DeadLetter("unreadable")


def test_topic_metrics_count_per_topic_and_group(engine: sa.Engine, topic_name: str, clock: ManualClock) -> None:
    registry = CollectorRegistry()
    topic = Topic(engine, topic_name, clock=clock)
    topic.create(2)
    h = handler(topic_name, failing_body, retry=RetryPolicy.fixed(dt.timedelta(0), max_attempts=2))
    worker = Worker(engine, [h], clock=clock)
    metrics = register(registry, topics=[topic])
    try:
        outcomes = topic.publish_many([("k1", "ok-1", 1), ("k2", "ok-2", 2), ("k1", "bad", 3), ("k2", "poison", 4)])
        topic.publish("k1", "ok-1", 1)  # a duplicate: not published again
        assert len(outcomes) == 4
        worker.run_once()
        worker.run_once()  # "bad" again, dead-lettered on its second attempt
        got = topic_samples(generate_latest(registry).decode(), topic_name)
    finally:
        unregister(metrics, registry)
    assert got["delayq_topic_published_total"] == 4
    assert got["delayq_topic_delivered_total{group=g}"] == 5
    assert got["delayq_topic_acked_total{group=g}"] == 2
    assert got["delayq_topic_nacked_total{group=g}"] == 1
    assert got["delayq_topic_dead_total{group=g}"] == 2
    assert got["delayq_topic_rebalances_total{group=g}"] >= 1
    assert got["delayq_topic_handler_duration_seconds_count{group=g,outcome=success}"] == 2
    assert got["delayq_topic_handler_duration_seconds_count{group=g,outcome=failure}"] == 2
    assert got["delayq_topic_handler_duration_seconds_count{group=g,outcome=dead_letter}"] == 1
    assert got["delayq_topic_lag{group=g}"] == 0 and got["delayq_topic_subscribers{group=g}"] == 0


def test_a_topic_handlers_span_links_to_the_publish(
    engine: sa.Engine, topic_name: str, clock: ManualClock, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = traced
    app = provider.get_tracer("app")
    topic = Topic(engine, topic_name, clock=clock)
    topic.create(2)
    with app.start_as_current_span("POST /orders"):
        topic.publish("order-1", "created", {"n": 1})
    topic.publish_many([("order-2", "created", 2), ("order-3", "bad", 3)])
    h = handler(topic_name, failing_body, retry=RetryPolicy.fixed(dt.timedelta(hours=1), max_attempts=5))
    assert Worker(engine, [h], clock=clock).run_once() == 3
    spans = exporter.get_finished_spans()
    publishes = [s for s in spans if s.name == f"publish {topic_name}"]
    processes = {
        s.attributes["messaging.message.conversation_id"]: s  # type: ignore[index]
        for s in spans
        if s.name == f"process {topic_name}"
    }
    assert len(publishes) == 2 and set(processes) == {"order-1", "order-2", "order-3"}
    one, batch = publishes
    assert one.kind is SpanKind.PRODUCER and one.parent is not None
    for key, publish in (("order-1", one), ("order-2", batch), ("order-3", batch)):
        process = processes[key]
        assert process.kind is SpanKind.CONSUMER and process.attributes is not None
        assert process.attributes["messaging.consumer.group.name"] == "g"
        [link] = process.links
        assert (link.context.trace_id, link.context.span_id) == (publish.context.trace_id, publish.context.span_id)
    assert processes["order-3"].status.status_code is StatusCode.ERROR
    assert processes["order-1"].status.status_code is not StatusCode.ERROR


@pytest.mark.parametrize("kind", ["threads", "asyncio", "asyncio, a sync handler"])
def test_a_topic_handlers_own_spans_nest_under_its_process_span(
    backend: Backend, topic_name: str, traced: tuple[TracerProvider, InMemorySpanExporter], kind: str
) -> None:
    import asyncio

    from conftest import make_async_engine

    from delayq.aio import AsyncWorker

    provider, exporter = traced
    app = provider.get_tracer("app")
    topic = Topic(backend.engine, topic_name)
    topic.create(2)
    topic.publish_many([("a", "m1", 1), ("b", "m2", 2)])

    def body(d: TopicDelivery) -> None:
        with app.start_as_current_span(f"charge {d.message_id}"):
            pass

    async def handle(self: TopicHandler, d: TopicDelivery, conn: Any = None) -> None:
        await asyncio.sleep(0)
        body(d)

    if kind == "threads":
        assert Worker(backend.engine, [handler(topic_name, body)]).run_once() == 2
    else:
        h = handler(topic_name, body)
        if kind == "asyncio":
            h = type("Charging", (TopicHandler,), {"topic": topic_name, "group": "g", "handle": handle})()
        h.lease_duration = 3 * SECOND

        async def main() -> None:
            engine = make_async_engine(backend.url)
            worker = AsyncWorker(engine, [h], poll_interval=0.05 * SECOND, listen=False)
            worker.start()
            try:
                deadline = time.monotonic() + 30
                while len([s for s in exporter.get_finished_spans() if s.name.startswith("process")]) < 2:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
            finally:
                assert await worker.stop()
                await engine.dispose()

        asyncio.run(main())
    spans = exporter.get_finished_spans()
    processes = {s.attributes["messaging.message.conversation_id"]: s for s in spans if s.name.startswith("process")}  # type: ignore[index]
    for key, mid in (("a", "m1"), ("b", "m2")):
        [charge] = [s for s in spans if s.name == f"charge {mid}"]
        assert charge.parent is not None and charge.parent.span_id == processes[key].context.span_id


def test_top_shows_topics_with_their_groups_lag_and_rates(engine: sa.Engine, topic_name: str) -> None:
    topic = Topic(engine, topic_name)
    topic.create(2)
    topic.publish_many([(f"k{i}", f"m{i}", i) for i in range(5)])
    read_up_to(engine, topic_name, "billing", 1, ManualClock(dt.datetime.now(dt.UTC)))
    top = Top(engine)
    first = {(r.topic, r.group): r for r in top.snapshot().topics}
    row = first[(topic_name, "billing")]
    assert (row.partitions, row.published, row.published_per_s) == (2, 5, None)
    assert row.lag == sum(p.lag for p in group_lag(engine, topic_name, "billing")) and row.lag > 0
    topic.publish("k9", "m9", 9)
    second = {(r.topic, r.group): r for r in top.snapshot().topics}
    row = second[(topic_name, "billing")]
    assert row.published == 6 and row.published_per_s is not None and row.published_per_s > 0
    assert (f"{topic_name}_dlq", None) in second  # a topic no group reads: one line
    out = Console(record=True, width=200, file=io.StringIO())
    out.print(render(top.snapshot()))
    text = out.export_text()
    assert "topics" in text and topic_name in text and "billing" in text
    assert Top(engine, only=["some-queue"]).snapshot().topics == []


def test_the_async_worker_collects_garbage_and_counts_topic_metrics(
    backend: Backend, topic_name: str, clock: ManualClock
) -> None:
    import asyncio

    from conftest import make_async_engine

    from delayq.aio import AsyncWorker

    registry = CollectorRegistry()
    metrics = register(registry)
    seen: list[str] = []

    async def handle(self: TopicHandler, d: TopicDelivery, conn: Any = None) -> None:
        seen.append(d.message_id)

    cls = type("Collecting", (TopicHandler,), {"topic": topic_name, "group": "g", "handle": handle})
    cls.lease_duration = 3 * SECOND
    topic = Topic(backend.engine, topic_name, clock=clock)
    topic.create(2)
    topic.publish_many([(f"k{i}", f"m{i}", i) for i in range(6)])

    async def main() -> None:
        engine = make_async_engine(backend.url)
        worker = AsyncWorker(engine, [cls()], clock=clock, poll_interval=0.05 * SECOND, listen=False)
        worker._core.topic_gc.interval = 0.05
        worker.start()
        try:
            deadline = time.monotonic() + 30
            while sum(map(len, offsets_left(backend.engine, topic_name).values())) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert worker.health().loops["topics-gc"]
        finally:
            assert await worker.stop()
            await engine.dispose()

    try:
        asyncio.run(main())
        got = topic_samples(generate_latest(registry).decode(), topic_name)
    finally:
        unregister(metrics, registry)
    assert sorted(seen) == [f"m{i}" for i in range(6)]
    assert offsets_left(backend.engine, topic_name) == {}  # every message done by the one group: collected
    assert got["delayq_topic_delivered_total{group=g}"] == 6 and got["delayq_topic_acked_total{group=g}"] == 6
    assert got["delayq_topic_collected_total"] == 6
