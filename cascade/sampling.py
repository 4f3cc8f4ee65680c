"""Sampling parameters and the warping of logits into the distributions every stage samples from.

The same ``warp`` is applied to every stage's logits, so ``p`` and ``q`` in verification are both *warped*
distributions (DESIGN.md, "Verification"). The order is the one Hugging Face's logits processors use:
temperature, then top-k, then top-p, then min-p. (Penalties, which depend on the tokens before each row, are the
target's alone: :mod:`cascade.penalties`.)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MIN_TEMPERATURE = 1e-5  # below it a temperature is greedy decoding (as vLLM does): logits divided by 1e-40 overflow
# float32 to ±inf, every probability becomes NaN, and a drawn index falls outside the vocabulary


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy; so does anything below MIN_TEMPERATURE
    top_k: int = 0  # 0 means no top-k filtering
    top_p: float = 1.0  # 1 means no nucleus filtering
    min_p: float = 0.0  # tokens less likely than min_p times the most likely one are dropped; 0 disables it

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # greedy: the limit of sampling as T -> 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


BROKEN_ROW = -1  # the "token" a stage's argmax gives for a row that is not finite (finite_rows): never a real id


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits`` [rows, vocab]: whether it can be warped into a distribution — no NaN, no +inf, some
    finite value (-inf alone marks tokens masked out). A row that fails would give NaN probabilities and a drawn
    index past the vocabulary. One reduction: a row's max is NaN if any value is, +inf if any is, and -inf only if
    all are. -> [rows] bool"""
    return torch.isfinite(logits.amax(-1))


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p.

    logits: [rows, vocab] -> probs: [rows, vocab] (float32, each row sums to 1)
    """
    assert not params.greedy, "greedy decoding uses argmax, not warped probabilities"
    logits = logits.float() / params.temperature  # [rows, vocab]
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [rows, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)  # [rows, vocab], ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose total mass is <= 1 - top_p; the most likely token always stays.
        drop_sorted = cumulative <= (1.0 - params.top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.min_p > 0.0:  # the most likely token always stays (its probability is the row's max)
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def warp_grouped(logits: Sequence[torch.Tensor], params: Sequence[SamplingParams]) -> list[torch.Tensor]:
    """``warp`` of each request's rows, one call per distinct sampling setting in the batch."""
    out: list[torch.Tensor | None] = [None] * len(logits)
    for setting in dict.fromkeys(params):
        members = [b for b, p in enumerate(params) if p == setting]
        warped = warp(torch.cat([logits[b] for b in members]), setting)  # [Σ positions, vocab]
        for b, rows in zip(members, warped.split([logits[b].shape[0] for b in members])):
            out[b] = rows
    return out


def sample_rows(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row by inverting its cumulative distribution: the first token whose cumulative weight exceeds
    ``u`` times the row's total. weights: [rows, vocab] (non-negative, any positive total: a distribution or a
    residual ``max(p − q, 0)``), uniforms: [rows] in [0, 1) -> [rows]. A token of weight 0 is never drawn.

    The definition every verification implementation follows (``cascade.verify``: the reference, the Triton and native kernels):
    cumulative sums in float64 over the float32 weights, the threshold ``u · total`` in float64, the first index
    whose sum exceeds it. The threshold is below the total (u < 1), so that index exists, and it has weight of its
    own (a token of weight 0 repeats the sum before it exactly). Implementations that sum in another order agree
    except where the threshold falls within float64 rounding of a boundary (about 1e-16 of the row's mass)."""
    cdf = weights.double().cumsum(dim=-1)  # [rows, vocab]
    threshold = uniforms.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]  # [rows, 1]
    return torch.searchsorted(cdf, threshold, right=True).squeeze(1)  # [rows]


# ---- shared-noise (coupled) sampling: seeded requests --------------------------------------------------------


def position_noise(seed: int, positions: Sequence[int], vocab: int) -> torch.Tensor:
    """Exp(1) draws [len(positions), vocab], one row per absolute position of a sequence, keyed by ``(seed,
    position)`` alone: whoever asks for position t of a seeded request, whenever, gets the same row. Row t is
    ``−log(1 − U)`` of the first ``vocab`` 53-bit outputs of PCG64 seeded by NumPy's ``SeedSequence([seed, t])`` —
    both specified algorithms, so the noise does not change with library versions or devices.

    Every stage of a chain asks for the same positions of a request (the drafters as they draft, each verifier as it
    verifies), so rows are kept in a small cache (:data:`NOISE_CACHE_BYTES`); the rows missing from it are made
    together, a few rows per conversion."""
    return _NOISE.rows([(seed, t) for t in positions], vocab)


