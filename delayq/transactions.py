"""Where a queue operation runs: in a transaction delayq owns, or in the caller's.

``using=None`` or an ``Engine``: delayq opens a connection, runs the operation in its own
short transaction and retries it whole on transient errors (deadlock, serialization failure,
lock wait timeout, dropped connection). A ``Connection`` or ORM ``Session``: the statements
join the caller's transaction; delayq never commits, rolls back or retries there, and
transient errors reach the caller, who owns the transaction.
"""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from delayq.dialects import Dialect, Mode, dialect_for
from delayq.errors import SchemaMissingError
from delayq.migrations import check_revision
from delayq.schema import Tables

log = logging.getLogger("delayq")
T = TypeVar("T")
Using = Engine | Connection | Session | None
Operation = Callable[[Connection, Dialect], T]


@dataclass(frozen=True)
class TransientRetry:
    """How delayq retries its own transactions after transient errors.

    It retries until ``attempts`` attempts were made or ``budget`` seconds have passed since the
    first one, whichever comes first, with full-jitter backoff from ``first_delay`` doubling to at
    most ``max_delay`` seconds. Defaults: 60 attempts, 30 s (a typical server restart), 20 ms to 2 s.
    """

    attempts: int = 60
    first_delay: float = 0.02
    max_delay: float = 2.0
    budget: float = 30.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay, self.first_delay * 2**attempt))

    def pause_after(
        self, exc: DBAPIError, attempt: int, deadline: float, dialect: Dialect, engine: Engine
    ) -> float | None:
        """After failed ``attempt`` (1 for the first) raised ``exc``: how long to pause before the next
        one (logged), or None when ``exc`` is not transient or the attempts or the time (``deadline``,
        a ``time.monotonic()`` value) are spent. Both the sync and the async retry loops ask this."""
        pause = self.delay(attempt)
        if not dialect.is_transient(exc) or attempt >= self.attempts or time.monotonic() + pause > deadline:
            return None
        log.warning(
            "transient database error, retrying in %.3fs (attempt %d of %d): %s",
            pause,
            attempt + 1,
            self.attempts,
            type(exc.orig).__name__ if engine.hide_parameters else exc.orig,
        )
        return pause


DEFAULT_RETRY = TransientRetry()


