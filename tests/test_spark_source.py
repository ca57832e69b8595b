"""The ``delayq`` Spark data source on every backend: batch reads and writes, filter pushdown, the streaming read
of a topic across a restart, streaming writes replayed. One SparkSession for the run (tests/test_spark.py's)."""

from __future__ import annotations

import datetime as dt
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyspark
import pytest
import sqlalchemy as sa
from conftest import Backend, count_rows
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.datasource import EqualTo, GreaterThanOrEqual, LessThan, StringStartsWith
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows
from test_spark import spark as spark_session  # noqa: F401 (the run's one SparkSession)

import delayq.spark
from delayq import DelayedQueue, Topic
from delayq.schema import make_tables
from delayq.spark.options import SourceOptions
from delayq.spark.read import (
    MESSAGE_SCHEMA,
    DelayqReader,
    PushdownReader,
    QueueSlice,
    condition,
    pushdown_supported,
)
from delayq.spark.source import DelayqDataSource
from delayq.spark.stream import CollectedError, TopicStreamReader, plan_limit
from delayq.spark.write import layout_for, write_rows
from delayq.topics import partition_for

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


@pytest.fixture
def spark(spark_session: SparkSession) -> SparkSession:  # noqa: F811
    delayq.spark.register(spark_session)
    return spark_session


@pytest.fixture
def topic_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def source(spark: SparkSession, backend: Backend, **options: Any) -> Any:
    return spark.read.format("delayq").option("url", backend.url).options(**options)


def save(df: DataFrame, backend: Backend, **options: Any) -> None:
    df.write.format("delayq").mode("append").option("url", backend.url).options(**options).save()


def orders(spark: SparkSession, rows: int) -> DataFrame:
    return spark.range(rows, numPartitions=3).select(
        F.format_string("order-%04d", "id").alias("key"),
        F.col("id").alias("n"),
        F.lit("gold").alias("plan"),
        F.timestamp_seconds(F.lit(int(T0.timestamp())) + F.col("id") * 60).alias("at"),
    )


def log_count(backend: Backend, topic: str) -> int:
    log = make_tables().topics.log
    with backend.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).where(log.c.topic == topic)).scalar_one())


# -- batch --------------------------------------------------------------------------------------------
def test_batch_write_offers_idempotently_then_reads_back_typed(
    spark: SparkSession, backend: Backend, queue_name: str
) -> None:
    df = orders(spark, 200)
    spark.conf.set("spark.sql.pyspark.worker.logging.enabled", "true")
    try:
        save(df, backend, queue=queue_name, chunk_size="64")
        assert count_rows(backend.engine, queue_name) == 200
        save(df, backend, queue=queue_name)  # again: every key exists, nothing new
        assert count_rows(backend.engine, queue_name) == 200
        reports = [
            r["msg"]
            for r in spark.tvf.python_worker_logs().where(F.col("logger") == "delayq.spark").collect()
            if queue_name in r["msg"]
        ]
        assert sorted(reports) == [  # (the log's rows come in no particular order)
            f"delayq: wrote to queue '{queue_name}': created 0, updated 0, ignored 200",
            f"delayq: wrote to queue '{queue_name}': created 200, updated 0, ignored 0",
        ]
    finally:
        spark.conf.unset("spark.sql.pyspark.worker.logging.enabled")
    changed = df.withColumn("plan", F.when(F.col("n") < 5, F.lit("platinum")).otherwise(F.col("plan")))
    save(changed, backend, queue=queue_name, update="true")
    q = DelayedQueue(backend.engine, queue_name)
    msg = q.get("order-0003")
    assert msg is not None and msg.payload == {"n": 3, "plan": "platinum"}
    assert msg.scheduled_at == T0 + dt.timedelta(minutes=3)  # an instant, whatever the session time zone

    read = source(spark, backend, queue=queue_name, partitions="3").load()
    assert read.count() == 200
    assert dict(read.dtypes) == {
        "id": "bigint",
        "queue": "string",
        "key": "string",
        "payload": "binary",
        "payload_type": "string",
        "payload_json": "string",
        "state": "string",
        "scheduled_at": "timestamp",
        "scheduled_at_initially": "timestamp",
        "created_at": "timestamp",
        "attempts": "int",
        "last_error": "string",
    }
    assert read.select("key").distinct().count() == 200
    # (A filtered query last: Spark 4.3 reuses a DataFrame's last pushed filters in its next unfiltered
    # query, see docs/spark.md; load() again for each.)
    row = read.where(F.col("key") == "order-0007").first()  # (and the rows read by the same DataFrame again)
    assert row is not None and row["payload_json"] == '{"n":7,"plan":"gold"}' and row["state"] == "scheduled"

    d = DelayedQueue(backend.engine, queue_name).try_poll()  # none is due: nothing to poll
    assert d is None
    DelayedQueue(backend.engine, queue_name).reschedule("order-0000", dt.timedelta(0))
    d = DelayedQueue(backend.engine, queue_name).try_poll()
    assert d is not None and d.dead_letter("bad")
    dead = source(spark, backend, queue=queue_name, dead="true").load()
    assert [(r["key"], r["last_error"], r["attempts"]) for r in dead.collect()] == [("order-0000", "bad", 1)]
    assert dict(dead.dtypes)["failed_at"] == "timestamp"
    assert source(spark, backend, queue=f"{queue_name}-empty").load().count() == 0


