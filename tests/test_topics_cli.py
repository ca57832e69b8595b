"""`delayq topics ls` and `delayq topics lag` on every backend."""

from __future__ import annotations

import json
import uuid

from click.testing import CliRunner, Result
from conftest import Backend

from delayq import Subscription, Topic
from delayq.cli import main


def cli(backend: Backend, *args: str) -> Result:
    return CliRunner().invoke(main, ["--url", backend.url, "topics", *args])


def test_ls_and_lag_show_heads_watermarks_and_leases(backend: Backend) -> None:
    name = f"cli-{uuid.uuid4().hex[:10]}"
    topic = Topic(backend.engine, name)
    topic.create(2)
    topic.publish_many([("customer-1", f"m{i}", {"i": i}) for i in range(5)])
    sub = Subscription(backend.engine, name, "billing", "billing-1")
    sub.rebalance()
    first, *_ = sub.poll(10)
    assert sub.ack(first)
    sub.advance_watermarks()

    listed = json.loads(cli(backend, "ls", "--json").output)
    [mine] = [t for t in listed if t["topic"] == name]
    assert mine == {"topic": name, "partitions": 2, "published": 5, "retained": 5}

    lag = json.loads(cli(backend, "lag", name, "billing", "--json").output)
    [busy] = [p for p in lag if p["head"] == 5]
    assert busy["watermark"] == 1 and busy["lag"] == 4 and busy["in_flight"] == 4
    assert busy["leased_by"] == "billing-1" and busy["epoch"] >= 1 and busy["lease_expires"] is not None
    table = cli(backend, "lag", name, "billing").output
    assert "WATERMARK" in table and "billing-1" in table and "in " in table  # the lease expires in …
    sub.close()


def test_unknown_topic_or_group_is_one_line(backend: Backend) -> None:
    name = f"cli-{uuid.uuid4().hex[:10]}"
    Topic(backend.engine, name).create(1)
    missing = cli(backend, "lag", "no-such-topic", "billing")
    assert missing.exit_code == 2 and "no topic named 'no-such-topic'" in missing.output
    unjoined = cli(backend, "lag", name, "nobody")
    assert unjoined.exit_code == 2 and "has not joined" in unjoined.output
