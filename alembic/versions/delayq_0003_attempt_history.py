"""delayq: each message and dead letter keeps the history of its failed attempts, and its headers

Revision ID: delayq_0003
Revises: delayq_0002
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.migrations import migration_options

revision = "delayq_0003"
down_revision = "delayq_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    prefix, schema = migration_options()
    for table in ("messages", "dead_letters"):
        op.add_column(f"{prefix}{table}", sa.Column("attempt_history", sa.Text, nullable=True), schema=schema)
        op.add_column(f"{prefix}{table}", sa.Column("headers", sa.Text, nullable=True), schema=schema)


def downgrade() -> None:
    prefix, schema = migration_options()
    for table in ("messages", "dead_letters"):
        op.drop_column(f"{prefix}{table}", "headers", schema=schema)
        op.drop_column(f"{prefix}{table}", "attempt_history", schema=schema)
