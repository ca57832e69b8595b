"""The queue history (``{prefix}queue_history``): the outcomes a worker counts (processed, failed, dead-lettered)
reach the minute's row with its registry heartbeat and its clean stop, on both drivers and every backend; many
workers add up; rows past a day go in bounded batches; a failed write loses nothing; ``delayq history``, the
dashboard's charts and ``/history.json`` read it, the same after a restart."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from conftest import Backend, make_async_engine
from starlette.testclient import TestClient

from delayq import DeadLetter, DelayedQueue, Delivery, Handler, ManualClock, RetryPolicy, Worker, migrations
from delayq.aio import AsyncDelivery, AsyncHandler, AsyncWorker
from delayq.aio import browse as aio_browse
from delayq.browse import HistoryPoint, QueueHistory, database_now, queue_history
from delayq.cli import main
from delayq.runtime import _registry
from delayq.runtime._registry import Registry
from delayq.schema import make_tables
from delayq.web import app

TABLES = make_tables()
MINUTE = dt.timedelta(minutes=1)
LATER = RetryPolicy.fixed(dt.timedelta(hours=1))
"""Failed messages come back in an hour: on a ManualClock that stands still, never during a test."""


@pytest.fixture
def t0(backend: Backend) -> dt.datetime:
    """The start of a minute ten minutes before the database's clock: inside the last day whatever the test does."""
    with backend.engine.connect() as conn:
        now = database_now(conn)
    return now.replace(second=0, microsecond=0) - 10 * MINUTE


def outcomes(queue_name: str, calls: list[str], all_in: threading.Event, expected: int) -> Handler:
    class Outcomes(Handler):
        queue = queue_name
        retry = LATER

        def handle(self, delivery: Delivery) -> None:
            calls.append(delivery.key)
            if len(calls) == expected:
                all_in.set()
            if delivery.key.startswith("fail"):
                raise ValueError("no")
            if delivery.key.startswith("dead"):
                raise DeadLetter("gone")

    return Outcomes()


def async_outcomes(queue_name: str, calls: list[str], all_in: asyncio.Event, expected: int) -> AsyncHandler:
    class Outcomes(AsyncHandler):
        queue = queue_name
        retry = LATER

        async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:  # type: ignore[override]
            calls.append(delivery.key)
            if len(calls) == expected:
                all_in.set()
            if delivery.key.startswith("fail"):
                raise ValueError("no")
            if delivery.key.startswith("dead"):
                raise DeadLetter("gone")

    return Outcomes()


def run_threads(backend: Backend, queue_name: str, clock: ManualClock, keys: list[str]) -> None:
    """A worker on ``clock`` handles ``keys`` (each once) and stops cleanly."""
    DelayedQueue(backend.engine, queue_name, clock=clock).offer_many([(k, 1, None) for k in keys])
    calls: list[str] = []
    all_in = threading.Event()
    worker = Worker(backend.engine, [outcomes(queue_name, calls, all_in, len(keys))], listen=False, clock=clock)
    worker.start()
    try:
        assert all_in.wait(30), calls
    finally:
        assert worker.stop()
    assert sorted(calls) == sorted(keys)


def run_asyncio(backend: Backend, queue_name: str, clock: ManualClock, keys: list[str]) -> None:
    async def main() -> None:
        aengine = make_async_engine(backend.url)
        calls: list[str] = []
        all_in = asyncio.Event()
        handler = async_outcomes(queue_name, calls, all_in, len(keys))
        worker = AsyncWorker(aengine, [handler], listen=False, clock=clock)
        await worker.async_queues[queue_name].offer_many([(k, 1, None) for k in keys])
        worker.start()
        try:
            await asyncio.wait_for(all_in.wait(), 30)
        finally:
            assert await worker.stop()
            await aengine.dispose()
        assert sorted(calls) == sorted(keys)

    asyncio.run(main())


def minutes(history: QueueHistory) -> list[tuple[dt.datetime, int, int, int]]:
    return [(p.minute, p.processed, p.failed, p.dead_lettered) for p in history.points]


@pytest.mark.parametrize("driver", ["threads", "asyncio"])
def test_a_worker_counts_its_outcomes_per_minute_and_a_restart_adds_to_them(
    backend: Backend, queue_name: str, t0: dt.datetime, driver: str
) -> None:
    run = run_threads if driver == "threads" else run_asyncio
    clock = ManualClock(t0 + dt.timedelta(seconds=5))
    run(backend, queue_name, clock, ["ok1", "ok2", "ok3", "fail1", "fail2", "dead1"])
    clock.advance(2 * MINUTE)
    run(backend, queue_name, clock, ["ok4", "ok5", "ok6", "ok7", "dead2"])  # a restarted worker, two minutes on
    with backend.engine.connect() as conn:
        found = queue_history(conn, TABLES, queue_name, now=clock.now())
        every = queue_history(conn, TABLES, now=clock.now())
    assert minutes(found) == [(t0, 3, 2, 1), (t0 + 2 * MINUTE, 4, 0, 1)]
    assert found.totals() == (7, 2, 2)
    dense = found.dense()
    assert (
        len(dense) == 24 * 60
        and dense[-1].minute == t0 + 2 * MINUTE
        and dense[-2] == HistoryPoint(t0 + MINUTE, 0, 0, 0)
    )
    mine = {p.minute: p for p in every.points}
    assert mine[t0].processed >= 3 and mine[t0 + 2 * MINUTE].processed >= 4  # (other tests' queues add to it)


@pytest.fixture
def quick_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registry beats whenever asked, and forgetting (and pruning) at every beat."""
    monkeypatch.setattr(_registry, "BEAT", 0.0)
    monkeypatch.setattr(_registry, "FORGET_EVERY", 1)


def registry(backend: Backend, clock: ManualClock, tables: Any = TABLES) -> Registry:
    r = Registry(backend.engine, tables, name="test", driver="threads", queues=["q"], topics=[], slots=1, clock=clock)
    r.start(0, 0)
    return r


def test_beats_add_up_across_workers_in_the_minute_of_the_beat(
    backend: Backend, queue_name: str, t0: dt.datetime, quick_beats: None
) -> None:
    clock = ManualClock(t0 + dt.timedelta(seconds=50))
    one, two = registry(backend, clock), registry(backend, clock)
    other = f"{queue_name}-b"
    one.tally.count("acked", queue_name, 5)
    one.tally.count("retried", queue_name, 1)
    one.tally.count("offered", queue_name, 9)  # not an outcome: not counted
    two.tally.count("acked", queue_name, 2)
    two.tally.count("dead_lettered", other, 3)
    one.beat(0, 0)
    two.beat(0, 0)
    clock.advance(dt.timedelta(seconds=20))  # the next minute
    one.tally.count("acked", queue_name, 1)
    one.beat(0, 0)
    one.beat(0, 0)  # nothing new: nothing written
    two.stop(0)
    one.stop(0)
    with backend.engine.connect() as conn:
        assert minutes(queue_history(conn, TABLES, queue_name, now=clock.now())) == [
            (t0, 7, 1, 0),
            (t0 + MINUTE, 1, 0, 0),
        ]
        assert minutes(queue_history(conn, TABLES, other, now=clock.now())) == [(t0, 0, 0, 3)]


def test_rows_past_a_day_are_deleted_in_bounded_batches_by_the_beats(
    backend: Backend, queue_name: str, t0: dt.datetime, quick_beats: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_registry, "HISTORY_BATCH", 2)
    old_clock = ManualClock(t0 - dt.timedelta(hours=25))
    old = registry(backend, old_clock)
    queues = [f"{queue_name}-{i}" for i in range(3)]
    for q in queues:
        old.tally.count("acked", q, 1)
    old.stop(0)
    recent = registry(backend, ManualClock(t0 - dt.timedelta(hours=23)))
    recent.tally.count("acked", queues[0], 1)
    recent.stop(0)

    def kept() -> list[tuple[str, int]]:
        h = TABLES.queue_history
        with backend.engine.connect() as conn:
            rows = conn.execute(sa.select(h.c.queue, h.c.processed).where(h.c.queue.in_(queues))).all()
        return sorted((r.queue, r.processed) for r in rows)

    assert len(kept()) == 4
    clock = ManualClock(t0)
    pruner = registry(backend, clock)
    # (other tests' old rows may be deleted first: beat until ours are gone, at most 2 per beat)
    deleted: list[int] = []
    for _ in range(50):
        before = len(kept())
        pruner.beat(0, 0)
        deleted.append(before - len(kept()))
        if len(kept()) == 1:
            break
    assert max(deleted) <= 2
    assert kept() == [(queues[0], 1)]  # the row of 23 hours ago stays
    pruner.stop(0)


@pytest.fixture
def no_history_table(backend: Backend) -> Iterator[Any]:
    """delayq's tables under a prefix of their own, without the queue history table."""
    prefix = "histmiss_"
    migrations.upgrade(backend.url, prefix=prefix)
    tables = make_tables(prefix)
    tables.queue_history.drop(backend.engine, checkfirst=True)
    try:
        yield tables
    finally:
        tables.queue_history.create(backend.engine, checkfirst=True)


def test_counts_whose_write_failed_are_written_by_a_later_beat(
    backend: Backend, queue_name: str, t0: dt.datetime, quick_beats: None, no_history_table: Any
) -> None:
    clock = ManualClock(t0)
    r = registry(backend, clock, no_history_table)
    r.tally.count("acked", queue_name, 4)
    r.beat(0, 0)  # fails (logged): the table is missing
    no_history_table.queue_history.create(backend.engine)
    r.tally.count("acked", queue_name, 1)
    r.beat(0, 0)
    r.stop(0)
    with backend.engine.connect() as conn:
        assert minutes(queue_history(conn, no_history_table, queue_name, now=clock.now())) == [(t0, 5, 0, 0)]


def test_the_async_read_is_the_same(backend: Backend, queue_name: str, t0: dt.datetime, quick_beats: None) -> None:
    clock = ManualClock(t0)
    r = registry(backend, clock)
    r.tally.count("retried", queue_name, 2)
    r.stop(0)

    async def main() -> QueueHistory:
        aengine = make_async_engine(backend.url)
        try:
            async with aengine.connect() as conn:
                return await aio_browse.queue_history(conn, TABLES, queue_name, now=clock.now())
        finally:
            await aengine.dispose()

    assert minutes(asyncio.run(main())) == [(t0, 0, 2, 0)]


def test_the_span_is_a_minute_to_a_day(backend: Backend) -> None:
    from delayq.errors import InvalidInputError

    with backend.engine.connect() as conn:
        for span in (dt.timedelta(seconds=59), dt.timedelta(hours=25)):
            with pytest.raises(InvalidInputError):
                queue_history(conn, TABLES, span=span)


def written(backend: Backend, queue_name: str, t0: dt.datetime) -> None:
    """History a worker wrote: 3 processed, 2 failed, 1 dead-lettered at t0; 4 processed two minutes later."""
    clock = ManualClock(t0)
    r = registry(backend, clock)
    r.tally.count("acked", queue_name, 3)
    r.tally.count("retried", queue_name, 2)
    r.tally.count("dead_lettered", queue_name, 1)
    r.beat(0, 0)
    clock.advance(2 * MINUTE)
    r.tally.count("acked", queue_name, 4)
    r.stop(0)


def test_a_restarted_dashboard_draws_and_serves_the_same_history(
    backend: Backend, queue_name: str, t0: dt.datetime, quick_beats: None
) -> None:
    written(backend, queue_name, t0)
    answers = []
    for _ in range(2):  # a dashboard, then another one (a restart): the same history, from the database
        with TestClient(app(backend.engine)) as client:
            r = client.get("/history.json", params={"queue": queue_name})
            assert r.status_code == 200, r.text
            answers.append(r.json())
            page = client.get("/queue", params={"queue": queue_name}).text
            assert 'class="history" data-history="/history?queue=' in page  # (its script loads the chart)
            assert 'class="history" data-history="/history?hours=24"' in client.get("/").text  # every queue
            day = client.get("/history", params={"queue": queue_name}).text  # 5-minute bars
            assert "messages per 5 min" in day and "the last 24 h" in day and "<svg" in day
            hour = client.get("/history", params={"queue": queue_name, "hours": "1"}).text  # 1-minute bars
            assert "messages per minute" in hour
            bars = re.findall(r"<title>([^<]*)</title>", hour)
            assert bars == [
                f"{t0:%H:%M}: processed 3, failed 2, dead-lettered 1",
                f"{t0 + 2 * MINUTE:%H:%M}: processed 4, failed 0, dead-lettered 0",
            ]
            assert 'data-total="processed">7<' in hour
    assert [(a["points"], a["totals"]) for a in answers] == [(answers[0]["points"], answers[0]["totals"])] * 2
    got = answers[0]
    assert got["queue"] == queue_name
    assert [(p["minute"], p["processed"], p["failed"], p["dead_lettered"]) for p in got["points"]] == [
        (t0.isoformat(), 3, 2, 1),
        ((t0 + 2 * MINUTE).isoformat(), 4, 0, 0),
    ]
    assert got["totals"] == {"processed": 7, "failed": 2, "dead_lettered": 1}


@pytest.mark.parametrize(
    "params",
    [
        {"queue": "x" * 101},
        {"queue": ""},
        {"queue": "a\x00b"},
        {"hours": "0"},
        {"hours": "25"},
        {"hours": "nan"},
        {"hours": "1e400"},
        {"hours": "x"},
    ],
)
def test_bad_history_input_is_a_400(backend: Backend, params: dict[str, str]) -> None:
    with TestClient(app(backend.engine)) as client:
        for path in ("/history.json", "/history"):
            r = client.get(path, params=params)
            assert r.status_code == 400, (path, r.status_code, r.text[:200])


def test_delayq_history_prints_the_minutes(
    backend: Backend, queue_name: str, t0: dt.datetime, quick_beats: None
) -> None:
    written(backend, queue_name, t0)
    found = CliRunner().invoke(main, ["--url", backend.url, "history", queue_name, "--json"])
    assert found.exit_code == 0, found.output
    got = json.loads(found.output)
    assert [(p["minute"], p["processed"], p["failed"], p["dead_lettered"]) for p in got["points"]] == [
        (t0.isoformat(), 3, 2, 1),
        ((t0 + 2 * MINUTE).isoformat(), 4, 0, 0),
    ]
    text = CliRunner().invoke(main, ["--url", backend.url, "history", queue_name])
    assert text.exit_code == 0, text.output
    assert f"{t0:%H:%M}" in text.output and "total" in text.output
    bad = CliRunner().invoke(main, ["--url", backend.url, "history", queue_name, "--last", "2d"])
    assert bad.exit_code == 2 and bad.output.count("\n") == 1 and "--last 2d" in bad.output


ADDING_UPSERT = {
    "postgresql": "ON CONFLICT (queue, minute) DO UPDATE SET processed = (delayq_queue_history.processed + "
    "excluded.processed), failed = (delayq_queue_history.failed + excluded.failed), dead_lettered = "
    "(delayq_queue_history.dead_lettered + excluded.dead_lettered)",
    "sqlite": "ON CONFLICT (queue, minute) DO UPDATE SET processed = (delayq_queue_history.processed + "
    "excluded.processed), failed = (delayq_queue_history.failed + excluded.failed), dead_lettered = "
    "(delayq_queue_history.dead_lettered + excluded.dead_lettered)",
    "mysql": "ON DUPLICATE KEY UPDATE processed = (delayq_queue_history.processed + VALUES(processed)), failed = "
    "(delayq_queue_history.failed + VALUES(failed)), dead_lettered = (delayq_queue_history.dead_lettered + "
    "VALUES(dead_lettered))",
}


@pytest.mark.parametrize("name", sorted(ADDING_UPSERT))
def test_the_adding_upsert_is_pinned(name: str) -> None:
    """Compiled only (no database): a minute's row takes what a beat adds, on each backend's upsert."""
    from sqlalchemy.dialects import mysql, postgresql, sqlite

    from delayq.dialects import dialect_class

    sa_dialect = {"postgresql": postgresql.dialect(), "mysql": mysql.dialect(), "sqlite": sqlite.dialect()}[name]
    upsert = dialect_class(name)(sa_dialect).adding_upsert(
        TABLES.queue_history, ["queue", "minute"], ["processed", "failed", "dead_lettered"]
    )
    rows = [{"queue": q, "minute": 0, "processed": 1, "failed": 0, "dead_lettered": 0} for q in ("a", "b")]
    text = re.sub(r"\s+", " ", str(upsert.values(rows).compile(dialect=sa_dialect)))
    assert text.count("VALUES (") == 1 and text.count("), (") == 1  # one statement, a row per queue
    assert text.endswith(ADDING_UPSERT[name])
