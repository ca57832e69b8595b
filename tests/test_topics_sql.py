"""The topic statements each backend gets, compiled without a database: the locks the docs promise."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

from delayq.dialects import dialect_class
from delayq.schema import make_tables
from delayq.topics.statements import TopicStatements

DIALECTS = {
    "postgresql": postgresql.psycopg.dialect(),
    "mysql": mysql.mysqldb.dialect(),
    "sqlite": sqlite.dialect(),
}


def compiled(name: str, attr: str) -> str:
    sa_dialect = DIALECTS[name]
    dialect = dialect_class(name)(sa_dialect)
    stmts = TopicStatements(dialect, make_tables().topics, dialect.now_ms())
    return " ".join(str(getattr(stmts, attr).compile(dialect=sa_dialect)).split())


@pytest.mark.parametrize(
    ("attr", "postgres", "mariadb"),
    [
        (
            "lock_heads",
            "ORDER BY delayq_topic_heads.partition FOR UPDATE",
            "ORDER BY delayq_topic_heads.`partition` FOR UPDATE",
        ),
        ("hold_exclusive", "FOR UPDATE", "FOR UPDATE"),
        ("hold_shared", "FOR SHARE", "LOCK IN SHARE MODE"),
        ("free_leases", "FOR UPDATE SKIP LOCKED", "FOR UPDATE SKIP LOCKED"),
        ("heads_for_group", "FOR SHARE", "LOCK IN SHARE MODE"),
        ("lock_collected", "FOR UPDATE", "FOR UPDATE"),
    ],
)
def test_the_locking_reads(attr: str, postgres: str, mariadb: str) -> None:
    assert compiled("postgresql", attr).endswith(postgres)
    assert compiled("mysql", attr).endswith(mariadb)
    assert "FOR " not in compiled("sqlite", attr)  # one writer at a time: no row locks to take


def test_the_upserts_never_use_insert_ignore() -> None:
    assert compiled("postgresql", "create_lease").endswith("ON CONFLICT (consumer_group, topic, partition) DO NOTHING")
    assert compiled("sqlite", "heartbeat").count("ON CONFLICT (consumer_group, topic, subscriber) DO UPDATE") == 1
    for attr in ("create_lease", "create_offset", "create_head", "create_topic", "heartbeat"):
        sql = compiled("mysql", attr)
        assert "ON DUPLICATE KEY UPDATE" in sql and "IGNORE" not in sql


def test_every_fenced_write_names_the_holder_and_the_epoch() -> None:
    for attr in ("hold_exclusive", "hold_shared"):
        sql = compiled("postgresql", attr)
        assert "delayq_topic_leases.holder = " in sql and "delayq_topic_leases.epoch = " in sql
    for attr in ("ack", "nack", "extend", "bury"):
        sql = compiled("postgresql", attr)
        assert "delayq_topic_deliveries.status = " in sql and "delayq_topic_deliveries.attempts = " in sql


def test_the_clock_is_the_databases() -> None:
    assert "statement_timestamp()" in compiled("postgresql", "hold_exclusive")
    assert "UTC_TIMESTAMP(6)" in compiled("mysql", "hold_exclusive")
    assert "julianday" in compiled("sqlite", "hold_exclusive")
    sa_dialect = DIALECTS["postgresql"]
    manual = TopicStatements(dialect_class("postgresql")(sa_dialect), make_tables().topics, sa.bindparam("now"))
    assert "%(now)s" in str(manual.hold_exclusive.compile(dialect=sa_dialect))