NOISE_CACHE_BYTES = 64 << 20  # per process: 5,000 rows of a 3,000-token vocabulary, 128 of a 128k one


class _NoiseCache:
    """The last rows :func:`position_noise` made, least recently used first out, up to a byte budget; shared by the
    step's thread and the pipelined mode's drafting thread."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.kept: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()
        self.lock = threading.Lock()

    def rows(self, keys: Sequence[tuple[int, int]], vocab: int) -> torch.Tensor:
        """The rows of ``(seed, position)`` keys: [len(keys), vocab]."""
        keys = [(seed, t, vocab) for seed, t in keys]
        with self.lock:
            found = [self.kept.get(key) for key in keys]
            for key, row in zip(keys, found):
                if row is not None:
                    self.kept.move_to_end(key)
        missing = list(dict.fromkeys(key for key, row in zip(keys, found) if row is None))
        if missing:
            # (each row its own storage: a kept row must not hold its whole batch's memory)
            made = dict(zip(missing, [row.clone() for row in _exponential_rows([key[:2] for key in missing], vocab)]))
            found = [made[key] if row is None else row for key, row in zip(keys, found)]
            with self.lock:
                for key, row in made.items():
                    if key not in self.kept:
                        self.kept[key] = row
                        self.used += row.nbytes
                while self.used > self.budget and self.kept:
                    self.used -= self.kept.popitem(last=False)[1].nbytes
        return torch.stack(found) if found else torch.empty(0, vocab)


def _exponential_rows(keys: Sequence[tuple[int, int]], vocab: int) -> list[torch.Tensor]:
    """:func:`position_noise`'s rows of ``(seed, position)`` keys, made a few at a time (the conversion's float64
    temporaries stay within ~4 MiB: a whole step's rows of a 128k vocabulary at once ran 2.3x slower): [vocab] each."""
    chunk = max(1, (1 << 19) // vocab)
    return [row for start in range(0, len(keys), chunk) for row in _convert(keys[start: start + chunk], vocab)]


def _convert(keys: Sequence[tuple[int, int]], vocab: int) -> torch.Tensor:  # [len(keys), vocab]
    rows = np.empty((len(keys), vocab), dtype=np.uint64)
    for row, key in zip(rows, keys):
        row[:] = np.random.PCG64(np.random.SeedSequence(list(key))).random_raw(vocab)
    uniform = torch.from_numpy((rows >> np.uint64(11)).astype(np.float64)).mul_(2.0**-53)  # U[0, 1)
    return uniform.neg_().log1p_().neg_().clamp_min_(torch.finfo(torch.float32).tiny).float()


_NOISE = _NoiseCache(NOISE_CACHE_BYTES)


def coupled_sample(logits: Sequence[torch.Tensor], params: Sequence[SamplingParams], seeds: Sequence[int],
                   first_positions: Sequence[int | Sequence[int]]) -> list[torch.Tensor]:
    """The token each row of each request's ``logits[b]`` ([rows, vocab]) samples with the request's shared noise:
    ``argmax(p_t / E_t)``, ``p_t`` this stage's warped distribution at absolute position ``first_positions[b] + row``
    (or the row's own position, where a list gives them: a draft tree's rows sit at their nodes' depths) and ``E_t``
    that position's :func:`position_noise` — the exponential race, so each token is an exact sample of ``p_t``
    (DESIGN.md, "Randomness"). One warp per distinct setting and one race over every row of the batch; each row's
    token is what it alone would give. -> [rows] per request"""
    if not logits:
        return []
    probs = torch.cat(warp_grouped(logits, params))  # [Σ rows, vocab]
    keys = []
    for rows, seed, first in zip(logits, seeds, first_positions):
        positions = range(first, first + rows.shape[0]) if isinstance(first, int) else first
        keys.extend((seed, t) for t in positions)
    noise = _NOISE.rows(keys, probs.shape[-1])  # position_noise's rows, all of the step's at once
    chosen = (probs / noise.to(probs.device)).argmax(dim=-1)
    return list(chosen.split([rows.shape[0] for rows in logits]))
