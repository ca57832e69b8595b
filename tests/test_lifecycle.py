"""A job's life after its handler: completed history (retention, results, durations), the pruner, uniqueness
after completion, states for callers (``get``, ``wait``) and dead-letter retention. Every backend, both APIs."""

from __future__ import annotations

import datetime as dt
import logging
import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, make_engine

from delayq import DelayedQueue, Delivery, Handler, ManualClock, OfferOutcome, UnknownMessageError, Worker
from delayq.errors import InvalidInputError
from delayq.queue._prune import Pruner
from delayq.schema import make_tables

MINUTE = dt.timedelta(minutes=1)
HOUR = dt.timedelta(hours=1)
T = make_tables()


def pruner(engine: sa.Engine, clock: ManualClock | None) -> Pruner:
    """A pruner of its own chore row (tests share the database, and their clocks differ)."""
    return Pruner(engine, f"test-{uuid.uuid4().hex[:8]}", clock=clock, chore=f"prune-{uuid.uuid4().hex[:12]}")


def finished_rows(engine: sa.Engine, queue_name: str) -> list[Any]:
    fin = T.finished
    with engine.connect() as conn:
        return list(conn.execute(sa.select(fin).where(fin.c.queue == queue_name).order_by(fin.c.id)).all())


def live_count(engine: sa.Engine, queue_name: str, key: str) -> int:
    m = T.messages
    with engine.connect() as conn:
        stmt = sa.select(sa.func.count()).where(m.c.queue == queue_name, m.c.key == key)
        return int(conn.execute(stmt).scalar_one())


# -- completed history ------------------------------------------------------------------------------
def test_an_ack_keeps_the_message_completed_with_result_and_duration_until_the_pruner_deletes_it(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine, clock: ManualClock, queue_name: str
) -> None:
    q = make_queue(retention=HOUR)
    q.offer("job", {"n": 1})
    assert q.get("job").state == "ready"  # type: ignore[union-attr]
    [d] = q.try_poll_many(1)
    assert q.get("job").state == "running"  # type: ignore[union-attr]
    assert d.ack(result={"sum": 3}, duration=dt.timedelta(milliseconds=1500))
    kept = q.get("job")
    assert kept is not None and kept.finished
    assert (kept.state, kept.result, kept.duration, kept.attempts) == (
        "completed",
        {"sum": 3},
        dt.timedelta(milliseconds=1500),
        1,
    )
    assert kept.payload == {"n": 1} and kept.finished_at == clock.now()
    assert q.stats().completed == 1 and q.stats().ready == 0
    [row] = finished_rows(engine, queue_name)
    assert row.expires_at == row.finished_at + HOUR // dt.timedelta(milliseconds=1)

    p = pruner(engine, clock)
    clock.advance(HOUR - dt.timedelta(milliseconds=1))
    assert p.run_once() is not None and q.get("job") is not None  # not before its expiry
    clock.advance(dt.timedelta(milliseconds=1))
    assert p.run_once() is not None
    assert q.get("job") is None and q.stats().completed == 0


def test_a_hand_ack_without_result_keeps_no_result_nor_duration_and_retention_zero_keeps_nothing(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine, queue_name: str
) -> None:
    kept_q = make_queue(retention=HOUR, keep_results=False)
    kept_q.offer_many([("a", 1, None), ("b", 2, None)])
    a, b = kept_q.try_poll_many(2)
    assert a.ack()
    assert kept_q.ack_many([b]) == 1
    for key in ("a", "b"):
        m = kept_q.get(key)
        assert m is not None and (m.state, m.result, m.duration) == ("completed", None, None)
    # keep_results=False: a result passed is not stored
    kept_q.offer("c", 3)
    [c] = kept_q.try_poll_many(1)
    assert c.ack(result="r", duration=MINUTE)
    m = kept_q.get("c")
    assert m is not None and (m.result, m.duration) == (None, MINUTE)

    plain = make_queue(name=f"{queue_name}-plain")
    plain.offer("x", 1)
    [x] = plain.try_poll_many(1)
    assert x.ack(result="ignored")
    assert plain.get("x") is None and finished_rows(engine, f"{queue_name}-plain") == []


