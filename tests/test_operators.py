"""What operators see of failures: the attempt history (type, message, traceback, time) and the delivery log."""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

import pytest
import sqlalchemy as sa

from delayq import DelayedQueue, Delivery, Handler, ManualClock, OfferOutcome, RetryPolicy, Worker, observe
from delayq.history import MAX_ENTRIES, MAX_MESSAGE, MAX_TRACEBACK, Failure, parse

SECOND = dt.timedelta(seconds=1)


class StorageError(OSError):
    pass


def resize_image(key: str) -> None:
    raise StorageError(f"storage hiccup on {key}")


def make_handler(queue_name: str, seen: list[tuple[int, int]], fail: list[bool]) -> Handler:
    class Images(Handler):
        queue = queue_name
        retry = RetryPolicy.fixed(SECOND, max_attempts=3)

        def handle(self, delivery: Delivery, conn: Any = None) -> None:
            seen.append((delivery.attempts, len(delivery.attempt_history)))
            if fail[0]:
                resize_image(delivery.key)

    return Images()


def test_three_failures_dead_letter_and_requeue_keep_the_attempt_history(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    seen: list[tuple[int, int]] = []
    fail = [True]
    worker = Worker(engine, [make_handler(queue_name, seen, fail)], clock=clock)
    q = worker.queues[0]
    q.offer("img-15", {"w": 300})
    for attempt in (1, 2):
        assert worker.run_once() == 1
        msg = q.get("img-15")
        assert msg is not None and [r.attempt for r in msg.attempt_history] == list(range(1, attempt + 1))
        clock.advance(SECOND)
    assert worker.run_once() == 1  # the third and last attempt: dead-lettered
    assert seen == [(1, 0), (2, 1), (3, 2)]  # the handler sees the earlier failures

    [dead] = q.dead_letters()
    assert dead.failed_at == clock.now()
    history = dead.attempt_history
    assert [r.attempt for r in history] == [1, 2, 3]
    assert [r.at for r in history] == [clock.now() - 2 * SECOND, clock.now() - SECOND, clock.now()]
    for r in history:
        assert r.error_type == "StorageError"
        assert r.message == "StorageError: storage hiccup on img-15"
        assert (
            r.traceback is not None
            and "in resize_image" in r.traceback
            and r.traceback.endswith("StorageError: storage hiccup on img-15\n")
        )

    assert q.requeue_dead("img-15") is True
    msg = q.get("img-15")
    assert msg is not None and msg.attempt_history == history  # kept
    assert msg.last_error == "StorageError: storage hiccup on img-15" and msg.attempts == 0
    fail[0] = False
    assert worker.run_once() == 1
    assert seen[-1] == (1, 3) and q.get("img-15") is None


def test_a_consumer_retrying_by_hand_records_the_exception_it_handles(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    from delayq import DelayedQueue

    q = DelayedQueue(engine, queue_name, clock=clock)
    q.offer("k", 1)
    d = q.try_poll()
    assert d is not None
    try:
        resize_image("k")
    except StorageError:
        assert d.retry(SECOND, "could not resize") is True
    [record] = q.get("k").attempt_history  # type: ignore[union-attr]
    assert (record.attempt, record.error_type, record.message) == (1, "StorageError", "could not resize")
    clock.advance(SECOND)
    d = q.try_poll()
    assert d is not None and d.dead_letter("given up") is True  # no exception at hand: message only
    [dead] = q.dead_letters()
    assert [(r.attempt, r.error_type, r.message, r.traceback is None) for r in dead.attempt_history] == [
        (1, "StorageError", "could not resize", False),
        (2, None, "given up", True),
    ]


def test_the_history_is_bounded_however_often_a_message_fails() -> None:
    try:
        raise ValueError("x" * 10_000) from KeyError("y" * 20_000)
    except ValueError as exc:
        failure = Failure.capture(None, exc)
    stored = None
    for attempt in range(1, 50):
        stored = failure.appended_to(stored, attempt, 1_000 * attempt)
    records = parse(stored)
    assert [r.attempt for r in records] == list(range(50 - MAX_ENTRIES, 50))
    assert all(len(r.message) <= MAX_MESSAGE and len(r.traceback or "") <= MAX_TRACEBACK for r in records)
    assert stored is not None and len(stored) < MAX_ENTRIES * (MAX_MESSAGE + MAX_TRACEBACK + 200) * 1.1
    assert parse("not json") == () and parse(json.dumps([{"attempt": "?"}])) == ()


def test_each_delivery_logs_its_start_and_outcome_with_structured_fields(
    engine: sa.Engine, queue_name: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[int, int]] = []
    fail = [True]
    worker = Worker(engine, [make_handler(queue_name, seen, fail)], clock=clock)
    q = worker.queues[0]
    q.offer("a", 1)
    with caplog.at_level(logging.DEBUG, logger="delayq.delivery"):
        worker.run_once()
        clock.advance(SECOND)
        fail[0] = False
        worker.run_once()
    records = [r for r in caplog.records if r.name == "delayq.delivery"]
    events = [(r.levelno, getattr(r, "delayq_event", None), getattr(r, "delayq_attempt", None)) for r in records]
    assert events == [
        (logging.DEBUG, "start", 1),
        (logging.WARNING, "failure", 1),
        (logging.DEBUG, "start", 2),
        (logging.INFO, "success", 2),
    ]
    failure = records[1]
    assert failure.exc_info is not None and failure.exc_info[0] is StorageError
    fields = (getattr(failure, "delayq_error_type", None), getattr(failure, "delayq_error", None))
    assert fields == ("StorageError", "storage hiccup on a")
    message = failure.getMessage()
    assert "attempt 1 failed in " in message and "StorageError: storage hiccup on a" in message
    for r in records:
        assert (getattr(r, "delayq_queue", None), getattr(r, "delayq_key", None)) == (queue_name, "a")
    assert all(isinstance(getattr(r, "delayq_duration", None), float) for r in records if r.delayq_event != "start")


def test_each_failure_is_one_log_line(
    engine: sa.Engine, queue_name: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[int, int]] = []
    worker = Worker(engine, [make_handler(queue_name, seen, [True])], clock=clock)
    worker.queues[0].offer("b", 1)
    with caplog.at_level(logging.INFO, logger="delayq"):
        for _ in range(3):  # two retries, then the dead letter
            assert worker.run_once() == 1
            clock.advance(SECOND)
    said = [r for r in caplog.records if "storage hiccup on b" in r.getMessage()]
    assert [(r.name, r.levelno, r.delayq_attempt) for r in said] == [  # type: ignore[attr-defined]
        ("delayq.delivery", logging.WARNING, attempt) for attempt in (1, 2, 3)
    ]


class Stamp(observe.Observer):
    """An observer that stores a header with every offer (as tracing stores its context)."""

    def publishing(self, queue: str, n: int, headers: dict[str, str]) -> None:
        headers["origin"] = "test"
        return None


def test_replacing_a_message_clears_its_attempt_history_and_headers(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    q = DelayedQueue(engine, queue_name, clock=clock)
    stamp = Stamp()
    observe.add(stamp)
    try:
        q.offer("report", {"v": 1})
    finally:
        observe.remove(stamp)
    assert q.headers("report") == {"origin": "test"}
    delivery = q.try_poll()
    assert delivery is not None and delivery.headers == {"origin": "test"}
    try:
        resize_image("report")
    except StorageError:
        assert delivery.retry(SECOND)
    assert len(q.attempt_history("report")) == 1
    assert q.offer("report", {"v": 2}, update=True) is OfferOutcome.UPDATED
    msg = q.get("report")
    assert msg is not None and msg.attempts == 0 and msg.attempt_history == () and q.headers("report") == {}
