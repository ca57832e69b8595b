"""The claim walks the due index whatever the table's statistics say.

A queue table is where statistics go stale fastest (and many servers run without autovacuum): a
planner that believes the table nearly empty takes a sort of every due row for free. On a table of
20,000 due messages, analyzed while empty or after the fill, the statements a batch claim sends are
replayed under ``EXPLAIN`` exactly as delayq sent them (its session settings included): the due index
`(queue, scheduled_at, id)`, and no sort.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, make_engine

from delayq import DelayedQueue, ManualClock, migrations

PREFIX = "plan_"
DUE_INDEX = f"{PREFIX}messages_due_ix"
ROWS = 20_000


def analyze(conn: sa.Connection, backend: str) -> None:
    table = f"{PREFIX}messages"
    conn.exec_driver_sql({"mysql": f"ANALYZE TABLE {table}"}.get(backend, f"ANALYZE {table}"))


@pytest.fixture
def stale_table(backend: Backend) -> Iterator[sa.Engine]:
    """delayq's tables under their own prefix, emptied, analyzed, autovacuum off (PostgreSQL)."""
    migrations.upgrade(backend.url, prefix=PREFIX)
    engine = make_engine(backend.url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {PREFIX}messages")
        conn.exec_driver_sql(f"DELETE FROM {PREFIX}queue_flow")  # no priorities or limits left by another test
        if backend.name == "postgresql":
            conn.exec_driver_sql(f"ALTER TABLE {PREFIX}messages SET (autovacuum_enabled = false)")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        analyze(conn, backend.name)
    try:
        yield engine
    finally:
        engine.dispose()


def claim_statements(engine: sa.Engine, queue: DelayedQueue) -> list[tuple[str, Any]]:
    """What ``try_poll_many(100)`` sends, in order, as (SQL, parameters) for the driver."""
    sent: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        sent.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        assert len(queue.try_poll_many(100)) == 100
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    return sent


def explain(engine: sa.Engine, backend: str, sent: list[tuple[str, Any]], ordered_by: str = "scheduled_at") -> str:
    """The plan of the statement that picks due rows, with what delayq sent before it in its transaction."""
    picks = [i for i, (sql, _) in enumerate(sent) if "ORDER BY" in sql and ordered_by in sql]
    assert picks, f"no pick among {[sql for sql, _ in sent]}"
    pick = picks[0]
    prefix = {"sqlite": "EXPLAIN QUERY PLAN ", "mysql": "EXPLAIN FORMAT=JSON "}.get(backend, "EXPLAIN ")
    with engine.connect() as conn:
        for sql, params in sent[:pick]:
            if "SET " in sql.upper() and not params:  # the session settings it sent (PostgreSQL: with BEGIN)
                conn.exec_driver_sql(sql)
        sql, params = sent[pick]
        rows = conn.exec_driver_sql(prefix + sql, params).all()
        conn.rollback()
    return "\n".join(" | ".join(str(c) for c in row) for row in rows)


@pytest.mark.parametrize("analyzed", ["while empty", "after the fill"])
def test_a_batch_claim_walks_the_due_index_whatever_the_statistics(
    stale_table: sa.Engine, backend: Backend, analyzed: str
) -> None:
    clock = ManualClock(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    q = DelayedQueue(stale_table, "plan", clock=clock, table_prefix=PREFIX)
    for start in range(0, ROWS, 2000):
        q.offer_many([(f"k{i}", i, dt.timedelta(seconds=-i)) for i in range(start, start + 2000)])
    if analyzed == "after the fill":
        with stale_table.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            analyze(conn, backend.name)
    plan = explain(stale_table, backend.name, claim_statements(stale_table, q))
    print(plan)
    assert DUE_INDEX in plan, plan
    assert "Sort" not in plan and "TEMP B-TREE" not in plan and "filesort" not in plan.lower(), plan


PRIORITY_INDEX = f"{PREFIX}messages_priority_ix"


@pytest.mark.parametrize("analyzed", ["while empty", "after the fill"])
def test_a_priority_claim_walks_the_priority_index_one_level_at_a_time(
    stale_table: sa.Engine, backend: Backend, analyzed: str
) -> None:
    """A queue offered priorities claims one level at a time, top first: a probe of the priority index for the
    highest level, then the claim restricted to it, an index range scan in due order, no sort."""
    clock = ManualClock(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    q = DelayedQueue(stale_table, "plan", clock=clock, table_prefix=PREFIX)
    for start in range(0, ROWS, 2000):
        priority = 0 if start < ROWS // 2 else 5
        items = [(f"k{i}", i, dt.timedelta(seconds=-i)) for i in range(start, start + 2000)]
        q.offer_many(items, priority=priority)
    if analyzed == "after the fill":
        with stale_table.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            analyze(conn, backend.name)
    sent = claim_statements(stale_table, q)
    plan = explain(stale_table, backend.name, sent)
    print(plan)
    assert (f'"key": "{PRIORITY_INDEX}"' if backend.name == "mysql" else PRIORITY_INDEX) in plan, plan
    assert "Sort" not in plan and "TEMP B-TREE" not in plan and "filesort" not in plan.lower(), plan
    tops = [i for i, (sql, _) in enumerate(sent) if "ORDER BY" in sql and "priority DESC" in sql]
    assert tops, sent
    top = explain(stale_table, backend.name, sent[: tops[0] + 1], "priority DESC")
    print(top)
    assert (f'"key": "{PRIORITY_INDEX}"' if backend.name == "mysql" else PRIORITY_INDEX) in top, top
    assert "Seq Scan" not in top and "Bitmap" not in top and "TEMP B-TREE" not in top, top
    assert "filesort" not in top.lower() and "Sort" not in top, top


@pytest.mark.parametrize("analyzed", ["while empty", "after the fill"])
def test_a_limited_claim_counts_the_held_messages_through_the_lock_token_index(
    stale_table: sa.Engine, backend: Backend, analyzed: str
) -> None:
    """A queue with a concurrency limit counts its held messages at each claim: through the lock-token index's
    non-NULL entries (the held messages of every queue: a few), never the queue's scheduled ones; and its claim
    is still the due index's walk."""
    clock = ManualClock(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    q = DelayedQueue(stale_table, "plan", clock=clock, table_prefix=PREFIX)
    for start in range(0, ROWS, 2000):
        q.offer_many([(f"k{i}", i, dt.timedelta(seconds=i - ROWS // 2)) for i in range(start, start + 2000)])
    q.set_concurrency_limit(1000)
    if analyzed == "after the fill":
        with stale_table.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            analyze(conn, backend.name)
    sent = claim_statements(stale_table, q)
    plan = explain(stale_table, backend.name, sent)
    assert (f'"key": "{DUE_INDEX}"' if backend.name == "mysql" else DUE_INDEX) in plan, plan
    counts = [i for i, (sql, _) in enumerate(sent) if "count(" in sql.lower() and "lock_token IS NOT NULL" in sql]
    assert counts, sent
    prefix = {"sqlite": "EXPLAIN QUERY PLAN ", "mysql": "EXPLAIN FORMAT=JSON "}.get(backend.name, "EXPLAIN ")
    sql, params = sent[counts[0]]
    with stale_table.connect() as conn:
        for before, before_params in sent[: counts[0]]:
            if "SET " in before.upper() and not before_params:
                conn.exec_driver_sql(before)
        count_plan = "\n".join(" | ".join(map(str, r)) for r in conn.exec_driver_sql(prefix + sql, params))
        conn.rollback()
    print(count_plan)
    lock_index = f"{PREFIX}messages_lock_ix"
    assert (f'"key": "{lock_index}"' if backend.name == "mysql" else lock_index) in count_plan, count_plan
    assert "Seq Scan" not in count_plan and "SCAN " + PREFIX not in count_plan, count_plan


def held_statements(engine: sa.Engine, act: Any) -> list[tuple[str, Any]]:
    """What ``act()`` sends that names held messages by (id, lock token), as (SQL, parameters)."""
    sent: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if "lock_token" in statement and "WHERE" in statement:
            sent.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        act()
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    return sent


def test_acks_and_heartbeats_of_held_messages_probe_the_primary_key_with_one_statement_text(
    stale_table: sa.Engine, backend: Backend
) -> None:
    """A worker acks and extends held messages in batches of every size: on SQLite and PostgreSQL the (id, token)
    pairs are bound whole (a JSON text; two arrays), so the statement text is the same for 3 pairs and for 60;
    on a table of 20,000 messages analyzed while empty the plan finds the rows through an index: the primary
    key on SQLite and MySQL/MariaDB, the lock tokens' on PostgreSQL, every scan with an index condition. (A
    planner that believes the table empty took a probe per id for dearer than a walk of a whole index: a JSON
    parameter and an array of ids both got the lock-token index scanned end to end, and the join back to the
    picked rows once walked the due index for each of them.)"""
    q = DelayedQueue(stale_table, "plan", table_prefix=PREFIX)
    for start in range(0, ROWS, 2000):
        q.offer_many([(f"k{i}", i, None) for i in range(start, start + 2000)])
    held = q.try_poll_many(100)
    small = held_statements(stale_table, lambda: q.extend_many(held[:3], dt.timedelta(minutes=1)))
    large = held_statements(stale_table, lambda: q.extend_many(held[3:63], dt.timedelta(minutes=1)))
    acks = held_statements(stale_table, lambda: q.ack_many(held[:63], skip_locked=True))
    assert q.ack_many(held[63:], skip_locked=True) == 37
    if backend.name != "mysql":
        assert [sql for sql, _ in small] == [sql for sql, _ in large]
    prefix = {"sqlite": "EXPLAIN QUERY PLAN ", "postgresql": "EXPLAIN (COSTS OFF) "}.get(backend.name, "EXPLAIN ")
    primary = {"sqlite": "INTEGER PRIMARY KEY", "postgresql": f"{PREFIX}messages_lock_ix"}.get(backend.name, "PRIMARY")
    for sql, params in [*large, *acks]:
        with stale_table.connect() as conn:
            plan = "\n".join(" | ".join(map(str, row)) for row in conn.exec_driver_sql(prefix + sql, params))
            conn.rollback()
        assert primary in plan, plan
        assert "SCAN " + PREFIX not in plan, plan
        if backend.name == "postgresql":
            assert "Seq Scan" not in plan and "due_ix" not in plan, plan
            assert plan.count("Index Cond") == plan.count("Index Scan"), plan  # no scan of a whole index
