"""A job's live view: what each worker's handlers run (queue, key, attempt, running for) rides in its registry
heartbeat's one UPDATE, on both drivers and every backend; ``delayq workers --running``, ``--json``, the workers
page and its JSON panel show it; a beat costs one statement, and one more only when there are outcomes to add."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from conftest import Backend, make_async_engine
from starlette.testclient import TestClient

from delayq import DelayedQueue, Delivery, Handler, ManualClock, Retry, Worker
from delayq.aio import AsyncDelivery, AsyncHandler, AsyncWorker
from delayq.aio import browse as aio_browse
from delayq.browse import RunningJob, WorkerInfo, database_now, list_workers
from delayq.cli import main
from delayq.runtime import _registry
from delayq.runtime._registry import Registry
from delayq.schema import make_tables
from delayq.web import app

TABLES = make_tables()
FAST = dt.timedelta(milliseconds=20)
RAN = dt.timedelta(seconds=90)


@pytest.fixture(autouse=True)
def beats_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """No registry beat but those a test asks for (``beat_now``): two at once could commit out of order."""
    monkeypatch.setattr(_registry, "BEAT", 3600.0)


def beat_now(registry: Registry, in_use: int = 0, handled: int = 0) -> None:
    registry._next = 0.0  # (due now)
    registry.beat(in_use, handled)


@pytest.fixture
def clock(backend: Backend) -> ManualClock:
    """A clock at the database's now: the rows it writes read as running."""
    with backend.engine.connect() as conn:
        return ManualClock(database_now(conn))


def mine(workers: list[WorkerInfo], name: str) -> WorkerInfo:
    [w] = [w for w in workers if w.name == name]
    return w


def test_a_worker_shows_what_its_handler_runs_and_for_how_long(
    backend: Backend, queue_name: str, clock: ManualClock
) -> None:
    engine = backend.engine
    started, release = threading.Event(), threading.Event()

    class SecondTime(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery) -> None:
            if delivery.attempts == 1:
                raise Retry(dt.timedelta(0))  # due again at once: its second attempt runs
            started.set()
            release.wait(30)

    DelayedQueue(engine, queue_name, clock=clock).offer("report-7", 1)
    worker = Worker(engine, [SecondTime()], concurrency=2, poll_interval=FAST, listen=False, clock=clock)
    worker.start()
    try:
        assert started.wait(30)
        clock.advance(RAN)
        beat_now(worker._core.registry, 1)  # (the heartbeat's, here on the test's thread: after the clock moved)
        with engine.connect() as conn:
            w = mine(list_workers(conn, TABLES), worker.name)
        assert w.state == "running"
        assert w.running == (RunningJob(queue_name, "report-7", 2, RAN),)
        assert w.as_dict()["running"] == [
            {"queue": queue_name, "key": "report-7", "attempt": 2, "running_seconds": 90.0, "topic": False}
        ]
        text = CliRunner().invoke(main, ["--url", backend.url, "workers", "--running"])
        assert text.exit_code == 0, text.output
        [line] = [x for x in text.output.splitlines() if "report-7" in x]
        assert queue_name in line and "1m 30s" in line and " 2 " in line
        found = CliRunner().invoke(main, ["--url", backend.url, "workers", "--json"])
        assert found.exit_code == 0, found.output
        [row] = [x for x in json.loads(found.output) if x["name"] == worker.name]
        assert row["running"][0]["key"] == "report-7" and row["running"][0]["attempt"] == 2
        with TestClient(app(engine)) as client:
            page = client.get("/workers").text
            assert "Running now" in page and "report-7" in page and "1m 30s" in page
            assert f'href="/message?queue={queue_name}&amp;key=report-7"' in page.replace("%2D", "-")
            panel = client.get("/api/workers").json()
            [job] = [j for j in panel["running"] if j["key"] == "report-7"]
            assert (job["queue"], job["attempt"], job["running_for"]) == (queue_name, 2, "1m 30s")
            assert [x["running_now"] for x in panel["workers"] if x["id"] == w.id] == [1]
    finally:
        release.set()
        assert worker.stop()
    with engine.connect() as conn:
        assert mine(list_workers(conn, TABLES), worker.name).running == ()  # a clean stop runs nothing


