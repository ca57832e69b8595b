"""Every queue's counts, read once for every viewer: the overview and the queue pages' count panels.

A count reads every live message of a queue (``DelayedQueue.stats``): on a queue of a million messages that
is a scan of a second or more, too slow for each page load and each poll of each browser. So one read of all
queues at a time is shared: a page gets the last snapshot at once, and when that is older than ``max_age``
the page starts a new read in the background (stale-while-revalidate: one read in flight at most, whatever
the number of viewers). Only the first page after start waits for a read. Pages show when their snapshot was
read. Each read also feeds the charts (``Samples``).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from delayq.web._reads import QueueView, Where, overview
from delayq.web._samples import Samples

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """One read of every queue: the database's time of the read, and each queue's counts and flow."""

    taken_at: dt.datetime
    queues: list[QueueView]
    read_at: float
    """When it was read (monotonic seconds)."""

    def get(self, name: str) -> QueueView | None:
        return next((q for q in self.queues if q.name == name), None)


class Snapshots:
    """The last snapshot, and at most one read under way."""

    def __init__(
        self,
        where: Where,
        max_age: float,
        samples: Samples,
        read: Callable[[Where], tuple[dt.datetime, list[QueueView]]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.where, self.max_age, self.samples, self._read, self._clock = where, max_age, samples, read, clock
        self._last: Snapshot | None = None
        self._lock = threading.Lock()
        self._reading = False

    @classmethod
    def of(cls, where: Where, max_age: float, samples: Samples) -> Snapshots:
        """Snapshots whose reads take the arrival marks the charts' throughput needs."""
        return cls(where, max_age, samples, lambda w: overview(w, samples.below()))

    def latest(self) -> Snapshot:
        """The last snapshot (read now when there is none yet); a stale one starts a read in the background."""
        last = self._last
        if last is None:
            return self._refresh()
        if self._clock() - last.read_at > self.max_age:
            self.refresh_soon()
        return last

    def refresh_soon(self) -> None:
        """Start a read in the background, unless one is under way."""
        with self._lock:
            if self._reading:
                return
            self._reading = True
        threading.Thread(target=self._background, name="delayq-web-snapshot", daemon=True).start()

    def _background(self) -> None:
        try:
            self._refresh(started=True)
        except Exception:  # (the next page retries; the snapshot stays as it was)
            log.warning("delayq web: reading the queues' counts failed", exc_info=True)

    def _refresh(self, started: bool = False) -> Snapshot:
        if not started:
            with self._lock:
                self._reading = True
        try:
            taken_at, queues = self._read(self.where)
            snap = Snapshot(taken_at, queues, self._clock())
            self._last = snap
            self.samples.add(queues)
            return snap
        finally:
            with self._lock:
                self._reading = False
