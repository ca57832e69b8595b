"""One execution path: delayq's statements run on SQLAlchemy's own Connection, so the engine's
configuration (pool invalidation, reset on return, hide_parameters, events, logging) holds for them."""

from __future__ import annotations

import ast
import gc
import logging
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import REPO_ROOT, Backend

from delayq import DelayedQueue, Handler, RetryPolicy, SchemaMissingError, Worker
from delayq.dialects import dialect_for
from delayq.transactions import TransientRetry

ONE_RETRY = TransientRetry(attempts=2, first_delay=0.0, max_delay=0.0)


def test_the_package_uses_no_private_attribute_of_sqlalchemy() -> None:
    """Every ``x._name`` in delayq/ (x not self or cls) is delayq's own or a documented public name."""
    allowed = {
        # delayq's own private names, used across its modules
        "_queue",
        "_retry",
        "_extend",
        "_dead_letter",
        "_next_batch",  # AsyncSubscription.poll runs Subscription.poll's steps, one batch of partitions per
        "_poll_batch",  # transaction
        "_poll_failed",
        "_leases_now",  # AsyncSubscription.poll hands out kept deliveries of the leases still held
        "_claiming",  # the runtime notes a claim cancelled in flight by its token (AsyncWorker gives it back)
        "_give_back",
        "_flow_state",  # the runtime reads a queue's cached flow state: an ack of a limited queue wakes the fetch
        "_now_in",  # cron's install and uninstall reach the runs through the queue's operations, in their
        "_existing_keys",  # transaction (delayq/queue/_queued.py), not through statements of their own
        "_offer_encoded",
        "_keys_between",
        "_delete_ids",
        "_finished_with",  # the runtime notes a handler's result and run time on its delivery, for the ack
        "_result",  # (the ack that keeps the message reads them: delayq/queue/_claims.py)
        "_duration_ms",
        "_lifecycle_options",  # the runtime builds a handler's queue with its lifecycle attributes
        "_around",  # the async worker runs the core's queue through an AsyncDelayedQueue built around it
        "_wrap",
        "_cancel",  # the worker tells a delivery its message was cancelled (or its lock lost): Delivery.cancelled
        "_cancelled",  # the delivery log reads whether it was, without making the event (observe.outcome)
        "_cancelled_among",  # the worker tells a cancel from a lost lock by the message's cancelled record
        "_tally",  # the worker's queues count their outcomes in its tally (the queue history: runtime._registry)
        "_worker_id",  # a worker's queue stamps its claims with the worker's registry id; their kept rows record it
        "_statements",  # the bulk actions (delayq/queue/_bulk.py) build on the queue's statements and clock
        "_now_param",
        "_cancel_walk",  # AsyncDelayedQueue runs the bulk actions' batches, one transaction each, as the sync
        "_reschedule_walk",  # class does (delayq/queue/_bulk.py)
        "_requeue_walk",
        "_purge_walk",
        "_bulk_batch",
        # public APIs spelled with an underscore: named tuples, Row, os
        "_make",
        "_asdict",
        "_replace",
        "_fields",
        "_mapping",
        "_exit",
    }
    found: dict[str, str] = {}
    for path in (REPO_ROOT / "delayq").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in allowed:
                found[node.attr] = f"{path.relative_to(REPO_ROOT)}:{node.lineno}"
    assert not found, f"private attributes used: {found}"
    assert not (REPO_ROOT / "delayq" / "direct.py").exists()


def _connection_ids(engine: sa.Engine, backend: str, count: int) -> list[int]:
    """Fill the pool with ``count`` connections and return their server-side ids."""
    query = "SELECT pg_backend_pid()" if backend == "postgresql" else "SELECT CONNECTION_ID()"
    conns = [engine.connect() for _ in range(count)]
    try:
        return [int(c.exec_driver_sql(query).scalar_one()) for c in conns]
    finally:
        for c in conns:
            c.close()


