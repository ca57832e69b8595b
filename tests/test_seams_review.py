"""Where the issue 29 fixes meet each other: deliveries a cancelled poll kept, and the partition's
lease moving on before the next poll."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import START, Backend, make_async_engine, make_engine
from faults import FaultProxy
from test_aio_seams import COMMIT, at_first_claim, at_second_partition, server, two_partition_topic

from delayq import DelayedQueue, ManualClock
from delayq.aio import AsyncDelayedQueue, AsyncSubscription
from delayq.topics import TopicDelivery

__all__ = ["server"]  # the PostgreSQL and MariaDB fixture of test_aio_seams

VISIBILITY = dt.timedelta(seconds=30)
LEASE = dt.timedelta(seconds=10)


# -- a kept delivery is handed out only while its partition's lease is still this subscriber's ----
@pytest.mark.parametrize("moved_by", ["close", "rebalance", "steal"])
def test_a_cancelled_polls_kept_deliveries_are_not_handed_out_once_their_partition_moved(
    backend: Backend, moved_by: str
) -> None:
    """A poll cancelled after it delivered keeps its deliveries for the next poll. When the partition's
    lease went to another subscriber meanwhile (``close()``, a rebalance, an expired lease stolen), that
    subscriber delivers them again once their visibility timeout passed: the kept ones must not be handed
    out too, or two live holders run the same message."""
    name, published = two_partition_topic(backend.engine, per_partition=2)

    async def main() -> dict[str, list[str]]:
        engine = make_async_engine(backend.url)
        clock = ManualClock(START)
        polling: list[asyncio.Task[list[TopicDelivery]]] = []
        at_second_partition(engine.sync_engine, lambda _: polling[0].cancel())
        options: dict[str, Any] = {"clock": clock, "visibility_timeout": VISIBILITY, "lease_duration": LEASE}
        a = AsyncSubscription(engine, name, "g", "a", **options)
        b = AsyncSubscription(engine, name, "g", "b", **options)
        holders: dict[str, list[str]] = {m: [] for m in published}
        try:
            assert set(await a.rebalance()) == {0, 1}
            polling.append(asyncio.create_task(a.poll(10)))
            await asyncio.wait(polling)
            assert polling[0].cancelled()  # its deliveries are kept for a's next poll
            if moved_by == "close":
                await a.close()
            elif moved_by == "rebalance":
                await b.join()
                assert set(await a.rebalance()) == {0}  # a's share is one partition now: it lets 1 go
            else:
                clock.advance(LEASE + dt.timedelta(seconds=1))  # a's leases expire unrenewed
            clock.advance(VISIBILITY)  # the kept deliveries' visibility timeout passes
            moved = set(await b.rebalance())
            assert moved
            for d in await b.poll(10):
                holders[d.message_id].append("b")
            for d in await a.poll(10):  # a's next poll: the kept deliveries of the partitions a still holds
                holders[d.message_id].append("a")
        finally:
            await engine.dispose()
        return holders

    holders = asyncio.run(main())
    twice = {m: h for m, h in holders.items() if len(h) > 1}
    assert not twice, f"handed out to two live holders: {twice}"
    assert all(holders.values()), f"lost: {[m for m, h in holders.items() if not h]}"


# -- a claim whose COMMIT reply was cut gives back what it took, not only a cancelled one ---------
@pytest.mark.parametrize("api", ["sync", "async"])
@pytest.mark.parametrize("limit", [1, 3])
def test_a_claim_whose_commit_reply_is_cut_leaves_nothing_locked(server: Backend, api: str, limit: int) -> None:
    """The server committed the claim and the connection died before its reply: ``try_poll_many``
    (retried or raising) must not leave the message locked, its attempt counted, for the visibility
    timeout with nobody holding it. The same claim cancelled in flight is given back already
    (``test_aio_seams``); this is the reply that never comes because the connection failed."""
    queue_name = f"review-{uuid.uuid4().hex[:12]}"
    direct = DelayedQueue(server.engine, queue_name)  # the database's clock: a 5 min visibility timeout
    direct.offer("m", {"n": 1})
    # PostgreSQL claims one message in one autocommitted statement: its reply is the COMMIT's.
    last = b"SKIP LOCKED" if server.name == "postgresql" and limit == 1 else COMMIT[server.name]
    handed: list[int] = []

    with FaultProxy.for_url(server.url) as proxy:
        if api == "sync":
            engine = make_engine(proxy.url_for(server.url))
            at_first_claim(engine, lambda: proxy.cut_after(last))
            try:
                with contextlib.suppress(sa.exc.OperationalError):  # raised, or retried on a new connection
                    handed += [d.attempts for d in DelayedQueue(engine, queue_name).try_poll_many(limit)]
            finally:
                engine.dispose()
        else:

            async def main() -> None:
                engine = make_async_engine(proxy.url_for(server.url))
                at_first_claim(engine.sync_engine, lambda: proxy.cut_after(last))
                try:
                    with contextlib.suppress(sa.exc.OperationalError):
                        handed.extend(
                            d.attempts for d in await AsyncDelayedQueue(engine, queue_name).try_poll_many(limit)
                        )
                finally:
                    await engine.dispose()

            asyncio.run(main())
        assert proxy.stats.cuts == 1
    message = direct.get("m")
    assert message is not None
    if handed:  # a retry took it again (its attempt counted once): the caller holds it
        assert handed == [1] and message.locked and message.attempts == 1
    else:  # nobody holds it: due at once, the cut attempt not counted
        assert not message.locked and message.attempts == 0, message
        again = direct.try_poll()
        assert again is not None and again.attempts == 1 and again.ack()


# -- a cancelled poll that never comes back does not hold up the next polls ------------------------
def test_a_cancelled_poll_whose_commit_reply_never_comes_does_not_hold_up_the_next_poll(server: Backend) -> None:
    """The poll's second partition committed and its reply is held (60 s, as a connection gone silent):
    ``wait_for`` gives up on the poll, which goes on in the background; the next poll must not wait for
    it past the lease duration. What it delivered comes back after the visibility timeout: nothing lost."""
    name, published = two_partition_topic(server.engine)
    lease = dt.timedelta(seconds=1)

    async def main(proxy: FaultProxy) -> dict[str, int]:
        engine = make_async_engine(proxy.url_for(server.url))
        at_second_partition(engine.sync_engine, lambda _: proxy.hold_reply_after(COMMIT[server.name], 60.0))
        clock = ManualClock(START)
        sub = AsyncSubscription(
            engine, name, "g", "s1", clock=clock, visibility_timeout=VISIBILITY, lease_duration=lease
        )
        delivered: dict[str, int] = {}
        try:
            await sub.rebalance()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sub.poll(10), 0.5)
            assert proxy.stats.holding == 1  # the second partition's COMMIT reply, held
            try:  # the cancelled poll is given up after the lease duration (psycopg waits <= 5 s to cancel)
                await asyncio.wait_for(sub.poll(10), 20)
            except TimeoutError:
                pytest.fail("the next poll waited for the cancelled one (its reply held 60 s)")
            clock.advance(VISIBILITY + lease)  # whatever the given-up poll delivered is visible again
            await sub.rebalance()
            for _ in range(4):
                got = await sub.poll(10)
                for d in got:
                    delivered[d.message_id] = delivered.get(d.message_id, 0) + 1
                assert await sub.ack_many(got) == [True] * len(got)
        finally:
            await engine.dispose()
        return delivered

    with FaultProxy.for_url(server.url) as proxy:
        delivered = asyncio.run(main(proxy))
    assert sorted(delivered) == sorted(published), f"lost: {sorted(set(published) - set(delivered))}"
    assert set(delivered.values()) == {1}


def test_a_cancelled_claim_whose_commit_reply_never_comes_gives_its_connection_back(server: Backend) -> None:
    """A ``try_poll`` timed out while its COMMIT reply is held (60 s, as a connection gone silent) goes on in
    the background to give its messages back; past the visibility timeout it is cancelled for good, so it
    does not keep a connection of the pool. Its message comes back as its lock expires: nothing lost."""
    queue_name = f"review-{uuid.uuid4().hex[:12]}"
    direct = DelayedQueue(server.engine, queue_name)
    direct.offer("m", {"n": 1})
    visibility = dt.timedelta(seconds=1)

    async def main(proxy: FaultProxy) -> None:
        # One connection in the pool: the claim's, while its reply is held.
        engine = make_async_engine(proxy.url_for(server.url), pool_size=1, max_overflow=0, pool_timeout=30)
        at_first_claim(engine.sync_engine, lambda: proxy.hold_reply_after(COMMIT[server.name], 60.0))
        queue = AsyncDelayedQueue(engine, queue_name, visibility_timeout=visibility)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(queue.try_poll_many(3), 0.5)
            assert proxy.stats.holding == 1
            try:  # needs the pool's one connection: given up by the claim after the visibility timeout
                await asyncio.wait_for(queue.next_due(), 20)
            except TimeoutError:
                pytest.fail("the cancelled claim kept the pool's connection (its reply held 60 s)")
            deadline = asyncio.get_running_loop().time() + 30
            while (again := await queue.try_poll()) is None:  # its lock expires (the database's clock)
                assert asyncio.get_running_loop().time() < deadline, "the claimed message never came back"
                await asyncio.sleep(0.05)
            assert again.key == "m" and await again.ack()
        finally:
            await engine.dispose()

    with FaultProxy.for_url(server.url) as proxy:
        asyncio.run(main(proxy))
    assert direct.get("m") is None


# -- the threaded worker's idle claim of one, its reply lost or late (PostgreSQL) ------------------
@pytest.mark.parametrize("fault", ["cut", "held"])
def test_the_threaded_workers_idle_claim_of_one_loses_nothing_and_runs_nothing_twice_when_its_reply_is(
    postgres: Backend, fault: str
) -> None:
    """An idle ``Worker`` on PostgreSQL claims one message in one autocommitted statement: the server commits
    it before replying. Reply cut (the connection dies): the message is not lost behind a lock nobody holds
    (given back at once, the attempt not counted) and runs once. Reply late (held 2 s, the worker waiting):
    while its holder lives no other worker gets it; the holder runs it, once."""
    from test_worker import handler_for, wait_until

    from delayq import Worker

    queue_name = f"review-{uuid.uuid4().hex[:12]}"
    direct = DelayedQueue(postgres.engine, queue_name)  # the database's clock: a 5 min visibility timeout
    direct.offer("m", {"n": 1})
    runs: list[tuple[str, int]] = []

    def worker(name: str, engine: sa.Engine) -> Worker:
        handler = handler_for(queue_name, lambda d, _: runs.append((name, d.attempts)))
        return Worker(engine, [handler], poll_interval=dt.timedelta(milliseconds=20), listen=False)

    with FaultProxy.for_url(postgres.url) as proxy:
        engine = make_engine(proxy.url_for(postgres.url))
        if fault == "cut":
            at_first_claim(engine, lambda: proxy.cut_after(b"SKIP LOCKED"))
        else:
            at_first_claim(engine, lambda: proxy.hold_reply_after(b"SKIP LOCKED", 2.0))
        holder, other = worker("holder", engine), worker("other", postgres.engine)
        holder.start()
        try:
            wait_until(lambda: proxy.stats.cuts + proxy.stats.held == 1, "the claim's reply cut or held")
            if fault == "held":  # committed, its reply held: locked for the holder, who waits for the reply
                assert direct.try_poll() is None
            other.start()  # another worker polls meanwhile (and after)
            wait_until(lambda: direct.get("m") is None, "the message handled and acked")
        finally:
            assert holder.stop() and other.stop()
            engine.dispose()
    if fault == "cut":  # given back, then claimed anew by either: its first counted attempt, run once
        assert len(runs) == 1 and runs[0][1] == 1, runs
    else:  # the holder lived: nobody else got it
        assert runs == [("holder", 1)]
