"""Flow control, enforced by the database: priorities, pause and resume, concurrency and rate limits
(docs/workers.md, "Flow control").

Every test runs on the three backends. Time that matters is the manual clock's; waits are bounded,
never asserted on.
"""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _history import History, Record, overlap, spawn_worker, started
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


def test_a_replacement_alone_marks_the_queue_for_priorities_and_groups(
    engine: sa.Engine, queue_name: str, clock: ManualClock
) -> None:
    q = DelayedQueue(engine, queue_name, clock=clock)
    q.offer_many([("a", 1, -2 * SECOND), ("b", 1, -SECOND)])
    assert (
        DelayedQueue(engine, queue_name, clock=clock).offer("b", 2, -SECOND, update=True, priority=3).value == "updated"
    )
    DelayedQueue(engine, queue_name, clock=clock).offer_many([("a", 2, -2 * SECOND)], update=True, group="g")
    assert q.flow() == FlowState(priorities=True, grouped=True)
    assert [d.key for d in q.try_poll_many(10)] == ["b", "a"]


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

    def claim(i: int) -> None:
        mine = DelayedQueue(engine, queue_name, clock=clock, flow_refresh=dt.timedelta(0))
        while batch := mine.try_poll_many(10):
            seen[i] += [d.key for d in batch]
            mine.ack_many(batch)

    History().in_threads(threads, claim, 120)
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


# -- concurrency and rate limits -------------------------------------------------------------------------------


def test_a_concurrency_limit_holds_across_claimers_and_an_expired_lock_stops_counting(
    flow_queue: Callable[..., DelayedQueue], clock: ManualClock
) -> None:
    q = flow_queue()
    other = flow_queue()
    q.offer_many([(f"k{i}", i, None) for i in range(10)])
    q.set_concurrency_limit(3)
    assert q.flow().concurrency == 3
    held = q.try_poll_many(2)
    assert len(held) == 2
    assert len(other.try_poll_many(10)) == 1  # one slot left
    assert q.try_poll_many(10) == [] and other.try_poll_many(1) == []
    assert q.next_due() == dt.timedelta(minutes=1)  # when the first held lock expires
    held[0].ack()
    assert len(other.try_poll_many(10)) == 1
    clock.advance(dt.timedelta(minutes=2))  # every lock expired: none counts, and they are due again
    assert len(q.try_poll_many(10)) == 3
    q.set_concurrency_limit(None)
    assert len(other.try_poll_many(10)) == 6  # the rest (9 left, 3 held): nothing held back
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidInputError, match="concurrency limit"):
            q.set_concurrency_limit(bad)  # type: ignore[arg-type]


def test_a_requeued_dead_letter_comes_back_with_its_priority_and_group_and_the_flow_holds_it(
    flow_queue: Callable[..., DelayedQueue], clock: ManualClock
) -> None:
    """``requeue_dead`` offers the letter afresh, due now, with the priority and group it had (kept with the dead
    letter since delayq_0013): a paused queue holds it like any message, it runs before lower priorities, it
    holds its group, and it counts against a concurrency limit."""
    q = flow_queue()
    q.offer("job", 1, -SECOND, priority=5, group="g")
    (d,) = q.try_poll_many(1)
    assert d.key == "job" and d.dead_letter("boom")
    q.offer("high", 2, -SECOND, priority=1)
    q.offer("g-next", 3, -SECOND, group="g")  # group g's next message (group concurrency 1)
    q.offer("low", 4, -SECOND, priority=-1)
    q.pause()
    assert q.requeue_dead("job")
    assert q.try_poll_many(10) == []  # paused: it waits with the rest
    q.resume()
    q.set_concurrency_limit(2)
    first = q.try_poll_many(10)
    assert [(d.key, d.priority, d.group) for d in first] == [("job", 5, "g"), ("high", 1, None)]  # the limit: two
    assert first[1].ack()
    (low,) = q.try_poll_many(10)  # "job" holds group g: "g-next" waits, "low" (no group) runs
    assert low.key == "low"
    assert q.try_poll_many(10) == []  # the limit: two held ("job" and "low")
    assert first[0].ack()
    assert [d.key for d in q.try_poll_many(10)] == ["g-next"]


