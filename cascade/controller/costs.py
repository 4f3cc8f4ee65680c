"""Measured forward costs: the curves the controller's throughput model reads (``cascade.controller.model``)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

OUTLIER = 3.0  # an observation counts at most this many times what was expected of it (CostFit, checks.Rate)
_REFRESH = 8  # the curve is solved again every this many observations (one moves a decayed mean little; plans
# ask for the curve every few rounds of every request)


class CostFit:
    """c(t): the seconds of a forward pass over t new tokens (all of a step's), from measured passes.

    Passes are kept per token count (each count below 16, then quarter octaves), as decayed means of their token
    counts and times. Between the counts seen, c interpolates their means linearly (made non-decreasing by pooling
    adjacent counts that violate it, weighted by how often each was seen); beyond them it follows the slope of a
    line fitted through the nearest means (weights falling off with the distance in octaves, σ = 1; never
    negative). Counts remember apart, so the curve keeps its shape — flat then linear on a GPU, a jump when the
    first draft is verified — while a steady load keeps the count at one value for long: one line fitted with a
    global decay then loses its slope, and extra tokens look free. A stage with a roofline ``prior`` (emulated, or
    with a ``profile``) keeps the roofline's shape instead: the measured means scale it, by their ratio to it
    interpolated between the counts seen (:meth:`_calibrated`), so the knee where its passes turn compute-bound stays
    where the roofline puts it however few counts were seen.

    A pass counts at most ``OUTLIER`` times its count's mean (or, for a count not seen yet, what the curve
    interpolates for it). A pass that a pause stretched — a KV cache growing by a copy of every slot, a collection,
    another process taking the core — would otherwise hold up a rarely seen count's mean for dozens of passes, and
    every count above it: measured, one cache growth inside a 9-position pass of the demo target priced depth 8 at
    11 ms against 3. A real rise in cost is still followed, each pass may triple the mean.
    """

    def __init__(self, prior_seconds: float = 1e-3, decay: float = 0.95, prior: Callable[[int], float] | None = None):
        """``prior``: c(t) until the first pass is measured (a stage's roofline, ``cascade.emulation.PassModel``);
        without one, a flat ``prior_seconds``."""
        self.decay = decay
        self.prior = prior if prior is not None else (lambda tokens: prior_seconds)
        self._shaped = prior is not None  # measurements scale the prior's shape (else: interpolated as they are)
        self._ratios: list[float] | None = None  # measured / prior at each count seen (with a prior)
        self._counts: dict[int, list[float]] = {}  # bucket -> [weight, Σ w·t, Σ w·seconds]
        self._curve: tuple[list[float], list[float], float, float] | None = None  # t̄s, means, slope below, above
        self._tables: dict[tuple[int, int], list[float]] = {}  # (batch, size) -> [0, c(B·1), …, c(B·size)]
        self._fresh = 0  # observations since the curve was last solved

    @property
    def observed(self) -> bool:
        return bool(self._counts)

    @property
    def informed(self) -> bool:
        """Its shape comes from somewhere: measured passes, or a prior curve (not the flat guess)."""
        return self._shaped or self.observed

    def add(self, tokens: int, seconds: float) -> None:
        tokens = max(tokens, 1)
        bucket = tokens if tokens < 16 else 12 + round(4 * math.log2(tokens))
        sums = self._counts.get(bucket)
        if sums is not None:
            seconds = min(seconds, OUTLIER * sums[2] / sums[0])
        elif self._counts:
            ts = self._solved()[0]
            if ts[0] <= tokens <= ts[-1]:  # between counts seen: the curve's interpolation is a fair expectation
                seconds = min(seconds, OUTLIER * self(tokens))
            sums = self._counts[bucket] = [0.0, 0.0, 0.0]
            self._fresh = _REFRESH  # a new count reshapes the curve: solved again when next asked
        else:
            sums = self._counts[bucket] = [0.0, 0.0, 0.0]
        d = self.decay
        sums[0], sums[1], sums[2] = sums[0] * d + 1, sums[1] * d + tokens, sums[2] * d + seconds
        self._fresh += 1
        if self._fresh >= _REFRESH:
            self._curve, self._ratios, self._fresh = None, None, 0
            self._tables.clear()

    def __call__(self, tokens: int) -> float:
        if not self._counts:
            return self.prior(tokens)
        if self._shaped:
            return self._calibrated(tokens)
        ts, cs, below, above = self._solved()
        if tokens <= ts[0]:
            return max(cs[0] - below * (ts[0] - tokens), 1e-7)
        if tokens >= ts[-1]:
            return cs[-1] + above * (tokens - ts[-1])
        i = bisect.bisect_left(ts, tokens)
        return cs[i - 1] + (cs[i] - cs[i - 1]) * (tokens - ts[i - 1]) / (ts[i] - ts[i - 1])

    def _calibrated(self, tokens: int) -> float:
        """c(t) where the stage has a roofline prior: the prior's shape, scaled by what the passes measured — the
        ratio measured/prior interpolated between the counts seen (held beyond them). The roofline knows where a
        pass turns compute-bound, which two counts seen far apart do not: measured at 64 and 256 positions, a line
        between them priced a 70B's pass over 192 at 52.5 ms on emulated MI300X, where the roofline (and the pass)
        says 44.3, and the controller drafted one token deeper than paid."""
        ts, cs, _, _ = self._solved()
        if self._ratios is None:
            self._ratios = [c / max(self.prior(round(t)), 1e-9) for t, c in zip(ts, cs)]
        ratios = self._ratios
        if tokens <= ts[0]:
            ratio = ratios[0]
        elif tokens >= ts[-1]:
            ratio = ratios[-1]
        else:
            i = bisect.bisect_left(ts, tokens)
            ratio = ratios[i - 1] + (ratios[i] - ratios[i - 1]) * (tokens - ts[i - 1]) / (ts[i] - ts[i - 1])
        return max(ratio * self.prior(tokens), 1e-7)

    def table(self, batch: int, size: int) -> list[float]:
        """``[0, c(B·1), …, c(B·size)]``, kept until the next observation (plans ask for it many times a step)."""
        key = (batch, size)
        if key not in self._tables:
            self._tables[key] = [0.0] + [self(batch * t) for t in range(1, size + 1)]
        return self._tables[key]

    def _solved(self) -> tuple[list[float], list[float], float, float]:
        if self._curve is None:
            self._curve = self._solve()
        return self._curve

    def _solve(self) -> tuple[list[float], list[float], float, float]:
        points = sorted((t / w, c / w, w) for w, t, c in self._counts.values())
        # A pass over more tokens costs no less: adjacent counts that say otherwise are pooled (each block the mean
        # of its counts weighted by how often each was seen), so one dear count does not lift every count above it.
        blocks: list[list[float]] = []  # [Σ w, Σ w·c, counts]
        for _, c, w in points:
            blocks.append([w, w * c, 1])
            while len(blocks) > 1 and blocks[-2][1] / blocks[-2][0] > blocks[-1][1] / blocks[-1][0]:
                weight, total, counts = blocks.pop()
                blocks[-1][0] += weight
                blocks[-1][1] += total
                blocks[-1][2] += counts
        ts = [t for t, _, _ in points]
        cs = [max(total / weight, 1e-7) for weight, total, counts in blocks for _ in range(int(counts))]
        means = [(t, c) for t, c, _ in points]
        return ts, cs, self._slope(means, ts[0]), self._slope(means, ts[-1])

    @staticmethod
    def _slope(points: list[tuple[float, float]], around: float) -> float:
        """The slope of the least-squares line through ``points`` weighted by exp(−d²/2), d their distance from
        ``around`` in octaves; 0 when they do not tell (one count) or it would be negative."""
        center = math.log2(around)
        sw = st = sc = stt = stc = 0.0
        for t, c in points:
            k = math.exp(-0.5 * (math.log2(t) - center) ** 2)
            sw, st, sc, stt, stc = sw + k, st + k * t, sc + k * c, stt + k * t * t, stc + k * t * c
        var = stt * sw - st * st
        if var <= 1e-9 * max(1.0, sw * stt):
            return 0.0
        return max((stc * sw - st * sc) / var, 0.0)


class StageCost:
    """A stage's two cost curves: passes that verify drafts, and plain passes that only decode (a drafter drafting,
    the target alone), which cost less than their token count says — no drafts to attend apart or to verify. A
    curve with no observation yet answers with the other, and with neither, the ``prior`` (flat without one)."""

    def __init__(self, prior: Callable[[int], float] | None = None) -> None:
        self.verify = CostFit(prior=prior)
        self.plain = CostFit(prior=prior)

    def add(self, tokens: int, seconds: float, plain: bool = False) -> None:
        (self.plain if plain else self.verify).add(tokens, seconds)

    @property
    def verifying(self) -> CostFit:
        return self.verify if self.verify.observed or not self.plain.observed else self.plain

    @property
    def decoding(self) -> CostFit:
        return self.plain if self.plain.observed or not self.verify.observed else self.verify
