"""A web dashboard of delayq's queues, dead letters, cron schedules, topics and workers (the ``delayq[web]`` extra).

``app(engine)`` returns an ASGI application (Starlette) to serve with ``delayq web`` or to mount inside
your own (FastAPI or Starlette: ``Mount("/delayq", app=delayq.web.app(engine))``; every link follows the
mount path). It reads and acts only through delayq's public operations, serves its few assets itself
(no CDN: it works offline), and is read-only unless ``actions=True``. See docs/operations.md.

Modules: ``_reads`` (what pages show, through the public reads), ``_pages`` (GET pages and their JSON
panels), ``_actions`` (POST actions), ``_csrf`` (the double-submit token), ``_render`` (templates and the
shared state), ``_snapshot`` (every queue's counts, read once for all viewers), ``_samples`` (the charts'
in-memory history), ``_auth`` (roles: ``authorize``'s answer; HTTP basic auth for ``delayq web``), ``_audit``
(the audit page), ``_history`` (the queue history's chart and JSON, from the database).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from delayq.errors import InvalidInputError
from delayq.schema import DEFAULT_PREFIX
from delayq.web import _actions, _audit, _history, _pages
from delayq.web._auth import Access, Authorize, BasicAuth, access_of, remember
from delayq.web._reads import Where
from delayq.web._render import HERE, Dashboard

__all__ = ["Access", "BasicAuth", "app"]

Handler = Callable[[Dashboard, Request], Awaitable[Response]]


def app(
    engine: sa.Engine,
    *,
    actions: bool = False,
    authorize: Authorize | None = None,
    table_prefix: str = DEFAULT_PREFIX,
    schema: str | None = None,
    refresh: float = 2.0,
) -> ASGIApp:
    """The dashboard of the delayq tables ``engine`` reaches, as an ASGI application.

    Args:
        engine: the database's engine (the application's own is fine: each page holds a connection
            only while it reads).
        actions: allow the actions (run now, reschedule, cancel, requeue/purge dead letters, pause, resume,
            limits); False (read-only) by default. Actions are POSTs carrying a CSRF token.
        authorize: called with every request (pages, panels, assets, actions); a False (or None) answer is a
            403. True lets the request in as an acting user; ``"read"`` or ``"act"`` says the user's role, an
            ``Access`` their role and identity (recorded by the audit): a ``read`` user sees no forms and their
            actions are refused (403). None (no hook) lets every request through as an acting user: protect
            the dashboard some other way (see docs/operations.md, "Roles").
        table_prefix, schema: where delayq's tables are, as for ``DelayedQueue``.
        refresh: seconds between the live panels' reads in the browser; 2 by default.
    """
    dash = Dashboard.make(Where(engine, table_prefix, schema), actions, authorize, refresh)

    def route(path: str, handler: Handler, methods: tuple[str, ...] = ("GET",)) -> Route:
        return Route(path, partial(_guarded, dash, handler), methods=list(methods))

    routes = [
        route("/", _pages.overview),
        route("/queue", _pages.messages),
        route("/dead", _pages.dead_letters),
        route("/message", _pages.message),
        route("/search", _pages.search),
        route("/cron", _pages.cron),
        route("/topics", _pages.topics),
        route("/topic", _pages.topic),
        route("/workers", _pages.workers),
        route("/history", _history.history_fragment),
        route("/history.json", _history.history_json),
        route("/api/overview", _pages.overview_json),
        route("/api/queue", _pages.queue_json),
        route("/api/topics", _pages.topics_json),
        route("/api/workers", _pages.workers_json),
        route("/audit", _audit.page),
        route("/act/{action}", _actions.act, ("POST",)),
        Route("/favicon.ico", _favicon),  # (browsers ask for it at the root of what they browse)
        Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
    ]
    inner = Starlette(routes=routes)
    if authorize is None:
        return inner
    return _Authorized(inner, dash)


async def _favicon(request: Request) -> Response:
    return FileResponse(HERE / "static" / "favicon.ico", media_type="image/x-icon")


async def _guarded(dash: Dashboard, handler: Handler, request: Request) -> Response:
    """Run a page or an action; bad input (a queue name too long, say) is a 400 page, not a traceback."""
    try:
        return await handler(dash, request)
    except InvalidInputError as exc:
        return dash.error(request, 400, str(exc))


class _Authorized:
    """Ask ``authorize`` about every request (the static assets' included) before the dashboard sees it."""

    def __init__(self, inner: ASGIApp, dash: Dashboard) -> None:
        self.inner, self.dash = inner, dash

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.dash.authorize is not None:
            request = Request(scope, receive)
            granted = access_of(self.dash.authorize(request))
            if granted is None:
                await self.dash.error(request, 403, "not authorized")(scope, receive, send)
                return
            remember(scope, granted)
        await self.inner(scope, receive, send)
