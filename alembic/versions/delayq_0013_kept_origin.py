"""delayq: a kept message remembers its priority, its group and the worker that recorded its outcome

Adds ``priority``, ``group_key`` and ``worker`` to ``{prefix}finished`` and ``{prefix}dead_letters``: the live
row's priority and group, copied by the statements that move it (an ack that keeps it, a dead letter, a
cancel), and the registry id (``{prefix}workers.id``) of the worker whose ack or dead letter moved it (NULL
for an outcome recorded outside a worker, and for a cancel: the canceller is not the worker). A requeued dead
letter gets its priority and group back. Rows kept before this revision leave the three NULL ("not
recorded"). Additive: nothing else changes, and no row is rewritten.

Revision ID: delayq_0013
Revises: delayq_0012
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.dialects.types import name_type
from delayq.migrations import migration_options

revision = "delayq_0013"
down_revision = "delayq_0012"
branch_labels = None
depends_on = None

KEPT = ("finished", "dead_letters")
"""The tables of kept rows."""


def upgrade() -> None:
    prefix, schema = migration_options()
    for table in KEPT:
        op.add_column(f"{prefix}{table}", sa.Column("priority", sa.SmallInteger, nullable=True), schema=schema)
        op.add_column(f"{prefix}{table}", sa.Column("group_key", name_type(200), nullable=True), schema=schema)
        op.add_column(f"{prefix}{table}", sa.Column("worker", sa.String(36), nullable=True), schema=schema)


def downgrade() -> None:
    prefix, schema = migration_options()
    for table in KEPT:
        for column in ("worker", "group_key", "priority"):
            op.drop_column(f"{prefix}{table}", column, schema=schema)
