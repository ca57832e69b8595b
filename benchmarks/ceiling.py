"""The raw-SQL ceiling: the statements delayq issues, sent straight through the driver.

Each function does the same work as its delayq counterpart with the fewest round trips the
backend allows (autocommit for single statements, one multi-row statement per batch), on a
DBAPI connection of its own. Offers bind the same values delayq binds (queue, key, payload,
payload type, times, attempts); they do not wake workers (delayq's PostgreSQL offers NOTIFY).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa

Raw = Any  # a DBAPI connection: psycopg, MySQLdb or sqlite3

NOW_MS = {
    "postgresql": "CAST(floor(EXTRACT(epoch FROM statement_timestamp()) * 1000) AS BIGINT)",
    "mysql": "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)",
    "sqlite": "CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS BIGINT)",
}


CPU_RUNS: list[tuple[float, float]] = []
"""(delayq, ceiling) CPU seconds per message of each run of the scenario being measured; ``measure``
empties it before a scenario and reports it after (scenarios that measure it append to it)."""

# delayq, the same statements by hand on SQLAlchemy (benchmarks/stack.py, the topic ceilings' stack
# connection) and the bare driver take turns call by call, the order rotating, so each ratio is measured in
# one stretch of the shared machine's time. The Figure's ceiling is the stack; ``bare`` beside it.
BARE_RUNS: list[tuple[float, float, float]] = []
"""(stack rate, bare rate, bare CPU s/msg) of each run of the stack scenario being measured."""


def three_way(n: int, calls: list[Callable[[int], object]], per_call: int = 1) -> tuple[float, float, list[float]]:
    """Run ``calls`` = [delayq, stack, bare], each ``n // per_call`` times (argument: the call's index), in
    rotating order; (delayq rate, stack rate, delayq's call times) of ``n`` messages each, the bare figures
    in ``BARE_RUNS``."""
    seconds, cpu = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    ours: list[float] = []
    for i in range(n // per_call):
        for j in range(3):
            side = (i + j) % 3
            fn = calls[side]
            c0, t0 = time.process_time(), time.perf_counter()
            fn(i)
            took = time.perf_counter() - t0
            seconds[side] += took
            cpu[side] += time.process_time() - c0
            if side == 0:
                ours.append(took)
    done = (n // per_call) * per_call
    CPU_RUNS.append((cpu[0] / done, cpu[1] / done))
    BARE_RUNS.append((done / seconds[1], done / seconds[2], cpu[2] / done))
    return done / seconds[0], done / seconds[1], ours


def connect(engine: sa.Engine, autocommit: bool) -> Raw:
    """A driver connection of its own, outside SQLAlchemy's pool."""
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    raw = engine.dialect.loaded_dbapi.connect(*cargs, **cparams)
    name = engine.dialect.name
    if name == "postgresql":
        raw.autocommit = autocommit
    elif name in ("mysql", "mariadb"):
        raw.autocommit(autocommit)
        raw.cursor().execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    else:
        raw.isolation_level = None  # we send BEGIN ourselves
        raw.execute("PRAGMA busy_timeout = 30000")
    return raw


def _ph(name: str) -> str:
    return "?" if name == "sqlite" else "%s"


def offer_one(name: str, table: str) -> Callable[[Raw, str, bytes], None]:
    p, now = _ph(name), NOW_MS[name]
    conflict = "" if name == "mysql" else " ON CONFLICT (queue, key) DO NOTHING"
    sql = (
        f"INSERT INTO {table} (queue, {_key(name)}, payload, payload_type, scheduled_at, scheduled_at_initially,"
        f" created_at, attempts) VALUES ({p}, {p}, {p}, {p}, {now}, {now}, {now}, {p}){conflict}"
    )

    def run(raw: Raw, key: str, payload: bytes) -> None:
        raw.cursor().execute(sql, ("bench", key, payload, "json", 0))

    return run


def offer_batch(name: str, table: str) -> Callable[[Raw, Sequence[tuple[str, bytes]], int], None]:
    p = _ph(name)
    conflict = "" if name == "mysql" else " ON CONFLICT (queue, key) DO NOTHING"
    row = f"({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})"
    head = (
        f"INSERT INTO {table} (queue, {_key(name)}, payload, payload_type, scheduled_at,"
        f" scheduled_at_initially, created_at, attempts) VALUES "
    )

    if name == "postgresql":  # the statement delayq sends: an array per varying column, sent binary (%b)
        unnest = (
            f"INSERT INTO {table} (queue, key, payload, payload_type, scheduled_at, scheduled_at_initially,"
            " created_at) SELECT %s, k, p, %s, s, s, %s FROM unnest(%b::varchar[], %b::bytea[], %b::bigint[])"
            f" AS new_rows(k, p, s){conflict} RETURNING key"
        )

        def run_pg(raw: Raw, items: Sequence[tuple[str, bytes]], now: int) -> None:
            keys, payloads = [k for k, _ in items], [p for _, p in items]
            raw.cursor().execute(unnest, ("bench", "json", now, keys, payloads, [now] * len(items)))

        return run_pg

    def run(raw: Raw, items: Sequence[tuple[str, bytes]], now: int) -> None:
        sql = head + ", ".join([row] * len(items)) + conflict
        params = [v for key, payload in items for v in ("bench", key, payload, "json", now, now, now, 0)]
        cur = raw.cursor()
        if name == "sqlite":
            cur.execute("BEGIN IMMEDIATE")
            cur.execute(sql, params)
            cur.execute("COMMIT")
        else:
            cur.execute(sql, params)

    return run


def get_one(name: str, table: str) -> Callable[[Raw, str], Any]:
    """Read one message by key (the columns ``DelayedQueue.get`` reads); autocommit, nothing begun."""
    p, key = _ph(name), _key(name)
    sql = (
        f"SELECT {key}, payload, payload_type, scheduled_at, scheduled_at_initially, created_at, attempts,"
        f" last_error, lock_token, attempt_history FROM {table} WHERE queue = {p} AND {key} = {p}"
    )

    def run(raw: Raw, k: str) -> Any:
        cur = raw.cursor()
        cur.execute(sql, ("bench", k))
        row = cur.fetchone()
        if name == "mysql":
            raw.commit()
        return row

    return run


def cancel_one(name: str, table: str) -> Callable[[Raw, str], bool]:
    """Delete one message by key, in autocommit."""
    p, key = _ph(name), _key(name)
    sql = f"DELETE FROM {table} WHERE queue = {p} AND {key} = {p}"

    def run(raw: Raw, k: str) -> bool:
        cur = raw.cursor()
        cur.execute(sql, ("bench", k))
        return bool(cur.rowcount == 1)

    return run


def claim_and_ack(name: str, table: str) -> Callable[[Raw, int], list[str]]:
    """Claim up to n due messages and ack them; returns their keys."""
    p, now, key = _ph(name), NOW_MS[name], _key(name)
    if name == "postgresql":
        claim = (
            f"WITH picked AS MATERIALIZED (SELECT id FROM {table} WHERE queue = 'bench' AND scheduled_at <= {now}"
            f" ORDER BY scheduled_at, id LIMIT %s FOR UPDATE SKIP LOCKED) UPDATE {table} SET"
            f" scheduled_at = {now} + 300000, lock_token = %s, attempts = {table}.attempts + 1 FROM picked"
            f" WHERE {table}.id = picked.id RETURNING {table}.id, {table}.key, {table}.payload"
        )

        def run_pg(raw: Raw, n: int) -> list[str]:
            token = str(uuid.uuid4())
            cur = raw.cursor()
            rows = cur.execute(claim, (n, token)).fetchall()
            if rows:
                cur.execute(f"DELETE FROM {table} WHERE lock_token = %s", (token,))
            return [r[1] for r in rows]

        return run_pg

    select = (
        f"SELECT id, {key}, payload, {now} FROM {table} WHERE queue = 'bench' AND scheduled_at <= {now}"
        f" ORDER BY scheduled_at, id LIMIT {p}" + (" FOR UPDATE SKIP LOCKED" if name == "mysql" else "")
    )

    def claim_rows(raw: Raw, n: int, token: str) -> list[Any]:
        cur = raw.cursor()
        if name == "sqlite":
            cur.execute("BEGIN IMMEDIATE")
        cur.execute(select, (n,))
        rows = cur.fetchall()
        if rows:
            marks = ", ".join([p] * len(rows))
            cur.execute(
                f"UPDATE {table} SET scheduled_at = {p}, lock_token = {p}, attempts = attempts + 1"
                f" WHERE id IN ({marks})",
                (rows[0][3] + 300000, token, *[r[0] for r in rows]),
            )
        raw.commit() if name == "mysql" else cur.execute("COMMIT")
        return list(rows)

    def delete_rows(raw: Raw, token: str) -> None:
        raw.cursor().execute(f"DELETE FROM {table} WHERE lock_token = {p}", (token,))
        if name == "mysql":
            raw.commit()

    def run(raw: Raw, n: int) -> list[str]:
        token = str(uuid.uuid4())
        rows = _retrying_deadlocks(raw, lambda: claim_rows(raw, n, token))
        if rows:
            _retrying_deadlocks(raw, lambda: delete_rows(raw, token))
        return [r[1] for r in rows]

    return run


T = TypeVar("T")
_DEADLOCK, _LOCK_WAIT_TIMEOUT = 1213, 1205


def _retrying_deadlocks(raw: Raw, transaction: Callable[[], T]) -> T:
    """Run a MySQL/MariaDB transaction again after a deadlock, as any client of InnoDB must."""
    while True:
        try:
            return transaction()
        except Exception as exc:  # the driver's OperationalError
            if not (exc.args and exc.args[0] in (_DEADLOCK, _LOCK_WAIT_TIMEOUT)):
                raise
            raw.rollback()


def _key(name: str) -> str:
    return "`key`" if name == "mysql" else "key"


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
