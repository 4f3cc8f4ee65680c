"""Warping matches transformers' own logits processors (an oracle nobody here wrote)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from cascade.sampling import SamplingParams, warp


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
