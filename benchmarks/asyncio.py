"""delayq.aio beside the sync API, in the same run: offers, claims, the worker, pickup latency.

Each figure pairs the async API (``delayq.aio`` on the async driver: psycopg async, asyncmy,
aiosqlite) with the sync API doing the same work on the sync driver, taking turns call by call
(or round by round), so the ratio is async / sync. One more pair isolates the greenlet bridge:
the sync core called directly vs. inside ``greenlet_spawn`` on the same sync engine.
Registered in ``python -m benchmarks`` (scenarios named "asyncio: ..."; ``--only asyncio``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.util import greenlet_spawn

from delayq import DelayedQueue, Delivery, Handler, Worker
from delayq.aio import AsyncDelayedQueue, AsyncDelivery, AsyncHandler, AsyncWorker

PREFIX = "bench_"
TABLE = f"{PREFIX}messages"
ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg", "mysql": "mysql+asyncmy"}
Result = tuple[float, float | None, list[float]]
Measure = Callable[[str, Callable[[], Result]], None]


class LostMessages(AssertionError):
    pass


def async_engine_for(engine: sa.Engine) -> AsyncEngine:
    url = engine.url.set(drivername=ASYNC_DRIVERS[engine.dialect.name])
    if engine.dialect.name == "sqlite":  # the sync engine set the file to WAL already
        return create_async_engine(url, connect_args={"timeout": 30})
    return create_async_engine(url, pool_size=10)


def clear(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {TABLE}" if engine.dialect.name == "sqlite" else f"TRUNCATE {TABLE}")


def count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(f"SELECT count(*) FROM {TABLE} WHERE queue = 'bench'").scalar_one())


def fill(q: DelayedQueue, n: int, tag: str) -> set[str]:
    keys = [f"{tag}{i}" for i in range(n)]
    for b in range(0, n, 1000):
        q.offer_many([(k, {"k": k}, None) for k in keys[b : b + 1000]])
    return set(keys)


def check(engine: sa.Engine, expected: set[str], delivered: Counter[str], what: str) -> None:
    if set(delivered) != expected or (delivered and max(delivered.values()) != 1) or count(engine) != 0:
        raise LostMessages(f"{what}: {len(expected - set(delivered))} not delivered or duplicated")


def on_loop(engine: sa.Engine, body: Callable[[AsyncEngine], Awaitable[Result]]) -> Result:
    """Run ``body`` on a fresh event loop with a fresh AsyncEngine on the same database."""

    async def main() -> Result:
        aengine = async_engine_for(engine)
        try:
            return await body(aengine)
        finally:
            await aengine.dispose()

    return asyncio.run(main())


# -- offers ---------------------------------------------------------------------------------------
def offer_single(engine: sa.Engine, q: DelayedQueue, n: int) -> Result:
    async def body(aengine: AsyncEngine) -> Result:
        clear(engine)
        aq = AsyncDelayedQueue(aengine, "bench", table_prefix=PREFIX)
        ours, theirs = 0.0, 0.0
        for i in range(n):
            start = time.perf_counter()
            await aq.offer(f"a{i}", {"n": i})
            mid = time.perf_counter()
            q.offer(f"s{i}", {"n": i})
            ours, theirs = ours + mid - start, theirs + time.perf_counter() - mid
        assert count(engine) == 2 * n
        return n / ours, n / theirs, []

    return on_loop(engine, body)


def offer_batches(engine: sa.Engine, q: DelayedQueue, n: int, size: int = 500) -> Result:
    async def body(aengine: AsyncEngine) -> Result:
        clear(engine)
        aq = AsyncDelayedQueue(aengine, "bench", table_prefix=PREFIX)
        ours, theirs = 0.0, 0.0
        for b in range(0, n, size):
            batch = range(b, min(n, b + size))
            start = time.perf_counter()
            await aq.offer_many([(f"a{i}", {"n": i}, None) for i in batch])
            mid = time.perf_counter()
            q.offer_many([(f"s{i}", {"n": i}, None) for i in batch])
            ours, theirs = ours + mid - start, theirs + time.perf_counter() - mid
        assert count(engine) == 2 * n
        return n / ours, n / theirs, []

    return on_loop(engine, body)


# -- consumers ------------------------------------------------------------------------------------
ROUNDS = 4


def consume(engine: sa.Engine, q: DelayedQueue, n: int, batch: int, consumers: int) -> Result:
    """Drain n messages with the async API (``consumers`` tasks) and n with the sync API (threads)."""

    async def body(aengine: AsyncEngine) -> Result:
        clear(engine)
        aq = AsyncDelayedQueue(aengine, "bench", table_prefix=PREFIX)
        ours = theirs = 0.0
        for r in range(ROUNDS):
            expected, delivered = fill(q, n // ROUNDS, f"a{r}-"), Counter[str]()

            async def drain_async(delivered: Counter[str] = delivered) -> None:
                while got := await aq.try_poll_many(batch):
                    await aq.ack_many(got)
                    delivered.update(d.key for d in got)

            start = time.perf_counter()
            await asyncio.gather(*(drain_async() for _ in range(consumers)))
            ours += time.perf_counter() - start
            check(engine, expected, delivered, "async consume")

            expected, delivered_sync = fill(q, n // ROUNDS, f"s{r}-"), Counter[str]()
            lock = threading.Lock()

            def drain_sync(delivered_sync: Counter[str] = delivered_sync, lock: threading.Lock = lock) -> None:
                while got := q.try_poll_many(batch):
                    q.ack_many(got)
                    with lock:
                        delivered_sync.update(d.key for d in got)

            threads = [threading.Thread(target=drain_sync) for _ in range(consumers)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            theirs += time.perf_counter() - start
            check(engine, expected, delivered_sync, "sync consume")
        done = ROUNDS * (n // ROUNDS)
        return done / ours, done / theirs, []

    return on_loop(engine, body)


# -- workers --------------------------------------------------------------------------------------
def worker_drain(engine: sa.Engine, q: DelayedQueue, n: int) -> Result:
    """No-op handlers draining n due messages: one AsyncWorker, then one Worker, 8 slots each.

    A drain ends when the worker has finished (acked) n messages, by its own count: a row count
    polled meanwhile would run a blocking query on the event loop's thread and slow the async worker.
    """
    poll = dt.timedelta(milliseconds=50)

    async def body(aengine: AsyncEngine) -> Result:
        clear(engine)
        delivered: Counter[str] = Counter()

        class AsyncNoop(AsyncHandler):
            queue = "bench"

            async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:
                delivered[delivery.key] += 1

        expected = fill(q, n, "a")
        worker = AsyncWorker(aengine, [AsyncNoop], table_prefix=PREFIX, concurrency=8, poll_interval=poll)
        start = time.perf_counter()
        worker.start()
        while worker.handled < n and time.perf_counter() - start < 600:
            await asyncio.sleep(0.002)
        ours = time.perf_counter() - start
        await worker.stop()
        check(engine, expected, delivered, "async worker drain")

        delivered_sync: Counter[str] = Counter()
        lock = threading.Lock()

        class Noop(Handler):
            queue = "bench"

            def handle(self, delivery: Delivery, conn: Any = None) -> None:
                with lock:
                    delivered_sync[delivery.key] += 1

        expected = fill(q, n, "s")
        sync_worker = Worker(engine, [Noop], table_prefix=PREFIX, concurrency=8, poll_interval=poll)
        start = time.perf_counter()
        sync_worker.start()
        while sync_worker.handled < n and time.perf_counter() - start < 600:
            time.sleep(0.002)
        theirs = time.perf_counter() - start
        sync_worker.stop()
        check(engine, expected, delivered_sync, "sync worker drain")
        return n / ours, n / theirs, []

    return on_loop(engine, body)


def pickup_latency(engine: sa.Engine, q: DelayedQueue, n: int) -> Result:
    """Offer one message at a time to an idle AsyncWorker; time from the offer's commit to the handler."""

    async def body(aengine: AsyncEngine) -> Result:
        clear(engine)
        started: dict[str, float] = {}
        arrived = asyncio.Event()

        class Stamp(AsyncHandler):
            queue = "bench"

            async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:
                started[delivery.key] = time.perf_counter()
                arrived.set()

        aq = AsyncDelayedQueue(aengine, "bench", table_prefix=PREFIX)
        worker = AsyncWorker(aengine, [Stamp], table_prefix=PREFIX, concurrency=4)
        worker.start()
        lat: list[float] = []
        try:
            await asyncio.sleep(0.2)  # let it go idle (and LISTEN on PostgreSQL)
            for i in range(n):
                arrived.clear()
                await aq.offer(f"l{i}", {"n": i})
                committed = time.perf_counter()
                await asyncio.wait_for(arrived.wait(), 10)
                lat.append(started[f"l{i}"] - committed)
                await asyncio.sleep(0.005 + 0.01 * (i % 3))  # idle between messages
        finally:
            await worker.stop()
        return n / sum(lat), None, lat

    return on_loop(engine, body)


