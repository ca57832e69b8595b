"""The soak row: one ``Worker`` of 100 slots and a no-op handler, a long stream of messages through it.

``python -m benchmarks --soak`` (1,000,000 messages on PostgreSQL; ``--soak 20000`` for a smoke run,
``--backends sqlite`` or ``mysql`` for another backend). A producer thread keeps a backlog of at most
``BACKLOG`` messages ahead of the worker (the table stays small, as in a steady service). The
process's resident memory, threads, pooled connections, open file descriptors and sockets are read
after 10,000 messages and at the end (and every tenth of the way, printed as it goes). Verdict
"flat": RSS at the end at most 1.2x the RSS after 10,000, and no more threads, connections or
descriptors at the end than after 10,000 (issue 33).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from dataclasses import dataclass

import sqlalchemy as sa

from delayq import DelayedQueue, Delivery, Handler, Worker, migrations

BACKLOG = 20_000
FIRST = 10_000


@dataclass
class Sample:
    handled: int
    rss_mb: float
    threads: int
    connections: int
    fds: int
    sockets: int

    def line(self) -> str:
        return (
            f"after {self.handled:>9,}: RSS {self.rss_mb:7.1f} MB  threads {self.threads:3}  pooled connections"
            f" {self.connections:3}  fds {self.fds:4} (sockets {self.sockets})"
        )


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def sample(handled: int, engine: sa.Engine) -> Sample:
    gc.collect()
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        with_link = os.path.join("/proc/self/fd", fd)
        with contextlib.suppress(OSError):
            sockets += os.readlink(with_link).startswith("socket:")
    pool = engine.pool
    conns = pool.checkedin() + pool.checkedout() if hasattr(pool, "checkedin") else -1  # type: ignore[attr-defined]
    return Sample(handled, rss_mb(), threading.active_count(), conns, len(fds), sockets)


def run(engine: sa.Engine, prefix: str, total: int) -> bool:
    """Soak ``total`` messages through one 100-slot worker; print the samples and the verdict; True when flat."""
    migrations.upgrade(engine.url.render_as_string(hide_password=False), prefix=prefix)
    with engine.begin() as conn:
        table = f"{prefix}messages"
        conn.exec_driver_sql(f"DELETE FROM {table}" if engine.dialect.name == "sqlite" else f"TRUNCATE {table}")
    q = DelayedQueue(engine, "soak", table_prefix=prefix)
    stop = threading.Event()
    offered = [0]

    class Noop(Handler):
        queue = "soak"

        def handle(self, delivery: Delivery, conn: object = None) -> None:
            pass

    worker = Worker(engine, [Noop], table_prefix=prefix, concurrency=100)

    def produce() -> None:
        while offered[0] < total and not stop.is_set():
            if offered[0] - worker.handled >= BACKLOG:
                time.sleep(0.01)
                continue
            n = min(1000, total - offered[0])
            base = offered[0]
            q.offer_many([(f"m{i}", {"n": i}, None) for i in range(base, base + n)])
            offered[0] += n

    producer = threading.Thread(target=produce, name="soak-producer", daemon=True)
    print(f"soak: {engine.dialect.name}, one Worker x 100 slots, {total:,} messages", flush=True)
    before = sample(0, engine)
    print("  " + before.line() + "  (before the worker starts)", flush=True)
    start = time.perf_counter()
    producer.start()
    worker.start()
    first: Sample | None = None
    marks = sorted({min(FIRST, total)} | {total * k // 10 for k in range(1, 10) if total * k // 10 > FIRST})
    try:
        while worker.handled < total and time.perf_counter() - start < 6 * 3600:
            time.sleep(0.05)
            if marks and worker.handled >= marks[0]:
                marks.pop(0)
                s = sample(worker.handled, engine)
                first = first or s
                print("  " + s.line(), flush=True)
    finally:
        stop.set()
        producer.join(30)
    elapsed = time.perf_counter() - start
    end = sample(worker.handled, engine)  # the worker still running: its threads and connections count
    worker.stop()
    time.sleep(1.0)  # threads that were told to stop get to end
    after = sample(worker.handled, engine)
    print("  " + end.line() + "  (end, worker running)")
    print("  " + after.line() + "  (worker stopped, 1 s later)")
    if first is None:
        first = end
    flat = (
        end.rss_mb <= 1.2 * first.rss_mb
        and end.threads <= first.threads
        and end.connections <= first.connections
        and end.fds <= first.fds
    )
    print(
        f"soak: {worker.handled:,} handled in {elapsed:.0f} s ({worker.handled / elapsed:,.0f}/s); RSS end/10,000"
        f" {end.rss_mb / first.rss_mb:.2f}; threads {first.threads}->{end.threads}, connections"
        f" {first.connections}->{end.connections}, fds {first.fds}->{end.fds}: {'FLAT' if flat else 'NOT FLAT'}",
        flush=True,
    )
    if worker.handled != total:
        print(f"soak: only {worker.handled:,} of {total:,} handled")
        return False
    return flat
