"""HTTP basic authentication for ``delayq web --basic-auth``: an ASGI wrapper that asks every request for
the one user and password (compared in constant time) before the dashboard sees it."""

from __future__ import annotations

import base64
import binascii
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send


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
                return hmac.compare_digest(given, self.expected)
        return False
