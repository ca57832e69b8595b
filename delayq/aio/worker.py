"""AsyncWorker: runs ``async def handle(...)`` handlers on an event loop, as ``Worker`` runs threads.

It is the threaded ``Worker`` with its waits made awaitable: the fair fetch (``Worker._fetch``),
the leases (heartbeats, batched acks, release), the outcome of a failed attempt and the wake-up
channel, and the topic consumers (``delayq.topics.consumer``: polls, rebalances, extensions,
watermarks, outcomes) are the threaded worker's own, run in SQLAlchemy's greenlets. What differs: handlers are
tasks (at most ``concurrency`` at once), the loops are tasks, every database call of the fetch loop
and the heartbeat is bounded by ``stall_timeout`` (a cancelled call drops its connection), and
PostgreSQL's LISTEN runs on an async psycopg connection.

A handler past its ``Handler.timeout`` is cancelled by the worker (found by the heartbeat task, or by
``run_once`` as it waits): that is a failed attempt (``TimedOut``), retried or dead-lettered per the
handler's policy, the one outcome decision (``delayq._outcome``). Any other cancellation of a
handler's task (or the worker's) releases its message: due again at once, the attempt not counted.
Cancelling ``run()`` releases everything held and re-raises at once; a stop (``stop()``,
SIGINT/SIGTERM) is graceful: no new fetches, running handlers may finish within
``shutdown_timeout``, the rest are cancelled and released.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import inspect
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from types import MappingProxyType
from typing import Any, TypeVar, cast

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.util import greenlet_spawn

from delayq import observe
from delayq._outcome import TimedOut
from delayq.aio.queue import AsyncDelayedQueue, AsyncDelivery
from delayq.clock import Clock
from delayq.dialects import dialect_for
from delayq.errors import InvalidInputError, SchemaMissingError
from delayq.handler import Handler
from delayq.leases import Lease, describe, overdue
from delayq.messages import Delivery
from delayq.schema import DEFAULT_PREFIX
from delayq.threads import DaemonPool, Task
from delayq.topics.consumer import TICK as TOPICS_TICK
from delayq.topics.consumer import Held, TopicConsumer
from delayq.topics.handler import TopicHandler
from delayq.transactions import DEFAULT_RETRY, TransientRetry, check_api
from delayq.worker import ACK_GATHER, HEARTBEAT_TICK, MIN_IDLE_SLEEP, Worker, WorkerHealth, backoff

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
    ) -> None:
        """Process one delivery; ``conn`` is given to transactional handlers."""
        raise NotImplementedError(f"{type(self).__name__}.handle")


class _NotBegun(Exception):
    """A transactional handler's transaction could not begin: the handler did not run."""


class _StartNow(DaemonPool):
    """The fetch's "pool" on the event loop: a submitted call runs at once (it starts a task)."""

    def __init__(self) -> None:
        super().__init__(0, "delayq-async")  # no threads

    def submit(self, fn: Callable[[], None]) -> Task:
        task = self.task(fn)
        task.run()
        return task

    def shutdown(self) -> None:
        pass


