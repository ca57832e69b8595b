"""Flow control of a queue, kept in the database: pause and resume, and claims by priority.

Each queue whose flow was ever set has a row in ``{prefix}queue_flow``: whether it is paused, and whether
it was ever offered a priority. A claimer reads that row at most once per ``flow_refresh`` (1 s by default)
and keeps it meanwhile, so a queue that never had either costs its claims nothing: they send the same one
statement as before (docs/workers.md, "Flow control"). A paused queue's claims return nothing without a
statement, and read the row again each time, so a resume counts at the next claim.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from delayq.dialects import ClaimedRow, Dialect, Mode, Statements
from delayq.errors import InvalidInputError
from delayq.messages import FlowState
from delayq.queue._base import _QueueBase
from delayq.transactions import Using

MIN_PRIORITY = -1000
MAX_PRIORITY = 1000
"""The range of a message's priority; 0 unless an offer sets one. Higher is claimed first."""


def check_priority(priority: object) -> int:
    """Return a valid priority or raise ``InvalidInputError``."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidInputError(f"priority must be an int, got {type(priority).__name__}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidInputError(f"priority must be from {MIN_PRIORITY} to {MAX_PRIORITY}, got {priority}")
    return priority


class _FlowStatements:
    """The statements over ``{prefix}queue_flow`` and the priority claim's, built once per ``Statements``."""

    def __init__(self, stmts: Statements) -> None:
        flow, m = stmts.tables.flow, stmts.tables.messages
        queue = sa.bindparam("queue_name", type_=sa.String)
        self.read = sa.select(flow.c.paused, flow.c.priorities).where(flow.c.queue == queue)
        # The highest priority below :below among the queue's messages: one probe of the priority index (as an
        # ORDER BY … LIMIT 1, not max(): PostgreSQL's planner on stale statistics answers max() from a scan of
        # the queue's rows, while the claim's transaction, its sorting off, must walk the index for this).
        self.top_level = (
            sa.select(m.c.priority)
            .with_hint(m, f"FORCE INDEX ({m.name}_priority_ix)", dialect_name="mysql")
            .where(m.c.queue == queue, m.c.priority < sa.bindparam("below", type_=sa.Integer))
            .order_by(m.c.priority.desc())
            .limit(1)
        )
        self.set_priority = (
            sa.update(m)
            .where(m.c.queue == queue, m.c.key.in_(sa.bindparam("keys", expanding=True)))
            .values(priority=sa.bindparam("new_priority", type_=sa.Integer))
        )

    @staticmethod
    def upsert(dialect: Dialect, stmts: Statements, column: str) -> sa.Executable:
        """Insert the queue's flow row with ``column`` set to ``:value``, or set it in the row that exists."""
        flow = stmts.tables.flow
        value = sa.bindparam("value", type_=sa.SmallInteger)
        defaults: dict[str, Any] = {"paused": 0, "priorities": 0, column: value}
        return dialect.topic_upsert(flow, ["queue"], {column: value, "updated_at": stmts.now}).values(
            queue=sa.bindparam("queue_name", type_=sa.String), updated_at=stmts.now, **defaults
        )


def _flow_statements(stmts: Statements) -> _FlowStatements:
    return _FlowStatements(stmts)


def _upsert(stmts: Statements, dialect: Dialect, column: str) -> sa.Executable:
    return _FlowStatements.upsert(dialect, stmts, column)


