"""delayq: topics (an immutable log per topic, consumer groups with delivery state, leases, offsets, heartbeats)

Revision ID: delayq_0004
Revises: delayq_0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.dialects.types import TABLE_OPTIONS, Payload, pad_space_name_type
from delayq.migrations import migration_options

revision = "delayq_0004"
down_revision = "delayq_0003"
branch_labels = None
depends_on = None

TABLES = (
    "topics",
    "topic_heads",
    "topic_log",
    "topic_deliveries",
    "topic_leases",
    "topic_offsets",
    "topic_subscribers",
)


def _group_topic_partition() -> list[sa.Column[object]]:
    return [
        sa.Column("consumer_group", pad_space_name_type(100), primary_key=True),
        sa.Column("topic", pad_space_name_type(100), primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
    ]


def upgrade() -> None:
    prefix, schema = migration_options()
    op.create_table(
        f"{prefix}topics",
        sa.Column("topic", pad_space_name_type(100), primary_key=True),
        sa.Column("partitions", sa.Integer, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        schema=schema,
        **TABLE_OPTIONS,
    )
    op.create_table(
        f"{prefix}topic_heads",
        sa.Column("topic", pad_space_name_type(100), primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("head", sa.BigInteger, nullable=False),
        sa.Column("collected", sa.BigInteger, nullable=False),
        schema=schema,
        **TABLE_OPTIONS,
    )
    op.create_table(
        f"{prefix}topic_log",
        sa.Column("topic", pad_space_name_type(100), primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("message_offset", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("partition_key", pad_space_name_type(200), nullable=False),
        sa.Column("message_id", pad_space_name_type(301), nullable=False),
        sa.Column("payload", Payload, nullable=False),
        sa.Column("payload_type", sa.String(100), nullable=False),
        sa.Column("published_at", sa.BigInteger, nullable=False),
        sa.Column("original_topic", pad_space_name_type(100), nullable=True),
        sa.Column("original_offset", sa.BigInteger, nullable=True),
        sa.Column("failed_group", pad_space_name_type(100), nullable=True),
        sa.Column("failed_at", sa.BigInteger, nullable=True),
        sa.Column("failure_count", sa.Integer, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.UniqueConstraint("topic", "partition_key", "message_id", name=f"{prefix}topic_log_id_uq"),
        schema=schema,
        **TABLE_OPTIONS,
    )
    op.create_table(
        f"{prefix}topic_deliveries",
        *_group_topic_partition(),
        sa.Column("message_offset", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("status", sa.SmallInteger, nullable=False),
        sa.Column("invisible_until", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        schema=schema,
        **TABLE_OPTIONS,
    )
    op.create_table(
        f"{prefix}topic_leases",
        *_group_topic_partition(),
        sa.Column("holder", pad_space_name_type(200), nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("acquired_at", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        schema=schema,
        **TABLE_OPTIONS,
    )
    op.create_index(f"{prefix}topic_leases_holder_ix", f"{prefix}topic_leases", ["holder"], schema=schema)
    op.create_table(
        f"{prefix}topic_offsets",
        *_group_topic_partition(),
        sa.Column("acked_offset", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
        schema=schema,
        **TABLE_OPTIONS,
    )
    op.create_index(f"{prefix}topic_offsets_topic_ix", f"{prefix}topic_offsets", ["topic", "partition"], schema=schema)
    op.create_table(
        f"{prefix}topic_subscribers",
        sa.Column("consumer_group", pad_space_name_type(100), primary_key=True),
        sa.Column("topic", pad_space_name_type(100), primary_key=True),
        sa.Column("subscriber", pad_space_name_type(200), primary_key=True),
        sa.Column("heartbeat_at", sa.BigInteger, nullable=False),
        sa.Column("deregistered_at", sa.BigInteger, nullable=True),
        schema=schema,
        **TABLE_OPTIONS,
    )


def downgrade() -> None:
    prefix, schema = migration_options()
    for table in reversed(TABLES):
        op.drop_table(f"{prefix}{table}", schema=schema)
