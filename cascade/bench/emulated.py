"""What ``cascade bench --serve`` adds for a config with emulated stages (DESIGN.md, "Emulated accelerators").

Each server's ``/metrics`` is read before and after a level; from the increases:

- per emulated stage, the share of its stretched passes the real compute took (``real / (time_scale · emulated)``;
  a figure counts only while every share stays under ``MAX_REAL_SHARE``);
- the host's share of the engine's step time, and the level's rate with host time at full weight: the host's work
  (planning, Python, the data plane's real cost) is not stretched, so beside a real device it would weigh
  ``time_scale`` times more, ``tokens / (wall / s + host · (1 − 1/s))`` (valid while the engine is busy all level);
- what the controller did: each drafting stage's acceptance, its mean depth and the share of rounds it was bypassed;
- the planner's prediction (:mod:`cascade.emulation.planner`) from the measured acceptance and mean context, beside
  the measured rate and judged against the level's sustained rate (:func:`cascade.bench.serving.sustained_rate`):
  the planner predicts ``C`` requests always in flight; the whole level adds each slice's opening burst of prompts
  and its drain, which a system whose requests commit different numbers of tokens a step (speculation) spends at a
  shrinking batch.
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from cascade.config import CascadeConfig, HFStageConfig
from cascade.emulation.planner import NGRAM, per_position_alpha, predict

MAX_REAL_SHARE = 0.25  # above it, the real compute shapes the pass more than the model does
MIN_DRAFTS = 100  # fewer drafts in a level estimate a stage's acceptance too loosely (2 drafts read α = 1.0)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of ``url``'s ``/metrics``, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def increase(before: dict, after: dict) -> dict:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def _by_stage(samples: dict, name: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (n, labels), value in samples.items():
        if n == name:
            out[dict(labels).get("stage", "")] += value
    return dict(out)


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def emulation_figures(delta: dict, scale: float, tokens: int, wall: float) -> dict:
    """Real-compute share per stage, the host's share of step time, and the rate with host time at full weight."""
    real = _by_stage(delta, "cascade_emulated_real_compute_seconds_total")
    emulated = _by_stage(delta, "cascade_emulated_pass_seconds_total")
    shares = {s: round(real[s] / (scale * emulated[s]), 4) for s in real if emulated.get(s, 0) > 0}
    steps = _total(delta, "cascade_engine_step_wall_seconds_total")
    host = _total(delta, "cascade_engine_host_wall_seconds_total")
    full = wall / scale + host * (1 - 1 / scale)
    return {
        "real_share": shares, "counts": all(v < MAX_REAL_SHARE for v in shares.values()),
        "host_share": round(host / steps, 4) if steps else None,
        "tokens_per_second_host_full_weight": round(tokens / full, 1) if full > 0 else None,
    }


def _pair_alpha(delta: dict, after: dict, stage: str, verifier: str) -> float | None:
    """The per-position acceptance of ``stage``'s drafts that ``verifier`` checked, over the level or the run so far
    (the first with ``MIN_DRAFTS`` drafts); None with fewer."""
    for source in (delta, after):
        counts = {key: sum(v for (n, labels), v in source.items()
                           if n == f"cascade_spec_decode_pair_{key}_total"
                           and dict(labels) == {"stage": stage, "verifier": verifier})
                  for key in ("drafts", "draft_tokens", "accepted_tokens")}
        if counts["drafts"] >= MIN_DRAFTS:
            return per_position_alpha(counts["accepted_tokens"], counts["draft_tokens"], counts["drafts"])
    return None


