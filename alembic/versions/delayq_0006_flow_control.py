"""delayq: message priorities and groups, and per-queue flow settings (pause, limits)

Adds ``messages.group_key`` (NULL unless an offer names a group) and ``messages.priority`` (0 unless an
offer sets one) with the index ``(queue, priority,
scheduled_at, id)`` a priority claim walks one priority level at a time, and ``{prefix}queue_flow``:
one row per queue whose flow was ever set (paused, offered a priority, limited: its concurrency limit,
its rate limit and that limit's token bucket, whether it was offered groups and their concurrency), read by
claimers and
cached for at most ``DelayedQueue(flow_refresh=...)``. Additive: existing rows get priority 0.

Revision ID: delayq_0006
Revises: delayq_0005
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.dialects.types import TABLE_OPTIONS, name_type
from delayq.migrations import migration_options

revision = "delayq_0006"
down_revision = "delayq_0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    prefix, schema = migration_options()
    op.add_column(
        f"{prefix}messages",
        sa.Column("priority", sa.SmallInteger, nullable=False, server_default="0"),
        schema=schema,
    )
    op.add_column(f"{prefix}messages", sa.Column("group_key", name_type(200), nullable=True), schema=schema)
    op.create_index(
        f"{prefix}messages_priority_ix",
        f"{prefix}messages",
        ["queue", "priority", "scheduled_at", "id"],
        schema=schema,
        # (partial: a queue without priorities writes nothing to it; MySQL/MariaDB have no partial indexes)
        postgresql_where=sa.text("priority <> 0"),
        sqlite_where=sa.text("priority <> 0"),
    )
    op.create_table(
        f"{prefix}queue_flow",
        sa.Column("queue", name_type(100), primary_key=True),
        sa.Column("paused", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("priorities", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("concurrency", sa.Integer, nullable=True),
        sa.Column("rate", sa.Integer, nullable=True),
        sa.Column("rate_period_ms", sa.BigInteger, nullable=True),
        sa.Column("tokens", sa.Double(), nullable=True),
        sa.Column("tokens_at", sa.BigInteger, nullable=True),
        sa.Column("grouped", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("group_concurrency", sa.Integer, nullable=True),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
        schema=schema,
        **TABLE_OPTIONS,
    )


def downgrade() -> None:
    prefix, schema = migration_options()
    op.drop_table(f"{prefix}queue_flow", schema=schema)
    op.drop_index(f"{prefix}messages_priority_ix", table_name=f"{prefix}messages", schema=schema)
    op.drop_column(f"{prefix}messages", "group_key", schema=schema)
    op.drop_column(f"{prefix}messages", "priority", schema=schema)
