"""The overview's charts: what this dashboard process saw of each queue over the last hour, kept in memory.

Each overview read adds a sample per queue (at most one per ``every`` seconds): the backlog (ready + expired
locks), the lag of the oldest due message, and throughput as the change of the counts between two samples
(messages that left the live states: done, cancelled or dead-lettered; an estimate, since offers arriving
between two samples offset it). Nothing is stored: a restarted dashboard starts its charts empty.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from delayq.web._reads import QueueView

WINDOW_S = 3600.0
"""How far back the charts go."""


@dataclass(frozen=True)
class Sample:
    at: float
    """Seconds since the epoch (the dashboard's clock: only the chart's x axis)."""
    backlog: int
    lag_s: float
    done_per_s: float | None
    dead: int


class Samples:
    """Per queue, the samples of the last ``WINDOW_S`` seconds."""

    def __init__(self, every: float = 5.0, clock: Callable[[], float] = time.time) -> None:
        self.every, self.clock = every, clock
        self._series: dict[str, deque[Sample]] = {}
        self._totals: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, views: list[QueueView]) -> None:
        now = self.clock()
        with self._lock:
            for v in views:
                s = v.stats
                series = self._series.setdefault(v.name, deque())
                if series and now - series[-1].at < self.every:
                    continue
                total = s.ready + s.scheduled + s.in_flight + s.expired_locks
                done = None
                if series and v.name in self._totals:
                    gone = self._totals[v.name] - total  # (what left minus what arrived)
                    done = max(gone, 0) / max(now - series[-1].at, 1e-3)
                self._totals[v.name] = total
                lag = 0.0 if s.oldest_due_age is None else s.oldest_due_age.total_seconds()
                series.append(Sample(now, s.ready + s.expired_locks, lag, done, s.dead))
                while series and now - series[0].at > WINDOW_S:
                    series.popleft()

    def series(self, name: str) -> dict[str, list[list[float | None]]]:
        """A queue's chart data: ``[t, value]`` pairs per measure."""
        with self._lock:
            points = list(self._series.get(name, ()))
        return {
            "backlog": [[p.at, p.backlog] for p in points],
            "lag_s": [[p.at, p.lag_s] for p in points],
            "done_per_s": [[p.at, p.done_per_s] for p in points if p.done_per_s is not None],
        }
