"""delayq beside its PostgreSQL peers in the same run: ``python -m benchmarks --peers``.

Contenders: delayq's threaded API and ``Worker`` (psycopg), ``delayq.aio`` and its ``AsyncWorker`` on
psycopg's async driver and on asyncpg (when ``postgresql+asyncpg`` works here; "n/a" otherwise),
pgqueuer on asyncpg and on psycopg, and procrastinate (psycopg). Neither peer is a dependency of delayq:
``pip install -r benchmarks/requirements-peers.txt``; a peer that is not installed is reported as
skipped. They run on a database of their own (``delayq_peers``) on the server of
``DELAYQ_TEST_POSTGRES_URL``, so their schemas stay out of the test database.

Rounds interleave: in each round every contender runs every row once, the contenders' order
rotating from round to round, and a row's figure is the median of its rounds; ratios are taken
between figures of the same run. Rows: offers one per call and 500 per call; drains of a no-op
handler at batch (or concurrency) 1 and 100, by the library's worker and, for delayq, by its API
loop (``try_poll_many`` + ``ack_many``); pickup latency of an idle worker (offer's commit to the
handler's start) with the raw LISTEN/NOTIFY round trip as its ceiling.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from benchmarks.asyncio import PREFIX, LostMessages, clear, count, fill, idle_gap, pickups
from delayq import DelayedQueue, Delivery, Handler, Worker, migrations
from delayq.aio import AsyncDelayedQueue, AsyncDelivery, AsyncHandler, AsyncWorker

PEERS_DB = "delayq_peers"
ROWS = (
    "offer, one per call",
    "offer, 500 per call",
    "drain API, batch 1",
    "drain API, batch 100",
    "drain worker, batch 1",
    "drain worker, batch 100",
)
Rates = dict[str, float]


def peers_url(url: str) -> str:
    """The peers' database on the server of ``url``, made when missing."""
    base = sa.make_url(url)
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        if conn.exec_driver_sql(f"SELECT 1 FROM pg_database WHERE datname = '{PEERS_DB}'").first() is None:
            conn.exec_driver_sql(f"CREATE DATABASE {PEERS_DB}")
    admin.dispose()
    return base.set(database=PEERS_DB).render_as_string(hide_password=False)


