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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from delayq.dialects import Dialect, Mode, dialect_for
from delayq.direct import DirectConnection, Executes, watched
from delayq.errors import SchemaMissingError
from delayq.schema import Tables

log = logging.getLogger("delayq")
T = TypeVar("T")
C = TypeVar("C")
Using = Engine | Connection | Session | None
Operation = Callable[[Connection, Dialect], T]
DirectOperation = Callable[[Executes, Dialect], T]


@dataclass(frozen=True)
class TransientRetry:
    """How delayq retries its own transactions after transient errors.

    Defaults: 8 attempts, full-jitter backoff from 20 ms doubling to at most 2 s.
    """

    attempts: int = 8
    first_delay: float = 0.02
    max_delay: float = 2.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay, self.first_delay * 2**attempt))


DEFAULT_RETRY = TransientRetry()


class Runner:
    """Runs operations against one engine and table set."""

    def __init__(self, engine: Engine, tables: Tables, retry: TransientRetry = DEFAULT_RETRY) -> None:
        self.engine = engine
        self.tables = tables
        self.retry = retry
        self.dialect = dialect_for(engine)

    def run(self, using: Using, operation: DirectOperation[T], mode: Mode) -> T:
        """Run ``operation(conn, dialect)`` in the caller's transaction or in one of delayq's own.

        ``mode`` says what the operation does, so that delayq's own transaction starts right
        (see ``Mode``). delayq's own transaction runs on the driver's connection directly
        (see ``delayq.direct``) unless someone watches the engine's statements.
        """
        if using is not None and not isinstance(using, Engine):
            return self._in_caller(_caller_connection(using), operation)
        engine = using or self.engine
        if watched(engine):
            return self._retrying(lambda: self.owned(mode, engine), operation)
        return self._retrying(lambda: self._owned_direct(mode, engine), operation)

    def run_in_connection(self, using: Using, operation: Operation[T], mode: Mode) -> T:
        """Like ``run``, for operations that need SQLAlchemy's ``Connection`` (they hand it to user code)."""
        if using is None or isinstance(using, Engine):
            engine = using or self.engine
            return self._retrying(lambda: self.owned(mode, engine), operation)
        return self._in_caller(_caller_connection(using), operation)

    def _in_caller(self, conn: Connection, operation: Operation[T]) -> T:
        try:
            self.dialect.verify()
            return operation(conn, self.dialect)
        except DBAPIError as exc:
            self._raise_if_schema_missing(exc)
            raise

    def _retrying(
        self, transaction: Callable[[], contextlib.AbstractContextManager[C]], operation: Callable[[C, Dialect], T]
    ) -> T:
        """Run ``operation`` in a fresh owned transaction, again on transient errors."""
        attempt = 0
        while True:
            try:
                with transaction() as conn:
                    return operation(conn, self.dialect)
            except DBAPIError as exc:
                attempt += 1
                if not self.dialect.is_transient(exc) or attempt >= self.retry.attempts:
                    self._raise_if_schema_missing(exc)
                    raise
                pause = self.retry.delay(attempt)
                log.warning(
                    "transient database error, retrying in %.3fs (attempt %d of %d): %s",
                    pause,
                    attempt + 1,
                    self.retry.attempts,
                    exc.orig,
                )
                time.sleep(pause)

    @contextlib.contextmanager
    def owned(self, mode: Mode, engine: Engine | None = None) -> Iterator[Connection]:
        """A fresh connection, its transaction begun as ``mode`` needs; committed when the block ends well."""
        with (engine or self.engine).connect() as conn:
            self.dialect.verify()
            start = self.dialect.owned_start(mode, self.dialect.autocommitting(conn.connection.dbapi_connection))
            if start.autocommit:
                conn.execution_options(isolation_level="AUTOCOMMIT")
            for sql in start.sql:
                conn.exec_driver_sql(sql)
            yield conn
            if start.commit:
                conn.commit()

    @contextlib.contextmanager
    def _owned_direct(self, mode: Mode, engine: Engine) -> Iterator[DirectConnection]:
        """``owned`` on the driver's connection: the same start, commit and pool reset."""
        conn = DirectConnection.checkout(engine)
        clean = False
        try:
            self.dialect.verify()
            start = self.dialect.owned_start(mode, self.dialect.autocommitting(conn.dbapi_connection))
            if start.autocommit:
                engine.dialect.set_isolation_level(conn.dbapi_connection, "AUTOCOMMIT")
            try:
                for sql in start.sql:
                    conn.exec_driver_sql(sql)
                yield conn
                if start.commit:
                    conn.commit()
                clean = True  # no transaction left open
            finally:
                if start.autocommit and conn.pooled.is_valid:
                    try:
                        engine.dialect.reset_isolation_level(conn.dbapi_connection)
                    except engine.dialect.loaded_dbapi.Error as exc:
                        conn.pooled.invalidate(exc)
        finally:
            conn.close(clean=clean)

    def _raise_if_schema_missing(self, exc: DBAPIError) -> None:
        if self.dialect.is_missing_table(exc):
            names = f"{self.tables.messages.name}, {self.tables.dead_letters.name}"
            raise SchemaMissingError(
                f"delayq's tables ({names}) do not exist in this database: run "
                "`delayq migrate --url URL` (or `alembic upgrade heads` with delayq's migrations)"
            ) from exc


def _caller_connection(using: Connection | Session) -> Connection:
    conn = using.connection() if isinstance(using, Session) else using
    if not isinstance(conn, Connection):
        raise TypeError(f"using= takes an Engine, a Connection or a Session, not {type(using).__name__}")
    return conn
