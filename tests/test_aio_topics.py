"""Topics for asyncio: the sync topic operations awaited, in delayq's transaction or the caller's."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from conftest import Backend, make_async_engine
from sqlalchemy.ext.asyncio import AsyncSession

from delayq import OfferOutcome
from delayq.aio import AsyncSubscription, AsyncTopic


def test_publish_in_an_async_session_commits_or_rolls_back_and_a_group_consumes_in_order(backend: Backend) -> None:
    name = f"t{uuid.uuid4().hex[:12]}"

    async def main() -> None:
        engine = make_async_engine(backend.url)
        try:
            topic = AsyncTopic(engine, name)
            assert await topic.create(2) == 2
            async with AsyncSession(engine) as session, session.begin():
                assert await topic.publish("order-1", "a", {"n": 1}, using=session) is OfferOutcome.CREATED
            with pytest.raises(RuntimeError):
                async with AsyncSession(engine) as session, session.begin():
                    await topic.publish("order-1", "lost", {"n": 0}, using=session)
                    raise RuntimeError("the order failed: its event goes with it")
            outcomes = await topic.publish_many([("order-1", "b", {"n": 2}), ("order-1", "a", {"n": 1})])
            assert outcomes == [OfferOutcome.CREATED, OfferOutcome.IGNORED]

            sub = AsyncSubscription(engine, name, "billing", "s1")
            assert len(await sub.rebalance()) == 2
            got = await sub.poll(10)
            assert [d.message_id for d in got] == ["a", "b"]  # one partition key: offset order
            assert await sub.nack(got[0]) and await sub.ack(got[1])
            again = await sub.poll(10)
            assert [d.message_id for d in again] == ["a"]
            assert await sub.ack_many(again) == [True]
            part = again[0].partition
            assert (await sub.advance_watermarks())[part] == 2
            await sub.close()
            assert sub.held == {}
        finally:
            await engine.dispose()

    asyncio.run(main())
