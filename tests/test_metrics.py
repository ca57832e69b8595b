"""Prometheus metrics: counted in-process into an application's own registry, and scraped from a worker process."""

from __future__ import annotations

import datetime as dt
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import REPO_ROOT, Backend
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from test_worker import wait_until

from delayq import DelayedQueue, Delivery, Handler, ManualClock, RetryPolicy, Worker
from delayq.aio import AsyncDelivery, AsyncHandler
from delayq.metrics import register, unregister


class Flaky(Handler):
    """Fails every message whose key starts with ``fail``; the worker process runs it too."""

    queue = os.environ.get("DELAYQ_TEST_QUEUE", "unset")
    retry = RetryPolicy.fixed(dt.timedelta(0), max_attempts=2)

    def handle(self, delivery: Delivery, conn: Any = None) -> None:
        if delivery.key.startswith("fail"):
            raise RuntimeError("no luck")


class AsyncFlaky(AsyncHandler):
    """``Flaky`` for ``delayq worker --driver asyncio``."""

    queue = Flaky.queue
    retry = Flaky.retry

    async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:
        if delivery.key.startswith("fail"):
            raise RuntimeError("no luck")


handlers = [Flaky]
async_handlers = [AsyncFlaky]


def samples(text: str, queue: str) -> dict[str, float]:
    """name{outcome} -> value, for one queue's samples."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("queue") == queue:
                outcome = s.labels.get("outcome")
                le = s.labels.get("le")
                if le is None:
                    found[s.name + (f"{{{outcome}}}" if outcome else "")] = s.value
    return found


def test_metrics_count_into_an_applications_own_registry(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    registry = CollectorRegistry()
    handler = type("H", (Flaky,), {"queue": queue_name})()
    worker = Worker(engine, [handler], clock=clock)
    metrics = register(registry, worker.queues)
    try:
        q = worker.queues[0]
        q.offer_many([("ok-1", 1, None), ("ok-2", 2, None), ("fail-1", 3, None)])
        q.offer("later", 4, at=dt.timedelta(hours=1))
        worker.run_once()  # two acked, one retried at once ...
        worker.run_once()  # ... and dead-lettered on its second attempt
        from prometheus_client import generate_latest

        got = samples(generate_latest(registry).decode(), queue_name)
    finally:
        unregister(metrics, registry)
    assert got["delayq_offered_total"] == 4
    assert got["delayq_delivered_total"] == 4
    assert got["delayq_acked_total"] == 2
    assert got["delayq_retried_total"] == 1
    assert got["delayq_dead_lettered_total"] == 1
    assert got.get("delayq_lock_lost_total", 0) == 0
    assert got["delayq_handler_duration_seconds_count{success}"] == 2
    assert got["delayq_handler_duration_seconds_count{failure}"] == 2
    assert got["delayq_pickup_latency_seconds_count"] == 4
    assert (got["delayq_scheduled"], got["delayq_ready"], got["delayq_dead"], got["delayq_in_flight"]) == (1, 0, 1, 0)


@pytest.mark.parametrize("tag_labels", [False, True, ["eu"]])
def test_tag_labels_are_only_there_when_asked(
    engine: sa.Engine, queue_name: str, clock: ManualClock, tag_labels: Any
) -> None:
    from prometheus_client import generate_latest

    registry = CollectorRegistry()
    handler = type("H", (Flaky,), {"queue": queue_name})()
    worker = Worker(engine, [handler], clock=clock)
    metrics = register(registry, worker.queues, tag_labels=tag_labels)
    try:
        q = worker.queues[0]
        q.offer_many([("a", 1, None, ["eu", "vip"]), ("b", 2, None, ["eu", "vip"]), ("c", 3, None)])
        worker.run_once()
        text = generate_latest(registry).decode()
    finally:
        unregister(metrics, registry)
    delivered = {
        s.labels.get("tags"): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "delayq_delivered_total" and s.labels.get("queue") == queue_name
    }
    durations = {
        s.labels.get("tags")
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "delayq_handler_duration_seconds_count" and s.labels.get("queue") == queue_name
    }
    expected = {
        False: {None: 3},
        True: {"eu,vip": 2, "": 1},
        "list": {"eu": 2, "": 1},
    }[tag_labels if isinstance(tag_labels, bool) else "list"]
    assert delivered == expected
    assert durations == set(expected)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=["threads", "asyncio"])
def worker_process(
    backend: Backend, queue_name: str, request: pytest.FixtureRequest
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A ``delayq worker`` process serving metrics, of either driver (the asyncio one reads the gauges
    through a sync engine of its own)."""
    port = free_port()
    env = {
        **os.environ,
        "DELAYQ_URL": backend.url,
        "DELAYQ_TEST_QUEUE": queue_name,
        "PYTHONPATH": str(REPO_ROOT / "tests"),
    }
    spec = "test_metrics:handlers" if request.param == "threads" else "test_metrics:async_handlers"
    args = ["worker", spec, "--metrics-port", str(port), "--metrics-addr", "127.0.0.1", "--driver", request.param]
    p = subprocess.Popen(
        [sys.executable, "-m", "delayq.cli", *args],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        yield p, f"http://127.0.0.1:{port}/metrics"
    finally:
        p.terminate()
        p.wait(30)


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def test_a_worker_process_serves_metrics_that_move_as_messages_flow(
    backend: Backend, queue_name: str, worker_process: tuple[subprocess.Popen[bytes], str]
) -> None:
    process, url = worker_process
    wait_until(lambda: "delayq_ready" in scrape(url) or process.poll() is not None, "the metrics endpoint")
    assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
    before = samples(scrape(url), queue_name)
    assert before.get("delayq_acked_total", 0) == 0 and before["delayq_ready"] == 0

    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"ok-{i}", i, None) for i in range(5)])
    q.offer("fail-1", 0)
    wait_until(lambda: q.stats().dead == 1 and q.stats().ready + q.stats().in_flight == 0, "the worker to drain")
    wait_until(lambda: samples(scrape(url), queue_name).get("delayq_acked_total") == 5, "the acks to be counted")
    after = samples(scrape(url), queue_name)
    assert after["delayq_delivered_total"] == 7  # five, and the failing one twice
    assert after["delayq_retried_total"] == 1 and after["delayq_dead_lettered_total"] == 1
    assert after["delayq_dead"] == 1 and after["delayq_ready"] == 0
    assert after["delayq_handler_duration_seconds_count{failure}"] == 2


