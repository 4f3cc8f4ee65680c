"""What a found n-gram continuation, drafted straight for the target, is worth to a step: pure functions of the
plan a round would otherwise run, the target's cost curves and the batch.

A continuation replaces the request's own round of its plan, and the rest of the step runs anyway, so it is judged
at the margin: drafting ``d`` tokens gains E(α_L, d) − E_plan tokens (α_L the n-gram drafter's acceptance given a
match, E_plan what the request's round would commit: its plan as the engine's observed steps let it run), and
changes the step's seconds by c(T − w + d + 1) − c(T) − S: the target verifies d + 1 positions for the request in
place of the plan's w (k + 1, or 1 for the target alone) within the step's T, and the plan's drafters no longer
draft for it, which saves S = T_draft(B) − T_draft(B − 1), T_draft(b) the drafting time of the plan's round at b
requests (its predicted round time less the target's pass; T_draft(0) = 0). Those seconds are worth R·(1 + m)
tokens each, R = max(R_B(plan), R_B(target alone)) the batch's predicted rate and m the ``speculation_margin``. The
best depth maximises

    G(d) = E(α_L, d) − E_plan − (1 + m)·R·(c(T − w + d + 1) − c(T) − S),

and a step whose requests would otherwise only decode also pays once for verifying at all, (1 + m)·R·(c(T) − ĉ(T))
tokens, which the found continuations of the step must gain together (``threshold``). At one request S is the whole
drafting time, and this is the rule R(lookup) > R(plan) with the margin on the seconds: a continuation found for a
lone request skips its drafters' passes. Under load a request's share of a batched drafter pass is small, while a
continuation's extra positions delay every request of the step, which a per-request rate (its tokens over the step's
seconds) does not see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cascade.controller.model import Plan, expected_tokens


@dataclass(frozen=True, slots=True)
class LookupValue:
    """What found n-gram continuations are worth in a step (:meth:`AdaptiveController.lookup_value`)."""

    depth: int  # the most tokens worth drafting (0: none)
    alpha: float  # α_L: acceptance of the n-gram drafter's tokens by the target, given a match
    base: float  # E_plan: tokens the request's own plan would commit this round
    rate: float  # (1 + m)·R: tokens a second of the step is worth
    extra: tuple[float, ...]  # c(T − w + d + 1) − c(T) − S: seconds a continuation of d tokens adds to the step
    threshold: float  # tokens the step's continuations must gain together to pay for verifying at all
    probe: bool = False  # a check of found continuations runs: one found is verified whatever its value

    def gain(self, drafted: int) -> float:
        """G(d): tokens a continuation of ``drafted`` tokens is expected to gain, net of the seconds it adds."""
        return expected_tokens(self.alpha, drafted) - self.base - self.rate * self.extra[drafted]


Curve = Callable[[int], float]  # c(t): the seconds of a forward pass over t new tokens (a CostFit)


def drafting_seconds(plan: Plan, batch: int, alpha: float, verifying: Curve) -> float:
    """T_draft(B): the seconds of a step of ``batch`` requests running ``plan`` (α its top pair's acceptance,
    ``verifying`` the target's curve) that are not the target's pass — the step's predicted time B·E_plan / R_B less
    c(B·(k + 1))."""
    step = batch * expected_tokens(alpha, plan.depths[-1]) / plan.throughput
    return max(step - verifying(batch * (plan.depths[-1] + 1)), 0.0)


def step_terms(
    current: Plan, alone: Plan, lighter: Plan | None, alpha: float, batch: int, tokens: int, verifying: Curve,
    decoding: Curve, max_depth: int, margin: float,
) -> LookupValue:
    """What every request of a step weighs a continuation against (E_plan, (1 + m)·R, the seconds
    c(T − w + d + 1) − c(T) − S for d = 0 .. ``max_depth``, the threshold), with α and depth left to the request.
    ``current``: the plan a round runs, predicted for ``batch`` requests; ``alone``: the target alone's; ``lighter``:
    ``current``'s chain predicted for ``batch − 1`` requests (None at one request, or where ``current`` does not
    draft faster than ``alone``); ``alpha``: ``current``'s top pair's acceptance; ``tokens``: T, the positions the
    step's target pass verifies; ``verifying``, ``decoding``: the target's curves c and ĉ; ``margin``: m."""
    rate = max(current.throughput, alone.throughput) * (1.0 + margin)
    width, saved, jump = 1, 0.0, 0.0
    if len(current.chain) > 1 and current.throughput > alone.throughput:
        base = expected_tokens(alpha, current.depths[-1])
        width = current.depths[-1] + 1
        saved = drafting_seconds(current, batch, alpha, verifying)
        if lighter is not None:
            saved = max(saved - drafting_seconds(lighter, batch - 1, alpha, verifying), 0.0)
    else:
        base, jump = 1.0, max(verifying(tokens) - decoding(tokens), 0.0)
    here = verifying(tokens)
    others = max(tokens - width, 0)  # the step's positions other than the request's own
    extra = tuple(verifying(others + d + 1) - here - saved for d in range(max_depth + 1))
    return LookupValue(max_depth, 0.0, base, rate, extra, rate * jump)