def test_a_read_of_finished_messages_exposes_their_states_results_and_durations(
    spark: SparkSession, backend: Backend, queue_name: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name, retention=dt.timedelta(hours=1))
    q.offer_many([(f"k{i}", {"n": i}, None) for i in range(3)])
    for d in q.try_poll_many(3):
        assert d.ack(result={"double": d.payload["n"] * 2}, duration=dt.timedelta(milliseconds=10 * d.payload["n"]))
    q.offer("live", 1)
    read = source(spark, backend, queue=queue_name, finished="true").load()
    assert dict(read.dtypes)["finished_at"] == "timestamp" and dict(read.dtypes)["duration_ms"] == "bigint"
    rows = sorted(read.collect(), key=lambda r: r["key"])
    assert [(r["key"], r["state"], r["result_json"], r["duration_ms"]) for r in rows] == [
        (f"k{i}", "completed", f'{{"double":{2 * i}}}', 10 * i) for i in range(3)
    ]
    filtered = source(spark, backend, queue=queue_name, finished="true").load()
    assert filtered.where(F.col("state") == "completed").count() == 3
    assert (
        source(spark, backend, queue=queue_name, finished="true").load().where(F.col("state") == "cancelled").count()
        == 0
    )
    fin = make_tables().finished  # a planner that pushes filters: the state is the stored number
    for state, n in (("completed", 3), ("cancelled", 0)):
        where = condition(fin, ("state", "in", [state]), None)
        with backend.engine.connect() as conn:
            stmt = sa.select(sa.func.count()).select_from(fin).where(fin.c.queue == queue_name, where)
            assert conn.execute(stmt).scalar_one() == n
    with pytest.raises(Exception, match="option 'finished' applies to a queue"):
        source(spark, backend, queue=queue_name, finished="true", dead="true").load().collect()


