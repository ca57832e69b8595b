"""Flow control, enforced by the database: priorities, pause and resume (docs/workers.md, "Flow control").

Every test runs on the three backends. Time that matters is the manual clock's; waits are bounded,
never asserted on.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, facade_queue
from test_worker import handler_for, wait_until

from delayq import DelayedQueue, FlowState, InvalidInputError, ManualClock, Worker

SECOND = dt.timedelta(seconds=1)


@pytest.fixture(params=["sync", "async"])
def flow_queue(
    request: pytest.FixtureRequest, engine: sa.Engine, queue_name: str, clock: ManualClock
) -> Callable[..., DelayedQueue]:
    """Queues on the test's queue name, by either API (the async one behind the sync surface)."""

    def make(**kwargs: Any) -> DelayedQueue:
        kwargs.setdefault("clock", clock)
        kwargs.setdefault("visibility_timeout", dt.timedelta(minutes=1))
        if request.param == "async":
            return facade_queue(request.getfixturevalue("aio_runner"), engine, queue_name, **kwargs)
        return DelayedQueue(engine, queue_name, **kwargs)

    return make


# -- priorities ------------------------------------------------------------------------------------------------


def test_claims_take_the_highest_priority_first_then_due_time_then_id(
    flow_queue: Callable[..., DelayedQueue], clock: ManualClock
) -> None:
    q = flow_queue()
    q.offer_many([(f"low{i}", i, dt.timedelta(seconds=-100 + i)) for i in range(5)])
    q.offer("mid-late", 0, -SECOND, priority=3)
    q.offer("mid-early", 0, -2 * SECOND, priority=3)
    q.offer_many([(f"high{i}", i, -SECOND) for i in range(3)], priority=7)
    q.offer("negative", 0, dt.timedelta(seconds=-500), priority=-5)
    q.offer("future-high", 0, SECOND, priority=9)  # not due: never claimed before its time
    keys = [d.key for d in q.try_poll_many(4)] + [d.key for d in q.try_poll_many(100)]
    assert keys == [
        "high0",
        "high1",
        "high2",
        "mid-early",
        "mid-late",
        "low0",
        "low1",
        "low2",
        "low3",
        "low4",
        "negative",
    ]
    clock.advance(2 * SECOND)
    assert [d.key for d in q.try_poll_many(10)] == ["future-high"]


def test_a_replacement_sets_the_priority_and_an_ignored_offer_keeps_it(flow_queue: Callable[..., DelayedQueue]) -> None:
    q = flow_queue()
    q.offer("a", 1, -SECOND)
    q.offer("b", 1, -SECOND)
    assert q.offer("b", 2, -SECOND, priority=5).value == "ignored"  # the key exists: nothing changes
    q.offer("a", 2, -SECOND, update=True, priority=5)
    q.offer_many([("b", 3, -SECOND)], update=True, priority=-1)
    assert [d.key for d in q.try_poll_many(10)] == ["a", "b"]


def test_priorities_out_of_range_are_refused_before_anything_is_written(
    flow_queue: Callable[..., DelayedQueue],
) -> None:
    q = flow_queue()
    for bad in (1001, -1001, True, 1.5, "3"):
        with pytest.raises(InvalidInputError, match="priority"):
            q.offer("k", 1, priority=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match="priority"):
            q.offer_many([("k", 1, None)], priority=bad)  # type: ignore[arg-type]
    assert q.get("k") is None
    assert q.flow() == FlowState()