# -- the bridge alone -----------------------------------------------------------------------------
def greenlet_overhead(engine: sa.Engine, q: DelayedQueue, n: int) -> Result:
    """The sync core on the sync driver, called inside ``greenlet_spawn`` vs. directly: the bridge's cost."""

    async def body(_: AsyncEngine) -> Result:
        clear(engine)
        ours = theirs = 0.0
        for i in range(n):
            start = time.perf_counter()
            await greenlet_spawn(q.get, f"k{i}")
            mid = time.perf_counter()
            q.get(f"k{i}")
            ours, theirs = ours + mid - start, theirs + time.perf_counter() - mid
        return n / ours, n / theirs, []

    return on_loop(engine, body)


def measure_all(engine: sa.Engine, q: DelayedQueue, sizes: Any, measure: Measure) -> None:
    """Every asyncio figure for one backend (``measure`` prints and records it; "ceiling" is the sync API)."""
    measure("asyncio: offer (one per call), async vs sync", lambda: offer_single(engine, q, sizes.single))
    measure("asyncio: offer_many (500 per call), async vs sync", lambda: offer_batches(engine, q, sizes.batch))
    measure(
        "asyncio: try_poll + ack, 1 consumer, async vs sync",
        lambda: consume(engine, q, sizes.consume_single, 1, 1),
    )
    for consumers in (1, 4):
        measure(
            f"asyncio: try_poll_many(100) + ack_many, {consumers} consumer(s), async vs sync",
            lambda c=consumers: consume(engine, q, sizes.consume_batch, 100, c),  # type: ignore[misc]
        )
    measure(
        "asyncio: worker no-op drain, 1 worker x 8 slots, async vs sync",
        lambda: worker_drain(engine, q, sizes.consume_batch),
    )
    measure(
        "asyncio: pickup latency, idle AsyncWorker (offer commit -> handler)",
        lambda: pickup_latency(engine, q, sizes.pickup),
    )
    measure(
        "asyncio: get() inside greenlet_spawn vs direct (sync driver)",
        lambda: greenlet_overhead(engine, q, sizes.single),
    )