def test_an_async_worker_shows_what_its_handler_runs(backend: Backend, queue_name: str, clock: ManualClock) -> None:
    async def main() -> None:
        started, release = asyncio.Event(), asyncio.Event()

        class Waits(AsyncHandler):
            queue = queue_name

            async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:  # type: ignore[override]
                started.set()
                await release.wait()

        aengine = make_async_engine(backend.url)
        worker = AsyncWorker(aengine, [Waits()], poll_interval=FAST, listen=False, clock=clock)
        await worker.async_queues[queue_name].offer("invoice-3", 1)
        worker.start()
        try:
            await asyncio.wait_for(started.wait(), 30)
            clock.advance(RAN)
            await worker._call(beat_now, worker._core.registry, 1)
            async with aengine.connect() as conn:
                w = mine(await aio_browse.list_workers(conn, TABLES), worker.name)
            assert w.running == (RunningJob(queue_name, "invoice-3", 1, RAN),)
        finally:
            release.set()
            assert await worker.stop()
            await aengine.dispose()

    asyncio.run(main())


@pytest.fixture
def statements(backend: Backend) -> Iterator[list[str]]:
    """The statements the backend's engine sends from here on (their first word)."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement.split(None, 1)[0].upper())

    sa.event.listen(backend.engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        sa.event.remove(backend.engine, "before_cursor_execute", record)


def test_a_beat_is_one_update_and_one_upsert_only_with_outcomes_to_add(
    backend: Backend, queue_name: str, clock: ManualClock, statements: list[str]
) -> None:
    r = Registry(
        backend.engine, TABLES, name="beats", driver="threads", queues=[queue_name], topics=[], slots=4, clock=clock
    )
    r.start(0, 0)
    for _ in range(3):  # outcomes counted between beats cost no statement
        r.tally.count("acked", queue_name, 1)
    statements.clear()
    beat_now(r, 0, 3)
    assert [s for s in statements if s not in ("BEGIN", "COMMIT", "SET")] == ["UPDATE", "INSERT"]
    statements.clear()
    beat_now(r, 0, 3)  # nothing counted since
    assert [s for s in statements if s not in ("BEGIN", "COMMIT", "SET")] == ["UPDATE"]
    r.stop(3)


@pytest.mark.slow
def test_in_chromium_the_workers_page_lists_what_runs_and_the_queue_page_draws_its_history(
    backend: Backend, queue_name: str, clock: ManualClock
) -> None:
    """The workers panel's poll fills Running now (no reload); the queue page's script loads the history chart,
    whose bars hover their counts."""
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (scripts/test --full does)")
    from playwright.sync_api import sync_playwright
    from test_web_browser import CHROMIUM, Served

    engine = backend.engine
    history = Registry(
        engine, TABLES, name="hist", driver="threads", queues=[queue_name], topics=[], slots=1, clock=clock
    )
    history.start(0, 0)
    history.tally.count("acked", queue_name, 12)
    history.tally.count("dead_lettered", queue_name, 2)
    history.stop(12)
    started, release = threading.Event(), threading.Event()

    class Waits(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery) -> None:
            started.set()
            release.wait(60)

    worker = Worker(engine, [Waits()], poll_interval=FAST, listen=False, clock=clock)
    try:
        with sync_playwright() as p, Served(engine, refresh=0.3) as served:
            browser = p.chromium.launch(executable_path=CHROMIUM)
            page = browser.new_page()
            page.goto(f"{served.url}/workers")
            assert page.locator("#running-jobs").inner_text().count("Nothing running") == 1
            DelayedQueue(engine, queue_name, clock=clock).offer("live-1", 1)
            worker.start()
            assert started.wait(30)
            beat_now(worker._core.registry, 1)
            row = page.locator(f'#running-jobs tr[data-runs-on="{worker._core.registry.id}"]')
            row.wait_for()  # the panel's poll brought it
            assert "live-1" in row.inner_text() and queue_name in row.inner_text()
            assert row.locator("a").get_attribute("href") == f"/message?queue={queue_name}&key=live-1"
            page.goto(f"{served.url}/queue?queue={queue_name}")
            page.wait_for_selector(".history .history-chart svg g.bar")  # the script loaded the chart
            chart = page.locator(".history-chart")
            assert "messages per 5 min" in chart.inner_text() and "Totals: processed 12" in chart.inner_text()
            assert "processed 12, failed 0, dead-lettered 2" in chart.locator("g.bar title").first.text_content()
            browser.close()
    finally:
        release.set()
        assert worker.stop()
