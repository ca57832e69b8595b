"""The ``delayq`` data source never answers a query with rows it did not ask for: a sequence of queries on one
DataFrame, and every filter the reader can push checked against Spark evaluating it on the unpushed rows
(a differential test over generated filters), on every backend. One SparkSession for the run."""

from __future__ import annotations

import datetime as dt
import random
import uuid
from typing import Any

import pytest
from conftest import Backend
from pyspark.sql import Column, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.datasource import (
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    IsNull,
    LessThan,
    LessThanOrEqual,
    StringStartsWith,
)
from test_spark import spark as spark_session  # noqa: F401 (the run's one SparkSession)

import delayq.spark
from delayq import DelayedQueue, Topic
from delayq.spark.options import SourceOptions
from delayq.spark.read import LOG_SCHEMA, MESSAGE_SCHEMA, PushdownReader, schema_for


@pytest.fixture
def spark(spark_session: SparkSession) -> SparkSession:  # noqa: F811
    delayq.spark.register(spark_session)
    return spark_session


def test_a_query_without_filters_after_a_filtered_one_reads_every_row(
    spark: SparkSession, backend: Backend, queue_name: str
) -> None:
    """Issue 31 row 1: PySpark 4.3 reused the plan pushed for ``where(key LIKE …)`` in the next query on the same
    DataFrame (count 2000, then 100, then 100 again). Rows offered after the first query are read too."""
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"sp-{i:05d}", {"i": i}, dt.timedelta(hours=1)) for i in range(2000)])
    r = spark.read.format("delayq").option("url", backend.url).option("queue", queue_name).load()
    assert r.count() == 2000
    assert r.where("key LIKE 'sp-001%'").count() == 100
    assert r.count() == 2000
    assert r.agg(F.min("key")).first()[0] == "sp-00000"  # type: ignore[index]


def test_a_dataframe_read_again_sees_later_offers_and_states(
    spark: SparkSession, backend: Backend, queue_name: str
) -> None:
    """The first plan's id ranges are open, and each task computes the state when it reads."""
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"sp-{i:05d}", {"i": i}, dt.timedelta(hours=1)) for i in range(2000)])
    r = spark.read.format("delayq").option("url", backend.url).option("queue", queue_name).load()
    assert r.where(F.col("key").startswith("sp-0199")).count() == 10
    assert r.count() == 2000
    q.offer_many([(f"sp-{i:05d}", {"i": i}, dt.timedelta(hours=1)) for i in range(2000, 2050)])
    assert r.count() == 2050
    assert r.agg(F.max("key")).first()[0] == "sp-02049"  # type: ignore[index]
    q.reschedule("sp-00007", dt.timedelta(0))
    assert [x["key"] for x in r.where("state = 'ready'").collect()] == ["sp-00007"]  # the state as of the read


def test_a_topic_read_without_filters_after_a_filtered_one_reads_every_row(
    spark: SparkSession, backend: Backend
) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"
    topic = Topic(backend.engine, name)
    topic.create(partitions=4)
    topic.publish_many([(f"k{i % 9}", f"m{i:04d}", {"n": i}) for i in range(300)])
    log = spark.read.format("delayq").option("url", backend.url).option("topic", name).load()
    assert log.count() == 300
    assert log.where(F.col("partition") == 1).count() < 300
    assert log.where(F.col("message_id") == "m0007").count() == 1
    assert log.count() == 300
    topic.publish_many([(f"k{i % 9}", f"m{i:04d}", {"n": i}) for i in range(300, 320)])
    assert log.count() == 320  # read up to the heads as each task starts


# -- the differential test of pushed filters --------------------------------------------------------------
T0 = dt.datetime(2031, 3, 1, tzinfo=dt.UTC)
KEYS = ["a", "a/1", "a/2", "a_1", "a%1", "A/1", "b", "b/é", "b/ü", "ab", "a\\1", "sp-1", "x y", "%"]
TIMES = [T0 + dt.timedelta(minutes=m, microseconds=us) for m in (0, 5, 30, 90) for us in (0, 999, 1000, 1500)]


def _column(name: str) -> Column:
    return F.col(f"`{name}`")


def _spark_condition(f: Filter) -> Column:
    """The same filter as Spark evaluates it."""
    col = _column(f.attribute[0])
    if isinstance(f, EqualTo):
        return col == F.lit(f.value)
    if isinstance(f, In):
        return col.isin(list(f.value))
    if isinstance(f, StringStartsWith):
        return col.startswith(f.value)
    if isinstance(f, IsNull):
        return col.isNull()
    ops = {GreaterThan: "__gt__", GreaterThanOrEqual: "__ge__", LessThan: "__lt__", LessThanOrEqual: "__le__"}
    return getattr(col, ops[type(f)])(F.lit(f.value))


def _generate(rng: random.Random, columns: dict[str, list[Any]]) -> Filter:
    name = rng.choice(sorted(columns))
    values = columns[name]
    value = rng.choice(values)
    if isinstance(value, str):
        kind = rng.choice(["eq", "in", "prefix"] if name != "state" else ["eq", "in"])
        if kind == "prefix":
            return StringStartsWith((name,), rng.choice([value[: rng.randint(0, len(value))], value + " ", "a_", "a%"]))
        if kind == "in":
            return In((name,), (*rng.sample(values, min(3, len(values))), value + " "))
        return EqualTo((name,), rng.choice([value, value + " ", value.upper()]))
    kind = rng.choice([EqualTo, GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual, In])
    if kind is In:
        return In((name,), tuple(rng.sample(values, min(3, len(values)))))
    return kind((name,), value)


