"""The stack ceiling: the statements delayq issues, run by hand on SQLAlchemy Core.

Where ``benchmarks/ceiling.py`` sends delayq's SQL straight through the driver (the physical limit),
this module runs the *same prebuilt statements* delayq runs (its ``Statements`` and each backend's
memoized claim and batch-insert statements) the plainest way SQLAlchemy allows: a pooled
``Connection`` per call from the same engine, the transaction begun as delayq begins it for that
kind of operation (autocommit for one statement on PostgreSQL, ``BEGIN`` with the same ``SET LOCAL``
for a batch claim, READ COMMITTED on MySQL/MariaDB, ...), rows read as tuples, and nothing else:
no retry loop, no schema check, no call bound, no observers, no ``Delivery`` objects, payloads
already encoded. delayq's overhead over SQLAlchemy is delayq/stack; SQLAlchemy's over the driver
is stack/bare (issue 33).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from delayq import DelayedQueue
from delayq.dialects import Statements, dialect_for
from delayq.dialects.base import OwnedStart, values_insert
from delayq.queue._history import statements as history_statements

VISIBILITY_MS = 300_000
IDLE_S = 30.0


class Stack:
    """The stack ceiling of one queue (``q``: its tables, name and clock); one method per path."""

    def __init__(self, q: DelayedQueue) -> None:
        self.engine = q.engine
        self.name = q.name
        self.dialect = dialect_for(q.engine)
        self.kind = self.dialect.name
        self.stmts: Statements = q._statements(self.dialect)
        self.tag = q.serializer.type_tag
        idle = None if self.kind == "mysql" else IDLE_S  # MariaDB sets it once per session: left out here
        self._starts = {
            mode: self.dialect.owned_start(mode, False, idle, {})
            for mode in ("read", "statement", "scan", "transaction", "ordered", "writes")
        }
        self.get_stmt = self.stmts.memo(history_statements).get
        self._claims: dict[int, Callable[[Connection, str, int], list[Any]]] = {}

    def _run(self, mode: str, body: Callable[[Connection], Any]) -> Any:
        start: OwnedStart = self._starts[mode]
        with self.engine.connect() as conn:
            if start.autocommit:
                conn.execution_options(isolation_level="AUTOCOMMIT")
            elif start.commit:
                conn.begin()
            for sql in start.sql:
                conn.exec_driver_sql(sql)
            found = body(conn)
            if start.commit:
                conn.commit()
            return found

    # -- single messages ------------------------------------------------------------------------
    def offer(self, key: str, payload: bytes) -> bool:
        params = {
            "queue_name": self.name,
            "msg_key": key,
            "payload": payload,
            "payload_type": self.tag,
            "due_at": None,
            "due_in": 0,
        }
        stmt = self.stmts.insert
        if self.kind == "mysql":
            return bool(self._run("statement", lambda conn: conn.execute(stmt, params).rowcount))
        return bool(self._run("statement", lambda conn: conn.execute(stmt, params).first() is not None))

    def get(self, key: str) -> tuple[Any, ...] | None:
        params = {"queue_name": self.name, "msg_key": key}
        row = self._run("read", lambda conn: conn.execute(self.get_stmt, params).first())
        return None if row is None else tuple(row)

    def cancel(self, key: str) -> bool:
        params = {"queue_name": self.name, "msg_key": key}
        return bool(self._run("statement", lambda conn: conn.execute(self.stmts.cancel, params).rowcount == 1))

    # -- claims and acks ------------------------------------------------------------------------
    def claim(self, limit: int) -> tuple[str, list[Any]]:
        """(token, rows as tuples: id first, key second) of a claim of up to ``limit`` due messages."""
        token = str(uuid.uuid4())
        mode = self.dialect.claim_mode_for(limit)
        claim = self._claim_body(limit)
        return token, self._run(mode, lambda conn: claim(conn, token, limit))

    def ack(self, token: str, ids: Sequence[int]) -> int:
        params = {"token": token, "ids": list(ids)}
        return int(self._run("scan", lambda conn: conn.execute(self.stmts.ack, params).rowcount))

    def claim_and_ack(self, limit: int) -> list[str]:
        token, rows = self.claim(limit)
        if rows:
            self.ack(token, [r[0] for r in rows])
        return [r[1] for r in rows]

    def _claim_body(self, limit: int) -> Callable[[Connection, str, int], list[Any]]:
        found = self._claims.get(limit)
        if found is not None:
            return found
        stmts = self.stmts
        if self.kind == "postgresql":
            from delayq.dialects.postgresql import _claim_statement

            stmt = stmts.memo(_claim_statement, limit)

            def pg(conn: Connection, token: str, n: int) -> list[Any]:
                params = {"queue_name": self.name, "limit": n, "token": token, "visibility": VISIBILITY_MS}
                return list(conn.execute(stmt, params).all())

            found = pg
        elif self.kind == "sqlite":
            from delayq.dialects.sqlite import _lock_taken, _take_due

            take, lock = stmts.memo(_take_due, limit), stmts.memo(_lock_taken)

            def lite(conn: Connection, token: str, n: int) -> list[Any]:
                rows = conn.execute(take, {"queue_name": self.name, "limit": n, "token": token}).all()
                if rows:
                    conn.execute(lock, {"token": token, "locked_until": rows[0][-1] + VISIBILITY_MS})
                return list(rows)

            found = lite
        else:
            from delayq.dialects.mysql import _due_ids, _lock_due_by_id

            due, lock_rows = stmts.memo(_due_ids, limit), stmts.memo(_lock_due_by_id)

            def my(conn: Connection, token: str, n: int) -> list[Any]:
                params = {"queue_name": self.name, "limit": n, "token": token, "taken": []}
                ids = list(conn.execute(due, params).scalars())
                if not ids:
                    return []
                rows = conn.execute(lock_rows, {**params, "ids": ids}).all()
                if rows:
                    until = rows[0][-1] + VISIBILITY_MS
                    conn.execute(
                        stmts.mark_claimed, {"ids": [r[0] for r in rows], "token": token, "locked_until": until}
                    )
                return list(rows)

            found = my
        self._claims[limit] = found
        return found

    # -- batches of offers ----------------------------------------------------------------------
    def offer_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Offer (key, payload) items due now in one transaction: "now" read first, one INSERT, one NOTIFY."""
        stmts = self.stmts

        def body(conn: Connection) -> int:
            now = int(conn.execute(stmts.now_select).scalar_one())
            if self.kind == "postgresql":
                from delayq.dialects.postgresql import _insert_unnest

                params = {
                    "queue": self.name,
                    "payload_type": self.tag,
                    "created_at": now,
                    "key": [k for k, _ in items],
                    "payload": [p for _, p in items],
                    "scheduled_at": [now] * len(items),
                }
                created = len(conn.execute(stmts.memo(_insert_unnest), params).scalars().all())
                if created and stmts.notify is not None:
                    conn.execute(stmts.notify, {"queue_name": self.name})
                return created
            sql = self._values_sql(len(items))
            flat = [v for key, payload in items for v in (self.name, key, payload, self.tag, now, now, now, 0)]
            result = conn.exec_driver_sql(sql, tuple(flat))
            return len(result.all()) if self.kind == "sqlite" else int(result.rowcount)

        return int(self._run("transaction", body))

    def _values_sql(self, rows: int) -> str:
        sql = values_insert(self.engine.dialect, self.stmts.tables.messages, rows)
        if self.kind == "sqlite":
            sql += ' ON CONFLICT (queue, "key") DO NOTHING RETURNING "key"'
        return sql


def check_same_sql(q: DelayedQueue, stack: Stack) -> None:
    """Assert that the stack's single offer sends the statement delayq's does (what "the same statements" means)."""
    seen: list[str] = []
    q.get("same-sql")  # the first call reads the schema's revision once; not recorded

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    sa.event.listen(q.engine, "before_cursor_execute", record)
    try:
        key = f"same-sql-{uuid.uuid4()}"
        q.offer(key, {"n": 1})
        stack.offer(key + "x", b'{"n":1}')
        q.cancel(key)
        stack.cancel(key + "x")
    finally:
        sa.event.remove(q.engine, "before_cursor_execute", record)
    if seen[0] != seen[1] or seen[2] != seen[3]:
        raise AssertionError(f"the stack ceiling's SQL differs from delayq's: {seen}")
