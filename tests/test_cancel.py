"""Cancelling one message (``cancel_job``): a queued one is deleted, a running one recorded as cancelled and
fenced; on every backend, through the sync and the async API (``api``). The workers' side (the handler is told)
is tests/test_worker_cancel.py."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import count_rows

from delayq import CancelOutcome, DelayedQueue, ManualClock
from delayq.errors import InvalidInputError
from delayq.queue._cancel import DEFAULT_CANCELLED_RETENTION, FINISHED_CANCELLED
from delayq.schema import make_tables

MINUTE = dt.timedelta(minutes=1)


def finished_rows(engine: sa.Engine, queue_name: str) -> list[Any]:
    f = make_tables().finished
    with engine.connect() as conn:
        return list(conn.execute(sa.select(f).where(f.c.queue == queue_name).order_by(f.c.id)).all())


def cancelled(q: Any, key: str) -> bool:
    """Whether ``get(key)`` finds the message kept as cancelled (no live one)."""
    found = q.get(key)
    return found is not None and found.state == "cancelled"


def test_the_outcome_is_true_when_something_was_cancelled() -> None:
    assert CancelOutcome.QUEUED and CancelOutcome.RUNNING
    assert not CancelOutcome.NOT_FOUND


def test_a_queued_message_is_deleted_and_not_recorded(queue: DelayedQueue, engine: sa.Engine) -> None:
    queue.offer("k", {"n": 1}, tags=["billing"])
    assert queue.cancel_job("k") is CancelOutcome.QUEUED
    assert queue.get("k") is None
    assert queue.cancel_job("k") is CancelOutcome.NOT_FOUND
    assert finished_rows(engine, queue.name) == []
    queue.offer("b", 1)
    assert queue.cancel("b") is True and queue.cancel("b") is False  # the shipped bool, unchanged


def test_a_message_whose_lock_expired_is_cancelled_as_queued(
    queue: DelayedQueue, engine: sa.Engine, clock: ManualClock
) -> None:
    queue.offer("k", 1)
    d = queue.try_poll()
    assert d is not None
    clock.advance(2 * MINUTE)  # the lock (one minute) expired: no handler counts any more
    assert queue.cancel_job("k") is CancelOutcome.QUEUED
    assert finished_rows(engine, queue.name) == []
    assert d.ack() is False


def test_a_running_message_is_recorded_as_cancelled_and_fenced(
    queue: DelayedQueue, engine: sa.Engine, clock: ManualClock
) -> None:
    queue.offer("k", {"n": 1}, tags=["billing", "eu"])
    d = queue.try_poll()
    assert d is not None and d.tags == ("billing", "eu")
    clock.advance(dt.timedelta(seconds=5))
    assert queue.cancel_job("k") is CancelOutcome.RUNNING
    [row] = finished_rows(engine, queue.name)
    now_ms = int(clock.now().timestamp() * 1000)
    assert (row.key, row.state, row.attempts, row.tags) == ("k", FINISHED_CANCELLED, 1, ",billing,eu,")
    assert row.finished_at == now_ms
    assert row.expires_at == now_ms + int(DEFAULT_CANCELLED_RETENTION.total_seconds() * 1000)
    assert row.duration_ms == 5000  # from the claim (the lock token's time, the manual clock's here)
    # Its handler's later outcomes change nothing: each is fenced by the lock token.
    assert d.ack() is False
    assert d.retry(dt.timedelta(0), "late") is False
    assert d.dead_letter("late") is False
    assert d.extend(MINUTE) is False
    assert queue.dead_letters() == [] and count_rows(engine, queue.name) == 0
    kept = queue.get("k")
    assert kept is not None and (kept.state, kept.tags) == ("cancelled", ("billing", "eu"))
    clock.advance(10 * MINUTE)
    assert queue.try_poll() is None  # it never runs again
    assert queue.cancel_job("k") is CancelOutcome.NOT_FOUND
    assert len(finished_rows(engine, queue.name)) == 1


def test_keep_for_sets_the_finished_rows_expiry(queue: DelayedQueue, engine: sa.Engine, clock: ManualClock) -> None:
    queue.offer("k", 1)
    assert queue.try_poll() is not None
    assert queue.cancel_job("k", keep_for=dt.timedelta(hours=1)) is CancelOutcome.RUNNING
    [row] = finished_rows(engine, queue.name)
    assert row.expires_at - row.finished_at == 3_600_000
    with pytest.raises(InvalidInputError):
        queue.cancel_job("k", keep_for=-MINUTE)


def test_a_cancel_in_the_callers_transaction_rolls_back_with_it(queue: DelayedQueue, engine: sa.Engine) -> None:
    queue.offer("k", 1)
    assert queue.try_poll() is not None
    with engine.connect() as conn, conn.begin() as tx:
        assert queue.cancel_job("k", using=conn) is CancelOutcome.RUNNING
        tx.rollback()
    assert queue.get("k") is not None and finished_rows(engine, queue.name) == []


def test_an_ack_that_commits_first_leaves_the_cancel_nothing_to_do(
    queue: DelayedQueue, engine: sa.Engine, make_queue: Callable[..., DelayedQueue]
) -> None:
    """The ack's transaction has deleted the message and holds its row lock when the cancel starts: the cancel
    waits for it, then finds nothing running and says so; nothing is recorded."""
    queue.offer("k", 1)
    d = queue.try_poll()
    assert d is not None
    canceller = make_queue(visibility_timeout=MINUTE)
    found: list[CancelOutcome] = []
    with queue.transaction() as conn:
        assert d.ack(using=conn) is True
        t = threading.Thread(target=lambda: found.append(canceller.cancel_job("k")))
        t.start()  # blocks on the row (or SQLite's write lock) until the ack commits
    t.join(30)
    assert found == [CancelOutcome.NOT_FOUND]
    assert finished_rows(engine, queue.name) == [] and count_rows(engine, queue.name) == 0


def test_a_cancel_that_commits_first_fences_the_ack(queue: DelayedQueue, engine: sa.Engine) -> None:
    queue.offer("k", 1)
    d = queue.try_poll()
    assert d is not None
    assert queue.cancel_job("k") is CancelOutcome.RUNNING
    assert queue.ack_many([d]) == 0
    assert len(finished_rows(engine, queue.name)) == 1


def test_a_queue_that_keeps_a_history_records_a_queued_cancel_too(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    """With ``retention`` a queued cancel is kept as cancelled too, for the retention (not the 7-day default)."""
    q = DelayedQueue(engine, queue_name, clock=clock, retention=dt.timedelta(hours=1))
    q.offer("k", 1, tags=["x"])
    assert q.cancel_job("k") is CancelOutcome.QUEUED
    [row] = finished_rows(engine, queue_name)
    assert (row.key, row.state, row.tags, row.duration_ms) == ("k", FINISHED_CANCELLED, ",x,", None)
    assert row.expires_at - row.finished_at == 3_600_000
    assert q.stats().cancelled == 1 and q.stats(tag="x").cancelled == 1 and q.stats(tag="y").cancelled == 0
