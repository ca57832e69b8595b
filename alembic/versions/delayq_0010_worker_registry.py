"""delayq: the worker registry, and message keys in the collation "C" on PostgreSQL

Adds ``{prefix}workers``: one row per worker (``Worker``, ``AsyncWorker``), inserted when it starts, its
heartbeat and slots in use updated as it runs, ``stopped_at`` set by a clean stop; read by ``delayq workers``,
``delayq top`` and the dashboard's workers page.

On PostgreSQL, the ``key`` columns of messages, dead letters and finished messages take the collation "C".
delayq selects keys by prefix as a range compared byte for byte (``key COLLATE "C"``, ``Dialect.starts_with``);
an index in the database's collation cannot serve that range, so ``browse`` under a key prefix,
``cancel_prefix`` and ``purge_dead(key_prefix=)`` read every row of the queue. In "C", the existing (queue,
key) indexes serve it, at no extra cost per write. Equality and uniqueness do not change (the collations
PostgreSQL creates databases with are deterministic: equal only when byte for byte equal); keys now sort by
code point, as on SQLite and MySQL/MariaDB. PostgreSQL rebuilds those indexes (not the tables) while it holds
the tables' lock: on a big table, run it when a pause of that long is fine. Other backends: nothing changes.

Revision ID: delayq_0010
Revises: delayq_0009
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.dialects.types import TABLE_OPTIONS
from delayq.migrations import migration_options

revision = "delayq_0010"
down_revision = "delayq_0009"
branch_labels = None
depends_on = None

KEYED = ("messages", "dead_letters", "finished")
"""The tables whose ``key`` column delayq selects by prefix."""


def _collate_keys(collation: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    prefix, schema = migration_options()
    for table in KEYED:
        op.alter_column(
            f"{prefix}{table}",
            "key",
            type_=sa.String(200, collation=collation),
            existing_type=sa.String(200),
            existing_nullable=False,
            schema=schema,
        )


def upgrade() -> None:
    prefix, schema = migration_options()
    op.create_table(
        f"{prefix}workers",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("driver", sa.String(20), nullable=False),
        sa.Column("queues", sa.Text, nullable=False),
        sa.Column("topics", sa.Text, nullable=False),
        sa.Column("slots", sa.Integer, nullable=False),
        sa.Column("slots_in_use", sa.Integer, nullable=False),
        sa.Column("handled", sa.BigInteger, nullable=False),
        sa.Column("started_at", sa.BigInteger, nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger, nullable=False),
        sa.Column("stopped_at", sa.BigInteger, nullable=True),
        sa.Index(f"{prefix}workers_heartbeat_ix", "heartbeat_at"),
        schema=schema,
        **TABLE_OPTIONS,
    )
    _collate_keys("C")


def downgrade() -> None:
    prefix, schema = migration_options()
    _collate_keys("default")
    op.drop_table(f"{prefix}workers", schema=schema)
