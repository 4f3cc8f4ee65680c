"""The OpenAI-compatible HTTP app: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``. Handlers only validate, tokenize and translate; the engine runs in :class:`Scheduler`'s thread."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from cascade.allocator import keep_freed_memory
from cascade.api import Cascade
from cascade.config import CascadeConfig, load_config, packaged_config_path
from cascade.server.errors import APIError, bad_request, install_error_handlers
from cascade.server.middleware import AuthAndCount
from cascade.server.metrics import Metrics
from cascade.server.openapi import (
    CHAT_RESPONSES,
    COMPLETION_RESPONSES,
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    MODELS_RESPONSES,
    without_422,
)
from cascade.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from cascade.stages.base import StageUnavailable
from cascade.server.scheduler import Delta, EngineUnavailable, Failed, Finished, Job, QueueFull, Scheduler
from cascade.server.worker import EngineThread

log = logging.getLogger("cascade.server")

_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
_WATCHDOG_S = 1.0  # how often the event loop checks that the engine is alive and its step not overrunning
_DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks whether its client is still there


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


class Server:
    """The state behind the routes: one cascade, its scheduler and its metrics."""

    def __init__(
        self, cascade: Cascade, *, api_key: str | None, max_waiting: int, worker: EngineThread | None = None,
        step_timeout_s: float = 120.0, max_new_tokens: int | None = None,
    ):
        self.cascade = cascade
        self.api_key = api_key
        self.max_new_tokens = max_new_tokens  # per choice: the most a request may ask, and what one that asks none gets
        target = cascade.engine.target
        self.max_context = target.max_context
        self.vocab_size = target.vocab_size
        tokenizer = cascade.tokenizer
        # Strings the tokenizer turns into its added tokens (end of text, turn markers, ...).
        self._markers = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
        cached = {
            s.name: s.num_cached_sequences for s in cascade.engine.stages if hasattr(s, "num_cached_sequences")
        }
        kv = {s.name: s.kv_cache_bytes for s in cascade.engine.stages if hasattr(s, "kv_cache_bytes")}
        reused = {s.name: (lambda s=s: s.reused_tokens) for s in cascade.engine.stages if hasattr(s, "reused_tokens")}
        self.metrics = Metrics([s.name for s in cascade.engine.stages], cached_sequences=cached, kv_cache_bytes=kv,
                               reused_tokens=reused)
        cascade.engine.observer = self.metrics
        self.scheduler = Scheduler(
            cascade, self.metrics, max_waiting=max_waiting, worker=worker, step_timeout_s=step_timeout_s
        )
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        return self.cascade.served_model_name

    # ---- validation -------------------------------------------------------------------------------------------

    def check_model(self, body: SamplingFields) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                404, f"The model {body.model!r} does not exist; this server serves {self.model_name!r}",
                param="model", code="model_not_found",
            )

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt")
            return self.cascade.encode(prompt)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}", "prompt")
        return list(prompt)

    def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        """The chat template's text, tokenized; message contents are text whatever they contain: a user who writes
        ``<|im_end|>`` or the end-of-text marker into a message gets those characters, not the control tokens (so
        no forged turns, no early end). Only the template's own markers are control tokens."""
        tokenizer = self.cascade.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request(f"the model {self.model_name!r} has no chat template; use /v1/completions", "messages")
        contents = [m.text() for m in body.messages]
        roles = [m.role for m in body.messages]
        if not any(marker in content for content in contents for marker in self._markers):
            text = self._render(roles, contents)
            return tokenizer.encode(text, add_special_tokens=False)  # the template already has what it needs
        # Render with a placeholder for each content, tokenize the template's text with its markers and each content
        # with special-token parsing off.
        placeholders = [f"\ue000cascade-content-{uuid.uuid4().hex}\ue000" for _ in contents]
        text = self._render(roles, placeholders)
        if any(text.count(p) != 1 for p in placeholders):
            raise bad_request(
                "a message contains a special-token string and this model's chat template does not carry message "
                "contents verbatim, so it cannot be sent as text", "messages",
            )
        ids: list[int] = []
        for placeholder, content in zip(placeholders, contents):
            before, text = text.split(placeholder)
            ids += tokenizer.encode(before, add_special_tokens=False)
            ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids + tokenizer.encode(text, add_special_tokens=False)

    def _render(self, roles: list[str], contents: list[str]) -> str:
        messages = [{"role": r, "content": c} for r, c in zip(roles, contents)]
        return self.cascade.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def token_budget(self, prompt_ids: list[int], max_tokens: int | None, param: str, min_tokens: int = 0) -> int:
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.max_context} tokens, but the prompt has "
                f"{len(prompt_ids)} tokens, which leaves no room for a completion",
                "prompt" if param == "max_tokens" else "messages",
            )
        cap = self.max_new_tokens
        if max_tokens is not None and cap is not None and max_tokens > cap:
            raise bad_request(f"{param} is {max_tokens}; this server generates at most {cap} tokens per choice", param)
        default = room if cap is None else min(room, cap)
        if min_tokens > (default if max_tokens is None else max_tokens):
            raise bad_request(
                f"min_tokens ({min_tokens}) exceeds the tokens this request may generate "
                f"({default if max_tokens is None else max_tokens})", "min_tokens",
            )
        if max_tokens is None:
            return default
        if max_tokens > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and {param} is {max_tokens}, so at most {room} can be generated",
                param,
            )
        return max_tokens

    # ---- running ----------------------------------------------------------------------------------------------

    def submit(self, body: SamplingFields, prompts: list[list[int]], budgets: list[int]) -> tuple[list[Job], asyncio.Queue]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        jobs = []
        for p, (ids, budget) in enumerate(zip(prompts, budgets)):
            for c in range(body.n):
                index = p * body.n + c
                jobs.append(Job(index, ids, body.engine_options(budget, c), loop, events, counts_prompt=c == 0))
        try:
            self.scheduler.submit(jobs)
        except QueueFull as e:
            raise APIError(503, f"{e}; retry later", type="server_overloaded", headers={"Retry-After": "1"}) from None
        except EngineUnavailable as e:
            raise _failure(e) from None
        return jobs, events


