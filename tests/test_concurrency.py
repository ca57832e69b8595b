"""Concurrency invariants with real threads, each on its own pooled connection, on every backend."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
import sqlalchemy as sa
from conftest import Backend, count_rows

from delayq import DelayedQueue, ManualClock, OfferOutcome

T = TypeVar("T")
MESSAGES = 5000


def run_together(n: int, work: Callable[[int], T]) -> list[T]:
    """Run ``work(i)`` on ``n`` threads released at once by a barrier."""
    barrier = threading.Barrier(n)

    def start(i: int) -> T:
        barrier.wait()
        return work(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(start, range(n)))


@pytest.mark.parametrize("update", [False, True])
def test_sixteen_producers_of_one_key_create_exactly_one(queue: DelayedQueue, update: bool) -> None:
    for round_ in range(5):
        key = f"race-{round_}"
        outcomes = run_together(16, lambda i, key=key: queue.offer(key, {"by": i}, update=update))
        counts = Counter(outcomes)
        assert counts[OfferOutcome.CREATED] == 1
        assert counts[OfferOutcome.CREATED] + counts[OfferOutcome.UPDATED] + counts[OfferOutcome.IGNORED] == 16
        if not update:
            assert counts[OfferOutcome.IGNORED] == 15
        assert queue.get(key) is not None


def drain(queue: DelayedQueue, consumers: int, batch: int) -> tuple[Counter[str], int]:
    """Consume until empty with ``consumers`` threads; returns deliveries per key and the largest claim."""
    delivered: Counter[str] = Counter()
    largest = 0
    lock = threading.Lock()

    def consume(_: int) -> None:
        nonlocal largest
        while True:
            got = queue.try_poll_many(batch)
            if not got:
                return
            assert queue.ack_many(got) == len(got)
            with lock:
                largest = max(largest, len(got))
                delivered.update(d.key for d in got)

    run_together(consumers, consume)
    return delivered, largest


@pytest.mark.parametrize("batch", [1, 10, 100])
def test_four_consumers_deliver_every_message_exactly_once(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine, queue_name: str, batch: int
) -> None:
    queue = make_queue(visibility_timeout=dt.timedelta(hours=1))
    keys = [f"m{i}" for i in range(MESSAGES)]
    queue.offer_many([(k, {"k": k}, None) for k in keys])
    delivered, largest = drain(queue, consumers=4, batch=batch)
    assert set(delivered) == set(keys)
    assert max(delivered.values()) == 1
    assert largest <= batch
    assert count_rows(engine, queue_name) == 0


def test_the_postgres_claim_respects_its_limit_under_nested_loop_plans(
    postgres: Backend, queue_name: str, clock: ManualClock
) -> None:
    nested = postgres.make_engine(
        connect_args={"options": "-c enable_hashjoin=off -c enable_mergejoin=off -c enable_material=off"}
    )
    try:
        queue = DelayedQueue(nested, queue_name, clock=clock, visibility_timeout=dt.timedelta(hours=1))
        keys = [f"m{i}" for i in range(1000)]
        queue.offer_many([(k, 1, None) for k in keys])
        for limit in (1, 7):
            assert len(queue.try_poll_many(limit)) == limit
        delivered, largest = drain(queue, consumers=4, batch=10)
        assert largest <= 10
        assert sum(delivered.values()) == 1000 - 8
        assert max(delivered.values()) == 1
    finally:
        nested.dispose()


def test_batch_offers_racing_single_offers_lose_nothing(
    queue: DelayedQueue, engine: sa.Engine, queue_name: str
) -> None:
    keys = [f"k{i}" for i in range(2000)]

    def produce(i: int) -> list[OfferOutcome]:
        mine = keys if i % 2 == 0 else keys[::-1]
        if i < 2:
            outcomes: list[OfferOutcome] = []
            for start in range(0, len(mine), 100):
                outcomes += queue.offer_many([(k, k, None) for k in mine[start : start + 100]])
            return outcomes
        return [queue.offer(k, k) for k in mine]

    results = run_together(4, produce)
    counts = Counter(o for outcomes in results for o in outcomes)
    assert counts[OfferOutcome.CREATED] == len(keys)
    assert counts[OfferOutcome.IGNORED] == 3 * len(keys)
    assert count_rows(engine, queue_name) == len(keys)


def test_an_autocommit_engine_still_claims_atomically(
    backend: Backend, make_queue: Callable[..., DelayedQueue], queue_name: str
) -> None:
    # Connections that commit every statement by themselves (isolation_level="AUTOCOMMIT"):
    # delayq's own multi-statement transactions begin explicitly, so a claim's lock holds
    # until its UPDATE, and one-statement operations skip the COMMIT.
    engine = backend.make_engine(isolation_level="AUTOCOMMIT")
    try:
        queue = make_queue(engine=engine, visibility_timeout=dt.timedelta(hours=1))
        keys = [f"a{i}" for i in range(MESSAGES)]
        queue.offer_many([(k, {"k": k}, None) for k in keys])
        delivered, _ = drain(queue, consumers=4, batch=10)
        assert set(delivered) == set(keys)
        assert max(delivered.values()) == 1
        assert count_rows(engine, queue_name) == 0
    finally:
        engine.dispose()


def test_a_batch_claim_frozen_before_its_commit_frees_its_rows_after_the_idle_bound(
    backend: Backend, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer that freezes (or whose network goes silent) between its claim and the COMMIT leaves the
    claimed rows locked by an open transaction, which the server keeps for as long as the connection seems
    up. On PostgreSQL the claim's transaction carries an idle bound: the server ends it, and the messages
    go to the other consumers, each once, instead of waiting for the frozen one."""
    if backend.name != "postgresql":
        pytest.skip("PostgreSQL's idle_in_transaction_session_timeout")
    from delayq.dialects import bounds

    monkeypatch.setattr(bounds, "IDLE_TIMEOUT_S", 0.5)
    frozen_engine = backend.make_engine()
    frozen, other = DelayedQueue(frozen_engine, queue_name), DelayedQueue(backend.engine, queue_name)
    other.offer_many([(f"k{i}", i, None) for i in range(5)])
    claimed, thaw = threading.Event(), threading.Event()

    def freeze(conn: object, cursor: object, statement: str, *_: object) -> None:
        if "picked" in statement and "RETURNING" in statement and threading.current_thread().name == "frozen":
            claimed.set()
            thaw.wait(30)  # the claim went through; the COMMIT waits

    sa.event.listen(frozen_engine, "after_cursor_execute", freeze)
    outcome: list[object] = []

    def consume() -> None:
        try:
            outcome.append(len(frozen.try_poll_many(5)))
        except Exception as exc:  # (the retry after the server ended the transaction claims what is left)
            outcome.append(exc)

    consumer = threading.Thread(target=consume, name="frozen")
    consumer.start()
    got: list[str] = []
    try:
        assert claimed.wait(10)
        deadline = time.monotonic() + 30
        while len(got) < 5 and time.monotonic() < deadline:
            got += [d.key for d in other.try_poll_many(5)]
            time.sleep(0.05)
    finally:
        thaw.set()
        consumer.join(30)
        sa.event.remove(frozen_engine, "after_cursor_execute", freeze)
        frozen_engine.dispose()
    assert sorted(got) == [f"k{i}" for i in range(5)]
    assert outcome == [0]  # its transaction was ended by the server: nothing claimed twice
