"""The source protocol, and its queue implementation (the topic one is ``delayq.runtime._topics``).

A source is what the worker core claims work from: it claims up to n deliveries and hands each to
the driver's ``start`` (which starts its handler), records the outcome of a failed attempt (the one
decision, ``delayq._outcome``), and backs off on its own after a failed claim. Extending and giving
back are per kind: a queue's jobs are extended, acked and released together, one statement per queue
(``Jobs``: lock tokens); a topic's one by one through its ``Subscription`` (leases and epochs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from delayq._outcome import RetryAfter, after_failure
from delayq.errors import SchemaMissingError
from delayq.handler import Handler
from delayq.humanize import human
from delayq.queue import DelayedQueue
from delayq.runtime._jobs import Cancellable, Job, Jobs, cancels_among, describe

log = logging.getLogger("delayq.worker")

J_co = TypeVar("J_co", covariant=True)


class Source(Protocol[J_co]):
    """What the core claims from: a queue (``QueueSource``) or a topic subscription (``TopicConsumer``)."""

    @property
    def label(self) -> str:
        """How log lines name it."""
        ...

    def ready(self, now: float) -> bool:
        """Whether a claim may run at monotonic ``now`` (not backing off after a failed one)."""
        ...

    def running(self) -> int:
        """How many of its jobs the worker holds."""
        ...


StartQueueJob = Callable[["QueueSource", Job], Cancellable | None]
"""The driver's way to start a queue job's handler."""


class QueueSource:
    """One queue handler's source: claims by lock token, failures recorded on the delivery."""

    __slots__ = ("_errors", "_retry_at", "handler", "jobs", "queue", "unknown_claims")

    def __init__(self, handler: Handler, queue: DelayedQueue, jobs: Jobs) -> None:
        self.handler = handler
        self.queue = queue
        self.jobs = jobs
        """The worker's queue jobs (shared by its queues: one extend, ack or release statement per queue)."""
        self._errors = 0  # failed claims in a row
        self._retry_at = 0.0  # monotonic: no claim before
        self.unknown_claims: list[str] | None = None
        """When a list (the asyncio driver's): the tokens of claims whose reply never came (cancelled or failed
        in flight); the server may have committed them and no job holds their messages, so the driver gives
        them back by token."""

    def __repr__(self) -> str:
        return f"QueueSource({self.queue.name!r})"

    @property
    def label(self) -> str:
        return f"queue {self.queue.name}"

    def ready(self, now: float) -> bool:
        return now >= self._retry_at

    def running(self) -> int:
        return self.jobs.running()

    def claim(
        self, limit: int, start: StartQueueJob, guard: bool = True, *, first: bool = False, backoff: Backoff
    ) -> list[Job] | None:
        """Claim up to ``limit`` messages and hand each job to ``start``; None when the claim failed (logged,
        this queue backs off). With ``guard=False`` (or a missing schema at the ``first`` claim) it raises."""
        before = time.monotonic()
        try:
            deliveries = self.queue.try_poll_many(limit)
        except BaseException as exc:
            if self.unknown_claims is not None and (token := self.queue._claiming) is not None:
                self.unknown_claims.append(token)
            if not isinstance(exc, Exception) or not guard or (isinstance(exc, SchemaMissingError) and first):
                raise
            self._errors += 1
            self._retry_at = before + backoff(self._errors)
            log.warning(
                "queue %s: fetch failed (%s); next try in %.1fs", self.queue.name, describe(exc), backoff(self._errors)
            )
            return None
        self._errors = 0
        jobs = self.jobs.add_claimed(self.handler, self.queue, deliveries, before)  # each held before it starts
        for job in jobs:
            job.task = start(self, job)
        return jobs

    @staticmethod
    def record_failure(job: Job, exc: Exception) -> None:
        """Record what the one decision makes of a failed attempt: a retry after a delay, or the dead letters."""
        handler, delivery = job.handler, job.delivery
        outcome = after_failure(exc, delivery.attempts, handler.retry)
        try:
            if isinstance(outcome, RetryAfter):
                what = "retry requested" if outcome.requested else "failed"
                next_in = human(outcome.delay)
                log.info("%s: attempt %d %s, next in %s", delivery.label, delivery.attempts, what, next_in)
                held = delivery.retry(outcome.delay, outcome.error, exception=exc)
            else:
                # (the failure itself is logged once, with its traceback, on delayq.delivery)
                log.info("%s: attempt %d dead-lettered", delivery.label, delivery.attempts)
                held = delivery.dead_letter(outcome.reason, exception=exc)
            # (a lost lock the heartbeat found is logged already; a cancel is logged at INFO)
            if not held and not job.lost and not cancels_among(job.queue, [delivery]):
                log.warning("%s: lock lost before the outcome was recorded", delivery.label)
        except Exception as db_error:
            log.warning(
                "%s: could not record the outcome (%s); it will be delivered again",
                delivery.label,
                describe(db_error),
            )


Backoff = Callable[[int], float]
