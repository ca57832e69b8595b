"""The overview's charts: what this dashboard process saw of each queue over the last hour, kept in memory.

Each read of the queues adds a sample per queue (at most one per ``every`` seconds): the backlog (ready +
expired locks), the lag of the oldest due message, and the throughput since the sample before, as
``delayq top`` computes it (``browse.arrival_marks``): messages arrived per second, and messages that left
per second (done, cancelled or dead-lettered). Nothing is stored: a restarted dashboard starts its charts empty.
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
    in_per_s: float | None
    out_per_s: float | None


class Samples:
    """Per queue, the samples of the last ``WINDOW_S`` seconds."""

    def __init__(self, every: float = 5.0, clock: Callable[[], float] = time.time) -> None:
        self.every, self.clock = every, clock
        self._series: dict[str, deque[Sample]] = {}
        self._marks: dict[str, tuple[int, int]] = {}  # queue -> (highest id, live count) at its last sample
        self._lock = threading.Lock()

    def below(self) -> dict[str, int]:
        """Per queue, the highest id its last sample saw (what the next read's arrival marks compare with)."""
        with self._lock:
            return {name: top for name, (top, _) in self._marks.items()}

    def add(self, views: list[QueueView]) -> None:
        now = self.clock()
        with self._lock:
            for v in views:
                s = v.stats
                series = self._series.setdefault(v.name, deque())
                if series and now - series[-1].at < self.every:
                    continue  # (its marks stay: the next sample's rates span both reads)
                arrived = left = None
                if v.marks is not None:
                    n, highest, old = v.marks
                    mark = self._marks.get(v.name)
                    if mark is not None and series:
                        elapsed = max(now - series[-1].at, 1e-3)
                        arrived, left = (n - old) / elapsed, max(mark[1] - old, 0) / elapsed
                    self._marks[v.name] = (max(highest or 0, mark[0] if mark else 0), n)
                lag = 0.0 if s.oldest_due_age is None else s.oldest_due_age.total_seconds()
                series.append(Sample(now, s.ready + s.expired_locks, lag, arrived, left))
                while series and now - series[0].at > WINDOW_S:
                    series.popleft()

    def series(self, name: str) -> dict[str, list[list[float | None]]]:
        """A queue's chart data: ``[t, value]`` pairs per measure."""
        with self._lock:
            points = list(self._series.get(name, ()))
        return {
            "backlog": [[p.at, p.backlog] for p in points],
            "lag_s": [[p.at, p.lag_s] for p in points],
            "in_per_s": [[p.at, p.in_per_s] for p in points if p.in_per_s is not None],
            "out_per_s": [[p.at, p.out_per_s] for p in points if p.out_per_s is not None],
        }
