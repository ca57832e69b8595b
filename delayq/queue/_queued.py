"""The operations on queued messages: read one, cancel (``delayq.queue._cancel``), reschedule, count, cancel or
coalesce a key prefix."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from delayq import history
from delayq.clock import duration_ms, from_ms, to_ms
from delayq.dialects import Dialect, Statements, dialect_for
from delayq.dialects.base import (
    cancel_prefix_keeping_statement,
    cancel_prefix_statement,
    coalesce_statements,
    prefix_bounds,
    stats_statement,
)
from delayq.errors import InvalidInputError, UnknownMessageError
from delayq.humanize import exact
from delayq.messages import CancelOutcome, Delivery, Message, QueueStats
from delayq.queue import _cancel as cancel_sql
from delayq.queue._base import _QueueBase
from delayq.queue._cancel import DEFAULT_CANCELLED_RETENTION
from delayq.queue._checks import At, _due, check_key, check_prefix
from delayq.queue._history import statements as history_sql
from delayq.queue._lifecycle import STATE_NAMES, lifecycle_sql
from delayq.tags import decode_tags, tag_pattern
from delayq.transactions import Using


class _Queued(_QueueBase):
    """``get``, ``cancel``, ``reschedule``, ``stats`` and the key-prefix operations of ``DelayedQueue``."""

    def get(self, key: str, *, include_dead: bool = False, using: Using = None) -> Message | None:
        """The message stored under ``key`` with its ``state``, or None.

        A live message first (``ready``, ``scheduled``, ``running``); else the latest one kept after it
        finished (``completed`` with its result and duration, ``cancelled``: ``retention``, ``unique_for``);
        with ``include_dead=True``, else the latest dead letter (``dead``) when it is newer.
        """
        params = {"queue_name": self.name, "msg_key": check_key(key), **self._now_param()}

        def op(conn: Connection, dialect: Dialect) -> Message | None:
            stmts = self._statements(dialect)
            row = conn.execute(stmts.memo(history_sql).get, params).first()
            if row is None:
                return self._finished_message(conn, dialect, stmts, params, include_dead)
            now = int(row.now)
            locked = row.lock_token is not None
            state = ("running" if locked else "scheduled") if row.scheduled_at > now else "ready"
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
                tags=decode_tags(row.tags),
                state=state,
                priority=int(row.priority),
                group=row.group_key,
            )

        return self._runner.run(using, op, "read")

    def _finished_message(
        self, conn: Connection, dialect: Dialect, stmts: Statements, params: dict[str, Any], include_dead: bool
    ) -> Message | None:
        """The latest kept record of a key that has no live message (see ``get``)."""
        ls = lifecycle_sql(stmts, dialect)
        fin = conn.execute(ls.latest_finished, params).first()
        dead = conn.execute(ls.dead_latest, params).first() if include_dead else None
        if dead is not None and (fin is None or dead.failed_at >= fin.finished_at):
            return self._kept_message(dead, "dead", dead.failed_at)
        if fin is None:
            return None
        result = None
        if fin.result is not None and fin.result_type is not None:
            result = self._decode(fin.key, fin.result_type, fin.result)
        duration = None if fin.duration_ms is None else dt.timedelta(milliseconds=fin.duration_ms)
        state = STATE_NAMES.get(fin.state, str(fin.state))
        return self._kept_message(fin, state, fin.finished_at, result=result, duration=duration)

    def _kept_message(self, row: Any, state: str, finished_at: int, **outcome: Any) -> Message:
        """A ``Message`` of a row kept after its message finished (``finished`` or ``dead_letters``): not
        locked, scheduled as it first was; its priority, group and worker as the row recorded them."""
        return Message(
            key=row.key,
            payload=self._decode(row.key, row.payload_type, row.payload),
            scheduled_at=from_ms(row.scheduled_at_initially),
            scheduled_at_initially=from_ms(row.scheduled_at_initially),
            created_at=from_ms(row.created_at),
            attempts=row.attempts,
            last_error=row.last_error,
            locked=False,
            attempt_history=history.parse(row.attempt_history),
            state=state,
            finished_at=from_ms(finished_at),
            tags=decode_tags(row.tags),
            priority=None if row.priority is None else int(row.priority),
            group=row.group_key,
            worker=row.worker,
            **outcome,
        )

    def wait(self, key: str, timeout: dt.timedelta, *, using: Using = None) -> Message | None:
        """Wait until no live message holds ``key``; then what was kept of it, as ``get(include_dead=True)``.

        Returns the ``completed`` / ``cancelled`` / ``dead`` message, or None when the live message it saw
        finished and nothing was kept (a queue without ``retention``). Raises ``UnknownMessageError`` (a
        ``KeyError``) when nothing is under ``key`` at its first look (never offered, or gone without a kept
        row before the call), and ``TimeoutError`` when the message is still live after ``timeout``.
        PostgreSQL wakes it when a completion commits (LISTEN/NOTIFY); elsewhere, and as a safety net, it
        polls (every 50 ms, backing off to 1 s).
        """
        limit = _wait_limit(timeout)
        deadline = time.monotonic() + limit
        woken = _Wakeups(self) if dialect_for(self.engine).can_notify and self.notify else None
        try:
            pause, first = 0.05, True
            while True:
                found = self.get(key, include_dead=True, using=using)
                if _waited(self.name, key, found, first):
                    return found
                assert found is not None
                first = False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _timed_out(self.name, key, found, timeout)
                if woken is not None:
                    woken.wait(min(left, 1.0))
                else:
                    time.sleep(min(left, pause))
                    pause = min(pause * 2, 1.0)
        finally:
            if woken is not None:
                woken.close()

    def cancel(self, key: str, *, using: Using = None) -> bool:
        """Cancel the message stored under ``key``; True when there was one (``cancel_job`` says which it did).

        A message whose handler runs is recorded as cancelled and its worker told; see ``cancel_job``.
        """
        return bool(self.cancel_job(key, using=using))

    def cancel_job(self, key: str, *, keep_for: dt.timedelta | None = None, using: Using = None) -> CancelOutcome:
        """Cancel the message stored under ``key``, and say which it did (``CancelOutcome``, true when it did).

        A queued message (not locked, or its lock expired) is deleted: ``QUEUED``. A message whose handler runs
        (locked, the lock unexpired) is deleted and recorded in the finished messages as cancelled, for
        ``keep_for`` (the queue's retention, else ``DEFAULT_CANCELLED_RETENTION``, 7 days), in one transaction:
        ``RUNNING``. Its worker is told (PostgreSQL: by NOTIFY when the transaction commits; elsewhere: its next
        heartbeat finds the lock gone): an asyncio handler's task is cancelled, a thread handler's
        ``delivery.cancelled`` is set; whatever it does after changes nothing, and the message never runs again.
        ``NOT_FOUND``: no message under ``key`` (an ack that committed first leaves none).
        """
        params = {"queue_name": self.name, "msg_key": check_key(key), **self._now_param()}
        keep_ms = None if keep_for is None else duration_ms(keep_for, "keep_for")
        if keep_for is not None and keep_for < dt.timedelta(0):
            raise InvalidInputError(f"keep_for must not be negative, got {exact(keep_for)}")
        keeps = self._keeps_cancelled()

        def fast(conn: Connection, dialect: Dialect) -> bool:
            return bool(conn.execute(self._statements(dialect).cancel, params).rowcount == 1)

        def held(conn: Connection, dialect: Dialect) -> CancelOutcome:
            cs = self._statements(dialect).memo(cancel_sql.statements)
            row = conn.execute(cs.lock_by_key, params).first()
            if row is None:
                return CancelOutcome.NOT_FOUND
            running = cancel_sql.running(row)
            if running or keeps:
                kept = self._cancelled_retention_ms() if keep_ms is None else keep_ms
                conn.execute(cs.insert_finished, cancel_sql.cancelled_row(row, kept))
                ls = lifecycle_sql(self._statements(dialect), dialect)
                if ls.notify is not None and self.notify:  # (``wait(key)`` hears it finished)
                    conn.execute(ls.notify, {"queue_name": self.name})
            conn.execute(cs.delete_id, {"msg_id": row.id})
            if row.lock_token is not None and cs.notify is not None:  # (an expired lock's handler may run still)
                conn.execute(cs.notify, {"msg_id": row.id})
            return CancelOutcome.RUNNING if running else CancelOutcome.QUEUED

        if not keeps and self._runner.run(using, fast, "statement"):
            return CancelOutcome.QUEUED
        return self._runner.run(using, held, "transaction")

    def _keeps_cancelled(self) -> bool:
        """Whether a cancelled queued message is recorded too: the queue keeps a history (``retention``)."""
        return self.lifecycle.keeps

    def _cancelled_retention_ms(self) -> int:
        """How long a cancelled message's finished row is kept: the queue's ``retention`` when it keeps a history,
        else ``DEFAULT_CANCELLED_RETENTION``."""
        if self.lifecycle.keeps:
            return self.lifecycle.retention_ms
        return int(DEFAULT_CANCELLED_RETENTION.total_seconds() * 1000)

    def _cancelled_among(self, deliveries: Sequence[Delivery]) -> set[int]:
        """The ids of ``deliveries`` (found without their lock by the worker holding them) whose message
        ``cancel_job`` recorded as cancelled at their attempt: a cancel, not a lost lock. One read."""
        keys = sorted({d.key for d in deliveries})
        if not keys:
            return set()
        params = {"queue_name": self.name, "keys": keys}

        def op(conn: Connection, dialect: Dialect) -> set[tuple[str, int, int]]:
            rows = conn.execute(self._statements(dialect).memo(cancel_sql.cancelled_records), params)
            return {(r.key, int(r.created_at), int(r.attempts)) for r in rows}

        found = self._runner.run(None, op, "read")
        return {d.id for d in deliveries if (d.key, to_ms(d.created_at), d.attempts) in found}

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

    def stats(self, *, tag: str | None = None, using: Using = None) -> QueueStats:
        """Counts of this queue's messages by state, and the age of the oldest due one; with ``tag``, of the
        messages (and dead letters) carrying that tag only (a filter over the queue's rows: no index serves it)."""
        params = {"queue_name": self.name, **self._now_param()}
        if tag is not None:
            params["tag_pattern"] = tag_pattern(tag)

        def op(conn: Connection, dialect: Dialect) -> QueueStats:
            stmts = self._statements(dialect)
            stmt = stmts.stats if tag is None else stmts.memo(_tagged_stats)
            r = conn.execute(stmt, params).one()
            age = None if r.oldest_due is None else dt.timedelta(milliseconds=int(r.now) - int(r.oldest_due))
            return QueueStats(
                ready=int(r.ready),
                scheduled=int(r.scheduled),
                in_flight=int(r.in_flight),
                expired_locks=int(r.expired_locks),
                dead=int(r.dead),
                oldest_due_age=age,
                completed=int(r.completed),
                cancelled=int(r.cancelled),
            )

        return self._runner.run(using, op, "read")

    def cancel_prefix(self, prefix: str, *, keep_prefix: str | None = None, using: Using = None) -> int:
        """Delete the messages whose key starts with ``prefix`` (but not with ``keep_prefix``); how many.

        One DELETE, running messages included: a running one is deleted under its handler, recorded nowhere, and
        no one is told; its worker finds the lock gone at its next heartbeat, as a lost lock (a ``lock lost``
        warning). To cancel running work as ``cancel_job`` does (recorded as cancelled, its worker told at once),
        use ``cancel_matching(key_prefix=prefix)``. Keys compare byte for byte: case matters, and ``%``, ``_`` and
        ``\\`` are ordinary characters.
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

    # -- for cron's install and uninstall, in the caller's transaction -----------------------------
    def _now_in(self, conn: Connection) -> int:
        """Now, read in ``conn``'s transaction: the queue's clock if it has one, else the database's."""
        return self._now_ms(conn, self._statements(dialect_for(self.engine)))

    def _existing_keys(self, conn: Connection, keys: list[str]) -> set[str]:
        """Which of ``keys`` this queue holds a live message under."""
        stmt = self._statements(dialect_for(self.engine)).existing_keys
        return set(conn.execute(stmt, {"queue_name": self.name, "keys": keys}).scalars())

    def _offer_encoded(self, conn: Connection, key: str, due_ms: int, payload: bytes, now_ms: int) -> bool:
        """Insert an encoded payload under ``key``, due at ``due_ms``, unless the key exists; True when created.
        ``now_ms`` is the transaction's now (``_now_in``), used on an injected clock."""
        dialect = dialect_for(self.engine)
        row = {
            "queue_name": self.name,
            "msg_key": key,
            "payload": payload,
            "payload_type": self.serializer.type_tag,
            "due_at": due_ms,
            "due_in": None,
            **({"now": now_ms} if self.clock is not None else {}),
        }
        return dialect.insert_if_absent(conn, self._statements(dialect), row)

    def _keys_between(self, conn: Connection, lo: str, hi: str) -> Sequence[Row[Any]]:
        """The live messages whose key is at least ``lo`` and below ``hi`` (byte for byte): id, key,
        lock_token, attempts."""
        stmt = self._statements(dialect_for(self.engine)).memo(_keys_between)
        return conn.execute(stmt, {"queue_name": self.name, "range_lo": lo, "range_hi": hi}).all()

    def _delete_ids(self, conn: Connection, ids: list[int]) -> int:
        """Delete this queue's live messages by id (``_keys_between``'s); how many."""
        if not ids:
            return 0
        return int(conn.execute(self._statements(dialect_for(self.engine)).delete_ids, {"ids": ids}).rowcount)


def _tagged_stats(stmts: Statements) -> sa.Select[Any]:
    return stats_statement(stmts.tables, stmts.now, tagged=True)


def _keys_between(stmts: Statements) -> sa.Select[Any]:
    m = stmts.tables.messages
    return sa.select(m.c.id, m.c.key, m.c.lock_token, m.c.attempts).where(
        m.c.queue == sa.bindparam("queue_name", type_=sa.String), stmts.starts_with(m.c.key, "range")
    )


def _wait_limit(timeout: dt.timedelta) -> float:
    """``wait``'s timeout in seconds; ``InvalidInputError`` when negative."""
    limit = duration_ms(timeout, "timeout") / 1000
    if limit < 0:
        raise InvalidInputError(f"timeout must not be negative, got {exact(timeout)}")
    return limit


def _waited(queue: str, key: str, found: Message | None, first: bool) -> bool:
    """Whether ``wait`` (sync and async) is done with what ``get`` found: a kept message, or None after a live
    one; ``UnknownMessageError`` when its first look finds nothing under ``key``."""
    if found is None and first:
        raise UnknownMessageError(f"no message {key!r} in queue {queue!r}: none live, kept or dead-lettered")
    return found is None or found.finished


def _timed_out(queue: str, key: str, found: Message, timeout: dt.timedelta) -> TimeoutError:
    return TimeoutError(f"message {key!r} of queue {queue!r} still {found.state} after {exact(timeout)}")


class _Wakeups:
    """A LISTEN on the queue's finished-table channel (PostgreSQL), on a thread of its own: ``wait`` returns
    early when a completion of the queue commits. Best effort: the caller polls anyway."""

    def __init__(self, queue: _QueueBase) -> None:
        self._stop = threading.Event()
        self._heard = threading.Event()
        engine, name, channel = queue.engine, queue.name, queue.tables.finished.name
        dialect = dialect_for(engine)

        def listen() -> None:
            try:
                for notified in dialect.listen(engine, channel, self._stop):
                    if notified == name:
                        self._heard.set()
            except Exception:  # the caller's polling goes on
                return

        self._thread = threading.Thread(target=listen, name="delayq-wait", daemon=True)
        self._thread.start()

    def wait(self, seconds: float) -> None:
        self._heard.wait(seconds)
        self._heard.clear()

    def close(self) -> None:
        self._stop.set()
