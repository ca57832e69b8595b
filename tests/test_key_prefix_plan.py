"""On PostgreSQL, a key-prefix filter is a range of the (queue, key) index, not a scan of the queue.

delayq compares keys byte for byte (``key COLLATE "C"``, ``Dialect.starts_with``); since delayq_0010 the key
columns are in "C" on PostgreSQL, so the (queue, key) indexes of messages and dead letters serve that range.
The statements ``browse.list_messages(key_prefix=)``, ``cancel_prefix`` and ``purge_dead(key_prefix=)`` send
are replayed under ``EXPLAIN`` as sent, on a queue of 20,000 messages among 40,000 (and as many dead letters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import Backend, make_engine

from delayq import DelayedQueue, browse, migrations
from delayq.schema import make_tables

PREFIX = "kplan_"
ROWS = 20_000


@pytest.fixture
def filled(postgres: Backend) -> Iterator[sa.Engine]:
    """Two queues of ``ROWS`` messages and dead letters each, analyzed."""
    migrations.upgrade(postgres.url, prefix=PREFIX)
    engine = make_engine(postgres.url)
    with engine.begin() as conn:
        for table in ("messages", "dead_letters"):
            conn.exec_driver_sql(f"DELETE FROM {PREFIX}{table}")
        conn.exec_driver_sql(
            f"INSERT INTO {PREFIX}messages (queue, key, payload, payload_type, scheduled_at, "
            "scheduled_at_initially, created_at) SELECT q, 'order/' || lpad(n::text, 6, '0'), '\\x7b7d', 'json', "
            "4102444800000 + n, 4102444800000 + n, 0 FROM generate_series(1, %(rows)s) n, "
            "(VALUES ('q1'), ('q2')) v(q)",
            {"rows": ROWS},
        )
        conn.exec_driver_sql(
            f"INSERT INTO {PREFIX}dead_letters (queue, key, payload, payload_type, scheduled_at_initially, "
            "created_at, attempts, failed_at) SELECT queue, key, payload, payload_type, scheduled_at_initially, "
            f"created_at, 1, 0 FROM {PREFIX}messages"
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"ANALYZE {PREFIX}messages")
        conn.exec_driver_sql(f"ANALYZE {PREFIX}dead_letters")
    try:
        yield engine
    finally:
        engine.dispose()


def plans(engine: sa.Engine, action: Callable[[], Any], table: str) -> list[str]:
    """The plans of the statements over ``table`` with a key range that ``action`` sends, replayed as sent."""
    sent: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if table in statement and 'COLLATE "C"' in statement:
            sent.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        action()
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    assert sent, f"no key range over {table} was sent"
    found = []
    with engine.connect() as conn:
        for sql, params in sent:
            found.append("\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + sql, params)))
        conn.rollback()
    return found


def test_the_key_columns_are_in_the_collation_c(filled: sa.Engine) -> None:
    with filled.connect() as conn:
        found = dict(
            conn.exec_driver_sql(
                "SELECT table_name, collation_name FROM information_schema.columns "
                "WHERE column_name = 'key' AND table_name IN (%(m)s, %(d)s, %(f)s)",
                {"m": f"{PREFIX}messages", "d": f"{PREFIX}dead_letters", "f": f"{PREFIX}finished"},
            ).all()
        )
    assert found == {f"{PREFIX}{t}": "C" for t in ("messages", "dead_letters", "finished")}


def test_a_key_prefix_filter_walks_the_queue_key_index(filled: sa.Engine) -> None:
    queue = DelayedQueue(filled, "q1", table_prefix=PREFIX)
    tables = make_tables(PREFIX)

    def listing(state: browse.State | None) -> Callable[[], Any]:
        def run() -> Any:
            with filled.connect() as conn:
                now = browse.database_now(conn)
                return browse.list_messages(
                    conn, tables, "q1", state=state, now=now, key_prefix="order/0123", by_key=state is None
                )

        return run

    checks = {
        "browse by key": plans(filled, listing(None), f"{PREFIX}messages"),
        "browse dead letters": plans(filled, listing(browse.State.DEAD), f"{PREFIX}dead_letters"),
        "keys_under": plans(
            filled,
            lambda: browse.keys_under(filled.connect(), tables, "q1", "order/0123"),
            f"{PREFIX}messages",
        ),
        "cancel_prefix": plans(filled, lambda: queue.cancel_prefix("order/0199"), f"{PREFIX}messages"),
        "purge_dead": plans(filled, lambda: queue.purge_dead(key_prefix="order/0199"), f"{PREFIX}dead_letters"),
    }
    for what, found in checks.items():
        for plan in found:
            assert "Seq Scan" not in plan, f"{what}:\n{plan}"
            assert any(ix in plan for ix in (f"{PREFIX}messages_queue_key_uq", f"{PREFIX}dead_letters_queue_key_ix")), (
                f"{what}:\n{plan}"
            )
    assert queue.get("order/019950") is None  # (cancel_prefix ran for real)
    assert queue.get("order/018950") is not None
