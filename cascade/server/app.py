"""The OpenAI-compatible HTTP app: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``. Handlers only validate, tokenize and translate (:class:`~cascade.server.server.Server`); the engine
runs in :class:`~cascade.server.scheduler.Scheduler`'s thread, and :mod:`cascade.server.responses` shapes what goes
back."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Collection
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from cascade.allocator import keep_freed_memory
from cascade.api import Cascade
from cascade.config import CascadeConfig, load_config, packaged_config_path
from cascade.server.bodies import document_bodies, parsed_body, request_body
from cascade.server.errors import bad_request, install_error_handlers
from cascade.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from cascade.server.middleware import Gate
from cascade.server.openapi import (
    CHAT_RESPONSES,
    COMPLETION_RESPONSES,
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    MODELS_RESPONSES,
    without_422,
)
from cascade.server.protocol import ChatCompletionRequest, CompletionRequest
from cascade.server.responses import respond
from cascade.server.server import Server
from cascade.server.worker import EngineThread

log = logging.getLogger("cascade.server")

_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: a prompt of a whole context window of text, with room to spare
_WATCHDOG_S = 1.0  # how often the event loop checks that the engine is alive and its step not overrunning


def create_app(
    config: str | Path | CascadeConfig | None = None,
    *,
    cascade: Cascade | None = None,
    api_key: str | None = None,
    max_running: int | None = None,
    max_batched_tokens: int | None = None,
    max_waiting: int = 256,
    progress: bool = False,
    step_timeout_s: float = 120.0,
    max_new_tokens: int | None = None,
    allowed_hosts: Collection[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """Build the app for ``config`` (default: the embedded demo) or for an already built ``cascade``.
    ``max_running`` and ``max_batched_tokens`` override the config's ``batching`` section. A step running longer
    than ``step_timeout_s`` marks the engine unhealthy (``/health`` 503, requests 503) until it returns.
    ``max_new_tokens`` caps what one choice may generate (a request asking more gets a 400; one asking nothing gets
    the cap rather than the whole context window). ``allowed_hosts``: the ``Host`` names served (None: any;
    ``cascade serve`` passes loopback names and its bind address, :func:`cascade.server.middleware.allowed_hosts_for`);
    ``max_body_bytes``: larger request bodies get 413."""
    if max_body_bytes < 1:
        raise ValueError(f"need max_body_bytes >= 1, got {max_body_bytes}")
    if (max_running is not None and max_running < 1) or max_waiting < 0:
        raise ValueError(f"need max_running >= 1 and max_waiting >= 0, got {max_running} and {max_waiting}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"need max_new_tokens >= 1, got {max_new_tokens}")
    if max_batched_tokens is not None and max_batched_tokens < 1:
        raise ValueError(f"need max_batched_tokens >= 1, got {max_batched_tokens}")
    worker = EngineThread()  # loads the models, then runs the engine: one thread for all PyTorch work
    if cascade is None:
        config = _with_batching(config, max_running, max_batched_tokens)  # the stages allocate KV slots for it
        cascade = worker.call(lambda: Cascade.from_config(config, progress=progress))
    cascade.set_batching(max_running=max_running, max_batched_tokens=max_batched_tokens)
    server = Server(
        cascade, api_key=api_key, max_waiting=max_waiting, worker=worker, step_timeout_s=step_timeout_s,
        max_new_tokens=max_new_tokens,
    )
    app = FastAPI(title="Cascade", version="0.1.0", lifespan=_lifespan(server))
    app.state.server = server
    install_error_handlers(app)
    generate_openapi = app.openapi
    app.openapi = lambda: document_bodies(  # cached by FastAPI after the first call
        without_422(generate_openapi()), [CompletionRequest, ChatCompletionRequest]
    )
    app.add_middleware(Gate, api_key=server.api_key, counter=server.metrics.http_requests, routes=_ROUTES,
                       allowed_hosts=allowed_hosts, max_body_bytes=max_body_bytes)
    _add_status_routes(app, server)
    _add_completions_route(app, server)
    _add_chat_route(app, server)
    return app


def _with_batching(
    config: str | Path | CascadeConfig | None, max_running: int | None, max_batched_tokens: int | None
) -> CascadeConfig:
    """``config`` (default: the embedded demo) with the command line's batching limits in its ``batching`` section."""
    config = config if isinstance(config, CascadeConfig) else load_config(config or packaged_config_path("demo"))
    overrides = {"max_running": max_running, "max_batched_tokens": max_batched_tokens}
    batching = config.batching.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    return config.model_copy(update={"batching": batching})


def _lifespan(server: Server):
    """The app's lifespan: the scheduler and the watchdog run while it serves; on the way out both stop and the
    cascade closes (its Ray actors, when it has them)."""

    async def watchdog() -> None:
        """Requests in flight fail as soon as the engine stops or a step overruns, rather than wait for ever."""
        while True:
            await asyncio.sleep(_WATCHDOG_S)
            trouble = server.scheduler.trouble()
            if trouble is not None and (failed := server.scheduler.fail_in_flight(trouble)):
                log.error("%s: failed the %d requests in flight", trouble, failed)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        cascade = server.cascade
        server.scheduler.start()
        guard = asyncio.create_task(watchdog())
        log.info("serving %s (stages: %s)", server.model_name, ", ".join(cascade.stage_names))
        try:
            yield
        finally:
            guard.cancel()
            server.scheduler.shutdown()
            close = getattr(cascade, "close", None)
            if close is not None:
                close()

    return lifespan


