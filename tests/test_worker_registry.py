"""The worker registry (``{prefix}workers``): each worker's row from start to clean stop, on both drivers and
every backend; gone and forgotten rows; a registry that fails (its table missing, its row locked) never stops
a worker from working; ``delayq workers`` and ``delayq top`` show it."""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from conftest import Backend, make_async_engine, make_engine

from delayq import DelayedQueue, Delivery, Handler, ManualClock, Worker, migrations
from delayq.aio import AsyncDelivery, AsyncHandler, AsyncWorker
from delayq.aio import browse as aio_browse
from delayq.browse import GONE_AFTER, WorkerInfo, database_now, list_workers
from delayq.cli import main
from delayq.runtime import _registry
from delayq.runtime._registry import Registry
from delayq.schema import make_tables

FAST = dt.timedelta(milliseconds=20)
TABLES = make_tables()


@pytest.fixture(autouse=True)
def quick_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registry beats at every heartbeat tick, and forgetting at every beat (the defaults: 10 s, a minute)."""
    monkeypatch.setattr(_registry, "BEAT", 0.0)
    monkeypatch.setattr(_registry, "FORGET_EVERY", 1)


def wait_for(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def row_of(engine: sa.Engine, name: str, tables: Any = TABLES) -> WorkerInfo | None:
    with engine.connect() as conn:
        return next((w for w in list_workers(conn, tables) if w.name == name), None)


def blocking_handler(queue_name: str, release: threading.Event) -> Handler:
    class Blocking(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery) -> None:
            release.wait(30)

    return Blocking()


def test_a_worker_registers_beats_with_its_slots_and_marks_its_clean_stop(backend: Backend, queue_name: str) -> None:
    engine = backend.engine
    release = threading.Event()
    worker = Worker(engine, [blocking_handler(queue_name, release)], concurrency=3, poll_interval=FAST, listen=False)
    DelayedQueue(engine, queue_name).offer("a", 1)
    worker.start()
    try:
        wait_for(lambda: (w := row_of(engine, worker.name)) is not None and w.slots_in_use == 1, "a slot in use")
        w = row_of(engine, worker.name)
        assert w is not None
        assert (w.state, w.slots, w.driver, w.queues, w.topics) == ("running", 3, "threads", (queue_name,), ())
        assert w.stopped_at is None and w.started_at <= w.heartbeat_at <= w.now
        release.set()
        wait_for(lambda: (w := row_of(engine, worker.name)) is not None and w.handled == 1, "the handled count")
    finally:
        release.set()
        assert worker.stop()
    w = row_of(engine, worker.name)
    assert w is not None and w.state == "stopped" and w.slots_in_use == 0 and w.stopped_at is not None


def test_an_async_worker_registers_and_marks_its_clean_stop(backend: Backend, queue_name: str) -> None:
    engine = backend.engine

    class Quick(AsyncHandler):
        queue = queue_name

        async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:  # type: ignore[override]
            pass

    async def main() -> None:
        aengine = make_async_engine(backend.url)
        worker = AsyncWorker(aengine, [Quick()], concurrency=2, poll_interval=FAST, listen=False)
        await worker.async_queues[queue_name].offer("a", 1)
        worker.start()
        try:
            for _ in range(1500):
                async with aengine.connect() as conn:
                    mine = [w for w in await aio_browse.list_workers(conn, TABLES) if w.name == worker.name]
                if mine and mine[0].handled == 1:
                    break
                await asyncio.sleep(0.02)
            assert mine and (mine[0].state, mine[0].driver, mine[0].slots) == ("running", "asyncio", 2)
        finally:
            assert await worker.stop()
            await aengine.dispose()
        w = row_of(engine, worker.name)
        assert w is not None and w.state == "stopped"

    asyncio.run(main())


def test_silent_workers_show_as_gone_and_old_rows_are_deleted_by_a_running_worker(backend: Backend) -> None:
    engine = backend.engine
    with engine.connect() as conn:
        now = database_now(conn)

    def crashed(name: str, ago: dt.timedelta) -> Registry:
        """A worker that registered, beat last ``ago`` before now (database time), and never stopped."""
        r = Registry(engine, TABLES, name=name, driver="threads", queues=["q"], topics=[], slots=1, clock=None)
        r.clock = ManualClock(now - ago)
        r.start(0, 0)
        return r

    fresh = crashed(f"fresh-{id(engine)}", dt.timedelta(seconds=5))
    silent = crashed(f"silent-{id(engine)}", GONE_AFTER + dt.timedelta(seconds=30))
    old = crashed(f"old-{id(engine)}", _registry.FORGET_AFTER + dt.timedelta(minutes=5))
    assert [row_of(engine, r._row["name"]).state for r in (fresh, silent, old)] == ["running", "gone", "gone"]  # type: ignore[union-attr]
    fresh.clock = None
    fresh.beat(0, 0)  # a running worker's beat deletes the rows gone for FORGET_AFTER (a bounded batch)
    assert row_of(engine, old._row["name"]) is None  # type: ignore[arg-type]
    assert row_of(engine, silent._row["name"]) is not None  # type: ignore[arg-type]
    for r in (fresh, silent):
        r.clock = None
        r.stop(0)
    assert row_of(engine, silent._row["name"]).state == "stopped"  # type: ignore[arg-type,union-attr]


@pytest.fixture
def no_registry_table(backend: Backend) -> Iterator[str]:
    """delayq's tables under a prefix of their own, without the workers table."""
    prefix = "wkmiss_"
    migrations.upgrade(backend.url, prefix=prefix)
    tables = make_tables(prefix)
    tables.workers.drop(backend.engine, checkfirst=True)
    try:
        yield prefix
    finally:
        tables.workers.create(backend.engine, checkfirst=True)


def test_a_worker_works_without_its_registry_table(
    backend: Backend, queue_name: str, no_registry_table: str, caplog: pytest.LogCaptureFixture
) -> None:
    done: list[str] = []

    class Record(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery) -> None:
            done.append(delivery.key)

    q = DelayedQueue(backend.engine, queue_name, table_prefix=no_registry_table)
    q.offer_many([(f"m{i}", i, None) for i in range(5)])
    worker = Worker(backend.engine, [Record()], poll_interval=FAST, listen=False, table_prefix=no_registry_table)
    with caplog.at_level(logging.WARNING, logger="delayq.worker"):
        worker.start()
        try:
            wait_for(lambda: len(done) == 5, "the messages to be handled")
            q.offer("late", 1)
            wait_for(lambda: "late" in done, "a message offered after a failed registry beat")
        finally:
            assert worker.stop()
    assert any("worker registry: register failed" in r.getMessage() for r in caplog.records)


def test_a_locked_registry_row_holds_no_work_up(
    backend: Backend, queue_name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another transaction holds the worker's registry row: its beats give up after the call bound (logged) and
    the worker goes on claiming, handling, acking and extending; once the lock goes, the beats resume."""
    if backend.name == "sqlite":
        pytest.skip("SQLite has no row locks (a held write lock holds every writer, the worker's acks too)")
    monkeypatch.setattr(_registry, "CALL_BOUND", 0.3)
    engine = make_engine(backend.url)
    done: list[str] = []

    class Record(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery) -> None:
            done.append(delivery.key)

    q = DelayedQueue(engine, queue_name)
    worker = Worker(engine, [Record()], poll_interval=FAST, listen=False)
    worker.start()
    locker = engine.connect()
    try:
        wait_for(lambda: row_of(engine, worker.name) is not None, "the worker's row")
        w = TABLES.workers
        with caplog.at_level(logging.WARNING, logger="delayq.worker"):
            locker.execute(sa.select(w.c.id).where(w.c.name == worker.name).with_for_update()).one()
            wait_for(
                lambda: any("worker registry: heartbeat failed" in r.getMessage() for r in caplog.records),
                "a beat to give up on the locked row",
            )
            q.offer_many([(f"m{i}", i, None) for i in range(20)])
            wait_for(lambda: len(done) == 20, "the messages to be handled under the lock")
            wait_for(lambda: q.stats().in_flight == 0 and q.stats().ready == 0, "the acks")
        locker.rollback()
        before = row_of(engine, worker.name)
        assert before is not None
        wait_for(lambda: (w2 := row_of(engine, worker.name)) is not None and w2.handled == 20, "the beats to resume")
    finally:
        locker.close()
        assert worker.stop()
        engine.dispose()


def test_delayq_workers_and_top_show_the_registry(backend: Backend, queue_name: str) -> None:
    engine = backend.engine
    release = threading.Event()
    worker = Worker(engine, [blocking_handler(queue_name, release)], concurrency=2, poll_interval=FAST, listen=False)
    DelayedQueue(engine, queue_name).offer("a", 1)
    worker.start()
    try:
        wait_for(lambda: (w := row_of(engine, worker.name)) is not None and w.slots_in_use == 1, "a slot in use")
        url = backend.url
        found = CliRunner().invoke(main, ["--url", url, "workers", "--json"])
        assert found.exit_code == 0, found.output
        mine = [w for w in json.loads(found.output) if w["name"] == worker.name]
        assert len(mine) == 1 and mine[0]["state"] == "running" and mine[0]["slots_in_use"] == 1
        text = CliRunner().invoke(main, ["--url", url, "workers"])
        assert text.exit_code == 0 and queue_name in text.output and "1/2" in text.output
        from rich.console import Console

        from delayq.top import Top, render

        out = io.StringIO()
        Console(file=out, width=200).print(render(Top(engine, only=[queue_name]).snapshot()))
        assert "workers" in out.getvalue() and "running" in out.getvalue()
    finally:
        release.set()
        assert worker.stop()
