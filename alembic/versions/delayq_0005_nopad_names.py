"""delayq: keys, ids and names compare byte for byte on MySQL/MariaDB too (a binary NO PAD collation)

``utf8mb4_bin`` is PAD SPACE: ``'m1' = 'm1 '``, so a key or id that differs from another by trailing
spaces was a duplicate there (and a lookup of one found the other). Every name column moves to the
server's NO PAD binary collation (``delayq.dialects.types.nopad_collation``). Nothing changes on
PostgreSQL and SQLite, which compare these columns byte for byte already.

Revision ID: delayq_0005
Revises: delayq_0004
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op
from delayq.dialects.types import name_type, pad_space_name_type
from delayq.migrations import migration_options

revision = "delayq_0005"
down_revision = "delayq_0004"
branch_labels = None
depends_on = None

# (table, column, length, nullable): every name column of delayq_0001 to delayq_0004.
COLUMNS = (
    ("messages", "queue", 100, False),
    ("messages", "key", 200, False),
    ("dead_letters", "queue", 100, False),
    ("dead_letters", "key", 200, False),
    ("schedules", "queue", 100, False),
    ("schedules", "name", 150, False),
    ("topics", "topic", 100, False),
    ("topic_heads", "topic", 100, False),
    ("topic_log", "topic", 100, False),
    ("topic_log", "partition_key", 200, False),
    ("topic_log", "message_id", 301, False),
    ("topic_log", "original_topic", 100, True),
    ("topic_log", "failed_group", 100, True),
    ("topic_deliveries", "consumer_group", 100, False),
    ("topic_deliveries", "topic", 100, False),
    ("topic_leases", "consumer_group", 100, False),
    ("topic_leases", "topic", 100, False),
    ("topic_leases", "holder", 200, True),
    ("topic_offsets", "consumer_group", 100, False),
    ("topic_offsets", "topic", 100, False),
    ("topic_subscribers", "consumer_group", 100, False),
    ("topic_subscribers", "topic", 100, False),
    ("topic_subscribers", "subscriber", 200, False),
)


def _alter(nopad: bool) -> None:
    if op.get_bind().dialect.name not in ("mysql", "mariadb"):
        return
    prefix, schema = migration_options()
    for table, column, length, nullable in COLUMNS:
        new, old = name_type(length), pad_space_name_type(length)
        if not nopad:
            new, old = old, new
        op.alter_column(
            f"{prefix}{table}", column, type_=new, existing_type=old, existing_nullable=nullable, schema=schema
        )


def upgrade() -> None:
    _alter(nopad=True)


def downgrade() -> None:
    # Fails with a duplicate key (1062) where two keys differ only by trailing spaces: remove one first.
    _alter(nopad=False)