def test_filters_are_pushed_down_and_only_matching_rows_are_read(
    spark: SparkSession, backend: Backend, queue_name: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    now = dt.datetime.now(dt.UTC)
    q.offer_many(
        [(f"{kind}/{i:03d}", {"i": i}, now + dt.timedelta(hours=i)) for kind in ("a", "b") for i in range(1, 41)]
        + [("a/ready", {"i": 0}, now - dt.timedelta(hours=1)), ("A/015", {"i": 15}, now + dt.timedelta(hours=15))]
    )
    options = {"url": backend.url, "queue": queue_name, "partitions": "4"}
    low, high = now + dt.timedelta(hours=10, minutes=30), now + dt.timedelta(hours=20, minutes=30)
    df = (
        spark.read.format("delayq")
        .options(**options)
        .load()
        .where(F.col("key").startswith("a/") & (F.col("state") == "scheduled"))
        .where((F.col("scheduled_at") >= F.lit(low)) & (F.col("scheduled_at") < F.lit(high)))
    )
    assert sorted(r["key"] for r in df.select("key").collect()) == [f"a/{i:03d}" for i in range(11, 21)]
    plan = df._jdf.queryExecution().executedPlan().toString()
    # PySpark 4.2/4.3 reuse a DataFrame's plan in its later queries: the reader pushes nothing there.
    assert (" Filter " not in plan) == pushdown_supported(pyspark.__version__), plan

    # The reader's plan where pushdown is on: the same filters, in SQL, and the rows each input partition reads.
    assert isinstance(DelayqDataSource(options).reader(make_schema_placeholder()), DelayqReader)
    reader = PushdownReader(SourceOptions.parse(options), MESSAGE_SCHEMA)
    kept = list(
        reader.pushFilters(
            [
                StringStartsWith(("key",), "a/"),
                EqualTo(("state",), "scheduled"),
                GreaterThanOrEqual(("scheduled_at",), low),
                LessThan(("scheduled_at",), high),
                EqualTo(("payload_type",), "json"),
                EqualTo(("nested", "field"), 1),
            ]
        )
    )
    assert kept == [EqualTo(("payload_type",), "json"), EqualTo(("nested", "field"), 1)]  # (collations differ)
    parts = reader.partitions()
    slices = [p.value for p in parts]
    assert all(isinstance(s, QueueSlice) for s in slices)
    assert sum(s.rows for s in slices) == 10 and 1 <= len(parts) <= 4


def test_the_tag_option_reads_only_the_messages_carrying_the_tag(
    spark: SparkSession, backend: Backend, queue_name: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"k{i}", {"i": i}, None, ["eu"] if i % 3 == 0 else ["a_b"]) for i in range(12)])
    assert q.try_poll_many(1)[0].dead_letter("bad")  # k0: a dead letter tagged eu
    read = source(spark, backend, queue=queue_name, tag="eu").load()
    assert sorted(r["key"] for r in read.select("key").collect()) == ["k3", "k6", "k9"]
    dead = source(spark, backend, queue=queue_name, tag="eu", dead="true").load()
    assert [r["key"] for r in dead.select("key").collect()] == ["k0"]
    reader = DelayqReader(SourceOptions.parse({"url": backend.url, "queue": queue_name, "tag": "axb"}), MESSAGE_SCHEMA)
    assert sum(p.value.rows for p in reader.partitions()) == 0  # "_" is no wildcard
    with pytest.raises(Exception, match="option tag 'EU' must be"):
        SourceOptions.parse({"url": backend.url, "queue": queue_name, "tag": "EU"})


def make_schema_placeholder() -> Any:
    return MESSAGE_SCHEMA


def test_topic_batch_publish_is_idempotent_by_id_and_the_log_reads_back(
    spark: SparkSession, backend: Backend, topic_name: str
) -> None:
    Topic(backend.engine, topic_name).create(partitions=4)
    events = spark.range(120, numPartitions=3).select(
        F.format_string("customer-%02d", F.col("id") % 10).alias("key"),
        F.format_string("event-%04d", "id").alias("id"),
        F.struct(F.col("id").alias("n"), F.lit("placed").alias("status")).alias("payload"),
    )
    save(events, backend, topic=topic_name)
    save(events, backend, topic=topic_name)
    assert log_count(backend, topic_name) == 120
    log = source(spark, backend, topic=topic_name).load()
    assert log.count() == 120
    assert dict(log.dtypes)["offset"] == "bigint" and dict(log.dtypes)["published_at"] == "timestamp"
    per_key = log.where(F.col("partition_key") == "customer-03").orderBy("offset").collect()
    assert sorted(r["message_id"] for r in per_key) == [f"event-{i:04d}" for i in range(3, 120, 10)]
    assert {r["payload_json"] for r in per_key} >= {'{"n":3,"status":"placed"}'}
    fresh = source(spark, backend, topic=topic_name).load()  # (a new load: see the caveat in docs/spark.md)
    per_partition = {
        r["partition"]: sorted(r["offsets"])
        for r in fresh.groupBy("partition").agg(F.collect_list("offset").alias("offsets")).collect()
    }
    assert all(offsets == list(range(1, len(offsets) + 1)) for offsets in per_partition.values())  # gap-free
    one = per_key[0]["partition"]
    only = source(spark, backend, topic=topic_name).load().where(F.col("partition") == one)
    assert only.count() == len(per_partition[one])


