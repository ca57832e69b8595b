"""The audit page (GET ``/audit``): who did what from the dashboard and the command line, newest first, a keyset
page at a time, filtered by queue, action and/or actor (``delayq.audit``)."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from delayq import audit
from delayq.errors import InvalidInputError
from delayq.web._reads import Where
from delayq.web._render import Dashboard

PAGE = 50
"""Entries per page."""


def _before(text: str) -> int | None:
    if not text:
        return None
    if not (text.isascii() and text.isdigit()):
        raise InvalidInputError("bad page cursor: follow the audit page's own 'next' link")
    return int(text)


def _read(
    where: Where, queue: str | None, action: str | None, actor: str | None, before: int | None
) -> list[audit.AuditEntry]:
    with where.engine.connect() as conn:
        found = audit.entries(
            conn, where.tables, queue=queue, action=action, actor=actor, before=before, limit=PAGE + 1
        )
        conn.rollback()
    return found


async def page(dash: Dashboard, request: Request) -> Response:
    chosen = {
        "queue": request.query_params.get("queue", ""),
        "action": request.query_params.get("action", ""),
        "actor": request.query_params.get("actor", ""),
    }
    before = _before(request.query_params.get("before", ""))
    found = await run_in_threadpool(
        _read, dash.where, chosen["queue"] or None, chosen["action"] or None, chosen["actor"] or None, before
    )
    rows, more = found[:PAGE], len(found) > PAGE
    following = rows[-1].id if more else None
    return dash.render(request, "audit.html", rows=rows, next_before=following, before=before, filters=chosen)