def _kill(admin: sa.Engine, backend: str, ids: list[int]) -> None:
    with admin.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        for server_id in ids:
            if backend == "postgresql":
                conn.exec_driver_sql(f"SELECT pg_terminate_backend({server_id})")
            else:
                conn.exec_driver_sql(f"KILL {server_id}")


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_after_every_pooled_connection_is_killed_each_operation_succeeds_within_one_retry(
    server: str, backend_urls: dict[str, str], queue_name: str
) -> None:
    """As after a server restart: one failed connection invalidates the whole pool, so the retry
    starts from a fresh connection instead of the next dead one."""
    from conftest import _backend

    b = _backend(server, backend_urls)
    engine = b.make_engine(pool_size=12, max_overflow=0)
    admin = b.make_engine(poolclass=sa.pool.NullPool)
    q = DelayedQueue(engine, queue_name, transient_retry=ONE_RETRY)
    try:
        _kill(admin, server, _connection_ids(engine, server, 12))
        q.offer("k", {"n": 1})
        _kill(admin, server, _connection_ids(engine, server, 12))
        d = q.try_poll()
        assert d is not None and d.key == "k"
        _kill(admin, server, _connection_ids(engine, server, 12))
        assert d.ack()
        assert q.get("k") is None
    finally:
        engine.dispose()
        admin.dispose()


def _in_transaction(engine: sa.Engine) -> bool:
    """Whether the pool's (only) connection is inside a transaction on the server side."""
    with engine.connect() as conn:
        raw: Any = conn.connection.dbapi_connection
        name = engine.dialect.name
        if name == "sqlite":
            return bool(raw.in_transaction)
        if name == "postgresql":
            from psycopg.pq import TransactionStatus

            return bool(raw.info.transaction_status != TransactionStatus.IDLE)
        cursor = raw.cursor()
        cursor.execute("SELECT @@in_transaction")
        return bool(cursor.fetchone()[0])


def test_a_failed_operation_leaves_no_transaction_open_without_the_pools_reset(
    backend: Backend, queue_name: str
) -> None:
    engine = backend.make_engine(pool_reset_on_return=None, pool_size=1, max_overflow=0)
    other = backend.make_engine(poolclass=sa.pool.NullPool)
    q = DelayedQueue(engine, queue_name)
    missing = DelayedQueue(engine, queue_name, table_prefix="not_migrated_")

    def offer_then_fail(conn: sa.Connection) -> None:
        q.offer("rolled-back", 1, using=conn)
        raise RuntimeError("the caller's code failed")

    try:
        with pytest.raises(RuntimeError):
            q.run(offer_then_fail)
        assert not _in_transaction(engine)
        with pytest.raises(SchemaMissingError):
            missing.offer("k", 1)
        assert not _in_transaction(engine)
        # No lock left behind: another connection writes at once, and the same pooled one too.
        assert DelayedQueue(other, queue_name).offer("from-elsewhere", 1).name == "CREATED"
        assert q.offer("next", 1).name == "CREATED"
        assert q.get("rolled-back") is None
    finally:
        engine.dispose()
        other.dispose()


class _Failing(Handler):
    queue = "set per test"
    retry = RetryPolicy(max_attempts=1)

    def handle(self, delivery: Any, conn: Any = None) -> None:
        raise ValueError("the handler failed")