def test_a_lost_lock_moves_nothing(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine, clock: ManualClock, queue_name: str
) -> None:
    q = make_queue(retention=HOUR, visibility_timeout=MINUTE)
    q.offer("job", 1)
    [first] = q.try_poll_many(1)
    clock.advance(2 * MINUTE)
    [second] = q.try_poll_many(1)  # the lock expired and another consumer took it
    assert not first.ack(result="stale")
    assert finished_rows(engine, queue_name) == []
    assert second.ack(result="fresh")
    [row] = finished_rows(engine, queue_name)
    assert row.attempts == 2 and q.get("job").result == "fresh"  # type: ignore[union-attr]


def test_a_result_above_the_limit_or_unserializable_is_dropped_with_a_warning_and_the_message_completes(
    make_queue: Callable[..., DelayedQueue], caplog: pytest.LogCaptureFixture
) -> None:
    q = make_queue(retention=HOUR, result_limit=10)
    q.offer_many([("big", 1, None), ("odd", 2, None)])
    big, odd = q.try_poll_many(2)
    with caplog.at_level(logging.WARNING, logger="delayq"):
        assert big.ack(result="x" * 50)
        assert odd.ack(result=object())
    assert "above result_limit=10" in caplog.text and "cannot serialize" in caplog.text
    for key in ("big", "odd"):
        m = q.get(key)
        assert m is not None and (m.state, m.result) == ("completed", None)


def test_lifecycle_settings_are_validated_in_one_place(make_queue: Callable[..., DelayedQueue]) -> None:
    for bad in (
        {"retention": dt.timedelta(seconds=-1)},
        {"retention": 5},
        {"keep_results": "yes"},
        {"result_limit": -1},
        {"unique_for": dt.timedelta(0)},
        {"dead_letter_retention": dt.timedelta(seconds=-1)},
    ):
        with pytest.raises(InvalidInputError):
            make_queue(**bad)
    q = make_queue()
    with pytest.raises(InvalidInputError):
        q.offer("k", 1, unique_for=dt.timedelta(seconds=-5))
    assert q.get("k") is None


# -- states for callers -----------------------------------------------------------------------------
def test_get_tells_scheduled_ready_running_and_dead(
    make_queue: Callable[..., DelayedQueue], clock: ManualClock
) -> None:
    q = make_queue(visibility_timeout=MINUTE)
    q.offer("later", 1, MINUTE)
    assert q.get("later").state == "scheduled"  # type: ignore[union-attr]
    q.offer("now", 2)
    [d] = q.try_poll_many(1)
    assert q.get("now").state == "running"  # type: ignore[union-attr]
    clock.advance(2 * MINUTE)  # its lock expired: due again
    assert q.get("now").state == "ready"  # type: ignore[union-attr]
    [d] = q.try_poll_many(1)
    assert d.dead_letter("no")
    assert q.get(d.key) is None  # as before: dead letters only when asked
    dead = q.get(d.key, include_dead=True)
    assert dead is not None and (dead.state, dead.last_error, dead.finished) == ("dead", "no", True)


def test_wait_returns_what_was_kept_or_times_out(make_queue: Callable[..., DelayedQueue]) -> None:
    q = make_queue(retention=HOUR)
    q.offer("job", 1)
    with pytest.raises(TimeoutError):
        q.wait("job", dt.timedelta(0))
    [d] = q.try_poll_many(1)
    assert d.ack(result=42)
    done = q.wait("job", MINUTE)
    assert done is not None and (done.state, done.result) == ("completed", 42)


