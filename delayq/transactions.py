"""Where a queue operation runs: in a transaction delayq owns, or in the caller's.

``using=None`` or an ``Engine``: delayq opens a connection, runs the operation in its own
short transaction and retries it whole on transient errors (deadlock, serialization failure,
lock wait timeout, dropped connection). A ``Connection`` or ORM ``Session``: the statements
join the caller's transaction; delayq never commits, rolls back or retries there, and
transient errors reach the caller, who owns the transaction.
"""

from __future__ import annotations

import asyncio
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
from sqlalchemy.util import await_only
from sqlalchemy.util.concurrency import in_greenlet

from delayq.dialects import Dialect, Mode, bounds, dialect_for
from delayq.errors import SchemaMissingError, WrongApiError
from delayq.migrations import check_revision
from delayq.schema import Tables

log = logging.getLogger("delayq")
T = TypeVar("T")
Using = Engine | Connection | Session | None
Operation = Callable[[Connection, Dialect], T]
_PREPARED = "delayq_prepared"
"""Key of a pooled connection's ``info``: the class of the dialect whose ``prepare`` ran on its driver connection."""


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


def _pause(seconds: float) -> None:
    """The one wait between two attempts of delayq's own transaction. In SQLAlchemy's asyncio greenlet (the sync
    core run by ``delayq.aio`` and the ``AsyncWorker``, its chores included, on the event loop's thread) it is an
    ``asyncio.sleep``, so a retry never blocks the loop; elsewhere a ``time.sleep``."""
    if in_greenlet():
        await_only(asyncio.sleep(seconds))
    else:
        time.sleep(seconds)


class Runner:
    """Runs operations against one engine and table set, always on SQLAlchemy's own ``Connection``.

    ``owner`` names the public class whose operations it runs, for the errors that name its async twin.
    """

    def __init__(
        self, engine: Engine, tables: Tables, retry: TransientRetry = DEFAULT_RETRY, owner: str = "DelayedQueue"
    ) -> None:
        self.engine = check_sync_engine(engine, owner)
        self.tables = tables
        self.retry = retry
        self.owner = owner
        self.dialect = dialect_for(engine)
        self._once: Runner | None = None

    def once(self) -> Runner:
        """This runner without retries: one attempt, for a best-effort cleanup after a failure."""
        if self._once is None:
            self._once = Runner(self.engine, self.tables, TransientRetry(attempts=1), self.owner)
        return self._once

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
            engine = self.engine if using is None else check_sync_engine(using, self.owner)
            if engine.dialect.is_async and not in_greenlet():  # an async engine's sync_engine, called blocking
                raise WrongApiError(_blocking_call_message(self.owner))
            return self._retrying(engine, mode, operation, hosting)
        conn = caller_connection(using, self.owner)
        try:
            dialect_for(conn.engine).verify()
            self.dialect.prepare(conn.connection.driver_connection)
            check_revision(conn, self.tables)
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
                _pause(pause)

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
            if pooled.info.get(_PREPARED) is not type(self.dialect):  # once per driver connection
                self.dialect.prepare(pooled.driver_connection)
                pooled.info[_PREPARED] = type(self.dialect)
            autocommitting = self.dialect.autocommitting(dbapi_connection)
            start = self.dialect.owned_start(mode, autocommitting, idle_timeout, pooled.info)
            try:
                if start.autocommit:
                    conn.execution_options(isolation_level="AUTOCOMMIT")
                elif start.isolation_level is not None:
                    conn.execution_options(isolation_level=start.isolation_level)
                elif start.commit:
                    conn.begin()  # in a transaction from the start: a Session(bind=conn) joins it
                for sql in start.sql:
                    conn.exec_driver_sql(sql)
                pooled.info.update(start.marks)
                check_revision(conn, self.tables)  # once per engine and tables: the schema this delayq needs
                yield conn
                if start.commit:
                    conn.commit()
            finally:
                bounds.disarm(dbapi_connection)

    def _raise_if_schema_missing(self, exc: DBAPIError) -> None:
        if self.dialect.is_missing_table(exc):
            names = missing_tables(self.engine, self.tables) or f"{self.tables.messages.name}, ..."
            raise SchemaMissingError(
                f"delayq's tables ({names}) do not exist in this database: run "
                "`delayq migrate --url URL` (or `alembic upgrade heads` with delayq's migrations)"
            ) from exc


def missing_tables(engine: Engine, tables: Tables) -> str:
    """The names of delayq's tables the database lacks (all of them: which ones tells which migration or feature
    is missing), or "" when that cannot be told."""
    try:
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            missing = [t.name for t in tables.metadata.sorted_tables if not inspector.has_table(t.name, t.schema)]
    except DBAPIError:
        return ""
    return ", ".join(missing)


