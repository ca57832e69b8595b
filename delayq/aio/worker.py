"""AsyncWorker: the asyncio driver of the worker core (``delayq.runtime``): ``async def`` handlers as tasks.

The core (``delayq.runtime._core.Core``) is the threaded ``Worker``'s own: the fair fetch over the
sources, the jobs (heartbeats, batched acks, give-backs), the one outcome decision, the topic
consumers (polls, rebalances, extensions, watermarks) and the schedules; its steps run in
SQLAlchemy's greenlets. What this driver adds: handlers are tasks (at most ``concurrency`` at
once), the loops are tasks, every database call of the core is bounded by ``stall_timeout`` (a
cancelled call drops its connection), and PostgreSQL's LISTEN runs on an async psycopg connection.

A handler past its ``Handler.timeout`` is cancelled by the worker (found by the heartbeat task, or by
``run_once`` as it waits): that is a failed attempt (``TimedOut``), retried or dead-lettered per the
handler's policy, the one outcome decision (``delayq._outcome``). Any other cancellation of a
handler's task releases its message: due again at once, the attempt not counted.

A stop (``stop()``, SIGINT/SIGTERM) is graceful, as the threaded worker's: no new claims, running
handlers may finish within ``shutdown_timeout``; what still runs then is never released while it
runs: ``run()`` returns, and a keeper task goes on extending its locks (and its topic partitions'
leases) and records its outcome when the handler returns. Cancelling ``run()`` instead cancels the
handlers, gives their messages back (the attempt not counted) and re-raises at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import inspect
import logging
import random
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.util import await_only, greenlet_spawn

from delayq import observe
from delayq._outcome import TimedOut
from delayq.aio.bridge import NO_RETRY
from delayq.aio.queue import AsyncDelayedQueue, AsyncDelivery
from delayq.clock import Clock
from delayq.cron.service import CronService
from delayq.dialects import dialect_for
from delayq.errors import InvalidInputError, SchemaMissingError
from delayq.handler import Handler
from delayq.messages import Delivery
from delayq.queue import DelayedQueue
from delayq.runtime import _topic_observe as topic_observe
from delayq.runtime._chores import PruneChore
from delayq.runtime._core import ACK_GATHER, HEARTBEAT_TICK, MIN_IDLE_SLEEP, Core, WorkerHealth, backoff, exit_now
from delayq.runtime._jobs import Job, cancels_among, describe, overdue
from delayq.runtime._sources import QueueSource
from delayq.runtime._topics import TICK as TOPICS_TICK
from delayq.runtime._topics import TopicConsumer, TopicJob
from delayq.schema import DEFAULT_PREFIX
from delayq.topics.delivery import LeaseLostError
from delayq.topics.handler import TopicHandler
from delayq.transactions import DEFAULT_RETRY, TransientRetry, check_api

__all__ = ["AsyncHandler", "AsyncWorker"]

T = TypeVar("T")
log = logging.getLogger("delayq.worker")


class AsyncHandler(Handler):
    """A ``Handler`` whose ``handle`` is a coroutine; the same class attributes (see ``Handler``).

    ``handle(delivery)`` gets an ``AsyncDelivery``; a transactional handler also gets the
    ``AsyncConnection`` of the transaction that deletes the message. Unlike a thread handler, one
    running past its ``timeout`` is cancelled: a failed attempt, retried or dead-lettered per ``retry``.
    """

    async def handle(  # type: ignore[override]
        self, delivery: AsyncDelivery, conn: AsyncConnection | None = None
    ) -> Any:
        """Process one delivery; ``conn`` is given to transactional handlers. What it returns is the
        message's result (kept with a queue history: ``Handler.retention``)."""
        raise NotImplementedError(f"{type(self).__name__}.handle")


class _NotBegun(Exception):
    """A transactional handler's transaction could not begin: the handler did not run."""


