"""A data pipeline on Spark: renewal reminders for every subscription, offered from the executors.

Generates (once) a Parquet table of subscriptions with renewal dates and customer time zones, computes a
reminder three days before each renewal at 09:00 in the customer's own time zone, offers them into the
queue ``renewal-reminders`` and prints the counts. Run it twice: the second run creates nothing.

Run: python examples/spark_pipeline.py [DATABASE_URL] [--rows N]   (needs `pip install 'delayq[spark]'`)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from delayq import migrations
from delayq.spark import offer_dataframe

ZONES = ["Europe/Berlin", "America/New_York", "Asia/Tokyo", "Australia/Sydney", "UTC"]


def subscriptions(spark: SparkSession, path: Path, rows: int) -> None:
    """Write a Parquet table: subscription id, customer time zone, renewal date (spread over a year)."""
    zones = F.array(*[F.lit(z) for z in ZONES])
    (
        spark.range(rows)
        .select(
            F.format_string("sub-%08d", "id").alias("subscription_id"),
            F.element_at(zones, (F.col("id") % len(ZONES) + 1).cast("int")).alias("time_zone"),
            F.date_add(F.lit("2031-01-01").cast("date"), (F.col("id") * 7919 % 365).cast("int")).alias("renews_on"),
            (F.col("id") % 3 == 0).alias("annual"),
        )
        .write.mode("overwrite")
        .parquet(str(path))
    )


def reminders(spark: SparkSession, path: Path):  # type: ignore[no-untyped-def]
    """One reminder per subscription: 09:00 local time, three days before it renews."""
    day = F.date_sub("renews_on", 3)
    return (
        spark.read.parquet(str(path))
        .withColumn(
            "remind_at",
            F.make_timestamp(
                F.year(day), F.month(day), F.dayofmonth(day), F.lit(9), F.lit(0), F.lit(0), F.col("time_zone")
            ),
        )
        .withColumn("key", F.concat(F.lit("remind/"), "subscription_id", F.lit("/"), F.col("renews_on")))
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url", nargs="?", default="sqlite:///delayq-examples.db")
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    migrations.upgrade(args.url)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this interpreter, with delayq
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("renewal-reminders")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    table = Path(tempfile.gettempdir()) / f"delayq-subscriptions-{args.rows}.parquet"
    if not table.exists():
        subscriptions(spark, table, args.rows)
    df = reminders(spark, table)
    for run in (1, 2):
        counts = offer_dataframe(
            df,
            args.url,
            "renewal-reminders",
            key="key",
            payload=["subscription_id", "renews_on", "annual"],
            at="remind_at",
        )
        print(f"run {run}: created {counts.created}, updated {counts.updated}, ignored {counts.ignored}")
    spark.stop()


if __name__ == "__main__":
    main()
