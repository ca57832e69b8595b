"""AsyncWorker specifics: cancellation, the ack task, async observers, killed and silent connections, async
handler timeouts, topic handlers as tasks or threads. What both drivers share (the policy, exactly-once
effects, faults, SIGTERM through ``delayq worker --driver asyncio``) is in test_worker_contract.py and the
worker fault modules, parametrized over the drivers."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, make_async_engine
from faults import FaultProxy

from delayq import (
    CancelOutcome,
    DeadLetter,
    DelayedQueue,
    InvalidInputError,
    ManualClock,
    RetryPolicy,
    Subscription,
    TopicDelivery,
    TopicHandler,
    Worker,
)
from delayq.aio import AsyncDelivery, AsyncHandler, AsyncTopic, AsyncWorker
from delayq.dialects._pg_listen import CANCELLED
from delayq.topics import dead_letter_topic, group_lag

SECOND = dt.timedelta(seconds=1)
FAST = dt.timedelta(milliseconds=20)


async def wait_for(condition: Callable[[], Awaitable[bool]], what: str, limit: float = 30.0) -> None:
    """Poll a condition; fail (not hang) if it stays false. Bounds a wait, asserts nothing about timing."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not await condition():
        if loop.time() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        await asyncio.sleep(0.01)


def async_handler(queue_name: str, body: Callable[..., Awaitable[None]], **attrs: Any) -> AsyncHandler:
    async def handle(self: AsyncHandler, d: AsyncDelivery, conn: Any = None) -> None:
        await body(d, conn)

    cls = type("TestAsyncHandler", (AsyncHandler,), {"queue": queue_name, "handle": handle, **attrs})
    return cls()  # type: ignore[no-any-return]


def test_a_cancelled_handler_or_worker_gives_its_message_back(backend: Backend, queue_name: str) -> None:
    started: list[str] = []
    cancelled: list[str] = []
    handled: list[str] = []
    tasks: dict[str, asyncio.Task[Any]] = {}

    async def body(d: AsyncDelivery, _: object) -> None:
        started.append(d.key)
        task = asyncio.current_task()
        assert task is not None
        tasks[d.key] = task
        assert d.attempts == 1  # a released delivery's attempt is not counted
        if started.count(d.key) == 1:
            try:
                await asyncio.Event().wait()  # until cancelled
            except asyncio.CancelledError:
                cancelled.append(d.key)
                raise
        handled.append(d.key)

    async def main() -> None:
        engine = make_async_engine(backend.url)
        worker = AsyncWorker(engine, [async_handler(queue_name, body)], poll_interval=FAST, listen=False)
        q = worker.async_queues[queue_name]
        await q.offer("a", 1)
        run = asyncio.create_task(worker.run())

        async def running(key: str) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return key in tasks

            return check

        await wait_for(await running("a"), "a's handler to start")
        tasks.pop("a").cancel()  # the handler's own task: released, redelivered, handled by the same worker

        async def redelivered() -> bool:
            return "a" in handled

        await wait_for(redelivered, "a to be handled after the cancellation")
        await q.offer("b", 2)
        await wait_for(await running("b"), "b's handler to start")
        run.cancel()  # the worker's task: everything held goes back at once
        with pytest.raises(asyncio.CancelledError):
            await run
        b = await q.get("b")
        assert b is not None and not b.locked and b.attempts == 0  # due again, the attempt not counted
        assert await q.get("a") is None
        await engine.dispose()

    asyncio.run(main())
    assert started == ["a", "a", "b"]
    assert cancelled == ["a", "b"]
    assert handled == ["a"]


