"""Request bodies parsed and validated in one pass, off the event loop when they are large.

FastAPI parses a declared body with ``json.loads`` and validates it on the event loop: a 4 MiB token list held the
loop for about 0.2 s on this machine, and every other request (``/health`` among them) waited. Here a route takes its
body through :func:`parsed_body` instead: pydantic's JSON validator reads the bytes straight into the model (about
twice as fast as parsing, then validating), on a worker thread above ``OFF_LOOP_BYTES``. The OpenAPI document still
shows the body's schema (:func:`document_bodies`).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

OFF_LOOP_BYTES = 64 << 10  # above this a body is parsed and validated on a worker thread (~5 ms of work)


def parsed_body(model: type[BaseModel]):
    """A FastAPI dependency giving the request's body as ``model``; a body that is not valid JSON, or not a valid
    ``model``, is the 400 every validation error is (``cascade.server.errors``)."""

    async def parse(request: Request) -> BaseModel:
        raw = await request.body()
        try:
            if len(raw) > OFF_LOOP_BYTES:
                return await asyncio.to_thread(model.model_validate_json, raw)
            return model.model_validate_json(raw)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None

    return parse


def request_body(model: type[BaseModel]) -> dict:
    """The ``openapi_extra`` of a route whose body is ``model`` (taken by :func:`parsed_body`)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def document_bodies(schema: dict, models: list[type[BaseModel]]) -> dict:
    """Add ``models`` (and the models they use) to the document's components, where :func:`request_body` points."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        found = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(found.pop("$defs", {}))
        components[model.__name__] = found
    return schema
