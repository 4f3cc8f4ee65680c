"""The adaptive controller: fed observations, returns plans. No I/O, no clocks, no randomness.

Rule (see ``cascade.controller.model`` for E, T, R and R_B): every few steps, choose the chain and depths that
maximise the predicted throughput R_B of a step of B requests (the current load: the requests in the step) under
the current estimates of the quantities below; every request of the sampling regime runs that plan (explorations
and found n-gram continuations aside). An :class:`AdaptiveController` decides for one regime, once per engine step
(:meth:`AdaptiveController.decide`); what is a request's own is only its text's acceptance of the n-gram drafter's
guesses (:class:`RequestAcceptance`). The estimates:

- α_{ij}, the acceptance of stage i's drafts by stage j: greedy — accepted / tested positions (a round with
  ``a`` of ``n`` drafts accepted tested ``a + [a < n]`` positions); sampling — the expected acceptance
  Σ (1 − TV(p, q)) over drafted positions. Counts decay by ``1 − 1/window`` per observed position and by
  ``1 − 1/stale_rounds`` per round, so the estimate follows changes in content and an estimate of a bypassed
  pair is renewed by the next exploration. The models' plans read the estimate over all requests, so every
  request of a step plans alike (a step pays once for a drafter's pass and for verifying at all, whichever of its
  requests draft); the n-gram shortcut, whose value is the request's own text, blends the request's own counts
  with the global estimate, which acts as ``prior_weight`` pseudo-positions;
- c_i(t) and ĉ_i(t), the seconds of stage i's passes over t new tokens that verify drafts and that only decode
  (:class:`StageCost`), each a curve through decayed means of measured passes per token count (:class:`CostFit`);
- P, the prompt tokens the target prefills per engine step (decayed over ``rate_window`` steps), which every model
  drafter that drafts reads too: the term A of R_B.

With the n-gram shortcut (the engine looks the context up before planning; a found continuation drafts
straight for the target) the controller plans only the rounds without a match, and decides whether found
continuations are worth taking at all, as it decides whether drafting pays: by the observed rates (committed tokens
per second) of the engine's steps at the current load that verified found continuations and of those that
verified none (:class:`~cascade.controller.checks.ObservedCheck`, with checks of the mode not favoured within the
budget). Observed rather than modelled rates: n-gram acceptance is bursty (a long match is right for many tokens
or wrong at once), which the i.i.d. formula for E undervalues in greedy mode, while at a sampling temperature
one-hot guesses are mostly rejected; and whole steps, not a request's own rounds, since under load a found
continuation's positions delay every request of its step.

It keeps the configured plan for the engine's first ``warmup_rounds`` steps, switches only when the new plan's predicted throughput beats
the current plan's by ``hysteresis``, tries every chain once as soon as the warm-up is over, and every
``explore_every`` steps of the engine lets one request of the batch run a round of the plan whose pairs it observed
least recently, so a bypassed stage (or an untried depth) can come back (an exploring request makes its whole step
wait for the stages it explores, so exploration is spread over the batch rather than taken by every request). While
explorations change no plan's chain the interval doubles, up to 8 × ``explore_every`` steps. Explorations and
the observed checks are paid from a budget of ``explore_budget`` of the engine's time at the cost the engine's steps
measured (:meth:`GlobalStats.observe_spending`), so they never cost more than that fraction, however long the
contexts a drafter has to catch up on. A found n-gram continuation is verified only while its expected tokens beat
what the request's own plan would commit by more than the seconds it adds to the step are worth, and the step's
found continuations together pay for verifying at all (:meth:`AdaptiveController.lookup_value`: under load every
request of the step waits for them). Drafting predicted to beat the target alone by ``speculation_margin`` runs
unless the engine's steps at this load observe it slower; drafting predicted faster by less than that (where
speculation is marginal, a sampling temperature or a loaded batch, the model's error is larger than the gain) runs
only where its steps were observed faster, a check having tried it; drafting predicted slower never runs: the
target alone is the side a user expects Cascade never to fall below. At a load not seen before the target decodes
alone first (which measures its plain pass there), and the plan is re-optimised for the load as soon as it moves to
another bucket; no exploration runs in a check's steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cascade.controller.checks import load_bucket
from cascade.controller.costs import CostFit
from cascade.controller.lookups import LookupValue, step_terms
from cascade.controller.model import CHAIN, Plan, TreeTerms, best_plan, candidate_chains, plan_chain
from cascade.controller.params import ControllerParams
from cascade.controller.shared import Decayed, GlobalStats

UNTRIED_TRIES = 3  # times an exploration hands out a chain it has not observed (AdaptiveController._untried_chain)


@dataclass(slots=True)
class RequestAcceptance:
    """What is a request's own in the controller: how often the n-gram drafter's guesses on its text are accepted by
    the target (blended with the regime's estimate, which counts as ``prior_weight`` pseudo-positions; aged by
    ``1 − 1/stale_rounds`` a step, and decayed over ``window`` positions), and the value of its found continuations,
    kept for a few steps (re-optimising every request's value at each change of batch size cost ~0.6 ms a step at 64
    requests)."""

    estimate: Decayed
    aged_at: int = 0  # the regime's step its estimate was last aged to
    value: LookupValue | None = None
    calls: int = 0  # values asked for
    planned_at: int = 0  # the call at which ``value`` was optimised
    bucket: int = -1  # for which load bucket
    chain: tuple[int, ...] | None = None  # and which running plan's chain

    def aged(self, step: int, params: ControllerParams) -> Decayed:
        if step > self.aged_at:
            self.estimate.age((1.0 - 1.0 / params.stale_rounds) ** (step - self.aged_at))
            self.aged_at = step
        return self.estimate


@dataclass(slots=True)
class AdaptiveController:
    """The rule for one sampling regime of an engine: ``global_stats`` is what all its requests taught; asked once
    per step for the regime's plan (:meth:`decide`)."""

    global_stats: GlobalStats
    model_free: Sequence[bool]  # per stage: drafts without a model (the n-gram drafter)
    initial: Plan
    params: ControllerParams = ControllerParams()
    chains: tuple[tuple[int, ...], ...] | None = None  # the chains it may choose and explore (None: every chain)
    tree_widths: dict[tuple[int, int], int] = field(default_factory=dict)  # (drafter, verifier) -> branch nodes per
    # draft token of the drafter's trees for that stage (the engine's siblings; none: chains)
    dropped: set[tuple[int, int]] = field(default_factory=set)  # the pairs whose trees the model found slower than
    # chains on the plan's chain at the last decision (_judge_trees): they draft chains until judged again
    current: Plan | None = None  # the regime's plan, as the model chose it
    running: Plan | None = None  # the plan the step's rounds run (``current`` as the observed check lets it run)
    explored: bool = False  # the last decision handed one request an exploration round
    _running_at: tuple[tuple[int, int, int], tuple[int, ...]] | None = None  # (steps, batch) -> the chain rounds run

    def __post_init__(self) -> None:
        self.current = self.running = self.initial

    def admit(self) -> RequestAcceptance:
        """A new request's own state."""
        return RequestAcceptance(Decayed(self.params.window), self.global_stats.steps)

    # ---- observations ---------------------------------------------------------------------------------------

    def observe_round(self, drafter: int, verifier: int, drafted: int, accepted: int, expected: float | None = None,
                      own: RequestAcceptance | None = None, branched: int | None = None) -> None:
        """A verified draft of ``own``'s request (None: of no request's own). ``expected``: Σ(1 − TV) over the
        drafted positions, when sampling. ``branched``: a draft tree's tokens accepted on a branch (None: a chain)."""
        if drafted == 0:
            return
        if branched is not None and accepted < drafted:
            self.global_stats.observe_rescue((drafter, verifier), branched > 0)
        if expected is not None:
            num, den = expected, float(drafted)
        else:
            num, den = float(accepted), float(accepted + (accepted < drafted))
        pair = (drafter, verifier)
        stats = self.global_stats
        if own is not None and pair == self._lookup_pair:
            own.aged(stats.steps, self.params).add(num, den)
        stats.observe_alpha(pair, num, den)
        stats.last_seen[pair] = stats.steps

    # ---- decisions --------------------------------------------------------------------------------------------

    @property
    def _lookup_pair(self) -> tuple[int, int]:
        return 0, len(self.model_free) - 1

    def take_lookup(self, batch: int = 1) -> bool:
        """Whether this step, of ``batch`` requests, looks for n-gram continuations to draft straight for the
        target: unless steps that verified found continuations were observed slower than steps that verified none at
        this load (``GlobalStats.lookups``: every request of a step alike, checks aside)."""
        return self.global_stats.lookups.runs(batch)

    def alpha(self, own: RequestAcceptance | None = None) -> float:
        """α_L, the n-gram drafter's acceptance by the target given a match: the regime's, blended with ``own``."""
        prior = self.global_stats.pair_alpha(*self._lookup_pair)
        if prior is None:
            prior = self.params.unobserved_alpha
        if own is None:
            return prior
        estimate = own.aged(self.global_stats.steps, self.params)
        if estimate.den <= 0.0:
            return prior
        w = self.params.prior_weight
        return (estimate.num + w * prior) / (estimate.den + w)

    def shared_alpha(self, i: int, j: int) -> float:
        """α of a stage pair over all requests: what the models' plans read. Every request of a step plans alike
        with it: a step pays once for a drafter's pass and for verifying drafts at all, whichever of its requests
        draft, so requests that split over plans by their own acceptance pay for both and gain from neither."""
        shared = self.global_stats.pair_alpha(i, j)
        return self.params.unobserved_alpha if shared is None else shared

    def plan_for(self, chain: tuple[int, ...], batch: int = 1,
                 pair_tree: Callable[[int, int], TreeTerms] | None = None) -> Plan:
        """The model's best depths for ``chain`` in a step of ``batch`` requests, under today's shared estimates
        (``cascade.controller.model.plan_chain``), with its predicted throughput; each level's trees as
        ``pair_tree`` (default :meth:`pair_tree`) says."""
        alphas = [0.0] + [self.shared_alpha(chain[p - 1], chain[p]) for p in range(1, len(chain))]
        verifying, decoding = self._curves()
        stats = self.global_stats
        pair_tree = pair_tree or self.pair_tree
        trees = [CHAIN] + [pair_tree(chain[p - 1], chain[p]) for p in range(1, len(chain))]
        return plan_chain(
            chain, alphas, verifying, self.model_free, self.params.max_depth, batch, decoding, stats.pipelining,
            stats.prompt_rate, trees,
        )

    def pair_tree(self, i: int, j: int) -> TreeTerms:
        """Stage i's draft trees for stage j as the plans count them: where the regime's steps run trees and the
        model has not dropped the pair's, the branch nodes per draft token and the share of rejected drafts a branch
        took over, as observed (0 where nothing is yet); else a chain."""
        width = self.tree_widths.get((i, j), 0)
        if not width or not self.global_stats.treeing or (i, j) in self.dropped:
            return CHAIN
        # planned with whatever is on record (a verdict waits for rescue_evidence; the plans should not: counting a
        # running tree's gain only while its fading record stays above that, the emulated chain read 1.07x instead
        # of 1.11x)
        rescue = self.global_stats.pair_rescue(i, j, evidence=1e-9)
        return TreeTerms(rescue or 0.0, width)

    def _judge_trees(self, chain: tuple[int, ...], batch: int) -> None:
        """Per stage pair of ``chain`` whose trees have an observed ρ: kept if the model predicts the chain faster
        with that level's trees than with a chain there (a branch's token against its nodes' cost on the verifying
        stage's curve, at this load: a chain is always a candidate), dropped otherwise. A pair not on the chain keeps
        its verdict; a dropped one, whose ρ is no longer observed, is tried again once its record has faded to an
        eighth of what a verdict needs (~66 rounds later)."""
        for i, j in zip(chain, chain[1:]):
            width = self.tree_widths.get((i, j), 0)
            evidence = self.params.rescue_evidence / 8 if (i, j) in self.dropped else None
            rescue = self.global_stats.pair_rescue(i, j, evidence) if width else None
            if rescue is None:
                self.dropped.discard((i, j))
                continue

            def judged(a: int, b: int, tree: TreeTerms) -> TreeTerms:  # the other pairs as the plans count them
                return tree if (a, b) == (i, j) else self.pair_tree(a, b)

            with_tree = self.plan_for(chain, batch, lambda a, b: judged(a, b, TreeTerms(rescue, width)))
            without = self.plan_for(chain, batch, lambda a, b: judged(a, b, CHAIN))
            if with_tree.throughput > without.throughput:
                self.dropped.discard((i, j))
            else:
                self.dropped.add((i, j))

    def _curves(self) -> tuple[list[CostFit], list[CostFit]]:
        costs = self.global_stats.costs
        return [c.verifying for c in costs], [c.decoding for c in costs]

    def lookup_value(self, batch: int = 1, step_tokens: int | None = None, own: RequestAcceptance | None = None
                     ) -> LookupValue:
        """What a found n-gram continuation drafted straight for the target is worth to a step of ``batch``
        requests whose target pass verifies ``step_tokens`` positions (default: one per request), for ``own``'s
        request (None: by the regime's acceptance alone), as :class:`~cascade.controller.lookups.LookupValue`: the
        best depth d maximises G(d) (the formula is in :mod:`cascade.controller.lookups`), none where G(d) ≤ 0.
        A request's value is re-optimised every few of its steps, like the plan; the step's shared terms are computed
        once per step."""
        own = own if own is not None else self.admit()
        own.calls += 1
        stats = self.global_stats
        warm = stats.steps > self.params.warmup_rounds
        # E_plan and S are those of the round the request would run now: the plan as the engine's observed steps
        # let it run (_observed_check), not the model's plan where drafting was observed slower. Valued against
        # a drafting round that does not run, continuations were declined for plain decoding, at half the rate.
        running = self._running_chain(batch) if warm else None
        probe = stats.lookups.checking_on  # a check of found continuations must verify them to measure them
        # Kept for replan_every of the request's steps while the load stays in its bucket (in a closed loop the batch
        # changes by one most steps) and the round runs the same chain. Kept replan_every steps per 8 requests, as it
        # once was, a value made while the estimates were young held for 32 steps at 64 requests on emulated MI300X
        # (the small model's α read 1.0 after its first rounds, so its round was taken to commit 9 tokens) and
        # declined every found continuation, while n-gram rounds ran 13% faster than the small model's.
        fresh = own.calls - own.planned_at < self.params.replan_every
        if (own.value is not None and fresh and own.bucket == load_bucket(batch) and own.chain == running
                and own.value.probe == probe):
            return own.value
        own.planned_at, own.bucket, own.chain = own.calls, load_bucket(batch), running
        alpha = self.alpha(own)
        if not warm:  # nothing measured yet: as deep as the model says
            depth = self.plan_for(self._lookup_pair, batch).depths[0]
            own.value = LookupValue(depth, alpha, 1.0, 0.0, (0.0,) * (depth + 1), 0.0)
            return own.value
        tokens = max(step_tokens or batch, 1)
        key = (stats.steps, running, batch, tokens)  # what every request of a step shares
        if stats.lookup_memo is None or stats.lookup_memo[0] != key:
            stats.lookup_memo = key, self._lookup_base(self.plan_for(running, batch), batch, tokens)
        value = dataclasses.replace(stats.lookup_memo[1], alpha=alpha)
        best = max(range(1, self.params.max_depth + 1), key=value.gain)
        depth = best if value.gain(best) > 0 else 0
        if probe:  # as an exploration drafts: at least explore_depth, taken whatever its value
            depth = max(depth, self.params.explore_depth)
        own.value = dataclasses.replace(value, depth=depth, probe=probe)
        return own.value

    def _running_chain(self, batch: int) -> tuple[int, ...]:
        """The chain a round of the regime runs at this step, as the observed check lets it (asked once a step: it
        changes only with a decision or an observed step)."""
        key = (self.global_stats.steps, self.global_stats.drafting.steps, batch)
        if self._running_at is None or self._running_at[0] != key:
            self._running_at = key, self._observed_check(self.current, batch, start=False).chain
        return self._running_at[1]

    def _lookup_base(self, current: Plan, batch: int, tokens: int) -> LookupValue:
        """:func:`~cascade.controller.lookups.step_terms` for ``current``, the plan a round runs, under today's
        estimates."""
        target = len(self.model_free) - 1
        verifying, decoding = self._curves()
        alone = self.plan_for((target,), batch)
        drafts = len(current.chain) > 1
        alpha = self.shared_alpha(current.chain[-2], current.chain[-1]) if drafts else 0.0
        lighter = None
        if drafts and current.throughput > alone.throughput and batch > 1:
            lighter = self.plan_for(current.chain, batch - 1)
        return step_terms(current, alone, lighter, alpha, batch, tokens, verifying[target], decoding[target],
                          self.params.max_depth, self.params.speculation_margin)

    def decide(self, batch: int = 1, rounds: int | None = None, backlog: Callable[[], Sequence[int]] | None = None
               ) -> Plan:
        """The regime's plan for the next step, of ``batch`` requests, ``rounds`` of them (default: all) planned by
        the models: what one of them runs, an exploration where :attr:`explored` (the others run :attr:`running`).
        ``backlog()``: per stage, the tokens of those requests' contexts it has not read, counted only if a check
        that makes the drafters catch up would start (None: nothing unread)."""
        stats = self.global_stats
        stats.steps += 1
        stats.age(batch if rounds is None else rounds)
        plan = self._decide(batch, backlog)
        if len(self.running.chain) == 1:
            stats.last_seen[self.running.chain] = stats.steps  # the target alone: its plain passes were observed
        return plan

    def _decide(self, batch: int, backlog: Callable[[], Sequence[int]] | None) -> Plan:
        self.explored = False
        stats = self.global_stats
        if stats.steps <= self.params.warmup_rounds:
            return self.running  # nothing is known yet
        # One plan for every request of the regime, re-optimised every replan_every steps: requests that hold plans
        # decided at different times split a step over drafting and plain decoding, which pays for both and gains
        # from neither. And at once when the load moves to another bucket: a plan made for one client, kept for the
        # first steps of 64 arriving ones, drafted through their prefill (traced at T=0.8: 7 steps of 280-400 ms,
        # where the target alone decoded them in under 100 ms).
        bucket = load_bucket(batch)
        if stats.plan is None or stats.steps - stats.planned_step >= self.params.replan_every or bucket != stats.planned_bucket:
            stats.planned_step, stats.planned_bucket = stats.steps, bucket
            self._replan(batch)
        self.current = stats.plan
        unread: list[Sequence[int]] = []

        def counted() -> Sequence[int]:  # the backlog, counted once, when first asked
            if not unread:
                unread.append(backlog() if backlog is not None else [0] * len(self.model_free))
            return unread[0]

        self.running = self._observed_check(self.current, batch, counted=counted)
        # No exploration in a check's steps: an exploring request makes its step say nothing about the mode checked.
        if stats.checked:
            return self.running
        untried = self._untried_chain() if not stats.all_tried else None
        if untried is not None and self.params.explore_every:
            self.explored = True  # try every chain once, early in the engine's life
            return self._explore(untried, batch)
        # One exploration round per explore_every steps (an exploring request makes every request of its step wait
        # for the stages it explores), less often while explorations change nothing, and only while the budget
        # affords it (GlobalStats.observe_spending).
        if self.params.explore_every and stats.steps >= stats.explore_at and stats.affords():
            stale = self._stalest_chain(exclude=self.running.chain)
            if stale is not None:
                stats.next_exploration()
                self.explored = True
                return self._explore(stale, batch)
        return self.running

    def _replan(self, batch: int) -> None:
        """Re-optimise the regime's shared plan for a step of ``batch`` requests: the model's best, if it beats the
        target alone by the margin (else the target alone), and only if it beats the current plan, re-predicted, by
        the hysteresis; a best plan predicted faster than the target alone by less than the margin is kept as
        ``marginal``, for the engine's observed steps to decide."""
        stats = self.global_stats
        first = stats.plan is None  # (a change at a later decision is a switch)
        if self.tree_widths:
            self._judge_trees((stats.plan or self.current).chain, batch)
        verifying, decoding = self._curves()
        best = best_plan(
            self.shared_alpha, verifying, self.model_free, self.params.max_depth, self._candidates(), batch, decoding,
            stats.pipelining, stats.prompt_rate, self.pair_tree,
        )
        alone = self.plan_for((len(self.model_free) - 1,), batch)

        def worth(plan: Plan) -> bool:  # drafting must beat the target alone by the margin
            return len(plan.chain) == 1 or plan.throughput >= alone.throughput * (1.0 + self.params.speculation_margin)

        # Predicted faster, but within the margin: the model cannot tell, so the engine's steps decide
        stats.marginal = best if len(best.chain) > 1 and best.throughput > alone.throughput else None
        best = best if worth(best) else alone
        stats.alone = alone
        current = self.plan_for((stats.plan or self.current).chain, batch)  # re-predicted: today's estimates, load
        if best.chain != current.chain or best.depths != current.depths:
            if not worth(current) or best.throughput > current.throughput * (1.0 + self.params.hysteresis):
                stats.switches += not first and best.chain != current.chain
                current = best
        stats.plan = current

    def _observed_check(self, plan: Plan, batch: int, start: bool = True,
                        counted: Callable[[], Sequence[int]] | None = None) -> Plan:
        """The model's plan, unless the engine's steps at this load say otherwise (``GlobalStats.drafting``, an
        :class:`~cascade.controller.checks.ObservedCheck`, whose checks run the other mode now and then, so that a
        change in content shows). Where the model drafts, the target decodes alone if drafting steps were observed
        slower. Where it decodes plainly although its best drafting plan is predicted faster, by less than the
        ``speculation_margin`` (the model's error where the gain is marginal: a sampling temperature, a loaded batch),
        that plan drafts if drafting steps were observed faster, a check having tried it. Where drafting is predicted
        slower, the target decodes alone (the safe side). ``start``: a check may start here (False: only asks);
        ``counted()``: per stage, the tokens of the step's contexts it has not read (None: nothing)."""
        stats = self.global_stats
        if not self.params.check_every:
            return plan
        if len(plan.chain) == 1:
            marginal = stats.marginal
            if marginal is None:
                return plan
            return marginal if self._drafting_runs(marginal, batch, start, counted, unobserved=False) else plan
        if self._drafting_runs(plan, batch, start, counted):
            return plan
        return stats.alone or self.plan_for((len(self.model_free) - 1,), batch)

    def _drafting_runs(self, plan: Plan, batch: int, start: bool, counted: Callable[[], Sequence[int]] | None,
                       unobserved: bool = True) -> bool:
        drafting = self.global_stats.drafting
        # Drafting with ``plan`` after plain steps (or a check that drafts) first makes its drafters read what they
        # have not of every context.
        def catch_up() -> float:
            backlog = counted() if counted is not None else [0] * len(self.model_free)
            return self.global_stats.catch_up(plan.chain, self.model_free, backlog)

        return drafting.runs(batch, unobserved, catch_up) if start else drafting.mode(batch, unobserved, catch_up)

    def _explore(self, chain: tuple[int, ...], batch: int) -> Plan:
        plan = self.plan_for(chain, batch)
        return Plan(plan.chain, tuple(max(d, self.params.explore_depth) for d in plan.depths), plan.throughput)

    def _untried_chain(self) -> tuple[int, ...] | None:
        """A chain with a stage pair that no request has observed yet, or the target alone while no plain pass of
        the target has been timed, if any: one request of the step tries it (were every request of the step to try
        it, traced in a fresh server under 64 sampled clients, 41 requests drafted with the medium model in one step,
        which first read all 41 contexts: 0.22 s, against a 30 ms step).

        A chain still unobserved after it was handed out (its request left) is handed out again, up to
        ``UNTRIED_TRIES`` times: some steps cannot observe it (the target alone, explored by one request of a step
        whose other rounds verify drafts, times no plain pass), and trying it every step (traced at 16 emulated
        clients: 11 steps) made each an exploration, which the observed checks do not count. The periodic
        explorations (:meth:`_stalest_chain`) try it later."""
        stats = self.global_stats
        for chain in self._candidates():
            if stats.tried[chain] >= UNTRIED_TRIES:
                continue
            if len(chain) == 1:
                unobserved = not stats.costs[chain[0]].plain.observed
            else:
                unobserved = any(stats.pair_alpha(chain[p - 1], chain[p]) is None for p in range(1, len(chain)))
            if unobserved:
                stats.tried[chain] += 1
                return chain
        stats.all_tried = True
        return None

    def _stalest_chain(self, exclude: tuple[int, ...]) -> tuple[int, ...] | None:
        """The chain whose least recently observed pair is oldest (never observed counts as oldest); the target
        alone counts as observed when it last ran."""
        last_seen = self.global_stats.last_seen

        def staleness(chain: tuple[int, ...]) -> int:
            if len(chain) == 1:
                return last_seen.get(chain, -1)
            return min(last_seen.get((chain[p - 1], chain[p]), -1) for p in range(1, len(chain)))

        options = [c for c in self._candidates() if c != exclude]
        return min(options, key=staleness) if options else None

    def _candidates(self) -> Sequence[tuple[int, ...]]:
        return self.chains if self.chains is not None else candidate_chains(len(self.model_free))
