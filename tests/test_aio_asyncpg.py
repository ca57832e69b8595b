"""What only asyncpg needs (``postgresql+asyncpg://``, the ``asyncio-asyncpg`` extra): its own transactions
(no BEGIN of delayq's, the settings in one query), statements prepared before a migration, migrations run
through ``run_sync``, the idle and call bounds behind a silent network, and its LISTEN. The async API's
contract suite runs on it as the ``postgresql-asyncpg`` backend (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, _backend, make_async_engine
from faults import FaultProxy

from delayq import DelayedQueue, migrations
from delayq.aio import AsyncDelayedQueue
from delayq.dialects import bounds, dialect_for
from delayq.dialects._pg_listen import ListenStalledError
from delayq.dialects.postgresql_asyncpg import AsyncpgDialect, transaction_settings
from delayq.transactions import TransientRetry

pytest.importorskip("asyncpg")


@pytest.fixture
def apg(backend_urls: dict[str, str]) -> Backend:
    """PostgreSQL through asyncpg (skipped unless ``postgresql-asyncpg`` is among DELAYQ_TEST_BACKENDS)."""
    return _backend("postgresql-asyncpg", backend_urls)


def test_the_settings_of_a_transaction_are_one_query_that_ends_with_it() -> None:
    assert transaction_settings(None) is None
    assert transaction_settings(2.5, sort=False) == (
        "SELECT set_config('enable_sort', 'off', true), "
        "set_config('idle_in_transaction_session_timeout', '2500ms', true)"
    )


@pytest.mark.parametrize("isolation", [None, "AUTOCOMMIT"])
def test_a_batch_claim_is_one_transaction_with_its_settings_on_any_engine(
    apg: Backend, queue_name: str, isolation: str | None
) -> None:
    """The adapter begins the transaction (delayq sends no BEGIN, which asyncpg cannot prepare); an engine in
    autocommit would begin none, so delayq's own transaction runs at READ COMMITTED there."""
    DelayedQueue(apg.engine, queue_name).offer_many([(f"k{i}", i, None) for i in range(3)])
    seen: list[tuple[str, bool]] = []

    async def main() -> list[str]:
        engine = make_async_engine(apg.url, **({"isolation_level": isolation} if isolation else {}))
        assert isinstance(dialect_for(engine.sync_engine), AsyncpgDialect)

        @sa.event.listens_for(engine.sync_engine, "before_cursor_execute")
        def before(conn: sa.Connection, cursor: Any, statement: str, *_: Any) -> None:
            seen.append((statement, conn.connection.driver_connection.is_in_transaction()))

        try:
            got = await AsyncDelayedQueue(engine, queue_name).try_poll_many(3)
            return sorted(d.key for d in got)
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == ["k0", "k1", "k2"]
    claim = next(i for i, (s, _) in enumerate(seen) if "SKIP LOCKED" in s)
    settings = next(i for i, (s, _) in enumerate(seen) if "idle_in_transaction_session_timeout" in s)
    assert settings < claim and "enable_sort" in seen[settings][0]
    assert not seen[settings][1]  # the first of the transaction: the adapter's BEGIN goes out just before it
    assert all(in_transaction for _, in_transaction in seen[settings + 1 : claim + 1]), "the claim ran on its own"
    assert not any(s.lstrip().upper().startswith("BEGIN") for s, _ in seen)


def test_a_statement_prepared_before_a_migration_is_prepared_again(apg: Backend) -> None:
    """asyncpg keeps prepared statements per connection; a migration that changes what one returns makes
    its next run fail once (the adapter empties its cache then): delayq's own transaction is retried.
    The migrations themselves run on the async engine through ``run_sync``."""
    prefix = f"apg{uuid.uuid4().hex[:8]}_"

    async def main() -> list[str]:
        engine = make_async_engine(apg.url, pool_size=1, max_overflow=0)  # one connection: its cache is hit
        async with engine.begin() as conn:
            await conn.run_sync(lambda c: migrations.upgrade(connection=c, prefix=prefix))
        try:
            q = AsyncDelayedQueue(engine, "q", table_prefix=prefix)
            await q.offer_many([("a", 1, None), ("b", 2, None)])
            first = await q.try_poll()  # prepared now
            async with engine.begin() as conn:  # what a later migration might do to a returned column
                await conn.execute(sa.text(f"ALTER TABLE {prefix}messages ALTER COLUMN payload_type TYPE text"))
            second = await q.try_poll()
            assert first is not None and second is not None
            return [first.key, second.key]
        finally:
            async with engine.begin() as conn:
                await conn.run_sync(lambda c: migrations.downgrade(connection=c, prefix=prefix))
            await engine.dispose()

    assert asyncio.run(main()) == ["a", "b"]


