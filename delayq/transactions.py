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
from delayq.errors import SchemaMissingError
from delayq.schema import Tables

log = logging.getLogger("delayq")
T = TypeVar("T")
Using = Engine | Connection | Session | None
Operation = Callable[[Connection, Dialect], T]


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

    def run(self, using: Using, operation: Operation[T], mode: Mode) -> T:
        """Run ``operation(conn, dialect)`` in the caller's transaction or in one of delayq's own.

        ``mode`` says what the operation does, so that delayq's own transaction starts right:
        ``"read"``, ``"statement"`` (one write statement) or ``"transaction"`` (several).
        """
        if using is None or isinstance(using, Engine):
            return self._run_owned(using or self.engine, operation, mode)
        conn = using.connection() if isinstance(using, Session) else using
        if not isinstance(conn, Connection):
            raise TypeError(f"using= takes an Engine, a Connection or a Session, not {type(using).__name__}")
        try:
            self.dialect.verify(conn)
            return operation(conn, self.dialect)
        except DBAPIError as exc:
            self._raise_if_schema_missing(exc)
            raise

    def _run_owned(self, engine: Engine, operation: Operation[T], mode: Mode) -> T:
        attempt = 0
        while True:
            try:
                with self.owned(mode, engine) as conn:
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
            self.dialect.verify(conn)
            self.dialect.start_owned(conn, mode)
            yield conn
            conn.commit()

    def _raise_if_schema_missing(self, exc: DBAPIError) -> None:
        if self.dialect.is_missing_table(exc):
            names = f"{self.tables.messages.name}, {self.tables.dead_letters.name}"
            raise SchemaMissingError(
                f"delayq's tables ({names}) do not exist in this database: run "
                "`delayq migrate --url URL` (or `alembic upgrade heads` with delayq's migrations)"
            ) from exc