def test_threads_claiming_under_a_limit_of_two_never_run_more_than_two(
    backend: Backend, engine: sa.Engine, queue_name: str
) -> None:
    """Six threads, each its own claimer asking for up to 4: handlers (start and end recorded after the claim and
    before the ack) never overlap more than the limit, and every message runs once."""
    DelayedQueue(engine, queue_name).offer_many([(f"k{i:02}", i, None) for i in range(40)])
    DelayedQueue(engine, queue_name).set_concurrency_limit(2)
    history = History()
    history.in_threads(6, lambda _: history.claim_and_hold(engine, queue_name, batch=4, hold=0.01))
    assert started(history.records) == [f"k{i:02}" for i in range(40)]
    assert overlap(history.records) <= 2


def test_a_rate_limit_gives_n_claims_per_period_on_the_injected_clock(
    flow_queue: Callable[..., DelayedQueue], clock: ManualClock
) -> None:
    """50 per second over 5 s of the manual clock, in steps of 50 ms, two claimers draining at each step:
    250 claims in all, never more than 50 in any second (the bucket starts empty when the limit is set)."""
    q, other = flow_queue(), flow_queue()
    q.offer_many([(f"k{i:03}", i, dt.timedelta(seconds=-1)) for i in range(400)])
    q.set_rate_limit(50, SECOND)
    assert q.flow().rate == 50 and q.flow().rate_period == SECOND
    per_step: list[int] = []
    for _ in range(100):
        clock.advance(dt.timedelta(milliseconds=50))
        n = 0
        while got := len(q.try_poll_many(7)) + len(other.try_poll_many(7)):
            n += got
        per_step.append(n)
    assert sum(per_step) == 250
    assert max(sum(per_step[i : i + 20]) for i in range(len(per_step) - 19)) <= 50
    assert q.try_poll_many(10) == []
    assert q.next_due() is not None and q.next_due() <= dt.timedelta(milliseconds=20)  # the next token
    q.set_rate_limit(None)
    assert len(q.try_poll_many(200)) == 150
    with pytest.raises(InvalidInputError, match="per"):
        q.set_rate_limit(5, dt.timedelta(0))


def test_limits_and_running_counts_show_in_stats_json(backend: Backend, queue_name: str) -> None:
    import json

    from click.testing import CliRunner

    from delayq.cli import main

    runner = CliRunner()
    base = ["--url", backend.url]
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"k{i}", i, None) for i in range(3)])
    out = runner.invoke(main, [*base, "limit", queue_name, "--concurrency", "2", "--rate", "10", "--per", "1m"])
    assert out.exit_code == 0, out.output
    assert out.output.strip() == f"{queue_name}: concurrency 2, rate 10 per 1m 00s, group concurrency 1"
    q.set_rate_limit(None)
    assert len(q.try_poll_many(3)) == 2
    [shown] = json.loads(runner.invoke(main, [*base, "stats", queue_name, "--json"]).output)
    assert (shown["running"], shown["concurrency_limit"], shown["rate_limit"], shown["ready"]) == (2, 2, None, 1)
    assert (shown["paused"], shown["grouped"], shown["group_concurrency"]) == (False, False, 1)
    assert runner.invoke(main, [*base, "limit", queue_name, "--concurrency", "none"]).exit_code == 0
    assert q.flow().concurrency is None
    bad = runner.invoke(main, [*base, "limit", queue_name, "--concurrency", "0"])
    assert bad.exit_code != 0 and "--concurrency" in bad.output
    assert runner.invoke(main, [*base, "limit", queue_name]).exit_code != 0


# -- real worker processes -------------------------------------------------------------------------------------


