"""AsyncDelayedQueue: ``DelayedQueue`` for asyncio applications, on the same statements.

Each method awaits the sync operation of a ``DelayedQueue`` built on ``engine.sync_engine``, run in
SQLAlchemy's greenlets (see ``delayq.aio.bridge``): one implementation of every operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from delayq.aio.bridge import NO_RETRY, AsyncUsing, Bridge
from delayq.clock import Clock
from delayq.dialects import dialect_for
from delayq.history import AttemptRecord
from delayq.messages import CancelOutcome, DeadMessage, Delivery, FlowState, Message, OfferOutcome, QueueStats
from delayq.queue import At, DelayedQueue
from delayq.queue._bulk import BULK_BATCH, BulkAction, BulkOutcome, Progress, Walk
from delayq.queue._lifecycle import DEFAULT_RESULT_LIMIT
from delayq.queue._queued import _timed_out, _wait_limit, _waited
from delayq.schema import DEFAULT_PREFIX
from delayq.serializers import Serializer
from delayq.transactions import DEFAULT_RETRY, TransientRetry

__all__ = ["AsyncDelayedQueue", "AsyncDelivery"]

T = TypeVar("T")
log = logging.getLogger("delayq")
SyncUsing = Engine | Connection | Session


class AsyncDelayedQueue:
    """One named queue of delayed messages, for coroutines; see ``delayq.DelayedQueue``.

    Args:
        engine: an ``AsyncEngine`` (psycopg async, asyncmy/aiomysql, aiosqlite) on the database
            holding delayq's tables.
        name, visibility_timeout, serializer, clock, table_prefix, schema, notify, max_deliveries,
            flow_refresh, retention, keep_results, result_limit, unique_for, dead_letter_retention:
            as for ``DelayedQueue`` (the same defaults).
        transient_retry: how delayq retries its own transactions; the pauses are ``asyncio.sleep``.

    Every method takes ``using=``: None or an ``AsyncEngine`` runs it in delayq's own transaction;
    an ``AsyncConnection`` or ``AsyncSession`` makes it part of the caller's transaction, which
    delayq never commits, rolls back or retries.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        name: str,
        *,
        visibility_timeout: dt.timedelta = dt.timedelta(minutes=5),
        serializer: Serializer | None = None,
        clock: Clock | None = None,
        table_prefix: str = DEFAULT_PREFIX,
        schema: str | None = None,
        transient_retry: TransientRetry = DEFAULT_RETRY,
        notify: bool = True,
        max_deliveries: int | None = None,
        flow_refresh: dt.timedelta = dt.timedelta(seconds=1),
        retention: dt.timedelta = dt.timedelta(0),
        keep_results: bool = True,
        result_limit: int = DEFAULT_RESULT_LIMIT,
        unique_for: dt.timedelta | None = None,
        dead_letter_retention: dt.timedelta | None = None,
    ) -> None:
        self.bridge = Bridge(engine, transient_retry, "AsyncDelayedQueue")  # (first: it checks the engine's API)
        sync = DelayedQueue(
            engine.sync_engine,
            name,
            visibility_timeout=visibility_timeout,
            serializer=serializer,
            clock=clock,
            table_prefix=table_prefix,
            schema=schema,
            transient_retry=NO_RETRY,
            notify=notify,
            max_deliveries=max_deliveries,
            flow_refresh=flow_refresh,
            retention=retention,
            keep_results=keep_results,
            result_limit=result_limit,
            unique_for=unique_for,
            dead_letter_retention=dead_letter_retention,
        )
        self._wrap(engine, sync)

    @classmethod
    def _around(cls, engine: AsyncEngine, sync: DelayedQueue, transient_retry: TransientRetry) -> AsyncDelayedQueue:
        """The async queue running ``sync``'s operations, configured as ``sync`` is (the worker's queues:
        the core decides their configuration). ``sync`` is on ``engine.sync_engine`` with ``NO_RETRY``."""
        assert sync.engine is engine.sync_engine
        aq = cls.__new__(cls)
        aq.bridge = Bridge(engine, transient_retry, "AsyncDelayedQueue")
        aq._wrap(engine, sync)
        return aq

    def _wrap(self, engine: AsyncEngine, sync: DelayedQueue) -> None:
        self.engine = engine
        self.sync = sync
        """The sync queue whose operations this one runs (its engine is ``engine.sync_engine``)."""
        self._giving_back: set[asyncio.Task[None]] = set()

    @property
    def name(self) -> str:
        return self.sync.name

    @property
    def visibility_timeout(self) -> dt.timedelta:
        return self.sync.visibility_timeout

    def __repr__(self) -> str:
        return f"AsyncDelayedQueue({self.name!r}, {self.engine.url.render_as_string(hide_password=True)!r})"

    async def _run(self, using: AsyncUsing, call: Callable[[SyncUsing], T]) -> T:
        return await self.bridge.run(using, call)

    # -- producers ------------------------------------------------------------------------------
    async def offer(
        self,
        key: str,
        payload: Any,
        at: At = None,
        *,
        update: bool = False,
        priority: int = 0,
        group: str | None = None,
        unique_for: dt.timedelta | None = None,
        tags: Iterable[str] | None = None,
        using: AsyncUsing = None,
    ) -> OfferOutcome:
        """Store a message due at ``at`` unless one with this key exists; see ``DelayedQueue.offer``."""
        return await self._run(
            using,
            lambda u: self.sync.offer(
                key,
                payload,
                at,
                update=update,
                priority=priority,
                group=group,
                unique_for=unique_for,
                tags=tags,
                using=u,
            ),
        )

    async def offer_many(
        self,
        items: Iterable[tuple[str, Any, At] | tuple[str, Any, At, Iterable[str] | None]],
        *,
        update: bool = False,
        priority: int = 0,
        group: str | None = None,
        unique_for: dt.timedelta | None = None,
        tags: Iterable[str] | None = None,
        using: AsyncUsing = None,
    ) -> list[OfferOutcome]:
        """Offer ``(key, payload, at)`` items in multi-row statements; see ``DelayedQueue.offer_many``."""
        listed = list(items)
        return await self._run(
            using,
            lambda u: self.sync.offer_many(
                listed, update=update, priority=priority, group=group, unique_for=unique_for, tags=tags, using=u
            ),
        )

    # -- flow control ---------------------------------------------------------------------------
    async def pause(self, *, using: AsyncUsing = None) -> None:
        """Pause the queue; see ``DelayedQueue.pause``."""
        await self._run(using, lambda u: self.sync.pause(using=u))

    async def resume(self, *, using: AsyncUsing = None) -> None:
        """Resume the queue; see ``DelayedQueue.resume``."""
        await self._run(using, lambda u: self.sync.resume(using=u))

    async def set_concurrency_limit(self, limit: int | None, *, using: AsyncUsing = None) -> None:
        """Limit how many of the queue's messages run at once; see ``DelayedQueue.set_concurrency_limit``."""
        await self._run(using, lambda u: self.sync.set_concurrency_limit(limit, using=u))

    async def set_group_concurrency(self, limit: int | None, *, using: AsyncUsing = None) -> None:
        """How many messages of one group may run at once (None: the default, 1); see
        ``DelayedQueue.set_group_concurrency``."""
        await self._run(using, lambda u: self.sync.set_group_concurrency(limit, using=u))

    async def set_rate_limit(
        self, limit: int | None, per: dt.timedelta = dt.timedelta(seconds=1), *, using: AsyncUsing = None
    ) -> None:
        """Limit the queue's claims per period; see ``DelayedQueue.set_rate_limit``."""
        await self._run(using, lambda u: self.sync.set_rate_limit(limit, per, using=u))

    async def flow(self, *, using: AsyncUsing = None) -> FlowState:
        """The queue's flow settings as stored now; see ``DelayedQueue.flow``."""
        return await self._run(using, lambda u: self.sync.flow(using=u))

    # -- consumers ------------------------------------------------------------------------------
    async def try_poll(self, *, using: AsyncUsing = None) -> AsyncDelivery | None:
        """Lock the next due message, or return None when none is due."""
        found = await self.try_poll_many(1, using=using)
        return found[0] if found else None

    async def try_poll_many(self, limit: int, *, using: AsyncUsing = None) -> list[AsyncDelivery]:
        """Lock up to ``limit`` due messages, oldest due first; see ``DelayedQueue.try_poll_many``.

        In delayq's own transaction, a claim cancelled meanwhile (``asyncio.wait_for`` included) goes on
        until it comes back, then gives back what it took (due again, the attempt not counted): a
        cancellation never leaves messages locked that nobody holds.
        """

        def claim(u: SyncUsing) -> list[Delivery]:
            return self.sync.try_poll_many(limit, using=u)

        if isinstance(using, AsyncConnection | AsyncSession):  # the caller's transaction, the caller's outcome
            found = await self._run(using, claim)
        else:
            claiming = asyncio.ensure_future(self._run(using, claim))
            try:
                found = await asyncio.shield(claiming)
            except asyncio.CancelledError:
                self._give_back_when_done(claiming, using)
                raise
        return [AsyncDelivery(d, self) for d in found]

    def _give_back_when_done(self, claiming: asyncio.Future[list[Delivery]], using: AsyncEngine | None) -> None:
        """Release what a cancelled claim took, once it comes back. One still under way after the visibility
        timeout (its connection gone silent, say) is cancelled for good: its rows' locks have expired by then,
        and it holds a connection of the pool no longer."""
        abandoned: list[bool] = []

        def abandon_it() -> None:
            abandoned.append(True)
            claiming.cancel()

        abandon = asyncio.get_running_loop().call_later(self.visibility_timeout.total_seconds(), abandon_it)

        async def give_back() -> None:
            try:
                found = await claiming
                if found:
                    await self._run(using, lambda u: self.sync.release(found, using=u))
            except asyncio.CancelledError:
                if not abandoned:  # (this task cancelled: the loop ends)
                    raise
                log.warning(
                    "queue %s: a cancelled claim still under way after the visibility timeout was cancelled; "
                    "its messages return as their lock expires",
                    self.name,
                )
            except Exception as exc:
                log.warning(
                    "queue %s: could not give back a cancelled claim (%s); its messages return after their "
                    "lock expires",
                    self.name,
                    exc,
                )

        task = asyncio.ensure_future(give_back())
        self._giving_back.add(task)  # a strong reference until it ends
        task.add_done_callback(self._giving_back.discard)
        task.add_done_callback(lambda _: abandon.cancel())

    async def release(self, deliveries: Sequence[AsyncDelivery], *, using: AsyncUsing = None) -> int:
        """Give deliveries back unprocessed (due at once, the attempt not counted); how many were held."""
        held = [d.delivery for d in deliveries]
        return await self._run(using, lambda u: self.sync.release(held, using=u))

    async def ack_many(
        self, deliveries: Sequence[AsyncDelivery], *, skip_locked: bool = False, using: AsyncUsing = None
    ) -> int:
        """Delete delivered messages whose locks these deliveries still hold; how many."""
        held = [d.delivery for d in deliveries]
        return await self._run(using, lambda u: self.sync.ack_many(held, skip_locked=skip_locked, using=u))

    async def extend_many(
        self, deliveries: Sequence[AsyncDelivery], by: dt.timedelta, *, using: AsyncUsing = None
    ) -> tuple[list[AsyncDelivery], list[AsyncDelivery]]:
        """Push the locks of held deliveries to ``by`` from now: ``(extended, lost)``."""
        of = {id(d.delivery): d for d in deliveries}
        extended, lost = await self._run(
            using, lambda u: self.sync.extend_many([d.delivery for d in deliveries], by, using=u)
        )
        return [of[id(d)] for d in extended], [of[id(d)] for d in lost]

    async def next_due(self, *, using: AsyncUsing = None) -> dt.timedelta | None:
        """How long until the next message is due (zero when one is due); None when the queue is empty."""
        return await self._run(using, lambda u: self.sync.next_due(using=u))

    # -- operations on queued messages ---------------------------------------------------------
    async def attempt_history(self, key: str, *, using: AsyncUsing = None) -> tuple[AttemptRecord, ...]:
        """The earlier failed attempts of the message (or newest dead letter) under ``key``, oldest first."""
        return await self._run(using, lambda u: self.sync.attempt_history(key, using=u))

    async def headers(self, key: str, *, using: AsyncUsing = None) -> dict[str, str]:
        """The headers an offer stored with the message under ``key`` (the trace context, with tracing on)."""
        return await self._run(using, lambda u: self.sync.headers(key, using=u))

    async def get(self, key: str, *, include_dead: bool = False, using: AsyncUsing = None) -> Message | None:
        """The message stored under ``key`` with its state, or None; see ``DelayedQueue.get``."""
        return await self._run(using, lambda u: self.sync.get(key, include_dead=include_dead, using=u))

    async def wait(self, key: str, timeout: dt.timedelta, *, using: AsyncUsing = None) -> Message | None:
        """Wait until no live message holds ``key``, then what was kept of it; see ``DelayedQueue.wait``.

        ``UnknownMessageError`` when nothing is under ``key`` at its first look; ``TimeoutError`` after
        ``timeout``. On PostgreSQL a completion's NOTIFY wakes it; it polls meanwhile (every 50 ms, backing
        off to 1 s).
        """
        limit = _wait_limit(timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        heard = asyncio.Event()
        listener = self._listen_for_finished(heard) if self.sync.notify else None
        try:
            pause, first = 0.05, True
            while True:
                found = await self.get(key, include_dead=True, using=using)
                if _waited(self.name, key, found, first):
                    return found
                assert found is not None
                first = False
                left = deadline - loop.time()
                if left <= 0:
                    raise _timed_out(self.name, key, found, timeout)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(heard.wait(), min(left, 1.0 if listener is not None else pause))
                heard.clear()
                pause = min(pause * 2, 1.0)
        finally:
            if listener is not None:
                listener.cancel()

    def _listen_for_finished(self, heard: asyncio.Event) -> asyncio.Task[None] | None:
        """A task that sets ``heard`` when a completion of this queue is notified (PostgreSQL); None elsewhere."""
        dialect = dialect_for(self.engine.sync_engine)
        if not dialect.can_notify:
            return None

        async def listen() -> None:
            with contextlib.suppress(Exception):  # the caller polls anyway
                async for notified in dialect.listen_async(self.engine, self.sync.tables.finished.name):
                    if notified == self.name:
                        heard.set()

        return asyncio.get_running_loop().create_task(listen())

    async def cancel(self, key: str, *, using: AsyncUsing = None) -> bool:
        """Cancel the message stored under ``key``; True when there was one (see ``DelayedQueue.cancel``)."""
        return await self._run(using, lambda u: self.sync.cancel(key, using=u))

    async def cancel_job(
        self, key: str, *, keep_for: dt.timedelta | None = None, using: AsyncUsing = None
    ) -> CancelOutcome:
        """Cancel the message under ``key`` and say which it did; see ``DelayedQueue.cancel_job``."""
        return await self._run(using, lambda u: self.sync.cancel_job(key, keep_for=keep_for, using=u))

    async def reschedule(self, key: str, at: At = None, *, using: AsyncUsing = None) -> bool:
        """Make the message under ``key`` due at ``at`` (clearing any lock); True when there was one."""
        return await self._run(using, lambda u: self.sync.reschedule(key, at, using=u))

    async def stats(self, *, tag: str | None = None, using: AsyncUsing = None) -> QueueStats:
        """Counts of this queue's messages by state, and the age of the oldest due one (see ``DelayedQueue.stats``)."""
        return await self._run(using, lambda u: self.sync.stats(tag=tag, using=u))

    async def dead_letters(self, *, limit: int = 100, after_id: int = 0, using: AsyncUsing = None) -> list[DeadMessage]:
        """This queue's dead letters, oldest first; page with ``after_id``."""
        return await self._run(using, lambda u: self.sync.dead_letters(limit=limit, after_id=after_id, using=u))

    async def requeue_dead(self, key: str, *, using: AsyncUsing = None) -> bool:
        """Move the newest dead letter under ``key`` back into the queue, due now; see ``DelayedQueue``."""
        return await self._run(using, lambda u: self.sync.requeue_dead(key, using=u))

    async def purge_dead(
        self,
        *,
        key: str | None = None,
        key_prefix: str | None = None,
        everything: bool = False,
        using: AsyncUsing = None,
    ) -> int:
        """Delete dead letters under ``key``, ``key_prefix``, or all with ``everything=True``; how many."""
        return await self._run(
            using, lambda u: self.sync.purge_dead(key=key, key_prefix=key_prefix, everything=everything, using=u)
        )

    async def cancel_prefix(self, prefix: str, *, keep_prefix: str | None = None, using: AsyncUsing = None) -> int:
        """Delete the messages whose key starts with ``prefix`` (but not ``keep_prefix``); how many. Running ones
        too, unrecorded and untold (see the sync ``cancel_prefix``); ``cancel_matching`` cancels them as
        ``cancel_job`` does."""
        return await self._run(using, lambda u: self.sync.cancel_prefix(prefix, keep_prefix=keep_prefix, using=u))

    async def coalesce_overdue(self, prefix: str, now: dt.datetime, *, using: AsyncUsing = None) -> int:
        """Of the never-attempted messages under ``prefix`` due by ``now``, keep the newest; how many deleted."""
        return await self._run(using, lambda u: self.sync.coalesce_overdue(prefix, now, using=u))

    async def cancel_matching(
        self,
        *,
        state: str | None = None,
        key_prefix: str | None = None,
        tag: str | None = None,
        batch_size: int = BULK_BATCH,
        progress: Progress | None = None,
        using: AsyncUsing = None,
    ) -> BulkOutcome:
        """Cancel every matching live message, in batches; see ``DelayedQueue.cancel_matching``."""
        return await self._bulk(self.sync._cancel_walk(state, key_prefix, tag, batch_size), progress, using)

    async def reschedule_matching(
        self,
        at: At = None,
        *,
        state: str | None = None,
        key_prefix: str | None = None,
        tag: str | None = None,
        batch_size: int = BULK_BATCH,
        progress: Progress | None = None,
        using: AsyncUsing = None,
    ) -> BulkOutcome:
        """Make the matching messages not running due at ``at``; see ``DelayedQueue.reschedule_matching``."""
        walk = self.sync._reschedule_walk(at, state, key_prefix, tag, batch_size)
        return await self._bulk(walk, progress, using)

    async def requeue_dead_matching(
        self,
        *,
        key_prefix: str | None = None,
        tag: str | None = None,
        batch_size: int = BULK_BATCH,
        progress: Progress | None = None,
        using: AsyncUsing = None,
    ) -> BulkOutcome:
        """Requeue the matching dead letters, in batches; see ``DelayedQueue.requeue_dead_matching``."""
        return await self._bulk(self.sync._requeue_walk(key_prefix, tag, batch_size), progress, using)

    async def purge(
        self,
        *,
        state: str,
        key_prefix: str | None = None,
        tag: str | None = None,
        batch_size: int = BULK_BATCH,
        progress: Progress | None = None,
        using: AsyncUsing = None,
    ) -> BulkOutcome:
        """Delete the matching rows (never a running message), in batches; see ``DelayedQueue.purge``."""
        return await self._bulk(self.sync._purge_walk(state, key_prefix, tag, batch_size), progress, using)

    async def count_matching(
        self,
        *,
        state: str | None = None,
        key_prefix: str | None = None,
        tag: str | None = None,
        at_most: int | None = None,
        action: BulkAction | None = None,
        using: AsyncUsing = None,
    ) -> int:
        """How many rows the bulk actions' filter matches; see ``DelayedQueue.count_matching``."""
        return await self._run(
            using,
            lambda u: self.sync.count_matching(
                state=state, key_prefix=key_prefix, tag=tag, at_most=at_most, action=action, using=u
            ),
        )

    async def _bulk(self, walk: Walk, progress: Progress | None, using: AsyncUsing) -> BulkOutcome:
        """A bulk action's batches, each its own call (retried alone on a transient error)."""
        while not walk.finished:
            await self._run(using, lambda u: self.sync._bulk_batch(walk, u))
            if progress is not None:
                progress(walk.outcome)
        return walk.outcome

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """An ``AsyncConnection`` in a transaction begun as delayq begins its own; committed on success.

        Pass it as ``using=`` to make queue operations part of the same unit of work as yours.
        """
        scope = self.sync.transaction()
        conn = await self.bridge.call(scope.__enter__)
        try:
            yield AsyncConnection(self.engine, conn)
        except BaseException as exc:
            if not await self.bridge.call(scope.__exit__, type(exc), exc, exc.__traceback__):
                raise
        else:
            await self.bridge.call(scope.__exit__, None, None, None)


class AsyncDelivery:
    """A message held under a lock until it is acked, retried or its lock expires; see ``Delivery``.

    Its fields are the sync ``Delivery``'s (``delivery``); every method is a compare-and-swap on
    the lock token, awaited.
    """

    __slots__ = ("delivery", "queue_of")

    def __init__(self, delivery: Delivery, queue: AsyncDelayedQueue) -> None:
        self.delivery = delivery
        self.queue_of = queue

    def __repr__(self) -> str:
        return f"AsyncDelivery({self.delivery!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AsyncDelivery) and self.delivery == other.delivery

    def __hash__(self) -> int:
        return hash((self.delivery.id, self.delivery.lock_token))

    @property
    def id(self) -> int:
        return self.delivery.id

    @property
    def key(self) -> str:
        return self.delivery.key

    @property
    def payload(self) -> Any:
        return self.delivery.payload

    @property
    def attempts(self) -> int:
        """Deliveries so far, this one included."""
        return self.delivery.attempts

    @property
    def scheduled_at(self) -> dt.datetime:
        """When the message was due for this delivery."""
        return self.delivery.scheduled_at

    @property
    def scheduled_at_initially(self) -> dt.datetime:
        return self.delivery.scheduled_at_initially

    @property
    def created_at(self) -> dt.datetime:
        return self.delivery.created_at

    @property
    def locked_until(self) -> dt.datetime:
        """When the lock expires unless extended."""
        return self.delivery.locked_until

    @property
    def lock_token(self) -> str:
        return self.delivery.lock_token

    @property
    def redelivered(self) -> bool:
        """True when an earlier delivery of this message was not acked."""
        return self.delivery.redelivered

    @property
    def tags(self) -> tuple[str, ...]:
        """The tags its offer gave the message, sorted (read with the claim)."""
        return self.delivery.tags

    @property
    def priority(self) -> int:
        """The message's priority (read with the claim)."""
        return self.delivery.priority

    @property
    def group(self) -> str | None:
        """The message's group, None when it has none (read with the claim)."""
        return self.delivery.group

    @property
    def cancelled(self) -> threading.Event:
        """Set once the message was cancelled or its lock lost (``Delivery.cancelled``); an ``AsyncWorker`` also
        cancels the handler's task then."""
        return self.delivery.cancelled

    async def raise_if_cancelled(self) -> None:
        """Raise ``DeliveryCancelledError`` when ``cancelled`` is set (``Delivery.raise_if_cancelled``)."""
        self.delivery.raise_if_cancelled()

    @property
    def queue(self) -> str:
        return self.delivery.queue

    @property
    def label(self) -> str:
        """``queue 'key'`` for logs (``queue #id`` when the engine hides parameters)."""
        return self.delivery.label

    async def headers(self) -> dict[str, str]:
        """What the offer stored with the message (the trace context, with tracing on); read from the database."""
        return await self.queue_of.bridge.call(getattr, self.delivery, "headers")

    async def attempt_history(self) -> tuple[AttemptRecord, ...]:
        """The message's earlier failed attempts, oldest first (read from the database on first use)."""
        return await self.queue_of.bridge.call(getattr, self.delivery, "attempt_history")

    async def ack(self, *, result: Any = None, duration: dt.timedelta | None = None, using: AsyncUsing = None) -> bool:
        """Delete the message (or keep it as completed, with ``result`` and ``duration``: see ``Delivery.ack``);
        True when this delivery still held the lock."""
        self.delivery._finished_with(result, duration)
        return await self.queue_of.ack_many([self], using=using) == 1

    async def retry(
        self,
        delay: dt.timedelta = dt.timedelta(0),
        error: str | None = None,
        *,
        using: AsyncUsing = None,
        exception: BaseException | None = None,
    ) -> bool:
        """Release the message for another attempt after ``delay``, recording ``error``.

        The attempt history gets ``exception``'s type and traceback (by default the exception
        being handled, when awaited in an ``except`` block).
        """
        exc = exception if exception is not None else sys.exc_info()[1]  # (a greenlet has none of its own)
        return await self.queue_of.bridge.run(
            using, lambda u: self.delivery.retry(delay, error, using=u, exception=exc)
        )

    async def extend(self, by: dt.timedelta, *, using: AsyncUsing = None) -> bool:
        """Push the lock's expiry to ``by`` from now (a heartbeat for long work)."""
        return await self.queue_of.bridge.run(using, lambda u: self.delivery.extend(by, using=u))

    async def dead_letter(
        self, error: str | None = None, *, using: AsyncUsing = None, exception: BaseException | None = None
    ) -> bool:
        """Move the message to the dead letters, recording ``error`` (and ``exception``, as ``retry``)."""
        exc = exception if exception is not None else sys.exc_info()[1]
        return await self.queue_of.bridge.run(using, lambda u: self.delivery.dead_letter(error, using=u, exception=exc))