def test_wait_wakes_when_another_thread_completes_the_message(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name, retention=HOUR)
    q.offer("job", 1)
    [d] = q.try_poll_many(1)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(q.wait("job", MINUTE)))
    waiter.start()
    assert d.ack(result="done")
    waiter.join(MINUTE.total_seconds())
    assert not waiter.is_alive() and got[0].result == "done"


# -- uniqueness after completion --------------------------------------------------------------------
def test_unique_for_ignores_the_key_while_live_and_within_the_period_after_completion(
    make_queue: Callable[..., DelayedQueue], clock: ManualClock, engine: sa.Engine, queue_name: str
) -> None:
    q = make_queue()  # no retention: the unique_for message alone is kept
    assert q.offer("k", 1, unique_for=HOUR) is OfferOutcome.CREATED
    assert q.offer("k", 2, unique_for=HOUR) is OfferOutcome.IGNORED  # live
    [d] = q.try_poll_many(1)
    assert d.ack(result="r")
    [row] = finished_rows(engine, queue_name)
    assert row.expires_at == row.finished_at + HOUR // dt.timedelta(milliseconds=1)
    assert q.offer("k", 3, unique_for=HOUR) is OfferOutcome.IGNORED  # completed within the hour
    assert q.offer("k", 3, unique_for=HOUR, update=True) is OfferOutcome.IGNORED  # update does not revive it
    assert q.offer_many([("k", 3, None), ("other", 4, None)], unique_for=HOUR) == [
        OfferOutcome.IGNORED,
        OfferOutcome.CREATED,
    ]
    assert q.get("k").state == "completed"  # type: ignore[union-attr]
    clock.advance(HOUR - dt.timedelta(milliseconds=1))
    assert q.offer("k", 5, unique_for=HOUR) is OfferOutcome.IGNORED  # finished_at > now - unique_for
    clock.advance(dt.timedelta(milliseconds=1))  # exactly the period's end: free again
    assert q.offer("k", 5, unique_for=HOUR) is OfferOutcome.CREATED
    assert q.get("k").state == "ready"  # type: ignore[union-attr]
    # a plain offer (no unique_for) is not held back by a completion
    [d] = [x for x in q.try_poll_many(2) if x.key == "k"]
    assert d.ack()
    assert q.offer("k", 6) is OfferOutcome.CREATED


def test_the_queue_default_unique_for_applies_to_offers_and_offer_many(
    make_queue: Callable[..., DelayedQueue], clock: ManualClock
) -> None:
    q = make_queue(unique_for=HOUR)
    q.offer_many([("a", 1, None), ("b", 2, None)])
    for d in q.try_poll_many(2):
        assert d.ack()
    assert q.offer("a", 1) is OfferOutcome.IGNORED
    assert q.offer_many([("b", 1, None), ("c", 1, None), ("c", 2, None)]) == [
        OfferOutcome.IGNORED,
        OfferOutcome.CREATED,
        OfferOutcome.IGNORED,
    ]
    clock.advance(dt.timedelta(milliseconds=1))
    assert q.offer("a", 1, unique_for=dt.timedelta(milliseconds=1)) is OfferOutcome.CREATED  # its own period


@pytest.mark.parametrize("retention", [dt.timedelta(0), HOUR])
def test_eight_concurrent_offerers_across_a_completion_never_make_two(
    backend: Backend, queue_name: str, retention: dt.timedelta
) -> None:
    """8 threads offer the key at a barrier while its completion commits: every offer is IGNORED (live, then
    completed within the period) and no second live message or completion appears."""
    q = DelayedQueue(backend.engine, queue_name, unique_for=HOUR, retention=retention)
    for round_ in range(3):
        key = f"k{round_}"
        assert q.offer(key, 0) is OfferOutcome.CREATED
        [d] = q.try_poll_many(1)
        barrier = threading.Barrier(9)
        outcomes: list[OfferOutcome] = []

        def offer(key: str, barrier: threading.Barrier, outcomes: list[OfferOutcome]) -> None:
            barrier.wait()
            outcomes.append(q.offer(key, 1))

        threads = [threading.Thread(target=offer, args=(key, barrier, outcomes)) for _ in range(8)]
        for t in threads:
            t.start()
        with q.transaction() as conn:
            assert d.ack(using=conn, result=round_)
            barrier.wait()
            time.sleep(0.05)  # widens the window in which the offers meet the uncommitted completion
        for t in threads:
            t.join(60)
        assert outcomes == [OfferOutcome.IGNORED] * 8
        assert live_count(backend.engine, queue_name, key) == 0
        assert [r.key for r in finished_rows(backend.engine, queue_name)].count(key) == 1


