"""delayq: delayed messages and background jobs in the relational database you already have."""

from delayq.clock import Clock, ManualClock
from delayq.errors import (
    DelayqError,
    InvalidInputError,
    InvalidKeyError,
    InvalidQueueError,
    InvalidTimeError,
    PayloadError,
    SchemaMissingError,
    SerializationMismatchError,
    UnsupportedDatabaseError,
)
from delayq.messages import DeadMessage, Delivery, Message, OfferOutcome, QueueStats
from delayq.queue import DelayedQueue
from delayq.serializers import BytesSerializer, JsonSerializer, Serializer, TextSerializer
from delayq.transactions import TransientRetry

__all__ = [
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
]
