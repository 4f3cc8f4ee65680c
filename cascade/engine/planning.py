"""Each request's plan for a step: the chain and depths of its round, and the draft it already has.

Under the adaptive controller the plans are its (:meth:`cascade.controller.step.StepController.plan`, given how to
look a context up and how to count what the drafters have not read); without one, every round runs the configured
plan, and with the n-gram shortcut a found continuation drafts straight for the target. Either way a round the
pipelined mode drafted ahead for verifies that draft (unless a continuation was found)."""

from __future__ import annotations

from collections.abc import Sequence

from cascade.controller import Plan
from cascade.controller.step import StepController, StepPlan, drafts_for_target
from cascade.engine.passes import StagePasses
from cascade.engine.request import Request
from cascade.verify import Draft


class StepPlanner:
    """Plans a step's rounds. ``fixed_plan``: every stage at its configured depth (the plan without a controller);
    ``shortcut``: the bottom stage is the n-gram drafter, whose found continuations go straight to the target;
    ``pipelined``: the engine can draft ahead."""

    def __init__(self, passes: StagePasses, fixed_plan: Plan, shortcut: bool, controller: StepController | None,
                 pipelined: bool, siblings: int = 0):
        self.passes = passes
        self.fixed_plan = fixed_plan
        self.shortcut = shortcut
        self.controller = controller
        self.pipelined = pipelined
        self.without_bottom = Plan(fixed_plan.chain[1:], fixed_plan.depths[1:], 0.0)  # the models' rounds
        self.model_free = [not m for m in passes.is_model]
        self.siblings = siblings if shortcut else 0  # the n-gram drafter's other continuations, as branches of its
        # found ones (0: chains)
        self._found: dict[Request, Draft] = {}  # this step's found continuations that are trees

    def plans(self, ready: Sequence[Request]) -> tuple[StepPlan, dict[Request, Draft]]:
        """The step's plan, and per request the draft its round starts from: a found n-gram continuation, or the
        draft the pipelined mode made ahead for it (the others have none)."""
        kept = {r: r.ahead for r in ready if r.ahead is not None and r.ahead.at == r.length}
        for request in ready:
            request.ahead = None
        if self.controller is not None:
            step = self.controller.plan(
                ready, {r: a.plan for r, a in kept.items()}, self._lookup, lambda regime: self.backlog(ready, regime),
                self.pipelined,
            )
        else:
            step = self._fixed(ready, kept)
        drafts = {r: self._found_draft(r, found, step) for r, (_, found) in step.rounds.items() if found is not None}
        self._found.clear()
        for request in step.kept:  # (a found continuation, looked up first, may take a round's place)
            drafts[request] = kept[request].draft
            request.stats.kept_ahead += 1
            request.stats.kept_ahead_rejected += kept[request].rejected
        return step, drafts

    def _fixed(self, ready: Sequence[Request], kept: dict) -> StepPlan:
        """Every round at the configured plan: the shortcut's found continuations first (at the bottom stage's
        depth), then the drafts made ahead, the others without the n-gram drafter under the shortcut."""
        target = self.passes.target
        rounds: dict[Request, tuple[Plan, list[int] | None]] = {}
        for request in ready:
            found = self._lookup(request, self.fixed_plan.depths[0]) if self.shortcut else []
            if found:
                rounds[request] = Plan((0, target), (len(found),), 0.0), found
            elif request in kept:
                rounds[request] = kept[request].plan, None
            else:
                rounds[request] = (self.without_bottom if self.shortcut else self.fixed_plan), None
        ahead = self.pipelined and any(drafts_for_target(p, self.model_free) for p, _ in rounds.values())
        return StepPlan(rounds, True if ahead else None, frozenset(r for r in kept if rounds[r][1] is None))

    def _lookup(self, request: Request, depth: int) -> list[int]:
        """The found continuation's tokens; with trees, its draft (its other continuations as branches) is kept for
        :meth:`plans`, which uses them if the step's trees are on."""
        branches = self.siblings if request.takes_trees else 0
        draft = self.passes.lookup(0, request, request.context, depth, branches)
        if draft.branches:
            self._found[request] = draft
        return draft.tokens

    def _found_draft(self, request: Request, found: list[int], step: StepPlan) -> Draft:
        draft = self._found.get(request)
        treed = step.trees is None or (0, len(self.passes.stages) - 1) in step.trees.get(request.regime, ())
        if draft is None or draft.tokens != found or not treed:
            return Draft(found, None)
        return draft

    def backlog(self, ready: Sequence[Request], regime: str) -> list[int]:
        """Per stage, the tokens of the contexts of ``ready``'s requests of ``regime`` it has not read (model drafters
        only; 0 for the rest)."""
        requests = [r for r in ready if r.regime == regime]
        backlog = [0] * len(self.passes.stages)
        for index, stage in enumerate(self.passes.stages[:-1]):
            if self.passes.is_model[index]:
                backlog[index] = sum(max(r.length - stage.cached_tokens(r.seq_id), 0) for r in requests)
        return backlog