def test_a_lost_lock_counts_once_per_delivery_whichever_operation_finds_it(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    registry = CollectorRegistry()
    metrics = register(registry)
    minute = dt.timedelta(minutes=1)

    def lost() -> float:
        from prometheus_client import generate_latest

        return samples(generate_latest(registry).decode(), queue_name).get("delayq_lock_lost_total", 0)

    try:
        q = DelayedQueue(engine, queue_name, clock=clock, visibility_timeout=minute)
        q.offer_many([(k, k, None) for k in ("beat", "ack", "batch-1", "batch-2", "kept")])
        stale = {d.key: d for d in q.try_poll_many(5)}
        clock.advance(2 * minute)  # every lock expires ...
        taken = {d.key: d for d in q.try_poll_many(4)}  # ... and another consumer takes all but "kept"
        assert set(taken) == {"beat", "ack", "batch-1", "batch-2"} and lost() == 0

        # The heartbeat finds the lock gone; the failed retry and dead letter that follow count nothing more.
        assert q.extend_many([stale["beat"]], minute) == ([], [stale["beat"]])
        assert lost() == 1
        assert stale["beat"].retry(error="late") is False and stale["beat"].dead_letter("late") is False
        assert stale["beat"].extend(minute) is False and lost() == 1

        # A lost ack counts, once, however often it is tried.
        assert stale["ack"].ack() is False and lost() == 2
        assert stale["ack"].ack() is False and stale["ack"].retry() is False and lost() == 2

        # A background ack (skip_locked) of a batch, as the worker sends it: the acked delivery is
        # no lost lock, even when the heartbeat asks about it afterwards, as the worker does.
        mixed = [taken["batch-1"], stale["batch-2"]]
        assert q.ack_many(mixed, skip_locked=True) == 1 and lost() == 3
        assert q.extend_many(mixed, minute) == ([], mixed) and lost() == 3
        assert q.ack_many([stale["batch-1"], stale["batch-2"]], skip_locked=True) == 0 and lost() == 4

        # An expired lock that nobody took is still held: no loss.
        assert stale["kept"].ack() is True
        assert q.ack_many([taken[k] for k in ("beat", "ack", "batch-2")]) == 3 and lost() == 4
    finally:
        unregister(metrics, registry)