def dsn(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _rate(n: int, start: float) -> float:
    return n / (time.perf_counter() - start)


# -- delayq, threads ------------------------------------------------------------------------------
def delayq_threads(url: str, n: int) -> Rates:
    engine = sa.create_engine(url, pool_size=20)
    q = DelayedQueue(engine, "bench", table_prefix=PREFIX)
    rates: Rates = {}
    try:
        for size, batch in ((1, 1), (500, 100)):
            clear(engine)
            start = time.perf_counter()
            for b in range(0, n, size):
                if size == 1:
                    q.offer(f"k{b}", {"n": b})
                else:
                    q.offer_many([(f"k{i}", {"n": i}, None) for i in range(b, min(n, b + size))])
            rates[f"offer, {'one' if size == 1 else size} per call"] = _rate(n, start)
            rates[f"drain worker, batch {batch}"] = _worker_drain(engine, n, batch)
            fill(q, n, "f")
            start, done = time.perf_counter(), 0
            while got := q.try_poll_many(batch) if batch > 1 else [d for d in [q.try_poll()] if d]:
                q.ack_many(got)
                done += len(got)
            rates[f"drain API, batch {batch}"] = _rate(n, start)
            if done != n or count(engine):
                raise LostMessages(f"delayq API drain: {done} of {n}")
    finally:
        engine.dispose()
    return rates


def _worker_drain(engine: sa.Engine, n: int, batch: int) -> float:
    class Noop(Handler):
        queue = "bench"

        def handle(self, delivery: Delivery, conn: Any = None) -> None:
            pass

    worker = Worker(engine, [Noop], table_prefix=PREFIX, concurrency=batch)
    start = time.perf_counter()
    worker.start()
    while worker.handled < n and time.perf_counter() - start < 600:  # the worker's own count
        time.sleep(0.002)
    rate = _rate(n, start)
    worker.stop()
    if worker.handled != n or count(engine):
        raise LostMessages(f"delayq Worker: {worker.handled} of {n} handled, {count(engine)} left")
    return rate


# -- delayq.aio -----------------------------------------------------------------------------------
def async_url(url: str, driver: str) -> str:
    return sa.make_url(url).set(drivername=f"postgresql+{driver}").render_as_string(hide_password=False)


def asyncpg_works(url: str) -> str | None:
    """None when ``delayq.aio`` runs on ``postgresql+asyncpg`` here; else why not (one line)."""
    try:
        import asyncpg  # noqa: F401
    except ImportError as exc:
        return f"asyncpg not installed ({exc})"

    async def probe() -> None:
        engine = create_async_engine(async_url(url, "asyncpg"))
        try:
            aq = AsyncDelayedQueue(engine, "bench-probe", table_prefix=PREFIX)
            await aq.offer("probe", {"n": 1})
            got = await aq.try_poll()
            if got is None:
                raise AssertionError("offered, then not claimed")
            await got.ack()
            await aq.offer_many([("probe-1", {"n": 1}, None), ("probe-2", {"n": 2}, None)])
            both = await aq.try_poll_many(2)
            if len(both) != 2 or await aq.ack_many(both) != 2:
                raise AssertionError("a batch offered, then not claimed and acked")
        finally:
            await engine.dispose()

    try:
        asyncio.run(probe())
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return None


def delayq_aio(url: str, n: int, driver: str) -> Rates:
    async def body() -> Rates:
        engine = create_async_engine(async_url(url, driver), pool_size=20)
        sync_engine = sa.create_engine(url)
        aq = AsyncDelayedQueue(engine, "bench", table_prefix=PREFIX)
        q = DelayedQueue(sync_engine, "bench", table_prefix=PREFIX)
        rates: Rates = {}
        try:
            for size, batch in ((1, 1), (500, 100)):
                clear(sync_engine)
                start = time.perf_counter()
                for b in range(0, n, size):
                    if size == 1:
                        await aq.offer(f"k{b}", {"n": b})
                    else:
                        await aq.offer_many([(f"k{i}", {"n": i}, None) for i in range(b, min(n, b + size))])
                rates[f"offer, {'one' if size == 1 else size} per call"] = _rate(n, start)
                done = 0

                class Noop(AsyncHandler):
                    queue = "bench"

                    async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:
                        nonlocal done
                        done += 1

                worker = AsyncWorker(engine, [Noop], table_prefix=PREFIX, concurrency=batch)
                start = time.perf_counter()
                worker.start()
                while done < n and time.perf_counter() - start < 600:
                    await asyncio.sleep(0.002)
                rates[f"drain worker, batch {batch}"] = _rate(n, start)
                await worker.stop()
                if done != n or count(sync_engine):
                    raise LostMessages(f"AsyncWorker ({driver}): {done} of {n}")
                fill(q, n, "f")
                start, done = time.perf_counter(), 0
                while got := await aq.try_poll_many(batch):
                    await aq.ack_many(got)
                    done += len(got)
                rates[f"drain API, batch {batch}"] = _rate(n, start)
                if done != n or count(sync_engine):
                    raise LostMessages(f"delayq.aio API drain ({driver}): {done} of {n}")
        finally:
            await engine.dispose()
            sync_engine.dispose()
        return rates

    return asyncio.run(body())


# -- pgqueuer -------------------------------------------------------------------------------------
async def _pgq_driver(url: str, driver: str) -> tuple[Any, Callable[[], Any]]:
    if driver == "asyncpg":
        import asyncpg
        from pgqueuer import AsyncpgDriver

        conn = await asyncpg.connect(dsn(url))
        return AsyncpgDriver(conn), conn.close
    import psycopg
    from pgqueuer import PsycopgDriver

    pconn = await psycopg.AsyncConnection.connect(dsn(url), autocommit=True)
    return PsycopgDriver(pconn), pconn.close


def pgqueuer(url: str, n: int, driver: str) -> Rates:
    from pgqueuer import Queries, QueueManager
    from pgqueuer.domain.types import QueueExecutionMode

    async def body() -> Rates:
        rates: Rates = {}
        for size, batch in ((1, 1), (500, 100)):
            drv, close = await _pgq_driver(url, driver)
            queries = Queries(drv)
            if not await queries.has_table("pgqueuer"):
                await queries.install()
            await queries.clear_queue()
            start = time.perf_counter()
            for b in range(0, n, size):
                part = min(size, n - b)
                if part == 1:
                    await queries.enqueue("bench", b"{}")
                else:
                    await queries.enqueue(["bench"] * part, [b"{}"] * part, [0] * part)
            rates[f"offer, {'one' if size == 1 else size} per call"] = _rate(n, start)
            qm = QueueManager(queries)
            done = 0

            @qm.entrypoint("bench")
            async def noop(job: Any) -> None:
                nonlocal done
                done += 1

            start = time.perf_counter()
            await qm.run(batch_size=batch, mode=QueueExecutionMode.drain)
            rates[f"drain worker, batch {batch}"] = _rate(n, start)
            with contextlib.suppress(Exception):  # run() leaves the driver closed
                await close()
            if done != n:
                raise LostMessages(f"pgqueuer ({driver}): {done} of {n} handled")
        return rates

    return asyncio.run(body())


# -- procrastinate --------------------------------------------------------------------------------
def procrastinate_rates(url: str, n: int) -> Rates:
    import procrastinate

    async def body() -> Rates:
        app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn(url)))
        done = 0

        @app.task(queue="bench", name="bench_noop")
        async def noop(i: int) -> None:
            nonlocal done
            done += 1

        rates: Rates = {}
        async with app.open_async():
            with contextlib.suppress(Exception):  # applied by an earlier run
                await app.schema_manager.apply_schema_async()
            for size, batch in ((1, 1), (500, 100)):
                admin = sa.create_engine(url)
                with admin.begin() as c:
                    c.exec_driver_sql("DELETE FROM procrastinate_jobs")
                admin.dispose()
                done = 0
                start = time.perf_counter()
                for b in range(0, n, size):
                    if size == 1:
                        await noop.defer_async(i=b)
                    else:
                        await noop.batch_defer_async(*({"i": i} for i in range(b, min(n, b + size))))
                rates[f"offer, {'one' if size == 1 else size} per call"] = _rate(n, start)
                start = time.perf_counter()
                await app.run_worker_async(
                    queues=["bench"],
                    concurrency=batch,
                    wait=False,
                    delete_jobs="always",
                    install_signal_handlers=False,
                )
                rates[f"drain worker, batch {batch}"] = _rate(n, start)
                if done != n:
                    raise LostMessages(f"procrastinate: {done} of {n} handled")
        return rates

    return asyncio.run(body())


