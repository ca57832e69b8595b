"""The exceptions delayq raises.

Everything delayq raises on purpose derives from ``DelayqError``::

    DelayqError
    ├── InvalidInputError        bad arguments; nothing was written
    │   ├── InvalidKeyError      empty key, key over 200 characters, NUL, not a string or not text
    │   ├── InvalidQueueError    empty queue name, name over 100 characters
    │   ├── InvalidTimeError     naive datetime, wrong type for a time
    │   └── PayloadError         the serializer cannot encode the payload, or it is over 8 MiB
    ├── UnknownMessageError      ``wait(key)`` on a key with nothing under it: no live message, kept row or dead
    │                            letter (also a KeyError)
    ├── SerializationMismatchError   a stored row was written by another serializer
    ├── SchemaMissingError       delayq's tables are not there: run `delayq migrate`
    │   └── SchemaRevisionError  they are at another revision than this delayq's (older or newer)
    ├── UnknownRevisionError     a migration target that names none of delayq's revisions
    ├── MissingExtraError        an optional feature whose extra is not installed (also an ImportError)
    ├── UnsupportedDatabaseError a backend or server version delayq cannot run on
    ├── DeliveryCancelledError   a handler's delivery was cancelled or lost its lock (``raise_if_cancelled``)
    └── WrongApiError            an async engine or transaction given to the sync API, or the reverse
                                 (also a TypeError); it names the class to use

Database errors that are not delayq's (a constraint of yours, a lost connection in
your own transaction) pass through unchanged as SQLAlchemy exceptions.
"""

from __future__ import annotations


class DelayqError(Exception):
    """Base class of every error delayq raises on purpose."""


class InvalidInputError(DelayqError, ValueError):
    """An argument was rejected before anything was written."""


class InvalidKeyError(InvalidInputError):
    """A message key is empty, too long or not a string."""


class InvalidQueueError(InvalidInputError):
    """A queue name is empty, too long or not a string."""


class InvalidTimeError(InvalidInputError):
    """A time is naive, of the wrong type, or out of range."""


class PayloadError(InvalidInputError):
    """The queue's serializer cannot encode the payload."""


class UnknownMessageError(DelayqError, KeyError):
    """A key names no message of the queue: none live, none kept (``retention``) and no dead letter."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # (KeyError's own quotes its message)


class SerializationMismatchError(DelayqError):
    """A stored message carries another serializer's type tag than the queue's."""


class SchemaMissingError(DelayqError):
    """delayq's tables do not exist in the database."""


class SchemaRevisionError(SchemaMissingError):
    """delayq's tables are at an older revision than this delayq needs, or a newer one than it knows."""


class UnknownRevisionError(DelayqError):
    """A migration target names none of delayq's revisions."""


class MissingExtraError(DelayqError, ImportError):
    """An optional feature needs a package its extra installs."""


def install_hint(extra: str) -> str:
    """How to install ``extra`` (delayq is installed from its source tree, not from a package index)."""
    return f"pip install -e '.[{extra}]' in delayq's source tree"


class UnsupportedDatabaseError(DelayqError):
    """The database backend or server version cannot run delayq."""


class DeliveryCancelledError(DelayqError):
    """Raised by ``Delivery.raise_if_cancelled()``: the message was cancelled, or the lock lost; a worker records
    nothing for it (the message is gone, or another consumer has it)."""


class WrongApiError(DelayqError, TypeError):
    """An ``AsyncEngine``, ``AsyncConnection`` or ``AsyncSession`` given to the sync API, a sync one given to
    ``delayq.aio``, or a blocking method called on what the async API returned; the message names the fix."""
