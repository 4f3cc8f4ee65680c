"""Load test for `cascade serve`: requests per second and latency at several concurrency levels.

Starts the server as its own process on loopback (the embedded demo config unless --config is given), then,
for each concurrency level C, keeps C clients busy sending completions (held-out prompts, greedy, --max-tokens
each) until --requests requests have completed or --seconds have passed, whichever comes first. Reports
requests/s, generated tokens/s, and p50/p95 end-to-end latency and time to first token (streamed requests).

    python benchmarks/serve_load.py                      # demo family, concurrency 1, 8, 32
    python benchmarks/serve_load.py --concurrency 1 4 --requests 16 --json load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from cascade.bench.prompts import held_out_prompts
from cascade.config import packaged_config_path
from cascade.server.launch import running_server


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "seconds": time.perf_counter() - started}
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"status": 200, "seconds": time.perf_counter() - started, "ttft": first,
            "tokens": usage["completion_tokens"] if usage else 0}


async def run_level(url: str, prompts: list[str], concurrency: int, requests: int, seconds: float, max_tokens: int):
    results: list[dict] = []
    issued = 0
    deadline = time.perf_counter() + seconds

    async def worker(client: httpx.AsyncClient):
        nonlocal issued
        while issued < requests and time.perf_counter() < deadline:
            prompt = prompts[issued % len(prompts)]
            issued += 1
            results.append(await one_request(client, url, prompt, max_tokens))

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    ok = [r for r in results if r["status"] == 200]
    latencies = [r["seconds"] for r in ok]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "wall_seconds": round(wall, 3),
        "requests_per_second": round(len(ok) / wall, 3),
        "tokens_per_second": round(sum(r["tokens"] for r in ok) / wall, 1),
        "latency_p50": round(percentile(latencies, 0.5), 3),
        "latency_p95": round(percentile(latencies, 0.95), 3),
        "ttft_p50": round(percentile(ttfts, 0.5), 3) if ttfts else None,
        "ttft_p95": round(percentile(ttfts, 0.95), 3) if ttfts else None,
        "mean_tokens": round(statistics.mean(r["tokens"] for r in ok), 1) if ok else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(packaged_config_path("demo")))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per level at most (default: 64)")
    parser.add_argument("--seconds", type=float, default=90.0, help="time per level at most (default: 90)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    prompts = held_out_prompts(32, seed=1)
    rows = []
    with running_server(args.config, "--max-running", str(args.max_running), "--log-level", "warning") as url:
        asyncio.run(run_level(url, prompts, 1, 2, 30, args.max_tokens))  # warm-up
        for c in args.concurrency:
            rows.append(asyncio.run(run_level(url, prompts, c, max(args.requests, c), args.seconds, args.max_tokens)))
            r = rows[-1]
            print(
                f"concurrency {c:>3}: {r['requests']:>4} requests ({r['errors']} errors) in {r['wall_seconds']:>6.1f} s  "
                f"{r['requests_per_second']:>6.2f} req/s  {r['tokens_per_second']:>7.1f} tok/s  "
                f"latency p50 {r['latency_p50']:.3f} s p95 {r['latency_p95']:.3f} s  "
                f"TTFT p50 {r['ttft_p50']} s p95 {r['ttft_p95']} s",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "max_tokens": args.max_tokens, "levels": rows}, f, indent=2)


if __name__ == "__main__":
    main()