def test_a_lost_cancellation_does_not_keep_the_heartbeat_of_a_kept_handler_running(
    backend: Backend, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler still running at the stop is kept, its lock extended by the heartbeat, until asyncio.run's end
    cancels what is left. On Python 3.11 a cancellation can be lost on its way (``asyncio.wait_for`` returns the
    result of a call that completed in the turn of the cancellation: asyncmy's connect): the heartbeat ends on
    the request all the same, or asyncio.run, which waits for the tasks it cancelled, would never return."""
    started = asyncio.Event()
    parked = asyncio.Event()
    lost: list[bool] = []

    async def body(d: AsyncDelivery, _: object) -> None:
        started.set()
        await asyncio.Event().wait()  # until cancelled

    async def main() -> None:
        engine = make_async_engine(backend.url)
        worker = AsyncWorker(
            engine, [async_handler(queue_name, body)], poll_interval=FAST, shutdown_timeout=FAST, listen=False
        )
        q = worker.async_queues[queue_name]
        await q.offer("a", 1)
        worker.start()
        await asyncio.wait_for(started.wait(), 30)
        assert await worker.stop()  # stopped, the handler kept
        assert worker.health().held == 1
        heartbeat = worker._loop_tasks["heartbeat"]
        keeper = worker._keeper
        assert keeper is not None
        call = worker._call

        async def losing(fn: Callable[..., Any], *args: Any) -> Any:
            if fn == worker._core.beat and not lost:
                # The next beat loses what cancels it: asyncio.run's request and the keeper's as it ends (the
                # two reach the task as one CancelledError when the keeper ends first), then returns.
                parked.set()
                while not keeper.done():
                    try:
                        await asyncio.sleep(3600 if not lost else 0.01)
                    except asyncio.CancelledError:
                        lost.append(True)
                return True
            return await call(fn, *args)

        monkeypatch.setattr(worker, "_call", losing)
        await asyncio.wait_for(parked.wait(), 30)
        # What asyncio.run does at its end: cancel every task left, and wait for them.
        left = asyncio.all_tasks() - {asyncio.current_task()}
        assert heartbeat in left
        for task in left:
            task.cancel()
        await asyncio.wait(left, timeout=10)
        assert lost and heartbeat.done()
        assert all(task.done() for task in left)
        a = await q.get("a")
        assert a is not None and not a.locked and a.attempts == 0  # given back as the handler was cancelled
        await engine.dispose()

    asyncio.run(main())


def test_the_ack_task_acks_while_the_worker_runs_and_hands_over_at_stop(backend: Backend, queue_name: str) -> None:
    """Acks go out from a task of their own while the fetch loop claims; what is handled is deleted before
    the stop, every key once; the stop ends the ack task and acks the rest itself."""
    n = 40
    handled: Counter[str] = Counter()
    gate = asyncio.Event()

    async def body(d: AsyncDelivery, _: object) -> None:
        if d.key == "last":
            await gate.wait()  # still running at the stop: acked by the shutdown, not the ack task
        handled[d.key] += 1

    async def main() -> None:
        engine = make_async_engine(backend.url)
        worker = AsyncWorker(engine, [async_handler(queue_name, body)], concurrency=4, poll_interval=FAST, listen=False)
        q = worker.async_queues[queue_name]
        await q.offer_many([(f"k{i}", i, None) for i in range(n)] + [("last", n, None)])
        worker.start()

        async def all_but_last_acked() -> bool:
            return (await q.stats()).ready + (await q.stats()).in_flight == 1

        await wait_for(all_but_last_acked, "the ack task to ack the handled messages")
        health = worker.health()
        assert set(health.loops) >= {"fetch", "heartbeat", "ack"} and health.healthy
        assert await q.get("last") is not None
        gate.set()
        assert await worker.stop()
        assert not worker.health().loops["ack"]
        assert await q.get("last") is None  # acked at the stop
        await engine.dispose()

    asyncio.run(main())
    assert handled == Counter({f"k{i}": 1 for i in range(n)} | {"last": 1})


def test_an_observer_that_reads_the_database_works_under_the_async_worker(backend: Backend, queue_name: str) -> None:
    """An application's own observer may read what is stored with the delivery (its headers, its attempt
    history) through the sync core, when a handler starts and when it ends: the async worker calls observers
    in a greenlet unless all of them say they read nothing, as delayq's delivery log and metrics do (then no
    greenlet is spent per delivery)."""
    from prometheus_client import CollectorRegistry

    from delayq import metrics, observe

    seen: list[object] = []

    class Auditor(observe.Observer):
        def started(self, delivery: Any) -> object:
            seen.append(delivery.headers)  # a read of the database, through the sync core
            return None

        def finished(self, delivery: Any, state: object, error: BaseException | None, duration: float) -> None:
            seen.append(delivery.attempt_history)  # another read, after the handler

    async def handle(d: AsyncDelivery, conn: Any) -> None:
        pass

    async def main() -> None:
        engine = make_async_engine(backend.url)
        worker = AsyncWorker(engine, [async_handler(queue_name, handle)])
        await worker.async_queues[queue_name].offer("audited", {"n": 1})
        assert await worker.run_once() == 1
        await engine.dispose()

    registry = CollectorRegistry()
    installed = metrics.register(registry)
    try:
        assert not observe.handling(None).reads_database  # type: ignore[arg-type]  # the log and the metrics
        auditor = Auditor()
        observe.add(auditor)
        try:
            assert observe.handling(None).reads_database  # type: ignore[arg-type]
            asyncio.run(main())
        finally:
            observe.remove(auditor)
    finally:
        metrics.unregister(installed, registry)
    assert seen == [{}, ()]


def test_an_offer_commit_wakes_the_async_listener(postgres: Backend, queue_name: str) -> None:
    from delayq.dialects import dialect_for

    async def main() -> None:
        engine = make_async_engine(postgres.url)
        q = DelayedQueue(postgres.engine, queue_name)
        heard = dialect_for(postgres.engine).listen_async(engine, q.tables.messages.name)
        first = asyncio.ensure_future(anext(heard))
        await asyncio.sleep(0.2)  # let LISTEN begin: a notification before it is not delivered
        while not first.done():
            q.offer(f"k{uuid.uuid4().hex}", 1)  # committed: notifies
            await asyncio.wait([first], timeout=0.5)
        assert first.result() == queue_name
        await heard.aclose()
        await engine.dispose()

    asyncio.run(main())


def test_a_cancel_of_a_running_message_reaches_the_async_listener(postgres: Backend, queue_name: str) -> None:
    """On the cancel channel, beside the wake-up one: the id after ``CANCELLED`` (psycopg's and asyncpg's)."""
    from delayq.dialects import dialect_for
    from delayq.dialects._pg_listen import CANCELLED

    async def main() -> None:
        engine = make_async_engine(postgres.url)
        q = DelayedQueue(postgres.engine, queue_name, notify=False)  # offers wake no one: only cancels are heard
        heard = dialect_for(postgres.engine).listen_async(engine, q.tables.messages.name, cancels=True)
        first = asyncio.ensure_future(anext(heard))
        await asyncio.sleep(0.2)  # let LISTEN begin: a notification before it is not delivered
        ids = set()
        while not first.done():
            key = f"k{uuid.uuid4().hex}"
            q.offer(key, 1)
            d = q.try_poll()
            assert d is not None
            ids.add(CANCELLED + str(d.id))
            assert q.cancel_job(key) is CancelOutcome.RUNNING  # committed: notifies its id
            await asyncio.wait([first], timeout=0.5)
        assert first.result() in ids
        await heard.aclose()
        await engine.dispose()

    asyncio.run(main())


@pytest.mark.slow  # a fault test: it waits out the stall bound
def test_a_silent_connection_is_given_up_after_the_stall_timeout(
    backend: Backend, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend.name == "sqlite":
        pytest.skip("no network connection to go silent")
    # A claim that reached the server just as its connection went silent stays open there, holding the rows
    # it claimed (seen: 3 of the 5 messages offered after the stall): the server ends it after the claim's
    # idle bound (docs/internals.md), shortened here to keep the test short.
    from delayq.dialects import bounds

    monkeypatch.setattr(bounds, "IDLE_TIMEOUT_S", 2.0)
    handled: Counter[str] = Counter()

    async def body(d: AsyncDelivery, _: object) -> None:
        handled[d.key] += 1

    async def main() -> None:
        with FaultProxy.for_url(backend.url) as proxy:
            # Each silent pooled connection costs a stall_timeout (and psycopg waits 5 s for its cancel
            # before closing it): a small pool keeps the test short.
            engine = make_async_engine(proxy.url_for(backend.url), pool_size=2, max_overflow=0)
            worker = AsyncWorker(
                engine, [async_handler(queue_name, body)], poll_interval=FAST, stall_timeout=dt.timedelta(seconds=1)
            )
            direct = DelayedQueue(backend.engine, queue_name)
            direct.offer("before", 0)
            worker.start()
            try:

                async def first() -> bool:
                    return handled["before"] == 1

                await wait_for(first, "the first message")
                proxy.stall_existing()  # open, silent for good: only a timeout gets the worker out
                direct.offer_many([(f"after-{i}", i, None) for i in range(5)])

                async def rest() -> bool:
                    return all(handled[f"after-{i}"] for i in range(5))

                await wait_for(rest, "the messages offered after the connections went silent", limit=90)
            finally:
                assert await worker.stop(timeout=30)
                await engine.dispose()

    asyncio.run(main())


def test_the_threaded_worker_refuses_an_async_handler(engine: sa.Engine, queue_name: str) -> None:
    """Its coroutine would never be awaited and the message acked unhandled: refused up front."""

    async def body(d: AsyncDelivery, _: object) -> None:
        raise AssertionError("never called")

    with pytest.raises(InvalidInputError, match="AsyncWorker"):
        Worker(engine, [async_handler(queue_name, body)])


# -- Handler.timeout: an asyncio handler is cancelled, and its attempt decided as any failure --------------
def test_an_async_handler_past_its_timeout_is_cancelled_and_retried_per_its_policy(
    backend: Backend, queue_name: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    history: list[str] = []

    async def body(d: AsyncDelivery, _: object) -> None:
        history.append(f"start {d.attempts}")
        if d.attempts == 1:
            try:
                await asyncio.Event().wait()  # hangs until cancelled
            except asyncio.CancelledError:
                history.append("cancelled 1")
                raise
        assert [h.error_type for h in await d.attempt_history()] == ["TimedOut"]
        history.append(f"done {d.attempts}")

    async def main() -> None:
        engine = make_async_engine(backend.url)
        handler = async_handler(
            queue_name, body, timeout=dt.timedelta(minutes=1), retry=RetryPolicy.fixed(10 * SECOND, max_attempts=2)
        )
        worker = AsyncWorker(engine, [handler], clock=clock, poll_interval=FAST, listen=False)
        q = worker.async_queues[queue_name]
        await q.offer("job", 1)
        worker.start()
        try:

            async def seen(what: str) -> Callable[[], Awaitable[bool]]:
                async def check() -> bool:
                    return what in history

                return check

            await wait_for(await seen("start 1"), "the first attempt")
            clock.advance(dt.timedelta(minutes=1, seconds=1))  # the handler has run past its timeout

            async def retried() -> bool:
                m = await q.get("job")
                return m is not None and not m.locked and m.last_error is not None

            await wait_for(retried, "the timed-out attempt to be recorded as a failure")
            m = await q.get("job")
            assert m is not None and m.attempts == 1
            assert m.last_error == "TimedOut: cancelled at its timeout of 1m 00s"
            assert history == ["start 1", "cancelled 1"]  # cancelled before anyone else could run it
            assert worker.health().held == 0
            clock.advance(10 * SECOND)  # the policy's delay
            await wait_for(await seen("done 2"), "the second attempt")

            async def gone() -> bool:
                return await q.get("job") is None

            await wait_for(gone, "the ack")
            assert await q.dead_letters() == []
        finally:
            assert await worker.stop()
        await engine.dispose()

    with caplog.at_level("WARNING", logger="delayq.worker"):
        asyncio.run(main())
    assert history == ["start 1", "cancelled 1", "start 2", "done 2"]
    assert len([r for r in caplog.records if "past its timeout" in r.getMessage()]) == 1


def test_an_async_handler_timing_out_on_its_last_attempt_is_dead_lettered_by_run_once(
    backend: Backend, queue_name: str, clock: ManualClock
) -> None:
    history: list[str] = []

    async def body(d: AsyncDelivery, _: object) -> None:
        history.append(f"start {d.attempts}")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            history.append("cancelled")
            raise

    async def main() -> None:
        engine = make_async_engine(backend.url)
        timeout = dt.timedelta(seconds=30)
        handler = async_handler(
            queue_name, body, timeout=timeout, retry=RetryPolicy(max_attempts=1), transactional=True
        )
        worker = AsyncWorker(engine, [handler], clock=clock, listen=False)
        q = worker.async_queues[queue_name]
        await q.offer("job", 1)
        run = asyncio.create_task(worker.run_once())

        async def started() -> bool:
            return history == ["start 1"]

        await wait_for(started, "the attempt")
        clock.advance(timeout + SECOND)
        assert await asyncio.wait_for(run, 30) == 1
        assert await q.get("job") is None
        [dead] = await q.dead_letters()
        assert (dead.key, dead.attempts, dead.last_error) == ("job", 1, "TimedOut: cancelled at its timeout of 30.0s")
        await engine.dispose()

    asyncio.run(main())
    assert history == ["start 1", "cancelled"]


# -- topic handlers: the threaded worker's topic consumers, each delivery a task -------------------------
def async_topic_handler(topic: str, body: Callable[[TopicDelivery], Awaitable[None]], **attrs: Any) -> TopicHandler:
    async def handle(self: TopicHandler, d: TopicDelivery, conn: Any = None) -> None:
        await body(d)

    attrs.setdefault("lease_duration", 3 * SECOND)  # a rebalance every second of real time
    attrs.setdefault("visibility_timeout", 30 * SECOND)
    cls = type("AsyncTopicConsumer", (TopicHandler,), {"topic": topic, "group": "g", "handle": handle, **attrs})
    return cls()  # type: ignore[no-any-return]


def test_the_async_worker_runs_topic_handlers_under_the_one_outcome_decision(
    backend: Backend, clock: ManualClock
) -> None:
    name = f"t-{uuid.uuid4().hex[:12]}"
    history: list[tuple[str, int]] = []

    async def body(d: TopicDelivery) -> None:
        history.append((d.message_id, d.attempts))
        if d.message_id == "flaky" and d.attempts == 1:
            raise ValueError("once")
        if d.message_id == "bad":
            raise DeadLetter("no such order")
        if d.message_id == "slow" and d.attempts == 1:
            try:
                await asyncio.Event().wait()  # hangs until its timeout cancels it
            except asyncio.CancelledError:
                history.append(("slow cancelled", 1))
                raise

    async def main() -> None:
        engine = make_async_engine(backend.url)
        topic = AsyncTopic(engine, name, clock=clock)
        await topic.create(1)
        await topic.publish_many([("k", m, m) for m in ("ok", "flaky", "bad", "slow")])
        handler = async_topic_handler(
            name,
            body,
            retry=RetryPolicy.fixed(dt.timedelta(0), max_attempts=3),
            timeout=dt.timedelta(minutes=1),
            visibility_timeout=dt.timedelta(minutes=5),  # the clock's jump past the timeout stays inside it
        )
        worker = AsyncWorker(engine, [handler], clock=clock, poll_interval=FAST, listen=False)
        worker.start()
        try:

            async def seen(*what: tuple[str, int]) -> Callable[[], Awaitable[bool]]:
                async def check() -> bool:
                    return all(w in history for w in what)

                return check

            await wait_for(await seen(("ok", 1), ("flaky", 2), ("bad", 1), ("slow", 1)), "the first deliveries")
            assert ("slow", 2) not in history  # held (its visibility extended) while its handler runs
            clock.advance(dt.timedelta(minutes=1, seconds=1))  # past the slow handler's timeout
            await wait_for(await seen(("slow cancelled", 1), ("slow", 2)), "the timed-out attempt's retry")

            async def all_done() -> bool:
                return worker.handled == 6 and worker.health().held == 0

            await wait_for(all_done, "every outcome recorded")
        finally:
            assert await worker.stop()
        await engine.dispose()

    asyncio.run(main())
    assert history.index(("slow cancelled", 1)) < history.index(("slow", 2))  # never two runs at once
    assert sorted(history) == sorted(
        [("ok", 1), ("flaky", 1), ("flaky", 2), ("bad", 1), ("slow", 1), ("slow cancelled", 1), ("slow", 2)]
    )
    [lag] = group_lag(backend.engine, name, "g")
    assert (lag.head, lag.watermark, lag.pending) == (4, 4, 0)  # the worker advanced it as it left the group
    dlq = Subscription(backend.engine, dead_letter_topic(name), "inspect", "me", clock=clock)
    dlq.rebalance()
    [dead] = dlq.poll()
    dlq.close()
    assert dead.dead_letter is not None and (dead.message_id, dead.dead_letter.last_error) == ("g:bad", "no such order")


def test_the_async_worker_refuses_sync_transactional_topic_handlers() -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    async def body(d: TopicDelivery) -> None:
        pass

    engine = create_async_engine("sqlite+aiosqlite://")
    attrs = {"topic": "orders", "group": "g", "handle": lambda self, d, conn=None: None, "transactional": True}
    sync = type("SyncConsumer", (TopicHandler,), attrs)
    with pytest.raises(InvalidInputError, match=r"needs an async def handle .* use delayq\.Worker"):
        AsyncWorker(engine, [sync])
    AsyncWorker(engine, [async_topic_handler("orders", body, transactional=True)])  # (exactly once: the contract)


def test_the_async_worker_runs_sync_topic_handlers_on_threads(backend: Backend, clock: ManualClock) -> None:
    """A sync topic handler runs on a thread, under the one outcome decision; past its timeout it is reported,
    not cancelled (a thread cannot be stopped), and its delivery stays held until it returns."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    history: list[tuple[str, int]] = []
    go_on = threading.Event()

    def handle(self: TopicHandler, d: TopicDelivery, conn: Any = None) -> None:
        history.append((d.message_id, d.attempts))
        if d.message_id == "flaky" and d.attempts == 1:
            raise ValueError("once")
        if d.message_id == "bad":
            raise DeadLetter("no such order")
        if d.message_id == "slow":
            go_on.wait(30)

    attrs = {
        "topic": name,
        "group": "g",
        "handle": handle,
        "retry": RetryPolicy.fixed(dt.timedelta(0), max_attempts=3),
        "timeout": dt.timedelta(minutes=1),
        "visibility_timeout": dt.timedelta(minutes=5),
        "lease_duration": 3 * SECOND,
    }
    handler = type("SyncTopicConsumer", (TopicHandler,), attrs)()

    async def main() -> None:
        engine = make_async_engine(backend.url)
        topic = AsyncTopic(engine, name, clock=clock)
        await topic.create(1)
        await topic.publish_many([("k", m, m) for m in ("ok", "flaky", "bad", "slow")])
        worker = AsyncWorker(engine, [handler], clock=clock, poll_interval=FAST, listen=False)
        worker.start()
        try:

            async def first_pass() -> bool:
                return all(w in history for w in [("ok", 1), ("flaky", 2), ("bad", 1), ("slow", 1)])

            await wait_for(first_pass, "the first deliveries")
            clock.advance(dt.timedelta(minutes=1, seconds=1))  # past the slow handler's timeout

            async def stuck() -> bool:
                return worker.health().stuck == 1

            await wait_for(stuck, "the slow handler to be found overdue")
            assert ("slow", 2) not in history  # reported, not cancelled: held while its thread runs
            go_on.set()

            async def all_done() -> bool:
                return worker.handled == 5 and worker.health().held == 0

            await wait_for(all_done, "every outcome recorded")
        finally:
            go_on.set()
            assert await worker.stop()
        await engine.dispose()

    asyncio.run(main())
    assert sorted(history) == sorted([("ok", 1), ("flaky", 1), ("flaky", 2), ("bad", 1), ("slow", 1)])
    [lag] = group_lag(backend.engine, name, "g")
    assert (lag.head, lag.watermark, lag.pending) == (4, 4, 0)


