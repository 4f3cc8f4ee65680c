"""The API key check and the per-route answer counter, as one plain ASGI middleware."""

from __future__ import annotations

from collections.abc import Collection

from cascade.server.errors import APIError


class AuthAndCount:
    """Checks ``Authorization: Bearer <key>`` on ``/v1`` routes (when a key is set) and counts answers by route and
    status. A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would hide client disconnects from the
    handlers."""

    def __init__(self, app, *, api_key: str | None, counter, routes: Collection[str]):
        self.app, self.api_key, self.counter, self.routes = app, api_key, counter, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in self.routes else "other"  # unknown paths share one label: bounded cardinality
        if self.api_key is not None and path.startswith("/v1/"):
            headers = dict(scope["headers"])
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                error = APIError(401, "Incorrect or missing API key; send `Authorization: Bearer <key>`",
                                 code="invalid_api_key")
                self.counter.labels(route=route, status="401").inc()
                return await error.response()(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counter.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