def controller_figures(delta: dict, after: dict, stages: list[str]) -> dict:
    """Per drafting stage: acceptance over the level (over the run so far where it drafted fewer than
    ``MIN_DRAFTS`` times in the level: a controller that bypassed a stage still checks it now and then, and a few
    such drafts say little of its acceptance), mean depth and the share of rounds it was bypassed, and its
    per-position acceptance by each stage above it that verified ``MIN_DRAFTS`` of its drafts (``pairs``)."""
    rounds = _total(delta, "cascade_rounds_total")
    out = {}
    for name in stages[:-1]:
        source = delta if _by_stage(delta, "cascade_spec_decode_num_drafts_total").get(name, 0.0) >= MIN_DRAFTS else after
        drafts = _by_stage(source, "cascade_spec_decode_num_drafts_total").get(name, 0.0)
        drafted = _by_stage(source, "cascade_spec_decode_num_draft_tokens_total").get(name, 0.0)
        accepted = _by_stage(source, "cascade_spec_decode_num_accepted_tokens_total").get(name, 0.0)
        depth_sum = _by_stage(delta, "cascade_spec_decode_depth_sum").get(name, 0.0)
        depth_count = _by_stage(delta, "cascade_spec_decode_depth_count").get(name, 0.0)
        bypassed = _by_stage(delta, "cascade_stage_bypassed_rounds_total").get(name, 0.0)
        alpha = per_position_alpha(accepted, drafted, drafts)
        out[name] = {
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "alpha": None if alpha is None else round(alpha, 4),  # per position (planner.per_position_alpha)
            "drafts": drafts, "drafted": drafted, "accepted": accepted,
            "mean_depth": round(depth_sum / depth_count, 2) if depth_count else 0.0,
            "bypassed": round(bypassed / rounds, 3) if rounds else None,
            "pairs": {v: round(a, 4) for v in stages[stages.index(name) + 1:]
                      if (a := _pair_alpha(delta, after, name, v)) is not None},
        }
    return out


def mean_context(delta: dict, max_tokens: int) -> float:
    """The mean prompt of the level's finished requests plus half a completion."""
    requests = _total(delta, "cascade_request_success_total")
    prompts = _total(delta, "cascade_prompt_tokens_total")
    return (prompts / requests if requests else 0.0) + max_tokens / 2


def stand_ins(config: CascadeConfig) -> list[str]:
    """The models the stages stand for, bottom first (``ngram`` for the n-gram drafter)."""
    return [s.emulate.model if isinstance(s, HFStageConfig) else NGRAM for s in config.stages]


def planner_prediction(config: CascadeConfig, controller: dict, context: float, concurrency: int,
                       max_tokens: int) -> dict:
    """The planner's adaptive choice and rate at this level, from what the level measured: the acceptance of each
    pair of stages (a drafter's by the verifier above it; where that pair verified too few of its drafts, the
    drafter's by whichever stage verified them), the mean prompt, and under the n-gram shortcut the share of rounds
    it found a continuation in (its rounds not bypassed). A pair the controller never ran keeps the drafter's
    acceptance by another verifier (at T = 0.8 and one client, the 1B's drafts checked by the 8B read α 0.81, where
    the 70B accepted them at 0.74–0.76 at other levels; the planner put the 1B drafting for the 70B at 83 tokens/s,
    and it had run at 64)."""
    models = stand_ins(config)
    names = [s.name for s in config.stages]
    measured = {i: controller[n]["alpha"] for i, n in enumerate(names[:-1])}
    alphas = {i: (a if a is not None else 0.0) for i, a in measured.items()}
    pairs = {(i, j): controller[names[i]].get("pairs", {}).get(names[j], alphas[i])
             for i in alphas for j in range(i + 1, len(names))}
    device = config.target.emulate.device
    gpus = [s.emulate.gpus if isinstance(s, HFStageConfig) else 1 for s in config.stages]
    hits = None
    if getattr(config.stages[0], "shortcut", False) and len(names) > 2:
        bypassed = controller[names[0]]["bypassed"]
        hits = 1.0 - bypassed if bypassed is not None else 0.0
    rows = predict(device, models, [alphas[i] for i in range(len(names) - 1)], [concurrency], context=context,
                   gpus=gpus, pairs=pairs, max_depth=config.controller.max_depth, prompt=context - max_tokens / 2,
                   output=max_tokens, lookup_hits=hits)
    adaptive = next(p for p in rows if p.method == "adaptive")
    alone = next(p for p in rows if p.method == "target alone")
    chain = [names[models.index(m)] if m != NGRAM else NGRAM for m in adaptive.chain]
    return {"chain": chain, "depths": list(adaptive.depths), "tokens_per_second": round(adaptive.tokens_per_second, 1),
            "target_alone_tokens_per_second": round(alone.tokens_per_second, 1)}


