"""The topic source: how the worker core runs ``TopicHandler``s, a ``Subscription`` per handler.

The core's fetch calls ``TopicConsumer.claim`` with its share of the free slots (a poll of that
many messages); the driver starts each ``TopicJob`` (on a thread: ``run``; on the event loop: a
task ending in ``finish``), and its outcome (ack, nack with the policy's delay, dead letter, or the
exactly-once transaction) is recorded when its handler ends.
A thread of its own (``TopicConsumers.loop``) keeps the subscriptions alive: it rebalances every
third of the lease duration, extends the visibility of deliveries whose handlers still run, and
advances the watermarks every few seconds. A poll and a rebalance of one subscription never
overlap, so the partitions a rebalance knows as busy are exact (it releases idle ones first: a
released partition fences out the acks of its deliveries in flight). Every step survives database
errors: it logs, backs off (per consumer) and goes on. A lost lease is logged and its delivery
dropped; the partition's new holder gets the message after its visibility timeout.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from delayq import observe
from delayq._outcome import Bury, after_failure
from delayq.clock import Clock
from delayq.errors import DelayqError, InvalidInputError
from delayq.handler import DeadLetter, Retry
from delayq.humanize import human
from delayq.runtime import _topic_observe as _observe
from delayq.runtime._jobs import Cancellable, describe, overdue, ran_past
from delayq.topics.delivery import LeaseLostError, TopicDelivery
from delayq.topics.handler import TopicHandler
from delayq.topics.names import dead_letter_topic
from delayq.topics.subscription import Subscription

log = logging.getLogger("delayq.worker")

TICK = 0.05
"""Seconds between two rounds of the maintenance loop (each round only acts on what is due)."""
WATERMARK_INTERVAL = 5.0
"""Seconds between two advances of a subscription's watermarks (polls advance those they visit)."""

Backoff = Callable[[int], float]


Start = Callable[["TopicConsumer", "TopicJob"], "Cancellable | None"]
"""The driver's way to start a topic job's handler (``claim``'s ``start``)."""


@dataclass(eq=False)
class TopicJob:
    """A delivery the worker holds, from the poll until its outcome is recorded."""

    delivery: TopicDelivery
    extend_at: float
    """Monotonic time of its next extension."""
    invisible_until: dt.datetime
    task: Cancellable | None = None
    finishing: bool = False
    """The handler returned: its outcome is being recorded (the maintenance loop leaves it alone)."""
    lost: bool = False
    """An extension found the lease or the delivery gone."""
    started_at: float = 0.0
    """Monotonic time of the poll (its handler starts at once: the worker polls for free slots only)."""
    started_on_clock: dt.datetime | None = None
    """The injected clock's time at the poll, if there is one."""
    overdue: bool = False
    """Its handler was found running past ``timeout`` (reported once)."""

    @property
    def label(self) -> str:
        d = self.delivery
        return f"{d.topic}[{d.partition}]@{d.offset} ({d.message_id!r}, attempt {d.attempts})"


