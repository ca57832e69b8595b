"""Held messages in bulk: heartbeats (extend_many) and background acks that never wait on a row lock."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from conftest import Backend

from delayq import DelayedQueue, ManualClock
from delayq.schema import metadata

MINUTE = dt.timedelta(minutes=1)


@contextmanager
def row_locked(engine: sa.Engine, msg_id: int) -> Iterator[None]:
    """Another transaction holding the row lock of one message (as an open request transaction would)."""
    m = metadata.tables["delayq_messages"]
    with engine.connect() as conn, conn.begin():
        conn.execute(sa.select(m.c.id).where(m.c.id == msg_id).with_for_update()).all()
        yield


def test_extend_many_extends_every_held_lock_and_never_shortens_one(queue: DelayedQueue, clock: ManualClock) -> None:
    queue.offer_many([(f"k{i}", i, None) for i in range(3)])
    held = queue.try_poll_many(3)
    first_expiry = held[0].locked_until
    clock.advance(dt.timedelta(seconds=30))
    extended, lost = queue.extend_many(held, dt.timedelta(minutes=5))
    assert (len(extended), lost) == (3, [])
    assert all(d.locked_until == clock.now() + dt.timedelta(minutes=5) for d in held)
    extended, lost = queue.extend_many(held, dt.timedelta(seconds=1))  # shorter: the later expiry stays
    assert all(d.locked_until == clock.now() + dt.timedelta(minutes=5) for d in extended)
    assert first_expiry < held[0].locked_until
    assert held[0].extend(dt.timedelta(seconds=1))
    assert queue.get("k0") is not None
    clock.advance(dt.timedelta(minutes=2))
    assert queue.try_poll() is None, "a short extend did not bring the expiry forward"


def test_extend_many_reports_the_locks_that_were_lost(queue: DelayedQueue, clock: ManualClock) -> None:
    queue.offer_many([("a", 1, None), ("b", 2, None)])
    a, b = queue.try_poll_many(2)
    clock.advance(2 * MINUTE)
    taken = queue.try_poll_many(2)  # both expired and taken by another consumer
    assert len(taken) == 2
    extended, lost = queue.extend_many([a, b], MINUTE)
    assert extended == [] and {d.key for d in lost} == {"a", "b"}
    assert queue.extend_many(taken, MINUTE)[0] == taken


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_a_row_lock_held_elsewhere_neither_blocks_nor_loses_the_other_messages(
    server: str, backend_urls: dict[str, str], queue_name: str
) -> None:
    from conftest import _backend

    b: Backend = _backend(server, backend_urls)
    clock = ManualClock(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    q = DelayedQueue(b.engine, queue_name, clock=clock, visibility_timeout=MINUTE)
    q.offer_many([(f"k{i}", i, None) for i in range(3)])
    held = q.try_poll_many(3)
    busy = held[1]
    with row_locked(b.engine, busy.id):
        extended, lost = q.extend_many(held, 5 * MINUTE)
        assert {d.key for d in extended} == {held[0].key, held[2].key} and lost == []
        assert q.ack_many(held, skip_locked=True) == 2
    assert q.extend_many([busy], 5 * MINUTE) == ([busy], [])  # tried again once the lock is gone
    assert q.ack_many([busy], skip_locked=True) == 1
    assert q.get(busy.key) is None


def test_ack_many_skipping_locks_acks_what_it_holds(queue: DelayedQueue, clock: ManualClock) -> None:
    queue.offer_many([(f"k{i}", i, None) for i in range(4)])
    held = queue.try_poll_many(4)
    assert queue.ack_many(held[:3], skip_locked=True) == 3
    clock.advance(2 * MINUTE)
    again = queue.try_poll()
    assert again is not None and again.key == held[3].key
    assert queue.ack_many([held[3]], skip_locked=True) == 0  # its lock was lost
    assert queue.ack_many([again], skip_locked=True) == 1


def test_an_open_claim_on_mariadb_locks_no_row_it_did_not_claim(backend_urls: dict[str, str]) -> None:
    """A claim frozen before its commit holds only the rows it claims: the next message to become due
    (of its own queue or of the queue after it in the index) can be claimed by others meanwhile."""
    from conftest import _backend

    b = _backend("mysql", backend_urls)
    clock = ManualClock(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    first = DelayedQueue(b.engine, "gap-a", clock=clock, visibility_timeout=MINUTE)
    second = DelayedQueue(b.engine, "gap-b", clock=clock, visibility_timeout=MINUTE)
    for q in (first, second):
        q.cancel_prefix("m")
    first.offer("m-due", 1)
    first.offer("m-next", 2, at=dt.timedelta(seconds=1))
    second.offer("m-other", 3)
    frozen = b.engine.connect().execution_options(isolation_level="READ COMMITTED")
    try:
        frozen.begin()
        assert [d.key for d in first.try_poll_many(10, using=frozen)] == ["m-due"]
        # the frozen claimer neither commits nor rolls back
        assert [d.key for d in second.try_poll_many(10)] == ["m-other"]
        clock.advance(dt.timedelta(seconds=2))
        assert [d.key for d in first.try_poll_many(10)] == ["m-next"]
    finally:
        frozen.rollback()
        frozen.close()


@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_a_claim_takes_the_next_due_message_when_the_first_is_locked_elsewhere(
    server: str, backend_urls: dict[str, str], queue_name: str
) -> None:
    """Not an empty poll while messages are due (MariaDB reads the due ids without locks first)."""
    from conftest import _backend

    b = _backend(server, backend_urls)
    clock = ManualClock(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    q = DelayedQueue(b.engine, queue_name, clock=clock, visibility_timeout=MINUTE)
    q.offer_many([(f"k{i}", i, None) for i in range(3)])
    first = q.get("k0")
    assert first is not None
    m = metadata.tables["delayq_messages"]
    with b.engine.connect() as conn:
        first_id = conn.execute(sa.select(m.c.id).where(m.c.queue == queue_name, m.c.key == "k0")).scalar_one()
    with row_locked(b.engine, first_id):
        got = q.try_poll()
        assert got is not None and got.key == "k1"
