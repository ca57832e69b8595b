"""Bulk actions on a filter (state, key prefix, tag): cancel, requeue, purge, reschedule and count, in bounded
batches; on every backend, through the sync and the async API (``api``). Then the seams where they meet faults:
consumers claiming the same rows, an action interrupted half-way, a row lock held by another transaction."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, count_rows

from delayq import DelayedQueue, ManualClock, TransientRetry
from delayq.errors import InvalidInputError
from delayq.queue import BulkOutcome
from delayq.queue._cancel import FINISHED_CANCELLED
from delayq.schema import make_tables

MINUTE = dt.timedelta(minutes=1)
HOUR = dt.timedelta(hours=1)


def keys_of(engine: sa.Engine, queue_name: str, table: str = "messages") -> list[str]:
    t = {"messages": make_tables().messages, "dead": make_tables().dead_letters, "kept": make_tables().finished}[table]
    with engine.connect() as conn:
        return sorted(conn.execute(sa.select(t.c.key).where(t.c.queue == queue_name)).scalars())


def cancelled_keys(engine: sa.Engine, queue_name: str) -> list[str]:
    f = make_tables().finished
    query = sa.select(f.c.key).where(f.c.queue == queue_name, f.c.state == FINISHED_CANCELLED)
    with engine.connect() as conn:
        return sorted(conn.execute(query).scalars())


def mixed(q: Any, clock: ManualClock) -> dict[str, str]:
    """A queue with a message in every live state; returns key -> state. ``q``'s visibility timeout is a minute."""
    q.offer("old/expired", 0)
    [held] = q.try_poll_many(1)
    clock.advance(2 * MINUTE)  # its lock expired: due for redelivery
    q.offer("a/ready-1", 1, tags=["red"])
    q.offer("a/ready-2", 2)
    q.offer("b/ready-3", 3, tags=["red"])
    q.offer("a/running", 4, -5 * MINUTE, tags=["red"])  # (due before the expired lock)
    [running] = q.try_poll_many(1)
    assert running.key == "a/running" and held.key == "old/expired"
    q.offer("a/later", 5, HOUR, tags=["red"])
    q.offer("b/later", 6, HOUR)
    return {
        "old/expired": "expired-lock",
        "a/ready-1": "ready",
        "a/ready-2": "ready",
        "b/ready-3": "ready",
        "a/running": "in-flight",
        "a/later": "scheduled",
        "b/later": "scheduled",
    }


def test_the_count_is_what_the_action_then_does(queue: DelayedQueue, engine: sa.Engine, clock: ManualClock) -> None:
    states = mixed(queue, clock)
    assert queue.count_matching() == 7
    assert queue.count_matching(state="ready") == 3
    assert queue.count_matching(state="all") == 6  # every live one not running
    assert queue.count_matching(state="in-flight") == 1
    assert queue.count_matching(key_prefix="a/", tag="red") == 3
    assert queue.count_matching(state="ready", at_most=2) == 2
    assert queue.count_matching(state="dead") == 0
    n = queue.count_matching(state="ready", key_prefix="a/")
    assert queue.purge(state="ready", key_prefix="a/") == BulkOutcome(done=n)
    assert keys_of(engine, queue.name) == sorted(k for k in states if k not in ("a/ready-1", "a/ready-2"))


def test_a_bulk_action_goes_in_batches_each_committed_before_the_next(queue: DelayedQueue, engine: sa.Engine) -> None:
    queue.offer_many([(f"k/{i:02}", i, None) for i in range(10)])
    seen: list[BulkOutcome] = []

    def progress(so_far: BulkOutcome) -> None:
        seen.append(so_far)
        seen.append(BulkOutcome(count_rows(engine, queue.name)))  # what another connection sees: committed

    assert queue.purge(state="ready", batch_size=3, progress=progress) == BulkOutcome(done=10)
    assert [s.done for s in seen[::2]] == [3, 6, 9, 10]
    assert [s.done for s in seen[1::2]] == [7, 4, 1, 0]


