"""PostgreSQL LISTEN on an async psycopg connection: the async worker's wake-ups (``PostgresDialect.listen_async``).

The async twin of ``PostgresDialect.listen`` (the same channel, payloads, self-check and
constants): a connection of the engine's own making, detached from the pool, in autocommit. After
a quiet spell it notifies itself through the pool and gives up on the connection when that test
notification does not arrive (a half-open connection delivers nothing and raises nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from delayq.dialects._pg_listen import LISTEN_PING_AFTER, LISTEN_PING_TIMEOUT, PING, ListenStalledError

__all__ = ["notifications"]


async def notifications(engine: AsyncEngine, channel: str) -> AsyncIterator[str]:
    """Yield the queue names notified on ``channel``, until cancelled or the connection fails."""
    from psycopg import sql as psycopg_sql

    pooled = await engine.raw_connection()
    conn: Any = pooled.driver_connection  # psycopg.AsyncConnection (read before the detach forgets it)
    pooled.detach()
    try:
        await conn.rollback()
        await conn.set_autocommit(True)
        await conn.execute(psycopg_sql.SQL("LISTEN {}").format(psycopg_sql.Identifier(channel)))
        while True:
            heard = False
            async for notice in conn.notifies(timeout=LISTEN_PING_AFTER):
                heard = True
                if notice.payload != PING:
                    yield notice.payload
            if heard:
                continue
            ping = asyncio.create_task(_ping(engine, channel))
            async for notice in conn.notifies(timeout=LISTEN_PING_TIMEOUT, stop_after=1):
                heard = True
                if notice.payload != PING:
                    yield notice.payload
            ping.cancel()
            if not heard:
                raise ListenStalledError(
                    f"LISTEN {channel}: a test notification did not arrive in {LISTEN_PING_TIMEOUT:.0f}s"
                )
    finally:
        await conn.close()


async def _ping(engine: AsyncEngine, channel: str) -> None:
    """Send the test notification through the pool (its failure is what the listener acts on)."""
    try:
        async with engine.connect() as conn:
            await conn.execute(sa.select(sa.func.pg_notify(channel, PING)))
            await conn.commit()
    except Exception:
        return
