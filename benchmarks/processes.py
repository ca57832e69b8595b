"""Workers in separate processes draining one queue: does a second process (or a fourth) add throughput?

Each process runs one ``Worker`` (no-op handler) on its own engine. The processes start, build their
worker and wait; the clock starts when they are all told to go and stops when their workers have
finished (acked) every message between them, by their own counts (each process publishes its
``worker.handled`` in shared memory: polling the table meanwhile would cost the database CPU the
drain is measured by). The table must be empty at the end. Registered in ``python -m benchmarks``
as "worker no-op drain, N process(es) x S slots", beside one process in the same run.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import time
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import sqlalchemy as sa

from delayq import Delivery, Handler, Worker

SPAWN = mp.get_context("spawn")  # a fresh interpreter each: no engine or thread inherited from the parent


class _Noop(Handler):
    queue = "bench"

    def handle(self, delivery: Delivery, conn: object = None) -> None:
        pass


def _run(url: str, prefix: str, slots: int, ready: Any, go: Any, stop: Any, handled: Synchronized[int]) -> None:
    sqlite = url.startswith("sqlite")
    engine = sa.create_engine(url, connect_args={"timeout": 30}) if sqlite else sa.create_engine(url, pool_size=10)
    poll = dt.timedelta(milliseconds=50)
    worker = Worker(engine, [_Noop], table_prefix=prefix, concurrency=slots, poll_interval=poll)
    ready.release()
    go.wait(60)
    worker.start()
    while not stop.is_set():
        handled.value = worker.handled
        stop.wait(0.002)
    worker.stop()
    handled.value = worker.handled
    engine.dispose()


def drain(url: str, prefix: str, n: int, processes: int, slots: int) -> float:
    """Seconds ``processes`` worker processes of ``slots`` slots take to handle the ``n`` messages due."""
    ready, go, stop = SPAWN.Semaphore(0), SPAWN.Event(), SPAWN.Event()
    counts = [SPAWN.Value("q", 0, lock=False) for _ in range(processes)]
    procs = [
        SPAWN.Process(target=_run, args=(url, prefix, slots, ready, go, stop, counts[i]), daemon=True)
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if not ready.acquire(timeout=120):
                raise RuntimeError("a worker process did not start")
        start = time.perf_counter()
        go.set()
        while sum(c.value for c in counts) < n:
            if time.perf_counter() - start > 600 or not all(p.is_alive() for p in procs):
                raise RuntimeError(f"drain stalled: {sum(c.value for c in counts)} of {n} handled")
            time.sleep(0.002)
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    total = sum(c.value for c in counts)
    if total != n:
        raise AssertionError(f"{processes} process(es) handled {total} messages, {n} were due")
    return elapsed
