"""Each request's plan for a step: the chain and depths of its round, and the draft it already has.

The n-gram shortcut looks first (its lookup is free): a found continuation drafts straight for the target. The
rest are the models' rounds, which the adaptive controller plans for the step's load (``cascade.controller``), or the
fixed plan."""

from __future__ import annotations

from collections.abc import Sequence

from cascade.controller import Plan
from cascade.controller.lookups import LookupValue
from cascade.engine.passes import StagePasses
from cascade.engine.request import Request
from cascade.verify import Draft


class StepPlanner:
    """Plans a step's rounds. ``fixed_plan``: every stage at its configured depth (the plan without a controller);
    ``shortcut``: the bottom stage is the n-gram drafter, whose found continuations go straight to the target."""

    def __init__(self, passes: StagePasses, fixed_plan: Plan, shortcut: bool):
        self.passes = passes
        self.fixed_plan = fixed_plan
        self.shortcut = shortcut
        self.without_bottom = Plan(fixed_plan.chain[1:], fixed_plan.depths[1:], 0.0)  # the models' rounds

    def plans(self, ready: Sequence[Request]) -> dict[Request, tuple[Plan, Draft | None]]:
        """Each request's chain and depths for this step, and the draft it already has: the one the pipelined mode
        drafted ahead for it (with the plan that drafted it), or the n-gram continuation the shortcut found (None when
        it has none).

        With the shortcut, the n-gram drafter's lookup is free, so look first: a found continuation drafts straight
        for the target this round (the models between would only re-check it). Under the adaptive controller it is
        drafted as deep as pays and taken only while steps that verified such drafts are observed faster at this
        load than steps that verified none (``AdaptiveController.take_lookup``) and while the step's found
        continuations together gain more tokens than the seconds they add to the step are worth
        (``AdaptiveController.lookup_value``: under load every request of the step waits for the extra positions).
        Rounds without one are the models': the adaptive controller plans (and explores) only those, among the
        chains without the n-gram drafter; a fixed plan loses its bottom stage. Any chain per round keeps the output
        exact.
        """
        kept = {r: r.ahead for r in ready if r.ahead is not None and r.ahead.at == r.length}
        for request in ready:
            request.ahead = None
        found = self._found(ready)
        target = self.passes.target
        plans: dict[Request, tuple[Plan, Draft | None]] = {}
        for request in ready:
            if request in found:  # (before a draft made ahead: a match is often right for many tokens)
                plans[request] = Plan((0, target), (len(found[request]),), 0.0), Draft(found[request], None)
            elif request in kept:  # the pipelined mode drafted this round while the target verified the last
                plans[request] = kept[request].plan, kept[request].draft
            elif request.controller is not None:
                plans[request] = request.controller.decide(len(ready)), None
            else:
                plans[request] = (self.without_bottom if self.shortcut else self.fixed_plan), None
        return plans

    def _found(self, ready: Sequence[Request]) -> dict[Request, list[int]]:
        """The continuations the shortcut finds and takes this step, per request (none without the shortcut)."""
        batch, tokens = len(ready), sum(r.width for r in ready)
        depths: dict[Request, int] = {}  # how deep to look, per request that looks
        values: dict[Request, LookupValue] = {}  # what each found continuation is worth, where that decides
        take: dict[str, bool] = {}  # per regime: whether this step looks (the same for all its requests)
        for request in ready if self.shortcut else ():
            controller = request.controller
            if controller is None:
                depths[request] = self.fixed_plan.depths[0]
                continue
            if request.regime not in take:
                take[request.regime] = controller.take_lookup(batch)
            if take[request.regime]:
                value = controller.lookup_value(batch, tokens)
                depths[request] = value.depth
                if not value.probe:
                    values[request] = value
        # A continuation gains at most its value's best, G(depth). Where the step's best gains together cannot pay
        # for verifying at all, every one found would be declined below, so none is looked for (a lookup costs
        # ~10 us of a ~2 ms step at one client: at temperature 0.8 on the demo family, over half of those steps).
        # A check of found continuations takes them whatever they are worth (LookupValue.probe, not in ``values``):
        # otherwise a stale estimate of their acceptance would decline every one, and the check would never see them.
        if values and sum(v.gain(v.depth) for v in values.values() if v.depth) <= min(v.threshold for v in values.values()):
            depths.update(dict.fromkeys(values, 0))
        found: dict[Request, list[int]] = {}
        for request, depth in depths.items():
            draft = self.passes.lookup(0, request, request.context, depth) if depth else []
            if draft:
                found[request] = draft
        gains = {r: v.gain(len(found[r])) for r, v in values.items() if r in found}
        if gains:
            threshold = max(values[r].threshold for r in gains)
            worth = sum(g for g in gains.values() if g > 0) > threshold
            for request, gain in gains.items():
                if not worth or gain <= 0:
                    del found[request]
        return found

    def backlog(self, ready: Sequence[Request], regime: str) -> list[int]:
        """Per stage, the tokens of the contexts of ``ready``'s requests of ``regime`` it has not read (model drafters
        only; 0 for the rest)."""
        requests = [r for r in ready if r.regime == regime]
        backlog = [0] * len(self.passes.stages)
        for index, stage in enumerate(self.passes.stages[:-1]):
            if self.passes.is_model[index]:
                backlog[index] = sum(max(r.length - stage.cached_tokens(r.seq_id), 0) for r in requests)
        return backlog
