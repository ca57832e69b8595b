"""Topics under faults: a publish whose COMMIT reply is lost, and a lease row locked by another transaction."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from conftest import START, Backend, make_engine
from faults import FaultProxy, hold_row_lock

from delayq import ManualClock, OfferOutcome
from delayq.schema import make_tables
from delayq.topics import Subscription, Topic

SERVERS = ["postgresql", "mysql"]
# The COMMIT itself: PostgreSQL's simple-query message for it, MariaDB's COM_QUERY byte and text (a bare
# "COMMIT" also matches "READ COMMITTED").
COMMIT = {"postgresql": b"Q\x00\x00\x00\x0bCOMMIT\x00", "mysql": b"\x03COMMIT"}


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest, backend_urls: dict[str, str]) -> Iterator[tuple[str, str, FaultProxy]]:
    url = backend_urls[request.param]
    with FaultProxy.for_url(url) as proxy:
        yield request.param, url, proxy


def test_a_publish_retried_after_its_commit_reply_was_lost_appends_once(
    server: tuple[str, str, FaultProxy], backend_urls: dict[str, str]
) -> None:
    name, url, proxy = server
    from conftest import _backend

    _backend(name, backend_urls)  # migrated
    direct, through = make_engine(url), make_engine(proxy.url_for(url))
    topic_name = f"f-{uuid.uuid4().hex[:12]}"
    try:
        Topic(direct, topic_name).create(1)
        topic = Topic(through, topic_name)
        topic.partitions()
        proxy.cut_after(COMMIT[name])
        outcomes = topic.publish_many([("k", "1", 1), ("k", "2", 2)])
        assert proxy.stats.cuts == 1
        assert outcomes == [OfferOutcome.IGNORED, OfferOutcome.IGNORED]  # the retry found them committed
        log = make_tables().topics.log
        with direct.connect() as conn:
            offsets = conn.execute(
                sa.select(log.c.message_offset).where(log.c.topic == topic_name).order_by(log.c.message_offset)
            ).scalars()
            assert list(offsets) == [1, 2]
        assert [p.head for p in Topic(direct, topic_name).heads()] == [2]
    finally:
        through.dispose()
        direct.dispose()


def test_a_rebalance_skips_a_lease_row_another_transaction_locked(backend: Backend) -> None:
    if backend.name == "sqlite":
        pytest.skip("SQLite has no row locks: another writer holds the whole database")
    topic_name = f"f-{uuid.uuid4().hex[:12]}"
    clock = ManualClock(START)
    Topic(backend.engine, topic_name, clock=clock).create(3)
    sub = Subscription(backend.engine, topic_name, "g", "s", clock=clock, lease_duration=dt.timedelta(seconds=30))
    sub.join()
    part = "`partition`" if backend.name == "mysql" else "partition"
    where = f"consumer_group = 'g' AND topic = :t AND {part} = 0"
    with hold_row_lock(backend.url, "delayq_topic_leases", where, {"t": topic_name}):
        assert sorted(sub.rebalance()) == [1, 2]  # no waiting for the locked row
    assert sorted(sub.rebalance()) == [0, 1, 2]