class _Flow(_QueueBase):
    """``pause``, ``resume`` and ``flow`` of ``DelayedQueue``, and the cached flow state its claims consult."""

    _flow_state: FlowState | None = None
    _flow_read_at = 0.0

    def pause(self, *, using: Using = None) -> None:
        """Pause the queue: every claimer's claims take nothing within its ``flow_refresh`` (1 s by default).

        Stored in the database (it outlives every process). Offers are still accepted; messages held
        already run to their end. ``resume`` ends it.
        """
        self._set_flow("paused", 1, using)

    def resume(self, *, using: Using = None) -> None:
        """End a pause: claimers take messages again at their next claim (on PostgreSQL, listening
        workers are woken at once)."""
        self._set_flow("paused", 0, using)

    def flow(self, *, using: Using = None) -> FlowState:
        """The queue's flow settings as stored now (no cache)."""
        params = {"queue_name": self.name}

        def op(conn: Connection, dialect: Dialect) -> FlowState:
            row = conn.execute(self._statements(dialect).memo(_flow_statements).read, params).first()
            return FlowState() if row is None else FlowState(bool(row.paused), bool(row.priorities))

        state = self._runner.run(using, op, "read")
        self._remember_flow(state)
        return state

    def _set_flow(self, column: str, value: int, using: Using) -> None:
        params = {"queue_name": self.name, "value": value, **self._now_param()}

        def op(conn: Connection, dialect: Dialect) -> None:
            stmts = self._statements(dialect)
            conn.execute(stmts.memo(_upsert, dialect, column), params)
            if column == "paused" and not value and stmts.notify is not None:
                conn.execute(stmts.notify, params)  # wake listening workers now

        self._runner.run(using, op, "statement" if column != "paused" or value else "transaction")
        self._flow_state = None  # read afresh at the next claim

    def _remember_flow(self, state: FlowState) -> None:
        self._flow_state, self._flow_read_at = state, time.monotonic()

    def _cached_flow(self, using: Using = None) -> FlowState:
        """The flow state, read at most once per ``flow_refresh`` (through ``using``); while paused, at every call."""
        state = self._flow_state
        if state is None or state.paused or time.monotonic() - self._flow_read_at >= self._flow_refresh_s:
            state = self.flow(using=using)
        return state

    def _set_priorities(self, conn: Connection, dialect: Dialect, keys: list[str], priority: int) -> None:
        """Give the messages just offered under ``keys`` their priority, and mark the queue as having priorities
        (once per queue object: the mark is never taken back)."""
        stmts = self._statements(dialect)
        fs = stmts.memo(_flow_statements)
        for start in range(0, len(keys), 500):
            params = {"queue_name": self.name, "keys": keys[start : start + 500], "new_priority": priority}
            conn.execute(fs.set_priority, params)
        if priority and not self._priorities_marked:
            params = {"queue_name": self.name, "value": 1, **self._now_param()}
            conn.execute(stmts.memo(_upsert, dialect, "priorities"), params)

    _priorities_marked = False

    def _priorities_set(self, priority: int, using: Using) -> None:
        """After an offer in delayq's own transaction committed with ``priority``: the queue's mark is stored
        (see ``_set_priorities``); in the caller's, it may yet roll back, so later offers mark it again."""
        if priority and not self._priorities_marked and (using is None or isinstance(using, Engine)):
            self._priorities_marked = True
            self._flow_state = None  # this object's own claims take priorities into account at once

    def _claim_levels(
        self, conn: Connection, dialect: Dialect, stmts: Statements, params: dict[str, Any]
    ) -> list[ClaimedRow]:
        """Claim up to ``params['limit']`` due messages highest priority first: for each priority level present,
        from the top, the backend's claim restricted to that level (an index range scan of the priority index),
        until enough were claimed or no level is left."""
        fs = stmts.memo(_flow_statements)
        limit, below = params["limit"], MAX_PRIORITY + 1
        claimed: list[ClaimedRow] = []
        while len(claimed) < limit:
            level = conn.execute(fs.top_level, {"queue_name": self.name, "below": below}).scalar()
            if level is None:
                break
            level_params = {**params, "limit": limit - len(claimed), "at_priority": int(level)}
            claimed += dialect.claim(conn, stmts, level_params, self._visibility_ms, level=True)
            below = int(level)
        return claimed

    @staticmethod
    def _levels_mode(dialect: Dialect, limit: int) -> Mode:
        """A priority claim is several statements: a transaction, with PostgreSQL's sorting off."""
        mode = dialect.claim_mode_for(max(limit, 2))
        return "transaction" if mode in ("statement", "writes") else mode
