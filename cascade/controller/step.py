"""The engine's one controller: asked once per step for the step's plans, told once what the step did.

:class:`StepController` holds everything the rule learns across requests (an :class:`AdaptiveController` per
sampling regime, deciding its plan once per step from its :class:`GlobalStats`; the pipelined mode's
:class:`PipelineCheck`) and hands each new request its own state (:meth:`StepController.admit`: a
:class:`RequestAcceptance`, its text's acceptance of the n-gram drafter's guesses). The engine talks to it through
two methods:

- :meth:`StepController.plan`, the one way out: each request's chain and depths for the step (and the found
  n-gram continuation a round drafts straight for the target), and whether the pipelined mode drafts ahead. What
  the engine alone can do is passed in with the step, never installed: looking a context up, and counting what the
  drafters have not read of the step's contexts (only if a check that makes them catch up would start).
- :meth:`StepController.observe`, the one way in: a :class:`StepRecord` the engine fills while the step runs (its
  timed passes, its verified drafts, the prompt tokens it prefilled, what it committed in how long and how its rounds
  were planned) and hands over when it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cascade.controller.adaptive import AdaptiveController, RequestAcceptance
from cascade.controller.checks import PipelineCheck
from cascade.controller.lookups import LookupValue
from cascade.controller.model import Plan, candidate_chains
from cascade.controller.params import ControllerParams
from cascade.controller.shared import GlobalStats

REGIMES = ("greedy", "coupled", "sampling")  # how a request's drafts are verified (Request.regime)


def drafts_for_target(plan: Plan, model_free: Sequence[bool]) -> bool:
    """Whether a model drafts for the target in ``plan``'s rounds: what the pipelined mode can draft ahead."""
    return len(plan.chain) > 1 and not model_free[plan.chain[-2]]


class Planned(Protocol):
    """What the controller reads of a request in a step (``cascade.engine.request.Request``)."""

    regime: str
    width: int  # positions its last round verified
    acceptance: RequestAcceptance | None


@dataclass(slots=True)
class StepRecord:
    """What one engine step did, gathered while it runs: the controller's only input (:meth:`StepController.observe`)."""

    # (stage, positions, seconds, plain, regimes) per timed pass of a round; a pass that mixes regimes costs what it
    # costs for each (a prefill chunk is no round's pass: the controller counts it by ``prefill_tokens``)
    passes: list[tuple[int, int, float, bool, frozenset[str]]] = field(default_factory=list)
    # (the request's regime and own acceptance, drafter, verifier, drafted, accepted, Σ(1 − TV) over the drafted
    # positions or None, a draft tree's tokens accepted on a branch or None for a chain)
    rounds: list[tuple[str, RequestAcceptance, int, int, int, int, float | None, int | None]] = field(default_factory=list)
    prefill_tokens: int = 0  # prompt tokens the target prefilled
    batch: int = 0  # requests that ran a round, as planned by the step's StepController.plan (0: it only prefilled)
    committed: int = 0  # tokens those rounds committed
    seconds: float = 0.0  # what the rounds took

    def on_pass(self, stage: int, positions: int, seconds: float, plain: bool, regimes: frozenset[str]) -> None:
        self.passes.append((stage, positions, seconds, plain, regimes))

    def on_round(self, regime: str, own: RequestAcceptance, drafter: int, verifier: int, drafted: int, accepted: int,
                 expected: float | None, branched: int | None = None) -> None:
        """A verified draft; ``branched``: a draft tree's tokens accepted on a branch (None: a chain)."""
        self.rounds.append((regime, own, drafter, verifier, drafted, accepted, expected, branched))


