"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("cascade.server")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _describe(errors: list[dict]) -> tuple[str, str | None]:
    """Pydantic's errors as one readable sentence, naming the field and what was received."""
    parts = []
    param = None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        field = ".".join(loc)
        param = param or (field or None)
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({e.get('ctx', {}).get('error', 'parse error')})")
            continue
        shown = "" if e.get("type") == "missing" else f" (got {_short(e.get('input'))})"
        parts.append(f"{field or 'body'}: {e.get('msg', 'invalid')}{shown}")
    return "; ".join(parts), param


def _short(value) -> str:
    """What was received, in a few words: the repr of a megabyte list would cost more than the request."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    return f"{value!r:.80}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        # FastAPI answers 422 by default; OpenAI clients expect 400 with an error object.
        message, param = _describe(list(exc.errors()))
        return JSONResponse(error_body(message, "invalid_request_error", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), kind), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        # The body names no internals (exception class, message, paths): the log has them, under the id it carries.
        request_id = f"req-{uuid.uuid4().hex[:16]}"
        log.error("internal error answering %s %s (%s)", request.method, request.url.path, request_id, exc_info=exc)
        body = error_body(f"internal server error; the server's log has the details under {request_id}",
                          "server_error", code=request_id)
        return JSONResponse(body, status_code=500, headers={"x-request-id": request_id})
