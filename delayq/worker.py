"""Worker: runs Handlers on a bounded pool, with lock heartbeats, retries, wake-ups and graceful shutdown.

Threads: the fetch loop (``run()``'s thread, or the one ``start()`` makes) claims messages for free
slots, acks what was handled and sleeps when idle; a heartbeat thread extends the locks still held;
on PostgreSQL a listener wakes the fetch loop; handlers run on a pool of daemon threads. Topic
handlers share the fetch loop and the pool; their subscriptions' upkeep (rebalances, extensions,
watermarks) runs on a thread of its own (``delayq.topics.consumer``). Every loop survives any
exception: it logs, backs off and goes on.
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import sqlalchemy as sa

from delayq import observe
from delayq._outcome import RetryAfter, after_failure
from delayq.clock import Clock
from delayq.cron import ScheduleRunner, schedules_for
from delayq.dialects import bounds, dialect_for
from delayq.errors import InvalidInputError, SchemaMissingError
from delayq.handler import Handler
from delayq.humanize import human
from delayq.leases import Lease, Leases, describe, overdue
from delayq.messages import Delivery
from delayq.queue import DelayedQueue
from delayq.schema import DEFAULT_PREFIX
from delayq.threads import DaemonPool, Task
from delayq.topics.consumer import TopicConsumer, TopicConsumers
from delayq.topics.handler import TopicHandler
from delayq.transactions import check_api
from delayq.watchdog import Watchdog

log = logging.getLogger("delayq.worker")

SIGNAL_GRACE = 10.0
"""Seconds past ``shutdown_timeout`` after a SIGINT/SIGTERM at which the process exits whatever blocks."""
MIN_IDLE_SLEEP = 0.01
ACK_GATHER = 0.002  # seconds the ack loop lets a batch of handlers finish before it acks them together
FETCH_GATHER = 0.002  # seconds the fetch loop, after a claim, lets handlers free slots to claim for together
MAX_ERROR_BACKOFF = 5.0
HEARTBEAT_TICK = 0.05


def backoff(errors: int) -> float:
    """Seconds to wait after ``errors`` failures in a row: 0.2 s doubling to 5 s."""
    return float(min(MAX_ERROR_BACKOFF, 0.1 * 2 ** min(errors, 10)))


@dataclass(frozen=True)
class WorkerHealth:
    """A snapshot of a worker's state, for an embedding application's health check."""

    running: bool
    """Started and not yet stopped."""
    loops: Mapping[str, bool]
    """Whether each background loop ("fetch", "heartbeat", "listen" on PostgreSQL, "topics" with topic
    handlers) is alive."""
    seconds_since_fetch: float | None
    """Monotonic seconds since a claim last reached the database (whatever it found); None before the first."""
    held: int
    """Deliveries held: handlers running, and handled messages awaiting their ack (or topic outcome)."""
    stuck: int = 0
    """Handlers running past their ``Handler.timeout``: their slots (and messages) stay taken while they run."""

    @property
    def healthy(self) -> bool:
        """Running, with every loop alive."""
        return self.running and all(self.loops.values())


class _NotBegun(Exception):
    """A transactional handler's transaction could not begin (no connection): the handler did not run."""


