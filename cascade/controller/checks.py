"""The engine's steps observed: tokens per second of the steps that ran a mode and of those that did not, per load,
and the checks that keep both measured (drafting against plain decoding, found continuations against none, drafting
ahead against not). ``cascade.controller.shared.GlobalStats`` holds them; ``cascade.controller.adaptive`` decides
with them."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from cascade.controller.costs import OUTLIER

if TYPE_CHECKING:
    from cascade.controller.params import ControllerParams


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
    ``1 + pipeline_check_steps`` steps. A step whose mode differs from the previous step's is not counted: the first step
    drafting ahead has no drafts made ahead to start from, and the first step without starts from drafts it did
    not pay for."""

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
            self.check_until = self.steps + 1 + self.params.pipeline_check_steps
            self.check_at = self.steps + self.params.check_every
        favoured = self.favoured(batch)
        self.steps += 1
        return favoured != (self.steps <= self.check_until)

    def observe(self, batch: int, ahead: bool, tokens: int, seconds: float) -> None:
        if ahead == self.last:
            self.rates.setdefault((load_bucket(batch), ahead), Rate(self.params.rate_window)).add(tokens, seconds)
        self.last = ahead


def faster(on: Rate, off: Rate, margin: float) -> bool:
    """Whether the steps of rate ``on`` were observed faster than those of ``off``, by ``margin`` (a fraction)."""
    return on.tokens / on.seconds > (1.0 + margin) * off.tokens / off.seconds


