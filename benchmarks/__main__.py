"""delayq beside the raw-SQL ceiling of each backend, measured in the same run.

    python -m benchmarks                       # all backends, full sizes, median of 3 runs
    python -m benchmarks --quick               # small sizes, one run (CI runs this)
    python -m benchmarks --backends postgresql --json results.json
    python -m benchmarks --only topics         # topics (benchmarks/topics.py)
    python -m benchmarks --only lifecycle      # the ack with retention 0 and on (benchmarks/lifecycle.py)
    python -m benchmarks --only "^offer|drain" # names that start with "offer" or contain "drain"
    python -m benchmarks --web                 # the dashboard's page loads over 1,000,000 messages (benchmarks/web.py)

Database URLs: DELAYQ_TEST_POSTGRES_URL, DELAYQ_TEST_MYSQL_URL (the local services by default);
SQLite runs on a file in a temporary directory. Tables use the prefix ``bench_``. Every
consume run checks that each message was delivered exactly once and the queue ended empty;
a benchmark that loses or duplicates a message fails instead of printing a figure.

Where a row ends with ``cpu X / Y µs/msg``: the CPU time this process spent per message for delayq and
for the ceiling (every thread; on SQLite the database's own work too). Unlike the rates it hardly
moves with what else the machine runs, and it shows where a gap is the client's work.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa

from benchmarks import asyncio as aio_bench
from benchmarks import ceiling
from benchmarks import flow as flow_bench
from benchmarks import lifecycle as lifecycle_bench
from benchmarks import processes as process_bench
from benchmarks import stack as stack_bench
from benchmarks import topic_pickup as topic_pickup_bench
from benchmarks import topics as topics_bench
from benchmarks.ceiling import BARE_RUNS, CPU_RUNS, three_way
from benchmarks.metrics import overhead as metrics_overhead
from delayq import DelayedQueue, Delivery, Handler, Worker, migrations

PREFIX = "bench_"
TABLE = f"{PREFIX}messages"
URLS = {
    "postgresql": os.environ.get("DELAYQ_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
    "mysql": os.environ.get("DELAYQ_TEST_MYSQL_URL", "mysql+mysqldb://root@127.0.0.1:3306/test"),
}
PAYLOAD = b'{"n":1}'
FAR_FUTURE = 4102444800000  # 2100-01-01 in epoch ms


@dataclass
class Sizes:
    single: int = 2000
    batch: int = 20000
    consume_single: int = 2000
    consume_batch: int = 20000
    future_rows: int = 1_000_000
    pickup: int = 500
    repeat: int = 3
    metrics_phase: float = 0.2  # seconds (benchmarks/metrics.py)


QUICK = Sizes(
    single=200,
    batch=2000,
    consume_single=200,
    consume_batch=2000,
    future_rows=10_000,
    pickup=50,
    repeat=1,
    metrics_phase=0.02,
)


@dataclass
class Figure:
    backend: str
    scenario: str
    delayq: float  # messages per second
    ceiling: float | None
    p50_ms: float | None = None
    p99_ms: float | None = None
    runs: list[float] = field(default_factory=list)
    run_ratios: list[float] = field(default_factory=list)  # delayq / ceiling within each run
    cpu_us: float | None = None  # this process's CPU per message (SQLite's own work included), median of runs
    ceiling_cpu_us: float | None = None
    bare: float | None = None  # stack rows: the bare driver's rate beside the stack ceiling (benchmarks/stack.py)
    bare_ratios: list[float] = field(default_factory=list)  # stack / bare within each run
    bare_cpu_us: float | None = None

    @property
    def stack_over_bare(self) -> float | None:
        return statistics.median(self.bare_ratios) if self.bare_ratios else None

    @property
    def ratio(self) -> float | None:
        """The median of the per-run ratios: each pairs delayq with the ceiling measured alongside it."""
        if self.run_ratios:
            return statistics.median(self.run_ratios)
        return None if not self.ceiling else self.delayq / self.ceiling


class LostMessages(AssertionError):
    pass


T = TypeVar("T")


class CpuTally:
    """The process's CPU time (``time.process_time``: every thread, and SQLite's own work) spent in
    the blocks timed with ``add``, for delayq and for the ceiling apart."""

    def __init__(self) -> None:
        self.ours = self.theirs = 0.0

    def timed(self, ours: bool, fn: Callable[[], object]) -> float:
        """``fn()``'s wall seconds (``ceiling.timed``), its CPU added to one side."""
        return self.add(ours, lambda: ceiling.timed(fn))

    def add(self, ours: bool, fn: Callable[[], T]) -> T:
        start = time.process_time()
        try:
            return fn()
        finally:
            spent = time.process_time() - start
            if ours:
                self.ours += spent
            else:
                self.theirs += spent

    def report(self, n: int) -> None:
        """Record the run's CPU per message (n messages each side) in ``CPU_RUNS``."""
        CPU_RUNS.append((self.ours / n, self.theirs / n))


