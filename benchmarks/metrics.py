"""What the Prometheus metrics cost a worker: its no-op drain rate with them on, beside the rate with them off.

One worker drains the queue while the metrics are switched on and off every ``PHASE`` seconds; each
handler's start is timed, so the rate of each phase is known, and the figure compares the rate of all
the "on" phases with that of all the "off" ones (its "ceiling" is the rate without metrics, so the
ratio is the share of the drain rate left with them on; issue 19 asks for at least 0.95). Phases a
fifth of a second long take turns many times in one drain, so whatever slows the machine for longer
than that (a WAL checkpoint, the growth of the table, another process) weighs on both alike. Separate
drains with and without metrics could not show a cost of a few percent: one drain's rate swings by a
sixth from the next on a shared 2-core machine. Even so, the rate of 0.2-second phases swings too much
for a few percent to stand out in one run (an observer that does nothing, switched the same way, gave
ratios from 0.87 to 1.08), so each run also prints the time the worker's threads spent inside the metrics:
their cost measured where it is paid, per delivery and as a share of the time they were on.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from delayq import Delivery, Handler, Worker, observe
from delayq.metrics import register, unregister


class Timed(observe.Observer):
    """Forwards to ``inner``, adding up the time spent in it: the metrics' own cost, measured where it is paid."""

    def __init__(self, inner: observe.Observer) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.deliveries = 0
        self._lock = threading.Lock()

    def _spent(self, since: float, deliveries: int = 0) -> None:
        spent = time.perf_counter() - since
        with self._lock:
            self.seconds += spent
            self.deliveries += deliveries

    def started(self, delivery: Delivery) -> object:
        since = time.perf_counter()
        state = self.inner.started(delivery)
        self._spent(since, 1)
        return state

    def finished(self, delivery: Delivery, state: object, error: BaseException | None, duration: float) -> None:
        since = time.perf_counter()
        self.inner.finished(delivery, state, error, duration)
        self._spent(since)

    def counted(self, event: observe.Event, queue: str, n: int) -> None:
        since = time.perf_counter()
        self.inner.counted(event, queue, n)
        self._spent(since)


PHASE = 0.2
"""Seconds between switches of the metrics (``--quick`` runs use shorter phases: its drains are short)."""


def overhead(
    engine: sa.Engine,
    fill: Callable[[], int],
    queue: str,
    table_prefix: str,
    remaining: Callable[[], int],
    phase: float = PHASE,
) -> tuple[float, float, list[float]]:
    """(rate with metrics, rate without, no latencies) of one drain of what ``fill()`` offered to ``queue``.

    One worker of 8 slots; ``remaining()`` counts the messages left. The first and the last phases
    (the worker starting up, the queue running dry) are left out.
    """
    starts: list[float] = []

    class Noop(Handler):
        def handle(self, delivery: Delivery, conn: object = None) -> None:
            starts.append(time.perf_counter())

    Noop.queue = queue
    n = fill()
    registry = CollectorRegistry()
    metrics = register(registry)
    observe.remove(metrics)
    timed = Timed(metrics)  # switched on by the first phase
    switches: list[tuple[float, bool]] = []
    done = threading.Event()

    def switch() -> None:
        on = True
        while not done.is_set():
            (observe.add if on else observe.remove)(timed)
            switches.append((time.perf_counter(), on))
            on = not on
            done.wait(phase)

    worker = Worker(engine, [Noop()], table_prefix=table_prefix, concurrency=8)
    switcher = threading.Thread(target=switch, daemon=True)
    try:
        worker.start()
        switcher.start()
        deadline = time.perf_counter() + 600
        while remaining() and time.perf_counter() < deadline:
            time.sleep(0.01)
    finally:
        done.set()
        switcher.join()
        worker.stop()
        observe.remove(timed)
        unregister(metrics, registry)
    if len(starts) < n:
        raise AssertionError(f"metrics drain: {n - len(starts)} of {n} messages not handled")
    starts.sort()
    seconds = {True: 0.0, False: 0.0}
    handled = {True: 0, False: 0}
    for (begin, on), (end, _) in itertools.pairwise(switches[1:-1]):  # neither the first nor the last two
        seconds[on] += end - begin
        handled[on] += bisect.bisect_left(starts, end) - bisect.bisect_left(starts, begin)
    if not (seconds[True] and seconds[False]):
        raise AssertionError("metrics drain: too short to take turns; offer more messages")
    on_time = sum(end - begin for (begin, on), (end, _) in itertools.pairwise(switches) if on)
    print(
        f"{'':10} (the metrics' own time: {timed.seconds / max(1, timed.deliveries) * 1e6:.1f} µs per delivery,"
        f" {timed.seconds / on_time:.2%} of the time they were on)",
        flush=True,
    )
    return handled[True] / seconds[True], handled[False] / seconds[False], []