# -- peers: pgqueuer and procrastinate ----------------------------------------------------------------
# ``python -m benchmarks.asyncio --peers``: delayq's threaded Worker and its AsyncWorker beside pgqueuer's
# and procrastinate's async workers, one process each, on one PostgreSQL (a database of their own, ``delayq_peers``, so
# their schemas stay out of the test database). Neither is a dependency of delayq: install them by
# hand (``pip install pgqueuer procrastinate``); a missing one is skipped. Offers: one per call and
# 100 per call; drains: a no-op handler, batch (or concurrency) 1 and 100.
PEERS_DB = "delayq_peers"


def peers_url(url: str) -> str:
    """The peers' database on the server of ``url``, made when missing."""
    base = sa.make_url(url)
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        if conn.exec_driver_sql(f"SELECT 1 FROM pg_database WHERE datname = '{PEERS_DB}'").first() is None:
            conn.exec_driver_sql(f"CREATE DATABASE {PEERS_DB}")
    admin.dispose()
    return base.set(database=PEERS_DB).render_as_string(hide_password=False)


async def delayq_peer(url: str, n: int, batch: int) -> tuple[float, float]:
    from delayq import migrations

    migrations.upgrade(url, prefix=PREFIX)
    sync_engine = sa.create_engine(url)
    clear(sync_engine)
    engine = create_async_engine(url, pool_size=20)
    aq = AsyncDelayedQueue(engine, "bench", table_prefix=PREFIX)
    start = time.perf_counter()
    for b in range(0, n, batch):
        if batch == 1:
            await aq.offer(f"k{b}", {"n": b})
        else:
            await aq.offer_many([(f"k{i}", {"n": i}, None) for i in range(b, min(n, b + batch))])
    offered = n / (time.perf_counter() - start)
    done = 0

    class Noop(AsyncHandler):
        queue = "bench"

        async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:
            nonlocal done
            done += 1

    worker = AsyncWorker(engine, [Noop], table_prefix=PREFIX, concurrency=batch)
    start = time.perf_counter()
    worker.start()
    while done < n and time.perf_counter() - start < 600:  # the handlers' own count: no query on the way
        await asyncio.sleep(0.002)
    consumed = n / (time.perf_counter() - start)
    await worker.stop()
    if done != n or count(sync_engine):
        raise LostMessages(f"delayq peer run: {done} of {n} handled, {count(sync_engine)} left")
    await engine.dispose()
    sync_engine.dispose()
    return offered, consumed


