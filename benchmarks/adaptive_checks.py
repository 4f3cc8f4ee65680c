"""Two checks of the adaptive controller on the demo family (issue 5), side by side in one run each.

    python benchmarks/adaptive_checks.py useless   # adaptive with and without a useless (random) extra stage
    python benchmarks/adaptive_checks.py mixed     # write a mixed prompt file (code + docstring prose) and print
                                                   # the `cascade bench` command that compares every method on it
"""

from __future__ import annotations

import collections
import json
import random
import re
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cascade import Cascade
from cascade.bench.methods import CascadeMethod, HFMethod
from cascade.bench.prompts import held_out_prompts
from cascade.bench.runner import run_benchmark, summarize
from cascade.config import parse_config
from cascade.controller import ControllerParams
from cascade.zoo import build_family
from cascade.zoo.corpus import load_corpus


def useless(out: Path) -> None:
    family = build_family("demo")
    random_dir = out / "useless"
    torch.manual_seed(123)  # the small member's shape, randomly initialised: its drafts are worthless
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(family.member_path("small"))).save_pretrained(random_dir)
    AutoTokenizer.from_pretrained(family.member_path("small")).save_pretrained(random_dir)
    names = ["ngram", "useless", "small", "medium", "target"]
    paths = {"useless": random_dir, **{n: family.member_path(n) for n in ("small", "medium", "target")}}
    stages = [{"name": "ngram", "type": "ngram", "match": "consensus"}] + [{"name": n, "type": "hf", "model": str(paths[n])} for n in names[1:]]
    loaded = Cascade.from_config(parse_config({"stages": stages}), progress=False)
    by_name = {s.name: s for s in loaded.engine.stages}

    def adaptive(chain, shortcut=False):
        return Cascade([by_name[n] for n in chain], [4] * (len(chain) - 1), loaded.tokenizer,
                       controller=ControllerParams(), shortcut=shortcut)

    normal = ["ngram", "small", "medium", "target"]
    methods = [
        HFMethod("target", by_name["target"]),
        CascadeMethod("adaptive", adaptive(normal), tuple(normal), 0),
        CascadeMethod("adaptive+useless", adaptive(names), tuple(names), 0),
        CascadeMethod("adaptive~shortcut", adaptive(normal, True), tuple(normal), 0),
        CascadeMethod("adaptive+useless~shortcut", adaptive(names, True), tuple(names), 0),
    ]
    prompts = [loaded.encode(p) for p in held_out_prompts(6)]
    result = run_benchmark(methods, prompts, max_tokens=128, temperature=0.0, repeats=3)
    if result.mismatches:
        sys.exit(f"greedy mismatches: {result.mismatches[:3]}")
    for s in summarize(result, [m.name for m in methods], "target", 3):
        lo, hi = s.speedup_spread
        print(f"{s.method:20s} {s.tokens_per_second:7.1f} tok/s  {s.speedup:.2f}x ({lo:.2f}-{hi:.2f})")
    chains = collections.Counter()
    for m in result.measurements:
        if m.method.startswith("adaptive+useless"):
            chains.update(m.stats["chains"])
    print("chains chosen with the useless stage:", chains.most_common(6))


def mixed(out: Path) -> None:
    """Four repetitive code prompts and four prose prompts (docstrings with few repeated words)."""
    prose = []
    for doc in load_corpus().held_out:
        for m in re.finditer(r'"""(.{300,1200}?)"""', doc.text, re.S):
            words = m.group(1).split()
            if len(set(words)) > 0.6 * len(words):
                prose.append(" ".join(words)[:400])
    random.Random(0).shuffle(prose)
    path = out / "mixed.jsonl"
    with path.open("w") as f:
        for p in held_out_prompts(4, seed=3) + prose[:4]:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"wrote {path}; now run:\n  cascade bench --prompts {path} --depths 2 4 6 8 --repeats 2 --out {out / 'mixed-out'}")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which not in ("useless", "mixed"):
        sys.exit(__doc__)
    target_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp(prefix="cascade-adaptive-"))
    target_dir.mkdir(parents=True, exist_ok=True)
    (useless if which == "useless" else mixed)(target_dir)
