"""Subscription: one subscriber of a consumer group on a topic.

It joins the group, shares the topic's partitions with the group's other live subscribers
(leases with fencing epochs), polls the partitions it holds, and acks, nacks or extends what it
got. Every write of a lease holder first finds and locks its lease row by (holder, epoch): a
subscriber whose lease was stolen changes nothing. See docs/topics.md.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import math
import threading
from collections.abc import Callable, Collection
from typing import Any, Literal, TypeVar

from sqlalchemy.engine import Connection, Engine

from delayq._outcome import Bury, Unfinished, after_failure
from delayq._steering import Retry
from delayq.clock import Clock, duration_ms, from_ms, to_ms
from delayq.dialects import Dialect
from delayq.errors import InvalidInputError, SerializationMismatchError
from delayq.schema import DEFAULT_PREFIX
from delayq.serializers import JsonSerializer, Serializer
from delayq.topics._backends import RANGE_SLOTS
from delayq.topics._context import TopicContext
from delayq.topics.dead_letters import bury
from delayq.topics.delivery import DeadLetterInfo, LeaseLostError, TopicDelivery
from delayq.topics.names import (
    DLQ_SUFFIX,
    check_group,
    check_subscriber,
    check_topic_stored,
    dead_letter_topic,
    has_dead_letter_topic,
)
from delayq.topics.statements import PENDING, TopicStatements
from delayq.topics.topic import ensure_topic
from delayq.transactions import DEFAULT_RETRY, TransientRetry, Using

log = logging.getLogger("delayq")
T = TypeVar("T")
Start = Literal["earliest", "latest"]


class Subscription:
    """One subscriber (``name``) of consumer group ``group`` on ``topic``. Its methods may be called from
    several threads (a worker's poller, heartbeat and handlers).

    Args:
        engine: the engine of the database holding delayq's tables.
        topic: the topic (created with ``Topic.create``).
        group: the consumer group: letters, digits, ``.``, ``_``, ``-``. Groups read the topic independently.
        name: this subscriber's name, unique in the group (a host and process id, say).
        start: where a group that does not exist yet starts: ``"earliest"`` (the oldest message the
            log retains) or ``"latest"`` (only messages published after it was created). Defaults to earliest.
        lease_duration: how long a partition's lease and a heartbeat last without renewal; a
            subscriber that stops renewing loses its partitions to others after it. 30 s by default.
        visibility_timeout: how long a delivered message stays invisible to further polls. 5 min by default.
        max_attempts: after this many deliveries without an ack, the message goes to ``{topic}_dlq``
            (a nack of the last attempt moves it at once; a subscriber that crashes on it every time
            has it moved by the next poll). 10 by default; None never dead-letters.
        strict: deliver one message of a partition at a time, in offset order (the next only after
            this one is acked or dead-lettered). Off by default: messages of a partition are
            delivered in order but may be in flight together and acked out of order.
        scan_limit: how many offsets above the watermark a poll looks at per partition. 200.
        serializer, clock, table_prefix, schema, transient_retry: as for ``DelayedQueue``.
    """

    def __init__(
        self,
        engine: Engine,
        topic: str,
        group: str,
        name: str,
        *,
        start: Start = "earliest",
        lease_duration: dt.timedelta = dt.timedelta(seconds=30),
        visibility_timeout: dt.timedelta = dt.timedelta(minutes=5),
        max_attempts: int | None = 10,
        strict: bool = False,
        scan_limit: int = 200,
        serializer: Serializer | None = None,
        clock: Clock | None = None,
        table_prefix: str = DEFAULT_PREFIX,
        schema: str | None = None,
        transient_retry: TransientRetry = DEFAULT_RETRY,
    ) -> None:
        self.topic = check_topic_stored(topic)
        if max_attempts is not None and not has_dead_letter_topic(self.topic):
            raise InvalidInputError(
                f"topic {topic!r} is too long for a dead-letter topic of its own: pass max_attempts=None"
            )
        self.group = check_group(group)
        self.name = check_subscriber(name)
        if start not in ("earliest", "latest"):
            raise InvalidInputError(f"start must be 'earliest' or 'latest', got {start!r}")
        self.start = start
        self._lease_ms = duration_ms(lease_duration, "lease_duration")
        self._visibility_ms = duration_ms(visibility_timeout, "visibility_timeout")
        if self._lease_ms <= 0 or self._visibility_ms <= 0:
            raise InvalidInputError("lease_duration and visibility_timeout must be positive")
        if max_attempts is not None and (not isinstance(max_attempts, int) or max_attempts < 1):
            raise InvalidInputError(f"max_attempts must be at least 1 or None, got {max_attempts!r}")
        if not isinstance(scan_limit, int) or scan_limit < 1:
            raise InvalidInputError(f"scan_limit must be a positive int, got {scan_limit!r}")
        self.max_attempts = max_attempts
        self.strict = strict
        self.scan_limit = scan_limit
        self.serializer: Serializer = serializer or JsonSerializer()
        self.ctx = TopicContext(
            engine,
            clock=clock,
            table_prefix=table_prefix,
            schema=schema,
            transient_retry=transient_retry,
            owner="Subscription",
        )
        self._partitions: int | None = None
        # Replaced, never changed in place (under ``_held_lock``): threads read it without a lock.
        self._held: dict[int, int] = {}
        self._held_lock = threading.Lock()
        self._turn = 0
        self._work: list[tuple[int, int, int]] = []  # partitions with work a poll did not reach (``_next_batch``)
        self._batch_limit = RANGE_SLOTS  # partitions per poll transaction

    def __repr__(self) -> str:
        return f"Subscription({self.topic!r}, group={self.group!r}, name={self.name!r})"

    @property
    def held(self) -> dict[int, int]:
        """The partitions this subscriber holds, each with its lease's epoch (as of the last rebalance or poll)."""
        return dict(self._held)

    # -- membership ---------------------------------------------------------------------------------
    def join(self, *, using: Using = None) -> None:
        """Create the group's rows for the topic if it has none (its start per ``start``) and send a heartbeat."""

        def op(conn: Connection, dialect: Dialect) -> None:
            stmts = self.ctx.stmts(dialect)
            partitions = self.ctx.partitions(conn, stmts, self.topic)
            now = self.ctx.now(conn, stmts)
            g = {"group": self.group, "topic_name": self.topic}
            if conn.execute(stmts.group_partitions, g).scalar_one() < partitions:
                # The topic's row, shared: a collection of the log waits for these watermarks, or this reads
                # the collected offsets it set. Not the head rows, which every open publisher holds.
                conn.execute(stmts.lock_topic_shared, g).all()
                heads = conn.execute(stmts.heads_of_topic, g).all()
                conn.execute(stmts.forget_orphan_states, g)  # a group created again inherits no states
                conn.execute(
                    stmts.create_offset,
                    [
                        {**g, "part": h.partition, "now_v": now}
                        | {"acked": h.collected if self.start == "earliest" else h.head}
                        for h in heads
                    ],
                )
                conn.execute(stmts.create_lease, [{**g, "part": h.partition} for h in heads])
            if self.max_attempts is not None:
                ensure_topic(conn, stmts, dead_letter_topic(self.topic), partitions, now)
            conn.execute(stmts.heartbeat, {**g, "me": self.name, "now_v": now})
            self._partitions = partitions

        self.ctx.runner.run(using, op, "transaction")

    def heartbeat(self, *, using: Using = None) -> None:
        """Tell the group this subscriber is alive (``rebalance`` does it too)."""

        def op(conn: Connection, dialect: Dialect) -> None:
            stmts = self.ctx.stmts(dialect)
            now = self.ctx.now(conn, stmts)
            conn.execute(
                stmts.heartbeat, {"group": self.group, "topic_name": self.topic, "me": self.name, "now_v": now}
            )

        self.ctx.runner.run(using, op, "statement")

    def rebalance(self, *, busy: Collection[int] = (), leaving: bool = False, using: Using = None) -> dict[int, int]:
        """Renew the leases held, heartbeat, then hold the fair share: ``ceil(partitions / live subscribers)``.

        Partitions beyond the share are released: first those not in ``busy`` (a worker passes the
        partitions it has deliveries in flight for, whose acks a release would fence out), the
        highest first, so the same ones go every time. Below it, free or expired leases are taken
        (an expired one is stolen: its epoch goes up, fencing its old holder). Returns the
        partitions held, each with its epoch. One transaction, a handful of statements; call it
        about three times per ``lease_duration``. With ``leaving``, every partition not in ``busy`` is
        released and none is taken: a stopping worker keeps only what its running handlers need.
        """
        if self._partitions is None:
            self.join(using=using)
        partitions = self._partitions
        assert partitions is not None

        def op(conn: Connection, dialect: Dialect) -> dict[int, int]:
            stmts = self.ctx.stmts(dialect)
            now = self.ctx.now(conn, stmts)
            g = {"group": self.group, "topic_name": self.topic, "me": self.name}
            until = now + self._lease_ms
            # The leases before the subscriber's row, as a poll, a close and a drop of the group take them.
            conn.execute(stmts.renew, {**g, "until": until})  # locks exactly the rows this subscriber holds
            conn.execute(stmts.heartbeat, {**g, "now_v": now})
            live = int(conn.execute(stmts.live_subscribers, {**g, "live_after": now - self._lease_ms}).scalar_one())
            share = math.ceil(partitions / max(live, 1))
            mine = {int(r.partition): int(r.epoch) for r in conn.execute(stmts.my_leases, g)}
            if leaving:
                idle = [p for p in mine if p not in busy]
                if idle:
                    conn.execute(stmts.release, {**g, "parts": idle})
                    for p in idle:
                        del mine[p]
            elif len(mine) > share:
                excess = sorted(mine, key=lambda p: (p in busy, -p))[: len(mine) - share]
                conn.execute(stmts.release, {**g, "parts": excess})
                for p in excess:
                    del mine[p]
            elif len(mine) < share:
                free = list(conn.execute(stmts.free_leases, {**g, "now_v": now, "limit": share - len(mine)}).scalars())
                if free:
                    conn.execute(stmts.take, {**g, "parts": free, "now_v": now, "until": until})
                    mine.update(
                        {int(r.partition): int(r.epoch) for r in conn.execute(stmts.taken, {**g, "parts": free})}
                    )
            return mine

        held = self.ctx.runner.run(using, op, "transaction")
        with self._held_lock:
            self._held = held
        return dict(held)

    def close(self, *, using: Using = None) -> None:
        """Leave the group at once: release every lease and deregister, so the others take the partitions
        on their next rebalance (no waiting for leases to expire). Deliveries not acked come back to
        whoever takes their partition, after their visibility timeout."""

        def op(conn: Connection, dialect: Dialect) -> None:
            stmts = self.ctx.stmts(dialect)
            now = self.ctx.now(conn, stmts)
            g = {"group": self.group, "topic_name": self.topic, "me": self.name}
            conn.execute(stmts.release_all, g)
            conn.execute(stmts.deregister, {**g, "now_v": now})

        self.ctx.runner.run(using, op, "transaction")
        with self._held_lock:
            self._held = {}

    @property
    def lease_duration(self) -> dt.timedelta:
        """How long a partition's lease lasts unless renewed (``rebalance``)."""
        return dt.timedelta(milliseconds=self._lease_ms)

    # -- consuming ----------------------------------------------------------------------------------
    def poll(self, limit: int = 10, *, using: Using = None) -> list[TopicDelivery]:
        """Up to ``limit`` deliverable messages from the partitions held, each partition in offset order.

        A message is deliverable when this group never delivered it, or its visibility timeout or
        nack delay has passed (with ``strict``, only the partition's first message not done, and
        only when no other is in flight). Delivering it counts an attempt and hides it for the
        visibility timeout; one that was delivered ``max_attempts`` times already goes to the
        dead-letter topic instead. Costs one read to find the held partitions with work, then one
        transaction per batch of partitions (as many as their heads promise to fill ``limit``;
        partitions take turns between polls). In delayq's own transactions, a batch's failure after
        earlier ones delivered returns their deliveries (they are committed) and logs the error; a poll
        that delivered nothing yet raises it. See docs/topics.md, "Delivery state".
        """
        if not isinstance(limit, int) or limit < 1:
            raise InvalidInputError(f"limit must be a positive int, got {limit!r}")
        out: list[TopicDelivery] = []
        reread = False
        while len(out) < limit:
            batch, reread = self._next_batch(limit - len(out), using, reread=reread)
            if batch is None:
                break
            try:
                got = self._poll_batch(batch, limit - len(out), using)
            except Exception as exc:
                if not out or not self._owned(using):
                    raise
                self._poll_failed(batch[0][0], exc)
                break
            out.extend(got)
        return out

    def _next_batch(self, want: int, using: Using, *, reread: bool) -> tuple[list[tuple[int, int]] | None, bool]:
        """The next batch of held partitions with work, each (partition, head), whose fresh messages fill
        ``want``, and whether the partitions with work were read during this poll.

        One read finds every held partition with work; the partitions a poll does not reach are kept, in
        their turn, for the next polls (a partition's work beyond what was read shows at the next read). A
        poll that used up the kept ones without filling its limit reads again, once: None then ends it."""
        while True:
            work = [w for w in self._work if w[0] in self._held]
            if work or reread:
                break
            self._work = self._plan(using)
            reread = True
        if not work:
            self._work = []
            return None, reread
        batch: list[tuple[int, int]] = []
        promised = 0
        for p, head, fresh in work:
            batch.append((p, head))
            promised += fresh
            if promised >= want or len(batch) >= self._batch_limit:
                break
        self._work = work[len(batch) :]
        return batch, reread

    def _plan(self, using: Using) -> list[tuple[int, int, int]]:
        """The held partitions with work, in this poll's turn: (partition, head, the fresh messages it
        promises, at least 1) of each with a head above its delivered offset (within the scan window), an
        expired range or rows (one read)."""
        if not self._held:
            return []
        work: dict[int, tuple[int, int]] = {}
        for p, r in self._progress(using).items():
            mark, head = int(r.acked_offset), int(r.head)
            sent = max(mark, int(r.delivered_offset))
            fresh = 0 if self.strict and sent > mark else max(0, min(head, mark + self.scan_limit) - sent)
            expired = sent > mark and int(r.range_until) <= int(r.now)
            if fresh or expired or int(r.marked_upto) > mark:
                work[p] = (head, max(fresh, 1))
        if not work:
            return []
        candidates = sorted(work)
        self._turn = (self._turn + 1) % len(candidates)
        return [(p, *work[p]) for p in candidates[self._turn :] + candidates[: self._turn]]

    def _poll_batch(self, batch: list[tuple[int, int]], want: int, using: Using) -> list[TopicDelivery]:
        """Up to ``want`` deliveries of a batch of held partitions, in a transaction of its own (or the caller's)."""
        got, lost = self.ctx.runner.run(
            using, functools.partial(self._poll_partitions, batch=batch, want=want), "transaction"
        )
        for partition in lost:
            self._drop(partition)
        return got

    def _poll_failed(self, partition: int, exc: Exception) -> None:
        """A later partition's transaction failed: the deliveries of those before it are committed, so the
        poll returns them (never drops them); this partition's transaction rolled back, and a poll where it
        comes first (partitions take turns) raises the error if it persists."""
        first_line = str(exc).strip().partition("\n")[0]
        log.warning(
            "poll of %s[%d…] failed (%s: %s); returning the earlier partitions' deliveries",
            self.topic,
            partition,
            type(exc).__name__,
            first_line,
        )

    @staticmethod
    def _owned(using: Using) -> bool:
        """Whether ``using`` has delayq run its own transactions (None or an Engine)."""
        return using is None or isinstance(using, Engine)

    def advance_watermarks(self, *, using: Using = None) -> dict[int, int]:
        """Advance the watermark of every partition held past its contiguous done messages, and delete the
        delivery states behind it. Acks in order move it themselves; polls do it for the partitions they
        visit; a worker calls this on a tick so partitions that no poll visits catch up too. One read,
        then one transaction per partition held with rows above its watermark; partitions with messages
        above the watermark whose lease was lost (one more read, when there are any) are forgotten.
        Returns the watermarks of the partitions held."""
        marks: dict[int, int] = {}
        progress = self._progress(using)
        unchecked: list[int] = []
        for partition, epoch in sorted(self._held.items()):
            found = progress.get(partition)
            mark = 0 if found is None else int(found.acked_offset)
            if found is None or int(found.head) <= mark:
                marks[partition] = mark
                continue
            if int(found.marked_upto) <= mark:  # no rows: nothing to pass (in-order acks moved it)
                marks[partition] = mark
                unchecked.append(partition)
                continue

            def op(conn: Connection, dialect: Dialect, p: int = partition, e: int = epoch) -> int | None:
                stmts = self.ctx.stmts(dialect)
                key = self._key(p)
                row = conn.execute(stmts.hold_exclusive, self._fence(key, e)).first()
                if row is None:
                    return None
                advanced, _, _ = self._scan(conn, stmts, key, int(row.now))
                return advanced

            advanced = self.ctx.runner.run(using, op, "transaction")
            if advanced is None:
                self._drop(partition)
            else:
                marks[partition] = advanced
        if unchecked:
            leases = self._leases_now(using)
            for partition in unchecked:
                if leases.get(partition) != self._held.get(partition):
                    self._drop(partition)
                    del marks[partition]
        return marks

    def watermarks(self, *, using: Using = None) -> dict[int, int]:
        """The group's watermark of every partition (every offset at or below it is done for the group)."""

        def op(conn: Connection, dialect: Dialect) -> dict[int, int]:
            rows = conn.execute(self.ctx.stmts(dialect).group_offsets, {"group": self.group, "topic_name": self.topic})
            return {int(r.partition): int(r.acked_offset) for r in rows}

        return self.ctx.runner.run(using, op, "read")

    # -- outcomes -----------------------------------------------------------------------------------
    def ack(self, delivery: TopicDelivery, *, using: Using = None) -> bool:
        """See ``TopicDelivery.ack``. One transaction: lock the lease (shared), then move the watermark past
        it when it is next in order, else mark it acked through its row."""
        return self.ack_many([delivery], using=using)[0]

    def ack_many(self, deliveries: list[TopicDelivery], *, using: Using = None) -> list[bool]:
        """Ack several deliveries in one transaction: the leases of their partitions locked (shared, one
        statement), the partitions whose deliveries are next in order acked by moving their watermarks
        (one statement), the others through their rows, each by its offset and attempt count. A result
        per delivery (one whose lease was lost is False; one listed twice is acked by its first entry)."""
        by_lease = self._by_lease(deliveries)
        if not by_lease:
            return []
        acked: set[int] = set()
        if self.ctx.runner.dialect.fence_in_update:
            runs = self._runs(by_lease)

            def in_order(conn: Connection, dialect: Dialect) -> set[int]:
                key = {"group": self.group, "topic_name": self.topic, "me": self.name, **self.ctx.now_param()}
                return self.ctx.stmts(dialect).ack_runs_fenced(conn, key, runs)

            # The common case, each partition's deliveries next in order: one statement, fences included.
            moved = self.ctx.runner.run(using, in_order, "statement") if runs else set()
            for p in moved:
                acked.update(i for i, _ in by_lease[p, runs[p][0]].values())
            by_lease = {pe: firsts for pe, firsts in by_lease.items() if pe[0] not in moved}
        if by_lease:

            def op(conn: Connection, dialect: Dialect) -> set[int]:
                return self._ack_in(conn, self.ctx.stmts(dialect), by_lease)

            acked |= self.ctx.runner.run(using, op, "transaction")
        return [i in acked for i in range(len(deliveries))]

    @staticmethod
    def _runs(
        by_lease: dict[tuple[int, int], dict[tuple[int, int], tuple[int, int]]],
    ) -> dict[int, tuple[int, int, int]]:
        """partition -> (epoch, after, upto) of the partitions whose deliveries (of one lease) are a run of
        offsets at attempt 1: acked in order by moving the watermark from ``after`` to ``upto``."""
        leases: dict[int, int] = {}
        for p, _ in by_lease:
            leases[p] = leases.get(p, 0) + 1
        runs: dict[int, tuple[int, int, int]] = {}
        for (p, epoch), firsts in by_lease.items():
            offsets = sorted(o for o, _ in firsts)
            if leases[p] == 1 and all(a == 1 for _, a in firsts) and offsets[-1] - offsets[0] == len(offsets) - 1:
                runs[p] = (epoch, offsets[0] - 1, offsets[-1])
        return runs

    @staticmethod
    def _by_lease(deliveries: list[TopicDelivery]) -> dict[tuple[int, int], dict[tuple[int, int], tuple[int, int]]]:
        """(partition, epoch) -> (offset, attempts) -> (the first index it has in ``deliveries``, its deadline)."""
        by_lease: dict[tuple[int, int], dict[tuple[int, int], tuple[int, int]]] = {}
        for i, d in enumerate(deliveries):
            by_lease.setdefault((d.partition, d.epoch), {}).setdefault(
                (d.offset, d.attempts), (i, to_ms(d.invisible_until))
            )
        return by_lease

    def _ack_in(
        self,
        conn: Connection,
        stmts: TopicStatements,
        by_lease: dict[tuple[int, int], dict[tuple[int, int], tuple[int, int]]],
    ) -> set[int]:
        """Ack in ``conn``'s transaction; the indexes acked."""
        g = {"group": self.group, "topic_name": self.topic}
        parts = sorted({p for p, _ in by_lease})
        fenced = conn.execute(
            stmts.fence_many_shared, {**g, "me": self.name, "parts": parts, **self.ctx.now_param()}
        ).all()
        if not fenced:
            return set()
        epochs = {int(r.partition): int(r.epoch) for r in fenced}
        now = int(fenced[0].now)
        held = {pe: firsts for pe, firsts in by_lease.items() if epochs.get(pe[0]) == pe[1]}
        runs = {p: (after, upto) for p, (_, after, upto) in self._runs(held).items()}
        in_order = stmts.ack_runs(conn, g, runs, now) if runs else set()
        acked: set[int] = set()
        for (p, _), firsts in sorted(held.items()):
            if p in in_order:
                acked.update(i for i, _ in firsts.values())
                continue
            key = self._key(p)
            self._materialize(conn, stmts, key, [(o, a, until) for (o, a), (_, until) in firsts.items()])
            acked.update(firsts[pair][0] for pair in stmts.ack_each(conn, key, list(firsts)))
        return acked

    def _materialize(
        self, conn: Connection, stmts: TopicStatements, key: dict[str, Any], items: list[tuple[int, int, int]]
    ) -> None:
        """Give the deliveries ``items`` (offset, attempts, deadline) of the range a row each (pending, attempt
        1), unless they have one: only those still in the range (docs/topics.md, "Delivery state")."""
        ones = sorted((offset, until) for offset, attempts, until in items if attempts == 1)  # (others: rows)
        if len(ones) > 1:
            span = {**key, "low": ones[0][0], "offset": ones[-1][0]}
            if conn.execute(stmts.mark_span, span).rowcount == 1:  # all in the range: two statements
                conn.execute(stmts.materialize, [{**key, "offset": o, "until": until} for o, until in ones])
                return
        for offset, until in ones:
            if conn.execute(stmts.mark, {**key, "offset": offset}).rowcount == 1:
                conn.execute(stmts.materialize, {**key, "offset": offset, "until": until})

    def nack(
        self,
        delivery: TopicDelivery,
        delay: dt.timedelta = dt.timedelta(0),
        error: str | None = None,
        *,
        using: Using = None,
    ) -> bool:
        """See ``TopicDelivery.nack``."""
        delay_ms = duration_ms(delay, "delay")
        if delay_ms < 0:
            raise InvalidInputError("delay must not be negative")

        def op(conn: Connection, stmts: TopicStatements, key: dict[str, Any], now: int) -> bool:
            retried = after_failure(Retry(delay, error), delivery.attempts, max_attempts=self.max_attempts)
            if isinstance(retried, Bury):  # the last attempt: a nack cannot bring it back
                return self._bury(conn, stmts, key, delivery.offset, delivery.attempts, error)
            params = {**self._this(key, delivery), "until": now + delay_ms, "error": error}
            return conn.execute(stmts.nack, params).rowcount == 1

        return bool(self._fenced(delivery, op, using))

    def release(self, delivery: TopicDelivery, *, using: Using = None) -> bool:
        """Give a delivery back unprocessed: deliverable again at once, the attempt not counted (as
        ``DelayedQueue.release``). For work polled but never started. False when the lease or the
        delivery was lost."""

        def op(conn: Connection, stmts: TopicStatements, key: dict[str, Any], now: int) -> bool:
            return conn.execute(stmts.give_back, {**self._this(key, delivery), "until": now}).rowcount == 1

        return bool(self._fenced(delivery, op, using))

    def fail(self, delivery: TopicDelivery, error: str, *, using: Using = None) -> bool:
        """See ``TopicDelivery.fail``."""

        def op(conn: Connection, stmts: TopicStatements, key: dict[str, Any], now: int) -> bool:
            return self._bury(conn, stmts, key, delivery.offset, delivery.attempts, error)

        return bool(self._fenced(delivery, op, using))

    def extend(self, delivery: TopicDelivery, by: dt.timedelta, *, using: Using = None) -> dt.datetime | None:
        """See ``TopicDelivery.extend``."""
        by_ms = duration_ms(by, "by")

        def op(conn: Connection, stmts: TopicStatements, key: dict[str, Any], now: int) -> int | None:
            if conn.execute(stmts.extend, {**self._this(key, delivery), "until": now + by_ms}).rowcount != 1:
                return None
            return int(conn.execute(stmts.visible_until, {**key, "offset": delivery.offset}).scalar_one())

        found = self._fenced(delivery, op, using, lost=None)
        return None if found is None else from_ms(found)

    def handle_exactly_once(
        self, delivery: TopicDelivery, handler: Callable[[Connection], T], *, using: Using = None
    ) -> T:
        """Run ``handler(conn)`` and ack ``delivery`` in one transaction (delayq's own, or the caller's).

        When the lease or the delivery was lost, ``LeaseLostError`` is raised and the handler's
        writes roll back with it (in the caller's transaction: the caller must roll back). So a
        message's database effects commit once per group, whatever crashes and redeliveries.
        """

        def op(conn: Connection, dialect: Dialect) -> T:
            result = handler(conn)
            self.ctx.runner.bound_calls(conn)  # delayq's calls from here, the COMMIT included
            if not self._ack_in(conn, self.ctx.stmts(dialect), self._by_lease([delivery])):
                raise LeaseLostError(
                    f"{self.name} lost offset {delivery.offset} of {self.topic}[{delivery.partition}]: rolled back"
                )
            return result

        # The server ends the transaction once idle for the visibility timeout (docs/topics.md, "Bounds").
        return self.ctx.runner.run(using, op, "transaction", hosting=self._visibility_ms / 1000)

    # -- internals ------------------------------------------------------------------------------------
    def _drop(self, partition: int) -> None:
        """Forget a partition whose lease was lost."""
        with self._held_lock:
            self._held = {p: e for p, e in self._held.items() if p != partition}

    def _leases_now(self, using: Using) -> dict[int, int]:
        """The partitions whose lease this subscriber holds in the database now, with their epochs (one read)."""

        def op(conn: Connection, dialect: Dialect) -> dict[int, int]:
            rows = conn.execute(
                self.ctx.stmts(dialect).my_leases, {"group": self.group, "topic_name": self.topic, "me": self.name}
            )
            return {int(r.partition): int(r.epoch) for r in rows}

        return self.ctx.runner.run(using, op, "read")

    def _progress(self, using: Using) -> dict[int, Any]:
        """Each partition held: its row of the group's state (watermark, delivered offset, range deadline,
        rows' reach), the partition's head and now. One read: of the group's partitions when this
        subscriber holds more than half of them (no list of partitions to bind), else of those it holds."""
        held = self._held
        if not held:
            return {}

        def op(conn: Connection, dialect: Dialect) -> dict[int, Any]:
            stmts = self.ctx.stmts(dialect)
            group = {"group": self.group, "topic_name": self.topic, **self.ctx.now_param()}
            if self._partitions is not None and 2 * len(held) > self._partitions:
                rows = conn.execute(stmts.group_progress, group)
            else:
                rows = conn.execute(stmts.with_work, {**group, "parts": sorted(held)})
            return {int(r.partition): r for r in rows if r.partition in held}

        return self.ctx.runner.run(using, op, "read")

    def _key(self, partition: int) -> dict[str, Any]:
        return {"group": self.group, "topic_name": self.topic, "part": partition}

    def _fence(self, key: dict[str, Any], epoch: int) -> dict[str, Any]:
        return {**key, "me": self.name, "lease_epoch": epoch, **self.ctx.now_param()}

    @staticmethod
    def _this(key: dict[str, Any], delivery: TopicDelivery) -> dict[str, Any]:
        return {**key, "offset": delivery.offset, "attempt_no": delivery.attempts}

    def _fenced(
        self,
        delivery: TopicDelivery,
        op: Callable[[Connection, TopicStatements, dict[str, Any], int], Any],
        using: Using,
        lost: Any = False,
    ) -> Any:
        """Run ``op`` after finding and locking (shared) this subscriber's lease of the delivery's partition."""

        def run(conn: Connection, dialect: Dialect) -> Any:
            stmts = self.ctx.stmts(dialect)
            key = self._key(delivery.partition)
            row = conn.execute(stmts.hold_shared, self._fence(key, delivery.epoch)).first()
            if row is None:
                return lost
            self._materialize(conn, stmts, key, [(delivery.offset, delivery.attempts, to_ms(delivery.invisible_until))])
            return op(conn, stmts, key, int(row.now))

        return self.ctx.runner.run(using, run, "transaction")

    def _bury(
        self,
        conn: Connection,
        stmts: TopicStatements,
        key: dict[str, Any],
        offset: int,
        attempts: int,
        error: str | None,
    ) -> bool:
        message = conn.execute(stmts.messages, {**key, "offsets": [offset]}).one()
        return bury(conn, stmts, self.ctx.now_param(), key, message, attempts, error)

    def _scan(
        self, conn: Connection, stmts: TopicStatements, key: dict[str, Any], now: int
    ) -> tuple[int, list[int], dict[int, Any]]:
        """Advance the partition's watermark past its contiguous done messages; return it, the offsets
        scanned above it and their delivery states. Call it after the exclusive fence: its first statement
        reads the watermark as the last exclusive holder committed it (the fence's own snapshot may be older)."""
        mark = int(conn.execute(stmts.watermark, key).scalar_one())
        offsets = [
            int(o)
            for o in conn.execute(stmts.offsets_after, {**key, "after": mark, "limit": self.scan_limit}).scalars()
        ]
        if not offsets:
            return mark, [], {}
        states = {
            int(r.message_offset): r for r in conn.execute(stmts.states, {**key, "after": mark, "upto": offsets[-1]})
        }
        new = mark
        for o in offsets:
            state = states.get(o)
            if state is None or state.status == PENDING:
                break
            new = o
        if new > mark:
            conn.execute(stmts.set_watermark, {**key, "acked": new, "now_v": now})
            conn.execute(stmts.forget_states, {**key, "upto": new})
        return new, [o for o in offsets if o > new], states

    def _poll_partitions(
        self, conn: Connection, dialect: Dialect, batch: list[tuple[int, int]], want: int
    ) -> tuple[list[TopicDelivery], set[int]]:
        """A batch's poll, in ``conn``'s transaction: (the deliveries, the partitions whose lease was lost).

        The fences of the batch and their offsets rows, locked by one statement; the partitions in the common case (no
        rows, the range not expired) read their log ranges in one statement and move their ranges in
        another; the others are scanned one by one (docs/topics.md, "Delivery state")."""
        stmts = self.ctx.stmts(dialect)
        g = {"group": self.group, "topic_name": self.topic}
        epochs = {p: e for p, e in ((p, self._held.get(p)) for p, _ in batch) if e is not None}
        lost = {p for p, _ in batch if p not in epochs}
        if not epochs:
            return [], lost
        fenced = conn.execute(
            stmts.fence_many, {**g, "me": self.name, "parts": sorted(epochs), **self.ctx.now_param()}
        ).all()
        states = {int(r.partition): r for r in fenced if epochs[int(r.partition)] == int(r.epoch)}
        held = set(states)
        lost |= set(epochs) - held
        if not held:
            return [], lost
        now = int(fenced[0].now)
        until = now + self._visibility_ms
        out: list[TopicDelivery] = []
        ranges: list[tuple[int, int, int]] = []
        left = want
        for p, head in batch:
            r = states.get(p)
            if p not in held or r is None or left <= 0:
                continue
            mark = int(r.acked_offset)
            sent = max(mark, int(r.delivered_offset))
            if int(r.marked_upto) > mark or (sent > mark and int(r.range_until) <= now):
                got = self._scan_partition(conn, stmts, p, epochs[p], now, left, (mark, sent, int(r.range_until)))
                out.extend(got)
                left -= len(got)
                continue
            if self.strict and sent > mark:
                continue  # one in flight already
            room = min(left, mark + self.scan_limit - sent, head - sent, 1 if self.strict else left)
            if room > 0:
                ranges.append((p, sent, sent + room))
                left -= room
        if ranges:
            out.extend(self._deliver_ranges(conn, stmts, ranges, epochs, now, until))
        return out, lost

    def _deliver_ranges(
        self,
        conn: Connection,
        stmts: TopicStatements,
        ranges: list[tuple[int, int, int]],
        epochs: dict[int, int],
        now: int,
        until: int,
    ) -> list[TopicDelivery]:
        """The common case: read the log ranges with their payloads, move each partition's delivered offset
        to the last offset read and its range deadline to ``until``. A message that does not decode goes
        to the dead-letter topic (a row of its own)."""
        g = {"group": self.group, "topic_name": self.topic}
        out: list[TopicDelivery] = []
        sent: dict[int, int] = {}
        doomed: list[tuple[int, Any, str]] = []
        dead = self.topic.endswith(DLQ_SUFFIX)  # (its failure columns)
        moving = stmts.kind.writable_cte  # the ranges moved by the read itself
        rows = (
            stmts.read_and_move_ranges(conn, g, ranges, dead, until)
            if moving
            else stmts.read_ranges(conn, g, ranges, dead)
        )
        for row in rows:
            p = int(row.partition)
            sent[p] = int(row.message_offset)
            try:
                payload = self._decode(row)
            except SerializationMismatchError as exc:
                if has_dead_letter_topic(self.topic):  # else no dead-letter topic: it stays in flight, undelivered
                    doomed.append((p, row, str(exc)))
                continue
            out.append(self._delivery(row, p, epochs[p], 1, until, payload, dead))
        if sent and not moving:
            stmts.set_ranges(conn, g, sent, until)
        for p, row, error in doomed:
            self._bury_fresh(conn, stmts, self._key(p), row, now, error)
        return out

    def _bury_fresh(
        self, conn: Connection, stmts: TopicStatements, key: dict[str, Any], row: Any, now: int, error: str
    ) -> None:
        """Dead-letter a message never delivered (it does not decode): a row at attempt 0 to bury."""
        offset = int(row.message_offset)
        conn.execute(
            stmts.insert_state,
            [
                {"consumer_group": self.group, "topic": self.topic, "partition": key["part"], "message_offset": offset}
                | {"status": PENDING, "invisible_until": now, "attempts": 0}
            ],
        )
        conn.execute(stmts.raise_mark, {**key, "offset": offset})
        bury(conn, stmts, self.ctx.now_param(), key, row, 0, error)

    def _expire_range(
        self, conn: Connection, stmts: TopicStatements, key: dict[str, Any], mark: int, sent: int, deadline: int
    ) -> None:
        """The range's deadline passed: give each of its messages without a row one (pending, attempt 1,
        invisible until the deadline), so they are delivered again through their rows, attempts counted."""
        have = {int(r.message_offset) for r in conn.execute(stmts.states, {**key, "after": mark, "upto": sent})}
        missing = [int(o) for o in conn.execute(stmts.offsets_between, {**key, "after": mark, "upto": sent}).scalars()]
        rows = [
            {"consumer_group": self.group, "topic": self.topic, "partition": key["part"], "message_offset": o}
            | {"status": PENDING, "invisible_until": deadline, "attempts": 1}
            for o in missing
            if o not in have
        ]
        if rows:
            conn.execute(stmts.insert_state, rows)
        conn.execute(stmts.raise_mark, {**key, "offset": sent})

    def _scan_partition(
        self,
        conn: Connection,
        stmts: TopicStatements,
        partition: int,
        epoch: int,
        now: int,
        want: int,
        progress: tuple[int, int, int],
    ) -> list[TopicDelivery]:
        """A partition with rows or an expired range: the scan of ``scan_limit`` offsets above its watermark
        (after its fence, in the poll's transaction). ``progress``: its watermark, delivered offset and range
        deadline, as read under the lock."""
        key = self._key(partition)
        mark, sent, deadline = progress
        if sent > mark and deadline <= now:
            self._expire_range(conn, stmts, key, mark, sent, deadline)
        _, offsets, states = self._scan(conn, stmts, key, now)
        fresh: list[int] = []
        again: dict[int, int] = {}
        doomed: dict[int, tuple[int, str | None]] = {}
        for o in offsets:
            state = states.get(o)
            if state is None and o <= sent:  # in the range (not expired: those have rows now)
                if self.strict:
                    break
                continue
            if state is not None and state.status != PENDING:
                continue
            if state is not None and state.invisible_until > now:
                if self.strict:
                    break
                continue
            if state is not None and self.max_attempts is not None:  # delivered before, no outcome since
                cap = after_failure(Unfinished(state.attempts), int(state.attempts), max_attempts=self.max_attempts)
                if isinstance(cap, Bury):
                    doomed[o] = (int(state.attempts), cap.reason)
                    continue
            if state is None:
                fresh.append(o)
            else:
                again[o] = int(state.attempts)
            if self.strict or len(fresh) + len(again) >= want:
                break
        if not (fresh or again or doomed):
            return []
        rows = {
            int(r.message_offset): r
            for r in conn.execute(stmts.messages, {**key, "offsets": fresh + list(again) + list(doomed)})
        }
        out: list[TopicDelivery] = []
        until = now + self._visibility_ms
        undecodable: dict[int, str] = {}
        for o in sorted([*fresh, *again]):
            row = rows[o]
            try:
                payload = self._decode(row)
            except SerializationMismatchError as exc:
                if has_dead_letter_topic(self.topic):  # else no dead-letter topic: it stays in flight, undelivered
                    if o in again:
                        doomed[o] = (again[o], str(exc))
                    else:
                        undecodable[o] = str(exc)
                continue
            out.append(self._delivery(row, partition, epoch, again.get(o, 0) + 1, until, payload))
        if fresh:  # into the range
            conn.execute(stmts.set_range, {**key, "sent": max(fresh), "until": until})
        redelivered = [o for o in again if o not in doomed]
        if redelivered:
            conn.execute(stmts.redeliver, {**key, "offsets": redelivered, "until": until})
        for o, (attempts, error) in doomed.items():
            bury(conn, stmts, self.ctx.now_param(), key, rows[o], attempts, error)
        for o, error in undecodable.items():
            self._bury_fresh(conn, stmts, key, rows[o], now, error)
        return out

    def _decode(self, row: Any) -> Any:
        tag = self.serializer.type_tag
        if row.payload_type != tag:
            raise SerializationMismatchError(
                f"message {row.message_id!r} of topic {self.topic!r} was written as {row.payload_type!r}, "
                f"read as {tag!r}"
            )
        try:
            return self.serializer.loads(bytes(row.payload))
        except (TypeError, ValueError) as exc:
            raise SerializationMismatchError(f"message {row.message_id!r} of topic {self.topic!r}: {exc}") from exc

    def _delivery(
        self, row: Any, partition: int, epoch: int, attempts: int, until: int, payload: Any, failure: bool = True
    ) -> TopicDelivery:
        """A delivery of the log row ``row``; ``failure``: whether it has the failure columns (a range read has
        them for a dead-letter topic only)."""
        dead = None
        if failure and row.original_topic is not None:  # (a message of a dead-letter topic)
            dead = DeadLetterInfo(
                row.original_topic,
                int(row.original_offset),
                row.failed_group,
                from_ms(int(row.failed_at)),
                int(row.failure_count),
                row.last_error,
            )
        return TopicDelivery(
            topic=self.topic,
            partition=partition,
            offset=int(row.message_offset),
            partition_key=row.partition_key,
            message_id=row.message_id,
            payload=payload,
            published_at=from_ms(int(row.published_at)),
            attempts=attempts,
            invisible_until=from_ms(until),
            epoch=epoch,
            dead_letter=dead,
            _subscription=self,
        )