async def delayq_threads_peer(url: str, n: int, batch: int) -> tuple[float, float]:
    """delayq's threaded ``Worker`` (``concurrency`` = the batch), offers through the sync queue."""
    return await asyncio.to_thread(_threads_run, url, n, batch)


def _threads_run(url: str, n: int, batch: int) -> tuple[float, float]:
    from delayq import migrations

    migrations.upgrade(url, prefix=PREFIX)
    engine = sa.create_engine(url, pool_size=20)
    clear(engine)
    q = DelayedQueue(engine, "bench", table_prefix=PREFIX)
    start = time.perf_counter()
    for b in range(0, n, batch):
        if batch == 1:
            q.offer(f"k{b}", {"n": b})
        else:
            q.offer_many([(f"k{i}", {"n": i}, None) for i in range(b, min(n, b + batch))])
    offered = n / (time.perf_counter() - start)

    class Noop(Handler):
        queue = "bench"

        def handle(self, delivery: Delivery, conn: Any = None) -> None:
            pass

    worker = Worker(engine, [Noop], table_prefix=PREFIX, concurrency=batch)
    start = time.perf_counter()
    worker.start()
    while worker.handled < n and time.perf_counter() - start < 600:  # the worker's own count
        time.sleep(0.002)
    consumed = n / (time.perf_counter() - start)
    worker.stop()
    if worker.handled != n or count(engine):
        raise LostMessages(f"delayq threads peer run: {worker.handled} of {n} handled, {count(engine)} left")
    engine.dispose()
    return offered, consumed


async def pgqueuer_peer(url: str, n: int, batch: int) -> tuple[float, float]:
    """pgqueuer on psycopg's async connection (the driver delayq uses)."""
    import psycopg
    from pgqueuer import PsycopgDriver

    dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        return await _pgqueuer_run(PsycopgDriver(conn), n, batch)
    finally:
        await conn.close()