# -- streaming ----------------------------------------------------------------------------------------
def publish(backend: Backend, topic: str, start: int, stop: int) -> None:
    Topic(backend.engine, topic).publish_many(
        [(f"customer-{i % 7}", f"order-{i:05d}", {"n": i}) for i in range(start, stop)]
    )


def follow_ups(spark: SparkSession, backend: Backend, topic: str, **options: Any) -> DataFrame:
    """Each order event as a follow-up message keyed by its order id, due a day after it was published."""
    return (
        spark.readStream.format("delayq")
        .option("url", backend.url)
        .option("topic", topic)
        .options(**options)
        .load()
        .select(
            F.concat(F.lit("follow-up/"), "message_id").alias("key"),
            (F.col("published_at") + F.expr("INTERVAL 1 DAY")).alias("at"),
            F.get_json_object("payload_json", "$.n").cast("long").alias("n"),
            F.col("partition"),
            F.col("offset"),
        )
    )


def start(df: DataFrame, backend: Backend, checkpoint: Path, trigger: dict[str, Any], **options: Any) -> Any:
    return (
        df.writeStream.format("delayq")
        .option("url", backend.url)
        .options(**options)
        .option("checkpointLocation", str(checkpoint))
        .trigger(**trigger)
        .start()
    )


def uncommit(checkpoint: Path, *, last_only: bool) -> None:
    """Remove commit markers (and their checksums), as if the query died before committing those batches."""
    batches = sorted(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    for batch in batches[-1:] if last_only else batches:
        (checkpoint / "commits" / str(batch)).unlink()
        (checkpoint / "commits" / f".{batch}.crc").unlink(missing_ok=True)


def keys(backend: Backend, queue: str) -> list[str]:
    m = make_tables().messages
    with backend.engine.connect() as conn:
        return sorted(conn.execute(sa.select(m.c.key).where(m.c.queue == queue)).scalars())


def test_a_stream_stopped_mid_way_and_restarted_from_its_checkpoint_delivers_each_message_once(
    spark: SparkSession, backend: Backend, topic_name: str, queue_name: str, tmp_path: Path
) -> None:
    Topic(backend.engine, topic_name).create(partitions=3)
    publish(backend, topic_name, 0, 300)
    checkpoint = tmp_path / "checkpoint"
    stream = follow_ups(spark, backend, topic_name, maxRowsPerTrigger="40", group="spark-follow-ups")
    query = start(stream, backend, checkpoint, {"processingTime": "200 milliseconds"}, queue=queue_name)
    try:
        deadline = time.monotonic() + 60
        while count_rows(backend.engine, queue_name) < 80 and time.monotonic() < deadline:
            assert query.exception() is None, query.exception()
            time.sleep(0.1)
    finally:
        query.stop()
    done = count_rows(backend.engine, queue_name)
    assert 80 <= done < 300  # stopped mid-stream
    batches = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert batches and max(batches) <= 40  # the read limit per trigger

    # The last completed batch is replayed too: its commit marker is removed, as if the query had died
    # between the sink's write and the checkpoint's commit.
    uncommit(checkpoint, last_only=True)
    publish(backend, topic_name, 300, 360)  # more arrive while it is down
    query = start(stream, backend, checkpoint, {"availableNow": True}, queue=queue_name)
    query.awaitTermination(120)
    assert keys(backend, queue_name) == sorted(f"follow-up/order-{i:05d}" for i in range(360))

    q = DelayedQueue(backend.engine, queue_name)
    msg = q.get("follow-up/order-00042")
    assert msg is not None and msg.payload["n"] == 42 and msg.scheduled_at > dt.datetime.now(dt.UTC)
    # The group's watermarks follow the batches the sink committed, the last one included (the source moves them
    # as the next batch is planned, which AvailableNow does once more before it stops).
    off = make_tables().topics.offsets
    with backend.engine.connect() as conn:
        marks = conn.execute(
            sa.select(sa.func.sum(off.c.acked_offset)).where(
                off.c.consumer_group == "spark-follow-ups", off.c.topic == topic_name
            )
        ).scalar_one()
    assert int(marks) == 360


def test_a_replayed_streaming_write_into_a_topic_creates_nothing_twice(
    spark: SparkSession, postgres: Backend, topic_name: str, tmp_path: Path
) -> None:
    """(One backend: the sink's idempotence is the topic's, which tests/test_topics.py holds on all three;
    the queue sink is replayed on every backend in the test above.)"""
    backend = postgres
    Topic(backend.engine, topic_name).create(partitions=2)
    target = f"{topic_name}-out"
    Topic(backend.engine, target).create(partitions=2)
    publish(backend, topic_name, 0, 50)
    checkpoint = tmp_path / "checkpoint"
    stream = (
        spark.readStream.format("delayq")
        .option("url", backend.url)
        .option("topic", topic_name)
        .load()
        .select(F.col("partition_key").alias("key"), F.col("message_id").alias("id"), "payload_json")
    )
    start(stream, backend, checkpoint, {"availableNow": True}, topic=target).awaitTermination(60)
    assert log_count(backend, target) == 50
    uncommit(checkpoint, last_only=False)  # every batch runs again
    start(stream, backend, checkpoint, {"availableNow": True}, topic=target).awaitTermination(60)
    assert log_count(backend, target) == 50


def test_a_micro_batch_ends_at_the_committed_heads_so_a_late_commit_is_read_later(
    backend: Backend, topic_name: str
) -> None:
    """The stream reader's offsets, driven directly (no Spark): a publisher holding its transaction open is
    not in the batch planned meanwhile, and lands in the next one, not skipped."""
    if backend.name == "sqlite":
        pytest.skip("SQLite runs one writer at a time: no publisher commits while another is open")
    topic = Topic(backend.engine, topic_name)
    topic.create(partitions=2)
    late_key = next(f"k{i}" for i in range(100) if partition_for(f"k{i}", 2) == 0)
    other_key = next(f"k{i}" for i in range(100) if partition_for(f"k{i}", 2) == 1)
    reader = TopicStreamReader(SourceOptions.parse({"url": backend.url, "topic": topic_name}))
    start = reader.initialOffset()
    assert start == {"0": 0, "1": 0}
    with backend.engine.connect() as late, late.begin():
        topic.publish(late_key, "late", {"n": 0}, using=late)  # offset 1 of partition 0, not committed yet
        topic.publish(other_key, "early", {"n": 1})
        first = reader.latestOffset(start, ReadAllAvailable())
        assert first == {"0": 0, "1": 1}
    second = reader.latestOffset(first, ReadAllAvailable())
    assert second == {"0": 1, "1": 1}
    (part,) = reader.partitions(first, second)
    assert [m for batch in reader.read(part) for m in batch.column("message_id").to_pylist()] == ["late"]
    assert reader.latestOffset(second, ReadMaxRows(5)) == second
    reader.stop()


@pytest.mark.parametrize("missing", [(1, 2), (5,), (10,)], ids=["oldest", "inside-a-chunk", "newest"])
def test_a_gap_in_the_log_fails_the_stream_read_wherever_it_falls(
    backend: Backend, topic_name: str, missing: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows collected before a query without a group read them fail its batch (``CollectedError``, naming
    the first missing offset) rather than being skipped: at the start of a fetched chunk, inside one, or at
    the end of the range. The reader driven directly, fetching chunks of 3 rows. (A gap above the collected
    offset, a dead letter requeued or purged, is stepped over: tests/test_spark_streams.py.)"""
    monkeypatch.setattr("delayq.spark.read.ARROW_BATCH", 3)
    topic = Topic(backend.engine, topic_name)
    topic.create(partitions=1)
    topic.publish_many([(f"k{i}", f"m{i}", {"n": i}) for i in range(10)])
    reader = TopicStreamReader(SourceOptions.parse({"url": backend.url, "topic": topic_name}))
    (part,) = reader.partitions({"0": 0}, {"0": 10})
    batches = list(reader.read(part))
    assert [b.num_rows for b in batches] == [3, 3, 3, 1]
    assert [o for b in batches for o in b.column("offset").to_pylist()] == list(range(1, 11))
    topics = make_tables().topics
    with backend.engine.begin() as conn:  # collected as garbage collection would: the rows and the mark
        conn.execute(
            sa.delete(topics.log).where(topics.log.c.topic == topic_name, topics.log.c.message_offset.in_(missing))
        )
        conn.execute(sa.update(topics.heads).where(topics.heads.c.topic == topic_name).values(collected=max(missing)))
    with pytest.raises(CollectedError, match=f"offsets {missing[0]}..10 of partition 0 "):
        list(reader.read(part))
    reader.stop()


def test_a_time_no_datetime_can_hold_reads_as_the_earliest_or_latest(backend: Backend, queue_name: str) -> None:
    """(As ``delayq.clock.from_ms``: a time written by hand fails no read.) The reader driven directly."""
    DelayedQueue(backend.engine, queue_name).offer("far", {"n": 1}, at=dt.timedelta(hours=1))
    m = make_tables().messages
    with backend.engine.begin() as conn:
        conn.execute(sa.update(m).where(m.c.queue == queue_name).values(scheduled_at=10**16, created_at=-(10**16)))
    reader = DelayqReader(SourceOptions.parse({"url": backend.url, "queue": queue_name}), MESSAGE_SCHEMA)
    (part,) = reader.partitions()
    (row,) = [r for batch in reader.read(part) for r in batch.to_pylist()]
    assert row["scheduled_at"] == dt.datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=dt.UTC)
    assert row["created_at"] == dt.datetime.min.replace(tzinfo=dt.UTC)
    assert (row["key"], row["state"], row["payload_json"]) == ("far", "scheduled", '{"n":1}')


def test_a_read_limit_is_shared_between_the_partitions() -> None:
    assert plan_limit({"0": 0, "1": 5, "2": 9}, {"0": 100, "1": 6, "2": 9}, 10) == {"0": 9, "1": 6, "2": 9}
    assert plan_limit({"0": 0, "1": 0}, {"0": 3, "1": 3}, 100) == {"0": 3, "1": 3}
    assert plan_limit({"0": 0, "1": 0}, {"0": 50, "1": 50}, 7) == {"0": 4, "1": 3}


# -- bad options --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)  # the checks run before any database work
@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"url": None}, "needs the database URL"),
        ({"url": "sqlite://"}, "in-memory SQLite"),
        ({"url": "sqlite:///:memory:"}, "in-memory SQLite"),
        ({"topic": "t"}, "exactly one of the options"),
        ({"queue": None}, "exactly one of the options"),
        ({"queue": None, "topic": "no-such-topic"}, "topic 'no-such-topic' does not exist"),
        ({"bogus": "1"}, "unknown option"),
        ({"update": "maybe"}, "must be true or false"),
    ],
)
def test_bad_options_fail_before_anything_is_written(
    spark: SparkSession, backend: Backend, queue_name: str, options: dict[str, Any], says: str
) -> None:
    given = {"url": backend.url, "queue": queue_name, **options}
    writer = orders(spark, 10).write.format("delayq").mode("append")
    reader = spark.read.format("delayq")
    for name, value in given.items():
        if value is not None:
            writer, reader = writer.option(name, value), reader.option(name, value)
    with pytest.raises(Exception, match=says):
        writer.save()
    if "url" in options or "no-such-topic" in says:  # reads check the same options: two of them suffice
        with pytest.raises(Exception, match=says):
            reader.load().collect()
    assert count_rows(backend.engine, queue_name) == 0


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda df: df.withColumn("at", F.col("at").cast("timestamp_ntz")), "TIMESTAMP_NTZ"),
        (lambda df: df.withColumn("at", F.col("at").cast("string")), "not a timestamp"),
        (lambda df: df.withColumnRenamed("key", "customer"), "needs a string column 'key'"),
        (lambda df: df.withColumn("key", F.col("n")), "not a string"),
    ],
)
def test_bad_columns_fail_before_anything_is_written(
    spark: SparkSession, backend: Backend, queue_name: str, change: Any, says: str
) -> None:
    with pytest.raises(Exception, match=says):
        save(change(orders(spark, 10)), backend, queue=queue_name)
    assert count_rows(backend.engine, queue_name) == 0


def test_a_write_task_offers_every_chunk_on_one_connection(
    backend: Backend, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection per chunk (connect, and on PostgreSQL unprepared statements) cost the writer 0.3 of the
    raw insert's rate: a task connects once, whatever its number of chunks."""
    connects: list[object] = []
    make = SourceOptions.engine

    def counted(opts: SourceOptions) -> sa.Engine:
        engine = make(opts)
        sa.event.listen(engine, "connect", lambda conn, _: connects.append(conn))
        return engine

    monkeypatch.setattr(SourceOptions, "engine", counted)
    opts = SourceOptions.parse({"url": backend.url, "queue": queue_name, "chunk_size": "10"})
    schema = T.StructType([T.StructField("key", T.StringType()), T.StructField("payload", T.LongType())])
    batches = [
        pa.record_batch({"key": [f"k{i:03d}" for i in range(b, b + 25)], "payload": list(range(b, b + 25))})
        for b in range(0, 100, 25)
    ]
    counts = write_rows(opts, layout_for(opts, schema), iter(batches))
    assert (counts.created, counts.ignored, len(connects)) == (100, 0, 1)  # 10 chunks, one connection
    again = write_rows(opts, layout_for(opts, schema), iter(batches[:1]))
    assert (again.created, again.ignored) == (0, 25)
    assert DelayedQueue(backend.engine, queue_name).get("k042").payload == 42  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_overwrite_and_a_stream_of_a_queue_are_refused(spark: SparkSession, backend: Backend, queue_name: str) -> None:
    writer = orders(spark, 10).write.format("delayq").option("url", backend.url).option("queue", queue_name)
    with pytest.raises(Exception, match="appends"):
        writer.mode("overwrite").save()
    stream = spark.readStream.format("delayq").option("url", backend.url).option("queue", queue_name).load()
    with pytest.raises(Exception, match="needs the option 'topic'"):
        stream.writeStream.format("noop").start().awaitTermination(60)  # (Spark asks for the reader at start)
    assert count_rows(backend.engine, queue_name) == 0


# -- the example, end to end ---------------------------------------------------------------------------
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "spark_orders" / "pipeline.py"


def run_example(url: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), url, *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_orders_pipeline_example_runs_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    url, checkpoint = f"sqlite:///{tmp_path / 'orders.db'}", str(tmp_path / "checkpoint")
    first = run_example(url, "--orders", "40", "--checkpoint", checkpoint)
    assert "streaming job: 40 order events read" in first
    # 09:00 in Tokyo, Berlin, New York and Sydney: four UTC hours (which ones depends on daylight saving time)
    assert re.search(r"\{(\d+: 10, ){3}\d+: 10\}", first), first
    assert "worker: handled 40 follow-ups" in first
    second = run_example(url, "--orders", "60", "--checkpoint", checkpoint)  # 20 new orders
    assert "published 20 new order events" in second
    assert "streaming job: 20 order events read" in second and "worker: handled 20 follow-ups" in second


@pytest.mark.slow
@pytest.mark.cluster
def test_the_example_runs_on_a_standalone_cluster(tmp_path: Path) -> None:
    """A master and a worker process of the installed pyspark on 127.0.0.1, instead of local[*]."""
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    java = [os.path.join(home, "bin", "spark-class")]
    env = {
        **os.environ,
        "SPARK_HOME": home,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": str(EXAMPLE.parent.parent.parent),  # the executors import this checkout's delayq
    }
    port = free_port()
    master = subprocess.Popen(
        [
            *java,
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--webui-port",
            str(free_port()),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker = subprocess.Popen(
        [
            *java,
            "org.apache.spark.deploy.worker.Worker",
            f"spark://127.0.0.1:{port}",
            "--cores",
            "2",
            "--memory",
            "1g",
            "--host",
            "127.0.0.1",
            "--webui-port",
            str(free_port()),
            "--work-dir",
            str(tmp_path / "work"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"sqlite:///{tmp_path / 'orders.db'}"
        out = run_example(
            url, "--orders", "40", "--checkpoint", str(tmp_path / "ck"), "--master", f"spark://127.0.0.1:{port}"
        )
        assert "streaming job: 40 order events read" in out and "worker: handled 40 follow-ups" in out
    finally:
        for process in (worker, master):
            process.terminate()
            process.wait(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
