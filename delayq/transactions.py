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

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from delayq.dialects import Dialect, Mode, bounds, dialect_for
from delayq.errors import SchemaMissingError
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

    Two bounds keep a frozen client or a silent network from holding rows locked, or a thread
    waiting, for ever (``delayq.dialects.bounds``; docs/workers.md, "Bounds"):

    - ``idle_timeout``: seconds a transaction of delayq's own (several statements: claims, topic
      polls and fences, dead-letter moves) may sit idle before the server ends it and frees its
      rows. PostgreSQL and MariaDB; MySQL and SQLite have no such setting. None: 30 s; 0: no bound.
    - ``call_timeout``: seconds one attempt of delayq's own operation may wait for the database
      before its connection is dropped (the attempt then fails as a lost connection, and is
      retried). None: 60 s; 0: no bound. Drivers whose connection has no socket (none of the
      supported ones) are not bounded.
    """

    attempts: int = 60
    first_delay: float = 0.02
    max_delay: float = 2.0
    budget: float = 30.0
    idle_timeout: float | None = None
    call_timeout: float | None = None

    def idle_bound(self) -> float | None:
        """The idle bound in seconds, or None for none."""
        found = bounds.IDLE_TIMEOUT_S if self.idle_timeout is None else self.idle_timeout
        return found if found > 0 else None

    def call_bound(self) -> float | None:
        """The call bound in seconds, or None for none."""
        found = bounds.CALL_TIMEOUT_S if self.call_timeout is None else self.call_timeout
        return found if found > 0 else None

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

    def run(self, using: Using, operation: Operation[T], mode: Mode, *, hosting: float | None = None) -> T:
        """Run ``operation(conn, dialect)`` in the caller's transaction or in one of delayq's own.

        ``mode`` says what the operation does, so that delayq's own transaction starts right
        (see ``Mode``); it is retried whole on transient errors. In the caller's transaction it
        runs once and errors reach the caller.

        ``hosting``: the operation runs the user's code (a transactional handler) in delayq's
        transaction; the idle bound is then this many seconds (the delivery's visibility timeout),
        and the call bound starts only where the operation calls ``bound_calls``.
        """
        if using is None or isinstance(using, Engine):
            engine = self.engine if using is None else check_sync_engine(using)
            return self._retrying(engine, mode, operation, hosting)
        conn = caller_connection(using)
        try:
            dialect_for(conn.engine).verify()
            self.dialect.prepare(conn.connection.driver_connection)
            return operation(conn, self.dialect)
        except DBAPIError as exc:
            self._raise_if_schema_missing(exc)
            raise

    def _retrying(self, engine: Engine, mode: Mode, operation: Operation[T], hosting: float | None = None) -> T:
        """Run ``operation`` in a fresh owned transaction, again on transient errors."""
        attempt, deadline = 0, time.monotonic() + self.retry.budget
        idle = self.retry.idle_bound() if hosting is None else hosting
        while True:
            try:
                with self.dialect.writer_turn(mode), self.owned(mode, engine, idle_timeout=idle) as conn:
                    if hosting is None:
                        self.bound_calls(conn)
                    return operation(conn, self.dialect)
            except DBAPIError as exc:
                attempt += 1
                pause = self.retry.pause_after(exc, attempt, deadline, self.dialect, engine)
                if pause is None:
                    self._raise_if_schema_missing(exc)
                    raise
                time.sleep(pause)

    def bound_calls(self, conn: Connection) -> None:
        """From now until the end of ``owned``'s block (its COMMIT included), ``conn``'s calls are bounded
        by the call bound: past it, its connection is dropped (``delayq.dialects.bounds``)."""
        bounds.arm(conn.connection.dbapi_connection, self.retry.call_bound())

    @contextlib.contextmanager
    def owned(
        self, mode: Mode, engine: Engine | None = None, *, idle_timeout: float | None = None
    ) -> Iterator[Connection]:
        """A fresh connection, its transaction begun as ``mode`` needs; committed when the block ends well.

        When the block raises, closing the connection rolls back whatever it began, so no
        transaction or lock outlives a failed operation (whatever the pool's reset on return).
        ``idle_timeout``: the transaction's idle bound in seconds (None: none; see ``TransientRetry``).
        A call bound armed in the block (``bound_calls``) ends with it.
        """
        engine = engine or self.engine
        own = bounds.OWN_CHECKOUT.set(True)
        try:
            conn = engine.connect()
        finally:
            bounds.OWN_CHECKOUT.reset(own)
        with conn:
            dialect_for(conn.engine).verify()  # the server this connection reached, not the queue's
            pooled = conn.connection
            dbapi_connection = pooled.dbapi_connection
            self.dialect.prepare(pooled.driver_connection)
            autocommitting = self.dialect.autocommitting(dbapi_connection)
            start = self.dialect.owned_start(mode, autocommitting, idle_timeout, pooled.info)
            try:
                if start.autocommit:
                    conn.execution_options(isolation_level="AUTOCOMMIT")
                elif start.commit:
                    conn.begin()  # in a transaction from the start: a Session(bind=conn) joins it
                for sql in start.sql:
                    conn.exec_driver_sql(sql)
                pooled.info.update(start.marks)
                yield conn
                if start.commit:
                    conn.commit()
            finally:
                bounds.disarm(dbapi_connection)

    def _raise_if_schema_missing(self, exc: DBAPIError) -> None:
        if self.dialect.is_missing_table(exc):
            names = f"{self.tables.messages.name}, {self.tables.dead_letters.name}"
            raise SchemaMissingError(
                f"delayq's tables ({names}) do not exist in this database: run "
                "`delayq migrate --url URL` (or `alembic upgrade heads` with delayq's migrations)"
            ) from exc


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
