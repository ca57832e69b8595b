"""Compile-only tests that pin the SQL of offer, claim and ack per dialect, and one EXPLAIN."""

from __future__ import annotations

import re
import uuid

import pytest
from conftest import Backend
from sqlalchemy.dialects import mysql, postgresql, sqlite

from delayq.dialects import Dialect, dialect_class
from delayq.dialects.mysql import _due_ids, _lock_due_by_id
from delayq.dialects.postgresql import _claim_statement, _keep_held_statement
from delayq.dialects.sqlite import _lock_taken, _take_due
from delayq.schema import make_tables

SA_DIALECTS = {"postgresql": postgresql.dialect(), "mysql": mysql.dialect(), "sqlite": sqlite.dialect()}
NOW = {
    "postgresql": "CAST(floor(EXTRACT(epoch FROM statement_timestamp()) * 1000) AS BIGINT)",
    "mysql": "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)",
    "sqlite": "CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS BIGINT)",
}


def sql(name: str, pick: str) -> str:
    sa_dialect = SA_DIALECTS[name]
    dialect: Dialect = dialect_class(name)(sa_dialect)
    stmts = dialect.statements(make_tables(), False, True)  # as DelayedQueue makes them: notify on
    built = {"claim": _claim_statement if name == "postgresql" else _take_due, "due_ids": _due_ids}
    if pick in built:
        stmt = stmts.memo(built[pick], 10)
    elif pick in ("lock_due_by_id", "lock_taken"):
        stmt = stmts.memo(_lock_due_by_id if pick == "lock_due_by_id" else _lock_taken)
    elif pick == "keep_held":  # (a worker's background ack: SKIP LOCKED, no NOTIFY)
        stmt = stmts.memo(_keep_held_statement, True, False, False)
    else:
        stmt = getattr(stmts, pick)
    text = str(stmt.compile(dialect=sa_dialect)).replace(NOW[name], "<now>")
    return re.sub(r"\s+", " ", text).strip()


