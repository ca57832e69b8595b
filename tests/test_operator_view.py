"""What flow control sets, shown where an operator looks (issue 42, item 3): a message's priority and group on
``Message`` (``get``, the listings), ``Delivery``, ``delayq show``, ``ls --json`` and the dashboard's message page;
each queue's limits, pause and running count in ``delayq stats`` and the overview, a paused or limited queue
listed with nothing in it; and the message page of a kept (completed, cancelled, dead) job. Every backend; the
queue's own reads with both APIs."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest

from delayq import DelayedQueue

HOUR = dt.timedelta(hours=1)
BOTH_APIS = pytest.mark.parametrize("api", ["sync", "async"], indirect=True)


def flow_of(d: Any) -> tuple[str, int, str | None]:
    return d.key, d.priority, d.group


# -- priority and group on deliveries and messages --------------------------------------------------------
@BOTH_APIS
def test_a_delivery_carries_its_priority_and_group_on_every_claim_path(make_queue: Callable[..., DelayedQueue]) -> None:
    """The plain claim (a claimer whose cached flow knows no priority yet), the claim by priority level and the
    grouped claim each hand the handler the message's priority and group."""
    producer = make_queue()
    consumer = make_queue(flow_refresh=HOUR)  # (its cached flow state stays "no priorities, no groups")
    assert consumer.try_poll() is None
    producer.offer("plain", 1, priority=7, group="customer-1")
    producer.offer("none", 2, at=dt.timedelta(seconds=-1))
    assert sorted(flow_of(d) for d in consumer.try_poll_many(5)) == [("none", 0, None), ("plain", 7, "customer-1")]

    by_level = make_queue(name=f"{producer.name}-levels")
    by_level.offer("low", 1, priority=-3)
    by_level.offer("high", 2, priority=4)
    assert [flow_of(d) for d in by_level.try_poll_many(5)] == [("high", 4, None), ("low", -3, None)]

    grouped = make_queue(name=f"{producer.name}-groups")
    grouped.offer("g1", 1, group="a", priority=2)
    grouped.offer("g2", 2, group="a")
    grouped.offer("solo", 3)
    assert [flow_of(d) for d in grouped.try_poll_many(5)] == [("g1", 2, "a"), ("solo", 0, None)]


@BOTH_APIS
def test_get_shows_a_live_messages_priority_and_group_and_none_once_kept(
    make_queue: Callable[..., DelayedQueue],
) -> None:
    q = make_queue(retention=HOUR)
    q.offer("job", {"n": 1}, priority=5, group="customer-9")
    q.offer("plain", {"n": 2})
    live, plain = q.get("job"), q.get("plain")
    assert live is not None and (live.priority, live.group) == (5, "customer-9")
    assert plain is not None and (plain.priority, plain.group) == (0, None)
    [d] = [d for d in q.try_poll_many(2) if d.key == "job"]
    running = q.get("job")
    assert running is not None and (running.state, running.priority, running.group) == ("running", 5, "customer-9")
    assert d.ack(result="done")
    kept = q.get("job")
    # (the finished rows and dead letters do not record them: docs/workers.md, "Flow control")
    assert kept is not None and (kept.state, kept.priority, kept.group) == ("completed", None, None)