def test_a_cancel_heard_before_the_handlers_task_first_runs_keeps_the_handler_from_running(
    backend: Backend, queue_name: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim's reply came and the handler's task was made; in that loop turn, before the task's first step, the
    cancel's notification was heard (the claim committed, then the cancel). The handler never runs, and the message
    stays cancelled. (The job used to be marked told while its task had not started, so no cancellation came, and
    the handler ran to its end.)"""
    ran: list[str] = []

    async def body(d: AsyncDelivery, _: object) -> None:
        ran.append(d.key)
        await asyncio.sleep(0)  # a cancellation delivered by now ends it here
        ran.append(f"{d.key} ended")

    async def main() -> None:
        engine = make_async_engine(backend.url)
        worker = AsyncWorker(engine, [async_handler(queue_name, body)], clock=clock, poll_interval=FAST, listen=False)
        aq = worker.async_queues[queue_name]
        await aq.offer("k", 1)
        operator = DelayedQueue(backend.engine, queue_name, clock=clock)
        start = worker._start_queue_job

        def start_then_hear_the_cancel(source: Any, job: Any) -> None:
            start(source, job)  # its task is made; its first step has not run
            if job.delivery.key == "k":
                assert operator.cancel_job("k") is CancelOutcome.RUNNING
                if worker._core.heard_cancel(f"{CANCELLED}{job.delivery.id}"):  # as the listener does
                    worker._cancel_lost()

        monkeypatch.setattr(worker, "_start_queue_job", start_then_hear_the_cancel)
        try:
            assert await worker.run_once() == 1
            assert ran == []
            cancelled = await aq.get("k")
            assert cancelled is not None and cancelled.state == "cancelled"
            assert worker.health().held == 0
            await aq.offer("after", 2)
            assert await worker.run_once() == 1
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert ran == ["after", "after ended"]