# -- pickup latency -------------------------------------------------------------------------------
def pickup_threads(url: str, n: int) -> list[float]:
    engine = sa.create_engine(url, pool_size=5)
    q = DelayedQueue(engine, "bench", table_prefix=PREFIX)
    clear(engine)
    started: dict[str, float] = {}
    arrived = threading.Event()

    class Stamp(Handler):
        queue = "bench"

        def handle(self, delivery: Delivery, conn: Any = None) -> None:
            started[delivery.key] = time.perf_counter()
            arrived.set()

    worker = Worker(engine, [Stamp], table_prefix=PREFIX, concurrency=4)
    worker.start()
    lat: list[float] = []
    try:
        time.sleep(0.2)  # idle, LISTENing
        for i in range(n):
            arrived.clear()
            q.offer(f"l{i}", {"n": i})
            committed = time.perf_counter()
            if not arrived.wait(10):
                raise LostMessages(f"pickup (Worker): l{i} not picked up within 10 s")
            lat.append(started[f"l{i}"] - committed)
            time.sleep(idle_gap(i))
    finally:
        worker.stop()
        engine.dispose()
    return lat


def pickup_aio(url: str, n: int, driver: str) -> list[float]:
    async def body() -> list[float]:
        engine = create_async_engine(async_url(url, driver), pool_size=5)
        sync_engine = sa.create_engine(url)
        try:
            clear(sync_engine)
            return await pickups(engine, n)
        finally:
            await engine.dispose()
            sync_engine.dispose()

    return asyncio.run(body())


