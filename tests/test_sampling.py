"""Warping matches transformers' own logits processors (an oracle nobody here wrote); plain samples follow their
distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare, kstest
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cascade.sampling import SamplingParams, sample_rows, warp
from cascade.verify.batch import verification_draws


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.3, 20, 0.5, 0.0),
     (0.5, 1, 1.0, 0.0), (1.0, 0, 0.01, 0.0), (1.0, 0, 1.0, 0.1), (1.5, 10, 0.9, 0.3), (0.8, 0, 1.0, 1.0)],
)
def test_warp_matches_transformers(temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    if min_p:
        expected = MinPLogitsWarper(min_p)(None, expected)
    ours = warp(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    assert torch.allclose(ours, expected.softmax(dim=-1), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
     ({"min_p": -0.1}, "min_p"), ({"min_p": 1.1}, "min_p")],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sample_rows_draws_each_token_with_its_probability():
    """Inverting the cumulative distribution samples it: frequencies over many draws pass a chi-square test, and a
    token of probability 0 (top-k/top-p removed it) is never drawn."""
    probs = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0])
    draws = 60_000
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(3))
    tokens = sample_rows(probs.expand(draws, -1), uniforms)
    counts = torch.bincount(tokens, minlength=probs.numel())
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    assert chisquare(counts[support].double().numpy(), (probs[support] * draws).double().numpy()).pvalue > 1e-3


def test_sample_rows_never_draws_past_the_last_token_with_mass():
    """The largest uniform below 1 gives the last token with mass, not an index past the vocabulary or a removed
    token after it; 0 gives the first token with mass."""
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1e-30, 0.0]])
    below_one = 1.0 - 2.0**-24
    assert sample_rows(probs, torch.tensor([below_one, 0.0, below_one])).tolist() == [1, 1, 2]


def test_verification_draws_of_a_request_do_not_depend_on_the_batch():
    """A request's acceptance uniforms and its final uniform are the same drawn alone as among others (its own
    generator, in the same order: those of ``torch.rand(count + 1)``), and they are U[0, 1): a Kolmogorov–Smirnov
    test."""
    def generators(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    alone_u, alone_final = verification_draws([3], generators([7]))
    uniforms, finals = verification_draws([2, 3, 0, 1], generators([1, 7, 4, 2]))
    assert torch.equal(uniforms[2:5], alone_u) and torch.equal(finals[1:2], alone_final)
    assert torch.equal(torch.cat([alone_u, alone_final]), torch.rand(4, generator=torch.Generator().manual_seed(7)))
    assert uniforms.shape == (6,) and finals.shape == (4,)
    many_u, many_finals = verification_draws([3] * 2000, generators(range(2000)))
    assert kstest(torch.cat([many_u, many_finals]).double().numpy(), "uniform").pvalue > 1e-3


@pytest.mark.parametrize("num_samples, stated", [(20_000, 0.0045), (8_000, 0.011), (2_000, 0.045)])
def test_the_chi_square_suites_tolerance_is_what_they_state(num_samples, stated):
    """The losslessness suites' chi-square test, as they call it, at their sample counts: an exact sampler fails it
    about once in a thousand runs, and a sampler off by the divergence stated for that count (tests/
    test_engine_sampling.py's docstring) is caught about nine times in ten."""
    from collections import Counter

    from tests.test_engine_sampling import VOCAB, chi_square_p_value, detectable_divergence

    divergence = detectable_divergence(num_samples)
    assert divergence == pytest.approx(stated, rel=0.05)
    generator = torch.Generator().manual_seed(num_samples)
    exact = torch.softmax(torch.randn(VOCAB * VOCAB, generator=generator, dtype=torch.float64), 0)
    direction = torch.randn(VOCAB * VOCAB, generator=generator, dtype=torch.float64)
    direction -= (exact * direction).sum()  # a change of mass that sums to zero
    off = exact * (1 + direction * (divergence / (exact * direction**2).sum()).sqrt())  # sum((off-exact)^2/exact)
    assert off.min() > 0 and (((off - exact) ** 2) / exact).sum().item() == pytest.approx(divergence)

    def rejections(q, trials=200):
        draws = torch.multinomial(q.expand(trials, -1), num_samples, replacement=True, generator=generator)
        failed = 0
        for row in draws.tolist():
            counts = Counter((cell // VOCAB, cell % VOCAB) for cell in row)
            failed += chi_square_p_value(counts, exact.reshape(VOCAB, VOCAB)) <= 1e-3
        return failed / trials

    assert rejections(exact) <= 0.02
    assert 0.8 <= rejections(off) <= 0.97


def test_position_noise_is_a_function_of_seed_and_position_whatever_is_cached():
    """A seeded request's noise row for position t is the same however positions are asked for (one at a time, in
    a batch, again from the cache, among other seeds') and after the cache has evicted it; the cache stays within its
    byte budget. The first row is pinned to its definition: −log(1 − U), U the 53-bit PCG64 outputs."""
    import numpy as np

    from cascade.sampling import _NoiseCache, coupled_sample, position_noise

    vocab = 50
    alone = torch.cat([position_noise(7, [t], vocab) for t in range(12)])
    assert torch.equal(position_noise(7, range(12), vocab), alone)
    assert torch.equal(position_noise(7, [3, 3, 11], vocab), alone[[3, 3, 11]])
    raw = np.random.PCG64(np.random.SeedSequence([7, 0])).random_raw(vocab)
    expected = -np.log1p(-(raw >> np.uint64(11)).astype(np.float64) * 2.0**-53)
    assert torch.allclose(alone[0].double(), torch.from_numpy(expected), rtol=1e-6)
    small = _NoiseCache(budget=5 * vocab * 4)  # five rows
    for start in (0, 6, 0):
        got = small.rows([(7, t) for t in range(start, start + 6)] + [(8, 1)], vocab)
        assert torch.equal(got[:6], alone[start: start + 6])
        assert small.used <= small.budget and len(small.kept) <= 5
    # coupled sampling reads the same rows: the argmax of p / E over them
    logits = torch.randn(2, 3, vocab)
    chosen = coupled_sample(list(logits), [SamplingParams(temperature=1.0)] * 2, [7, 8], [4, 9])
    for b, seed, first in ((0, 7, 4), (1, 8, 9)):
        probs = torch.softmax(logits[b], -1)
        assert torch.equal(chosen[b], (probs / position_noise(seed, range(first, first + 3), vocab)).argmax(-1))
