"""What a chain will do on a device before anyone rents it: the controller's throughput model
(:mod:`cascade.controller.model`) fed the roofline's pass times (:mod:`cascade.emulation.roofline`) in place of
measured ones (``cascade plan``).

For ``B`` concurrent requests with contexts of ``C`` tokens, stage ``i``'s cost curve over a step's ``t`` new tokens
is ``c_i(t) = pass_seconds(model_i, device, B rows of t/B new tokens after C)``; the plans are the controller's
(:func:`~cascade.controller.model.plan_chain`), so a prediction is what the adaptive controller would choose if its
measured costs were the model's. A request's inter-token latency is ``B / R_B``. Acceptance is per pair of stages;
a pair that skips stages between (a bypass) defaults to the product of the acceptances along the way — an
assumption, which ``pairs`` overrides with measured values.

Two refinements make a prediction comparable with a served rate:

- **Prefill.** Each request first prefills its ``prompt`` tokens (the target, and each model drafter of the chain
  when it first drafts), then generates ``output`` tokens. For a batch of ``B`` the rate is
  ``B·N / (B·N / R_B + T_fill)``, ``T_fill`` the passes over ``B`` rows of ``P`` new tokens.
- **The n-gram shortcut.** Where the n-gram drafter finds a continuation (each request's round, independently, with
  probability ``h``) it drafts straight for the target; the other rounds run the best plan without it. The rounds
  of a step share it: with ``H`` of its ``B`` requests' continuations found, a step commits ``H·E_n + (B − H)·E_p``
  tokens in ``L + D(B − H) + c_T(H·(d_n + 1) + (B − H)·w_p)`` seconds — the lookups ``L``, the plan's drafting
  for the other ``B − H`` requests (``D(b)``: its round at ``b`` requests less the target's pass; ``D(0) = 0``) and
  one target pass over every position (``w_p`` = k + 1, or 1 for the target alone). The rate is the ratio of the
  expectations over ``H ~ Binomial(B, h)``. At one request that is the mixture of rounds
  ``(h·E_n + (1 − h)·E_p) / (h·T_n + (1 − h)·T_p)``; under load nearly every step pays for the drafting (at
  ``h`` = 0.54 and 4 requests, 92% of steps), which a mixture of rounds put at a share ``1 − h`` of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cascade.controller.model import Plan, best_plan, candidate_chains, expected_tokens, plan_chain
from cascade.emulation.profiles import device as device_profile
from cascade.emulation.profiles import model as model_shape
from cascade.emulation.roofline import pass_seconds, uniform_rows

NGRAM = "ngram"
LOOKUP_SECONDS = 5e-5  # one n-gram lookup on the host (measured here: tens of microseconds)


@dataclass(frozen=True, slots=True)
class Prediction:
    """One method at one concurrency: the chain (names, bottom first), its depths, tokens/s and inter-token latency."""

    concurrency: int
    method: str  # "target alone", "fixed", "best <chain>", "adaptive"
    chain: tuple[str, ...]
    depths: tuple[int, ...]
    tokens_per_second: float
    itl_seconds: float

    def to_dict(self) -> dict:
        return {
            "concurrency": self.concurrency, "method": self.method, "chain": list(self.chain),
            "depths": list(self.depths), "tokens_per_second": round(self.tokens_per_second, 3),
            "itl_seconds": round(self.itl_seconds, 6),
        }


def cost_curves(
    models: Sequence[str], device: str, batch: int, context: float, gpus: Sequence[int] | None = None
) -> list:
    """``c_i(t)`` for each stage of ``models`` (an n-gram drafter costs one host lookup)."""
    profile = device_profile(device)
    gpus = list(gpus) if gpus is not None else [1] * len(models)
    curves = []
    for name, g in zip(models, gpus):
        if name == NGRAM:
            curves.append(lambda t: LOOKUP_SECONDS)
            continue
        shape = model_shape(name)
        curves.append(
            lambda t, shape=shape, g=g: pass_seconds(shape, profile, uniform_rows(batch, t / batch, context), gpus=g)
        )
    return curves


def per_position_alpha(accepted: float, drafted: float, drafts: float) -> float | None:
    """The i.i.d. per-position acceptance α behind counters of a stage's drafts: a draft of depth k accepts
    Σ_{j=1..k} α^j tokens in expectation (its first rejection ends it), so accepted / drafted is not α (at α = 0.8 and
    depth 7 it reads 0.45). Solved by bisection for the drafts' mean depth (drafted / drafts); None without drafts."""
    if drafts <= 0 or drafted <= 0:
        return None
    depth, mean = drafted / drafts, accepted / drafts

    def accepted_at(a: float) -> float:
        whole = int(depth)  # a fractional mean depth: the last position counts its share
        return sum(a ** j for j in range(1, whole + 1)) + (depth - whole) * a ** (whole + 1)

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accepted_at(mid) < mean else (lo, mid)
    return (lo + hi) / 2


