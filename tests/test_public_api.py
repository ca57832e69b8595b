"""The public surface is small and deliberate: what __all__ names, documented."""

from __future__ import annotations

import inspect

import delayq

EXPECTED = {
    "BytesSerializer",
    "Clock",
    "DeadMessage",
    "DelayedQueue",
    "DelayqError",
    "Delivery",
    "InvalidInputError",
    "InvalidKeyError",
    "InvalidQueueError",
    "InvalidTimeError",
    "JsonSerializer",
    "ManualClock",
    "Message",
    "OfferOutcome",
    "PayloadError",
    "QueueStats",
    "SchemaMissingError",
    "SerializationMismatchError",
    "Serializer",
    "TextSerializer",
    "TransientRetry",
    "UnsupportedDatabaseError",
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