class TopicConsumer:
    """One ``TopicHandler``, its ``Subscription`` and the deliveries the worker holds of it."""

    def __init__(self, handler: TopicHandler, sub: Subscription, clock: Clock | None, backoff: Backoff) -> None:
        self.handler = handler
        self.sub = sub
        self.clock = clock
        self._backoff = backoff
        self._lock = threading.Lock()  # guards _jobs
        self._jobs: dict[int, TopicJob] = {}
        self._polling = threading.Lock()  # a poll and a rebalance never overlap
        self.handled = 0
        """Deliveries finished (acked, nacked, dead-lettered, or found lost) so far."""
        self._poll_errors = 0
        self._poll_at = 0.0  # monotonic: no poll before
        self._errors = 0
        self._maintain_at = 0.0  # monotonic: no maintenance before (after an error)
        self._rebalance_at = 0.0
        self._rebalanced_on_clock: dt.datetime | None = None
        self._watermarks_at = 0.0
        self._rebalance_every = handler.lease_duration.total_seconds() / 3
        self.on_tasks = False
        """Driven by an ``AsyncWorker``: polls and upkeep are greenlets of one thread, so a rebalance never
        waits for a poll (it would block the loop the poll needs: it tries at the next round), and handlers
        past their timeout are left to the worker, which cancels them."""

    def __repr__(self) -> str:
        return f"TopicConsumer({self.sub.topic!r}, group={self.sub.group!r}, subscriber={self.sub.name!r})"

    @property
    def label(self) -> str:
        return f"topic {self.sub.topic} (group {self.sub.group})"

    def running(self) -> int:
        """Deliveries held: handlers running or recording their outcome."""
        with self._lock:
            return len(self._jobs)

    def stuck(self) -> int:
        """Handlers running past the handler's ``timeout``."""
        with self._lock:
            return sum(1 for x in self._jobs.values() if x.overdue and not x.finishing)

    def newly_overdue(self) -> list[TopicJob]:
        """The deliveries whose handlers now run past the handler's ``timeout``, each returned once."""
        timeout = self.handler.timeout
        if timeout is None:
            return []
        with self._lock:
            found = [
                x
                for x in self._jobs.values()
                if not (x.overdue or x.finishing) and ran_past(timeout, x.started_at, x.started_on_clock, self.clock)
            ]
            for x in found:
                x.overdue = True
        return found

    def holding(self) -> list[TopicJob]:
        """The deliveries held now."""
        with self._lock:
            return list(self._jobs.values())

    def _report_overdue(self, now: float) -> None:
        """Warn of (and count) each handler found running past its ``timeout``, once."""
        if self.on_tasks:
            return
        for x in self.newly_overdue():
            assert self.handler.timeout is not None
            overdue(x.label, now - x.started_at, self.handler.timeout)
            observe.count("overdue", self.sub.topic)

    def ready(self, now: float) -> bool:
        """Whether a poll may run now (not backing off after a failed one)."""
        return now >= self._poll_at

    # -- the fetch loop's side ------------------------------------------------------------------
    def claim(self, limit: int, start: Start, guard: bool = True) -> list[TopicJob] | None:
        """Poll up to ``limit`` messages and hand each to ``start`` (the driver starts its handler: on a
        thread, ``run``; on the event loop, a task that ends in ``finish``); None when the poll failed
        (logged, this consumer backs off). With ``guard=False`` a failed poll raises."""
        if not self._polling.acquire(blocking=False):  # a rebalance runs: poll at the next round
            return []
        try:
            before = time.monotonic()
            try:
                deliveries = self.sub.poll(limit)
            except Exception as exc:
                if not guard:
                    raise
                self._poll_errors += 1
                self._poll_at = before + self._backoff(self._poll_errors)
                log.warning(
                    "%s: poll failed (%s); next try in %.1fs", self.label, describe(exc), self._poll_at - before
                )
                return None
            self._poll_errors = 0
            vt = self.handler.visibility_timeout.total_seconds()
            jobs = []
            for d in deliveries:
                job = TopicJob(d, extend_at=before + vt / 2, invisible_until=d.invisible_until, started_at=before)
                job.started_on_clock = None if self.clock is None else self.clock.now()
                with self._lock:
                    self._jobs[id(job)] = job
                _observe.started(self, job)
                job.task = start(self, job)
                jobs.append(job)
            return jobs
        finally:
            self._polling.release()

    # -- one delivery ---------------------------------------------------------------------------
    def run(self, job: TopicJob, done: Callable[[], None]) -> None:
        d, handler = job.delivery, self.handler
        log.debug("%s: handling", job.label)
        begun = not handler.transactional

        def in_transaction(conn: Connection) -> None:
            nonlocal begun
            begun = True  # from here on it is an attempt
            handler.handle(d, conn)

        try:
            try:
                with _observe.running(job):
                    if handler.transactional:
                        self.sub.handle_exactly_once(d, in_transaction)
                    else:
                        handler.handle(d)
            except LeaseLostError:
                job.finishing = True
                _observe.outcome(self, job, "lease_lost", None)
                log.warning("%s: lease lost while handling; its writes were rolled back", job.label)
                return
            except Exception as exc:  # whatever the handler raised is a failed attempt, or Retry / DeadLetter
                job.finishing = True
                if begun:
                    self.record_failure(job, exc)
                else:  # no connection for its transaction: the handler did not run, give it back
                    log.warning("%s: its transaction could not begin (%s)", job.label, describe(exc))
                    self._release([job], "the handler's transaction could not begin")
                return
            job.finishing = True
            if not handler.transactional:
                self._ack(job)
            else:  # acked in its transaction
                _observe.outcome(self, job, "acked", None)
        finally:
            self.forget(job, done)

    def finish(self, job: TopicJob, error: Exception | None, done: Callable[[], None]) -> None:
        """Record the outcome of a handler that returned (``error`` None: ack) or raised (nack or dead letter,
        as ``decide`` says), then forget the delivery; never raises (failures are logged)."""
        try:
            job.finishing = True
            if error is None:
                self._ack(job)
            else:
                self.record_failure(job, error)
        finally:
            self.forget(job, done)

    def give_back(self, job: TopicJob, done: Callable[[], None], why: str) -> None:
        """Release a delivery whose handler was stopped (the attempt not counted), then forget it."""
        try:
            job.finishing = True
            self._release([job], why)
        finally:
            self.forget(job, done)

    def forget(self, job: TopicJob, done: Callable[[], None]) -> None:
        """Forget a job whose outcome is recorded (or lost), and call ``done``."""
        job.finishing = True
        with self._lock:
            if self._jobs.pop(id(job), None) is None:
                return  # forgotten already
            self.handled += 1
        _observe.finished(self, job)
        done()

    def _ack(self, job: TopicJob) -> None:
        try:
            if self.sub.ack(job.delivery):
                _observe.outcome(self, job, "acked", None)
                log.debug("%s: handled", job.label)
            else:
                _observe.outcome(self, job, "lease_lost", None)
                log.warning("%s: lease lost before the ack; the partition's holder gets it again", job.label)
        except Exception as exc:  # (delayq retried transient errors already)
            log.warning("%s: could not ack (%s); it will be delivered again", job.label, describe(exc))

    def record_failure(self, job: TopicJob, exc: Exception) -> None:
        """Record what ``decide`` makes of a failed attempt: a nack with a delay, or the dead-letter topic."""
        d = job.delivery
        outcome = after_failure(exc, d.attempts, self.handler.retry)
        traceback = None if isinstance(exc, (Retry, DeadLetter)) else exc
        try:
            if isinstance(outcome, Bury):
                dlq = dead_letter_topic(d.topic)
                log.warning("%s: failed, moved to %s: %s", job.label, dlq, outcome.reason, exc_info=traceback)
                recorded = self.sub.fail(d, outcome.reason)
            else:
                log.log(
                    logging.INFO if traceback is None else logging.WARNING,
                    "%s: %s, next in %s: %s",
                    job.label,
                    "retry requested" if outcome.requested else "failed",
                    human(outcome.delay),
                    outcome.error,
                    exc_info=traceback,
                )
                recorded = self.sub.nack(d, outcome.delay, outcome.error)
            _observe.outcome(
                self, job, ("dead" if isinstance(outcome, Bury) else "nacked") if recorded else "lease_lost", exc
            )
            if not recorded:
                log.warning("%s: lease lost before the outcome was recorded", job.label)
        except Exception as db_error:
            log.warning(
                "%s: could not record the outcome (%s); it will be delivered again", job.label, describe(db_error)
            )

    # -- the maintenance loop's side ------------------------------------------------------------
    def maintain(self, wake: Callable[[], None]) -> None:
        """Do what is due: rebalance, extend long handlers' deliveries, advance the watermarks.
        Never raises: a failure is logged and this consumer's next round waits (backoff)."""
        now = time.monotonic()
        if now < self._maintain_at:
            return
        try:
            if self._rebalance_due(now):
                self.rebalance(wake)
            self._extend_due(now)
            self._report_overdue(now)
            if now >= self._watermarks_at:
                self.sub.advance_watermarks()
                self._watermarks_at = now + WATERMARK_INTERVAL
            self._errors = 0
        except Exception as exc:
            self._errors += 1
            self._maintain_at = now + self._backoff(self._errors)
            unexpected = not isinstance(exc, (DelayqError, DBAPIError))  # a bug: show where
            log.warning(
                "%s: %s; going on in %.1fs", self.label, describe(exc), self._maintain_at - now, exc_info=unexpected
            )

    def rebalance(self, wake: Callable[[], None] = lambda: None) -> None:
        """Heartbeat, renew the leases, hold the fair share (busy partitions released last); ``wake``
        when partitions were gained."""
        if not self._polling.acquire(blocking=not self.on_tasks):
            return  # a poll runs (greenlets): at the next round
        try:
            with self._lock:
                busy = {x.delivery.partition for x in self._jobs.values()}
            before = set(self.sub.held)
            held = set(self.sub.rebalance(busy=busy))
        finally:
            self._polling.release()
        self._rebalance_at = time.monotonic() + self._rebalance_every
        self._rebalanced_on_clock = None if self.clock is None else self.clock.now()
        if held != before:
            _observe.rebalanced(self)
            log.info("%s: %s holds partitions %s", self.label, self.sub.name, sorted(held) or "none")
        if held - before:
            wake()

    def _rebalance_due(self, now: float) -> bool:
        if now >= self._rebalance_at:
            return True
        # On an injected clock the leases expire in that clock's time, which tests move by hand.
        last, every = self._rebalanced_on_clock, self.handler.lease_duration / 3
        return self.clock is not None and last is not None and self.clock.now() >= last + every

    def _extend_due(self, now: float) -> None:
        vt = self.handler.visibility_timeout
        clock_now = None if self.clock is None else self.clock.now()
        with self._lock:
            due = [
                x
                for x in self._jobs.values()
                if not (x.finishing or x.lost)
                and (now >= x.extend_at or (clock_now is not None and clock_now >= x.invisible_until - vt / 2))
            ]
        for x in due:
            before = time.monotonic()
            until = self.sub.extend(x.delivery, vt)
            if until is not None:
                x.extend_at, x.invisible_until = before + vt.total_seconds() / 2, until
            elif not x.finishing:  # (an outcome recorded meanwhile ends the delivery too)
                x.lost = True
                log.warning("%s: lease or delivery lost while handling; another subscriber may get it", x.label)

    # -- shutdown -------------------------------------------------------------------------------
    def give_back_unstarted(self) -> None:
        """Keep the handlers not yet started from starting, and give their messages back: deliverable
        again at once for the partition's next holder, the attempt not counted."""
        with self._lock:
            unstarted = [x for x in self._jobs.values() if x.task is not None and x.task.cancel()]
            for x in unstarted:
                self._jobs.pop(id(x), None)
        self._release(unstarted, "never started")

    def _release(self, jobs: list[TopicJob], why: str) -> None:
        released = 0
        for x in jobs:
            try:
                released += self.sub.release(x.delivery)
            except Exception as exc:
                log.warning("%s: could not give it back (%s); it returns after its timeout", x.label, describe(exc))
        if released:
            log.info("%s: released %d message(s) (%s)", self.label, released, why)

    def keep(self, at_once: bool = False) -> bool:
        """One round of a stopped worker's upkeep: while handlers still run, hold only their partitions
        (leases renewed, the rest released: ``at_once`` on the first round) and extend their deliveries;
        leave the group once none runs. True once left. Never raises."""
        if not self.running():
            self.leave()
            return True
        now = time.monotonic()
        if now < self._maintain_at:
            return False
        try:
            if at_once or self._rebalance_due(now):
                self._hold_busy()
            self._extend_due(now)
            self._report_overdue(now)
            self._errors = 0
        except Exception as exc:
            self._errors += 1
            self._maintain_at = now + self._backoff(self._errors)
            log.warning("%s: %s; going on in %.1fs", self.label, describe(exc), self._maintain_at - now)
        return False

    def _hold_busy(self) -> None:
        with self._polling:
            with self._lock:
                busy = {x.delivery.partition for x in self._jobs.values()}
            self.sub.rebalance(busy=busy, leaving=True)
        self._rebalance_at = time.monotonic() + self._rebalance_every
        self._rebalanced_on_clock = None if self.clock is None else self.clock.now()

    def leave(self) -> None:
        """Advance the watermarks, then leave the group: the others take the partitions at once."""
        for step in (self.sub.advance_watermarks, self.sub.close):
            try:
                step()
            except Exception as exc:
                log.warning("%s: %s on leaving: %s", self.label, step.__name__, describe(exc))
        log.info("%s: %s left the group", self.label, self.sub.name)


