"""Worker: runs Handlers on a bounded pool, with lock heartbeats, retries, wake-ups and graceful shutdown."""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from delayq.clock import Clock
from delayq.dialects import dialect_for
from delayq.errors import DelayqError, InvalidInputError
from delayq.handler import DeadLetter, Handler, Retry
from delayq.messages import Delivery
from delayq.queue import DelayedQueue
from delayq.schema import DEFAULT_PREFIX

log = logging.getLogger("delayq.worker")

MIN_IDLE_SLEEP = 0.01
MAX_ERROR_BACKOFF = 5.0


@dataclass(eq=False)
class _Running:
    handler: Handler
    queue: DelayedQueue
    delivery: Delivery
    extend_at: dt.datetime
    future: Future[None] | None = field(default=None, repr=False)


class Worker:
    """Consumes the queues of its handlers until stopped.

    Args:
        engine: the database holding delayq's tables.
        handlers: ``Handler`` subclasses or instances, one per queue.
        concurrency: how many handlers run at once; the worker fetches only as many messages as
            it has free slots. Defaults to 4.
        poll_interval: the longest an idle worker sleeps between polls when nothing wakes it
            (PostgreSQL wakes it with LISTEN/NOTIFY as soon as an offer commits). 1 second.
        shutdown_timeout: how long in-flight handlers may run on after a stop. 30 seconds.
        clock: the queues' clock (a ``ManualClock`` in tests); the database's clock by default.
        table_prefix, schema: where delayq's tables are.
        listen: use PostgreSQL LISTEN/NOTIFY for wake-ups. True.
    """

    def __init__(
        self,
        engine: sa.Engine,
        handlers: Iterable[Handler | type[Handler]],
        *,
        concurrency: int = 4,
        poll_interval: dt.timedelta = dt.timedelta(seconds=1),
        shutdown_timeout: dt.timedelta = dt.timedelta(seconds=30),
        clock: Clock | None = None,
        table_prefix: str = DEFAULT_PREFIX,
        schema: str | None = None,
        listen: bool = True,
    ) -> None:
        if concurrency < 1:
            raise InvalidInputError("concurrency must be at least 1")
        self.engine = engine
        self.handlers = [h() if isinstance(h, type) else h for h in handlers]
        if not self.handlers:
            raise InvalidInputError("a Worker needs at least one handler")
        self.concurrency = concurrency
        self.poll_interval = poll_interval.total_seconds()
        self.shutdown_timeout = shutdown_timeout.total_seconds()
        self.clock = clock
        self._queues: dict[str, tuple[Handler, DelayedQueue]] = {}
        for h in self.handlers:
            name = getattr(h, "queue", None)
            if not isinstance(name, str):
                raise InvalidInputError(f"{type(h).__name__} must set the class attribute `queue`")
            if name in self._queues:
                raise InvalidInputError(f"two handlers for queue {name!r}")
            q = DelayedQueue(
                engine,
                name,
                serializer=h.serializer,
                visibility_timeout=h.visibility_timeout,
                clock=clock,
                table_prefix=table_prefix,
                schema=schema,
            )
            self._queues[name] = (h, q)
        self._channel = next(iter(self._queues.values()))[1].tables.messages.name
        self._listen = listen
        self._running: dict[int, _Running] = {}
        self._to_ack: list[_Running] = []  # handled, acked together by the fetch loop
        self._lock = threading.Lock()
        self._slot_freed = threading.Event()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()  # not running
        self._thread: threading.Thread | None = None
        self.handled = 0
        """Deliveries finished (acked, retried or dead-lettered) so far."""

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self) -> None:
        """Consume until ``stop()`` or SIGINT/SIGTERM; a second signal exits at once."""
        restore = self._install_signal_handlers()
        try:
            self._serve()
        finally:
            restore()

    def start(self) -> None:
        """Run in a background thread (no signal handling): embed the worker in an application."""
        self._stopped.clear()
        self._thread = threading.Thread(target=self._serve, name="delayq-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop fetching, let in-flight handlers finish, release the rest; True once fully stopped."""
        self._stopping.set()
        self._wake.set()
        return self._stopped.wait(timeout if timeout is not None else self.shutdown_timeout + 5)

    def run_once(self) -> int:
        """Handle every message due now, then return how many were handled. For tests and scripts."""
        done = 0
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="delayq-handler") as pool:
            while True:
                started = self._fetch(pool)
                if not started:
                    break
                for running in started:
                    assert running.future is not None
                    running.future.result()
                done += len(started)
        self._flush_acks()
        return done

    # -- the loop -------------------------------------------------------------------------------
    def _serve(self) -> None:
        self._stopped.clear()
        helpers = [threading.Thread(target=self._heartbeat, name="delayq-heartbeat", daemon=True)]
        if self._listen and dialect_for(self.engine).can_notify:
            helpers.append(threading.Thread(target=self._listen_loop, name="delayq-listen", daemon=True))
        for t in helpers:
            t.start()
        log.info("worker started: queues %s, concurrency %d", ", ".join(self._queues), self.concurrency)
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="delayq-handler")
        try:
            self._fetch_loop(pool)
        finally:
            self._shutdown(pool)
            self._stopped.set()

    def _fetch_loop(self, pool: ThreadPoolExecutor) -> None:
        idle_sleep, errors = MIN_IDLE_SLEEP, 0
        while not self._stopping.is_set():
            if self._free_slots() == 0:
                self._slot_freed.wait(self.poll_interval)
                self._slot_freed.clear()
                continue
            try:
                started = self._fetch(pool)
                errors = 0
            except (DBAPIError, DelayqError) as exc:
                errors += 1
                pause = min(MAX_ERROR_BACKOFF, 0.1 * 2**errors)
                log.warning("fetch failed (%s); retrying in %.1fs", exc, pause)
                self._stopping.wait(pause)
                continue
            if started:  # more may be due: fetch again at once (or as soon as a slot frees)
                idle_sleep = MIN_IDLE_SLEEP
                continue
            timeout = min(idle_sleep, self.poll_interval, self._until_next_due())
            idle_sleep = min(idle_sleep * 2, self.poll_interval)
            self._wake.wait(timeout)
            self._wake.clear()

    def _fetch(self, pool: ThreadPoolExecutor) -> list[_Running]:
        """Ack what was handled since the last fetch, claim up to the free slots and start their handlers."""
        self._flush_acks()
        started: list[_Running] = []
        for handler, queue in self._queues.values():
            free = self._free_slots()
            if free == 0 or self._stopping.is_set():
                break
            for delivery in queue.try_poll_many(free):
                running = _Running(handler, queue, delivery, self._extend_at(handler))
                with self._lock:
                    self._running[id(running)] = running
                running.future = pool.submit(self._execute, running)
                started.append(running)
        return started

    def _until_next_due(self) -> float:
        soonest = self.poll_interval
        for _, queue in self._queues.values():
            try:
                due = queue.next_due()
            except (DBAPIError, DelayqError):
                return soonest
            if due is not None:
                soonest = min(soonest, due.total_seconds())
        return max(soonest, MIN_IDLE_SLEEP)

    def _free_slots(self) -> int:
        with self._lock:
            return self.concurrency - len(self._running)

    # -- one delivery ---------------------------------------------------------------------------
    def _execute(self, running: _Running) -> None:
        handler, queue, delivery = running.handler, running.queue, running.delivery
        ack_later = False
        try:
            if handler.transactional:
                self._handle_in_transaction(handler, queue, delivery)
            else:
                handler.handle(delivery)
                ack_later = True
        except Exception as exc:  # whatever the handler raised is a failed attempt, or Retry / DeadLetter
            self._record_failure(handler, queue, delivery, exc)
        finally:
            with self._lock:
                self._running.pop(id(running), None)
                if ack_later:
                    self._to_ack.append(running)
                else:
                    self.handled += 1
            self._slot_freed.set()
            self._wake.set()

    def _flush_acks(self) -> None:
        """Ack the deliveries handled since the last flush: one statement per queue.

        A handler that finishes frees its slot at once; its message stays locked until this ack,
        which the fetch loop sends before its next claim (and the shutdown before it returns).
        """
        with self._lock:
            done, self._to_ack = self._to_ack, []
        for queue, deliveries in _by_queue(done):
            try:
                lost = len(deliveries) - queue.ack_many(deliveries)
            except (DBAPIError, DelayqError) as exc:
                log.warning("%s: could not ack %d message(s) (%s); they come again", queue.name, len(deliveries), exc)
                continue
            if lost:
                log.warning("%s: %d lock(s) lost before the ack; those messages come again", queue.name, lost)
        with self._lock:
            self.handled += len(done)

    @staticmethod
    def _record_failure(handler: Handler, queue: DelayedQueue, delivery: Delivery, exc: Exception) -> None:
        if isinstance(exc, DeadLetter):
            error, give_up = exc.reason, True
        elif isinstance(exc, Retry):
            error, give_up = exc.reason or "retry requested", False
        else:
            error, give_up = f"{type(exc).__name__}: {exc}", handler.retry.gives_up_after(delivery.attempts)
        try:
            if give_up:
                log.warning("%s: attempt %d failed, dead-lettered: %s", delivery.label, delivery.attempts, error)
                held = delivery.dead_letter(error)
            else:
                delay = exc.after if isinstance(exc, Retry) and exc.after is not None else None
                delay = handler.retry.delay(delivery.attempts) if delay is None else delay
                log.info(
                    "%s: attempt %d failed, next in %s: %s",
                    delivery.label,
                    delivery.attempts,
                    delay,
                    error,
                )
                held = delivery.retry(delay, error)
            if not held:
                log.warning("%s: lock lost before the failure was recorded", delivery.label)
        except (DBAPIError, DelayqError) as db_error:
            log.warning(
                "%s: could not record the failure (%s); it will be delivered again",
                delivery.label,
                db_error,
            )

    def _handle_in_transaction(self, handler: Handler, queue: DelayedQueue, delivery: Delivery) -> None:
        with queue.transaction() as conn:
            handler.handle(delivery, conn)
            if not delivery.ack(using=conn):
                conn.rollback()
                log.warning("%s: lock lost while handling; its writes were rolled back", delivery.label)

    # -- helpers --------------------------------------------------------------------------------
    def _now(self) -> dt.datetime:
        return self.clock.now() if self.clock is not None else dt.datetime.now(dt.UTC)

    def _extend_at(self, handler: Handler) -> dt.datetime:
        return self._now() + handler.visibility_timeout / 2

    def _heartbeat(self) -> None:
        """Extend the locks of handlers still running, half a visibility timeout ahead of expiry."""
        while not self._stopped.is_set():
            with self._lock:
                due = [r for r in self._running.values() if self._now() >= r.extend_at]
            for r in due:
                try:
                    if r.delivery.extend(r.handler.visibility_timeout):
                        r.extend_at = self._extend_at(r.handler)
                    else:
                        log.warning("%s: lock lost; another consumer may have it", r.delivery.label)
                        r.extend_at = self._now() + dt.timedelta(days=365)
                except (DBAPIError, DelayqError) as exc:
                    log.warning("could not extend the lock of %s: %s", r.delivery.label, exc)
            self._stopped.wait(0.05)

    def _listen_loop(self) -> None:
        dialect, errors = dialect_for(self.engine), 0
        while not self._stopped.is_set():
            try:
                for queue_name in dialect.listen(self.engine, self._channel, self._stopped):
                    errors = 0
                    if queue_name in self._queues:
                        self._wake.set()
            except Exception as exc:  # the listener must survive anything; polling goes on meanwhile
                errors += 1
                pause = min(MAX_ERROR_BACKOFF, 0.1 * 2**errors)
                log.warning("LISTEN connection failed (%s); reconnecting in %.1fs", exc, pause)
                self._stopped.wait(pause)

    def _shutdown(self, pool: ThreadPoolExecutor) -> None:
        with self._lock:
            running = list(self._running.values())
        unstarted = [r for r in running if r.future is not None and r.future.cancel()]
        with self._lock:
            for r in unstarted:
                self._running.pop(id(r), None)
        for queue, deliveries in _by_queue(unstarted):
            try:
                queue.release(deliveries)  # one transaction per queue
            except (DBAPIError, DelayqError) as exc:
                log.warning(
                    "%s: could not release %d message(s) (%s); they return after their timeout",
                    queue.name,
                    len(deliveries),
                    exc,
                )
        deadline = time.monotonic() + self.shutdown_timeout
        while self._free_slots() < self.concurrency and time.monotonic() < deadline:
            self._slot_freed.wait(0.05)
            self._slot_freed.clear()
        left = self.concurrency - self._free_slots()
        if left:
            log.warning(
                "%d handler(s) still running after %.0fs; their messages return after the visibility timeout",
                left,
                self.shutdown_timeout,
            )
        pool.shutdown(wait=left == 0, cancel_futures=True)
        self._flush_acks()
        log.info("worker stopped")

    def _install_signal_handlers(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.getsignal(s) for s in signals}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if self._stopping.is_set():
                log.warning("second signal: exiting at once")
                os._exit(128 + signum)
            log.info("signal %d: stopping (in-flight handlers may finish within %.0fs)", signum, self.shutdown_timeout)
            self._stopping.set()
            self._wake.set()

        for s in signals:
            signal.signal(s, on_signal)

        def restore() -> None:
            for s, handler in previous.items():
                signal.signal(s, handler)

        return restore

    @property
    def queues(self) -> Sequence[DelayedQueue]:
        """The queues this worker consumes."""
        return [q for _, q in self._queues.values()]


def _by_queue(runnings: Iterable[_Running]) -> list[tuple[DelayedQueue, list[Delivery]]]:
    """The deliveries grouped by queue, for one statement per queue."""
    groups: dict[str, tuple[DelayedQueue, list[Delivery]]] = {}
    for r in runnings:
        groups.setdefault(r.queue.name, (r.queue, []))[1].append(r.delivery)
    return list(groups.values())
