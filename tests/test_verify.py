"""The verification reference: greedy and sampling, batched and ragged."""

from __future__ import annotations

import torch

from cascade.verify.reference import PLACEHOLDER_TOKEN_ID as PAD
from cascade.verify.reference import matching, sampling


def _one_hot_rows(tokens, vocab):
    rows = torch.full((len(tokens), vocab), 0.0)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return rows


def test_greedy_ragged_batch():
    # request 0: drafts [5, 6, 7], target argmax [5, 6, 2, 9] -> accepts 2, recovered 2
    # request 1: no drafts, target argmax [4] -> bonus 4
    # request 2: drafts [1, 1], target argmax [1, 1, 3] -> all accepted, bonus 3
    # request 3: drafts [8], target argmax [0, 0] -> first token rejected, recovered 0
    drafts = torch.tensor([5, 6, 7, 1, 1, 8])
    cu = torch.tensor([0, 3, 3, 5, 6])
    argmax = torch.tensor([5, 6, 2, 9, 4, 1, 1, 3, 0, 0])
    out, accepted = matching(drafts, cu, argmax, max_depth=3)
    assert accepted.tolist() == [2, 0, 2, 0]
    assert out.tolist() == [
        [5, 6, 2, PAD],
        [4, PAD, PAD, PAD],
        [1, 1, 3, PAD],
        [0, PAD, PAD, PAD],
    ]


def test_greedy_no_drafts_at_all():
    out, accepted = matching(torch.tensor([], dtype=torch.long), torch.tensor([0, 0]), torch.tensor([7]), 0)
    assert out.tolist() == [[7]] and accepted.tolist() == [0]


def test_sampling_draft_probability_zero_is_rejected():
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft_probs = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    # The drafted token 1 has q = 0 (a corrupted draft): it must be rejected whatever the uniform is.
    out, accepted = sampling(
        torch.tensor([1]), torch.tensor([0, 1]), draft_probs, target, torch.tensor([0.0]), torch.tensor([0.5]), 1
    )
    assert accepted.tolist() == [0]
    # residual = max(0, p - q) = [0, .5, 0, 0] -> the recovered token is 1
    assert out.tolist() == [[1, PAD]]


def test_sampling_all_accepted_draws_bonus_from_last_row():
    target = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    out, accepted = sampling(
        torch.tensor([1, 2]), torch.tensor([0, 2]), None, target, torch.tensor([0.99, 0.99]), torch.tensor([0.5]), 2
    )
    assert accepted.tolist() == [2]
    assert out.tolist() == [[1, 2, 0]]


def test_sampling_one_hot_draft_equals_explicit_one_hot():
    torch.manual_seed(0)
    vocab, n = 10, 5
    drafts = torch.randint(0, vocab, (n,))
    cu = torch.tensor([0, 2, 5])
    target = torch.softmax(torch.randn(n + 2, vocab), dim=-1)
    uniforms = torch.rand(n)
    finals = torch.rand(2)
    implicit = sampling(drafts, cu, None, target, uniforms, finals, 3)
    explicit = sampling(drafts, cu, _one_hot_rows(drafts.tolist(), vocab), target, uniforms, finals, 3)
    assert torch.equal(implicit[0], explicit[0]) and torch.equal(implicit[1], explicit[1])


def test_sampling_single_position_output_follows_target():
    """One draft position, many independent trials: the emitted first token is distributed as p, not q."""
    generator = torch.Generator().manual_seed(0)
    vocab, trials = 6, 40_000
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.1, 0.05])
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    drafts = torch.multinomial(q, trials, replacement=True, generator=generator)  # [trials]
    cu = torch.arange(trials + 1)
    target = torch.stack([p, p]).repeat(trials, 1)  # [2 * trials, vocab]
    uniforms = torch.rand(trials, generator=generator)
    finals = torch.rand(trials, generator=generator)
    out, _ = sampling(drafts, cu, q.repeat(trials, 1), target, uniforms, finals, 1)
    freq = torch.bincount(out[:, 0], minlength=vocab).float() / trials
    # Standard error of a frequency near 0.4 with 40k trials is ~0.0025; 0.01 is four of them.
    assert torch.allclose(freq, p, atol=0.01), freq
