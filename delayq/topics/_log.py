"""A topic's log: create its rows, append to it under its partitions' head locks (a leaf of the topic
package, below ``topic`` and ``dead_letters``, which both append)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from delayq.errors import InvalidInputError
from delayq.topics.statements import TopicStatements


def ensure_topic(conn: Connection, stmts: TopicStatements, topic: str, partitions: int, now: int) -> None:
    """Create a topic's row and its partitions' head rows unless they exist; refuse another partition count.

    A topic that exists is only read: its rows are not written again, since an upsert of a head row
    waits for the publishers that hold it (MariaDB locks the row it finds; PostgreSQL waits for the
    uncommitted version a publisher wrote).
    """
    existing = conn.execute(stmts.partitions, {"topic_name": topic}).scalar()
    if existing is None:
        conn.execute(stmts.create_topic, {"topic_name": topic, "partition_count": partitions, "now_v": now})
        existing = conn.execute(stmts.partitions, {"topic_name": topic}).scalar_one()
        if existing == partitions:
            conn.execute(stmts.create_head, [{"topic_name": topic, "part": p} for p in range(partitions)])
    if existing != partitions:
        raise InvalidInputError(f"topic {topic!r} exists with {existing} partitions, not {partitions}")


def append(
    conn: Connection,
    stmts: TopicStatements,
    now_param: dict[str, int],
    topic: str,
    items: Sequence[tuple[int, str, str, bytes]],
    payload_type: str,
    extra: Sequence[dict[str, Any]] | None = None,
) -> list[bool]:
    """``append_offsets``, telling per item only whether it was created."""
    return [o is not None for o in append_offsets(conn, stmts, now_param, topic, items, payload_type, extra)]


def append_offsets(
    conn: Connection,
    stmts: TopicStatements,
    now_param: dict[str, int],
    topic: str,
    items: Sequence[tuple[int, str, str, bytes]],
    payload_type: str,
    extra: Sequence[dict[str, Any]] | None = None,
) -> list[int | None]:
    """Append ``(partition, partition_key, message_id, payload)`` items, skipping ids in the log; per item,
    its new offset, or None when its id was there already. Four statements, whatever the number of
    partitions touched.

    The partitions' head rows are locked first, in ascending order: publishers of a partition take
    their offsets one transaction after another, so offsets follow commit order with no gaps. Ids
    are looked up under those locks with a plain read: every key of a partition is published under
    its lock, and at READ COMMITTED (delayq's own transactions) the read sees what the previous
    holder committed. (A locking read would wait for an uncommitted publisher of another partition
    on MySQL.) In a caller's REPEATABLE READ transaction that read an older snapshot, a duplicate can
    fail the unique constraint instead of being ignored.
    """
    parts = sorted({p for p, _, _, _ in items})
    locked = conn.execute(stmts.lock_heads, {"topic_name": topic, "parts": parts, **now_param}).all()
    if len(locked) != len(parts):
        raise InvalidInputError(
            f"topic {topic!r} lacks partitions {sorted(set(parts) - {r.partition for r in locked})}"
        )
    heads = {int(r.partition): int(r.head) for r in locked}
    now = int(locked[0].now)
    existing = stmts.existing_ids_of(conn, topic, list({(k, mid) for _, k, mid, _ in items}))
    created: list[int | None] = []
    rows: list[tuple[int, int, str, str, bytes, dict[str, Any] | None]] = []
    for i, (partition, k, mid, payload) in enumerate(items):
        if (k, mid) in existing:
            created.append(None)
            continue
        existing.add((k, mid))
        heads[partition] += 1
        rows.append((partition, heads[partition], k, mid, payload, extra[i] if extra is not None else None))
        created.append(heads[partition])
    if rows:
        stmts.insert_log_rows(conn, topic, payload_type, now, rows)
        stmts.set_heads(conn, topic, {p: heads[p] for p in {r[0] for r in rows}})
    return created
