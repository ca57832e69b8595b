"""The AsyncWorker's chores under transient database errors: the pruner's transaction is retried as the sync core
retries its own, and in the event loop's greenlet the pause between two attempts is an ``asyncio.sleep``
(``delayq.transactions``), so the loop keeps turning while it waits: heartbeats, lock extensions, handlers and the
stall timeout go on. The same retry serves the topic garbage collector and the topic consumers' statements.

The fault is injected by a SQLAlchemy event on the worker's own engine: every DELETE of kept rows fails with the
error the dialect counts as transient (PostgreSQL's SQLSTATE 40001, MariaDB's deadlock 1213, a lost connection on
SQLite, where nothing else is transient), so nothing is deleted from the shared database.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import sqlite3
import uuid
from typing import Any

import greenlet
import psycopg.errors
import sqlalchemy as sa
from conftest import Backend, make_async_engine
from test_aio_worker import wait_for

from delayq import DelayedQueue, ManualClock
from delayq.aio import AsyncHandler, AsyncWorker

MINUTE = dt.timedelta(minutes=1)
PAUSES = 3
"""Pauses between attempts the test watches."""


def _transient(dialect: sa.Dialect, statement: str, parameters: Any) -> sa.exc.DBAPIError:
    """The error ``dialect``'s delayq dialect takes for transient, as SQLAlchemy raises it."""
    if dialect.name == "postgresql":
        return sa.exc.OperationalError(statement, parameters, psycopg.errors.SerializationFailure("injected"))
    if dialect.name == "mysql":
        deadlock = dialect.loaded_dbapi.OperationalError(1213, "Deadlock found when trying to get lock (injected)")
        return sa.exc.OperationalError(statement, parameters, deadlock)
    lost = sqlite3.OperationalError("the connection was lost (injected)")
    return sa.exc.OperationalError(statement, parameters, lost, connection_invalidated=True)


class FailingDeletes(logging.Handler):
    """Fails the pruner's DELETEs of kept rows on ``engine`` (transient errors while ``transient`` is set, then a
    lasting one, so the round ends), and notes for each pause between two attempts whether the event loop ran a
    coroutine scheduled as the pause began (the retry's warning) before the next attempt took its connection
    (nothing in between may wait for the database: the failed attempt's connection went back to the pool first)."""

    def __init__(self, engine: sa.Engine) -> None:
        super().__init__(logging.WARNING)
        self.transient = True
        self.turned: list[bool] = []
        """Per pause: whether the loop ran the coroutine scheduled at its start before the next attempt."""
        self._pausing: tuple[Any, list[bool]] | None = None  # (the retrying greenlet, what the coroutine marks)
        sa.event.listen(engine, "checkout", self._checkout)
        sa.event.listen(engine, "before_cursor_execute", self._before)

    def emit(self, record: logging.LogRecord) -> None:
        if not record.getMessage().startswith("transient database error"):
            return
        ran: list[bool] = []

        async def mark() -> None:
            ran.append(True)

        asyncio.get_running_loop().create_task(mark())
        self._pausing = (greenlet.getcurrent(), ran)

    def _checkout(self, *_: Any) -> None:
        if self._pausing is not None and self._pausing[0] is greenlet.getcurrent():
            self.turned.append(bool(self._pausing[1]))
            self._pausing = None

    def _before(self, conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE FROM") and "finished" in statement:
            if self.transient:
                raise _transient(conn.dialect, statement, parameters)
            raise sa.exc.ProgrammingError(statement, parameters, Exception("injected: a lasting error"))


def test_the_pruners_retry_pauses_without_blocking_the_event_loop(
    backend: Backend, queue_name: str, clock: ManualClock
) -> None:
    kept = DelayedQueue(backend.engine, queue_name, clock=clock, retention=MINUTE)
    kept.offer("a", 1)
    delivery = kept.try_poll()
    assert delivery is not None and delivery.ack()  # kept for a minute
    clock.advance(2 * MINUTE)  # and past its expiry: the pruner's

    class Idle(AsyncHandler):
        queue = queue_name
        retention = MINUTE

        async def handle(self, delivery: Any, conn: Any = None) -> None:  # pragma: no cover - nothing to handle
            pass

    async def main() -> list[bool]:
        engine = make_async_engine(backend.url)
        faults = FailingDeletes(engine.sync_engine)
        logger = logging.getLogger("delayq")
        logger.addHandler(faults)
        try:
            worker = AsyncWorker(engine, [Idle()], clock=clock, poll_interval=dt.timedelta(milliseconds=20))
            pruner = worker._core.pruner
            assert pruner is not None
            pruner.interval = 0.02
            pruner.pruner.chore = f"prune-{uuid.uuid4().hex[:12]}"  # a chore row of its own (tests share the database)
            worker.start()
            try:

                async def watched() -> bool:
                    return len(faults.turned) >= PAUSES

                await wait_for(watched, f"{PAUSES} retries of the pruner's DELETE")
            finally:
                faults.transient = False  # the round ends at its next attempt
                assert await worker.stop()
        finally:
            logger.removeHandler(faults)
            await engine.dispose()
        return faults.turned

    turned = asyncio.run(main())
    assert len(turned) >= PAUSES and all(turned), turned
    assert kept.get("a") is not None  # (nothing was deleted)