EXPECTED = {
    "postgresql": {
        "insert": (
            "WITH offered AS (INSERT INTO delayq_messages (queue, key, payload, payload_type, scheduled_at, "
            "scheduled_at_initially, created_at, attempts) VALUES (%(queue_name)s::VARCHAR, "
            "%(msg_key)s::VARCHAR, %(payload)s, %(payload_type)s::VARCHAR, coalesce(%(due_at)s::BIGINT, <now>"
            " + %(due_in)s::BIGINT), coalesce(%(due_at)s::BIGINT, <now> + %(due_in)s::BIGINT), <now>, "
            "%(param_1)s::INTEGER) ON CONFLICT (queue, key) DO NOTHING RETURNING delayq_messages.id, "
            "delayq_messages.queue) SELECT offered.id, pg_notify(%(pg_notify_2)s, offered.queue) AS "
            "pg_notify_1 FROM offered"
        ),
        "claim": (
            "WITH picked AS MATERIALIZED (SELECT delayq_messages.id AS id, delayq_messages.scheduled_at AS "
            "scheduled_at FROM delayq_messages WHERE delayq_messages.queue = %(queue_name)s::VARCHAR AND "
            "delayq_messages.scheduled_at <= <now> ORDER BY delayq_messages.scheduled_at, delayq_messages.id "
            "LIMIT 10 FOR UPDATE SKIP LOCKED) UPDATE delayq_messages SET scheduled_at=(<now> "
            "+ %(visibility)s::BIGINT), lock_token=%(token)s::VARCHAR, attempts=(delayq_messages.attempts + "
            "%(attempts_1)s::INTEGER) FROM picked WHERE delayq_messages.id = picked.id RETURNING "
            "delayq_messages.id, delayq_messages.key, delayq_messages.payload, delayq_messages.payload_type, "
            "picked.scheduled_at, delayq_messages.scheduled_at AS scheduled_at_1, delayq_messages.attempts, "
            "delayq_messages.created_at, delayq_messages.scheduled_at_initially, delayq_messages.lock_token, "
            "delayq_messages.tags, delayq_messages.priority, delayq_messages.group_key"
        ),
        "ack": (
            "DELETE FROM delayq_messages WHERE delayq_messages.lock_token = %(token)s::VARCHAR AND "
            "delayq_messages.id = ANY (%(ids)s::BIGINT[]) AND delayq_messages.unique_for_ms IS NULL"
        ),
        # The ack that keeps: one statement; the live row's priority and group go with it, the worker is one
        # bound value for every row.
        "keep_held": (
            "WITH picked AS MATERIALIZED (SELECT delayq_messages.id AS id FROM delayq_messages WHERE "
            "delayq_messages.lock_token = ANY (%(held_token_set)s::VARCHAR[]) AND (delayq_messages.id, "
            "delayq_messages.lock_token) IN (SELECT held.held_ids, held.held_tokens FROM unnest(%(held_ids)s::"
            "BIGINT[], %(held_tokens)s::VARCHAR[]) AS held(held_ids, held_tokens)) FOR UPDATE SKIP LOCKED), gone "
            "AS (DELETE FROM delayq_messages USING picked WHERE delayq_messages.id = picked.id AND "
            "delayq_messages.lock_token = ANY (%(held_token_set)s::VARCHAR[]) RETURNING delayq_messages.id, "
            "delayq_messages.unique_for_ms, delayq_messages.queue, delayq_messages.key, delayq_messages.payload, "
            "delayq_messages.payload_type, delayq_messages.scheduled_at_initially, delayq_messages.created_at, "
            "delayq_messages.attempts, delayq_messages.last_error, delayq_messages.attempt_history, "
            "delayq_messages.headers, delayq_messages.tags, delayq_messages.priority, delayq_messages.group_key), "
            "kept AS (INSERT INTO delayq_finished (queue, key, payload, payload_type, scheduled_at_initially, "
            "created_at, attempts, last_error, attempt_history, headers, tags, priority, group_key, state, "
            "finished_at, duration_ms, result, result_type, expires_at, worker) SELECT gone.queue AS queue, "
            "gone.key AS key, gone.payload AS payload, gone.payload_type AS payload_type, "
            "gone.scheduled_at_initially AS scheduled_at_initially, gone.created_at AS created_at, gone.attempts "
            "AS attempts, gone.last_error AS last_error, gone.attempt_history AS attempt_history, gone.headers AS "
            "headers, gone.tags AS tags, gone.priority AS priority, gone.group_key AS group_key, 1 AS state, "
            "<now> AS finished_at, extra.keep_durations AS keep_durations, extra.keep_results AS keep_results, "
            "extra.keep_result_types AS keep_result_types, <now> + greatest(%(retention_ms)s::BIGINT, "
            "coalesce(gone.unique_for_ms, %(coalesce_1)s::INTEGER)) AS expires_at, %(worker)s::VARCHAR AS worker "
            "FROM gone LEFT OUTER JOIN unnest(%(keep_ids)s::BIGINT[], %(keep_durations)s::BIGINT[], "
            "%(keep_results)s::BYTEA[], %(keep_result_types)s::VARCHAR[]) AS extra(keep_ids, keep_durations, "
            "keep_results, keep_result_types) ON gone.id = extra.keep_ids RETURNING delayq_finished.id) SELECT "
            "(SELECT count(*) AS count_1 FROM kept) AS kept"
        ),
    },
    "mysql": {
        "insert": (
            "INSERT INTO delayq_messages (queue, `key`, payload, payload_type, scheduled_at, "
            "scheduled_at_initially, created_at, attempts) VALUES (%s, %s, %s, %s, coalesce(%s, <now> + %s), "
            "coalesce(%s, <now> + %s), <now>, %s)"
        ),
        "due_ids": (
            "SELECT delayq_messages.id FROM delayq_messages WHERE delayq_messages.queue = %s AND "
            "delayq_messages.scheduled_at <= <now> ORDER BY delayq_messages.scheduled_at, delayq_messages.id "
            "LIMIT 10"
        ),
        "lock_due_by_id": (
            "SELECT delayq_messages.id, delayq_messages.`key`, delayq_messages.payload, "
            "delayq_messages.payload_type, delayq_messages.scheduled_at, delayq_messages.attempts, "
            "delayq_messages.created_at, delayq_messages.scheduled_at_initially, delayq_messages.tags, "
            "delayq_messages.priority, delayq_messages.group_key, <now> AS now FROM "
            "delayq_messages WHERE delayq_messages.id IN (__[POSTCOMPILE_ids]) AND delayq_messages.scheduled_at"
            " <= <now> FOR UPDATE SKIP LOCKED"
        ),
        "mark_claimed": (
            "UPDATE delayq_messages SET scheduled_at=%s, lock_token=%s, attempts=(delayq_messages.attempts + "
            "%s) WHERE delayq_messages.id IN (__[POSTCOMPILE_ids])"
        ),
        "ack": (
            "DELETE FROM delayq_messages WHERE delayq_messages.lock_token = %s AND delayq_messages.id IN "
            "(__[POSTCOMPILE_ids]) AND delayq_messages.unique_for_ms IS NULL"
        ),
    },
    "sqlite": {
        "insert": (
            'INSERT INTO delayq_messages (queue, "key", payload, payload_type, scheduled_at, '
            "scheduled_at_initially, created_at, attempts) VALUES (?, ?, ?, ?, coalesce(?, <now> + ?), "
            'coalesce(?, <now> + ?), <now>, ?) ON CONFLICT (queue, "key") DO NOTHING RETURNING id, queue'
        ),
        "claim": (
            "UPDATE delayq_messages SET lock_token=?, attempts=(delayq_messages.attempts + ?) WHERE "
            "delayq_messages.id IN (SELECT due.id FROM delayq_messages AS due WHERE due.queue = ? AND "
            "due.scheduled_at <= <now> ORDER BY due.scheduled_at, due.id LIMIT 10 OFFSET ?) RETURNING id, "
            '"key", payload, payload_type, scheduled_at, attempts, created_at, scheduled_at_initially, tags, '
            "priority, group_key, <now> AS now"
        ),
        "lock_taken": "UPDATE delayq_messages SET scheduled_at=? WHERE delayq_messages.lock_token = ?",
        "ack": (
            "DELETE FROM delayq_messages WHERE delayq_messages.lock_token = ? AND delayq_messages.id IN "
            "(SELECT anon_1.value FROM json_each(?) AS anon_1) AND delayq_messages.unique_for_ms IS NULL"
        ),
        # Every backend's dead letter (one row per message, each column bound): priority, group and worker too.
        "insert_dead": (
            'INSERT INTO delayq_dead_letters (queue, "key", payload, payload_type, scheduled_at_initially, '
            "created_at, attempts, last_error, attempt_history, headers, failed_at, tags, expires_at, priority, "
            "group_key, worker) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        ),
    },
}


@pytest.mark.parametrize(("name", "pick"), [(n, p) for n, picks in EXPECTED.items() for p in picks])
def test_the_emitted_sql_is_pinned(name: str, pick: str) -> None:
    assert sql(name, pick) == EXPECTED[name][pick]


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
def test_the_postgres_claim_uses_the_due_index_on_a_large_table(postgres: Backend, plan_cache_mode: str) -> None:
    # psycopg prepares a statement run five times; PostgreSQL may then plan it once for any
    # parameters (the generic plan). Tables of its own, made and dropped in the test's
    # transaction: the plan depends on their size, not on what other tests left behind.
    prefix = f"explain_{uuid.uuid4().hex[:8]}_"
    tables = make_tables(prefix)
    stmts = dialect_class("postgresql")(postgres.engine.dialect).statements(tables, False)
    with postgres.engine.connect() as conn:
        conn.begin()
        tables.metadata.create_all(conn)
        conn.exec_driver_sql(
            f"INSERT INTO {prefix}messages (queue, key, payload, payload_type, scheduled_at,"
            " scheduled_at_initially, created_at)"
            " SELECT 'explain-' || mod(g, 10), 'k' || g, '\\x00', 'json', g, g, 0"
            " FROM generate_series(1, 100000) AS g"
        )
        conn.exec_driver_sql(f"ANALYZE {prefix}messages")
        compiled = stmts.memo(_claim_statement, 10).compile(dialect=conn.dialect)
        expanded = compiled.construct_expanded_state(
            {"queue_name": "explain-3", "limit": 10, "token": "t", "visibility": 1}
        )
        names: list[str] = []

        def numbered(match: re.Match[str]) -> str:
            if match[1] not in names:
                names.append(match[1])
            return f"${names.index(match[1]) + 1}"

        conn.exec_driver_sql("PREPARE delayq_claim AS " + re.sub(r"%\((\w+)\)s", numbered, expanded.statement))
        conn.exec_driver_sql(f"SET LOCAL plan_cache_mode = {plan_cache_mode}")
        values = [expanded.parameters[n] for n in names]
        arguments = ", ".join(str(v) if isinstance(v, int) else "'" + str(v).replace("'", "''") + "'" for v in values)
        plan = "\n".join(conn.exec_driver_sql(f"EXPLAIN EXECUTE delayq_claim({arguments})").scalars())
        conn.exec_driver_sql("DEALLOCATE delayq_claim")  # prepared statements outlive the transaction
        conn.rollback()
    assert f"Index Scan using {prefix}messages_due_ix" in plan, plan
    assert f"Seq Scan on {prefix}messages" not in plan, plan
    assert "LockRows" in plan and "CTE picked" in plan, plan
