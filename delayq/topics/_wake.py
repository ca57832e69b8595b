"""Wake-ups for topics: a publish notifies listening workers when it commits (PostgreSQL LISTEN/NOTIFY).

The notification travels on the queues' channel (the messages table's name, one LISTEN connection per
worker for both), its payload ``topic:{name}``. A queue whose name happens to read the same only costs a
worker of that topic one spare poll. Where the database cannot notify, subscribers poll as before.
"""

from __future__ import annotations

from sqlalchemy.engine import Connection

from delayq.dialects import Dialect
from delayq.schema import Tables

PREFIX = "topic:"
"""What a topic's notification payload starts with (then the topic's name)."""


def payload(topic: str) -> str:
    """The notification payload that wakes the subscribers of ``topic``."""
    return PREFIX + topic


def notify(conn: Connection, dialect: Dialect, tables: Tables, topic: str) -> None:
    """Wake the workers listening for ``topic`` once this transaction commits (nothing where the
    database cannot notify). PostgreSQL folds equal notifications of one transaction into one."""
    if not dialect.can_notify:
        return
    statement = dialect.cached(("topic_wake", tables), lambda: dialect.notify_statement(tables))
    if statement is not None:
        conn.execute(statement, {"queue_name": payload(topic)})


def channel(dialect: Dialect, tables: Tables, topic: str) -> tuple[str, str] | None:
    """(channel, payload) of the notification that wakes ``topic``'s subscribers, for a statement that sends
    it itself; None where the database cannot notify."""
    return (tables.messages.name, payload(topic)) if dialect.can_notify else None
