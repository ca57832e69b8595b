"""The pruner's statements: take the shared chore row, and delete kept rows past their expiry in bounded batches.

Every worker may try; the ``chores`` row decides which one prunes (no leader election): a conditional UPDATE
of a row whose lease ran out (database time), after a ``SELECT … FOR UPDATE SKIP LOCKED`` of it, so a row lock
held on it makes a worker skip this round rather than wait. The deletes pick their rows ``SKIP LOCKED`` too:
a kept row that another transaction holds is left for a later round.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from delayq.clock import Clock, duration_ms, to_ms
from delayq.dialects import Dialect
from delayq.schema import DEFAULT_PREFIX, Tables, make_tables
from delayq.transactions import DEFAULT_RETRY, Runner

PRUNE_CHORE = "prune"
"""The name of the pruner's row in the ``chores`` table."""
PRUNE_BATCH = 1000
"""Rows per DELETE."""
PRUNE_STATEMENTS = 3
"""DELETEs per table per round, at most."""


@dataclass(frozen=True, eq=False)
class _PruneStatements:
    ensure: sa.Insert
    lockable: sa.Select[Any]
    take: sa.Update
    done: sa.Update
    expired_finished: sa.Select[Any]
    delete_finished: sa.Delete
    expired_dead: sa.Select[Any]
    delete_dead: sa.Delete


def _statements(dialect: Dialect, tables: Tables, now: sa.ColumnElement[int], batch: int) -> _PruneStatements:
    chores, fin, dead = tables.chores, tables.finished, tables.dead_letters
    name = sa.bindparam("chore", type_=sa.String)
    me = sa.bindparam("me", type_=sa.String)
    ids: sa.BindParameter[Any] = sa.bindparam("ids", expanding=True)
    return _PruneStatements(
        ensure=dialect.topic_upsert(chores, ["name"], None).values(name=name, holder=None, expires_at=0),
        lockable=sa.select(chores.c.name)
        .where(chores.c.name == name, sa.or_(chores.c.expires_at <= now, chores.c.holder == me))
        .with_for_update(skip_locked=True),
        take=sa.update(chores)
        .where(chores.c.name == name)
        .values(holder=me, expires_at=now + sa.bindparam("lease", type_=sa.BigInteger)),
        done=sa.update(chores).where(chores.c.name == name, chores.c.holder == me).values(done_at=now),
        expired_finished=sa.select(fin.c.id)
        .where(fin.c.expires_at <= now)
        .order_by(fin.c.expires_at)
        .limit(batch)
        .with_for_update(skip_locked=True),
        delete_finished=sa.delete(fin).where(fin.c.id.in_(ids), fin.c.expires_at <= now),
        expired_dead=sa.select(dead.c.id)
        .where(dead.c.expires_at <= now)
        .order_by(dead.c.expires_at)
        .limit(batch)
        .with_for_update(skip_locked=True),
        delete_dead=sa.delete(dead).where(dead.c.id.in_(ids), dead.c.expires_at <= now),
    )


class Pruner:
    """Deletes kept rows (completed or cancelled messages, dead letters with a retention) past their expiry,
    while this process holds the shared ``chore`` row (``prune``). ``holder`` names the process (unique per worker);
    ``lease``: how long a round's claim on the chore holds (database time); ``batch``: rows per DELETE;
    ``statements``: DELETEs per table per round."""

    def __init__(
        self,
        engine: Engine,
        holder: str,
        *,
        table_prefix: str = DEFAULT_PREFIX,
        schema: str | None = None,
        clock: Clock | None = None,
        lease: dt.timedelta = dt.timedelta(minutes=2),
        batch: int = PRUNE_BATCH,
        statements: int = PRUNE_STATEMENTS,
        chore: str = PRUNE_CHORE,
    ) -> None:
        self.engine = engine
        self.holder = holder[:200]
        self.chore = chore
        self.clock = clock
        self.tables = make_tables(table_prefix, schema)
        self.lease_ms = duration_ms(lease, "lease")
        self.batch = batch
        self.statements = statements
        self._runner = Runner(engine, self.tables, DEFAULT_RETRY)
        self._ensured = False

    def _sql(self, dialect: Dialect) -> _PruneStatements:
        manual = self.clock is not None

        def build() -> _PruneStatements:
            now = sa.bindparam("now", type_=sa.BigInteger) if manual else dialect.now_ms()
            return _statements(dialect, self.tables, now, self.batch)

        return dialect.cached(("prune", self.tables, manual, self.batch), build)

    def _params(self) -> dict[str, Any]:
        now = {} if self.clock is None else {"now": to_ms(self.clock.now())}
        return {"chore": self.chore, "me": self.holder, "lease": self.lease_ms, **now}

    def take(self) -> bool:
        """Take (or keep) the chore for one lease, unless another process holds it; whether this one does."""
        params = self._params()
        if not self._ensured:

            def ensure(conn: Connection, dialect: Dialect) -> None:
                conn.execute(self._sql(dialect).ensure, params)

            self._runner.run(None, ensure, "statement")
            self._ensured = True

        def op(conn: Connection, dialect: Dialect) -> bool:
            sql = self._sql(dialect)
            if conn.execute(sql.lockable, params).first() is None:
                return False
            return bool(conn.execute(sql.take, params).rowcount == 1)

        return self._runner.run(None, op, "transaction")

    def prune(self) -> int:
        """One round: up to ``statements`` batches of expired finished rows, then of expired dead letters,
        each batch its own short transaction; how many rows were deleted."""
        params = self._params()
        deleted = 0
        for pick, delete in (("expired_finished", "delete_finished"), ("expired_dead", "delete_dead")):
            for _ in range(self.statements):

                def op(conn: Connection, dialect: Dialect, pick: str = pick, delete: str = delete) -> tuple[int, int]:
                    sql = self._sql(dialect)
                    ids = list(conn.execute(getattr(sql, pick), params).scalars())
                    if not ids:
                        return 0, 0
                    return len(ids), int(conn.execute(getattr(sql, delete), {**params, "ids": ids}).rowcount)

                picked, gone = self._runner.run(None, op, "transaction")
                deleted += gone
                if picked < self.batch:
                    break

        def done(conn: Connection, dialect: Dialect) -> None:
            conn.execute(self._sql(dialect).done, params)

        self._runner.run(None, done, "statement")
        return deleted

    def run_once(self) -> int | None:
        """``prune`` if this process holds (or takes) the chore; how many rows it deleted, or None."""
        return self.prune() if self.take() else None
