"""The async API in the caller's AsyncSession / AsyncConnection, on the async drivers; its own transactions retried."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import START, Backend, count_rows, make_async_engine
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from delayq import DelayedQueue, ManualClock, OfferOutcome
from delayq.aio import AsyncDelayedQueue
from delayq.aio.browse import list_messages, queue_names
from delayq.browse import State
from delayq.transactions import TransientRetry


class Base(DeclarativeBase):
    pass


class AioOrder(Base):
    __tablename__ = "delayq_test_aio_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(sa.String(50))


@pytest.fixture
def orders(engine: sa.Engine) -> Iterator[None]:
    Base.metadata.create_all(engine)
    yield
    with engine.begin() as conn:
        conn.execute(sa.delete(AioOrder))


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
def test_offer_in_an_async_session_commits_or_rolls_back_with_the_business_data(
    backend: Backend, queue_name: str, orders: None, commit: bool
) -> None:
    async def main() -> None:
        engine = make_async_engine(backend.url)
        queue = AsyncDelayedQueue(engine, queue_name)
        async with AsyncSession(engine) as session, session.begin():
            session.add(AioOrder(id=1, item="book"))
            outcome = await queue.offer("order-1", {"order": 1}, using=session)
            assert outcome is OfferOutcome.CREATED
            assert session.in_transaction()  # delayq neither committed nor rolled back
            if not commit:
                await session.rollback()
        async with AsyncSession(engine) as session:
            assert (await session.get(AioOrder, 1) is not None) is commit
        assert (await queue.get("order-1") is not None) is commit
        await engine.dispose()

    asyncio.run(main())
    assert count_rows(backend.engine, queue_name) == (1 if commit else 0)


def test_every_operation_joins_a_callers_async_connection_and_the_views_read_it(
    backend: Backend, queue_name: str, clock: ManualClock
) -> None:
    async def main() -> None:
        engine = make_async_engine(backend.url)
        queue = AsyncDelayedQueue(engine, queue_name, clock=clock)
        async with engine.connect() as conn:
            await queue.offer("a", 1, using=conn)
            await queue.offer_many([("b", 2, None), ("c", 3, dt.timedelta(hours=1))], using=conn)
            d = await queue.try_poll(using=conn)
            assert d is not None and d.key == "a"
            assert await d.extend(dt.timedelta(minutes=10), using=conn)
            listed = await list_messages(conn, queue.sync.tables, queue_name, state=None, now=START)
            assert [m.key for m in listed] == ["b", "a", "c"]  # by due time: a's lock runs 10 minutes
            assert queue_name in await queue_names(conn, queue.sync.tables)
            states = await list_messages(conn, queue.sync.tables, queue_name, state=State.IN_FLIGHT, now=START)
            assert [m.key for m in states] == ["a"]
            assert await d.ack(using=conn)
            assert await queue.cancel("b", using=conn)
            assert conn.in_transaction()
            await conn.rollback()
        assert (await queue.stats()).scheduled == 0  # nothing of it stayed
        assert await queue.get("a") is None
        await engine.dispose()

    asyncio.run(main())


def _lock_wait_args(backend: Backend) -> dict[str, Any]:
    """connect_args for an async engine that gives up quickly on a row lock."""
    if backend.name == "postgresql":
        return {"options": "-c lock_timeout=200"}
    if backend.name == "mysql":
        return {"init_command": "SET SESSION innodb_lock_wait_timeout=1"}
    return {"timeout": 0.2}


def test_delayqs_own_async_transaction_is_retried_after_a_lock_timeout(
    backend: Backend, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    sync = DelayedQueue(backend.engine, queue_name)
    sync.offer("k", 1)
    retry = TransientRetry(attempts=60, first_delay=0.05, max_delay=0.2, budget=30.0)

    async def main() -> None:
        engine = make_async_engine(backend.url, connect_args=_lock_wait_args(backend))
        queue = AsyncDelayedQueue(engine, queue_name, transient_retry=retry)
        holder = backend.make_engine()
        conn = holder.connect()
        try:
            if backend.name == "sqlite":
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            sync.reschedule("k", using=conn)  # holds the row (SQLite: the database) until released
            cancel = asyncio.ensure_future(queue.cancel("k"))
            while not any("retrying" in r.message for r in caplog.records):
                await asyncio.sleep(0.05)  # the loop runs on while delayq waits to retry
            assert not cancel.done()
            conn.rollback()
            assert await cancel is True
        finally:
            conn.close()
            holder.dispose()
        await engine.dispose()

    with caplog.at_level(logging.WARNING, logger="delayq"):
        asyncio.run(main())
    assert sync.get("k") is None


def test_the_async_api_refuses_what_is_not_async_and_the_sync_api_points_to_it(backend: Backend) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    with pytest.raises(TypeError, match="AsyncEngine"):
        AsyncDelayedQueue(backend.engine, "q")  # type: ignore[arg-type]
    async_engine = create_async_engine("sqlite+aiosqlite://")
    with pytest.raises(TypeError, match=r"delayq\.aio"):
        DelayedQueue(async_engine, "q")  # type: ignore[arg-type]
    queue = AsyncDelayedQueue(async_engine, "q")
    with backend.engine.connect() as conn, pytest.raises(TypeError, match="AsyncConnection"):
        asyncio.run(queue.offer("k", 1, using=conn))  # type: ignore[arg-type]


def test_a_callers_async_transaction_gets_the_transient_error_unretried(backend: Backend, queue_name: str) -> None:
    from sqlalchemy.exc import DBAPIError

    from delayq.dialects import dialect_for

    sync = DelayedQueue(backend.engine, queue_name)
    sync.offer("k", 1)

    async def main() -> None:
        engine = make_async_engine(backend.url, connect_args=_lock_wait_args(backend))
        queue = AsyncDelayedQueue(engine, queue_name)
        holder = backend.make_engine()
        held = holder.connect()
        try:
            if backend.name == "sqlite":
                held.exec_driver_sql("BEGIN IMMEDIATE")
            sync.reschedule("k", using=held)
            async with engine.connect() as conn:
                with pytest.raises(DBAPIError) as caught:
                    await queue.cancel("k", using=conn)
                assert dialect_for(engine.sync_engine).is_transient(caught.value)
        finally:
            held.rollback()
            held.close()
            holder.dispose()
        await engine.dispose()

    asyncio.run(main())
    assert sync.get("k") is not None  # nothing was retried behind the caller's back


def test_engine_events_see_the_async_apis_statements(backend: Backend, queue_name: str) -> None:
    seen: list[str] = []

    async def main() -> None:
        engine = make_async_engine(backend.url)

        @sa.event.listens_for(engine.sync_engine, "before_cursor_execute")
        def record(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
            seen.append(statement)

        queue = AsyncDelayedQueue(engine, queue_name)
        await queue.offer("k", 1)
        d = await queue.try_poll()
        assert d is not None and await d.ack()
        await engine.dispose()

    asyncio.run(main())
    assert any("INSERT INTO delayq_messages" in s for s in seen)
    assert any("DELETE FROM delayq_messages" in s for s in seen)
