"""What every request of an engine shares with the others: the controller's parameters, the acceptance and cost
estimates over all requests, the plan they all run, and the observed rates of the engine's steps
(``cascade.controller.adaptive`` decides with them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from cascade.controller.costs import OUTLIER, StageCost
from cascade.controller.model import Plan

if TYPE_CHECKING:
    from cascade.controller.adaptive import LookupValue


@dataclass(frozen=True, slots=True)
class ControllerParams:
    max_depth: int = 8  # the largest depth considered for any stage
    warmup_rounds: int = 4  # rounds on the configured plan before the first decision (of the engine, not per request)
    hysteresis: float = 0.05  # a new plan must be predicted this much faster to replace the current one
    speculation_margin: float = 0.1  # drafting (models or found continuations) must be predicted this much faster
    # than the target alone: the model's error where speculation is marginal, resolved on the safe side
    explore_every: int = 32  # one exploration round every this many rounds (0 disables exploration)
    explore_depth: int = 4  # drafts at least this deep when exploring, to observe enough positions
    replan_every: int = 4  # re-optimise the plan every this many steps (the optimisation costs ~0.2 ms in Python;
    # one serves every request of the step)
    window: float = 64.0  # acceptance memory, in observed positions
    stale_rounds: float = 32.0  # and in rounds: an estimate not refreshed for this long loses most of its weight
    prior_weight: float = 8.0  # the global estimate counts as this many positions of a request's own
    unobserved_alpha: float = 0.5  # α assumed for a pair never observed
    rate_window: float = 32.0  # memory of the observed rates of the engine's steps, in steps
    pipelined: bool = False  # the engine drafts ahead while the target verifies (runtime.pipeline): the round time
    # of cascade.controller.model's T^pipe
    check_every: int = 16  # every this many steps, the whole step runs the mode (drafting or plain; found
    # continuations or none) the observed rates do not favour, so that both stay measured at the load (0: no checks)
    explore_budget: float = 0.01  # explorations and checks: at most this fraction of the engine's time, each
    # charged what its step measured beyond the other steps' rate (GlobalStats.observe_spending)


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


class Rate:
    """Tokens per second over recent rounds: decayed sums of tokens and of seconds.

    A round counts at most ``OUTLIER`` times the mean round's seconds: the rounds of one rate run the same kind of
    step at the same load, and one that a pause stretched (a KV cache growing by a copy of every slot, measured at
    200 ms inside a 7 ms round) would otherwise outweigh dozens of rounds, for as long as it takes a rarely run mode
    to be observed that often again. Measured: one such round held greedy decoding on the target alone for the next
    250 steps, at a third of the rate drafting had."""

    __slots__ = ("tokens", "seconds", "rounds", "decay")

    def __init__(self, window: float):
        self.tokens = self.seconds = self.rounds = 0.0
        self.decay = 1.0 - 1.0 / window

    def add(self, tokens: int, seconds: float, elapsed: int = 1) -> None:
        """One round, ``elapsed`` rounds (of whatever the rate's owner counts) after the last one added."""
        if self.rounds >= 1.0:
            seconds = min(seconds, OUTLIER * self.seconds / self.rounds)
        d = self.decay**elapsed
        self.tokens, self.seconds, self.rounds = self.tokens * d + tokens, self.seconds * d + seconds, self.rounds * d + 1

    def age(self, factor: float) -> None:
        self.tokens, self.seconds, self.rounds = self.tokens * factor, self.seconds * factor, self.rounds * factor


def load_bucket(batch: int) -> int:
    """Steps of nearby batch sizes share observed rates: each size below 8, then quarter octaves."""
    return batch if batch < 8 else 8 + round(4 * math.log2(batch / 8))


class PipelineCheck:
    """Whether the pipelined mode's drafting ahead pays, by observation at each load (the engine's steps where a
    model drafts for the target, under the adaptive controller).

    On separate devices the drafting ahead is hidden behind the target's pass; on one shared device (or CPU cores)
    it slows the pass it runs beside, and what a kept draft saves may not pay for that. So each such step drafts
    ahead when the observed rate R = tokens / seconds of those steps at this load is at least that of the steps
    that did not (the one unobserved is tried first), and every ``check_every`` steps runs the other mode for
    ``1 + CHECK_STEPS`` steps. A step whose mode differs from the previous step's is not counted: the first step
    drafting ahead has no drafts made ahead to start from, and the first step without starts from drafts it did
    not pay for."""

    CHECK_STEPS = 2

    def __init__(self, params: ControllerParams):
        self.params = params
        self.rates: dict[tuple[int, bool], Rate] = {}
        self.steps = 0
        self.check_until = -1  # the steps before this one run the mode the rates do not favour
        self.check_at = params.check_every
        self.last: bool | None = None  # the mode of the last observed step

    def favoured(self, batch: int) -> bool:
        """Drafting ahead, unless it was observed slower at this load (the unobserved mode is tried first)."""
        bucket = load_bucket(batch)
        ahead, plain = self.rates.get((bucket, True)), self.rates.get((bucket, False))
        if ahead is None or plain is None:
            return ahead is None
        return ahead.tokens / ahead.seconds >= plain.tokens / plain.seconds

    def ahead(self, batch: int) -> bool:
        """Whether this step drafts ahead."""
        if self.params.check_every and self.steps >= self.check_at:
            self.check_until = self.steps + 1 + self.CHECK_STEPS
            self.check_at = self.steps + self.params.check_every
        favoured = self.favoured(batch)
        self.steps += 1
        return favoured != (self.steps <= self.check_until)

    def observe(self, batch: int, ahead: bool, tokens: int, seconds: float) -> None:
        if ahead == self.last:
            self.rates.setdefault((load_bucket(batch), ahead), Rate(self.params.rate_window)).add(tokens, seconds)
        self.last = ahead


MAX_BACKOFF = 3  # explorations that change nothing stretch the interval to at most 8 × explore_every steps
CHECK_STEPS = 3  # steps of one check of the mode the observed rates do not favour
CHECK_RENEWAL = 0.05  # at a check's start, the weight kept by what was observed before of the mode it runs
BUDGET_HORIZON_S = 5.0  # the exploration budget saves up at most this many seconds' worth


class ObservedCheck:
    """Whether a mode of the engine's steps pays at the current load, by observation: the models drafting (against
    the target decoding plainly), or found n-gram continuations verified (against none).

    The throughput model decides by predictions whose error, where the gain is marginal (a sampling temperature, a
    loaded batch), is larger than the gain; steps observe the truth. The rate R = committed tokens / seconds of the
    steps run with the mode and of those run without it is kept per load (:func:`load_bucket`), decayed over
    ``rate_window`` of the engine's steps, so that a mode run only in checks is judged by its recent steps.
    :meth:`runs` turns a mode the plan wants off where its steps were observed slower, and every ``check_every``
    steps a check runs the mode the rates do not favour for ``CHECK_STEPS`` whole steps (every request of a step
    alike), so that a change in content shows: up to 8 times less often while checks keep confirming the rates'
    verdict, since a check costs every request of its steps, and only once the explorations' budget covers what it
    is predicted to cost (:meth:`GlobalStats.affords`).
    That holds where the mode is favoured too (a check then runs without it), and a check re-measures the mode it
    runs: what was observed of it before at this load keeps ``CHECK_RENEWAL`` of its weight (all of its rate, if
    none of the check's steps counts). Otherwise one early observation of the other mode decides for as long as the
    load lasts: traced at 64 sampled requests, the first plain steps at that load ran beside the prefill of a burst
    of arriving prompts, slowly, and the small model then drafted for the rest of the level, unchecked. A mode
    unobserved at a load is run (or, where the plan only may want it, not); the other is what a check runs there.
    With ``off_first`` (drafting), steps without the mode run first at a load where none was observed: they are the
    safe side, and they measure what the model would otherwise extrapolate there (the target's plain pass).

    A step whose mode differs from that of the last step that said something is not counted: the first drafting step
    after plain ones pays for the change (the drafters catch up on every token they did not see), which is not what
    drafting costs while it runs, and counting it made every check confirm that drafting does not pay. Steps that say
    nothing are passed over: at one client most steps verify a found continuation, which leaves a drafter only its
    few tokens to read, and counting a model step only right after another left the check one to three steps to
    judge by (fresh engines on the same prompts then read 144-315 tokens/s; 254-282 since)."""

    def __init__(self, params: ControllerParams, affords: Callable[[float], bool], off_first: bool = False):
        self.params = params
        self.affords = affords
        self.off_first = off_first  # at a load where steps without the mode are unobserved, run without it first  # whether the budget affords a check of a predicted cost now (GlobalStats.affords)
        self.rates: dict[tuple[int, bool], Rate] = {}  # (load bucket, mode on) -> observed rate
        self.seen: dict[tuple[int, bool], int] = {}  # (load bucket, mode on) -> the step it was last observed
        self.steps = 0  # steps observed
        self.check_at = params.check_every - 1  # the step from which the next check may run
        self.backoff = 0  # the interval is check_every · 2**backoff steps
        self.left = 0  # steps of the running check still to be observed
        self.verdict: bool | None = None  # what the rates said where the running check started
        self.checked_mode = False  # the mode its steps run: the other one
        self.last: bool | None = None  # the mode of the last observed step

    def observe(self, batch: int, on: bool | None, tokens: int, seconds: float) -> None:
        """An engine step of ``batch`` requests committed ``tokens`` in ``seconds``, with the mode ``on`` or not;
        None: the step says nothing about the mode (its requests ran it and did not, or an exploration ran). Every
        step counts towards the end of a check, so that one ends however its steps are mixed."""
        if on is not None and on == self.last:
            key = (load_bucket(batch), on)
            elapsed = self.steps - self.seen.get(key, self.steps - 1)
            self.rates.setdefault(key, Rate(self.params.rate_window)).add(tokens, seconds, elapsed)
            self.seen[key] = self.steps
        if on is not None:
            self.last = on
        if self.left:
            self.left -= 1
            # the check is over: schedule the next, less often while checks confirm the rates' verdict (where there
            # was none yet, that the mode does not pay)
            if not self.left:
                confirmed = self.observed(batch) is (False if self.verdict is None else self.verdict)
                self.backoff = min(self.backoff + 1, MAX_BACKOFF) if confirmed else 0
                self.check_at = self.steps + self.params.check_every * 2**self.backoff
        self.steps += 1

    @property
    def checked(self) -> bool:
        """The current step is part of a check."""
        return self.left > 0

    def observed(self, batch: int) -> bool | None:
        """Whether steps at this load have been observed faster with the mode than without (None while either kind
        is unobserved there)."""
        bucket = load_bucket(batch)
        on, off = self.rates.get((bucket, True)), self.rates.get((bucket, False))
        if on is None or off is None:
            return None
        return on.tokens / on.seconds > off.tokens / off.seconds

    @property
    def due(self) -> bool:
        """A check may start at this step, if the budget affords it."""
        return not self.left and bool(self.params.check_every) and self.steps >= self.check_at

    def runs(self, batch: int, unobserved: bool = True, cost: Callable[[], float] | None = None) -> bool:
        """Whether a step of ``batch`` requests runs the mode: as observed faster or slower at this load, or
        ``unobserved`` where either kind is unobserved there; a check aside. Starts a check when one is due and the
        budget affords it: ``cost()``, the seconds a check that runs the mode is predicted to cost beyond its steps
        (the drafters catching up on the batch's contexts; one that runs without it costs nothing of the kind)."""
        if self.due:
            # the other mode than the rates favour; or, while plain steps are to be observed first, those
            observed, mode = self.observed(batch), not self._favoured(batch, unobserved) and not self._off_first(batch)
            if self.affords(cost() if mode and cost is not None else 0.0):
                self.left, self.verdict, self.checked_mode = CHECK_STEPS, observed, mode  # a check starts
                earlier = self.rates.get((load_bucket(batch), mode))
                if earlier is not None:  # it re-measures that mode here: what was seen of it before weighs less
                    earlier.age(CHECK_RENEWAL)
        return self.mode(batch, unobserved, cost)

    def _favoured(self, batch: int, unobserved: bool) -> bool:
        """The mode the observed rates favour at this load, checks aside: where both kinds of step were observed,
        the faster; where steps without the mode were not and ``off_first``, none; else ``unobserved``."""
        observed = self.observed(batch)
        if observed is not None:
            return observed
        return unobserved and not self._off_first(batch)

    def _off_first(self, batch: int) -> bool:
        """Steps without the mode are to be observed first at this load (``off_first``, and none was)."""
        return self.off_first and (load_bucket(batch), False) not in self.rates

    def _repays(self, batch: int, seconds: float) -> bool:
        """Whether turning the mode on after a step without it pays for the ``seconds`` the change costs at once
        (the drafters catching up on every context of the batch): what it saves over ``rate_window`` steps at the
        observed rates, ``H · N · (1/R_off − 1/R_on)`` with N the tokens of a step, must exceed them (unobserved:
        it does). Traced at 64 greedy requests in a closed loop: a drafting step after plain ones took 100–250 ms of
        catching up against a 40 ms step, drafting steps as they ran were within 5% of plain ones either way, and
        the changes of mode alone made Cascade 5% slower than the target alone."""
        bucket = load_bucket(batch)
        on, off = self.rates.get((bucket, True)), self.rates.get((bucket, False))
        if on is None or off is None or seconds <= 0.0:
            return True
        saved = self.params.rate_window * off.tokens / off.rounds * (off.seconds / off.tokens - on.seconds / on.tokens)
        return saved > seconds

    def mode(self, batch: int, unobserved: bool = True, cost: Callable[[], float] | None = None) -> bool:
        """What :meth:`runs` answers now, without starting a check. ``cost``: as for :meth:`runs`; after a step
        without the mode, the mode runs only where it repays that cost (:meth:`_repays`)."""
        if self.checked:
            return self.checked_mode
        on = self._favoured(batch, unobserved)
        if on and cost is not None and self.last is False:
            return self._repays(batch, cost())
        return on

    @property
    def checking_on(self) -> bool:
        """The current step is part of a check that runs the mode."""
        return self.checked and self.checked_mode


class GlobalStats:
    """What all requests of one sampling regime have taught: acceptance per stage pair and the cost curve of every
    stage (an engine keeps one per regime: greedy acceptance says little about acceptance at a temperature, and a
    pass over sampled requests costs more, its logits warped and sampled over the whole vocabulary)."""

    def __init__(self, num_stages: int, params: ControllerParams = ControllerParams()):
        self.params = params
        # acceptance per stage pair, read through pair_alpha (which first applies the rounds' aging)
        self._alpha = {(i, j): Decayed(params.window) for i in range(num_stages) for j in range(i + 1, num_stages)}
        self.costs = [StageCost() for _ in range(num_stages)]
        self.rounds = 0  # decisions made by all requests together
        self._unaged = 0  # rounds that have not aged ``_alpha`` yet (age)
        self.all_tried = False  # every stage pair has been observed at least once
        self.switches = 0  # times a request's plan moved to another chain
        self.plan: Plan | None = None  # the plan every request runs (explorations and found continuations aside)
        # Plans are for rounds drafted ahead (cascade.controller.model's T^pipe): the engine sets it each step, in
        # the pipelined mode, while drafting ahead is observed to pay at the step's load (PipelineCheck).
        self.pipelining = params.pipelined
        self.planned_round = 0  # the decision at which it was last re-optimised
        self.planned_bucket = -1  # and the load bucket it was re-optimised for (load_bucket)
        self.explore_at = params.explore_every  # the round from which the next exploration may run
        self.explore_backoff = 0  # the interval is explore_every · batch · 2**explore_backoff rounds
        self._switches_at_exploration = 0
        # steps where the models drafted, against plain ones; at a new load plain steps first: they measure the
        # target's plain pass there, which the model otherwise extrapolates (traced at 64 sampled requests after
        # one client: it priced the target alone at a third of its rate, and the small model drafted, 15% slower)
        self.drafting = ObservedCheck(params, self.affords, off_first=True)
        self.lookups = ObservedCheck(params, self.affords)  # steps that verified found continuations, against none
        self.alone: Plan | None = None  # the target alone, planned with ``plan``
        self.marginal: Plan | None = None  # the best drafting plan, when predicted faster only within the margin
        self.lookup_memo: tuple[tuple, LookupValue] | None = None  # (plan, batch, step size) -> lookup base
        self.normal_rates: dict[int, Rate] = {}  # load bucket -> tokens/s of steps without explorations or checks
        self.budget = 0.0  # seconds explorations and checks may still cost (see observe_spending)
        self.saving_for = 0.0  # the predicted cost of a check waiting for the budget to cover it (see affords)
        self.backlog: list[int] = [0] * num_stages  # per stage: the tokens of the step's contexts it has not read
        self.prompt_rate = 0.0  # P: prompt tokens the target prefilled per engine step, a decayed mean

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
        cap = max(self.params.explore_budget * BUDGET_HORIZON_S, self.saving_for)
        self.budget = min(self.budget + self.params.explore_budget * seconds, cap)

    def observe_prefill(self, tokens: int) -> None:
        """Every engine step: the prompt tokens the target prefilled in it. Each model drafter that drafts reads
        them once too (the catch-up term of :func:`cascade.controller.model.plan_chain`)."""
        self.prompt_rate += (tokens - self.prompt_rate) / self.params.rate_window

    @property
    def checked(self) -> bool:
        """The current step is part of a check of either mode."""
        return self.drafting.checked or self.lookups.checked

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

    def catch_up(self, chain: Sequence[int], model_free: Sequence[bool]) -> float:
        """Seconds the model drafters of ``chain`` would take to read what they have not read of the step's
        contexts (``backlog``, which the engine sets where a check is due or the last step did not draft), by their cost
        curves."""
        return sum(self.costs[i].decoding(self.backlog[i]) for i in chain[:-1] if not model_free[i] and self.backlog[i])

    def next_exploration(self, batch: int) -> None:
        """An exploration runs now: schedule the next one. The interval doubles (up to ``2**MAX_BACKOFF`` times)
        while explorations change no request's chain, and returns to ``explore_every`` steps when one does: where
        a bypassed stage keeps confirming that it does not pay (a drafter under heavy load), exploring it costs
        every request of the step a wait for its catch-up, for nothing."""
        if self.switches == self._switches_at_exploration:
            self.explore_backoff = min(self.explore_backoff + 1, MAX_BACKOFF)
        else:
            self.explore_backoff = 0
        self._switches_at_exploration = self.switches
        self.explore_at = self.rounds + self.params.explore_every * batch * 2**self.explore_backoff

    def age(self) -> None:
        """One round passed: estimates that are not refreshed fade, so one exploration round can renew them. Applied
        when they are next read or added to (every request of a step decides before any of its rounds is observed,
        so a step's rounds age them at once, not pair by pair per decision)."""
        self._unaged += 1

    def observe_alpha(self, pair: tuple[int, int], num: float, den: float) -> None:
        self._age_now()
        self._alpha[pair].add(num, den)

    def pair_alpha(self, i: int, j: int) -> float | None:
        self._age_now()
        s = self._alpha[(i, j)]
        return s.num / s.den if s.den > 1e-9 else None

    def _age_now(self) -> None:
        if self._unaged:
            factor = (1.0 - 1.0 / self.params.stale_rounds) ** self._unaged
            for s in self._alpha.values():
                s.age(factor)
            self._unaged = 0