# -- dead letters with a retention --------------------------------------------------------------------
def test_dead_letters_get_an_expiry_and_are_pruned(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine, clock: ManualClock, queue_name: str
) -> None:
    q = make_queue(dead_letter_retention=HOUR, max_deliveries=1, visibility_timeout=MINUTE)
    q.offer_many([("a", 1, None), ("b", 2, None)])
    a, _ = q.try_poll_many(2)
    assert a.dead_letter("boom")
    clock.advance(2 * MINUTE)  # b's consumer died: the capped claim dead-letters it
    assert q.try_poll_many(2) == []
    dead = T.dead_letters
    with engine.connect() as conn:
        mine = sa.select(dead.c.key, dead.c.failed_at, dead.c.expires_at).where(dead.c.queue == queue_name)
        rows = conn.execute(mine)
        expiries = {r.key: r.expires_at - r.failed_at for r in rows}
    assert expiries == {"a": 3_600_000, "b": 3_600_000}
    clock.advance(HOUR)
    assert pruner(engine, clock).run_once() is not None
    assert q.dead_letters() == []
    kept = make_queue(name=f"{queue_name}-kept")  # no retention: kept until requeued or purged
    kept.offer("c", 1)
    [c] = kept.try_poll_many(1)
    assert c.dead_letter("x")
    clock.advance(1000 * HOUR)
    assert pruner(engine, clock).run_once() is not None
    assert [m.key for m in kept.dead_letters()] == ["c"]


def test_a_requeued_dead_letter_that_dies_again_gets_a_fresh_expiry(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine, clock: ManualClock
) -> None:
    q = make_queue(dead_letter_retention=HOUR, max_deliveries=1, visibility_timeout=MINUTE)
    q.offer("a", 1)
    [a] = q.try_poll_many(1)
    assert a.dead_letter("first")
    clock.advance(30 * MINUTE)
    assert q.requeue_dead("a")
    assert pruner(engine, clock).run_once() is not None  # nothing expired; the live message is never the pruner's
    clock.advance(10 * MINUTE)
    [again] = q.try_poll_many(1)
    assert again.dead_letter("second")  # at 40 minutes: kept until 1 h 40 min
    clock.advance(30 * MINUTE)  # past the first death's expiry (1 h)
    assert pruner(engine, clock).run_once() is not None
    assert [(d.key, d.last_error) for d in q.dead_letters()] == [("a", "second")]
    clock.advance(31 * MINUTE)
    assert pruner(engine, clock).run_once() is not None
    assert q.dead_letters() == [] and q.get("a") is None


# -- the pruner -----------------------------------------------------------------------------------
def test_one_pruner_holds_the_chore_at_a_time_until_its_lease_runs_out(engine: sa.Engine, clock: ManualClock) -> None:
    chore = f"prune-{uuid.uuid4().hex[:12]}"
    one = Pruner(engine, "one", clock=clock, chore=chore, lease=MINUTE)
    two = Pruner(engine, "two", clock=clock, chore=chore, lease=MINUTE)
    assert one.take() and not two.take()
    assert one.take()  # its own, renewed
    clock.advance(MINUTE)
    assert two.take() and not one.take()


