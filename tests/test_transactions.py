"""using=: the caller's Connection or Session owns the transaction; delayq's own transactions retry."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, count_rows
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from delayq import DelayedQueue, ManualClock, OfferOutcome


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "delayq_test_orders"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    item: Mapped[str] = mapped_column(sa.String(50))


@pytest.fixture
def orders(engine: sa.Engine) -> Iterator[None]:
    Base.metadata.create_all(engine)
    yield
    with engine.begin() as conn:
        conn.execute(sa.delete(Order.__table__))


@pytest.mark.parametrize("commit", [True, False])
def test_offer_in_an_orm_session_commits_or_rolls_back_with_the_business_data(
    queue: DelayedQueue, engine: sa.Engine, queue_name: str, orders: None, commit: bool
) -> None:
    with Session(engine) as session, session.begin():
        session.add(Order(id=1, item="book"))
        session.flush()
        assert queue.offer("order-1", {"order": 1}, using=session) is OfferOutcome.CREATED
        assert session.in_transaction()
        if not commit:
            session.rollback()
    assert count_rows(engine, queue_name) == (1 if commit else 0)
    with Session(engine) as session:
        assert (session.get(Order, 1) is not None) == commit


@pytest.mark.parametrize("commit", [True, False])
def test_every_operation_joins_a_callers_connection(
    queue: DelayedQueue, engine: sa.Engine, queue_name: str, commit: bool
) -> None:
    queue.offer("held", 1)
    with engine.connect() as conn:
        conn.begin()
        queue.offer("a", 1, using=conn)
        queue.offer_many([("b", 2, None), ("c", 3, None)], using=conn)
        d = queue.try_poll(using=conn)
        assert d is not None and d.key == "held"
        assert d.ack(using=conn) is True
        assert queue.cancel("c", using=conn) is True
        assert queue.get("a", using=conn) is not None
        assert conn.in_transaction()  # delayq neither committed nor rolled back
        conn.commit() if commit else conn.rollback()
    keys = {k for k in ("held", "a", "b", "c") if queue.get(k) is not None}
    assert keys == ({"a", "b"} if commit else {"held"})


def test_claim_in_a_callers_transaction_is_undone_by_its_rollback(queue: DelayedQueue, engine: sa.Engine) -> None:
    queue.offer("k", 1)
    with engine.connect() as conn:
        conn.begin()
        assert queue.try_poll(using=conn) is not None
        conn.rollback()
    d = queue.try_poll()
    assert d is not None and d.attempts == 1


def test_a_claim_that_fails_at_its_last_statement_leaves_every_message_as_it_was(
    backend: Backend, queue_name: str, clock: ManualClock
) -> None:
    """A claim of several statements is one transaction: when the statement that sets the locks' expiry
    fails (SQLite's second UPDATE, MariaDB's UPDATE by id, PostgreSQL's claim), what the earlier ones
    wrote (SQLite: the token and the attempt) is undone, and the next claim counts its attempt as the first."""
    engine = backend.make_engine()
    queue = DelayedQueue(engine, queue_name, clock=clock)
    queue.offer_many([("a", 1, None), ("b", 2, None)])
    armed = [True]

    @sa.event.listens_for(engine, "before_cursor_execute")
    def fail_lock_expiry(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if armed and "SET scheduled_at" in statement and "lock_token" in statement:
            armed.clear()
            raise sa.exc.OperationalError(statement, {}, RuntimeError("injected: the lock's expiry failed"))

    try:
        with pytest.raises(sa.exc.OperationalError, match="injected"):
            queue.try_poll_many(2)
        assert not armed  # the fault fired
        assert all(m is not None and not m.locked and m.attempts == 0 for m in (queue.get("a"), queue.get("b")))
        assert sorted((d.key, d.attempts) for d in queue.try_poll_many(2)) == [("a", 1), ("b", 1)]
    finally:
        engine.dispose()


def _lock_wait_engine(backend: Backend) -> sa.Engine:
    """An engine that gives up quickly on a lock another transaction holds."""
    args: dict[str, Any] = {
        "sqlite": {"timeout": 0.05},
        "postgresql": {"options": "-c lock_timeout=100"},
        "mysql": {"init_command": "SET SESSION innodb_lock_wait_timeout=1"},
    }[backend.name]
    return backend.make_engine(connect_args=args)


def _hold_lock(backend: Backend, queue: DelayedQueue, key: str) -> tuple[sa.Connection, sa.Engine]:
    """Open a transaction that holds the write lock on ``key``'s row (the whole file on SQLite)."""
    holder_engine = backend.make_engine()
    conn = holder_engine.connect()
    if backend.name == "sqlite":
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    queue.reschedule(key, using=conn)
    return conn, holder_engine


class _OnRetry(logging.Handler):
    """Releases the held lock when delayq logs its first retry."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__(logging.WARNING)
        self.released = release
        self.retries = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "retrying" in record.getMessage():
            self.retries += 1
            self.released.set()


def test_delayqs_own_transaction_is_retried_after_a_lock_timeout(
    backend: Backend,
    make_queue,
    queue_name: str,  # type: ignore[no-untyped-def]
) -> None:
    queue = make_queue()
    queue.offer("k", 1)
    fast = make_queue(engine=_lock_wait_engine(backend))
    holder, holder_engine = _hold_lock(backend, queue, "k")
    release = threading.Event()
    handler = _OnRetry(release)
    logging.getLogger("delayq").addHandler(handler)

    def release_when_retried() -> None:
        release.wait(30)
        holder.rollback()

    releaser = threading.Thread(target=release_when_retried)
    releaser.start()
    try:
        assert fast.cancel("k") is True
    finally:
        release.set()
        releaser.join()
        logging.getLogger("delayq").removeHandler(handler)
        holder.close()
        holder_engine.dispose()
    assert handler.retries >= 1
    assert queue.get("k") is None


def test_a_callers_transaction_gets_the_transient_error_unretried(
    backend: Backend,
    make_queue,  # type: ignore[no-untyped-def]
) -> None:
    queue = make_queue()
    queue.offer("k", 1)
    fast_engine = _lock_wait_engine(backend)
    fast = make_queue(engine=fast_engine)
    holder, holder_engine = _hold_lock(backend, queue, "k")
    try:
        with fast_engine.connect() as conn:
            conn.begin()
            with pytest.raises(sa.exc.OperationalError):
                fast.cancel("k", using=conn)
            conn.rollback()
    finally:
        holder.rollback()
        holder.close()
        holder_engine.dispose()
    assert queue.get("k") is not None


def test_statement_listeners_see_every_statement_of_delayqs_own_operations(
    backend: Backend,
    make_queue,  # type: ignore[no-untyped-def]
) -> None:
    # delayq's own short operations skip SQLAlchemy's execution layer unless someone watches
    # the engine's statements: then they go through it, and the listener sees them all.
    engine = backend.make_engine()
    seen: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def record(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        seen.append(statement.upper())

    try:
        queue = make_queue(engine=engine)
        queue.offer("k", 1)
        delivery = queue.try_poll()
        assert delivery is not None
        assert queue.ack_many([delivery]) == 1
        assert any("INSERT INTO" in s for s in seen)  # the offer
        assert any("SCHEDULED_AT <=" in s and "ORDER BY" in s for s in seen)  # the claim's pick of due rows
        assert any(s.startswith("DELETE") for s in seen)  # the ack
    finally:
        engine.dispose()


def test_a_thread_frozen_in_its_sqlite_writer_turn_delays_the_others_only_for_the_bound(
    backend: Backend,
    make_queue,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On SQLite, delayq's own writes from one process take turns on a lock before SQLite's busy wait. A
    thread that stops inside its turn (frozen in a flush, say) holds the others up for ``WRITER_WAIT`` at
    most: then they go on to SQLite's own lock, which that thread does not hold, and succeed."""
    if backend.name != "sqlite":
        pytest.skip("the writer turn is SQLite's")
    from delayq.dialects import dialect_for
    from delayq.dialects import sqlite as sqlite_dialect

    monkeypatch.setattr(sqlite_dialect, "WRITER_WAIT", 0.2)
    queue = make_queue()
    entered, thaw = threading.Event(), threading.Event()

    def frozen() -> None:
        with dialect_for(queue.engine).writer_turn("transaction"):
            entered.set()
            thaw.wait(30)

    holder = threading.Thread(target=frozen)
    holder.start()
    try:
        assert entered.wait(10)
        assert queue.offer("k", 1) is OfferOutcome.CREATED
        delivery = queue.try_poll()
        assert delivery is not None and delivery.ack()
        assert holder.is_alive()  # the writes went on while the frozen thread still held its turn
    finally:
        thaw.set()
        holder.join()
    assert count_rows(queue.engine, queue.name) == 0
