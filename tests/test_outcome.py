"""The one outcome decision (``delayq._outcome``), over its whole table: no database."""

from __future__ import annotations

import datetime as dt

import pytest

from delayq import DeadLetter, Retry, RetryPolicy
from delayq._outcome import ACK, Bury, RetryAfter, TimedOut, Unfinished, after_failure, decide, used_up

S = dt.timedelta(seconds=1)
POLICY = RetryPolicy(max_attempts=3, initial_delay=10 * S, multiplier=2.0, max_delay=dt.timedelta(hours=1), jitter=0)


@pytest.mark.parametrize("attempts", [1, 3, 99])
def test_returned_is_acked_whatever_the_attempts(attempts: int) -> None:
    assert decide(None, attempts, POLICY) == ACK
    assert decide(None, attempts, max_attempts=1) == ACK


@pytest.mark.parametrize("attempts", [1, 3])
def test_dead_letter_buries_at_once_with_its_reason(attempts: int) -> None:
    assert decide(DeadLetter("no address"), attempts, POLICY) == Bury("no address")
    assert decide(DeadLetter("no address"), attempts) == Bury("no address")  # no cap: buried all the same


@pytest.mark.parametrize(
    ("attempts", "expected"),
    [
        (1, RetryAfter(10 * S, "ValueError: boom")),
        (2, RetryAfter(20 * S, "ValueError: boom")),
        (3, Bury("ValueError: boom")),
    ],
)
def test_a_failure_follows_the_policy(attempts: int, expected: object) -> None:
    assert decide(ValueError("boom"), attempts, POLICY) == expected


@pytest.mark.parametrize(
    ("error", "attempts", "expected"),
    [
        (Retry(after=5 * S, reason="later"), 1, RetryAfter(5 * S, "later", requested=True)),
        (Retry(reason="later"), 2, RetryAfter(20 * S, "later", requested=True)),  # no after: the policy's delay
        (Retry(), 1, RetryAfter(10 * S, "retry requested", requested=True)),
        (Retry(after=5 * S, reason="later"), 3, Bury("later")),  # it counts as an attempt: the last one buries
        (Retry(after=5 * S), 3, Bury("retry requested")),
    ],
)
def test_a_requested_retry_counts_as_an_attempt(error: Exception, attempts: int, expected: object) -> None:
    assert decide(error, attempts, POLICY) == expected


def test_a_timeout_is_a_failed_attempt() -> None:
    error = TimedOut(dt.timedelta(seconds=30))
    first = decide(error, 1, POLICY)
    assert isinstance(first, RetryAfter) and first.delay == 10 * S and not first.requested
    assert first.error == "TimedOut: cancelled at its timeout of 30.0s"
    assert decide(error, 3, POLICY) == Bury(first.error)


@pytest.mark.parametrize(("attempts", "cap", "buried"), [(1, 2, False), (2, 2, True), (5, 2, True), (9, None, False)])
def test_the_claim_cap_of_deliveries_without_an_outcome(attempts: int, cap: int | None, buried: bool) -> None:
    # Queues and topics alike: ``attempts`` earlier deliveries ended with no outcome at all.
    got = decide(Unfinished(attempts), attempts, max_attempts=cap)
    if buried:
        assert got == Bury(f"delivered {attempts} times without an outcome")
    else:
        assert got == RetryAfter(dt.timedelta(0), f"delivered {attempts} times without an outcome")


def test_without_a_policy_a_retry_is_due_at_once_unless_it_names_a_delay() -> None:
    assert decide(ValueError("x"), 1, max_attempts=3) == RetryAfter(dt.timedelta(0), "ValueError: x")
    assert decide(Retry(after=S, reason="r"), 2, max_attempts=3) == RetryAfter(S, "r", requested=True)
    assert decide(Retry(after=S, reason="r"), 3, max_attempts=3) == Bury("r")


def test_a_policy_that_overrides_gives_up_after_is_obeyed() -> None:
    class Never(RetryPolicy):
        def gives_up_after(self, attempts: int) -> bool:
            return False

    never = Never(max_attempts=1, initial_delay=S, jitter=0)
    assert decide(ValueError("x"), 50, never) == RetryAfter(dt.timedelta(hours=1), "ValueError: x")  # capped delay
    assert used_up(50, never, 1) is False
    assert used_up(1, None, 1) and not used_up(0, None, 1) and not used_up(10**6, None, None)


def test_after_failure_never_acks() -> None:
    assert isinstance(after_failure(ValueError(), 1, POLICY), RetryAfter)