def make_engine(backend: str, tmp: Path | None = None) -> sa.Engine:
    if backend == "sqlite":
        if tmp is None:
            raise ValueError("SQLite needs a directory for its file")
        engine = sa.create_engine(f"sqlite:///{tmp / 'bench.db'}", connect_args={"timeout": 30})

        @sa.event.listens_for(engine, "connect")
        def _wal(dbapi_conn: object, _: object) -> None:
            dbapi_conn.execute("PRAGMA journal_mode=WAL")  # type: ignore[attr-defined]

        return engine
    return sa.create_engine(URLS[backend], pool_size=10)


def clear(engine: sa.Engine) -> None:
    """Empty the table between runs; TRUNCATE leaves no dead rows for the next run to wade through."""
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {TABLE}" if engine.dialect.name == "sqlite" else f"TRUNCATE {TABLE}")


def count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(f"SELECT count(*) FROM {TABLE} WHERE queue = 'bench'").scalar_one())


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2] * 1000, ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


def run_threads(n: int, work: Callable[[int], None]) -> float:
    barrier = threading.Barrier(n + 1)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        barrier.wait()
        try:
            work(i)
        except BaseException as exc:  # reported after join
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


# -- offers ---------------------------------------------------------------------------------------
# delayq and the ceiling take turns, call by call (or round by round for consumers): whatever
# else the shared machine does slows both alike, so the ratio holds steady from run to run.
def offer_single(engine: sa.Engine, q: DelayedQueue, n: int) -> tuple[float, float, list[float]]:
    clear(engine)
    raw = ceiling.connect(engine, autocommit=True)
    offer = ceiling.offer_one(engine.dialect.name, TABLE)
    ours: list[float] = []
    theirs = 0.0
    cpu = CpuTally()
    for i in range(n):
        ours.append(cpu.timed(True, functools.partial(q.offer, f"s{i}", {"n": i})))
        theirs += cpu.timed(False, functools.partial(offer, raw, f"r{i}", PAYLOAD))
    raw.close()
    assert count(engine) == 2 * n
    cpu.report(n)
    return n / sum(ours), n / theirs, ours


def offer_batches(engine: sa.Engine, q: DelayedQueue, n: int, size: int = 500) -> tuple[float, float, list[float]]:
    clear(engine)
    raw = ceiling.connect(engine, autocommit=True)
    offer = ceiling.offer_batch(engine.dialect.name, TABLE)
    ours: list[float] = []
    theirs = 0.0
    cpu = CpuTally()
    for b in range(0, n, size):
        batch = range(b, min(n, b + size))
        items = [(f"b{i}", {"n": i}, None) for i in batch]
        ours.append(cpu.timed(True, functools.partial(q.offer_many, items)))
        rows = [(f"r{i}", PAYLOAD) for i in batch]
        theirs += cpu.timed(False, functools.partial(offer, raw, rows, int(time.time() * 1000)))
    raw.close()
    assert count(engine) == 2 * n
    cpu.report(n)
    return n / sum(ours), n / theirs, ours


# -- consumers ------------------------------------------------------------------------------------
ROUNDS = 4


def fill(q: DelayedQueue, n: int) -> set[str]:
    keys = [f"c{i}" for i in range(n)]
    for b in range(0, n, 1000):
        q.offer_many([(k, {"k": k}, None) for k in keys[b : b + 1000]])
    return set(keys)


def check_exactly_once(engine: sa.Engine, expected: set[str], delivered: Counter[str], what: str) -> None:
    if set(delivered) != expected or (delivered and max(delivered.values()) != 1) or count(engine) != 0:
        missing = len(expected - set(delivered))
        twice = sum(1 for v in delivered.values() if v > 1)
        raise LostMessages(f"{what}: {missing} not delivered, {twice} delivered twice, {count(engine)} left")


def analyze_empty(engine: sa.Engine) -> None:
    """Refresh the statistics of the (empty) table: the planner then believes it stays nearly empty."""
    name = engine.dialect.name
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if name == "postgresql":  # no autovacuum to refresh them behind the benchmark's back
            conn.exec_driver_sql(f"ALTER TABLE {TABLE} SET (autovacuum_enabled = false)")
        conn.exec_driver_sql(f"ANALYZE TABLE {TABLE}" if name == "mysql" else f"ANALYZE {TABLE}")


