"""A topic message's pickup latency on an idle subscriber (``python -m benchmarks --only "topics: pickup"``).

One worker runs one ``TopicHandler`` over a topic of 16 partitions; the benchmark publishes one message
at a time and times from the publish's commit to the handler's start, pausing between messages so the
worker is idle (its fetch loop asleep) at each publish. On PostgreSQL the publish's NOTIFY wakes it; on
MariaDB and SQLite it polls (at most ``poll_interval``, 1 s, apart; more often just after work), so their
figures are the polling fallback's. The row's "/s" is 1 / mean latency, with p50/p99 in ms.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from benchmarks.topics import PREFIX, LostMessages, reset
from delayq import TopicDelivery, TopicHandler, Worker

PARTITIONS = 16
Result = tuple[float, float | None, list[float]]


def pickup_latency(engine: sa.Engine, n: int) -> Result:
    """Publish ``n`` messages one at a time to an idle worker; time from each commit to its handler's start."""
    topic = reset(engine, PARTITIONS)
    started: dict[str, float] = {}
    arrived = threading.Event()

    class Timed(TopicHandler):
        def handle(self, delivery: TopicDelivery, conn: sa.Connection | None = None) -> None:
            started[delivery.message_id] = time.perf_counter()
            arrived.set()

    Timed.topic, Timed.group, Timed.start = topic.name, "pickup", "latest"
    worker = Worker(engine, [Timed()], table_prefix=PREFIX, concurrency=4)
    worker.start()
    latencies: list[float] = []
    try:
        _wait(lambda: _held(engine) == PARTITIONS, "the worker to hold every partition")
        time.sleep(0.2)  # let it go idle (and LISTEN on PostgreSQL)
        for i in range(n):
            arrived.clear()
            topic.publish(f"k{i}", f"m{i}", {"n": i})
            committed = time.perf_counter()
            if not arrived.wait(10):
                raise LostMessages(f"topic pickup: message m{i} was not picked up within 10 s")
            latencies.append(started[f"m{i}"] - committed)
            time.sleep(0.005 + 0.01 * (i % 3))  # idle between messages
    finally:
        worker.stop()
    return n / sum(latencies), None, latencies


def _held(engine: sa.Engine) -> int:
    from delayq.topics import group_lag

    return sum(1 for p in group_lag(engine, "bench", "pickup", table_prefix=PREFIX) if p.holder is not None)


def _wait(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise LostMessages(f"gave up waiting for {what}")
        time.sleep(0.02)


def measure_all(engine: sa.Engine, sizes: Any, measure: Callable[[str, Callable[[], Result]], None]) -> None:
    """The pickup row, through ``python -m benchmarks``'s ``measure`` (which honours ``--only``)."""
    measure(
        "topics: pickup latency, idle subscriber (publish commit -> handler)",
        lambda: pickup_latency(engine, sizes.pickup),
    )
