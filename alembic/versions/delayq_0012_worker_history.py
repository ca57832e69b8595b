"""delayq: what each worker runs now, and each queue's outcomes per minute

Adds ``running`` to ``{prefix}workers``: the deliveries a worker's handlers were running at its last heartbeat
(a JSON list: queue, key, attempt, how long each had run), written with the heartbeat's UPDATE; read by the
dashboard's workers page and ``delayq workers --running``. Rows of older delayq versions leave it NULL.

Adds ``{prefix}queue_history``: per queue and minute (epoch ms of the minute's start, database time), how many
deliveries the workers processed, failed (to be retried) and dead-lettered. Each worker adds what it counted
since its last heartbeat to the minute's row (one upsert per beat, so many workers add up); rows older than
24 hours are deleted a bounded batch at a time by the running workers. Read by ``delayq history`` and the
dashboard's charts. Additive: nothing else changes.

Revision ID: delayq_0012
Revises: delayq_0011
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.dialects.types import TABLE_OPTIONS, name_type
from delayq.migrations import migration_options

revision = "delayq_0012"
down_revision = "delayq_0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    prefix, schema = migration_options()
    op.add_column(f"{prefix}workers", sa.Column("running", sa.Text, nullable=True), schema=schema)
    op.create_table(
        f"{prefix}queue_history",
        sa.Column("queue", name_type(100), primary_key=True),
        sa.Column("minute", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("processed", sa.BigInteger, nullable=False),
        sa.Column("failed", sa.BigInteger, nullable=False),
        sa.Column("dead_lettered", sa.BigInteger, nullable=False),
        sa.Index(f"{prefix}queue_history_minute_ix", "minute"),
        schema=schema,
        **TABLE_OPTIONS,
    )


def downgrade() -> None:
    prefix, schema = migration_options()
    op.drop_table(f"{prefix}queue_history", schema=schema)
    op.drop_column(f"{prefix}workers", "running", schema=schema)
