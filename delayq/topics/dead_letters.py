"""Moving a message to its topic's dead-letter topic, for one consumer group."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Connection

from delayq.topics.names import dead_letter_topic
from delayq.topics.statements import TopicStatements
from delayq.topics.topic import append


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
    nothing (acked or delivered again since), nothing is appended. The dead letter's id is
    ``{group}:{message id}``, so each group's failure of a message is a row of its own; appending it
    twice (after a retried commit) finds the first and adds nothing. Returns whether it was moved.
    """
    marked = conn.execute(
        stmts.bury, {**key, "offset": message.message_offset, "attempt_no": attempts, "error": error}
    ).rowcount
    if marked != 1:
        return False
    dlq = dead_letter_topic(key["topic_name"])
    conn.execute(stmts.create_head, {"topic_name": dlq, "part": key["part"]})
    now = conn.execute(stmts.now, now_param).scalar_one()
    append(
        conn,
        stmts,
        now_param,
        dlq,
        [(key["part"], message.partition_key, f"{key['group']}:{message.message_id}", bytes(message.payload))],
        message.payload_type,
        extra=[
            {
                "original_topic": key["topic_name"],
                "original_offset": message.message_offset,
                "failed_group": key["group"],
                "failed_at": int(now),
                "failure_count": attempts,
                "last_error": error,
            }
        ],
    )
    return True