class Worker:
    """Consumes the queues and topics of its handlers until stopped.

    Args:
        engine: the database holding delayq's tables. Its pool should allow a connection per
            handler (a transactional handler holds one for its whole run) plus three for the
            fetch loop, the heartbeat and the listener, and one more with topic handlers;
            ``delayq worker`` sizes it so.
        handlers: ``Handler`` subclasses or instances, one per queue, and ``TopicHandler`` ones,
            one per (topic, group).
        concurrency: how many handlers run at once; the worker fetches only as many messages as
            it has free slots, shared fairly between queues and topics with due work. Defaults to 4.
        poll_interval: the longest an idle worker sleeps between polls when nothing wakes it
            (PostgreSQL wakes it with LISTEN/NOTIFY as soon as an offer commits). 1 second.
        shutdown_timeout: how long in-flight handlers may run on after a stop; then the worker
            returns, but what still runs is never released while its thread lives: its locks (and
            its topic partitions' leases) stay extended until the handler returns and its outcome is
            recorded. 30 seconds.
        clock: the queues' clock (a ``ManualClock`` in tests); the database's clock by default.
        table_prefix, schema: where delayq's tables are.
        listen: use PostgreSQL LISTEN/NOTIFY for wake-ups. True.
        stall_timeout: a database call of the fetch loop or the heartbeat, or the ack and COMMIT of a
            transactional handler, that has not returned after this long is taken for a connection
            gone silent, which is dropped (see ``delayq.watchdog``, docs/workers.md "Bounds"). 60
            seconds; None turns the watchdog off.

    Each handler's queue caps deliveries at ``handler.retry.max_attempts``: a message whose
    handler never reaches an outcome (its process dies every time) goes to the dead letters.
    Topic handlers are consumed through a ``Subscription`` each, named by
    ``handler.subscriber_name(worker.name)``; see ``TopicHandler`` and docs/topics.md.
    """

    #: Whether ``handle`` may be a coroutine function (``delayq.aio.AsyncWorker``); here it may not.
    runs_coroutines: ClassVar[bool] = False

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
        stall_timeout: dt.timedelta | None = dt.timedelta(seconds=60),
    ) -> None:
        check_api(engine, "Worker")
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
        self.name = f"{socket.gethostname()[:150]}:{os.getpid()}:{secrets.token_hex(3)}"
        """This worker's name (``host:pid:random``, unique per worker): its topic handlers' subscriber name."""
        for h in self.handlers:
            timeout = h.timeout
            if timeout is not None and (not isinstance(timeout, dt.timedelta) or timeout <= dt.timedelta(0)):
                raise InvalidInputError(f"{type(h).__name__}.timeout must be a positive timedelta or None")
            if inspect.iscoroutinefunction(h.handle) and not self.runs_coroutines:
                raise InvalidInputError(
                    f"{type(h).__name__}.handle is a coroutine (async def): run it with delayq.aio.AsyncWorker"
                )
        self._topics = TopicConsumers(
            engine,
            [h for h in self.handlers if isinstance(h, TopicHandler)],
            self.name,
            clock=clock,
            table_prefix=table_prefix,
            schema=schema,
            backoff=backoff,
        )
        queue_handlers = [h for h in self.handlers if not isinstance(h, TopicHandler)]
        self._queues: dict[str, tuple[Handler, DelayedQueue]] = {}
        for h in queue_handlers:
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
                max_deliveries=h.retry.max_attempts,
            )
            self._queues[name] = (h, q)
        self._schedules = ScheduleRunner(self.queues, schedules_for(queue_handlers))
        self._channel = next((q.tables.messages.name for _, q in self._queues.values()), "")  # "": no queues
        self._listen = listen
        self._leases = Leases(clock)
        self._slot_freed = threading.Event()
        self._wake_at_free = 1  # free slots at which a finishing handler sets ``_slot_freed``
        self._ack_due = threading.Event()  # a handled delivery awaits its ack
        self._acking = threading.Event()  # set: the ack loop ends
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()  # not running
        self._thread: threading.Thread | None = None
        self._loops: dict[str, threading.Thread] = {}
        self._pool: DaemonPool | None = None
        self._turn = 0  # the queue or topic that claims first on the next fetch (round robin)
        self._errors: dict[str, int] = {}  # failed claims in a row, per queue
        self._retry_at: dict[str, float] = {}  # per queue: no claim before this monotonic time
        self._last_fetch: float | None = None
        self._error: BaseException | None = None
        self._exit_timer: threading.Timer | None = None
        self._stall_timeout = None if stall_timeout is None else stall_timeout.total_seconds()

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self) -> None:
        """Consume until ``stop()`` or SIGINT/SIGTERM; a second signal exits at once.

        Raises ``SchemaMissingError`` when delayq's tables are missing at the first fetch.
        """
        self._stopping.clear()
        restore = self._install_signal_handlers()
        try:
            self._serve()
        finally:
            restore()
        if self._error is not None:
            raise self._error

    def start(self) -> None:
        """Run in a background thread (no signal handling): embed the worker in an application."""
        self._stopping.clear()
        self._stopped.clear()
        self._thread = threading.Thread(target=self._serve, name="delayq-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop fetching, give back what never started, let in-flight handlers finish; True once stopped.

        Handlers still running after ``shutdown_timeout`` keep their messages, extended in the
        background until they return (``health().held`` counts them)."""
        self._stopping.set()
        self._wake.set()
        return self._stopped.wait(timeout if timeout is not None else self.shutdown_timeout + 5)

    def health(self) -> WorkerHealth:
        """Whether the worker runs, its loops are alive, how recently it fetched, how much it holds."""
        running = not self._stopped.is_set()
        last = self._last_fetch
        return WorkerHealth(
            running=running,
            loops=MappingProxyType({name: running and t.is_alive() for name, t in self._loops.items()}),
            seconds_since_fetch=None if last is None else time.monotonic() - last,
            held=len(self._leases) + self._topics.running(),
            stuck=self._leases.stuck() + self._topics.stuck(),
        )

    @property
    def handled(self) -> int:
        """Deliveries finished (acked, retried or dead-lettered) so far, of queues and topics."""
        return self._leases.handled + self._topics.handled

    def run_once(self) -> int:
        """Handle every message due now, then return how many were handled. For tests and scripts.

        Topic handlers join their groups first and leave them at the end. Unlike ``run()``, a
        failed claim raises.
        """
        self._pool = DaemonPool(self.concurrency, "delayq-handler")
        self._schedules.refresh()
        done = 0
        try:
            self._topics.rebalance()
            while True:
                started = self._fetch(self.concurrency, guard=False)
                for task in started:
                    task.wait()
                self._flush_acks()
                if not started:
                    return done
                done += len(started)
        finally:
            self._topics.stop()
            self._pool.shutdown()
            self._pool = None

    # -- the fetch loop -------------------------------------------------------------------------
    def _serve(self) -> None:
        self._stopped.clear()
        self._error = None
        self._pool = DaemonPool(self.concurrency, "delayq-handler")
        self._loops = {
            "fetch": threading.current_thread(),
            "heartbeat": threading.Thread(target=self._heartbeat_loop, name="delayq-heartbeat", daemon=True),
            "ack": threading.Thread(target=self._ack_loop, name="delayq-ack", daemon=True),
        }
        self._acking.clear()
        if self._listen and self._channel and dialect_for(self.engine).can_notify:
            self._loops["listen"] = threading.Thread(target=self._listen_loop, name="delayq-listen", daemon=True)
        if self._topics:
            self._loops["topics"] = self._topics.loop(self._wake.set)
        for name, t in self._loops.items():
            if name != "fetch":
                t.start()
        self._schedules.start()  # declared schedules are kept installed where the worker runs
        watchdog = None
        if self._stall_timeout is not None:
            loops = [t for name, t in self._loops.items() if name != "listen"]
            watchdog = Watchdog(self.engine, self._stall_timeout, lambda: {t.ident for t in loops if t.ident})
            watchdog.start()
        log.info(
            "worker %s started: queues %s; topics %s; concurrency %d",
            self.name,
            ", ".join(self._queues) or "none",
            self._topics or "none",
            self.concurrency,
        )
        try:
            self._fetch_loop()
        except SchemaMissingError as exc:  # nothing can work: say so and stop
            log.error("%s", exc)
            self._error = exc
        finally:
            try:
                self._shutdown()
            finally:
                if watchdog is not None:
                    watchdog.stop()
                self._stopped.set()

    def _fetch_loop(self) -> None:
        idle_sleep, errors = MIN_IDLE_SLEEP, 0
        while not self._stopping.is_set():
            self._wake.clear()  # a wake-up from now on ends the next sleep
            try:  # (acks go out from their own loop meanwhile)
                free = self._free_slots()
                started = self._fetch(free) if free else []
                errors = 0
            except SchemaMissingError:
                raise
            except Exception as exc:  # anything at all: log, back off, go on
                errors += 1
                log.warning("fetch loop: %s; going on in %.1fs", describe(exc), backoff(errors), exc_info=True)
                self._stopping.wait(backoff(errors))
                continue
            if not free:
                self._slot_freed.wait(self.poll_interval)
                self._slot_freed.clear()
            elif started:  # more may be due: fetch again soon, for the slots freed meanwhile
                idle_sleep = MIN_IDLE_SLEEP
                self._gather_slots()
            else:
                self._wake.wait(min(idle_sleep, self.poll_interval, self._until_next_due()))
                idle_sleep = min(idle_sleep * 2, self.poll_interval)

    def _gather_slots(self) -> None:
        """Wait until half the slots are free, or ``FETCH_GATHER`` seconds: one claim for slots that free
        up together instead of a claim (a round trip and a commit) for each handler as it returns."""
        half = (self.concurrency + 1) // 2
        deadline = time.monotonic() + FETCH_GATHER
        self._wake_at_free = half  # handlers signal once that many are free, not at each one
        try:
            while self._free_slots() < half and not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._slot_freed.wait(left)
                self._slot_freed.clear()
        finally:
            self._wake_at_free = 1

    def _fetch(self, free: int, *, guard: bool = True) -> list[Task]:
        """Claim up to ``free`` messages, shared fairly between queues and topics, and start their handlers.

        Queues and topics take turns to claim first; each gets an equal share of the free slots, and
        what one leaves (it had fewer due) goes to the others in further passes.
        """
        sources: list[str | TopicConsumer] = [*self._queues, *self._topics.consumers]
        sources = sources[self._turn :] + sources[: self._turn]
        self._turn = (self._turn + 1) % len(sources)
        now = time.monotonic()
        candidates = [s for s in sources if (self._retry_at.get(s, 0.0) <= now if isinstance(s, str) else s.ready(now))]
        started: list[Task] = []
        while free > 0 and candidates and not self._stopping.is_set():
            share, more = max(1, free // len(candidates)), []
            for source in candidates:
                if free == 0 or self._stopping.is_set():
                    break
                want = min(share, free)
                got = self._claim(source, want, guard) if isinstance(source, str) else self._poll(source, want, guard)
                started += got
                free -= len(got)
                if len(got) == want:
                    more.append(source)
            candidates = more
        return started

    def _poll(self, consumer: TopicConsumer, limit: int, guard: bool) -> list[Task]:
        """Poll up to ``limit`` messages of a topic handler and start them (the consumer backs off on failure)."""
        assert self._pool is not None
        got = consumer.claim(limit, self._pool, self._handler_done, guard)
        if got is None:
            return []
        self._last_fetch = time.monotonic()
        return got

    def _claim(self, name: str, limit: int, guard: bool) -> list[Task]:
        """Claim up to ``limit`` messages of one queue and start their handlers; on failure back this queue off."""
        handler, queue = self._queues[name]
        before = time.monotonic()
        try:
            deliveries = queue.try_poll_many(limit)
        except Exception as exc:
            if not guard or (isinstance(exc, SchemaMissingError) and self._last_fetch is None):
                raise
            errors = self._errors[name] = self._errors.get(name, 0) + 1
            self._retry_at[name] = before + backoff(errors)
            log.warning("queue %s: fetch failed (%s); next try in %.1fs", name, describe(exc), backoff(errors))
            return []
        self._errors[name] = 0
        self._last_fetch = time.monotonic()
        started = []
        assert self._pool is not None
        for delivery in deliveries:
            lease = self._leases.add(handler, queue, delivery, before)
            lease.task = self._pool.submit(functools.partial(self._execute, lease))
            started.append(lease.task)
        return started

    def _until_next_due(self) -> float:
        soonest = self.poll_interval
        for _, queue in self._queues.values():
            try:
                due = queue.next_due()
            except Exception:  # the claim reports database trouble; here it only shortens nothing
                return soonest
            if due is not None:
                soonest = min(soonest, due.total_seconds())
        return max(soonest, MIN_IDLE_SLEEP)

    def _free_slots(self) -> int:
        return self.concurrency - self._leases.running() - self._topics.running()

    def _handler_done(self) -> None:
        """A handler finished: its slot is free, and the fetch loop may find more.

        Each event is set only when clear (a set one wakes its waiter all the same; the waiter
        clears it before it looks at the slots, so it sees this one too), and ``_slot_freed`` only
        once as many slots are free as the fetch loop waits for: one wake-up per claim, not one
        per handler.
        """
        if not self._slot_freed.is_set() and self._free_slots() >= self._wake_at_free:
            self._slot_freed.set()
        if not self._wake.is_set():
            self._wake.set()

    # -- one delivery ---------------------------------------------------------------------------
    def _execute(self, lease: Lease) -> None:
        handler, queue, delivery = lease.handler, lease.queue, lease.delivery
        to_ack = False
        try:
            if handler.transactional:
                self._handle_in_transaction(handler, queue, delivery, self._stall_timeout)
            else:
                with observe.handling(delivery):  # the delivery log, metrics and tracing hear of it
                    handler.handle(delivery)
                to_ack = True
        except _NotBegun as exc:  # no connection for the handler: not an attempt, give it back
            log.warning("%s: its transaction could not begin (%s)", delivery.label, describe(exc.__cause__ or exc))
            self._leases.release([lease], "the handler's transaction could not begin")
        except Exception as exc:  # whatever the handler raised is a failed attempt, or Retry / DeadLetter
            self._record_failure(lease, exc)
        finally:
            self._leases.finish(lease, to_ack)  # the ack follows, with others, from the ack loop
            if to_ack and not self._ack_due.is_set():  # (the ack loop clears it before it collects)
                self._ack_due.set()
            self._handler_done()

    @staticmethod
    def _record_failure(lease: Lease, exc: Exception) -> None:
        """Record what ``decide`` makes of a failed attempt: a retry after a delay, or the dead letters."""
        handler, delivery = lease.handler, lease.delivery
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
            if not held and not lease.lost:  # (a lost lock the heartbeat found is logged already)
                log.warning("%s: lock lost before the outcome was recorded", delivery.label)
        except Exception as db_error:
            log.warning(
                "%s: could not record the outcome (%s); it will be delivered again",
                delivery.label,
                describe(db_error),
            )

    @staticmethod
    def _handle_in_transaction(
        handler: Handler, queue: DelayedQueue, delivery: Delivery, call_bound: float | None
    ) -> None:
        """Run the handler and the ack in one transaction; ``_NotBegun`` when it could not begin.

        The server ends the transaction once idle for the visibility timeout (``queue.transaction``);
        the ack and the COMMIT, delayq's calls, are bounded by ``call_bound`` (the stall timeout)."""
        begun = False
        try:
            with queue.transaction() as conn:
                begun = True
                with observe.handling(delivery):  # begun: from here on it is an attempt
                    handler.handle(delivery, conn)
                bounds.arm(conn.connection.dbapi_connection, call_bound)  # until the COMMIT returns
                if not delivery.ack(using=conn):
                    conn.rollback()
                    log.warning("%s: lock lost while handling; its writes were rolled back", delivery.label)
        except Exception as exc:
            if begun:
                raise
            raise _NotBegun from exc

    # -- heartbeat ------------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        """Extend the locks held, half a visibility timeout before they would expire; once the worker
        stopped, go on (and ack) for the handlers that outlived ``shutdown_timeout`` until they return."""
        errors, kept = 0, False
        while not self._stopped.is_set() or self._leases.running():
            try:
                if self._stopped.is_set():  # the ack loop has ended: ack what the kept handlers finish
                    kept = True
                    self._leases.flush_acks()
                ok = self._leases.beat()
                self._report_overdue()
            except Exception as exc:
                log.warning("heartbeat: %s", describe(exc), exc_info=True)
                ok = False
            errors = 0 if ok else errors + 1
            time.sleep(backoff(errors) if errors else HEARTBEAT_TICK)
        if kept:
            self._flush_acks()  # the last kept handler's
            if self._leases.forget_handled():
                log.warning("handled message(s) kept past the stop could not be acked; they return after their timeout")

    def _report_overdue(self) -> None:
        """Warn of (and count) each handler found running past its ``timeout``, once."""
        for lease in self._leases.newly_overdue():
            timeout = lease.handler.timeout
            assert timeout is not None
            overdue(lease.delivery.label, time.monotonic() - lease.started_at, timeout)
            observe.count("overdue", lease.queue.name)

    # -- wake-ups -------------------------------------------------------------------------------
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
                log.warning("LISTEN connection failed (%s); reconnecting in %.1fs", describe(exc), backoff(errors))
                self._stopped.wait(backoff(errors))

    # -- shutdown -------------------------------------------------------------------------------
    def _ack_loop(self) -> None:
        """Ack handled deliveries as they come, in batches, beside the claims (not between them).

        A claim and an ack each wait for a round trip (and a commit); sent from two connections at
        once, the fetch loop claims the next batch while the last one's acks are on their way.
        """
        while not self._acking.is_set():
            if self._ack_due.wait(self.poll_interval):
                self._acking.wait(ACK_GATHER)  # the rest of a batch's handlers finish meanwhile
            self._ack_due.clear()
            self._flush_acks()  # on a quiet tick too: what a row lock held back last time

    def _stop_acking(self) -> None:
        """End the ack loop (the shutdown acks from here on); a call stuck in it is left to the watchdog."""
        self._acking.set()
        self._ack_due.set()  # it may be asleep until the next poll
        ack = self._loops.get("ack")
        if ack is not None and ack.ident is not None and ack is not threading.current_thread():
            ack.join(timeout=2.0)

    def _shutdown(self) -> None:
        """Release what never started; wait for running handlers (acking, heartbeats going on);
        after ``shutdown_timeout`` keep what still runs: its locks and leases stay extended until
        the handler returns (never given to another consumer while its thread lives)."""
        self._stop_acking()
        self._schedules.stop(timeout=5.0)
        self._leases.release(self._leases.cancel_unstarted(), "never started")
        self._topics.give_back_unstarted()
        deadline = time.monotonic() + self.shutdown_timeout
        while True:
            self._flush_acks()
            left = deadline - time.monotonic()
            if self._free_slots() == self.concurrency or left <= 0:
                break
            self._slot_freed.wait(min(0.1, left))
            self._slot_freed.clear()
        running = self._leases.running() + self._topics.running()
        if running:
            log.warning(
                "%d handler(s) still running after %.0fs: their messages stay held (locks extended) until they "
                "return, or until the process ends",
                running,
                self.shutdown_timeout,
            )
        self._topics.stop()  # leaves the groups (partitions move at once), but keeps the partitions still in use
        self._flush_acks()
        unacked = self._leases.forget_handled()
        if unacked:
            log.warning("%d handled message(s) could not be acked; they return after their timeout", unacked)
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        log.info("worker stopped")

    def _flush_acks(self) -> None:
        try:
            self._leases.flush_acks()
        except Exception as exc:
            log.warning("could not ack: %s", describe(exc))

    def _install_signal_handlers(self) -> Callable[[], None]:
        """SIGINT/SIGTERM: the first stops the worker (and arms an exit in bounded time), a second exits.

        The signals are taken from a wakeup socket by a thread of their own: Python runs a signal
        handler only when the main thread returns to the interpreter, and a driver call blocked on a
        silent network (mysqlclient's read) may never return.
        """
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.getsignal(s) for s in signals}
        receive, send = socket.socketpair()
        send.setblocking(False)
        previous_fd = signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
        for s in signals:
            signal.signal(s, lambda signum, frame: None)  # the watcher below acts on it
        stop_watching = threading.Event()

        def watch() -> None:
            receive.settimeout(0.2)
            count = 0
            while not stop_watching.is_set():
                try:
                    data = receive.recv(16)
                except TimeoutError:
                    continue
                except OSError:
                    return
                for signum in data:
                    if signum not in signals:
                        continue
                    count += 1
                    if count > 1:
                        log.warning("second signal: exiting at once")
                        logging.shutdown()
                        os._exit(128 + signum)
                    self._on_stop_signal(signum)

        watcher = threading.Thread(target=watch, name="delayq-signals", daemon=True)
        watcher.start()

        def restore() -> None:  # the worker stopped in time: no forced exit
            if self._exit_timer is not None:
                self._exit_timer.cancel()
                self._exit_timer = None
            stop_watching.set()
            signal.set_wakeup_fd(previous_fd)
            for s, handler in previous.items():
                signal.signal(s, handler)
            watcher.join(1)
            receive.close()
            send.close()

        return restore

    def _on_stop_signal(self, signum: int) -> None:
        log.info("signal %d: stopping (in-flight handlers may finish within %.0fs)", signum, self.shutdown_timeout)
        self._stopping.set()
        self._wake.set()
        # Whatever blocks (a driver call on a dead network), the process ends in bounded time.
        limit = self.shutdown_timeout + SIGNAL_GRACE
        self._exit_timer = threading.Timer(limit, self._exit_now, args=(signum, limit))
        self._exit_timer.daemon = True
        self._exit_timer.start()

    @staticmethod
    def _exit_now(signum: int, after: float) -> None:
        log.error(
            "still not stopped %.0fs after signal %d: exiting now; held messages return after their timeout",
            after,
            signum,
        )
        logging.shutdown()
        os._exit(128 + signum)

    @property
    def queues(self) -> Sequence[DelayedQueue]:
        """The queues this worker consumes."""
        return [q for _, q in self._queues.values()]
