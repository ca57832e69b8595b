"""What every part of ``DelayedQueue`` shares: its settings, its transactions, "now", and the payload codec."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine

from delayq import observe
from delayq.clock import Clock, duration_ms, to_ms
from delayq.dialects import Dialect, Statements
from delayq.errors import InvalidInputError, SerializationMismatchError
from delayq.queue._checks import check_queue_name
from delayq.queue._lifecycle import DEFAULT_RESULT_LIMIT, settings
from delayq.schema import DEFAULT_PREFIX, make_tables
from delayq.serializers import JsonSerializer, Serializer
from delayq.transactions import DEFAULT_RETRY, Runner, TransientRetry, Using

T = TypeVar("T")


class _QueueBase:
    """The constructor and the internals of ``DelayedQueue`` (documented there); its parts build on it."""

    def __init__(
        self,
        engine: Engine,
        name: str,
        *,
        visibility_timeout: dt.timedelta = dt.timedelta(minutes=5),
        serializer: Serializer | None = None,
        clock: Clock | None = None,
        table_prefix: str = DEFAULT_PREFIX,
        schema: str | None = None,
        transient_retry: TransientRetry = DEFAULT_RETRY,
        notify: bool = True,
        max_deliveries: int | None = None,
        flow_refresh: dt.timedelta = dt.timedelta(seconds=1),
        retention: dt.timedelta = dt.timedelta(0),
        keep_results: bool = True,
        result_limit: int = DEFAULT_RESULT_LIMIT,
        unique_for: dt.timedelta | None = None,
        dead_letter_retention: dt.timedelta | None = None,
    ) -> None:
        self.name = check_queue_name(name)
        self.engine = engine
        self.visibility_timeout = visibility_timeout
        self._visibility_ms = duration_ms(visibility_timeout, "visibility_timeout")
        if self._visibility_ms <= 0:
            raise InvalidInputError("visibility_timeout must be positive")
        self.serializer: Serializer = serializer or JsonSerializer()
        self.clock = clock
        self.notify = notify
        if max_deliveries is not None and max_deliveries < 1:
            raise InvalidInputError("max_deliveries must be at least 1")
        self.max_deliveries = max_deliveries
        flow_refresh_ms = duration_ms(flow_refresh, "flow_refresh")
        if flow_refresh_ms < 0:
            raise InvalidInputError("flow_refresh must not be negative")
        self._flow_refresh_s = flow_refresh_ms / 1000
        self.lifecycle = settings(retention, keep_results, result_limit, unique_for, dead_letter_retention)
        """How finished messages are kept (``retention``, ``keep_results``, ...; docs/lifecycle.md)."""
        self.tables = make_tables(table_prefix, schema)
        self._runner = Runner(engine, self.tables, transient_retry)
        self._claiming: str | None = None
        """The token of the claim under way, or of the last one whose reply never came (``_give_back``)."""
        self._tally: Callable[[observe.Event, str, int], None] | None = None
        """On a worker's queue, its outcome counter (``delayq.runtime._registry.Tally.count``): the queue history."""
        self._worker_id: str | None = None
        """On a worker's queue, the worker's registry id: its claims' deliveries carry it, and the kept rows their
        outcomes write record it (``finished.worker``, ``dead_letters.worker``)."""

    def __repr__(self) -> str:
        return f"DelayedQueue({self.name!r}, {self.engine.url.render_as_string(hide_password=True)!r})"

    def _count(self, event: observe.Event, n: int = 1) -> None:
        """Tell the observers, and a worker's tally, that ``n`` of this queue's messages had ``event``."""
        observe.count(event, self.name, n)
        if self._tally is not None and n:
            self._tally(event, self.name, n)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A connection in a transaction begun as delayq begins its own; committed on success.

        (``BEGIN IMMEDIATE`` on SQLite, READ COMMITTED on MySQL/MariaDB.) Pass it as ``using=``
        to make queue operations part of the same unit of work as your own statements. On PostgreSQL
        and MariaDB the server ends it when it sits idle longer than the visibility timeout.
        """
        with self._runner.owned("transaction", idle_timeout=self._visibility_ms / 1000) as conn:
            yield conn

    def run(self, operation: Callable[[Connection], T], *, using: Using = None) -> T:
        """Run ``operation(conn)`` in one transaction: delayq's own (retried whole on transient errors)
        or the caller's. Pass ``conn`` as ``using=`` to the queue operations inside."""
        return self._runner.run(using, lambda conn, _: operation(conn), "transaction")

    def _statements(self, dialect: Dialect) -> Statements:
        return dialect.statements(self.tables, self.clock is not None, self.notify)

    def _now_param(self) -> dict[str, int]:
        return {} if self.clock is None else {"now": to_ms(self.clock.now())}

    def _now_ms(self, conn: Connection, stmts: Statements) -> int:
        if self.clock is not None:
            return to_ms(self.clock.now())
        return int(conn.execute(stmts.now_select).scalar_one())

    def _decode(self, key: str, payload_type: str, payload: bytes) -> Any:
        tag = self.serializer.type_tag
        if payload_type != tag:
            raise SerializationMismatchError(
                f"message {key!r} in queue {self.name!r} was written as {payload_type!r} but this queue "
                f"reads {tag!r}: use the serializer that wrote it, or cancel the message"
            )
        try:
            return self.serializer.loads(bytes(payload))
        except (TypeError, ValueError) as exc:
            raise SerializationMismatchError(
                f"message {key!r} in queue {self.name!r} cannot be decoded as {tag!r}: {exc}"
            ) from exc
