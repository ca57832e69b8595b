"""Names in topics: checked before anything is written, and the partition a key maps to."""

from __future__ import annotations

import re
import zlib

from delayq.errors import InvalidInputError, InvalidKeyError
from delayq.queue import check_text
from delayq.schema import MAX_GROUP_LENGTH, MAX_KEY_LENGTH, MAX_MESSAGE_ID_LENGTH, MAX_SUBSCRIBER_LENGTH

DLQ_SUFFIX = "_dlq"
"""A topic's dead letters are the topic ``{topic}_dlq``."""
MAX_TOPIC_NAME = 100 - len(DLQ_SUFFIX)
"""The longest topic name: its dead-letter topic's name must fit too."""
MAX_PARTITIONS = 100_000
_NAME = re.compile(r"[A-Za-z0-9._-]+")


def check_topic(name: object) -> str:
    """A topic name: letters, digits, ``.``, ``_`` and ``-``, at most 96 characters; ``InvalidInputError`` otherwise."""
    return _check_identifier(name, "topic name", MAX_TOPIC_NAME)


def check_topic_stored(name: object) -> str:
    """A topic name as stored: a topic's name or a dead-letter topic's (at most 100 characters)."""
    return _check_identifier(name, "topic name", MAX_TOPIC_NAME + len(DLQ_SUFFIX))


def check_group(name: object) -> str:
    """A consumer group name: letters, digits, ``.``, ``_`` and ``-``, at most 100 characters."""
    return _check_identifier(name, "consumer group name", MAX_GROUP_LENGTH)


def check_subscriber(name: object) -> str:
    """A subscriber name: any text of at most 200 characters without NUL."""
    return check_text(name, "subscriber name", MAX_SUBSCRIBER_LENGTH, InvalidInputError)


def check_partition_key(key: object) -> str:
    """A partition key: any text of at most 200 characters without NUL; ``InvalidKeyError`` otherwise."""
    return check_text(key, "partition key", MAX_KEY_LENGTH, InvalidKeyError)


def check_message_id(message_id: object) -> str:
    """A message id: any text of at most 200 characters without NUL; ``InvalidKeyError`` otherwise."""
    return check_text(message_id, "message id", MAX_MESSAGE_ID_LENGTH, InvalidKeyError)


def check_partitions(partitions: object) -> int:
    """A partition count: an int from 1 to 100,000."""
    if not isinstance(partitions, int) or isinstance(partitions, bool) or not 1 <= partitions <= MAX_PARTITIONS:
        raise InvalidInputError(f"partitions must be an int from 1 to {MAX_PARTITIONS}, got {partitions!r}")
    return partitions


def dead_letter_topic(topic: str) -> str:
    """The name of a topic's dead-letter topic."""
    return topic + DLQ_SUFFIX


def has_dead_letter_topic(topic: str) -> bool:
    """Whether ``topic`` can have a dead-letter topic: not one of 97-100 characters (itself a dead-letter
    topic, of a 93-96 character topic), whose ``{topic}_dlq`` would not fit."""
    return len(topic) <= MAX_TOPIC_NAME


def partition_for(key: str, partitions: int) -> int:
    """The partition of a key: CRC-32 of its UTF-8 bytes modulo the partition count.

    Stable across processes, machines and Python versions (``hash()`` is not), so every
    publisher puts one key in one partition.
    """
    return zlib.crc32(key.encode("utf-8")) % partitions


def _check_identifier(value: object, what: str, limit: int) -> str:
    text = check_text(value, what, limit, InvalidInputError)
    if not _NAME.fullmatch(text):
        raise InvalidInputError(f"{what} must be letters, digits, '.', '_' and '-' only, got {text!r}")
    return text