@pytest.fixture
def short_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounds, "IDLE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(bounds, "CALL_TIMEOUT_S", 4.0)  # the server ends the transaction first


@pytest.fixture
def proxy(apg: Backend) -> Iterator[FaultProxy]:
    with FaultProxy.for_url(apg.url) as found:
        yield found


@pytest.mark.slow  # a fault test: it waits out the stall bound
def test_a_batch_claim_behind_a_silent_network_frees_its_rows_and_its_call(
    apg: Backend, proxy: FaultProxy, queue_name: str, short_bounds: None
) -> None:
    """The idle bound (``set_config`` in the adapter's transaction) frees the rows a frozen claim locked,
    and the call bound (the asyncio transport's socket shut down) fails its wait for the COMMIT; the retry
    finds nothing left: every message went to the other consumer, once."""
    keys = [f"k{i}" for i in range(5)]
    other = DelayedQueue(apg.engine, queue_name)
    other.offer_many([(k, k, None) for k in keys])
    stalled = threading.Event()
    got: list[str] = []

    async def main() -> list[str]:
        engine = make_async_engine(proxy.url_for(apg.url), pool_size=2, max_overflow=0)

        @sa.event.listens_for(engine.sync_engine, "after_cursor_execute")
        def after(conn: sa.Connection, cursor: Any, statement: str, *_: Any) -> None:
            if not stalled.is_set() and "SKIP LOCKED" in statement:
                proxy.stall_existing()
                stalled.set()

        frozen = AsyncDelayedQueue(engine, queue_name, transient_retry=TransientRetry(budget=60.0))
        try:
            consumer = asyncio.create_task(frozen.try_poll_many(5))
            while not stalled.is_set():
                await asyncio.sleep(0.01)
            for _ in range(400):  # the other consumer, on a direct connection (a bounded poll)
                for d in await asyncio.to_thread(other.try_poll_many, 5):
                    got.append(d.key)
                    assert await asyncio.to_thread(d.ack)
                if len(got) == len(keys):
                    break
                await asyncio.sleep(0.05)
            return [d.key for d in await asyncio.wait_for(consumer, 60)]
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == []  # its transaction was ended by the server: nothing claimed twice
    assert sorted(got) == keys, "the claimed messages did not continue elsewhere"


def test_the_listener_ends_at_once_when_its_connection_closes(apg: Backend) -> None:
    channel = f"listen_{uuid.uuid4().hex[:12]}"

    async def main() -> None:
        engine = make_async_engine(apg.url)
        heard = dialect_for(engine.sync_engine).listen_async(engine, channel)
        try:
            first = asyncio.ensure_future(anext(heard))
            with apg.engine.connect() as conn:
                for _ in range(200):  # until its LISTEN began (a bounded poll)
                    await asyncio.sleep(0.02)
                    found = conn.execute(
                        sa.text("SELECT pid FROM pg_stat_activity WHERE query = :q"), {"q": f'LISTEN "{channel}"'}
                    ).scalar()
                    if found is not None:
                        break
                conn.execute(sa.text("SELECT pg_notify(:c, 'q1')"), {"c": channel})
                conn.commit()
                assert await asyncio.wait_for(first, 30) == "q1"
                conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": found})
                conn.commit()
            with pytest.raises(ListenStalledError, match="closed"):
                await asyncio.wait_for(anext(heard), 30)  # not after the quiet spell and its test notification
        finally:
            await heard.aclose()
            await engine.dispose()

    asyncio.run(main())


def test_migrations_run_from_an_asyncpg_url(apg: Backend) -> None:
    """``delayq.migrations`` (and ``alembic -x url=...``) given an asyncio driver's URL run the migrations
    on an async engine through ``run_sync``, outside any event loop."""
    prefix = f"apg{uuid.uuid4().hex[:8]}_"
    names = migrations.table_names(prefix)

    def present() -> set[str]:
        return set(sa.inspect(apg.engine).get_table_names()) & names

    migrations.upgrade(apg.url, prefix=prefix)
    try:
        assert present() == names
    finally:
        migrations.downgrade(apg.url, prefix=prefix)
    assert present() <= {migrations.version_table(prefix)}
