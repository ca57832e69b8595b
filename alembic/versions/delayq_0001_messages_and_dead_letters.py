"""delayq: the live-message table and the dead-letter table

Revision ID: delayq_0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.dialects.types import TABLE_OPTIONS, BigId, Payload, pad_space_name_type
from delayq.migrations import migration_options

revision = "delayq_0001"
down_revision = None
branch_labels = ("delayq",)
depends_on = None


def upgrade() -> None:
    prefix, schema = migration_options()
    messages, dead = f"{prefix}messages", f"{prefix}dead_letters"
    op.create_table(
        messages,
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("queue", pad_space_name_type(100), nullable=False),
        sa.Column("key", pad_space_name_type(200), nullable=False),
        sa.Column("payload", Payload, nullable=False),
        sa.Column("payload_type", sa.String(100), nullable=False),
        sa.Column("scheduled_at", sa.BigInteger, nullable=False),
        sa.Column("scheduled_at_initially", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("lock_token", sa.String(36), nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.UniqueConstraint("queue", "key", name=f"{prefix}messages_queue_key_uq"),
        schema=schema,
        **TABLE_OPTIONS,
    )
    op.create_index(f"{prefix}messages_due_ix", messages, ["queue", "scheduled_at", "id"], schema=schema)
    op.create_index(f"{prefix}messages_lock_ix", messages, ["lock_token"], schema=schema)
    op.create_table(
        dead,
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("queue", pad_space_name_type(100), nullable=False),
        sa.Column("key", pad_space_name_type(200), nullable=False),
        sa.Column("payload", Payload, nullable=False),
        sa.Column("payload_type", sa.String(100), nullable=False),
        sa.Column("scheduled_at_initially", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("failed_at", sa.BigInteger, nullable=False),
        schema=schema,
        **TABLE_OPTIONS,
    )
    op.create_index(f"{prefix}dead_letters_queue_key_ix", dead, ["queue", "key"], schema=schema)
    op.create_index(f"{prefix}dead_letters_failed_ix", dead, ["queue", "failed_at"], schema=schema)


def downgrade() -> None:
    prefix, schema = migration_options()
    op.drop_table(f"{prefix}dead_letters", schema=schema)
    op.drop_table(f"{prefix}messages", schema=schema)
