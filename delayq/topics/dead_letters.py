"""A topic's dead letters: moving a message there for one consumer group, and an operator's list,
requeue and purge of them.

A group's dead letter of a message is a row of the topic ``{topic}_dlq`` whose id is
``{group}:{message id}`` (or, when an earlier dead letter holds that one or it does not fit, the id
``dead_letter_id`` makes with the original offset) and whose failure columns say where it came from.
Requeueing one publishes its payload again on the original topic, under a new id, for the group that
gave up on it alone (the topic's other groups get it marked done), and deletes the dead letter, in one
transaction. See docs/topics.md, "Dead letters".
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from delayq.browse import show_payload
from delayq.clock import from_ms
from delayq.errors import InvalidInputError
from delayq.schema import MAX_GROUP_LENGTH, MAX_LOG_ID_LENGTH, MAX_MESSAGE_ID_LENGTH, MAX_TOPIC_LENGTH, TopicTables
from delayq.serializers import Serializer
from delayq.topics._log import append, append_offsets, ensure_topic
from delayq.topics.names import (
    check_group,
    check_message_id,
    check_partition_key,
    dead_letter_topic,
    has_dead_letter_topic,
    partition_for,
)
from delayq.topics.statements import ACKED, TopicStatements

DEAD_AGAIN = "~dead-"
"""The tail of a dead letter's second id, ``{group}:{id}~dead-{original offset}`` (``dead_letter_id``)."""
_DEAD_ID_ROOM = MAX_LOG_ID_LENGTH - MAX_GROUP_LENGTH - len(":") - len(DEAD_AGAIN) - len(str(2**63 - 1))
REQUEUED = "~requeue-"
"""A requeued message's id is ``{id}~requeue-{n}``, ``n`` its dead letter's offset in ``{topic}_dlq``."""
_REQUEUED_TAIL = re.compile(re.escape(REQUEUED) + r"[0-9]+\Z")
CHUNK = 500
"""Dead letters requeued or purged per transaction."""


def bury(
    conn: Connection,
    stmts: TopicStatements,
    now_param: dict[str, int],
    key: dict[str, Any],
    message: Any,
    attempts: int,
    error: str | None,
) -> bool:
    """Mark the group's delivery of ``message`` dead and append it to ``{topic}_dlq``, in the caller's transaction.

    The delivery's status changes first, by compare-and-swap on its attempt count: when that finds
    nothing (acked or delivered again since), nothing is appended, so a retried commit appends
    nothing twice. The dead letter's id is ``dead_letter_id``'s; the append's outcome is checked, and
    one whose id an earlier dead letter holds is appended under the id naming the original offset.
    Returns whether it was moved; ``InvalidInputError`` (before anything is written) when the
    topic's name leaves no room for a dead-letter topic.
    """
    topic = key["topic_name"]
    dlq = dead_letter_topic(topic)
    if not has_dead_letter_topic(topic):
        raise InvalidInputError(
            f"topic {topic!r} has no dead-letter topic ({dlq!r} would be over {MAX_TOPIC_LENGTH} characters): "
            "ack or nack the message instead"
        )
    marked = conn.execute(
        stmts.bury, {**key, "offset": message.message_offset, "attempt_no": attempts, "error": error}
    ).rowcount
    if marked != 1:
        return False
    now = int(conn.execute(stmts.now, now_param).scalar_one())
    if conn.execute(stmts.partitions, {"topic_name": dlq}).scalar() is None:
        # A dead letter of a dead letter whose subscriber did not create it (max_attempts=None): a whole topic.
        # (A topic's row comes with every partition's head row: nothing to create when it is there.)
        ensure_topic(conn, stmts, dlq, int(conn.execute(stmts.partitions, {"topic_name": topic}).scalar_one()), now)
    group, offset = key["group"], int(message.message_offset)
    extra = {
        "original_topic": topic,
        "original_offset": offset,
        "failed_group": group,
        "failed_at": now,
        "failure_count": attempts,
        "last_error": error,
    }
    for again in (False, True):
        dead_id = dead_letter_id(group, message.message_id, offset, again=again)
        if dead_id is None:
            continue
        item = (key["part"], message.partition_key, dead_id, bytes(message.payload))
        if append(conn, stmts, now_param, dlq, [item], message.payload_type, extra=[extra])[0]:
            return True
    # Both ids taken: the second names this group and this offset, so it is this message's dead letter from
    # an earlier incarnation of the group (dropped and created again), unless somebody published it by hand.
    same = conn.execute(
        stmts.dead_letter_of,
        {"topic_name": dlq, "part": key["part"], "group": group, "original_offset": offset, "original_topic": topic},
    ).first()
    if same is None:
        raise InvalidInputError(
            f"cannot dead-letter offset {offset} of {topic}[{key['part']}]: its dead-letter ids are taken in {dlq!r} "
            "by messages that are not its dead letters"
        )
    return True


