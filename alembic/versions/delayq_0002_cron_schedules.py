"""delayq: a record of each installed cron schedule

Revision ID: delayq_0002
Revises: delayq_0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.dialects.types import TABLE_OPTIONS, pad_space_name_type
from delayq.migrations import migration_options

revision = "delayq_0002"
down_revision = "delayq_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    prefix, schema = migration_options()
    op.create_table(
        f"{prefix}schedules",
        sa.Column("queue", pad_space_name_type(100), primary_key=True),
        sa.Column("name", pad_space_name_type(150), primary_key=True),
        sa.Column("definition", sa.Text, nullable=False),
        sa.Column("config_hash", sa.String(32), nullable=False),
        sa.Column("installed_at", sa.BigInteger, nullable=False),
        sa.Column("refreshed_at", sa.BigInteger, nullable=False),
        sa.Column("refreshed_by", sa.String(200), nullable=False),
        sa.Column("installed_until", sa.BigInteger, nullable=True),
        schema=schema,
        **TABLE_OPTIONS,
    )


def downgrade() -> None:
    prefix, schema = migration_options()
    op.drop_table(f"{prefix}schedules", schema=schema)
