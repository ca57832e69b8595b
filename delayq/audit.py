"""Who did what: the audit of operators' actions, recorded by the dashboard and the command line.

Every action taken from ``delayq.web`` or the ``delayq`` command (pause, resume, limits, cancel, requeue,
purge, reschedule, run now, and their bulk forms) is a row of ``{prefix}audit`` (delayq_0011): who (the
dashboard's ``authorize`` identity, the OS user of the command line), from where (``web``, ``cli``), what,
on which queue, under which filter, how many messages it affected, and when (the database's time).
``delayq audit`` and the dashboard's audit page read it, newest first. An application that acts on its
queues itself can record its own actions with ``record``, in its own transaction (pass a ``Connection``).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection, Engine, RowMapping

from delayq.clock import Clock, from_ms, to_ms
from delayq.errors import InvalidInputError
from delayq.queue import _audit, check_queue_name, check_text
from delayq.schema import Tables
from delayq.transactions import Runner

__all__ = ["MAX_PAGE", "AuditEntry", "entries", "record"]

MAX_PAGE = 1000
"""The most entries one read returns."""
_MAX_ID = 2**63 - 1


@dataclass(frozen=True)
class AuditEntry:
    """One recorded action."""

    id: int
    """Grows with every entry: a page of entries ends at one, the next starts below it (``entries(before=)``)."""
    at: dt.datetime
    """When it was recorded: the database's time (UTC)."""
    source: str
    """``web`` (the dashboard) or ``cli`` (the command line), or what an application recorded."""
    actor: str
    """Who: the ``authorize`` hook's identity (``anonymous`` without one), or the OS user of the command line."""
    action: str
    """What: ``pause``, ``limits``, ``cancel``, ``requeue-all``, ... (docs/operations.md, "Audit")."""
    queue: str | None
    filter: dict[str, Any] = field(default_factory=dict)
    """What the action selected (``key``, ``prefix``, ``tag``, ``state``) or set (the limits, the due time)."""
    count: int | None = None
    """How many messages it affected; None where that is not a count (a pause)."""


def record(
    using: Engine | Connection,
    tables: Tables,
    action: str,
    *,
    actor: str,
    source: str,
    queue: str | None = None,
    filter: Mapping[str, Any] | None = None,
    count: int | None = None,
    clock: Clock | None = None,
) -> None:
    """Record an action: in a transaction of its own (an ``Engine``, retried on transient errors) or the caller's
    (a ``Connection``: the entry commits, or not, with the action).

    ``actor`` is kept as given, its NUL characters dropped and cut to 200 characters (it is recorded after
    the fact: it never refuses). ``filter``: a JSON object; its None values are left out. ``clock``: a
    ``ManualClock`` for tests; the database's time by default.
    """
    action = check_text(action, "audit action", _audit.MAX_ACTION_LENGTH, InvalidInputError)
    source = check_text(source, "audit source", _audit.MAX_SOURCE_LENGTH, InvalidInputError)
    if queue is not None:
        queue = check_queue_name(queue)
    if count is not None and (not isinstance(count, int) or count < 0):
        raise InvalidInputError(f"an audit count is an int of at least 0, got {count!r}")
    shown = {k: v for k, v in (filter or {}).items() if v is not None}
    now = None if clock is None else to_ms(clock.now())
    who = _actor(actor)
    engine = using if isinstance(using, Engine) else using.engine

    def op(conn: Connection, _: object) -> None:
        _audit.insert(
            conn, tables, source=source, actor=who, action=action, queue=queue, filter=shown, count=count, now=now
        )

    Runner(engine, tables, owner="delayq.audit").run(using, op, "statement")


def _actor(actor: str) -> str:
    text = str(actor).replace("\x00", "").encode("utf-8", "replace").decode("utf-8")
    return text[: _audit.MAX_ACTOR_LENGTH] or "anonymous"


def entries(
    conn: Connection,
    tables: Tables,
    *,
    queue: str | None = None,
    action: str | None = None,
    actor: str | None = None,
    before: int | None = None,
    limit: int = 50,
) -> list[AuditEntry]:
    """Recorded actions, newest first: up to ``limit`` (at most ``MAX_PAGE``) of those below the id ``before``
    (the last one of the page before; None: from the newest), of one queue, action and/or actor when given."""
    if queue is not None:
        queue = check_queue_name(queue)
    if action is not None:
        action = check_text(action, "action", _audit.MAX_ACTION_LENGTH, InvalidInputError)
    if actor is not None:
        actor = check_text(actor, "actor", _audit.MAX_ACTOR_LENGTH, InvalidInputError)
    if before is not None and (not isinstance(before, int) or not 0 < before <= _MAX_ID):
        raise InvalidInputError(f"an audit page starts below an id from 1 to {_MAX_ID}, got {before!r}")
    if not isinstance(limit, int) or not 0 < limit <= MAX_PAGE:
        raise InvalidInputError(f"an audit page holds 1 to {MAX_PAGE} entries, got {limit!r}")
    rows = _audit.page(conn, tables, queue=queue, action=action, actor=actor, before=before, limit=limit)
    return [_entry(r._mapping) for r in rows]


def _entry(r: RowMapping) -> AuditEntry:
    return AuditEntry(
        id=int(r["id"]),
        at=from_ms(int(r["at"])),
        source=r["source"],
        actor=r["actor"],
        action=r["action"],
        queue=r["queue"],
        filter=json.loads(r["filter"]) if r["filter"] else {},
        count=None if r["count"] is None else int(r["count"]),
    )
