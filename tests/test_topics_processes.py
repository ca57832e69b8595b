"""Topics with real subscriber processes: a SIGKILLed subscriber's partitions are stolen and nothing is lost;
a SIGSTOPped one whose lease was stolen changes nothing when it wakes up.

The child runs this file (``main``) on a ``ManualClock`` that stays at ``START``; the test's clock moves on,
so the child's leases and deliveries expire for the test without anyone sleeping.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import START, Backend, make_engine
from faults import freeze, sigkill

from delayq import ManualClock
from delayq.topics import Subscription, Topic

SECOND = dt.timedelta(seconds=1)
PARTITIONS = 4
MESSAGES = 20


def subscription(engine: sa.Engine, topic: str, name: str, clock: ManualClock) -> Subscription:
    return Subscription(
        engine,
        topic,
        "g",
        name,
        lease_duration=30 * SECOND,
        visibility_timeout=60 * SECOND,
        clock=clock,
    )


def main(url: str, topic: str) -> None:
    """The child: take every partition, poll some messages, report them, then ack them when told."""
    engine = make_engine(url)
    sub = subscription(engine, topic, "child", ManualClock(START))
    held = sub.rebalance()
    got = sub.poll(MESSAGES // 2)
    print(json.dumps({"held": sorted(held), "offsets": [[d.partition, d.offset] for d in got]}), flush=True)
    sys.stdin.readline()  # the test says when (after the SIGSTOP that it may have sent)
    acks = [d.ack() for d in got]
    print(json.dumps({"acks": acks, "marks": sub.advance_watermarks()}), flush=True)


@pytest.fixture
def child(backend: Backend) -> Iterator[tuple[subprocess.Popen[str], Topic]]:
    topic = Topic(backend.engine, f"p-{uuid.uuid4().hex[:12]}", clock=ManualClock(START))
    topic.create(PARTITIONS)
    topic.publish_many([(f"key-{i % 7}", str(i), i) for i in range(MESSAGES)])
    proc = subprocess.Popen(
        [sys.executable, __file__, backend.url, topic.name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(Path(__file__).parent),
    )
    try:
        yield proc, topic
    finally:
        if proc.poll() is None:
            sigkill(proc)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _consume_all(sub: Subscription, clock: ManualClock) -> set[int]:
    payloads: set[int] = set()
    for _ in range(5):
        sub.rebalance()
        for d in sub.poll(MESSAGES):
            assert d.ack()
            payloads.add(d.payload)
        if len(payloads) == MESSAGES:
            break
        clock.advance(61 * SECOND)  # deliveries the dead child held come back
    return payloads


def test_a_killed_subscribers_partitions_continue_elsewhere(
    child: tuple[subprocess.Popen[str], Topic], backend: Backend
) -> None:
    proc, topic = child
    assert proc.stdout is not None
    report = json.loads(proc.stdout.readline())
    assert report["held"] == list(range(PARTITIONS))
    assert len(report["offsets"]) == MESSAGES // 2
    assert sigkill(proc) == -9
    clock = ManualClock(START)
    sub = subscription(backend.engine, topic.name, "survivor", clock)
    assert sub.rebalance() == {}  # the dead child's leases have not expired yet
    clock.advance(31 * SECOND)
    assert sorted(sub.rebalance()) == list(range(PARTITIONS))
    assert _consume_all(sub, clock) == set(range(MESSAGES))  # nothing lost
    heads = {p.partition: p.head for p in topic.heads()}
    assert sub.advance_watermarks() == heads


def test_a_frozen_subscriber_whose_lease_was_stolen_changes_nothing(
    child: tuple[subprocess.Popen[str], Topic], backend: Backend
) -> None:
    proc, topic = child
    assert proc.stdout is not None and proc.stdin is not None
    report = json.loads(proc.stdout.readline())
    clock = ManualClock(START)
    sub = subscription(backend.engine, topic.name, "thief", clock)
    with freeze(proc.pid):
        clock.advance(31 * SECOND)
        assert sorted(sub.rebalance()) == list(range(PARTITIONS))
        assert _consume_all(sub, clock) == set(range(MESSAGES))
        marks = sub.advance_watermarks()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    woke = json.loads(proc.stdout.readline())
    assert woke["acks"] == [False] * len(report["offsets"])
    assert {int(p): m for p, m in woke["marks"].items()} == marks  # read, not changed: the thief's
    assert sub.advance_watermarks() == marks == {p.partition: p.head for p in topic.heads()}
    assert proc.wait(timeout=30) == 0


def crash_on_first(url: str, topic: str, seconds: str) -> None:
    """A child whose handler kills its process on the first message it gets (at ``START + seconds``)."""
    engine = make_engine(url)
    clock = ManualClock(START + dt.timedelta(seconds=int(seconds)))
    sub = Subscription(
        engine,
        topic,
        "g",
        f"crasher-{seconds}",
        clock=clock,
        max_attempts=3,
        strict=True,
        lease_duration=SECOND,
        visibility_timeout=60 * SECOND,
    )
    sub.rebalance()
    for _ in sub.poll(1):
        os._exit(3)  # dies mid-handling: no ack, no nack, no close
    os._exit(0)


def test_a_message_whose_subscriber_crashes_every_time_is_dead_lettered(backend: Backend) -> None:
    topic = Topic(backend.engine, f"p-{uuid.uuid4().hex[:12]}", clock=ManualClock(START))
    topic.create(1)
    topic.publish_many([("k", "poison", "p"), ("k", "fine", "f")])
    for attempt in range(3):  # each child takes over the dead one's lease and gets the poison again
        seconds = str(attempt * 120)
        child = subprocess.run(
            [sys.executable, __file__, "crash", backend.url, topic.name, seconds],
            cwd=str(Path(__file__).parent),
            timeout=60,
        )
        assert child.returncode == 3
    clock = ManualClock(START + dt.timedelta(seconds=3 * 120))
    sub = Subscription(backend.engine, topic.name, "g", "survivor", clock=clock, max_attempts=3)
    sub.rebalance()
    [fine] = sub.poll(10)  # the poison went to the dead letters instead of a fourth delivery
    assert fine.payload == "f"
    assert fine.ack()
    assert sub.advance_watermarks() == {0: 2}
    dead = Subscription(backend.engine, topic.name + "_dlq", "audit", "reader", clock=clock, max_attempts=None)
    dead.rebalance()
    [letter] = dead.poll(10)
    assert letter.payload == "p"
    assert letter.dead_letter is not None
    assert letter.dead_letter.failure_count == 3


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        crash_on_first(*sys.argv[2:])
    else:
        main(sys.argv[1], sys.argv[2])
