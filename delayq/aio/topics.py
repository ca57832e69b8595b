"""AsyncTopic and AsyncSubscription: topics for asyncio applications, on the same statements.

Each method awaits the sync operation of a ``Topic`` / ``Subscription`` built on
``engine.sync_engine``, run in SQLAlchemy's greenlets (``delayq.aio.bridge``). Polls return the
sync API's ``TopicDelivery`` records; in a coroutine, act on them through the subscription
(``await sub.ack(delivery)``), never through their own blocking methods.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import warnings
from collections.abc import Callable, Collection, Iterable
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from delayq.aio.bridge import NO_RETRY, AsyncUsing, Bridge
from delayq.errors import InvalidInputError
from delayq.messages import OfferOutcome
from delayq.topics import PartitionInfo, Subscription, Topic, TopicDelivery
from delayq.topics.dead_letters import TopicDeadLetter
from delayq.transactions import DEFAULT_RETRY, TransientRetry

__all__ = ["AsyncSubscription", "AsyncTopic"]

T = TypeVar("T")
log = logging.getLogger("delayq")
SyncUsing = Engine | Connection | Session


class AsyncTopic:
    """A partitioned, append-only log of messages, for coroutines; see ``delayq.Topic``.

    Takes an ``AsyncEngine`` and ``Topic``'s keyword arguments; ``using=`` takes an
    ``AsyncConnection`` or ``AsyncSession`` (the caller's transaction: a transactional publish).
    """

    def __init__(
        self, engine: AsyncEngine, name: str, *, transient_retry: TransientRetry = DEFAULT_RETRY, **options: Any
    ) -> None:
        self.bridge = Bridge(engine, transient_retry, "AsyncTopic")
        self.sync = Topic(engine.sync_engine, name, transient_retry=NO_RETRY, **options)
        """The sync topic whose operations this one runs."""

    @property
    def name(self) -> str:
        return self.sync.name

    def __repr__(self) -> str:
        return f"AsyncTopic({self.name!r})"

    async def create(self, partitions: int, *, using: AsyncUsing = None) -> int:
        """Create the topic with ``partitions`` partitions (idempotent); its partition count."""
        return await self.bridge.run(using, lambda u: self.sync.create(partitions, using=u))

    async def partitions(self, *, using: AsyncUsing = None) -> int:
        """The topic's partition count."""
        return await self.bridge.run(using, lambda u: self.sync.partitions(using=u))

    async def publish(
        self, partition_key: str, message_id: str, payload: Any, *, using: AsyncUsing = None
    ) -> OfferOutcome:
        """Append a message unless ``(partition_key, message_id)`` is already in the log."""
        return await self.bridge.run(using, lambda u: self.sync.publish(partition_key, message_id, payload, using=u))

    async def publish_many(
        self, items: Iterable[tuple[str, str, Any]], *, using: AsyncUsing = None
    ) -> list[OfferOutcome]:
        """Publish ``(partition_key, message_id, payload)`` items; one outcome per item, in order."""
        listed = list(items)
        return await self.bridge.run(using, lambda u: self.sync.publish_many(listed, using=u))

    async def heads(self, *, using: AsyncUsing = None) -> list[PartitionInfo]:
        """Each partition's head offset."""
        return await self.bridge.run(using, lambda u: self.sync.heads(using=u))

    async def collect_garbage(self, *, using: AsyncUsing = None) -> int:
        """Delete log rows every consumer group has passed; how many."""
        return await self.bridge.run(using, lambda u: self.sync.collect_garbage(using=u))

    async def drop_group(self, group: str, *, force: bool = False, using: AsyncUsing = None) -> bool:
        """Remove a consumer group from this topic; see ``Topic.drop_group``."""
        return await self.bridge.run(using, lambda u: self.sync.drop_group(group, force=force, using=u))

    async def dead_letters(
        self,
        *,
        group: str | None = None,
        key: str | None = None,
        message_id: str | None = None,
        limit: int = 100,
        using: AsyncUsing = None,
    ) -> list[TopicDeadLetter]:
        """The topic's dead letters, by partition and offset; see ``Topic.dead_letters``."""
        return await self.bridge.run(
            using,
            lambda u: self.sync.dead_letters(group=group, key=key, message_id=message_id, limit=limit, using=u),
        )

    async def requeue_dead(
        self,
        *,
        group: str | None = None,
        key: str | None = None,
        message_id: str | None = None,
        everything: bool = False,
        using: AsyncUsing = None,
    ) -> int:
        """Publish dead letters again, each for its own group only, and delete them; see ``Topic.requeue_dead``."""
        return await self.bridge.run(
            using,
            lambda u: self.sync.requeue_dead(
                group=group, key=key, message_id=message_id, everything=everything, using=u
            ),
        )

    async def purge_dead(
        self,
        *,
        group: str | None = None,
        key: str | None = None,
        message_id: str | None = None,
        everything: bool = False,
        using: AsyncUsing = None,
    ) -> int:
        """Delete dead letters; how many. See ``Topic.purge_dead``."""
        return await self.bridge.run(
            using,
            lambda u: self.sync.purge_dead(group=group, key=key, message_id=message_id, everything=everything, using=u),
        )


class AsyncSubscription:
    """One subscriber of a consumer group, for coroutines; see ``delayq.Subscription``.

    Takes an ``AsyncEngine`` and ``Subscription``'s arguments. Every operation on a delivery is
    fenced by the partition's lease epoch and the delivery's attempt, as in the sync API.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        topic: str,
        group: str,
        name: str,
        *,
        transient_retry: TransientRetry = DEFAULT_RETRY,
        **options: Any,
    ) -> None:
        self.bridge = Bridge(engine, transient_retry, "AsyncSubscription")
        self.sync = Subscription(engine.sync_engine, topic, group, name, transient_retry=NO_RETRY, **options)
        """The sync subscription whose operations this one runs."""
        self._kept: list[TopicDelivery] = []  # delivered by a cancelled poll: the next poll returns them
        self._polls: set[asyncio.Task[list[TopicDelivery]]] = set()

    def __repr__(self) -> str:
        return f"AsyncSubscription({self.sync.topic!r}, group={self.sync.group!r}, name={self.sync.name!r})"

    @property
    def held(self) -> dict[int, int]:
        """The partitions this subscriber holds, with their lease epochs."""
        return self.sync.held

    @property
    def lease_duration(self) -> dt.timedelta:
        """How long a partition's lease lasts unless renewed (``rebalance``)."""
        return self.sync.lease_duration

    async def _run(self, using: AsyncUsing, call: Callable[[SyncUsing], T]) -> T:
        return await self.bridge.run(using, call)

    async def join(self, *, using: AsyncUsing = None) -> None:
        """Create the group's rows if missing and register this subscriber."""
        await self._run(using, lambda u: self.sync.join(using=u))

    async def heartbeat(self, *, using: AsyncUsing = None) -> None:
        """Tell the group this subscriber is alive."""
        await self._run(using, lambda u: self.sync.heartbeat(using=u))

    async def rebalance(
        self, *, busy: Collection[int] = (), leaving: bool = False, using: AsyncUsing = None
    ) -> dict[int, int]:
        """Renew, release and take leases toward a fair share (``leaving``: keep only ``busy``); the
        partitions held, with epochs."""
        return await self._run(using, lambda u: self.sync.rebalance(busy=busy, leaving=leaving, using=u))

    async def close(self, *, using: AsyncUsing = None) -> None:
        """Release every lease and deregister: the other subscribers take over at once."""
        await self._run(using, lambda u: self.sync.close(using=u))

    async def poll(self, limit: int = 10, *, using: AsyncUsing = None) -> list[TopicDelivery]:
        """Up to ``limit`` deliverable messages of the held partitions, in offset order per partition.

        In delayq's own transactions (one per batch of partitions), nothing a poll committed is dropped: a
        transient error is retried for its batch alone; any other error after earlier batches
        delivered returns their deliveries. A poll cancelled meanwhile (``asyncio.wait_for`` included)
        finishes in the background, and the next ``poll()`` returns what it delivered of the partitions
        whose lease this subscriber still holds at the same epoch (one read); the others come back to the
        lease's new holder after their visibility timeout. One still under way after ``lease_duration`` is
        cancelled for good, and what it delivered comes back after the visibility timeout.
        """
        if not isinstance(limit, int) or limit < 1:
            raise InvalidInputError(f"limit must be a positive int, got {limit!r}")
        if isinstance(using, AsyncConnection | AsyncSession):  # the caller's transaction, the caller's outcome
            return await self._run(using, lambda u: self.sync.poll(limit, using=u))
        if self._polls:  # a cancelled poll still under way: its deliveries come first
            await asyncio.wait(set(self._polls))
        if self._kept:  # only those whose partition's lease is still this subscriber's, at their epoch
            leases = await self._run(using, self.sync._leases_now)
            self._kept = [d for d in self._kept if leases.get(d.partition) == d.epoch]
        if self._kept:
            kept, self._kept = self._kept[:limit], self._kept[limit:]
            return kept
        task = asyncio.ensure_future(self._poll_owned(limit, using))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._keep_when_done(task)
            raise

    async def _poll_owned(self, limit: int, using: AsyncEngine | None) -> list[TopicDelivery]:
        """``Subscription.poll``, each batch's transaction retried on its own by the bridge."""
        out: list[TopicDelivery] = []
        reread = False
        while len(out) < limit:
            want = limit - len(out)
            batch, reread = await self._run(using, functools.partial(self.sync._next_batch, want, reread=reread))
            if batch is None:
                break
            try:
                got = await self._run(using, functools.partial(self.sync._poll_batch, batch, want))
            except Exception as exc:
                if not out:
                    raise
                self.sync._poll_failed(batch[0][0], exc)
                break
            out.extend(got)
        return out

    def _keep_when_done(self, task: asyncio.Task[list[TopicDelivery]]) -> None:
        """A cancelled poll's deliveries are committed (or about to be): keep them for the next poll.

        One still under way after the lease duration is cancelled for good (its connection gone silent, say):
        the next poll waits for it no longer, and what it delivered comes back after the visibility timeout.
        """
        abandon = asyncio.get_running_loop().call_later(self.sync.lease_duration.total_seconds(), self._abandon, task)

        def keep(done: asyncio.Task[list[TopicDelivery]]) -> None:
            abandon.cancel()
            self._polls.discard(done)
            if done.cancelled():
                return
            failed = done.exception()
            if failed is None:
                self._kept.extend(done.result())
            else:  # it raised before any partition delivered: nothing to keep
                log.warning("a cancelled poll of %s failed afterwards: %s", self.sync.topic, failed)

        self._polls.add(task)  # a strong reference until it ends
        task.add_done_callback(keep)

    def _abandon(self, task: asyncio.Task[list[TopicDelivery]]) -> None:
        log.warning(
            "a cancelled poll of %s still under way after the lease duration: cancelled; its deliveries come "
            "back after their visibility timeout",
            self.sync.topic,
        )
        task.cancel()

    async def advance_watermarks(self, *, using: AsyncUsing = None) -> dict[int, int]:
        """Move each held partition's watermark past its contiguously acked offsets."""
        return await self._run(using, lambda u: self.sync.advance_watermarks(using=u))

    async def watermarks(self, *, using: AsyncUsing = None) -> dict[int, int]:
        """The group's watermark per partition."""
        return await self._run(using, lambda u: self.sync.watermarks(using=u))

    async def ack(self, delivery: TopicDelivery, *, using: AsyncUsing = None) -> bool:
        """Mark ``delivery`` done; False when the lease or the delivery was lost."""
        return await self._run(using, lambda u: self.sync.ack(delivery, using=u))

    async def ack_many(self, deliveries: list[TopicDelivery], *, using: AsyncUsing = None) -> list[bool]:
        """``ack`` each delivery (one transaction per partition); one result per delivery."""
        return await self._run(using, lambda u: self.sync.ack_many(deliveries, using=u))

    async def nack(
        self,
        delivery: TopicDelivery,
        delay: dt.timedelta = dt.timedelta(0),
        error: str | None = None,
        *,
        using: AsyncUsing = None,
    ) -> bool:
        """Deliver ``delivery`` again after ``delay`` (later ones keep flowing); dead-letter it on the last attempt."""
        return await self._run(using, lambda u: self.sync.nack(delivery, delay, error, using=u))

    async def release(self, delivery: TopicDelivery, *, using: AsyncUsing = None) -> bool:
        """Give ``delivery`` back unprocessed: deliverable again at once, the attempt not counted."""
        return await self._run(using, lambda u: self.sync.release(delivery, using=u))

    async def fail(self, delivery: TopicDelivery, error: str, *, using: AsyncUsing = None) -> bool:
        """Dead-letter ``delivery`` now."""
        return await self._run(using, lambda u: self.sync.fail(delivery, error, using=u))

    async def extend(
        self, delivery: TopicDelivery, by: dt.timedelta, *, using: AsyncUsing = None
    ) -> dt.datetime | None:
        """Keep ``delivery`` invisible to others for ``by`` from now; the new expiry, or None when lost."""
        return await self._run(using, lambda u: self.sync.extend(delivery, by, using=u))

    async def handle_exactly_once(
        self,
        delivery: TopicDelivery,
        handler: Callable[[Connection], T] | None = None,
        *,
        using: AsyncUsing = None,
        fn: Callable[[Connection], T] | None = None,
    ) -> T:
        """Run the sync ``handler(conn)`` and the fenced ack in one transaction; see ``Subscription``.

        ``fn=`` is the name this parameter had before it took the sync API's: still accepted, with a
        ``DeprecationWarning``.
        """
        if fn is not None:
            if handler is not None:
                raise InvalidInputError("pass handler= alone (fn= is its deprecated name)")
            warnings.warn(
                "AsyncSubscription.handle_exactly_once(fn=...) is deprecated: pass handler=, as in the sync API",
                DeprecationWarning,
                stacklevel=2,
            )
            handler = fn
        if handler is None:
            raise InvalidInputError("handle_exactly_once needs handler, the callable run in the transaction")
        call = handler
        return await self._run(using, lambda u: self.sync.handle_exactly_once(delivery, call, using=u))
