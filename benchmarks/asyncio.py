"""delayq.aio beside the sync API, in the same run: offers, claims, the worker, pickup latency.

Each figure pairs the async API (``delayq.aio`` on the async driver: psycopg async, asyncmy,
aiosqlite) with the sync API doing the same work on the sync driver, taking turns call by call
(or round by round), so the ratio is async / sync. One more pair isolates the greenlet bridge:
the sync core called directly vs. inside ``greenlet_spawn`` on the same sync engine.
Registered in ``python -m benchmarks`` (scenarios named "asyncio: ..."; ``--only asyncio``).
"""

from __future__ import annotations

import asyncio
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
        lat = await pickups(aengine, n)
        return n / sum(lat), None, lat

    return on_loop(engine, body)


def idle_gap(i: int) -> float:
    """The pause after the i-th pickup: the worker goes idle between messages, for varied lengths."""
    return 0.005 + 0.01 * (i % 3)


async def pickups(aengine: AsyncEngine, n: int) -> list[float]:
    """Offer ``n`` messages one at a time to an idle AsyncWorker on ``aengine``: the seconds from each offer's
    commit to its handler's start (also ``python -m benchmarks --peers``'s AsyncWorker pickup latency)."""
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
            await asyncio.sleep(idle_gap(i))
    finally:
        await worker.stop()
    return lat


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


# -- peers ------------------------------------------------------------------------------------------
# ``python -m benchmarks.asyncio --peers`` is kept as another name for ``python -m benchmarks --peers``
# (benchmarks/peers.py): delayq's workers and APIs, threads and asyncio, beside pgqueuer and procrastinate.
def peers_main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    from benchmarks import peers

    parser = argparse.ArgumentParser(prog="python -m benchmarks.asyncio --peers")
    parser.add_argument("--peers", action="store_true", required=True)
    parser.add_argument("-n", type=int, default=5000, help="messages per run")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds")
    args = parser.parse_args(argv)
    url = os.environ.get("DELAYQ_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    peers.main(url, args.n, args.repeat)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(peers_main())