class Runner:
    """Runs operations against one engine and table set, always on SQLAlchemy's own ``Connection``."""

    def __init__(self, engine: Engine, tables: Tables, retry: TransientRetry = DEFAULT_RETRY) -> None:
        self.engine = check_sync_engine(engine)
        self.tables = tables
        self.retry = retry
        self.dialect = dialect_for(engine)

    def run(self, using: Using, operation: Operation[T], mode: Mode) -> T:
        """Run ``operation(conn, dialect)`` in the caller's transaction or in one of delayq's own.

        ``mode`` says what the operation does, so that delayq's own transaction starts right
        (see ``Mode``); it is retried whole on transient errors. In the caller's transaction it
        runs once and errors reach the caller.
        """
        if using is None or isinstance(using, Engine):
            engine = self.engine if using is None else check_sync_engine(using)
            return self._retrying(engine, mode, operation)
        conn = caller_connection(using)
        try:
            dialect_for(conn.engine).verify()
            self.dialect.prepare(conn.connection.driver_connection)
            check_revision(conn, self.tables)
            return operation(conn, self.dialect)
        except DBAPIError as exc:
            self._raise_if_schema_missing(exc)
            raise

    def _retrying(self, engine: Engine, mode: Mode, operation: Operation[T]) -> T:
        """Run ``operation`` in a fresh owned transaction, again on transient errors."""
        attempt, deadline = 0, time.monotonic() + self.retry.budget
        while True:
            try:
                with self.dialect.writer_turn(mode), self.owned(mode, engine) as conn:
                    return operation(conn, self.dialect)
            except DBAPIError as exc:
                attempt += 1
                pause = self.retry.pause_after(exc, attempt, deadline, self.dialect, engine)
                if pause is None:
                    self._raise_if_schema_missing(exc)
                    raise
                time.sleep(pause)

    @contextlib.contextmanager
    def owned(self, mode: Mode, engine: Engine | None = None) -> Iterator[Connection]:
        """A fresh connection, its transaction begun as ``mode`` needs; committed when the block ends well.

        When the block raises, closing the connection rolls back whatever it began, so no
        transaction or lock outlives a failed operation (whatever the pool's reset on return).
        """
        with (engine or self.engine).connect() as conn:
            dialect_for(conn.engine).verify()  # the server this connection reached, not the queue's
            pooled = conn.connection
            self.dialect.prepare(pooled.driver_connection)
            start = self.dialect.owned_start(mode, self.dialect.autocommitting(pooled.dbapi_connection))
            if start.autocommit:
                conn.execution_options(isolation_level="AUTOCOMMIT")
            elif start.commit:
                conn.begin()  # in a transaction from the start: a Session(bind=conn) joins it
            for sql in start.sql:
                conn.exec_driver_sql(sql)
            check_revision(conn, self.tables)  # once per engine and tables: the schema this delayq needs
            yield conn
            if start.commit:
                conn.commit()

    def _raise_if_schema_missing(self, exc: DBAPIError) -> None:
        if self.dialect.is_missing_table(exc):
            names = missing_tables(self.engine, self.tables) or f"{self.tables.messages.name}, ..."
            raise SchemaMissingError(
                f"delayq's tables ({names}) do not exist in this database: run "
                "`delayq migrate --url URL` (or `alembic upgrade heads` with delayq's migrations)"
            ) from exc


def missing_tables(engine: Engine, tables: Tables) -> str:
    """The names of delayq's tables the database lacks (the first few), or "" when that cannot be told."""
    try:
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            missing = [t.name for t in tables.metadata.sorted_tables if not inspector.has_table(t.name, t.schema)]
    except DBAPIError:
        return ""
    return ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")


def caller_connection(using: Connection | Session) -> Connection:
    """The ``Connection`` of the caller's transaction (a ``Session``'s, for an ORM session)."""
    _refuse_async(using)
    conn = using.connection() if isinstance(using, Session) else using
    if not isinstance(conn, Connection):
        raise TypeError(f"using= takes an Engine, a Connection or a Session, not {type(using).__name__}")
    return conn


def check_sync_engine(engine: object) -> Engine:
    """``engine`` if it is a sync ``Engine``; a ``TypeError`` that names the alternative otherwise."""
    _refuse_async(engine)
    if not isinstance(engine, Engine):
        raise TypeError(f"delayq takes a SQLAlchemy Engine (sqlalchemy.create_engine), not {type(engine).__name__}")
    return engine


def _refuse_async(value: object) -> None:
    asyncio_ext = sys.modules.get("sqlalchemy.ext.asyncio")  # loaded wherever an async object exists
    if asyncio_ext is None:
        return
    if isinstance(value, asyncio_ext.AsyncEngine):
        raise TypeError(
            "delayq's queue takes a sync Engine, not an AsyncEngine: for asyncio use "
            "delayq.aio.AsyncDelayedQueue(async_engine, ...), or pass async_engine.sync_engine "
            "(the same pool and URL), or build one with sqlalchemy.create_engine"
        )
    if isinstance(value, asyncio_ext.AsyncConnection | asyncio_ext.AsyncSession):
        kind = type(value).__name__
        name = "session" if kind == "AsyncSession" else "conn"
        raise TypeError(
            f"using= takes a sync Connection or Session, not an {kind}: use delayq.aio.AsyncDelayedQueue "
            f"(`await queue.offer(..., using={name})`), or run the operation inside "
            f"`await {name}.run_sync(lambda sync: queue.offer(..., using=sync))`"
        )
