"""SQLite, the embedded default: one writer at a time, so the claim needs no SKIP LOCKED.

A library-owned transaction of several statements that may read before it writes starts with
``BEGIN IMMEDIATE``: a deferred transaction that reads and then writes fails with "database is
locked" at once, whatever the busy timeout. A transaction whose first statement writes (one write,
or the claim) takes the write lock as that statement starts, waiting for it as long as the busy
timeout allows, so it needs no ``BEGIN IMMEDIATE``.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from delayq.dialects.base import (
    ClaimedRow,
    Dialect,
    Level,
    Mode,
    OwnedStart,
    Statements,
    at_level,
    candidate_columns,
    claim_limit,
)
from delayq.dialects.types import JsonList
from delayq.errors import UnsupportedDatabaseError

_BUSY, _LOCKED = 5, 6
_CONSTRAINT_UNIQUE, _CONSTRAINT_PRIMARYKEY = 2067, 1555
_UNIX_EPOCH_JULIAN_DAY = 2440587.5


WRITER_WAIT = 5.0
"""Seconds a delayq operation waits for another thread's write (``writer_turn``) before it goes on anyway."""


class _Turn:
    """``with _Turn(lock):`` holds ``lock`` for the block when it gets it within ``WRITER_WAIT``."""

    __slots__ = ("_held", "_lock")

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._held = False

    def __enter__(self) -> object:
        self._held = self._lock.acquire(timeout=WRITER_WAIT)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._held:
            self._lock.release()


def _take_due(stmts: Statements, limit: int, level: Level = "") -> sa.Update:
    """Mark the first ``limit`` due messages of ``:queue_name`` with ``:token`` (an attempt more) and return
    their ``candidate_columns``: still with their due time, the attempts counted, and "now"."""
    m = stmts.tables.messages
    due = m.alias("due")
    picked = (
        sa.select(due.c.id)
        .where(due.c.queue == sa.bindparam("queue_name", type_=sa.String), due.c.scheduled_at <= stmts.now)
        .where(*at_level(due, level))
        .order_by(due.c.scheduled_at, due.c.id)
        .limit(claim_limit(limit))
    )
    return (
        sa.update(m)
        .where(m.c.id.in_(picked))
        .values(lock_token=sa.bindparam("token", type_=sa.String), attempts=m.c.attempts + 1)
        .returning(*candidate_columns(stmts))
    )


def _lock_taken(stmts: Statements) -> sa.Update:
    """Set the lock's expiry (``:locked_until``) of the messages a claim marked with ``:token``."""
    m = stmts.tables.messages
    return (
        sa.update(m)
        .where(m.c.lock_token == sa.bindparam("token", type_=sa.String))
        .values(scheduled_at=sa.bindparam("locked_until", type_=sa.BigInteger))
    )


def _errorcode(exc: DBAPIError) -> int:
    return int(getattr(exc.orig, "sqlite_errorcode", 0) or 0)