def dead_letter_id(group: str, message_id: str, original_offset: int, *, again: bool) -> str | None:
    """A dead letter's id in ``{topic}_dlq``: ``{group}:{message_id}`` first (None when it does not fit the
    column: a dead letter of a dead letter with long names); ``again``, when an earlier dead letter holds
    that one (the id was published again after the log was collected),
    ``{group}:{message_id cut to 175 characters}~dead-{original offset}``, which always fits.

    Offsets of a partition are never given out twice and a partition key has one partition, so
    the second id is unique per group and message.
    """
    first = f"{group}:{message_id}"
    if not again:
        return first if len(first) <= MAX_LOG_ID_LENGTH else None
    return f"{group}:{message_id[:_DEAD_ID_ROOM]}{DEAD_AGAIN}{original_offset}"


def original_id(dead_id: str, group: str, original_offset: int) -> str:
    """The id a dead letter's message was published under (cut to 175 characters when its dead letter's id
    had to be): ``dead_letter_id`` undone."""
    found = _unprefixed(dead_id, group)
    tail = f"{DEAD_AGAIN}{original_offset}"
    return found[: -len(tail)] if found.endswith(tail) else found


# -- the operator's view ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TopicDeadLetter:
    """A message one consumer group gave up on, as the topic's dead-letter topic holds it."""

    group: str
    """The consumer group that gave up on it (its other groups are not concerned)."""
    partition: int
    offset: int
    """Its offset in ``{topic}_dlq`` (the same partition as the original)."""
    partition_key: str
    message_id: str
    """The id it was published under (the dead letter's own id is ``{group}:{message_id}``, or
    ``{group}:{message_id}~dead-{original_offset}`` with the id cut to 175 characters: see ``dead_letter_id``)."""
    original_offset: int
    failed_at: dt.datetime
    failure_count: int
    last_error: str | None
    payload_type: str
    payload: Any
    """Decoded by the topic's serializer when written by its kind; else as ``delayq.browse.show_payload`` shows it."""
    original_topic: str
    """The topic it was published on (``{original_topic}_dlq`` holds the dead letter)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "original_topic": self.original_topic,
            "group": self.group,
            "partition": self.partition,
            "offset": self.offset,
            "partition_key": self.partition_key,
            "message_id": self.message_id,
            "original_offset": self.original_offset,
            "failed_at": self.failed_at.isoformat(),
            "failure_count": self.failure_count,
            "last_error": self.last_error,
            "payload_type": self.payload_type,
            "payload": self.payload,
        }


@dataclass(frozen=True)
class Selection:
    """Which dead letters: of one group or all; by message id, partition key, both, or all of them."""

    group: str | None
    key: str | None
    message_id: str | None

    @classmethod
    def of(
        cls, group: str | None, key: str | None, message_id: str | None, everything: bool | None, verb: str
    ) -> Selection:
        """Checked; ``everything`` None for a listing (no filter is all), else it must be said."""
        if everything is not None and everything == (key is not None or message_id is not None):
            raise InvalidInputError(f"{verb} takes message_id= and/or key=, or everything=True (group= narrows either)")
        return cls(
            None if group is None else check_group(group),
            None if key is None else check_partition_key(key),
            None if message_id is None else check_message_id(message_id),
        )

    def where(self, t: TopicTables, topic: str, partitions: int) -> list[sa.ColumnElement[bool]]:
        log = t.log
        found = [log.c.topic == dead_letter_topic(topic), log.c.original_topic.is_not(None)]
        if self.key is not None:
            found += [log.c.partition == partition_for(self.key, partitions), log.c.partition_key == self.key]
        if self.group is not None:
            found.append(log.c.failed_group == self.group)
        if self.message_id is not None:
            # Either of its ids (``dead_letter_id``): the first, or the second with its original offset.
            group: Any = log.c.failed_group if self.group is None else sa.literal(self.group, sa.String)
            again = group + (":" + self.message_id[:_DEAD_ID_ROOM] + DEAD_AGAIN)
            found.append(
                sa.or_(
                    log.c.message_id == group + (":" + self.message_id),
                    log.c.message_id == again + sa.cast(log.c.original_offset, sa.String),
                )
            )
        return found


def list_dead(
    conn: Connection, t: TopicTables, topic: str, partitions: int, sel: Selection, limit: int, serializer: Serializer
) -> list[TopicDeadLetter]:
    """The selected dead letters of ``topic``, by partition and offset (one read)."""
    log = t.log
    query = (
        sa.select(
            log.c.partition,
            log.c.message_offset,
            log.c.partition_key,
            log.c.message_id,
            log.c.payload,
            log.c.payload_type,
            log.c.original_topic,
            log.c.original_offset,
            log.c.failed_group,
            log.c.failed_at,
            log.c.failure_count,
            log.c.last_error,
        )
        .where(*sel.where(t, topic, partitions))
        .order_by(log.c.partition, log.c.message_offset)
        .limit(limit)
    )
    return [
        TopicDeadLetter(
            group=r.failed_group,
            partition=int(r.partition),
            offset=int(r.message_offset),
            partition_key=r.partition_key,
            message_id=original_id(r.message_id, r.failed_group, int(r.original_offset)),
            original_offset=int(r.original_offset),
            failed_at=from_ms(int(r.failed_at)),
            failure_count=int(r.failure_count),
            last_error=r.last_error,
            payload_type=r.payload_type,
            payload=_shown(serializer, r.payload_type, bytes(r.payload)),
            original_topic=r.original_topic,
        )
        for r in conn.execute(query)
    ]


def dead_offsets(
    conn: Connection, t: TopicTables, topic: str, partitions: int, sel: Selection
) -> list[tuple[int, int]]:
    """The ``(partition, offset)`` of each selected dead letter (one read)."""
    log = t.log
    query = (
        sa.select(log.c.partition, log.c.message_offset)
        .where(*sel.where(t, topic, partitions))
        .order_by(log.c.partition, log.c.message_offset)
    )
    return [(int(r.partition), int(r.message_offset)) for r in conn.execute(query)]


def requeued_id(dead_id: str, group: str, original_offset: int, dead_offset: int) -> str:
    """The id a dead letter is published again under: its original id (``original_id``; an earlier requeue's
    tail replaced) with ``~requeue-{its offset in the dead-letter topic}``, cut to fit 200 characters.

    Offsets in a partition of the dead-letter topic are never given out twice and a key has one
    partition, so two dead letters never get the same id, and one dead letter always gets the same:
    a requeue whose commit is retried finds its message there and publishes nothing twice.
    """
    base = _REQUEUED_TAIL.sub("", original_id(dead_id, group, original_offset))
    tail = f"{REQUEUED}{dead_offset}"
    return base[: MAX_MESSAGE_ID_LENGTH - len(tail)] + tail


def requeue(
    conn: Connection,
    stmts: TopicStatements,
    now_param: dict[str, int],
    topic: str,
    partitions: int,
    letters: Sequence[tuple[int, int]],
) -> int:
    """Publish the given dead letters again on ``topic`` and delete them, in the caller's transaction.

    Each goes to its own group only: a delivery state "acked" is written for every other group
    that subscribes to the partition, so their watermarks pass it (none for a group with watermarks and
    no leases, a Spark query's: it reads the log by offsets, and nothing would ever forget the state).
    A dead letter whose group no longer reads
    the topic (its ``topic_offsets`` rows deleted), or whose new id is taken, stays where it is.
    Returns how many were requeued.
    """
    dlq = dead_letter_topic(topic)
    dead_parts = _fence(conn, stmts, now_param, dlq, letters)
    rows = [
        (p, r)
        for p in dead_parts
        for r in conn.execute(
            stmts.messages, {"topic_name": dlq, "part": p, "offsets": [o for q, o in letters if q == p]}
        )
    ]
    if not rows:
        return 0
    targets = sorted({partition_for(r.partition_key, partitions) for _, r in rows})
    # Every head first, in ascending order as publishers lock them (appends by payload kind lock them again).
    conn.execute(stmts.lock_heads, {"topic_name": topic, "parts": targets, **now_param}).all()
    readers: dict[int, set[str]] = {}
    subscribed: dict[int, set[str]] = {}
    for reader in conn.execute(stmts.readers, {"topic_name": topic, "parts": targets}):
        readers.setdefault(int(reader.partition), set()).add(reader.consumer_group)
        if reader.subscribed:
            subscribed.setdefault(int(reader.partition), set()).add(reader.consumer_group)
    by_kind: dict[str, list[tuple[int, Any, tuple[int, str, str, bytes]]]] = {}
    for dead_part, r in rows:
        part = partition_for(r.partition_key, partitions)
        if r.failed_group not in readers.get(part, ()):
            continue
        new_id = requeued_id(r.message_id, r.failed_group, int(r.original_offset), int(r.message_offset))
        by_kind.setdefault(r.payload_type, []).append((dead_part, r, (part, r.partition_key, new_id, bytes(r.payload))))
    states: list[dict[str, Any]] = []
    removed: dict[int, list[int]] = {}
    for kind, entries in by_kind.items():
        made = append_offsets(conn, stmts, now_param, topic, [item for _, _, item in entries], kind)
        for (dead_part, r, (part, _, _, _)), offset in zip(entries, made, strict=True):
            if offset is None:
                continue
            states += [
                {"consumer_group": g, "topic": topic, "partition": part, "message_offset": offset}
                | {"status": ACKED, "invisible_until": 0, "attempts": 0}
                for g in sorted(subscribed.get(part, set()) - {r.failed_group})
            ]
            removed.setdefault(dead_part, []).append(int(r.message_offset))
    if states:
        conn.execute(stmts.insert_state, states)
        # Their polls read rows only up to marked_upto (docs/topics.md, "Delivery state").
        conn.execute(
            stmts.raise_mark,
            [
                {
                    "group": s["consumer_group"],
                    "topic_name": topic,
                    "part": s["partition"],
                    "offset": s["message_offset"],
                }
                for s in states
            ],
        )
    return _remove(conn, stmts, dlq, removed)


def purge(
    conn: Connection, stmts: TopicStatements, now_param: dict[str, int], topic: str, letters: Sequence[tuple[int, int]]
) -> int:
    """Delete the given dead letters of ``topic``, in the caller's transaction; how many."""
    dlq = dead_letter_topic(topic)
    parts = _fence(conn, stmts, now_param, dlq, letters)
    return _remove(conn, stmts, dlq, {p: [o for q, o in letters if q == p] for p in parts})


def _fence(
    conn: Connection, stmts: TopicStatements, now_param: dict[str, int], dlq: str, letters: Sequence[tuple[int, int]]
) -> list[int]:
    """Lock the dead-letter topic's head rows of these letters' partitions (ordered with a group joining
    it and with its garbage collection), then the leases of every group reading them (ordered with
    their polls, which read offsets and then their rows: none sees a row vanish between the two)."""
    parts = sorted({p for p, _ in letters})
    conn.execute(stmts.lock_heads, {"topic_name": dlq, "parts": parts, **now_param}).all()
    groups = sorted({r.consumer_group for r in conn.execute(stmts.readers, {"topic_name": dlq, "parts": parts})})
    if groups:
        conn.execute(stmts.lock_readers, {"groups": groups, "topic_name": dlq, "parts": parts}).all()
    return parts


def _remove(conn: Connection, stmts: TopicStatements, dlq: str, offsets: dict[int, list[int]]) -> int:
    return sum(
        int(conn.execute(stmts.remove, {"topic_name": dlq, "part": p, "offsets": offs}).rowcount)
        for p, offs in sorted(offsets.items())
        if offs
    )


def _unprefixed(dead_id: str, group: str) -> str:
    prefix = f"{group}:"
    return dead_id[len(prefix) :] if dead_id.startswith(prefix) else dead_id


def _shown(serializer: Serializer, payload_type: str, data: bytes) -> Any:
    if payload_type == serializer.type_tag:
        try:
            return serializer.loads(data)
        except (TypeError, ValueError):
            pass
    return show_payload(payload_type, data)