def pickup_pgqueuer(url: str, n: int) -> list[float]:
    from pgqueuer import Queries, QueueManager

    async def body() -> list[float]:
        drv, close = await _pgq_driver(url, "asyncpg")
        sender_drv, sender_close = await _pgq_driver(url, "asyncpg")
        qm = QueueManager(Queries(drv))
        sender = Queries(sender_drv)
        await sender.clear_queue()
        stamps: list[float] = []
        arrived = asyncio.Event()

        @qm.entrypoint("bench")
        async def stamp(job: Any) -> None:
            stamps.append(time.perf_counter())
            arrived.set()

        task = asyncio.create_task(qm.run(batch_size=1))
        lat: list[float] = []
        try:
            await asyncio.sleep(0.3)
            for i in range(n):
                arrived.clear()
                await sender.enqueue("bench", b"{}")
                committed = time.perf_counter()
                await asyncio.wait_for(arrived.wait(), 10)
                lat.append(stamps[-1] - committed)
                await asyncio.sleep(idle_gap(i))
        finally:
            qm.shutdown.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
            for c in (close, sender_close):
                with contextlib.suppress(Exception):
                    await c()
        return lat

    return asyncio.run(body())


def pickup_notify_ceiling(url: str, n: int) -> list[float]:
    """The raw round trip: NOTIFY on one psycopg connection, received by another LISTENing in a thread."""
    import psycopg

    listener = psycopg.connect(dsn(url), autocommit=True)
    sender = psycopg.connect(dsn(url), autocommit=True)
    listener.execute("LISTEN bench_ceiling")
    got: list[float] = []
    ready = threading.Event()
    arrived = threading.Event()

    def listen() -> None:
        ready.set()
        for _ in listener.notifies(stop_after=n, timeout=60):
            got.append(time.perf_counter())
            arrived.set()

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    ready.wait()
    time.sleep(0.1)
    lat: list[float] = []
    try:
        for i in range(n):
            arrived.clear()
            sender.execute("NOTIFY bench_ceiling, 'x'")
            committed = time.perf_counter()
            if not arrived.wait(10):
                raise LostMessages("raw NOTIFY not received within 10 s")
            lat.append(got[-1] - committed)
            time.sleep(idle_gap(i))
    finally:
        thread.join(5)
        listener.close()
        sender.close()
    return lat


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2] * 1000, ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