@contextmanager
def row_locked(engine: sa.Engine, table: sa.Table, where: sa.ColumnElement[bool]) -> Iterator[None]:
    with engine.connect() as conn, conn.begin():
        conn.execute(sa.select(table).where(where).with_for_update()).all()
        yield


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_the_pruner_skips_row_locks_on_its_chore_and_on_kept_rows_and_goes_on(
    server: str, backend_urls: dict[str, str], queue_name: str
) -> None:
    from conftest import _backend

    b = _backend(server, backend_urls)
    clock = ManualClock(dt.datetime(2031, 1, 1, tzinfo=dt.UTC))
    q = DelayedQueue(b.engine, queue_name, clock=clock, retention=MINUTE)
    q.offer_many([(f"k{i}", i, None) for i in range(3)])
    assert q.ack_many(q.try_poll_many(3)) == 3
    clock.advance(HOUR)
    p = pruner(b.engine, clock)
    assert p.take()
    with row_locked(b.engine, T.chores, T.chores.c.name == p.chore):
        assert p.take() is False  # skipped, not waited for
    [first, *_] = finished_rows(b.engine, queue_name)
    with row_locked(b.engine, T.finished, T.finished.c.id == first.id):
        assert p.prune() >= 2
        assert [r.key for r in finished_rows(b.engine, queue_name)] == [first.key]
    assert p.run_once() is not None and finished_rows(b.engine, queue_name) == []


PRUNE_PREFIX = "lifeprune_"


def _prune_in_process(url: str, holder: str, chore: str, start: Any, out: Any) -> None:
    """Take the chore (one process gets it), then prune until a round finds nothing (rows that others
    picked are theirs to delete): (took, deleted)."""
    engine = make_engine(url)
    try:
        p = Pruner(engine, holder, table_prefix=PRUNE_PREFIX, chore=chore, batch=100, statements=2)
        start.wait()
        took = p.take()
        deleted = 0
        for _ in range(200):
            n = p.prune()
            deleted += n
            if n == 0:
                break
        out.put((took, deleted))
    except Exception as exc:
        out.put((None, repr(exc)))
    finally:
        engine.dispose()


def test_the_pruner_run_from_three_processes_deletes_each_kept_row_once_and_never_a_live_message(
    backend: Backend,
) -> None:
    from delayq import migrations

    migrations.upgrade(backend.url, prefix=PRUNE_PREFIX)
    tables = make_tables(PRUNE_PREFIX)
    q = DelayedQueue(backend.engine, "q", table_prefix=PRUNE_PREFIX, retention=MINUTE)
    with backend.engine.begin() as conn:
        for t in (tables.finished, tables.messages, tables.dead_letters, tables.chores):
            conn.execute(sa.delete(t))
    kept = 1200
    q.offer_many([(f"k{i}", i, None) for i in range(kept)])
    while True:
        got = q.try_poll_many(500)
        if not got:
            break
        q.ack_many(got)
    with backend.engine.begin() as conn:  # expired long ago (database time), and some live messages
        conn.execute(sa.update(tables.finished).values(expires_at=1))
    q.offer_many([(f"live{i}", i, None) for i in range(50)])
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_prune_in_process, args=(backend.url, f"p{i}", "prune-3", start, out)) for i in range(3)
    ]
    for proc in procs:
        proc.start()
    start.set()
    results = [out.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(60)
    assert [took for took, _ in results].count(True) == 1, results  # one holds the chore (errors: None)
    assert sum(n for _, n in results) == kept, results  # every kept row deleted once
    with backend.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(tables.finished)).scalar_one() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(tables.messages)).scalar_one() == 50


# -- the worker -------------------------------------------------------------------------------------
@pytest.mark.parametrize("transactional", [False, True])
def test_a_workers_handler_result_and_run_time_are_kept(
    engine: sa.Engine, queue_name: str, clock: ManualClock, transactional: bool
) -> None:
    class Doubler(Handler):
        queue = queue_name
        retention = HOUR

        def handle(self, delivery: Delivery, conn: sa.Connection | None = None) -> Any:
            return {"twice": delivery.payload * 2}

    Doubler.transactional = transactional
    worker = Worker(engine, [Doubler()], clock=clock)
    q = worker.queues[0]
    q.offer("a", 2)
    assert worker.run_once() == 1
    m = q.get("a")
    assert m is not None and (m.state, m.result) == ("completed", {"twice": 4})
    assert m.duration is not None and m.duration >= dt.timedelta(0)


