"""Offers: dedupe by key, replace with update=True, batches in order."""

from __future__ import annotations

import datetime as dt

import pytest
from conftest import START, count_rows

from delayq import BytesSerializer, DelayedQueue, ManualClock, OfferOutcome

C, U, IG = OfferOutcome.CREATED, OfferOutcome.UPDATED, OfferOutcome.IGNORED
HOUR = dt.timedelta(hours=1)


def test_offer_creates_then_ignores_the_same_key(queue: DelayedQueue) -> None:
    assert queue.offer("welcome-42", {"user": 42}, at=HOUR) is C
    assert queue.offer("welcome-42", {"user": 43}, at=2 * HOUR) is IG
    msg = queue.get("welcome-42")
    assert msg is not None
    assert msg.payload == {"user": 42}
    assert msg.scheduled_at == START + HOUR
    assert msg.attempts == 0 and msg.last_error is None and not msg.locked


def test_update_replaces_and_identical_content_is_ignored(queue: DelayedQueue) -> None:
    at = START + HOUR
    assert queue.offer("k", {"v": 1}, at=at) is C
    assert queue.offer("k", {"v": 1}, at=at, update=True) is IG
    assert queue.offer("k", {"v": 2}, at=at, update=True) is U
    assert queue.offer("k", {"v": 2}, at=at + HOUR, update=True) is U
    msg = queue.get("k")
    assert msg is not None and msg.payload == {"v": 2} and msg.scheduled_at == at + HOUR


def test_same_key_in_two_queues_is_two_messages(make_queue, queue_name: str) -> None:  # type: ignore[no-untyped-def]
    a, b = make_queue(), make_queue(name=queue_name + "-other")
    assert a.offer("k", 1) is C
    assert b.offer("k", 2) is C
    assert a.get("k").payload == 1 and b.get("k").payload == 2


def test_keys_are_case_and_space_sensitive(queue: DelayedQueue) -> None:
    assert [queue.offer(k, k) for k in ("Key", "key", "KEY", "ключ", "Ключ")] == [C] * 5


def test_at_defaults_to_now_and_takes_aware_datetimes_in_any_zone(queue: DelayedQueue) -> None:
    queue.offer("now", 1)
    berlin = dt.timezone(dt.timedelta(hours=1))
    queue.offer("later", 2, at=dt.datetime(2030, 1, 1, 2, 0, tzinfo=berlin))
    assert queue.get("now").scheduled_at == START
    assert queue.get("later").scheduled_at == START + HOUR


def test_offer_many_reports_outcomes_in_input_order(queue: DelayedQueue) -> None:
    queue.offer("b", "old")
    outcomes = queue.offer_many([("a", 1, None), ("b", 2, HOUR), ("c", 3, START + HOUR), ("a", 4, None)])
    assert outcomes == [C, IG, C, IG]
    assert queue.get("a").payload == 1 and queue.get("b").payload == "old"
    assert queue.get("c").scheduled_at == START + HOUR


def test_offer_many_with_update_replaces_existing(queue: DelayedQueue) -> None:
    queue.offer_many([("a", 1, None), ("b", 2, None)])
    outcomes = queue.offer_many([("a", 1, None), ("b", 20, None), ("c", 3, None), ("c", 30, None)], update=True)
    assert outcomes == [IG, U, C, U]
    assert [queue.get(k).payload for k in "abc"] == [1, 20, 30]


def test_offer_many_large_batch_spans_chunks(queue: DelayedQueue, engine, queue_name: str) -> None:  # type: ignore[no-untyped-def]
    items = [(f"k{i}", {"i": i}, dt.timedelta(seconds=i)) for i in range(1203)]
    assert queue.offer_many(items) == [C] * 1203
    assert queue.offer_many(items[::2]) == [IG] * 602
    assert count_rows(engine, queue_name) == 1203
    assert queue.offer_many([]) == []


