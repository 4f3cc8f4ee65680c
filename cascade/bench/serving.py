"""``cascade bench --serve``: serving throughput and latency under concurrency, side by side in one run.

For each system — Cascade (the config as given) and the target alone (the same target in the same server, one
stage: plain batched decoding) — a ``cascade serve`` process is started on loopback, and for each temperature and
each concurrency level C, C streaming clients keep sending completions of held-out prompts (``ignore_eos``: every
completion is ``max_tokens`` long) until ``requests`` have completed or ``seconds`` have passed; the systems take
turns within each level (:func:`interleaved_levels`). The external anchor is transformers' own batched ``generate``
of the target (left padding, batch = C). At one client the Python API's speed-up of Cascade over the target alone is
measured on the same prompts, its engines taking turns with the servers in that level's slices, so the cost of
serving shows as the gap between the two speed-ups (when the engines ran minutes before the servers started, the two
read up to 20% apart on a shared machine where a level moves by ±10% between runs). Without a level of one client
there is no Python API speed-up to report.

Reported per row: output tokens/s (all clients together), time to first token and the time per output token
after the first (TPOT: ``(latency − TTFT) / (tokens − 1)`` per request), p50 and p95 over requests.

The clients are aiohttp's, whose C line parser costs about a third of httpx's CPU per streamed token: on a
machine of two cores the clients share the CPU with the server they measure, and with httpx they took a tenth of
it at 64 clients, enough to read the same server 10–20% slower.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import yaml

try:
    import aiohttp
except ImportError as e:
    raise ImportError("cascade bench --serve drives the servers with aiohttp: pip install 'cascade[bench]'") from e

from cascade.api import Cascade
from cascade.bench.prompts import file_prompts, held_out_prompts
from cascade.config import CascadeConfig, load_config, packaged_config_path
from cascade.server.launch import running_server


@dataclass(frozen=True, slots=True)
class ServeOptions:
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    temperatures: tuple[float, ...] = (0.0, 0.8)
    max_tokens: int = 64
    requests: int = 128  # per level at most (at least 2 per client in each of MIN_SLICES slices)
    seconds: float = 60.0  # per level at most
    num_prompts: int = 64  # held-out prompts drawn when no prompts_file is given
    prompts_file: str | None = None  # one prompt per line, or JSON lines with a "prompt" field
    out: str | None = "bench-out"


@dataclass(slots=True)
class LevelResult:
    system: str  # "cascade", "target" (alone, in the same server) or "transformers" (batched generate)
    temperature: float
    concurrency: int
    requests: int
    errors: int
    wall_seconds: float
    tokens_per_second: float
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    tpot_p50: float | None = None
    tpot_p95: float | None = None
    gap_p95: float | None = None  # p95 of the time between consecutive streamed chunks (stalls show here)


@dataclass(slots=True)
class ServeReport:
    rows: list[LevelResult]
    api_speedup: dict[str, float] = field(default_factory=dict)  # temperature -> Python API speed-up at 1 client
    table: str = ""
    files: list[Path] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ---- HTTP load ------------------------------------------------------------------------------------------------


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One streamed completion; returns its status, latency, TTFT, token count and the gaps between chunks."""
    started = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True,
                            "stream_options": {"include_usage": True}}) as response:
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
MIN_SLICES = 2  # a level has at least this many requests per client times two, so that the systems take turns at
# every level: at 64 clients, 128 requests were one slice per system, the two servers ran a minute apart, and the level
# read Cascade at 0.77× the target alone in two runs where four slices of 128 taking turns read 0.96×


def level_requests(requests: int, concurrency: int) -> int:
    """The requests one level runs per system: ``requests``, but at least two per client in each of ``MIN_SLICES``
    slices."""
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