class ObservedCheck:
    """Whether a mode of the engine's steps pays at the current load, by observation: the models drafting (against
    the target decoding plainly), or found n-gram continuations verified (against none).

    The throughput model decides by predictions whose error, where the gain is marginal (a sampling temperature, a
    loaded batch), is larger than the gain; steps observe the truth. The rate R = committed tokens / seconds of the
    steps run with the mode and of those run without it is kept per load (:func:`load_bucket`), decayed over
    ``rate_window`` of the engine's steps, so that a mode run only in checks is judged by its recent steps.
    :meth:`runs` turns a mode the plan wants off where its steps were observed slower, and every ``check_every``
    steps a check runs the mode the rates do not favour for ``check_steps`` whole steps (every request of a step
    alike), so that a change in content shows: up to 8 times less often while checks keep confirming the rates'
    verdict, since a check costs every request of its steps, and only once the explorations' budget covers what it
    is predicted to cost (:meth:`GlobalStats.affords`).
    That holds where the mode is favoured too (a check then runs without it), and a check re-measures the mode it
    runs: what was observed of it before at this load keeps ``check_renewal`` of its weight (all of its rate, if
    none of the check's steps counts). Otherwise one early observation of the other mode decides for as long as the
    load lasts: traced at 64 sampled requests, the first plain steps at that load ran beside the prefill of a burst
    of arriving prompts, slowly, and the small model then drafted for the rest of the level, unchecked. A load where
    either kind of step is unobserved is judged by the nearest load observed with both (:meth:`_pair`); a mode
    unobserved there and near it is run (or, where the plan only may want it, not); the other is what a check runs.
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
        self.affords = affords  # whether the budget affords a check of a predicted cost now (GlobalStats.affords)
        self.off_first = off_first  # at a load where steps without the mode are unobserved, run without it first
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
                self.backoff = min(self.backoff + 1, self.params.max_backoff) if confirmed else 0
                self.check_at = self.steps + self.params.check_every * 2**self.backoff
        self.steps += 1

    @property
    def checked(self) -> bool:
        """The current step is part of a check."""
        return self.left > 0

    def _pair(self, batch: int) -> tuple[Rate, Rate] | None:
        """The rates with and without the mode at this load, or, where either is unobserved, at the nearest load
        within ``nearby_buckets`` where both are (the smaller one first); None where none is. A batch passes through
        many loads as a level ramps up or drains, and at each new one the mode was taken to pay until observed: a
        drafting step there made the small model catch up on every context first (traced at 64 sampled requests: one
        such step of 280 ms at 42 requests, 4% of the decode time of the run, where the loads around had long shown
        drafting slower)."""
        bucket = load_bucket(batch)
        for near in (bucket, *(b for d in range(1, self.params.nearby_buckets + 1) for b in (bucket - d, bucket + d))):
            on, off = self.rates.get((near, True)), self.rates.get((near, False))
            if on is not None and off is not None:
                return on, off
        return None

    def observed(self, batch: int) -> bool | None:
        """Whether steps at this load (or the nearest observed one, :meth:`_pair`) have been observed faster with the
        mode than without (by ``observed_margin``); where no nearby load observed both, what a load farther off
        implies (:meth:`_bounded`), else None."""
        pair = self._pair(batch)
        if pair is None:
            return self._bounded(batch)
        return faster(*pair, self.params.observed_margin)

    def _bounded(self, batch: int) -> bool | None:
        """The mode's verdict at a load observed both ways farther off, where it carries over: either mode adds
        positions to every request's pass, and a pass costs more per position the more requests share it (on a GPU
        as it turns compute-bound, on a CPU as the attention's reads grow), so a mode slower at a lighter load is
        slower here, and one faster at a heavier load is faster here. None where neither is known. Traced at 64
        sampled requests after a 16-client level where drafting ran slower: as the batch first reached 59 requests,
        two drafting steps made the small model catch up on every context (0.165 s, 4% of the level's decode time)
        and observed what the lighter load had said."""
        bucket = load_bucket(batch)
        lighter = [b for b, mode in self.rates if mode and b < bucket and (b, False) in self.rates]
        heavier = [b for b, mode in self.rates if mode and b > bucket and (b, False) in self.rates]
        for near, slower in ((max(lighter, default=None), True), (min(heavier, default=None), False)):
            if near is None:
                continue
            if faster(self.rates[(near, True)], self.rates[(near, False)], self.params.observed_margin) is not slower:
                return not slower
        return None

    @property
    def due(self) -> bool:
        """A check may start at this step, if the budget affords it."""
        return not self.left and bool(self.params.check_every) and self.steps >= self.check_at

    def runs(self, batch: int, unobserved: bool = True, cost: Callable[[], float] | None = None) -> bool:
        """Whether a step of ``batch`` requests runs the mode: as observed faster or slower at this load or the nearest
        observed one (:meth:`_pair`), or ``unobserved`` where there is none; a check aside. Starts a check when one is
        due and the budget affords it: ``cost()``, the seconds a check that runs the mode is predicted to cost beyond its steps
        (the drafters catching up on the batch's contexts; one that runs without it costs nothing of the kind)."""
        if self.due:
            # the other mode than the rates favour; or, while plain steps are to be observed first, those
            observed, mode = self.observed(batch), not self._favoured(batch, unobserved) and not self._off_first(batch)
            if self.affords(cost() if mode and cost is not None else 0.0):
                self.left, self.verdict, self.checked_mode = self.params.check_steps, observed, mode  # a check starts
                earlier = self.rates.get((load_bucket(batch), mode))
                if earlier is not None:  # it re-measures that mode here: what was seen of it before weighs less
                    earlier.age(self.params.check_renewal)
        return self.mode(batch, unobserved, cost)

    def _favoured(self, batch: int, unobserved: bool) -> bool:
        """The mode the observed rates favour at this load, checks aside: where both kinds of step were observed
        here or nearby (:meth:`_pair`), the faster; where steps without the mode were not and ``off_first``, none;
        else ``unobserved``."""
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
        observed rates (here or nearby, :meth:`_pair`), ``H · N · (1/R_off − 1/R_on)`` with N the tokens of a step,
        must exceed them (where no load nearby observed both: it does). Traced at 64 greedy requests in a closed loop:
        a drafting step after plain ones took 100–250 ms of catching up against a 40 ms step, drafting steps as they
        ran were within 5% of plain ones either way, and the changes of mode alone made Cascade 5% slower than the
        target alone."""
        pair = self._pair(batch)
        if pair is None or seconds <= 0.0:
            return True
        on, off = pair
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
