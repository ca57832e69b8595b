"""Rows offered from Spark beside offer_many from one process and the raw multi-row insert of the same rows.

    python -m benchmarks.spark                        # one million rows, PostgreSQL and MariaDB
    python -m benchmarks.spark --rows 100000 --backends postgresql

Every run checks that the queue ends with exactly one message per row.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from benchmarks import ceiling
from benchmarks.__main__ import PAYLOAD, TABLE, clear, count, make_engine
from delayq import DelayedQueue, migrations
from delayq.spark import offer_dataframe

PREFIX = "bench_"


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
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    n = args.rows
    df = spark.range(n, numPartitions=8).select(F.format_string("k%09d", "id").alias("key"), F.col("id").alias("n"))
    df.cache().count()
    for backend in args.backends.split(","):
        engine = make_engine(backend)
        url = engine.url.render_as_string(hide_password=False)
        migrations.upgrade(url, prefix=PREFIX)
        q = DelayedQueue(engine, "bench", table_prefix=PREFIX)

        clear(engine)
        start = time.perf_counter()
        counts = offer_dataframe(df, url, "bench", key="key", payload="n", chunk_size=args.chunk, table_prefix=PREFIX)
        spark_rate = n / (time.perf_counter() - start)
        assert counts.created == n and count(engine) == n, (counts, count(engine))

        clear(engine)
        start = time.perf_counter()
        for b in range(0, n, args.chunk):
            q.offer_many([(f"k{i:09d}", i, None) for i in range(b, min(n, b + args.chunk))])
        single_rate = n / (time.perf_counter() - start)
        assert count(engine) == n

        clear(engine)
        raw = ceiling.connect(engine, autocommit=True)
        insert = ceiling.offer_batch(engine.dialect.name, TABLE)
        now = int(time.time() * 1000)
        start = time.perf_counter()
        for b in range(0, n, args.chunk):
            insert(raw, [(f"k{i:09d}", PAYLOAD) for i in range(b, min(n, b + args.chunk))], now)
        raw_rate = n / (time.perf_counter() - start)
        raw.close()
        assert count(engine) == n
        clear(engine)
        engine.dispose()
        print(
            f"{backend:<10} {n:,} rows: Spark local[2] {spark_rate:8.0f}/s | offer_many, one process "
            f"{single_rate:8.0f}/s | raw multi-row insert {raw_rate:8.0f}/s | Spark / raw {spark_rate / raw_rate:.2f}",
            flush=True,
        )
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
