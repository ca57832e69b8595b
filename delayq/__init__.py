"""delayq: delayed messages and background jobs in the relational database you already have."""

from delayq.clock import Clock, ManualClock
from delayq.cron import CronService, Schedule
from delayq.errors import (
    DelayqError,
    DeliveryCancelledError,
    InvalidInputError,
    InvalidKeyError,
    InvalidQueueError,
    InvalidTimeError,
    PayloadError,
    SchemaMissingError,
    SerializationMismatchError,
    UnknownMessageError,
    UnsupportedDatabaseError,
    WrongApiError,
)
from delayq.handler import DeadLetter, Handler, Retry
from delayq.messages import CancelOutcome, DeadMessage, Delivery, FlowState, Message, OfferOutcome, QueueStats
from delayq.queue import BulkOutcome, DelayedQueue
from delayq.retry import RetryPolicy
from delayq.serializers import BytesSerializer, JsonSerializer, Serializer, TextSerializer
from delayq.topics import LeaseLostError, Subscription, Topic, TopicDelivery, TopicHandler
from delayq.transactions import TransientRetry
from delayq.worker import Worker, WorkerHealth

__all__ = [
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
]
