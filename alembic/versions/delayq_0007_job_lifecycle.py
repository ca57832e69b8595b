"""delayq: a job's whole life — kept finished messages, tags, uniqueness after completion, the pruner's chore

Adds ``messages.tags`` and ``messages.unique_for_ms`` (NULL unless an offer sets them), ``dead_letters.tags``
and ``dead_letters.expires_at`` (NULL: kept until requeued or purged), ``{prefix}finished`` (messages kept after
they completed or were cancelled, with their result and duration, until ``expires_at``) and ``{prefix}chores``
(which worker runs a shared background chore, such as the pruner, until when). Additive: live messages and dead
letters keep every value they had, and an ack of a message offered before the upgrade deletes it as before.

Revision ID: delayq_0007
Revises: delayq_0006
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.dialects.types import TABLE_OPTIONS, BigId, Payload, name_type
from delayq.migrations import migration_options

revision = "delayq_0007"
down_revision = "delayq_0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    prefix, schema = migration_options()
    op.add_column(f"{prefix}messages", sa.Column("tags", sa.Text, nullable=True), schema=schema)
    op.add_column(f"{prefix}messages", sa.Column("unique_for_ms", sa.BigInteger, nullable=True), schema=schema)
    op.add_column(f"{prefix}dead_letters", sa.Column("tags", sa.Text, nullable=True), schema=schema)
    op.add_column(f"{prefix}dead_letters", sa.Column("expires_at", sa.BigInteger, nullable=True), schema=schema)
    op.create_index(f"{prefix}dead_letters_expires_ix", f"{prefix}dead_letters", ["expires_at"], schema=schema)
    op.create_table(
        f"{prefix}finished",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("queue", name_type(100), nullable=False),
        sa.Column("key", name_type(200), nullable=False),
        sa.Column("payload", Payload, nullable=False),
        sa.Column("payload_type", sa.String(100), nullable=False),
        sa.Column("state", sa.SmallInteger, nullable=False),
        sa.Column("scheduled_at_initially", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("attempt_history", sa.Text, nullable=True),
        sa.Column("headers", sa.Text, nullable=True),
        sa.Column("tags", sa.Text, nullable=True),
        sa.Column("finished_at", sa.BigInteger, nullable=False),
        sa.Column("duration_ms", sa.BigInteger, nullable=True),
        sa.Column("result", Payload, nullable=True),
        sa.Column("result_type", sa.String(100), nullable=True),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        sa.Index(f"{prefix}finished_queue_key_ix", "queue", "key", "finished_at"),
        sa.Index(f"{prefix}finished_state_ix", "queue", "state", "finished_at", "id"),
        sa.Index(f"{prefix}finished_expires_ix", "expires_at"),
        schema=schema,
        **TABLE_OPTIONS,
    )
    op.create_table(
        f"{prefix}chores",
        sa.Column("name", name_type(100), primary_key=True),
        sa.Column("holder", sa.String(200), nullable=True),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        sa.Column("done_at", sa.BigInteger, nullable=True),
        schema=schema,
        **TABLE_OPTIONS,
    )


def downgrade() -> None:
    prefix, schema = migration_options()
    op.drop_table(f"{prefix}chores", schema=schema)
    op.drop_table(f"{prefix}finished", schema=schema)
    op.drop_index(f"{prefix}dead_letters_expires_ix", table_name=f"{prefix}dead_letters", schema=schema)
    op.drop_column(f"{prefix}dead_letters", "expires_at", schema=schema)
    op.drop_column(f"{prefix}dead_letters", "tags", schema=schema)
    op.drop_column(f"{prefix}messages", "unique_for_ms", schema=schema)
    op.drop_column(f"{prefix}messages", "tags", schema=schema)