def test_cancel_matching_cancels_each_as_cancel_job_does(
    queue: DelayedQueue, engine: sa.Engine, clock: ManualClock
) -> None:
    mixed(queue, clock)
    assert queue.cancel_matching(key_prefix="a/", tag="red", batch_size=2) == BulkOutcome(done=3)
    # The queued ones deleted, unrecorded; the running one recorded as cancelled (its holder is told).
    assert keys_of(engine, queue.name) == ["a/ready-2", "b/later", "b/ready-3", "old/expired"]
    assert cancelled_keys(engine, queue.name) == ["a/running"]
    got = queue.get("a/running")
    assert got is not None and got.state == "cancelled"
    assert queue.cancel_matching(state="expired-lock") == BulkOutcome(done=1)
    assert cancelled_keys(engine, queue.name) == ["a/running"]  # (an expired lock's message is queued again)
    assert queue.cancel_matching() == BulkOutcome(done=3)
    assert keys_of(engine, queue.name) == []


def test_a_queue_that_keeps_a_history_records_every_cancelled_message(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine
) -> None:
    q = make_queue(retention=HOUR)
    q.offer_many([(f"k/{i}", i, None) for i in range(4)])
    assert q.cancel_matching(key_prefix="k/", batch_size=3) == BulkOutcome(done=4)
    assert cancelled_keys(engine, q.name) == ["k/0", "k/1", "k/2", "k/3"]


def test_purge_deletes_what_is_not_running_and_never_a_running_message(
    queue: DelayedQueue, engine: sa.Engine, clock: ManualClock
) -> None:
    mixed(queue, clock)
    assert queue.purge(state="scheduled") == BulkOutcome(done=2)
    assert queue.purge(state="all", key_prefix="a/") == BulkOutcome(done=2)  # a/ready-1, a/ready-2: not a/running
    assert queue.purge(state="all") == BulkOutcome(done=2)  # b/ready-3 and the expired lock's old/expired
    assert keys_of(engine, queue.name) == ["a/running"]
    with pytest.raises(InvalidInputError, match="running messages are not purged"):
        queue.purge(state="in-flight")
    assert keys_of(engine, queue.name) == ["a/running"]
    assert cancelled_keys(engine, queue.name) == []  # a purge records nothing


def test_purge_deletes_dead_letters_and_kept_messages_by_tag_and_prefix(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine
) -> None:
    q = make_queue(retention=HOUR)
    q.offer_many([(f"d/{i}", i, None) for i in range(3)], tags=["eu"])
    q.offer_many([("d/3", 3, None), ("done/1", 4, None), ("done/2", 5, None)])
    for d in q.try_poll_many(10):
        assert d.ack() if d.key.startswith("done/") else d.dead_letter("boom")
    assert q.count_matching(state="dead") == 4 and q.count_matching(state="completed") == 2
    assert q.purge(state="dead", tag="eu", batch_size=2) == BulkOutcome(done=3)
    assert keys_of(engine, q.name, "dead") == ["d/3"]
    assert q.purge(state="completed", key_prefix="done/") == BulkOutcome(done=2)
    assert q.purge(state="cancelled") == BulkOutcome(done=0)
    assert keys_of(engine, q.name, "kept") == []


def test_requeue_dead_matching_puts_back_the_newest_of_each_key(queue: DelayedQueue, engine: sa.Engine) -> None:
    for attempt in range(2):  # two dead letters under r/1, the second one newer
        queue.offer("r/1", attempt)
        [d] = queue.try_poll_many(1)
        assert d.dead_letter(f"boom {attempt}")
    queue.offer_many([("r/2", 2, None), ("s/3", 3, None), ("r/4", 4, None)], tags=["eu"])
    for d in queue.try_poll_many(10):
        assert d.dead_letter("boom")
    queue.offer("r/4", "live again")
    assert queue.requeue_dead_matching(key_prefix="r/", batch_size=1) == BulkOutcome(done=2)  # r/1, r/2; r/4 is live
    got = queue.get("r/1")
    assert got is not None and got.payload == 1 and got.last_error == "boom 1"
    assert keys_of(engine, queue.name, "dead") == ["r/1", "r/4", "s/3"]
    assert queue.requeue_dead_matching(tag="eu") == BulkOutcome(done=1)  # s/3
    assert keys_of(engine, queue.name, "dead") == ["r/1", "r/4"]


