"""delayq: the audit of operators' actions

Adds ``{prefix}audit``: one row per action an operator took from the dashboard or the CLI (pause, resume,
limits, cancel, requeue, purge, reschedule, run now, and their bulk forms): who (the dashboard's ``authorize``
identity, or the OS user of the CLI), from where (``web`` / ``cli``), what, on which queue, under which filter
(a JSON object), how many messages it affected, and when (database time, epoch ms). Read by ``delayq audit``
and the dashboard's audit page, newest first. Additive: nothing else changes.

Revision ID: delayq_0011
Revises: delayq_0010
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.dialects.types import TABLE_OPTIONS, BigId, name_type
from delayq.migrations import migration_options

revision = "delayq_0011"
down_revision = "delayq_0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    prefix, schema = migration_options()
    op.create_table(
        f"{prefix}audit",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("at", sa.BigInteger, nullable=False),
        sa.Column("source", sa.String(10), nullable=False),
        sa.Column("actor", name_type(200), nullable=False),
        sa.Column("action", name_type(50), nullable=False),
        sa.Column("queue", name_type(100), nullable=True),
        sa.Column("filter", sa.Text, nullable=True),
        sa.Column("count", sa.BigInteger, nullable=True),
        sa.Index(f"{prefix}audit_queue_ix", "queue", "id"),
        sa.Index(f"{prefix}audit_actor_ix", "actor", "id"),
        schema=schema,
        **TABLE_OPTIONS,
    )


def downgrade() -> None:
    prefix, schema = migration_options()
    op.drop_table(f"{prefix}audit", schema=schema)
