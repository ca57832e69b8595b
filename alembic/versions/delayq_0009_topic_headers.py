"""delayq: topic messages keep headers (the trace context of their publish)

Adds ``topic_log.headers``: a JSON object of text, NULL unless an observer (``delayq.tracing``) added
headers when the message was published. A topic handler's span links to the publish's through it.
Additive: existing messages have none.

Revision ID: delayq_0009
Revises: delayq_0007
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.migrations import migration_options

revision = "delayq_0009"
down_revision = "delayq_0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    prefix, schema = migration_options()
    op.add_column(f"{prefix}topic_log", sa.Column("headers", sa.Text, nullable=True), schema=schema)


def downgrade() -> None:
    prefix, schema = migration_options()
    op.drop_column(f"{prefix}topic_log", "headers", schema=schema)
