"""DelayedQueue: offer messages due at a time, poll the due ones under a lock, ack them."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from delayq import history, observe
from delayq._outcome import Bury, Unfinished, after_failure
from delayq.clock import Clock, duration_ms, from_ms, require_aware, to_ms
from delayq.dialects import ClaimedRow, Dialect, Statements
from delayq.dialects.base import (
    NewRow,
    cancel_prefix_keeping_statement,
    cancel_prefix_statement,
    coalesce_statements,
    prefix_bounds,
    purge_dead_statement,
)
from delayq.errors import DelayqError, InvalidInputError, InvalidKeyError, InvalidQueueError, SerializationMismatchError
from delayq.messages import DeadMessage, Delivery, Message, OfferOutcome, QueueStats
from delayq.schema import DEFAULT_PREFIX, MAX_KEY_LENGTH, MAX_QUEUE_LENGTH, make_tables
from delayq.serializers import JsonSerializer, Serializer, encode
from delayq.transactions import DEFAULT_RETRY, Runner, TransientRetry, Using

__all__ = ["At", "DelayedQueue", "Using"]

T = TypeVar("T")
log = logging.getLogger("delayq")

At = dt.datetime | dt.timedelta | None
"""A due time: an aware datetime, a timedelta from now, or None for now."""

OFFER_CHUNK = 500
"""Rows per multi-row INSERT in ``offer_many``."""


class _LostLocks:
    """The deliveries (id, lock token) whose lost lock was counted: each is counted once, whichever of
    the heartbeat (``extend_many``), ``ack``, ``retry``, ``extend`` or ``dead_letter`` finds it gone.

    Bounded: the oldest entries go first. A delivery is asked about again within its handler's run, long
    before ``SIZE`` other lost locks pass.
    """

    SIZE = 10_000

    def __init__(self) -> None:
        self._seen: dict[tuple[int, str], None] = {}
        self._lock = threading.Lock()

    def count(self, queue: str, lost: Iterable[tuple[int, str]]) -> None:
        """Count the lost locks of ``lost`` not counted before."""
        with self._lock:
            new = self._mark(lost)
        observe.count("lock_lost", queue, new)

    def count_unacked(self, queue: str, pairs: Sequence[tuple[int, str]], acked: int) -> None:
        """An ack deleted ``acked`` of ``pairs``, none of which is held any more: the others' locks are lost.

        Which ones is not known (the deleted rows are gone): those counted before are among them,
        and from now on all of ``pairs`` are marked (the acked ones are finished: when a heartbeat
        finds them gone, that is no lost lock).
        """
        with self._lock:
            already = sum(1 for p in pairs if p in self._seen)
            self._mark(pairs)
        observe.count("lock_lost", queue, max(0, len(pairs) - acked - already))

    def _mark(self, pairs: Iterable[tuple[int, str]]) -> int:
        new = 0
        for p in pairs:
            if p not in self._seen:
                self._seen[p] = None
                new += 1
        while len(self._seen) > self.SIZE:
            del self._seen[next(iter(self._seen))]
        return new


_lost_locks = _LostLocks()


class DelayedQueue:
    """One named queue of delayed messages in a relational database.

    Args:
        engine: the SQLAlchemy engine of the database holding delayq's tables.
        name: the queue's name (at most 100 characters); queues share the tables.
        visibility_timeout: how long a polled message stays locked before it is delivered
            again. Defaults to 5 minutes.
        serializer: encodes payloads; defaults to ``JsonSerializer()``.
        clock: where "now" comes from; defaults to the database's clock, read inside each
            statement. Pass a ``ManualClock`` to move time by hand.
        table_prefix, schema: where the tables are; default ``delayq_messages`` and
            ``delayq_dead_letters`` in the connection's default schema.
        transient_retry: how delayq retries its own transactions; see ``TransientRetry``.
        notify: on PostgreSQL, wake listening workers (NOTIFY) when an offer commits. True.
        max_deliveries: a claim that would deliver a message for the ``max_deliveries + 1``-th
            time moves it to the dead letters instead ("delivered N times without an outcome"):
            a message whose consumer dies every time does not come back forever. None (no cap)
            by default; a ``Worker`` sets its handler's ``retry.max_attempts``.

    Every operation takes ``using=``: None or an ``Engine`` runs it in delayq's own
    transaction; a ``Connection`` or ``Session`` makes it part of the caller's transaction.
    """

    def __init__(
        self,
        engine: Engine,
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
    ) -> None:
        self.name = check_queue_name(name)
        self.engine = engine
        self.visibility_timeout = visibility_timeout
        self._visibility_ms = duration_ms(visibility_timeout, "visibility_timeout")
        if self._visibility_ms <= 0:
            raise InvalidInputError("visibility_timeout must be positive")
        self.serializer: Serializer = serializer or JsonSerializer()
        self.clock = clock
        self.notify = notify
        if max_deliveries is not None and max_deliveries < 1:
            raise InvalidInputError("max_deliveries must be at least 1")
        self.max_deliveries = max_deliveries
        self.tables = make_tables(table_prefix, schema)
        self._runner = Runner(engine, self.tables, transient_retry)
        self._claiming: str | None = None
        """The token of the claim under way, or of the last one whose reply never came (``_give_back``)."""

    def __repr__(self) -> str:
        return f"DelayedQueue({self.name!r}, {self.engine.url.render_as_string(hide_password=True)!r})"

    # -- producers ------------------------------------------------------------------------------
    def offer(
        self, key: str, payload: Any, at: At = None, *, update: bool = False, using: Using = None
    ) -> OfferOutcome:
        """Store a message due at ``at`` unless one with this key exists in the queue.

        With ``update=True`` an existing message is replaced (payload and due time; its
        attempts and error are reset, and a consumer's lock on it is cleared, so that
        consumer's ack deletes nothing). Replacing with identical content is ``IGNORED``;
        a relative ``at`` is measured from now, so it differs on every call.
        """
        params = self._offer_params(key, payload, at)
        with observe.offering(self.name, 1) as headers:  # tracing's span, and its context to store

            def op(conn: Connection, dialect: Dialect) -> OfferOutcome:
                outcome = self._offer_one(conn, dialect, self._statements(dialect), params, update)
                if headers and outcome is not OfferOutcome.IGNORED:
                    self._store_headers(conn, dialect, [params["msg_key"]], headers)
                return outcome

            outcome = self._runner.run(using, op, "statement" if not (update or headers) else "transaction")
        observe.count("offered", self.name, outcome is not OfferOutcome.IGNORED)
        return outcome

    def offer_many(
        self, items: Iterable[tuple[str, Any, At]], *, update: bool = False, using: Using = None
    ) -> list[OfferOutcome]:
        """Offer ``(key, payload, at)`` items in multi-row statements; one outcome per item, in order.

        All items are validated first: a bad one raises before anything is written. A key
        that repeats within the batch is offered again after the first (so it is ``IGNORED``,
        or ``UPDATED`` with ``update=True``).
        """
        prepared = [self._item(key, payload, at) for key, payload, at in items]
        if not prepared:
            return []
        with observe.offering(self.name, len(prepared)) as headers:
            found = self._offer_prepared(prepared, update, headers, using)
        observe.count("offered", self.name, sum(o is not OfferOutcome.IGNORED for o in found))
        return found

    def _store_headers(self, conn: Connection, dialect: Dialect, keys: list[str], headers: dict[str, str]) -> None:
        """Keep ``headers`` with the messages just offered under ``keys``."""
        stmt = self._statements(dialect).memo(history.statements).set_headers
        conn.execute(stmt, {"queue_name": self.name, "keys": keys, "headers": history.dump_headers(headers)})

    def _offer_prepared(
        self, prepared: list[_Item], update: bool, headers: dict[str, str] | None, using: Using
    ) -> list[OfferOutcome]:
        def op(conn: Connection, dialect: Dialect) -> list[OfferOutcome]:
            stmts = self._statements(dialect)
            now = self._now_ms(conn, stmts)
            outcomes: list[OfferOutcome | None] = [None] * len(prepared)
            keys = [key for key, *_ in prepared]
            first: dict[str, int] = {}
            for i, key in enumerate(keys):
                first.setdefault(key, i)
            firsts = list(first.values())
            queue, tag = self.name, self.serializer.type_tag
            for start in range(0, len(firsts), OFFER_CHUNK):
                chunk = firsts[start : start + OFFER_CHUNK]
                rows = [_new_row(queue, tag, prepared[i], now) for i in chunk]
                created = dialect.insert_many_if_absent(conn, stmts, queue, rows)
                for i in chunk:
                    if keys[i] in created:
                        outcomes[i] = OfferOutcome.CREATED
            for i, item in enumerate(prepared):
                if outcomes[i] is None:
                    outcomes[i] = (
                        self._offer_one(conn, dialect, stmts, self._item_params(item), update=True)
                        if update
                        else OfferOutcome.IGNORED
                    )
            if headers:
                done = [key for key, o in zip(keys, outcomes, strict=True) if o is not OfferOutcome.IGNORED]
                for start in range(0, len(done), OFFER_CHUNK):
                    self._store_headers(conn, dialect, done[start : start + OFFER_CHUNK], headers)
            return [o for o in outcomes if o is not None]

        return self._runner.run(using, op, "transaction")

    # -- consumers ------------------------------------------------------------------------------
    def try_poll(self, *, using: Using = None) -> Delivery | None:
        """Lock the next due message for this consumer, or return None when none is due."""
        found = self.try_poll_many(1, using=using)
        return found[0] if found else None

    def try_poll_many(self, limit: int, *, using: Using = None) -> list[Delivery]:
        """Lock up to ``limit`` due messages, oldest due first; an empty list when none is due.

        Each delivery's lock expires after the visibility timeout; ``attempts`` counts it.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidInputError(f"limit must be a positive integer, got {limit!r}")

        def op(conn: Connection, dialect: Dialect) -> list[ClaimedRow]:
            # A fresh token on every attempt: when an attempt's commit succeeded unseen (its reply
            # lost), the rows it locked carry a token nobody holds and return after the timeout.
            now = self._now_param()
            token = self._claiming = new_token(now.get("now"))
            params = {"queue_name": self.name, "limit": limit, "token": token, **now}
            return dialect.claim(conn, self._statements(dialect), params, self._visibility_ms)

        self._claiming = None
        rows = self._runner.run(using, op, self._runner.dialect.claim_mode_for(limit))
        self._claiming = None  # the claim came back: its rows are in hand
        return self._deliveries(rows, using)

    def _give_back(self, token: str, *, using: Using = None) -> int:
        """Give back every message of a claim whose outcome is unknown to its caller (an asyncio claim cancelled
        while its COMMIT was in flight): due as when claimed, unlocked, the attempt not counted; how many."""

        def op(conn: Connection, dialect: Dialect) -> int:
            params = {"queue_name": self.name, "token": token, "vt": self._visibility_ms}
            return int(conn.execute(self._statements(dialect).unclaim_token, params).rowcount)

        return self._runner.run(using, op, "statement")

    def release(self, deliveries: Sequence[Delivery], *, using: Using = None) -> int:
        """Give deliveries back unprocessed: due again at once, the attempt not counted.

        Returns how many were still held. For work that was fetched but never started.
        """
        return self._unclaim([(d.id, d.lock_token, to_ms(d.scheduled_at)) for d in deliveries], using)

    def _unclaim(self, rows: list[tuple[int, str, int]], using: Using) -> int:
        """Put claimed rows (id, token, due) back as they were: due, unlocked, the attempt not counted."""
        params = [{"msg_id": msg_id, "token": token, "due": due} for msg_id, token, due in rows]
        if not params:
            return 0

        def op(conn: Connection, dialect: Dialect) -> int:
            stmt = self._statements(dialect).unclaim
            return sum(conn.execute(stmt, p).rowcount for p in params)

        return self._runner.run(using, op, "transaction")

    def next_due(self, *, using: Using = None) -> dt.timedelta | None:
        """How long until this queue's next message is due (zero when one is due now); None when empty.

        A held message counts at its lock's expiry, when it would be delivered again.
        """
        params = {"queue_name": self.name, **self._now_param()}

        def op(conn: Connection, dialect: Dialect) -> dt.timedelta | None:
            row = conn.execute(self._statements(dialect).next_due, params).one()
            if row.next_due is None:
                return None
            return dt.timedelta(milliseconds=max(0, int(row.next_due) - int(row.now)))

        return self._runner.run(using, op, "read")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in a transaction begun as delayq begins its own; committed on success.

        (``BEGIN IMMEDIATE`` on SQLite, READ COMMITTED on MySQL/MariaDB.) Pass it as ``using=``
        to make queue operations part of the same unit of work as your own statements.
        """
        with self._runner.owned("transaction") as conn:
            yield conn

    def ack_many(self, deliveries: Sequence[Delivery], *, skip_locked: bool = False, using: Using = None) -> int:
        """Delete delivered messages whose locks these deliveries still hold; returns how many.

        Each message is named by its id and lock token: a token alone never deletes anything.
        With ``skip_locked=True`` a message that another transaction holds a row lock on (a
        producer replacing it, an operator's ``SELECT … FOR UPDATE``) is left for a later ack
        instead of waited for: a background ack never blocks behind someone else's transaction.
        A delivery whose lock is gone (expired and taken, or the message replaced or deleted)
        is counted as ``lock_lost``, once; with ``skip_locked=True`` one more SELECT, only when
        not all were acked, tells such deliveries from row-locked ones.
        """
        pairs: dict[tuple[int, str], None] = {}
        for d in deliveries:
            if d.queue != self.name:
                raise InvalidInputError(f"delivery of {d.key!r} belongs to queue {d.queue!r}, not {self.name!r}")
            pairs[d.id, d.lock_token] = None
        if not pairs:
            return 0
        tokens = {token for _, token in pairs}

        def op(conn: Connection, dialect: Dialect) -> tuple[int, set[int]]:
            stmts = self._statements(dialect)
            if len(tokens) == 1 and not skip_locked:
                [token] = tokens
                return int(conn.execute(stmts.ack, {"token": token, "ids": [i for i, _ in pairs]}).rowcount), set()
            held = dialect.held_params(list(pairs))
            if not skip_locked:
                return int(conn.execute(stmts.ack_pairs, held).rowcount), set()
            acked = dialect.delete_held(conn, stmts, held)
            if acked == len(pairs):
                return acked, set()
            # What is still ours was row-locked elsewhere (a later ack takes it); the rest is gone.
            return acked, set(conn.execute(stmts.held_ids, held).scalars())

        acked, held = self._runner.run(using, op, self._runner.dialect.claim_mode if skip_locked else "scan")
        if acked > len(pairs):  # cannot happen while ids are unique; never silently
            log.error("%s: an ack of %d deliveries deleted %d rows", self.name, len(pairs), acked)
            raise DelayqError(f"ack of {len(pairs)} deliveries deleted {acked} rows in queue {self.name!r}")
        observe.count("acked", self.name, acked)
        if acked < len(pairs):
            _lost_locks.count_unacked(self.name, [p for p in pairs if p[0] not in held], acked)
        return acked

    def extend_many(
        self, deliveries: Sequence[Delivery], by: dt.timedelta, *, using: Using = None
    ) -> tuple[list[Delivery], list[Delivery]]:
        """Push the locks of held deliveries to ``by`` from now, all in one go; never shortens one.

        Returns ``(extended, lost)``: the deliveries whose lock was extended (their
        ``locked_until`` updated from the database), and those whose lock is gone (expired and
        taken, or the message replaced or deleted). A delivery in neither list is held but its
        row is locked by another transaction: it was skipped, not waited for; try it again.
        """
        by_ms = duration_ms(by, "by")
        if by_ms <= 0:
            raise InvalidInputError("extend_many(by=...) must be positive")
        pairs = list({(d.id, d.lock_token): None for d in deliveries})
        if not pairs:
            return [], []

        def op(conn: Connection, dialect: Dialect) -> tuple[dict[int, int], set[int]]:
            stmts = self._statements(dialect)
            held = dialect.held_params(pairs)
            expiries = dialect.extend_held(conn, stmts, {**held, "by": by_ms, **self._now_param()})
            if len(expiries) == len(pairs):
                return expiries, set(expiries)
            return expiries, set(conn.execute(stmts.held_ids, held).scalars())

        expiries, held = self._runner.run(using, op, self._runner.dialect.claim_mode)
        extended, lost = [], []
        for d in deliveries:
            if d.id in expiries:
                d.locked_until = from_ms(expiries[d.id])
                extended.append(d)
            elif d.id not in held:
                lost.append(d)
        if lost:
            _lost_locks.count(self.name, [(d.id, d.lock_token) for d in lost])
        return extended, lost

    def _retry(
        self, d: Delivery, delay: dt.timedelta, error: str | None, using: Using, exception: BaseException | None = None
    ) -> bool:
        params = {"msg_id": d.id, "token": d.lock_token, "delay": duration_ms(delay, "delay"), "error": error}
        params.update(self._now_param())
        failure = history.Failure.capture(error, exception)

        def op(conn: Connection, dialect: Dialect) -> bool:
            hs = self._statements(dialect).memo(history.statements)
            row = conn.execute(hs.select_held, params).first()
            if row is None:
                return False
            params["history"] = failure.appended_to(row.attempt_history, row.attempts, int(row.now))
            return bool(conn.execute(hs.retry, params).rowcount == 1)

        held = self._runner.run(using, op, "transaction")
        if held:
            observe.count("retried", self.name)
        else:
            _lost_locks.count(self.name, [(d.id, d.lock_token)])
        return held

    def _extend(self, d: Delivery, by: dt.timedelta, using: Using) -> bool:
        by_ms = duration_ms(by, "by")
        if by_ms <= 0:
            raise InvalidInputError("extend(by=...) must be positive")
        params = {"msg_id": d.id, "token": d.lock_token, "by": by_ms, **self._now_param()}
        held = self._held_update(lambda s: s.extend, params, using)
        if not held:
            _lost_locks.count(self.name, [(d.id, d.lock_token)])
        return held

    def _held_update(self, pick: Callable[[Statements], sa.Executable], params: dict[str, Any], using: Using) -> bool:
        def op(conn: Connection, dialect: Dialect) -> bool:
            return bool(conn.execute(pick(self._statements(dialect)), params).rowcount == 1)

        return self._runner.run(using, op, "statement")

    def _dead_letter(
        self, d: Delivery, error: str | None, using: Using, exception: BaseException | None = None
    ) -> bool:
        held = self._dead_letter_held([(d.id, d.lock_token, error)], using, exception) == 1
        if not held:
            _lost_locks.count(self.name, [(d.id, d.lock_token)])
        return held

    def _dead_letter_held(
        self, held: Sequence[tuple[int, str, str | None]], using: Using, exception: BaseException | None = None
    ) -> int:
        """Move held messages ``(id, token, error)`` to the dead letters, in one transaction; how many.

        Each one's attempt history gets this last failure (with ``exception``'s traceback, if any).
        """
        failures = {error: history.Failure.capture(error, exception) for _, _, error in held}

        def op(conn: Connection, dialect: Dialect) -> int:
            stmts = self._statements(dialect)
            hs = stmts.memo(history.statements)
            moved = 0
            for msg_id, token, error in held:
                params = {"msg_id": msg_id, "token": token, **self._now_param()}
                row = conn.execute(hs.select_held, params).first()
                if row is None:
                    continue
                conn.execute(
                    stmts.insert_dead,
                    {
                        "queue": row.queue,
                        "key": row.key,
                        "payload": row.payload,
                        "payload_type": row.payload_type,
                        "scheduled_at_initially": row.scheduled_at_initially,
                        "created_at": row.created_at,
                        "attempts": row.attempts,
                        "last_error": error,
                        "attempt_history": failures[error].appended_to(row.attempt_history, row.attempts, int(row.now)),
                        "headers": row.headers,
                        "failed_at": row.now,
                    },
                )
                moved += conn.execute(stmts.delete_held, params).rowcount
            return moved

        moved = self._runner.run(using, op, "transaction")
        observe.count("dead_lettered", self.name, moved)
        return moved

    def attempt_history(self, key: str, *, using: Using = None) -> tuple[history.AttemptRecord, ...]:
        """The failed attempts of the message under ``key``, oldest first (empty when none, or no message)."""
        params = {"queue_name": self.name, "msg_key": check_key(key)}

        def op(conn: Connection, dialect: Dialect) -> tuple[history.AttemptRecord, ...]:
            stored = conn.execute(self._statements(dialect).memo(history.statements).history_of, params)
            return history.parse(stored.scalar())

        return self._runner.run(using, op, "read")

    def headers(self, key: str, *, using: Using = None) -> dict[str, str]:
        """The headers an offer stored with the message under ``key`` (the trace context, with tracing on)."""
        params = {"queue_name": self.name, "msg_key": check_key(key)}

        def op(conn: Connection, dialect: Dialect) -> dict[str, str]:
            stored = conn.execute(self._statements(dialect).memo(history.statements).headers_of, params)
            return history.load_headers(stored.scalar())

        return self._runner.run(using, op, "read")

    # -- operations on queued messages ---------------------------------------------------------
    def get(self, key: str, *, using: Using = None) -> Message | None:
        """The message stored under ``key``, or None."""
        params = {"queue_name": self.name, "msg_key": check_key(key)}

        def op(conn: Connection, dialect: Dialect) -> Message | None:
            row = conn.execute(self._statements(dialect).memo(history.statements).get, params).first()
            if row is None:
                return None
            return Message(
                key=row.key,
                payload=self._decode(row.key, row.payload_type, row.payload),
                scheduled_at=from_ms(row.scheduled_at),
                scheduled_at_initially=from_ms(row.scheduled_at_initially),
                created_at=from_ms(row.created_at),
                attempts=row.attempts,
                last_error=row.last_error,
                locked=row.lock_token is not None,
                attempt_history=history.parse(row.attempt_history),
            )

        return self._runner.run(using, op, "read")

    def cancel(self, key: str, *, using: Using = None) -> bool:
        """Delete the message stored under ``key``; True when there was one."""
        params = {"queue_name": self.name, "msg_key": check_key(key)}

        def op(conn: Connection, dialect: Dialect) -> bool:
            return bool(conn.execute(self._statements(dialect).cancel, params).rowcount == 1)

        return self._runner.run(using, op, "statement")

    def reschedule(self, key: str, at: At = None, *, using: Using = None) -> bool:
        """Make the message under ``key`` due at ``at`` (clearing any consumer's lock on it).

        True when there was such a message.
        """
        due_at, due_in = _due(at)
        params = {
            "queue_name": self.name,
            "msg_key": check_key(key),
            "due_at": due_at,
            "due_in": due_in,
            **self._now_param(),
        }

        def op(conn: Connection, dialect: Dialect) -> bool:
            return bool(conn.execute(self._statements(dialect).reschedule, params).rowcount == 1)

        return self._runner.run(using, op, "statement")

    def stats(self, *, using: Using = None) -> QueueStats:
        """Counts of this queue's messages by state, and the age of the oldest due one."""
        params = {"queue_name": self.name, **self._now_param()}

        def op(conn: Connection, dialect: Dialect) -> QueueStats:
            r = conn.execute(self._statements(dialect).stats, params).one()
            age = None if r.oldest_due is None else dt.timedelta(milliseconds=int(r.now) - int(r.oldest_due))
            return QueueStats(
                ready=int(r.ready),
                scheduled=int(r.scheduled),
                in_flight=int(r.in_flight),
                expired_locks=int(r.expired_locks),
                dead=int(r.dead),
                oldest_due_age=age,
            )

        return self._runner.run(using, op, "read")

    def dead_letters(self, *, limit: int = 100, after_id: int = 0, using: Using = None) -> list[DeadMessage]:
        """This queue's dead letters, oldest first; page with ``after_id`` (the last ``id`` seen)."""
        params = {"queue_name": self.name, "limit": limit, "after_id": after_id}

        def op(conn: Connection, dialect: Dialect) -> list[DeadMessage]:
            rows = conn.execute(self._statements(dialect).memo(history.statements).dead_letters, params).all()
            return [
                DeadMessage(
                    id=r.id,
                    key=r.key,
                    payload=self._decode(r.key, r.payload_type, r.payload),
                    scheduled_at_initially=from_ms(r.scheduled_at_initially),
                    created_at=from_ms(r.created_at),
                    attempts=r.attempts,
                    last_error=r.last_error,
                    failed_at=from_ms(r.failed_at),
                    attempt_history=history.parse(r.attempt_history),
                )
                for r in rows
            ]

        return self._runner.run(using, op, "read")

    def requeue_dead(self, key: str, *, using: Using = None) -> bool:
        """Move the newest dead letter under ``key`` back into the queue, due now.

        It keeps its ``last_error`` and attempt history (earlier attempts stay numbered as they
        were); its ``attempts`` count starts afresh, so it gets its handler's whole retry budget
        again. False when there is none, or when a live message already holds the key (it stays dead).
        """
        params = {"queue_name": self.name, "msg_key": check_key(key), "due_at": None, "due_in": 0, **self._now_param()}

        def op(conn: Connection, dialect: Dialect) -> bool:
            stmts = self._statements(dialect)
            row = conn.execute(stmts.memo(history.statements).dead_latest, params).first()
            if row is None or not dialect.insert_if_absent(
                conn, stmts, {**params, "payload": row.payload, "payload_type": row.payload_type}
            ):
                return False
            if row.last_error is not None or row.attempt_history is not None or row.headers is not None:
                restore = {**params, "error": row.last_error, "history": row.attempt_history, "headers": row.headers}
                conn.execute(stmts.memo(history.statements).restore_requeued, restore)
            conn.execute(stmts.dead_delete, {"dead_id": row.id})
            return True

        return self._runner.run(using, op, "transaction")

    def purge_dead(
        self, *, key: str | None = None, key_prefix: str | None = None, everything: bool = False, using: Using = None
    ) -> int:
        """Delete this queue's dead letters under ``key``, or whose key starts with ``key_prefix``,
        or all of them with ``everything=True``; returns how many. Keys compare byte for byte."""
        if (key is None and key_prefix is None) != everything:
            raise InvalidInputError("purge_dead takes key=, key_prefix=, or everything=True")
        params: dict[str, Any] = {"queue_name": self.name}
        if key is not None:
            params["msg_key"] = check_key(key)
        if key_prefix is not None:
            params.update(prefix_bounds(check_prefix(key_prefix)))

        def op(conn: Connection, dialect: Dialect) -> int:
            stmt = purge_dead_statement(dialect, self.tables, key is not None, key_prefix is not None)
            return int(conn.execute(stmt, params).rowcount)

        return self._runner.run(using, op, "scan")

    def cancel_prefix(self, prefix: str, *, keep_prefix: str | None = None, using: Using = None) -> int:
        """Delete the messages whose key starts with ``prefix`` (but not with ``keep_prefix``); how many.

        Keys compare byte for byte: case matters, and ``%``, ``_`` and ``\\`` are ordinary characters.
        """
        params = {"queue_name": self.name, **prefix_bounds(check_prefix(prefix))}
        if keep_prefix is not None:
            params.update(prefix_bounds(check_prefix(keep_prefix), "keep"))

        def op(conn: Connection, dialect: Dialect) -> int:
            stmts = self._statements(dialect)
            stmt = stmts.memo(cancel_prefix_statement if keep_prefix is None else cancel_prefix_keeping_statement)
            return int(conn.execute(stmt, params).rowcount)

        return self._runner.run(using, op, "scan")

    def coalesce_overdue(self, prefix: str, now: dt.datetime, *, using: Using = None) -> int:
        """Of the never-attempted messages under ``prefix`` due by ``now``, keep the newest; delete the rest.

        Returns how many were deleted. Messages being handled or awaiting a retry are left alone.
        """
        params = {"queue_name": self.name, **prefix_bounds(check_prefix(prefix)), "now_ms": to_ms(now)}

        def op(conn: Connection, dialect: Dialect) -> int:
            latest_stmt, older_stmt = self._statements(dialect).memo(coalesce_statements)
            latest = conn.execute(latest_stmt, params).scalar_one()
            if latest is None:
                return 0
            return int(conn.execute(older_stmt, {**params, "latest": latest}).rowcount)

        return self._runner.run(using, op, "transaction")

    def run(self, operation: Callable[[Connection], T], *, using: Using = None) -> T:
        """Run ``operation(conn)`` in one transaction: delayq's own (retried whole on transient errors)
        or the caller's. Pass ``conn`` as ``using=`` to the queue operations inside."""
        return self._runner.run(using, lambda conn, _: operation(conn), "transaction")

    # -- internals ------------------------------------------------------------------------------
    def _statements(self, dialect: Dialect) -> Statements:
        return dialect.statements(self.tables, self.clock is not None, self.notify)

    def _now_param(self) -> dict[str, int]:
        return {} if self.clock is None else {"now": to_ms(self.clock.now())}

    def _now_ms(self, conn: Connection, stmts: Statements) -> int:
        if self.clock is not None:
            return to_ms(self.clock.now())
        return int(conn.execute(stmts.now_select).scalar_one())

    def _offer_params(self, key: str, payload: Any, at: At) -> dict[str, Any]:
        return self._item_params(self._item(key, payload, at))

    def _item(self, key: str, payload: Any, at: At) -> _Item:
        """An offered message validated and encoded; raises on bad input before anything is sent."""
        return check_key(key), encode(self.serializer, payload), *_due(at)

    def _item_params(self, item: _Item) -> dict[str, Any]:
        """The parameters of the one-message offer statements for a validated item."""
        key, payload, due_at, due_in = item
        return {
            "queue_name": self.name,
            "msg_key": key,
            "payload": payload,
            "payload_type": self.serializer.type_tag,
            "due_at": due_at,
            "due_in": due_in,
            **self._now_param(),
        }

    def _offer_one(
        self, conn: Connection, dialect: Dialect, stmts: Statements, params: dict[str, Any], update: bool
    ) -> OfferOutcome:
        while True:
            if dialect.insert_if_absent(conn, stmts, params):
                return OfferOutcome.CREATED
            if not update:
                return OfferOutcome.IGNORED
            row = conn.execute(stmts.lock_for_update, params).first()
            if row is None:
                continue  # a consumer acked it since the insert: offer it afresh
            due = params["due_at"] if params["due_at"] is not None else row.now + params["due_in"]
            if (
                bytes(row.payload) == params["payload"]
                and row.payload_type == params["payload_type"]
                and row.scheduled_at_initially == due
            ):
                return OfferOutcome.IGNORED
            swapped = conn.execute(
                stmts.replace,
                {
                    "msg_id": row.id,
                    "old_scheduled_at_initially": row.scheduled_at_initially,
                    "old_created_at": row.created_at,
                    "payload": params["payload"],
                    "payload_type": params["payload_type"],
                    "new_scheduled_at": due,
                    "new_created_at": row.now,
                },
            ).rowcount
            if swapped == 1:
                if stmts.notify is not None:
                    conn.execute(stmts.notify, params)
                return OfferOutcome.UPDATED

    def _deliveries(self, rows: list[ClaimedRow], using: Using) -> list[Delivery]:
        """The deliveries of one claim, each row decoded on its own.

        A row that cannot be decoded, or that was delivered ``max_deliveries`` times without an
        outcome (its consumer died every time), is moved to the dead letters with the reason,
        instead of failing the whole claim or coming back forever. The claim's rows share its
        lock expiry, and often their times too: each distinct time is converted once.
        """
        times: dict[int, dt.datetime] = {}

        def at(ms: int) -> dt.datetime:
            found = times.get(ms)
            if found is None:
                found = times[ms] = from_ms(ms)
            return found

        deliveries: list[Delivery] = []
        dead: list[tuple[int, str, str | None]] = []
        limit = self.max_deliveries
        for row in rows:
            if limit is not None:  # this claim is delivery ``attempts``: the earlier ones ended without an outcome
                cap = after_failure(Unfinished(row.attempts - 1), row.attempts - 1, max_attempts=limit)
                if isinstance(cap, Bury):
                    dead.append((row.id, row.lock_token, cap.reason))
                    continue
            try:
                payload = self._decode(row.key, row.payload_type, row.payload)
            except SerializationMismatchError as exc:
                dead.append((row.id, row.lock_token, str(exc)))
                continue
            deliveries.append(
                Delivery(
                    row.id,
                    row.key,
                    payload,
                    row.attempts,
                    at(row.due_at),
                    at(row.scheduled_at_initially),
                    at(row.created_at),
                    at(row.locked_until),
                    row.lock_token,
                    self,
                )
            )
        if dead:
            log.warning("%s: %d claimed message(s) moved to the dead letters: %s", self.name, len(dead), dead[0][2])
            try:
                self._dead_letter_held(dead, using)
            except DBAPIError as exc:
                if using is not None and not isinstance(using, Engine):
                    raise  # the caller's transaction: theirs to handle
                # The good rows are delivered all the same; these stay locked and come back after
                # the visibility timeout, to be dead-lettered by that claim.
                log.warning("%s: could not move them now (%s)", self.name, type(exc.orig).__name__)
        return deliveries

    def _decode(self, key: str, payload_type: str, payload: bytes) -> Any:
        tag = self.serializer.type_tag
        if payload_type != tag:
            raise SerializationMismatchError(
                f"message {key!r} in queue {self.name!r} was written as {payload_type!r} but this queue "
                f"reads {tag!r}: use the serializer that wrote it, or cancel the message"
            )
        try:
            return self.serializer.loads(bytes(payload))
        except (TypeError, ValueError) as exc:
            raise SerializationMismatchError(
                f"message {key!r} in queue {self.name!r} cannot be decoded as {tag!r}: {exc}"
            ) from exc


_Item = tuple[str, bytes, int | None, int | None]
"""An offered message, validated and encoded: (key, payload, due at in epoch ms, or due in ms from now)."""


def _new_row(queue: str, payload_type: str, item: _Item, now: int) -> NewRow:
    key, payload, due_at, due_in = item
    due = due_at if due_at is not None else now + (due_in or 0)
    return (queue, key, payload, payload_type, due, due, now, 0)


def _due(at: At) -> tuple[int | None, int | None]:
    """(absolute epoch ms, None) for a datetime; (None, ms from now) for a timedelta or None."""
    if at is None:
        return None, 0
    if isinstance(at, dt.timedelta):
        return None, duration_ms(at, "at")
    return to_ms(require_aware(at, "at")), None


def check_key(key: object) -> str:
    """Return a valid message key or raise ``InvalidKeyError``."""
    return check_text(key, "key", MAX_KEY_LENGTH, InvalidKeyError)


def check_prefix(prefix: object) -> str:
    """Return a valid, non-empty key prefix or raise ``InvalidKeyError``."""
    return check_text(prefix, "key prefix", MAX_KEY_LENGTH, InvalidKeyError)


def check_queue_name(name: object) -> str:
    """Return a valid queue name or raise ``InvalidQueueError``."""
    return check_text(name, "queue name", MAX_QUEUE_LENGTH, InvalidQueueError)


def check_text(value: object, what: str, limit: int, error: type[InvalidInputError]) -> str:
    """Return ``value`` if it is text a column of ``limit`` characters stores on every backend, else raise ``error``."""
    if not isinstance(value, str):
        raise error(f"{what} must be a str, got {type(value).__name__}")
    if not value:
        raise error(f"{what} must not be empty")
    if len(value) > limit:
        raise error(f"{what} is {len(value)} characters long; at most {limit} fit: {value[:40]!r}...")
    if "\x00" in value:
        raise error(f"{what} must not contain NUL characters (PostgreSQL cannot store them)")
    if not value.isascii():  # (ASCII text, the usual key, holds no surrogate: no need to encode it)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise error(f"{what} is not valid text: it contains a lone surrogate") from None
    return value


def new_token(claimed_ms: int | None = None) -> str:
    """A fresh lock token: one per claim attempt, unique, in the UUID version 7 layout: its first 48 bits
    are the claim's time in epoch ms (the injected clock's, else this process's; for display only, see
    ``claimed_at``), the other 74 are random."""
    ms = time.time_ns() // 1_000_000 if claimed_ms is None else claimed_ms
    bits = (ms & (1 << 48) - 1) << 80 | 0x7 << 76 | secrets.randbits(12) << 64 | 0b10 << 62 | secrets.randbits(62)
    return str(uuid.UUID(int=bits))


def claimed_at(token: str | None) -> dt.datetime | None:
    """When the claim that set ``token`` ran (see ``new_token``); None for another kind of token."""
    if token is None or len(token) != 36 or token[14] != "7":
        return None
    try:
        return from_ms(int(token[:8] + token[9:13], 16))
    except ValueError:
        return None
