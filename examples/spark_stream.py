"""A streaming job: every order event of a topic becomes a follow-up message of a queue, exactly once.

The query reads the topic ``orders`` as consumer group ``follow-ups`` (so garbage collection keeps what it
has not read, and ``delayq topics lag orders follow-ups`` shows how far behind it is), turns each event into
a message keyed by the event's id, due a day after the event, and offers it into the queue ``follow-ups``.
Keys deduplicate, so a batch Spark runs again (a task retried after an executor died, the last batch of a
query that was killed) creates nothing twice. ``Trigger.AvailableNow``: it reads what is published when it
starts, then stops; run it again (same checkpoint) for what came since.

Run: python examples/spark_stream.py DATABASE_URL --checkpoint DIR [--publish N] [--max-rows N]
         [--topic orders] [--queue follow-ups]   (the group is named after the queue)
  or: spark-submit --master spark://HOST:7077 examples/spark_stream.py DATABASE_URL --checkpoint DIR
(``--publish N`` first publishes order events 0..N-1, idempotently: ids repeat, nothing is published twice.)
"""

from __future__ import annotations

import argparse
import os

import sqlalchemy as sa
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import delayq.spark
from delayq import Topic, migrations


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--publish", type=int, default=0)
    parser.add_argument("--max-rows", default="100")
    parser.add_argument("--topic", default="orders")
    parser.add_argument("--queue", default="follow-ups")
    args = parser.parse_args()
    migrations.upgrade(args.url)
    engine = sa.create_engine(args.url)
    orders = Topic(engine, args.topic)
    orders.create(partitions=4)
    if args.publish:
        orders.publish_many([(f"customer-{i % 17}", f"order-{i:06d}", {"n": i}) for i in range(args.publish)])
    engine.dispose()

    builder = SparkSession.builder.appName("follow-ups")
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # run by python, not spark-submit: a local master
        builder = builder.master("local[2]").config("spark.ui.enabled", "false")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    delayq.spark.register(spark)

    events = (
        spark.readStream.format("delayq")
        .option("url", args.url)
        .option("topic", args.topic)
        .option("group", args.queue)
        .option("maxRowsPerTrigger", args.max_rows)
        .load()
    )
    follow_ups = events.select(
        F.concat(F.lit("follow-up/"), "message_id").alias("key"),
        (F.col("published_at") + F.expr("INTERVAL 1 DAY")).alias("at"),
        F.col("payload_json"),
    )
    query = (
        follow_ups.writeStream.format("delayq")
        .option("url", args.url)
        .option("queue", args.queue)
        .option("checkpointLocation", args.checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    read = sum(p["numInputRows"] for p in query.recentProgress)
    print(f"read {read} order events in {len(query.recentProgress)} batches")
    spark.stop()


if __name__ == "__main__":
    main()
