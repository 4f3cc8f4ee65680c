"""Running methods side by side: warm-up, then interleaved repeats (A B C A B C ...) so machine drift cancels."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from cascade.bench.methods import Method


@dataclass(frozen=True, slots=True)
class Measurement:
    method: str
    prompt: int  # index into the prompt list
    repeat: int
    tokens: int
    seconds: float
    stats: dict | None  # Cascade's per-request statistics


# How far apart two of the target's logits may be for a divergence between them to count as numerical (a near-tie):
# the target scoring k + 1 positions in one pass is not bit-identical to its one-token decode, and a batched pass not
# to an unbatched one (DESIGN.md, "Numerics"). Absolute logit gaps, per dtype of the target's logits: float64 agrees
# to ~1e-12; float32 drifts by ~1e-5 over a forward pass (1e-3 leaves a wide margin); bfloat16 keeps 8 bits of
# mantissa, so logits of magnitude ~10 are only resolved to ~0.06 and drift by a few of those steps.
NEAR_TIE = {"torch.float64": 1e-8, "torch.float32": 1e-3, "torch.float16": 0.25, "torch.bfloat16": 0.25}


@dataclass(frozen=True, slots=True)
class Mismatch:
    method: str
    prompt: int
    repeat: int
    first_difference: int  # index of the first generated token that differs from the target's
    expected: list[int]
    got: list[int]
    kind: str = "failure"  # "numerical": it began at a near-tie of the target's logits (NEAR_TIE); else a bug
    logit_gap: float | None = None  # the target's logit of its own token minus that of the other, where they diverge


def classify(logits: torch.Tensor, expected: int, got: int) -> tuple[str, float]:
    """Whether a greedy divergence where the target's own decode chose ``expected`` and a cascade ``got`` is
    numerical (the two logits within ``NEAR_TIE`` of the logits' dtype) or a failure. logits: [vocab], the
    target's at that position."""
    gap = float(logits[expected].double() - logits[got].double())
    return ("numerical" if abs(gap) <= NEAR_TIE.get(str(logits.dtype), 1e-3) else "failure"), gap


@dataclass(slots=True)
class BenchResult:
    measurements: list[Measurement] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "measurements": [asdict(m) for m in self.measurements],
            "mismatches": [asdict(m) for m in self.mismatches],
        }


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_benchmark(
    methods: Sequence[Method],
    prompts: Sequence[list[int]],
    *,
    max_tokens: int,
    temperature: float,
    repeats: int,
    warmup_tokens: int = 8,
    progress: bool = True,
    target_logits: Callable[[list[int]], torch.Tensor] | None = None,
) -> BenchResult:
    """Every method on every prompt, ``repeats`` times, interleaved. Greedy outputs are checked against the
    first method's (the target alone) and any difference is recorded as a mismatch; with ``target_logits`` (the
    target's next-token logits after a context), one that begins at a near-tie of those logits is classified as
    numerical, any other as a failure."""
    result = BenchResult()
    for method in tqdm(methods, desc="warm-up", unit="method", disable=not progress, leave=False):
        method.generate(prompts[0], warmup_tokens, temperature, seed=0)
    reference: dict[int, list[int]] = {}
    bar = tqdm(total=repeats * len(prompts) * len(methods), desc="bench", unit="run", disable=not progress)
    for repeat in range(repeats):
        for p, prompt in enumerate(prompts):
            for method in methods:
                seed = 1000 * repeat + p  # every method sees the same seed for the same prompt and repeat
                run = method.generate(prompt, max_tokens, temperature, seed)
                result.measurements.append(Measurement(method.name, p, repeat, len(run.token_ids), run.seconds, run.stats))
                if temperature == 0:
                    expected = reference.setdefault(p, run.token_ids)
                    if run.token_ids != expected:
                        at = _first_difference(expected, run.token_ids)
                        kind, gap = "failure", None
                        if target_logits is not None and at < min(len(expected), len(run.token_ids)):
                            kind, gap = classify(target_logits([*prompt, *expected[:at]]), expected[at], run.token_ids[at])
                        result.mismatches.append(Mismatch(method.name, p, repeat, at, expected, run.token_ids, kind, gap))
                bar.update()
                bar.set_postfix_str(method.name, refresh=False)
    bar.close()
    return result


@dataclass(frozen=True, slots=True)
class MethodSummary:
    method: str
    tokens_per_second: float  # median over repeats of (all tokens / all seconds) of that repeat
    tokens_per_second_spread: tuple[float, float]  # (min, max) over repeats
    speedup: float  # median over repeats of this method's throughput / the baseline's in the same repeat
    speedup_spread: tuple[float, float]
    stages: dict[str, dict]  # per stage: acceptance_rate, mean_accepted, accepted_by_position, time_share
    tokens_per_target_pass: float | None = None  # tokens generated over the target's forward passes (its prompt's
    # first pass included): what speculation gets out of each pass of the target (None: transformers' methods)


def _throughputs(measurements: list[Measurement], method: str, repeats: int) -> list[float]:
    out = []
    for r in range(repeats):
        ms = [m for m in measurements if m.method == method and m.repeat == r]
        out.append(sum(m.tokens for m in ms) / max(1e-12, sum(m.seconds for m in ms)))
    return out


def _stage_summary(measurements: list[Measurement]) -> dict[str, dict]:
    stats = [m.stats for m in measurements if m.stats]
    if not stats:
        return {}
    total_seconds = sum(m.seconds for m in measurements)
    out = {}
    for name in stats[0]["stages"]:
        rows = [s["stages"][name] for s in stats]
        drafted, accepted, drafts = (sum(r[k] for r in rows) for k in ("drafted", "accepted", "drafts"))
        width = max((len(r["accepted_by_position"]) for r in rows), default=0)
        by_position = [sum(r["accepted_by_position"][j] for r in rows if j < len(r["accepted_by_position"])) for j in range(width)]
        out[name] = {
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted": accepted / drafts if drafts else None,
            "accepted_by_position": [a / drafts for a in by_position] if drafts else [],
            "time_share": sum(r["forward_seconds"] for r in rows) / total_seconds if total_seconds else 0.0,
        }
    return out


def _per_target_pass(measurements: list[Measurement]) -> float | None:
    stats = [(m.tokens, m.stats) for m in measurements if m.stats]
    if not stats:
        return None
    passes = sum(list(s["stages"].values())[-1]["forward_passes"] for _, s in stats)  # (the target is the last)
    return sum(tokens for tokens, _ in stats) / passes if passes else None


def summarize(result: BenchResult, methods: Sequence[str], baseline: str, repeats: int) -> list[MethodSummary]:
    base = _throughputs(result.measurements, baseline, repeats)
    summaries = []
    for name in methods:
        tps = _throughputs(result.measurements, name, repeats)
        ratios = [t / b for t, b in zip(tps, base)]
        summaries.append(
            MethodSummary(
                method=name,
                tokens_per_second=statistics.median(tps),
                tokens_per_second_spread=(min(tps), max(tps)),
                speedup=statistics.median(ratios),
                speedup_spread=(min(ratios), max(ratios)),
                stages=_stage_summary([m for m in result.measurements if m.method == name]),
                tokens_per_target_pass=_per_target_pass([m for m in result.measurements if m.method == name]),
            )
        )
    return summaries