def replan(config: CascadeConfig, rows, max_tokens: int) -> None:
    """The planner's predictions of every emulated row again, from the figures the run recorded (its measured
    acceptance, lookups and context; never its measured rates), with the planner as it is now."""
    depths = {s.name: s.depth for s in config.stages}
    for row in rows:
        if row.emulation:
            system = config if row.system == "cascade" else target_only(config)
            e = row.emulation
            for name, c in e["controller"].items():
                if "alpha" not in c:  # recorded before the bench counted drafts: their mean depth stands in
                    depth = c["mean_depth"] or depths[name]
                    c["alpha"] = None if c["acceptance"] is None else per_position_alpha(c["acceptance"] * depth,
                                                                                        depth, 1.0)
            e["planner"] = planner_prediction(system, e["controller"], e["mean_context"], row.concurrency, max_tokens)


def target_only(config: CascadeConfig) -> CascadeConfig:
    data = config.model_dump()
    data["stages"] = [config.target.model_dump()]
    data["controller"] = {"mode": "fixed"}
    return CascadeConfig.model_validate(data)


def decisions_table(rows) -> str:
    """Where the controller lowered depths or switched speculation off, beside the planner's prediction. The planner
    predicts the rate with every client's request in flight, so its error is against the level's sustained rate
    (against the whole level's in a row from before the bench measured it)."""
    lines = [
        "| T | clients | measured tok/s (Cascade; target alone) | sustained tok/s (Cascade; target alone) "
        "| planner tok/s (Cascade; target alone) | error (against sustained) "
        "| controller: mean depth (bypassed share) per stage | planner's plan | real-compute share max | host share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_level = defaultdict(dict)
    for r in rows:
        if r.emulation:
            by_level[(r.temperature, r.concurrency)][r.system] = r
    for (t, c), systems in sorted(by_level.items()):
        cas, tgt = systems.get("cascade"), systems.get("target")
        if cas is None or tgt is None:
            continue
        plan = cas.emulation["planner"]
        predicted = {"cascade": plan["tokens_per_second"],
                     "target": tgt.emulation["planner"]["target_alone_tokens_per_second"]}
        errors = [f"{100 * (sustained(r) / predicted[r.system] - 1):+.0f}%" for r in (cas, tgt) if predicted[r.system]]
        stages = ", ".join(f"{n} {v['mean_depth']:.1f} ({v['bypassed']:.0%})" for n, v in cas.emulation["controller"].items()
                           if v["bypassed"] is not None)
        share = max([*cas.emulation["real_share"].values(), *tgt.emulation["real_share"].values()], default=0.0)
        lines.append(
            f"| {t:g} | {c} | {cas.tokens_per_second:.0f}; {tgt.tokens_per_second:.0f} | {sustained(cas):.0f}; "
            f"{sustained(tgt):.0f} | {predicted['cascade']:.0f}; {predicted['target']:.0f} | {'; '.join(errors)} | "
            f"{stages} | "
            f"{'+'.join(plan['chain'])} @ {','.join(map(str, plan['depths'])) or '-'} | {share:.0%} | "
            f"{cas.emulation['host_share']:.0%}; {tgt.emulation['host_share']:.0%} |"
        )
    return "\n".join(lines)


def sustained(row) -> float:
    """A row's sustained rate (every client's request in flight), or its whole level's where it has none."""
    return row.sustained_tokens_per_second or row.tokens_per_second