class TopicConsumers:
    """The topic side of a ``Worker``: a ``TopicConsumer`` per ``TopicHandler`` and their maintenance loop."""

    def __init__(
        self,
        engine: Engine,
        handlers: Sequence[TopicHandler],
        worker: str,
        *,
        clock: Clock | None,
        table_prefix: str,
        schema: str | None,
        backoff: Backoff,
    ) -> None:
        self.consumers: list[TopicConsumer] = []
        seen: set[tuple[str, str]] = set()
        for h in handlers:
            for attr in ("topic", "group"):
                if not isinstance(getattr(h, attr, None), str):
                    raise InvalidInputError(f"{type(h).__name__} must set the class attribute `{attr}`")
            if (h.topic, h.group) in seen:
                raise InvalidInputError(f"two handlers for topic {h.topic!r} in group {h.group!r}")
            seen.add((h.topic, h.group))
            if h.schedules:
                raise InvalidInputError(f"{type(h).__name__}: a topic handler cannot declare schedules")
            sub = Subscription(
                engine,
                h.topic,
                h.group,
                h.subscriber_name(worker),
                start=h.start,
                lease_duration=h.lease_duration,
                visibility_timeout=h.visibility_timeout,
                max_attempts=h.retry.max_attempts,
                strict=h.strict,
                serializer=h.serializer,
                clock=clock,
                table_prefix=table_prefix,
                schema=schema,
            )
            self.consumers.append(TopicConsumer(h, sub, clock, backoff))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._keeper: threading.Thread | None = None
        self._unkeep = threading.Event()  # set: the keeper ends (the worker runs again), leaving nobody

    def __bool__(self) -> bool:
        return bool(self.consumers)

    def __str__(self) -> str:
        return ", ".join(f"{c.sub.topic} (group {c.sub.group})" for c in self.consumers)

    def running(self) -> int:
        return sum(c.running() for c in self.consumers)

    def stuck(self) -> int:
        return sum(c.stuck() for c in self.consumers)

    @property
    def handled(self) -> int:
        return sum(c.handled for c in self.consumers)

    def loop(self, wake: Callable[[], None]) -> threading.Thread:
        """The maintenance thread (not started): rebalances, extensions, watermarks, until ``stop``. It takes
        over from a keeper still holding deliveries of a previous run."""
        self._stop.clear()
        self._unkeep.set()
        if self._keeper is not None:
            self._keeper.join(30)
            self._keeper = None

        def run() -> None:
            while not self._stop.is_set():
                for c in self.consumers:
                    if self._stop.is_set():
                        break
                    c.maintain(wake)
                self._stop.wait(TICK)

        self._thread = threading.Thread(target=run, name="delayq-topics", daemon=True)
        return self._thread

    def rebalance(self) -> None:
        """Join the groups and take the partitions now (``Worker.run_once``); raises on failure."""
        for c in self.consumers:
            c.rebalance()

    def give_back_unstarted(self) -> None:
        for c in self.consumers:
            c.give_back_unstarted()

    def stop(self) -> None:
        """Stop the maintenance loop; consumers with no handler running advance their watermarks and leave
        their groups now. Those with handlers still running keep their messages (never given back while
        the handler's thread lives): a thread of its own holds their partitions' leases and extends their
        deliveries until the handlers return and record their outcomes, then leaves (``keep``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        kept = [c for c in self.consumers if not c.keep(at_once=True)]
        if kept:
            self._unkeep.clear()
            self._keeper = threading.Thread(target=self._keep, args=(kept,), name="delayq-topics-keeper", daemon=True)
            self._keeper.start()

    def _keep(self, kept: list[TopicConsumer]) -> None:
        while kept and not self._unkeep.wait(TICK):
            kept = [c for c in kept if not c.keep()]