def test_hide_parameters_keeps_keys_and_payloads_out_of_errors_and_worker_logs(
    backend: Backend, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    key, payload = "secret-key-4711", "secret-payload-0815"
    engine = backend.make_engine(hide_parameters=True)
    try:
        with pytest.raises(SchemaMissingError) as raised:
            DelayedQueue(engine, queue_name, table_prefix="not_migrated_").offer(key, payload)
        text = "".join(traceback.format_exception(raised.value))
        assert key not in text and payload not in text

        handler = _Failing()
        handler.queue = queue_name  # type: ignore[misc]
        DelayedQueue(engine, queue_name).offer(key, payload)
        caplog.set_level(logging.DEBUG, logger="delayq")
        assert Worker(engine, [handler], listen=False).run_once() == 1
        assert caplog.records, "the failure is logged"
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert key not in logged and payload not in logged
    finally:
        engine.dispose()


@pytest.fixture
def seen() -> Iterator[dict[str, list[str]]]:
    """Statements seen by a class-level Connection listener (removed afterwards)."""
    found: dict[str, list[str]] = {"connection": [], "dialect": [], "log": []}

    def on_execute(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        found["connection"].append(statement)

    sa.event.listen(sa.engine.Connection, "before_cursor_execute", on_execute)
    yield found
    sa.event.remove(sa.engine.Connection, "before_cursor_execute", on_execute)


def test_events_and_logging_see_every_statement_of_an_offer_a_claim_and_an_ack(
    backend: Backend, queue_name: str, seen: dict[str, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    engine = backend.make_engine()

    @sa.event.listens_for(engine, "do_execute")
    def on_dialect_execute(cursor: Any, statement: str, parameters: Any, context: Any) -> None:
        seen["dialect"].append(statement)

    q = DelayedQueue(engine, queue_name)
    try:
        caplog.set_level(logging.INFO, logger="sqlalchemy.engine.Engine")
        q.offer("k", 1)
        d = q.try_poll()
        assert d is not None
        assert d.ack()
        seen["log"] = [r.getMessage() for r in caplog.records if r.name.startswith("sqlalchemy.engine")]
        for observer, statements in seen.items():
            text = "\n".join(statements)
            assert "INSERT" in text, observer
            assert "UPDATE" in text, observer  # the claim
            assert "DELETE" in text, observer  # the ack
    finally:
        caplog.set_level(logging.WARNING, logger="sqlalchemy.engine.Engine")
        engine.dispose()


def test_the_hot_statements_are_cached(backend: Backend, queue_name: str, caplog: pytest.LogCaptureFixture) -> None:
    """SQLAlchemy compiles each of delayq's statements once per engine: echo shows them cached."""
    engine = backend.make_engine()
    q = DelayedQueue(engine, queue_name)
    try:
        q.offer("warm", 1)
        q.ack_many(q.try_poll_many(5))
        caplog.set_level(logging.INFO, logger="sqlalchemy.engine.Engine")
        q.offer("k", 1)
        q.ack_many(q.try_poll_many(5))
        notes = [r.getMessage() for r in caplog.records if "[" in r.getMessage()]
        assert notes and not [n for n in notes if "[no key" in n or "[generated" in n]
    finally:
        caplog.set_level(logging.WARNING, logger="sqlalchemy.engine.Engine")
        engine.dispose()


def test_engines_that_are_disposed_leave_no_delayq_state_behind(backend: Backend, queue_name: str) -> None:
    dialects: list[weakref.ref[Any]] = []
    for i in range(200):
        engine = backend.make_engine(poolclass=sa.pool.NullPool)
        q = DelayedQueue(engine, queue_name)
        if i % 50 == 0:  # build every statement on some of them
            q.offer(f"k{i}", i)
            q.ack_many(q.try_poll_many(1))
        q.stats()
        dialects.append(weakref.ref(dialect_for(engine)))
        engine.dispose()
        del engine, q
    gc.collect()
    alive = [ref for ref in dialects if ref() is not None]
    assert not alive, f"{len(alive)} of 200 delayq dialects still alive"


def test_async_objects_get_a_type_error_that_names_the_sync_alternative(tmp_path: Path) -> None:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, create_async_engine

    async_engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}")
    with pytest.raises(TypeError, match="sync_engine"):
        DelayedQueue(async_engine, "q")  # type: ignore[arg-type]
    q = DelayedQueue(async_engine.sync_engine, "q")
    with pytest.raises(TypeError, match=r"conn.run_sync"):
        q.offer("k", 1, using=AsyncConnection(async_engine))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"session.run_sync"):
        q.offer("k", 1, using=AsyncSession(async_engine))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sync_engine"):
        q.offer("k", 1, using=async_engine)  # type: ignore[arg-type]