# -- the run --------------------------------------------------------------------------------------
def main(
    url: str,
    n: int,
    rounds: int,
    json_path: Path | None = None,
    pickups: int = 300,
    mysql_url: str | None = None,
) -> dict[str, Any]:
    logging.basicConfig(level=logging.ERROR)
    url = peers_url(url)
    migrations.upgrade(url, prefix=PREFIX)
    why_not_asyncpg = asyncpg_works(url)
    contenders: dict[str, Callable[[], Rates] | str] = {
        "delayq threads": lambda: delayq_threads(url, n),
        "delayq.aio psycopg": lambda: delayq_aio(url, n, "psycopg"),
        "delayq.aio asyncpg": (lambda: delayq_aio(url, n, "asyncpg")) if why_not_asyncpg is None else "n/a",
    }
    peers: dict[str, tuple[str, Callable[[], Rates]]] = {
        "pgqueuer asyncpg": ("pgqueuer", lambda: pgqueuer(url, n, "asyncpg")),
        "pgqueuer psycopg": ("pgqueuer", lambda: pgqueuer(url, n, "psycopg")),
        "procrastinate": ("procrastinate", lambda: procrastinate_rates(url, n)),
    }
    for name, (module, run) in peers.items():
        try:
            __import__(module)
            if name == "pgqueuer asyncpg":
                __import__("asyncpg")
            contenders[name] = run
        except ImportError as exc:
            contenders[name] = f"skipped ({exc})"
    pickers: dict[str, Callable[[int], list[float]] | str] = {
        "delayq Worker": lambda k: pickup_threads(url, k),
        "delayq AsyncWorker psycopg": lambda k: pickup_aio(url, k, "psycopg"),
        "delayq AsyncWorker asyncpg": (lambda k: pickup_aio(url, k, "asyncpg")) if why_not_asyncpg is None else "n/a",
        "pgqueuer asyncpg": (lambda k: pickup_pgqueuer(url, k))
        if not isinstance(contenders["pgqueuer asyncpg"], str)
        else "skipped",
        "raw LISTEN/NOTIFY (ceiling)": lambda k: pickup_notify_ceiling(url, k),
    }
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in contenders}
    lats: dict[str, list[float]] = {name: [] for name in pickers}
    names = [name for name, run in contenders.items() if not isinstance(run, str)]
    pick_names = [name for name, run in pickers.items() if not isinstance(run, str)]
    per_round = max(1, pickups // rounds)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run = contenders[name]
            if isinstance(run, str):  # failed in an earlier round
                continue
            try:
                found = run()
            except LostMessages:
                raise
            except Exception as exc:  # a peer that fails here: reported, the others go on
                contenders[name] = f"failed ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})"
                print(f"{name}: {contenders[name]}", flush=True)
                continue
            for row, rate in found.items():
                runs[name].setdefault(row, []).append(rate)
        for name in pick_names[r % len(pick_names) :] + pick_names[: r % len(pick_names)]:
            pick = pickers[name]
            assert not isinstance(pick, str)
            lats[name] += pick(per_round)
        print(f"(round {r + 1} of {rounds} done)", flush=True)
    if why_not_asyncpg is not None:
        print(f"delayq.aio on asyncpg: n/a ({why_not_asyncpg})")
    medians = {name: {row: statistics.median(v) for row, v in rows.items()} for name, rows in runs.items()}
    ratios = print_table(contenders, medians, n, rounds, runs)
    print(f"\npickup latency, idle, offer commit -> handler start ({per_round * rounds} samples each):")
    pickup: dict[str, tuple[float, float] | str] = {}
    for name, pick in pickers.items():
        if isinstance(pick, str):
            print(f"  {name:<30} {pick}")
            pickup[name] = pick
            continue
        p50, p99 = percentiles(lats[name])
        pickup[name] = (p50, p99)
        print(f"  {name:<30} p50 {p50:6.2f} ms  p99 {p99:6.2f} ms", flush=True)
    result: dict[str, Any] = {
        "n": n,
        "rounds": rounds,
        "rates": medians,
        "runs": runs,
        "ratios": ratios,
        "pickup": pickup,
    }
    if mysql_url is not None:
        result["mysql AsyncWorker / Worker"] = mysql_workers(mysql_url, n, rounds)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))
    return result


def print_table(
    contenders: dict[str, Any], medians: dict[str, Rates], n: int, rounds: int, runs: dict[str, dict[str, list[float]]]
) -> dict[str, dict[str, float]]:
    """The rates' table, then each delayq contender's ratios to pgqueuer: the median of the ratios of each
    round (the two measured minutes apart at most, where the machine's load swings between rounds); returned."""
    cols = list(contenders)
    print(f"\npeers, PostgreSQL, msgs/s, median of {rounds} interleaved round(s) of {n} messages")
    print(f"{'row':<26}" + "".join(f"{c:>20}" for c in cols))
    for row in ROWS:
        cells = []
        for c in cols:
            if isinstance(contenders[c], str):
                cells.append(f"{contenders[c].split(' ')[0]:>20}")
            else:
                v = medians[c].get(row)
                cells.append(f"{v:20.0f}" if v is not None else f"{'-':>20}")
        print(f"{row:<26}" + "".join(cells))
    ratios: dict[str, dict[str, float]] = {}
    base = runs.get("pgqueuer asyncpg")
    if not base:
        return ratios
    print(
        "ratios to pgqueuer on asyncpg, median of the rounds' ratios"
        " (offers of the psycopg contenders: to pgqueuer on psycopg):"
    )
    for c in cols:
        if c.startswith("pgqueuer") or isinstance(contenders[c], str):
            continue
        parts = []
        for row in ROWS:
            ref = base
            if (
                row.startswith("offer")
                and c in ("delayq threads", "delayq.aio psycopg")
                and runs.get("pgqueuer psycopg")
            ):
                ref = runs["pgqueuer psycopg"]
            ours, theirs = runs[c].get(row, []), ref.get(row, [])
            if ours and len(ours) == len(theirs):
                found = statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
                ratios.setdefault(c, {})[row] = found
                parts.append(f"{row}: {found:.2f}")
        print(f"  {c:<20} " + "; ".join(parts))
    threads = runs.get("delayq threads", {})
    for driver in ("psycopg", "asyncpg"):
        aio = runs.get(f"delayq.aio {driver}", {})
        for row in ("drain worker, batch 1", "drain worker, batch 100"):
            if threads.get(row) and len(threads[row]) == len(aio.get(row, [])):
                found = statistics.median(a / b for a, b in zip(aio[row], threads[row], strict=True))
                key = "AsyncWorker / Worker" + ("" if driver == "psycopg" else " (asyncpg)")
                ratios.setdefault(key, {})[row] = found
                print(f"  AsyncWorker ({driver}) / Worker (psycopg), {row}: {found:.2f}")
    return ratios