def test_reschedule_matching_moves_what_is_not_running(
    queue: DelayedQueue, engine: sa.Engine, clock: ManualClock
) -> None:
    mixed(queue, clock)
    at = clock.now() + 2 * HOUR
    assert queue.reschedule_matching(at, key_prefix="a/") == BulkOutcome(done=3)  # not a/running
    for key in ("a/ready-1", "a/ready-2", "a/later"):
        got = queue.get(key)
        assert got is not None and got.scheduled_at == at
    running = queue.get("a/running")
    assert running is not None and running.state == "running"
    assert queue.reschedule_matching(state="expired-lock") == BulkOutcome(done=1)  # due now, its lock cleared
    expired = queue.get("old/expired")
    assert expired is not None and expired.state == "ready" and not expired.locked
    with pytest.raises(InvalidInputError, match="not rescheduled in bulk"):
        queue.reschedule_matching(at, state="in-flight")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda q: q.purge(state="nope"), "no such state 'nope'"),
        (lambda q: q.purge(state="ready", tag="Not A Tag"), "tag"),
        (lambda q: q.purge(state="ready", key_prefix=""), "key prefix must not be empty"),
        (lambda q: q.purge(state="ready", key_prefix="a\x00"), "NUL"),
        (lambda q: q.purge(state="ready", batch_size=0), "batch_size"),
        (lambda q: q.purge(state="ready", batch_size=10_001), "batch_size"),
        (lambda q: q.cancel_matching(state="dead"), "dead messages are not cancelled: purge them"),
        (lambda q: q.cancel_matching(state="completed"), "not cancelled"),
        (lambda q: q.count_matching(at_most=-1), "at_most"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(
    queue: DelayedQueue, engine: sa.Engine, call: Callable[[Any], Any], message: str
) -> None:
    queue.offer("a", 1)
    with pytest.raises(InvalidInputError, match=message):
        call(queue)
    assert keys_of(engine, queue.name) == ["a"]


# -- the seams: faults a bulk action meets (sync API; each on every backend) -------------------------------------
def _consumers(q: DelayedQueue, n: int, start: threading.Barrier, stop: threading.Event) -> Iterator[Any]:
    """``n`` threads claiming from ``q`` and acking until ``stop`` is set and nothing is left; yields the
    history list (key, ack result) they share, once they ended."""
    history: list[tuple[str, bool]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            start.wait()
            while True:
                found = q.try_poll_many(3)
                if not found and stop.is_set():
                    return
                for d in found:
                    ok = d.ack()
                    with lock:
                        history.append((d.key, ok))
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=consume) for _ in range(n)]
    for t in threads:
        t.start()
    yield history
    for t in threads:
        t.join(60)
    assert not errors, errors


@pytest.mark.parametrize("action", ["purge", "cancel"])
def test_a_bulk_action_racing_consumers_acts_on_each_message_once_and_never_under_its_holder(
    engine: sa.Engine, queue_name: str, clock: ManualClock, action: str
) -> None:
    q = DelayedQueue(engine, queue_name, clock=clock, visibility_timeout=HOUR)
    n = 240
    q.offer_many([(f"k/{i:03}", i, None) for i in range(n)])
    start, stop = threading.Barrier(4), threading.Event()
    consumers = _consumers(q, 3, start, stop)
    history = next(consumers)
    start.wait()
    outcome = q.purge(state="ready", batch_size=7) if action == "purge" else q.cancel_matching(batch_size=7)
    stop.set()
    next(consumers, None)
    claimed = [k for k, _ in history]
    assert len(claimed) == len(set(claimed)), "a message was claimed twice"
    acked = {k for k, ok in history if ok}
    lost = {k for k, ok in history if not ok}
    if action == "purge":
        assert not lost, "a purge deleted a claimed message under its holder"
    else:  # a message cancelled while its handler ran is recorded, and its holder's ack changes nothing
        assert lost == set(cancelled_keys(engine, queue_name))
    assert outcome.done + len(acked) == n  # each message once: acked, or acted on by the bulk action
    assert count_rows(engine, queue_name) == 0