@dataclass(slots=True)
class StepPlan:
    """The controller's answer for one step: each request's plan, with the draft it already has (a found n-gram
    continuation, or None), and whether the pipelined mode drafts the next rounds ahead (None: no round can, none of
    the step's plans having a model draft for the target)."""

    rounds: dict[Planned, tuple[Plan, list[int] | None]]
    ahead: bool | None
    kept: frozenset = frozenset()  # the requests whose round verifies the draft made ahead for it, under its plan
    explored: frozenset = frozenset()  # the requests whose round is an exploration
    # per regime, the (drafter, verifier) stage pairs whose drafts are trees this step (of the pairs whose drafter
    # proposes siblings to a verifier that scores them: CascadeEngine's ``siblings``); a regime or pair not here:
    # chains; None (no controller): every such pair
    trees: Mapping[str, frozenset[tuple[int, int]]] | None = None


class StepController:
    """The adaptive controller of one engine (``cascade.controller.adaptive`` states the rule). ``model_free``: per
    stage, whether it drafts without a model (the n-gram drafter, only at the bottom); ``initial``: the plan before
    anything is measured (every stage at its configured depth); ``shortcut``: the n-gram drafter's found
    continuations draft straight for the target, and the controller plans the other rounds, without it; ``priors``:
    per stage, its cost curve before any pass is measured (a roofline, or None)."""

    def __init__(
        self, params: ControllerParams, model_free: Sequence[bool], initial: Plan, *, shortcut: bool = False,
        priors: Sequence | None = None, trees: Mapping[tuple[int, int], int] | None = None,
    ):
        self.params = params
        self.model_free = list(model_free)
        self.shortcut = shortcut
        self.initial, self.chains = initial, None
        if shortcut:  # the n-gram drafter takes every round it finds a match for; the others are planned without it
            self.initial = Plan(initial.chain[1:], initial.depths[1:], 0.0)
            self.chains = tuple(c for c in candidate_chains(len(self.model_free)) if c[0] != 0)
        # What requests taught, per regime: acceptance, and the cost curve of every stage. A pass over sampled
        # requests costs more than the same pass over greedy ones: its logits are warped and sampled, and its drafts
        # rejection-sampled, over the whole vocabulary (measured on the demo family at 64 requests: +19% for the
        # target verifying 192 positions, +33% for the small drafter's passes). Priced at greedy's costs, drafting at
        # a temperature was predicted up to 50% faster under load than it ran.
        self.regimes = {regime: GlobalStats(len(self.model_free), params, priors) for regime in REGIMES}
        self.tree_edges = dict(trees or {})  # (drafter, verifier) -> the siblings per draft token of the drafter's
        # trees for that stage; whether a step uses them is observed (GlobalStats.trees)
        self.controllers = {
            regime: AdaptiveController(stats, self.model_free, self.initial, params, self.chains, self.tree_edges)
            for regime, stats in self.regimes.items()
        }
        self.pipeline_check = PipelineCheck(params) if params.pipelined else None
        self._planned: StepPlan | None = None  # the step's plan, until the step is observed
        self._modes: dict[str, tuple[bool, list[bool]]] = {}  # and per regime, whether it explored and drafted
        self._looked_up = False  # and whether a round verifies a found continuation
        self._treed: dict[str, bool] = {}  # and per regime that could, whether its drafts for the target were trees

    def admit(self, regime: str) -> RequestAcceptance:
        """A new request's own state (what all requests of its regime taught is the regime's controller's)."""
        return self.controllers[regime].admit()

    # ---- the one way out ----------------------------------------------------------------------------------------

    def plan(
        self, requests: Sequence[Planned], kept: dict[Planned, Plan], lookup: Callable[[Planned, int], list[int]],
        backlog: Callable[[str], list[int]], pipelined: bool,
    ) -> StepPlan:
        """The plans of a step whose decoding requests are ``requests``; ``kept``: those of them the pipelined mode
        drafted ahead for, with the plan it drafted by (such a round verifies that draft, unless the n-gram drafter
        finds a continuation: a match is often right for many tokens). ``lookup(request, depth)``: up to ``depth`` tokens
        the n-gram drafter finds continuing its context; ``backlog(regime)``: per stage, the tokens of that regime's
        contexts of the step it has not read (counted only if a check that makes the drafters catch up would start);
        ``pipelined``: the engine can draft ahead, which the step does where it has been observed to pay at this load.

        With the shortcut, the n-gram drafter's lookup is free, so it looks first: a found continuation drafts
        straight for the target this round (the models between would only re-check it), as deep as pays, and only
        while steps that verified such drafts are observed faster at this load than steps that verified none
        (``AdaptiveController.take_lookup``) and while the step's found continuations together gain more tokens
        than the seconds they add to the step are worth (``AdaptiveController.lookup_value``: under load every
        request of the step waits for the extra positions). The other rounds are the models': every request of a
        regime runs its plan, decided once for the step (:meth:`AdaptiveController.decide`), but for one of them
        where it explores. Any chain per round keeps the output exact."""
        batch = len(requests)
        if self.pipeline_check is not None:
            favoured = self.pipeline_check.favoured(batch)
            for stats in self.regimes.values():
                stats.pipelining = favoured  # plans are for the mode the step is expected to run
        found = self._found(requests, batch, lookup) if self.shortcut else {}
        target = len(self.model_free) - 1
        planned: dict[str, list[Planned]] = {}  # per regime, the requests the models' plan is for
        for request in requests:
            if request not in found and request not in kept:
                planned.setdefault(request.regime, []).append(request)
        shared: dict[str, Plan] = {}  # per regime, the plan its requests run
        explored: dict[Planned, Plan] = {}  # and the one request of the step that explores, if any
        for regime, group in planned.items():
            controller = self.controllers[regime]
            plan = controller.decide(batch, len(group), lambda regime=regime: backlog(regime))
            shared[regime] = controller.running
            if controller.explored:
                explored[group[0]] = plan
        rounds: dict[Planned, tuple[Plan, list[int] | None]] = {}
        taken = set()
        drafted: dict[str, set[bool]] = {}  # per regime: whether its requests' models drafted (found ones aside)
        for request in requests:  # (in the step's order: the batch's rows)
            modes = drafted.setdefault(request.regime, set())
            if request in found:
                rounds[request] = Plan((0, target), (len(found[request]),), 0.0), found[request]
                continue
            if request in kept:
                rounds[request] = kept[request], None
                taken.add(request)
            else:
                rounds[request] = explored.get(request, shared[request.regime]), None
            modes.add(len(rounds[request][0].chain) > 1)
        # what observe needs of how the step was planned, summed up here rather than read back request by request
        self._modes = {regime: (any(r.regime == regime for r in explored), sorted(modes))
                       for regime, modes in drafted.items()}
        # Per regime, the stage pairs of its rounds where a stage may draft trees for the stage above it (a model, or
        # found continuations), but for those whose trees the model judged slower than chains at this load
        # (AdaptiveController.dropped, once a pair's ρ is observed). Of those, the preferred: the pairs the model
        # kept, and the unjudged ones whose nodes are nearly free to verify (a tree's extra positions cost the whole
        # step). Whether the regime's drafts are trees this step is one decision, as steps with them were observed
        # faster or slower than steps without at this load (checks aside), trees first where any pair is preferred;
        # then the preferred pairs draft trees, or every eligible one where none is (what a check measures).
        eligible: dict[str, set[tuple[int, int]]] = {}
        for request, (plan, _) in rounds.items():
            dropped = self.controllers[request.regime].dropped
            edges = [e for e in zip(plan.chain, plan.chain[1:]) if e in self.tree_edges and e not in dropped]
            if edges:
                eligible.setdefault(request.regime, set()).update(edges)
        trees = {}
        for regime, edges in eligible.items():
            stats = self.regimes[regime]
            preferred = {e for e in edges if stats.pair_rescue(*e) is not None} | self._cheap_pairs(regime, edges, rounds)
            if stats.trees.runs(batch, unobserved=bool(preferred)):
                trees[regime] = frozenset(preferred or edges)
        self._treed = {regime: regime in trees for regime in eligible}
        for regime, treed in self._treed.items():  # the next plans count the trees' gain while they run
            self.regimes[regime].treeing = treed
        self._looked_up = bool(found)
        ahead = None
        if pipelined and any(drafts_for_target(p, self.model_free) for p, _ in rounds.values()):
            ahead = self.pipeline_check is None or self.pipeline_check.ahead(batch)
        self._planned = StepPlan(rounds, ahead, frozenset(taken), frozenset(explored), trees)
        return self._planned

    def _cheap_pairs(self, regime: str, edges: set[tuple[int, int]],
                     rounds: dict[Planned, tuple[Plan, list[int] | None]]) -> set[tuple[int, int]]:
        """Those of ``edges`` whose trees add at most ``tree_cost_margin`` to the verifying stage's predicted pass at
        the positions the step's rounds give it (each round's depth + 1; a stage's cost curve as measured, or its
        roofline before that; a stage with neither: none)."""
        positions: dict[int, int] = {}  # verifying stage -> the positions the step's rounds verify there
        nodes: dict[tuple[int, int], int] = {}  # and per pair, the regime's tree nodes beside them
        for request, (plan, _) in rounds.items():
            for edge, depth in zip(zip(plan.chain, plan.chain[1:]), plan.depths):
                positions[edge[1]] = positions.get(edge[1], 0) + depth + 1
                if request.regime == regime and edge in edges:
                    nodes[edge] = nodes.get(edge, 0) + self.tree_edges[edge] * depth
        margin = 1.0 + self.params.tree_cost_margin
        cheap = set()
        for edge, added in nodes.items():
            curve, verified = self.regimes[regime].costs[edge[1]].verifying, positions[edge[1]]
            if curve.informed and curve(verified + added) <= margin * curve(verified):
                cheap.add(edge)
        return cheap

    def _found(self, requests: Sequence[Planned], batch: int, lookup: Callable[[Planned, int], list[int]]
               ) -> dict[Planned, list[int]]:
        """The continuations the shortcut finds and takes this step, per request."""
        tokens = sum(r.width for r in requests)
        depths: dict[Planned, int] = {}  # how deep to look, per request that looks
        values: dict[Planned, LookupValue] = {}  # what each found continuation is worth, where that decides
        take: dict[str, bool] = {}  # per regime: whether this step looks (the same for all its requests)
        for request in requests:
            controller = self.controllers[request.regime]
            if request.regime not in take:
                take[request.regime] = controller.take_lookup(batch)
            if take[request.regime]:
                value = controller.lookup_value(batch, tokens, request.acceptance)
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
        found: dict[Planned, list[int]] = {}
        for request, depth in depths.items():
            draft = lookup(request, depth) if depth else []
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

    # ---- the one way in -----------------------------------------------------------------------------------------

    def observe(self, record: StepRecord) -> None:
        """What a step did: its passes' costs, its verified drafts' acceptance, its prefill, and its outcome for the
        budget and the observed checks of each mode at this load (``GlobalStats.observe_step``; the pipelined mode's
        drafting ahead, ``PipelineCheck``)."""
        for stage, positions, seconds, plain, regimes in record.passes:
            for regime in regimes:
                self.regimes[regime].observe_pass(stage, positions, seconds, plain)
        for regime, own, drafter, verifier, drafted, accepted, expected, branched in record.rounds:
            self.controllers[regime].observe_round(drafter, verifier, drafted, accepted, expected, own, branched)
        for stats in self.regimes.values():
            stats.observe_prefill(record.prefill_tokens)
        planned, self._planned = self._planned, None
        if not record.batch or planned is None:
            return
        batch, committed, seconds = record.batch, record.committed, record.seconds
        if planned.ahead is not None and self.pipeline_check is not None:
            self.pipeline_check.observe(batch, planned.ahead, committed, seconds)
        # How the step's rounds were planned (summed up by plan), for the checks of what each mode is worth at this
        # load: per regime, whether a request explored and whether its requests' models drafted (found continuations
        # aside: all, none, or some); and whether a round verified a found continuation.
        for regime, (exploring, drafted) in self._modes.items():
            self.regimes[regime].observe_step(
                batch, committed, seconds, explored=exploring, drafted=drafted,
                looked_up=self._looked_up if self.shortcut else None, treed=self._treed.get(regime),
            )