class SQLiteDialect(Dialect):
    name: ClassVar[str] = "sqlite"

    @classmethod
    def in_memory(cls, url: sa.URL) -> bool:
        return url.database in (None, "", ":memory:")

    min_version: ClassVar[tuple[int, ...]] = (3, 35)  # RETURNING
    # No row locks (FOR UPDATE is dropped): one writer at a time, whose lock a transaction takes at
    # its first write (pysqlite begins a caller's transaction there), so a locking read is a write.
    row_locks: ClassVar[bool] = False
    unseen_commits: ClassVar[bool] = False  # in process: a COMMIT that raised did not commit

    def __init__(self, sa_dialect: sa.Dialect) -> None:
        super().__init__(sa_dialect)
        self._writers = threading.RLock()  # see ``writer_turn``

    @classmethod
    def check_shared_url(cls, url: sa.URL) -> None:
        if url.database in (None, "", ":memory:"):
            raise UnsupportedDatabaseError(
                "an in-memory SQLite database lives in one process: executors need a file "
                "(sqlite:///path/to/file.db) or a server"
            )

    def check_server(self) -> None:
        if sqlite3.sqlite_version_info < self.min_version:
            raise UnsupportedDatabaseError(
                f"SQLite {sqlite3.sqlite_version} is too old; delayq needs SQLite 3.35 or newer (RETURNING)"
            )
        probe = sqlite3.connect(":memory:")  # JSON: built in since 3.38, a build option before (see ``id_in``)
        try:
            probe.execute("SELECT value FROM json_each('[1]')")
        except sqlite3.OperationalError:
            raise UnsupportedDatabaseError(
                f"this SQLite {sqlite3.sqlite_version} was built without its JSON functions, which delayq needs"
            ) from None
        finally:
            probe.close()

    def now_ms(self) -> sa.ColumnElement[int]:
        # julianday('now') is fixed for one statement and has millisecond precision. Written out,
        # not bound: three parameters less for every statement that reads the clock.
        return sa.literal_column(
            f"CAST(round((julianday('now') - {_UNIX_EPOCH_JULIAN_DAY}) * 86400000.0) AS BIGINT)", sa.BigInteger
        )

    def writer_turn(self, mode: Mode) -> contextlib.AbstractContextManager[object]:
        # SQLite lets one writer in at a time, and a writer that finds the lock taken sleeps in the
        # busy handler (1 ms, 2 ms, 5 ms, ... until the lock is free at one of its checks): a worker's
        # claims and acks, from two threads, lost milliseconds to each other at every turn. Writers of
        # one engine in this process queue on a lock instead, woken as soon as it is free; other
        # processes still meet in the busy handler. Reentrant (a nested call, or the coroutines of one
        # event loop, never wait on themselves), and bounded: after WRITER_WAIT seconds the call goes
        # on to SQLite's own wait.
        return contextlib.nullcontext() if mode == "read" else _Turn(self._writers)

    def owned_start(
        self, mode: Mode, autocommitting: bool, idle_s: float | None = None, session: Mapping[str, Any] | None = None
    ) -> OwnedStart:
        # No idle bound: there is no server to end a transaction (a frozen writer keeps the write lock
        # until its process ends). A read opens no transaction (sqlite3 begins one before data changes
        # only). A transaction whose first statement writes ("statement", "scan", "writes") takes the write lock as that
        # statement starts (with the busy timeout), so sqlite3's implicit deferred BEGIN is enough and
        # saves a statement. Several statements that may read before they write, or several on a
        # connection in autocommit (sqlite3 then begins nothing): BEGIN IMMEDIATE.
        if mode == "read":
            return OwnedStart(commit=False)
        if mode in ("statement", "scan") or (mode == "writes" and not autocommitting):
            return OwnedStart()
        return OwnedStart(sql=("BEGIN IMMEDIATE",))

    def claim_mode_for(self, limit: int) -> Mode:
        return "writes"  # the claim begins with its UPDATE (see ``claim``)

    def claim(
        self,
        conn: Connection,
        stmts: Statements,
        params: Mapping[str, Any],
        visibility_ms: int,
        level: Level = "",
    ) -> list[ClaimedRow]:
        # Two statements, the first a write: it takes the write lock as it starts, so no other
        # writer runs until the commit. The first marks the due rows with this claim's token and
        # returns them while they still carry their due time (SQLite's RETURNING gives the values
        # after the UPDATE, and may return them in any order); the second sets the lock's expiry,
        # found by the token's index. One statement (and, for an async driver, three thread hops)
        # less than a BEGIN IMMEDIATE, a SELECT and an UPDATE by id.
        taken = conn.execute(stmts.memo(_take_due, params["limit"], level), params).all()
        if not taken:
            return []
        locked_until, token = taken[0].now + visibility_ms, params["token"]
        conn.execute(stmts.memo(_lock_taken), {"token": token, "locked_until": locked_until})
        rows = sorted(taken, key=lambda r: (r.scheduled_at, r.id))  # oldest due first, as the pick ordered them
        return [
            ClaimedRow(
                msg_id,
                key,
                payload,
                payload_type,
                due,
                locked_until,
                attempts,
                created,
                initially,
                token,
                tags,
                pri,
                group,
            )
            for msg_id, key, payload, payload_type, due, attempts, created, initially, tags, pri, group, _ in rows
        ]

    def autocommitting(self, dbapi_connection: Any) -> bool:
        return dbapi_connection.isolation_level is None

    def is_transient(self, exc: DBAPIError) -> bool:
        return super().is_transient(exc) or _errorcode(exc) & 0xFF in (_BUSY, _LOCKED)

    def is_missing_table(self, exc: DBAPIError) -> bool:
        return "no such table" in str(exc.orig)

    def is_duplicate_key(self, exc: DBAPIError) -> bool:
        return _errorcode(exc) in (_CONSTRAINT_UNIQUE, _CONSTRAINT_PRIMARYKEY)

    def id_in(self, column: sa.Column[int]) -> sa.ColumnElement[bool]:
        # One text parameter, a JSON array read by json_each: SQLAlchemy renders no placeholder per
        # id at each execution (an expanding IN cost 40 µs for 3 ids and 140 µs for 100 here).
        ids = sa.func.json_each(sa.bindparam("ids", type_=JsonList)).table_valued("value")
        return column.in_(sa.select(ids.c.value))

    def held_in(self, ids: sa.Column[int], tokens: sa.Column[str]) -> sa.ColumnElement[bool]:
        # The pairs as one JSON text, as ``id_in``: no placeholder per pair; the id IN probes the rowid.
        pairs = sa.func.json_each(sa.bindparam("pairs", type_=JsonList)).table_valued("value")
        held_id = sa.func.json_extract(pairs.c.value, sa.literal_column("'$[0]'"))
        held_token = sa.func.json_extract(pairs.c.value, sa.literal_column("'$[1]'"))
        return sa.and_(ids.in_(sa.select(held_id)), sa.tuple_(ids, tokens).in_(sa.select(held_id, held_token)))

    def greatest(self, a: sa.ColumnElement[int], b: sa.ColumnElement[int]) -> sa.ColumnElement[int]:
        # SQLite's max() with two arguments is the scalar GREATEST.
        return sa.func.max(a, b, type_=sa.BigInteger)

    def insert_skipping_duplicates(self, table: sa.Table) -> sa.Insert:
        return sqlite_insert(table).on_conflict_do_nothing(index_elements=["queue", "key"])

    # Topics
    def topic_upsert(self, table: sa.Table, keys: Sequence[str], set_: Mapping[str, Any] | None) -> sa.Insert:
        insert = sqlite_insert(table)
        if set_ is None:
            return insert.on_conflict_do_nothing(index_elements=list(keys))
        return insert.on_conflict_do_update(index_elements=list(keys), set_=dict(set_))

    def adding_upsert(self, table: sa.Table, keys: Sequence[str], counts: Sequence[str]) -> sa.Insert:
        insert = sqlite_insert(table)
        added = {c: table.c[c] + insert.excluded[c] for c in counts}
        return insert.on_conflict_do_update(index_elements=list(keys), set_=added)
