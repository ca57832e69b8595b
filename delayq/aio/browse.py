"""The operator views of ``delayq.browse`` on an ``AsyncConnection``: the same statements, awaited."""

from __future__ import annotations

import datetime as dt
import functools

from sqlalchemy.ext.asyncio import AsyncConnection

from delayq import browse
from delayq.browse import QueueHistory, SearchCursor, State, StoredMessage, WorkerInfo
from delayq.schema import Tables

__all__ = ["list_messages", "list_workers", "queue_history", "queue_names", "search_messages"]


async def queue_names(conn: AsyncConnection, tables: Tables) -> list[str]:
    """Every queue the database knows of (messages, dead letters, kept ones, a schedule, a pause or a limit); see
    ``delayq.browse.queue_names``."""
    return await conn.run_sync(browse.queue_names, tables)


async def list_messages(
    conn: AsyncConnection,
    tables: Tables,
    queue: str,
    *,
    state: State | None,
    now: dt.datetime,
    key_prefix: str | None = None,
    key: str | None = None,
    limit: int = 100,
    after: tuple[int, int, str] | None = None,
    by_key: bool = False,
    tag: str | None = None,
) -> list[StoredMessage]:
    """A queue's messages in a state (live, dead, completed or cancelled), a keyset page at a time; see
    ``delayq.browse.list_messages``."""
    view = functools.partial(
        browse.list_messages,
        tables=tables,
        queue=queue,
        state=state,
        now=now,
        key_prefix=key_prefix,
        key=key,
        limit=limit,
        after=after,
        by_key=by_key,
        tag=tag,
    )
    return await conn.run_sync(view)


async def search_messages(
    conn: AsyncConnection,
    tables: Tables,
    *,
    state: State | None,
    now: dt.datetime,
    key_prefix: str | None = None,
    tag: str | None = None,
    limit: int = 100,
    after: SearchCursor | None = None,
) -> list[StoredMessage]:
    """The matching messages of every queue, queue by queue, a keyset page at a time; see
    ``delayq.browse.search_messages``."""
    view = functools.partial(
        browse.search_messages,
        tables=tables,
        state=state,
        now=now,
        key_prefix=key_prefix,
        tag=tag,
        limit=limit,
        after=after,
    )
    return await conn.run_sync(view)


async def list_workers(conn: AsyncConnection, tables: Tables) -> list[WorkerInfo]:
    """The workers in the worker registry, oldest first; see ``delayq.browse.list_workers``."""
    return await conn.run_sync(browse.list_workers, tables)


async def queue_history(
    conn: AsyncConnection,
    tables: Tables,
    queue: str | None = None,
    *,
    span: dt.timedelta = browse.HISTORY_SPAN,
    now: dt.datetime | None = None,
) -> QueueHistory:
    """Outcomes per minute of a queue (or every queue); see ``delayq.browse.queue_history``."""
    return await conn.run_sync(functools.partial(browse.queue_history, tables=tables, queue=queue, span=span, now=now))
