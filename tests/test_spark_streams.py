"""Streaming reads of topics through real Spark queries (issue 31 rows 2-5 and 7), writes of ``payload_json``,
and the driver's one-line errors, on every backend. One SparkSession for the run (tests/test_spark.py's)."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from test_spark import spark as spark_session  # noqa: F401 (the run's one SparkSession)

import delayq.spark
from delayq import DelayedQueue, Topic
from delayq.schema import make_tables
from delayq.spark.stream import plan_limit
from delayq.topics import Subscription, partition_for
from delayq.topics.views import group_lag


@pytest.fixture
def spark(spark_session: SparkSession) -> SparkSession:  # noqa: F811
    delayq.spark.register(spark_session)
    return spark_session


@pytest.fixture
def topic_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def stream(spark: SparkSession, backend: Backend, topic: str, **options: str) -> DataFrame:
    return spark.readStream.format("delayq").option("url", backend.url).option("topic", topic).options(**options).load()


class Sink:
    """A ``foreachBatch`` sink on the driver: what each batch delivered, and an action before a batch reads."""

    def __init__(self, before: Callable[[int], None] | None = None) -> None:
        self.batches: list[tuple[int, list[tuple[str, int]]]] = []
        self.before = before
        self.lock = threading.Lock()

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        if self.before is not None:
            self.before(batch_id)
        rows = [(r["message_id"], r["partition"]) for r in df.select("message_id", "partition").collect()]
        with self.lock:
            self.batches.append((batch_id, rows))

    def ids(self) -> list[str]:
        with self.lock:
            return [m for _, rows in self.batches for m, _ in rows]


def run(df: DataFrame, sink: Sink, checkpoint: Path, **trigger: Any) -> Any:
    return df.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint)).trigger(**trigger).start()


def wait_for(check: Callable[[], bool], query: Any, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert query.exception() is None, query.exception()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_a_group_protects_a_new_query_before_its_first_batch_and_its_lag_reaches_zero(
    spark: SparkSession, backend: Backend, topic_name: str, tmp_path: Path
) -> None:
    """Rows 2 and 7. Another group has read everything, and garbage collection runs as batch 0 starts: the
    query's group must already hold its start (its rows were made only at its first commit, so batch 0
    failed with ``CollectedError``, for good). Once the stream has caught up, the lag view shows 0 (it
    showed the last batch, committed only when a next one was planned)."""
    topic = Topic(backend.engine, topic_name)
    topic.create(partitions=3)
    topic.publish_many([(f"k{i % 7}", f"m{i:03d}", {"n": i}) for i in range(90)])
    Subscription(backend.engine, topic_name, "done", "d1", start="latest", max_attempts=None).join()
    collected: list[int] = []
    sink = Sink(before=lambda batch: collected.append(topic.collect_garbage()) if batch == 0 else None)
    df = stream(spark, backend, topic_name, group="spark-g", maxRowsPerTrigger="40")
    query = run(df, sink, tmp_path / "ck", processingTime="300 milliseconds")
    try:
        wait_for(lambda: len(sink.ids()) >= 90, query)
        wait_for(lambda: all(p.lag == 0 for p in group_lag(backend.engine, topic_name, "spark-g")), query)
    finally:
        query.stop()
    assert collected == [0]
    assert sorted(sink.ids()) == [f"m{i:03d}" for i in range(90)]  # each once
    assert [p.watermark for p in group_lag(backend.engine, topic_name, "spark-g")] == [h.head for h in topic.heads()]
    assert topic.collect_garbage() == 90  # both groups are past everything now


def test_a_batch_the_sink_failed_is_never_committed_to_the_group(
    spark: SparkSession, backend: Backend, topic_name: str, tmp_path: Path
) -> None:
    """Row 7's bound: the watermarks follow what the sink committed, never a batch it failed."""
    topic = Topic(backend.engine, topic_name)
    topic.create(partitions=1)
    topic.publish_many([("k", f"m{i:03d}", {"n": i}) for i in range(30)])

    def fail_batch_1(batch: int) -> None:
        if batch == 1:
            raise RuntimeError("injected sink failure")

    sink = Sink(before=fail_batch_1)
    query = run(stream(spark, backend, topic_name, group="g", maxRowsPerTrigger="10"), sink, tmp_path / "ck",
                availableNow=True)  # fmt: skip
    with pytest.raises(Exception, match="injected sink failure"):
        query.awaitTermination(90)
    assert sink.ids() == [f"m{i:03d}" for i in range(10)]
    assert [p.watermark for p in group_lag(backend.engine, topic_name, "g")] == [10]
    sink.before = None  # the restarted query runs batch 1 again, and the rest
    again = run(stream(spark, backend, topic_name, group="g", maxRowsPerTrigger="10"), sink, tmp_path / "ck",
                availableNow=True)  # fmt: skip
    again.awaitTermination(90)
    assert sink.ids() == [f"m{i:03d}" for i in range(30)]
    assert [p.watermark for p in group_lag(backend.engine, topic_name, "g")] == [30]


