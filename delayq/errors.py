"""The exceptions delayq raises.

Everything delayq raises on purpose derives from ``DelayqError``::

    DelayqError
    ├── InvalidInputError        bad arguments; nothing was written
    │   ├── InvalidKeyError      empty key, key over 200 characters, NUL, not a string or not text
    │   ├── InvalidQueueError    empty queue name, name over 100 characters
    │   ├── InvalidTimeError     naive datetime, wrong type for a time
    │   └── PayloadError         the serializer cannot encode the payload, or it is over 8 MiB
    ├── SerializationMismatchError   a stored row was written by another serializer
    ├── SchemaMissingError       delayq's tables are not there: run `delayq migrate`
    ├── UnsupportedDatabaseError a backend or server version delayq cannot run on
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


class SerializationMismatchError(DelayqError):
    """A stored message carries another serializer's type tag than the queue's."""


class SchemaMissingError(DelayqError):
    """delayq's tables do not exist in the database."""


class UnsupportedDatabaseError(DelayqError):
    """The database backend or server version cannot run delayq."""


class WrongApiError(DelayqError, TypeError):
    """An ``AsyncEngine``, ``AsyncConnection`` or ``AsyncSession`` given to the sync API, a sync one given to
    ``delayq.aio``, or a blocking method called on what the async API returned; the message names the fix."""
