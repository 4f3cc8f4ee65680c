"""A bounded soak run of `cascade serve` on loopback: many clients, every kind of request, for minutes.

--clients clients (32) keep sending, for --minutes (10), a rotation of requests: streamed greedy completions,
plain sampled ones, seeded ones with n=2, chat completions, streams the client abandons after a few chunks, valid
edge cases (a temperature of 1e-40, stop token ids), log-probabilities with every penalty and min_p (every other one
streamed to a slow reader), malformed ones (bad JSON, out-of-range values, a lone UTF-16
surrogate) and hostile ones (unknown fields, parameters that are refused, a batch that can never fit, a body over the
size limit, a 3 MB token list under it, a foreign Host header, a megabyte of floats as a prompt), while a probe times ``/health`` every half
second. Pass criteria, checked at the end:

- no 5xx for a valid request, a 400 for every malformed one and a 4xx for every hostile one;
- once the clients stop, no request running or waiting and every stage's cached-sequences gauge at 0;
- the server's resident memory at the end within --rss-tolerance (3%) of what it was once warmed up (after the
  first --warmup-minutes, 2);
- reported: the slowest ``/health`` answer while all that arrived.

    python benchmarks/soak.py                              # the embedded demo config, 32 clients, 10 minutes
    python benchmarks/soak.py --minutes 1 --clients 8 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from cascade.bench.prompts import held_out_prompts
from cascade.config import packaged_config_path
from cascade.server.launch import running_server, scrape

MALFORMED = [
    b'{"prompt": "def f(", "max_tokens": ',
    b'{"prompt": "def \\ud800 f(", "max_tokens": 4}',
    b'{"prompt": "x", "max_tokens": 4, "temperature": -1}',
    b'{"prompt": "x", "max_tokens": 4, "seed": 18446744073709551616}',
    b'{"messages": [], "max_tokens": 4}',
]


HOSTILE = [  # (route, body bytes, extra headers)
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 4, "temprature": 0.5}', {}),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 4, "logprobs": 21}', {}),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 4, "logit_bias": {"5": 3}}', {}),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 4, "response_format": {"type": "json_object"}}', {}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}', {}),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 4, "repetition_penalty": 5e-324}', {}),
    ("/v1/completions", json.dumps({"prompt": [5] * 1_000_000, "max_tokens": 4}).encode(), {}),  # 3 MB: parsed
    ("/v1/completions", json.dumps({"prompt": ["x"] * 200, "n": 16, "max_tokens": 4}).encode(), {}),
    ("/v1/completions", json.dumps({"prompt": [5] * 1_500_000, "max_tokens": 4}).encode(), {}),
    ("/v1/completions", json.dumps({"prompt": [0.5] * 100_000, "max_tokens": 4}).encode(), {}),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 4}', {"host": "rebind.evil.example"}),
]


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def one_request(client: httpx.AsyncClient, url: str, kind: str, prompt: str, i: int) -> tuple[str, int]:
    """Send one request of ``kind``; return (kind, HTTP status)."""
    if kind == "hostile":
        route, body, headers = HOSTILE[i % len(HOSTILE)]
        response = await client.post(f"{url}{route}", content=body,
                                     headers={"content-type": "application/json", **headers})
        return kind, response.status_code
    if kind == "edge":  # valid: a temperature below the floor is greedy; stop token ids end the text
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 1e-40, "seed": i if i % 2 else None,
                "stop_token_ids": [10, 11]}
        return kind, (await client.post(f"{url}/v1/completions", json=body)).status_code
    if kind == "malformed":
        body = MALFORMED[i % len(MALFORMED)]
        route = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        response = await client.post(f"{url}{route}", content=body, headers={"content-type": "application/json"})
        return kind, response.status_code
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": prompt[:200]}], "max_tokens": 32, "temperature": 0.7}
        return kind, (await client.post(f"{url}/v1/chat/completions", json=body)).status_code
    if kind == "scored":  # valid: log-probabilities and the target's penalties, streamed every other time
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 0.7 if i % 3 else 0, "logprobs": 3,
                "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.2, "min_p": 0.05,
                "stream": bool(i % 2)}
        if not body["stream"]:
            return kind, (await client.post(f"{url}/v1/completions", json=body)).status_code
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for _ in response.aiter_lines():
                await asyncio.sleep(0.05)  # a slow reader: its chunks merge, nothing queues per step
            return kind, response.status_code
    body = {"prompt": prompt, "max_tokens": 48}
    if kind == "plain-sampled":
        body |= {"temperature": 0.8}
    elif kind == "seeded":
        body |= {"temperature": 0.8, "seed": i, "n": 2}
    else:  # streamed greedy, or abandoned after a few chunks
        body |= {"temperature": 0, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if kind == "abandoned" and chunks == 3:
                    break
            return kind, response.status_code
    return kind, (await client.post(f"{url}/v1/completions", json=body)).status_code


async def soak(url: str, clients: int, seconds: float, prompts: list[str]) -> Counter:
    kinds = ["streamed", "plain-sampled", "seeded", "chat", "abandoned", "malformed", "edge", "hostile", "scored"]
    statuses: Counter = Counter()
    deadline = time.monotonic() + seconds
    issued = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal issued
        while time.monotonic() < deadline:
            i = issued
            issued += 1
            try:
                kind, status = await one_request(client, url, kinds[i % len(kinds)], prompts[i % len(prompts)], i)
            except httpx.HTTPError as e:
                kind, status = kinds[i % len(kinds)], f"transport error {type(e).__name__}"
            statuses[(kind, status)] += 1

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(packaged_config_path("demo")))
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-minutes", type=float, default=2.0)
    parser.add_argument("--rss-tolerance", type=float, default=0.03)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    prompts = held_out_prompts(48, seed=7)
    server: dict = {}
    with running_server(args.config, "--log-level", "warning", "--max-waiting", "1024",
                        on_start=lambda proc: server.update(pid=proc.pid)) as url:
        pid, samples, health = server["pid"], [], []

        async def run() -> Counter:
            async def sample_memory() -> None:
                while True:
                    samples.append((time.monotonic(), resident_mb(pid)))
                    await asyncio.sleep(5)

            async def probe_health() -> None:
                async with httpx.AsyncClient(timeout=30) as c:
                    while True:
                        begun = time.monotonic()
                        await c.get(f"{url}/health")
                        health.append(time.monotonic() - begun)
                        await asyncio.sleep(0.5)

            tasks = [asyncio.create_task(sample_memory()), asyncio.create_task(probe_health())]
            try:
                return await soak(url, args.clients, 60 * args.minutes, prompts)
            finally:
                for task in tasks:
                    task.cancel()

        started = time.monotonic()
        statuses = asyncio.run(run())
        deadline = time.monotonic() + 60
        while True:  # the abandoned streams' requests leave the batch at the next step
            metrics = scrape(url)
            cached = sum(v for k, v in metrics.items() if k.startswith("cascade_stage_cached_sequences"))
            kept = {k: v for k, v in metrics.items() if k.startswith("cascade_stage_kept_tokens")}  # a suffix drafter's
            busy = metrics["cascade_num_requests_running"] + metrics["cascade_num_requests_waiting"]
            if (cached == 0 and busy == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        healthy = httpx.get(f"{url}/health").status_code == 200
    warm = [mb for t, mb in samples if t - started >= 60 * args.warmup_minutes]
    rss_warm, rss_end = (warm[0], warm[-1]) if warm else (samples[0][1], samples[-1][1])
    refused = ("malformed", "hostile")
    server_errors = {f"{k} {s}": n for (k, s), n in statuses.items() if k not in refused and not (isinstance(s, int) and s < 500)}
    wrong_rejections = {f"{k} {s}": n for (k, s), n in statuses.items()
                        if (k == "malformed" and s != 400) or (k == "hostile" and not (isinstance(s, int) and 400 <= s < 500))}
    report = {
        "clients": args.clients, "minutes": args.minutes, "requests": sum(statuses.values()),
        "statuses": {f"{k} {s}": n for (k, s), n in sorted(statuses.items(), key=str)},
        "server_errors_for_valid_requests": server_errors, "refused_wrongly": wrong_rejections,
        "health_seconds_max": round(max(health), 4) if health else None,
        "health_seconds_p99": round(sorted(health)[int(0.99 * (len(health) - 1))], 4) if health else None,
        "cached_sequences_after": cached, "running_or_waiting_after": busy, "healthy_after": healthy,
        "suffix_index_tokens_after": kept,
        "rss_mb_first": round(samples[0][1], 1), "rss_mb_warm": round(rss_warm, 1), "rss_mb_end": round(rss_end, 1),
        "rss_growth_after_warmup": round(rss_end / rss_warm - 1, 4),
    }
    ok = (not server_errors and not wrong_rejections and cached == 0 and busy == 0 and healthy
          and report["rss_growth_after_warmup"] <= args.rss_tolerance)
    report["passed"] = ok
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