def fresh_statistics(engine: sa.Engine) -> None:
    """Undo ``analyze_empty``: autovacuum back on (PostgreSQL)."""
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f"ALTER TABLE {TABLE} RESET (autovacuum_enabled)")


def consume(
    engine: sa.Engine, q: DelayedQueue, n: int, batch: int, consumers: int, *, stale: bool = False
) -> tuple[float, float]:
    """Drain n messages with delayq and n with the ceiling, in alternating rounds.

    ``stale``: each round fills a table whose statistics were taken while it was empty (a queue
    table's usual state where autovacuum is off or slow), so a claim planned from statistics alone
    sorts every due row.
    """
    clear(engine)
    claim = ceiling.claim_and_ack(engine.dialect.name, TABLE)
    raws = [ceiling.connect(engine, autocommit=engine.dialect.name == "postgresql") for _ in range(consumers)]
    lock = threading.Lock()
    ours_time = theirs_time = 0.0
    cpu = CpuTally()
    for _ in range(ROUNDS):
        if stale:
            analyze_empty(engine)
        expected = fill(q, n // ROUNDS)
        delivered: Counter[str] = Counter()

        def ours(_: int, delivered: Counter[str] = delivered) -> None:
            while got := q.try_poll_many(batch):
                q.ack_many(got)
                with lock:
                    delivered.update(d.key for d in got)

        ours_time += cpu.add(True, lambda: run_threads(consumers, ours))
        check_exactly_once(engine, expected, delivered, "delayq")

        if stale:
            analyze_empty(engine)
        expected = fill(q, n // ROUNDS)
        delivered = Counter()

        def theirs(i: int, delivered: Counter[str] = delivered) -> None:
            while keys := claim(raws[i], batch):
                with lock:
                    delivered.update(keys)

        theirs_time += cpu.add(False, lambda: run_threads(consumers, theirs))
        check_exactly_once(engine, expected, delivered, "ceiling")
    for raw in raws:
        raw.close()
    if stale:
        fresh_statistics(engine)
    done = ROUNDS * (n // ROUNDS)
    cpu.report(done)
    return done / ours_time, done / theirs_time


def add_future_rows(engine: sa.Engine, n: int) -> None:
    """n messages in the same queue, due in ten years (generated by the database itself)."""
    with engine.begin() as conn:
        due = FAR_FUTURE
        name = engine.dialect.name
        if name == "postgresql":
            conn.exec_driver_sql(
                f"INSERT INTO {TABLE} (queue, key, payload, payload_type, scheduled_at, scheduled_at_initially,"
                f" created_at) SELECT 'bench', 'future-' || g, '\\x00', 'json', {due}, {due}, 0"
                f" FROM generate_series(1, {n}) AS g"
            )
        else:
            key = "`key`" if name == "mysql" else "key"
            concat = "CONCAT('future-', g)" if name == "mysql" else "'future-' || g"
            if name == "mysql":
                limit = "max_recursive_iterations" if engine.dialect.is_mariadb else "cte_max_recursion_depth"
                conn.exec_driver_sql(f"SET SESSION {limit} = {n + 1}")
            conn.exec_driver_sql(
                f"INSERT INTO {TABLE} (queue, {key}, payload, payload_type, scheduled_at, scheduled_at_initially,"
                f" created_at) WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < {n})"
                f" SELECT 'bench', {concat}, x'00', 'json', {due}, {due}, 0 FROM s"
            )
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f"ANALYZE {TABLE}")


def scale(engine: sa.Engine, q: DelayedQueue, sizes: Sizes) -> tuple[float, float, float, float]:
    """Claim (batches of 100) and single-offer rates, empty table vs. with future_rows far-future rows."""

    def claim_rate() -> float:
        n = sizes.consume_batch
        expected = fill(q, n)
        delivered: Counter[str] = Counter()

        def work(_: int) -> None:
            while got := q.try_poll_many(100):
                q.ack_many(got)
                delivered.update(d.key for d in got)

        rate = n / run_threads(1, work)
        if set(delivered) != expected or max(delivered.values()) != 1:
            raise LostMessages("scale claim")
        return rate

    def offer_rate(tag: str) -> float:
        n = sizes.single
        start = time.perf_counter()
        for i in range(n):
            q.offer(f"{tag}{i}", {"n": i})
        rate = n / (time.perf_counter() - start)
        with engine.begin() as conn:  # the offered rows, not the far-future ones
            conn.exec_driver_sql(f"DELETE FROM {TABLE} WHERE scheduled_at < {FAR_FUTURE}")
        return rate

    clear(engine)
    empty_claim, empty_offer = claim_rate(), offer_rate("e")
    add_future_rows(engine, sizes.future_rows)
    full_claim, full_offer = claim_rate(), offer_rate("f")
    clear(engine)
    return empty_claim, full_claim, empty_offer, full_offer


# -- the worker -----------------------------------------------------------------------------------
def noop_handler(queue: str, on_start: Callable[[str], None]) -> Handler:
    class Noop(Handler):
        def handle(self, delivery: Delivery, conn: object = None) -> None:
            on_start(delivery.key)

    Noop.queue = queue
    return Noop()


def pickup_latency(engine: sa.Engine, q: DelayedQueue, n: int) -> tuple[float, None, list[float]]:
    """Offer one message at a time to an idle worker; time from the offer's commit to the handler's start."""
    clear(engine)
    started: dict[str, float] = {}
    arrived = threading.Event()

    def on_start(key: str) -> None:
        started[key] = time.perf_counter()
        arrived.set()

    worker = Worker(engine, [noop_handler("bench", on_start)], table_prefix=PREFIX, concurrency=4)
    worker.start()
    lat: list[float] = []
    try:
        time.sleep(0.2)  # let it go idle (and LISTEN on PostgreSQL)
        for i in range(n):
            arrived.clear()
            q.offer(f"l{i}", {"n": i})
            committed = time.perf_counter()
            if not arrived.wait(10):
                raise LostMessages(f"pickup: message l{i} was not picked up within 10 s")
            lat.append(started[f"l{i}"] - committed)
            time.sleep(0.005 + 0.01 * (i % 3))  # idle between messages
    finally:
        worker.stop()
    total = sum(lat)
    return n / total, None, lat


def worker_drain(
    engine: sa.Engine,
    q: DelayedQueue,
    n: int,
    workers: int,
    slots: int = 8,
    *,
    ceiling_batch: int | None = None,
    api_ceiling: bool = False,
) -> tuple[float, float | None, list[float]]:
    """No-op handlers draining n due messages with ``workers`` workers of ``slots`` slots each.

    A drain ends when the workers have finished (acked) n messages, by their own count: polling the
    table's row count meanwhile would cost the database the CPU the drain is measured by. With
    ``ceiling_batch``, rounds of the drain take turns with rounds of the raw claim + ack of that
    many messages (one consumer), and the ceiling is that rate.
    """
    clear(engine)
    claim = ceiling.claim_and_ack(engine.dialect.name, TABLE)
    raw = ceiling.connect(engine, autocommit=engine.dialect.name == "postgresql") if ceiling_batch else None
    rounds = ROUNDS if ceiling_batch else 1
    ours_time = theirs_time = 0.0
    cpu = CpuTally()
    for _ in range(rounds):
        expected = fill(q, n // rounds)
        delivered: Counter[str] = Counter()
        lock = threading.Lock()

        def on_start(key: str, delivered: Counter[str] = delivered, lock: threading.Lock = lock) -> None:
            with lock:
                delivered[key] += 1

        pool = [
            Worker(
                engine,
                [noop_handler("bench", on_start)],
                table_prefix=PREFIX,
                concurrency=slots,
                poll_interval=dt.timedelta(milliseconds=50),
            )
            for _ in range(workers)
        ]

        def drain(pool: list[Worker] = pool, expected: set[str] = expected) -> float:
            start = time.perf_counter()
            for w in pool:
                w.start()
            while sum(w.handled for w in pool) < len(expected) and time.perf_counter() - start < 600:
                time.sleep(0.002)
            return time.perf_counter() - start

        ours_time += cpu.add(True, drain)
        for w in pool:
            w.stop()
        check_exactly_once(engine, expected, delivered, f"worker drain x{workers}")
        if raw is not None and ceiling_batch is not None:
            expected = fill(q, n // rounds)
            delivered = Counter()

            def theirs(_: int, delivered: Counter[str] = delivered, size: int = ceiling_batch) -> None:
                if api_ceiling:
                    while got := q.try_poll_many(size):
                        q.ack_many(got)
                        delivered.update(d.key for d in got)
                    return
                while keys := claim(raw, size):
                    delivered.update(keys)

            theirs_time += cpu.add(False, lambda: run_threads(1, theirs))
            check_exactly_once(engine, expected, delivered, "ceiling")
    if raw is not None:
        raw.close()
    done = rounds * (n // rounds)
    if theirs_time:
        cpu.report(done)
    return done / ours_time, (done / theirs_time if theirs_time else None), []


# -- the stack ceiling ----------------------------------------------------------------------------
# delayq, the same statements by hand on SQLAlchemy Core (benchmarks/stack.py) and the bare driver
# (benchmarks/ceiling.py) take turns call by call, the order rotating, so each ratio is measured in
# one stretch of the shared machine's time. The Figure's ceiling is the stack; ``bare`` beside it.
def stack_offer(
    engine: sa.Engine, q: DelayedQueue, stack: stack_bench.Stack, n: int
) -> tuple[float, float, list[float]]:
    clear(engine)
    raw = ceiling.connect(engine, autocommit=True)
    bare = ceiling.offer_one(engine.dialect.name, TABLE)
    try:
        figures = three_way(
            n,
            [
                lambda i: q.offer(f"d{i}", {"n": 1}),
                lambda i: stack.offer(f"s{i}", PAYLOAD),
                lambda i: bare(raw, f"b{i}", PAYLOAD),
            ],
        )
    finally:
        raw.close()
    assert count(engine) == 3 * n
    return figures


def stack_get(engine: sa.Engine, q: DelayedQueue, stack: stack_bench.Stack, n: int) -> tuple[float, float, list[float]]:
    clear(engine)
    fill(q, n)
    raw = ceiling.connect(engine, autocommit=True)
    bare = ceiling.get_one(engine.dialect.name, TABLE)
    found = [0, 0, 0]

    def tally(side: int, got: object) -> None:
        found[side] += got is not None

    try:
        figures = three_way(
            n,
            [
                lambda i: tally(0, q.get(f"c{i}")),
                lambda i: tally(1, stack.get(f"c{i}")),
                lambda i: tally(2, bare(raw, f"c{i}")),
            ],
        )
    finally:
        raw.close()
    if found != [n, n, n]:
        raise LostMessages(f"stack get: found {found} of {n} each")
    return figures


def stack_cancel(
    engine: sa.Engine, q: DelayedQueue, stack: stack_bench.Stack, n: int
) -> tuple[float, float, list[float]]:
    clear(engine)
    fill(q, 3 * n)
    raw = ceiling.connect(engine, autocommit=True)
    bare = ceiling.cancel_one(engine.dialect.name, TABLE)
    gone = [0, 0, 0]

    def tally(side: int, ok: bool) -> None:
        gone[side] += ok

    try:
        figures = three_way(
            n,
            [
                lambda i: tally(0, q.cancel(f"c{i}")),
                lambda i: tally(1, stack.cancel(f"c{n + i}")),
                lambda i: tally(2, bare(raw, f"c{2 * n + i}")),
            ],
        )
    finally:
        raw.close()
    if gone != [n, n, n] or count(engine):
        raise LostMessages(f"stack cancel: cancelled {gone} of {n} each, {count(engine)} left")
    return figures


def stack_offer_many(
    engine: sa.Engine, q: DelayedQueue, stack: stack_bench.Stack, n: int, size: int = 500
) -> tuple[float, float, list[float]]:
    clear(engine)
    raw = ceiling.connect(engine, autocommit=True)
    bare = ceiling.offer_batch(engine.dialect.name, TABLE)

    def keys(tag: str, i: int) -> range:
        return range(i * size, (i + 1) * size)

    try:
        figures = three_way(
            n,
            [
                lambda i: q.offer_many([(f"d{k}", {"n": 1}, None) for k in keys("d", i)]),
                lambda i: stack.offer_many([(f"s{k}", PAYLOAD) for k in keys("s", i)]),
                lambda i: bare(raw, [(f"b{k}", PAYLOAD) for k in keys("b", i)], int(time.time() * 1000)),
            ],
            per_call=size,
        )
    finally:
        raw.close()
    assert count(engine) == 3 * (n // size) * size, count(engine)
    return figures


def stack_consume(
    engine: sa.Engine, q: DelayedQueue, stack: stack_bench.Stack, n: int, batch: int
) -> tuple[float, float, list[float]]:
    """Claim ``batch`` + ack, one consumer each side, from one queue filled with 3n messages."""
    clear(engine)
    expected = fill(q, 3 * (n // batch) * batch)
    raw = ceiling.connect(engine, autocommit=engine.dialect.name == "postgresql")
    bare = ceiling.claim_and_ack(engine.dialect.name, TABLE)
    delivered: Counter[str] = Counter()
    short = [0]

    def ours(_: int) -> None:
        if batch == 1:  # the single-message API: try_poll, then the delivery's ack
            one = q.try_poll()
            got = [] if one is None else [one]
            if one is not None:
                one.ack()
        else:
            got = q.try_poll_many(batch)
            q.ack_many(got)
        delivered.update(d.key for d in got)
        short[0] += len(got) < batch

    def by_stack(_: int) -> None:
        keys = stack.claim_and_ack(batch)
        delivered.update(keys)
        short[0] += len(keys) < batch

    def by_bare(_: int) -> None:
        keys = bare(raw, batch)
        delivered.update(keys)
        short[0] += len(keys) < batch

    try:
        figures = three_way(n, [ours, by_stack, by_bare], per_call=batch)
    finally:
        raw.close()
    check_exactly_once(engine, expected, delivered, f"stack consume {batch}")
    if short[0]:
        raise LostMessages(f"stack consume {batch}: {short[0]} claims came back short")
    return figures


# -- the run --------------------------------------------------------------------------------------
def median_figure(backend: str, scenario: str, runs: list[tuple[float, float | None, list[float]]]) -> Figure:
    ours = [r[0] for r in runs]
    theirs = [r[1] for r in runs if r[1] is not None]
    lat = [x for r in runs for x in r[2]]
    p50, p99 = percentiles(lat) if lat else (None, None)
    ratios = [r[0] / r[1] for r in runs if r[1]]
    return Figure(
        backend,
        scenario,
        statistics.median(ours),
        statistics.median(theirs) if theirs else None,
        p50,
        p99,
        ours,
        ratios,
    )


def selected(scenario: str, only: str) -> bool:
    """Whether ``--only`` picks ``scenario``: its name contains one of the ``|``-separated texts (or
    starts with one written ``^text``)."""
    return any(scenario.startswith(t[1:]) if t.startswith("^") else t in scenario for t in only.split("|"))


def bench_backend(
    backend: str, sizes: Sizes, tmp: Path, only: str = "", stack_only: bool = False, flow_only: bool = False
) -> list[Figure]:
    engine = make_engine(backend, tmp)
    migrations.upgrade(engine.url.render_as_string(hide_password=False), prefix=PREFIX)
    q = DelayedQueue(engine, "bench", table_prefix=PREFIX)
    figures: list[Figure] = []

    def measure(scenario: str, fn: Callable[[], tuple[float, float | None, list[float]]]) -> None:
        if not selected(scenario, only):
            return
        CPU_RUNS.clear()
        BARE_RUNS.clear()
        figure = median_figure(backend, scenario, [fn() for _ in range(sizes.repeat)])
        if CPU_RUNS:
            figure.cpu_us = statistics.median(r[0] for r in CPU_RUNS) * 1e6
            figure.ceiling_cpu_us = statistics.median(r[1] for r in CPU_RUNS) * 1e6
        if BARE_RUNS:
            figure.bare = statistics.median(r[1] for r in BARE_RUNS)
            figure.bare_ratios = [r[0] / r[1] for r in BARE_RUNS]
            figure.bare_cpu_us = statistics.median(r[2] for r in BARE_RUNS) * 1e6
        figures.append(figure)
        print_row(figure)

    if flow_only:
        flow_bench.rows(engine, PREFIX, sizes.consume_batch, sizes.single, measure)
        return figures
    if not stack_only:
        measure("offer (one per call)", lambda: offer_single(engine, q, sizes.single))
    stack = stack_bench.Stack(q)
    stack_bench.check_same_sql(q, stack)
    measure("stack: offer (one per call)", lambda: stack_offer(engine, q, stack, sizes.single))
    measure("stack: try_poll + ack", lambda: stack_consume(engine, q, stack, sizes.consume_single, 1))
    measure("stack: get", lambda: stack_get(engine, q, stack, sizes.single))
    measure("stack: cancel", lambda: stack_cancel(engine, q, stack, sizes.single))
    measure("stack: offer_many (500 per call)", lambda: stack_offer_many(engine, q, stack, sizes.batch))
    measure(
        "stack: try_poll_many(100) + ack_many",
        lambda: stack_consume(engine, q, stack, sizes.consume_batch, 100),
    )
    measure(
        "stack: worker 1 x 100 slots (ceiling: API loop try_poll_many(100) + ack_many)",
        lambda: worker_drain(engine, q, sizes.consume_batch, 1, 100, ceiling_batch=100, api_ceiling=True),
    )
    lifecycle_bench.measure_all(engine, PREFIX, sizes.consume_batch // 2, measure)  # benchmarks/lifecycle.py
    if stack_only:
        engine.dispose()
        return figures
    if backend != "sqlite":  # an engine whose connections commit each statement: no COMMIT round trip,
        # and no ROLLBACK when a connection returns to the pool (docs/performance.md, "Tuning")
        autocommit = sa.create_engine(
            URLS[backend], pool_size=10, isolation_level="AUTOCOMMIT", skip_autocommit_rollback=True
        )
        q_auto = DelayedQueue(autocommit, "bench", table_prefix=PREFIX)
        measure("offer (one per call), engine in autocommit", lambda: offer_single(engine, q_auto, sizes.single))
        measure(
            "try_poll + ack, 1 consumer(s), engine in autocommit",
            lambda: (*consume(engine, q_auto, sizes.consume_single, 1, 1), []),
        )
        autocommit.dispose()
    measure("offer_many (500 per call)", lambda: offer_batches(engine, q, sizes.batch))
    for consumers in (1, 4):
        measure(
            f"try_poll + ack, {consumers} consumer(s)",
            lambda c=consumers: (*consume(engine, q, sizes.consume_single, 1, c), []),
        )
        measure(
            f"try_poll_many(100) + ack_many, {consumers} consumer(s)",
            lambda c=consumers: (*consume(engine, q, sizes.consume_batch, 100, c), []),
        )
    measure(
        "try_poll_many(100) + ack_many, 1 consumer(s), statistics taken while empty",
        lambda: (*consume(engine, q, sizes.consume_batch, 100, 1, stale=True), []),
    )
    measure("pickup latency, idle worker (offer commit -> handler)", lambda: pickup_latency(engine, q, sizes.pickup))
    for workers in (1, 4):
        measure(
            f"worker no-op drain, {workers} worker(s) x 8 slots",
            lambda w=workers: worker_drain(engine, q, sizes.consume_batch, w),
        )
    # Issue 15's figure: a worker that claims up to 100 at a time, beside the raw claim + ack of 100
    measure(
        "worker no-op drain, 1 worker x 100 slots (ceiling: raw claim + ack of 100)",
        lambda: worker_drain(engine, q, sizes.consume_batch, 1, 100, ceiling_batch=100),
    )

    def process_drains(processes: int, slots: int) -> tuple[float, float, list[float]]:
        """``processes`` worker processes beside one, in turns; the "ceiling" is the one process's rate."""
        url = engine.url.render_as_string(hide_password=False)
        n = sizes.consume_batch
        clear(engine)
        fill(q, n)
        many = n / process_bench.drain(url, PREFIX, n, processes, slots)
        assert count(engine) == 0
        fill(q, n)
        one = n / process_bench.drain(url, PREFIX, n, 1, slots)
        assert count(engine) == 0
        return many, one, []

    # Issue 15: 4 worker processes are at least as fast as 1 (ratio >= 1)
    measure("worker no-op drain, 4 processes x 100 slots (ceiling: 1 process)", lambda: process_drains(4, 100))

    def metrics_drain() -> tuple[float, float, list[float]]:
        clear(engine)
        fill_all = lambda: len(fill(q, sizes.consume_batch))  # noqa: E731
        return metrics_overhead(engine, fill_all, "bench", PREFIX, lambda: count(engine), sizes.metrics_phase)

    # benchmarks/metrics.py: one drain, the metrics switched on and off; the ceiling is the rate with them off
    measure("worker no-op drain with metrics, 1 worker x 8 slots", metrics_drain)
    aio_bench.measure_all(engine, q, sizes, measure)  # delayq.aio beside the sync API
    topics_bench.measure_all(engine, sizes, measure)  # benchmarks/topics.py: topics beside their ceiling
    topic_pickup_bench.measure_all(engine, sizes, measure)  # benchmarks/topic_pickup.py: NOTIFY on publish
    scale_figures = {
        f"scale: {label} with {sizes.future_rows:,} future rows vs empty": (i_empty, i_full)
        for label, i_empty, i_full in (("claim 100 + ack", 0, 1), ("offer (one per call)", 2, 3))
    }
    wanted = any(selected(scenario, only) for scenario in scale_figures)
    runs = [scale(engine, q, sizes) for _ in range(sizes.repeat)] if wanted else []
    for scenario, (i_empty, i_full) in scale_figures.items() if runs else ():
        empty = statistics.median(r[i_empty] for r in runs)
        full = statistics.median(r[i_full] for r in runs)
        figure = Figure(backend, scenario, full, empty, run_ratios=[r[i_full] / r[i_empty] for r in runs])
        figures.append(figure)
        print_row(figure, ceiling_label="empty")
    engine.dispose()
    return figures


def print_row(f: Figure, ceiling_label: str = "ceiling") -> None:
    ratio = f"{f.ratio:5.2f}" if f.ratio is not None else "    -"
    theirs = f"{f.ceiling:9.0f}" if f.ceiling is not None else "        -"
    ours = f"{f.delayq:9.0f}" if f.delayq >= 10 else f"{f.delayq:9.2f}"  # slow events (topics: settle times)
    lat = f"  p50 {f.p50_ms:6.2f} ms  p99 {f.p99_ms:6.2f} ms" if f.p50_ms is not None else ""
    spread = f"  (runs {min(f.run_ratios):.2f}-{max(f.run_ratios):.2f})" if len(f.run_ratios) > 1 else ""
    cpu = ""
    if f.cpu_us is not None and f.ceiling_cpu_us is not None:
        cpu = f"  cpu {f.cpu_us:.1f} / {f.ceiling_cpu_us:.1f} µs/msg"
    if f.stack_over_bare is not None and f.bare is not None:  # a stack row: delayq/stack, then stack/bare
        ceiling_label = "stack"
        cpu += f"  | bare {f.bare:7.0f}/s  stack/bare {f.stack_over_bare:5.2f}"
        if f.bare_cpu_us is not None:
            cpu += f"  cpu bare {f.bare_cpu_us:.1f} µs/msg"
    print(
        f"{f.backend:<10} {f.scenario:<58} {ours}/s  {ceiling_label} {theirs}/s  ratio {ratio}{spread}{lat}{cpu}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgresql,mysql", help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="small sizes, one run (what CI runs)")
    parser.add_argument("--repeat", type=int, help="runs per figure (the median is reported)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--only",
        default="",
        help="run the scenarios whose name contains this text (several: separated by |; ^text: starts with it)",
    )
    parser.add_argument(
        "--stack", action="store_true", help="only the stack-ceiling rows: delayq, SQLAlchemy Core, bare driver"
    )
    parser.add_argument(
        "--flow",
        action="store_true",
        help="only the flow-control rows: priorities, limits, groups beside hand-written claims (benchmarks/flow.py)",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="delayq beside pgqueuer (asyncpg, psycopg) and procrastinate on PostgreSQL (benchmarks/peers.py)",
    )
    parser.add_argument("--peers-n", type=int, default=5000, help="messages per peers run")
    parser.add_argument(
        "--topic-scale",
        action="store_true",
        help="200 idle topic subscribers (processes x threads) over 2,000 partitions (benchmarks/topic_scale.py)",
    )
    parser.add_argument(
        "--soak", type=int, nargs="?", const=1_000_000, help="one worker, 100 slots, this many messages (1,000,000)"
    )
    parser.add_argument(
        "--web", type=int, nargs="?", const=1_000_000, help="the dashboard's page loads over this many messages"
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    if args.repeat:
        sizes.repeat = args.repeat
    figures: list[Figure] = []
    if args.web:
        from benchmarks import web as web_bench

        backend = args.backends.split(",")[0] if args.backends != parser.get_default("backends") else "postgresql"
        with tempfile.TemporaryDirectory() as tmp:
            loads = web_bench.run(make_engine(backend, Path(tmp)), PREFIX, args.web)
        if args.json:
            args.json.write_text(json.dumps([asdict(load) for load in loads], indent=2))
        return 0
    if args.topic_scale:
        from benchmarks import topic_scale

        for backend in args.backends.split(","):
            if backend.strip() in URLS:
                topic_scale.main(["--url", URLS[backend.strip()], *(["--json", str(args.json)] if args.json else [])])
        return 0
    if args.peers or args.soak:
        from benchmarks import peers as peers_bench
        from benchmarks import soak as soak_bench

        if args.peers:
            mysql_url = URLS["mysql"] if "mysql" in args.backends.split(",") and URLS["mysql"] else None
            peers_bench.main(URLS["postgresql"], args.peers_n, sizes.repeat, args.json, sizes.pickup, mysql_url)
        if args.soak:
            backend = args.backends.split(",")[0] if args.backends != parser.get_default("backends") else "postgresql"
            with tempfile.TemporaryDirectory() as tmp:
                ok = soak_bench.run(make_engine(backend, Path(tmp)), PREFIX, args.soak)
            if not ok:
                return 1
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            figures += bench_backend(backend.strip(), sizes, Path(tmp), args.only, args.stack, args.flow)
    if args.json:
        args.json.write_text(
            json.dumps(
                [{**asdict(f), "ratio": f.ratio, "stack_over_bare": f.stack_over_bare} for f in figures], indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
