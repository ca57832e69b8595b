"""The topic statements each backend gets, compiled without a database: the locks the docs promise."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

from delayq.dialects import dialect_class
from delayq.schema import make_tables
from delayq.topics import _backends
from delayq.topics._backends import set_heads_case
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
        ("lock_topic_shared", "FOR SHARE", "LOCK IN SHARE MODE"),
        ("lock_topic", "FOR UPDATE", "FOR UPDATE"),
        ("lock_collected", "FOR UPDATE", "FOR UPDATE"),
    ],
)
def test_the_locking_reads(attr: str, postgres: str, mariadb: str) -> None:
    assert compiled("postgresql", attr).endswith(postgres)
    assert compiled("mysql", attr).endswith(mariadb)
    sql = compiled("sqlite", attr)
    assert "FOR " not in sql  # one writer at a time: no row locks to take
    if attr in ("lock_heads", "lock_topic_shared", "lock_topic", "lock_collected"):
        # Read before a write: a write that returns the rows, so it takes the writer's lock first.
        assert sql.startswith("UPDATE ") and " RETURNING " in sql, sql


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


def built(name: str, build: Any, *args: Any) -> str:
    sa_dialect = DIALECTS[name]
    dialect = dialect_class(name)(sa_dialect)
    stmts = TopicStatements(dialect, make_tables().topics, dialect.now_ms())
    return " ".join(str(stmts.memo(build, *args).compile(dialect=sa_dialect)).split())


def test_the_held_partitions_are_one_array_on_postgresql() -> None:
    # One statement text whatever the number held (1,000 parameters cost a poll ~25 ms to bind).
    sql = compiled("postgresql", "with_work")
    assert sql.endswith("AND delayq_topic_offsets.partition = ANY (%(parts)s::INTEGER[])")
    assert "IN (__[POSTCOMPILE_parts])" in compiled("mysql", "with_work")
    assert "ANY" not in compiled("postgresql", "group_progress")  # the whole group's: no list at all
    # Where an array would let a generic plan on stale statistics read a partition's whole log: a list.
    for attr in ("lock_heads", "messages", "redeliver", "remove"):
        assert "IN (__[POSTCOMPILE_" in compiled("postgresql", attr), attr


def test_the_id_lookup_of_a_batch() -> None:
    assert compiled("mysql", "existing_ids").endswith(
        "AND (delayq_topic_log.partition_key, delayq_topic_log.message_id) IN (__[POSTCOMPILE_pairs])"
    )
    # PostgreSQL: two arrays, each pair probed through the unique index (LATERAL … LIMIT 1 stays a
    # nested loop, where a plain join on stale statistics hashes the topic's whole log).
    assert built("postgresql", _backends._existing_ids_unnest) == (
        "SELECT asked.keys AS partition_key, asked.ids AS message_id"
        " FROM unnest(%(keys)s::VARCHAR[], %(ids)s::VARCHAR[]) AS asked(keys, ids)"
        " JOIN LATERAL (SELECT 1 AS found FROM delayq_topic_log WHERE delayq_topic_log.topic = %(topic_name)s::VARCHAR"
        " AND delayq_topic_log.partition_key = asked.keys AND delayq_topic_log.message_id = asked.ids LIMIT 1)"
        " AS found ON true"
    )


def test_the_heads_of_a_batch_are_one_update() -> None:
    assert built("postgresql", _backends._set_heads_unnest) == (
        "UPDATE delayq_topic_heads SET head=moved.new_heads"
        " FROM unnest(%(parts)s::INTEGER[], %(new_heads)s::BIGINT[]) AS moved(parts, new_heads)"
        " WHERE delayq_topic_heads.topic = %(topic_name)s::VARCHAR AND delayq_topic_heads.partition = moved.parts"
    )
    assert built("mysql", set_heads_case, 2) == (
        "UPDATE delayq_topic_heads SET head=CASE delayq_topic_heads.`partition` WHEN %s THEN %s WHEN %s THEN %s END"
        " WHERE delayq_topic_heads.topic = %s AND delayq_topic_heads.`partition` IN (%s, %s)"
    )
    assert built("sqlite", set_heads_case, 4).count("WHEN ? THEN ?") == 4


def test_ack_many_is_one_update_per_partition_fenced_by_each_attempt() -> None:
    sql = compiled("sqlite", "ack_pairs")
    assert "delayq_topic_deliveries.status = ?" in sql
    assert sql.endswith(
        "(delayq_topic_deliveries.message_offset, delayq_topic_deliveries.attempts) IN (__[POSTCOMPILE_pairs])"
        " RETURNING message_offset, attempts"
    )
    sql = built("postgresql", _backends._ack_unnest)
    assert "FROM unnest(%(offsets)s::BIGINT[], %(attempt_nos)s::INTEGER[]) AS acked(offsets, attempt_nos)" in sql
    assert "delayq_topic_deliveries.attempts = acked.attempt_nos AND delayq_topic_deliveries.status = " in sql
    assert sql.endswith("RETURNING delayq_topic_deliveries.message_offset, delayq_topic_deliveries.attempts")
    # MariaDB has no UPDATE … RETURNING: the pending ones are locked and read first, then updated by offset.
    sql = built("mysql", _backends._ackable)
    assert "(delayq_topic_deliveries.message_offset, delayq_topic_deliveries.attempts) IN" in sql
    assert sql.endswith("FOR UPDATE")


def test_the_exclusive_fence_does_not_read_the_watermark() -> None:
    # A fence that waited for the lock would read it as of its start: stale after another holder's advance.
    sql = compiled("postgresql", "hold_exclusive")
    assert "delayq_topic_offsets" not in sql and sql.endswith("FOR UPDATE")


def test_an_ack_in_order_on_postgresql_takes_its_fences_in_a_sub_select_run_once() -> None:
    sql = built("postgresql", _backends._ack_runs_fenced, 2)
    # ``= ANY((SELECT …))``: one array, an InitPlan run before the UPDATE locks a row of its own.
    assert "delayq_topic_offsets.partition = ANY (CAST((SELECT array_agg(fenced.partition)" in sql
    assert "delayq_topic_leases.holder = %(me)s::VARCHAR" in sql
    assert "delayq_topic_leases.epoch = %(e0)s::BIGINT" in sql
    assert "ORDER BY delayq_topic_leases.partition FOR SHARE) AS fenced) AS INTEGER[]))" in sql
    assert sql.endswith("RETURNING delayq_topic_offsets.partition")


def test_a_polls_read_of_its_ranges_moves_them_in_the_same_statement_on_postgresql() -> None:
    sql = built("postgresql", _backends._read_and_move_ranges, False)
    assert sql.startswith("WITH read AS (SELECT")
    # Each partition's delivered offset moves to the last offset the statement read (not to the bound asked).
    assert "SET delivered_offset=last.top, range_until=%(until)s::BIGINT FROM (SELECT read.partition" in sql
    assert "max(read.message_offset) AS top FROM read GROUP BY read.partition) AS last" in sql
    assert sql.endswith("FROM read ORDER BY read.partition, read.message_offset")


def test_the_range_reads_lateral_keeps_a_limit_so_it_stays_a_loop_of_range_scans() -> None:
    # Without a LIMIT PostgreSQL may flatten the LATERAL into a join reading the topic's every log row (seen:
    # a hash join over 20,000 rows for 100, on statistics taken while the table was empty).
    for sql in (
        built("postgresql", _backends._read_ranges_unnest, False),
        built("postgresql", _backends._read_and_move_ranges, False),
    ):
        assert "ORDER BY bench_topic_log.message_offset LIMIT %(width)s" in sql.replace("delayq_", "bench_")


def test_a_batchs_log_rows_are_five_arrays_on_postgresql() -> None:
    sql = built("postgresql", _backends._insert_log_unnest)
    assert sql.startswith("INSERT INTO delayq_topic_log (topic, partition, message_offset, partition_key, message_id,")
    assert (
        "FROM unnest(%(parts)s::INTEGER[], %(offsets)s::BIGINT[], %(keys)s::VARCHAR[], %(ids)s::VARCHAR[],"
        " %(payloads)s::BYTEA[]) AS appended(parts, offsets, keys, ids, payloads)"
    ) in sql