class AsyncWorker:
    """Consumes the queues of its ``AsyncHandler``s, and the topics of its ``TopicHandler``s, on the
    running event loop until stopped; declared ``schedules`` are kept installed meanwhile.

    Args:
        engine: an ``AsyncEngine`` on the database holding delayq's tables. Its pool should allow
            a connection per transactional handler plus three (fetch, heartbeat, listener), and
            one more with topic handlers (and one with schedules).
        handlers: ``AsyncHandler`` subclasses or instances, one per queue; ``TopicHandler`` ones,
            one per (topic, group): an ``async def handle`` runs as a task (a transactional one gets the
            ``AsyncConnection`` of the transaction that acks its delivery, exactly once per group), a
            plain ``def`` one on a thread (reported, never cancelled, past its ``timeout``).
            A topic handler acts on its message by returning or raising (``Retry``, ``DeadLetter``),
            not through ``delivery.ack()``.
        concurrency, poll_interval, shutdown_timeout, clock, table_prefix, schema, listen,
            stall_timeout: as for ``Worker`` (the same defaults).
        transient_retry: how the handlers' ``AsyncDelivery`` operations (and their queues')
            retry delayq's own transactions. The worker's claims, extensions and acks are not
            retried in place: its loops back off and go on. Its chores (the pruner, the topic
            consumers and garbage collector) retry as the sync core does, pausing with
            ``asyncio.sleep`` (``delayq.transactions``): never blocking the loop.

    Use ``await worker.run()`` (SIGINT/SIGTERM stop it when run in the main thread),
    ``worker.start()`` + ``await worker.stop()`` inside an application, or
    ``await worker.run_once()`` in tests and scripts. It drives the same core as ``Worker``
    (``delayq.runtime``), by composition: it is not a ``Worker`` subclass.
    """

    #: Whether ``handle`` may be a coroutine function; here it must be.
    runs_coroutines = True

    def __init__(
        self,
        engine: AsyncEngine,
        handlers: Iterable[AsyncHandler | type[AsyncHandler] | TopicHandler | type[TopicHandler]],
        *,
        concurrency: int = 4,
        poll_interval: dt.timedelta = dt.timedelta(seconds=1),
        shutdown_timeout: dt.timedelta = dt.timedelta(seconds=30),
        clock: Clock | None = None,
        table_prefix: str = DEFAULT_PREFIX,
        schema: str | None = None,
        listen: bool = True,
        stall_timeout: dt.timedelta | None = dt.timedelta(seconds=60),
        transient_retry: TransientRetry = DEFAULT_RETRY,
    ) -> None:
        check_api(engine, "AsyncWorker")  # a sync Engine: the error names delayq.Worker
        if not isinstance(engine, AsyncEngine):
            raise TypeError(f"AsyncWorker takes an AsyncEngine, not {type(engine).__name__}")
        core = self._core = Core(
            engine.sync_engine,
            handlers,
            concurrency=concurrency,
            poll_interval=poll_interval,
            shutdown_timeout=shutdown_timeout,
            clock=clock,
            table_prefix=table_prefix,
            schema=schema,
            listen=listen,
            stall_timeout=stall_timeout,
            coroutines=True,
            transient_retry=NO_RETRY,
        )
        self.engine = engine.sync_engine
        self.async_engine = engine
        self.handlers = core.handlers
        self.concurrency = core.concurrency
        self.poll_interval = core.poll_interval
        self.shutdown_timeout = core.shutdown_timeout
        self.clock = clock
        self.name = core.name
        """This worker's name (``host:pid:random``, unique per worker): its topic handlers' subscriber name."""
        self._on_threads: set[int] = set()  # id(consumer) of the sync topic handlers: each run on a thread
        self._in_thread: set[int] = set()  # id(job) of the sync topic handlers whose thread runs now
        for c in core.topics.consumers:
            if not inspect.iscoroutinefunction(c.handler.handle):
                if c.handler.transactional:
                    raise InvalidInputError(
                        f"{type(c.handler).__name__}: a transactional topic handler in an AsyncWorker needs an "
                        "async def handle (its connection is the AsyncEngine's), or use delayq.Worker"
                    )
                self._on_threads.add(id(c))
            c.on_tasks = True
        self.async_queues: dict[str, AsyncDelayedQueue] = {}
        for name, source in core.queue_sources.items():
            h = source.handler
            if not inspect.iscoroutinefunction(h.handle):
                raise InvalidInputError(f"{type(h).__name__}.handle must be a coroutine (async def) in an AsyncWorker")
            # The core's queue (built with NO_RETRY: the worker's loops retry), run by the async one.
            self.async_queues[name] = AsyncDelayedQueue._around(engine, source.queue, transient_retry)
            source.unknown_claims = []  # claims whose reply never came: given back by token
        self._jobs = core.jobs
        self._topics = core.topics
        self._stopping = core.stopping
        self._stopped = core.stopped
        self._tasks: dict[int, asyncio.Task[None]] = {}  # handler tasks by id(job)
        self._in_handler: set[int] = set()  # id(job) of the handlers awaited now (only these are timed out)
        self._timed_out: set[int] = set()  # id(job) of the handlers cancelled at their timeout
        self._lost: set[int] = set()  # id(job) of the handlers cancelled as their message was (or their lock lost)
        self._loop_tasks: dict[str, asyncio.Task[Any]] = {}
        self._nudge: asyncio.Event | None = None
        self._acks_due: asyncio.Event | None = None  # a handled delivery awaits its ack
        self._acking_ends = False  # set: the ack task ends
        self._topics_end = False  # set: the topics task ends
        self._schedules_end: asyncio.Event | None = None  # set: the schedule tasks end
        self._done: asyncio.Event | None = None
        self._main: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._exit_timer: threading.Timer | None = None

    @property
    def queues(self) -> Sequence[DelayedQueue]:
        """The queues this worker consumes (their sync cores; ``async_queues`` has the async ones)."""
        return self._core.queues

    @property
    def handled(self) -> int:
        """Deliveries finished (acked, retried or dead-lettered) so far, of queues and topics."""
        return self._core.handled

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Consume until ``stop()``, SIGINT/SIGTERM (a second one exits at once) or cancellation.

        Raises ``SchemaMissingError`` when delayq's tables are missing at the first fetch.
        """
        self._stopping.clear()
        restore = self._install_loop_signal_handlers()
        try:
            await self._serve()
        finally:
            restore()
        if self._error is not None:
            raise self._error

    def start(self) -> None:
        """Run as a task of the running loop (no signal handling); ``await stop()`` ends it."""
        self._stopping.clear()
        self._stopped.clear()
        self._main = asyncio.get_running_loop().create_task(self._serve(), name="delayq-worker")

    async def stop(self, timeout: float | None = None) -> bool:
        """Stop fetching, let running handlers finish within ``shutdown_timeout``; True once stopped.

        Handlers still running then keep their messages, extended in the background (a task of
        the loop) until they return (``health().held`` counts them)."""
        self._stopping.set()
        self._poke()
        if self._stopped.is_set() or self._done is None:
            return True
        try:
            await asyncio.wait_for(self._done.wait(), timeout if timeout is not None else self.shutdown_timeout + 5)
        except TimeoutError:
            return False
        return True

    def health(self) -> WorkerHealth:
        """Whether the worker runs, its loops are alive, how recently it fetched, how much it holds."""
        return self._core.health(lambda: {name: not t.done() for name, t in self._loop_tasks.items()})

    async def run_once(self) -> int:
        """Handle every message due now, then return how many were handled; a failed claim raises."""
        core = self._core
        self._nudge = asyncio.Event()
        done = 0
        if core.schedules.services:
            await self._call(core.schedules.refresh)
        try:
            if self._topics:
                await self._call(self._topics.rebalance)
            while True:
                try:
                    started = await self._call(
                        core.fetch, self.concurrency, self._start_queue_job, self._start_topic_job, False
                    )
                finally:
                    await self._give_back_unknown_claims()
                new = {t for job in started if (t := self._tasks.get(id(job))) is not None}
                while new:  # (handlers past their timeout are cancelled meanwhile)
                    _, new = await asyncio.wait(new, timeout=HEARTBEAT_TICK)
                    self._cancel_overdue()
                await self._flush_acks()
                if not started:
                    return done
                done += len(started)
        finally:
            if self._topics:
                await self._bounded(self._leave_topics)

    # -- loops ----------------------------------------------------------------------------------
    async def _serve(self) -> None:
        core = self._core
        if self._keeper is not None and not self._keeper.done():  # kept jobs of the last run: hand them over
            self._keeper.cancel()
            await asyncio.wait([self._keeper], timeout=5.0)
        self._stopped.clear()
        self._error = None
        self._nudge, self._acks_due, self._done = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._schedules_end = asyncio.Event()
        self._acking_ends = self._topics_end = False
        current = asyncio.current_task()
        assert current is not None
        self._loop_tasks = {
            "fetch": current,
            "heartbeat": asyncio.create_task(self._heartbeat_task()),
            "ack": asyncio.create_task(self._ack_task()),
        }
        if core.listens:
            self._loop_tasks["listen"] = asyncio.create_task(self._listen_task())
        if self._topics:
            self._loop_tasks["topics"] = asyncio.create_task(self._topics_task())
        if core.topic_gc:
            self._loop_tasks["topics-gc"] = asyncio.create_task(self._topic_gc_task())
        schedules = [asyncio.create_task(self._schedule_task(s)) for s in core.schedules.services.values()]
        if core.pruner is not None:
            schedules.append(asyncio.create_task(self._prune_task(core.pruner)))
        log.info("async %s", core.started_line())
        await self._registry(core.register)
        cancelled = False
        try:
            await self._fetch_task()
        except SchemaMissingError as exc:
            log.error("%s", exc)
            self._error = exc
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            try:
                await self._stop_schedules(schedules)
                await self._shutdown(cancelled)
            finally:
                for name, task in self._loop_tasks.items():
                    if name != "fetch" and not (name == "heartbeat" and self._keeper is not None):
                        task.cancel()
                self._stopped.set()
                self._done.set()

    async def _fetch_task(self) -> None:
        core = self._core
        start_queue, start_topic = self._start_queue_job, self._start_topic_job
        idle_sleep, errors = MIN_IDLE_SLEEP, 0
        while not self._stopping.is_set():
            assert self._nudge is not None
            self._nudge.clear()  # a wake-up from now on ends the next pause
            await self._give_back_unknown_claims()
            try:  # (acks go out from their own task meanwhile)
                free = core.free_slots()
                started = await self._call(core.fetch, free, start_queue, start_topic) if free else []
                errors = 0
            except SchemaMissingError:
                raise
            except Exception as exc:  # anything at all: log, back off, go on
                errors += 1
                log.warning("fetch loop: %s; going on in %.1fs", describe(exc), backoff(errors), exc_info=True)
                await self._pause(backoff(errors))
                continue
            if not free or started:
                idle_sleep = MIN_IDLE_SLEEP
                if not free:
                    await self._pause(self.poll_interval)  # a handler that ends wakes it
            else:
                try:
                    until_due = await self._call(core.until_next_due)
                except Exception:  # (a stalled call) the claim reports database trouble; here: poll
                    until_due = self.poll_interval
                await self._pause(min(idle_sleep, self.poll_interval, until_due))
                idle_sleep = min(idle_sleep * 2, self.poll_interval)

    async def _heartbeat_task(self) -> None:
        """Extend the locks held, half a visibility timeout before they would expire; cancel the handlers past
        their timeout."""
        errors = 0
        while not _asked_to_end():  # (it outlives run() while a keeper runs: asyncio.run's end cancels it)
            self._cancel_overdue()
            try:
                ok = await self._call(self._core.beat)
                self._cancel_lost()
            except Exception as exc:
                log.warning("heartbeat: %s", describe(exc), exc_info=True)
                ok = False
            errors = 0 if ok else errors + 1
            await asyncio.sleep(backoff(errors) if errors else HEARTBEAT_TICK)

    async def _topics_task(self) -> None:
        """The topic handlers' upkeep, as the threaded worker's topics thread: rebalances, extensions of the
        deliveries whose handlers run, watermarks (``TopicConsumer.maintain``, which never raises)."""
        while not self._topics_end:
            try:
                await self._call(self._maintain_topics)
            except Exception as exc:  # (a stalled call) the next round tries again
                log.warning("topics: %s", describe(exc))
            await asyncio.sleep(TOPICS_TICK)

    async def _topic_gc_task(self) -> None:
        """The worker's topic garbage collection, as the threaded worker's thread (``TopicCollector``): a
        round in a greenlet, then a wait; it ends with the topics task."""
        collector = self._core.topic_gc
        wait = min(collector.interval, 1.0) * random.random()
        while not self._topics_end:
            if wait > 0:
                await asyncio.sleep(min(wait, 0.5))
                wait -= 0.5
                continue
            try:
                wait = await self._call(collector.next_wait)
            except Exception as exc:  # (a stalled call) the next round tries again
                log.warning("topic garbage collection: %s", describe(exc))
                wait = collector.interval

    async def _stop_topics_task(self) -> None:
        """End the topics task between two rounds (cancelled inside one, its transaction would stay open on a
        connection nobody returns); a round stuck for 10 s is cancelled all the same."""
        task = self._loop_tasks.get("topics")
        if task is None or task.done():
            return
        self._topics_end = True
        gc = self._loop_tasks.get("topics-gc")
        await asyncio.wait([task] if gc is None else [task, gc], timeout=10.0)
        task.cancel()
        if gc is not None:
            gc.cancel()

    def _maintain_topics(self) -> None:
        for c in self._topics.consumers:
            c.maintain(self._poke)

    def _leave_topics(self) -> None:
        for c in self._topics.consumers:
            c.leave()

    async def _schedule_task(self, service: CronService) -> None:
        """Keep one queue's declared schedules installed, as the threaded worker's cron thread does: a round
        at once, then at the service's interval (``min_refresh`` after a failure)."""
        assert self._schedules_end is not None
        while not self._schedules_end.is_set():
            try:
                await self._call(service.refresh)
                wait = service.refresh_interval()
            except Exception as exc:  # a background loop survives anything: log, try again soon
                log.warning("cron refresh of queue %s failed (%s); trying again soon", service.queue.name, exc)
                wait = service.min_refresh
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._schedules_end.wait(), wait.total_seconds())

    async def _prune_task(self, pruner: PruneChore) -> None:
        """The pruner's loop, as the threaded worker's pruner thread (ended with the schedule tasks)."""
        assert self._schedules_end is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._schedules_end.wait(), pruner.pause())
            if self._schedules_end.is_set():
                return
            try:
                await self._call(pruner.step)
            except Exception as exc:  # a stalled round (``step`` logs its own failures)
                log.warning("pruner: %s", describe(exc))

    async def _stop_schedules(self, tasks: list[asyncio.Task[None]]) -> None:
        """End the schedule tasks between two rounds; a round stuck for 5 s is cancelled."""
        if self._schedules_end is not None:
            self._schedules_end.set()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
            for t in tasks:
                t.cancel()

    async def _ack_task(self) -> None:
        """Ack handled deliveries in batches beside the claims, as ``Worker``'s ack loop does: a claim and
        an ack each wait for a round trip (and a commit); from two connections they do not wait for each other."""
        assert self._acks_due is not None
        while not self._acking_ends:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._acks_due.wait(), self.poll_interval)
                if not self._acking_ends:
                    await asyncio.sleep(ACK_GATHER)  # the rest of a batch's handlers finish meanwhile
            self._acks_due.clear()
            await self._flush_acks()  # on a quiet tick too: what a row lock held back last time

    async def _stop_ack_task(self) -> None:
        """End the ack task (the shutdown acks from here on): a flush under way may finish, for 2 s at most."""
        task = self._loop_tasks.get("ack")
        if task is None or task.done():
            return
        self._acking_ends = True
        assert self._acks_due is not None
        self._acks_due.set()
        await asyncio.wait([task], timeout=2.0)
        task.cancel()

    async def _listen_task(self) -> None:
        errors = 0
        wakes = self._core.wakes
        while not _asked_to_end():
            try:
                listener = dialect_for(self.engine).listen_async(self.async_engine, self._core.channel, cancels=True)
                async for name in listener:
                    errors = 0
                    if self._core.heard_cancel(name):
                        self._cancel_lost()
                    elif wakes(name):
                        self._poke()
            except Exception as exc:  # the listener must survive anything; polling goes on meanwhile
                errors += 1
                log.warning("LISTEN connection failed (%s); reconnecting in %.1fs", describe(exc), backoff(errors))
                await asyncio.sleep(backoff(errors))

    # -- shutdown -------------------------------------------------------------------------------
    async def _shutdown(self, cancelled: bool) -> None:
        """As the threaded worker's: no new claims; running handlers may finish within ``shutdown_timeout``
        (acking meanwhile); what still runs then is kept (``_keep``), never released while it runs. A
        cancelled ``run()`` cancels the handlers instead: each gives its message back."""
        core = self._core
        await self._give_back_unknown_claims()
        await self._stop_ack_task()
        deadline = time.monotonic() + (0.0 if cancelled else self.shutdown_timeout)
        while True:
            await self._flush_acks()
            left = deadline - time.monotonic()
            if core.free_slots() == self.concurrency or left <= 0:
                break
            await self._pause(min(0.1, left))
        running = list(self._tasks.values())
        if running and cancelled:
            log.warning("run() cancelled: cancelling %d handler(s); their messages are given back", len(running))
            for task in running:
                task.cancel()  # each gives its message back
            await asyncio.wait(running, timeout=5.0)
        if self._topics:
            await self._stop_topics_task()  # no rebalance from here on
        kept = [c for c in self._topics.consumers if c.running()]
        for c in self._topics.consumers:
            if c not in kept:
                await self._bounded(c.leave)
        await self._flush_acks()
        if self._tasks:
            core.warn_kept(len(self._tasks))
            for c in kept:
                await self._bounded(c.keep, True)  # hold only the busy partitions
            self._keeper = asyncio.get_running_loop().create_task(self._keep(kept), name="delayq-keeper")
        else:
            core.forget_unacked()
        await self._registry(core.deregister)
        log.info("async worker stopped")

    async def _keep(self, consumers: list[TopicConsumer]) -> None:
        """After the stop, while kept handlers run: extend their locks (the heartbeat task goes on), cancel
        them at their timeout, hold their partitions, ack what they finish; then leave and end."""
        heartbeat = self._loop_tasks.get("heartbeat")
        try:
            while self._tasks or consumers:
                await asyncio.sleep(HEARTBEAT_TICK)
                await self._flush_acks()
                left = []
                for c in consumers:
                    try:
                        if not await self._call(c.keep):
                            left.append(c)
                    except Exception as exc:  # (a stalled call) the next round tries again
                        log.warning("topics: %s", describe(exc))
                        left.append(c)
                consumers = left
            await self._flush_acks()
            self._core.forget_unacked()
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            self._keeper = None

    async def _flush_acks(self) -> None:
        try:
            freed = await self._call(self._core.flush_acks)
        except Exception as exc:  # (a stalled call) the next flush tries again
            log.warning("could not ack: %s", describe(exc))
            return
        if freed:  # a limited queue's claims no longer count these: the fetch may find work now
            self._poke()

    # -- claims ---------------------------------------------------------------------------------
    async def _give_back_unknown_claims(self) -> None:
        """Give back what the claims that never came back took (due as when claimed, the attempt not counted),
        each in delayq's own retried transaction, bounded by ``stall_timeout``."""
        for name, source in self._core.queue_sources.items():
            tokens = source.unknown_claims
            while tokens:
                await self._give_back_claim(self.async_queues[name], tokens.pop())

    async def _give_back_claim(self, aq: AsyncDelayedQueue, token: str) -> None:
        try:
            async with asyncio.timeout(self._core.stall_timeout):
                given = await aq.bridge.run(None, lambda u: aq.sync._give_back([token], using=u))
        except Exception as exc:
            log.warning(
                "queue %s: could not give back a claim whose reply never came (%s); "
                "its messages return after their lock expires",
                aq.name,
                describe(exc),
            )
            return
        if given:
            log.info("queue %s: gave back %d message(s) of a claim whose reply never came", aq.name, given)

    # -- one job --------------------------------------------------------------------------------
    def _cancel_overdue(self) -> None:
        """Cancel (once) each handler found running past its ``timeout``: a failed attempt, decided as any."""
        for job, label, timeout, counted_as in self._core.overdue_jobs():
            task = self._tasks.get(id(job))
            if task is None or task.done():
                continue  # (it returned: that stands)
            if id(job) in self._in_thread:  # a sync handler's thread cannot be stopped: reported, not cancelled
                overdue(label, time.monotonic() - job.started_at, timeout)
                observe.count("overdue", counted_as)
                continue
            if id(job) not in self._in_handler:
                continue  # (it records its outcome: that stands)
            overdue(label, time.monotonic() - job.started_at, timeout, cancelled=True)
            observe.count("overdue", counted_as)
            self._timed_out.add(id(job))
            task.cancel()

    def _cancel_lost(self) -> None:
        """Cancel (once) each handler whose message was cancelled or whose lock was lost: nothing is recorded.

        A job whose task has not taken its first step yet (made in this loop turn) needs no cancellation: that
        step finds the job lost and never runs the handler (``_handle``)."""
        for job in self._jobs.lost_running():
            task = self._tasks.get(id(job))
            if task is None or task.done() or id(job) not in self._in_handler:
                continue  # (not started: it never runs; returned: its outcome changes nothing, the lock being gone)
            self._lost.add(id(job))
            task.cancel()

    def _start_queue_job(self, source: QueueSource, job: Job) -> None:
        """Start a queue job's handler as a task (called by the core's fetch, on the loop's thread)."""
        self._tasks[id(job)] = asyncio.get_running_loop().create_task(self._handle(job))

    def _start_topic_job(self, consumer: TopicConsumer, job: TopicJob) -> None:
        self._tasks[id(job)] = asyncio.get_running_loop().create_task(self._handle_topic(consumer, job))

    async def _handle_topic(self, consumer: TopicConsumer, job: TopicJob) -> None:
        """Await a topic handler; its outcome (``TopicConsumer.finish``: the one decision) is recorded in a
        greenlet. A timeout is a failed attempt; any other cancellation gives the delivery back."""
        handler = consumer.handler
        error: Exception | None = None
        done = self._poke
        if id(consumer) in self._on_threads:
            return await self._handle_topic_on_thread(consumer, job)
        try:
            try:
                self._in_handler.add(id(job))
                try:
                    with topic_observe.running(job):
                        if handler.transactional:
                            if not await self._handle_topic_in_transaction(consumer, job):
                                await self._bounded(consumer.forget, job, done)
                                return
                        else:
                            handle = cast(Callable[[Any], Awaitable[None]], handler.handle)  # async: checked at init
                            await handle(job.delivery)
                finally:
                    self._in_handler.discard(id(job))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if id(job) in self._timed_out and task is not None and task.uncancel() == 0:
                    timeout = handler.timeout
                    assert timeout is not None
                    error = TimedOut(timeout)
                else:
                    await self._bounded(consumer.give_back, job, done, "its handler was cancelled")
                    raise
            except _NotBegun as exc:  # no connection for its transaction: the handler did not run, give it back
                log.warning("%s: its transaction could not begin (%s)", job.label, describe(exc.__cause__ or exc))
                await self._bounded(consumer.give_back, job, done, "the handler's transaction could not begin")
                return
            except Exception as exc:  # whatever the handler raised is a failed attempt, or Retry / DeadLetter
                error = exc
            if handler.transactional and error is None:
                topic_observe.outcome(consumer, job, "acked", None)
                await self._bounded(consumer.forget, job, done)  # acked in its transaction
            else:
                await self._bounded(consumer.finish, job, error, done)
        finally:
            self._tasks.pop(id(job), None)
            self._timed_out.discard(id(job))
            self._poke()

    async def _handle_topic_on_thread(self, consumer: TopicConsumer, job: TopicJob) -> None:
        """A sync topic handler, run on a thread (``asyncio.to_thread``). A thread cannot be stopped: past its
        ``timeout`` it is reported, not cancelled, and if its task is cancelled (``run()`` cancelled, the loop
        ending) the delivery stays held until the thread returns; its outcome is then recorded as usual."""
        with topic_observe.running(job):  # (the task copies the context: the thread runs in it)
            thread = asyncio.ensure_future(asyncio.to_thread(consumer.handler.handle, job.delivery))
        cancelled: asyncio.CancelledError | None = None
        self._in_thread.add(id(job))
        try:
            while not thread.done():
                try:
                    await asyncio.shield(thread)
                except asyncio.CancelledError as exc:
                    if not thread.done():
                        cancelled = exc  # the thread runs on: wait for it, then record its outcome
                except Exception:
                    pass  # (its outcome, below)
            self._in_thread.discard(id(job))
            error = thread.exception()
            if error is not None and not isinstance(error, Exception):
                raise error
            await self._bounded(consumer.finish, job, error, self._poke)
        finally:
            self._in_thread.discard(id(job))
            self._tasks.pop(id(job), None)
            self._poke()
        if cancelled is not None:
            raise cancelled

    async def _handle_topic_in_transaction(self, consumer: TopicConsumer, job: TopicJob) -> bool:
        """Run a transactional topic handler and the fenced ack in delayq's one transaction, as the threaded
        worker does (``Subscription.handle_exactly_once``: exactly once per group), the handler awaited
        with an ``AsyncConnection`` on it; False when the lease or the delivery was lost (its writes rolled
        back), ``_NotBegun`` when the transaction could not begin."""
        handle = cast(Callable[[Any, AsyncConnection], Awaitable[None]], consumer.handler.handle)
        begun = False

        def in_transaction(conn: Connection) -> None:
            nonlocal begun
            begun = True  # from here on it is an attempt
            await_only(handle(job.delivery, AsyncConnection(self.async_engine, conn)))

        try:
            await greenlet_spawn(consumer.sub.handle_exactly_once, job.delivery, in_transaction)
        except LeaseLostError:
            topic_observe.outcome(consumer, job, "lease_lost", None)
            log.warning("%s: lease lost while handling; its writes were rolled back", job.label)
            return False
        except Exception as exc:
            if begun:
                raise
            raise _NotBegun from exc
        return True

    async def _handle(self, job: Job) -> None:
        handler, delivery = cast(AsyncHandler, job.handler), job.delivery  # async handle: checked at init
        aq = self.async_queues[job.queue.name]
        to_ack = False
        try:
            if job.lost:  # cancelled (or its lock lost) before this task's first step: its handler never runs
                log.info("%s: not started: the message was cancelled, or its lock lost", delivery.label)
                return
            self._in_handler.add(id(job))
            try:
                if handler.transactional:
                    await self._handle_in_transaction(
                        handler, aq, AsyncDelivery(delivery, aq), self._core.stall_timeout
                    )
                else:
                    started = time.monotonic()
                    result = await _observed(delivery, handler.handle(AsyncDelivery(delivery, aq)))
                    delivery._finished_with(result, dt.timedelta(seconds=time.monotonic() - started))
                    to_ack = True
            finally:
                self._in_handler.discard(id(job))
        except _NotBegun as exc:  # no connection for the handler: not an attempt, give it back
            log.warning("%s: its transaction could not begin (%s)", delivery.label, describe(exc.__cause__ or exc))
            await self._bounded(self._jobs.release, [job], "the handler's transaction could not begin")
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if id(job) in self._lost and task is not None and task.uncancel() == 0:
                # Its message was cancelled (or its lock lost), and nothing else cancelled it: nothing to record.
                log.info("%s: its handler was cancelled: the message was cancelled, or its lock lost", delivery.label)
            elif id(job) in self._timed_out and task is not None and task.uncancel() == 0:
                # Cancelled at its timeout, and by nothing else: a failed attempt, retried per the policy.
                timeout = handler.timeout
                assert timeout is not None
                await self._bounded(_record_failure, job, TimedOut(timeout))
            else:  # the message goes back at once, the attempt not counted
                await self._bounded(self._jobs.release, [job], "its handler was cancelled")
                raise
        except Exception as exc:  # whatever the handler raised is a failed attempt, or Retry / DeadLetter
            if job.lost:  # cancelled, or the lock lost: a retry or dead letter would change nothing
                log.info("%s: failed after its lock was gone (%s); nothing recorded", delivery.label, describe(exc))
            else:
                await self._bounded(_record_failure, job, exc)
        finally:
            self._jobs.finish(job, to_ack)  # the ack follows, with others, from the ack task
            self._tasks.pop(id(job), None)
            self._timed_out.discard(id(job))
            self._lost.discard(id(job))
            if to_ack and self._acks_due is not None:
                self._acks_due.set()
            self._poke()

    @staticmethod
    async def _handle_in_transaction(
        handler: AsyncHandler, aq: AsyncDelayedQueue, delivery: AsyncDelivery, call_bound: float | None
    ) -> None:
        """Run the handler and the ack in one transaction; ``_NotBegun`` when it could not begin.

        As on threads, the ack and the COMMIT, delayq's calls, are bounded by ``call_bound`` (the stall
        timeout): a COMMIT into a connection that went silent is given up (``TimeoutError``, a failed
        attempt) instead of holding the handler's slot, and the worker's stop, for good."""
        begun = lost = False
        bound = asyncio.timeout(None)  # armed once the handler has returned
        try:
            async with bound, aq.transaction() as conn:
                begun = True
                started = time.monotonic()
                result = await _observed(delivery.delivery, handler.handle(delivery, conn))
                took = dt.timedelta(seconds=time.monotonic() - started)
                if call_bound is not None:
                    bound.reschedule(asyncio.get_running_loop().time() + call_bound)
                if not await delivery.ack(result=result, duration=took, using=conn):
                    await conn.rollback()
                    lost = True
        except Exception as exc:
            if begun:
                raise
            raise _NotBegun from exc
        if lost and not await greenlet_spawn(cancels_among, aq.sync, [delivery.delivery]):
            log.warning("%s: lock lost while handling; its writes were rolled back", delivery.label)

    # -- plumbing -------------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """A sync step of the core, in a greenlet, bounded by ``stall_timeout``.

        A driver may take the timeout's cancellation in hand and raise ``CancelledError`` later
        (psycopg first waits up to 5 s for the server to cancel the query): when no one else asked
        to cancel this task, that is the stall timeout still, not the end of the worker.
        """
        bound = self._core.stall_timeout
        scope = asyncio.timeout(bound)
        try:
            async with scope:
                return await greenlet_spawn(fn, *args)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if scope.expired() and task is not None and task.cancelling() == 0:
                raise TimeoutError(f"a database call took longer than {bound}s") from None
            raise

    async def _bounded(self, fn: Callable[..., Any], *args: Any) -> None:
        """``_call`` for recording an outcome: a stalled call is given up (the message comes back after its
        lock expires, as when its outcome cannot be recorded)."""
        try:
            await self._call(fn, *args)
        except TimeoutError as exc:
            log.warning("could not record an outcome (%s); the message returns after its lock expires", exc)

    async def _registry(self, step: Callable[[], None]) -> None:
        """A worker registry step (it logs its own failures); a stalled call is given up (logged)."""
        try:
            await self._call(step)
        except Exception as exc:
            log.warning("worker registry: %s", describe(exc))

    async def _pause(self, seconds: float) -> None:
        """Sleep up to ``seconds``; a wake-up (a handler ended, a notification, a stop) ends it early."""
        assert self._nudge is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._nudge.wait(), max(seconds, 0.0))
        self._nudge.clear()

    def _poke(self) -> None:
        if self._nudge is not None:
            self._nudge.set()

    def _install_loop_signal_handlers(self) -> Callable[[], None]:
        """SIGINT/SIGTERM on the loop: the first stops the worker gracefully (and arms an exit in
        bounded time, as ``Worker`` does), a second exits at once."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        count = 0

        def on_signal(signum: int) -> None:
            nonlocal count
            count += 1
            if count > 1:
                log.warning("second signal: exiting at once")
                exit_now(signum, 0.0)
            self._exit_timer = self._core.on_stop_signal(signum, self._poke)

        for s in signals:
            loop.add_signal_handler(s, on_signal, s)

        def restore() -> None:
            if self._exit_timer is not None:
                self._exit_timer.cancel()
                self._exit_timer = None
            for s in signals:
                loop.remove_signal_handler(s)

        return restore


