"""The queue jobs a worker holds: their heartbeats, their acks, their release.

A job is one delivery the worker holds (a topic's is a ``TopicJob``, ``delayq.runtime._topics``):
from the claim until the message's outcome is recorded: while its handler runs, and
after the handler returned until the ack deletes the message. The heartbeat extends the locks of
the jobs due, with one ``extend_many`` per queue; acks go out with one ``ack_many`` per queue.
Neither ever waits on a row lock that another transaction holds: such a row is tried again at
the next round, while the lock is still held. Timers are ``time.monotonic()``; with an injected
clock the lock's expiry in that clock's time counts too.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from delayq.clock import Clock
from delayq.handler import Handler
from delayq.humanize import human
from delayq.messages import Delivery
from delayq.queue import DelayedQueue

log = logging.getLogger("delayq.worker")

CANCELLED_LINE = "%s: cancelled while its handler ran; nothing of it is recorded"
"""The INFO line of a job whose message ``cancel_job`` took while its handler ran, however its worker heard of it."""


class Cancellable(Protocol):
    """A driver's handle on a started job: ``cancel()`` keeps it from starting, False once it has started."""

    def cancel(self) -> bool: ...


@dataclass(eq=False, slots=True)
class Job:
    """A delivery the worker holds, from the claim until its outcome is recorded."""

    handler: Handler
    queue: DelayedQueue
    delivery: Delivery
    extend_at: float
    """Monotonic time of its next heartbeat."""
    valid_until: float
    """Monotonic time until which the lock surely holds (from before the claim or the last extension)."""
    task: Cancellable | None = None
    done: bool = False
    """The handler returned: awaiting the ack."""
    acking: bool = False
    """An ack of it is under way (the heartbeat leaves it alone meanwhile)."""
    lost: bool = False
    """The lock is gone: the heartbeat found it so, or the message was cancelled (its handler is told)."""
    told: bool = False
    """The driver was given it as lost while its handler runs (``lost_running``), to stop the handler."""
    started_at: float = 0.0
    """Monotonic time of the claim (its handler starts at once: the worker claims for free slots only)."""
    started_on_clock: dt.datetime | None = None
    """The injected clock's time at the claim, if there is one."""
    overdue: bool = False
    """Its handler was found running past ``Handler.timeout`` (reported once)."""


EARLY_CANCELS = 1024
"""How many cancels of messages a worker did not hold it remembers, for a claim whose reply comes late."""


