"""Cancelling running work, with real workers of both drivers on every backend: the handler is told (threads:
``delivery.cancelled``; asyncio: its task is cancelled), the message is recorded as cancelled, the handler's later
ack or failure changes nothing, and the message never runs again.

PostgreSQL's workers hear the cancel by NOTIFY (the test waits until the listener listens, then moves no clock);
the other backends' at their next heartbeat, which the manual clock brings on (half a visibility timeout).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa
from test_cancel import cancelled, finished_rows
from test_worker import wait_until
from test_worker_contract import FAST, Driver, Running
from test_worker_contract import driver as driver  # the fixture

from delayq import CancelOutcome, DelayedQueue, Delivery, Handler, ManualClock, RetryPolicy
from delayq.aio import AsyncHandler
from delayq.queue._cancel import FINISHED_CANCELLED
from delayq.runtime._jobs import Jobs

VT = dt.timedelta(seconds=20)


def _listening_pids(engine: sa.Engine) -> set[int]:
    """The sessions of this database whose last statement was a LISTEN on a cancel channel."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %_cancel%'"
            )
        )
        return {int(r[0]) for r in rows}


class Telling:
    """Start a worker so that it can hear a cancel, and bring the news to it: PostgreSQL's by NOTIFY (once its
    listener listens), the others' by the heartbeat the manual clock makes due."""

    def __init__(self, driver: Driver, clock: ManualClock) -> None:
        self.driver, self.clock = driver, clock
        self.notifies = driver.backend.name == "postgresql"
        self.options: dict[str, Any] = {**FAST, "listen": self.notifies, "clock": clock}

    def start(self, worker: Running) -> None:
        before = _listening_pids(self.driver.backend.engine) if self.notifies else set()
        worker.start()
        if self.notifies:
            engine = self.driver.backend.engine
            wait_until(lambda: bool(_listening_pids(engine) - before), "the worker's listener to LISTEN")

    def tell(self) -> None:
        if not self.notifies:
            self.clock.advance(VT / 2 + dt.timedelta(seconds=1))


def test_a_running_handler_is_told_recorded_cancelled_and_its_ack_changes_nothing(
    driver: Driver, queue_name: str, clock: ManualClock
) -> None:
    runs: Counter[str] = Counter()
    started, told, acked = threading.Event(), threading.Event(), []

    def body(d: Delivery, _: object) -> None:
        runs[d.key] += 1
        if d.key == "k":
            started.set()
            if d.cancelled.wait(30):
                told.set()
            # Its own ack, after the cancel: fenced. (An asyncio handler's sync delivery runs on the loop only; its
            # task is cancelled by now, and test_cancel.py fences the async API's ack.)
            acked.append(d.ack() if driver.kind == "threads" else False)

    handler = driver.queue_handler(queue_name, body, visibility_timeout=VT)
    telling = Telling(driver, clock)
    worker = driver.worker([handler], **telling.options)
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock)
    q.offer("k", {"n": 1}, tags=["report"])
    telling.start(worker)
    try:
        wait_until(started.is_set, "the handler to start")
        assert q.cancel_job("k") is CancelOutcome.RUNNING
        telling.tell()
        wait_until(told.is_set, "the handler to be told")
        wait_until(lambda: bool(acked), "the handler's own ack")
        q.offer("after", 2)
        wait_until(lambda: runs["after"] == 1 and worker.health().held == 0, "a later message")
    finally:
        assert worker.stop()
    assert acked == [False]
    assert runs["k"] == 1 and cancelled(q, "k") and q.dead_letters() == []
    [row] = finished_rows(driver.backend.engine, queue_name)
    assert (row.key, row.state, row.tags) == ("k", FINISHED_CANCELLED, ",report,")


def test_a_handler_failing_after_its_cancel_is_not_retried(driver: Driver, queue_name: str, clock: ManualClock) -> None:
    """One handler raises an error once told, one stops with ``raise_if_cancelled``: no retry is scheduled, no dead
    letter made, and neither runs again."""
    runs: Counter[str] = Counter()
    started = {"raises": threading.Event(), "stops": threading.Event()}
    ended: list[str] = []

    def body(d: Delivery, _: object) -> None:
        runs[d.key] += 1
        if d.key in started:
            started[d.key].set()
            d.cancelled.wait(30)
            ended.append(d.key)
            if d.key == "stops":
                d.raise_if_cancelled()
            raise RuntimeError("failed after the cancel")

    retry = RetryPolicy.fixed(dt.timedelta(0), max_attempts=5)
    handler = driver.queue_handler(queue_name, body, visibility_timeout=VT, retry=retry)
    telling = Telling(driver, clock)
    worker = driver.worker([handler], concurrency=2, **telling.options)
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock)
    q.offer_many([("raises", 1, None), ("stops", 2, None)])
    telling.start(worker)
    try:
        wait_until(lambda: all(e.is_set() for e in started.values()), "both handlers to start")
        assert [q.cancel_job(k) for k in ("raises", "stops")] == [CancelOutcome.RUNNING] * 2
        telling.tell()
        wait_until(lambda: sorted(ended) == ["raises", "stops"], "both handlers to end")
        q.offer("after", 3)
        wait_until(lambda: runs["after"] == 1 and worker.health().held == 0, "a later message")
    finally:
        assert worker.stop()
    assert runs == Counter({"raises": 1, "stops": 1, "after": 1})
    assert cancelled(q, "raises") and cancelled(q, "stops") and q.dead_letters() == []
    assert sorted(r.key for r in finished_rows(driver.backend.engine, queue_name)) == ["raises", "stops"]