def test_a_bulk_cancel_interrupted_half_way_keeps_its_done_batches_and_a_rerun_finishes(
    backend: Backend, queue_name: str, clock: ManualClock
) -> None:
    engine = backend.make_engine()
    deletes = 0

    @sa.event.listens_for(engine, "before_cursor_execute")
    def cut(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        nonlocal deletes
        if statement.lstrip().upper().startswith("DELETE FROM") and "delayq_messages" in statement:
            deletes += 1
            if deletes == 3:  # the third batch's delete: its transaction rolls back
                raise ConnectionAbortedError("cut in the third batch")

    try:
        q = DelayedQueue(engine, queue_name, clock=clock)
        q.offer_many([(f"k/{i:02}", i, None) for i in range(25)])
        seen: list[BulkOutcome] = []
        with pytest.raises(ConnectionAbortedError):
            q.cancel_matching(key_prefix="k/", batch_size=5, progress=seen.append)
        assert seen == [BulkOutcome(5), BulkOutcome(10)]
        assert count_rows(engine, queue_name) == 15  # two batches done, the third rolled back whole
        assert keys_of(engine, queue_name)[0] == "k/10"
        assert q.cancel_matching(key_prefix="k/", batch_size=5) == BulkOutcome(done=15)
        assert count_rows(engine, queue_name) == 0
    finally:
        engine.dispose()


def test_a_row_another_transaction_holds_is_skipped_and_counted_or_waited_for_bounded(
    backend: Backend, queue_name: str, clock: ManualClock
) -> None:
    q = DelayedQueue(backend.engine, queue_name, clock=clock)
    q.offer_many([(f"k/{i:02}", i, None) for i in range(12)])
    m = make_tables().messages
    other = backend.make_engine(poolclass=sa.pool.NullPool)
    try:
        with other.connect() as holder:
            if backend.name == "sqlite":
                # No row locks: another writer holds the database. A batch waits for it (its busy timeout, then
                # the queue's retries) and then raises, having changed nothing.
                holder.exec_driver_sql("BEGIN IMMEDIATE")
                quick = backend.make_engine(connect_args={"timeout": 0.05})
                impatient = DelayedQueue(quick, queue_name, clock=clock, transient_retry=TransientRetry(attempts=2))
                with pytest.raises(sa.exc.OperationalError, match="locked"):
                    impatient.purge(state="ready", batch_size=5)
                quick.dispose()
                holder.rollback()
                assert q.purge(state="ready", batch_size=5) == BulkOutcome(done=12)
                return
            held = ["k/03", "k/07"]
            holder.execute(sa.select(m.c.id).where(m.c.queue == queue_name, m.c.key.in_(held)).with_for_update())
            assert q.purge(state="ready", batch_size=5) == BulkOutcome(done=10, skipped=2)  # not waited for
            holder.rollback()
        assert keys_of(backend.engine, queue_name) == held
        assert q.purge(state="ready", batch_size=5) == BulkOutcome(done=2)
    finally:
        other.dispose()


# -- the command line --------------------------------------------------------------------------------------------
def cli(backend: Backend, *args: str, input: str | None = None) -> Any:
    from click.testing import CliRunner

    from delayq.cli import main

    return CliRunner().invoke(main, ["--url", backend.url, *args], input=input, catch_exceptions=False)


def test_delayq_purge_counts_asks_purges_in_batches_and_never_a_running_message(
    backend: Backend, queue_name: str
) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer("r/run", 0, -MINUTE)
    [held] = q.try_poll_many(1)  # running: never purged
    q.offer_many([(f"r/{i}", i, None) for i in range(5)] + [("s/1", 0, HOUR)], tags=["eu"])
    declined = cli(backend, "purge", queue_name, "--state", "all", "--key-prefix", "r/", input="n\n")
    assert declined.exit_code == 1 and "purge 5 message(s) of" in declined.output and q.count_matching() == 7
    done = cli(backend, "purge", queue_name, "--state", "all", "--key-prefix", "r/", "--batch-size", "2", "--yes")
    assert done.exit_code == 0 and f"{queue_name}: 5 message(s) purged" in done.stdout, done.output
    assert keys_of(backend.engine, queue_name) == ["r/run", "s/1"] and held.extend(MINUTE)
    assert cli(backend, "purge", queue_name, "--state", "scheduled", "--tag", "eu", "--yes").exit_code == 0
    assert q.count_matching(state="scheduled") == 0
    for bad in (["--state", "in-flight"], ["--state", "nope"], [], ["--state", "ready", "--tag", "EU"]):
        out = cli(backend, "purge", queue_name, *bad, "--yes")
        assert out.exit_code == 2 and q.count_matching() == 1, out.output
    nothing = cli(backend, "purge", queue_name, "--state", "ready", "--yes")
    assert nothing.exit_code == 2 and "no message of queue" in nothing.output


def test_cancel_reschedule_and_dead_take_a_tag_and_a_state(backend: Backend, queue_name: str) -> None:
    q = DelayedQueue(backend.engine, queue_name)
    q.offer_many([(f"a/{i}", i, None) for i in range(4)], tags=["eu"])
    q.offer_many([(f"b/{i}", i, None) for i in range(3)])
    out = cli(backend, "reschedule", queue_name, "--tag", "eu", "--in", "1h", "--yes")
    assert out.exit_code == 0 and "4 message(s) rescheduled" in out.stdout, out.output
    assert q.count_matching(state="scheduled") == 4
    out = cli(backend, "cancel", queue_name, "--state", "scheduled", "--key-prefix", "a/", "--yes")
    assert out.exit_code == 0 and "4 message(s) cancelled" in out.stdout, out.output
    assert keys_of(backend.engine, queue_name) == ["b/0", "b/1", "b/2"]
    for d in q.try_poll_many(3):
        assert d.dead_letter("boom")
    q.offer("b/0", "live again")
    out = cli(backend, "dead", "requeue", queue_name, "--key-prefix", "b/", "--yes")
    assert out.exit_code == 0 and "2 dead letter(s) requeued" in out.stdout, out.output  # b/0 is live: stays dead
    out = cli(backend, "dead", "purge", queue_name, "--all", "--yes")
    assert out.exit_code == 0 and "1 dead letter(s) purged" in out.stdout, out.output
    for bad in (
        ["cancel", queue_name, "b/1", "--tag", "eu"],
        ["cancel", queue_name, "--state", "dead"],
        ["reschedule", queue_name, "--in", "1h"],
        ["reschedule", queue_name, "--state", "in-flight", "--in", "1h"],
        ["dead", "purge", queue_name, "--all", "--tag", "eu"],
    ):
        out = cli(backend, *bad, "--yes")
        assert out.exit_code == 2 and "Error" in out.output.strip().splitlines()[-1], (bad, out.output)
    assert q.count_matching() == 3


def test_cancel_by_key_prefix_records_a_running_message_and_tells_its_handler(
    backend: Backend, queue_name: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """``delayq cancel QUEUE --key-prefix P`` cancels as ``--tag`` and ``--state`` do (``cancel_matching``): a
    running message under the prefix is recorded as cancelled and its handler told (PostgreSQL: by NOTIFY;
    elsewhere at the worker's next heartbeat, which the manual clock brings on), never deleted under it unrecorded
    (which its worker would take for a lost lock)."""
    from test_worker_cancel import VT, Telling
    from test_worker_contract import Driver

    from delayq import Delivery, audit

    started, told = threading.Event(), threading.Event()

    def body(d: Delivery, _: object) -> None:
        if d.key == "p/running":
            started.set()
            if d.cancelled.wait(30):
                told.set()

    caplog.set_level(logging.INFO, logger="delayq")
    driver = Driver("threads", backend)
    telling = Telling(driver, clock)
    worker = driver.worker([driver.queue_handler(queue_name, body, visibility_timeout=VT)], **telling.options)
    q = DelayedQueue(backend.engine, queue_name, clock=clock)
    q.offer("p/running", 1, tags=["eu"])
    telling.start(worker)
    try:
        assert started.wait(30), "the handler did not start"
        q.offer_many([("p/queued", 2, HOUR), ("other", 3, HOUR)])
        out = cli(backend, "cancel", queue_name, "--key-prefix", "p/", "--yes")
        assert out.exit_code == 0 and f"{queue_name}: 2 message(s) cancelled" in out.stdout, out.output
        telling.tell()
        assert told.wait(30), "the handler was not told"
    finally:
        assert worker.stop()
    assert keys_of(backend.engine, queue_name) == ["other"]
    assert cancelled_keys(backend.engine, queue_name) == ["p/running"]  # (the queued one deleted, unrecorded)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [w for w in warnings if "lost" in w], warnings  # (a cancel, not a lost lock)
    told_lines = [r.getMessage() for r in caplog.records if "cancelled while its handler ran" in r.getMessage()]
    assert told_lines and all("'p/running'" in line for line in told_lines), told_lines
    with backend.engine.connect() as conn:
        [entry] = audit.entries(conn, make_tables(), queue=queue_name)
    assert (entry.action, entry.filter, entry.count) == ("cancel", {"prefix": "p/"}, 2)
