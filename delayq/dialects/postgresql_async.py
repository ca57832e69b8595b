"""PostgreSQL LISTEN on an async connection, psycopg's or asyncpg's: the async worker's wake-ups
(``PostgresDialect.listen_async``).

The async twin of ``PostgresDialect.listen`` (the same channel, payloads, self-check and
constants): a connection of the engine's own making, detached from the pool, in autocommit. After
a quiet spell it notifies itself through the pool and gives up on the connection when that test
notification does not arrive (a half-open connection delivers nothing and raises nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from delayq.dialects._pg_listen import (
    CANCEL_SUFFIX,
    CANCELLED,
    LISTEN_PING_AFTER,
    LISTEN_PING_TIMEOUT,
    PING,
    ListenStalledError,
)

__all__ = ["notifications"]


def notifications(engine: AsyncEngine, channel: str, cancels: bool = False) -> AsyncIterator[str]:
    """Yield the queue names notified on ``channel``, until cancelled or the connection fails; with ``cancels``
    also the ids notified on its cancel channel, each after ``CANCELLED``."""
    if engine.dialect.driver == "asyncpg":
        return _asyncpg_notifications(engine, channel, cancels)
    return _psycopg_notifications(engine, channel, cancels)


def _heard(channel: str, notice_channel: str, payload: str) -> str | None:
    """What a notification yields: a queue name, ``CANCELLED`` + an id, or None (the listener's own test)."""
    if notice_channel != channel:
        return CANCELLED + payload
    return None if payload == PING else payload


async def _psycopg_notifications(engine: AsyncEngine, channel: str, cancels: bool) -> AsyncIterator[str]:
    from psycopg import sql as psycopg_sql

    pooled = await engine.raw_connection()
    conn: Any = pooled.driver_connection  # psycopg.AsyncConnection (read before the detach forgets it)
    pooled.detach()
    try:
        await conn.rollback()
        await conn.set_autocommit(True)
        await conn.execute(psycopg_sql.SQL("LISTEN {}").format(psycopg_sql.Identifier(channel)))
        if cancels:
            await conn.execute(psycopg_sql.SQL("LISTEN {}").format(psycopg_sql.Identifier(channel + CANCEL_SUFFIX)))
        while True:
            heard = False
            async for notice in conn.notifies(timeout=LISTEN_PING_AFTER):
                heard = True
                if (said := _heard(channel, notice.channel, notice.payload)) is not None:
                    yield said
            if heard:
                continue
            ping = asyncio.create_task(_ping(engine, channel))
            async for notice in conn.notifies(timeout=LISTEN_PING_TIMEOUT, stop_after=1):
                heard = True
                if (said := _heard(channel, notice.channel, notice.payload)) is not None:
                    yield said
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


_CLOSED = object()


async def _asyncpg_notifications(engine: AsyncEngine, channel: str, cancels: bool) -> AsyncIterator[str]:
    """``_psycopg_notifications`` on asyncpg, which hands notifications to a callback (``add_listener``):
    the callback feeds a queue, read with the same self-check after a quiet spell. A connection that
    closes ends the iteration with ``ListenStalledError`` at once (asyncpg's termination callback)."""
    pooled = await engine.raw_connection()
    conn: Any = pooled.driver_connection  # asyncpg.Connection (read before the detach forgets it)
    pooled.detach()
    heard: asyncio.Queue[object] = asyncio.Queue()

    def on_notification(_conn: Any, _pid: int, notice_channel: str, payload: str) -> None:
        said = _heard(channel, notice_channel, payload)
        heard.put_nowait(PING if said is None else said)

    def on_close(_conn: Any) -> None:
        heard.put_nowait(_CLOSED)

    try:
        conn.add_termination_listener(on_close)
        await conn.add_listener(channel, on_notification)  # LISTEN, the channel quoted by asyncpg
        if cancels:
            await conn.add_listener(channel + CANCEL_SUFFIX, on_notification)
        while True:
            try:
                payload = await asyncio.wait_for(heard.get(), LISTEN_PING_AFTER)
            except TimeoutError:
                ping = asyncio.create_task(_ping(engine, channel))
                try:
                    payload = await asyncio.wait_for(heard.get(), LISTEN_PING_TIMEOUT)
                except TimeoutError:
                    raise ListenStalledError(
                        f"LISTEN {channel}: a test notification did not arrive in {LISTEN_PING_TIMEOUT:.0f}s"
                    ) from None
                finally:
                    ping.cancel()
            if payload is _CLOSED:
                raise ListenStalledError(f"LISTEN {channel}: the connection closed")
            if payload != PING:
                yield str(payload)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close(), LISTEN_PING_TIMEOUT)
        conn.terminate()  # (nothing to do where close() finished)
