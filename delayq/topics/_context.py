"""What a topic and a subscription share: the engine, where the tables are, the clock, the runner."""

from __future__ import annotations

from typing import TypeVar

from sqlalchemy.engine import Connection, Engine

from delayq.clock import Clock, to_ms
from delayq.dialects import Dialect
from delayq.errors import InvalidInputError
from delayq.schema import DEFAULT_PREFIX, make_tables
from delayq.topics.statements import TopicStatements, statements_for
from delayq.transactions import DEFAULT_RETRY, Runner, TransientRetry

T = TypeVar("T")


class TopicContext:
    """The engine, the tables, the clock and the runner of one topic's operations."""

    def __init__(
        self,
        engine: Engine,
        *,
        clock: Clock | None,
        table_prefix: str = DEFAULT_PREFIX,
        schema: str | None = None,
        transient_retry: TransientRetry = DEFAULT_RETRY,
        owner: str = "Topic",
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.prefix, self.schema = table_prefix, schema
        self.tables = make_tables(table_prefix, schema)
        self.runner = Runner(engine, self.tables, transient_retry, owner)

    def stmts(self, dialect: Dialect) -> TopicStatements:
        return statements_for(dialect, self.prefix, self.schema, self.clock is not None)

    def now_param(self) -> dict[str, int]:
        """The ``:now`` bind parameter on an injected clock; nothing on the database's clock."""
        return {} if self.clock is None else {"now": to_ms(self.clock.now())}

    def now(self, conn: Connection, stmts: TopicStatements) -> int:
        """Now, in epoch ms: the injected clock's, or the database's (one round trip)."""
        if self.clock is not None:
            return to_ms(self.clock.now())
        return int(conn.execute(stmts.now).scalar_one())

    def partitions(self, conn: Connection, stmts: TopicStatements, topic: str) -> int:
        """A topic's partition count; ``InvalidInputError`` for a topic that was never created."""
        found = conn.execute(stmts.partitions, {"topic_name": topic}).scalar()
        if found is None:
            raise InvalidInputError(f"topic {topic!r} does not exist: create it first (Topic.create(partitions=N))")
        return int(found)
