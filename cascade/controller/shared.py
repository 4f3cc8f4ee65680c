"""What every request of an engine shares with the others: the controller's parameters, the acceptance and cost
estimates over all requests, the plan they all run, and the observed rates of the engine's steps
(``cascade.controller.checks``; ``cascade.controller.adaptive`` decides with them)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cascade.controller.checks import ObservedCheck, Rate, load_bucket
from cascade.controller.costs import StageCost
from cascade.controller.model import Plan
from cascade.controller.params import ControllerParams

if TYPE_CHECKING:
    from cascade.controller.lookups import LookupValue


class Decayed:
    """A ratio of exponentially decayed sums: recent observations weigh more."""

    __slots__ = ("num", "den", "decay")

    def __init__(self, window: float):
        self.num = self.den = 0.0
        self.decay = 1.0 - 1.0 / window

    def add(self, num: float, den: float) -> None:
        scale = self.decay**den
        self.num = self.num * scale + num
        self.den = self.den * scale + den

    def age(self, factor: float) -> None:
        self.num *= factor
        self.den *= factor


class GlobalStats:
    """What all requests of one sampling regime have taught: acceptance per stage pair and the cost curve of every
    stage (an engine keeps one per regime: greedy acceptance says little about acceptance at a temperature, and a
    pass over sampled requests costs more, its logits warped and sampled over the whole vocabulary)."""

    def __init__(self, num_stages: int, params: ControllerParams = ControllerParams(), priors=None):
        """``priors``: per stage, its cost curve before any pass is measured (None, or a None entry: flat)."""
        self.params = params
        # acceptance per stage pair, read through pair_alpha (which first applies the rounds' aging)
        self._alpha = {(i, j): Decayed(params.window) for i in range(num_stages) for j in range(i + 1, num_stages)}
        # and per pair, of the draft trees' rounds whose draft was rejected, the share a branch took over (ρ)
        self._rescue = {pair: Decayed(params.window) for pair in self._alpha}
        self.treeing = False  # the regime's drafts are trees in the steps being planned (StepController.plan sets it)
        self.costs = [StageCost(prior) for prior in (priors or [None] * num_stages)]
        self.steps = 0  # steps the regime's plan was decided for (AdaptiveController.decide)
        self._unaged = 0  # request rounds that have not aged ``_alpha`` yet (age)
        self.last_seen: dict[tuple[int, ...], int] = {}  # a stage pair, or the target alone -> the step it last ran
        self.all_tried = False  # every stage pair has been observed at least once
        self.tried: Counter[tuple[int, ...]] = Counter()  # chain -> explorations that tried it as untried
        self.switches = 0  # times the regime's plan moved to another chain
        self.plan: Plan | None = None  # the plan every request runs (explorations and found continuations aside)
        # Plans are for rounds drafted ahead (cascade.controller.model's T^pipe): StepController.plan sets it each
        # step, in the pipelined mode, while drafting ahead is observed to pay at the step's load (PipelineCheck).
        self.pipelining = params.pipelined
        self.planned_step = 0  # the step for which it was last re-optimised
        self.planned_bucket = -1  # and the load bucket it was re-optimised for (load_bucket)
        self.explore_at = params.explore_every  # the step from which the next exploration may run
        self.explore_backoff = 0  # the interval is explore_every · 2**explore_backoff steps
        self._switches_at_exploration = 0
        # steps where the models drafted, against plain ones; at a new load plain steps first: they measure the
        # target's plain pass there, which the model otherwise extrapolates (traced at 64 sampled requests after
        # one client: it priced the target alone at a third of its rate, and the small model drafted, 15% slower)
        self.drafting = ObservedCheck(params, self.affords, off_first=True)
        self.lookups = ObservedCheck(params, self.affords)  # steps that verified found continuations, against none
        self.trees = ObservedCheck(params, self.affords)  # steps whose drafts for the target were trees, against chains
        self.alone: Plan | None = None  # the target alone, planned with ``plan``
        self.marginal: Plan | None = None  # the best drafting plan, when predicted faster only within the margin
        self.lookup_memo: tuple[tuple, LookupValue] | None = None  # (step, plan, batch, step size) -> lookup base
        self.normal_rates: dict[int, Rate] = {}  # load bucket -> tokens/s of steps without explorations or checks
        self.budget = 0.0  # seconds explorations and checks may still cost (see observe_spending)
        self.saving_for = 0.0  # the predicted cost of a check waiting for the budget to cover it (see affords)
        self.prompt_rate = 0.0  # P: prompt tokens the target prefilled per engine step, a decayed mean

    def observe_step(
        self, batch: int, tokens: int, seconds: float, *, explored: bool, drafted: Sequence[bool],
        looked_up: bool | None = None, treed: bool | None = None,
    ) -> None:
        """An engine step of ``batch`` requests that committed ``tokens`` in ``seconds``: its cost against the
        budget (:meth:`observe_spending`) and its rate, for the checks at this load of found continuations against
        none (``looked_up``: whether a round verified found continuations; None without the n-gram shortcut) and
        of drafting against plain decoding (``drafted``: per request of the regime that planned, whether its models
        drafted). A step where a request explored says nothing about either; nor, about drafting, one where only
        some requests' models drafted. One where found continuations were verified counts for the mode the other
        requests' models ran: that is the step either mode makes under the shortcut, and under load nearly every
        step verifies some (traced at 64 greedy requests, the few steps without any were the only ones observed,
        at unusual moments, and said drafting paid while its steps ran 20% slower). ``treed``: whether the step's
        drafts for the target were trees (None: no round could be one), for the check of trees against chains."""
        self.observe_spending(batch, tokens, seconds, explored or self.checked)  # before the observations end a check
        if looked_up is not None:
            self.lookups.observe(batch, None if explored else looked_up, tokens, seconds)
        if treed is not None:
            self.trees.observe(batch, None if explored else treed, tokens, seconds)
        alike = not explored and drafted and (all(drafted) or not any(drafted))
        self.drafting.observe(batch, drafted[0] if alike else None, tokens, seconds)

    def observe_spending(self, batch: int, tokens: int, seconds: float, special: bool) -> None:
        """Every engine step the regime took part in; ``special``: it ran an exploration or a check (:attr:`checked`).

        Explorations and checks are paid from a budget: each step adds ``explore_budget · seconds``, and a special
        step takes what it cost, its seconds less what its tokens would have taken at the observed rate R_n of the
        steps without them at this load, ``seconds − tokens / R_n``. One runs only while the budget is not negative
        (:meth:`affords`), so over time they cost at most that fraction of the engine's time, however expensive
        one is (an exploration makes a drafter catch up on whole contexts, a check makes the whole batch draft)."""
        normal = self.normal_rates.setdefault(load_bucket(batch), Rate(self.params.rate_window))
        if not special:
            normal.add(tokens, seconds)
        elif normal.tokens > 0:
            self.budget -= seconds - tokens * normal.seconds / normal.tokens
        # Credit saved in a quiet period is not spent at once, unless a check waits for it (affords).
        cap = max(self.params.explore_budget * self.params.budget_horizon_s, self.saving_for)
        self.budget = min(self.budget + self.params.explore_budget * seconds, cap)

    def observe_pass(self, stage: int, tokens: int, seconds: float, plain: bool = False) -> None:
        """A forward pass of ``stage`` over ``tokens`` new tokens took ``seconds``; ``plain``: it verified no draft
        (the cost model keeps a curve for each kind, :class:`~cascade.controller.costs.StageCost`)."""
        self.costs[stage].add(tokens, seconds, plain)

    def observe_prefill(self, tokens: int) -> None:
        """Every engine step: the prompt tokens the target prefilled in it. Each model drafter that drafts reads
        them once too (the catch-up term of :func:`cascade.controller.model.plan_chain`)."""
        self.prompt_rate += (tokens - self.prompt_rate) / self.params.rate_window

    @property
    def checked(self) -> bool:
        """The current step is part of a check of either mode."""
        return self.drafting.checked or self.lookups.checked or self.trees.checked

    def affords(self, cost: float = 0.0) -> bool:
        """Whether an exploration or a check may run now (the budget of :meth:`observe_spending`); ``cost``: what
        it is predicted to cost at once. A check that makes the drafters catch up on every context of a loaded
        batch costs far more than its budget holds (traced at 64 sampled requests: 0.66 s, in a level of 5 s), and
        paid for afterwards it still takes its seconds from the requests of its moment; so it runs only once the
        budget covers it, saving up for it meanwhile."""
        if self.params.explore_budget >= 1.0:
            return True
        if self.budget >= max(cost, 0.0):
            if cost > 0.0:
                self.saving_for = 0.0
            return True
        if cost > 0.0:
            self.saving_for = cost
        return False

    def catch_up(self, chain: Sequence[int], model_free: Sequence[bool], backlog: Sequence[int]) -> float:
        """Seconds the model drafters of ``chain`` would take to read what they have not read of the step's
        contexts (``backlog``: per stage, the tokens it has not read), by their cost curves."""
        return sum(self.costs[i].decoding(backlog[i]) for i in chain[:-1] if not model_free[i] and backlog[i])

    def next_exploration(self) -> None:
        """An exploration runs now: schedule the next one. The interval doubles (up to ``2**max_backoff`` times)
        while explorations change no request's chain, and returns to ``explore_every`` steps when one does: where
        a bypassed stage keeps confirming that it does not pay (a drafter under heavy load), exploring it costs
        every request of the step a wait for its catch-up, for nothing."""
        if self.switches == self._switches_at_exploration:
            self.explore_backoff = min(self.explore_backoff + 1, self.params.max_backoff)
        else:
            self.explore_backoff = 0
        self._switches_at_exploration = self.switches
        self.explore_at = self.steps + self.params.explore_every * 2**self.explore_backoff

    def age(self, rounds: int) -> None:
        """A step of ``rounds`` requests' rounds passed: estimates that are not refreshed fade, by
        ``1 − 1/stale_rounds`` a round, so one exploration round can renew them. Applied when they are next read or
        added to."""
        self._unaged += rounds

    def observe_alpha(self, pair: tuple[int, int], num: float, den: float) -> None:
        self._age_now()
        self._alpha[pair].add(num, den)

    def observe_rescue(self, pair: tuple[int, int], rescued: bool) -> None:
        """A draft tree of ``pair`` whose draft was rejected: whether a branch took over."""
        self._age_now()
        self._rescue[pair].add(float(rescued), 1.0)

    def pair_rescue(self, i: int, j: int, evidence: float | None = None) -> float | None:
        """ρ of a stage pair's draft trees; None until ``evidence`` (default ``rescue_evidence``) rejected tree drafts
        are on record (they age: a pair whose trees stopped running comes back to None)."""
        self._age_now()
        s = self._rescue[(i, j)]
        return s.num / s.den if s.den >= (self.params.rescue_evidence if evidence is None else evidence) else None

    def pair_alpha(self, i: int, j: int) -> float | None:
        self._age_now()
        s = self._alpha[(i, j)]
        return s.num / s.den if s.den > 1e-9 else None

    def _age_now(self) -> None:
        if self._unaged:
            factor = (1.0 - 1.0 / self.params.stale_rounds) ** self._unaged
            for s in (*self._alpha.values(), *self._rescue.values()):
                s.age(factor)
            self._unaged = 0
