"""A kept message remembers its priority, its group and the worker that finished it (issue 42, item 1's message
page; delayq_0013): completed by a ``Worker`` or an ``AsyncWorker``, dead-lettered by its handler, cancelled while
running; a requeued dead letter gets its priority and group back; ``get``, the listings, ``delayq show``,
``ls --json`` and the message page show them; the migration keeps the rows, up and down. Every backend; the
queue's own operations with both APIs."""

from __future__ import annotations

import datetime as dt
import json
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from conftest import Backend

from delayq import DeadLetter, DelayedQueue, Delivery, Handler, ManualClock, RetryPolicy, Worker, migrations
from delayq.browse import State, database_now, list_messages
from delayq.cli import main
from delayq.schema import make_tables
from delayq.web import app

with warnings.catch_warnings():  # (Starlette 1.x prefers httpx2 under its TestClient; httpx works)
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

HOUR = dt.timedelta(hours=1)
BOTH_APIS = pytest.mark.parametrize("api", ["sync", "async"], indirect=True)
T = make_tables()


def origin(m: Any) -> tuple[str, int | None, str | None, str | None]:
    return m.state, m.priority, m.group, m.worker


def kept_rows(engine: sa.Engine, table: sa.Table, queue_name: str) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        stmt = sa.select(table.c.key, table.c.priority, table.c.group_key, table.c.worker)
        return [tuple(r) for r in conn.execute(stmt.where(table.c.queue == queue_name).order_by(table.c.id))]


# -- a worker's outcomes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("transactional", [False, True])
def test_a_job_a_worker_completes_keeps_its_priority_group_and_the_workers_registry_id(
    engine: sa.Engine, queue_name: str, clock: ManualClock, transactional: bool
) -> None:
    class Kept(Handler):
        queue = queue_name
        retention = HOUR

        def handle(self, delivery: Delivery, conn: sa.Connection | None = None) -> Any:
            return delivery.payload

    Kept.transactional = transactional
    worker = Worker(engine, [Kept()], clock=clock)
    q = worker.queues[0]
    q.offer("job", 1, priority=7, group="g")
    q.offer("plain", 2)
    assert worker.run_once() == 2
    me = worker._core.registry.id
    assert origin(q.get("job")) == ("completed", 7, "g", me)
    assert origin(q.get("plain")) == ("completed", 0, None, me)
    assert sorted(kept_rows(engine, T.finished, queue_name)) == [("job", 7, "g", me), ("plain", 0, None, me)]


def test_a_job_an_async_worker_completes_keeps_its_priority_group_and_the_workers_registry_id(
    aio_runner: Any, queue_name: str, clock: ManualClock
) -> None:
    from delayq.aio import AsyncHandler, AsyncWorker

    class Kept(AsyncHandler):
        queue = queue_name
        retention = HOUR

        async def handle(self, delivery: Any, conn: Any = None) -> Any:
            return delivery.payload

    async def run() -> tuple[Any, str]:
        worker = AsyncWorker(aio_runner.engine, [Kept()], clock=clock)
        aq = worker.async_queues[queue_name]
        await aq.offer("job", 1, priority=7, group="g")
        assert await worker.run_once() == 1
        return await aq.get("job"), worker._core.registry.id

    m, me = aio_runner.run(run())
    assert origin(m) == ("completed", 7, "g", me)


@pytest.mark.parametrize("how", ["DeadLetter", "retries used up"])
def test_a_job_its_handler_dead_letters_keeps_its_priority_group_and_the_workers_registry_id(
    engine: sa.Engine, queue_name: str, clock: ManualClock, how: str
) -> None:
    class Failing(Handler):
        queue = queue_name
        retry = RetryPolicy(max_attempts=1)

        def handle(self, delivery: Delivery) -> None:
            raise DeadLetter("not for us") if how == "DeadLetter" else ValueError("broken")

    worker = Worker(engine, [Failing()], clock=clock)
    q = worker.queues[0]
    q.offer("job", 1, priority=7, group="g")
    assert worker.run_once() == 1
    me = worker._core.registry.id
    assert origin(q.get("job", include_dead=True)) == ("dead", 7, "g", me)
    [dead] = q.dead_letters()
    assert (dead.priority, dead.group, dead.worker) == (7, "g", me)


