"""A worker whose database connections are killed logs, backs off and resumes, losing nothing."""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, count_rows, make_async_engine, make_engine
from faults import FaultProxy
from test_worker import wait_until
from test_worker_contract import Driver

from delayq import DelayedQueue, Delivery, OfferOutcome


def victim_engine(name: str, url: str, tag: str) -> tuple[sa.Engine, list[int]]:
    """An engine whose connections can be found and killed from outside: by application name, or id."""
    ids: list[int] = []
    if name == "postgresql":
        engine = make_engine(
            sa.engine.make_url(url).update_query_dict({"application_name": tag}).render_as_string(False)
        )
    else:
        engine = make_engine(url)

        @sa.event.listens_for(engine, "connect")
        def remember(dbapi_conn: Any, _: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("SELECT CONNECTION_ID()")
            ids.append(cur.fetchone()[0])

    return engine, ids


def victim_async_engine(name: str, url: str, tag: str, ids: list[int]) -> Any:
    """``victim_engine``'s ``AsyncEngine``: by application name on PostgreSQL, its ids in ``ids`` on MariaDB."""
    if name == "postgresql":
        return make_async_engine(
            sa.engine.make_url(url).update_query_dict({"application_name": tag}).render_as_string(False)
        )
    engine = make_async_engine(url)

    @sa.event.listens_for(engine.sync_engine, "connect")
    def remember(dbapi_conn: Any, _: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("SELECT CONNECTION_ID()")
        ids.append(cur.fetchone()[0])
        cur.close()

    return engine


def kill_connections(name: str, admin: sa.Engine, tag: str, ids: list[int]) -> int:
    with admin.connect() as conn:
        if name == "postgresql":
            killed = conn.execute(
                sa.text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = :t"),
                {"t": tag},
            ).scalar_one()
            return int(killed)
        killed = 0
        for connection_id in list(ids):
            try:
                conn.exec_driver_sql(f"KILL {int(connection_id)}")
                killed += 1
            except sa.exc.OperationalError:  # already gone
                pass
        return killed


@pytest.mark.parametrize("kind", ["threads", "asyncio"])
@pytest.mark.parametrize("name", ["postgresql", "mysql"])
def test_worker_survives_its_connections_being_killed(name: str, backend_urls: dict[str, str], kind: str) -> None:
    url, tag = backend_urls[name], f"delayq-victim-{uuid.uuid4().hex[:8]}"
    queue_name = f"test-{tag}"
    engine, ids = victim_engine(name, url, tag)
    driver = Driver(kind, Backend(name, url, engine))
    if kind == "asyncio":  # the worker's connections are the AsyncEngine's: found and killed the same way
        driver.call(driver.async_engine.dispose())
        driver.async_engine = victim_async_engine(name, url, tag, ids)
    admin = make_engine(url)
    handled: Counter[str] = Counter()
    lock = threading.Lock()

    def body(d: Delivery, _: object) -> None:
        with lock:
            handled[d.key] += 1

    worker = driver.worker(
        [driver.queue_handler(queue_name, body, visibility_timeout=dt.timedelta(seconds=5))],
        poll_interval=dt.timedelta(milliseconds=100),
    )
    producer = DelayedQueue(admin, queue_name)
    worker.start()
    try:
        producer.offer_many([(f"a{i}", i, None) for i in range(10)])
        wait_until(lambda: len(handled) == 10, "the first batch")
        assert kill_connections(name, admin, tag, ids) >= 1
        producer.offer_many([(f"b{i}", i, None) for i in range(5)])
        kill_connections(name, admin, tag, ids)  # again, whatever has reconnected by now
        producer.offer_many([(f"b{i}", i, None) for i in range(5, 10)])
        wait_until(lambda: len(handled) == 20, "the batch offered after the kill", limit=60)
        health = worker.health()
        assert health.running and all(health.loops.values()), health
    finally:
        assert worker.stop()
        driver.close()
        engine.dispose()
        admin.dispose()
    assert set(handled) == {f"a{i}" for i in range(10)} | {f"b{i}" for i in range(10)}
    assert producer.stats().ready == 0


@pytest.mark.parametrize("name", ["postgresql", "mysql"])
def test_queue_operations_go_on_after_their_pooled_connections_are_killed(
    name: str, backend_urls: dict[str, str]
) -> None:
    # Each operation finds its pooled connection dead, invalidates it, and is retried whole on a
    # fresh one: the caller sees nothing.
    url, tag = backend_urls[name], f"delayq-victim-{uuid.uuid4().hex[:8]}"
    engine, ids = victim_engine(name, url, tag)
    admin = make_engine(url)
    queue = DelayedQueue(engine, f"test-{tag}")
    try:
        queue.offer("before", 1)
        assert kill_connections(name, admin, tag, ids) >= 1
        assert queue.offer("after", 2) is OfferOutcome.CREATED
        kill_connections(name, admin, tag, ids)
        got = queue.try_poll_many(10)
        assert sorted(d.key for d in got) == ["after", "before"]
        kill_connections(name, admin, tag, ids)
        assert queue.ack_many(got) == 2
        assert queue.next_due() is None
    finally:
        engine.dispose()
        admin.dispose()


@pytest.mark.parametrize("kind", ["threads", "asyncio"])
@pytest.mark.parametrize("name", ["postgresql", "mysql"])
def test_a_worker_whose_connections_are_cut_again_and_again_loses_nothing(
    name: str, backend_urls: dict[str, str], kind: str
) -> None:
    """Every connection (pooled, LISTEN, the one mid-claim) cut three times while a handler holds a message:
    each round's messages are handled, and the held one is acked once its handler returns."""
    url, queue_name = backend_urls[name], f"test-cut-{uuid.uuid4().hex[:8]}"
    handled: Counter[str] = Counter()
    lock, hold = threading.Lock(), threading.Event()

    def body(d: Delivery, _: object) -> None:
        if d.key == "held":
            hold.wait(60)
        with lock:
            handled[d.key] += 1

    admin = make_engine(url)
    direct = DelayedQueue(admin, queue_name)
    with FaultProxy.for_url(url) as proxy:
        through = proxy.url_for(url)
        engine = make_engine(through, pool_size=4, max_overflow=0)
        driver = Driver(kind, Backend(name, through, engine))
        if kind == "asyncio":
            driver.call(driver.async_engine.dispose())
            driver.async_engine = make_async_engine(through, pool_size=4, max_overflow=0)
        worker = driver.worker(
            [driver.queue_handler(queue_name, body)],
            poll_interval=dt.timedelta(milliseconds=20),
            stall_timeout=dt.timedelta(seconds=2),
        )
        direct.offer("held", 0)
        worker.start()
        try:
            wait_until(lambda: direct.stats().in_flight == 1, "the held message to be claimed")
            for round_ in range(3):
                proxy.cut_all()
                direct.offer_many([(f"r{round_}-{i}", i, None) for i in range(5)])
                wait_until(lambda r=round_: all(handled[f"r{r}-{i}"] for i in range(5)), f"round {round_}", limit=90)
            hold.set()
            wait_until(lambda: count_rows(admin, queue_name) == 0, "every message to be acked", limit=90)
        finally:
            hold.set()
            assert worker.stop()
            driver.close()
            engine.dispose()
            admin.dispose()
    assert set(handled) == {"held"} | {f"r{r}-{i}" for r in range(3) for i in range(5)}
