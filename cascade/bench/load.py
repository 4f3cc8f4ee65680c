"""The bench's clients: streamed completions over HTTP, ``C`` clients at a time, and the levels the systems measure
in turns (:func:`interleaved_levels`), through their servers or, at one client, through the Python API.

The clients are aiohttp's, whose C line parser costs about a third of httpx's CPU per streamed token: on a
machine of two cores the clients share the CPU with the server they measure, and with httpx they took a tenth of
it at 64 clients, enough to read the same server 10–20% slower.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

try:
    import aiohttp
except ImportError as e:
    raise ImportError("cascade bench --serve drives the servers with aiohttp: pip install 'cascade[bench]'") from e

from cascade.api import Cascade


@dataclass(frozen=True, slots=True)
class ServeOptions:
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    temperatures: tuple[float, ...] = (0.0, 0.8)
    max_tokens: int = 64
    requests: int = 128  # per level at most (at least 2 per client in each of MIN_SLICES slices)
    seconds: float = 60.0  # per level at most (emulated seconds under an emulated config)
    num_prompts: int = 64  # held-out prompts drawn when no prompts_file is given
    prompts_file: str | None = None  # one prompt per line, or JSON lines with a "prompt" field
    out: str | None = "bench-out"
    against: str | None = None  # a second config of the same target, served beside the first, taking turns
    time_scale: float | None = None  # in place of the emulated configs' own (emulation.time_scale)


def on_the_wall(options: ServeOptions, time_scale: float) -> ServeOptions:
    """The bounds a level's clients keep on the wall clock: under emulation ``seconds`` are emulated, like every
    figure, so ``time_scale`` times as many on the wall (bounded on the wall, a level at scale 12 cut each slice to one
    request per client: a burst of prompts and a drain, never a steady state)."""
    return replace(options, seconds=options.seconds * time_scale)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One streamed completion; returns its status, latency, TTFT, token count (from the usage the last chunk
    carries) and the gaps between chunks (a chunk carries as many tokens as the server's step committed)."""
    started = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            await response.read()
            return {"status": response.status, "seconds": time.perf_counter() - started}
        async for line in response.content:  # one line at a time, as the server-sent events arrive
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter() - started)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    seconds = time.perf_counter() - started
    ttft = arrivals[0] if arrivals else None
    return {
        "status": 200, "seconds": seconds, "ttft": ttft, "tokens": tokens,
        "tpot": (seconds - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None,
        "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])],
    }


async def load_level(url: str, prompts: list[str], concurrency: int, temperature: float, options: ServeOptions) -> dict:
    """``concurrency`` clients, each sending one request after the other, bounded in count and time."""
    results: list[dict] = []
    issued = 0
    budget = max(options.requests, 2 * concurrency)
    deadline = time.perf_counter() + options.seconds

    async def client_loop(session: aiohttp.ClientSession) -> None:
        nonlocal issued
        while issued < budget and time.perf_counter() < deadline:
            prompt = prompts[issued % len(prompts)]
            issued += 1
            # No seed, as most clients send none: sampled requests get rejection sampling, not shared noise.
            body = {"prompt": prompt, "max_tokens": options.max_tokens, "temperature": temperature, "ignore_eos": True}
            results.append(await stream_completion(session, url, body))

    started = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client_loop(session) for _ in range(concurrency)))
    return {"results": results, "wall": time.perf_counter() - started}


MAX_SLICES = 4  # per level and system
MIN_SLICES = 4  # a level has at least this many requests per client times two, so that the systems take turns at
# every level: at 64 clients, 128 requests were one slice per system, the two servers ran a minute apart, and the level
# read Cascade at 0.77× the target alone in two runs where four slices of 128 taking turns read 0.96×. With two slices
# (A B B A) it still moved by ±10% between runs (a slice at 64 clients is one burst of prompts, a wave of decoding and
# a drain, about 4 s): every level now takes four turns.


def level_requests(requests: int, concurrency: int) -> int:
    """The requests one level runs per system: ``requests``, but at least two per client in each of ``MIN_SLICES``
    slices (512 at 64 clients)."""
    return max(requests, MIN_SLICES * 2 * concurrency)


def level_slices(requests: int, concurrency: int) -> list[tuple[int, int]]:
    """How one level's ``requests`` are split into slices that the systems take turns on: ``(first, count)`` per
    slice, ``first`` being the index of its first request among the level's. As many slices as leave every one at
    least two requests per client, at most ``MAX_SLICES``."""
    slices = max(1, min(MAX_SLICES, requests // (2 * concurrency)))
    counts = [requests // slices + (i < requests % slices) for i in range(slices)]
    return list(zip(itertools.accumulate([0, *counts[:-1]]), counts))


def interleaved_levels(urls: dict[str, str], prompts: list[str], concurrency: int, temperature: float,
                       options: ServeOptions, engines: dict[str, Cascade] | None = None) -> dict[str, dict]:
    """One concurrency level of every system, measured in slices (:func:`level_slices`) taken in turns (A B, B A,
    A B, ...: each system loads its server while the others idle), so that a slow patch of a shared machine hits them
    alike; a system's level is its slices together. Each slice continues through the prompts where the last one
    stopped: the systems see the prompts in the same order as in one unsliced level. ``engines`` (at one client):
    Python API engines that take their turns too, as ``api:NAME`` (:func:`api_level`)."""
    def over_http(url: str) -> Callable[[list[str], ServeOptions], dict]:
        return lambda rotated, part: asyncio.run(load_level(url, rotated, concurrency, temperature, part))

    def in_process(engine: Cascade) -> Callable[[list[str], ServeOptions], dict]:
        return lambda rotated, part: api_level(engine, rotated, temperature, part)

    runners = {name: over_http(url) for name, url in urls.items()}
    runners |= {f"api:{name}": in_process(engine) for name, engine in (engines or {}).items()}
    slices = level_slices(level_requests(options.requests, concurrency), concurrency)
    levels = {name: {"results": [], "wall": 0.0} for name in runners}
    for i, (first, count) in enumerate(slices):
        first %= len(prompts)
        rotated = prompts[first:] + prompts[:first]
        part = replace(options, requests=count, seconds=options.seconds / len(slices))
        for name in list(runners)[:: 1 if i % 2 == 0 else -1]:
            level = runners[name](rotated, part)
            levels[name]["results"] += level["results"]
            levels[name]["wall"] += level["wall"]
    return levels


def api_level(engine: Cascade, prompts: list[str], temperature: float, options: ServeOptions) -> dict:
    """What :func:`load_level` measures of one client, through the Python API (the serving path without HTTP):
    the same prompts in the same order, unseeded, within the same bounds."""
    results: list[dict] = []
    started = time.perf_counter()
    for i in range(max(options.requests, 2)):
        if time.perf_counter() - started >= options.seconds:
            break
        begun = time.perf_counter()
        result = engine.generate(prompts[i % len(prompts)], max_tokens=options.max_tokens, temperature=temperature,
                                 ignore_eos=True)
        results.append({"status": 200, "seconds": time.perf_counter() - begun, "tokens": len(result.token_ids)})
    return {"results": results, "wall": time.perf_counter() - started}
