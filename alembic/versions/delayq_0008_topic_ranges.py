"""delayq: per-message topic state only where it is needed

Adds to ``topic_offsets`` the group's in-flight range of each partition, ``(acked_offset,
delivered_offset]`` with its deadline ``range_until``, and ``marked_upto``, the highest offset that has a
``topic_deliveries`` row (docs/topics.md, "Delivery state"). Keeps every row in flight: before, each
delivery had its row, so ``marked_upto`` is set to the highest row of each partition and the range starts
empty (``delivered_offset`` 0, read as the watermark).

Revision ID: delayq_0008
Revises: delayq_0007
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa

from alembic import op
from delayq.migrations import migration_options

revision = "delayq_0008"
down_revision = "delayq_0007"
branch_labels = None
depends_on = None

COLUMNS = ("delivered_offset", "range_until", "marked_upto")


def upgrade() -> None:
    prefix, schema = migration_options()
    for name in COLUMNS:
        op.add_column(
            f"{prefix}topic_offsets", sa.Column(name, sa.BigInteger, nullable=False, server_default="0"), schema=schema
        )
    offsets = sa.table(
        f"{prefix}topic_offsets",
        sa.column("consumer_group"),
        sa.column("topic"),
        sa.column("partition"),
        sa.column("marked_upto"),
        schema=schema,
    )
    states = sa.table(
        f"{prefix}topic_deliveries",
        sa.column("consumer_group"),
        sa.column("topic"),
        sa.column("partition"),
        sa.column("message_offset"),
        schema=schema,
    )
    highest = (
        sa.select(sa.func.max(states.c.message_offset))
        .where(
            states.c.consumer_group == offsets.c.consumer_group,
            states.c.topic == offsets.c.topic,
            states.c.partition == offsets.c.partition,
        )
        .scalar_subquery()
    )
    op.execute(sa.update(offsets).values(marked_upto=sa.func.coalesce(highest, 0)))


def downgrade() -> None:
    prefix, schema = migration_options()
    # The range's messages have no row: give each the row it would have had (pending, attempt 1), so a
    # downgraded delayq sees them in flight.
    bind = op.get_bind()
    offsets = sa.table(
        f"{prefix}topic_offsets",
        sa.column("consumer_group"),
        sa.column("topic"),
        sa.column("partition"),
        sa.column("acked_offset"),
        sa.column("delivered_offset"),
        sa.column("range_until"),
        schema=schema,
    )
    log = sa.table(
        f"{prefix}topic_log", sa.column("topic"), sa.column("partition"), sa.column("message_offset"), schema=schema
    )
    states = sa.table(
        f"{prefix}topic_deliveries",
        sa.column("consumer_group"),
        sa.column("topic"),
        sa.column("partition"),
        sa.column("message_offset"),
        sa.column("status"),
        sa.column("invisible_until"),
        sa.column("attempts"),
        schema=schema,
    )
    ranges = bind.execute(sa.select(offsets).where(offsets.c.delivered_offset > offsets.c.acked_offset)).all()
    for r in ranges:
        key = {"consumer_group": r.consumer_group, "topic": r.topic, "partition": r.partition}
        have = set(
            bind.execute(
                sa.select(states.c.message_offset).where(
                    states.c.consumer_group == r.consumer_group,
                    states.c.topic == r.topic,
                    states.c.partition == r.partition,
                    states.c.message_offset > r.acked_offset,
                    states.c.message_offset <= r.delivered_offset,
                )
            ).scalars()
        )
        in_log = bind.execute(
            sa.select(log.c.message_offset).where(
                log.c.topic == r.topic,
                log.c.partition == r.partition,
                log.c.message_offset > r.acked_offset,
                log.c.message_offset <= r.delivered_offset,
            )
        ).scalars()
        rows = [
            {**key, "message_offset": o, "status": 0, "invisible_until": r.range_until, "attempts": 1}
            for o in in_log
            if o not in have
        ]
        if rows:
            bind.execute(sa.insert(states), rows)
    for name in reversed(COLUMNS):
        op.drop_column(f"{prefix}topic_offsets", name, schema=schema)