def _add_status_routes(app: FastAPI, server: Server) -> None:
    """``/health``, ``/metrics`` and ``/v1/models``."""

    @app.get("/health", response_model=None, responses=HEALTH_RESPONSES)
    async def health():
        trouble = server.scheduler.trouble()
        if trouble is not None:
            return JSONResponse({"status": trouble}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, response_model=None, responses=METRICS_RESPONSES)
    async def metrics():
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=None, responses=MODELS_RESPONSES)
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model_name,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "cascade",
                    "max_model_len": server.max_context,
                }
            ],
        }


def _add_completions_route(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions", response_model=None, responses=COMPLETION_RESPONSES,
              openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request, body: CompletionRequest = Depends(parsed_body(CompletionRequest))):
        server.check_model(body)
        try:  # off the event loop: a megabyte prompt takes seconds to tokenize
            prompts = await asyncio.to_thread(lambda: [server.encode_prompt(p) for p in body.prompts()])
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None
        budgets = [server.token_budget(p, body.max_tokens, "max_tokens", body.min_tokens) for p in prompts]
        jobs, events = server.submit(body, prompts, budgets)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        token_text = TokenText(server.cascade.tokenizer)
        offsets: dict[int, int] = {}  # per choice: the characters its stream's logprobs have covered

        def logprobs(index: int, entries) -> dict | None:
            if body.logprobs is None or entries is None:
                return None
            found = completion_logprobs(entries, token_text, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in found["tokens"])
            return found

        def chunk(index: int, text: str | None, finish_reason: str | None, entries=None) -> dict:
            choice = {"index": index, "text": text or "", "logprobs": logprobs(index, entries),
                      "finish_reason": finish_reason}
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": server.model_name,
                "choices": [choice],
            }

        return await respond(
            server.model_name, body, request, jobs, events, prompts, rid=rid, created=created,
            object_name="text_completion", chunk=chunk, first=[],
            choice=lambda f: {"text": f.result.text, "logprobs": logprobs(f.index, f.result.logprobs)},
        )


def _add_chat_route(app: FastAPI, server: Server) -> None:
    @app.post("/v1/chat/completions", response_model=None, responses=CHAT_RESPONSES,
              openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(
        request: Request, body: ChatCompletionRequest = Depends(parsed_body(ChatCompletionRequest))
    ):
        server.check_model(body)
        prompt = await asyncio.to_thread(server.encode_chat, body)
        budget = server.token_budget(
            prompt, body.token_limit, "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
            body.min_tokens,
        )
        jobs, events = server.submit(body, [prompt], [budget])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        token_text = TokenText(server.cascade.tokenizer)

        def logprobs(entries) -> dict | None:
            return chat_logprobs(entries, token_text) if body.logprobs and entries is not None else None

        def chunk(index: int, text: str | None, finish_reason: str | None, entries=None, role: bool = False) -> dict:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs(entries), "finish_reason": finish_reason}
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": server.model_name,
                "choices": [choice],
            }

        return await respond(
            server.model_name, body, request, jobs, events, [prompt], rid=rid, created=created,
            object_name="chat.completion", chunk=chunk, first=[chunk(j.index, None, None, role=True) for j in jobs],
            choice=lambda f: {"message": {"role": "assistant", "content": f.result.text},
                              "logprobs": logprobs(f.result.logprobs)},
        )


def app_from_env() -> FastAPI:
    """ASGI factory for ``uvicorn --factory cascade.server.app:app_from_env``: reads ``CASCADE_CONFIG`` (a YAML
    path; unset means the embedded demo), ``CASCADE_API_KEY``, ``CASCADE_MAX_RUNNING``,
    ``CASCADE_MAX_BATCHED_TOKENS`` (both default to the config's ``batching``), ``CASCADE_MAX_WAITING`` and
    ``CASCADE_STEP_TIMEOUT`` (seconds, 120), ``CASCADE_MAX_NEW_TOKENS`` (unset: no cap), ``CASCADE_MAX_BODY_BYTES``
    and ``CASCADE_ALLOWED_HOSTS`` (comma-separated; unset: any, as a Ray Serve application sits behind its own
    proxy). The process is a server's:
    its allocator keeps freed memory for the next step (``cascade.allocator``)."""
    keep_freed_memory()

    def optional(name: str) -> int | None:
        return int(os.environ[name]) if os.environ.get(name) else None

    return create_app(
        os.environ.get("CASCADE_CONFIG") or None,
        api_key=os.environ.get("CASCADE_API_KEY") or None,
        max_running=optional("CASCADE_MAX_RUNNING"),
        max_batched_tokens=optional("CASCADE_MAX_BATCHED_TOKENS"),
        step_timeout_s=float(os.environ.get("CASCADE_STEP_TIMEOUT") or 120),
        max_new_tokens=optional("CASCADE_MAX_NEW_TOKENS"),
        max_waiting=int(os.environ.get("CASCADE_MAX_WAITING", "256")),
        max_body_bytes=optional("CASCADE_MAX_BODY_BYTES") or DEFAULT_MAX_BODY_BYTES,
        allowed_hosts=[h for h in os.environ["CASCADE_ALLOWED_HOSTS"].split(",") if h]
        if os.environ.get("CASCADE_ALLOWED_HOSTS") else None,
    )