def test_offer_many_keeps_keys_and_bytes_that_array_and_string_literals_would_escape(make_queue) -> None:  # type: ignore[no-untyped-def]
    # PostgreSQL binds a batch as arrays: quotes, braces, commas, backslashes, NULL-like text and
    # bytes of every value come back as they went in, through the batch and the claim.
    queue = make_queue(serializer=BytesSerializer())
    keys = ['a"b', "{c,d}", "e\\f", "NULL", "()", " ", "ключ", "x'y", "ü"]
    payloads = [bytes(range(256)), b"", b"\x00", b"\\x41", b'{"a":1}', b"NULL", b"\xff" * 3, b",", b"}"]
    assert queue.offer_many([(k, p, None) for k, p in zip(keys, payloads, strict=True)]) == [C] * len(keys)
    assert {d.key: d.payload for d in queue.try_poll_many(20)} == dict(zip(keys, payloads, strict=True))


def test_offer_many_of_large_payloads_fits_each_statement_in_a_packet(make_queue) -> None:  # type: ignore[no-untyped-def]
    # 10 MiB in one call: MySQL/MariaDB split the rows over statements of at most 4 MiB of payload,
    # under the server's max_allowed_packet; a key that exists makes its part fall back and no other.
    queue = make_queue(serializer=BytesSerializer())
    blob = bytes(range(256)) * (6 * 4096)  # 6 MiB
    queue.offer("big-1", b"already here")
    items = [(f"big-{i}", blob[: (i + 1) * 1024 * 1024], None) for i in range(4)]  # 1 + 2 + 3 + 4 MiB
    assert queue.offer_many(items) == [C, IG, C, C]
    assert queue.get("big-3").payload == blob[: 4 * 1024 * 1024]
    assert queue.get("big-1").payload == b"already here"


def test_database_clock_is_used_without_an_injected_clock(make_queue) -> None:  # type: ignore[no-untyped-def]
    q = make_queue(clock=None)
    before = dt.datetime.now(dt.UTC)
    q.offer("a", 1, at=HOUR)
    q.offer_many([("b", 2, HOUR)])
    after = dt.datetime.now(dt.UTC)
    slack = dt.timedelta(seconds=5)  # the database's clock may differ a little from ours
    for key in "ab":
        msg = q.get(key)
        assert before + HOUR - slack <= msg.scheduled_at <= after + HOUR + slack
        assert before - slack <= msg.created_at <= after + slack


def test_manual_clock_moves_time(clock: ManualClock) -> None:
    assert clock.advance(HOUR) == START + HOUR
    clock.set(START)
    assert clock.now() == START


@pytest.mark.parametrize("prefix", ["invoice/", "a%", "a_", "a\\", "ü/", "x/"])
def test_prefix_operations_compare_keys_byte_for_byte(queue: DelayedQueue, prefix: str) -> None:
    """Case matters, and %, _ and \\ are ordinary characters, on every backend (SQLite's LIKE ignores case)."""
    under = [prefix + "1", prefix + "Zz", prefix]
    others = ["Invoice/1", "INVOICE/3", "invoice", "a", "ab", "a1", "aX", "Ü/1", "u/1", "x.", "x0", "w/"]
    others = [k for k in others if not k.startswith(prefix)]
    queue.offer_many([(k, 1, None) for k in under + others])
    assert queue.cancel_prefix(prefix) == len(under)
    assert all(queue.get(k) is None for k in under)
    assert all(queue.get(k) is not None for k in others)


def test_cancel_prefix_keeps_the_kept_prefix(queue: DelayedQueue) -> None:
    queue.offer_many([(k, 1, None) for k in ["r/a/1", "r/a/2", "r/b/1", "r/B/1", "s/a/1"]])
    assert queue.cancel_prefix("r/", keep_prefix="r/a/") == 2
    assert [k for k in ["r/a/1", "r/a/2", "r/b/1", "r/B/1", "s/a/1"] if queue.get(k)] == ["r/a/1", "r/a/2", "s/a/1"]
