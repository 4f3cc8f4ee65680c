"""What the server really answers, for the OpenAPI document: response bodies, status codes and content types.

FastAPI documents a 422 for every route with a body, while this server answers a 400 with an OpenAI error object
(``cascade.server.errors``); it knows nothing of the 401, 404 and 503 the routes raise, nor that ``/metrics`` is
Prometheus text and a streamed completion server-sent events. These models document the responses only (the routes
build their JSON themselves, ``response_model=None``); a schema-driven fuzzer checks every response against them
(tests/test_openapi.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class TokenLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprobOut):
    top_logprobs: list[TokenLogprobOut]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class _Choice(BaseModel):
    """What a completion choice and a chat choice share (the token ids with ``return_token_ids``)."""

    index: int
    finish_reason: Literal["stop", "length", "abort"] | None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Choice):
    message: ChatMessageOut
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


_EVENTS = {  # one server-sent event: `data: {chunk as JSON}`, the last one `data: [DONE]`
    "text/event-stream": {
        "schema": {
            "type": "object",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
            "required": ["data"],
        }
    }
}



def generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {
        200: {"model": model, "description": "The completion, or with `stream: true` server-sent events",
              "content": _EVENTS},
        400: _error("Invalid request: malformed JSON, wrong types, out-of-range values, a prompt that does not fit"),
        401: _error("Missing or wrong API key (when the server has one)"),
        404: _error("Unknown model"),
        503: _error("The waiting queue is full, a stage is unavailable, or the engine is not serving; see Retry-After"),
    }


COMPLETION_RESPONSES = generation_responses(CompletionResponse)
CHAT_RESPONSES = generation_responses(ChatCompletionResponse)
MODELS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ModelList, "description": "The one model this server serves"},
    401: _error("Missing or wrong API key (when the server has one)"),
}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": Health, "description": "Serving"},
    503: {"model": Health, "description": "The engine is not serving (the status says why)"},
}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}},
}


def without_422(schema: dict) -> dict:
    """Drop the 422 FastAPI documents for every route with a body (and its schemas): this server answers 400."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema
