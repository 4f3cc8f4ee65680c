"""Warping matches transformers' own logits processors (an oracle nobody here wrote); plain samples follow their
distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare, kstest
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from cascade.sampling import SamplingParams, sample_rows, verification_draws, warp


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8), (1.3, 20, 0.5), (0.5, 1, 1.0), (1.0, 0, 0.01)],
)
def test_warp_matches_transformers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    ours = warp(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.allclose(ours, expected.softmax(dim=-1), atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
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
    """A threshold at the row's total (where rounding can put a draw close to 1) gives the last token with mass,
    not an index past the vocabulary or a removed token after it."""
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    assert sample_rows(probs, torch.tensor([1.0, 0.0])).tolist() == [1, 0]


def test_verification_draws_of_a_request_do_not_depend_on_the_batch():
    """A request's acceptance uniforms and race row are the same drawn alone as among others (its own generator,
    in the same order), and the race rows are Exp(1): a Kolmogorov–Smirnov test, and never 0."""
    def generators(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    vocab = 5_000
    alone_u, alone_races = verification_draws([3], vocab, generators([7]))
    uniforms, races = verification_draws([2, 3, 1], vocab, generators([1, 7, 2]))
    assert torch.equal(uniforms[2:5], alone_u) and torch.equal(races[1], alone_races[0])
    assert uniforms.shape == (6,) and races.shape == (3, vocab) and races.min() > 0
    assert kstest(races.flatten().double().numpy(), "expon").pvalue > 1e-3
