"""What running the stages as Ray actors costs, against the same cascade in one process, synchronous and pipelined.

Runs the demo family (or --config) with `runtime.backend: local` and `ray`, each synchronous and pipelined
(`runtime.pipeline`: the next round drafted while the target verifies), fixed depths, on the same held-out prompts,
interleaved (local, ray, local pipelined, ray pipelined, ...), greedy and sampling. Reports the tokens/s ratios
(median over prompts), the time per top-level round spent outside the stages' forward passes (for Ray: the driver's
time minus what the actors spent computing), the bytes moved per round, and how often a draft made ahead was kept.

    python benchmarks/ray_overhead.py [--config configs/demo-ray.yaml] [--prompts 6] [--max-tokens 64]
                                      [--concurrency 16]

With ``--concurrency N``, every run generates N prompts together (the batched engine; the held-out prompts
repeated as needed), and the ratios compare those batches.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cascade.api import Cascade
from cascade.bench.prompts import held_out_prompts
from cascade.config import load_config, packaged_config_path


def run(cascade: Cascade, prompt: str | list[str], max_tokens: int, temperature: float) -> dict:
    remote = [s for s in cascade.engine.stages if hasattr(s, "transfer")]
    before = [(s.transfer.bytes_sent, s.transfer.bytes_received, s.transfer.stage_seconds, s.transfer.calls)
              for s in remote]
    started = time.perf_counter()
    results = cascade.generate(prompt, max_tokens=max_tokens, temperature=temperature, seed=0)
    wall = time.perf_counter() - started
    results = results if isinstance(results, list) else [results]
    rounds = sum(sum(r.stats.chains.values()) for r in results)
    if remote:
        sent = sum(s.transfer.bytes_sent - b[0] for s, b in zip(remote, before))
        received = sum(s.transfer.bytes_received - b[1] for s, b in zip(remote, before))
        compute = sum(s.transfer.stage_seconds - b[2] for s, b in zip(remote, before))
        calls = sum(s.transfer.calls - b[3] for s, b in zip(remote, before))
    else:
        sent = received = calls = 0
        compute = sum(s.forward_seconds for r in results for s in r.stats.stages)  # each request's share
    return {"tokens": sum(len(r.token_ids) for r in results), "wall": wall, "rounds": rounds,
            "outside": wall - compute, "sent": sent, "received": received, "calls": calls,
            "ahead": sum(r.stats.drafted_ahead for r in results), "kept": sum(r.stats.kept_ahead for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(packaged_config_path("demo-ray")))
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-pipeline", action="store_true", help="only the synchronous rows")
    parser.add_argument("--concurrency", type=int, default=1, help="prompts generated together in each run")
    args = parser.parse_args()
    loaded = load_config(args.config)
    ray_config = loaded.model_copy(update={"controller": loaded.controller.model_copy(update={"mode": "fixed"})})
    local_config = ray_config.model_copy(update={"runtime": ray_config.runtime.model_copy(update={"backend": "local"})})
    local = Cascade.from_config(local_config, progress=False)
    remote = Cascade.from_config(ray_config, progress=False)
    prompts = held_out_prompts(args.prompts, seed=2)
    if args.concurrency > 1:  # each run: the prompt and the ones after it, as many as asked
        prompts = [[prompts[(i + j) % len(prompts)] for j in range(args.concurrency)] for i in range(len(prompts))]
    try:
        variants = {"local": (local, False), "ray": (remote, False)}
        if not args.no_pipeline:
            variants |= {"local pipelined": (local, True), "ray pipelined": (remote, True)}
        for temperature in (0.0, 0.8):
            rows = {name: [] for name in variants}
            for p in prompts[:2]:  # warm-up
                for cascade, pipelined in variants.values():
                    cascade.engine.pipeline = pipelined
                    run(cascade, p, 8, temperature)
            label = f"{args.concurrency} requests together" if args.concurrency > 1 else "one request at a time"
            for _ in range(args.repeats):
                for p in prompts:
                    for name, (cascade, pipelined) in variants.items():
                        cascade.engine.pipeline = pipelined
                        rows[name].append(run(cascade, p, args.max_tokens, temperature))
            summary = {}
            for name, rs in rows.items():
                tokens, wall, rounds = (sum(r[k] for r in rs) for k in ("tokens", "wall", "rounds"))
                summary[name] = {
                    "tok_s": tokens / wall,
                    "outside_ms_per_round": 1000 * sum(r["outside"] for r in rs) / rounds,
                    "bytes_sent_per_round": sum(r["sent"] for r in rs) / rounds,
                    "bytes_received_per_round": sum(r["received"] for r in rs) / rounds,
                    "tokens_per_round": tokens / rounds,
                    "calls_per_round": sum(r["calls"] for r in rs) / rounds,
                    "kept": sum(r["kept"] for r in rs) / max(1, sum(r["ahead"] for r in rs)),
                }
            def ratio(a: str, b: str) -> float:
                return statistics.median((x["tokens"] / x["wall"]) / (y["tokens"] / y["wall"])
                                         for x, y in zip(rows[a], rows[b]))

            mode = "greedy" if temperature == 0 else f"sampling T={temperature}"
            print(f"\n{mode}, {label}: tokens/s ratios, median over prompts: Ray / local {ratio('ray', 'local'):.3f}", end="")
            if not args.no_pipeline:
                print(f"; pipelined / synchronous: local {ratio('local pipelined', 'local'):.3f}, "
                      f"Ray {ratio('ray pipelined', 'ray'):.3f}; Ray pipelined / local {ratio('ray pipelined', 'local'):.3f}",
                      end="")
            print()
            for name, s in summary.items():
                print(f"  {name:>15}: {s['tok_s']:7.1f} tok/s  {s['tokens_per_round']:.2f} tokens/round  "
                      f"outside forward passes {s['outside_ms_per_round']:.2f} ms/round  "
                      f"{s['calls_per_round']:.1f} actor calls/round  "
                      f"sent {s['bytes_sent_per_round']:.0f} B/round  received {s['bytes_received_per_round']:.0f} B/round"
                      + (f"  drafts ahead kept {s['kept']:.0%}" if "pipelined" in name else ""))
    finally:
        remote.close()


if __name__ == "__main__":
    main()
