"""CSRF protection of the actions: a double-submit token.

The first page a browser gets sets a random token in a cookie (``SameSite=Strict``, ``HttpOnly``, scoped to
the dashboard's path); every form carries the same token in a hidden field. A POST is accepted only when
the two agree (compared in constant time), and, when the browser sends an ``Origin``, only from the
dashboard's own host. Another site can make a browser send the cookie (not even that, with ``Strict``), but
cannot read it to put it in the form.
"""

from __future__ import annotations

import hmac
import secrets
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

COOKIE = "delayq_csrf"
FIELD = "csrf"


def token(request: Request) -> str:
    """The request's token: the cookie's, or a new one (``remember`` sets it on the response)."""
    have = request.cookies.get(COOKIE, "")
    return have if len(have) >= 32 else secrets.token_urlsafe(32)


def remember(request: Request, response: Response, value: str, base: str) -> None:
    """Set the cookie, unless the browser has it already."""
    if request.cookies.get(COOKIE) != value:
        response.set_cookie(COOKIE, value, path=base or "/", httponly=True, samesite="strict")


def valid(request: Request, form: dict[str, str]) -> bool:
    """Whether a POST carries the cookie's token in its form, from the dashboard's own origin."""
    cookie, sent = request.cookies.get(COOKIE, ""), form.get(FIELD, "")
    if len(cookie) < 32 or not hmac.compare_digest(cookie.encode(), sent.encode()):
        return False
    origin = request.headers.get("origin")
    return origin is None or urlsplit(origin).netloc == request.headers.get("host", "")
