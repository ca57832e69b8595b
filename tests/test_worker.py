"""The Worker in-process, driven by the manual clock: retries, dead letters, heartbeats (exactly-once effects:
test_worker_contract.py, on both drivers)."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import count_rows

from delayq import (
    DeadLetter,
    DelayedQueue,
    Delivery,
    Handler,
    ManualClock,
    Retry,
    RetryPolicy,
    Worker,
)
from delayq.dialects import dialect_for

SECOND = dt.timedelta(seconds=1)


def wait_until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """Poll a condition; fail (not hang) if it stays false. Bounds a wait, asserts nothing about timing."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.01)


def handler_for(queue_name: str, body: Callable[..., None], **attrs: Any) -> Handler:
    cls = type(
        "TestHandler", (Handler,), {"queue": queue_name, "handle": lambda self, d, conn=None: body(d, conn), **attrs}
    )
    return cls()  # type: ignore[no-any-return]


def test_failures_follow_the_policy_then_dead_letter_and_requeue(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    policy = RetryPolicy(max_attempts=4, initial_delay=10 * SECOND, multiplier=2, jitter=0)
    seen: list[tuple[int, dt.datetime]] = []
    fail = [True]

    def body(d: Delivery, _: object) -> None:
        seen.append((d.attempts, clock.now()))
        if fail[0]:
            raise ValueError(f"boom {d.attempts}")

    worker = Worker(engine, [handler_for(queue_name, body, retry=policy)], clock=clock)
    q = worker.queues[0]
    q.offer("job", {"n": 1})
    expected_delays = [10 * SECOND, 20 * SECOND, 40 * SECOND]
    for attempt, delay in enumerate(expected_delays, start=1):
        assert worker.run_once() == 1
        msg = q.get("job")
        assert msg is not None and msg.attempts == attempt and msg.last_error == f"ValueError: boom {attempt}"
        assert msg.scheduled_at == clock.now() + delay
        clock.advance(delay - dt.timedelta(milliseconds=1))
        assert worker.run_once() == 0  # not before its time
        clock.advance(dt.timedelta(milliseconds=1))
    assert worker.run_once() == 1  # the fourth and last attempt
    assert [a for a, _ in seen] == [1, 2, 3, 4]
    assert q.get("job") is None
    [dead] = q.dead_letters()
    assert (dead.key, dead.attempts, dead.last_error) == ("job", 4, "ValueError: boom 4")

    fail[0] = False
    assert q.requeue_dead("job") is True
    assert q.dead_letters() == []
    assert worker.run_once() == 1
    assert seen[-1][0] == 1 and q.get("job") is None


def test_retry_and_dead_letter_requests(engine: sa.Engine, queue_name: str, clock: ManualClock) -> None:
    def body(d: Delivery, _: object) -> None:
        if d.key == "later" and d.attempts == 1:
            raise Retry(after=5 * SECOND, reason="not yet")
        if d.key == "bad":
            raise DeadLetter("bad address")

    worker = Worker(engine, [handler_for(queue_name, body)], clock=clock)
    q = worker.queues[0]
    q.offer_many([("later", 1, None), ("bad", 2, None)])
    assert worker.run_once() == 2
    assert q.get("later").scheduled_at == clock.now() + 5 * SECOND
    assert q.get("later").last_error == "not yet"
    assert [(d.key, d.last_error, d.attempts) for d in q.dead_letters()] == [("bad", "bad address", 1)]
    clock.advance(5 * SECOND)
    assert worker.run_once() == 1
    assert q.get("later") is None
    assert q.purge_dead(key="bad") == 1


def test_purge_dead_by_prefix_escapes_like_wildcards(queue: DelayedQueue) -> None:
    for key in ("a_1", "ab1", "a%2"):
        queue.offer(key, 1)
        d = queue.try_poll()
        assert d is not None and d.dead_letter("x")
    assert queue.purge_dead(key_prefix="a_") == 1
    assert sorted(d.key for d in queue.dead_letters()) == ["a%2", "ab1"]
    assert queue.purge_dead(everything=True) == 2
    with pytest.raises(ValueError, match="purge_dead takes"):
        queue.purge_dead()


def test_a_handler_running_three_visibility_timeouts_keeps_its_lock(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    vt = 10 * SECOND
    started, release = threading.Event(), threading.Event()
    calls: Counter[str] = Counter()

    def body(d: Delivery, _: object) -> None:
        calls[d.key] += 1
        started.set()
        release.wait(60)

    worker = Worker(
        engine,
        [handler_for(queue_name, body, visibility_timeout=vt)],
        clock=clock,
        poll_interval=dt.timedelta(milliseconds=50),
    )
    q = worker.queues[0]
    other = DelayedQueue(engine, queue_name, clock=clock, visibility_timeout=vt)
    q.offer("slow", 1)
    worker.start()
    try:
        wait_until(started.is_set, "the handler to start")
        for _ in range(6):  # 6 x 0.6 vt = 3.6 visibility timeouts
            clock.advance(vt * 0.6)
            wait_until(lambda: q.get("slow").scheduled_at == clock.now() + vt, "the heartbeat to extend the lock")
            assert other.try_poll() is None
        release.set()
        wait_until(lambda: q.get("slow") is None, "the ack")
    finally:
        release.set()
        assert worker.stop()
    assert calls == {"slow": 1}


def test_a_handler_that_returns_frees_its_slot_for_the_next_due_message_at_once(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    """With every slot busy the fetch loop sleeps until a handler returns (the poll interval here is an
    hour): each return must wake it, whatever the worker was waiting for when it went to sleep, so the
    messages left start one by one as slots free up."""
    gates = {f"m{i}": threading.Event() for i in range(6)}
    started: list[str] = []

    def body(d: Delivery, _: object) -> None:
        started.append(d.key)
        gates[d.key].wait(60)

    worker = Worker(
        engine, [handler_for(queue_name, body)], clock=clock, concurrency=4, poll_interval=dt.timedelta(hours=1)
    )
    q = worker.queues[0]
    q.offer_many([(key, i, None) for i, key in enumerate(gates)])
    worker.start()
    try:
        wait_until(lambda: len(started) == 4, "four handlers to start")
        for done in range(2):
            gates[started[done]].set()
            wait_until(lambda done=done: len(started) == 5 + done, "the next message to start in the freed slot")
        for gate in gates.values():
            gate.set()
        wait_until(lambda: count_rows(engine, queue_name) == 0, "every message acked")
    finally:
        for gate in gates.values():
            gate.set()
        assert worker.stop()
    assert sorted(started) == sorted(gates)


def test_stop_ends_the_ack_loop_even_while_it_sleeps_for_a_long_poll_interval(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    """The ack loop sleeps up to the poll interval between flushes; stop wakes it, flushes and joins it
    (it used to sleep on, an hour here, and be left behind after a 2 s join)."""
    handled = threading.Event()
    worker = Worker(
        engine, [handler_for(queue_name, lambda d, _: handled.set())], clock=clock, poll_interval=dt.timedelta(hours=1)
    )
    worker.queues[0].offer("k", 1)
    before = set(threading.enumerate())
    worker.start()
    try:
        wait_until(handled.is_set, "the handler to run")
    finally:
        assert worker.stop()
    assert [t.name for t in set(threading.enumerate()) - before if t.name == "delayq-ack" and t.is_alive()] == []
    assert count_rows(engine, queue_name) == 0


def test_an_idle_worker_claims_one_first_then_the_rest_in_a_batch(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    """Where a claim of one costs one round trip and a batch a transaction's three (PostgreSQL), a worker
    whose last fetch started nothing claims one message first, its handler starting at once, then the rest
    of its free slots in a batch; a busy worker claims batches. Elsewhere every claim is a batch."""
    handled: list[str] = []
    worker = Worker(engine, [handler_for(queue_name, lambda d, _: handled.append(d.key))], clock=clock, concurrency=8)
    q = worker.queues[0]
    limits: list[int] = []
    claim = q.try_poll_many

    def spy(limit: int, **kwargs: Any) -> list[Delivery]:
        limits.append(limit)
        return claim(limit, **kwargs)

    q.try_poll_many = spy  # type: ignore[method-assign]
    dialect = dialect_for(engine)
    one_is_cheaper = dialect.claim_mode_for(1) != dialect.claim_mode_for(2)
    assert one_is_cheaper == (engine.dialect.name == "postgresql")

    assert worker.run_once() == 0  # idle: nothing due
    q.offer_many([(f"k{i}", i, None) for i in range(5)])
    assert worker.run_once() == 5  # one, the other four in a batch, then a batch that finds none
    q.offer("again", 1)
    assert worker.run_once() == 1  # idle again: one first
    assert sorted(handled) == sorted(["again", *(f"k{i}" for i in range(5))])
    if one_is_cheaper:
        assert limits == [1, 1, 7, 8, 1, 7, 8]
    else:
        assert limits == [8, 8, 8, 8, 8]


def test_a_claims_jobs_are_all_held_before_its_first_handler_starts(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    """The jobs of one claim are recorded together (one lock, one clock reading), then their handlers start:
    the first handler to run already finds the whole claim held."""
    held: list[int] = []
    lock = threading.Lock()

    def body(d: Delivery, _: object) -> None:
        with lock:
            held.append(worker._core.jobs.running())

    worker = Worker(engine, [handler_for(queue_name, body)], clock=clock, concurrency=8)
    q = worker.queues[0]
    q.offer_many([(f"k{i}", i, None) for i in range(5)])
    worker._core._idle = False  # a busy worker's claim: a batch (an idle one on PostgreSQL claims one first)
    assert worker.run_once() == 5
    assert held[0] == 5


def test_the_handler_pool_gives_each_waiting_call_a_thread_of_its_own() -> None:
    """A batch of calls that all block each start on a thread of their own (a sleeping thread is woken for
    each, one wake-up leading to the next); quick calls all run; cancelled ones never; shutdown ends the
    threads. (No database: the pool is the driver's own machinery.)"""
    from delayq.runtime._threads import DaemonPool

    pool = DaemonPool(8, "test-pool")
    gate, lock = threading.Event(), threading.Lock()
    running: set[str] = set()

    def blocking() -> None:
        with lock:
            running.add(threading.current_thread().name)
        gate.wait(60)

    tasks = [pool.submit(blocking) for _ in range(8)]
    wait_until(lambda: len(running) == 8, "eight blocking calls running at once, each on its own thread")
    late = pool.submit(lambda: running.add("late"))
    assert late.cancel()  # no thread free: it had not started
    gate.set()
    assert all(t.wait(30) for t in tasks)
    done: list[int] = []
    quick = [pool.submit(lambda i=i: done.append(i)) for i in range(100)]
    assert all(t.wait(30) for t in quick)
    assert sorted(done) == list(range(100)) and "late" not in running
    pool.shutdown()
    for t in pool._threads:
        t.join(30)
        assert not t.is_alive()