def test_a_dead_letter_topic_with_requeued_and_purged_letters_streams_every_letter_left(
    spark: SparkSession, backend: Backend, topic_name: str, tmp_path: Path
) -> None:
    """Row 3: requeue and purge leave gaps in ``{topic}_dlq`` (its readers step over them); the streaming
    read failed with ``CollectedError`` for good, and its read limit counted offsets, not rows."""
    topic = Topic(backend.engine, topic_name)
    topic.create(partitions=2)
    topic.publish_many([(f"k{i % 5}", str(i), {"n": i}) for i in range(20)])
    billing = Subscription(backend.engine, topic_name, "billing", "b1", max_attempts=1)
    billing.rebalance()
    failed = 0
    while failed < 20:
        deliveries = billing.poll(10)
        assert deliveries
        failed += sum(1 for d in deliveries if d.nack(error="boom"))
    assert len(topic.dead_letters(limit=100)) == 20
    assert topic.purge_dead(message_id="3") == 1 and topic.purge_dead(message_id="17") == 1
    assert topic.requeue_dead(message_id="11") == 1
    left = sorted(f"billing:{i}" for i in range(20) if i not in (3, 11, 17))
    sink = Sink()
    df = stream(spark, backend, f"{topic_name}_dlq", maxRowsPerTrigger="4")
    query = run(df, sink, tmp_path / "ck", availableNow=True)
    query.awaitTermination(120)
    assert query.exception() is None, query.exception()
    assert sorted(sink.ids()) == left
    sizes = [len(rows) for _, rows in sink.batches if rows]
    assert max(sizes) <= 4 and sizes.count(4) >= len(sizes) - 2  # the limit counts rows, not offsets
    log = spark.read.format("delayq").option("url", backend.url).option("topic", f"{topic_name}_dlq").load()
    assert log.count() == 17


def test_a_read_limit_below_the_busy_partitions_reaches_every_partition(
    spark: SparkSession, backend: Backend, topic_name: str, tmp_path: Path
) -> None:
    """Row 4: 12 busy partitions and 8 rows per batch: the first two batches read from all 12 (partitions
    sorted as strings, one row each from the front, starved 6..9 for as long as the others had rows)."""
    topic = Topic(backend.engine, topic_name)
    topic.create(partitions=12)
    keys = {}
    for i in range(1000):
        keys.setdefault(partition_for(f"k{i}", 12), f"k{i}")
    topic.publish_many([(keys[p], f"{p}-{j}", {"n": j}) for p in range(12) for j in range(5)])
    sink = Sink()
    query = run(stream(spark, backend, topic_name, maxRowsPerTrigger="8"), sink, tmp_path / "ck", availableNow=True)
    query.awaitTermination(120)
    assert query.exception() is None, query.exception()
    assert sorted(sink.ids()) == sorted(f"{p}-{j}" for p in range(12) for j in range(5))
    first_two = {p for _, rows in sorted(sink.batches)[:2] for _, p in rows}
    assert first_two == set(range(12))


def test_a_read_limit_serves_the_partitions_in_turn() -> None:
    heads = {str(p): 1000 for p in range(12)}
    start = dict.fromkeys(heads, 0)
    for _ in range(50):
        start = plan_limit(start, heads, 8)
    assert min(start.values()) >= 33 and sum(start.values()) == 400


