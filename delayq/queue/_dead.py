"""The dead letters of a queue: list them, move one back into the queue, purge them."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Connection

from delayq import history
from delayq.clock import from_ms
from delayq.dialects import Dialect
from delayq.dialects.base import prefix_bounds, purge_dead_statement
from delayq.errors import InvalidInputError
from delayq.messages import DeadMessage
from delayq.queue._base import _QueueBase
from delayq.queue._checks import check_key, check_prefix
from delayq.queue._history import statements as history_sql
from delayq.tags import decode_tags
from delayq.transactions import Using


class _DeadLetters(_QueueBase):
    """``dead_letters``, ``requeue_dead`` and ``purge_dead`` of ``DelayedQueue``."""

    def dead_letters(self, *, limit: int = 100, after_id: int = 0, using: Using = None) -> list[DeadMessage]:
        """This queue's dead letters, oldest first; page with ``after_id`` (the last ``id`` seen)."""
        params = {"queue_name": self.name, "limit": limit, "after_id": after_id}

        def op(conn: Connection, dialect: Dialect) -> list[DeadMessage]:
            rows = conn.execute(self._statements(dialect).memo(history_sql).dead_letters, params).all()
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
                    tags=decode_tags(r.tags),
                    priority=None if r.priority is None else int(r.priority),
                    group=r.group_key,
                    worker=r.worker,
                )
                for r in rows
            ]

        return self._runner.run(using, op, "read")

    def requeue_dead(self, key: str, *, using: Using = None) -> bool:
        """Move the newest dead letter under ``key`` back into the queue, due now.

        It keeps its ``last_error``, tags, attempt history (earlier attempts stay numbered as they were),
        priority and group (as the dead letter recorded them: none before delayq_0013); its ``attempts`` count
        starts afresh, so it gets its handler's whole retry budget again. False when there is none, or when a
        live message already holds the key (it stays dead).
        """
        params = {"queue_name": self.name, "msg_key": check_key(key)}

        def op(conn: Connection, dialect: Dialect) -> bool:
            row = conn.execute(self._statements(dialect).memo(history_sql).dead_latest, params).first()
            return row is not None and self._requeue_row(conn, dialect, row)

        return self._runner.run(using, op, "transaction")

    def _requeue_row(self, conn: Connection, dialect: Dialect, row: Any) -> bool:
        """Move the dead letter ``row`` (read under a lock: its id, key, payload, payload_type, last_error,
        attempt_history, headers, tags, priority, group_key) back into the queue, due now; False when a live
        message holds its key. Its priority and group count in claims as the queue's flow row marks them (set by
        the offer that first gave the queue a priority or a group, and never taken back)."""
        stmts = self._statements(dialect)
        params = {"queue_name": self.name, "msg_key": row.key, "due_at": None, "due_in": 0, **self._now_param()}
        if not dialect.insert_if_absent(
            conn, stmts, {**params, "payload": row.payload, "payload_type": row.payload_type}
        ):
            return False
        kept = (row.last_error, row.attempt_history, row.headers, row.group_key)
        if any(v is not None for v in kept) or row.tags or row.priority:  # (else the insert's defaults are it)
            restore = {
                **params,
                "error": row.last_error,
                "history": row.attempt_history,
                "headers": row.headers,
                "tags": row.tags,
                "priority": row.priority or 0,
                "group": row.group_key,
            }
            conn.execute(stmts.memo(history_sql).restore_requeued, restore)
        conn.execute(stmts.dead_delete, {"dead_id": row.id})
        return True

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