def _differential(
    spark: SparkSession, options: dict[str, str], rows: list[dict[str, Any]], columns: dict[str, list[Any]], ident: str
) -> None:
    """200 generated conjunctions of 1-3 filters: the rows the reader returns with the filters it takes
    pushed equal the rows for which Spark, evaluating those filters itself, holds them all."""
    opts = SourceOptions.parse(options)
    schema = schema_for(opts)
    rng = random.Random(31)
    cases: list[tuple[list[Filter], list[Filter]]] = []
    answers: list[set[Any]] = []
    for _ in range(200):
        filters = [_generate(rng, columns) for _ in range(rng.randint(1, 3))]
        reader = PushdownReader(opts, schema)
        kept = list(reader.pushFilters(filters))
        pushed = [f for f in filters if f not in kept]
        cases.append((filters, pushed))
        answers.append(
            {r[ident] for part in reader.partitions() for batch in reader.read(part) for r in batch.to_pylist()}
        )
    assert sum(1 for _, pushed in cases if pushed) > 150  # most cases push something
    table = spark.createDataFrame(rows, schema)
    agg = [
        F.collect_set(F.when(_conjunction(pushed), _column(ident))).alias(f"c{i}")
        for i, (_, pushed) in enumerate(cases)
    ]
    expected = table.agg(*agg).first()
    assert expected is not None
    for i, (filters, pushed) in enumerate(cases):
        assert answers[i] == set(expected[f"c{i}"]), (filters, pushed)


def _conjunction(filters: list[Filter]) -> Column:
    out = F.lit(True)
    for f in filters:
        out = out & _spark_condition(f)
    return out


@pytest.mark.slow
def test_every_pushed_filter_gives_the_rows_spark_gives_on_a_queue(
    spark: SparkSession, backend: Backend, queue_name: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    now = dt.datetime.now(dt.UTC)
    q.offer_many([(k, {"k": k}, TIMES[i % len(TIMES)]) for i, k in enumerate(KEYS)])
    q.offer("ready", {"k": 0}, at=now - dt.timedelta(minutes=5))
    d = DelayedQueue(backend.engine, queue_name).try_poll()  # the ready one is held: in_flight while locked
    assert d is not None
    options = {"url": backend.url, "queue": queue_name, "partitions": "3"}
    rows = spark.read.format("delayq").options(**options).load().collect()  # no filter: every row
    assert len(rows) == len(KEYS) + 1
    ids = sorted(r["id"] for r in rows)
    columns = {
        "key": [*KEYS, "ready", "nope"],
        "queue": [queue_name, "other"],
        "state": ["ready", "scheduled", "in_flight", "gone"],
        "id": [ids[0], ids[3], ids[-1], ids[-1] + 1],
        "attempts": [0, 1, 2],
        "scheduled_at": [*TIMES, now],
        "created_at": [r["created_at"] for r in rows[:3]] + [now + dt.timedelta(days=1)],
        "scheduled_at_initially": TIMES,
        "last_error": ["x", "y"],
        "payload_type": ["json", "JSON"],
    }
    _differential(spark, options, [r.asDict() for r in rows], columns, "id")


@pytest.mark.slow
def test_every_pushed_filter_gives_the_rows_spark_gives_on_a_topic(spark: SparkSession, backend: Backend) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"
    topic = Topic(backend.engine, name)
    topic.create(partitions=3)
    topic.publish_many([(KEYS[i % len(KEYS)], f"{KEYS[i % 5]}-{i}", {"n": i}) for i in range(60)])
    options = {"url": backend.url, "topic": name, "partitions": "2"}
    rows = spark.read.format("delayq").options(**options).load().collect()
    assert len(rows) == 60
    published = sorted({r["published_at"] for r in rows})
    columns = {
        "partition_key": [*KEYS, "nope"],
        "message_id": [r["message_id"] for r in rows[:10]] + ["a-0 ", "A-0"],
        "topic": [name, "other"],
        "partition": [0, 1, 2, 3],
        "offset": [1, 5, 12, 30],
        "published_at": [published[0], published[-1], published[0] + dt.timedelta(microseconds=500)],
        "payload_type": ["json"],
    }
    _differential(spark, options, [r.asDict() for r in rows], columns, "message_id")


def test_the_schemas_the_differential_test_covers() -> None:
    """(Guard: a new column of the read schemas gets a place in the generated filters.)"""
    assert set(MESSAGE_SCHEMA.fieldNames()) - {"payload", "payload_json"} <= {
        "id", "queue", "key", "state", "scheduled_at", "scheduled_at_initially", "created_at", "attempts",
        "last_error", "payload_type",
    }  # fmt: skip
    assert set(LOG_SCHEMA.fieldNames()) - {"payload", "payload_json"} <= {
        "topic", "partition", "offset", "partition_key", "message_id", "published_at", "payload_type",
    }  # fmt: skip
