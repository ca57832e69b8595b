"""Bad input raises a DelayqError a user can act on, and writes nothing."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import count_rows

from delayq import (
    BytesSerializer,
    DelayedQueue,
    DelayqError,
    InvalidInputError,
    InvalidKeyError,
    InvalidQueueError,
    InvalidTimeError,
    PayloadError,
    RetryPolicy,
    SchemaMissingError,
    SerializationMismatchError,
    TransientRetry,
    UnsupportedDatabaseError,
)
from delayq.dialects import dialect_class
from delayq.dialects.mysql import check_version
from delayq.schema import metadata

NAIVE = dt.datetime(2030, 1, 1)


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        (lambda q: q.offer("k", 1, at=NAIVE), InvalidTimeError, "naive"),
        (lambda q: q.offer("k", 1, at="tomorrow"), InvalidTimeError, "datetime"),
        (lambda q: q.offer("", 1), InvalidKeyError, "empty"),
        (lambda q: q.offer("k" * 201, 1), InvalidKeyError, "at most 200"),
        (lambda q: q.offer(42, 1), InvalidKeyError, "str"),
        (lambda q: q.offer("k", {1, 2}), PayloadError, "serialized"),
        (lambda q: q.offer("k", float("nan")), PayloadError, "serialized"),
        (lambda q: q.offer_many([("ok", 1, None), ("bad", object(), None)]), PayloadError, "serialized"),
        (lambda q: q.offer_many([("ok", 1, None), ("late", 1, NAIVE)]), InvalidTimeError, "naive"),
        (lambda q: q.try_poll_many(0), InvalidInputError, "positive"),
        (lambda q: q.reschedule("k", at=NAIVE), InvalidTimeError, "naive"),
    ],
)
def test_bad_input_is_refused_and_writes_nothing(
    queue: DelayedQueue,
    engine: sa.Engine,
    queue_name: str,
    call: Callable[[DelayedQueue], Any],
    error: type[DelayqError],
    says: str,
) -> None:
    with pytest.raises(error, match=says):
        call(queue)
    assert count_rows(engine, queue_name) == 0


@pytest.mark.parametrize("name", ["", "q" * 101, None])
def test_bad_queue_names_are_refused(engine: sa.Engine, name: Any) -> None:
    with pytest.raises(InvalidQueueError):
        DelayedQueue(engine, name)


def test_a_key_of_200_characters_fits(queue: DelayedQueue) -> None:
    key = "ķ" * 200
    queue.offer(key, 1)
    assert queue.get(key) is not None


def test_a_row_of_another_serializer_is_dead_lettered_and_the_rest_of_the_claim_delivered(
    make_queue: Callable[..., DelayedQueue],
) -> None:
    raw = make_queue(serializer=BytesSerializer())
    as_json = make_queue()
    as_json.offer("a-good", 1, at=dt.timedelta(0))
    raw.offer("b-poisoned", b"\x00\xff", at=dt.timedelta(0))
    as_json.offer("c-good", 3, at=dt.timedelta(0))
    with pytest.raises(SerializationMismatchError, match="'bytes'"):
        as_json.get("b-poisoned")
    got = as_json.try_poll_many(10)
    assert sorted(d.key for d in got) == ["a-good", "c-good"]
    assert as_json.ack_many(got) == 2
    assert raw.get("b-poisoned") is None
    [dead] = raw.dead_letters()
    assert dead.key == "b-poisoned" and dead.payload == b"\x00\xff"
    assert dead.last_error is not None and "'bytes'" in dead.last_error


def test_missing_tables_say_to_run_migrate(engine: sa.Engine) -> None:
    q = DelayedQueue(engine, "q", table_prefix="not_migrated_")
    with pytest.raises(SchemaMissingError, match="delayq migrate"):
        q.offer("k", 1)
    with pytest.raises(SchemaMissingError, match="delayq migrate"):
        q.try_poll()
    with engine.connect() as conn, pytest.raises(SchemaMissingError):
        q.stats(using=conn)


@pytest.mark.parametrize(
    ("version", "mariadb"), [((10, 5, 22), True), ((10, 3, 0), True), ((8, 0, 0), False), ((5, 7, 44), False)]
)
def test_servers_without_skip_locked_are_refused(version: tuple[int, ...], mariadb: bool) -> None:
    with pytest.raises(UnsupportedDatabaseError, match="SKIP LOCKED"):
        check_version(version, mariadb)


@pytest.mark.parametrize(("version", "mariadb"), [((10, 6, 0), True), ((10, 11, 19), True), ((8, 0, 1), False)])
def test_servers_with_skip_locked_are_accepted(version: tuple[int, ...], mariadb: bool) -> None:
    check_version(version, mariadb)


def test_unsupported_backends_are_refused() -> None:
    with pytest.raises(UnsupportedDatabaseError, match="supported: mariadb, mysql, postgresql, sqlite"):
        dialect_class("oracle")


@pytest.mark.parametrize(
    "url", ["postgresql+psycopg://postgres@127.0.0.1:1/test", "mysql+mysqldb://root@127.0.0.1:1/test"]
)
def test_a_server_that_cannot_be_reached_raises_sqlalchemys_error(url: str) -> None:
    engine = sa.create_engine(url)
    queue = DelayedQueue(engine, "unreachable", transient_retry=TransientRetry(attempts=2, first_delay=0.001))
    with pytest.raises(sa.exc.OperationalError):
        queue.offer("k", 1)
    with pytest.raises(sa.exc.OperationalError):
        queue.try_poll()


def test_times_and_durations_outside_the_stored_range_are_refused_and_change_nothing(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine, queue_name: str
) -> None:
    q = make_queue()
    for at in (dt.timedelta(days=-800_000), dt.timedelta(days=40_000), dt.datetime(9500, 1, 1, tzinfo=dt.UTC)):
        with pytest.raises(InvalidTimeError, match="out of range"):
            q.offer("k", 1, at=at)
    with pytest.raises(InvalidTimeError, match="out of range"):
        q.offer_many([("ok", 1, None), ("bad", 1, dt.datetime(1960, 1, 1, tzinfo=dt.UTC))])
    with pytest.raises(InvalidTimeError, match="out of range"):
        make_queue(visibility_timeout=dt.timedelta(days=3_000_000))
    assert count_rows(engine, queue_name) == 0


def test_retry_delays_stay_capped_however_many_attempts() -> None:
    policy = RetryPolicy()
    assert all(policy.delay(n) <= policy.max_delay * 1.1 for n in (44, 100, 5000))


def test_a_stored_time_no_datetime_can_hold_is_read_not_a_crash(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine, queue_name: str
) -> None:
    """As written by an older delayq that accepted any time: it reads as the earliest datetime."""
    q = make_queue()
    q.offer_many([("good", 1, None), ("odd", 2, None)])
    m = metadata.tables["delayq_messages"]
    with engine.begin() as conn:
        conn.execute(
            sa.update(m)
            .where(m.c.queue == queue_name, m.c.key == "odd")
            .values(scheduled_at_initially=-70_000_000 * 86_400_000)
        )
    got = {d.key: d for d in q.try_poll_many(10)}
    assert set(got) == {"good", "odd"}
    assert got["odd"].scheduled_at_initially.year == 1
    assert got["odd"].dead_letter("inspect it")
    assert q.dead_letters()[0].scheduled_at_initially.year == 1


@pytest.mark.parametrize("key", ["nul\x00inside", "surrogate\udc80"])
def test_keys_a_database_cannot_store_are_refused_on_every_backend(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine, queue_name: str, key: str
) -> None:
    with pytest.raises(InvalidKeyError):
        make_queue().offer(key, 1)
    assert count_rows(engine, queue_name) == 0


def test_payloads_too_deep_or_too_large_get_a_payload_error(
    make_queue: Callable[..., DelayedQueue], engine: sa.Engine, queue_name: str
) -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    q = make_queue()
    with pytest.raises(PayloadError, match="nested too deeply"):
        q.offer("deep", deep)
    with pytest.raises(PayloadError, match="at most"):
        q.offer("large", "x" * (9 * 1024 * 1024))
    assert count_rows(engine, queue_name) == 0