async def _collect(jobs: list[Job], events: asyncio.Queue, request: Request) -> dict[int, Finished]:
    """Wait for every choice; cancel them all if the client goes away or one fails."""
    done: dict[int, Finished] = {}
    checked = time.monotonic()
    try:
        while len(done) < len(jobs):
            try:
                event = await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() - checked >= _DISCONNECT_POLL_S:
                if await request.is_disconnected():
                    raise ClientGone()
                checked = time.monotonic()
            if isinstance(event, Finished):
                done[event.index] = event
            elif isinstance(event, Failed):
                raise _failure(event.error)
        return done
    finally:
        if len(done) < len(jobs):
            for job in jobs:
                job.cancel()


def _failure(error: Exception) -> APIError:
    if isinstance(error, StageUnavailable):
        return APIError(503, str(error), type="service_unavailable", code="stage_unavailable", headers={"Retry-After": "5"})
    if isinstance(error, EngineUnavailable):
        return APIError(503, f"{error}; the server cannot generate now", type="service_unavailable",
                        code="engine_unavailable", headers={"Retry-After": "5"})
    return APIError(500, f"generation failed: {type(error).__name__}: {error}", type="server_error")


def _usage(prompt_ids: list[list[int]], finished: list[Finished]) -> dict:
    prompt_tokens = sum(len(p) for p in prompt_ids)
    completion_tokens = sum(len(f.result.token_ids) for f in finished)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _token_ids(body: SamplingFields, f: Finished) -> dict:
    if not body.return_token_ids:
        return {}
    return {"prompt_token_ids": f.result.prompt_token_ids, "token_ids": f.result.token_ids}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _stream(
    jobs: list[Job],
    events: asyncio.Queue,
    prompt_ids: list[list[int]],
    include_usage: bool,
    chunk: Callable[[int, str | None, str | None], dict],
    usage_chunk: Callable[[dict], dict],
    first: list[dict],
) -> AsyncIterator[str]:
    """Server-sent events: the first chunks, a chunk per delta, a final chunk per choice with its finish reason,
    the usage chunk if asked for, then ``[DONE]``. Closing the generator (client gone) cancels every choice."""
    finished: list[Finished] = []
    try:
        for c in first:
            yield _sse(c)
        while len(finished) < len(jobs):
            event = await events.get()
            if isinstance(event, Delta):
                if event.text:
                    yield _sse(chunk(event.index, event.text, None))
            elif isinstance(event, Finished):
                finished.append(event)
                yield _sse(chunk(event.index, None, event.result.finish_reason))
            elif isinstance(event, Failed):
                yield _sse(_failure(event.error).body())
                break
        if include_usage and len(finished) == len(jobs):
            yield _sse(usage_chunk(_usage(prompt_ids, finished)))
        yield _sse("[DONE]")
    finally:
        for job in jobs:
            job.cancel()  # a no-op for the ones already finished


