"""The suffix drafter (``type: suffix``) against the n-gram drafter on a repetitive multi-request workload and on one
with no repetition across requests, side by side in one run.

Both systems are the shipped demo config (n-gram shortcut over small → medium → target, adaptive controller); one of
them has the suffix drafter at the bottom instead of the n-gram drafter. Requests run one at a time through the
Python API, the two systems taking turns request by request on the same prompts, greedy, each output checked to be
the target's (the two must agree token for token).

- ``repetitive``: the same held-out source files asked about again and again — each request's prompt is one file's
  first ~1,500 characters followed by a line from further down it (the model continues from there), and one request
  in four asks again exactly what an earlier one asked (a retried or repeated question). What repeats is what
  production traffic repeats: the shared document and the answers already given about it.
- ``distinct``: held-out prompts from different files (``cascade bench``'s), nothing shared across requests: what the
  suffix drafter costs where it cannot help.

    python benchmarks/suffix_workload.py [--requests 48] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from cascade.api import Cascade
from cascade.bench.prompts import held_out_prompts
from cascade.config import load_config, packaged_config_path
from cascade.zoo.corpus import load_corpus


def repetitive_prompts(count: int, seed: int = 0, files: int = 3) -> list[str]:
    documents = [d for d in load_corpus().held_out if len(d.text) > 6000]
    rng = random.Random(seed)
    chosen = rng.sample(documents, files)
    prompts: list[str] = []
    for i in range(count):
        if prompts and rng.random() < 0.25:
            prompts.append(rng.choice(prompts))  # asked again
            continue
        text = chosen[i % files].text
        head = text[: text.rfind("\n", 0, 1500) + 1]
        lines = [line for line in text[len(head) : 6000].splitlines(keepends=True) if line.strip()]
        prompts.append(head + rng.choice(lines))
    return prompts


def systems() -> dict[str, Cascade]:
    demo = load_config(packaged_config_path("demo"))
    data = demo.model_dump(mode="json")
    ngram = data["stages"][0]
    data["stages"][0] = {"name": "suffix", "type": "suffix", "depth": ngram["depth"], "shortcut": ngram["shortcut"]}
    suffix = type(demo).model_validate(data)
    return {"ngram (demo)": Cascade.from_config(demo), "suffix": Cascade.from_config(suffix)}


def run(workload: str, prompts: list[str], cascades: dict[str, Cascade], max_tokens: int) -> dict[str, float]:
    seconds = dict.fromkeys(cascades, 0.0)
    tokens = dict.fromkeys(cascades, 0)
    for prompt in prompts:
        outputs = []
        for name, cascade in cascades.items():
            started = time.perf_counter()
            result = cascade.generate(prompt, max_tokens=max_tokens)
            seconds[name] += time.perf_counter() - started
            tokens[name] += len(result.token_ids)
            outputs.append(result.token_ids)
        assert all(o == outputs[0] for o in outputs), "the systems disagree: one of them is not lossless"
    rates = {name: tokens[name] / seconds[name] for name in cascades}
    base = next(iter(rates.values()))
    for name, rate in rates.items():
        print(f"{workload:<11} {name:<14} {rate:8.1f} tok/s  {rate / base:5.2f}x")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    cascades = systems()
    warm = held_out_prompts(2, seed=args.seed + 99)
    for cascade in cascades.values():
        cascade.generate(warm, max_tokens=16)
    run("distinct", held_out_prompts(args.requests, seed=args.seed + 1), cascades, args.max_tokens)
    run("repetitive", repetitive_prompts(args.requests, seed=args.seed), cascades, args.max_tokens)
    kept = cascades["suffix"].engine.stages[0].kept_tokens
    print(f"suffix index: {kept} tokens kept")


if __name__ == "__main__":
    main()
