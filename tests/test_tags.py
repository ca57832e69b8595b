"""Tags: offered with a message, validated, carried to its deliveries, dead letters and finished rows, and
filtered on with LIKE on every backend; through the sync and the async API (``api``)."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from conftest import count_rows

from delayq import DelayedQueue, OfferOutcome
from delayq.errors import InvalidInputError
from delayq.schema import make_tables
from delayq.tags import MAX_TAGS, decode_tags, encode_tags, tag_pattern


def test_tags_are_stored_sorted_once_between_commas() -> None:
    assert encode_tags(["b", "a", "b"]) == ",a,b,"
    assert encode_tags([]) is None and encode_tags(None) is None
    assert decode_tags(",a,b,") == ("a", "b") and decode_tags(None) == ()
    assert tag_pattern("a_b") == "%,a!_b,%"


@pytest.mark.parametrize(
    ("tags", "says"),
    [
        ("billing", "list of str"),
        (["Billing"], "lowercase"),
        (["a b"], "lowercase"),
        ([""], "1 to 50"),
        (["x" * 51], "1 to 50"),
        ([1], "must be a str"),
        ([f"t{i}" for i in range(MAX_TAGS + 1)], f"at most {MAX_TAGS}"),
    ],
)
def test_bad_tags_raise_one_clear_error_and_store_nothing(
    queue: DelayedQueue, engine: sa.Engine, tags: object, says: str
) -> None:
    with pytest.raises(InvalidInputError, match=says) as raised:
        queue.offer("k", 1, tags=tags)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)
    with pytest.raises(InvalidInputError):
        queue.offer_many([("a", 1, None), ("b", 1, None, tags)])  # type: ignore[list-item]
    assert count_rows(engine, queue.name) == 0


def test_tags_go_with_the_message_its_delivery_and_its_dead_letter(queue: DelayedQueue) -> None:
    assert queue.offer("k", 1, tags=["eu", "billing"]) is OfferOutcome.CREATED
    message = queue.get("k")
    assert message is not None and message.tags == ("billing", "eu")
    d = queue.try_poll()
    assert d is not None and d.tags == ("billing", "eu")
    assert d.dead_letter("no")
    [dead] = queue.dead_letters()
    assert dead.tags == ("billing", "eu")
    assert queue.requeue_dead("k")
    message = queue.get("k")
    assert message is not None and message.tags == ("billing", "eu")


def test_offer_many_takes_shared_tags_and_each_items_own(queue: DelayedQueue) -> None:
    outcomes = queue.offer_many([("a", 1, None), ("b", 2, None, ["vip"]), ("c", 3, None, None)], tags=["bulk"])
    assert outcomes == [OfferOutcome.CREATED] * 3
    tags = {k: m.tags for k in "abc" if (m := queue.get(k)) is not None}
    assert tags == {"a": ("bulk",), "b": ("vip",), "c": ()}
    assert queue.offer_many([("a", 1, None)], tags=["other"]) == [OfferOutcome.IGNORED]
    message = queue.get("a")
    assert message is not None and message.tags == ("bulk",)  # an ignored offer changes nothing


def test_a_replacement_sets_its_own_tags(queue: DelayedQueue) -> None:
    queue.offer("k", 1, tags=["old"])
    assert queue.offer("k", 2, update=True, tags=["new"]) is OfferOutcome.UPDATED
    message = queue.get("k")
    assert message is not None and message.tags == ("new",)
    assert queue.offer("k", 3, update=True) is OfferOutcome.UPDATED
    message = queue.get("k")
    assert message is not None and message.tags == ()


def test_the_like_filter_matches_whole_tags_only(queue: DelayedQueue, engine: sa.Engine) -> None:
    """``_`` is escaped (not a wildcard), and a tag never matches a longer one that contains it."""
    queue.offer("under", 1, tags=["a_b"])
    queue.offer("other", 1, tags=["axb", "a_bc", "xa_b"])
    queue.offer("none", 1, at=dt.timedelta(minutes=1))
    m = make_tables().messages
    with engine.connect() as conn:
        stmt = sa.select(m.c.key).where(m.c.queue == queue.name, m.c.tags.like(tag_pattern("a_b"), escape="!"))
        assert list(conn.execute(stmt).scalars()) == ["under"]
