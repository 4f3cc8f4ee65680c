"""What running the stages as Ray actors costs, against the same cascade in one process.

Runs the demo family (or --config) with `runtime.backend: local` and `ray`, fixed depths, on the same held-out
prompts, interleaved (local, ray, local, ray, ...), greedy and sampling. Reports the tokens/s ratio, the time
per top-level round spent outside the stages' forward passes (for Ray: the driver's time minus what the
actors spent computing), and the bytes moved per round.

    python benchmarks/ray_overhead.py [--config configs/demo-ray.yaml] [--prompts 6] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from cascade.api import Cascade
from cascade.bench.prompts import held_out_prompts
from cascade.config import load_config, packaged_config_path


def run(cascade: Cascade, prompt: str, max_tokens: int, temperature: float) -> dict:
    remote = [s for s in cascade.engine.stages if hasattr(s, "transfer")]
    before = [(s.transfer.bytes_sent, s.transfer.bytes_received, s.transfer.stage_seconds, s.transfer.calls)
              for s in remote]
    started = time.perf_counter()
    result = cascade.generate(prompt, max_tokens=max_tokens, temperature=temperature, seed=0)
    wall = time.perf_counter() - started
    rounds = sum(result.stats.chains.values())
    if remote:
        sent = sum(s.transfer.bytes_sent - b[0] for s, b in zip(remote, before))
        received = sum(s.transfer.bytes_received - b[1] for s, b in zip(remote, before))
        compute = sum(s.transfer.stage_seconds - b[2] for s, b in zip(remote, before))
        calls = sum(s.transfer.calls - b[3] for s, b in zip(remote, before))
    else:
        sent = received = calls = 0
        compute = sum(s.forward_seconds for s in result.stats.stages)
    return {"tokens": len(result.token_ids), "wall": wall, "rounds": rounds, "outside": wall - compute,
            "sent": sent, "received": received, "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(packaged_config_path("demo-ray")))
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    loaded = load_config(args.config)
    ray_config = loaded.model_copy(update={"controller": loaded.controller.model_copy(update={"mode": "fixed"})})
    local_config = ray_config.model_copy(update={"runtime": ray_config.runtime.model_copy(update={"backend": "local"})})
    local = Cascade.from_config(local_config, progress=False)
    remote = Cascade.from_config(ray_config, progress=False)
    prompts = held_out_prompts(args.prompts, seed=2)
    try:
        for temperature in (0.0, 0.8):
            rows = {"local": [], "ray": []}
            for p in prompts[:2]:  # warm-up
                run(local, p, 8, temperature), run(remote, p, 8, temperature)
            for _ in range(args.repeats):
                for p in prompts:
                    rows["local"].append(run(local, p, args.max_tokens, temperature))
                    rows["ray"].append(run(remote, p, args.max_tokens, temperature))
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
                }
            ratio = statistics.median(
                (r["tokens"] / r["wall"]) / (l["tokens"] / l["wall"]) for l, r in zip(rows["local"], rows["ray"])
            )
            mode = "greedy" if temperature == 0 else f"sampling T={temperature}"
            print(f"\n{mode}: Ray / local tokens/s, median over prompts: {ratio:.3f}")
            for name, s in summary.items():
                print(f"  {name:>5}: {s['tok_s']:7.1f} tok/s  {s['tokens_per_round']:.2f} tokens/round  "
                      f"outside forward passes {s['outside_ms_per_round']:.2f} ms/round  "
                      f"{s['calls_per_round']:.1f} actor calls/round  "
                      f"sent {s['bytes_sent_per_round']:.0f} B/round  received {s['bytes_received_per_round']:.0f} B/round")
    finally:
        remote.close()


if __name__ == "__main__":
    main()
