"""How the async API runs delayq's sync core: in SQLAlchemy's greenlets, never on a thread.

Every operation of ``delayq.aio`` is the sync operation itself (its statements, validation,
serialization, outcomes and error translation), called inside a greenlet that SQLAlchemy's
asyncio extension provides: ``AsyncConnection.run_sync`` / ``AsyncSession.run_sync`` for the
caller's transaction, ``greenlet_spawn`` for delayq's own. Where the sync driver would block, the
async driver awaits and the event loop runs other tasks meanwhile.

delayq's own transactions are retried here, not in the sync core (whose queues are built with
``NO_RETRY``): the pause between attempts is an ``asyncio.sleep``, so a retry never blocks the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.util import greenlet_spawn

from delayq.dialects import dialect_for
from delayq.transactions import TransientRetry, check_api

__all__ = ["NO_RETRY", "AsyncUsing", "Bridge"]

T = TypeVar("T")

AsyncUsing = AsyncEngine | AsyncConnection | AsyncSession | None
"""Where an async operation runs: None or an ``AsyncEngine`` (delayq's own transaction, retried on
transient errors), or the caller's ``AsyncConnection`` / ``AsyncSession`` (joined, never committed,
rolled back or retried)."""

NO_RETRY = TransientRetry(attempts=1)
"""The sync core's retry inside the async API: none (the bridge retries, sleeping without blocking)."""

SyncCall = Callable[[Engine | Connection | Session], T]


class Bridge:
    """Runs sync operations of one ``AsyncEngine``'s sync engine from coroutines."""

    def __init__(self, engine: AsyncEngine, retry: TransientRetry, owner: str) -> None:
        check_api(engine, owner)  # a sync Engine: the error names owner's sync twin
        if not isinstance(engine, AsyncEngine):
            raise TypeError(
                f"{owner} takes an AsyncEngine (sqlalchemy.ext.asyncio.create_async_engine), "
                f"not {type(engine).__name__}"
            )
        self.owner = owner
        self.engine = engine
        self.retry = retry
        self.dialect = dialect_for(engine.sync_engine)

    async def run(self, using: AsyncUsing, call: SyncCall[T]) -> T:
        """``call(sync_using)`` in a greenlet: in the caller's transaction, or in delayq's own (retried)."""
        if isinstance(using, AsyncConnection | AsyncSession):
            return await using.run_sync(call)
        if using is None or isinstance(using, AsyncEngine):
            return await self._retrying((using or self.engine).sync_engine, call)
        check_api(using, self.owner)  # a sync Connection or Session: the error names owner's sync twin
        raise TypeError(
            f"using= takes an AsyncEngine, an AsyncConnection or an AsyncSession, not {type(using).__name__}"
        )

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """A sync call that may reach the database through the sync engine, run in a greenlet."""
        return await greenlet_spawn(fn, *args)

    async def _retrying(self, engine: Engine, call: SyncCall[T]) -> T:
        attempt, deadline = 0, time.monotonic() + self.retry.budget
        while True:
            try:
                return await greenlet_spawn(call, engine)
            except DBAPIError as exc:
                attempt += 1
                pause = self.retry.pause_after(exc, attempt, deadline, self.dialect, engine)
                if pause is None:
                    raise
                await asyncio.sleep(pause)
