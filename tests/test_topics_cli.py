"""`delayq topics ls`, `delayq topics lag` and `delayq topics dead ls|requeue|purge` on every backend."""

from __future__ import annotations

import json
import uuid

import sqlalchemy as sa
from click.testing import CliRunner, Result
from conftest import Backend

from delayq import Subscription, Topic
from delayq.cli import main
from delayq.dialects import dialect_for
from delayq.schema import make_tables


def cli(backend: Backend, *args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(main, ["--url", backend.url, "topics", *args], input=input)


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
    assert isinstance(busy["lease_age_ms"], int) and 0 <= busy["lease_age_ms"] < 60_000  # the database's clock
    table = cli(backend, "lag", name, "billing").output
    assert "WATERMARK" in table and "billing-1" in table and "in " in table  # the lease expires in …
    assert "LEASE_AGE" in table
    sub.close()


def test_unknown_topic_or_group_is_one_line(backend: Backend) -> None:
    name = f"cli-{uuid.uuid4().hex[:10]}"
    Topic(backend.engine, name).create(1)
    missing = cli(backend, "lag", "no-such-topic", "billing")
    assert missing.exit_code == 2 and "no topic named 'no-such-topic'" in missing.output
    unjoined = cli(backend, "lag", name, "nobody")
    assert unjoined.exit_code == 2 and "has not joined" in unjoined.output


def test_lease_age_is_now_minus_acquisition_on_the_database_clock(backend: Backend) -> None:
    name = f"cli-{uuid.uuid4().hex[:10]}"
    Topic(backend.engine, name).create(2)
    sub = Subscription(backend.engine, name, "g", "s1")
    sub.rebalance()
    leases = make_tables().topics.leases
    with backend.engine.begin() as conn:  # taken 90 minutes ago (as the database's clock says now)
        now = conn.execute(sa.select(dialect_for(backend.engine).now_ms())).scalar_one()
        conn.execute(
            sa.update(leases)
            .where(leases.c.topic == name, leases.c.partition == 0)
            .values(acquired_at=now - 90 * 60_000)
        )
    lag = {p["partition"]: p for p in json.loads(cli(backend, "lag", name, "g", "--json").output)}
    assert 90 * 60_000 <= lag[0]["lease_age_ms"] < 91 * 60_000
    assert 0 <= lag[1]["lease_age_ms"] < 60_000
    table = cli(backend, "lag", name, "g").output
    assert "1h 30m" in table
    sub.close()
    freed = json.loads(cli(backend, "lag", name, "g", "--json").output)
    assert all(p["leased_by"] is None and p["lease_age_ms"] is None for p in freed)


def _dead_letters(backend: Backend) -> tuple[Topic, Subscription, Subscription]:
    """A one-partition topic whose groups ``one`` and ``two`` each gave up on its two messages (keys ``a``
    and ``b``): dead letters 1 and 2 are group one's, 3 and 4 group two's."""
    name = f"cli-{uuid.uuid4().hex[:10]}"
    topic = Topic(backend.engine, name)
    topic.create(1)
    topic.publish_many([("a", "m1", {"n": 1}), ("b", "m2", {"n": 2})])
    subs = []
    for group in ("one", "two"):
        sub = Subscription(backend.engine, name, group, f"{group}-1", max_attempts=1)
        sub.rebalance()
        assert all(d.fail(f"{group} failed") for d in sub.poll(10))
        subs.append(sub)
    return topic, subs[0], subs[1]


def test_dead_ls_lists_each_groups_dead_letters(backend: Backend) -> None:
    topic, one, two = _dead_letters(backend)
    listed = json.loads(cli(backend, "dead", "ls", topic.name, "--json").output)
    assert sorted((d["group"], d["partition_key"], d["message_id"]) for d in listed) == [
        ("one", "a", "m1"),
        ("one", "b", "m2"),
        ("two", "a", "m1"),
        ("two", "b", "m2"),
    ]
    [m2] = json.loads(cli(backend, "dead", "ls", topic.name, "--group", "two", "--key", "b", "--json").output)
    assert m2["payload"] == {"n": 2} and m2["last_error"] == "two failed" and m2["failure_count"] == 1
    assert m2["payload_type"] == "json" and m2["original_offset"] == 2 and m2["offset"] == 4 and m2["failed_at"]
    assert len(json.loads(cli(backend, "dead", "ls", topic.name, "--id", "m1", "--json").output)) == 2
    assert len(json.loads(cli(backend, "dead", "ls", topic.name, "--limit", "1", "--json").output)) == 1
    table = cli(backend, "dead", "ls", topic.name).output
    assert "MESSAGE_ID" in table and "one failed" in table and " ago" in table
    missing = cli(backend, "dead", "ls", "no-such-topic")
    assert missing.exit_code == 2 and "no topic named 'no-such-topic'" in missing.output
    one.close()
    two.close()


def test_dead_requeue_asks_first_and_delivers_to_the_group_again(backend: Backend) -> None:
    topic, one, two = _dead_letters(backend)
    refused = cli(backend, "dead", "requeue", topic.name, "--group", "one", "--all", input="n\n")
    assert refused.exit_code == 1 and "requeue 2 dead letter(s) of group 'one'" in refused.output
    assert len(topic.dead_letters()) == 4  # nothing changed on "no"
    assert one.poll(10) == []

    done = cli(backend, "dead", "requeue", topic.name, "--group", "one", "--all", input="y\n")
    assert done.exit_code == 0, done.output
    assert f"{topic.name}: 2 dead letter(s) requeued" in done.output
    assert {d.group for d in topic.dead_letters()} == {"two"}
    again = one.poll(10)
    assert sorted(d.payload["n"] for d in again) == [1, 2]
    assert all(d.message_id.startswith(("m1~requeue-", "m2~requeue-")) for d in again)
    assert one.ack_many(again) == [True, True]
    assert two.poll(10) == []  # the other group is not given them again

    by_id = cli(backend, "dead", "requeue", topic.name, "--id", "m1", "--yes")
    assert by_id.exit_code == 0 and "1 dead letter(s) requeued" in by_id.output
    assert [d.message_id for d in two.poll(10)] == ["m1~requeue-3"]
    none = cli(backend, "dead", "requeue", topic.name, "--id", "m1", "--yes")
    assert none.exit_code == 2 and "no dead letters match" in none.output
    bad = cli(backend, "dead", "requeue", topic.name, "--yes")
    assert bad.exit_code == 2 and "--all" in bad.output
    one.close()
    two.close()


def test_dead_purge_asks_first_and_deletes(backend: Backend) -> None:
    topic, one, two = _dead_letters(backend)
    refused = cli(backend, "dead", "purge", topic.name, "--key", "a", input="n\n")
    assert refused.exit_code == 1 and "purge 2 dead letter(s) of topic" in refused.output
    assert len(topic.dead_letters()) == 4
    done = cli(backend, "dead", "purge", topic.name, "--key", "a", input="y\n")
    assert done.exit_code == 0 and f"{topic.name}: 2 dead letter(s) purged" in done.output
    assert {d.partition_key for d in topic.dead_letters()} == {"b"}
    everything = cli(backend, "dead", "purge", topic.name, "--all", "--yes")
    assert everything.exit_code == 0 and "2 dead letter(s) purged" in everything.output
    assert topic.dead_letters() == []
    assert one.poll(10) == [] and two.poll(10) == []  # purged: delivered to nobody
    [dlq] = [t for t in json.loads(cli(backend, "ls", "--json").output) if t["topic"] == f"{topic.name}_dlq"]
    assert dlq["published"] == 4 and dlq["retained"] == 0
    one.close()
    two.close()


def test_groups_ls_and_drop(backend: Backend) -> None:
    name = f"cli-{uuid.uuid4().hex[:10]}"
    topic = Topic(backend.engine, name)
    topic.create(2)
    topic.publish_many([(f"k{i}", f"m{i}", i) for i in range(4)])
    fast, slow = Subscription(backend.engine, name, "fast", "f1"), Subscription(backend.engine, name, "slow", "s1")
    fast.rebalance()
    slow.rebalance()
    assert all(fast.ack_many(fast.poll(10)))
    fast.advance_watermarks()
    slow.poll(1)

    listed = {g["group"]: g for g in json.loads(cli(backend, "groups", "ls", name, "--json").output)}
    assert listed["fast"] == {"group": "fast", "partitions": 2, "lag": 0, "in_flight": 0, "subscribers": 1}
    assert listed["slow"] == {"group": "slow", "partitions": 2, "lag": 4, "in_flight": 1, "subscribers": 1}
    assert "IN_FLIGHT" in cli(backend, "groups", "ls", name).output

    assert cli(backend, "groups", "drop", name, "slow", input="n\n").exit_code == 1  # "no" changes nothing
    assert {g["group"] for g in json.loads(cli(backend, "groups", "ls", name, "--json").output)} == {"fast", "slow"}
    refused = cli(backend, "groups", "drop", name, "slow", "--yes")  # s1 holds its partitions
    assert refused.exit_code != 0 and "live subscribers (s1 holds partitions 0, 1)" in refused.output
    dropped = cli(backend, "groups", "drop", name, "slow", "--yes", "--force")
    assert dropped.exit_code == 0 and "group 'slow' dropped" in dropped.output
    assert [g["group"] for g in json.loads(cli(backend, "groups", "ls", name, "--json").output)] == ["fast"]
    assert topic.collect_garbage() == 4  # nothing waits for slow any more
    again = cli(backend, "groups", "drop", name, "slow", "--yes")
    assert again.exit_code == 2 and "does not read topic" in again.output
    bad = cli(backend, "groups", "drop", name, "no spaces", "--yes")
    assert bad.exit_code != 0 and "consumer group name" in bad.output