def test_an_async_workers_handler_result_and_run_time_are_kept(
    aio_runner: Any, queue_name: str, clock: ManualClock
) -> None:
    from delayq.aio import AsyncHandler, AsyncWorker

    class Doubler(AsyncHandler):
        queue = queue_name
        retention = HOUR

        async def handle(self, delivery: Any, conn: Any = None) -> Any:
            return {"twice": delivery.payload * 2}

    async def run() -> Any:
        worker = AsyncWorker(aio_runner.engine, [Doubler()], clock=clock)
        aq = worker.async_queues[queue_name]
        await aq.offer("a", 2)
        assert await worker.run_once() == 1
        return await aq.get("a")

    m = aio_runner.run(run())
    assert m is not None and (m.state, m.result) == ("completed", {"twice": 4}) and m.duration is not None


# -- the command line --------------------------------------------------------------------------------
def test_the_cli_lists_shows_and_counts_completed_messages(backend: Backend, queue_name: str) -> None:
    from click.testing import CliRunner

    from delayq.cli import main

    def cli(*args: str) -> Any:
        out = CliRunner().invoke(main, ["--url", backend.url, *args], catch_exceptions=False)
        assert out.exit_code == 0, out.output
        return out.output

    q = DelayedQueue(backend.engine, queue_name, retention=HOUR)
    q.offer_many([("a", {"n": 1}, None), ("b", {"n": 2}, None)])
    a, _ = q.try_poll_many(2)
    assert a.ack(result={"ok": True}, duration=dt.timedelta(seconds=2))
    import json

    [row] = json.loads(cli("stats", queue_name, "--json"))
    assert (row["completed"], row["cancelled"], row["in_flight"]) == (1, 0, 1)
    assert "COMPLETED" in cli("stats", queue_name)
    listed = json.loads(cli("ls", queue_name, "--state", "completed", "--json"))
    assert [(m["key"], m["state"], m["result"], m["duration"]) for m in listed] == [
        ("a", "completed", {"ok": True}, 2.0)
    ]
    assert json.loads(cli("ls", queue_name, "--state", "cancelled", "--json")) == []
    assert "RESULT" in cli("ls", queue_name, "--state", "completed")
    shown = cli("show", queue_name, "a")
    assert "completed" in shown and "result" in shown and "2.0s" in shown and "finished_at" in shown


