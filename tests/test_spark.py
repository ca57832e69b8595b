"""delayq.spark on every backend, with one local SparkSession that retries failed tasks (local[2,3])."""

from __future__ import annotations

import datetime as dt
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Backend, count_rows
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from spark_faults import fail_first_attempt_half_way

from delayq import DelayedQueue, DelayqError
from delayq.spark import OfferCounts, offer_dataframe, read_messages

ROWS = 1000


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    tests = str(Path(__file__).parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    os.environ["PYSPARK_PYTHON"] = sys.executable  # executors run this interpreter, with delayq installed
    session = (
        SparkSession.builder.master("local[2,3]")
        .appName("delayq-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "America/New_York")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def renewals(spark: SparkSession, rows: int = ROWS) -> DataFrame:
    return spark.range(rows, numPartitions=4).select(
        F.concat(F.lit("renewal-"), F.col("id").cast("string")).alias("customer"),
        F.col("id").alias("n"),
        F.lit("gold").alias("plan"),
        F.timestamp_seconds(F.lit(1893456000) + F.col("id") * 60).alias("remind_at"),
    )


def test_offer_counts_then_all_ignored_then_only_changes_updated(
    spark: SparkSession, backend: Backend, queue_name: str
) -> None:
    df = renewals(spark)
    first = offer_dataframe(
        df, backend.url, queue_name, key="customer", payload=["n", "plan"], at="remind_at", chunk_size=100
    )
    assert first == OfferCounts(created=ROWS)
    assert count_rows(backend.engine, queue_name) == ROWS
    again = offer_dataframe(df, backend.url, queue_name, key="customer", payload=["n", "plan"], at="remind_at")
    assert again == OfferCounts(ignored=ROWS)
    changed = df.withColumn("plan", F.when(F.col("n") < 10, F.lit("platinum")).otherwise(F.col("plan")))
    third = offer_dataframe(
        changed, backend.url, queue_name, key="customer", payload=["n", "plan"], at="remind_at", update=True
    )
    assert third == OfferCounts(updated=10, ignored=ROWS - 10)
    q = DelayedQueue(backend.engine, queue_name)
    msg = q.get("renewal-3")
    assert msg is not None and msg.payload == {"n": 3, "plan": "platinum"}
    # TimestampType is an instant: the session time zone (New York) changes nothing.
    assert msg.scheduled_at == dt.datetime(2030, 1, 1, 0, 3, tzinfo=dt.UTC)


def test_a_task_failing_half_way_is_retried_and_each_key_is_one_message(
    spark: SparkSession, backend: Backend, queue_name: str
) -> None:
    counts = offer_dataframe(
        renewals(spark),
        backend.url,
        queue_name,
        key="customer",
        payload="n",
        at=dt.timedelta(hours=1),
        chunk_size=50,
        _after_chunk=fail_first_attempt_half_way,
    )
    assert count_rows(backend.engine, queue_name) == ROWS
    assert counts.total == ROWS
    assert counts.ignored == 100  # the two chunks the failed attempt wrote, found again by the retry
    assert counts.created == ROWS - 100


def test_read_messages_and_dead_letters_as_dataframes(spark: SparkSession, backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"k{i}", {"i": i}, None) for i in range(30)])
    d = q.try_poll()
    assert d is not None and d.dead_letter("bad")
    live = read_messages(spark, backend.url, queue_name, partitions=3)
    assert live.count() == 29
    assert dict(live.dtypes)["scheduled_at"] == "timestamp"
    row = live.where(F.col("key") == "k5").first()
    assert row is not None and row["payload_json"] == '{"i": 5}' and row["attempts"] == 0
    dead = read_messages(spark, backend.url, queue_name, dead=True).collect()
    assert [(r["key"], r["last_error"]) for r in dead] == [("k0", "bad")]
    assert read_messages(spark, backend.url, "nothing-here").count() == 0


@pytest.mark.parametrize(
    ("change", "kwargs", "says"),
    [
        (lambda df: df, {"key": "missing"}, "no column 'missing'"),
        (
            lambda df: df.withColumn("customer", F.when(F.col("n") == 7, None).otherwise(F.col("customer"))),
            {},
            "null, empty or over-long key",
        ),
        (
            lambda df: df.withColumn(
                "customer", F.when(F.col("n") == 7, F.lit("x" * 201)).otherwise(F.col("customer"))
            ),
            {},
            "null, empty or over-long key",
        ),
        (lambda df: df.withColumn("remind_at", F.col("remind_at").cast("timestamp_ntz")), {}, "TIMESTAMP_NTZ"),
        (lambda df: df, {"url": "sqlite://"}, "in-memory SQLite"),
        (lambda df: df, {"url": "oracle+oracledb://u:p@h/x"}, "does not run on"),
    ],
)
def test_bad_input_fails_before_anything_is_written(
    spark: SparkSession, backend: Backend, queue_name: str, change, kwargs, says
) -> None:  # type: ignore[no-untyped-def]
    args = {"key": "customer", "payload": "n", "at": "remind_at", **kwargs}
    url = args.pop("url", backend.url)
    with pytest.raises(DelayqError, match=says):
        offer_dataframe(change(renewals(spark)), url, queue_name, **args)
    assert count_rows(backend.engine, queue_name) == 0