def _asked_to_end() -> bool:
    """Whether the running task was cancelled, even if the ``CancelledError`` never reached it: the loops that
    only a cancellation ends check this each round. On Python 3.11 an ``asyncio.wait_for`` whose call completes
    in the loop turn of the cancellation returns the result and drops the error (asyncmy connects inside one, and
    a heartbeat after ``engine.dispose()`` connects anew); the request stays counted (``Task.cancelling``).
    Without this, that heartbeat would go on beating, and ``asyncio.run``, which waits for the tasks it cancels
    at its end, would never return."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _record_failure(job: Job, exc: Exception) -> None:
    """``QueueSource.record_failure`` in a greenlet, with ``exc`` as the exception being handled there
    (the attempt history reads its type and traceback from ``sys.exc_info()``)."""
    try:
        raise exc
    except Exception:
        QueueSource.record_failure(job, exc)


async def _observed(delivery: Delivery, call: Awaitable[Any]) -> Any:
    """Await the handler's ``call`` inside ``observe.handling``, the delivery log, metrics and tracing
    hearing of it; observers are called in a greenlet, on entry and on exit, when one may read the database
    through the sync core (tracing reads the trace context), else directly (a greenlet costs 10-20 µs)."""
    observed = observe.handling(delivery)
    in_greenlet = observed.reads_database
    if in_greenlet:
        await greenlet_spawn(observed.__enter__)
    else:
        observed.__enter__()
    try:
        result = await call
    except BaseException as exc:
        if in_greenlet:
            await greenlet_spawn(observed.__exit__, type(exc), exc, exc.__traceback__)
        else:
            observed.__exit__(type(exc), exc, exc.__traceback__)
        raise
    if in_greenlet:
        await greenlet_spawn(observed.__exit__, None, None, None)
    else:
        observed.__exit__(None, None, None)
    return result