def test_the_pruner_loop_survives_a_failing_round_and_a_worker_runs_it(
    engine: sa.Engine, queue_name: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    from delayq.runtime._chores import PruneChore

    broken = PruneChore(engine, "w1", table_prefix="nothere_", schema=None, clock=clock)
    with caplog.at_level(logging.WARNING, logger="delayq.worker"):
        assert broken.step() is False and broken.step() is False  # logged, and tried again next time
    assert "pruner:" in caplog.text

    class Kept(Handler):
        queue = queue_name
        retention = MINUTE

        def handle(self, delivery: Delivery, conn: sa.Connection | None = None) -> Any:
            return delivery.payload

    worker = Worker(engine, [Kept()], clock=clock, poll_interval=dt.timedelta(milliseconds=20))
    pruner = worker._core.pruner
    assert pruner is not None
    pruner.interval = 0.02  # rounds every 20 ms
    pruner.pruner.chore = f"prune-{uuid.uuid4().hex[:12]}"  # a chore row of its own (tests share the database)
    q = worker.queues[0]
    q.offer("a", 1)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while q.get("a") is None or q.get("a").state != "completed":  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the worker to complete the message"
            time.sleep(0.01)
        clock.advance(2 * MINUTE)
        while q.get("a") is not None:
            assert time.monotonic() < deadline, "the worker's pruner to delete the kept message"
            time.sleep(0.01)
    finally:
        worker.stop()
    assert pruner.rounds >= 1 and pruner.deleted >= 1


def test_an_async_workers_pruner_deletes_kept_messages(aio_runner: Any, queue_name: str, clock: ManualClock) -> None:
    import asyncio

    from delayq.aio import AsyncHandler, AsyncWorker

    class Kept(AsyncHandler):
        queue = queue_name
        retention = MINUTE

        async def handle(self, delivery: Any, conn: Any = None) -> Any:
            return delivery.payload

    async def run() -> int:
        worker = AsyncWorker(aio_runner.engine, [Kept()], clock=clock, poll_interval=dt.timedelta(milliseconds=20))
        pruner = worker._core.pruner
        assert pruner is not None
        pruner.interval = 0.02
        pruner.pruner.chore = f"prune-{uuid.uuid4().hex[:12]}"
        aq = worker.async_queues[queue_name]
        await aq.offer("a", 1)
        worker.start()
        try:
            deadline = time.monotonic() + 30
            while (m := await aq.get("a")) is None or m.state != "completed":
                assert time.monotonic() < deadline, "the worker to complete the message"
                await asyncio.sleep(0.01)
            clock.advance(2 * MINUTE)
            while await aq.get("a") is not None:
                assert time.monotonic() < deadline, "the worker's pruner to delete the kept message"
                await asyncio.sleep(0.01)
        finally:
            await worker.stop()
        return pruner.deleted

    assert aio_runner.run(run()) >= 1


# -- wait on a key never seen; durations in its errors ----------------------------------------------------------
def test_wait_on_a_key_never_seen_raises_unknown_message_error(make_queue: Callable[..., DelayedQueue]) -> None:
    q = make_queue(retention=HOUR)
    with pytest.raises(UnknownMessageError) as raised:
        q.wait("never-offered", MINUTE)
    assert isinstance(raised.value, KeyError)
    assert str(raised.value) == f"no message 'never-offered' in queue {q.name!r}: none live, kept or dead-lettered"


def test_wait_returns_none_when_the_message_it_saw_finished_and_nothing_was_kept(
    make_queue: Callable[..., DelayedQueue], api: str
) -> None:
    """No retention: the ack keeps nothing. The ack runs right after wait's first look (a hook on ``get``), so
    wait saw the message live: None, not ``UnknownMessageError``."""
    q = make_queue()
    q.offer("job", 1)
    [d] = q.try_poll_many(1)
    acked: list[bool] = []
    target: Any = q._target if api == "async" else q  # type: ignore[attr-defined]
    looked = target.get
    if api == "async":

        async def get(*args: Any, **kwargs: Any) -> Any:
            found = await looked(*args, **kwargs)
            if not acked:
                acked.append(await d._target.ack())  # type: ignore[attr-defined]
            return found

    else:

        def get(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            found = looked(*args, **kwargs)
            if not acked:
                acked.append(d.ack())
            return found

    target.get = get
    assert q.wait("job", MINUTE) is None and acked == [True]


def test_durations_in_errors_read_as_people_write_them(make_queue: Callable[..., DelayedQueue]) -> None:
    with pytest.raises(InvalidInputError, match=r"^retention must be zero or positive, got -1s$"):
        make_queue(retention=-dt.timedelta(seconds=1))
    q = make_queue(retention=HOUR)
    q.offer("job", 1)
    with pytest.raises(InvalidInputError, match=r"^timeout must not be negative, got -1.5s$"):
        q.wait("job", -dt.timedelta(seconds=1.5))
    with pytest.raises(TimeoutError, match=r"still ready after 0ms$"):
        q.wait("job", dt.timedelta(0))
    with pytest.raises(InvalidInputError, match=r"^keep_for must not be negative, got -1m 30s$"):
        q.cancel_job("job", keep_for=-dt.timedelta(seconds=90))
