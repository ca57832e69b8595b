"""What PostgreSQL's two listeners share, the thread's (``postgresql``) and the coroutine's
(``postgresql_async``): a leaf, so that neither imports the other."""

PING = ""
"""The payload of the listener's own test notification (no queue has an empty name)."""
LISTEN_PING_AFTER = 10.0
"""Seconds without a notification after which the listener checks its connection."""
LISTEN_PING_TIMEOUT = 5.0
"""Seconds the listener waits for its test notification before it gives up on the connection."""


class ListenStalledError(Exception):
    """The LISTEN connection stopped delivering notifications; the caller reconnects."""


CANCEL_SUFFIX = "_cancel"
"""The cancel channel is the wake-up channel's name (the messages table's) with this suffix: its payload is the id
of a message that ``DelayedQueue.cancel_job`` cancelled while locked."""
CANCELLED = "\x00"
"""What the listeners put before a cancel channel's payload when they yield it: NUL, which no queue name (the wake-up
channel's payloads) holds."""
