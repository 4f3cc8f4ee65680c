"""What a drafting stage proposes and what verifying it decides: the two records every stage and the engine pass
between them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from cascade.verify.tree import Branch


@dataclass(frozen=True, slots=True)
class Draft:
    """Tokens a stage proposes for the stage above to verify, with the distributions they were drawn from."""

    tokens: list[int]  # [depth]: the chain (a tree's spine: the path tried first)
    probs: torch.Tensor | None  # [depth, vocab] on the drafter's device: the distribution each token was drawn
    # from. None: each token had probability 1 — a one-hot draft (a greedy or coupled drafter, the n-gram drafter)
    branches: tuple[Branch, ...] = ()  # alternatives to the chain from some position on: with them the draft is a
    # tree (cascade.verify.tree), scored in one pass of the verifying stage

    @staticmethod
    def empty() -> Draft:
        return Draft([], None)

    def prefix(self, n: int) -> Draft:
        """The first ``n`` tokens with their rows (a prefix of a draft is a draft of the same distribution), and the
        branches within them, cut to the same depth."""
        branches = tuple(dataclasses.replace(b, tokens=b.tokens[: n - b.at], probs=None if b.probs is None else
                                             b.probs[: n - b.at]) for b in self.branches if b.at < n)
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n], branches)

    def after(self, n: int) -> Draft:
        """The tokens after the first ``n``, with their rows (a chain: the branches are dropped)."""
        return Draft(self.tokens[n:], None if self.probs is None else self.probs[n:])


@dataclass(frozen=True, slots=True)
class Verdict:
    """What verifying one draft decided: the tokens committed, and what the controller learns from it."""

    tokens: list[int]  # [accepted + 1]: the accepted drafts, then the recovered or bonus token
    rows: torch.Tensor | None  # [accepted + 1, vocab]: the p row each token was drawn from (None when verified by
    # matching: greedy or coupled)
    accepted: int  # draft tokens accepted on the chain (the spine of a tree)
    expected: float | None  # Σ(1 − TV(p, q)) over the drafted positions, when sampling (for the controller)
    branched: int = 0  # tokens accepted on a branch of a tree, after the ``accepted`` of the chain
    rank: int = 0  # where the accepted path left the spine: the rank of the sibling it took (1: the first tested
    # after the spine's own token); 0: it did not leave the spine
    alternatives: tuple[tuple[int, ...], ...] = ()  # [len(tokens)] when asked (``Verify.alternatives``): beside each
    # committed token, the verifier's next likeliest tokens at its row (a middle stage's draft tree for the stage
    # above)
