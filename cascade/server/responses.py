"""What a generation route sends back: server-sent events as its choices progress, or one JSON body once every
choice is done; a failure inside the engine becomes an OpenAI-style error. Either way, a client that goes away
cancels every choice of its request."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from cascade.server.errors import APIError
from cascade.server.protocol import SamplingFields
from cascade.server.scheduler import Delta, EngineUnavailable, Events, Failed, Finished, GenerationFailed, Job
from cascade.stages.base import StageUnavailable

log = logging.getLogger("cascade.server")

_DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks whether its client is still there


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


async def _collect(jobs: list[Job], events: Events, request: Request) -> dict[int, Finished]:
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
                raise failure(event.error)
        return done
    finally:
        if len(done) < len(jobs):
            for job in jobs:
                job.cancel()


def failure(error: Exception) -> APIError:
    if isinstance(error, StageUnavailable):
        return APIError(503, str(error), type="service_unavailable", code="stage_unavailable", headers={"Retry-After": "5"})
    if isinstance(error, EngineUnavailable):
        return APIError(503, f"{error}; the server cannot generate now", type="service_unavailable",
                        code="engine_unavailable", headers={"Retry-After": "5"})
    if isinstance(error, GenerationFailed):
        return APIError(500, f"generation failed: {error}", type="server_error", code="generation_failed")
    # Anything else is a fault of the server's: the log has it, the body carries only the id it is logged under.
    request_id = f"req-{uuid.uuid4().hex[:16]}"
    log.error("generation failed (%s)", request_id, exc_info=error)
    return APIError(500, f"internal server error; the server's log has the details under {request_id}",
                    type="server_error", code=request_id, headers={"x-request-id": request_id})


def _usage(prompt_ids: list[list[int]], finished: list[Finished]) -> dict:
    return _counts(sum(len(p) for p in prompt_ids), sum(len(f.result.token_ids) for f in finished))


def _counts(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_ids(body: SamplingFields, f: Finished) -> dict:
    if not body.return_token_ids:
        return {}
    return {"prompt_token_ids": f.result.prompt_token_ids, "token_ids": f.result.token_ids}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _stream(
    jobs: list[Job],
    events: Events,
    prompt_ids: list[list[int]],
    include_usage: bool,
    continuous_usage: bool,
    chunk: Callable[[int, str | None, str | None], dict],
    usage_chunk: Callable[[dict], dict],
    first: list[dict],
) -> AsyncIterator[str]:
    """Server-sent events: the first chunks, a chunk per delta, a final chunk per choice with its finish reason,
    the usage chunk if asked for, then ``[DONE]``; with ``continuous_usage`` every chunk carries the usage so far.
    Closing the generator (client gone) cancels every choice."""
    finished: list[Finished] = []
    produced = [0] * len(jobs)  # per choice, its tokens committed so far
    prompt_tokens = sum(len(p) for p in prompt_ids)

    def sent(payload: dict) -> str:
        if continuous_usage:
            payload["usage"] = _counts(prompt_tokens, sum(produced))
        return _sse(payload)

    try:
        for c in first:
            yield sent(c)
        while len(finished) < len(jobs):
            event = await events.get()
            if isinstance(event, Delta):
                produced[event.index] = event.tokens
                if event.text or event.logprobs:
                    yield sent(chunk(event.index, event.text, None, event.logprobs))
            elif isinstance(event, Finished):
                finished.append(event)
                produced[event.index] = len(event.result.token_ids)
                yield sent(chunk(event.index, None, event.result.finish_reason))
            elif isinstance(event, Failed):
                yield _sse(failure(event.error).body())
                break
        if include_usage and len(finished) == len(jobs):
            yield _sse(usage_chunk(_usage(prompt_ids, finished)))
        yield _sse("[DONE]")
    finally:
        for job in jobs:
            job.cancel()  # a no-op for the ones already finished


async def respond(
    model: str,
    body: SamplingFields,
    request: Request,
    jobs: list[Job],
    events: Events,
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
        continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage_stats)

        def usage_chunk(usage: dict) -> dict:
            return {**chunk(0, None, None), "choices": [], "usage": usage}

        return StreamingResponse(
            _stream(jobs, events, prompts, include_usage, continuous_usage, chunk, usage_chunk, first),
            media_type="text/event-stream",
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
        "model": model,
        "choices": [
            {
                "index": f.index,
                **choice(f),
                "finish_reason": f.result.finish_reason,
                **_token_ids(body, f),
            }
            for f in finished
        ],
        "usage": _usage(prompts, finished),
    }