class AsyncWorker(Worker):
    """Consumes the queues of its ``AsyncHandler``s, and the topics of its async ``TopicHandler``s, on the
    running event loop until stopped.

    Args:
        engine: an ``AsyncEngine`` on the database holding delayq's tables. Its pool should allow
            a connection per transactional handler plus three (fetch, heartbeat, listener), and
            one more with topic handlers.
        handlers: ``AsyncHandler`` subclasses or instances, one per queue; ``TopicHandler`` ones
            whose ``handle(delivery)`` is ``async def``, one per (topic, group), run through the
            threaded worker's own topic consumers (not transactional ones yet). A topic handler
            acts on its message by returning or raising (``Retry``, ``DeadLetter``), not through
            ``delivery.ack()``.
        concurrency, poll_interval, shutdown_timeout, clock, table_prefix, schema, listen,
            stall_timeout: as for ``Worker`` (the same defaults).
        transient_retry: how the handlers' ``AsyncDelivery`` operations (and their queues')
            retry delayq's own transactions. The worker's own calls are not retried in place:
            its loops back off and go on, as the threaded worker's do.

    Use ``await worker.run()`` (SIGINT/SIGTERM stop it when run in the main thread),
    ``worker.start()`` + ``await worker.stop()`` inside an application, or
    ``await worker.run_once()`` in tests and scripts. Declared ``schedules`` are not run here yet.
    """

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
        super().__init__(
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
        )
        self.async_engine = engine
        for c in self._topics.consumers:
            name = type(c.handler).__name__
            if not inspect.iscoroutinefunction(c.handler.handle):
                raise InvalidInputError(
                    f"{name}.handle must be a coroutine (async def) in an AsyncWorker, or use delayq.Worker"
                )
            if c.handler.transactional:
                raise InvalidInputError(
                    f"{name}: AsyncWorker does not run transactional topic handlers yet (use delayq.Worker)"
                )
            c.on_tasks = True
        self.async_queues: dict[str, AsyncDelayedQueue] = {}
        for name, (h, _) in list(self._queues.items()):
            if not inspect.iscoroutinefunction(h.handle):
                raise InvalidInputError(f"{type(h).__name__}.handle must be a coroutine (async def) in an AsyncWorker")
            if h.schedules:
                raise InvalidInputError(
                    f"{type(h).__name__} declares schedules: AsyncWorker does not run them yet (use delayq.Worker)"
                )
            aq = AsyncDelayedQueue(
                engine,
                name,
                serializer=h.serializer,
                visibility_timeout=h.visibility_timeout,
                clock=clock,
                table_prefix=table_prefix,
                schema=schema,
                transient_retry=transient_retry,
                max_deliveries=h.retry.max_attempts,
            )
            self.async_queues[name] = aq
            self._queues[name] = (h, aq.sync)  # the sync core, retried by the worker's loops
        self._tasks: dict[int, asyncio.Task[None]] = {}  # handler tasks by id(lease)
        self._in_handler: set[int] = set()  # id(lease) of the handlers awaited now (only these are timed out)
        self._timed_out: set[int] = set()  # id(lease) of the handlers cancelled at their timeout
        self._unknown_claims: list[tuple[str, str]] = []  # (queue, token) of claims whose reply never came
        self._loop_tasks: dict[str, asyncio.Task[Any]] = {}
        self._nudge: asyncio.Event | None = None
        self._acks_due: asyncio.Event | None = None  # a handled delivery awaits its ack
        self._acking_ends = False  # set: the ack task ends
        self._topics_end = False  # set: the topics task ends
        self._done: asyncio.Event | None = None
        self._main: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:  # type: ignore[override]
        """Consume until ``stop()``, SIGINT/SIGTERM (a second one exits at once) or cancellation.

        Raises ``SchemaMissingError`` when delayq's tables are missing at the first fetch.
        """
        self._stopping.clear()
        restore = self._install_loop_signal_handlers()
        try:
            await self._serve_async()
        finally:
            restore()
        if self._error is not None:
            raise self._error

    def start(self) -> None:
        """Run as a task of the running loop (no signal handling); ``await stop()`` ends it."""
        self._stopping.clear()
        self._stopped.clear()
        self._main = asyncio.get_running_loop().create_task(self._serve_async(), name="delayq-worker")

    async def stop(self, timeout: float | None = None) -> bool:  # type: ignore[override]
        """Stop fetching, let running handlers finish, release the rest; True once fully stopped."""
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
        running = not self._stopped.is_set()
        last = self._last_fetch
        return WorkerHealth(
            running=running,
            loops=MappingProxyType({name: running and not t.done() for name, t in self._loop_tasks.items()}),
            seconds_since_fetch=None if last is None else time.monotonic() - last,
            held=len(self._leases) + self._topics.running(),
            stuck=self._leases.stuck() + self._topics.stuck(),
        )

    async def run_once(self) -> int:  # type: ignore[override]
        """Handle every message due now, then return how many were handled; a failed claim raises."""
        self._pool = _StartNow()
        self._nudge = asyncio.Event()
        done = 0
        try:
            if self._topics:
                await self._call(self._topics.rebalance)
            while True:
                before = set(self._tasks.values())
                try:
                    started = await self._call(functools.partial(self._fetch, self.concurrency, guard=False))
                finally:
                    await self._give_back_unknown_claims()
                new = {t for t in self._tasks.values() if t not in before}
                while new:  # (handlers past their timeout are cancelled meanwhile)
                    _, new = await asyncio.wait(new, timeout=HEARTBEAT_TICK)
                    self._cancel_overdue()
                await self._call(self._flush_acks)
                if not started:
                    return done
                done += len(started)
        finally:
            if self._topics:
                await self._bounded(self._leave_topics)

    # -- loops ----------------------------------------------------------------------------------
    async def _serve_async(self) -> None:
        self._stopped.clear()
        self._error = None
        self._pool = _StartNow()
        self._nudge, self._acks_due, self._done = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._acking_ends = self._topics_end = False
        current = asyncio.current_task()
        assert current is not None
        self._loop_tasks = {
            "fetch": current,
            "heartbeat": asyncio.create_task(self._heartbeat_task()),
            "ack": asyncio.create_task(self._ack_task()),
        }
        if self._listen and self._channel and dialect_for(self.engine).can_notify:
            self._loop_tasks["listen"] = asyncio.create_task(self._listen_task())
        if self._topics:
            self._loop_tasks["topics"] = asyncio.create_task(self._topics_task())
        log.info(
            "async worker %s started: queues %s; topics %s; concurrency %d",
            self.name,
            ", ".join(self._queues) or "none",
            self._topics or "none",
            self.concurrency,
        )
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
                await self._shutdown_async(grace=0.0 if cancelled else self.shutdown_timeout)
            finally:
                for name, task in self._loop_tasks.items():
                    if name != "fetch":
                        task.cancel()
                self._stopped.set()
                self._done.set()

    async def _fetch_task(self) -> None:
        idle_sleep, errors = MIN_IDLE_SLEEP, 0
        while not self._stopping.is_set():
            assert self._nudge is not None
            self._nudge.clear()  # a wake-up from now on ends the next pause
            await self._give_back_unknown_claims()
            try:  # (acks go out from their own task meanwhile)
                free = self._free_slots()
                started = await self._call(self._fetch, free) if free else []
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
                    until_due = await self._call(self._until_next_due)
                except Exception:  # (a stalled call) the claim reports database trouble; here: poll
                    until_due = self.poll_interval
                await self._pause(min(idle_sleep, self.poll_interval, until_due))
                idle_sleep = min(idle_sleep * 2, self.poll_interval)

    async def _heartbeat_task(self) -> None:
        """Extend the locks held, half a visibility timeout before they would expire; cancel the handlers past
        their timeout."""
        errors = 0
        while True:
            self._cancel_overdue()
            try:
                ok = await self._call(self._leases.beat)
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

    async def _stop_topics_task(self) -> None:
        """End the topics task between two rounds (cancelled inside one, its transaction would stay open on a
        connection nobody returns); a round stuck for 10 s is cancelled all the same."""
        task = self._loop_tasks.get("topics")
        if task is None or task.done():
            return
        self._topics_end = True
        await asyncio.wait([task], timeout=10.0)
        task.cancel()

    def _maintain_topics(self) -> None:
        for c in self._topics.consumers:
            c.maintain(self._poke)

    def _leave_topics(self) -> None:
        for c in self._topics.consumers:
            c.leave()

    async def _ack_task(self) -> None:
        """Ack handled deliveries in batches beside the claims, as ``Worker._ack_loop`` does: a claim and
        an ack each wait for a round trip (and a commit); from two connections they do not wait for each other."""
        assert self._acks_due is not None
        while not self._acking_ends:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._acks_due.wait(), self.poll_interval)
                if not self._acking_ends:
                    await asyncio.sleep(ACK_GATHER)  # the rest of a batch's handlers finish meanwhile
            self._acks_due.clear()
            await self._flush_acks_async()  # on a quiet tick too: what a row lock held back last time

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
        while True:
            try:
                async for queue_name in dialect_for(self.engine).listen_async(self.async_engine, self._channel):
                    errors = 0
                    if queue_name in self._queues:
                        self._poke()
            except Exception as exc:  # the listener must survive anything; polling goes on meanwhile
                errors += 1
                log.warning("LISTEN connection failed (%s); reconnecting in %.1fs", describe(exc), backoff(errors))
                await asyncio.sleep(backoff(errors))

    async def _shutdown_async(self, grace: float) -> None:
        """Wait for running handlers (acking meanwhile) up to ``grace`` seconds, then cancel and
        release what still runs."""
        await self._give_back_unknown_claims()
        await self._stop_ack_task()
        deadline = time.monotonic() + grace
        while True:
            await self._flush_acks_async()
            left = deadline - time.monotonic()
            if self._free_slots() == self.concurrency or left <= 0:
                break
            await self._pause(min(0.1, left))
        running = list(self._tasks.values())
        if running:
            log.warning("%d handler(s) still running after %.0fs: cancelling them", len(running), grace)
            for task in running:
                task.cancel()  # each releases its message
            await asyncio.wait(running, timeout=5.0)
        # A task cancelled before its first step never ran its handler, nor the release: give those back here.
        unstarted = [x for x in self._leases.still_running() if (t := self._tasks.get(id(x))) is None or t.done()]
        if unstarted:
            await self._bounded(self._leases.release, unstarted, "cancelled before its handler started")
        for c in self._topics.consumers:
            for held in c.holding():
                if (t := self._tasks.get(id(held))) is None or t.done():
                    await self._bounded(c.give_back, held, self._poke, "cancelled before its handler started")
        if self._topics:
            await self._stop_topics_task()  # no rebalance after leaving
            await self._bounded(self._leave_topics)
        await self._flush_acks_async()
        unacked = self._leases.clear()
        if unacked:
            log.warning("%d handled message(s) could not be acked; they return after their timeout", unacked)
        log.info("async worker stopped")

    async def _flush_acks_async(self) -> None:
        try:
            await self._call(self._flush_acks)
        except Exception as exc:  # (a stalled call) the next flush tries again
            log.warning("could not ack: %s", describe(exc))

    # -- claims ---------------------------------------------------------------------------------
    def _claim(self, name: str, limit: int, guard: bool) -> list[Task]:
        """``Worker._claim``, noting a claim that did not come back: cancelled (``run()`` cancelled, or the
        stall timeout) or failed while it was in flight. The server may have committed it, and no lease
        holds its messages: ``_give_back_unknown_claims`` gives them back by the claim's token."""
        queue = self._queues[name][1]
        try:
            started = super()._claim(name, limit, guard)
        except BaseException:
            self._note_unknown_claim(name, queue._claiming)
            raise
        self._note_unknown_claim(name, queue._claiming)  # set only when the claim failed (and was logged)
        return started

    def _note_unknown_claim(self, name: str, token: str | None) -> None:
        if token is not None:
            self._unknown_claims.append((name, token))

    async def _give_back_unknown_claims(self) -> None:
        """Give back what the claims that never came back took (due as when claimed, the attempt not counted),
        each in delayq's own retried transaction, bounded by ``stall_timeout``."""
        while self._unknown_claims:
            name, token = self._unknown_claims.pop()
            await self._give_back_claim(self.async_queues[name], token)

    async def _give_back_claim(self, aq: AsyncDelayedQueue, token: str) -> None:
        try:
            async with asyncio.timeout(self._stall_timeout):
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

    # -- one delivery ---------------------------------------------------------------------------
    def _cancel_overdue(self) -> None:
        """Cancel (once) each handler found running past its ``timeout``: a failed attempt, decided as any."""
        for lease in self._leases.newly_overdue():
            task = self._tasks.get(id(lease))
            if task is None or task.done() or id(lease) not in self._in_handler:
                continue  # (it returned, or records its outcome: that stands)
            timeout = lease.handler.timeout
            assert timeout is not None
            overdue(lease.delivery.label, time.monotonic() - lease.started_at, timeout, cancelled=True)
            observe.count("overdue", lease.queue.name)
            self._timed_out.add(id(lease))
            task.cancel()
        for c in self._topics.consumers:
            for held in c.newly_overdue():
                task = self._tasks.get(id(held))
                if task is None or task.done() or id(held) not in self._in_handler:
                    continue
                timeout = c.handler.timeout
                assert timeout is not None
                overdue(held.label, time.monotonic() - held.started_at, timeout, cancelled=True)
                observe.count("overdue", c.sub.topic)
                self._timed_out.add(id(held))
                task.cancel()

    def _poll(self, consumer: TopicConsumer, limit: int, guard: bool) -> list[Task]:
        """``Worker._poll``, each delivery's handler started as a task that records its outcome at the end."""
        assert self._pool is not None
        got = consumer.claim(
            limit, self._pool, self._poke, guard, execute=functools.partial(self._start_topic, consumer)
        )
        if got is None:
            return []
        self._last_fetch = time.monotonic()
        return got

    def _start_topic(self, consumer: TopicConsumer, held: Held, done: Callable[[], None]) -> None:
        self._tasks[id(held)] = asyncio.get_running_loop().create_task(self._handle_topic(consumer, held, done))

    async def _handle_topic(self, consumer: TopicConsumer, held: Held, done: Callable[[], None]) -> None:
        """Await a topic handler; its outcome (``TopicConsumer.finish``: the one decision) is recorded in a
        greenlet. A timeout is a failed attempt; any other cancellation gives the delivery back."""
        handle = cast(Callable[[Any], Awaitable[None]], consumer.handler.handle)  # async: checked at init
        error: Exception | None = None
        try:
            try:
                self._in_handler.add(id(held))
                try:
                    await handle(held.delivery)
                finally:
                    self._in_handler.discard(id(held))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if id(held) in self._timed_out and task is not None and task.uncancel() == 0:
                    timeout = consumer.handler.timeout
                    assert timeout is not None
                    error = TimedOut(timeout)
                else:
                    await self._bounded(consumer.give_back, held, done, "its handler was cancelled")
                    raise
            except Exception as exc:  # whatever the handler raised is a failed attempt, or Retry / DeadLetter
                error = exc
            await self._bounded(consumer.finish, held, error, done)
        finally:
            self._tasks.pop(id(held), None)
            self._timed_out.discard(id(held))
            self._poke()

    def _execute(self, lease: Lease) -> None:
        """Start the lease's handler as a task (called by ``Worker._fetch``, on the loop's thread)."""
        self._tasks[id(lease)] = asyncio.get_running_loop().create_task(self._handle(lease))

    async def _handle(self, lease: Lease) -> None:
        handler, delivery = cast(AsyncHandler, lease.handler), lease.delivery  # async handle: checked at init
        aq = self.async_queues[lease.queue.name]
        to_ack = False
        try:
            self._in_handler.add(id(lease))
            try:
                if handler.transactional:
                    await self._handle_in_transaction_async(handler, aq, AsyncDelivery(delivery, aq))
                else:
                    await _observed(delivery, handler.handle(AsyncDelivery(delivery, aq)))
                    to_ack = True
            finally:
                self._in_handler.discard(id(lease))
        except _NotBegun as exc:  # no connection for the handler: not an attempt, give it back
            log.warning("%s: its transaction could not begin (%s)", delivery.label, describe(exc.__cause__ or exc))
            await self._bounded(self._leases.release, [lease], "the handler's transaction could not begin")
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if id(lease) in self._timed_out and task is not None and task.uncancel() == 0:
                # Cancelled at its timeout, and by nothing else: a failed attempt, retried per the policy.
                timeout = handler.timeout
                assert timeout is not None
                await self._bounded(self._record_failure_of, lease, TimedOut(timeout))
            else:  # the message goes back at once, the attempt not counted
                await self._bounded(self._leases.release, [lease], "its handler was cancelled")
                raise
        except Exception as exc:  # whatever the handler raised is a failed attempt, or Retry / DeadLetter
            await self._bounded(self._record_failure_of, lease, exc)
        finally:
            self._leases.finish(lease, to_ack)  # the ack follows, with others, from the ack task
            self._tasks.pop(id(lease), None)
            self._timed_out.discard(id(lease))
            if to_ack and self._acks_due is not None:
                self._acks_due.set()
            self._poke()

    @staticmethod
    async def _handle_in_transaction_async(
        handler: AsyncHandler, aq: AsyncDelayedQueue, delivery: AsyncDelivery
    ) -> None:
        """Run the handler and the ack in one transaction; ``_NotBegun`` when it could not begin."""
        begun = False
        try:
            async with aq.transaction() as conn:
                begun = True
                await _observed(delivery.delivery, handler.handle(delivery, conn))
                if not await delivery.ack(using=conn):
                    await conn.rollback()
                    log.warning("%s: lock lost while handling; its writes were rolled back", delivery.label)
        except Exception as exc:
            if begun:
                raise
            raise _NotBegun from exc

    def _record_failure_of(self, lease: Lease, exc: Exception) -> None:
        """``Worker._record_failure`` in a greenlet, with ``exc`` as the exception being handled there
        (the attempt history reads its type and traceback from ``sys.exc_info()``)."""
        try:
            raise exc
        except Exception:
            self._record_failure(lease, exc)

    # -- plumbing -------------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """A sync call of the threaded worker's, in a greenlet, bounded by ``stall_timeout``.

        A driver may take the timeout's cancellation in hand and raise ``CancelledError`` later
        (psycopg first waits up to 5 s for the server to cancel the query): when no one else asked
        to cancel this task, that is the stall timeout still, not the end of the worker.
        """
        scope = asyncio.timeout(self._stall_timeout)
        try:
            async with scope:
                return await greenlet_spawn(fn, *args)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if scope.expired() and task is not None and task.cancelling() == 0:
                raise TimeoutError(f"a database call took longer than {self._stall_timeout}s") from None
            raise

    async def _bounded(self, fn: Callable[..., None], *args: Any) -> None:
        """``_call`` for recording an outcome: a stalled call is given up (the message comes back after its
        lock expires, as when its outcome cannot be recorded)."""
        try:
            await self._call(fn, *args)
        except TimeoutError as exc:
            log.warning("could not record an outcome (%s); the message returns after its lock expires", exc)

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
                self._exit_now(signum, 0.0)
            self._on_stop_signal(signum)
            self._poke()

        for s in signals:
            loop.add_signal_handler(s, on_signal, s)

        def restore() -> None:
            if self._exit_timer is not None:
                self._exit_timer.cancel()
                self._exit_timer = None
            for s in signals:
                loop.remove_signal_handler(s)

        return restore


async def _observed(delivery: Delivery, call: Awaitable[None]) -> None:
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
        await call
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
