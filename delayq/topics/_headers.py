"""Headers of topic messages: what observers add when a message is published (``delayq.tracing``'s trace
context), stored with it in ``topic_log.headers`` and read back when a handler starts."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from delayq.dialects import Dialect
from delayq.topics._context import TopicContext


def encode(headers: dict[str, str] | None) -> str | None:
    """The column's text for ``headers`` (None when there are none)."""
    return json.dumps(headers, separators=(",", ":"), sort_keys=True) if headers else None


def _statement(ctx: TopicContext, dialect: Dialect) -> Any:
    def build() -> Any:
        log = ctx.tables.topics.log
        return sa.select(log.c.headers).where(
            log.c.topic == sa.bindparam("topic_name", type_=sa.String),
            log.c.partition == sa.bindparam("part", type_=sa.Integer),
            log.c.message_offset == sa.bindparam("offset", type_=sa.BigInteger),
        )

    return dialect.cached(("topic_headers", ctx.prefix, ctx.schema), build)


def read(ctx: TopicContext, topic: str, partition: int, offset: int) -> dict[str, str]:
    """The headers published with message ``offset`` of ``topic``'s ``partition`` ({} when none, or gone)."""
    text = ctx.runner.run(
        None,
        lambda conn, d: conn.execute(
            _statement(ctx, d), {"topic_name": topic, "part": partition, "offset": offset}
        ).scalar(),
        "read",
    )
    if not text:
        return {}
    found = json.loads(text)
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
