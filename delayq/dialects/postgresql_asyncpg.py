"""PostgreSQL on asyncpg (``postgresql+asyncpg://``, the async API only): what differs from psycopg.

The SQL is PostgreSQL's (``PostgresDialect``); the driver differs in four places here, and in the
call bound (``bounds``: the socket is the asyncio transport's, asyncpg's connection has no ``fileno``):

- transactions: SQLAlchemy's asyncpg adapter begins its own transaction (``BEGIN`` through asyncpg)
  before the first statement, and asyncpg prepares every statement, which takes one command only. So
  delayq sends no ``BEGIN`` of its own: a transaction of several statements gets its idle bound (and
  the batch claim's planner setting) from one ``set_config(..., true)`` query, the ``SET LOCAL`` of a
  prepared statement, which ends with the transaction.
- arrays: asyncpg sends every list parameter in binary already (no dumper to teach).
- errors: besides SQLSTATE (the adapter copies it), a statement prepared before a migration changed a
  table fails once with ``InvalidCachedStatementError``; the adapter then empties its statement cache,
  so delayq's own transaction is retried.
- LISTEN: asyncpg delivers notifications to a callback (``add_listener``), not an iterator
  (``postgresql_async``, which listens through the driver of the engine it is given).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from sqlalchemy.exc import DBAPIError

from delayq.dialects.base import Mode, OwnedStart
from delayq.dialects.postgresql import PostgresDialect

__all__ = ["AsyncpgDialect", "transaction_settings"]


def transaction_settings(idle_s: float | None, sort: bool = True) -> str | None:
    """One query that sets, for the transaction it runs in, what ``postgresql.bounded_begin`` sets after
    its BEGIN (``set_config(name, value, true)`` is ``SET LOCAL``); None when there is nothing to set."""
    settings = []
    if not sort:
        settings.append("set_config('enable_sort', 'off', true)")
    if idle_s is not None:
        timeout = f"{max(1, round(idle_s * 1000))}ms"
        settings.append(f"set_config('idle_in_transaction_session_timeout', '{timeout}', true)")
    return "SELECT " + ", ".join(settings) if settings else None


class AsyncpgDialect(PostgresDialect):
    """``PostgresDialect`` on asyncpg (see the module's note)."""

    # asyncpg's connect arguments: ``timeout`` (seconds to connect); it has no keepalive settings of its own.
    network_timeouts: ClassVar[dict[str, int]] = {"timeout": 10}

    def owned_start(
        self, mode: Mode, autocommitting: bool, idle_s: float | None = None, session: Mapping[str, Any] | None = None
    ) -> OwnedStart:
        # One statement: autocommit, as on psycopg (the adapter then begins no transaction).
        if mode in ("read", "statement", "scan"):
            return OwnedStart(autocommit=not autocommitting, commit=False)
        # Several: the adapter's BEGIN (it begins before the first statement), then the settings. On an
        # engine in autocommit the adapter would begin and commit nothing: READ COMMITTED for this one.
        settings = transaction_settings(idle_s, sort=mode != "ordered")
        isolation = "READ COMMITTED" if autocommitting else None
        return OwnedStart(isolation_level=isolation, sql=(settings,) if settings else ())

    def prepare(self, driver_connection: Any) -> None:
        # asyncpg sends lists as binary arrays by itself.
        return

    def is_transient(self, exc: DBAPIError) -> bool:
        return super().is_transient(exc) or _stale_statement(exc)


def _stale_statement(exc: DBAPIError) -> bool:
    """A statement asyncpg prepared before the table it reads changed (a migration ran): the adapter has
    emptied its cache by now, and the transaction's next attempt prepares it afresh."""
    cause = exc.orig.__cause__ if exc.orig is not None else None
    return type(cause).__name__ == "InvalidCachedStatementError"
