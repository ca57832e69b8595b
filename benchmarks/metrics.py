"""What the Prometheus metrics cost a worker: its no-op drain rate with them on, beside the rate with them off.

Both are measured in the same run, one after the other (the order alternating between runs); the
figure's "ceiling" is the rate without metrics, so its ratio is the share of the drain rate that is
left with them on (issue 19 asks for at least 0.95).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from delayq.metrics import register, unregister

Drain = Callable[[], tuple[float, float | None, list[float]]]
_turn = itertools.count()


def overhead(drain: Drain) -> tuple[float, float, list[float]]:
    """(rate with metrics, rate without, no latencies) of two drains by ``drain``."""

    def with_metrics() -> float:
        registry = CollectorRegistry()
        metrics = register(registry)
        try:
            return drain()[0]
        finally:
            unregister(metrics, registry)

    if next(_turn) % 2:
        on, off = with_metrics(), drain()[0]
    else:
        off, on = drain()[0], with_metrics()
    return on, off, []