# -- MySQL/MariaDB: AsyncWorker (asyncmy) beside Worker (mysqlclient) --------------------------------------
def mysql_workers(url: str, n: int, rounds: int) -> dict[str, float]:
    """``Worker`` and ``AsyncWorker`` draining ``n`` no-op messages at batch (concurrency) 1 and 100 on the
    MySQL/MariaDB database of ``url``, in turns (who goes first alternates by round); prints and returns the
    median of the rounds' AsyncWorker / Worker ratios per batch."""
    migrations.upgrade(url, prefix=PREFIX)
    engine = sa.create_engine(url, pool_size=20)
    q = DelayedQueue(engine, "bench", table_prefix=PREFIX)
    aurl = sa.make_url(url).set(drivername="mysql+asyncmy").render_as_string(hide_password=False)

    def threads(batch: int) -> float:
        fill(q, n, "f")
        return _worker_drain(engine, n, batch)

    def aio(batch: int) -> float:
        fill(q, n, "f")

        async def body() -> float:
            aengine = create_async_engine(aurl, pool_size=20)
            done = 0

            class Noop(AsyncHandler):
                queue = "bench"

                async def handle(self, delivery: AsyncDelivery, conn: Any = None) -> None:
                    nonlocal done
                    done += 1

            try:
                worker = AsyncWorker(aengine, [Noop], table_prefix=PREFIX, concurrency=batch)
                start = time.perf_counter()
                worker.start()
                while done < n and time.perf_counter() - start < 600:
                    await asyncio.sleep(0.002)
                rate = _rate(n, start)
                await worker.stop()
            finally:
                await aengine.dispose()
            if done != n or count(engine):
                raise LostMessages(f"AsyncWorker (asyncmy): {done} of {n}")
            return rate

        return asyncio.run(body())

    found: dict[str, float] = {}
    try:
        clear(engine)
        print(f"\nMySQL/MariaDB, no-op drains of {n} messages, {rounds} interleaved round(s), msgs/s:")
        for batch in (1, 100):
            pairs: list[tuple[float, float]] = []
            for r in range(rounds):
                if r % 2 == 0:
                    t = threads(batch)
                    a = aio(batch)
                else:
                    a = aio(batch)
                    t = threads(batch)
                pairs.append((t, a))
            ratio = statistics.median(a / t for t, a in pairs)
            found[f"drain worker, batch {batch}"] = ratio
            print(
                f"  batch {batch:<3}  Worker {statistics.median(t for t, _ in pairs):8.0f}"
                f"  AsyncWorker {statistics.median(a for _, a in pairs):8.0f}"
                f"  AsyncWorker / Worker {ratio:.2f}  (rounds {', '.join(f'{a / t:.2f}' for t, a in pairs)})",
                flush=True,
            )
    finally:
        engine.dispose()
    return found