class Jobs:
    """The jobs of one worker; thread-safe."""

    def __init__(self, clock: Clock | None) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._running = 0  # jobs whose handler has not returned (kept, not counted: asked per freed slot)
        # Cancels heard for messages this worker did not hold (yet): a claim's reply may come after the
        # notification of a cancel that followed its commit. Ids are never reused; the newest are kept.
        self._early_cancels: dict[int, None] = {}
        self.handled = 0
        """Deliveries finished (acked, retried, dead-lettered, or found lost) so far."""

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def add_claimed(
        self, handler: Handler, queue: DelayedQueue, deliveries: Sequence[Delivery], claimed_at: float
    ) -> list[Job]:
        """The jobs on the deliveries of one claim, sent at monotonic time ``claimed_at``: one lock and one
        clock reading per claim, not per message."""
        vt = handler.visibility_timeout.total_seconds()
        extend_at, valid_until = claimed_at + vt / 2, claimed_at + vt
        on_clock = None if self.clock is None else self.clock.now()
        jobs = [
            Job(
                handler,
                queue,
                delivery,
                extend_at,
                valid_until,
                started_at=claimed_at,
                started_on_clock=on_clock,
            )
            for delivery in deliveries
        ]
        with self._lock:
            held = self._jobs
            for job in jobs:
                held[id(job)] = job
            self._running += len(jobs)
            early = [d.id for d in deliveries if d.id in self._early_cancels] if self._early_cancels else []
        if early:
            self.cancelled(early)  # cancelled between the claim's commit and now
        return jobs

    def running(self) -> int:
        """How many handlers run."""
        return self._running

    def finish(self, job: Job, to_ack: bool) -> None:
        """The handler returned; ``to_ack`` when its message awaits the ack (else its outcome is recorded)."""
        with self._lock:
            if id(job) not in self._jobs:  # released by a shutdown meanwhile
                return
            self._running -= 1
            if to_ack and not job.lost:
                job.done = True
            else:
                del self._jobs[id(job)]
                self.handled += 1

    def cancelled(self, ids: Iterable[int]) -> int:
        """The messages ``ids`` were cancelled (a notification): their jobs are lost, their handlers told
        (``Delivery.cancelled``); a handled one awaiting its ack is forgotten. How many jobs this worker held."""
        wanted = set(ids)
        with self._lock:
            found = [x for x in self._jobs.values() if x.delivery.id in wanted and not x.lost and not x.acking]
            for x in found:
                x.lost = True
                if x.done:  # handled, and nothing left to ack
                    del self._jobs[id(x)]
                    self.handled += 1
            for msg_id in wanted - {x.delivery.id for x in found}:
                self._early_cancels[msg_id] = None
            while len(self._early_cancels) > EARLY_CANCELS:
                del self._early_cancels[next(iter(self._early_cancels))]
        for x in found:
            x.delivery._cancel()
            log.info(CANCELLED_LINE, x.delivery.label)
        return len(found)

    def lost_running(self) -> list[Job]:
        """The jobs whose handlers still run although their lock is gone (cancelled, replaced, or expired and
        taken), each returned once: the asyncio driver cancels their tasks."""
        with self._lock:
            found = [x for x in self._jobs.values() if x.lost and not x.done and not x.told]
            for x in found:
                x.told = True
        return found

    def cancel_unstarted(self) -> list[Job]:
        """The jobs whose handlers had not started, now kept from starting."""
        with self._lock:
            jobs = list(self._jobs.values())
        return [x for x in jobs if not x.done and x.task is not None and x.task.cancel()]

    def newly_overdue(self) -> list[Job]:
        """The jobs whose handlers now run past their ``timeout``, each returned once."""
        with self._lock:
            found = [
                x
                for x in self._jobs.values()
                if not (x.done or x.overdue)
                and ran_past(x.handler.timeout, x.started_at, x.started_on_clock, self.clock)
            ]
            for x in found:
                x.overdue = True
        return found

    def stuck(self) -> int:
        """How many handlers run past their ``timeout``."""
        with self._lock:
            return sum(1 for x in self._jobs.values() if x.overdue and not x.done)

    def still_running(self) -> list[Job]:
        with self._lock:
            return [x for x in self._jobs.values() if not x.done]

    def clear(self) -> int:
        """Forget every job (their locks run out by themselves); how many there were."""
        with self._lock:
            left = len(self._jobs)
            self._jobs.clear()
            self._running = 0
            return left

    def forget_handled(self) -> int:
        """Forget the jobs whose handlers returned but whose acks did not go out (their locks run out by
        themselves); how many. The jobs of running handlers stay: their locks are extended until they return."""
        with self._lock:
            handled = [k for k, x in self._jobs.items() if x.done]
            for k in handled:
                del self._jobs[k]
            return len(handled)

    # -- acks -----------------------------------------------------------------------------------
    def flush_acks(self) -> list[DelayedQueue]:
        """Ack the handled deliveries: one statement per queue, never waiting on a row lock; the queues
        whose ack statement committed.

        What an ack could not delete this time (its row locked by another transaction, or the
        statement failed) is tried again at the next flush, while the lock still holds.
        """
        with self._lock:
            pending = [x for x in self._jobs.values() if x.done and not x.acking and not x.lost]
            for x in pending:
                x.acking = True
        acked: list[DelayedQueue] = []
        for queue, group in by_queue(pending):
            try:
                self._ack(queue, group)
                acked.append(queue)
            except Exception as exc:
                log.warning(
                    "queue %s: could not ack %d message(s) (%s); trying again at the next flush",
                    queue.name,
                    len(group),
                    describe(exc),
                )
                self._forget_expired(group)
            finally:
                with self._lock:
                    for x in group:
                        x.acking = False
        return acked

    def _ack(self, queue: DelayedQueue, group: list[Job]) -> None:
        acked = queue.ack_many([x.delivery for x in group], skip_locked=True)
        gone = group
        if acked < len(group):  # which are still ours (row locked elsewhere), which are gone?
            _, lost = self._extend(queue, group)
            lost_ids = {id(d) for d in lost}
            gone = [x for x in group if id(x.delivery) in lost_ids]
            lost_count = len(gone) - acked
            if lost_count > 0:  # (an acked delivery has no cancelled record: it counts in neither)
                lost_count -= len(cancels_among(queue, [x.delivery for x in gone]))
            if lost_count > 0:
                log.warning(
                    "queue %s: %d lock(s) lost before the ack; those messages come again", queue.name, lost_count
                )
            if len(gone) < len(group):
                log.info("queue %s: %d message(s) locked elsewhere; acked later", queue.name, len(group) - len(gone))
        with self._lock:
            for x in gone:
                if self._jobs.pop(id(x), None) is not None:
                    self.handled += 1

    def _forget_expired(self, group: list[Job]) -> None:
        """Stop trying to ack deliveries whose locks may have expired: they are delivered again."""
        expired = [x for x in group if not self._lock_valid(x)]
        with self._lock:
            for x in expired:
                self._jobs.pop(id(x), None)
        for x in expired:
            log.warning("%s: not acked before its lock expired; it will be delivered again", x.delivery.label)

    # -- heartbeat ------------------------------------------------------------------------------
    def beat(self) -> bool:
        """Extend the locks due: one ``extend_many`` per queue. False when one of them failed."""
        now = time.monotonic()
        with self._lock:
            due = [x for x in self._jobs.values() if not x.acking and not x.lost and self._extend_due(x, now)]
        ok = True
        for queue, group in by_queue(due):
            try:
                self._extend(queue, group)
            except Exception as exc:
                ok = False
                log.warning("queue %s: could not extend %d lock(s): %s", queue.name, len(group), describe(exc))
        return ok

    def _extend(self, queue: DelayedQueue, group: list[Job]) -> tuple[list[Delivery], list[Delivery]]:
        """Extend the locks of one queue's ``group``; note which were extended and which were lost.

        A delivery in neither list has its row locked by another transaction: it stays due and is
        tried again at the next beat. A lost lock is logged once.
        """
        vt = group[0].handler.visibility_timeout
        before = time.monotonic()
        extended, lost = queue.extend_many([x.delivery for x in group], vt)
        of = {id(x.delivery): x for x in group}
        newly_lost = []
        with self._lock:
            for d in extended:
                of[id(d)].extend_at = before + vt.total_seconds() / 2
                of[id(d)].valid_until = before + vt.total_seconds()
            for d in lost:
                x = of[id(d)]
                if x.acking or x.lost or id(x) not in self._jobs:
                    continue  # acked meanwhile, or reported already
                x.lost = True
                newly_lost.append(x)
                if x.done:  # handled, and never to be acked
                    del self._jobs[id(x)]
                    self.handled += 1
        for x in newly_lost:
            x.delivery._cancel()  # its handler's work no longer counts
        cancelled = cancels_among(queue, [x.delivery for x in newly_lost])
        for x in newly_lost:
            if x.delivery.id not in cancelled:
                log.warning(
                    "%s: lock lost (the message replaced, rescheduled, deleted, or taken after expiry)",
                    x.delivery.label,
                )
        return extended, lost

    def _extend_due(self, job: Job, now: float) -> bool:
        if now >= job.extend_at:
            return True
        # On an injected clock the lock's expiry is in that clock's time, which tests move by hand.
        half = job.handler.visibility_timeout / 2
        return self.clock is not None and self.clock.now() >= job.delivery.locked_until - half

    def _lock_valid(self, job: Job) -> bool:
        if time.monotonic() >= job.valid_until:
            return False
        return self.clock is None or self.clock.now() < job.delivery.locked_until

    # -- release --------------------------------------------------------------------------------
    def release(self, jobs: list[Job], why: str) -> None:
        """Give messages back, due again at once, the attempt not counted: one statement per queue."""
        with self._lock:
            for x in jobs:
                if self._jobs.pop(id(x), None) is not None and not x.done:
                    self._running -= 1
        for queue, group in by_queue(jobs):
            try:
                queue.release([x.delivery for x in group])
                log.info("queue %s: released %d message(s) (%s)", queue.name, len(group), why)
            except Exception as exc:
                log.warning(
                    "queue %s: could not release %d message(s) (%s); they return after their timeout",
                    queue.name,
                    len(group),
                    describe(exc),
                )


