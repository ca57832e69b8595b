"""Worker: the threads driver of the worker core (``delayq.runtime``): Handlers on a bounded pool.

Threads: the fetch loop (``run()``'s thread, or the one ``start()`` makes) claims messages for free
slots, acks what was handled and sleeps when idle; a heartbeat thread extends the locks still held;
on PostgreSQL a listener wakes the fetch loop; handlers run on a pool of daemon threads. Topic
handlers share the fetch loop and the pool; their subscriptions' upkeep (rebalances, extensions,
watermarks) runs on a thread of its own (``delayq.runtime._topics``). Every loop survives any
exception: it logs, backs off and goes on. What is decided (the fair fetch, the outcomes, the
heartbeats, the acks, the schedules) is the core's; this module only runs it on threads.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

import sqlalchemy as sa

from delayq.clock import Clock
from delayq.dialects import dialect_for
from delayq.errors import SchemaMissingError
from delayq.handler import Handler
from delayq.queue import DelayedQueue
from delayq.runtime._core import (
    ACK_GATHER,
    FETCH_GATHER,
    HEARTBEAT_TICK,
    MIN_IDLE_SLEEP,
    SIGNAL_GRACE,
    Core,
    WorkerHealth,
    backoff,
)
from delayq.runtime._jobs import Cancellable, Job, describe
from delayq.runtime._sources import QueueSource
from delayq.runtime._threads import DaemonPool, Task
from delayq.runtime._topics import TopicConsumer, TopicJob
from delayq.schema import DEFAULT_PREFIX
from delayq.transactions import check_api
from delayq.watchdog import Watchdog

__all__ = ["SIGNAL_GRACE", "Worker", "WorkerHealth", "backoff"]

log = logging.getLogger("delayq.worker")


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
            (PostgreSQL wakes it with LISTEN/NOTIFY as soon as an offer commits). 1 second. The worker's
            queues read their flow state (pause, limits) at least this often (``flow_refresh``, 1 s at most).
        shutdown_timeout: how long in-flight handlers may run on after a stop; then the worker
            returns, but what still runs is never released while its thread lives: its locks (and
            its topic partitions' leases) stay extended until the handler returns and its outcome is
            recorded. 30 seconds.
        clock: the queues' clock (a ``ManualClock`` in tests); the database's clock by default.
        table_prefix, schema: where delayq's tables are.
        listen: use PostgreSQL LISTEN/NOTIFY for wake-ups, and to hear at once of a running message cancelled
            (``DelayedQueue.cancel_job``; without it the heartbeat finds the lock gone). True.
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
        core = self._core = Core(
            engine,
            handlers,
            concurrency=concurrency,
            poll_interval=poll_interval,
            shutdown_timeout=shutdown_timeout,
            clock=clock,
            table_prefix=table_prefix,
            schema=schema,
            listen=listen,
            stall_timeout=stall_timeout,
            coroutines=False,
        )
        self.engine = engine
        self.handlers = core.handlers
        self.concurrency = core.concurrency
        self.poll_interval = core.poll_interval
        self.shutdown_timeout = core.shutdown_timeout
        self.clock = clock
        self.name = core.name
        """This worker's name (``host:pid:random``, unique per worker): its topic handlers' subscriber name."""
        self._jobs = core.jobs
        self._topics = core.topics
        self._stopping = core.stopping
        self._stopped = core.stopped
        self._slot_freed = threading.Event()
        self._wake_at_free = 1  # free slots at which a finishing handler sets ``_slot_freed``
        self._ack_due = threading.Event()  # a handled delivery awaits its ack
        self._acking = threading.Event()  # set: the ack loop ends
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loops: dict[str, threading.Thread] = {}
        self._pool: DaemonPool | None = None
        self._error: BaseException | None = None
        self._exit_timer: threading.Timer | None = None

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
        return self._core.health(lambda: {name: t.is_alive() for name, t in self._loops.items()})

    @property
    def handled(self) -> int:
        """Deliveries finished (acked, retried or dead-lettered) so far, of queues and topics."""
        return self._core.handled

    def run_once(self) -> int:
        """Handle every message due now, then return how many were handled. For tests and scripts.

        Topic handlers join their groups first and leave them at the end. Unlike ``run()``, a
        failed claim raises.
        """
        self._pool = DaemonPool(self.concurrency, "delayq-handler")
        self._core.schedules.refresh()
        done = 0
        try:
            self._topics.rebalance()
            while True:
                started = self._core.fetch(self.concurrency, self._start_queue_job, self._start_topic_job, guard=False)
                for job in started:
                    assert isinstance(job.task, Task)
                    job.task.wait()
                self._core.flush_acks()
                if not started:
                    return done
                done += len(started)
        finally:
            self._topics.stop()
            self._pool.shutdown()
            self._pool = None

    # -- the fetch loop -------------------------------------------------------------------------
    def _serve(self) -> None:
        core = self._core
        self._stopped.clear()
        self._error = None
        self._pool = DaemonPool(self.concurrency, "delayq-handler")
        self._loops = {
            "fetch": threading.current_thread(),
            "heartbeat": threading.Thread(target=self._heartbeat_loop, name="delayq-heartbeat", daemon=True),
            "ack": threading.Thread(target=self._ack_loop, name="delayq-ack", daemon=True),
        }
        self._acking.clear()
        if core.listens:
            self._loops["listen"] = threading.Thread(target=self._listen_loop, name="delayq-listen", daemon=True)
        if self._topics:
            self._loops["topics"] = self._topics.loop(self._wake.set)
        if core.topic_gc:
            self._loops["topics-gc"] = core.topic_gc.loop(self._stopping)
        for name, t in self._loops.items():
            if name != "fetch":
                t.start()
        core.schedules.start()  # declared schedules are kept installed where the worker runs
        if core.pruner is not None:
            core.pruner.start()
        watchdog = None
        if core.stall_timeout is not None:
            loops = [t for name, t in self._loops.items() if name != "listen"]
            watchdog = Watchdog(self.engine, core.stall_timeout, lambda: {t.ident for t in loops if t.ident})
            watchdog.start()
        log.info("%s", core.started_line())
        core.register()
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
        core = self._core
        fetch, free_slots, start_queue, start_topic = (
            core.fetch,
            core.free_slots,
            self._start_queue_job,
            self._start_topic_job,
        )
        idle_sleep, errors = MIN_IDLE_SLEEP, 0
        while not self._stopping.is_set():
            self._wake.clear()  # a wake-up from now on ends the next sleep
            try:  # (acks go out from their own loop meanwhile)
                free = free_slots()
                started = fetch(free, start_queue, start_topic) if free else []
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
                self._wake.wait(min(idle_sleep, self.poll_interval, core.until_next_due()))
                idle_sleep = min(idle_sleep * 2, self.poll_interval)

    def _gather_slots(self) -> None:
        """Wait until half the slots are free, or ``FETCH_GATHER`` seconds: one claim for slots that free
        up together instead of a claim (a round trip and a commit) for each handler as it returns."""
        half = (self.concurrency + 1) // 2
        deadline = time.monotonic() + FETCH_GATHER
        free_slots = self._core.free_slots
        self._wake_at_free = half  # handlers signal once that many are free, not at each one
        try:
            while free_slots() < half and not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._slot_freed.wait(left)
                self._slot_freed.clear()
        finally:
            self._wake_at_free = 1

    def _start_queue_job(self, source: QueueSource, job: Job) -> Cancellable:
        assert self._pool is not None
        return self._pool.submit(functools.partial(self._run_queue_job, job))

    def _start_topic_job(self, consumer: TopicConsumer, job: TopicJob) -> Cancellable:
        assert self._pool is not None
        return self._pool.submit(functools.partial(consumer.run, job, self._handler_done))

    def _handler_done(self) -> None:
        """A handler finished: its slot is free, and the fetch loop may find more.

        Each event is set only when clear (a set one wakes its waiter all the same; the waiter
        clears it before it looks at the slots, so it sees this one too), and ``_slot_freed`` only
        once as many slots are free as the fetch loop waits for: one wake-up per claim, not one
        per handler.
        """
        if not self._slot_freed.is_set() and self._core.free_slots() >= self._wake_at_free:
            self._slot_freed.set()
        if not self._wake.is_set():
            self._wake.set()

    # -- one delivery ---------------------------------------------------------------------------
    def _run_queue_job(self, job: Job) -> None:
        to_ack = False
        try:
            to_ack = self._core.run_queue_job(job)
        finally:
            self._jobs.finish(job, to_ack)  # the ack follows, with others, from the ack loop
            if to_ack and not self._ack_due.is_set():  # (the ack loop clears it before it collects)
                self._ack_due.set()
            self._handler_done()

    # -- heartbeat ------------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        """Extend the locks held, half a visibility timeout before they would expire; once the worker
        stopped, go on (and ack) for the handlers that outlived ``shutdown_timeout`` until they return."""
        core = self._core
        errors, kept = 0, False
        while not self._stopped.is_set() or self._jobs.running():
            try:
                if self._stopped.is_set():  # the ack loop has ended: ack what the kept handlers finish
                    kept = True
                    self._jobs.flush_acks()
                ok = core.beat()
                core.report_overdue()
            except Exception as exc:
                log.warning("heartbeat: %s", describe(exc), exc_info=True)
                ok = False
            errors = 0 if ok else errors + 1
            time.sleep(backoff(errors) if errors else HEARTBEAT_TICK)
        if kept:
            core.flush_acks()  # the last kept handler's
            if self._jobs.forget_handled():
                log.warning("handled message(s) kept past the stop could not be acked; they return after their timeout")

    # -- wake-ups -------------------------------------------------------------------------------
    def _listen_loop(self) -> None:
        dialect, errors = dialect_for(self.engine), 0
        wakes = self._core.wakes
        while not self._stopped.is_set():
            try:
                for name in dialect.listen(self.engine, self._core.channel, self._stopped, cancels=True):
                    errors = 0
                    if self._core.heard_cancel(name):
                        continue
                    if wakes(name):
                        self._wake.set()
            except Exception as exc:  # the listener must survive anything; polling goes on meanwhile
                errors += 1
                log.warning("LISTEN connection failed (%s); reconnecting in %.1fs", describe(exc), backoff(errors))
                self._stopped.wait(backoff(errors))

    # -- acks and shutdown ----------------------------------------------------------------------
    def _ack_loop(self) -> None:
        """Ack handled deliveries as they come, in batches, beside the claims (not between them).

        A claim and an ack each wait for a round trip (and a commit); sent from two connections at
        once, the fetch loop claims the next batch while the last one's acks are on their way.
        """
        flush = self._core.flush_acks
        while not self._acking.is_set():
            if self._ack_due.wait(self.poll_interval):
                self._acking.wait(ACK_GATHER)  # the rest of a batch's handlers finish meanwhile
            self._ack_due.clear()
            if flush():  # (on a quiet tick too: what a row lock held back last time)
                self._wake.set()  # a limited queue's claims no longer count these: the fetch may find work now

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
        core = self._core
        self._stop_acking()
        core.schedules.stop(timeout=5.0)
        if core.pruner is not None:
            core.pruner.stop()
        self._jobs.release(self._jobs.cancel_unstarted(), "never started")
        self._topics.give_back_unstarted()
        deadline = time.monotonic() + self.shutdown_timeout
        while True:
            core.flush_acks()
            left = deadline - time.monotonic()
            if core.free_slots() == self.concurrency or left <= 0:
                break
            self._slot_freed.wait(min(0.1, left))
            self._slot_freed.clear()
        running = self._jobs.running() + self._topics.running()
        if running:
            core.warn_kept(running)
        self._topics.stop()  # leaves the groups (partitions move at once), but keeps the partitions still in use
        gc = self._loops.get("topics-gc")
        if gc is not None and gc.ident is not None:
            gc.join(timeout=5.0)  # a round is bounded; it ends between two transactions
        core.flush_acks()
        core.forget_unacked()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        core.deregister()
        log.info("worker stopped")

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
        self._exit_timer = self._core.on_stop_signal(signum, self._wake.set)

    @property
    def queues(self) -> Sequence[DelayedQueue]:
        """The queues this worker consumes."""
        return self._core.queues