def test_a_job_an_async_worker_dead_letters_keeps_its_priority_group_and_the_workers_registry_id(
    aio_runner: Any, queue_name: str, clock: ManualClock
) -> None:
    from delayq.aio import AsyncHandler, AsyncWorker

    class Failing(AsyncHandler):
        queue = queue_name
        retry = RetryPolicy(max_attempts=1)

        async def handle(self, delivery: Any, conn: Any = None) -> Any:
            raise ValueError("broken")

    async def run() -> tuple[Any, str]:
        worker = AsyncWorker(aio_runner.engine, [Failing()], clock=clock)
        aq = worker.async_queues[queue_name]
        await aq.offer("job", 1, priority=7, group="g")
        assert await worker.run_once() == 1
        return await aq.get("job", include_dead=True), worker._core.registry.id

    m, me = aio_runner.run(run())
    assert origin(m) == ("dead", 7, "g", me)


def test_a_message_dead_lettered_at_its_claim_keeps_the_claiming_workers_registry_id(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    """A payload its serializer cannot read is dead-lettered by the claim itself, before any handler runs."""

    class Reader(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery) -> None:
            raise AssertionError("never handed a payload it cannot read")

    DelayedQueue(engine, queue_name, clock=clock, serializer=_text()).offer("odd", "plain text", priority=2)
    worker = Worker(engine, [Reader()], clock=clock)
    worker.run_once()
    assert kept_rows(engine, T.dead_letters, queue_name) == [("odd", 2, None, worker._core.registry.id)]


def _text() -> Any:
    from delayq import TextSerializer

    return TextSerializer()


def test_a_job_cancelled_while_its_worker_runs_it_keeps_its_priority_and_group(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    """The cancel is the operator's, not the worker's outcome: it records no worker."""
    operator = DelayedQueue(engine, queue_name, clock=clock)

    class Cancelled(Handler):
        queue = queue_name

        def handle(self, delivery: Delivery) -> None:
            assert operator.cancel_job(delivery.key)  # (while it runs: recorded as cancelled)

    worker = Worker(engine, [Cancelled()], clock=clock)
    operator.offer("job", 1, priority=7, group="g")
    worker.run_once()
    assert origin(operator.get("job")) == ("cancelled", 7, "g", None)


@BOTH_APIS
def test_an_ack_outside_a_worker_keeps_priority_and_group_and_records_no_worker(
    make_queue: Callable[..., DelayedQueue],
) -> None:
    q = make_queue(retention=HOUR)
    q.offer("hand", 1, priority=-3, group="g2")
    q.offer("dead", 2, priority=5)
    q.offer("stop", 3, group="g3")
    held = {d.key: d for d in q.try_poll_many(3)}
    assert held["hand"].ack(result="ok")
    assert held["dead"].dead_letter("gave up")
    assert q.cancel_job("stop")
    assert origin(q.get("hand")) == ("completed", -3, "g2", None)
    assert origin(q.get("dead", include_dead=True)) == ("dead", 5, None, None)
    assert origin(q.get("stop")) == ("cancelled", 0, "g3", None)


# -- a requeued dead letter ---------------------------------------------------------------------------------------
@BOTH_APIS
def test_a_requeued_dead_letter_gets_its_priority_and_group_back(make_queue: Callable[..., DelayedQueue]) -> None:
    q = make_queue()
    q.offer("one", 1, priority=7, group="g")
    q.offer("bulk", 2, priority=4, group="h")
    q.offer("plain", 3)
    for d in q.try_poll_many(3):
        assert d.dead_letter("no")
    assert q.requeue_dead("one")
    assert q.requeue_dead_matching().done == 2
    live = {k: q.get(k) for k in ("one", "bulk", "plain")}
    assert {k: (m.state, m.priority, m.group) for k, m in live.items() if m is not None} == {
        "one": ("ready", 7, "g"),
        "bulk": ("ready", 4, "h"),
        "plain": ("ready", 0, None),
    }
    claimed = q.try_poll_many(3)  # (the queue's priorities and groups count as before: the highest first)
    assert [(d.key, d.priority, d.group) for d in claimed][:1] == [("one", 7, "g")]


# -- where an operator looks ----------------------------------------------------------------------------------
def field(page: str, name: str) -> str:
    found = re.search(rf'data-field="{name}">(.*?)</dd>', page, re.S)
    assert found is not None, f"no {name} on the page"
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def test_listings_ls_json_show_and_the_message_page_show_a_kept_jobs_priority_group_and_worker(
    backend: Backend, queue_name: str
) -> None:
    class Kept(Handler):
        queue = queue_name
        retention = HOUR

        def handle(self, delivery: Delivery) -> str:
            return "ok"

    worker = Worker(backend.engine, [Kept()])
    worker.queues[0].offer("job", 1, priority=7, group="g")
    worker.start()  # (registered: the page finds its row)
    try:
        assert worker.queues[0].wait("job", dt.timedelta(seconds=30)) is not None
    finally:
        assert worker.stop()
    me = worker._core.registry.id
    with backend.engine.connect() as conn:
        now = database_now(conn)
        [listed] = list_messages(conn, T, queue_name, state=State.COMPLETED, now=now)
    assert (listed.priority, listed.group, listed.worker) == (7, "g", me)

    runner = CliRunner()
    ls = runner.invoke(main, ["--url", backend.url, "ls", queue_name, "--state", "completed", "--json"])
    assert ls.exit_code == 0, ls.output
    assert [(r["priority"], r["group"], r["worker"]) for r in json.loads(ls.output)] == [(7, "g", me)]
    shown = runner.invoke(main, ["--url", backend.url, "show", queue_name, "job"]).output
    assert re.search(r"^\s*priority: 7$", shown, re.M) and re.search(r"^\s*group: g$", shown, re.M), shown
    assert re.search(rf"^\s*worker: {me}$", shown, re.M), shown

    page = TestClient(app(backend.engine)).get("/message", params={"queue": queue_name, "key": "job"}).text
    assert 'class="state completed"' in page
    assert (field(page, "priority"), field(page, "group")) == ("7", "g")
    assert field(page, "worker").endswith(f"({worker._core.name})") and 'href="/workers"' in page

    with backend.engine.begin() as conn:  # the registry forgot the worker (an hour on): its id is still shown
        conn.execute(sa.delete(T.workers).where(T.workers.c.id == me))
    page = TestClient(app(backend.engine)).get("/message", params={"queue": queue_name, "key": "job"}).text
    assert field(page, "worker") == f"{me} (no longer in the registry)"


# -- the migration ------------------------------------------------------------------------------------------------
def test_delayq_0013_keeps_the_kept_rows_not_recorded_and_goes_down_again(backend: Backend) -> None:
    """Rows kept at delayq_0012 read as not recorded after the upgrade; new ones record their origin; down again,
    the columns go and every row stays."""
    prefix = "mig13_"
    t = make_tables(prefix)
    origin_columns = {"priority", "group_key", "worker"}
    migrations.downgrade(backend.url, prefix=prefix)
    migrations.upgrade(backend.url, "delayq_0012", prefix=prefix)
    try:
        with backend.engine.begin() as conn:  # below head delayq refuses to run: the old schema, written directly
            base = {"queue": "q", "payload": b"1", "payload_type": "json", "scheduled_at_initially": 0, "created_at": 0}
            conn.execute(sa.insert(t.dead_letters).values(key="dead", attempts=1, failed_at=5, **base))
            conn.execute(
                sa.insert(t.finished).values(
                    key="done", state=1, attempts=1, finished_at=5, expires_at=4_102_444_800_000, **base
                )
            )
        migrations.upgrade(backend.url, prefix=prefix)
        from test_migrations import schema_diff

        assert schema_diff(backend.engine, prefix) == []
        q = DelayedQueue(backend.engine, "q", table_prefix=prefix, retention=HOUR)
        assert origin(q.get("done")) == ("completed", None, None, None)
        assert origin(q.get("dead", include_dead=True)) == ("dead", None, None, None)
        shown = CliRunner().invoke(main, ["--url", backend.url, "--prefix", prefix, "show", "q", "done"]).output
        assert re.search(r"^\s*priority: \(not recorded\)$", shown, re.M), shown
        q.offer("new", 1, priority=3, group="g")
        d = q.try_poll()
        assert d is not None and d.ack()
        assert origin(q.get("new")) == ("completed", 3, "g", None)
        assert q.requeue_dead("dead")  # (an unrecorded priority comes back as 0)
        requeued = q.get("dead")
        assert requeued is not None and (requeued.priority, requeued.group) == (0, None)

        migrations.downgrade(backend.url, "delayq_0012", prefix=prefix)
        with backend.engine.connect() as conn:
            for table in ("finished", "dead_letters"):
                names = {c["name"] for c in sa.inspect(conn).get_columns(f"{prefix}{table}")}
                assert not names & origin_columns, (table, names)
            assert conn.execute(sa.text(f"SELECT count(*) FROM {prefix}finished")).scalar_one() == 2
            assert conn.execute(sa.text(f"SELECT count(*) FROM {prefix}messages")).scalar_one() == 1
    finally:
        migrations.downgrade(backend.url, prefix=prefix)
