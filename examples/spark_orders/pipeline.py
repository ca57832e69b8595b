"""A pipeline end to end: order events on a topic -> a Spark Structured Streaming job -> follow-up messages
due at 09:00 in each customer's own time zone, in a delayed queue -> a worker handles them.

1. The application publishes order events on the topic ``orders`` (as it would inside its own transactions,
   ``Topic.publish(..., using=session)``).
2. A Spark streaming job reads the topic (format ``delayq``), joins each order with the customers' profiles
   (time zone, tier), and schedules a follow-up at 09:00 local time the day after the order, into the queue
   ``order-follow-ups`` (keyed by the order id: a replayed micro-batch creates nothing twice). It runs with
   ``Trigger.AvailableNow`` from a checkpoint: run the script again and only new orders are read.
3. A worker handles the follow-ups. Here it runs on a manual clock moved past the due times, to show in
   seconds what a real ``delayq worker`` does over a day.

Run: python examples/spark_orders/pipeline.py [DATABASE_URL] [--orders N] [--checkpoint DIR] [--master URL]
(needs `pip install 'delayq[spark]'`; SQLite file or PostgreSQL). On a cluster: docs/spark.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
from typing import Any, ClassVar

import sqlalchemy as sa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

import delayq.spark
from delayq import Delivery, Handler, ManualClock, Topic, Worker, migrations

CUSTOMERS = [
    ("c-berlin", "Anna", "Europe/Berlin", "gold"),
    ("c-nyc", "Bob", "America/New_York", "silver"),
    ("c-tokyo", "Chie", "Asia/Tokyo", "gold"),
    ("c-sydney", "Dan", "Australia/Sydney", "bronze"),
]
ORDER = T.StructType(
    [
        T.StructField("order_id", T.StringType()),
        T.StructField("customer_id", T.StringType()),
        T.StructField("total", T.DoubleType()),
    ]
)


def publish_orders(engine: sa.Engine, count: int) -> None:
    """The application's side: one event per order, keyed by customer (their orders stay in order)."""
    orders = Topic(engine, "orders")
    orders.create(partitions=4)
    events = []
    for i in range(count):
        customer = CUSTOMERS[i % len(CUSTOMERS)][0]
        events.append((customer, f"order-{i:06d}", {"order_id": f"order-{i:06d}", "customer_id": customer, "total": i}))
    created = sum(o.value == "created" for o in orders.publish_many(events))
    print(f"published {created} new order events ({count - created} were there already)")


def follow_ups(spark: SparkSession, url: str) -> DataFrame:
    """The streaming job's logic: orders joined with customers -> a follow-up at 09:00 local, the next day."""
    customers = spark.createDataFrame(CUSTOMERS, "customer_id string, name string, time_zone string, tier string")
    orders = (
        spark.readStream.format("delayq")
        .option("url", url)
        .option("topic", "orders")
        .option("maxRowsPerTrigger", "5000")
        .load()
        .select(F.from_json("payload_json", ORDER).alias("o"), "published_at")
        .select("o.*", "published_at")
    )
    local_day = F.date_add(F.to_date(F.from_utc_timestamp("published_at", F.col("time_zone"))), 1)
    return orders.join(F.broadcast(customers), "customer_id").select(
        F.concat(F.lit("follow-up/"), "order_id").alias("key"),
        F.make_timestamp(
            F.year(local_day), F.month(local_day), F.dayofmonth(local_day), F.lit(9), F.lit(0), F.lit(0), "time_zone"
        ).alias("at"),
        "order_id",
        "name",
        "tier",
        "total",
    )


def run_job(spark: SparkSession, url: str, checkpoint: str) -> None:
    query = (
        follow_ups(spark, url)
        .writeStream.format("delayq")
        .option("url", url)
        .option("queue", "order-follow-ups")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    rows = sum(p["numInputRows"] for p in query.recentProgress)
    print(f"streaming job: {rows} order events read in {len(query.recentProgress)} micro-batches")


class SendFollowUp(Handler):
    queue = "order-follow-ups"
    handled: ClassVar[dict[str, Any]] = {}

    def handle(self, delivery: Delivery, conn: Any = None) -> None:
        SendFollowUp.handled[delivery.key] = delivery.payload  # an e-mail in real life


def run_worker(engine: sa.Engine) -> None:
    """Handle every follow-up, on a manual clock moved a day and a half on (a real worker just waits)."""
    clock = ManualClock(dt.datetime.now(dt.UTC) + dt.timedelta(days=2, hours=12))
    worker = Worker(engine, [SendFollowUp], clock=clock)
    while worker.run_once():
        pass
    print(f"worker: handled {len(SendFollowUp.handled)} follow-ups")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url", nargs="?", default="sqlite:///delayq-examples.db")
    parser.add_argument("--orders", type=int, default=1000)
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "delayq-orders-checkpoint"))
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()
    migrations.upgrade(args.url)
    engine = sa.create_engine(args.url)
    publish_orders(engine, args.orders)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this interpreter, with delayq
    spark = (
        SparkSession.builder.master(args.master)
        .appName("order-follow-ups")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")  # from_utc_timestamp below renders local wall-clock times
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    delayq.spark.register(spark)
    run_job(spark, args.url, args.checkpoint)
    scheduled = (
        spark.read.format("delayq")
        .option("url", args.url)
        .option("queue", "order-follow-ups")
        .load()
        .where(F.col("key").startswith("follow-up/"))
        .groupBy(F.hour("scheduled_at").alias("utc_hour"))
        .count()
        .orderBy("utc_hour")
        .collect()
    )
    print("follow-ups waiting, by UTC hour of their 09:00 local:", {r["utc_hour"]: r["count"] for r in scheduled})
    spark.stop()
    run_worker(engine)
    engine.dispose()


if __name__ == "__main__":
    main()
