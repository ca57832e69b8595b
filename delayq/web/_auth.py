"""Who may do what on the dashboard: the ``authorize`` hook's answer as an ``Access`` (a role and an identity),
and HTTP basic authentication for ``delayq web --basic-auth``.

``authorize`` answers each request with ``True`` (in, as an acting user), ``False`` or ``None`` (a 403), a
role (``"read"`` or ``"act"``) or an ``Access`` (a role and who it is). A ``read`` user sees no forms and their
POSTs are refused; an ``act`` user acts when the dashboard allows actions (``actions=True``). The identity is
who the audit records (``delayq.audit``); without one, the basic auth user, else ``anonymous``.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

Role = Literal["read", "act"]
ROLES: tuple[Role, ...] = ("read", "act")


@dataclass(frozen=True)
class Access:
    """What ``authorize`` may answer for a request: the user's role and who they are (for the audit)."""

    role: Role = "act"
    """``read``: pages only; ``act``: the actions too, when the dashboard allows them."""
    identity: str | None = None
    """Who the audit records as having acted; None: the basic auth user, else ``anonymous``."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"an Access role is 'read' or 'act', got {self.role!r}")


Answer = bool | Role | Access | None
"""What ``authorize`` returns: see the module's docstring."""
Authorize = Callable[[Request], Answer]

_ACCESS = "delayq.access"
"""The scope key of the request's ``Access`` (set by the app's authorize wrapper)."""
_USER = "delayq.basic_user"
"""The scope key of the basic auth user (set by ``BasicAuth``)."""
_FULL = Access()


def access_of(answer: object) -> Access | None:
    """``authorize``'s answer as an ``Access``; None when it refuses the request. A ``TypeError`` for an answer
    that is none of those (a hook's bug: better a loud failure than a guess at someone's rights)."""
    if answer is True:
        return _FULL
    if answer is False or answer is None:
        return None
    if isinstance(answer, Access):
        return answer
    if isinstance(answer, str) and answer in ROLES:
        return Access(role=answer)
    raise TypeError(f"authorize returned {answer!r}: return True, False, 'read', 'act' or an Access")


def remember(scope: Scope, access: Access) -> None:
    scope[_ACCESS] = access


def access(request: Request) -> Access:
    """The request's ``Access``: as ``authorize`` answered, else (no hook) an acting user."""
    found = request.scope.get(_ACCESS)
    return found if isinstance(found, Access) else _FULL


def actor(request: Request) -> str:
    """Who the audit records for this request."""
    who = access(request).identity or request.scope.get(_USER)
    return who if isinstance(who, str) and who else "anonymous"


class BasicAuth:
    """Let through requests that carry ``user:password``; answer 401 to the others."""

    def __init__(self, app: ASGIApp, credentials: str) -> None:
        if ":" not in credentials:
            raise ValueError("basic auth credentials are user:password")
        self.app, self.expected = app, credentials.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        headers = [(b"www-authenticate", b'Basic realm="delayq", charset="UTF-8"'), (b"content-type", b"text/plain")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": b"authentication required\n"})

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value[:6].lower() == b"basic ":
                try:
                    given = base64.b64decode(value[6:].strip(), validate=True)
                except (binascii.Error, ValueError):
                    return False
                if hmac.compare_digest(given, self.expected):
                    scope[_USER] = given.partition(b":")[0].decode("utf-8", "replace")
                    return True
                return False
        return False
