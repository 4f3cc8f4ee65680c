"""Does a long prompt stall the requests that are decoding? Chunked prefill on and off, side by side.

Starts `cascade serve` twice on loopback (the embedded demo config unless --config is given): once with the default
per-step token budget (`--max-batched-tokens 512`: a 2,000-token prompt is prefilled over several steps) and once
with a budget larger than the prompt (the whole prompt in one step: no chunking). In each, --clients streaming
clients decode long greedy completions; once they are all decoding, one request with a --prompt-tokens prompt
arrives. Reported: the gaps between the decoding clients' streamed chunks while the long prompt is being prefilled
(p50, p95, max) and the long request's time to first token, after a warm-up round that already grew the KV cache
to the long prompt's length (the first such prompt stalls every request once while the slots grow).

    python benchmarks/chunked_prefill.py
    python benchmarks/chunked_prefill.py --clients 16 --prompt-tokens 2000 --json prefill.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from cascade.bench.prompts import held_out_prompts
from cascade.bench.load import percentile
from cascade.config import packaged_config_path
from cascade.server.launch import running_server


async def decode_client(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, arrivals: list[float]) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                arrivals.append(time.perf_counter())


async def trial(url: str, clients: int, long_prompt: list[int], max_tokens: int) -> dict:
    prompts = held_out_prompts(clients, seed=3)
    arrivals: list[list[float]] = [[] for _ in range(clients)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        decoders = [asyncio.create_task(decode_client(client, url, p, max_tokens, a)) for p, a in zip(prompts, arrivals)]
        while any(len(a) < 2 and not d.done() for a, d in zip(arrivals, decoders)):  # everybody is decoding
            await asyncio.sleep(0.05)
        sent = time.perf_counter()
        response = await client.post(f"{url}/v1/completions", json={"prompt": long_prompt, "max_tokens": 1, "temperature": 0})
        first_token = time.perf_counter()
        assert response.status_code == 200, response.text
        await asyncio.gather(*decoders)
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if a >= sent and a <= first_token]
    return {
        "long_prompt_ttft": round(first_token - sent, 3),
        "gaps_during_prefill": len(gaps),
        "gap_p50": round(percentile(gaps, 0.5), 4) if gaps else None,
        "gap_p95": round(percentile(gaps, 0.95), 4) if gaps else None,
        "gap_max": round(max(gaps), 4) if gaps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(packaged_config_path("demo")))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=192, help="tokens each decoding client generates")
    parser.add_argument("--budget", type=int, default=512, help="--max-batched-tokens with chunking")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    long_prompt = [(7 * i) % 4000 + 10 for i in range(args.prompt_tokens)]  # token ids: the content does not matter
    rows = {}
    for label, budget in (("chunked", args.budget), ("unchunked", 4 * args.prompt_tokens)):
        with running_server(args.config, "--max-batched-tokens", str(budget), "--log-level", "warning") as url:
            # Warm-up with the long prompt too: the first one grows every slot of the KV cache to its length (a copy
            # of the whole cache, a one-time stall of about a second here); what is measured is the steady state.
            asyncio.run(trial(url, args.clients, long_prompt, 32))
            rows[label] = {"max_batched_tokens": budget, **asyncio.run(trial(url, args.clients, long_prompt, args.max_tokens))}
        r = rows[label]
        print(f"{label:>9} (budget {budget:>5}): decoding clients' chunk gaps while the {args.prompt_tokens}-token prompt "
              f"prefills: p50 {r['gap_p50']} s, p95 {r['gap_p95']} s, max {r['gap_max']} s; its TTFT {r['long_prompt_ttft']} s",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "clients": args.clients, "prompt_tokens": args.prompt_tokens, **rows}, f, indent=2)


if __name__ == "__main__":
    main()
