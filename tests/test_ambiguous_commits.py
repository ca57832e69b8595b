"""Commits whose reply is lost: the server committed, the client saw a dropped connection and retried.

Through a TCP fault proxy that lets a statement or COMMIT reach the server and then cuts the connection
before the reply. A retried claim must not let a later ack delete messages nobody received; under a
stress of such cuts, no message is lost and none is acked twice.
"""

from __future__ import annotations

import datetime as dt
import random
import threading
from collections import Counter
from collections.abc import Iterator

import pytest
from conftest import count_rows, make_engine
from faults import FaultProxy

from delayq import DelayedQueue, Delivery, ManualClock

SERVERS = ["postgresql", "mysql"]
MINUTE = dt.timedelta(minutes=1)
# What a claim sends last before it commits: PostgreSQL's claim of one is one autocommitted
# statement, a batch claim a transaction ended by COMMIT (it plans with sorting off); MariaDB's is a
# transaction ended by COMMIT (the COM_QUERY byte 0x03 first: "READ COMMITTED" is no commit). An ack:
# a DELETE (autocommitted) / COMMIT.
CLAIM = {"postgresql": b"WITH picked AS MATERIALIZED", "mysql": b"\x03COMMIT"}
BATCH_CLAIM = {"postgresql": b"COMMIT\x00", "mysql": b"\x03COMMIT"}
ACK = {"postgresql": b"DELETE FROM delayq_messages", "mysql": b"\x03COMMIT"}


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest, backend_urls: dict[str, str]) -> Iterator[tuple[str, str, FaultProxy]]:
    """(backend name, direct URL, a proxy in front of the server)."""
    url = backend_urls[request.param]
    with FaultProxy.for_url(url) as proxy:
        yield request.param, url, proxy


@pytest.mark.parametrize("batch", [1, 3])
def test_a_claim_retried_after_its_reply_was_lost_never_lets_an_ack_delete_what_nobody_received(
    server: tuple[str, str, FaultProxy], queue_name: str, batch: int
) -> None:
    name, url, proxy = server
    clock = ManualClock(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    direct = make_engine(url)
    through = make_engine(proxy.url_for(url))
    producer = DelayedQueue(direct, queue_name, clock=clock, visibility_timeout=MINUTE)
    consumer = DelayedQueue(through, queue_name, clock=clock, visibility_timeout=MINUTE)
    try:
        producer.offer_many([(f"k{i}", i, None) for i in range(2 * batch)])
        proxy.cut_after(CLAIM[name] if batch == 1 else BATCH_CLAIM[name])
        got = consumer.try_poll_many(batch)  # the first attempt committed unseen; the retry took others
        assert proxy.stats.cuts == 1
        assert len(got) == batch
        if batch == 1:
            assert got[0].ack()
        else:
            assert consumer.ack_many(got) == batch
        assert count_rows(direct, queue_name) == batch, "the unseen claim's messages must survive the ack"
        clock.advance(2 * MINUTE)  # the unseen claim's locks expire: its messages come again
        again = consumer.try_poll_many(10)
        assert sorted(d.key for d in again + got) == sorted(f"k{i}" for i in range(2 * batch))
        assert consumer.ack_many(again) == batch
    finally:
        through.dispose()
        direct.dispose()


def test_under_a_stress_of_lost_replies_nothing_is_lost_and_nothing_acked_twice(
    server: tuple[str, str, FaultProxy], queue_name: str
) -> None:
    """4 consumers, random batches, retries, releases and acks; a few claims and acks per hundred lose
    their reply after the server committed. History: each key acked (True) at most once, and every key
    either acked, or possibly acked by an ack whose reply was lost, or still there at the end."""
    name, url, proxy = server
    seed = random.randrange(1_000_000)
    rng = random.Random(seed)
    clock = ManualClock(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    keys = [f"s{i}" for i in range(300)]
    direct = make_engine(url)
    DelayedQueue(direct, queue_name, clock=clock).offer_many([(k, k, None) for k in keys])
    acked: Counter[str] = Counter()
    maybe_acked: set[str] = set()
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def consume(n: int) -> None:
        local = random.Random(seed + n)
        engine = make_engine(proxy.url_for(url), pool_size=2, max_overflow=0)
        q = DelayedQueue(engine, queue_name, clock=clock, visibility_timeout=MINUTE)
        try:
            while not stop.is_set():
                got = q.try_poll_many(local.randint(1, 8))
                if not got:
                    return
                to_ack: list[Delivery] = []
                for d in got:
                    action = local.random()
                    if action < 0.15:
                        q.release([d])
                    elif action < 0.3:
                        d.retry(dt.timedelta(0), "stress")
                    else:
                        to_ack.append(d)
                if not to_ack:
                    continue
                done = q.ack_many(to_ack)
                with lock:
                    if done == len(to_ack):
                        acked.update(d.key for d in to_ack)
                    else:  # some lock was lost, or an unseen earlier attempt deleted them: which is unknown
                        maybe_acked.update(d.key for d in to_ack)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)
        finally:
            engine.dispose()

    def inject() -> None:
        # One cut armed at a time: cuts armed faster than claims and acks arrive would pile up and
        # cut every retry in a row (a fault rate no network has), until the retry budget is spent.
        while not stop.wait(0.05):
            if proxy.stats.armed == 0:
                proxy.cut_after(rng.choice([CLAIM[name], BATCH_CLAIM[name], ACK[name]]))

    threads = [threading.Thread(target=consume, args=(n,)) for n in range(4)]
    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    injector.join(5)
    proxy.heal()
    assert not errors, f"seed {seed}: {errors[0]!r}"
    assert proxy.stats.cuts > 0
    # What is left comes back after the visibility timeout (claims whose reply was lost): drain it.
    clock.advance(2 * MINUTE)
    final = DelayedQueue(direct, queue_name, clock=clock, visibility_timeout=MINUTE)
    left: list[str] = []
    while got := final.try_poll_many(100):
        left += [d.key for d in got]
        final.ack_many(got)
    direct.dispose()
    twice = [k for k, n in acked.items() if n > 1]
    assert not twice, f"seed {seed}: acked twice: {twice}"
    assert not set(left) & set(acked), f"seed {seed}: acked and still there: {set(left) & set(acked)}"
    lost = set(keys) - set(acked) - maybe_acked - set(left)
    assert not lost, f"seed {seed}: lost {sorted(lost)}"
    assert set(left) | set(acked) | maybe_acked == set(keys)
    summary = f"{proxy.stats.cuts} cuts, {sum(acked.values())} acked, {len(maybe_acked)} maybe, {len(left)} left"
    print(f"seed {seed}: {summary}")