def summarize_level(system: str, temperature: float, concurrency: int, level: dict) -> LevelResult:
    ok = [r for r in level["results"] if r["status"] == 200]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpots = [r["tpot"] for r in ok if r["tpot"] is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    return LevelResult(
        system, temperature, concurrency, len(level["results"]), len(level["results"]) - len(ok),
        round(level["wall"], 3), round(sum(r["tokens"] for r in ok) / level["wall"], 1),
        _round(percentile(ttfts, 0.5)), _round(percentile(ttfts, 0.95)),
        _round(percentile(tpots, 0.5)), _round(percentile(tpots, 0.95)), _round(percentile(gaps, 0.95)),
    )


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# ---- the anchors ---------------------------------------------------------------------------------------------


MIN_ANCHOR_PROMPTS = 16  # at one client, 4 prompts (the first of the cycle) read transformers at 212-428 tokens/s
# in three runs against the target alone's 324-377 over 128 requests; prompt lengths differ by 40x here


def anchor_prompts(batch: int) -> int:
    """The prompts transformers' ``generate`` runs at a batch size: two batches, and at least ``MIN_ANCHOR_PROMPTS``."""
    return max(2 * batch, MIN_ANCHOR_PROMPTS)


@torch.inference_mode()
def transformers_batched(model, tokenizer, prompts: list[str], batch: int, temperature: float, max_tokens: int) -> float:
    """Output tokens/s of transformers' ``generate`` over :func:`anchor_prompts` prompts, ``batch`` at a time,
    left-padded, every sequence generating exactly ``max_tokens``."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature,
                                                             "top_k": 0, "top_p": 1.0}
    count = anchor_prompts(batch)
    chosen = [prompts[i % len(prompts)] for i in range(count)]
    generated, started = 0, time.perf_counter()
    for i in range(0, count, batch):
        encoded = tokenizer(chosen[i : i + batch], return_tensors="pt", padding=True).to(model.device)
        out = model.generate(**encoded, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **sampling)
        generated += (out.shape[1] - encoded["input_ids"].shape[1]) * out.shape[0]
    return generated / (time.perf_counter() - started)


# ---- the run ---------------------------------------------------------------------------------------------------


def without_prefix_reuse(config: CascadeConfig) -> CascadeConfig:
    """The same config with ``batching.reuse_prefixes`` off. The bench's prompts repeat (a few dozen held-out
    prompts cycle through hundreds of requests), and where their number equals a level's concurrency the slot a
    finished request leaves holds exactly the prompt of the next one: at 64 clients the target alone then prefilled
    a fifth of its prompt tokens and ran 1.7× as fast, a measure of the cycle, not of batching or speculation."""
    data = config.model_dump()
    data["batching"]["reuse_prefixes"] = False
    return CascadeConfig.model_validate(data)


def target_alone(config: CascadeConfig) -> CascadeConfig:
    """The same target, batching and runtime, with no drafting stage."""
    data = config.model_dump()
    data["stages"] = [config.target.model_dump()]
    data["served_model_name"] = f"{config.served_model_name}-target"
    data["controller"] = {"mode": "fixed"}
    return CascadeConfig.model_validate(data)


WARMUP_REQUESTS = 8  # per system and temperature, one at a time, before anything is measured: the controller's
# first decisions (its warm-up rounds, every chain tried once) are the same cost through either path


def run_serving(config: str | Path | CascadeConfig | None, options: ServeOptions, progress=print) -> ServeReport:
    if config is None:
        config = packaged_config_path("demo")
    if not isinstance(config, CascadeConfig):
        config = load_config(config)
    if any(c < 1 for c in options.concurrency) or options.max_tokens < 2 or options.requests < 1:
        raise ValueError("concurrency levels and --requests must be >= 1, --max-tokens >= 2")
    for name, values in (("--concurrency", options.concurrency), ("--temperatures", options.temperatures)):
        if len(set(values)) < len(values):  # a level is one row of the table and one point of the plot
            raise ValueError(f"{name} lists a value twice ({' '.join(f'{v:g}' for v in values)}); use --requests "
                             "to measure a level longer")
    prompts = file_prompts(options.prompts_file) if options.prompts_file else held_out_prompts(options.num_prompts, seed=1)
    config = without_prefix_reuse(config)
    systems = {"cascade": config, "target": target_alone(config)}
    report = ServeReport(rows=[])
    with tempfile.TemporaryDirectory(prefix="cascade-serve-bench-") as tmp:
        # The transformers anchor first, on the Python API engines' target; the engines, warmed up as each server
        # is below, then take turns with the servers at one client.
        engines = {name: Cascade.from_config(cfg, progress=False) for name, cfg in systems.items()}
        model, tokenizer = engines["target"].engine.target.model, engines["target"].tokenizer
        for engine in engines.values():  # the warm-up each server gets below
            for t in options.temperatures:
                for prompt in prompts[-WARMUP_REQUESTS:]:
                    engine.generate(prompt, max_tokens=options.max_tokens, temperature=t, ignore_eos=True)
        for t in options.temperatures:
            for c in options.concurrency:
                rate = transformers_batched(model, tokenizer, prompts, c, t, options.max_tokens)
                report.rows.append(LevelResult("transformers", t, c, anchor_prompts(c), 0, 0.0, round(rate, 1)))
                progress(f"transformers generate, batch {c}, T={t}: {rate:.0f} tok/s")
        del model, tokenizer  # the engines stay: at one client they take turns with the servers
        with contextlib.ExitStack() as servers:
            urls = {}
            for name, cfg in systems.items():
                path = Path(tmp) / f"{name}.yaml"
                path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
                urls[name] = servers.enter_context(
                    running_server(path, "--log-level", "warning", "--max-waiting", "4096")
                )
                for t in options.temperatures:  # the warm-up the Python API engines got above
                    warm = ServeOptions(requests=WARMUP_REQUESTS, max_tokens=options.max_tokens)
                    asyncio.run(load_level(urls[name], prompts[-WARMUP_REQUESTS:], 1, t, warm))
            for t in options.temperatures:
                for c in options.concurrency:
                    levels = interleaved_levels(urls, prompts, c, t, options, engines if c == 1 else None)
                    if c == 1:
                        api = {name: sum(r["tokens"] for r in levels[f"api:{name}"]["results"])
                               / levels[f"api:{name}"]["wall"] for name in engines}
                        report.api_speedup[str(t)] = round(api["cascade"] / api["target"], 3)
                        progress(f"python API, 1 client, T={t}: cascade {api['cascade']:.0f} tok/s, target alone "
                                 f"{api['target']:.0f} tok/s, speed-up {report.api_speedup[str(t)]:.2f}x")
                    for name in urls:
                        row = summarize_level(name, t, c, levels[name])
                        report.rows.append(row)
                        progress(f"{name:>12} T={t} c={c:>3}: {row.tokens_per_second:7.1f} tok/s, TTFT p50 "
                                 f"{row.ttft_p50} s, TPOT p50 {row.tpot_p50} s ({row.requests} requests, "
                                 f"{row.errors} errors)")
        del engines
    report.table = serving_table(report)
    if options.out:
        out = Path(options.out)
        out.mkdir(parents=True, exist_ok=True)
        json_path = out / "serve.json"
        json_path.write_text(json.dumps({
            "config": config.model_dump(mode="json"), "options": asdict(options),
            "api_speedup_at_1_client": report.api_speedup, "rows": [asdict(r) for r in report.rows],
        }, indent=2))
        report.files = [json_path, *serving_plot(out, report, config.served_model_name)]
    return report


def _row(report: ServeReport, system: str, t: float, c: int) -> LevelResult | None:
    return next((r for r in report.rows if r.system == system and r.temperature == t and r.concurrency == c), None)


def serving_table(report: ServeReport) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    lines = [
        "| T | clients | Cascade tok/s | target alone tok/s | transformers generate tok/s | Cascade / target "
        "| TTFT p50/p95 ms (Cascade, target) | TPOT p50/p95 ms (Cascade, target) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    temperatures = sorted({r.temperature for r in report.rows})
    levels = sorted({r.concurrency for r in report.rows})
    for t in temperatures:
        for c in levels:
            cas, tgt, hf = (_row(report, s, t, c) for s in ("cascade", "target", "transformers"))
            if cas is None or tgt is None:
                continue
            ratio = cas.tokens_per_second / tgt.tokens_per_second if tgt.tokens_per_second else float("nan")
            anchor = f"{hf.tokens_per_second:.0f}" if hf else "-"
            lines.append(
                f"| {t:g} | {c} | {cas.tokens_per_second:.0f} | {tgt.tokens_per_second:.0f} | {anchor} | "
                f"{ratio:.2f}x | {ms(cas.ttft_p50)}/{ms(cas.ttft_p95)}, {ms(tgt.ttft_p50)}/{ms(tgt.ttft_p95)} | "
                f"{ms(cas.tpot_p50)}/{ms(cas.tpot_p95)}, {ms(tgt.tpot_p50)}/{ms(tgt.tpot_p95)} |"
            )
    for t, speedup in report.api_speedup.items():
        http = _row(report, "cascade", float(t), 1), _row(report, "target", float(t), 1)
        if all(http):
            lines.append(
                f"1 client, T={t}: speed-up over HTTP {http[0].tokens_per_second / http[1].tokens_per_second:.2f}x, "
                f"through the Python API {speedup:.2f}x"
            )
    return "\n".join(lines)


def serving_plot(out: Path, report: ServeReport, title: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    temperatures = sorted({r.temperature for r in report.rows})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4.5), squeeze=False)
    styles = {"cascade": ("Cascade", "o-"), "target": ("target alone (same server)", "s--"),
              "transformers": ("transformers generate (batched)", "^:")}
    for ax, t in zip(axes[0], temperatures):
        for system, (label, style) in styles.items():
            rows = sorted((r for r in report.rows if r.system == system and r.temperature == t),
                          key=lambda r: r.concurrency)
            if rows:
                ax.plot([r.concurrency for r in rows], [r.tokens_per_second for r in rows], style, label=label)
        levels = sorted({r.concurrency for r in report.rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients (batch size for transformers)")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{title}: {'greedy' if t == 0 else f'T = {t:g}'}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out / "serve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