def caller_connection(using: Connection | Session, owner: str = "DelayedQueue") -> Connection:
    """The ``Connection`` of the caller's transaction (a ``Session``'s, for an ORM session)."""
    check_api(using, owner)
    conn = using.connection() if isinstance(using, Session) else using
    if not isinstance(conn, Connection):
        raise TypeError(f"using= takes an Engine, a Connection or a Session, not {type(using).__name__}")
    return conn


def check_sync_engine(engine: object, owner: str = "DelayedQueue") -> Engine:
    """``engine`` if it is a sync ``Engine``; a ``TypeError`` that names the alternative otherwise."""
    check_api(engine, owner)
    if not isinstance(engine, Engine):
        raise TypeError(f"delayq takes a SQLAlchemy Engine (sqlalchemy.create_engine), not {type(engine).__name__}")
    return engine


_ASYNC_TWINS = {
    "DelayedQueue": "AsyncDelayedQueue",
    "Topic": "AsyncTopic",
    "Subscription": "AsyncSubscription",
    "Worker": "AsyncWorker",
}
"""The public classes with an async twin in ``delayq.aio``, by name."""


def check_api(value: object, owner: str) -> None:
    """The one check of which API an engine or a ``using=`` belongs to, for sync and async classes alike.

    ``owner`` is the public class taking ``value`` ("Topic", "AsyncTopic", ...). An ``AsyncEngine``,
    ``AsyncConnection`` or ``AsyncSession`` given to a sync class, or a sync ``Engine``, ``Connection`` or
    ``Session`` given to a ``delayq.aio`` class, raises ``WrongApiError`` naming the class that takes it; so
    does a ``delayq.aio`` object (an ``AsyncDelayedQueue``, say) given to a sync class.
    """
    if type(value).__module__.startswith("delayq.aio") and not owner.startswith("Async"):
        name = type(value).__name__
        sync = name.removeprefix("Async")
        build = f"delayq.{sync}(engine, ...)" if sync in _ASYNC_TWINS else "its sync twin"
        raise WrongApiError(
            f"{owner} takes delayq's sync objects, not a delayq.aio.{name}: build {build} on a sync Engine "
            "(sqlalchemy.create_engine with a sync driver)"
        )
    is_async = isinstance(value, _async_types())
    if owner.startswith("Async"):
        if is_async or not isinstance(value, Engine | Connection | Session):
            return
        sync = owner.removeprefix("Async")
        kind = type(value).__name__
        if isinstance(value, Engine):
            raise WrongApiError(
                f"{owner} takes an AsyncEngine (sqlalchemy.ext.asyncio.create_async_engine), not an Engine: "
                f"for a sync Engine use delayq.{sync}(engine, ...)"
            )
        raise WrongApiError(
            f"{owner}'s using= takes an AsyncConnection or AsyncSession, not a {kind}: for a sync {kind} use "
            f"delayq.{sync}(engine, ...)"
        )
    if not is_async:
        return
    twin = _ASYNC_TWINS.get(owner)
    use = f"for asyncio use delayq.aio.{twin}(async_engine, ...), or " if twin else ""
    kind = type(value).__name__
    if isinstance(value, _async_types()[0]):  # an AsyncEngine
        raise WrongApiError(
            f"{owner} takes a sync Engine, not an AsyncEngine: {use}pass async_engine.sync_engine "
            "(the same pool and URL), or build one with sqlalchemy.create_engine"
        )
    name = "session" if kind == "AsyncSession" else "conn"
    awaited = f"await the operation of delayq.aio.{twin} with using={name}, or " if twin else ""
    raise WrongApiError(
        f"{owner}'s using= takes a sync Connection or Session, not an {kind}: {awaited}run it inside "
        f"`await {name}.run_sync(...)` with the sync Connection that passes"
    )


_BLOCKING_HINTS = {
    "DelayedQueue": "; for a delivery: `await delivery.ack()` (or retry, extend, dead_letter) on the "
    "AsyncDelivery, not on its .delivery",
    "Subscription": "; for a delivery: `await sub.ack(delivery)` (or nack, extend, fail) on the "
    "AsyncSubscription, not `delivery.ack()`",
}


def _blocking_call_message(owner: str) -> str:
    """Why a sync operation on an async engine's ``sync_engine`` cannot run outside asyncio's greenlet."""
    twin = _ASYNC_TWINS.get(owner)
    where = f" through delayq.aio.{twin}" if twin else " inside `await conn.run_sync(...)`"
    return (
        f"this {owner} runs on an AsyncEngine, whose operations cannot block the event loop: await them"
        f"{where}{_BLOCKING_HINTS.get(owner, '')}"
    )


def _async_types() -> tuple[type, ...]:
    asyncio_ext = sys.modules.get("sqlalchemy.ext.asyncio")  # loaded wherever an async object exists
    if asyncio_ext is None:
        return ()
    return (asyncio_ext.AsyncEngine, asyncio_ext.AsyncConnection, asyncio_ext.AsyncSession)
