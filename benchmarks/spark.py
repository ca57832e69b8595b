"""Spark and delayq: the data source's batch writes and streaming read beside raw-SQL ceilings, in one run.

    python -m benchmarks.spark                        # one million rows, PostgreSQL and MariaDB
    python -m benchmarks.spark --rows 100000 --backends postgresql

Per backend, with N rows, Spark ``local[2]`` and chunks of 500:

- offers: ``offer_dataframe``, ``df.write.format("delayq")`` (option ``queue``), ``offer_many`` from one
  process, and the raw multi-row insert (``benchmarks.ceiling.offer_batch``) of the same rows;
- publishes: ``df.write.format("delayq")`` (option ``topic``, 16 partitions) beside the raw batch publish
  (``benchmarks.topics.CeilingPublisher.many``: lock the touched heads, one multi-row INSERT of the log rows,
  one UPDATE of the heads, COMMIT) from one process;
- reads of that topic's log: the streaming read (``readStream.format("delayq")``, ``Trigger.AvailableNow``,
  into a ``foreachBatch`` sink that aggregates per partition), the data source's batch read of the same rows,
  and the plain parallel SQL read: 2 Python processes (as many as Spark's cores), each with its own DBAPI
  connection running ``SELECT … FROM log WHERE topic = ? AND partition = ?`` for its share of the
  partitions and fetching every column.

Every run checks its counts: the queue ends with exactly one message per row, the log holds offsets
1..head in every partition with N rows in all, and every read sees each log row exactly once (per
partition: count = head, min = 1, max = head, sum of offsets = head (head + 1) / 2).

The tables use the prefix ``sparkb_`` (not the other benchmarks' ``bench_``), so this can run beside them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

import delayq.spark
from benchmarks import ceiling
from benchmarks.__main__ import PAYLOAD, make_engine
from benchmarks.topics import TOPIC, CeilingPublisher
from delayq import DelayedQueue, Topic, migrations
from delayq.spark import offer_dataframe

PREFIX = "sparkb_"
TABLE = f"{PREFIX}messages"
PARTITIONS = 16
READERS = 2  # the plain SQL read: processes, as many as local[2]'s cores
TOPIC_TABLES = [
    f"{PREFIX}{t}"
    for t in (
        "topic_subscribers",
        "topic_offsets",
        "topic_leases",
        "topic_deliveries",
        "topic_log",
        "topic_heads",
        "topics",
    )
]

Stats = dict[int, tuple[int, int, int, int]]  # partition -> (count, min, max, sum of offsets)


class CountMismatch(AssertionError):
    pass


# -- helpers ----------------------------------------------------------------------------------------
def _p(name: str) -> str:
    return "`partition`" if name == "mysql" else '"partition"'


def clear_queue(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f"TRUNCATE {TABLE}")


def check_queue(engine: sa.Engine, n: int, what: str) -> None:
    """Exactly one message per row: n messages, n distinct keys."""
    with engine.connect() as conn:
        rows, keys = conn.exec_driver_sql(
            f"SELECT count(*), count(DISTINCT {ceiling._key(engine.dialect.name)}) FROM {TABLE} WHERE queue = 'bench'"
        ).one()
    if not rows == keys == n:
        raise CountMismatch(f"{what}: {rows} messages, {keys} keys, {n} expected")


def reset_topic(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f"TRUNCATE {', '.join(TOPIC_TABLES)}")
        else:
            for t in TOPIC_TABLES:
                conn.exec_driver_sql(f"TRUNCATE {t}")
    Topic(engine, TOPIC, table_prefix=PREFIX).create(PARTITIONS)


def heads(engine: sa.Engine) -> dict[int, int]:
    p = _p(engine.dialect.name)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(f"SELECT {p}, head FROM {PREFIX}topic_heads WHERE topic = '{TOPIC}'").all()
    return {int(r[0]): int(r[1]) for r in rows}


def check_stats(stats: Stats, expected: dict[int, int], n: int, what: str) -> None:
    """Offsets 1..head, each exactly once, in every partition; n rows in all."""
    total = sum(c for c, _, _, _ in stats.values())
    bad = {
        part: stats.get(part)
        for part, head in expected.items()
        if head and stats.get(part) != (head, 1, head, head * (head + 1) // 2)
    }
    if total != n or sum(expected.values()) != n or bad:
        raise CountMismatch(f"{what}: {total} rows read, {n} expected; partitions off: {list(bad.items())[:3]}")


def check_log(engine: sa.Engine, n: int, what: str) -> dict[int, int]:
    """The log holds n rows, offsets 1..head in every partition (gap-free, no duplicate); the heads."""
    p = _p(engine.dialect.name)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT {p}, count(*), min(message_offset), max(message_offset), sum(message_offset)"
            f" FROM {PREFIX}topic_log WHERE topic = '{TOPIC}' GROUP BY {p}"
        ).all()
    expected = heads(engine)
    check_stats({int(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows}, expected, n, what)
    return expected


def timed_rate(n: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return n / (time.perf_counter() - start), out


# -- the ceilings -----------------------------------------------------------------------------------
def _read_partitions(args: tuple[str, list[int]]) -> Stats:
    """In a process of its own: a plain SELECT of every column per partition, over a raw DBAPI connection."""
    backend, parts = args
    engine = make_engine(backend)
    name = engine.dialect.name
    raw = ceiling.connect(engine, autocommit=True)
    p = _p(name)
    stats: Stats = {}
    for part in parts:
        cur = raw.cursor()
        cur.execute(
            f"SELECT topic, {p}, message_offset, partition_key, message_id, payload, payload_type, published_at"
            f" FROM {PREFIX}topic_log WHERE topic = %s AND {p} = %s",
            (TOPIC, part),
        )
        count, low, high, total = 0, None, 0, 0
        for row in cur.fetchall():
            o = row[2]
            count, total, high = count + 1, total + o, max(high, o)
            low = o if low is None else min(low, o)
        stats[part] = (count, low or 0, high, total)
    raw.close()
    engine.dispose()
    return stats


def plain_parallel_read(backend: str) -> tuple[Stats, float]:
    with multiprocessing.get_context("spawn").Pool(READERS) as pool:
        shares = [(backend, list(range(i, PARTITIONS, READERS))) for i in range(READERS)]
        pool.map(_read_partitions, [(backend, [])] * READERS)  # warm up: imports and a first connection
        start = time.perf_counter()  # not the pool's start-up
        out: Stats = {}
        for part in pool.map(_read_partitions, shares):
            out.update(part)
        return out, time.perf_counter() - start


def _agg(df: DataFrame) -> Stats:
    rows = df.groupBy("partition").agg(F.count("*"), F.min("offset"), F.max("offset"), F.sum("offset")).collect()
    return {int(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows}


def _merge(into: Stats, more: Stats) -> None:
    for part, (c, lo, hi, s) in more.items():
        if part in into:
            c0, lo0, hi0, s0 = into[part]
            into[part] = (c0 + c, min(lo0, lo), max(hi0, hi), s0 + s)
        else:
            into[part] = (c, lo, hi, s)


def stream_read(spark: SparkSession, url: str) -> Stats:
    """The streaming read of the whole topic: Trigger.AvailableNow into a foreachBatch sink that aggregates."""
    seen: Stats = {}
    with tempfile.TemporaryDirectory() as checkpoint:
        query = (
            spark.readStream.format("delayq")
            .option("url", url)
            .option("topic", TOPIC)
            .option("table_prefix", PREFIX)
            .load()
            .writeStream.foreachBatch(lambda df, _: _merge(seen, _agg(df)))
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
    return seen


# -- the run ----------------------------------------------------------------------------------------
def run(spark: SparkSession, backend: str, n: int, chunk: int, offers: DataFrame, publishes: DataFrame) -> None:
    """Every measurement on one backend; prints its lines."""
    engine = make_engine(backend)
    name = engine.dialect.name
    url = engine.url.render_as_string(hide_password=False)
    migrations.upgrade(url, prefix=PREFIX)
    q = DelayedQueue(engine, "bench", table_prefix=PREFIX)
    out: dict[str, float] = {}

    # offers
    clear_queue(engine)
    out["offer_dataframe"], counts = timed_rate(
        n,
        lambda: offer_dataframe(
            offers, url, "bench", key="key", payload="payload", chunk_size=chunk, table_prefix=PREFIX
        ),
    )
    assert counts.created == n, counts
    check_queue(engine, n, "offer_dataframe")

    clear_queue(engine)

    def write(df: DataFrame, target: str, value: str) -> None:
        df.write.format("delayq").mode("append").options(
            url=url, table_prefix=PREFIX, chunk_size=str(chunk), **{target: value}
        ).save()

    out["source offers"], _ = timed_rate(n, lambda: write(offers, "queue", "bench"))
    check_queue(engine, n, "write.format('delayq') offers")

    clear_queue(engine)

    def offer_many() -> None:
        for b in range(0, n, chunk):
            q.offer_many([(f"k{i:09d}", i, None) for i in range(b, min(n, b + chunk))])

    out["offer_many"], _ = timed_rate(n, offer_many)
    check_queue(engine, n, "offer_many")

    clear_queue(engine)
    raw = ceiling.connect(engine, autocommit=True)
    insert = ceiling.offer_batch(name, TABLE)
    now = int(time.time() * 1000)

    def raw_offers() -> None:
        for b in range(0, n, chunk):
            insert(raw, [(f"k{i:09d}", PAYLOAD) for i in range(b, min(n, b + chunk))], now)

    out["raw offers"], _ = timed_rate(n, raw_offers)
    raw.close()
    check_queue(engine, n, "raw multi-row insert")
    clear_queue(engine)

    # publishes
    reset_topic(engine)
    publisher = CeilingPublisher(engine, PREFIX, PARTITIONS)

    def raw_publishes() -> None:
        for b in range(0, n, chunk):
            publisher.many([(f"k{i:09d}", f"m{i:09d}", PAYLOAD) for i in range(b, min(n, b + chunk))])

    out["raw publishes"], _ = timed_rate(n, raw_publishes)
    publisher.close()
    check_log(engine, n, "raw batch publish")

    reset_topic(engine)
    out["source publishes"], _ = timed_rate(n, lambda: write(publishes, "topic", TOPIC))
    expected = check_log(engine, n, "write.format('delayq') publishes")

    # reads of the log just published
    out["stream read"], seen = timed_rate(n, lambda: stream_read(spark, url))
    check_stats(seen, expected, n, "readStream (AvailableNow)")
    out["batch read"], seen = timed_rate(
        n,
        lambda: _agg(
            spark.read.format("delayq")
            .option("url", url)
            .option("topic", TOPIC)
            .option("table_prefix", PREFIX)
            .option("partitions", PARTITIONS)
            .load()
        ),
    )
    check_stats(seen, expected, n, "read (batch)")
    seen, seconds = plain_parallel_read(backend)
    out["plain read"] = n / seconds
    check_stats(seen, expected, n, f"plain SQL read x{READERS}")
    reset_topic(engine)
    engine.dispose()

    print(
        f"{backend:<10} {n:,} rows, Spark local[2], chunks of {chunk}, all counts checked\n"
        f"  offers:    offer_dataframe {out['offer_dataframe']:8.0f}/s | write.format(delayq) "
        f"{out['source offers']:8.0f}/s | offer_many, one process {out['offer_many']:8.0f}/s | raw multi-row "
        f"insert {out['raw offers']:8.0f}/s | source / raw {out['source offers'] / out['raw offers']:.2f}\n"
        f"  publishes: write.format(delayq) {out['source publishes']:8.0f}/s | raw batch publish, one process "
        f"{out['raw publishes']:8.0f}/s | source / raw {out['source publishes'] / out['raw publishes']:.2f}\n"
        f"  reads:     readStream AvailableNow {out['stream read']:8.0f}/s | read (batch) {out['batch read']:8.0f}/s"
        f" | plain SQL, {READERS} processes {out['plain read']:8.0f}/s | stream / plain "
        f"{out['stream read'] / out['plain read']:.2f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spark", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--backends", default="postgresql,mysql")
    parser.add_argument("--chunk", type=int, default=500)
    args = parser.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("delayq-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    delayq.spark.register(spark)
    n, chunk = args.rows, args.chunk
    ids = spark.range(n, numPartitions=8)
    offers = ids.select(F.format_string("k%09d", "id").alias("key"), F.col("id").alias("payload"))
    offers.cache().count()
    publishes = ids.select(
        F.format_string("k%09d", "id").alias("key"),
        F.format_string("m%09d", "id").alias("id"),
        F.col("id").alias("payload"),
    )
    publishes.cache().count()
    for backend in args.backends.split(","):
        run(spark, backend, n, chunk, offers, publishes)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
