"""Polling, locks and the transitions of a held message, driven by the manual clock."""

from __future__ import annotations

import datetime as dt

from conftest import START

from delayq import DelayedQueue, ManualClock, OfferOutcome

MINUTE = dt.timedelta(minutes=1)


def test_nothing_due_polls_none(queue: DelayedQueue) -> None:
    assert queue.try_poll() is None
    queue.offer("later", 1, at=MINUTE)
    assert queue.try_poll() is None
    assert queue.try_poll_many(10) == []


def test_due_messages_come_oldest_first_and_ack_deletes(queue: DelayedQueue, clock: ManualClock) -> None:
    queue.offer("second", 2, at=START + 2 * MINUTE)
    queue.offer("first", 1, at=START + MINUTE)
    queue.offer("third", 3, at=START + 3 * MINUTE)
    clock.advance(5 * MINUTE)
    batch = queue.try_poll_many(2)
    assert [(d.key, d.payload, d.attempts, d.redelivered) for d in batch] == [
        ("first", 1, 1, False),
        ("second", 2, 1, False),
    ]
    assert batch[0].scheduled_at == START + MINUTE
    assert batch[0].locked_until == clock.now() + MINUTE
    assert queue.ack_many(batch) == 2
    d = queue.try_poll()
    assert d is not None and d.key == "third"
    assert d.ack() is True
    assert d.ack() is False
    assert queue.get("third") is None
    assert queue.try_poll() is None


def test_unacked_message_is_delivered_again_after_the_visibility_timeout(
    queue: DelayedQueue, clock: ManualClock
) -> None:
    queue.offer("k", "v")
    first = queue.try_poll()
    assert first is not None and first.attempts == 1
    assert queue.try_poll() is None
    clock.advance(MINUTE - dt.timedelta(milliseconds=1))
    assert queue.try_poll() is None
    clock.advance(dt.timedelta(milliseconds=1))
    second = queue.try_poll()
    assert second is not None
    assert (second.key, second.attempts, second.redelivered) == ("k", 2, True)
    # The stale delivery can change nothing, and says so.
    assert first.ack() is False
    assert first.retry(error="late") is False
    assert first.extend(MINUTE) is False
    assert first.dead_letter(error="late") is False
    msg = queue.get("k")
    assert msg is not None and msg.attempts == 2 and msg.last_error is None and msg.locked
    assert queue.stats().dead == 0
    assert second.ack() is True


def test_update_of_a_held_message_voids_the_holders_ack(queue: DelayedQueue) -> None:
    queue.offer("k", "v1")
    held = queue.try_poll()
    assert held is not None
    assert queue.offer("k", "v2", update=True) is OfferOutcome.UPDATED
    assert held.ack() is False
    fresh = queue.try_poll()
    assert fresh is not None and fresh.payload == "v2" and fresh.attempts == 1
    assert fresh.ack() is True


def test_identical_offer_of_a_held_message_keeps_the_lock(queue: DelayedQueue) -> None:
    queue.offer("k", "v", at=START)
    held = queue.try_poll()
    assert queue.offer("k", "v", at=START, update=True) is OfferOutcome.IGNORED
    assert held is not None and held.ack() is True


def test_retry_releases_with_delay_and_keeps_the_error(queue: DelayedQueue, clock: ManualClock) -> None:
    queue.offer("k", "v")
    d = queue.try_poll()
    assert d is not None and d.retry(delay=10 * MINUTE, error="smtp timeout") is True
    msg = queue.get("k")
    assert msg is not None and msg.last_error == "smtp timeout" and not msg.locked
    assert msg.scheduled_at == clock.now() + 10 * MINUTE
    clock.advance(9 * MINUTE)
    assert queue.try_poll() is None
    clock.advance(MINUTE)
    again = queue.try_poll()
    assert again is not None and again.attempts == 2 and again.redelivered
    assert d.ack() is False and again.ack() is True


def test_extend_keeps_the_lock_past_the_timeout(queue: DelayedQueue, clock: ManualClock) -> None:
    queue.offer("k", "v")
    d = queue.try_poll()
    assert d is not None
    for _ in range(3):
        clock.advance(MINUTE / 2)
        assert d.extend(MINUTE) is True
    clock.advance(MINUTE / 2)
    assert queue.try_poll() is None
    assert d.ack() is True


def test_dead_letter_moves_the_message(queue: DelayedQueue, clock: ManualClock) -> None:
    queue.offer("k", {"to": "nobody"})
    d = queue.try_poll()
    assert d is not None and d.dead_letter(error="bad address") is True
    assert queue.get("k") is None
    assert d.ack() is False
    [dead] = queue.dead_letters()
    assert (dead.key, dead.payload, dead.attempts, dead.last_error) == ("k", {"to": "nobody"}, 1, "bad address")
    assert dead.failed_at == clock.now()
    assert queue.stats().dead == 1
    # The key is free again.
    assert queue.offer("k", "again") is OfferOutcome.CREATED


def test_cancel_and_reschedule(queue: DelayedQueue, clock: ManualClock) -> None:
    queue.offer("k", "v", at=START + 10 * MINUTE)
    assert queue.reschedule("k", at=MINUTE) is True
    assert queue.get("k").scheduled_at == START + MINUTE
    assert queue.reschedule("missing", at=MINUTE) is False
    clock.advance(MINUTE)
    held = queue.try_poll()
    assert held is not None
    assert queue.reschedule("k") is True  # now, and the holder's lock is gone
    assert held.ack() is False
    assert queue.cancel("k") is True
    assert queue.cancel("k") is False
    assert queue.get("k") is None


def test_stats_count_every_state(queue: DelayedQueue, clock: ManualClock) -> None:
    queue.offer_many([("r1", 1, None), ("r2", 2, None), ("s", 3, 10 * MINUTE), ("f", 4, None), ("x", 5, None)])
    [held_f] = [d for d in queue.try_poll_many(5) if d.key == "f"] or [None]
    assert held_f is not None
    stats = queue.stats()
    assert (stats.ready, stats.scheduled, stats.in_flight, stats.expired_locks, stats.dead) == (0, 1, 4, 0, 0)
    clock.advance(2 * MINUTE)
    stats = queue.stats()
    assert (stats.ready, stats.scheduled, stats.in_flight, stats.expired_locks) == (0, 1, 0, 4)
    assert stats.oldest_due_age == MINUTE  # the locks expired a minute ago


def test_stats_of_ready_messages(queue: DelayedQueue, clock: ManualClock) -> None:
    queue.offer("a", 1)
    clock.advance(MINUTE)
    queue.offer("b", 2)
    stats = queue.stats()
    assert (stats.ready, stats.scheduled, stats.in_flight, stats.oldest_due_age) == (2, 0, 0, MINUTE)
    assert queue.stats(using=queue.engine).ready == 2  # an Engine as using= runs in delayq's own transaction


def test_ack_many_across_claims_deletes_only_what_each_delivery_still_holds(
    queue: DelayedQueue, clock: ManualClock
) -> None:
    for i, key in enumerate("abc"):
        queue.offer(key, key, at=START + i * MINUTE)
    clock.advance(5 * MINUTE)
    a, b, c = (queue.try_poll() for _ in range(3))  # three claims, three lock tokens
    assert a is not None and b is not None and c is not None
    clock.advance(2 * MINUTE)  # every lock expires; another consumer takes "a" again
    again = queue.try_poll()
    assert again is not None and again.key == "a"
    assert queue.ack_many([a, b, c]) == 2  # "a" is not ours any more
    assert queue.get("a") is not None
    assert queue.get("b") is None and queue.get("c") is None
    assert again.ack() is True
