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
ratios from 0.84 to 1.07 on SQLite), so each run also prints the metrics' own cost where it is paid: the
CPU time of the observer calls of one delivery, measured on one thread after the drain, beside the CPU
time the worker process spent per delivery during the drain. (The drain itself runs the metrics bare:
timing each call inside the drain cost as much as the metrics did.)
"""

from __future__ import annotations

import bisect
import itertools
import random
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from delayq import Delivery, Handler, Worker, observe
from delayq.metrics import Metrics, register, unregister


def own_cpu(metrics: Metrics, delivery: Delivery, calls: int = 20_000, rounds: int = 5) -> float:
    """Seconds of CPU the metrics add to one delivery's observer calls (on one thread, best of ``rounds``)."""

    def per_delivery() -> float:
        best = float("inf")
        for _ in range(rounds):
            since = time.process_time()
            for _ in range(calls):
                with observe.handling(delivery):
                    pass
            best = min(best, (time.process_time() - since) / calls)
        return best

    without = per_delivery()
    observe.add(metrics)
    try:
        return max(0.0, per_delivery() - without)
    finally:
        observe.remove(metrics)


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
    sample: list[Delivery] = []

    class Noop(Handler):
        def handle(self, delivery: Delivery, conn: object = None) -> None:
            starts.append(time.perf_counter())
            if not sample:
                sample.append(delivery)

    Noop.queue = queue
    n = fill()
    registry = CollectorRegistry()
    metrics = register(registry)
    observe.remove(metrics)  # switched on by the first phase
    switches: list[tuple[float, bool]] = []
    done = threading.Event()

    def switch() -> None:
        coin = random.Random(19)
        while not done.is_set():  # phases in pairs, on and off in a random order: no order weighs on either
            first = coin.random() < 0.5
            for on in (first, not first):
                (observe.add if on else observe.remove)(metrics)
                switches.append((time.perf_counter(), on))
                if done.wait(phase):
                    break

    worker = Worker(engine, [Noop()], table_prefix=table_prefix, concurrency=8)
    switcher = threading.Thread(target=switch, daemon=True)
    cpu_since = time.process_time()
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
        cpu = time.process_time() - cpu_since
        observe.remove(metrics)
    try:
        if len(starts) < n:
            raise AssertionError(f"metrics drain: {n - len(starts)} of {n} messages not handled")
        own = own_cpu(metrics, sample[0])
    finally:
        unregister(metrics, registry)
    starts.sort()
    seconds = {True: 0.0, False: 0.0}
    handled = {True: 0, False: 0}
    for (begin, on), (end, _) in itertools.pairwise(switches[1:-1]):  # neither the first nor the last two
        seconds[on] += end - begin
        handled[on] += bisect.bisect_left(starts, end) - bisect.bisect_left(starts, begin)
    if not (seconds[True] and seconds[False]):
        raise AssertionError("metrics drain: too short to take turns; offer more messages")
    print(
        f"{'':10} (the metrics' own CPU time: {own * 1e6:.1f} µs per delivery, against {cpu / n * 1e6:.0f} µs"
        f" the worker process spent per delivery in the drain: {own / (cpu / n):.1%})",
        flush=True,
    )
    return handled[True] / seconds[True], handled[False] / seconds[False], []