def start_flow_worker(
    backend: Backend, queue: str, history: Path, *, seconds: float, concurrency: int = 8, visibility: float = 30.0
) -> subprocess.Popen[bytes]:
    env = {
        "DELAYQ_TEST_QUEUE": queue,
        "DELAYQ_TEST_HISTORY": str(history),
        "DELAYQ_TEST_HANDLER_SECONDS": str(seconds),
        "DELAYQ_TEST_VISIBILITY": str(visibility),
    }
    return spawn_worker(backend, "flow_app:handlers", env, ["--concurrency", str(concurrency)], repo_on_path=True)


def read_history(directory: Path) -> list[Record]:
    found: list[Record] = []
    for path in directory.glob("*.log"):
        for line in path.read_text().splitlines():
            event, key, ns = line.split()
            found.append((int(ns), event, key))
    return found


@pytest.mark.slow
def test_three_worker_processes_of_eight_slots_limited_to_two_never_run_more_than_two(
    backend: Backend, queue_name: str, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.set_concurrency_limit(2)
    q.offer_many([(f"k{i:02}", i, None) for i in range(24)])
    for _ in range(3):
        processes.append(start_flow_worker(backend, queue_name, tmp_path, seconds=0.1))
    wait_until(lambda: q.stats().ready + q.stats().in_flight == 0 and len(read_history(tmp_path)) == 48, "all", 240)
    history = read_history(tmp_path)
    assert started(history) == [f"k{i:02}" for i in range(24)]
    assert overlap(history) <= 2


@pytest.mark.slow
def test_a_killed_workers_slots_free_once_its_locks_expire(
    backend: Backend, queue_name: str, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """Under a limit of 2, a worker SIGKILLed while it runs two handlers holds both slots until their locks
    expire (2 s); then another worker runs everything, the two included: nothing is lost."""
    q = DelayedQueue(backend.engine, queue_name)
    q.set_concurrency_limit(2)
    q.offer_many([(f"k{i}", i, None) for i in range(6)])
    doomed = start_flow_worker(backend, queue_name, tmp_path, seconds=120, visibility=2.0)
    processes.append(doomed)
    wait_until(lambda: len(read_history(tmp_path)) == 2, "two handlers to start", 60)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    assert q.stats().in_flight + q.stats().expired_locks == 2
    survivor = start_flow_worker(backend, queue_name, tmp_path, seconds=0.0, visibility=2.0)
    processes.append(survivor)

    def left() -> int:  # (one stats() read: three reads could each miss a message moving between states)
        s = q.stats()
        return s.ready + s.in_flight + s.expired_locks

    wait_until(lambda: left() == 0, "all handled", 120)
    ends = [k for _, e, k in read_history(tmp_path) if e == "end"]
    assert sorted(ends) == [f"k{i}" for i in range(6)]


@pytest.mark.slow
def test_a_rate_limit_of_50_per_second_starts_about_250_in_5_seconds(
    backend: Backend, queue_name: str, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """Three worker processes of eight slots, 50 claims per second, 600 messages: the starts in the 5 s that
    begin 1 s after the first one (past the bucket's first period, whose burst is at most 50) number 225 to
    275. Counted from the handlers' history; the wait is bounded, not asserted on."""
    q = DelayedQueue(backend.engine, queue_name)
    q.set_rate_limit(50, SECOND)
    q.offer_many([(f"k{i:03}", i, None) for i in range(600)])
    for _ in range(3):
        processes.append(start_flow_worker(backend, queue_name, tmp_path, seconds=0.01))

    def starts() -> list[int]:
        return sorted(ns for ns, e, _ in read_history(tmp_path) if e == "start")

    wait_until(lambda: bool(starts()) and starts()[-1] - starts()[0] > 6.5e9, "6.5 s of starts", 120)
    first = starts()[0]
    window = [ns for ns in starts() if first + 1e9 <= ns < first + 6e9]
    assert 225 <= len(window) <= 275, len(window)


def test_a_spark_write_takes_a_priority_option() -> None:
    from delayq.spark.options import SourceOptions

    base = {"url": "sqlite:///delayq.db", "queue": "q"}
    assert SourceOptions.parse(base).priority == 0
    assert SourceOptions.parse({**base, "priority": "-7"}).priority == -7
    for bad in ("high", "1001"):
        with pytest.raises(InvalidInputError, match="priority"):
            SourceOptions.parse({**base, "priority": bad})


# -- groups ----------------------------------------------------------------------------------------------------


def test_a_group_runs_one_message_at_a_time_in_due_order(
    flow_queue: Callable[..., DelayedQueue], clock: ManualClock
) -> None:
    q, other = flow_queue(), flow_queue()
    for g in "AB":
        q.offer_many([(f"{g}{i}", i, dt.timedelta(seconds=-10 + i)) for i in range(3)], group=g)
    q.offer("free", 0, dt.timedelta(seconds=-20))
    assert q.flow().grouped and q.flow().group_concurrency == 1
    first = q.try_poll_many(10)
    assert [d.key for d in first] == ["free", "A0", "B0"]
    assert other.try_poll_many(10) == []  # each group has its one running
    assert other.next_due() == dt.timedelta(minutes=1)  # a worker waits for a held lock, not a 10 ms poll
    first[1].ack()
    assert [d.key for d in other.try_poll_many(10)] == ["A1"]
    q.set_group_concurrency(2)
    assert [d.key for d in q.try_poll_many(10)] == ["B1", "A2"]
    # Every lock expired: they count no more, and are due again at their lock's expiry, so behind B2 (due
    # before that): B takes B2 and B0 (of B0 and B1, expiring together, the first offered).
    clock.advance(dt.timedelta(minutes=2))
    assert sorted(d.key for d in other.try_poll_many(10)) == ["A1", "A2", "B0", "B2", "free"]
    with pytest.raises(InvalidInputError, match="group"):
        q.offer("bad", 0, group="")
    with pytest.raises(InvalidInputError, match="group concurrency"):
        q.set_group_concurrency(0)


def test_threads_never_overlap_a_groups_messages_and_run_them_in_due_order(
    backend: Backend, engine: sa.Engine, queue_name: str
) -> None:
    """Six threads claiming up to 3 at a time from 5 groups of 8 messages, group concurrency 1: from the history
    recorded between claim and ack, no group has two running at once, and each group's start in due order."""
    q = DelayedQueue(engine, queue_name)
    for g in range(5):
        q.offer_many([(f"g{g}-{i}", i, dt.timedelta(milliseconds=-1000 + 10 * i)) for i in range(8)], group=f"g{g}")
    history = History()
    history.in_threads(6, lambda _: history.claim_and_hold(engine, queue_name, batch=3, hold=0.005))
    check_groups(history.records, groups=5, each=8)


def check_groups(history: list[Record], groups: int, each: int) -> None:
    """Every message started once; per group, no two between start and end at once, and starts in due order."""
    for g in range(groups):
        mine = [h for h in history if h[2].startswith(f"g{g}-")]
        assert overlap(mine) <= 1, sorted(mine)
        starts = [k for _, e, k in sorted(mine) if e == "start"]
        assert starts == [f"g{g}-{i}" for i in range(each)], starts


@pytest.mark.slow
def test_three_worker_processes_run_each_group_one_at_a_time_in_due_order(
    backend: Backend, queue_name: str, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    for g in range(4):
        q.offer_many([(f"g{g}-{i}", i, dt.timedelta(milliseconds=-1000 + 10 * i)) for i in range(6)], group=f"g{g}")
    for _ in range(3):
        processes.append(start_flow_worker(backend, queue_name, tmp_path, seconds=0.05))
    wait_until(lambda: len(read_history(tmp_path)) == 48, "all 24 handled", 240)
    check_groups(read_history(tmp_path), groups=4, each=6)
