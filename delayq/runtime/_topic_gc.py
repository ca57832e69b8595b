"""The worker's topic garbage collector: the topics of its ``TopicHandler``s, collected in bounded batches.

Every ``INTERVAL`` seconds (spread by a random share so that workers started together do not collect
together) it runs ``delayq.topics._gc.collect`` over each topic whose handlers allow it
(``TopicHandler.collect_garbage``), keeping what every group still needs and, per topic, messages younger
than the longest ``keep_for`` its handlers declare; at most ``MAX_BATCHES`` transactions per topic a
round. Many workers may collect at once: the database gives each partition to one of them at a time
(``SKIP LOCKED``, see ``delayq.topics._gc``). It survives anything: a failed round is logged, and the
next one waits longer (backoff).
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence

from sqlalchemy.engine import Engine

from delayq import observe
from delayq.clock import Clock
from delayq.runtime._jobs import describe
from delayq.topics._context import TopicContext
from delayq.topics._gc import BATCH, Collected, check_retention, collect
from delayq.topics.handler import TopicHandler

log = logging.getLogger("delayq.worker")

INTERVAL = 30.0
"""Seconds between two collection rounds of a worker."""
MAX_BATCHES = 100
"""Transactions (of ``BATCH`` messages at most) per topic in one round: a round's work is bounded."""


class TopicCollector:
    """Collects the garbage of a worker's topics, one round at a time (``round``) or on a thread (``loop``)."""

    def __init__(
        self,
        engine: Engine,
        handlers: Sequence[TopicHandler],
        *,
        table_prefix: str,
        schema: str | None,
        backoff: Callable[[int], float],
        clock: Clock | None = None,
        interval: float = INTERVAL,
    ) -> None:
        keep: dict[str, dt.timedelta] = {}
        for h in handlers:
            if h.collect_garbage:
                check_retention(h.keep_for, BATCH)
                keep[h.topic] = max(keep.get(h.topic, dt.timedelta(0)), h.keep_for)
        self.keep_for = keep
        """Per topic collected, the age below which its messages are kept."""
        self.ctx = TopicContext(engine, clock=clock, table_prefix=table_prefix, schema=schema, owner="Worker")
        self.interval = interval
        self._backoff = backoff
        self._errors = 0
        self.deleted = 0
        """Messages deleted so far."""

    def __bool__(self) -> bool:
        return bool(self.keep_for)

    def round(self) -> Collected:
        """Collect each topic once (bounded); raises what the database raised."""
        total = Collected()
        for topic, keep_for in self.keep_for.items():
            done = collect(self.ctx, topic, keep_for=keep_for, batch=BATCH, max_batches=MAX_BATCHES)
            if done.deleted:
                log.debug("topic %s: collected %d message(s)", topic, done.deleted)
                observe.count_topic("collected", topic, "", done.deleted)
            total += done
        self.deleted += total.deleted
        return total

    def next_wait(self) -> float:
        """Run a round, never raising; seconds until the next one (longer after failures)."""
        try:
            self.round()
            self._errors = 0
        except Exception as exc:  # the loop survives anything: the next round tries again
            self._errors += 1
            wait = max(self._backoff(self._errors), self.interval)
            log.warning("topic garbage collection: %s; next round in %.1fs", describe(exc), wait)
            return wait
        return self.interval * random.uniform(0.75, 1.25)

    def loop(self, stop: threading.Event) -> threading.Thread:
        """The collector's thread (not started): a first round soon, then one per interval, until ``stop``."""

        def run() -> None:
            wait = min(self.interval, 1.0) * random.random()
            while not stop.wait(wait):
                started = time.monotonic()
                wait = max(0.0, self.next_wait() - (time.monotonic() - started))

        return threading.Thread(target=run, name="delayq-topics-gc", daemon=True)
