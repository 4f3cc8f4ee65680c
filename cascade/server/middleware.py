"""The server's gate, as one plain ASGI middleware: the Host allow-list, the request body limit, the API key, and
the per-route answer counter (Starlette's ``BaseHTTPMiddleware`` would hide client disconnects from the handlers).

- **Host allow-list.** Without an API key, a page the user visits can reach a loopback server through a domain
  that rebinds to 127.0.0.1 (DNS rebinding; Ollama's CVE-2024-28224): its requests carry that domain in ``Host``.
  Only the names in ``allowed_hosts`` are served (``None``: any); others get 403.
- **Body limit.** A body over ``max_body_bytes`` is a 413, by its ``Content-Length`` before it is read, or, for a
  chunked body, as soon as it passes the limit while read here: a 12 MB token list otherwise held the event loop
  for seconds.
- **API key.** ``Authorization: Bearer <key>`` on ``/v1`` routes, compared in constant time (``secrets``; vLLM's
  CVE-2025-59425 was a plain ``==``).
"""

from __future__ import annotations

import secrets
from collections.abc import Collection

from cascade.server.errors import APIError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")


def allowed_hosts_for(bind: str, extra: Collection[str] = ()) -> frozenset[str] | None:
    """The Host names a server bound to ``bind`` answers: loopback names, the bind address and ``extra``; ``None``
    (any) when ``extra`` holds ``*`` or the server is bound to every interface with no names given (it is reachable
    by whatever name the network gives it, and is then exposed beyond this machine anyway)."""
    if "*" in extra or (bind in WILDCARD_BINDS and not extra):
        return None
    return frozenset({*LOOPBACK_HOSTS, bind.strip("[]"), *(h.lower() for h in extra)})


def _host_name(header: bytes) -> str:
    """``Host`` without its port: ``example.com:8000`` -> ``example.com``, ``[::1]:8000`` -> ``::1``."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class Gate:
    """See the module docstring; ``counter`` counts answers by route (``routes``, others as ``other``) and status."""

    def __init__(
        self, app, *, api_key: str | None, counter, routes: Collection[str], allowed_hosts: Collection[str] | None,
        max_body_bytes: int,
    ):
        self.app, self.counter, self.routes = app, counter, routes
        self.key = None if api_key is None else f"Bearer {api_key}".encode()
        self.allowed_hosts = None if allowed_hosts is None else frozenset(allowed_hosts)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in self.routes else "other"  # unknown paths share one label: bounded cardinality
        headers = dict(scope["headers"])
        refusal = self._refusal(path, headers)
        if refusal is not None:
            self.counter.labels(route=route, status=str(refusal.status)).inc()
            return await refusal.response()(scope, receive, send)
        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counter.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        if b"content-length" not in headers and scope.get("method") in ("POST", "PUT", "PATCH"):
            # A chunked body has no length to check: read it here, up to the limit, and hand it on whole.
            body = await self._read_limited(receive)
            if body is None:
                return await self._too_large().response()(scope, receive, counting_send)
            receive = _replay(body, receive)
        await self.app(scope, receive, counting_send)

    async def _read_limited(self, receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def _refusal(self, path: str, headers: dict) -> APIError | None:
        if self.allowed_hosts is not None:
            host = _host_name(headers.get(b"host", b""))
            if host not in self.allowed_hosts:
                return APIError(403, f"Host {host!r} is not allowed here; start the server with --allowed-hosts to "
                                "serve it", type="permission_error", code="host_not_allowed")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        if self.key is not None and path.startswith("/v1/"):
            if not secrets.compare_digest(headers.get(b"authorization", b""), self.key):
                return APIError(401, "Incorrect or missing API key; send `Authorization: Bearer <key>`",
                                code="invalid_api_key")
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body exceeds {self.max_body_bytes} bytes (--max-body-bytes)",
                        code="request_too_large")


def _replay(body: bytes, receive):
    """A ``receive`` that gives ``body`` once, then what the connection says (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
