"""The worker's shared background chores: the pruner of kept rows (``delayq.queue._prune``).

Every worker with queue handlers runs the loop; at most one process at a time prunes, the one whose claim
on the ``chores`` row took (the database decides, no leader election). A round that fails is logged and
tried again at the next one: the loop never ends while the worker runs.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import threading

import sqlalchemy as sa

from delayq.clock import Clock
from delayq.queue._prune import Pruner
from delayq.runtime._jobs import describe

log = logging.getLogger("delayq.worker")

PRUNE_INTERVAL = dt.timedelta(seconds=30)
"""How often a worker tries to prune (the first time after one interval, with a little jitter)."""


class PruneChore:
    """One worker's pruner loop; ``step`` is one round, ``start`` / ``stop`` run it on a thread."""

    def __init__(
        self,
        engine: sa.Engine,
        holder: str,
        *,
        table_prefix: str,
        schema: str | None,
        clock: Clock | None,
        interval: dt.timedelta = PRUNE_INTERVAL,
    ) -> None:
        self.interval = interval.total_seconds()
        self.pruner = Pruner(
            engine, holder, table_prefix=table_prefix, schema=schema, clock=clock, lease=max(interval * 4, interval)
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0
        """Rounds this process ran (it held the chore)."""
        self.deleted = 0
        """Rows it deleted so far."""

    def step(self) -> bool:
        """One round if this process holds the chore; False when it failed (logged, tried again next time)."""
        try:
            deleted = self.pruner.run_once()
        except Exception as exc:
            log.warning("pruner: %s; trying again in %.0fs", describe(exc), self.interval)
            return False
        if deleted is not None:
            self.rounds += 1
            self.deleted += deleted
            if deleted:
                log.info("pruner: deleted %d kept row(s) past their retention", deleted)
        return True

    def pause(self) -> float:
        """Seconds until the next round (the interval, give or take a tenth, so workers spread out)."""
        return self.interval * random.uniform(0.9, 1.1)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="delayq-pruner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.pause()):
            self.step()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