def cancels_among(queue: DelayedQueue, deliveries: Sequence[Delivery]) -> set[int]:
    """The ids of ``deliveries``, found without their lock, whose message a ``cancel_job`` took while they were held,
    each logged at INFO (``CANCELLED_LINE``, as when a worker hears the cancel by NOTIFY); the others' locks were
    lost otherwise, which the caller warns of. One read, only when a lock was found gone; a failed one finds none."""
    if not deliveries:
        return set()
    try:
        cancelled = queue._cancelled_among(deliveries)
    except Exception as exc:
        log.info("queue %s: could not read which lost locks were cancels (%s)", queue.name, describe(exc))
        return set()
    for d in deliveries:
        if d.id in cancelled:
            log.info(CANCELLED_LINE, d.label)
    return cancelled


def by_queue(jobs: Iterable[Job]) -> list[tuple[DelayedQueue, list[Job]]]:
    """The jobs grouped by queue, for one statement per queue."""
    groups: dict[str, tuple[DelayedQueue, list[Job]]] = {}
    for x in jobs:
        groups.setdefault(x.queue.name, (x.queue, []))[1].append(x)
    return list(groups.values())


def ran_past(
    timeout: dt.timedelta | None, started_at: float, started_on_clock: dt.datetime | None, clock: Clock | None
) -> bool:
    """Whether a handler started at monotonic ``started_at`` has run past ``timeout`` (None: never); on an
    injected clock, its run time counts in that clock's time too (tests move it by hand)."""
    if timeout is None:
        return False
    if time.monotonic() - started_at > timeout.total_seconds():
        return True
    return clock is not None and started_on_clock is not None and clock.now() - started_on_clock > timeout


def overdue(label: str, seconds: float, timeout: dt.timedelta, *, cancelled: bool = False) -> None:
    """Log a handler found running past its timeout (queues' and topics' alike); ``cancelled``: an asyncio
    handler, cancelled for it."""
    what = (
        "cancelled: a failed attempt, retried per its policy"
        if cancelled
        else "a thread cannot be stopped: its message stays held while the handler runs, and its slot is taken"
    )
    log.warning(
        "%s: its handler has run %s, past its timeout of %s; %s",
        label,
        human(dt.timedelta(seconds=seconds)),
        human(timeout),
        what,
    )


def describe(exc: BaseException) -> str:
    """An exception for a log line: its type and first line (SQLAlchemy's messages run long)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
