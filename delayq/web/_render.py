"""The dashboard as one object the pages and actions share, and HTML rendering (Jinja2, autoescaped)."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlencode

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from delayq.humanize import human
from delayq.web import _csrf
from delayq.web._auth import Authorize, access
from delayq.web._reads import Where
from delayq.web._samples import Samples
from delayq.web._snapshot import Snapshots

HERE = Path(__file__).parent


def _ago(when: dt.datetime | None, now: dt.datetime) -> str:
    if when is None:
        return "-"
    span = when - now
    return f"in {human(span)}" if span.total_seconds() > 0 else f"{human(span)} ago"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = lambda s: quote(str(s), safe="")
    env.filters["human"] = lambda span: "-" if span is None else human(span)
    env.filters["iso"] = lambda t: "-" if t is None else t.isoformat(timespec="seconds")
    env.globals["ago"] = _ago
    env.globals["query"] = lambda **kw: urlencode({k: v for k, v in kw.items() if v not in (None, "")})
    return env


@dataclass
class Dashboard:
    """What every page and action needs: the tables, whether actions are on, the auth hook, the charts."""

    where: Where
    actions: bool
    authorize: Authorize | None
    refresh_s: float
    samples: Samples
    snapshots: Snapshots
    env: jinja2.Environment

    @classmethod
    def make(cls, where: Where, actions: bool, authorize: Authorize | None, refresh_s: float) -> Dashboard:
        samples = Samples(every=max(refresh_s, 1.0))
        snapshots = Snapshots.of(where, refresh_s, samples)
        return cls(where, actions, authorize, refresh_s, samples, snapshots, _environment())

    def render(self, request: Request, template: str, status: int = 200, **context: Any) -> Response:
        """A page, with what every page shows: the base path, the CSRF token, whether actions are on."""
        base = base_path(request)
        token = _csrf.token(request)
        html = self.env.get_template(template).render(
            base=base,
            csrf=token,
            actions=self.can_act(request),
            refresh_ms=int(self.refresh_s * 1000),
            notice=unquote(request.cookies.get(NOTICE, "")),
            **context,
        )
        response = HTMLResponse(html, status_code=status)
        _csrf.remember(request, response, token, base)
        if NOTICE in request.cookies:  # shown once
            response.delete_cookie(NOTICE, path=base or "/")
        return response

    def can_act(self, request: Request) -> bool:
        """Whether this request's user may act: actions are on and their role is ``act`` (the one flag the
        templates check before they show a form)."""
        return self.actions and access(request).role == "act"

    def error(self, request: Request, status: int, message: str) -> Response:
        return self.render(request, "error.html", status=status, message=message)


NOTICE = "delayq_done"
"""The cookie that carries what an action did to the page it redirects to (a cookie, not the URL: a link
cannot make the dashboard say something it did not do)."""


def notice(response: Response, text: str, base: str) -> None:
    """Have the next page say ``text`` (once)."""
    response.set_cookie(NOTICE, quote(text), path=base or "/", max_age=60, httponly=True, samesite="strict")


def base_path(request: Request) -> str:
    """Where the dashboard is mounted ("" at the root): every link and form starts with it."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def json_response(data: Any) -> Response:
    return JSONResponse(json.loads(json.dumps(data, default=str)), headers={"cache-control": "no-store"})
