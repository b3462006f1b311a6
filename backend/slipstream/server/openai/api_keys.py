"""``--api-key``: requests to ``/v1/...`` must carry ``Authorization: Bearer <key>`` (one of
the keys); everything else (``/health``, ``/metrics``, ``/tokenize`` ...) stays open, as in
vLLM, so probes and scrapers need no key. A missing or wrong key: 401 in OpenAI's error
shape. Keys are compared in constant time."""

from __future__ import annotations

import hmac
import json

from slipstream.server.openai.errors import error_body

PROTECTED_PREFIX = "/v1"


class ApiKeyGuard:
    """ASGI middleware."""

    def __init__(self, app, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)

    def _allowed(self, scope) -> bool:
        if scope["type"] != "http" or not self.keys:
            return True
        if not scope["path"].startswith(PROTECTED_PREFIX) or scope["method"] == "OPTIONS":
            return True
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        return any(hmac.compare_digest(token, key) for key in self.keys)

    async def __call__(self, scope, receive, send) -> None:
        if self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, "Unauthorized: a valid API key is required")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
