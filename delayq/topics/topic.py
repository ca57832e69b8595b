"""Topic: create it, publish to it (idempotently, in commit order per partition), collect its garbage."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from delayq import observe
from delayq.clock import Clock
from delayq.dialects import Dialect
from delayq.dialects.base import Mode
from delayq.errors import InvalidInputError
from delayq.messages import OfferOutcome
from delayq.schema import DEFAULT_PREFIX
from delayq.serializers import JsonSerializer, Serializer, encode
from delayq.topics import _headers, _wake
from delayq.topics._context import TopicContext
from delayq.topics._log import append as append
from delayq.topics._log import append_offsets as append_offsets
from delayq.topics._log import ensure_topic as ensure_topic
from delayq.topics.dead_letters import CHUNK, Selection, TopicDeadLetter, dead_offsets, list_dead, purge, requeue
from delayq.topics.names import (
    check_group,
    check_message_id,
    check_partition_key,
    check_partitions,
    check_topic,
    dead_letter_topic,
    partition_for,
)
from delayq.topics.statements import TopicStatements
from delayq.transactions import DEFAULT_RETRY, TransientRetry, Using


@dataclass(frozen=True)
class PartitionInfo:
    """One partition of a topic: its last offset and the offset up to which the log was collected."""

    partition: int
    head: int
    collected: int


class Topic:
    """A named, partitioned, append-only log of messages in the database.

    Args:
        engine: the engine of the database holding delayq's tables.
        name: letters, digits, ``.``, ``_`` and ``-``, at most 96 characters (its dead letters go to
            ``{name}_dlq``).
        serializer: encodes payloads; defaults to ``JsonSerializer()``.
        clock: where "now" comes from (``published_at``); the database's clock by default.
        table_prefix, schema, transient_retry: as for ``DelayedQueue``.
        notify: on PostgreSQL, wake the subscribers listening in workers (NOTIFY) when a publish
            commits; they poll otherwise. True.

    A message goes to the partition of its partition key (``partition_for``); within a partition
    offsets are 1, 2, 3, … in the order the publishing transactions commit, with no gaps.
    """

    def __init__(
        self,
        engine: Engine,
        name: str,
        *,
        serializer: Serializer | None = None,
        clock: Clock | None = None,
        table_prefix: str = DEFAULT_PREFIX,
        schema: str | None = None,
        transient_retry: TransientRetry = DEFAULT_RETRY,
        notify: bool = True,
    ) -> None:
        self.name = check_topic(name)
        self.notify = notify
        self.serializer: Serializer = serializer or JsonSerializer()
        self.ctx = TopicContext(
            engine, clock=clock, table_prefix=table_prefix, schema=schema, transient_retry=transient_retry
        )
        self._partitions: int | None = None

    def __repr__(self) -> str:
        return f"Topic({self.name!r})"

    # -- creation -------------------------------------------------------------------------------
    def create(self, partitions: int, *, using: Using = None) -> int:
        """Create the topic (and its dead-letter topic) with ``partitions`` partitions, unless it exists.

        The partition count is fixed at creation: creating an existing topic with another count is
        an ``InvalidInputError``. Returns the partition count.
        """
        check_partitions(partitions)

        def op(conn: Connection, dialect: Dialect) -> int:
            stmts = self.ctx.stmts(dialect)
            now = self.ctx.now(conn, stmts)
            ensure_topic(conn, stmts, self.name, partitions, now)
            ensure_topic(conn, stmts, dead_letter_topic(self.name), partitions, now)
            return partitions

        self._partitions = self.ctx.runner.run(using, op, "transaction")
        return self._partitions

    def partitions(self, *, using: Using = None) -> int:
        """The topic's partition count (read once, then remembered: it never changes)."""
        if self._partitions is None:
            self._partitions = self.ctx.runner.run(
                using, lambda conn, d: self.ctx.partitions(conn, self.ctx.stmts(d), self.name), "read"
            )
        return self._partitions

    # -- publishing -----------------------------------------------------------------------------
    def publish(self, partition_key: str, message_id: str, payload: Any, *, using: Using = None) -> OfferOutcome:
        """Append a message unless ``(topic, partition_key, message_id)`` is in the log already.

        ``CREATED`` or ``IGNORED``. With ``using=`` a ``Connection`` or ``Session``, it is part of the
        caller's transaction (an outbox): it becomes visible when that commits, and other publishers
        of the same partition wait for it (that is what keeps offsets in commit order).
        """
        return self.publish_many([(partition_key, message_id, payload)], using=using)[0]

    def publish_many(self, items: Iterable[tuple[str, str, Any]], *, using: Using = None) -> list[OfferOutcome]:
        """Publish ``(partition_key, message_id, payload)`` items in one transaction; one outcome per item.

        Everything is checked before anything is written. An id that repeats within the batch is
        ``IGNORED`` after its first. Partitions are locked in ascending order, so concurrent batches
        do not deadlock. Four statements in one transaction, however many partitions it touches.
        """
        prepared = [
            (check_partition_key(key), check_message_id(mid), encode(self.serializer, payload))
            for key, mid, payload in items
        ]
        if not prepared:
            return []

        def located(conn: Connection, stmts: TopicStatements) -> list[tuple[int, str, str, bytes]]:
            if self._partitions is None:
                self._partitions = self.ctx.partitions(conn, stmts, self.name)
            return [(partition_for(key, self._partitions), key, mid, payload) for key, mid, payload in prepared]

        def op(conn: Connection, dialect: Dialect) -> list[OfferOutcome]:
            stmts = self.ctx.stmts(dialect)
            located_items = located(conn, stmts)
            extra = None if headers is None else [{"headers": headers}] * len(located_items)
            created = append(conn, stmts, self.ctx.now_param(), self.name, located_items, tag, extra)
            if self.notify and any(created):
                _wake.notify(conn, dialect, self.ctx.tables, self.name)
            return [OfferOutcome.CREATED if made else OfferOutcome.IGNORED for made in created]

        def one(conn: Connection, dialect: Dialect) -> list[OfferOutcome]:
            stmts = self.ctx.stmts(dialect)
            wake = _wake.channel(dialect, self.ctx.tables, self.name) if self.notify else None
            made = stmts.publish_one(conn, self.name, located(conn, stmts)[0], tag, wake)
            return [OfferOutcome.CREATED if made else OfferOutcome.IGNORED]

        tag = self.serializer.type_tag
        with observe.publishing_topic(self.name, len(prepared)) as added:  # (tracing: the publish's span)
            headers = _headers.encode(added)
            outcomes: list[OfferOutcome] | None = None
            if len(prepared) == 1 and headers is None and self.ctx.clock is None and _owned(using):
                # One message without headers in delayq's own transaction: one autocommitted statement, its
                # wake-up included, where the database can (else two statements; see ``publish_one``).
                mode: Mode = "statement" if self.ctx.runner.dialect.writable_cte else "transaction"
                try:
                    outcomes = self.ctx.runner.run(using, one, mode)
                except IntegrityError:  # the same id published at this moment elsewhere: the general way
                    outcomes = None
            published = self.ctx.runner.run(using, op, "transaction") if outcomes is None else outcomes
        observe.count_topic("published", self.name, "", published.count(OfferOutcome.CREATED))
        return published

    # -- operators ------------------------------------------------------------------------------
    def heads(self, *, using: Using = None) -> list[PartitionInfo]:
        """Each partition's last offset and collected offset."""

        def op(conn: Connection, dialect: Dialect) -> list[PartitionInfo]:
            rows = conn.execute(self.ctx.stmts(dialect).heads_of_topic, {"topic_name": self.name})
            return [PartitionInfo(int(r.partition), int(r.head), int(r.collected)) for r in rows]

        return self.ctx.runner.run(using, op, "read")

    def collect_garbage(self, *, using: Using = None) -> int:
        """Delete the log's messages at or below the lowest watermark of all the topic's groups.

        A partition no group reads is kept whole. Returns how many messages were deleted.
        """

        def find(conn: Connection, dialect: Dialect) -> list[tuple[int, int]]:
            rows = conn.execute(self.ctx.stmts(dialect).collectable, {"topic_name": self.name})
            return [(int(r.partition), int(r.low)) for r in rows]

        deleted = 0
        for partition, _ in self.ctx.runner.run(using, find, "read"):
            deleted += self.ctx.runner.run(using, functools.partial(self._collect, partition=partition), "transaction")
        return deleted

    def drop_group(self, group: str, *, force: bool = False, using: Using = None) -> bool:
        """Remove consumer group ``group`` from this topic: its leases, watermarks, delivery states and
        subscribers, in one transaction. Returns whether it had any of them.

        Garbage collection stops waiting for it. A group whose partitions a subscriber holds (a lease not
        expired) is refused with ``InvalidInputError``, nothing dropped: close its subscribers first, or
        let their leases expire (a subscriber that died). ``force=True`` drops it anyway: a subscriber of
        it still running then holds nothing and gets nothing (its acks and polls change nothing) until it
        joins again (a restart), when the group starts anew, where its ``start`` says. Its dead letters
        stay in ``{name}_dlq`` (purge them, or requeue them once the group reads the topic again).
        """
        check_group(group)

        def op(conn: Connection, dialect: Dialect) -> bool:
            stmts = self.ctx.stmts(dialect)
            g = {"group": group, "topic_name": self.name}
            now = self.ctx.now(conn, stmts)
            # The leases first, locked (a poll or an ack of the group locks its lease row, then the other rows).
            leases = conn.execute(stmts.lock_group_leases, g).all()
            held: dict[str, list[str]] = {}
            for r in sorted(leases, key=lambda r: (r.holder or "", r.partition)):
                if r.holder is not None and r.expires_at > now:
                    held.setdefault(r.holder, []).append(str(r.partition))
            if held and not force:
                who = "; ".join(f"{h} holds partition{'s' * (len(p) > 1)} {', '.join(p)}" for h, p in held.items())
                raise InvalidInputError(
                    f"group {group!r} of topic {self.name!r} has live subscribers ({who}): "
                    "close them first, or force the drop (force=True, --force)"
                )
            found = [
                int(conn.execute(statement, g).rowcount)
                for statement in (stmts.drop_leases, stmts.drop_offsets, stmts.drop_states, stmts.drop_subscribers)
            ]
            return any(found)

        return self.ctx.runner.run(using, op, "transaction")

    # -- dead letters ---------------------------------------------------------------------------
    def dead_letters(
        self,
        *,
        group: str | None = None,
        key: str | None = None,
        message_id: str | None = None,
        limit: int = 100,
        using: Using = None,
    ) -> list[TopicDeadLetter]:
        """The topic's dead letters (the messages of ``{name}_dlq``), by partition and offset, at most
        ``limit``: of one consumer group or all, with this partition key and/or original message id."""

        if not isinstance(limit, int) or limit < 1:
            raise InvalidInputError(f"limit must be a positive int, got {limit!r}")
        sel = Selection.of(group, key, message_id, None, "dead_letters")
        n = self.partitions(using=using)
        return self.ctx.runner.run(
            using,
            lambda conn, d: list_dead(conn, self.ctx.tables.topics, self.name, n, sel, limit, self.serializer),
            "read",
        )

    def requeue_dead(
        self,
        *,
        group: str | None = None,
        key: str | None = None,
        message_id: str | None = None,
        everything: bool = False,
        using: Using = None,
    ) -> int:
        """Publish dead letters again on this topic, each for the group that gave up on it only, and delete
        them from ``{name}_dlq``; how many.

        Select them by ``message_id`` (the id they were published under) and/or partition ``key``, or
        ``everything=True``; ``group=`` narrows to one consumer group's. Each is published under the
        id ``{id}~requeue-{its offset in the dead-letter topic}`` (new: the original may still be in
        the log, where the same id would be ``IGNORED``), at the partition's head (after messages
        published since), and the topic's other groups get it marked acked so their watermarks pass
        it. Its publication and the deletion of the dead letter commit together, 500 dead letters
        per transaction. A dead letter of a group that no longer reads the topic stays where it is.
        """

        sel = Selection.of(group, key, message_id, everything, "requeue_dead")
        n = self.partitions(using=using)
        return self._each_chunk(
            sel, using, lambda conn, stmts, chunk: requeue(conn, stmts, self.ctx.now_param(), self.name, n, chunk)
        )

    def purge_dead(
        self,
        *,
        group: str | None = None,
        key: str | None = None,
        message_id: str | None = None,
        everything: bool = False,
        using: Using = None,
    ) -> int:
        """Delete dead letters from ``{name}_dlq`` (selected as for ``requeue_dead``); how many."""

        sel = Selection.of(group, key, message_id, everything, "purge_dead")
        return self._each_chunk(
            sel, using, lambda conn, stmts, chunk: purge(conn, stmts, self.ctx.now_param(), self.name, chunk)
        )

    def _each_chunk(
        self,
        sel: Selection,
        using: Using,
        act: Callable[[Connection, TopicStatements, list[tuple[int, int]]], int],
    ) -> int:

        n = self.partitions(using=using)
        found = self.ctx.runner.run(
            using, lambda conn, d: dead_offsets(conn, self.ctx.tables.topics, self.name, n, sel), "read"
        )

        def chunk(conn: Connection, dialect: Dialect, letters: list[tuple[int, int]]) -> int:
            return act(conn, self.ctx.stmts(dialect), letters)

        return sum(
            self.ctx.runner.run(using, functools.partial(chunk, letters=found[i : i + CHUNK]), "transaction")
            for i in range(0, len(found), CHUNK)
        )

    def _collect(self, conn: Connection, dialect: Dialect, partition: int) -> int:
        # The head row's lock orders this with publishers; then the topic row's, with a group being created
        # (which holds it shared while it reads where to start and writes its watermarks).
        stmts = self.ctx.stmts(dialect)
        key = {"topic_name": self.name, "part": partition}
        collected = conn.execute(stmts.lock_collected, key).scalar()
        conn.execute(stmts.lock_topic, key).all()
        low = conn.execute(stmts.lowest_watermark, key).scalar()
        if collected is None or low is None or low <= collected:
            return 0
        deleted = int(conn.execute(stmts.collect, {**key, "upto": low}).rowcount)
        conn.execute(stmts.set_collected, {**key, "upto": low})
        return deleted


def _owned(using: Using) -> bool:
    """Whether ``using`` has delayq run its own transactions (None or an Engine)."""
    return using is None or isinstance(using, Engine)
