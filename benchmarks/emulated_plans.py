"""Fixed plans against the adaptive controller on an emulated config, in emulated seconds, without HTTP: the way to
tell whether a gap between the planner and a served rate is the cost model's or the controller's.

    python benchmarks/emulated_plans.py configs/emulated-mi300x.yaml --concurrency 64 \
        --plans target small+target@2 ngram+target@2 ngram+small+target@2 adaptive

Each plan decodes ``--concurrency`` greedy requests of ``--max-tokens`` tokens (held-out prompts, ``ignore_eos``), all
started at once; the rate is measured over the decode phase while the batch is full (every request prefilled, none
finished), so prefill and the drain do not weigh in. A plan is ``target`` (the target alone), ``adaptive`` (the
config's own cascade and controller) or ``<stage>+...+<target>@<depth>`` (every drafting stage at that depth; with the
n-gram drafter below a model, its found continuations go straight to the target, the shortcut). Beside each rate, the
planner's prediction for the same plan at the mean context (``cascade.emulation.planner``, fixed depths) where the
plan is fixed (``--alpha``: each drafting stage's per-position acceptance, e.g. from a served level's
``serve.json``; not for a plan under the shortcut, whose mixture the planner models only for the adaptive default).
Every figure is **emulated** (wall seconds over the config's time scale).
"""

from __future__ import annotations

import argparse
import time

from cascade.api import Cascade
from cascade.bench.emulated import stand_ins
from cascade.bench.prompts import held_out_prompts
from cascade.config import load_config
from cascade.emulation.planner import cost_curves, fixed_rate


def build(full: Cascade, plan: str, config) -> Cascade:
    if plan == "adaptive":
        return full
    stages = {s.name: s for s in full.engine.stages}
    names, depth = (plan, "0") if plan == "target" else plan.split("@")
    names = [config.target.name] if plan == "target" else names.split("+")
    unknown = [n for n in names if n not in stages]
    if unknown or names[-1] != config.target.name:
        raise SystemExit(f"plan {plan!r}: stages {unknown or names} are not a chain ending at the target "
                         f"{config.target.name!r}; stages: {list(stages)}")
    return Cascade(
        [stages[n] for n in names], [int(depth)] * (len(names) - 1), full.tokenizer, clock=full.clock,
        max_running=config.batching.max_running, max_batched_tokens=config.batching.max_batched_tokens,
        shortcut=names[0] == config.stages[0].name and config.stages[0].type == "ngram" and len(names) > 2,
    )


def decode_rate(cascade: Cascade, prompts: list[str], max_tokens: int, scale: float) -> tuple[float, float, int]:
    """(tokens/s over the full-batch decode phase, its mean context, steps)."""
    generations = [cascade.start(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for p in prompts]
    requests, started, first, steps = None, 0.0, 0, 0
    engine = cascade.engine
    while not all(g.finished for g in generations):
        cascade.step()
        if requests is None:
            if len(engine.running) == len(prompts) and all(r.decoding for r in engine.running):
                requests, started = list(engine.running), time.perf_counter()
                first = sum(len(r.generated) for r in requests)
            continue
        steps += 1
        if len(engine.running) < len(prompts):
            break
    if requests is None or steps == 0:
        raise SystemExit("the batch never ran full: raise --max-tokens")
    seconds = (time.perf_counter() - started) / scale
    context = sum(r.length for r in requests) / len(requests)
    return (sum(len(r.generated) for r in requests) - first) / seconds, context, steps


def predicted(config, plan: str, batch: int, context: float, alphas: dict[str, float]) -> float | None:
    """The planner's rate for a fixed plan at these per-position acceptances (None: the adaptive controller, a plan
    under the n-gram shortcut, or a stage without a given acceptance)."""
    if plan == "adaptive":
        return None
    names = [config.target.name] if plan == "target" else plan.split("@")[0].split("+")
    models = dict(zip([s.name for s in config.stages], stand_ins(config)))
    chain_models = [models[n] for n in names]
    if any(n not in alphas for n in names[:-1]) or ("ngram" in chain_models[:1] and len(names) > 2):
        return None
    costs = cost_curves(chain_models, config.target.emulate.device, batch, context)
    depth = 0 if plan == "target" else int(plan.split("@")[1])
    chain = tuple(range(len(names)))

    def alpha(i: int, j: int) -> float:
        return alphas[names[i]]

    return fixed_rate(chain, [depth] * (len(names) - 1), alpha, costs, [m == "ngram" for m in chain_models], batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--plans", nargs="+", default=["target", "adaptive"])
    parser.add_argument("--alpha", nargs="*", default=[], metavar="STAGE=A",
                        help="per-position acceptance of each drafting stage by the target, for the predictions")
    args = parser.parse_args()
    config = load_config(args.config)
    if not config.emulated:
        raise SystemExit(f"{args.config} has no emulated stages")
    alphas = {k: float(v) for k, v in (a.split("=") for a in args.alpha)}
    full = Cascade.from_config(config)
    prompts = held_out_prompts(args.concurrency, seed=3)
    print(f"{args.concurrency} greedy requests, {args.max_tokens} tokens each; emulated seconds (time scale "
          f"{config.time_scale})")
    print("| plan | decode tok/s (full batch) | steps | planner tok/s |")
    print("|---|---|---|---|")
    for plan in args.plans:
        rate, context, steps = decode_rate(build(full, plan, config), prompts, args.max_tokens, config.time_scale)
        guess = predicted(config, plan, args.concurrency, context, alphas)
        print(f"| {plan} | {rate:.0f} | {steps} | {'-' if guess is None else f'{guess:.0f}'} |", flush=True)


if __name__ == "__main__":
    main()