async def pgqueuer_asyncpg_peer(url: str, n: int, batch: int) -> tuple[float, float]:
    """pgqueuer on asyncpg, the driver its documentation starts with (``pip install asyncpg``)."""
    import asyncpg
    from pgqueuer import AsyncpgDriver

    dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    try:
        return await _pgqueuer_run(AsyncpgDriver(conn), n, batch)
    finally:
        await conn.close()


async def _pgqueuer_run(driver: Any, n: int, batch: int) -> tuple[float, float]:
    from pgqueuer import Queries, QueueManager
    from pgqueuer.domain.types import QueueExecutionMode

    queries = Queries(driver)
    if not await queries.has_table("pgqueuer"):
        await queries.install()
    await queries.clear_queue()
    start = time.perf_counter()
    for b in range(0, n, batch):
        size = min(batch, n - b)
        if size == 1:
            await queries.enqueue("bench", b"{}")
        else:
            await queries.enqueue(["bench"] * size, [b"{}"] * size, [0] * size)
    offered = n / (time.perf_counter() - start)
    qm = QueueManager(queries)
    done = 0

    @qm.entrypoint("bench")
    async def noop(job: Any) -> None:
        nonlocal done
        done += 1

    start = time.perf_counter()
    await qm.run(batch_size=batch, mode=QueueExecutionMode.drain)
    consumed = n / (time.perf_counter() - start)
    if done != n:
        raise LostMessages(f"pgqueuer: {done} of {n} handled")
    return offered, consumed


async def procrastinate_peer(url: str, n: int, batch: int) -> tuple[float, float]:
    import procrastinate

    dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))
    done = 0

    @app.task(queue="bench", name="bench_noop")
    async def noop(i: int) -> None:
        nonlocal done
        done += 1

    async with app.open_async():
        with contextlib.suppress(Exception):  # applied by an earlier run
            await app.schema_manager.apply_schema_async()
        admin = sa.create_engine(url)
        with admin.begin() as c:
            c.exec_driver_sql("DELETE FROM procrastinate_jobs")
        admin.dispose()
        start = time.perf_counter()
        for b in range(0, n, batch):
            if batch == 1:
                await noop.defer_async(i=b)
            else:
                await noop.batch_defer_async(*({"i": i} for i in range(b, min(n, b + batch))))
        offered = n / (time.perf_counter() - start)
        start = time.perf_counter()
        await app.run_worker_async(
            queues=["bench"], concurrency=batch, wait=False, delete_jobs="always", install_signal_handlers=False
        )
        consumed = n / (time.perf_counter() - start)
    if done != n:
        raise LostMessages(f"procrastinate: {done} of {n} handled")
    return offered, consumed


def peers_main(argv: list[str] | None = None) -> int:
    import argparse
    import logging
    import os

    parser = argparse.ArgumentParser(prog="python -m benchmarks.asyncio --peers")
    parser.add_argument("--peers", action="store_true", required=True)
    parser.add_argument("-n", type=int, default=5000, help="messages per run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    url = peers_url(os.environ.get("DELAYQ_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    runs: list[tuple[str, Callable[[str, int, int], Awaitable[tuple[float, float]]]]] = [
        ("delayq Worker", delayq_threads_peer),
        ("delayq.aio", delayq_peer),
        ("pgqueuer", pgqueuer_peer),
        ("pgqueuer+apg", pgqueuer_asyncpg_peer),
        ("procrastinate", procrastinate_peer),
    ]
    for batch in (1, 100):
        for name, run in runs:
            try:
                offered, consumed = asyncio.run(run(url, args.n, batch))
            except ImportError as exc:
                print(f"{name:<14} skipped: {exc}")
                continue
            print(
                f"{name:<14} batch {batch:>3}: offer {offered:8.0f}/s  drain (no-op handler) {consumed:8.0f}/s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(peers_main())