def test_an_async_handlers_task_is_cancelled(driver: Driver, queue_name: str, clock: ManualClock) -> None:
    """An ``async def`` handler gets ``CancelledError`` where it awaits; nothing is recorded for it but the cancel."""
    if driver.kind != "asyncio":
        return  # (a thread handler cannot be interrupted: the tests above)
    runs: Counter[str] = Counter()
    started, interrupted = threading.Event(), threading.Event()

    class Sleeper(AsyncHandler):
        queue = queue_name
        visibility_timeout = VT

        async def handle(self, delivery: Any, conn: Any = None) -> None:
            runs[delivery.key] += 1
            if delivery.key != "k":
                return
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                assert delivery.cancelled.is_set()
                interrupted.set()
                raise

    telling = Telling(driver, clock)
    worker = driver.worker([Sleeper()], **telling.options)
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock)
    q.offer("k", 1)
    telling.start(worker)
    try:
        wait_until(started.is_set, "the handler to start")
        assert q.cancel_job("k") is CancelOutcome.RUNNING
        telling.tell()
        wait_until(interrupted.is_set, "the handler's task to be cancelled")
        q.offer("after", 2)
        wait_until(lambda: runs["after"] == 1 and worker.health().held == 0, "a later message")
    finally:
        assert worker.stop()
    assert runs == Counter({"k": 1, "after": 1})
    assert cancelled(q, "k") and q.dead_letters() == []
    assert [r.state for r in finished_rows(driver.backend.engine, queue_name)] == [FINISHED_CANCELLED]


def test_a_cancel_heard_before_the_claims_reply_tells_the_handler_once_its_job_is_registered(
    make_queue: Any, clock: ManualClock
) -> None:
    """The claim committed, the cancel followed and its notification reached the worker before the claim's reply
    did: the job is told as it is registered (not at its first heartbeat, half a visibility timeout later)."""

    class Quiet(Handler):
        def handle(self, delivery: Delivery, conn: object = None) -> None:  # pragma: no cover - never run here
            pass

    q = make_queue()
    q.offer_many([("k", 1, None), ("other", 2, None)])
    k, other = sorted(q.try_poll_many(2), key=lambda d: d.key)
    assert q.cancel_job("k") is CancelOutcome.RUNNING
    jobs = Jobs(clock)
    assert jobs.cancelled([k.id]) == 0  # heard first: nothing held yet
    registered = jobs.add_claimed(Quiet(), q, [k, other], time.monotonic())
    assert k.cancelled.is_set() and not other.cancelled.is_set()
    assert jobs.lost_running() == [registered[0]]  # (the asyncio driver cancels its task)
    assert not k.ack() and other.ack()


@pytest.mark.parametrize("ends", ["when told", "returning first", "raising first", "transactional"])
def test_a_cancel_of_a_running_job_is_logged_at_info_never_as_a_lost_lock(
    driver: Driver, queue_name: str, clock: ManualClock, caplog: pytest.LogCaptureFixture, ends: str
) -> None:
    """docs/workers.md: a cancelled job's worker logs ``cancelled while its handler ran`` at INFO on every backend;
    ``lock lost`` warnings are the alarm for locks lost otherwise. PostgreSQL's workers hear the cancel by NOTIFY;
    the others find the lock gone at a heartbeat (a handler that waits until told), or at the ack or the recorded
    failure of a handler that ended first (a transactional one's ack in its transaction), and tell the cancel from
    a lost lock by the message's cancelled record."""
    if ends == "transactional" and driver.backend.name == "sqlite":
        pytest.skip("on SQLite a transactional handler's transaction holds the write lock: a cancel waits for its end")
    started, go_on = threading.Event(), threading.Event()

    def body(d: Delivery, _: object) -> None:
        if d.key != "k":
            return
        started.set()
        if ends == "when told":
            d.cancelled.wait(30)
            return
        go_on.wait(30)
        if ends == "raising first":
            raise RuntimeError("failed after its cancel")

    caplog.set_level(logging.INFO, logger="delayq")
    handler = driver.queue_handler(queue_name, body, visibility_timeout=VT, transactional=ends == "transactional")
    telling = Telling(driver, clock)
    worker = driver.worker([handler], **telling.options)
    q = DelayedQueue(driver.backend.engine, queue_name, clock=clock)
    q.offer("k", 1)
    telling.start(worker)
    try:
        wait_until(started.is_set, "the handler to start")
        assert q.cancel_job("k") is CancelOutcome.RUNNING
        if ends == "when told":
            telling.tell()
        go_on.set()
        q.offer("after", 2)
        wait_until(lambda: worker.handled == 2 and worker.health().held == 0, "both messages to be done with")
    finally:
        go_on.set()
        assert worker.stop()
    assert cancelled(q, "k") and q.get("after") is None and q.dead_letters() == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [w for w in warnings if "lost" in w], warnings  # (lock lost, or lock(s) lost before the ack)
    told = [r for r in caplog.records if "cancelled while its handler ran" in r.getMessage()]
    assert told and {(r.name, r.levelno) for r in told} == {("delayq.worker", logging.INFO)}
    assert all("'k'" in r.getMessage() for r in told)