def pair_alpha(edges: Sequence[float], pairs: Mapping[tuple[int, int], float] | None = None):
    """α between stages i < j: ``pairs[(i, j)]`` where given, else the product of the adjacent edges' α."""
    pairs = dict(pairs or {})

    def alpha(i: int, j: int) -> float:
        if (i, j) in pairs:
            return pairs[(i, j)]
        product = 1.0
        for e in range(i, j):
            product *= edges[e]
        return product

    return alpha


def fixed_rate(chain: Sequence[int], depths: Sequence[int], alpha, costs, model_free, batch: int) -> float:
    """Tokens/s of a chain at fixed depths (``depths[p]``: what chain[p] drafts per round), the bottom-up recursion
    of :mod:`cascade.controller.model` without the minimisation."""
    if len(chain) == 1:
        return batch / costs[chain[0]](batch)
    bottom = chain[0]
    unit = costs[bottom](batch)

    def time_of(k: int, model_free=model_free[bottom]) -> float:
        return unit if model_free else k * unit

    for p in range(1, len(chain) - 1):
        d = depths[p - 1]
        per_token = (time_of(d) + costs[chain[p]](batch * (d + 1))) / expected_tokens(alpha(chain[p - 1], chain[p]), d)

        def time_of(k: int, per_token=per_token) -> float:
            return k * per_token

    k = depths[-1]
    a = alpha(chain[-2], chain[-1])
    return batch * expected_tokens(a, k) / (time_of(k) + costs[chain[-1]](batch * (k + 1)))


def with_shortcut(lookup: Plan, rest: Plan, hits: float, alpha, batch: int, curves_at, model_free) -> Plan:
    """The steps of the module docstring: each of ``batch`` requests' rounds runs ``lookup`` (n-gram -> target) with
    probability ``hits``, else ``rest``; ``curves_at(b)``: the stages' cost curves at ``b`` requests. The plan reported
    is ``rest`` with the steps' rate."""
    target = lookup.chain[-1]
    costs = curves_at(batch)
    e_n, w_n = expected_tokens(alpha(lookup.chain[0], target), lookup.depths[-1]), lookup.depths[-1] + 1
    drafts = len(rest.chain) > 1
    e_p = expected_tokens(alpha(rest.chain[-2], target), rest.depths[-1]) if drafts else 1.0
    w_p = rest.depths[-1] + 1 if drafts else 1

    def drafting(b: int) -> float:  # D(b)
        if b == 0 or not drafts:
            return 0.0
        at = curves_at(b)
        step = b * e_p / fixed_rate(rest.chain, rest.depths, alpha, at, model_free, b)
        return max(step - at[target](b * w_p), 0.0)

    tokens = seconds = 0.0
    for found in range(batch + 1):
        p = math.comb(batch, found) * hits ** found * (1.0 - hits) ** (batch - found)
        if p == 0.0:
            continue
        tokens += p * (found * e_n + (batch - found) * e_p)
        lookups = costs[lookup.chain[0]](batch) if found else 0.0
        seconds += p * (lookups + drafting(batch - found) + costs[target](found * w_n + (batch - found) * w_p))
    return Plan(rest.chain, rest.depths, tokens / seconds)


