"""Where the issue 29 fixes meet each other: deliveries a cancelled poll kept, and the partition's
lease moving on before the next poll."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from conftest import START, Backend, make_async_engine
from test_aio_seams import at_second_partition, two_partition_topic

from delayq import ManualClock
from delayq.aio import AsyncSubscription
from delayq.topics import TopicDelivery

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