async def _respond(
    server: Server,
    body: SamplingFields,
    request: Request,
    jobs: list[Job],
    events: asyncio.Queue,
    prompts: list[list[int]],
    *,
    rid: str,
    created: int,
    object_name: str,
    chunk: Callable[..., dict],
    first: list[dict],
    choice: Callable[[Finished], dict],
):
    """The response of either route: server-sent events, or one JSON object once every choice is done."""
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def usage_chunk(usage: dict) -> dict:
            return {**chunk(0, None, None), "choices": [], "usage": usage}

        return StreamingResponse(
            _stream(jobs, events, prompts, include_usage, chunk, usage_chunk, first), media_type="text/event-stream"
        )
    try:
        done = await _collect(jobs, events, request)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; the status is for the access log
    finished = [done[i] for i in sorted(done)]
    return {
        "id": rid,
        "object": object_name,
        "created": created,
        "model": server.model_name,
        "choices": [
            {
                "index": f.index,
                **choice(f),
                "logprobs": None,
                "finish_reason": f.result.finish_reason,
                **_token_ids(body, f),
            }
            for f in finished
        ],
        "usage": _usage(prompts, finished),
    }


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
) -> FastAPI:
    """Build the app for ``config`` (default: the embedded demo) or for an already built ``cascade``.
    ``max_running`` and ``max_batched_tokens`` override the config's ``batching`` section. A step running longer
    than ``step_timeout_s`` marks the engine unhealthy (``/health`` 503, requests 503) until it returns.
    ``max_new_tokens`` caps what one choice may generate (a request asking more gets a 400; one asking nothing gets
    the cap rather than the whole context window)."""
    if (max_running is not None and max_running < 1) or max_waiting < 0:
        raise ValueError(f"need max_running >= 1 and max_waiting >= 0, got {max_running} and {max_waiting}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"need max_new_tokens >= 1, got {max_new_tokens}")
    if max_batched_tokens is not None and max_batched_tokens < 1:
        raise ValueError(f"need max_batched_tokens >= 1, got {max_batched_tokens}")
    worker = EngineThread()  # loads the models, then runs the engine: one thread for all PyTorch work
    if cascade is None:
        config = config if isinstance(config, CascadeConfig) else load_config(config or packaged_config_path("demo"))
        overrides = {"max_running": max_running, "max_batched_tokens": max_batched_tokens}
        batching = config.batching.model_copy(update={k: v for k, v in overrides.items() if v is not None})
        config = config.model_copy(update={"batching": batching})  # the stages allocate KV slots for max_running
        cascade = worker.call(lambda: Cascade.from_config(config, progress=progress))
    if max_running is not None:
        cascade.engine.max_running = max_running
    if max_batched_tokens is not None:
        cascade.engine.max_batched_tokens = max_batched_tokens
    server = Server(
        cascade, api_key=api_key, max_waiting=max_waiting, worker=worker, step_timeout_s=step_timeout_s,
        max_new_tokens=max_new_tokens,
    )

    async def watchdog() -> None:
        """Requests in flight fail as soon as the engine stops or a step overruns, rather than wait for ever."""
        while True:
            await asyncio.sleep(_WATCHDOG_S)
            trouble = server.scheduler.trouble()
            if trouble is not None and (failed := server.scheduler.fail_in_flight(trouble)):
                log.error("%s: failed the %d requests in flight", trouble, failed)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        guard = asyncio.create_task(watchdog())
        log.info("serving %s (stages: %s)", server.model_name, ", ".join(s.name for s in cascade.engine.stages))
        try:
            yield
        finally:
            guard.cancel()
            server.scheduler.shutdown()
            close = getattr(cascade, "close", None)
            if close is not None:
                close()

    app = FastAPI(title="Cascade", version="0.1.0", lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)
    generate_openapi = app.openapi
    app.openapi = lambda: without_422(generate_openapi())  # cached by FastAPI after the first call

    app.add_middleware(AuthAndCount, api_key=server.api_key, counter=server.metrics.http_requests, routes=_ROUTES)

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

    @app.post("/v1/completions", response_model=None, responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body)
        try:  # off the event loop: a megabyte prompt takes seconds to tokenize
            prompts = await asyncio.to_thread(lambda: [server.encode_prompt(p) for p in body.prompts()])
        except ValueError as e:
            raise bad_request(str(e), "prompt") from None
        budgets = [server.token_budget(p, body.max_tokens, "max_tokens", body.min_tokens) for p in prompts]
        jobs, events = server.submit(body, prompts, budgets)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str | None, finish_reason: str | None) -> dict:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": server.model_name,
                "choices": [choice],
            }

        return await _respond(
            server, body, request, jobs, events, prompts, rid=rid, created=created, object_name="text_completion",
            chunk=chunk, first=[], choice=lambda f: {"text": f.result.text},
        )

    @app.post("/v1/chat/completions", response_model=None, responses=CHAT_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_model(body)
        prompt = await asyncio.to_thread(server.encode_chat, body)
        budget = server.token_budget(
            prompt, body.token_limit, "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
            body.min_tokens,
        )
        jobs, events = server.submit(body, [prompt], [budget])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": server.model_name,
                "choices": [choice],
            }

        return await _respond(
            server, body, request, jobs, events, [prompt], rid=rid, created=created, object_name="chat.completion",
            chunk=chunk, first=[chunk(j.index, None, None, role=True) for j in jobs],
            choice=lambda f: {"message": {"role": "assistant", "content": f.result.text}},
        )

    return app


def app_from_env() -> FastAPI:
    """ASGI factory for ``uvicorn --factory cascade.server.app:app_from_env``: reads ``CASCADE_CONFIG`` (a YAML
    path; unset means the embedded demo), ``CASCADE_API_KEY``, ``CASCADE_MAX_RUNNING``,
    ``CASCADE_MAX_BATCHED_TOKENS`` (both default to the config's ``batching``), ``CASCADE_MAX_WAITING`` and
    ``CASCADE_STEP_TIMEOUT`` (seconds, 120) and ``CASCADE_MAX_NEW_TOKENS`` (unset: no cap). The process is a server's:
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
    )
