"""The API key check of `dlmc serve --api-key`: every route but `/health` and `/metrics` wants
the header `Authorization: Bearer <key>`, as OpenAI clients send it (`api_key=`); a request
without it, or with another key, is answered 401 before its body is read. /metrics stays open,
as in vLLM, for Prometheus scrapers; it shows counts and timings, never prompts or answers.

A plain ASGI middleware, so streamed answers and the disconnect checks of the routes pass
through untouched.
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.responses import JSONResponse

OPEN_PATHS = frozenset({"/health", "/metrics"})  # for load balancers, probes and scrapers


class ApiKeyCheck:
    """ASGI middleware: HTTP requests to any path outside `OPEN_PATHS` must carry `key`."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        reason = "no Authorization header" if not given else "a wrong API key"
        body = {"error": {
            "message": f"{scope['method']} {scope['path']}: {reason}; this server wants the "
                       "header 'Authorization: Bearer <key>' with the key given to "
                       "`dlmc serve --api-key`",
            "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