def _with_prefill(plan: Plan, costs_fill, model_free, batch: int, prompt: float, output: float) -> float:
    """Tokens/s with each request's prefill of ``prompt`` tokens per ``output`` tokens generated."""
    if prompt <= 0:
        return plan.throughput
    fill = sum(costs_fill[i] for i in plan.chain if not model_free[i])
    return batch * output / (batch * output / plan.throughput + fill)


def predict(
    device: str, models: Sequence[str], edges: Sequence[float], concurrencies: Sequence[int], *, context: float = 512,
    max_depth: int = 8, depths: Sequence[int] | None = None, gpus: Sequence[int] | None = None,
    pairs: Mapping[tuple[int, int], float] | None = None, prompt: float = 0.0, output: float = 128.0,
    lookup_hits: float | None = None,
) -> list[Prediction]:
    """For each concurrency: the target alone, the full chain at ``depths`` (if given), each chain at its best depths,
    and the adaptive default (the best plan over every chain, the target alone included). ``prompt`` (> 0): rates
    include each request's prefill of that many tokens per ``output`` generated; ``lookup_hits``: the share of
    rounds where an n-gram drafter at the bottom finds a continuation under the shortcut (None: no shortcut), for the
    adaptive default (module docstring)."""
    if len(edges) != len(models) - 1:
        raise ValueError(f"need one acceptance per pair of adjacent stages ({len(models) - 1}), got {len(edges)}")
    if any(not 0.0 <= a <= 1.0 for a in edges):
        raise ValueError(f"acceptance rates must be in [0, 1], got {list(edges)}")
    if NGRAM in models[1:]:
        raise ValueError("an n-gram drafter can only be the first stage")
    if depths is not None and len(depths) != len(models) - 1:
        raise ValueError(f"need one depth per drafting stage ({len(models) - 1}), got {len(depths)}")
    if lookup_hits is not None and (models[0] != NGRAM or not 0.0 <= lookup_hits <= 1.0):
        raise ValueError(f"lookup_hits needs an n-gram drafter first and a share in [0, 1], got {lookup_hits!r}")
    alpha = pair_alpha(edges, pairs)
    model_free = [m == NGRAM for m in models]
    out = []
    for batch in concurrencies:
        costs = cost_curves(models, device, batch, context, gpus)
        fill = [0.0 if m == NGRAM else cost_curves([m], device, batch, prompt / 2, [g])[0](batch * prompt)
                for m, g in zip(models, gpus or [1] * len(models))] if prompt > 0 else []

        def named(plan: Plan, method: str) -> Prediction:
            rate = _with_prefill(plan, fill, model_free, batch, prompt, output)
            return Prediction(
                batch, method, tuple(models[i] for i in plan.chain), plan.depths, rate, batch / plan.throughput,
            )

        target = len(models) - 1
        out.append(named(Plan((target,), (), batch / costs[target](batch)), "target alone"))
        if depths is not None:
            chain = tuple(range(len(models)))
            rate = fixed_rate(chain, depths, alpha, costs, model_free, batch)
            out.append(named(Plan(chain, tuple(depths), rate), "fixed"))
        for chain in candidate_chains(len(models)):
            if len(chain) == 1:
                continue
            alphas = [0.0] + [alpha(chain[p - 1], chain[p]) for p in range(1, len(chain))]
            plan = plan_chain(chain, alphas, costs, model_free, max_depth, batch)
            out.append(named(plan, "best " + "+".join(models[i] for i in chain)))
        if lookup_hits is None:
            out.append(named(best_plan(alpha, costs, model_free, max_depth, batch=batch), "adaptive"))
            continue
        others = [c for c in candidate_chains(len(models)) if c[0] != 0]
        rest = best_plan(alpha, costs, model_free, max_depth, chains=others, batch=batch)
        target = len(models) - 1
        lookup = plan_chain((0, target), [0.0, alpha(0, target)], costs, model_free, max_depth, batch)
        curves_at = (lambda b: costs if b == batch else cost_curves(models, device, b, context, gpus))
        out.append(named(with_shortcut(lookup, rest, lookup_hits, alpha, batch, curves_at, model_free), "adaptive"))
    return out