def test_payload_json_is_written_as_the_value_it_encodes(
    spark: SparkSession, backend: Backend, queue_name: str
) -> None:
    """Row 5: ``payload_json`` (JSON text, as a read returns it) written back, as itself or renamed ``payload``,
    by the data source or ``offer_dataframe``, is the object, not a string."""
    DelayedQueue(backend.engine, queue_name).offer_many([(f"k{i}", {"i": i}, dt.timedelta(hours=1)) for i in range(5)])
    read = spark.read.format("delayq").option("url", backend.url).option("queue", queue_name).load()
    writes: dict[str, Callable[[str], None]] = {
        "as-is": lambda q: (
            read.select("key", "payload_json")
            .write.format("delayq")
            .mode("append")
            .option("url", backend.url)
            .option("queue", q)
            .save()
        ),
        "renamed": lambda q: (
            read.select("key", F.col("payload_json").alias("payload"))
            .write.format("delayq")
            .mode("append")
            .option("url", backend.url)
            .option("queue", q)
            .save()
        ),
        "offer_dataframe": lambda q: delayq.spark.offer_dataframe(
            read, backend.url, q, key="key", payload="payload_json"
        ),
    }
    for name, write in writes.items():
        write(f"{queue_name}-{name}")
        msg = DelayedQueue(backend.engine, f"{queue_name}-{name}").get("k3")
        assert msg is not None and msg.payload == {"i": 3}, name


@pytest.mark.parametrize("scheme", ["postgresql+psycopg", "mysql+mysqldb"])
def test_an_unreachable_database_is_one_line(spark: SparkSession, scheme: str, queue_name: str) -> None:
    """Issue 30 row 9: the driver's first connection fails with one line (it was 66 lines of SQLAlchemy)."""
    url = f"{scheme}://u:secret@127.0.0.1:{closed_port()}/test"
    df = spark.range(3).select(F.format_string("k%d", "id").alias("key"), F.col("id").alias("payload"))
    with pytest.raises(Exception) as failed:
        df.write.format("delayq").mode("append").option("url", url).option("queue", queue_name).save()
    text = str(failed.value)
    assert "UnreachableDatabaseError: cannot reach the database at" in text, text
    assert "secret" not in text and "sqlalchemy" not in text and len(text.splitlines()) <= 10, (
        text
    )  # (Spark adds the frames)
    with pytest.raises(Exception, match="cannot reach the database"):
        spark.read.format("delayq").option("url", url).option("queue", queue_name).load().count()


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- row 6: the workers' Python ------------------------------------------------------------------------------
JOB = """
import sys
from pyspark.sql import SparkSession, functions as F
import delayq.spark
from delayq import migrations
url = sys.argv[1]
migrations.upgrade(url)
spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
delayq.spark.register(spark)
df = spark.range(4).select(F.format_string("k%d", "id").alias("key"), F.col("id").alias("payload"))
df.write.format("delayq").mode("append").option("url", url).option("queue", "venv").save()
spark.stop()
"""


@pytest.mark.slow
def test_a_job_run_by_a_venvs_python_without_it_on_path_runs_its_workers_there(tmp_path: Path) -> None:
    """Row 6: ``/path/venv/bin/python job.py`` with PATH not naming the venv: Spark started ``python3`` from
    PATH for its workers, which had no delayq. ``register`` points them at this interpreter."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"  # a python3 without delayq (or none); java is found here
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)  # this checkout's delayq
    done = subprocess.run([sys.executable, str(job), url], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    m = make_tables().messages
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).where(m.c.queue == "venv")).scalar_one() == 4
    engine.dispose()


def test_rows_collected_past_a_groups_watermarks_say_the_checkpoint_cannot_resume(
    backend: Backend, topic_name: str
) -> None:
    """Row 2's message: with a group, collected rows mean the group's watermarks were moved past the query
    (it no longer advises adding the group the query has). The reader driven directly."""
    from delayq.spark.options import SourceOptions
    from delayq.spark.stream import CollectedError, TopicStreamReader

    topic = Topic(backend.engine, topic_name)
    topic.create(partitions=1)
    topic.publish_many([(f"k{i}", f"m{i}", {"n": i}) for i in range(10)])
    reader = TopicStreamReader(SourceOptions.parse({"url": backend.url, "topic": topic_name, "group": "g"}))
    assert reader.initialOffset() == {"0": 0}
    assert [p.watermark for p in group_lag(backend.engine, topic_name, "g")] == [0]  # made before any batch
    assert topic.collect_garbage() == 0
    off = make_tables().topics.offsets
    with backend.engine.begin() as conn:  # another consumer of the group moves it past the query
        conn.execute(sa.update(off).where(off.c.topic == topic_name).values(acked_offset=4))
    assert topic.collect_garbage() == 4
    (part,) = reader.partitions({"0": 0}, {"0": 10})
    with pytest.raises(CollectedError, match=r"offsets 1\.\.10 of partition 0 .* start the query on a new checkpoint"):
        list(reader.read(part))
    reader.stop()
