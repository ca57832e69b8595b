"""The public surface is small and deliberate: what __all__ names, documented."""

from __future__ import annotations

import inspect

import delayq

EXPECTED = {
    "BulkOutcome",
    "BytesSerializer",
    "CancelOutcome",
    "Clock",
    "CronService",
    "DeadLetter",
    "DeadMessage",
    "DelayedQueue",
    "DelayqError",
    "Delivery",
    "DeliveryCancelledError",
    "FlowState",
    "Handler",
    "InvalidInputError",
    "InvalidKeyError",
    "InvalidQueueError",
    "InvalidTimeError",
    "JsonSerializer",
    "LeaseLostError",
    "ManualClock",
    "Message",
    "OfferOutcome",
    "PayloadError",
    "QueueStats",
    "Retry",
    "RetryPolicy",
    "Schedule",
    "SchemaMissingError",
    "SerializationMismatchError",
    "Serializer",
    "Subscription",
    "TextSerializer",
    "Topic",
    "TopicDelivery",
    "TopicHandler",
    "TransientRetry",
    "UnknownMessageError",
    "UnsupportedDatabaseError",
    "Worker",
    "WorkerHealth",
    "WrongApiError",
}


def test_all_names_the_public_surface() -> None:
    assert set(delayq.__all__) == EXPECTED
    public = {n for n in dir(delayq) if not n.startswith("_") and inspect.isclass(getattr(delayq, n))}
    assert public == EXPECTED


def test_every_public_name_and_method_has_a_docstring() -> None:
    for name in delayq.__all__:
        obj = getattr(delayq, name)
        assert inspect.getdoc(obj), name
    for name, member in inspect.getmembers(delayq.DelayedQueue, inspect.isfunction):
        if not name.startswith("_"):
            assert member.__doc__, f"DelayedQueue.{name}"


def test_the_readme_states_the_minimum_versions_the_dialects_enforce() -> None:
    from conftest import REPO_ROOT

    from delayq.dialects.mysql import MARIADB_MIN, MYSQL_MIN
    from delayq.dialects.postgresql import PostgresDialect
    from delayq.dialects.sqlite import SQLiteDialect

    readme = (REPO_ROOT / "README.md").read_text()
    for product, version in [
        ("PostgreSQL", PostgresDialect.min_version),
        ("MariaDB", MARIADB_MIN),
        ("MySQL", MYSQL_MIN),
        ("SQLite", SQLiteDialect.min_version),
    ]:
        assert f"{product} {'.'.join(map(str, version))} or newer" in readme, product