def test_other_claimers_see_priorities_within_their_flow_refresh(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    """A claimer keeps the flow row for ``flow_refresh``: a queue's first priority offer counts in another
    process's claims once it reads the row again (here at once: ``flow_refresh=0``)."""
    producer = DelayedQueue(engine, queue_name, clock=clock)
    consumer = DelayedQueue(engine, queue_name, clock=clock, flow_refresh=dt.timedelta(0))
    assert consumer.try_poll_many(1) == []
    producer.offer("low", 0, -2 * SECOND)
    producer.offer("high", 0, -SECOND, priority=1)
    assert [d.key for d in consumer.try_poll_many(1)] == ["high"]


def test_concurrent_claimers_never_take_a_low_one_before_a_high_one_that_was_due(
    backend: Backend, engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    """1,000 low and 100 high messages, all due, claimed in batches of 10 by 4 threads: each thread's claims come
    one after another, so a thread that took a low message must never take a high one later (every high one
    was due all along). What is promised: a claim takes a lower priority only once every due message of the
    higher ones is claimed, or locked by a claim running at the same time (SKIP LOCKED passes those by)."""
    q = DelayedQueue(engine, queue_name, clock=clock, flow_refresh=dt.timedelta(0))
    q.offer_many([(f"low{i:04}", i, -SECOND) for i in range(1000)])
    q.offer_many([(f"high{i:03}", i, -2 * SECOND) for i in range(100)], priority=10)
    threads = 2 if backend.name == "sqlite" else 4
    seen: list[list[str]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def claim(i: int) -> None:
        mine = DelayedQueue(engine, queue_name, clock=clock, flow_refresh=dt.timedelta(0))
        try:
            while batch := mine.try_poll_many(10):
                seen[i] += [d.key for d in batch]
                mine.ack_many(batch)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=claim, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(120)
    assert not errors, errors
    assert sorted(k for keys in seen for k in keys) == sorted(
        [f"low{i:04}" for i in range(1000)] + [f"high{i:03}" for i in range(100)]
    )
    for keys in seen:
        levels = [k.startswith("high") for k in keys]
        assert levels == sorted(levels, reverse=True), keys[:30]


def test_a_worker_runs_the_high_priority_ones_first(engine: sa.Engine, queue_name: str, clock: ManualClock) -> None:
    """A worker with one slot starts its messages in the order claims hand them out: highest priority first."""
    q = DelayedQueue(engine, queue_name, clock=clock)
    q.offer_many([(f"low{i}", i, -2 * SECOND) for i in range(5)])
    q.offer_many([(f"high{i}", i, -SECOND) for i in range(5)], priority=1)
    started: list[str] = []
    worker = Worker(engine, [handler_for(queue_name, lambda d, _: started.append(d.key))], concurrency=1, clock=clock)
    worker.start()
    try:
        wait_until(lambda: len(started) == 10, "all ten handled")
    finally:
        worker.stop()
    assert started == [f"high{i}" for i in range(5)] + [f"low{i}" for i in range(5)]


# -- pause and resume ------------------------------------------------------------------------------------------


def test_a_paused_queue_takes_offers_and_gives_nothing_until_resumed(
    flow_queue: Callable[..., DelayedQueue], clock: ManualClock
) -> None:
    q = flow_queue()
    q.offer("a", 1, -SECOND)
    q.pause()
    assert q.flow().paused
    assert q.offer("b", 2, -SECOND).value == "created"
    assert q.try_poll_many(10) == []
    assert q.next_due() is None  # a worker sleeps its poll interval, not a spin
    assert q.stats().ready == 2
    q.pause()  # again: nothing changes
    q.resume()
    assert q.flow() == FlowState(paused=False)
    assert sorted(d.key for d in q.try_poll_many(10)) == ["a", "b"]


def test_a_pause_reaches_other_claimers_within_their_flow_refresh(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    """Another claimer keeps the flow state for its ``flow_refresh`` (a bounded staleness); while it sees the
    queue paused it reads the state at every claim, so a resume counts at its next claim."""
    operator = DelayedQueue(engine, queue_name, clock=clock)
    fresh = DelayedQueue(engine, queue_name, clock=clock, flow_refresh=dt.timedelta(0))
    cached = DelayedQueue(engine, queue_name, clock=clock, flow_refresh=dt.timedelta(hours=1))
    operator.offer_many([(f"k{i}", i, -SECOND) for i in range(4)])
    assert len(fresh.try_poll_many(1)) == 1
    assert len(cached.try_poll_many(1)) == 1  # reads the state: not paused, kept for an hour
    operator.pause()
    assert fresh.try_poll_many(1) == []
    assert len(cached.try_poll_many(1)) == 1  # within its hour: a bounded staleness, as documented
    cached.flow()  # reading it (as each refresh does) ends the staleness
    assert cached.try_poll_many(1) == []
    operator.resume()
    assert len(cached.try_poll_many(1)) == 1  # paused, it read the state again: resumed at once


def test_a_worker_starts_nothing_of_a_paused_queue_and_resumes(
    backend: Backend, engine: sa.Engine, queue_name: str
) -> None:
    """A running worker: after a pause it starts none of the messages offered (checked after it claimed, and
    read the paused state, twice more); after the resume it runs them all."""
    q = DelayedQueue(engine, queue_name)
    started: list[str] = []
    flow_reads = [0]

    def count(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "queue_flow" in statement and statement.lstrip().upper().startswith("SELECT"):
            flow_reads[0] += 1

    sa.event.listen(engine, "before_cursor_execute", count)
    worker = Worker(
        engine,
        [handler_for(queue_name, lambda d, _: started.append(d.key))],
        concurrency=2,
        poll_interval=dt.timedelta(milliseconds=50),
    )
    worker.start()
    try:
        q.offer("before", 0)
        wait_until(lambda: started == ["before"], "the first message handled")
        q.pause()
        reads = flow_reads[0]
        wait_until(lambda: flow_reads[0] >= reads + 1, "the worker read the paused state")
        q.offer_many([(f"k{i}", i, None) for i in range(5)])
        reads = flow_reads[0]
        wait_until(lambda: flow_reads[0] >= reads + 2, "two more claims while paused")
        assert started == ["before"]
        assert q.stats().ready == 5
        q.resume()
        wait_until(lambda: len(started) == 6, "all handled after the resume")
    finally:
        worker.stop()
        sa.event.remove(engine, "before_cursor_execute", count)


def test_pause_and_resume_from_the_command_line_show_in_stats(backend: Backend, queue_name: str) -> None:
    import json

    from click.testing import CliRunner

    from delayq.cli import main

    runner = CliRunner()
    base = ["--url", backend.url]
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("a", 1)
    assert runner.invoke(main, [*base, "enqueue", queue_name, "b", "2", "--priority", "5"]).exit_code == 0
    out = runner.invoke(main, [*base, "pause", queue_name])
    assert out.exit_code == 0, out.output
    assert out.output.strip() == f"{queue_name}: paused"
    shown = json.loads(runner.invoke(main, [*base, "stats", queue_name, "--json"]).output)
    assert shown[0]["paused"] is True and shown[0]["priorities"] is True and shown[0]["ready"] == 2
    assert "PAUSED" in runner.invoke(main, [*base, "stats", queue_name]).output
    assert runner.invoke(main, [*base, "resume", queue_name]).exit_code == 0
    assert json.loads(runner.invoke(main, [*base, "stats", queue_name, "--json"]).output)[0]["paused"] is False
    assert [d.key for d in q.try_poll_many(2)] == ["b", "a"]
    bad = runner.invoke(main, [*base, "enqueue", queue_name, "c", "3", "--priority", "5000"])
    assert bad.exit_code != 0 and "priority" in bad.output
    assert q.get("c") is None


def test_the_pause_shows_in_top_and_in_the_metrics(engine: sa.Engine, queue_name: str) -> None:
    from prometheus_client import CollectorRegistry

    from delayq.metrics import register, unregister
    from delayq.top import Top, render

    q = DelayedQueue(engine, queue_name)
    registry = CollectorRegistry()
    metrics = register(registry, [q])
    try:
        assert registry.get_sample_value("delayq_paused", {"queue": queue_name}) == 0
        q.pause()
        assert registry.get_sample_value("delayq_paused", {"queue": queue_name}) == 1
    finally:
        unregister(metrics, registry)
    [row] = Top(engine, only=[queue_name]).snapshot().queues
    assert row.paused
    render(Top(engine, only=[queue_name]).snapshot())  # the view draws it
